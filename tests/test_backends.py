"""The same lifecycle through both backends: ``local`` subprocesses and ``ray`` actors.

Each test runs once per backend against a router with two real vLLM CPU workers
(``alpha``, ``beta``: the embedded model). For ``ray`` the module starts a one-node Ray
instance (2 CPUs, no dashboard, its own temp dir and session) and the router joins it
with ``ray_address``; the instance and every process it started are gone afterwards.

The Ray node (``tests/ray_nodes.py``) runs in a mount namespace of its own where the
router's runtime dir is an empty tmpfs: as on a real cluster, the node does not see the
router's files, so nothing of a Ray worker (its log, its failure's tail, its load
phases) may reach the router through them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest

from tests.conftest import RouterProcess, kill_mid_stream
from tests.ray_nodes import ray_head, ray_runtime_dir, ray_temp_dir  # noqa: F401  # fixtures

pytestmark = pytest.mark.integration

PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  backend: {backend}
  {ray_address}
  {runtime_dir}
  spare_workers: 0
  load_timeout: 600
  drain_timeout: 5
models:
  alpha: {model: "builtin:smollm2", max_model_len: 512, num_cpus: 1, load_on_startup: true}
  beta: {model: "builtin:smollm2", max_model_len: 512, num_cpus: 1}
"""
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


@pytest.fixture(scope="module", params=["local", "ray"])
def backend_router(request: pytest.FixtureRequest,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    backend = request.param
    address = runtime_dir = ""
    if backend == "ray":
        address = f"ray_address: \"{request.getfixturevalue('ray_head')}\""
        runtime_dir = f"runtime_dir: \"{request.getfixturevalue('ray_runtime_dir')}\""
    r = RouterProcess(PRESET, tmp_path_factory.mktemp(backend), backend,
                      {"backend": backend, "ray_address": address, "runtime_dir": runtime_dir})
    r.start()
    try:
        r.wait_healthy(60)
        r.wait_model("alpha", timeout=600)
        yield r
    finally:
        r.stop()


def models(r: RouterProcess) -> dict[str, dict[str, object]]:
    return {m["id"]: m for m in r.client.get(f"{r.url}/v1/models").json()["data"]}


def sdk(r: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{r.url}/v1", api_key="x", max_retries=0, timeout=600)


def chat(r: RouterProcess, model: str, **extra: object) -> httpx.Response:
    return httpx.post(f"{r.url}/v1/chat/completions", timeout=600, json={
        "model": model, "messages": STORY, "max_tokens": 8, **extra})


def test_both_models_stream_and_show_their_node(backend_router: RouterProcess) -> None:
    backend = backend_router.preset.stem
    client = sdk(backend_router)
    for model in ("alpha", "beta"):
        stream = client.chat.completions.create(model=model, messages=STORY,  # type: ignore[arg-type]
                                                max_tokens=12, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text.strip(), model
    listed = models(backend_router)
    for model in ("alpha", "beta"):
        assert listed[model]["state"] == "ready"
        assert listed[model]["backend"] == backend
        assert isinstance(listed[model]["node"], str) and listed[model]["node"]
        assert psutil.pid_exists(int(listed[model]["pid"]))  # type: ignore[call-overload]
    assert listed["alpha"]["pid"] != listed["beta"]["pid"]
    if backend == "ray":  # each worker is a child of its own actor process
        parents = {psutil.Process(int(listed[m]["pid"])).parent()  # type: ignore[call-overload]
                   for m in ("alpha", "beta")}
        assert all(p is not None and "WorkerHost" in " ".join(p.cmdline()) for p in parents)


def test_unload_then_load_again(backend_router: RouterProcess) -> None:
    pid = models(backend_router)["beta"]["pid"]
    reply = backend_router.client.post(f"{backend_router.url}/v1/models/unload",
                                       json={"model": "beta"}, timeout=60)
    assert reply.status_code == 200 and reply.json()["state"] == "unloaded"
    assert "node" not in reply.json() and "pid" not in reply.json()
    assert not psutil.pid_exists(int(pid))  # type: ignore[call-overload]
    reply = backend_router.client.post(f"{backend_router.url}/v1/models/load",
                                       json={"model": "beta"}, timeout=600)
    assert reply.status_code == 200 and reply.json()["state"] == "ready", reply.text
    assert reply.json()["pid"] != pid
    assert chat(backend_router, "beta").status_code == 200


def test_killed_worker_ends_its_streams_within_2s_and_restarts(
        backend_router: RouterProcess) -> None:
    """Local: SIGKILL of the worker. Ray: SIGKILL of its actor's process (as when its node
    dies), which the worker does not outlive."""
    backend = backend_router.preset.stem
    pid = int(models(backend_router)["alpha"]["pid"])  # type: ignore[call-overload]
    victim = psutil.Process(pid)
    if backend == "ray":
        parent = victim.parent()
        assert parent is not None
        victim = parent
    kill_mid_stream(backend_router, "alpha", victim)
    state = models(backend_router)["alpha"]
    assert state["state"] == "failed" and state["failures"] == 1
    if backend == "local":
        assert state["exit_code"] == -9
    else:
        assert "Ray actor died" in str(state["error"])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(pid)  # the worker did not outlive its actor
    assert chat(backend_router, "alpha").status_code == 200, backend_router.tail()
    assert models(backend_router)["alpha"]["pid"] != pid


def test_a_workers_log_phases_and_failure_tail_reach_the_router(
        backend_router: RouterProcess) -> None:
    """Wherever the worker runs: its log is served by the router, its load's engine phases
    are there when the load returns, and a crash's error ends with the log's last lines."""
    r = backend_router
    reply = r.client.post(f"{r.url}/v1/models/load", json={"model": "beta"}, timeout=600)
    assert reply.status_code == 200, reply.text
    phases = models(r)["beta"]["load_phases"]
    assert {"weights", "kv_cache_and_warmup"} <= set(phases), phases  # type: ignore[arg-type]
    lines = r.client.get(f"{r.url}/v1/models/beta/logs", params={"lines": 1000}).json()["data"]
    assert any("Loading weights took" in line for line in lines), lines[-20:]
    # The worker itself dies (its Ray actor lives on to report the exit code).
    pid = int(models(r)["beta"]["pid"])  # type: ignore[call-overload]
    psutil.Process(pid).kill()
    deadline = time.monotonic() + 30
    while (state := models(r)["beta"])["state"] != "failed" or "\n" not in str(state["error"]):
        assert time.monotonic() < deadline, state
        time.sleep(0.1)
    assert state["exit_code"] == -9, state
    reason, tail = str(state["error"]).split("\n", 1)
    assert "exited unexpectedly with code -9" in reason
    assert set(tail.splitlines()) & set(lines), (tail, lines[-20:])
    assert chat(r, "beta").status_code == 200, r.tail()  # a request starts it again


def test_router_sigkill_leaves_no_worker(backend_router: RouterProcess) -> None:
    """Last: it kills the module's router. Every worker, its engine processes and (Ray)
    its actor process are gone soon after."""
    listed = models(backend_router)
    workers = [psutil.Process(int(listed[m]["pid"]))  # type: ignore[call-overload]
               for m in ("alpha", "beta") if listed[m].get("pid")]
    assert len(workers) == 2
    watched = [p for w in workers for p in (w, *w.children(recursive=True))]
    if backend_router.preset.stem == "ray":
        watched += [p for w in workers if (p := w.parent()) is not None]
    assert backend_router.proc is not None
    backend_router.proc.kill()
    backend_router.proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alive = [p for p in watched if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            break
        time.sleep(0.2)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
