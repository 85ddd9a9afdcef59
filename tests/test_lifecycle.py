"""Model lifecycle with real vLLM workers: load/unload, eviction, idle reaping, crashes.

One router with ``max_loaded_models: 1`` serves this module. Each worker start costs
about 40 s here, so the tests are ordered to reuse what is loaded.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import socket
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import RouterProcess, kill_mid_stream, running_router

pytestmark = pytest.mark.integration
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]

LIFE_PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  max_loaded_models: 1
  load_timeout: 600
  max_queue_depth: 500
  send_timeout: 2
  send_buffer_bytes: 65536
  spare_workers: 2   # 20 loads in a row use them up faster than one is replaced
  max_parked_models: 0  # this module's swaps are stops (parking: tests/test_parking*.py)
models:
  blinky: {model: "builtin:smollm2", ttl: 1, max_model_len: 512}
  swap-a: {model: "builtin:smollm2", max_model_len: 512}
  swap-b: {model: "builtin:smollm2", max_model_len: 512}
"""


@pytest.fixture(scope="module")
def life(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with running_router(LIFE_PRESET, tmp_path_factory.mktemp("life"), "life") as r:
        yield r


def models(r: RouterProcess) -> dict[str, dict]:  # type: ignore[type-arg]
    return {m["id"]: m for m in r.client.get(f"{r.url}/v1/models").json()["data"]}


def chat(r: RouterProcess, model: str, client: httpx.Client | None = None,
         **kw) -> httpx.Response:  # type: ignore[no-untyped-def]
    body = {"model": model, "messages": STORY, "max_tokens": 4, **kw}
    return (client or httpx).post(f"{r.url}/v1/chat/completions", json=body, timeout=600)


def test_load_and_unload_are_idempotent_and_visible(life: RouterProcess) -> None:
    first = httpx.post(f"{life.url}/v1/models/load", json={"model": "swap-a"}, timeout=600)
    again = httpx.post(f"{life.url}/v1/models/load", json={"model": "swap-a"}, timeout=600)
    assert first.status_code == again.status_code == 200, life.tail()
    assert first.json()["state"] == again.json()["state"] == "ready"
    assert first.json()["pid"] == again.json()["pid"] == models(life)["swap-a"]["pid"]
    assert models(life)["swap-a"]["load_seconds"] > 0
    for _ in range(2):
        out = httpx.post(f"{life.url}/v1/models/unload", json={"model": "swap-a"}, timeout=120)
        assert out.status_code == 200 and out.json()["state"] == "unloaded"
    assert models(life)["swap-a"]["state"] == "unloaded" and "pid" not in models(life)["swap-a"]
    assert httpx.post(f"{life.url}/v1/models/load", json={"model": "nope"}).status_code == 404


def test_a_load_shows_its_phases_and_a_spare_takes_the_next(life: RouterProcess) -> None:
    """A spare worker (vLLM imported, no model) becomes the next model's worker; the load
    then spends nothing on imports, and a new spare is started for the one after."""
    wait_spare(life)
    health = life.client.get(f"{life.url}/health").json()
    spare = next(s["pid"] for s in health["spares"] if s["ready"])
    # The zygote, whose imports every spare forked from it shares, runs at the lowest
    # priority, so its imports took only the CPU that loaded models left idle; a spare
    # forked from it (it only waits) is back at the router's.
    router_nice = os.getpriority(os.PRIO_PROCESS, life.proc.pid)  # type: ignore[union-attr]
    assert health["zygote"]["ready"] and set(thread_nices(health["zygote"]["pid"])) == {19}
    assert psutil.Process(spare).ppid() == health["zygote"]["pid"]
    assert set(thread_nices(spare)) == {router_nice}
    httpx.post(f"{life.url}/v1/models/load", json={"model": "swap-a"}, timeout=600)
    phases = models(life)["swap-a"]["load_phases"]
    assert phases["spare"] < 1 and phases["imports"] == 0, phases
    # The spare became the worker, back at the router's priority on every thread.
    assert models(life)["swap-a"]["pid"] == spare
    assert set(thread_nices(spare)) == {router_nice}
    assert {"model_files", "engine", "weights", "kv_cache_and_warmup"} <= set(phases)
    assert sum(v for k, v in phases.items() if k not in ("weights", "kv_cache_and_warmup")) \
        <= models(life)["swap-a"]["load_seconds"] + 0.01
    wait_spare(life)  # its replacement


def thread_nices(pid: int) -> list[int]:
    """The nice value of each thread of ``pid`` (field 19 of /proc/PID/task/TID/stat)."""
    nices = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            nices.append(int(f.read().rsplit(")", 1)[1].split()[16]))
    return nices


def wait_spare(r: RouterProcess, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any(s["ready"] for s in r.client.get(f"{r.url}/health").json()["spares"]):
        assert time.monotonic() < deadline, "no spare worker became ready"
        time.sleep(0.2)


def test_keep_alive_0_stops_the_model_after_its_request(life: RouterProcess) -> None:
    assert chat(life, "swap-a", keep_alive=0).status_code == 200
    ended = time.monotonic()
    while models(life)["swap-a"]["state"] != "unloaded":
        assert time.monotonic() - ended < 3, models(life)["swap-a"]  # reaper 50 ms + stop
        time.sleep(0.05)
    assert chat(life, "swap-a", keep_alive="10m").status_code == 200
    assert models(life)["swap-a"]["keep_alive"] == 600


def test_20_loads_and_stops_leave_no_process_behind(life: RouterProcess) -> None:
    """Each stop takes well under a second and leaves nothing of the worker (nor vLLM's
    EngineCore and executor); what remains besides loaded workers are the spares and the
    zygote they are forked from."""
    assert life.proc is not None
    router = psutil.Process(life.proc.pid)
    for i in range(10):  # 20 loads in all: each evicts (stops) the one before
        for model in ("swap-b", "swap-a"):
            r = httpx.post(f"{life.url}/v1/models/load", json={"model": model}, timeout=600)
            assert r.status_code == 200, (i, model, life.tail())
    httpx.post(f"{life.url}/v1/models/unload", json={"model": ["swap-a", "swap-b"]},
               timeout=60)
    stops = [float(line.rsplit("stopped in ", 1)[1].split()[0])
             for line in life.tail(4000).splitlines() if "stopped in " in line]
    assert len(stops) >= 20 and max(stops[-20:]) < 1.0, stops
    health = life.client.get(f"{life.url}/health").json()
    spares = {s["pid"] for s in health["spares"]} | {health["zygote"]["pid"]}
    left = [p for p in router.children(recursive=True) if p.pid not in spares]
    _, alive = psutil.wait_procs(left, timeout=5)
    assert not alive, [(p.pid, p.cmdline()[:4]) for p in alive]


def test_alternating_models_under_max_loaded_1_never_cuts_a_stream(life: RouterProcess) -> None:
    loaded_counts: list[int] = []
    stop_sampling = threading.Event()

    def sample() -> None:
        while not stop_sampling.is_set():
            states = [m["state"] for m in models(life).values()]
            loaded_counts.append(sum(s in ("ready", "loading", "stopping") for s in states))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with httpx.stream("POST", f"{life.url}/v1/chat/completions", timeout=600, json={
                "model": "swap-a", "messages": STORY, "max_tokens": 120, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                other = pool.submit(chat, life, "swap-b")  # needs swap-a's slot
                events = [json.loads(line[6:]) for line in lines
                          if line.startswith("data: {")]
                assert events[-1]["usage"]["completion_tokens"] == 120  # stream not cut
                assert other.result().status_code == 200, life.tail()
        assert chat(life, "swap-a").status_code == 200   # and back again
        assert chat(life, "swap-b").status_code == 200
    finally:
        stop_sampling.set()
        sampler.join()
    assert max(loaded_counts) == 1, loaded_counts


def test_reaped_after_ttl_but_not_while_a_stream_is_open(life: RouterProcess) -> None:
    # The stream is read for 6 s (it would last 9 s at 50 tokens/s, 30 s at 14), then the
    # client leaves, which also releases the lease. The state is read at most every 0.5 s:
    # a read per line made the client fall behind the stream, so it read "stopping" for
    # lines the server had sent (and released its lease after) more than the ttl earlier.
    checks: list[tuple[float, str]] = []
    with httpx.stream("POST", f"{life.url}/v1/chat/completions", timeout=600, json={
            "model": "blinky", "messages": STORY, "max_tokens": 450, "stream": True,
            "ignore_eos": True}) as r:
        started = None
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            if started is None:
                started = now
            elif now - started > 6:
                break
            elif now - started > 2.5 and (not checks or now - checks[-1][0] > 0.5):
                checks.append((now, models(life)["blinky"]["state"]))  # ttl is 1 s
        last_token = time.monotonic()
    assert checks and last_token - checks[0][0] > 1, (started, checks, last_token)
    assert [state for _, state in checks] == ["ready"] * len(checks)
    ended = time.monotonic()
    while models(life)["blinky"]["state"] == "ready" and time.monotonic() - ended < 5:
        time.sleep(0.05)
    reaped_after = time.monotonic() - ended
    assert reaped_after < 1.5, reaped_after  # ttl 1 s, checked every 50 ms
    while models(life)["blinky"]["state"] == "stopping" and time.monotonic() - ended < 30:
        time.sleep(0.1)  # vLLM's graceful shutdown takes a few seconds
    assert models(life)["blinky"]["state"] == "unloaded"


def test_200_requests_racing_a_1_second_ttl_all_succeed(life: RouterProcess) -> None:
    rng = random.Random(1234)
    statuses: list[int] = []
    pids: set[int] = set()
    limits = httpx.Limits(max_connections=20, max_keepalive_connections=20)
    with concurrent.futures.ThreadPoolExecutor(20) as pool, \
            httpx.Client(limits=limits, timeout=600) as client:
        for _ in range(10):
            # Arrive near the moment the model's 1 s of idleness runs out: mostly just
            # before it, sometimes just after, so requests meet the reaper mid-decision.
            # Each late round pays a restart (~45 s here), hence not more of them. (One
            # pooled client: a client per request delayed arrivals by ~0.3 s.)
            time.sleep(rng.uniform(0.8, 1.02))
            batch = [pool.submit(chat, life, "blinky", client, max_tokens=1)
                     for _ in range(20)]
            statuses += [f.result().status_code for f in batch]
            pid = models(life)["blinky"].get("pid")
            if pid:
                pids.add(pid)
    assert statuses == [200] * 200, life.tail()
    assert len(pids) >= 1


def test_50_streams_that_never_read_are_ended_and_free_the_model(life: RouterProcess) -> None:
    """Issue 8, defect 3: a client that stopped reading pinned its model (no write timeout,
    the lease held for ever) while the router buffered its stream without bound."""
    router = psutil.Process(life.proc.pid)  # type: ignore[union-attr]
    chat(life, "blinky", max_tokens=1)  # loaded, so start-up memory is not counted
    base = router.memory_info().rss
    body = json.dumps({"model": "blinky", "messages": STORY, "max_tokens": 400,
                       "stream": True, "logprobs": True, "top_logprobs": 20,
                       "ignore_eos": True}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
               b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    readers = []
    for _ in range(50):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that never reads
        s.connect(("127.0.0.1", life.port))
        s.sendall(request)
        readers.append(s)
    peak, deadline = base, time.monotonic() + 240
    seen = 0  # the most requests in flight at once: the router may not have read them yet
    while True:
        peak = max(peak, router.memory_info().rss)
        in_flight = models(life)["blinky"]["in_flight"]
        seen = max(seen, in_flight)
        if (seen and in_flight == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert models(life)["blinky"]["in_flight"] == 0, life.tail()
    assert peak - base < 64 * 2**20, f"router grew by {(peak - base) >> 20} MiB"
    for s in readers:
        s.settimeout(10)
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
        s.close()
        assert data.startswith(b"HTTP/1.1 200") and b"data: {" in data
        # cut off: the stream did not end as a finished one
        assert b"[DONE]" not in data, f"{len(data)} bytes, all of the stream"
    log = life.log_path.read_text(errors="replace")
    assert log.count("status=408") >= 50, life.tail()
    started = time.monotonic()
    while models(life)["blinky"]["state"] != "unloaded":  # reaped at its 1 s ttl
        assert time.monotonic() - started < 10, models(life)["blinky"]
        time.sleep(0.1)


def test_kill_9_mid_stream_ends_every_client_and_the_next_request_restarts(
        life: RouterProcess) -> None:
    assert chat(life, "swap-a").status_code == 200
    pid = models(life)["swap-a"]["pid"]
    kill_mid_stream(life, "swap-a", psutil.Process(pid))
    state = models(life)["swap-a"]
    assert state["state"] == "failed" and state["exit_code"] == -9 and state["failures"] == 1
    assert chat(life, "swap-a").status_code == 200, life.tail()
    assert models(life)["swap-a"]["pid"] != pid


ORPHAN_PRESET = """
server: {host: 127.0.0.1, port: {port}}
models:
  solo: {model: "builtin:smollm2", load_on_startup: true, max_model_len: 512}
"""


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_no_worker_or_engine_process_outlives_the_router(tmp_path_factory: pytest.TempPathFactory,
                                                         how: str) -> None:
    r = RouterProcess(ORPHAN_PRESET, tmp_path_factory.mktemp("orphans"), "orphans")
    r.start()
    try:
        r.wait_healthy()
        r.wait_model("solo", timeout=600)
        assert r.proc is not None
        tree = psutil.Process(r.proc.pid).children(recursive=True)
        assert len(tree) >= 2  # the worker and vLLM's EngineCore at least
        if how == "SIGTERM":
            r.proc.terminate()
        else:
            r.proc.kill()
        r.proc.wait(60)
        _, alive = psutil.wait_procs(tree, timeout=15)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        r.stop()


FRESH_PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  cache_dir: {cache}
  load_timeout: 400
models:
  fresh:
    model: "builtin:smollm2"
    max_model_len: 512
    load_on_startup: true
"""


def test_a_first_start_with_an_empty_cache_converts_the_model_and_serves(
        tmp_path: Path) -> None:
    """`make serve` on a new machine: the embedded model is converted into the empty cache
    by the worker's first start, which then serves. The conversion used to run in the
    worker, whose forked engine processes then hung forever after its OpenMP threads."""
    cache = tmp_path / "cache"
    cache.mkdir()
    with running_router(FRESH_PRESET, tmp_path, "fresh", {"cache": str(cache)}) as r:
        r.wait_model("fresh", timeout=400)
        assert list(cache.rglob("config.json")), "no converted model in the cache"
        reply = chat(r, "fresh")
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] > 0
