"""``RoomMaker``: carries out the room policy (``router.lifecycle.policy.room``) for a load.

A load (or a parked model's wake) that needs room waits in one line with the others;
while it is first, it reads what sleeping (and parked GPU) models still hold on their
GPUs, this host's memory and, where a GPU model may park, NVML's free memory (threads),
asks ``room.decide`` and acts: parks a victim at the level it says (the ``Parker``'s
``park``, awaited), stops an idle one (the supervisor's ``stop``, awaited),
or makes a busy one yield (``yield_to``: it takes no new requests and stops once its own
are done). The ``Supervisor`` owns one and hands it the few of its own operations it
needs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import psutil

from router.errors import ModelUnavailable
from router.lifecycle.policy import park, room
from router.lifecycle.replica import Replica
from router.observe.events import EventBus
from router.registry import ModelEntry, ModelRegistry
from router.workers.placement import Placer
from shared.config import ServerConfig

log = logging.getLogger("modelyard.router")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weights_on_disk(model: str) -> int:
    """The size of the weight files in ``model``'s folder (0: not a folder here, e.g. a
    hub id or ``builtin:``). Blocking: call it in a thread."""
    folder = Path(model)
    if not folder.is_dir():
        return 0
    total = 0
    for path in folder.rglob("*"):
        if path.suffix in WEIGHT_SUFFIXES and path.is_file():
            total += path.stat().st_size
    return total


class RoomMaker:
    """Finds a load room by stopping, or making yield, the models policy names.

    ``removed`` are models a reload removed that still hold room; ``worker_of`` gives a
    model's running worker (whose processes tell what a sleeping model holds); ``stop``
    is how a victim is stopped (the supervisor's)."""

    def __init__(self, registry: ModelRegistry, removed: set[ModelEntry], server: ServerConfig,
                 placer: Placer, events: EventBus,
                 worker_of: Callable[[ModelEntry], Replica | None],
                 stop: Callable[[ModelEntry], Coroutine[Any, Any, None]], poll: float,
                 park_victim: Callable[[ModelEntry, str, int], Coroutine[Any, Any, bool]]
                 | None = None) -> None:
        self.registry = registry
        self.removed = removed
        self.server = server
        self.placer = placer
        self.events = events
        self.worker_of = worker_of
        self.stop = stop
        self.poll = poll
        self.park_victim = park_victim
        """How a victim parks, at a level (the ``Parker``'s ``park``); ``None``: nothing
        parks."""

    def loaded(self, entry: ModelEntry) -> list[ModelEntry]:
        """The models other than ``entry`` that run (or will soon): parked ones hold
        memory but no room to run (``parked``)."""
        return [e for e in (*self.registry, *self.removed) if e is not entry
                and e.state in ("loading", "ready", "sleeping", "stopping", "parking",
                                "waking")]

    def parked(self, entry: ModelEntry) -> list[ModelEntry]:
        """The models other than ``entry`` that are parked: their memory is held."""
        return [e for e in (*self.registry, *self.removed) if e is not entry
                and e.state == "parked"]

    def batch_may_run(self, entry: ModelEntry) -> bool:
        """``room.batch_may_run`` for ``entry`` as things stand."""
        return room.batch_may_run(entry, self.loaded(entry), self.server, self.placer.gpus,
                                  time.monotonic(), self.parked(entry))

    def _memory_needed(self) -> bool:
        """Whether a decision may read this host's memory (parking without a ceiling)."""
        return (self.park_victim is not None and self.server.max_parked_models > 0
                and self.server.park_memory_gib is None)

    def _gpu_may_park(self, loaded: list[ModelEntry]) -> bool:
        """Whether a decision may park a GPU model (its level reads NVML and its
        weights' size)."""
        return (self.park_victim is not None and self.server.max_parked_models > 0
                and any(e.spec.device == "cuda" and e.state == "ready" for e in loaded))

    async def _held_asleep(self, loaded: list[ModelEntry]) -> dict[str, dict[str, float]]:
        """What each sleeping model, and each GPU model parked (asleep through vLLM's
        sleep mode), still holds on its GPUs (it counts against the budget by that, not by
        its full footprint)."""
        out = {}
        for e in loaded:
            if e.state == "sleeping" or (e.state == "parked" and e.spec.device == "cuda"):
                worker = self.worker_of(e)
                pids = worker.handle.pids() if worker is not None else set()
                out[e.id] = await asyncio.to_thread(self.placer.held_asleep, e.spec, pids)
        return out

    async def make(self, entry: ModelEntry, wanted: Callable[[], bool] | None = None) -> bool:
        """Stop other models until ``entry`` fits, as ``room.decide`` says, one at a time.
        A yielding model takes no new requests (``yield_to``) and stops once its own are
        done. The waiting model keeps its state (its ``queued`` count shows the wait) and
        becomes ``loading`` only once it has room. ``wanted``, asked before each
        decision (no await from there until room is claimed): once it says no, the wait
        ends with nothing done for it, False (a wake whose requests have all gone)."""
        began = entry.room_since = time.monotonic()
        try:
            while True:
                first = room.first_in_line(entry, self.registry)
                present = [*self.loaded(entry), *self.parked(entry)]
                # A parked GPU model's wake needs the GPU memory it gave back: what it
                # holds asleep is read with the others' (``room.decide`` checks it).
                wakes_gpu = entry.spec.device == "cuda" and entry.state in park.PARKED_STATES
                held = (await self._held_asleep([*present, entry] if wakes_gpu else present)
                        if first else {})
                memory, gpus_now = None, None
                if first and self._memory_needed():
                    if not entry.weights_bytes and park.expected_bytes(entry):
                        entry.weights_bytes = await asyncio.to_thread(weights_on_disk,
                                                                      entry.spec.model)
                    vm = await asyncio.to_thread(psutil.virtual_memory)
                    memory = park.HostMemory(vm.total, vm.available)
                if first and (wakes_gpu or self._gpu_may_park(present)):
                    # A GPU model's sleep level needs its weights' size (level 1 pins a
                    # copy in host memory), and whether the GPU then holds ``entry``:
                    # NVML's free memory now (the placer's reading is from start-up).
                    for e in present:
                        if e.spec.device == "cuda" and not e.weights_bytes:
                            e.weights_bytes = await asyncio.to_thread(weights_on_disk,
                                                                      e.spec.model)
                    gpus_now = await asyncio.to_thread(self.placer.read_gpus)
                # Read after those awaits (threads): a load that claimed room meanwhile
                # counts, and nothing awaits from here until room is claimed.
                if wanted is not None and not wanted():
                    return False
                now = time.monotonic()
                decision = room.decide(entry, self.registry, self.loaded(entry), self.server,
                                       self.placer.gpus, held, now=now, wall=time.time(),
                                       waited=now - began, parked=self.parked(entry),
                                       memory=memory, parking=self.park_victim is not None,
                                       gpus_now=gpus_now)
                victim = decision.victim
                if decision.action == "fits":
                    return True
                if decision.action == "park" and victim is not None:
                    assert self.park_victim is not None  # ``memory`` None: ``may_park`` no
                    log.info("model %s: parking %s to run (%s)%s", entry.id, victim.id,
                             decision.why, f", asleep at level {decision.level}"
                             if decision.level else "")
                    self.events.publish("eviction", victim.id, action="park",
                                        reason=decision.why, level=decision.level,
                                        **{"for": entry.id})
                    victim.parked_for = entry.id
                    if not await self.park_victim(victim, f"for {entry.id}", decision.level):
                        victim.evictions += 1  # nothing there to park: it stops
                        await self.stop(victim)
                    continue
                if decision.action == "evict" and victim is not None:
                    log.info("model %s: evicting %s to make room (%s)", entry.id, victim.id,
                             decision.why)
                    self.events.publish("eviction", victim.id, action="stop",
                                        reason=decision.why, **{"for": entry.id})
                    victim.evictions += 1
                    await self.stop(victim)
                    continue
                if decision.action == "yield" and victim is not None:
                    log.info("model %s: waited %.1f s for room; %s takes no new requests "
                             "and stops when its own are done (%s)", entry.id, now - began,
                             victim.id, decision.why)
                    self.events.publish("eviction", victim.id, action="yield",
                                        reason=decision.why, **{"for": entry.id})
                    victim.yield_to = entry.id
                if now - began >= self.server.load_timeout:
                    raise ModelUnavailable(f"model '{entry.id}' found no room within "
                                           f"{self.server.load_timeout:g} s")
                await asyncio.sleep(self.poll)  # room appears when a lease ends or a model stops
        finally:
            entry.room_since = None
            # Not needed any more: serve again. Whatever state it is in: one that crashed
            # while it yielded must not hold its requests back (they wait on ``yield_to``).
            for other in (*self.registry, *self.removed):
                if other.yield_to == entry.id:
                    other.yield_to = None
