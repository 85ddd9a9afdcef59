"""Scheduling: which model makes room for which, and when (``Supervisor._make_room``).

Loads waiting for room form one line (priority, then wait). The first in line stops one
victim at a time: never a pinned one or one within its ``min_resident``; one that yields
or sits idle first, a sleeping one before an awake one; then the lowest priority, the
lowest expected cost (measured load seconds x decaying request rate), the least recently
used. A model still in use yields only after the waiter has waited ``swap_wait``.
``Supervisor`` inherits these methods; they use its registry, placement and ``stop``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from router.errors import ModelUnavailable
from router.events import EventBus
from router.placement import Placer, fits
from router.registry import ModelEntry, ModelRegistry
from shared.config import ServerConfig

if TYPE_CHECKING:
    from router.worker_record import WorkerRecord

log = logging.getLogger("modelyard.router")
POLL = 0.05  # seconds between looks at state that has no event of its own
ACTIVE_GAP = 2.0
"""A model used this recently still has clients coming: a model waiting for room does not
evict it at once, but after ``swap_wait``."""
UNKNOWN_LOAD_SECONDS = 30.0
"""A model's load time before one was measured (its eviction cost)."""


class Scheduling:
    """The room-making half of ``Supervisor`` (see the module docstring)."""

    registry: ModelRegistry
    server: ServerConfig
    placer: Placer
    events: EventBus
    _workers: dict[str, WorkerRecord]
    _removed: set[ModelEntry]

    async def stop(self, entry: ModelEntry, *, force: bool = False, grace: float = 1.0) -> None:
        raise NotImplementedError  # Supervisor's

    def expected_cost(self, entry: ModelEntry, now: float) -> float:
        """What evicting ``entry`` is expected to cost: the seconds its next load takes,
        times how often it is asked for (seconds of loading per second)."""
        return (entry.load_seconds or UNKNOWN_LOAD_SECONDS) * entry.request_rate(now)

    async def _held_asleep(self, loaded: list[ModelEntry]) -> dict[str, dict[str, float]]:
        """What each sleeping model still holds on its GPUs (it counts against the budget
        by that, not by its full footprint)."""
        asleep = [e for e in loaded if e.state == "sleeping"]
        if not asleep:
            return {}
        out = {}
        for e in asleep:
            worker = self._workers.get(e.id)
            pids = worker.handle.pids() if worker is not None else set()
            out[e.id] = await asyncio.to_thread(self.placer.held_asleep, e.spec, pids)
        return out

    def _loaded(self, entry: ModelEntry) -> list[ModelEntry]:
        """The models other than ``entry`` that hold room (or will soon)."""
        return [e for e in (*self.registry, *self._removed) if e is not entry
                and e.state in ("loading", "ready", "sleeping", "stopping")]

    def _first_in_line(self, entry: ModelEntry) -> bool:
        """Of the loads waiting for room, ``entry``'s goes first: highest priority, then
        the longest wait."""
        waiting = [e for e in self.registry if e.room_since is not None]
        return max(waiting, key=lambda e: (e.spec.priority, -(e.room_since or 0))) is entry

    @staticmethod
    def _idle(entry: ModelEntry) -> bool:
        return entry.leases == 0 and not (entry.link is not None and entry.link.busy)

    def _victim(self, entry: ModelEntry, loaded: list[ModelEntry],
                now: float) -> ModelEntry | None:
        """The model to stop for ``entry``: never a pinned one or one loaded less than its
        ``min_resident`` ago; one that yields to ``entry`` or sits idle first, a sleeping
        one before an awake one; then the lowest priority, the lowest ``expected_cost``,
        the least recently used."""
        wall = time.time()
        candidates = [e for e in loaded if e.state in ("ready", "sleeping") and not e.spec.pinned
                      and wall - (e.loaded_at or 0) >= e.spec.min_resident]
        if not candidates:
            return None

        def order(e: ModelEntry) -> tuple[bool, bool, int, float, float]:
            free = e.yield_to == entry.id or (self._idle(e) and now - e.last_used >= ACTIVE_GAP)
            return (not free, e.state != "sleeping", e.spec.priority, self.expected_cost(e, now),
                    e.last_used)

        return min(candidates, key=order)

    def _why(self, victim: ModelEntry, now: float) -> str:
        rate = victim.request_rate(now)
        return (f"priority {victim.spec.priority}, expected cost "
                f"{self.expected_cost(victim, now):.3f} s/s = load "
                f"{victim.load_seconds or UNKNOWN_LOAD_SECONDS:.1f} s x {rate * 60:.2f} "
                f"requests/min, idle {now - victim.last_used:.1f} s")

    async def _make_room(self, entry: ModelEntry) -> None:
        """Stop other models until ``entry`` fits (``_victim`` picks them, one at a time).

        Loads waiting for room form one line (``_first_in_line``). An idle model goes at
        once; a model still in use keeps serving until ``entry`` has waited
        ``swap_wait``, then it takes no new requests (``yield_to``), finishes the ones it
        has and stops: each model serves its queued requests together instead of one swap
        per request, and no request waits much longer than ``swap_wait`` plus a load. The
        waiting model keeps its state (its ``queued`` count shows the wait) and becomes
        ``loading`` only once it has room."""
        began = entry.room_since = time.monotonic()
        try:
            while True:
                held = (await self._held_asleep(self._loaded(entry))
                        if self._first_in_line(entry) else {})
                # Read after that await (a thread): a load that claimed room meanwhile
                # counts, and nothing awaits from here until room is claimed.
                now = time.monotonic()
                loaded = self._loaded(entry)
                if self._first_in_line(entry):
                    if fits(entry.spec, [e.spec for e in loaded], self.server, self.placer.gpus,
                            held):
                        return
                    victim = self._victim(entry, loaded, now)
                    if victim is not None and self._idle(victim) and (
                            victim.yield_to == entry.id or now - victim.last_used >= ACTIVE_GAP):
                        why = self._why(victim, now)
                        log.info("model %s: evicting %s to make room (%s)", entry.id, victim.id,
                                 why)
                        self.events.publish("eviction", victim.id, action="stop",
                                            reason=why, **{"for": entry.id})
                        victim.evictions += 1
                        await self.stop(victim)
                        continue
                    if (victim is not None and victim.yield_to is None
                            and now - began >= self.server.swap_wait
                            and victim.spec.priority <= entry.spec.priority):
                        why = self._why(victim, now)
                        log.info("model %s: waited %.1f s for room; %s takes no new requests "
                                 "and stops when its own are done (%s)", entry.id, now - began,
                                 victim.id, why)
                        self.events.publish("eviction", victim.id, action="yield",
                                            reason=why, **{"for": entry.id})
                        victim.yield_to = entry.id
                if now - began >= self.server.load_timeout:
                    raise ModelUnavailable(f"model '{entry.id}' found no room within "
                                           f"{self.server.load_timeout:g} s")
                await asyncio.sleep(POLL)  # room appears when a lease ends or a model stops
        finally:
            entry.room_since = None
            for other in self.registry:  # not needed any more: serve again
                if other.yield_to == entry.id and other.state in ("ready", "sleeping"):
                    other.yield_to = None
