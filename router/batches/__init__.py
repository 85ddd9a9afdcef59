"""Batches without HTTP: files, batches and their lines in the router's database
(``store``), and the runner that runs a batch's lines through the app's own handlers,
behind every person's request (``runner``). The APIs over them are ``router.api.batches``.

Must not import: ``router.api``, ``worker``.
"""
