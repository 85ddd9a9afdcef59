"""Replicas of the embedded model with real vLLM on the Ray backend (issue 35's "done when":
"the same with the Ray backend on the test's one-node cluster (two replicas, placement
shown)"), over HTTP with the official SDK: two replicas, each a Ray actor's worker on a
core of its own, serve concurrent streams (both replicas' ``completed`` grow, their pids
differ, each shows its node and placement); a replica's worker killed mid-stream ends its
stream within 2 s with an error, the following requests succeed on the other, and it
restarts. The one-node cluster (``tests/ray_nodes.py``: 2 CPUs) spreads nothing: the
second replica's ``spread`` preference falls back to the node that has room.

Synthetic workers on a two-node cluster (spread over nodes, pack on one, an actor's
kill): ``tests/test_replicas_ray.py``."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import openai
import psutil
import pytest

from tests.conftest import RouterProcess, running_router
from tests.ray_nodes import ray_head, ray_runtime_dir, ray_temp_dir  # noqa: F401  # fixtures

pytestmark = pytest.mark.integration

PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  backend: ray
  ray_address: "{address}"
  runtime_dir: "{runtime_dir}"
  spare_workers: 0
  load_timeout: 600
  drain_timeout: 5
models:
  smol:
    model: "builtin:smollm2"
    dtype: float32
    max_model_len: 1024
    kv_cache_gib: 1
    num_cpus: 1
    cpu_cores: "0-1"
    replicas: {min: 2, max: 2, cooldown: 1}
    load_on_startup: true
"""


def replicas(r: RouterProcess) -> list[dict[str, Any]]:
    return list(r.client.get(f"{r.url}/v1/models/smol").json().get("replicas") or [])


def wait_replicas(r: RouterProcess, timeout: float = 600) -> list[dict[str, Any]]:
    """Until both replicas are ready: them."""
    deadline = time.monotonic() + timeout
    while True:
        now = replicas(r)
        if len(now) == 2 and all(x["state"] == "ready" for x in now):
            return now
        assert time.monotonic() < deadline, (now, r.tail())
        time.sleep(0.5)


def completed(r: RouterProcess) -> dict[int, int]:
    return {x["number"]: x["completed"] for x in replicas(r)}


def client(r: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{r.url}/v1", api_key="x", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def on_ray(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """A router on the one-node cluster (its runtime dir hidden from the node)."""
    with running_router(PRESET, tmp_path_factory.mktemp("ray-vllm"), "ray-vllm",
                        {"address": request.getfixturevalue("ray_head"),
                         "runtime_dir": str(request.getfixturevalue("ray_runtime_dir"))}
                        ) as r:
        wait_replicas(r)
        yield r


def test_two_ray_replicas_serve_concurrent_streams_and_show_where_they_run(
        on_ray: RouterProcess) -> None:
    running = wait_replicas(on_ray)
    assert len({x["pid"] for x in running}) == 2
    for shown in running:  # placement shown: its node, its Ray node, its core
        assert shown["node"] and len(shown["node_id"]) == 56, shown
        parent = psutil.Process(shown["pid"]).parent()  # its own Ray actor
        assert parent is not None and "WorkerHost" in " ".join(parent.cmdline())
    assert sorted(x["placement"]["VLLM_CPU_OMP_THREADS_BIND"] for x in running) == ["0", "1"]
    assert running[0]["node_id"] == running[1]["node_id"]  # one node: spread fell back
    before = completed(on_ray)
    c = client(on_ray)

    def stream(i: int) -> int:
        tokens = 0
        for chunk in c.chat.completions.create(
                model="smol", max_tokens=24, stream=True, temperature=0,
                messages=[{"role": "user", "content": f"Count to ten, attempt {i}."}]):
            tokens += bool(chunk.choices and chunk.choices[0].delta.content)
        return tokens

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(n > 0 for n in pool.map(stream, range(4)))
    after = completed(on_ray)
    assert all(after[n] > before[n] for n in (0, 1)), (before, after)  # both served


def test_a_killed_ray_replica_ends_its_stream_the_other_serves_and_it_restarts(
        on_ray: RouterProcess) -> None:
    c = client(on_ray)
    running = wait_replicas(on_ray)
    victim = next(x for x in running if x["number"] == 1)

    def stream(i: int) -> str:
        out = ""
        for chunk in c.chat.completions.create(
                model="smol", max_tokens=400, stream=True, temperature=0,
                extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": f"Tell me a long story, number {i}."}]):
            out += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        return out

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(stream, i) for i in range(2)]
        deadline = time.monotonic() + 120
        while not all(x["in_flight"] >= 1 for x in replicas(on_ray)):
            assert time.monotonic() < deadline, replicas(on_ray)
            time.sleep(0.05)
        killed = time.monotonic()
        psutil.Process(victim["pid"]).kill()
        done, _ = concurrent.futures.wait(streams, return_when="FIRST_COMPLETED")
        assert time.monotonic() - killed < 2.0
        (lost,) = done
        with pytest.raises(openai.APIError, match="exited unexpectedly"):
            lost.result()
        for i in range(4):  # every following request succeeds, on the other replica
            reply = c.chat.completions.create(
                model="smol", max_tokens=4, messages=[{"role": "user", "content": f"Hi {i}"}])
            assert reply.choices[0].message.content is not None
        other = next(s for s in streams if s is not lost)
        assert other.result(timeout=600)  # the other replica's stream ended whole
    again = wait_replicas(on_ray)
    back = next(x for x in again if x["number"] == 1)
    assert back["pid"] != victim["pid"] and back["node_id"], again
