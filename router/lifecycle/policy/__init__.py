"""Policy: who gets room (``room``), who parks (``park``), who idles (``idle``) and which
replica serves a request (``route``).

Plain functions over the model entries, the server config, ``now`` and what the placer
measured. They never await, never touch a process and import nothing of the supervisor,
which asks them and then acts (stops, sleeps, wakes, publishes events). Unit tests drive
them alone (``tests/test_policy.py``, ``tests/test_route.py``).
``scale`` says when a model gains or loses a replica, over plain views of its replicas
and queue (``tests/test_scale.py``).

Must not import: ``router.api``, ``router.lifecycle.supervisor``,
``router.lifecycle.room_maker``, ``router.lifecycle.idle_reaper``, ``router.workers.link``,
``router.workers.backends``, ``router.workers.spares``.
"""
