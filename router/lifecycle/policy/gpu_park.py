"""At which level of vLLM's sleep mode a GPU model parks (plain functions over numbers;
``policy.park.park_level`` feeds them the entries' figures).

A GPU model that makes room parks through vLLM's sleep mode instead of stopping: its
KV cache is dropped and its weights leave the GPU, to pinned host memory (level 1: a
wake copies them back, ~0.3 s for 0.6B and ~2 s for 8B published) or nowhere (level 2: a
wake reads them from disk again). Either way the GPU keeps only the CUDA context and
vLLM's buffers (``ASLEEP_GIB`` per GPU until NVML measured it asleep), so the model
that needs room gets the rest. Level 1 is taken where host RAM holds the weights'
pinned copy with a margin (``sleep_level``), level 2 otherwise; where the GPU would
still not hold the model that needs room (``gpu_room_after_sleep``), it stops.

Imports nothing of ``msgspec`` (nor anything that does): ``bench/gpu_park_probe.py`` runs
these on a GPU machine's real NVML and ``psutil`` readings without the router's wheels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PARK_MARGIN = 0.2
"""Of this host's memory, what must stay available once a model parks and the model it
makes room for has started (when ``park_memory_gib`` is unset)."""
PINNED_ROUNDING = 2.0
"""What a level-1 sleep's copy of the weights may take in host RAM, per byte of
weights: torch's pinned (page-locked) host allocator rounds each block up to a power of
two (1.78x seen, ``VLLM_NOTES``), so up to twice their size. The bound is counted, not
the typical figure: pinned memory cannot be swapped out, and a host short of it kills
processes rather than slowing down."""


@dataclass(frozen=True, slots=True)
class HostMemory:
    """This host's memory in bytes, as ``psutil.virtual_memory`` read it."""

    total: int
    available: int


def pinned_bytes(weights_bytes: int) -> int:
    """Host RAM a level-1 sleep may pin for ``weights_bytes`` of weights."""
    return int(weights_bytes * PINNED_ROUNDING)


def sleep_level(weights_bytes: int, *, need_bytes: int, host: HostMemory | None,
                ceiling: int | None = None, held: int = 0,
                margin: float = PARK_MARGIN) -> int | None:
    """The level a GPU model whose weights take ``weights_bytes`` parks at, as host
    memory allows: 1 where their pinned copy (``pinned_bytes``) fits, 2 where it does
    not or their size is unknown (0: a hub id, not a folder here), ``None`` where even
    level 2 does not (it stops).

    ``ceiling`` (``park_memory_gib``, in bytes) bounds what parked models hold in host
    RAM in all, ``held`` counting the others' and this one's resident set already; unset,
    ``host``'s available memory less ``need_bytes`` (what the model that needs room is
    expected to take of it) and the pinned copy must stay above ``margin`` of its total
    (``host`` ``None``: not read, and nothing parks on its account)."""
    pinned = pinned_bytes(weights_bytes)
    if ceiling is not None:
        if held > ceiling:
            return None
        return 1 if weights_bytes and held + pinned <= ceiling else 2
    if host is None:
        return None
    left = host.available - need_bytes
    if left < margin * host.total:
        return None
    return 1 if weights_bytes and left - pinned >= margin * host.total else 2


def gpu_room_after_sleep(need_gib: Mapping[str, float], free_gib: Mapping[str, float],
                         now_gib: Mapping[str, float], asleep_gib: Mapping[str, float]
                         ) -> bool:
    """Whether the model that needs room gets, on each of its GPUs (``cuda:N`` keys),
    the ``need_gib`` vLLM will ask of it at start (it refuses to start with less free):
    what NVML says is free now (``free_gib``) plus what the sleeping model gives back
    there (what it holds now, ``now_gib``, less what it holds asleep, ``asleep_gib``).
    A GPU with no NVML reading is left to the memory budgets."""
    for key, gib in need_gib.items():
        if key not in free_gib:
            continue
        back = max(0.0, now_gib.get(key, 0.0) - asleep_gib.get(key, 0.0))
        if free_gib[key] + back + 1e-9 < gib:
            return False
    return True
