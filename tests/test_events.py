"""The event bus, ``GET /v1/events`` and ``GET /v1/models/{id}/logs``.

Units: the bus (replay, a slow subscriber loses its oldest events and is told, publishing
never waits), who sees a batch's events, the log follower (last lines, appended lines, a replaced or truncated log),
which paths need a key. Integration: one router (``max_loaded_models: 1``, two ids of the
embedded model) and two model starts: a load's state changes and phases, a request's
summary, an eviction with its reason, and a worker log's last lines then a live line.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from router.api.events import LogFollower, last_lines
from router.app import build_app
from router.observe.events import EventBus
from shared.preset_loader import build_preset, parse_yaml
from tests.conftest import RouterProcess, router_with_runtime

# -- the bus -----------------------------------------------------------------------------


def test_subscribers_get_events_in_order_and_new_ones_the_recent_first() -> None:
    async def scenario() -> None:
        bus = EventBus(history=3)
        early = bus.subscribe()
        for n in range(5):
            bus.publish("state", f"m{n}", state="ready", pid=n)
        got = [await early.get() for _ in range(5)]
        assert [e["model"] for e in got] == ["m0", "m1", "m2", "m3", "m4"]
        assert [e["id"] for e in got] == [1, 2, 3, 4, 5]
        assert got[0]["type"] == "state" and got[0]["pid"] == 0 and got[0]["time"] > 0
        late = bus.subscribe()
        assert [(await late.get())["model"] for _ in range(3)] == ["m2", "m3", "m4"]
        assert await late.get(timeout=0.01) is None  # nothing more
        assert [e["model"] for e in bus.recent] == ["m2", "m3", "m4"]
        fresh = bus.subscribe(replay=False)
        bus.publish("load", "m5")
        assert (await fresh.get())["model"] == "m5"
        early.close()
        late.close()
        fresh.close()
        assert bus.subscribers == 0

    asyncio.run(scenario())


def test_an_event_published_with_its_fields_later_reads_the_same_as_one_made_at_once() -> None:
    """``publish_with`` (every request's event) makes the dict only when someone reads
    it; its id, time and order are the publish's, and it reads as ``publish`` would."""

    async def scenario() -> None:
        bus = EventBus(history=3)
        made: list[int] = []

        def fields(n: int) -> dict[str, Any]:
            made.append(n)
            return {"n": n}

        bus.publish("state", "m0", state="ready")
        before = time.time()
        bus.publish_with("request", "m1", fields, 1)
        bus.publish_with("request", "m2", fields, 2)
        assert made == []  # nobody has read them
        assert [(e["type"], e["id"], e["model"], e.get("n")) for e in bus.recent] == [
            ("state", 1, "m0", None), ("request", 2, "m1", 1), ("request", 3, "m2", 2)]
        assert before - 0.001 <= bus.recent[1]["time"] <= time.time() + 0.001  # ms, rounded
        assert made == [1, 2]  # once each, however often read
        listening = bus.subscribe(replay=False)
        bus.publish_with("request", "m3", fields, 3)
        assert made == [1, 2, 3]  # a subscriber gets it made at once
        got = await listening.get()
        assert got is not None and (got["id"], got["n"]) == (4, 3)
        assert bus.recent[-1] is got
        listening.close()

    asyncio.run(scenario())


def test_a_slow_subscriber_loses_its_oldest_events_and_never_blocks_the_publisher() -> None:
    async def scenario() -> None:
        bus = EventBus(history=10, queue_size=10)
        slow = bus.subscribe()
        fast = bus.subscribe()
        taken = []

        async def keep_up() -> None:
            while len(taken) < 5000:
                event = await fast.get()
                assert event is not None
                taken.append(event["id"])

        reader = asyncio.create_task(keep_up())
        began = time.perf_counter()
        for n in range(5000):
            bus.publish("request", "m", n=n)  # synchronous: nothing here can wait
            if n % 10 == 9:
                await asyncio.sleep(0)  # let the fast reader take its events
        assert time.perf_counter() - began < 2.0
        await asyncio.wait_for(reader, 5)
        assert taken == list(range(1, 5001))  # the fast one lost nothing
        assert fast.dropped_total == 0
        told = await slow.get()
        assert told is not None and told["type"] == "dropped" and told["count"] == 4990
        rest = [await slow.get() for _ in range(10)]
        assert [e["n"] for e in rest if e] == list(range(4990, 5000))  # the newest kept
        assert await slow.get(timeout=0.01) is None

    asyncio.run(scenario())


# -- the log follower --------------------------------------------------------------------


def test_last_lines_and_following_a_log_that_grows_and_is_replaced(tmp_path: Path) -> None:
    log = tmp_path / "m.log"
    assert last_lines(log, 5) == ([], 0, 0)  # not there yet
    follower = LogFollower(log, 0, 0)
    assert follower.read() == []
    log.write_text("".join(f"line {n}\n" for n in range(100)) + "partial")
    lines, offset, inode = last_lines(log, 3)
    assert lines == ["line 97", "line 98", "line 99"]
    assert last_lines(log, 0)[0] == []
    follower = LogFollower(log, offset, inode)
    assert follower.read() == []  # the partial line waits for its end
    with open(log, "a") as f:
        f.write(" ends here\nnext\n")
    assert follower.read() == ["partial ends here", "next"]
    assert follower.read() == []
    log.unlink()  # a new worker's log: another file at the same path
    log.write_text("fresh 1\nfresh 2\n")
    assert follower.read() == ["fresh 1", "fresh 2"]
    log.write_text("cut\n")  # truncated in place
    assert follower.read() == ["cut"]


# -- who sees which events ---------------------------------------------------------------


def test_a_batch_event_is_its_owners_and_an_unlimited_admins_or_viewers() -> None:
    """As per-key metrics: a user sees its own batches' events, an admin or a viewer all,
    unless held to some models (another key's batch may run any model)."""
    from router.access.admission import Principal
    from router.access.key_store import KeySpec
    from router.api.events import seen_by

    bus = EventBus()
    event = bus.publish("batch", None, action="progress", batch="batch_1", key="key-alice",
                        status="in_progress", total=4, done=1)
    alice, bob = Principal("key-alice", "user"), Principal("key-bob", "user")
    assert seen_by(event, alice) == event
    assert seen_by(event, bob) is None
    assert seen_by(event, Principal("key-admin", "admin")) == event
    assert seen_by(event, Principal("key-viewer", "viewer")) == event
    held = KeySpec(models=["m*"])
    assert seen_by(event, Principal("key-viewer", "viewer", held)) is None
    assert seen_by(event, Principal("key-alice", "user", held)) == event


# -- which paths need a key --------------------------------------------------------------

KEYED_PRESET = """
server: {runtime_dir: "%s", api_keys: [sekret]}
models:
  synth: {model: none, engine: synthetic}
"""


def test_the_page_is_open_and_what_it_calls_needs_the_key(tmp_path: Path) -> None:
    runtime = Path(tempfile.mkdtemp(prefix="my-keys-"))
    try:
        app = build_app(build_preset(parse_yaml(KEYED_PRESET % runtime, "k.yaml"), "k.yaml"))
        client = TestClient(app)  # no lifespan: no worker starts
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="/static/status.js"' in page.text
        for asset in ("/static/status.js", "/static/status.css"):
            assert client.get(asset).status_code == 200, asset
        assert client.get("/static/nope.js").status_code == 404
        for path in ("/v1/events", "/v1/models/synth/logs", "/static/../v1/events"):
            got = client.get(path)
            assert got.status_code in (401, 404), (path, got.status_code)
            if path != "/static/../v1/events":
                assert got.status_code == 401 and got.json()["error"]["code"] == "invalid_api_key"
        auth = {"Authorization": "Bearer sekret"}
        assert client.get("/v1/events", headers=auth).json() == {"object": "list", "data": []}
        assert client.get("/v1/events?replay=", headers=auth).status_code == 400
        logs = client.get("/v1/models/synth/logs?lines=5", headers=auth)
        assert logs.json() == {"object": "list", "model": "synth", "data": []}
        missing = client.get("/v1/models/nope/logs", headers=auth)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        for bad in ("lines=-1", "lines=x", "lines=10001", "follow=maybe", "follow=",
                    "follow=TRUE"):
            got = client.get(f"/v1/models/synth/logs?{bad}", headers=auth)
            assert got.status_code == 400, bad
            assert got.json()["error"]["param"] == bad.split("=")[0]
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


# -- a real router -----------------------------------------------------------------------

EVENTS_PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  runtime_dir: {runtime}
  max_loaded_models: 1
  max_parked_models: 0  # an eviction that stops (a park's events: tests/test_parking.py)
  load_timeout: 600
models:
  ev-a: {model: "builtin:smollm2", max_model_len: 512}
  ev-b: {model: "builtin:smollm2", max_model_len: 512}
"""


class SSEReader:
    """Reads a server-sent event stream in a thread: ``(event name, data)`` pairs, in
    order, with the time each arrived."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.events: list[tuple[str, Any, float]] = []
        self.status = 0
        self._client = httpx.Client(timeout=httpx.Timeout(5, read=None))
        self._closed = False
        self._thread = threading.Thread(target=self._read, args=(url, headers or {}),
                                        daemon=True)
        self._thread.start()

    def _read(self, url: str, headers: dict[str, str]) -> None:
        try:
            with self._client.stream("GET", url, headers=headers) as response:
                self.status = response.status_code
                name = "message"
                for line in response.iter_lines():
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: "):
                        self.events.append((name, json.loads(line[6:]), time.monotonic()))
                        name = "message"
        except httpx.HTTPError:
            if not self._closed:  # an error before we closed it is the test's failure
                raise

    def wait_for(self, test: Callable[[list[tuple[str, Any, float]]], bool],
                 timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not test(self.events):
            assert time.monotonic() < deadline, self.events[-10:]
            assert self._thread.is_alive(), ("stream ended", self.status, self.events[-10:])
            time.sleep(0.05)

    def close(self) -> None:
        self._closed = True
        self._client.close()
        self._thread.join(5)


@pytest.fixture(scope="module")
def events_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with router_with_runtime(EVENTS_PRESET, tmp_path_factory.mktemp("events"), "events") as r:
        yield r


@pytest.mark.integration
def test_events_and_logs_of_a_load_a_request_and_an_eviction(
        events_router: RouterProcess) -> None:
    r = events_router
    runtime = Path(r.preset.read_text().split("runtime_dir: ", 1)[1].split()[0])
    stream = SSEReader(r.url + "/v1/events", {"Accept": "text/event-stream"})
    stream.wait_for(lambda evs: any(name == "hello" for name, _, _ in evs), 10)
    try:
        loaded = r.client.post(f"{r.url}/v1/models/load", json={"model": "ev-a"}, timeout=600)
        assert loaded.status_code == 200, r.tail()
        pid_a = loaded.json()["pid"]
        chat = r.client.post(f"{r.url}/v1/chat/completions", timeout=120, json={
            "model": "ev-a", "max_tokens": 5,
            "messages": [{"role": "user", "content": "Say hello."}]})
        assert chat.status_code == 200, chat.text
        usage = chat.json()["usage"]

        # The worker log: the last 3 lines now, then what the worker writes next.
        log_path = runtime / "ev-a.log"
        plain = r.client.get(f"{r.url}/v1/models/ev-a/logs?lines=3").json()
        assert plain["data"] == log_path.read_text().splitlines()[-3:]
        follow = SSEReader(f"{r.url}/v1/models/ev-a/logs?lines=3&follow=1")
        follow.wait_for(lambda evs: len(evs) >= 3, 10)
        assert [e[1]["line"] for e in follow.events[:3]] == plain["data"]
        time.sleep(0.5)
        assert len(follow.events) == 3  # nothing was written meanwhile

        # ev-b does not fit beside ev-a: ev-a is evicted (its worker logs its stop).
        swapped = r.client.post(f"{r.url}/v1/models/load", json={"model": "ev-b"}, timeout=600)
        assert swapped.status_code == 200, r.tail()
        follow.wait_for(lambda evs: any("model ev-a: stopping" in e[1]["line"] for e in evs), 30)
        assert all(e[0] == "line" and e[1]["model"] == "ev-a" for e in follow.events)
        follow.close()

        stream.wait_for(lambda evs: any(name == "load" and e["model"] == "ev-b"
                                        for name, e, _ in evs), 30)
        live = [e for name, e, _ in stream.events if name not in ("hello", "activity")]
        assert all(e["type"] == name for name, e, _ in stream.events)
        ids = [e["id"] for e in live]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)

        def states(model: str) -> list[str]:
            return [e["state"] for e in live if e["type"] == "state" and e["model"] == model]

        assert states("ev-a") == ["loading", "loading", "ready", "stopping", "unloaded"]
        assert states("ev-b")[-1] == "ready"
        ready = next(e for e in live if e["type"] == "state" and e["state"] == "ready"
                     and e["model"] == "ev-a")
        assert ready["pid"] == pid_a
        load = next(e for e in live if e["type"] == "load" and e["model"] == "ev-a")
        assert load["pid"] == pid_a and load["load_seconds"] > 0
        assert {"model_files", "engine", "weights", "kv_cache_and_warmup"} <= set(
            load["load_phases"]), load
        assert load["load_seconds"] == r.client.get(
            f"{r.url}/v1/models/ev-a").json()["load_seconds"]

        request = next(e for e in live if e["type"] == "request")
        assert request["model"] == "ev-a" and request["endpoint"] == "chat"
        assert request["status"] == 200 and request["stream"] is False
        assert request["prompt_tokens"] == usage["prompt_tokens"]
        assert request["completion_tokens"] == usage["completion_tokens"]
        assert 0 < request["ttft_ms"] <= request["total_ms"] and request["decode_tps"] > 0

        eviction = next(e for e in live if e["type"] == "eviction")
        assert eviction["model"] == "ev-a" and eviction["for"] == "ev-b"
        assert eviction["action"] == "stop" and "expected cost" in eviction["reason"]
        assert eviction["reason"] in r.tail(400)  # the same words as the log line
        order = [(e["type"], e["model"], e.get("state")) for e in live]
        assert (order.index(("eviction", "ev-a", None))
                < order.index(("state", "ev-a", "unloaded"))
                < order.index(("state", "ev-b", "ready")))
        # The counts of in-flight and queued requests end at 0.
        activity = [e["activity"]["ev-a"] for name, e, _ in stream.events
                    if name in ("hello", "activity")]
        assert activity[-1] == {"in_flight": 0, "queued": 0}

        # A new subscriber first gets the recent events, marked, then "hello".
        again = SSEReader(r.url + "/v1/events", {"Accept": "text/event-stream"})
        again.wait_for(lambda evs: any(name == "hello" for name, _, _ in evs), 10)
        replayed = [e for name, e, _ in again.events if name != "hello"]
        again.close()
        assert [e["id"] for e in replayed] == ids[-len(replayed):]
        assert all(e["replayed"] for e in replayed)
        recent = r.client.get(f"{r.url}/v1/events").json()["data"]
        assert [e["id"] for e in recent][-len(ids):] == ids
    finally:
        stream.close()
    assert os.path.exists(runtime / "ev-b.log")
