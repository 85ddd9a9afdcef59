"""OpenMP thread binding for vLLM's CPU executor when it is forked rather than spawned.

vLLM binds its CPU executor's OpenMP threads through the environment of the process it
spawns: ``LD_PRELOAD`` of torch's libgomp and ``GOMP_CPU_AFFINITY="0 1 …"`` (thread *i*
on the *i*-th core), which libgomp reads once, when it is loaded. A forked executor has
libgomp loaded already (the worker imported torch), so those variables never take: its
threads float over every core, and on a busy machine a team thread descheduled at a
barrier stalled decoding ~200 ms every few dozen tokens (measured: 27–36 tokens/s at one
stream and p99 inter-token 150–220 ms, vs 33 / 50–70 ms spawned). ``bind_openmp_threads``
does in the forked child what libgomp does at load in a spawned one.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping

log = logging.getLogger("modelyard.worker")


def cores_from_env(env: Mapping[str, str]) -> list[int] | None:
    """The cores vLLM asked the executor's OpenMP threads to run on (thread *i* on the
    *i*-th), from the variables its ``OMPProcessManager`` sets before starting it; ``None``
    when it asked for none (``nobind``, or not a CPU executor)."""
    gomp = env.get("GOMP_CPU_AFFINITY", "").split()
    if gomp and all(c.isdigit() for c in gomp):
        return [int(c) for c in gomp]
    places = env.get("OMP_PLACES", "")  # "{0,1,2}": one place; libgomp keeps the threads in it
    if places.startswith("{") and places.endswith("}"):
        ids = places[1:-1].split(",")
        if ids and all(c.strip().isdigit() for c in ids):
            return [int(c) for c in ids]
    return None


def _torch_openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch's kernels (and vLLM's) call, as a library handle.

    Symbols are looked up through ``libtorch_cpu``, so they resolve to the libgomp it was
    linked with: a process can hold more than one (sentencepiece ships its own, whose
    thread pool torch never uses)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            if os.path.basename(path).startswith("libtorch_cpu."):
                lib = ctypes.CDLL(path)
                return lib if hasattr(lib, "GOMP_parallel") else None
    return None


def bind_openmp_threads(cores: list[int]) -> bool:
    """Start this process's OpenMP team with one thread per core in ``cores`` and pin
    thread *i* (the calling thread is thread 0) to ``cores[i]``, as libgomp does at load
    for ``GOMP_CPU_AFFINITY``. Later parallel regions of this thread reuse the team.
    Call it before any OpenMP region runs in the process. ``False`` (and a warning)
    where torch has no libgomp."""
    import torch

    gomp = _torch_openmp()
    if gomp is None:
        log.warning("torch uses no libgomp here; its OpenMP threads stay unbound")
        return False
    gomp.omp_get_thread_num.restype = ctypes.c_int
    torch.set_num_threads(len(cores))  # torch's own count, and libgomp's nthreads-var
    failed: list[str] = []

    def pin(_: ctypes.c_void_p) -> None:
        core = cores[gomp.omp_get_thread_num() % len(cores)]
        try:
            os.sched_setaffinity(0, {core})  # 0: the calling thread
        except OSError as err:  # a core outside the cgroup's set: keep its mask, say so
            failed.append(f"core {core}: {err}")

    callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(pin)
    gomp.GOMP_parallel(callback, None, ctypes.c_uint(len(cores)), ctypes.c_uint(0))
    if failed:
        log.warning("could not pin OpenMP threads: %s", "; ".join(failed))
    return not failed
