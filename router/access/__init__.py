"""Who may call what, and how much, decided before a handler runs or as a request is counted.

Owns the access table (``rules``; ``python -m router.access`` prints it), the limits ×
ways-in matrix (``limit_table``; ``python -m router.access limits``), who asks
(``admission``: keys, principals and the ``KeyGuard`` middleware), the request and token
limits (``limits``, over the bucket arithmetic of ``buckets``), named keys (``key_store``),
the usage ledger and the budgets read from it (``ledger``, ``budgets``) and the database
they are kept in (``database``).

Must not import: ``router.api``, ``router.lifecycle``, ``router.observe``,
``router.workers`` (they ask access; it answers a request before any of them is asked).
"""
