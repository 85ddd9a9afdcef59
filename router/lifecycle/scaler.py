"""``Scaler``: carries out the scale policy (``router.lifecycle.policy.scale``) for models of
several replicas.

Every ``EVERY`` seconds it builds each ready model's ``ScaleView`` (its replicas, the
requests waiting for one of its slots, whether one more replica finds free room) and acts
on ``scale.decide``: starts a replica (``add``, as one more start of the model's worker on
its own share of the cores) or drains one and stops it (``remove``: it takes no new request
and stops once its last is done; never a cut). A model's load starts its first replica;
``fill`` starts the ones ``replicas.min`` asks for right after it is ready, without
waiting for a tick. The ``Supervisor`` owns one and hands it the few of its own operations
it needs; the start tasks it keeps (``cancel``: a stop or a crash of the model takes them
with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Literal

from router.errors import APIError
from router.lifecycle.policy import scale
from router.lifecycle.replica import Replica, ReplicaSet
from router.registry import ModelEntry

log = logging.getLogger("modelyard.router")

EVERY = 0.25
"""Seconds between looks (the policy's clocks are seconds: ``up_wait``, ``up_after``)."""


class Scaler:
    """Adds and removes replicas of the models that may run several (module docstring).

    ``models`` lists the registry's entries now; ``replicas_of`` a model's running
    replicas; ``start`` starts replica n of a model and returns once it serves (the
    supervisor's ``_spawn`` as an extra); ``retire`` drains one and stops it; ``room``
    tells whether one more replica of a model fits beside what runs; ``stopping`` is the
    model's one stop (``min: 0``'s last replica is a stop of the model)."""

    def __init__(self, models: Iterable[ModelEntry],
                 replicas_of: Callable[[ModelEntry], ReplicaSet],
                 start: Callable[[ModelEntry, int], Coroutine[Any, Any, object]],
                 retire: Callable[[ModelEntry, Replica], Coroutine[Any, Any, None]],
                 room: Callable[[ModelEntry], bool],
                 stopping: Callable[[ModelEntry], asyncio.Task[None]]) -> None:
        self.models = models
        self.replicas_of = replicas_of
        self._start = start
        self._retire = retire
        self.room = room
        self._stopping = stopping
        self._starts: dict[str, dict[int, asyncio.Task[None]]] = {}
        """Each model's replica starts under way, by replica number."""
        self._retires: dict[str, asyncio.Task[None]] = {}
        self._failed: dict[str, tuple[int, float]] = {}
        """Each model's replicas that failed to start or crashed in a row, and when the
        last did (``failed``): the next add waits ``scale.backoff_seconds`` of that."""
        self._pressure: dict[str, float | None] = {}
        self._changed: dict[str, float] = {}

    async def run(self) -> None:
        """Look every ``EVERY`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(EVERY)
            try:
                self.tick(time.monotonic())
            except Exception:  # a bug here must not end scaling for good: log, go on
                log.exception("scaler failed; retrying")

    def pending(self, entry: ModelEntry) -> set[int]:
        """The numbers of ``entry``'s replica starts under way (spawned or not yet)."""
        return {n for n, t in self._starts.get(entry.id, {}).items() if not t.done()}

    def starting(self, entry: ModelEntry) -> int:
        return len(self.pending(entry))

    def view(self, entry: ModelEntry, now: float) -> scale.ScaleView:
        """``entry`` as the policy sees it at ``now``."""
        replicas: list[scale.ReplicaView] = []
        for r in self.replicas_of(entry):
            state: Literal["starting", "ready", "parked", "draining"] = (
                "parked" if r.parked else r.state)
            replicas.append(scale.ReplicaView(r.number, state, r.link.in_flight,
                                              r.last_used))
        taken = {r.number for r in replicas}
        for number, task in self._starts.get(entry.id, {}).items():
            if not task.done() and number not in taken:  # placed, not spawned yet
                replicas.append(scale.ReplicaView(number, "starting", 0, now))
        waiters: list[scale.Waiter] = []
        if entry.slots is not None:
            waiters = [scale.Waiter(since, batch) for since, batch in entry.slots.waiting_since()]
        return scale.ScaleView(
            replicas=replicas, waiters=waiters, pressure_since=self._pressure.get(entry.id),
            room=self.room(entry), last_change=self._changed.get(entry.id),
            hold_last=(entry.spec.pinned or (entry.keep_alive is not None
                                             and entry.keep_alive < 0)
                       or entry.kept_until > now))

    def tick(self, now: float) -> None:
        for entry in self.models:
            limits = entry.spec.replicas
            if not scale.scales(limits):
                continue
            if entry.state != "ready" or entry.id in self._retires:
                self._pressure.pop(entry.id, None)
                continue
            view = self.view(entry, now)
            since = scale.pressure(view.pressure_since, view.waiters, now, limits)
            self._pressure[entry.id] = since
            view = dataclasses.replace(view, pressure_since=since)
            decision = scale.decide(limits, view, now)
            if decision is None:
                continue
            failed, at = self._failed.get(entry.id, (0, 0.0))
            if decision.action == "add" and now - at < scale.backoff_seconds(failed):
                continue  # a replica that keeps failing is not started at every tick
            self._changed[entry.id] = now
            log.info("model %s: %s replica %d (%s)", entry.id, decision.action,
                     decision.replica, decision.why)
            if decision.action == "add":
                self.add(entry, decision.replica)
            else:
                self.remove(entry, decision.replica)

    def failed(self, entry: ModelEntry, served: bool = False) -> None:
        """A replica of ``entry`` failed to start or crashed while the model served on;
        ``served``: it had completed requests (healthy until then: a new streak)."""
        failed = 0 if served else self._failed.get(entry.id, (0, 0.0))[0]
        self._failed[entry.id] = (failed + 1, time.monotonic())

    def fill(self, entry: ModelEntry) -> None:
        """Start at once the replicas ``replicas.min`` asks for beyond the first, as far
        as room allows (the scaler's ticks start the rest when room frees)."""
        limits = entry.spec.replicas
        for number in range(limits.max):
            running = len(self.replicas_of(entry)) + self.starting(entry)
            if running >= limits.min or not self.room(entry):
                return
            if self.replicas_of(entry).numbered(number) is None and \
                    number not in self._starts.get(entry.id, {}):
                self.add(entry, number)

    def add(self, entry: ModelEntry, number: int) -> None:
        """Start replica ``number`` of ``entry`` in the background."""
        starts = self._starts.setdefault(entry.id, {})

        async def start() -> None:
            try:
                await self._start(entry, number)
            except APIError:
                pass  # logged and published as the replica's failure: the model serves on
            finally:
                starts.pop(number, None)

        starts[number] = asyncio.create_task(start(), name=f"replica-{entry.id}#{number}")

    def remove(self, entry: ModelEntry, number: int) -> None:
        """Drain replica ``number`` and stop it; the last one (``min: 0``): stop the model."""
        replicas = self.replicas_of(entry)
        victim = replicas.numbered(number)
        if victim is None:
            return
        if len([r for r in replicas if r.state != "draining"]) <= 1:
            self._stopping(entry)
            return

        async def retire() -> None:
            try:
                await self._retire(entry, victim)
            finally:
                self._retires.pop(entry.id, None)

        self._retires[entry.id] = asyncio.create_task(retire(),
                                                      name=f"retire-{entry.id}#{number}")

    def cancel(self, entry: ModelEntry) -> None:
        """``entry`` stops or crashed: its replica starts under way are cancelled (each
        reaps what it started)."""
        for task in self._starts.get(entry.id, {}).values():
            task.cancel()

    async def wait_starts(self, entry: ModelEntry) -> None:
        """Until ``entry``'s cancelled starts have reaped what they started."""
        tasks = list(self._starts.get(entry.id, {}).values())
        if tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait(tasks)
