"""``Parker``: parks a model's worker and wakes it (``router.lifecycle.policy.park`` says
who and when; the ``RoomMaker`` asks for a park when a victim may park).

A park is ``ready → parking → parked``: the worker's engine, if it has requests in
flight, pauses between two steps, keeping them and its caches (``Sleep(level=0)``; an
idle engine is between steps already), then on this host its processes stop
(``WorkerHandle.freeze``): a parked worker holds memory and no core,
and costs no CPU. A wake is ``parked → waking → ready``: the wake waits in the line for
room as a load does (and may park the model running now), continues the processes and
resumes the engine. One wake task per model, which every request for it shares; a
parked model whose requests are still in flight (paused mid-stream) asks for its next
turn at once. A worker that dies while parked is noticed by the supervisor's death watch
as any other (a stopped process still dies); a failed park or wake stops the model.

A GPU model parks through vLLM's sleep mode (``Sleep(level=1|2)``, the level
``policy.park.park_level`` chose) and its processes keep running (no ``SIGSTOP``); it
wakes with ``Wake`` through the same line for room. Its requests in flight are kept:
the worker asks vLLM for ``sleep(level, mode="keep")``, whose pause freezes them between
two steps and, as the KV cache is freed, moves the running ones back to the waiting
queue (``reset_prefix_cache(reset_running_requests=True)``: their tokens kept, their
in-flight step's output dropped, not doubled); after the wake they are recomputed
(prefill of prompt and tokens so far) and go on. So a busy GPU model takes turns as a
CPU one does, at the price of that recompute, not of the stream. Stopped while asleep,
it is not woken to drain (waking takes GPU memory that another model may hold now): its
paused requests end with the unload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from router.errors import APIError
from router.lifecycle.replica import Replica, link_of
from router.observe.events import EventBus
from router.registry import ModelEntry

log = logging.getLogger("modelyard.router")
POLL = 0.01
"""Seconds between looks at a park still under way, for a wake that must follow it."""
PARK_TIMEOUT = 10.0
"""Seconds an engine may take to pause (its step in flight ends first): the line for room
waits for the park, so one that hangs stops instead."""
THAW_TIMEOUT = 10.0
"""Seconds a parked worker that is to stop may take to resume its engine first."""
PIN_BYTES_PER_S = 0.5e9
"""A floor for how fast host memory is pinned for a level-1 sleep (half the H200's)."""
SLEEP_TIMEOUT = 60.0
"""Seconds a GPU engine may take to fall asleep: level 1 copies its weights to pinned
host memory (page-locking 16 GB for an 8B model alone takes seconds; the probe,
``bench/gpu_park_probe.py``, measures it), and the step in flight ends first."""


def sleep_timeout(weights_bytes: int) -> float:
    """Seconds a GPU engine may take to sleep: ``SLEEP_TIMEOUT``, plus the first level-1
    park's pinning of its weights at ``PIN_BYTES_PER_S`` (measured ~1.2 GB/s on an H200:
    13.8 s for 8B), which a fixed bound would refuse for every model past ~70 GB."""
    return SLEEP_TIMEOUT + weights_bytes / PIN_BYTES_PER_S


class Parker:
    """Parks and wakes models' workers (module docstring).

    ``worker_of`` gives a model's running worker; ``publish_state`` tells the event bus
    of a state change; ``stopping`` is the model's one stop task; ``make_room`` waits in
    the line for room as a load does (the ``RoomMaker``'s), while its second argument
    says the wake is still wanted."""

    def __init__(self, events: EventBus,
                 worker_of: Callable[[ModelEntry], Replica | None],
                 publish_state: Callable[[ModelEntry, str | None], None],
                 stopping: Callable[[ModelEntry], asyncio.Task[None]],
                 make_room: Callable[[ModelEntry, Callable[[], bool]],
                                     Coroutine[Any, Any, bool]],
                 spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self.events = events
        self.worker_of = worker_of
        self._publish_state = publish_state
        self._stopping = stopping
        self._make_room = make_room
        self._spawn = spawn
        self._wakes: dict[str, asyncio.Task[None]] = {}
        self._asked: set[str] = set()
        """Models whose wake under way a load asked for (a request's, an admin's), not
        only their own paused requests (``wanted``)."""
        self._parks: set[asyncio.Task[None]] = set()
        self.observe: Callable[[str, str, float], None] = lambda model, kind, seconds: None
        """Told of each ``park`` and ``wake`` and its seconds (the metrics' histogram),
        and of each wake's ``wake_wait``: from its first waiting request to ready."""

    async def park(self, entry: ModelEntry, reason: str = "", level: int = 0) -> bool:
        """Park ``entry`` now (it is ``ready``; anything else is left as it is): ``level``
        0 pauses its engine and stops its processes, 1 or 2 puts its GPU engine to sleep
        at that level (module docstring). Its requests in flight pause and take its next
        turn, which it asks for at once. A park, once begun, is never cancelled by
        whoever waits for it (a load making room that is itself unloaded): it runs as a
        task of its own, awaited shielded. False: it could not begin (no worker to
        park), and the caller stops it instead."""
        if entry.state != "ready" or self.worker_of(entry) is None or entry.replica is None:
            return False
        task = asyncio.create_task(self._park(entry, reason, level), name=f"park-{entry.id}")
        self._parks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._parks.discard)
        await asyncio.shield(task)
        return True

    async def _park(self, entry: ModelEntry, reason: str, level: int) -> None:
        worker, link = self.worker_of(entry), link_of(entry)
        if entry.state != "ready" or worker is None or link is None:
            return
        began = time.monotonic()
        entry.state = "parking"  # no new lease from here (``acquire_now`` wants ready)
        entry.parked_level = level
        self._publish_state(entry, reason or None)
        # An engine with nothing in flight is between steps already: its processes stop
        # as they are (a pause costs ~50 ms of vLLM's). A request that got its lease
        # before the park and sends later waits, queued, for the wake. A GPU engine
        # sleeps whether busy or not: that is what frees its GPU memory.
        paused = link.busy or level > 0
        if paused:
            try:
                async with asyncio.timeout(sleep_timeout(entry.weights_bytes)
                                           if level else PARK_TIMEOUT):
                    await link.sleep(level)
            except (APIError, TimeoutError) as err:
                log.warning("model %s: park failed (%s); stopping instead", entry.id,
                            getattr(err, "message", "no answer"))
                # vLLM pauses its scheduler before it sleeps: a sleep that failed (or
                # still runs) may have left it paused, and its requests would hang
                # until the stop's drain timed out. Resumed first, they drain.
                with contextlib.suppress(APIError, TimeoutError):
                    async with asyncio.timeout(THAW_TIMEOUT):
                        await link.wake()
                entry.parked_level = 0
                await asyncio.shield(self._stopping(entry))
                return
            if entry.state != "parking" or self.worker_of(entry) is not worker:
                # It died, or a stop began meanwhile (whose drain needs it running).
                with contextlib.suppress(APIError):
                    await link.wake()
                return
        worker.parked, worker.paused = True, paused  # a stop resumes it first (``thaw``)
        if not level:
            worker.handle.freeze(True)
        seconds = time.monotonic() - began
        entry.state, entry.parked_at = "parked", time.monotonic()
        entry.parks += 1
        self.observe(entry.id, "park", seconds)
        self._publish_state(entry, reason or None)
        self.events.publish("park", entry.id, seconds=round(seconds, 4),
                            in_flight=entry.leases, level=level)
        log.info("model %s: parked in %.3f s%s%s", entry.id, seconds,
                 f" (asleep at level {level})" if level else "",
                 f" ({entry.leases} request(s) paused)" if entry.leases else "")
        if not level:
            # A GPU one keeps its measure as it ran: its pinned weights are counted apart
            # (``policy.park.host_held``), and would be twice in a new one.
            self._spawn(self._measure(entry, worker))
        if entry.leases:
            # Its paused requests wait in the line for the next turn; batch lines alone
            # take only a turn no person uses (``policy.room.for_batch_alone``).
            entry.batch_load = entry.leases == entry.batch_leases
            self.wake(entry, since=began, asked=False)  # they wait since the park began

    async def _measure(self, entry: ModelEntry, worker: Replica) -> None:
        """What ``entry``'s parked worker holds (``policy.park.may_park`` reads it)."""
        held = await asyncio.to_thread(worker.handle.resident_bytes)
        if held and self.worker_of(entry) is worker:
            entry.resident_bytes = held

    def measure(self, entry: ModelEntry) -> None:
        """Measure what ``entry``'s worker holds, in the background (as it became ready)."""
        worker = self.worker_of(entry)
        if worker is not None:
            self._spawn(self._measure(entry, worker))

    def wake(self, entry: ModelEntry, since: float | None = None,
             asked: bool = True) -> asyncio.Task[None]:
        """The model's one wake task, begun now if none runs. It waits for a park under
        way, then for room, then resumes the worker; it ends with the model ``ready``,
        or in whatever state a crash or a stop left it (its waiters look again).
        ``since``: when its first request began to wait (default now), what its
        ``waited`` seconds count from. ``asked``: a load asks for it (else it is for the
        model's paused requests alone, and ends unwoken once none is left: ``wanted``)."""
        if asked:
            self._asked.add(entry.id)
        task = self._wakes.get(entry.id)
        if task is None:
            first = time.monotonic() if since is None else since
            task = asyncio.create_task(self._wake(entry, first), name=f"wake-{entry.id}")
            self._wakes[entry.id] = task
            task.add_done_callback(lambda t: self._wake_done(entry, t, first))
        return task

    def cancel(self, entry: ModelEntry) -> None:
        """End ``entry``'s wake under way, if any (a stop or a crash: it must not park
        another model for one that no longer wakes)."""
        task = self._wakes.pop(entry.id, None)
        self._asked.discard(entry.id)
        if task is not None:
            task.cancel()

    def wanted(self, entry: ModelEntry) -> bool:
        """Someone waits for ``entry``'s wake: a load asked for it, or requests hold the
        model (paused in flight, or waiting for a slot), or a stream of its link is still
        read. A paused request whose client left holds nothing: a wake for it alone would
        take the running model's turn for no one."""
        return (entry.id in self._asked or entry.leases > 0 or entry.queued > 0
                or entry.busy)

    def _wake_done(self, entry: ModelEntry, task: asyncio.Task[None], since: float) -> None:
        if self._wakes.get(entry.id) is task:
            del self._wakes[entry.id]
            self._asked.discard(entry.id)  # the loads that awaited it go on alone now
        if task.cancelled():
            return
        if task.exception() is not None:
            log.warning("model %s: wake failed: %s", entry.id, task.exception())
            if entry.state == "parked" and entry.busy:
                # Its paused requests must not wait for ever, and room may never come (a
                # pinned model holds it): it stops, draining them where room allows.
                self._stopping(entry)
            elif entry.state == "parked" and entry.leases:
                self.wake(entry, since=since, asked=False)  # requests wait: try again

    async def _wake(self, entry: ModelEntry, since: float) -> None:
        while entry.state == "parking":
            await asyncio.sleep(POLL)
        if entry.state != "parked":
            return
        # Asked once more right before room is claimed: a wake its paused requests alone
        # asked for, whose clients have all gone, parks no one (it stays parked).
        if not await self._make_room(entry, lambda: self.wanted(entry)):
            return
        worker, link = self.worker_of(entry), link_of(entry)
        if entry.state != "parked" or worker is None or link is None:
            return  # it died or stopped while it waited: a request loads it again
        # No await between finding room and claiming it (``waking`` runs, for room).
        entry.state = "waking"
        self._publish_state(entry, None)
        began = time.monotonic()
        if not entry.parked_level:
            worker.handle.freeze(False)
        if worker.paused:
            try:
                await link.wake()
            except APIError as err:
                log.warning("model %s: wake failed (%s); stopping instead", entry.id,
                            err.message)
                await asyncio.shield(self._stopping(entry))
                return
        worker.parked = worker.paused = False
        if entry.state != "waking" or self.worker_of(entry) is not worker:
            return
        entry.parked_level = 0
        now = time.monotonic()
        entry.state, entry.turn_at, entry.last_used = "ready", now, now
        entry.wakes += 1
        # ``wake``: the resume alone (what bench/swap.py holds to 0.1 s); ``wake_wait``:
        # what its requests saw, the line for room (and a park under way) included.
        self.observe(entry.id, "wake", now - began)
        self.observe(entry.id, "wake_wait", now - since)
        self._publish_state(entry, "woken")
        self.events.publish("wake", entry.id, seconds=round(now - began, 4),
                            waited=round(now - since, 4),
                            parked_seconds=round(began - entry.parked_at, 3))

    async def thaw(self, entry: ModelEntry, worker: Replica) -> bool:
        """Before a stop: a parked worker's processes continue and its engine resumes, so
        its requests in flight drain and ``Shutdown`` is read. False: it is left asleep,
        a GPU engine (module docstring), or did not resume; its requests will not drain."""
        if not worker.parked:
            return True
        worker.parked = False
        if entry.parked_level:
            entry.parked_level = 0
            return False  # its worker reads ``Shutdown`` asleep
        worker.handle.freeze(False)
        if not worker.paused:
            return True
        try:
            async with asyncio.timeout(THAW_TIMEOUT):
                await worker.link.wake()
            worker.paused = False
        except (APIError, TimeoutError) as err:
            log.warning("model %s: its parked engine did not resume before its stop (%s)",
                        entry.id, err)
            return False
        return True
