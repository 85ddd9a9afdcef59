"""What the router tells about itself: ``events`` (the in-process bus the supervisor and
the relay publish to) and ``metrics`` (Prometheus counters and histograms, the models'
state read at scrape time). Their HTTP endpoints are ``router.api.events`` and
``router.api.metrics``.

Must not import: ``router.api``, ``router.lifecycle``, ``router.access``.
"""
