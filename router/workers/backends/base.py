"""The two shapes every backend fills: ``Backend`` starts workers, ``WorkerHandle`` is one
started worker as the supervisor sees it."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from pathlib import Path

from router.workers.placement import Placer
from shared.config import ModelSpec

BootFor = Callable[[str], bytes]
"""The worker's ``WorkerBoot`` (JSON) given where it must send its own output ("": its
output is already where it belongs)."""


class SpawnError(Exception):
    """No worker could be started (its message says why); the model goes ``failed``."""


class WorkerHandle(abc.ABC):
    """One started worker process, wherever it runs."""

    pid: int
    node: str
    """Where it runs: this host's name, or its Ray node's address."""
    node_id: str = ""
    """Its Ray node's id ("" for a local worker): two nodes on one host share an
    address, so replicas placed apart (``replicas.placement``) are told apart by it."""
    log_path: Path
    started_at: float
    from_spare: bool = False

    @property
    @abc.abstractmethod
    def returncode(self) -> int | None:
        """Its exit code once it is known to be gone; ``None`` while it may live."""

    @property
    def lost(self) -> str:
        """Why it is gone without an exit code ("" when it exited with one)."""
        return ""

    @abc.abstractmethod
    async def wait(self) -> int | None:
        """Until it is gone: its exit code, or ``None`` when it was lost without one (its
        Ray actor or node died). Any number of callers may wait."""

    async def sync_log(self) -> None:
        """Until ``log_path`` holds all the worker has written so far (a worker on
        another node writes its output there by copy)."""

    def note_children(self) -> None:
        """Remember the processes it started (its engine), to kill them with it."""

    def pids(self) -> set[int]:
        """Its process and the ones it started, as this host sees them (GPU accounting)."""
        return {self.pid}

    def freeze(self, frozen: bool) -> bool:
        """Stop (``SIGSTOP``) or continue (``SIGCONT``) it and every process it started,
        threads and all: a parked worker holds no core. ``False`` where this backend
        cannot (a worker on another node: its link's heartbeats must go on); a CPU model
        there does not park at all (``policy.park.freezes``)."""
        return False

    def resident_bytes(self) -> int:
        """The memory its processes hold now (resident set sizes, summed; 0 where this
        host cannot see them). Blocking: call it in a thread."""
        return 0

    @abc.abstractmethod
    async def kill(self) -> None:
        """Make sure it and every process it started are gone, then return."""


class Backend(abc.ABC):
    """Starts workers of one kind."""

    name: str

    @abc.abstractmethod
    def endpoint(self, runtime_dir: Path, number: int) -> str:
        """The address the router's link for a new worker binds (``*`` port: any)."""

    def place(self, spec: ModelSpec, placer: Placer, key: str) -> dict[str, str]:
        """The environment that puts the worker where it belongs (shown in
        ``/v1/models``): by default this host's ``Placer`` pins its cores or GPUs."""
        return placer.place(spec, key)

    @abc.abstractmethod
    async def spawn(self, spec: ModelSpec, boot_for: BootFor, log_path: Path,
                    env: dict[str, str], siblings: Sequence[WorkerHandle] = ()
                    ) -> WorkerHandle:
        """Start the worker of ``spec``, its boot written; raises ``SpawnError`` (or
        ``OSError``) when none could start. ``env`` is what the model adds to the
        worker's environment (its ``env`` and placement); ``siblings`` are the workers of
        the model's other running replicas, lowest-numbered first (a backend that places
        workers over nodes puts this one apart from or beside them:
        ``replicas.placement``)."""

    def close(self) -> None:
        """The router is stopping: let go of what the backend holds."""
