"""The worker processes, and the router's end of them: what a worker starts with
(``worker_start``) and where (``placement``: cores, GPUs, memory; ``backends``: a local
subprocess or a Ray actor), spares kept warm (``spares``), processes as the OS sees them
(``processes``) and the socket each worker is talked to over (``link``). It executes;
whether a worker should start or stop is lifecycle's decision.

Must not import: ``router.api``, ``router.lifecycle``, ``router.observe``.
"""
