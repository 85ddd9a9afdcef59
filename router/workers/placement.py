"""Where a worker runs and whether it fits: CPU core sets, GPUs, memory budgets.

Pure bookkeeping (no processes): ``Placer.place`` picks cores for a CPU model and returns
the variables vLLM reads; ``release`` frees them when the worker stops. ``footprint`` and
``fits`` decide whether one more model may load; GPU memory comes from NVML when the
``nvidia-ml-py`` package and a driver are present (``read_gpus``, re-exported from
``router.workers.nvml``), else from nothing.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable

from router.workers.nvml import (
    ASLEEP_GIB,
    GIB,
    GpuMemory,
    nvml_process_memory,
    read_gpus,
)
from shared.config import ConfigError, ModelSpec, ServerConfig, format_cores, parse_cores

__all__ = ["ASLEEP_GIB", "GIB", "GpuMemory", "Placer", "check_budgets", "devices", "fits",
           "footprint", "nvml_process_memory", "read_gpus", "runs_beside", "within_budgets"]


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

    def place(self, spec: ModelSpec) -> dict[str, str]:
        """The environment variables that put ``spec``'s worker where it belongs.

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
        self._held[spec.id] = chosen
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

    def release(self, model_id: str) -> None:
        self._held.pop(model_id, None)
