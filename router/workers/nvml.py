"""NVML's readings of the GPUs (``nvidia-ml-py``): each GPU's memory and what given
processes hold on each. Empty where there is no ``pynvml`` or no driver.

Imports nothing of the project's nor of ``msgspec``: ``bench/gpu_park_probe.py`` reads
the GPUs through this same code on a machine that carries torch and ``pynvml`` only.
``router.workers.placement`` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024 ** 3
ASLEEP_GIB = 1.0
"""GPU memory a model asleep (vLLM's sleep mode, either level) is taken to hold per GPU
(the CUDA context and vLLM's buffers; its weights went to host memory or were dropped,
its KV cache was freed) when NVML cannot say what its processes use."""


@dataclass(frozen=True)
class GpuMemory:
    index: int
    total_bytes: int
    free_bytes: int


def read_gpus() -> dict[int, GpuMemory]:
    """Every GPU's memory as NVML reports it; empty without NVML or a driver."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001  # NVMLError: no driver / no GPU here, so there is nothing to place on
        return {}
    try:
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i))
            out[i] = GpuMemory(i, int(mem.total), int(mem.free))
        return out
    finally:
        pynvml.nvmlShutdown()


def nvml_process_memory(pids: set[int]) -> dict[int, float]:
    """GiB of each GPU that the processes ``pids`` use, as NVML reports it; empty without
    NVML or a driver."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001  # NVMLError: no driver / no GPU
        return {}
    try:
        out: dict[int, float] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in pids and proc.usedGpuMemory:
                    out[i] = out.get(i, 0.0) + proc.usedGpuMemory / GIB
        return out
    finally:
        pynvml.nvmlShutdown()
