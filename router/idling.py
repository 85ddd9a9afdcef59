"""Idling: when a model has been idle long enough, and what then (``Supervisor``'s reaper).

A model is idle once it is ready, unleased and its link has nothing in flight. Its limit
is a request's ``keep_alive`` (Ollama's: seconds, ``-1`` for ever, ``0`` after this
request) over the preset's ``ttl``; a pinned model has none. Past it the reaper, which
looks every ``POLL`` seconds, stops the worker, or on a GPU with ``idle_action: sleep``
puts the engine to sleep (level 1); the next request wakes it, and a failed sleep or wake
stops it instead. ``Supervisor`` inherits these methods, like ``Scheduling``'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from router.errors import APIError
from router.registry import ModelEntry, ModelRegistry
from router.scheduling import POLL
from shared.config import ServerConfig

if TYPE_CHECKING:
    from router.worker_record import WorkerRecord

log = logging.getLogger("modelyard.router")


class Idling:
    """The idle half of ``Supervisor`` (see the module docstring)."""

    registry: ModelRegistry
    server: ServerConfig
    _workers: dict[str, WorkerRecord]
    _wakes: dict[str, asyncio.Task[None]]

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        raise NotImplementedError  # Supervisor's

    def _publish_state(self, entry: ModelEntry, reason: str | None = None) -> None:
        raise NotImplementedError  # Supervisor's

    async def stop(self, entry: ModelEntry, *, force: bool = False, grace: float = 1.0) -> None:
        raise NotImplementedError  # Supervisor's

    def stopping(self, entry: ModelEntry, *, force: bool = False,
                 grace: float = 1.0) -> asyncio.Task[None]:
        raise NotImplementedError  # Supervisor's

    def ttl(self, entry: ModelEntry) -> float:
        return entry.spec.ttl if entry.spec.ttl is not None else self.server.ttl

    def idle_limit(self, entry: ModelEntry) -> float | None:
        """Seconds idle before the model is stopped (or put to sleep); ``None``: never.
        A request's ``keep_alive`` overrides the preset's ``ttl``; a pinned model stays."""
        if entry.spec.pinned:
            return None
        if entry.keep_alive is not None:
            return None if entry.keep_alive < 0 else entry.keep_alive
        ttl = self.ttl(entry)
        return ttl if ttl > 0 else None

    def _idle_expired(self, entry: ModelEntry, now: float) -> bool:
        limit = self.idle_limit(entry)
        return (entry.state == "ready" and limit is not None and entry.leases == 0
                and entry.link is not None and not entry.link.busy
                and now - entry.last_used >= limit)

    async def _reap_idle(self) -> None:
        """Stop (or put to sleep) models idle past their ttl; checked every POLL seconds."""
        while True:
            await asyncio.sleep(POLL)
            try:
                self._reap_idle_once(time.monotonic())
            except Exception:  # a bug here must not end reaping for good: log, go on
                log.exception("idle reaper failed; retrying")

    def _reap_idle_once(self, now: float) -> None:
        for entry in self.registry:
            # The check and stop()'s first state change run with no await between
            # them, so a request cannot take a lease in between.
            if self._idle_expired(entry, now):
                log.info("model %s: idle for %.1f s; %s", entry.id,
                         now - entry.last_used, entry.spec.idle_action)
                if entry.spec.idle_action == "sleep" and entry.spec.device == "cuda":
                    entry.state = "sleeping"
                    self._publish_state(entry, "idle")
                    self._spawn_task(self._sleep(entry))
                else:
                    entry.state = "stopping"  # now, not when the task first runs
                    self._publish_state(entry, "idle")
                    self.stopping(entry)  # the model's one stop: a later unload waits for it

    async def _sleep(self, entry: ModelEntry) -> None:
        link = entry.link
        if link is None:
            return
        try:
            await link.sleep(1)
        except APIError as err:
            log.warning("model %s: sleep failed (%s); stopping instead", entry.id, err.message)
            await self.stop(entry)

    def _wake(self, entry: ModelEntry) -> asyncio.Task[None]:
        task = self._wakes.get(entry.id)
        if task is None:
            task = asyncio.create_task(self._do_wake(entry))
            self._wakes[entry.id] = task
            task.add_done_callback(lambda t: self._wakes.pop(entry.id, None))
        return task

    async def _do_wake(self, entry: ModelEntry) -> None:
        link = entry.link
        if entry.state != "sleeping" or link is None:
            return
        try:
            await link.wake()
            entry.state, entry.last_used = "ready", time.monotonic()
            self._publish_state(entry, "woken")
        except APIError as err:
            log.warning("model %s: wake failed (%s); restarting", entry.id, err.message)
            await self.stop(entry)
