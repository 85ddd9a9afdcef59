"""The watch over batch lines in a simulated run: they fill idle capacity and yield to
people (``harness`` runs batches as ``router.batches.runner`` does: each line waits for
``RoomMaker.batch_may_run``, then leases its model with ``batch=True``).

``BatchWatch`` checks, as the run goes (each operation, every ``Q`` in worlds with
batches, each eviction event) and at quiescence:

- (a) a slot never goes to a batch line while a client's request waits for one of the
  same ``Slots`` (``WatchedSlots`` sees every grant: ``give`` and ``try_take``);
- (b) at quiescence no batch lease is held: ``batch_leases`` is back to 0 with ``leases``
  (and, by (a), no batch line ever held a slot that a client's request waited for);
- (c) a batch lease is no one's demand: ``acquire_now`` of a batch line leaves the
  ``demand`` of its model (and adapter) as it was; a model's demand never moved after its
  last person's lease (``interactive_at``); ``0 <= batch_leases <= leases``;
- (d) batch lines never keep a person's load waiting for room: a model serving them
  alone, once policy names it the victim (``room.victim``) of the load first in line
  that a person waits for, yields within ``YIELD_WITHIN`` virtual seconds (then stops
  when its lines end), unless that room maker awaits a stop or a park it began (a park
  overtaken by a stop ends once the victim's engine answers); and a load only batch lines asked for is never first in line for
  longer while a person's load waits behind it;
- (e) a load only batch lines asked for (each ``start_loading`` of it from a batch line's
  task) never evicts, or makes yield, a model a person had a lease on within
  ``BATCH_QUIET`` seconds.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from router.lifecycle.policy import room
from router.lifecycle.policy.room import BATCH_QUIET
from router.lifecycle.supervisor import POLL, Supervisor
from router.registry import Lease, ModelEntry, Slots
from router.workers.link import WorkerLink
from tests.simulation.fakes import Q
from tests.simulation.vtime import EPOCH

YIELD_WITHIN = 3 * POLL
"""Virtual seconds a model serving batch lines alone may stay the unyielded victim of a
load a person waits for: one look of the room maker (``POLL``), and turns."""
IDLE_LOOK = 4 * Q
"""Virtual seconds between ``check``s while no load waits for room."""
BATCH_LINE: contextvars.ContextVar[bool] = contextvars.ContextVar("batch_line", default=False)
"""Set in a batch line's task: what it asks the supervisor for, a batch asks for."""


class WatchedSlots(Slots):
    """``Slots`` that report a slot handed to a batch line (``later``) while a client's
    request waited in the first line, and tell ``freed`` of each slot given back (a
    moment clients may leave at: ``harness.Simulation.moment``)."""

    def __init__(self, size: int, model: str, saw: Callable[[str], None],
                 counts: Counter[str], freed: Callable[[str], None]) -> None:
        super().__init__(size)
        self.model = model
        self.saw = saw
        self.counts = counts
        self.freed = freed

    def _first_line(self) -> int:
        return sum(not w.done() for w in self._waiters)

    def try_take(self, later: bool = False) -> bool:
        waiting = self._first_line()
        took = super().try_take(later)
        if took and later and waiting:
            self.saw(f"{self.model}: (a) a batch line took a free slot while a client's "
                     "request waited for one")
        return took

    def give(self) -> None:
        waiting = self._first_line()
        batch_lines = [w for w in self._later if not w.done()]
        super().give()
        got = any(w.done() for w in batch_lines)
        if waiting and batch_lines:
            self.counts["slot freed with both lines waiting"] += 1
        if got:
            self.counts["slot handed to a waiting batch line"] += 1
        if got and waiting:
            self.saw(f"{self.model}: (a) a freed slot went to a batch line while a client's "
                     "request waited for one")
        self.freed(self.model)


class BatchWatch:
    """See the module docstring. ``saw`` records a violation (once per text)."""

    def __init__(self, sup: Supervisor, saw: Callable[[str], None],
                 now: Callable[[], float], freed: Callable[[str], None]) -> None:
        self.sup = sup
        self.saw = saw
        self.now = now
        self.freed = freed
        """Told the model of each slot given back (``WatchedSlots``)."""
        self.counts: Counter[str] = Counter()
        """What the run exercised, for its trace."""
        self._causes: dict[asyncio.Task[WorkerLink], str] = {}
        """Each load task: ``batch`` while only batch lines' tasks started or joined it."""
        self._unyielded: dict[tuple[str, str], float] = {}
        """(waiting load, batch-only victim): since when (d)'s state has held."""
        self._miscounted: set[str] = set()
        self._stopping_for: dict[str, ModelEntry] = {}
        """A load's (or wake's) last victim stopped or parked for it: its room maker
        awaits that stop or park."""
        self._watch_loads()

    def _watch_loads(self) -> None:
        """Note who starts or joins each load (a batch line or anyone else). The harness's
        one write inside the supervisor besides ``install_fakes``."""
        real = self.sup.start_loading

        def start_loading(entry: ModelEntry, batch: bool = False) -> asyncio.Task[WorkerLink]:
            task = real(entry, batch)
            if BATCH_LINE.get():
                if task not in self._causes:
                    self.counts["loads batch lines started"] += 1
                self._causes.setdefault(task, "batch")
            else:
                self._causes[task] = "person"
            return task

        self.sup.start_loading = start_loading  # type: ignore[method-assign]

    def watch_slots(self, entries: Iterable[ModelEntry]) -> None:
        """Put ``WatchedSlots`` in place of each fresh ``Slots`` of ``entries`` (a new
        entry's, or one a reload made anew): nothing took or waited for one yet."""
        for entry in entries:
            slots = entry.slots
            if (type(slots) is Slots and slots.free == slots.size and not slots.waiting
                    and entry.lora is None):
                entry.slots = WatchedSlots(slots.size, entry.id, self.saw, self.counts,
                                           self.freed)

    def lease_now(self, model: str) -> tuple[Lease, WorkerLink] | ModelEntry:
        """A batch line's ``Supervisor.acquire_now``: its lease leaves every demand as it
        was (c)."""
        registry = self.sup.registry
        named = registry.resolve(model)  # refuses as ``acquire_now`` would
        before = {e: (e.demand, e.demand_at) for e in (named, registry.serving(named))}
        got = self.sup.acquire_now(model, "generate", batch=True)
        if isinstance(got, tuple):
            self.counts["batch leases at once"] += 1
            for entry, was in before.items():
                if (entry.demand, entry.demand_at) != was:
                    self.saw(f"{entry.id}: (c) a batch line's lease counted as demand")
        return got

    # during the run
    def check(self) -> None:
        """(c) and (d), as things stand now."""
        for entry in self.sup.registry:
            if not 0 <= entry.batch_leases <= entry.leases and entry.id not in self._miscounted:
                self._miscounted.add(entry.id)  # once: it stays wrong from then on
                self.saw(f"{entry.id}: (c) {entry.batch_leases} batch lease(s) of "
                         f"{entry.leases}")
            if entry.demand_at > entry.interactive_at:
                self.saw(f"{entry.id}: (c) its demand moved after its last person's lease "
                         "(a batch line's counted)")
        self._check_yields()

    def _for_batch_alone(self, entry: ModelEntry) -> bool:
        """``entry``'s load was started by batch lines, and no person waits for it."""
        load = self.sup._loads.get(entry.id)
        return (load is not None and self._causes.get(load) == "batch"
                and not room.wanted_in_person(entry))

    def _check_yields(self) -> None:
        sup, now = self.sup, self.now()
        waiting = [e for e in sup.registry if e.room_since is not None]
        first = next((e for e in waiting if room.first_in_line(e, sup.registry)), None)
        held: dict[tuple[str, str], float] = {}
        for entry in waiting:
            if not room.wanted_in_person(entry) or first is None:
                continue
            if first is not entry:
                if self._for_batch_alone(first):
                    self._held(held, entry, first, now, "is first in line for room, a load "
                               "only batch lines asked for, before")
                continue
            stopping = self._stopping_for.get(entry.id)
            if stopping is not None and stopping.state in ("stopping", "parking"):
                continue  # its room maker awaits that stop (or park), as it should
            chosen = room.victim(entry, sup.rooms.loaded(entry), now, EPOCH + now)
            if chosen is not None and chosen.yield_to is None and room.batch_only(chosen):
                self._held(held, entry, chosen, now, "served batch lines alone and did not "
                           "yield to")
        self._unyielded = held

    def _held(self, held: dict[tuple[str, str], float], entry: ModelEntry,
              blocker: ModelEntry, now: float, what: str) -> None:
        """(d)'s state for ``entry``'s load held at ``now``: since when; too long a finding."""
        key = (entry.id, blocker.id)
        held[key] = since = self._unyielded.get(key, now)
        if now - since > YIELD_WITHIN:
            self.saw(f"{blocker.id}: (d) {what} {entry.id}'s load, which a person waits "
                     f"for, for over {YIELD_WITHIN:g} s")

    async def keep_checking(self) -> None:
        """``check`` every ``Q`` (virtual seconds) while a load waits for room (else every
        ``IDLE_LOOK``: (d) needs the first), until cancelled."""
        while True:
            self.check()
            waits = any(e.room_since is not None for e in self.sup.registry)
            await asyncio.sleep(Q if waits else IDLE_LOOK)

    def on_event(self, event: dict[str, Any]) -> None:
        """(e), at each eviction event: sent as the room maker decides, before it acts."""
        if event["type"] != "eviction":
            return
        for_id, sup = event["for"], self.sup
        entry = sup.registry.entries.get(for_id)
        if entry is None:
            return
        loaded = {e.id: e for e in sup.rooms.loaded(entry)}
        victim = loaded.get(event["model"])
        if victim is None:
            return
        if event["action"] in ("stop", "park"):
            self._stopping_for[for_id] = victim
        if "batch lines only" in event.get("reason", ""):
            self.counts["yields of batch-only models"] += 1
        load = sup._loads.get(for_id)
        if load is None or self._causes.get(load) != "batch" or room.wanted_in_person(entry):
            return
        self.counts["evictions for batch lines"] += 1
        ago = self.now() - victim.interactive_at
        if room.wanted_in_person(victim) or ago < BATCH_QUIET:
            self.saw(f"{victim.id}: (e) {event['action']} for {for_id}, whose load only batch "
                     f"lines asked for, {ago:.2f} s after a person's lease on it "
                     f"(BATCH_QUIET {BATCH_QUIET:g} s)")

    # at the end
    def quiescent_violations(self, entries: Iterable[ModelEntry]) -> list[str]:
        """(b): no batch lease left (the grants were checked as they happened)."""
        return [f"{e.id}: (b) {e.batch_leases} batch lease(s) held at quiescence"
                for e in entries if e.batch_leases]

    def summary(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items())) or "no batch"
