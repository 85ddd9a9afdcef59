"""Where a worker runs and whether it fits: CPU core sets, GPUs, memory budgets.

Pure bookkeeping (no processes): ``Placer.place`` picks cores for a CPU model and returns
the variables vLLM reads; ``release`` frees them when the worker stops. ``replica_spec``
gives each replica of a model its own share of the model's cores or GPUs. ``footprint`` and
``fits`` decide whether one more model may load; GPU memory comes from NVML when the
``nvidia-ml-py`` package and a driver are present (``read_gpus``, re-exported from
``router.workers.nvml``), else from nothing.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable

import msgspec

from router.workers.nvml import (
    ASLEEP_GIB,
    GIB,
    GpuMemory,
    nvml_process_memory,
    read_gpus,
)
from shared.config import ConfigError, ModelSpec, ServerConfig, format_cores, parse_cores

__all__ = ["ASLEEP_GIB", "GIB", "GpuMemory", "Placer", "check_budgets", "devices", "fits",
           "footprint", "nvml_process_memory", "read_gpus", "replica_spec", "runs_beside",
           "shares", "within_budgets"]


def devices(spec: ModelSpec) -> list[str]:
    """The device keys a model occupies: ``cpu`` or ``cuda:N`` for each of its GPUs."""
    if spec.device == "cpu":
        return ["cpu"]
    return [f"cuda:{g}" for g in (spec.gpus or [0])]


def footprint(spec: ModelSpec, gpus: dict[int, GpuMemory]) -> dict[str, float]:
    """GiB the model holds on each of its devices (what the memory budget counts)."""
    keys = devices(spec)
    if spec.memory_gib is not None:
        return {k: spec.memory_gib / len(keys) for k in keys}
    if spec.device == "cpu":
        return {"cpu": spec.kv_cache_gib + 1.0}  # KV cache plus a small model's weights
    out = {}
    for k in keys:
        gpu = gpus.get(int(k.split(":")[1]))
        fraction = spec.gpu_memory_utilization or 0.9
        out[k] = fraction * gpu.total_bytes / GIB if gpu else 0.0
    return out


def fits(spec: ModelSpec, loaded: Iterable[ModelSpec], server: ServerConfig,
         gpus: dict[int, GpuMemory], held: dict[str, dict[str, float]] | None = None,
         parked: Iterable[ModelSpec] = ()) -> bool:
    """May ``spec`` start while ``loaded`` run? (``max_loaded_models`` and budgets.)
    ``held`` replaces the footprint of some of them (sleeping models: what they still
    hold). ``parked`` models hold their memory but run nothing: they count against the
    budgets, not ``max_loaded_models``."""
    return runs_beside(spec, loaded, server) and within_budgets(
        spec, [*loaded, *parked], server, gpus, held)


def runs_beside(spec: ModelSpec, loaded: Iterable[ModelSpec], server: ServerConfig) -> bool:
    """``max_loaded_models`` lets ``spec`` run beside ``loaded``."""
    others = [m for m in loaded if m.id != spec.id]
    return not server.max_loaded_models or len(others) < server.max_loaded_models


def within_budgets(spec: ModelSpec, resident: Iterable[ModelSpec], server: ServerConfig,
                   gpus: dict[int, GpuMemory],
                   held: dict[str, dict[str, float]] | None = None) -> bool:
    """``spec``'s footprint fits ``memory_budget_gib`` beside the ``resident`` models'
    (``held``: what some of them still hold instead)."""
    resident = [m for m in resident if m.id != spec.id]
    need = footprint(spec, gpus)
    held = held or {}
    for key, gib in need.items():
        budget = server.memory_budget_gib.get(key)
        if budget is None:
            continue
        used = sum(held.get(m.id, footprint(m, gpus)).get(key, 0.0) for m in resident)
        if used + gib > budget + 1e-9:
            return False
    return True


def check_budgets(models: Iterable[ModelSpec], server: ServerConfig,
                  gpus: dict[int, GpuMemory]) -> None:
    """Refuse a model that could never load: larger than its device's whole budget (it
    would wait for room forever)."""
    for spec in models:
        for key, gib in footprint(spec, gpus).items():
            budget = server.memory_budget_gib.get(key)
            if budget is not None and gib > budget + 1e-9:
                raise ConfigError(f"model '{spec.id}': needs {gib:g} GiB on {key}, more than "
                                  f"its whole memory_budget_gib of {budget:g}")


def shares(items: list[int], count: int) -> list[list[int]]:
    """``items`` cut into ``count`` contiguous slices, as even as may be, the first ones
    longer by one where they do not divide (``[0..4]`` over 2: ``[0, 1, 2]``, ``[3, 4]``).
    Contiguous, so a replica's cores are neighbours (one cache, one NUMA node)."""
    if count < 1 or len(items) < count:
        raise ValueError(f"{len(items)} cannot be shared by {count}")
    size, extra = divmod(len(items), count)
    out: list[list[int]] = []
    start = 0
    for n in range(count):
        end = start + size + (n < extra)
        out.append(items[start:end])
        start = end
    return out


def replica_spec(spec: ModelSpec, n: int, count: int,
                 host_cores: set[int] | None = None) -> ModelSpec:
    """Replica ``n`` (from 0) of ``count``'s own spec: its disjoint share of the model's
    ``cpu_cores`` (``"0-3"`` over 2: ``"0-1"``, ``"2-3"``), or of ``host_cores`` where the
    model names none (the ``Placer``'s cores: else the first replica would take every free
    core), and its share of ``gpus`` (the same number each). Siblings never share a core
    or a GPU; one replica is ``spec`` itself, so a model of one replica runs as before.
    On Ray, GPUs (and cores the preset does not name) are Ray's to hand out per actor.

    ``count`` is the model's ``replicas.max``, not how many run: a replica added later
    then never needs a core a running sibling holds (cores are bound when a worker starts).
    A share that cannot be cut (fewer cores or GPUs than replicas, GPUs that do not divide)
    is a ``ConfigError`` naming the model and key; the preset's load refuses it first."""
    if not 0 <= n < count:
        raise ValueError(f"replica {n} of {count}")
    if count == 1:
        return spec
    where = f"model '{spec.id}'"
    ray = spec.backend == "ray"
    if spec.device == "cuda":
        if ray:  # Ray hands each actor its own GPUs (``num_gpus``): nothing to cut here
            return spec
        gpus = spec.gpus or [0]
        if len(gpus) < count or len(gpus) % count:
            raise ConfigError(f"{where}: key 'gpus': {len(gpus)} GPUs cannot be shared "
                              f"equally by {count} replicas")
        share = shares(gpus, count)[n]
        if len(share) < spec.tensor_parallel_size:
            raise ConfigError(f"{where}: key 'gpus': {len(share)} GPUs per replica, fewer "
                              f"than tensor_parallel_size ({spec.tensor_parallel_size})")
        return msgspec.structs.replace(spec, gpus=share)
    if ray and not spec.cpu_cores:  # Ray pins no cores it was not told of (``num_cpus``)
        return spec
    named = parse_cores(spec.cpu_cores) if spec.cpu_cores else host_cores
    if not named:  # nothing to cut: siblings would be placed on the same cores
        raise ConfigError(f"{where}: key 'cpu_cores': {count} replicas need cores to share "
                          "and none are known")
    if len(named) < count:
        raise ConfigError(f"{where}: key 'cpu_cores': {len(named)} cores "
                          f"(\"{format_cores(named)}\") cannot give {count} replicas one each")
    return msgspec.structs.replace(
        spec, cpu_cores=format_cores(set(shares(sorted(named), count)[n])))


class Placer:
    """Hands out CPU core sets so that concurrently running workers do not overlap.

    A model with ``cpu_cores`` gets exactly those. Otherwise it gets every core no
    running worker holds; when none is free, the least-shared single core.
    """

    def __init__(self, cores: set[int] | None = None,
                 gpus: dict[int, GpuMemory] | None = None,
                 process_memory: Callable[[set[int]], dict[int, float]] = nvml_process_memory,
                 nvml: Callable[[], dict[int, GpuMemory]] = read_gpus) -> None:
        self.cores = cores if cores is not None else set(os.sched_getaffinity(0))
        self.gpus = gpus if gpus is not None else nvml()
        """The GPUs as read at start-up: their totals (``footprint``)."""
        self.process_memory = process_memory
        self.read_gpus = nvml
        """NVML's reading now (free memory changes as workers come and go): blocking, call
        it in a thread."""
        self._held: dict[str, set[int]] = {}
        self._gpu_locks: dict[int, asyncio.Lock] = {}

    def start_locks(self, spec: ModelSpec) -> list[asyncio.Lock]:
        """Locks to hold while ``spec`` starts: vLLM measures free GPU memory at start, so
        workers that share a GPU must start one at a time (sorted: no lock-order cycles)."""
        if spec.device != "cuda":
            return []
        return [self._gpu_locks.setdefault(g, asyncio.Lock()) for g in sorted(spec.gpus or [0])]

    def place(self, spec: ModelSpec, key: str | None = None) -> dict[str, str]:
        """The environment variables that put ``spec``'s worker where it belongs (held
        under ``key``, the replica's: ``replica.replica_key``; default the model's id).

        Only placement: a model's ``env`` (tokens, credentials) is added by the supervisor
        and never shown, since this is what ``/v1/models`` and the logs show.
        """
        env: dict[str, str] = {}
        if spec.device == "cuda":
            # GPU numbers are NVML's (``read_gpus``, ``nvml_process_memory``), which go by
            # PCI bus; CUDA numbers the fastest first unless told otherwise, so on a
            # machine of mixed GPUs "1" would be another card.
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in (spec.gpus or [0]))
            return env
        if spec.cpu_cores:
            chosen = parse_cores(spec.cpu_cores)
        else:
            used = [c for held in self._held.values() for c in held]
            free = self.cores - set(used)
            chosen = free or {min(self.cores, key=used.count)}
        self._held[key or spec.id] = chosen
        env["VLLM_CPU_OMP_THREADS_BIND"] = format_cores(chosen)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.kv_cache_gib)
        return env

    def gpu_memory_utilization(self, spec: ModelSpec) -> float | None:
        """The fraction vLLM should take on each GPU: as configured, or ``memory_gib``
        over the smallest GPU's total when NVML knows it."""
        if spec.device != "cuda" or spec.gpu_memory_utilization is not None:
            return spec.gpu_memory_utilization
        if spec.memory_gib is None:
            return None
        totals = [self.gpus[g].total_bytes for g in (spec.gpus or [0]) if g in self.gpus]
        if not totals:
            return None
        per_gpu = spec.memory_gib / len(spec.gpus or [0])
        return round(min(0.95, per_gpu * GIB / min(totals)), 4)

    def held_asleep(self, spec: ModelSpec, pids: set[int]) -> dict[str, float]:
        """GiB a sleeping model still holds on each of its GPUs: what NVML says its
        processes use there, else ``ASLEEP_GIB``."""
        measured = self.process_memory(pids) if pids else {}
        return {key: measured.get(int(key.split(":")[1]), ASLEEP_GIB)
                for key in devices(spec) if key.startswith("cuda:")}

    def release(self, key: str) -> None:
        """The worker placed under ``key`` is gone: its cores are free."""
        self._held.pop(key, None)
