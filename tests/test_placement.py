"""CPU core sets and the environment a worker starts with."""

from __future__ import annotations

import pytest

from router.workers.placement import Placer
from shared.config import ModelSpec, format_cores, parse_cores


@pytest.mark.parametrize("text,cores", [("0", {0}), ("0-3", {0, 1, 2, 3}),
                                        ("0-2,6,8-9", {0, 1, 2, 6, 8, 9})])
def test_core_lists_round_trip(text: str, cores: set[int]) -> None:
    assert parse_cores(text) == cores and format_cores(cores) == text


def test_auto_placement_gives_disjoint_cores_while_free() -> None:
    placer = Placer(cores={0, 1, 2, 3})
    a = placer.place(ModelSpec(id="a", model="/a", cpu_cores="0-1"))
    b = placer.place(ModelSpec(id="b", model="/b", kv_cache_gib=3))
    assert a["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert b == {"VLLM_CPU_OMP_THREADS_BIND": "2-3", "VLLM_CPU_KVCACHE_SPACE": "3"}
    c = placer.place(ModelSpec(id="c", model="/c"))  # nothing free: share one core
    assert len(parse_cores(c["VLLM_CPU_OMP_THREADS_BIND"])) == 1
    placer.release("b")
    d = placer.place(ModelSpec(id="d", model="/d"))
    assert d["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"


def test_gpu_placement_sets_visible_devices_and_env() -> None:
    env = Placer(cores={0}).place(ModelSpec(id="g", model="/g", device="cuda", gpus=[2, 3],
                                            env={"NCCL_DEBUG": "WARN"}))
    # a model's env is not placement; CUDA numbers the GPUs as NVML does (PCI bus order)
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3"}
