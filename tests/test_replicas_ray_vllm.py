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

from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from tests.conftest import RouterProcess, running_router
from tests.ray_nodes import ray_head, ray_runtime_dir, ray_temp_dir  # noqa: F401  # fixtures
from tests.test_replicas_vllm import kill_one_mid_stream, streams_reach_both
from tests.test_replicas_vllm import wait_replicas as wait_for

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


def wait_replicas(r: RouterProcess, timeout: float = 600) -> list[dict[str, Any]]:
    """Until both replicas are ready: them."""
    return wait_for(r, 2, timeout)


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
    streams_reach_both(on_ray)


def test_a_killed_ray_replica_ends_its_stream_the_other_serves_and_it_restarts(
        on_ray: RouterProcess) -> None:
    victim = next(x for x in wait_replicas(on_ray) if x["number"] == 1)
    kill_one_mid_stream(on_ray, victim)
    again = wait_replicas(on_ray)
    back = next(x for x in again if x["number"] == 1)
    assert back["pid"] != victim["pid"] and back["node_id"], again
