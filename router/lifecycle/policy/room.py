"""Who gets room, and who makes it (``decide``; ``RoomMaker.make`` acts on it).

Loads waiting for room form one line (``first_in_line``: priority, then wait). The first
in line stops one ``victim`` at a time: never a pinned one or one within its
``min_resident``; one that yields or sits idle first, a sleeping one before an awake one;
then the lowest priority, the lowest ``expected_cost`` (measured load seconds x decaying
request rate), the least recently used. A model still in use yields only after the waiter
has waited ``swap_wait``, and only to a model of its priority or higher; one that serves
batch lines alone yields at once to a model a person waits for. A load that batch lines
alone wait for goes after every other load in line, and takes only room no person used
for ``BATCH_QUIET`` s.
A load (or a wake) a model was parked for during its wait goes before all others
(``owed``): the room that park freed is its own.

Where the victim may park instead (``policy.park.may_park``: memory allows), stopping's
caution has no reason left: an idle victim, or one serving batch lines alone for a
person, parks at once, and a busy one once it has run ``park_quantum`` since its turn
began (then the two take turns); for a pinned model, which never gives the cores back,
a busy one yields instead (its requests finish, then it stops), as before parking. A parked model waking up waits in the same line, needs
no memory, and is the same kind of waiter as a load. Parked models hold memory but run
nothing: they count against memory budgets, not ``max_loaded_models``; when memory is
what is short, a parked one with nothing in flight stops first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from router.lifecycle.policy import park
from router.lifecycle.policy.gpu_park import gpu_room_after_sleep
from router.registry import ModelEntry
from router.workers.placement import GpuMemory, fits, footprint, runs_beside
from shared.config import ModelSpec, ServerConfig

ACTIVE_GAP = 2.0
"""A model used this recently still has clients coming: a model waiting for room does not
evict it at once, but after ``swap_wait``."""
BATCH_QUIET = 10.0
"""Seconds a model must have had no request of a person's before a batch may evict it
(``batch_may_run``)."""
UNKNOWN_LOAD_SECONDS = 30.0
"""A model's load time before one was measured (its eviction cost)."""


@dataclass(frozen=True, slots=True)
class RoomDecision:
    """What a load (or a wake) waiting for room does now: start (``fits``), stop
    ``victim`` at once (``evict``), park it (``park``: between two engine steps, its
    requests kept), make a busy ``victim`` take no new requests and stop when done
    (``yield``), or look again later (``wait``). ``why`` is the victim's reason."""

    action: Literal["fits", "evict", "park", "yield", "wait"]
    victim: ModelEntry | None = None
    why: str = ""
    level: int = 0
    """How ``park`` parks it (``park.park_level``): 0 paused and stopped (CPU), 1 or 2
    vLLM's sleep mode at that level (GPU)."""


WAIT = RoomDecision("wait")


def expected_cost(entry: ModelEntry, now: float) -> float:
    """What evicting ``entry`` is expected to cost: the seconds its next load takes,
    times how often it is asked for (seconds of loading per second)."""
    return (entry.load_seconds or UNKNOWN_LOAD_SECONDS) * entry.request_rate(now)


def is_idle(entry: ModelEntry) -> bool:
    """No lease held and nothing in flight on its link."""
    return entry.leases == 0 and not entry.busy


def batch_only(entry: ModelEntry) -> bool:
    """Busy with batch lines alone (``Lease.batch``): no one waits on it in person."""
    return entry.leases > 0 and entry.leases == entry.batch_leases


def wanted_in_person(entry: ModelEntry) -> bool:
    """A request that is no batch line holds a lease on ``entry`` (waiting for it)."""
    return entry.leases > entry.batch_leases


def used_in_person(entry: ModelEntry, now: float) -> bool:
    """A person's request holds a lease on ``entry``, or took one within ``BATCH_QUIET``
    seconds: a batch must not take its room."""
    return wanted_in_person(entry) or now - entry.interactive_at < BATCH_QUIET


def for_batch_alone(entry: ModelEntry) -> bool:
    """``entry``'s load was asked for by batch lines alone (``ModelEntry.batch_load``) and
    no person's request waits for it since."""
    return entry.batch_load and not wanted_in_person(entry)


def specs(loaded: Iterable[ModelEntry]) -> list[ModelSpec]:
    """The workers of ``loaded`` as ``fits`` counts them: a model's spec once per running
    replica (each is one of ``max_loaded_models`` and holds its own memory)."""
    return [e.spec for e in loaded for _ in range(max(1, e.replica_count))]


def batch_may_run(entry: ModelEntry, loaded: list[ModelEntry], server: ServerConfig,
                  gpus: dict[int, GpuMemory], now: float,
                  parked: Iterable[ModelEntry] = ()) -> bool:
    """Whether a batch may start a line on ``entry`` (``now``: ``time.monotonic()``): it
    serves or loads already and makes room for no one; or its load (or wake) fits
    beside the ``loaded`` models (and the ``parked`` ones' memory); or none of those
    has had a person's request for ``BATCH_QUIET`` seconds. A batch fills idle room; it
    never evicts, or parks, a model people use."""
    if entry.yield_to is not None:
        return False
    if entry.state in ("ready", "loading", "sleeping", "waking"):
        return True
    if fits(entry.spec, specs(loaded), server, gpus, {},
            [e.spec for e in parked if e is not entry]):
        return True
    return not any(used_in_person(e, now) for e in loaded)


def first_in_line(entry: ModelEntry, models: Iterable[ModelEntry]) -> bool:
    """Of the loads waiting for room among ``models``, ``entry``'s goes first: one for
    which a model was parked during its wait (``owed``) before any other, then one a
    person waits for (or no batch alone asked for) before one for batch lines alone,
    then the highest priority, then the longest wait. A waiting ``entry`` is in the line
    whether or not ``models`` holds it: a reload may have taken it out of the registry
    while it waits (its retirement cancels the wait)."""
    # In ``models``' order (a dict, not a set): a tie goes to the first, whatever the
    # entries' addresses; a set made the line, and a seed's simulation, depend on memory.
    everyone = list(dict.fromkeys((*models, entry)))
    waiting = [e for e in everyone if e.room_since is not None]
    by_id = {e.id: e for e in waiting}
    return bool(waiting) and max(
        waiting, key=lambda e: (owed(e, everyone), not for_batch_alone(e),
                                not defers(e, by_id), e.spec.priority,
                                -(e.room_since or 0))) is entry


def owed(entry: ModelEntry, models: Iterable[ModelEntry]) -> bool:
    """A model of ``models`` was parked for ``entry`` (``parked_for``) during its wait
    for room, and is parked still: the room that park freed is ``entry``'s, whatever
    loads came since. The park was decided for it (``park.may_park``: the parked set's
    limits with ``entry``, a parked model, leaving it, or memory for ``entry``'s
    size): a higher priority taking that room left two parked past
    ``max_parked_models`` (simulation seed 800170) and ``entry`` waiting on."""
    since = entry.room_since
    return since is not None and any(e.parked_for == entry.id and e.state == "parked"
                                     and e.parked_at >= since for e in models)


def defers(entry: ModelEntry, waiting: dict[str, ModelEntry]) -> bool:
    """``entry`` was parked for a model (``parked_for``) that still waits and has not
    begun its turn since: it goes behind it in the line whatever the priorities, or the
    room its park made would go straight back to it (a turn taken, never given)."""
    other = waiting.get(entry.parked_for or "")
    return (other is not None and entry.state == "parked"
            and other.turn_at < entry.parked_at)


def victim(entry: ModelEntry, loaded: Iterable[ModelEntry], now: float,
           wall: float) -> ModelEntry | None:
    """The model to stop for ``entry``: never a pinned one or one loaded less than its
    ``min_resident`` ago (``wall``: ``time.time()``), nor for a load of batch lines alone
    one ``used_in_person``; one that yields to ``entry`` or sits idle first, a sleeping
    one before an awake one; then the lowest priority, the lowest ``expected_cost``, the
    least recently used (``now``: ``time.monotonic()``)."""
    quiet_only = for_batch_alone(entry)
    candidates = [e for e in loaded if e.state in ("ready", "sleeping") and not e.spec.pinned
                  and wall - (e.loaded_at or 0) >= e.spec.min_resident
                  and not (quiet_only and used_in_person(e, now))]
    if not candidates:
        return None

    person = wanted_in_person(entry)

    def order(e: ModelEntry) -> tuple[bool, bool, int, float, float]:
        free = (e.yield_to == entry.id or (is_idle(e) and now - e.last_used >= ACTIVE_GAP)
                or (person and batch_only(e)))
        return (not free, e.state != "sleeping", e.spec.priority, expected_cost(e, now),
                e.last_used)

    return min(candidates, key=order)


def why(victim: ModelEntry, now: float) -> str:
    """The reason an eviction event and the log give for stopping ``victim``."""
    rate = victim.request_rate(now)
    return (f"priority {victim.spec.priority}, expected cost "
            f"{expected_cost(victim, now):.3f} s/s = load "
            f"{victim.load_seconds or UNKNOWN_LOAD_SECONDS:.1f} s x {rate * 60:.2f} "
            f"requests/min, idle {now - victim.last_used:.1f} s")


def decide(entry: ModelEntry, models: Iterable[ModelEntry], loaded: list[ModelEntry],
           server: ServerConfig, gpus: dict[int, GpuMemory],
           held: dict[str, dict[str, float]], *, now: float, wall: float,
           waited: float, parked: list[ModelEntry] | None = None,
           memory: park.HostMemory | None = None, parking: bool = False,
           gpus_now: dict[int, GpuMemory] | None = None) -> RoomDecision:
    """What ``entry``'s load (or wake), waiting for room for ``waited`` seconds, does now.

    ``models`` are those that may wait for room (the line), ``loaded`` the others that
    run (or will soon), ``parked`` those that hold memory and no core, ``held`` what
    each sleeping (or parked GPU) one still holds on its GPUs, ``memory`` this host's
    and ``gpus_now`` NVML's reading now (for ``park.park_level``); ``parking``: the
    executor can park (else victims stop). Only the first in line acts. A victim that
    may park parks at once when idle and after its ``park_quantum`` when busy; one that
    must stop goes at once when idle, and when in use keeps serving until ``entry`` has
    waited ``swap_wait``, then yields if ``entry``'s priority is at least its own."""
    if not first_in_line(entry, models):
        return WAIT
    parked = [e for e in parked or () if e is not entry]
    if fits(entry.spec, specs(loaded), server, gpus, held,
            [e.spec for e in parked]) and gpu_holds_wake(entry, gpus, held, gpus_now):
        return RoomDecision("fits")
    idle_parked = [e for e in parked if park.stoppable(e) and not e.spec.pinned]
    stale = min(idle_parked, default=None,
                key=lambda e: (e.spec.priority, expected_cost(e, now), e.last_used))

    def level(chosen: ModelEntry) -> int | None:
        return park.park_level(chosen, entry, [*loaded, *parked], server, memory,
                               gpus=gpus, held=held, gpus_now=gpus_now)

    if runs_beside(entry.spec, specs(loaded), server):
        # Memory is what is short: a parked model with nothing in flight goes first
        # (parking a running CPU model would free none; a GPU model's sleep frees its
        # GPU memory, and it parks where that leaves room).
        if stale is not None:
            return RoomDecision("evict", stale, "parked; " + why(stale, now))
        chosen = victim(entry, loaded, now, wall)
        if parking and chosen is not None and chosen.spec.device == "cuda":
            gpu_level = level(chosen)
            parks = None if gpu_level is None else _park(entry, chosen, gpu_level, server,
                                                         now)
            if parks is not None:
                return parks
        return _stop_for(entry, chosen, server, now, waited)
    chosen = victim(entry, loaded, now, wall)
    if parking and chosen is not None:
        how = level(chosen)
        if how is None:
            # Memory (or ``max_parked_models``) holds no more parked models: the parked
            # one least worth keeping stops first, by the same cost rules, so that the
            # running one, which people use now, parks instead of stopping.
            if stale is not None and (stale.spec.priority, expected_cost(stale, now),
                                      stale.last_used) <= (chosen.spec.priority,
                                                           expected_cost(chosen, now),
                                                           chosen.last_used):
                return RoomDecision("evict", stale, "parked, to park another; "
                                    + why(stale, now))
            return _stop_for(entry, chosen, server, now, waited)
        parks = _park(entry, chosen, how, server, now)
        if parks is not None:
            return parks
    return _stop_for(entry, chosen, server, now, waited)


def gpu_holds_wake(entry: ModelEntry, gpus: dict[int, GpuMemory],
                   held: dict[str, dict[str, float]],
                   gpus_now: dict[int, GpuMemory] | None) -> bool:
    """A GPU model parked (asleep) gets back, on each of its GPUs, its footprint: NVML's
    free memory now plus what it holds asleep. The budgets alone did not say it (with
    none set they hold anything), and a ``wake_up`` short of memory fails, its paused
    requests then ending with the stop. Not a parked GPU model, or no NVML reading: yes."""
    if entry.spec.device != "cuda" or entry.state not in park.PARKED_STATES or not gpus_now:
        return True
    return gpu_room_after_sleep(footprint(entry.spec, gpus), park.free_gib(gpus_now),
                                held.get(entry.spec.id, {}), {})


def _park(entry: ModelEntry, chosen: ModelEntry, level: int, server: ServerConfig,
          now: float) -> RoomDecision | None:
    """Parking ``chosen`` (at ``level``) for ``entry``: at once when idle, when busy
    once its turn is over (or at once for a person, from batch lines alone); ``None``:
    it may not park with work in flight (``entry`` is pinned), and stops instead."""
    if is_idle(chosen):
        return RoomDecision("park", chosen, why(chosen, now), level)
    if level > 0 and not batch_only(chosen):
        # vLLM's sleep frees the KV cache: kept requests are recomputed (prompt and answer
        # so far) after the wake, and a turn shorter than that recompute throws it away
        # again, each turn (a livelock with long contexts; at level 2 each turn also
        # rereads the weights). A busy GPU model yields instead (its requests finish,
        # then it parks, idle); batch lines alone still park for a person.
        return None
    # Work in flight parks only for a model that gives the cores back in turn: a
    # pinned one never does, and the paused requests would wait for ever (it yields).
    if entry.spec.pinned:
        return None
    if batch_only(chosen) and wanted_in_person(entry):
        return RoomDecision("park", chosen, why(chosen, now), level)
    # Paused requests of its own take their turn whatever the priorities: a quantum
    # bounds how long a stream, once begun, is held (a higher priority says who goes
    # first, not who may starve a half-written answer).
    if park.turn_over(chosen, now, server) and (
            chosen.spec.priority <= entry.spec.priority or paused_work(entry)):
        return RoomDecision("park", chosen, "its turn is over; " + why(chosen, now), level)
    return WAIT


def paused_work(entry: ModelEntry) -> bool:
    """``entry`` is parked with requests in flight (paused mid-answer)."""
    return entry.state == "parked" and entry.busy


def _stop_for(entry: ModelEntry, chosen: ModelEntry | None, server: ServerConfig,
              now: float, waited: float) -> RoomDecision:
    """Stopping ``chosen`` for ``entry``: at once when idle, as a yield when in use."""
    if chosen is None:
        return WAIT
    if is_idle(chosen) and (chosen.yield_to == entry.id or now - chosen.last_used >= ACTIVE_GAP):
        return RoomDecision("evict", chosen, why(chosen, now))
    if chosen.yield_to is None and batch_only(chosen) and wanted_in_person(entry):
        # a batch never keeps a person waiting: its lines there end, and it goes on later
        return RoomDecision("yield", chosen, "batch lines only; " + why(chosen, now))
    if (chosen.yield_to is None and waited >= server.swap_wait
            and chosen.spec.priority <= entry.spec.priority):
        return RoomDecision("yield", chosen, why(chosen, now))
    return WAIT
