"""``WorkerRecord``: what the supervisor keeps per running worker.

A model's worker, once started: its backend's handle (pid, node, exit, kill), its link,
the spec it was started with, its log and the task that watches for its end; ``gone``
tells when it ended. The supervisor keeps one per worker (``Supervisor.worker_of``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from router.workers.backends import WorkerHandle
from router.workers.backends.local import LocalHandle
from router.workers.link import WorkerLink
from shared.config import ModelSpec

LINK_GRACE = 0.3
"""Seconds a dropped remote link waits for its backend's own word on the worker's end."""


class WorkerRecord:
    """One running worker: its backend's ``handle``, its ``link``, the ``spec`` it was
    started with, its ``log_path`` and its ``watcher`` (the task that sees it end)."""

    def __init__(self, handle: WorkerHandle | asyncio.subprocess.Process, link: WorkerLink,
                 log_path: Path | None = None, spec: ModelSpec | None = None) -> None:
        if isinstance(handle, asyncio.subprocess.Process):  # a process started here
            assert log_path is not None
            handle = LocalHandle(handle, log_path)
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
