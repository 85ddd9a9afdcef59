"""Who gets room, and when, without any process: the supervisor's own decisions with a
stand-in for the worker start (a model is ``ready`` the moment it has room).

Pinned models stay, the line for room goes by priority, a model in use keeps its room
until a waiter has waited ``swap_wait`` (then requests are served model by model, not one
swap each), eviction takes the cheapest model to reload, and a request's ``keep_alive``
replaces the idle ttl.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from router.api.openai.schema import keep_alive_seconds
from router.errors import BadRequest, ModelUnavailable
from router.lifecycle.policy.idle import idle_limit
from router.lifecycle.supervisor import Supervisor
from router.registry import ModelEntry, ModelRegistry
from router.workers.placement import GIB, GpuMemory, Placer
from shared.preset_loader import build_preset


class FakeLink:
    busy = False


def supervisor(tmp_path: Path, models: dict[str, dict[str, Any]], placer: Placer | None = None,
               stop_seconds: float = 0.01, **server: Any) -> tuple[Supervisor, list[str]]:
    """A supervisor whose loads never start a process (ready after 10 ms) and whose stops
    take ``stop_seconds`` (a drain, a worker's exit); the returned list records the loads
    in order."""
    server = {"max_loaded_models": 1, "spare_workers": 0, "max_parked_models": 0, **server}
    preset = build_preset({"server": server,
                           "models": {k: {"model": f"/{k}", **v} for k, v in models.items()}})
    sup = Supervisor(ModelRegistry(preset), preset.server, tmp_path,
                     placer or Placer(cores={0}, gpus={}))
    loads: list[str] = []

    async def spawn(entry: ModelEntry) -> Any:
        loads.append(entry.id)
        await asyncio.sleep(0.01)
        pid = 1000 + len(loads)
        worker = SimpleNamespace(number=0, handle=SimpleNamespace(pids=lambda: {pid}),
                                 link=FakeLink(), busy=False)
        sup.add_worker(entry, worker)  # type: ignore[arg-type]
        entry.state, entry.replica = "ready", worker
        entry.loaded_at, entry.last_used, entry.load_seconds = time.time(), time.monotonic(), 5
        return worker.link

    async def finish_stop(entry: ModelEntry, worker: Any, force: bool = False,
                          grace: float = 1.0) -> None:
        await asyncio.sleep(stop_seconds)
        sup.remove_worker(entry, worker)
        entry.state, entry.replica, entry.yield_to = "unloaded", None, None

    sup._spawn = spawn  # type: ignore[method-assign]
    sup._finish_stop = finish_stop  # type: ignore[method-assign]
    return sup, loads


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_pinned_model_is_never_evicted_or_reaped(tmp_path: Path) -> None:
    sup, loads = supervisor(tmp_path, {"p": {"pinned": True, "ttl": 0.05}, "q": {}},
                            load_timeout=0.5)

    async def go() -> None:
        sup.start()
        lease, _ = await sup.acquire("p")
        lease.release()
        await asyncio.sleep(0.3)  # past its ttl, idle: still there
        assert sup.registry.entries["p"].state == "ready"
        with pytest.raises(ModelUnavailable, match="within 0.5 s"):
            await sup.acquire("q")
        assert sup.registry.entries["p"].state == "ready" and loads == ["p"]

    run(go())


def test_the_line_for_room_goes_by_priority(tmp_path: Path) -> None:
    sup, loads = supervisor(tmp_path, {"a": {}, "low": {}, "high": {"priority": 5}})

    async def go() -> None:
        held, _ = await sup.acquire("a")  # in use: nobody evicts it
        low = asyncio.create_task(sup.acquire("low"))
        await asyncio.sleep(0.1)
        high = asyncio.create_task(sup.acquire("high"))  # asks later, goes first
        await asyncio.sleep(0.1)
        held.release()
        lease, _ = await high
        assert loads == ["a", "high"] and not low.done()
        lease.release()
        (await low)[0].release()
        assert loads == ["a", "high", "low"]

    run(go())


def test_requests_are_grouped_by_model_and_no_one_starves(tmp_path: Path) -> None:
    """Two closed-loop clients, one per model, one room: each model serves its client for
    about ``swap_wait`` before the other takes the room, and no request waits much longer
    (on every request, one swap each would be ABAB...)."""
    sup, loads = supervisor(tmp_path, {"a": {}, "b": {}}, swap_wait=0.4)
    waits: dict[str, list[float]] = {"a": [], "b": []}

    async def client(name: str, until: float) -> None:
        while time.monotonic() < until:
            asked = time.monotonic()
            lease, _ = await sup.acquire(name)
            waits[name].append(time.monotonic() - asked)
            await asyncio.sleep(0.02)  # the request's work
            lease.release()

    async def go() -> None:
        until = time.monotonic() + 3
        await asyncio.gather(client("a", until), client("b", until))

    run(go())
    assert 4 <= len(loads) <= 10, loads  # ~0.45 s per turn: grouped, not one swap per request
    assert all(x != y for x, y in itertools.pairwise(loads))  # alternating turns
    assert len(waits["a"]) + len(waits["b"]) > 10 * len(loads)  # many requests per load
    assert max(waits["a"] + waits["b"]) < 0.4 + 0.3  # swap_wait, a drain and a load


def test_a_model_yields_only_to_one_of_its_priority_or_higher(tmp_path: Path) -> None:
    sup, loads = supervisor(tmp_path, {"vip": {"priority": 5}, "b": {}}, swap_wait=0.1,
                            load_timeout=0.6)

    async def go() -> None:
        lease, _ = await sup.acquire("vip")
        busy = True

        async def vip_client() -> None:
            nonlocal lease
            while busy:  # a steady client: never idle for 2 s
                lease.release()
                lease, _ = await sup.acquire("vip")
                await asyncio.sleep(0.01)

        task = asyncio.create_task(vip_client())
        with pytest.raises(ModelUnavailable):
            await sup.acquire("b")  # waited past swap_wait: vip did not yield
        busy = False
        await task
        lease.release()
        assert loads == ["vip"]

    run(go())


def test_min_resident_holds_a_fresh_model(tmp_path: Path) -> None:
    sup, loads = supervisor(tmp_path, {"a": {"min_resident": 0.5}, "b": {}})

    async def go() -> None:
        lease, _ = await sup.acquire("a")
        lease.release()
        entry = sup.registry.entries["a"]
        entry.last_used -= 10  # idle long enough: only min_resident holds it
        began = time.monotonic()
        (await sup.acquire("b"))[0].release()
        assert time.monotonic() - began >= 0.4 and loads == ["a", "b"]

    run(go())


def test_eviction_takes_the_cheapest_model_to_reload(tmp_path: Path) -> None:
    """Of two idle models, the one asked for more often stays, though it was used longer
    ago (plain LRU would evict it)."""
    sup, _loads = supervisor(tmp_path, {"busy": {}, "rare": {}, "new": {}}, max_loaded_models=2)

    async def go() -> None:
        for _ in range(20):
            (await sup.acquire("busy"))[0].release()
        (await sup.acquire("rare"))[0].release()
        for entry in sup.registry:
            entry.last_used -= 10  # both idle, "busy" used before "rare"
        sup.registry.entries["busy"].last_used -= 1
        (await sup.acquire("new"))[0].release()
        assert sup.registry.entries["busy"].state == "ready"
        assert sup.registry.entries["rare"].state == "unloaded"
        assert sup.registry.entries["rare"].evictions == 1

    run(go())


def test_keep_alive_zero_stops_the_model_after_the_request(tmp_path: Path) -> None:
    sup, _ = supervisor(tmp_path, {"a": {}}, ttl=0)  # ttl 0: kept loaded for good

    async def go() -> None:
        sup.start()
        lease, _ = await sup.acquire("a")
        entry = sup.registry.entries["a"]
        entry.keep_alive = 0.0  # what the relay sets for keep_alive: 0
        await asyncio.sleep(0.2)
        assert entry.state == "ready"  # in use: not yet
        lease.release()
        await asyncio.sleep(0.2)
        assert entry.state == "unloaded"
        entry.keep_alive = -1
        assert idle_limit(entry, sup.server) is None  # negative: for good
        entry.keep_alive = 300
        assert idle_limit(entry, sup.server) == 300
        await sup.stop_all()

    run(go())


@pytest.mark.parametrize("given,seconds", [
    (None, None), (0, 0.0), (-1, -1.0), (30, 30.0), ("0", 0.0), ("-1", -1.0), ("10m", 600.0),
    ("1h30m", 5400.0), ("45s", 45.0), ("1.5s", 1.5), ("-1m", -60.0), ("250ms", 0.25),
])
def test_keep_alive_takes_ollamas_forms(given: Any, seconds: float | None) -> None:
    assert keep_alive_seconds(given) == seconds


@pytest.mark.parametrize("given", ["", "soon", "10 minutes", "1.2.3", "5d"])
def test_keep_alive_refuses_what_it_cannot_read(given: str) -> None:
    with pytest.raises(BadRequest) as info:
        keep_alive_seconds(given)
    assert info.value.param == "keep_alive"


def test_a_sleeping_gpu_model_counts_by_what_it_still_holds(tmp_path: Path) -> None:
    """GPU budget 80 GiB: a 50 GiB model asleep holds 2 GiB (NVML, faked), so two 30 GiB
    models load beside it; awake, one of them must go. Asleep models are the first to
    stop for room."""
    h100 = {0: GpuMemory(0, 80 * GIB, 79 * GIB)}
    readings: list[set[int]] = []

    def nvml(pids: set[int]) -> dict[int, float]:
        readings.append(pids)
        return {0: 2.0}

    gpu = {"device": "cuda", "gpus": [0], "idle_action": "sleep"}
    sup, loads = supervisor(tmp_path, {"big": {**gpu, "memory_gib": 50},
                                       "small": {**gpu, "memory_gib": 30},
                                       "third": {**gpu, "memory_gib": 30}},
                            Placer(cores={0}, gpus=h100, process_memory=nvml),
                            max_loaded_models=0, memory_budget_gib={"cuda:0": 80})

    async def go() -> None:
        (await sup.acquire("big"))[0].release()
        big = sup.registry.entries["big"]
        big.state = "sleeping"  # as the reaper leaves it (the fake has no worker to ask)
        (await sup.acquire("small"))[0].release()
        assert big.state == "sleeping" and readings == [{1001}]  # 2 + 30 <= 80: both stay
        sup.registry.entries["small"].last_used -= 10
        (await sup.acquire("third"))[0].release()  # 2 + 30 + 30 <= 80 as well
        assert big.state == "sleeping"
        sup.registry.entries["third"].last_used -= 10
        big.state = "ready"  # awake: 50 + 30 + 30 > 80
        sup.registry.entries["small"].state = "sleeping"
        big.last_used -= 10
        await sup.stop(sup.registry.entries["third"])
        (await sup.acquire("third"))[0].release()
        # room for 30 GiB: the asleep "small" goes first, though "big" was used longer ago
        assert sup.registry.entries["small"].state == "unloaded" and big.state == "ready"
        assert loads == ["big", "small", "third", "third"]

    run(go())


@pytest.mark.parametrize("streaming", [False, True])
def test_a_prompt_past_a_stopped_models_known_bound_evicts_nothing(
        tmp_path: Path, streaming: bool) -> None:
    """A prompt longer than the bound a model's worker gave when it last ran is refused
    before anything waits for that model. It was refused only once the model had room and a
    slot (6ae4ac0): a 30 MiB prompt for a stopped model evicted the one serving others,
    loaded its own, and was then refused. ``streaming`` with a keep-alive event is the
    Anthropic stream that begins before its model is ready."""
    from starlette.requests import Request

    from router.api.relay import Relay
    from shared.protocol import ChatMessage, Generate, SamplingSpec

    sup, loads = supervisor(tmp_path, {"a": {}, "b": {}})
    relay = Relay(sup)
    b = sup.registry.entries["b"]
    b.max_model_len, b.max_prompt_chars = 100, 6400  # what b's worker said when it ran
    huge = Generate(id="g", sampling=SamplingSpec(max_tokens=5),
                    messages=[ChatMessage(role="user", content="x" * 6401)])

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    async def go() -> None:
        sup.start()
        (await sup.acquire("a"))[0].release()
        request = Request({"type": "http", "method": "POST", "path": "/", "headers": []},
                          receive)
        with pytest.raises(BadRequest) as refused:
            await relay.generate(request, "chat", "b", [huge], streaming,
                                 lambda _: None,  # type: ignore[arg-type,return-value]
                                 keepalive=b": ping\n\n" if streaming else b"")
        assert refused.value.code == "context_length_exceeded"
        assert "(6401 characters)" in str(refused.value)
        assert loads == ["a"] and sup.registry.entries["a"].state == "ready"
        assert (b.state, b.queued, b.leases) == ("unloaded", 0, 0)
        assert relay.metrics.snapshot()["models"]["b"]["requests"] == {"chat": {"400": 1}}
        await sup.stop_all()

    run(go())
