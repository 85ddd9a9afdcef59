"""``WorkerRecord``: what the supervisor keeps per running worker.

A model's worker, once started: its backend's handle (pid, node, exit, kill), its link,
the spec it was started with, its log and the task that watches for its end. The
supervisor keeps one per worker (``Supervisor.worker_of``); nothing else holds one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from router.backends import WorkerHandle
from router.backends.local import LocalHandle
from router.link import WorkerLink
from shared.config import ModelSpec


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
