"""The backend seam without workers: presets choose a backend, Ray's actor options and
placement, and which models a spare may serve."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import zmq

from router.lifecycle.supervisor import Supervisor
from router.registry import ModelRegistry
from router.workers.backends.local import LocalBackend
from router.workers.backends.ray_cluster import RayBackend
from router.workers.link import WorkerLink
from router.workers.placement import Placer
from router.workers.spares import SparePool
from shared.config import ConfigError
from shared.preset_loader import build_preset
from tests.conftest import ROOT


def preset(server: dict[str, object] | None = None, **models: dict[str, object]):  # type: ignore[no-untyped-def]
    return build_preset({"server": server or {}, "models": models or {"m": {"model": "x"}}})


def test_the_server_backend_is_every_model_s_default_and_a_model_may_override_it() -> None:
    p = preset({"backend": "ray", "ray_address": "10.0.0.5:6379"},
               a={"model": "x"}, b={"model": "x", "backend": "local"})
    assert p.server.ray_address == "10.0.0.5:6379"
    assert p.models["a"].backend == "ray" and p.models["b"].backend == "local"
    assert preset().models["m"].backend == "local"


def test_an_unknown_backend_or_negative_resources_are_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="backend"):
        preset({"backend": "k8s"})
    with pytest.raises(ConfigError, match="num_gpus"):
        preset(m={"model": "x", "num_gpus": -1})


def test_ray_actor_options_follow_the_preset() -> None:
    p = preset({"backend": "ray"},
               cpu={"model": "x"},
               gpu={"model": "x", "device": "cuda", "tensor_parallel_size": 1},
               wide={"model": "x", "device": "cuda", "tensor_parallel_size": 2},
               custom={"model": "x", "num_cpus": 4, "num_gpus": 0.5,
                       "resources": {"a100": 1}, "label_selector": {"zone": "eu"}})
    options = {name: RayBackend.actor_options(spec)
               for name, spec in p.models.items()}
    assert options["cpu"] == {"num_cpus": 1.0, "num_gpus": 0.0, "resources": {}}
    assert options["gpu"]["num_gpus"] == 1.0
    assert options["wide"]["num_gpus"] == 0.0  # vLLM's Ray executor places its ranks
    assert options["custom"] == {"num_cpus": 4, "num_gpus": 0.5, "resources": {"a100": 1},
                                 "label_selector": {"zone": "eu"}}


def test_ray_placement_sizes_the_kv_cache_and_pins_only_named_cores() -> None:
    p = preset({"backend": "ray"}, a={"model": "x", "kv_cache_gib": 2},
               b={"model": "x", "cpu_cores": "2-3"}, g={"model": "x", "device": "cuda"})
    ray = RayBackend(None, [], 10)
    placer = Placer(cores={0, 1}, gpus={})
    assert ray.place(p.models["a"], placer, "a") == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    assert ray.place(p.models["b"], placer, "b") == {
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "2-3"}
    assert ray.place(p.models["g"], placer, "g") == {}
    assert ray.endpoint(Path("/x"), 1).startswith("tcp://")


def test_spares_serve_local_models_only_and_ray_is_joined_only_when_used(
        tmp_path: Path) -> None:
    p = preset({"backend": "ray"}, a={"model": "x"}, b={"model": "x", "backend": "local"})
    assert not SparePool.fits(p.models["a"])
    assert SparePool.fits(p.models["b"])
    sup = Supervisor(ModelRegistry(p), p.server, tmp_path, Placer(cores={0}, gpus={}))
    assert isinstance(sup.backends["ray"], RayBackend)
    assert isinstance(sup.backends["local"], LocalBackend)
    local = preset()
    assert set(Supervisor(ModelRegistry(local), local.server, tmp_path,
                          Placer(cores={0}, gpus={})).backends) == {"local"}
    assert sup.backends["local"].endpoint(tmp_path, 7) == f"ipc://{tmp_path}/w7.sock"


PEER = """
import sys, time, zmq
from shared.protocol import Codec, Ready, ToRouter
sock = zmq.Context().socket(zmq.DEALER)
sock.curve_serverkey = sys.argv[2].encode()
sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
sock.connect(sys.argv[1])
sock.send(Codec(ToRouter).encode(Ready(model="m", max_model_len=1, pid=1)))
time.sleep(60)
"""


def test_a_tcp_link_drops_a_silent_worker_within_2s_and_an_ipc_link_has_no_heartbeat(
        tmp_path: Path) -> None:
    """A worker whose node dies sends nothing: a stopped peer process stands for it."""

    async def main() -> float:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        local = WorkerLink(ctx, f"ipc://{tmp_path}/w.sock", "m")
        assert local.disconnected is None
        link = WorkerLink(ctx, "tcp://127.0.0.1:*", "m")
        assert link.endpoint.startswith("tcp://127.0.0.1:") and not link.endpoint.endswith("*")
        peer = subprocess.Popen(  # noqa: ASYNC220  # starts at once; nothing to wait for
            [sys.executable, "-c", PEER, link.endpoint, link.key],
            env=dict(os.environ, PYTHONPATH=str(ROOT)))
        try:
            await asyncio.wait_for(link.wait_ready(), 30)
            assert link.disconnected is not None
            await asyncio.sleep(1.5)  # its heartbeats are answered: still connected
            assert not link.disconnected.done()
            os.kill(peer.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            await asyncio.wait_for(asyncio.shield(link.disconnected), 5)
            return time.monotonic() - stopped
        finally:
            peer.kill()
            peer.wait()
            link.close()
            local.close()
            ctx.destroy(linger=0)

    assert asyncio.run(main()) < 2.0


FORKER = """
import os, sys, time
from worker.__main__ import _children_die_with_us
_children_die_with_us()
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
time.sleep(60)
"""


def test_a_process_forked_by_a_ray_owned_worker_dies_with_it() -> None:
    """Ray SIGKILLs an actor's child (the worker), which cannot then end its group: what
    the worker forked (EngineCore) must die by itself."""
    worker = subprocess.Popen([sys.executable, "-c", FORKER], stdout=subprocess.PIPE,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert worker.stdout is not None
    child = psutil.Process(int(worker.stdout.readline()))
    assert child.is_running()
    worker.kill()
    worker.wait()
    deadline = time.monotonic() + 5
    while child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the forked process outlived its worker"
        time.sleep(0.05)
