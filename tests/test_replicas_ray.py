"""Replicas of a ``backend: ray`` model (issue 35): the preset key
``replicas.placement`` (``spread | pack``), the actor options it makes of the siblings'
nodes, the supervisor handing a new replica its siblings; then, with synthetic workers
on a real two-node Ray cluster on this host (``tests/ray_nodes.py``) behind a real
router: ``spread`` puts the two replicas on two nodes, ``pack`` on one, each shows its
node, each on its own CURVE link; a replica whose actor is killed ends only its own
stream (with an error), the other serves on, and it comes back.

The same with real vLLM on the one-node cluster: ``tests/test_replicas_ray_vllm.py``."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from router.lifecycle.supervisor import Supervisor
from router.workers.backends import WorkerHandle
from router.workers.backends.base import BootFor
from router.workers.backends.local import LocalBackend
from router.workers.backends.ray_cluster import NODE_LABEL, RayBackend
from shared.config import ConfigError, ModelSpec, Replicas
from shared.preset_loader import build_preset, load_preset
from tests.conftest import RouterProcess, running_router
from tests.ray_nodes import (  # noqa: F401  # fixtures
    ray_head,
    ray_runtime_dir,
    ray_second_node,
    ray_temp_dir,
)
from tests.test_parking import until
from tests.test_replicas import ready_replicas, run, supervisor, use

A, B = "a" * 56, "b" * 56  # Ray node ids (hex)


def ray_model(**model: Any) -> ModelSpec:
    return build_preset({"server": {"backend": "ray"},
                         "models": {"m": {"model": "/m", **model}}}, "p.yaml").models["m"]


# -- the preset key -------------------------------------------------------------------
def test_a_ray_models_replicas_spread_unless_told_to_pack() -> None:
    assert Replicas().placement == "spread"
    assert ray_model(replicas=2).replicas.placement == "spread"
    packed = ray_model(replicas={"min": 2, "max": 2, "placement": "pack"})
    assert packed.replicas == Replicas(min=2, max=2, placement="pack")


def test_placement_is_refused_for_a_local_model_and_a_bad_word_names_the_key() -> None:
    for where in ({"models": {"m": {"model": "/m", "replicas": {"placement": "spread"}}}},
                  {"server": {"backend": "ray"}, "defaults": {"replicas": {"placement": "pack"}},
                   "models": {"m": {"model": "/m", "backend": "local"}}}):
        with pytest.raises(ConfigError, match=r"p.yaml: model 'm': key 'replicas.placement': "
                                              r"places replicas over a Ray cluster's nodes, "
                                              r"and this model's backend is 'local'"):
            build_preset(where, "p.yaml")
    with pytest.raises(ConfigError, match=r"model 'm': key 'replicas.placement': Invalid enum"):
        ray_model(replicas={"placement": "scatter"})


def test_ini_writes_placement_as_yaml_does(tmp_path: Path) -> None:
    (tmp_path / "p.ini").write_text("[server]\nbackend = ray\n\n[m]\nmodel = /m\n"
                                    "replicas.max = 2\nreplicas.placement = pack\n")
    (tmp_path / "p.yaml").write_text("server: {backend: ray}\nmodels:\n  m: {model: /m, "
                                     "replicas: {max: 2, placement: pack}}\n")
    ini, yaml = load_preset(tmp_path / "p.ini"), load_preset(tmp_path / "p.yaml")
    assert ini.models["m"].replicas == yaml.models["m"].replicas
    assert ini.models["m"].replicas.placement == "pack"


# -- the actor's options ----------------------------------------------------------------
def test_spread_prefers_a_node_without_a_sibling_and_falls_back_to_any() -> None:
    spec = ray_model(replicas=3)
    plain = {"num_cpus": 1.0, "num_gpus": 0.0, "resources": {}}
    assert RayBackend.actor_options(spec) == plain  # the first: wherever Ray puts it
    assert RayBackend.actor_options(spec, [A, B, A, ""]) == {
        **plain, "label_selector": {NODE_LABEL: f"!in({A},{B})"},
        "fallback_strategy": [{"label_selector": {}}]}


def test_pack_prefers_the_first_siblings_node_and_keeps_the_presets_labels() -> None:
    spec = ray_model(replicas={"max": 2, "placement": "pack"}, label_selector={"zone": "eu"})
    assert RayBackend.actor_options(spec)["label_selector"] == {"zone": "eu"}
    options = RayBackend.actor_options(spec, [B, A])
    assert options["label_selector"] == {"zone": "eu", NODE_LABEL: B}
    assert options["fallback_strategy"] == [{"label_selector": {"zone": "eu"}}]


def test_a_preset_that_names_the_node_keeps_it() -> None:
    spec = ray_model(replicas=2, label_selector={NODE_LABEL: A})
    assert RayBackend.actor_options(spec, [B]) == {
        "num_cpus": 1.0, "num_gpus": 0.0, "resources": {}, "label_selector": {NODE_LABEL: A}}


# -- the supervisor hands a new replica its siblings ------------------------------------
def test_a_replica_is_spawned_knowing_its_running_siblings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[int]] = []
    spawn = LocalBackend.spawn

    async def recording(self: LocalBackend, spec: ModelSpec, boot_for: BootFor,
                        log_path: Path, env: dict[str, str],
                        siblings: Sequence[WorkerHandle] = ()) -> WorkerHandle:
        seen.append([h.pid for h in siblings])
        return await spawn(self, spec, boot_for, log_path, env, siblings)

    monkeypatch.setattr(LocalBackend, "spawn", recording)
    sup: Supervisor = supervisor(tmp_path, m={"replicas": 2})

    async def scenario() -> None:
        entry = sup.registry.entries["m"]
        await use(sup, "m")
        await until(lambda: ready_replicas(sup, entry) == [0, 1], 30, "both replicas ready")
        first = sup.replicas_of(entry).numbered(0)
        assert first is not None
        assert seen == [[], [first.handle.pid]]

    run(sup, scenario)


# -- on a real two-node cluster -----------------------------------------------------------
PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  backend: ray
  ray_address: "{address}"
  runtime_dir: "{runtime_dir}"
  spare_workers: 0
  load_timeout: 120
  drain_timeout: 5
models:
  spread:
    model: /synthetic
    engine: synthetic
    engine_args: {tokens_per_second: 40}
    num_cpus: 0.5
    replicas: {min: 2, max: 2, cooldown: 0.5}
    load_on_startup: true
  pack:
    model: /synthetic
    engine: synthetic
    num_cpus: 0.5
    replicas: {min: 2, max: 2, placement: pack}
    load_on_startup: true
"""


def replicas(r: RouterProcess, model: str) -> list[dict[str, Any]]:
    return list(r.client.get(f"{r.url}/v1/models/{model}").json().get("replicas") or [])


def wait_replicas(r: RouterProcess, model: str, timeout: float = 120) -> list[dict[str, Any]]:
    """Until both replicas of ``model`` are ready: them."""
    deadline = time.monotonic() + timeout
    while True:
        now = replicas(r, model)
        if len(now) == 2 and all(x["state"] == "ready" for x in now):
            return now
        assert time.monotonic() < deadline, (now, r.tail())
        time.sleep(0.3)


@pytest.fixture(scope="module")
def two_nodes(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """A router on the two-node cluster (its runtime dir is hidden from both nodes)."""
    with running_router(PRESET, tmp_path_factory.mktemp("ray-replicas"), "ray-replicas",
                        {"address": request.getfixturevalue("ray_second_node"),
                         "runtime_dir": str(request.getfixturevalue("ray_runtime_dir"))}
                        ) as r:
        yield r


def test_spread_replicas_run_on_two_nodes_and_pack_replicas_on_one(
        two_nodes: RouterProcess) -> None:
    spread, pack = wait_replicas(two_nodes, "spread"), wait_replicas(two_nodes, "pack")
    for shown in (*spread, *pack):  # where each runs, as Ray placed it
        assert shown["node"] and len(shown["node_id"]) == 56, shown
    assert spread[0]["node_id"] != spread[1]["node_id"], spread
    assert pack[0]["node_id"] == pack[1]["node_id"], pack
    assert len({x["pid"] for x in (*spread, *pack)}) == 4
    for shown in (*spread, *pack):  # each worker is a child of its own actor process
        parent = psutil.Process(shown["pid"]).parent()
        assert parent is not None and "WorkerHost" in " ".join(parent.cmdline())


def test_each_replica_has_its_own_authenticated_link(two_nodes: RouterProcess) -> None:
    """Each replica's worker connected to a TCP port of its own (a CURVE key minted per
    worker: ``WorkerLink``): one established connection each, to distinct router ports."""
    running = wait_replicas(two_nodes, "spread")
    router = psutil.Process(two_nodes.proc.pid)  # type: ignore[union-attr]
    listening = {c.laddr.port for c in router.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN}
    ports = []
    for shown in running:
        worker = psutil.Process(shown["pid"])
        ports += [c.raddr.port for c in worker.net_connections("tcp")
                  if c.raddr and c.raddr.port in listening]
    assert len(ports) == 2 and len(set(ports)) == 2, ports


def test_a_replica_whose_actor_dies_ends_only_its_stream_and_comes_back(
        two_nodes: RouterProcess) -> None:
    """As a lost node loses its replicas: the Ray actor of replica 1 is killed (the worker
    dies with it) mid-stream; its stream ends with an error, the other replica's stream
    ends whole, requests meanwhile succeed, and replica 1 restarts."""
    r = two_nodes
    running = wait_replicas(r, "spread")
    victim = next(x for x in running if x["number"] == 1)
    actor = psutil.Process(victim["pid"]).parent()
    assert actor is not None and "WorkerHost" in " ".join(actor.cmdline())
    c = openai.OpenAI(base_url=f"{r.url}/v1", api_key="x", max_retries=0, timeout=120)

    def stream(i: int) -> int:
        tokens = 0
        for chunk in c.chat.completions.create(
                model="spread", max_tokens=600, stream=True,  # 15 s at 40 tokens/s
                messages=[{"role": "user", "content": f"Story {i}."}]):
            tokens += bool(chunk.choices and chunk.choices[0].delta.content)
        return tokens

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(stream, i) for i in range(2)]
        deadline = time.monotonic() + 60
        while not all(x["in_flight"] >= 1 for x in replicas(r, "spread")):
            assert time.monotonic() < deadline, replicas(r, "spread")
            time.sleep(0.05)
        killed = time.monotonic()
        actor.kill()
        done, _ = concurrent.futures.wait(streams, timeout=60,
                                          return_when="FIRST_COMPLETED")
        ended = time.monotonic() - killed
        # A generous bound (this machine is shared): what it tells is that the stream did
        # not run to its end, 15 s on; the 2 s target is checked by the real-vLLM test.
        assert len(done) == 1 and ended < 10, (ended, r.tail())
        (lost,) = done
        with pytest.raises(openai.APIError, match="exited unexpectedly"):
            lost.result()
        for i in range(3):  # the other replica serves on meanwhile
            reply = c.chat.completions.create(model="spread", max_tokens=4,
                                              messages=[{"role": "user", "content": f"{i}"}])
            assert reply.choices[0].message.content
        other = next(s for s in streams if s is not lost)
        assert other.result(timeout=120) == 600  # its stream ended whole
    print(f"the killed replica's stream ended {ended:.2f} s after its actor's kill")
    again = wait_replicas(r, "spread")
    back = next(x for x in again if x["number"] == 1)
    assert back["pid"] != victim["pid"], again
    assert back["node_id"] != next(x for x in again if x["number"] == 0)["node_id"], again
