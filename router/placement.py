"""Where a worker runs: its CPU cores or GPUs, expressed as the environment it starts with.

Pure bookkeeping (no processes): ``Placer.place`` picks cores for a CPU model and returns
the variables vLLM reads; ``release`` frees them when the worker stops.
"""

from __future__ import annotations

import os

from shared.config import ModelSpec


def parse_cores(text: str) -> set[int]:
    """``"0-3,6"`` → ``{0, 1, 2, 3, 6}``."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def format_cores(cores: set[int]) -> str:
    """``{0, 1, 2, 6}`` → ``"0-2,6"`` (the form ``VLLM_CPU_OMP_THREADS_BIND`` takes)."""
    runs: list[str] = []
    ordered = sorted(cores)
    start = prev = ordered[0]
    for c in ordered[1:] + [None]:  # type: ignore[list-item]
        if c is not None and c == prev + 1:
            prev = c
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(runs)


class Placer:
    """Hands out CPU core sets so that concurrently running workers do not overlap.

    A model with ``cpu_cores`` gets exactly those. Otherwise it gets every core no
    running worker holds; when none is free, the least-shared single core.
    """

    def __init__(self, cores: set[int] | None = None) -> None:
        self.cores = cores if cores is not None else set(os.sched_getaffinity(0))
        self._held: dict[str, set[int]] = {}

    def place(self, spec: ModelSpec) -> dict[str, str]:
        """The environment variables that put ``spec``'s worker where it belongs."""
        env = {k: str(v) for k, v in spec.env.items()}
        if spec.device == "cuda":
            if spec.gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
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

    def release(self, model_id: str) -> None:
        self._held.pop(model_id, None)
