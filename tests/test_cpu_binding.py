"""OpenMP threads of a forked vLLM executor are pinned as vLLM pins a spawned one.

vLLM binds its CPU executor's threads through variables libgomp reads when a process loads
it; a forked executor had loaded it already, so its threads floated and decoding stalled
~200 ms every few dozen tokens (issue 21). ``worker.cpu_binding`` pins them itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import httpx
import psutil
import pytest

from tests.conftest import RouterProcess
from worker.cpu_binding import cores_from_env


def test_the_cores_vllm_asks_for_are_read_from_its_variables() -> None:
    assert cores_from_env({"GOMP_CPU_AFFINITY": "2 3 5"}) == [2, 3, 5]
    assert cores_from_env({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}) == [0, 1]
    assert cores_from_env({"GOMP_CPU_AFFINITY": "0-3"}) is None  # a form vLLM never writes
    assert cores_from_env({}) is None


CHILD = textwrap.dedent("""
    import os, sys, torch
    import sentencepiece  # ships a libgomp of its own: the wrong one to bind
    from worker.cpu_binding import bind_openmp_threads

    x = torch.randn(1 << 22)
    pid = os.fork()
    if pid == 0:  # the parent imported torch and ran no parallel region, as the worker
        bind_openmp_threads([0, 1])
        for _ in range(200):
            x.exp()  # at::parallel_for: torch's own OpenMP team
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                ticks = sum(int(v) for v in f.read().rsplit(")", 1)[1].split()[11:13])
            print(tid, ",".join(map(str, sorted(os.sched_getaffinity(int(tid))))), ticks)
        sys.stdout.flush()
        os._exit(0)
    os.waitpid(pid, 0)
""")


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs cores 0 and 1")
def test_a_forked_child_pins_the_team_torch_computes_with() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         check=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(__file__))).stdout
    threads = {int(tid): (cores, int(ticks))
               for tid, cores, ticks in (line.split() for line in out.splitlines())}
    main = min(threads)
    assert threads.pop(main)[0] == "0"
    # The thread that shared the work is torch's team thread, pinned to the second core.
    cores, ticks = max(threads.values(), key=lambda t: t[1])
    assert ticks > 0 and cores == "1", out


@pytest.mark.integration
def test_the_forked_executor_of_a_served_model_is_pinned(router: RouterProcess) -> None:
    model = httpx.get(f"{router.url}/v1/models/smollm2", timeout=10).json()
    assert model["state"] == "ready"  # the shared router's smollm2: cpu_cores "0", forked
    executors = [p for p in psutil.Process(model["pid"]).children(recursive=True)
                 if p.name().startswith("VLLM::Worker")]
    assert executors, "no vLLM executor process under the worker"
    for proc in executors:
        assert os.sched_getaffinity(proc.pid) == {0}, proc  # its main thread: OpenMP's 0
