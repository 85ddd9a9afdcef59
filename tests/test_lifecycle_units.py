"""Lifecycle decisions that need no process: capacity, budgets, backoff, GPU placement,
and the exact environment a worker starts with."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from router.lifecycle.supervisor import Supervisor, backoff_seconds
from router.registry import ModelRegistry
from router.workers.placement import GIB, GpuMemory, Placer, fits, footprint
from router.workers.worker_start import base_env, model_env, worker_command
from shared.config import ModelSpec, ServerConfig
from shared.preset_loader import build_preset
from tests.conftest import connected_peer, from_router

H100 = {i: GpuMemory(i, 80 * GIB, 79 * GIB) for i in range(4)}


def spec(name: str, **kw: object) -> ModelSpec:
    return ModelSpec(id=name, model=f"/{name}", **kw)  # type: ignore[arg-type]


def test_max_loaded_models() -> None:
    server = ServerConfig(max_loaded_models=2)
    a, b, c = spec("a"), spec("b"), spec("c")
    assert fits(c, [a], server, {})
    assert not fits(c, [a, b], server, {})
    assert fits(a, [a, b], server, {})  # a model never competes with itself


def test_memory_budget_per_device_with_nvml_reading() -> None:
    server = ServerConfig(memory_budget_gib={"cuda:0": 80, "cpu": 6})
    big = spec("big", device="cuda", gpus=[0], gpu_memory_utilization=0.6)
    small = spec("small", device="cuda", gpus=[0], memory_gib=30)
    assert footprint(big, H100) == {"cuda:0": pytest.approx(48.0)}
    assert fits(small, [big], server, H100)             # 48 + 30 <= 80
    assert not fits(spec("s2", device="cuda", gpus=[0], memory_gib=40), [big], server, H100)
    assert fits(spec("elsewhere", device="cuda", gpus=[1], memory_gib=79), [big], server, H100)
    cpu = [spec("c1", kv_cache_gib=2), spec("c2", kv_cache_gib=1)]  # 3 + 2 GiB
    assert not fits(spec("c3"), cpu, server, {})                   # + 2 > 6
    assert fits(spec("c3"), cpu[:1], server, {})


def test_gpu_memory_fraction_from_nvml_and_start_locks() -> None:
    placer = Placer(cores={0}, gpus=H100)
    assert placer.gpu_memory_utilization(spec("m", device="cuda", gpus=[2], memory_gib=20)) \
        == pytest.approx(0.25)
    assert placer.gpu_memory_utilization(spec("m", device="cuda", gpu_memory_utilization=0.7)) == 0.7
    assert placer.gpu_memory_utilization(spec("m", device="cuda")) is None  # vLLM's default
    assert Placer(cores={0}, gpus={}).gpu_memory_utilization(
        spec("m", device="cuda", memory_gib=20)) is None                  # no NVML: no guess

    async def locks() -> None:
        a = placer.start_locks(spec("a", device="cuda", gpus=[1, 0]))
        b = placer.start_locks(spec("b", device="cuda", gpus=[0]))
        assert a[0] is b[0] and len(a) == 2  # shared GPU 0: one start at a time
        assert placer.start_locks(spec("c")) == []
    asyncio.run(locks())


def test_backoff_grows_and_caps() -> None:
    assert [backoff_seconds(n) for n in range(8)] == [0, 0.5, 1, 2, 4, 8, 16, 30]


def test_worker_env_for_cpu_and_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    preset = build_preset({"models": {
        "cpu-a": {"model": "/a", "cpu_cores": "1", "kv_cache_gib": 2},
        "gpu-b": {"model": "/b", "device": "cuda", "gpus": [2, 3], "tensor_parallel_size": 2,
                  "env": {"NCCL_DEBUG": "WARN"}},
    }})
    sup = Supervisor(ModelRegistry(preset), preset.server, tmp_path,
                     Placer(cores={0, 1}, gpus=H100))
    for entry in sup.registry:  # as a load does, before the worker's environment
        entry.placement = sup.placer.place(entry.spec)
    assert base_env()["HF_HUB_OFFLINE"] == "1"
    cpu_env = model_env(sup.registry.entries["cpu-a"].spec, sup.registry.entries["cpu-a"].placement)
    assert cpu_env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert cpu_env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    gpu_env = model_env(sup.registry.entries["gpu-b"].spec, sup.registry.entries["gpu-b"].placement)
    assert gpu_env["CUDA_VISIBLE_DEVICES"] == "2,3" and gpu_env["NCCL_DEBUG"] == "WARN"
    assert "VLLM_CPU_KVCACHE_SPACE" not in gpu_env
    cmd = worker_command(preset.server)
    assert cmd[1:3] == ["-m", "worker"] and "--spare" not in cmd
    assert "--spare" in worker_command(preset.server, spare=True)
    assert "NCCL_DEBUG" not in " ".join(cmd)  # the spec and its env go over stdin
    assert sup.registry.entries["gpu-b"].placement == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                                       "CUDA_VISIBLE_DEVICES": "2,3"}


def test_wait_queue_is_bounded_and_load_timeout_is_503(tmp_path: Path) -> None:
    from router.errors import ModelUnavailable, TooManyRequests

    preset = build_preset({"server": {"max_queue_depth": 2, "load_timeout": 0.3},
                           "models": {"slow": {"model": "/s"}}})
    sup = Supervisor(ModelRegistry(preset), preset.server, tmp_path, Placer(cores={0}, gpus={}))

    async def never_ready(entry: object) -> object:
        await asyncio.sleep(3600)  # a load that does not finish in time
        raise AssertionError("unreachable")

    sup._load = never_ready  # type: ignore[assignment,method-assign]

    async def scenario() -> list[str]:
        waiting = [asyncio.create_task(sup.acquire("slow")) for _ in range(2)]
        await asyncio.sleep(0.05)
        entry = sup.registry.entries["slow"]
        assert entry.queued == 2 and entry.leases == 2
        with pytest.raises(TooManyRequests) as info:
            await sup.acquire("slow")
        assert info.value.status == 429
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        assert entry.queued == 0 and entry.leases == 0  # waiters gave their leases back
        for task in sup._loads.values():
            task.cancel()
        return [type(o).__name__ for o in outcomes]

    assert asyncio.run(scenario()) == [ModelUnavailable.__name__] * 2


def test_a_worker_that_cannot_start_leaves_the_model_failed_with_the_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 8, defect 4: a spawn failure escaped as a 500 and left the model 'loading'
    (so capacity counted it) forever."""
    from router.errors import ModelUnavailable

    preset = build_preset({"models": {"m": {"model": "/m", "cpu_cores": "0"}}})
    sup = Supervisor(ModelRegistry(preset), preset.server, tmp_path, Placer(cores={0}, gpus={}))

    async def no_exec(*args: object, **kw: object) -> object:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", no_exec)

    async def scenario() -> None:
        with pytest.raises(ModelUnavailable) as info:
            await sup.acquire("m")
        assert info.value.status == 503 and "Too many open files" in info.value.message
        entry = sup.registry.entries["m"]
        assert entry.state == "failed" and "Too many open files" in (entry.error or "")
        assert entry.leases == 0 and sup.placer._held == {}  # nothing held by a failure
        assert entry.restarts == 0  # a first start is not a restart (a metric)
        with pytest.raises(ModelUnavailable):
            await sup.acquire("m")  # after the 0.5 s backoff
        assert entry.restarts == 1

    asyncio.run(scenario())
    sup._ctx.term()


def test_a_model_larger_than_its_whole_budget_is_refused_at_start(tmp_path: Path) -> None:
    """Issue 8, defect 6: such a model waited for room forever."""
    from router.app import build_app
    from router.workers.placement import check_budgets
    from shared.config import ConfigError

    preset = build_preset({"server": {"memory_budget_gib": {"cpu": 4, "cuda:0": 40}},
                           "models": {"small": {"model": "/s", "kv_cache_gib": 2},
                                      "big": {"model": "/b", "kv_cache_gib": 8}}})
    with pytest.raises(ConfigError, match="'big': needs 9 GiB on cpu"):
        build_app(preset)
    gpu = build_preset({"server": {"memory_budget_gib": {"cuda:0": 40}},
                        "models": {"g": {"model": "/g", "device": "cuda",
                                         "gpu_memory_utilization": 0.9}}})
    with pytest.raises(ConfigError, match="72 GiB on cuda:0"):
        check_budgets(gpu.models.values(), gpu.server, H100)  # 0.9 of an 80 GiB GPU
    check_budgets(gpu.models.values(), gpu.server, {})  # unknown without NVML: no claim


def test_runtime_dir_must_be_private(tmp_path: Path) -> None:
    """Issue 8, defect 12: a configured runtime_dir was used whatever its mode."""
    from router.app import check_runtime_dir
    from shared.config import ConfigError

    shared_dir = tmp_path / "open"
    shared_dir.mkdir(mode=0o755)
    shared_dir.chmod(0o755)
    with pytest.raises(ConfigError, match="chmod 700"):
        check_runtime_dir(shared_dir, "p.yaml")
    shared_dir.chmod(0o700)
    check_runtime_dir(shared_dir, "p.yaml")
    deep = tmp_path / ("d" * 90)
    deep.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="too long"):
        check_runtime_dir(deep, "p.yaml")


def test_force_unload_reaches_the_worker(tmp_path: Path) -> None:
    """Issue 8, defect 2: a force unload failed the link first, after which it sent
    nothing, so the engine went on generating for nobody until SIGTERM."""
    import sys

    import zmq

    from router.errors import ModelUnavailable
    from router.lifecycle.replica import Replica
    from router.workers.link import WorkerLink
    from shared.protocol import Generate, SamplingSpec, Shutdown

    preset = build_preset({"models": {"m": {"model": "/m"}}})
    sup = Supervisor(ModelRegistry(preset), preset.server, tmp_path, Placer(cores={0}, gpus={}))

    async def scenario() -> list[object]:
        endpoint = f"ipc://{tmp_path}/w.sock"
        link = WorkerLink(sup._ctx, endpoint, "m")
        peer = await connected_peer(sup._ctx, link, endpoint)  # the worker's end
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import time; time.sleep(60)", start_new_session=True)
        entry = sup.registry.entries["m"]
        worker = Replica(proc, link, tmp_path / "m.log")
        sup.add_worker(entry, worker)
        entry.state, entry.replica = "ready", worker
        stream = link.submit([Generate(id="g1", sampling=SamplingSpec())])  # in flight
        stop = asyncio.create_task(sup.stop(entry, force=True, grace=0.5))
        received: list[object] = []
        for _ in range(200):
            try:
                received.append(from_router(peer))
            except zmq.Again:
                await asyncio.sleep(0.01)
            if any(isinstance(m, Shutdown) for m in received):
                break
        await stop
        with pytest.raises(ModelUnavailable):
            await stream.__anext__()  # the client hears of it at once
        assert entry.state == "unloaded" and proc.returncode is not None
        peer.close(0)
        return received

    received = asyncio.run(scenario())
    sup._ctx.term()
    assert [type(m).__name__ for m in received] == ["Generate", "Shutdown"]


# -- replicas (issue 35, S0: one replica per model) ------------------------------------
def test_replica_zero_goes_by_its_models_id_and_the_set_keeps_the_newest(
        tmp_path: Path) -> None:
    """Replica 0's key is the model's id (logs, placer keys, events and simulation traces
    read as before replicas); a worker reaped after its successor started (a restart
    after a crash) leaves the successor in the set, as the one map by model id did."""
    from types import SimpleNamespace

    from router.lifecycle.replica import Replica, ReplicaSet, replica_key

    assert replica_key("m", 0) == "m" and replica_key("m", 2) == "m#2"
    preset = build_preset({"models": {"m": {"model": "/m"}, "n": {"model": "/n"}}})
    sup = Supervisor(ModelRegistry(preset), preset.server, tmp_path, Placer(cores={0}, gpus={}))
    m, n = sup.registry.entries["m"], sup.registry.entries["n"]

    def worker(model: str) -> Replica:
        link = SimpleNamespace(model=model, busy=False)
        handle = SimpleNamespace(log_path=tmp_path / f"{model}.log")
        return Replica(handle, link)  # type: ignore[arg-type]

    old, new, other = worker("m"), worker("m"), worker("n")
    assert (old.number, old.key) == (0, "m")
    assert sup.worker_of(m) is None and not sup.replicas_of(m) and sup.running() == {}
    sup.add_worker(m, old)
    sup.add_worker(m, new)  # a restart: the new worker in replica 0's place
    sup.add_worker(n, other)
    assert sup.worker_of(m) is new and list(sup.replicas_of(m)) == [new]
    assert sup.running() == {"m": new, "n": other}
    sup.remove_worker(m, old)  # the old one's reap comes late: the new one stays
    assert sup.worker_of(m) is new
    sup.remove_worker(m, new)
    assert sup.worker_of(m) is None and sup.running() == {"n": other}
    assert isinstance(sup.replicas_of(m), ReplicaSet) and len(sup.replicas_of(m)) == 0
    sup._ctx.term()


def test_a_model_entry_sees_its_serving_replica_only_as_busy_or_not(tmp_path: Path) -> None:
    """The registry holds no link of a worker (the lifecycle's ``Replica`` owns it):
    ``ModelEntry.busy`` is what policy reads, ``link_of`` what requests are sent on."""
    from types import SimpleNamespace

    from router.lifecycle.replica import Replica, link_of

    entry = ModelRegistry(build_preset({"models": {"m": {"model": "/m"}}})).entries["m"]
    assert not hasattr(entry, "link")
    assert entry.replica is None and not entry.busy and link_of(entry) is None
    link = SimpleNamespace(model="m", busy=True)
    replica = Replica(SimpleNamespace(log_path=tmp_path / "m.log"), link)  # type: ignore[arg-type]
    entry.replica = replica
    assert entry.busy and link_of(entry) is link
    link.busy = False
    assert not entry.busy


def test_the_registry_imports_nothing_of_the_workers_or_the_lifecycle() -> None:
    """A model's running workers are the lifecycle's: ``router.registry`` (names, specs,
    resolution) imports nothing of ``router.workers`` or ``router.lifecycle``, not even
    under ``TYPE_CHECKING`` (it named ``WorkerLink`` as ``ModelEntry.link``'s type)."""
    from tests.test_layers import import_graph, source_files

    imported = import_graph(source_files())["router.registry"]
    assert not {m for m in imported
                if m.startswith(("router.workers", "router.lifecycle"))}, imported
