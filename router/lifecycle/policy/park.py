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
(``room.decide``). Models on a GPU are not parked yet (their memory is the GPU's), nor
those whose processes cannot be stopped (``freezes``: a Ray worker's).

Two models with work take turns of ``park_quantum`` seconds (``turn_over``): the running
one is parked between two engine steps, its streams pause and go on at its next turn.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from router.registry import ModelEntry
from shared.config import ModelSpec, ServerConfig

GIB = 1024 ** 3
PARK_MARGIN = 0.2
"""Of this host's memory, what must stay available once a model parks and the model it
makes room for has started (when ``park_memory_gib`` is unset)."""
UNKNOWN_NEED_GIB = 2.0
"""Memory a model never measured is expected to take beyond its KV cache."""
PARKED_STATES = ("parking", "parked")
"""A model in one of these holds memory and no core (``parking``: its engine is pausing)."""
RESIDENT_STATES = (*PARKED_STATES, "waking")
"""A model in one of these keeps its worker without serving: a wake, not a load, brings
it back (and a stop need not cancel a load to end that wake)."""


@dataclass(frozen=True, slots=True)
class HostMemory:
    """This host's memory in bytes, as ``psutil.virtual_memory`` read it."""

    total: int
    available: int


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


def freezes(spec: ModelSpec) -> bool:
    """Whether its worker's processes can be stopped (``WorkerHandle.freeze``): those
    started on this host. A Ray worker's cannot (its actor and its link's heartbeats
    must go on), nor can this host measure what it holds: parked there, it would be an
    engine paused alone, still polling on its cores, its memory counted as nothing
    against ``park_memory_gib``. It stops instead, as before parking."""
    return spec.backend in (None, "local")


def may_park(victim: ModelEntry, need: ModelEntry, models: Iterable[ModelEntry],
             server: ServerConfig, memory: HostMemory | None) -> bool:
    """Whether ``victim``, making room for ``need``, parks instead of stopping (module
    docstring). ``memory`` is needed only without ``park_memory_gib``; ``None``: not
    read, and nothing parks on its account."""
    if server.max_parked_models <= 0 or victim.spec.device == "cuda" or victim.removed:
        return False
    if not freezes(victim.spec):  # a CPU model (a GPU one's park would be vLLM's sleep)
        return False  # a pause alone holds its cores, and its memory unmeasured
    others = [e for e in parked(models) if e is not victim]
    if len(others) >= server.max_parked_models:
        return False
    if server.park_memory_gib is not None:
        held = sum(e.resident_bytes for e in others) + victim.resident_bytes
        return held <= server.park_memory_gib * GIB
    if memory is None:
        return False
    return memory.available - expected_bytes(need) >= PARK_MARGIN * memory.total


def turn_over(entry: ModelEntry, now: float, server: ServerConfig) -> bool:
    """``entry`` has run ``park_quantum`` seconds since it last began to (``turn_at``):
    another model waiting for its cores may have them."""
    return now - entry.turn_at >= server.park_quantum


def stoppable(entry: ModelEntry) -> bool:
    """A parked model with nothing in flight and no request waiting: stopping it loses
    no one's work (memory pressure stops these first)."""
    return (entry.state == "parked" and entry.leases == 0 and entry.queued == 0
            and not (entry.link is not None and entry.link.busy))
