"""Who parks instead of stopping, and when a running model's turn is over (plain
functions; ``RoomMaker`` and ``Parker`` act on them).

A parked model's worker keeps its memory and gives up its cores: its engine's scheduler
paused between two steps with every request it had, and on this host its processes
stopped (``SIGSTOP``). Waking it takes milliseconds where a load takes seconds, so a
model that makes room parks whenever memory allows (``may_park``): fewer than
``max_parked_models`` are parked, and what they hold stays within ``park_memory_gib``,
or (unset) this host's available memory, less what the model that needs room is
expected to take, stays above ``PARK_MARGIN`` of its total. Otherwise it stops, as
before. Under memory pressure a parked model with nothing in flight is the first to stop
(``room.decide``). A CPU model whose processes cannot be stopped (``freezes``: a Ray
worker's) stops instead of parking, and so does a model that may run several replicas
(``replicas.max`` > 1: its load is spread, a park would hold every replica's memory).

A model on a GPU parks through vLLM's sleep mode instead (``park_level``,
``policy.gpu_park``): level 1 (weights to pinned host memory) where host memory holds
them, level 2 (weights dropped, read from disk on wake) where it does not, and it stops
where the GPU, with what it still holds asleep, would not hold the model that needs room
(NVML's free memory, ``memory_budget_gib``). Its processes keep running (no ``SIGSTOP``:
an engine asleep holds no core but its idle loop); what it still holds on its GPUs
counts against their budgets as a sleeping model's does, and at level 1 its pinned
weights count against host memory (``host_held``).

Two models with work take turns of ``park_quantum`` seconds (``turn_over``): the running
one is parked between two engine steps, its streams pause and go on at its next turn.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from router.lifecycle.policy.gpu_park import (
    PARK_MARGIN,
    HostMemory,
    gpu_room_after_sleep,
    pinned_bytes,
    sleep_level,
)
from router.registry import ModelEntry
from router.workers.placement import ASLEEP_GIB, GpuMemory, devices, footprint, within_budgets
from shared.config import ModelSpec, ServerConfig, sleep_mode

__all__ = ["GIB", "PARKED_STATES", "PARK_MARGIN", "RESIDENT_STATES", "UNKNOWN_NEED_GIB",
           "HostMemory", "expected_bytes", "free_gib", "freezes", "host_held", "may_park", "park_level", "parked",
           "sleeps", "stoppable", "turn_over"]

GIB = 1024 ** 3
UNKNOWN_NEED_GIB = 2.0
"""Memory a model never measured is expected to take beyond its KV cache."""
PARKED_STATES = ("parking", "parked")
"""A model in one of these holds memory and no core (``parking``: its engine is pausing)."""
RESIDENT_STATES = (*PARKED_STATES, "waking")
"""A model in one of these keeps its worker without serving: a wake, not a load, brings
it back (and a stop need not cancel a load to end that wake)."""


def parked(models: Iterable[ModelEntry]) -> list[ModelEntry]:
    """The models of ``models`` that are parked or parking."""
    return [e for e in models if e.state in PARKED_STATES]


def expected_bytes(entry: ModelEntry) -> int:
    """What ``entry``'s worker is expected to hold once it runs: as measured last time,
    else its weights on disk (``weights_bytes``), its KV cache and ``UNKNOWN_NEED_GIB``;
    never less than its weights. Nothing for a model already resident."""
    if entry.state in (*RESIDENT_STATES, "ready"):
        return 0
    if entry.resident_bytes:
        return max(entry.resident_bytes, entry.weights_bytes)
    return entry.weights_bytes + int((entry.spec.kv_cache_gib + UNKNOWN_NEED_GIB) * GIB)


def host_held(entry: ModelEntry) -> int:
    """What ``entry``'s parked worker holds in host memory: its resident set as measured,
    and, asleep at level 1, its weights' pinned copy (counted apart: it was measured
    running, before the copy was made)."""
    pinned = pinned_bytes(entry.weights_bytes) if entry.parked_level == 1 else 0
    return entry.resident_bytes + pinned


def freezes(spec: ModelSpec) -> bool:
    """Whether its worker's processes can be stopped (``WorkerHandle.freeze``): those
    started on this host. A Ray worker's cannot (its actor and its link's heartbeats
    must go on), nor can this host measure what it holds: parked there, it would be an
    engine paused alone, still polling on its cores, its memory counted as nothing
    against ``park_memory_gib``. A CPU model there stops instead, as before parking (a GPU
    model's park is vLLM's sleep, which needs neither)."""
    return spec.backend in (None, "local")


def sleeps(spec: ModelSpec) -> bool:
    """A GPU model whose engine started with vLLM's sleep mode (``shared.config.sleep_mode``,
    the rule ``worker.engine_args`` starts it by; workers inherit this process's
    environment)."""
    return sleep_mode(spec, os.environ)


def park_level(victim: ModelEntry, need: ModelEntry, models: Iterable[ModelEntry],
               server: ServerConfig, memory: HostMemory | None, *,
               gpus: dict[int, GpuMemory] | None = None,
               held: dict[str, dict[str, float]] | None = None,
               gpus_now: dict[int, GpuMemory] | None = None) -> int | None:
    """How ``victim``, making room for ``need``, parks (module docstring): 0 its engine
    paused and its processes stopped (a CPU model), 1 or 2 vLLM's sleep mode at that
    level (a GPU model); ``None``: it stops instead.

    ``models`` are the others that run or are parked; ``memory`` this host's (needed only
    without ``park_memory_gib``; ``None``: not read, and nothing parks on its account).
    For a GPU victim, ``gpus`` are the GPUs' totals (the footprints), ``held`` what
    sleeping and parked models hold on them, ``gpus_now`` NVML's reading now (free
    memory; ``None``: the budgets alone decide)."""
    if server.max_parked_models <= 0 or victim.removed or victim.spec.replicas.max > 1:
        return None  # a model of several replicas stops: one park would hold them all
    models = list(models)
    others = [e for e in parked(models) if e is not victim]
    if len(others) >= server.max_parked_models:
        return None
    ceiling = (int(server.park_memory_gib * GIB) if server.park_memory_gib is not None
               else None)
    held_host = sum(host_held(e) for e in others) + victim.resident_bytes
    if victim.spec.device != "cuda":
        if not freezes(victim.spec):
            return None  # a pause alone holds its cores, and its memory unmeasured
        if ceiling is not None:
            return 0 if held_host <= ceiling else None
        if memory is None:
            return None
        return 0 if memory.available - expected_bytes(need) >= PARK_MARGIN * memory.total \
            else None
    if not sleeps(victim.spec):
        return None
    gpus = gpus or {}
    asleep = {k: ASLEEP_GIB for k in devices(victim.spec)}  # until NVML sees it asleep
    # The GPUs: its footprint gives way to what it holds asleep, in the budgets and in
    # what NVML says is free; where the model that needs room still does not fit, its
    # park would free too little and it stops.
    resident = [e.spec for e in models if e is not need]
    if not within_budgets(need.spec, resident, server, gpus,
                          {**(held or {}), victim.spec.id: asleep}):
        return None
    if gpus_now and not gpu_room_after_sleep(footprint(need.spec, gpus), free_gib(gpus_now),
                                             footprint(victim.spec, gpus), asleep):
        return None
    if not freezes(victim.spec):
        # On another node (Ray): level 1 would pin the weights in that node's memory,
        # which this host neither reads nor counts; level 2 holds none of it.
        return 2 if reloads_weights(victim.spec) else None
    need_host = (need.resident_bytes or int(UNKNOWN_NEED_GIB * GIB)
                 if need.spec.device == "cuda" else expected_bytes(need))
    level = sleep_level(victim.weights_bytes, need_bytes=need_host, host=memory,
                        ceiling=ceiling, held=held_host)
    return None if level == 2 and not reloads_weights(victim.spec) else level


NO_RELOAD_FORMATS = frozenset({"tensorizer", "sharded_state", "dummy",
                               "runai_streamer_sharded"})
"""vLLM 0.32's load formats whose loader cannot read the weights again in place
(``reload_weights`` raises ``NotImplementedError``: no ``get_all_weights``)."""


def reloads_weights(spec: ModelSpec) -> bool:
    """Whether a level-2 wake can read ``spec``'s weights again (``worker.engine``'s
    ``reload_weights``): not with a load format vLLM cannot reload in place, nor with a
    speculative draft model (only the target's weights are read again: the draft's
    would wake uninitialised). Such a model parks at level 1 or stops."""
    args = spec.engine_args
    return (str(args.get("load_format", "auto")) not in NO_RELOAD_FORMATS
            and not args.get("speculative_config"))


def free_gib(gpus_now: dict[int, GpuMemory]) -> dict[str, float]:
    """NVML's free memory now, in GiB, by device key (``cuda:N``, as footprints are)."""
    return {f"cuda:{i}": g.free_bytes / GIB for i, g in gpus_now.items()}


def may_park(victim: ModelEntry, need: ModelEntry, models: Iterable[ModelEntry],
             server: ServerConfig, memory: HostMemory | None) -> bool:
    """Whether ``victim``, making room for ``need``, parks instead of stopping
    (``park_level`` with no GPU readings)."""
    return park_level(victim, need, models, server, memory) is not None


def turn_over(entry: ModelEntry, now: float, server: ServerConfig) -> bool:
    """``entry`` has run ``park_quantum`` seconds since it last began to (``turn_at``):
    another model waiting for its cores may have them."""
    return now - entry.turn_at >= server.park_quantum


def stoppable(entry: ModelEntry) -> bool:
    """A parked model with nothing in flight and no request waiting: stopping it loses
    no one's work (memory pressure stops these first)."""
    return (entry.state == "parked" and entry.leases == 0 and entry.queued == 0
            and not entry.busy)
