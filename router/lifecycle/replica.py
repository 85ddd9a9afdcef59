"""``Replica`` and ``ReplicaSet``: a model's running workers, as the lifecycle keeps them.

A ``Replica`` is one worker of a model, once started: its number and key, its backend's
handle (pid, node, exit, kill), its link, the spec it was started with, its log and the
task that watches for its end; ``gone`` tells when it ended. A model's replicas are its
``ReplicaSet``, which the supervisor keeps by model id (``Supervisor.replicas_of``).

A model runs up to its ``replicas.max`` replicas. Replica 0's key is the model's id, so
a model of one replica has the logs, placer keys, events and simulation traces it had
before replicas; replica ``n`` is ``<id>#<n>``. The model's load starts the first; the
supervisor starts the others (``replicas.min``, and its scaler under a queue), each on its
own share of the model's cores (``placement.replica_spec``). A replica is ``starting``
until its engine is ready, ``ready`` while it takes requests, and ``draining`` once it is
to stop (it takes no new request and ends when its last one does). ``ModelEntry.replica``
names one ready replica (what one-shot calls and a model of one replica use); requests
to a model of several are routed among the ready ones (``Supervisor.route``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from router.workers.backends import WorkerHandle
from router.workers.backends.local import LocalHandle
from router.workers.link import WorkerLink
from shared.config import ModelSpec

if TYPE_CHECKING:
    from router.registry import ModelEntry

LINK_GRACE = 0.3
"""Seconds a dropped remote link waits for its backend's own word on the worker's end."""


def replica_key(model_id: str, number: int) -> str:
    """The name replica ``number`` of ``model_id`` goes by (placer keys, logs): replica 0
    is the model's id itself, replica ``n`` is ``<id>#<n>``."""
    return model_id if number == 0 else f"{model_id}#{number}"


def link_of(entry: ModelEntry) -> WorkerLink | None:
    """The link of the replica that serves ``entry``'s requests (``ModelEntry.replica``:
    from ready until reaped or crashed); None while none does."""
    replica = entry.replica
    return cast("Replica", replica).link if replica is not None else None



def ready_link(entry: ModelEntry) -> WorkerLink | None:
    """The link a request may use now: ``link_of`` while ``entry`` is ready, else None."""
    return link_of(entry) if entry.state == "ready" else None


class Replica:
    """One running worker of a model: its ``number`` and ``key`` among the model's
    replicas, its backend's ``handle``, its ``link``, the ``spec`` it was started with,
    its ``log_path`` and its ``watcher`` (the task that sees it end)."""

    def __init__(self, handle: WorkerHandle | asyncio.subprocess.Process, link: WorkerLink,
                 log_path: Path | None = None, spec: ModelSpec | None = None,
                 number: int = 0) -> None:
        if isinstance(handle, asyncio.subprocess.Process):  # a process started here
            assert log_path is not None
            handle = LocalHandle(handle, log_path)
        self.number = number
        """Its place among its model's replicas (0: the first, and for now the only)."""
        self.key = replica_key(link.model, number)
        """What it goes by: its model's id for replica 0 (``replica_key``)."""
        self.handle = handle
        self.spec = spec
        """What it was started with (a reload may have changed its model's since)."""
        self.link = link
        self.log_path = handle.log_path
        self.watcher: asyncio.Task[None] | None = None
        self.parked = False
        """Parked and not yet woken: on this host its processes are stopped
        (``router.lifecycle.parking``)."""
        self.paused = False
        """Its engine was paused for the park (``Sleep(level=0)`` answered): it had
        requests in flight, which a ``Wake`` resumes."""
        self.state: ReplicaState = "starting"
        self.placement: dict[str, str] = {}
        """The environment that put it where it runs (cores or GPUs: ``/v1/models``)."""
        self.last_used = 0.0
        """When (``time.monotonic``) it became ready or was last routed a request."""
        self.routed_seq = 0
        """The supervisor's count of routed requests when it was last routed one (0: never;
        ties among equally loaded replicas go to the one routed least recently)."""

    @property
    def serving(self) -> bool:
        """It takes new requests: ready, not draining, not parked."""
        return self.state == "ready" and not self.parked

    @property
    def busy(self) -> bool:
        """Generations or calls (but pings) in flight on its link."""
        return self.link.busy

    async def gone(self) -> int | None:
        """Until the worker is gone: its exit code, or ``None``. A remote worker whose link
        drops (a dead node sends nothing) is gone too; its backend may still say how
        within ``LINK_GRACE`` seconds (a killed actor is reported in milliseconds)."""
        exited: asyncio.Future[int | None] = asyncio.ensure_future(self.handle.wait())
        dropped = self.link.disconnected
        if dropped is None:
            return await exited
        either: set[asyncio.Future[Any]] = {exited, dropped}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not exited.done():
            await asyncio.wait({exited}, timeout=LINK_GRACE)
        if exited.done():
            return exited.result()
        exited.cancel()
        return None


ReplicaState = Literal["starting", "ready", "draining"]


class ReplicaSet:
    """A model's running replicas, by number (module docstring).

    A replica is in its set from its spawn until its reap; an empty set is dropped by its
    keeper (``Supervisor.remove_worker``)."""

    __slots__ = ("_replicas", "model")

    def __init__(self, model: str) -> None:
        self.model = model
        """The model's id."""
        self._replicas: list[Replica] = []

    def first(self) -> Replica | None:
        """The lowest-numbered replica, if any: the model's worker while it runs one."""
        return self._replicas[0] if self._replicas else None

    def serving(self) -> list[Replica]:
        """The replicas that take new requests, by number."""
        return [r for r in self._replicas if r.serving]

    def numbered(self, number: int) -> Replica | None:
        return next((r for r in self._replicas if r.number == number), None)

    def add(self, replica: Replica) -> None:
        """Keep ``replica``; one in its place (a worker reaped later than its successor
        started: a restart after a crash) is replaced, as the one map by model id did."""
        self._replicas = sorted([r for r in self._replicas if r.number != replica.number]
                                + [replica], key=lambda r: r.number)

    def remove(self, replica: Replica) -> bool:
        """Forget ``replica`` (a newer one in its place stays); False if it was not kept."""
        if not any(r is replica for r in self._replicas):
            return False
        self._replicas = [r for r in self._replicas if r is not replica]
        return True

    def __len__(self) -> int:
        return len(self._replicas)

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self._replicas))

    def __bool__(self) -> bool:
        return bool(self._replicas)
