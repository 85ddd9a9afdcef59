"""Each replica of a model gets its own share of the model's cores or GPUs
(``placement.replica_spec``): siblings never overlap, one replica is the spec itself."""

from __future__ import annotations

import itertools

import pytest

from router.workers.placement import Placer, replica_spec, shares
from shared.config import ConfigError, ModelSpec, parse_cores


def spec(**kw: object) -> ModelSpec:
    return ModelSpec(id="m", model="/m", backend="local", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("cores", "count", "want"), [
    ("0-3", 2, ["0-1", "2-3"]),
    ("0-4", 2, ["0-2", "3-4"]),
    ("0-3", 4, ["0", "1", "2", "3"]),
    ("0,2,4,6", 2, ["0,2", "4,6"]),
    ("4-7,0-1", 3, ["0-1", "4-5", "6-7"]),
    ("0-3", 1, ["0-3"]),
])
def test_cores_are_cut_into_contiguous_disjoint_shares(cores: str, count: int,
                                                       want: list[str]) -> None:
    got = [replica_spec(spec(cpu_cores=cores), n, count).cpu_cores for n in range(count)]
    assert got == want


@pytest.mark.parametrize(("size", "count"), itertools.product(range(1, 13), range(1, 7)))
def test_shares_cover_every_core_once_and_differ_by_one_at_most(size: int,
                                                                count: int) -> None:
    if size < count:
        with pytest.raises(ValueError):
            shares(list(range(size)), count)
        return
    cut = shares(list(range(size)), count)
    assert [c for share in cut for c in share] == list(range(size))
    assert max(map(len, cut)) - min(map(len, cut)) <= 1 and min(map(len, cut)) >= 1


def test_siblings_never_share_a_core_and_placers_bind_them_apart() -> None:
    model = spec(cpu_cores="0-5")
    placer = Placer(cores=set(range(8)), gpus={})
    bound = [parse_cores(placer.place(replica_spec(model, n, 3))["VLLM_CPU_OMP_THREADS_BIND"])
             for n in range(3)]
    assert bound == [{0, 1}, {2, 3}, {4, 5}]


def test_one_replica_is_the_spec_itself() -> None:
    for model in (spec(cpu_cores="0-3"), spec(), spec(device="cuda", gpus=[0, 1])):
        assert replica_spec(model, 0, 1) is model


def test_without_cpu_cores_the_hosts_cores_are_shared() -> None:
    got = [replica_spec(spec(), n, 2, host_cores={0, 1}).cpu_cores for n in range(2)]
    assert got == ["0", "1"]
    with pytest.raises(ConfigError, match="model 'm': key 'cpu_cores': 2 replicas need cores"):
        replica_spec(spec(), 0, 2)


def test_fewer_cores_than_replicas_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"model 'm': key 'cpu_cores': 2 cores \(\"0-1\"\) "
                                          "cannot give 3 replicas one each"):
        replica_spec(spec(cpu_cores="0-1"), 2, 3)
    with pytest.raises(ConfigError, match="cannot give 2 replicas"):
        replica_spec(spec(), 0, 2, host_cores={3})


@pytest.mark.parametrize("n", [-1, 2])
def test_a_replica_outside_the_count_is_a_bug(n: int) -> None:
    with pytest.raises(ValueError):
        replica_spec(spec(cpu_cores="0-3"), n, 2)


def test_gpus_are_cut_equally_and_hold_a_tensor_parallel_group() -> None:
    model = spec(device="cuda", gpus=[0, 1, 2, 3], tensor_parallel_size=2)
    assert [replica_spec(model, n, 2).gpus for n in range(2)] == [[0, 1], [2, 3]]
    placer = Placer(cores={0}, gpus={})
    assert placer.place(replica_spec(model, 1, 2))["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert [replica_spec(spec(device="cuda", gpus=[3, 1]), n, 2).gpus
            for n in range(2)] == [[3], [1]]


@pytest.mark.parametrize(("gpus", "count", "says"), [
    ([], 2, "1 GPUs cannot be shared equally by 2"),
    ([0, 1, 2], 2, "3 GPUs cannot be shared equally by 2"),
])
def test_gpus_that_do_not_divide_are_refused(gpus: list[int], count: int, says: str) -> None:
    with pytest.raises(ConfigError, match=f"model 'm': key 'gpus': {says}"):
        replica_spec(spec(device="cuda", gpus=gpus), 0, count)


def test_a_share_smaller_than_the_tensor_parallel_group_is_refused() -> None:
    model = spec(device="cuda", gpus=[0, 1], tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="1 GPUs per replica, fewer than tensor_parallel"):
        replica_spec(model, 0, 2)


def test_ray_hands_out_gpus_and_unnamed_cores_itself() -> None:
    gpu = spec(device="cuda", tensor_parallel_size=2)
    gpu.backend = "ray"
    assert replica_spec(gpu, 1, 2) is gpu
    cpu = spec()
    cpu.backend = "ray"
    assert replica_spec(cpu, 1, 2, host_cores={0, 1}) is cpu
    named = spec(cpu_cores="0-3")
    named.backend = "ray"  # siblings may land on one node: named cores are still cut
    assert replica_spec(named, 1, 2).cpu_cores == "2-3"
