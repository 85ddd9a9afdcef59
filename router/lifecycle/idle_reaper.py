"""``IdleReaper``: carries out the idle policy (``router.lifecycle.policy.idle``) and sleep/wake.

Every ``poll`` seconds it asks the policy which models have idled past their limit and
stops them (the model's one stop task) or puts their engines to sleep (level 1). The next
request wakes a sleeping model (one wake task per model); a failed sleep or wake stops it
instead. The ``Supervisor`` owns one and hands it the few of its own operations it needs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from router.errors import APIError
from router.lifecycle.policy import idle
from router.lifecycle.replica import ReplicaSet, link_of
from router.registry import ModelEntry
from router.workers.link import WorkerLink
from shared.config import ServerConfig

log = logging.getLogger("modelyard.router")


class IdleReaper:
    """Stops or puts to sleep idle models, and wakes sleeping ones (module docstring).

    ``models`` lists the registry's entries now; ``publish_state`` tells the event bus
    of a state change; ``stopping`` is the model's one stop task; ``spawn`` runs a
    background task the supervisor keeps until done."""

    def __init__(self, models: Iterable[ModelEntry], server: ServerConfig, poll: float,
                 publish_state: Callable[[ModelEntry, str | None], None],
                 stopping: Callable[[ModelEntry], asyncio.Task[None]],
                 spawn: Callable[[Coroutine[Any, Any, None]], None],
                 replicas_of: Callable[[ModelEntry], ReplicaSet] | None = None) -> None:
        self.models = models
        self.server = server
        self.poll = poll
        self._publish_state = publish_state
        self._stopping = stopping
        self._spawn = spawn
        self._wakes: dict[str, asyncio.Task[None]] = {}
        self._replicas_of = replicas_of

    def _links(self, entry: ModelEntry) -> list[WorkerLink]:
        """Every engine of ``entry`` that sleeps and wakes with it: each replica's."""
        if self._replicas_of is not None:
            links = [r.link for r in self._replicas_of(entry) if r.state == "ready"]
            if len(links) > 1:
                return links
        link = link_of(entry)
        return [link] if link is not None else []

    async def run(self) -> None:
        """Reap idle models every ``poll`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(self.poll)
            try:
                self.reap_once(time.monotonic())
            except Exception:  # a bug here must not end reaping for good: log, go on
                log.exception("idle reaper failed; retrying")

    def reap_once(self, now: float) -> None:
        # The policy's look and each state change below run with no await between
        # them, so a request cannot take a lease in between.
        for decision in idle.due(self.models, now, self.server):
            entry = decision.entry
            log.info("model %s: idle for %.1f s; %s", entry.id, decision.idle_seconds,
                     entry.spec.idle_action)
            if decision.action == "sleep":
                entry.state = "sleeping"
                self._publish_state(entry, "idle")
                self._spawn(self._sleep(entry))
            else:
                entry.state = "stopping"  # now, not when the task first runs
                self._publish_state(entry, "idle")
                self._stopping(entry)  # the model's one stop: a later unload waits for it

    async def _sleep(self, entry: ModelEntry) -> None:
        links = self._links(entry)
        try:
            await asyncio.gather(*(link.sleep(1) for link in links))
        except APIError as err:
            log.warning("model %s: sleep failed (%s); stopping instead", entry.id, err.message)
            await asyncio.shield(self._stopping(entry))

    def wake(self, entry: ModelEntry) -> asyncio.Task[None]:
        """The model's one wake task, begun now if none runs."""
        task = self._wakes.get(entry.id)
        if task is None:
            task = asyncio.create_task(self._wake(entry))
            self._wakes[entry.id] = task
            task.add_done_callback(lambda t: self._wakes.pop(entry.id, None))
        return task

    async def _wake(self, entry: ModelEntry) -> None:
        links = self._links(entry)
        if entry.state != "sleeping" or not links:
            return
        try:
            await asyncio.gather(*(link.wake() for link in links))
            entry.state, entry.last_used = "ready", time.monotonic()
            self._publish_state(entry, "woken")
        except APIError as err:
            log.warning("model %s: wake failed (%s); restarting", entry.id, err.message)
            await asyncio.shield(self._stopping(entry))
