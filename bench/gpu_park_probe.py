"""``python -m bench.gpu_park_probe``: what a GPU park costs on this machine (issue 37), for
when a GPU is lent. Needs torch with CUDA, ``nvidia-ml-py`` (``pynvml``), ``psutil``,
``safetensors``; not vLLM, ``msgspec`` or ``starlette`` (it imports nothing of the router
but ``router.workers.nvml`` and ``router.lifecycle.policy.gpu_park``, which import none).

1. The GPUs as our code reads them (``read_gpus``, ``nvml_process_memory``), and whether
   CUDA's device 0 is NVML's device 0 under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (what
   ``Placer.place`` sets): name and PCI bus of each.
2. Our level choice (``gpu_park.sleep_level``) on this host's memory (``psutil``) for
   models of 135M, 0.6B and 8B parameters in bf16, as ``policy.park.park_level`` calls
   it for a GPU model making room for another (which is expected to take
   ``UNKNOWN_NEED_GIB`` of host memory), and what that level would pin.
3. A park and wake of each with torch alone, shaped like the model's layers (random
   bf16): level 1 as vLLM's ``CuMemAllocator`` does it (each GPU tensor copied to a
   pinned host tensor, the GPU memory freed; the wake copies back), level 2 (the GPU
   memory freed; the wake reads a safetensors file, dropped from the page cache first,
   onto the GPU). Seconds (median of ``REPS``, each level-1 park with the pinned cache
   emptied first: a first park's cost; then one park with the cache kept, as a worker's
   later parks are) and GB/s, NVML's view of this process after the
   park, its resident set, and the pinned allocator's bytes against the weights' (the
   power-of-two rounding ``gpu_park.PINNED_ROUNDING`` bounds).

Prints one JSON object and writes it to ``$OUT/gpu_park.json`` where ``OUT`` is set.
Without CUDA it says so and exits 2. Sized to end within 3 minutes on an H100 (the 8B
level-2 file is ~16 GB of disk writes and reads; ``GPU_PARK_SIZES=135m,0.6b`` skips it).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.lifecycle.policy import gpu_park
from router.workers import nvml

REPS = 3
UNKNOWN_NEED_GIB = 2.0
"""What ``policy.park.park_level`` expects a GPU model that needs room to take of host
memory when it was never measured (``policy.park.UNKNOWN_NEED_GIB``, not imported:
``policy.park`` imports ``msgspec``)."""
BUDGET_S = 150.0
"""Seconds after which no further repetition starts (the probe must end within 3 min)."""


@dataclass(frozen=True)
class Shape:
    """A decoder's layer shapes (its ``config.json``'s figures)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    def tensors(self) -> list[tuple[int, ...]]:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = [(q, self.hidden), (kv, self.hidden), (kv, self.hidden), (self.hidden, q),
                 (self.intermediate, self.hidden), (self.intermediate, self.hidden),
                 (self.hidden, self.intermediate), (self.hidden,), (self.hidden,)]
        head = [] if self.tied else [(self.vocab, self.hidden)]
        return [(self.vocab, self.hidden), *layer * self.layers, (self.hidden,), *head]

    def params(self) -> int:
        total = 0
        for shape in self.tensors():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


SHAPES = {  # SmolLM2-135M, Qwen3-0.6B, Qwen3-8B
    "135m": Shape("135M", 576, 1536, 30, 49152, 9, 3, 64, True),
    "0.6b": Shape("0.6B", 1024, 3072, 28, 151936, 16, 8, 128, True),
    "8b": Shape("8B", 4096, 12288, 36, 151936, 32, 8, 128, False),
}


def no_cuda(why: str) -> int:
    print(f"gpu_park_probe: no CUDA ({why}); run it where a GPU is lent", file=sys.stderr)
    return 2


def gpus_agree(torch: Any) -> dict[str, Any]:
    """CUDA's numbering against NVML's, device by device: name and PCI bus."""
    import pynvml

    pynvml.nvmlInit()
    try:
        out = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            pci = pynvml.nvmlDeviceGetPciInfo(handle)
            cuda_bus = (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
            nvml_bus = (int(pci.domain), int(pci.bus), int(pci.device))
            out.append({"index": i, "cuda_name": props.name, "nvml_name": name,
                        "cuda_pci": list(cuda_bus), "nvml_pci": list(nvml_bus),
                        "agree": cuda_bus == nvml_bus and props.name == name})
        return {"CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER"), "devices": out,
                "all_agree": all(d["agree"] for d in out)}
    finally:
        pynvml.nvmlShutdown()


def empty_pinned_cache(torch: Any) -> bool:
    """Return the pinned host allocator's cached blocks to CUDA (its name varies)."""
    for owner, name in ((torch._C, "_host_emptyCache"), (torch._C, "_accelerator_emptyHostCache"),
                        (torch.cuda, "empty_host_cache")):
        fn = getattr(owner, name, None)
        if fn is not None:
            fn()
            return True
    return False


def pinned_bytes_now(torch: Any) -> int | None:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    value = stats().get("allocated_bytes.current")
    return int(value) if value is not None else None


def timed(torch: Any, fn: Callable[[], Any]) -> tuple[float, Any]:
    torch.cuda.synchronize()
    began = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - began, out


def offload(torch: Any, gpu: list[Any]) -> list[Any]:
    """A level-1 park as vLLM's ``CuMemAllocator.sleep`` makes it: each GPU tensor
    copied to a pinned host tensor of its size, then the GPU memory freed (``gpu`` is
    emptied: it held the only references)."""
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in gpu]
    for h, t in zip(host, gpu, strict=True):
        h.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    gpu.clear()
    torch.cuda.empty_cache()
    return host


def rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def probe_size(torch: Any, shape: Shape, folder: Path, deadline: float) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    pid = os.getpid()
    shapes = shape.tensors()
    nbytes = shape.params() * 2
    gb = nbytes / 1e9

    def make() -> list[Any]:
        return [torch.empty(s, dtype=torch.bfloat16, device="cuda").normal_() for s in shapes]

    weights = make()
    torch.cuda.synchronize()
    held_awake = nvml.nvml_process_memory({pid}).get(0)  # None: NVML does not see our pid
    l1_sleep, l1_wake, l1_after, rounding, rss_asleep = [], [], [], [], []
    for rep in range(REPS):
        if rep and time.monotonic() > deadline:
            break
        empty_pinned_cache(torch)  # a first park's cost: pinning is part of it
        before = pinned_bytes_now(torch)

        seconds, host = timed(torch, functools.partial(offload, torch, weights))
        l1_sleep.append(seconds)
        after = pinned_bytes_now(torch)
        if after is not None and before is not None:
            rounding.append(round((after - before) / nbytes, 3))
        l1_after.append(nvml.nvml_process_memory({pid}).get(0, 0.0))
        rss_asleep.append(rss())

        def wake1(cpu: list[Any] = host) -> list[Any]:
            return [h.to("cuda", non_blocking=True) for h in cpu]

        seconds, weights = timed(torch, wake1)
        l1_wake.append(seconds)
        host.clear()  # back to the pinned cache (vLLM drops its backup after a wake)
    # A later park of the same worker: torch keeps the pinned blocks the last wake gave
    # back (vLLM drops its backup tensors after a wake), so no page is pinned anew.
    warm = None
    if time.monotonic() < deadline:
        warm, host = timed(torch, functools.partial(offload, torch, weights))
        weights = [h.to("cuda", non_blocking=True) for h in host]
        torch.cuda.synchronize()
        host.clear()
    # level 2: the weights dropped; a wake reads them from disk
    path = folder / f"{shape.name}.safetensors"
    began = time.perf_counter()
    save_file({f"w{i}": t.cpu() for i, t in enumerate(weights)}, str(path))
    save_s = time.perf_counter() - began
    l2_sleep, l2_wake, l2_after = [], [], []
    for rep in range(REPS):
        if rep and time.monotonic() > deadline:
            break

        def sleep2(gpu: list[Any] = weights) -> None:
            gpu.clear()
            torch.cuda.empty_cache()

        seconds, _ = timed(torch, sleep2)
        l2_sleep.append(seconds)
        l2_after.append(nvml.nvml_process_memory({pid}).get(0, 0.0))
        with open(path, "rb") as f:  # cold: as a wake long after the load reads it
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        seconds, loaded = timed(torch, lambda: load_file(str(path), device="cuda:0"))
        weights = list(loaded.values())
        del loaded  # the list alone holds them: the next park must free them all
        l2_wake.append(seconds)
    path.unlink()
    weights.clear()
    torch.cuda.empty_cache()
    empty_pinned_cache(torch)

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 4) if xs else float("nan")

    return {
        "params": shape.params(), "weights_gb": round(gb, 3),
        "nvml_gib_awake": None if held_awake is None else round(held_awake, 3),
        "nvml_sees_this_pid": held_awake is not None,
        "level1": {"park_s": med(l1_sleep), "wake_s": med(l1_wake),
                   "park_gb_per_s": round(gb / med(l1_sleep), 2),
                   "wake_gb_per_s": round(gb / med(l1_wake), 2),
                   "runs_park_s": [round(x, 4) for x in l1_sleep],
                   "park_warm_s": None if warm is None else round(warm, 4),
                   "runs_wake_s": [round(x, 4) for x in l1_wake],
                   "nvml_gib_asleep": round(max(l1_after), 3) if l1_after else None,
                   "rss_gib_asleep": round(max(rss_asleep) / nvml.GIB, 3) if rss_asleep else None,
                   "pinned_over_weights": rounding},
        "level2": {"park_s": med(l2_sleep), "wake_s": med(l2_wake),
                   "wake_gb_per_s": round(gb / med(l2_wake), 2),
                   "runs_wake_s": [round(x, 4) for x in l2_wake],
                   "save_s": round(save_s, 2),
                   "nvml_gib_asleep": round(max(l2_after), 3) if l2_after else None},
    }


def main() -> int:
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # as ``Placer.place`` sets it
    try:
        import torch
    except ImportError:
        return no_cuda("no torch")
    if not torch.cuda.is_available():
        return no_cuda("torch.cuda.is_available() is False")
    gpus = nvml.read_gpus()
    if not gpus:
        return no_cuda("NVML found no GPU (no pynvml or no driver)")
    import psutil

    began = time.monotonic()
    deadline = began + BUDGET_S
    vm = psutil.virtual_memory()
    host = gpu_park.HostMemory(int(vm.total), int(vm.available))
    need = int(UNKNOWN_NEED_GIB * nvml.GIB)
    sizes = [s.strip() for s in os.environ.get("GPU_PARK_SIZES", "135m,0.6b,8b").split(",")]
    result: dict[str, Any] = {
        "benchmark": "gpu_park_probe", "when": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpus": os.cpu_count(), "memory_gib": round(vm.total / nvml.GIB, 1),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0)},
        "gpus": {str(i): {"total_gib": round(g.total_bytes / nvml.GIB, 2),
                          "free_gib": round(g.free_bytes / nvml.GIB, 2)}
                 for i, g in gpus.items()},
        "host": {"total_gib": round(host.total / nvml.GIB, 2),
                 "available_gib": round(host.available / nvml.GIB, 2)},
        "index_agreement": gpus_agree(torch),
        "pinned_rounding_bound": gpu_park.PINNED_ROUNDING,
        "sizes": {},
    }
    with tempfile.TemporaryDirectory(prefix="gpu-park-") as tmp:
        for key in sizes:
            shape = SHAPES[key]
            weights = shape.params() * 2
            level = gpu_park.sleep_level(weights, need_bytes=need, host=host)
            entry: dict[str, Any] = {
                "policy_level": level,
                "pinned_gib_counted": round(gpu_park.pinned_bytes(weights) / nvml.GIB, 2)}
            if time.monotonic() < deadline:
                entry.update(probe_size(torch, shape, Path(tmp), deadline))
            else:
                entry["skipped"] = "time budget spent"
            result["sizes"][shape.name] = entry
    result["seconds"] = round(time.monotonic() - began, 1)
    text = json.dumps(result, indent=2)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_park.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
