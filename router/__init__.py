"""The router process: one HTTP front for many vLLM workers.

Its packages by role, each importing only those listed above it (``tests/test_layers.py``
holds them to it, and to no import circle):

    errors.py, registry.py  the vocabulary every layer speaks: the errors a client sees,
                            the model table (``ModelEntry``, ``Lease``, ``resolve``)
    access/                 who may call what and how much: the access table, keys,
                            limits, budgets, the usage ledger and its database
    workers/                the worker processes and the router's end of them: start,
                            placement, spares, backends (local, Ray), the ZeroMQ link
    observe/                what the router tells about itself: events, metrics
    lifecycle/              when a model loads, sleeps, yields and stops: the
                            supervisor, its policies, the room maker and idle reaper,
                            reload
    api/                    HTTP: the protocols, the relay, SSE, the uvicorn protocol
    app.py, cli.py          the factory that wires them, and the command

``registry`` imports nothing of ``workers`` or ``lifecycle``: a model's running workers
are the lifecycle's (``lifecycle.replica``), and its ``ModelEntry`` sees the one serving
it only as a ``Serving`` (whether it is busy). The worker (``worker/``) is another
process: only ``shared/`` is common to both.
"""
