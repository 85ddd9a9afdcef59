"""``bench/gpu_park_probe.py`` (issue 37) where there is no GPU: it says so and exits 2,
importing nothing the GPU machine lacks (``msgspec``, ``starlette``, vLLM); its layer
shapes are the models' sizes. What it measures needs a GPU (docs/performance.md)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT


def test_without_cuda_the_probe_says_so_and_exits_2() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUT": ""}
    done = subprocess.run([sys.executable, "-m", "bench.gpu_park_probe"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done
    assert "no CUDA" in done.stderr and done.stdout == ""


def test_the_probe_imports_none_of_the_routers_wheels_and_its_shapes_are_the_models() -> None:
    code = ("import sys, bench.gpu_park_probe as p; "
            "bad = [m for m in ('msgspec', 'starlette', 'zmq', 'vllm') if m in sys.modules]; "
            "assert not bad, bad; "
            "print(*(round(s.params() / 1e6) for s in p.SHAPES.values()))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.split() == ["135", "596", "8191"]  # SmolLM2-135M, Qwen3-0.6B, -8B
