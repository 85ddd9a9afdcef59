"""Where a model's worker runs: the seam between the supervisor and the machines.

The supervisor owns a model's lifecycle, leases, queue, eviction and metrics; a backend
only starts a worker (``spawn``), tells when it is gone (``WorkerHandle.wait``), kills it
(``WorkerHandle.kill``) and names the address its link binds. ``local`` runs workers as
the router's subprocesses (``router.workers.backends.local``); ``ray`` runs each as a process that
a Ray actor owns on the node Ray placed it on (``router.workers.backends.ray_cluster``).
"""

from router.workers.backends.base import Backend, SpawnError, WorkerHandle

__all__ = ["Backend", "SpawnError", "WorkerHandle"]
