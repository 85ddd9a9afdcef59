"""GPU park (issue 37) with real worker processes: GPU models (``device: cuda``) run the
``synthetic`` engine, NVML is faked (the placer's readings), and the engine records the
sleep level it was asked for (``engine_args.sleep_log``). No GPU, no vLLM: what is tested
is the router's choice and what it sends (``Sleep(level=1|2)``, ``Wake``), not vLLM's
sleep mode (``bench/gpu_park_probe.py`` measures what it costs on a GPU).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from router.errors import ModelUnavailable
from router.lifecycle.supervisor import Supervisor
from router.registry import ModelRegistry
from router.workers.placement import GIB, GpuMemory, Placer
from shared.preset_loader import build_preset
from shared.protocol import Generate, SamplingSpec
from tests.test_parking import run, statuses, until, use

H100 = {0: GpuMemory(0, 80 * GIB, 79 * GIB)}


def weights(tmp_path: Path, name: str, gib: float) -> str:
    """A model folder whose weights take ``gib`` on disk (sparse: nothing written)."""
    folder = tmp_path / name
    folder.mkdir()
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(int(gib * GIB))
    (folder / "config.json").write_text("{}")
    return str(folder)


def gpu_supervisor(tmp_path: Path, server: dict[str, Any] | None = None,
                   **models: dict[str, Any]) -> Supervisor:
    """GPU models on GPU 0 of a fake H100, each engine's sleeps written to
    ``<tmp>/<name>.sleeps``; a parked model's processes hold 1 GiB on it (fake NVML)."""
    preset = build_preset({
        "server": {"max_loaded_models": 1, "spare_workers": 0, "park_memory_gib": 3,
                   **(server or {})},
        "models": {name: {"model": "/synthetic", "engine": "synthetic", "device": "cuda",
                          "gpus": [0], **spec,
                          "engine_args": {"sleep_log": str(tmp_path / f"{name}.sleeps"),
                                          **spec.get("engine_args", {})}}
                   for name, spec in models.items()}})
    placer = Placer(cores={0}, gpus=H100, process_memory=lambda pids: {0: 1.0},
                    nvml=lambda: H100)
    return Supervisor(ModelRegistry(preset), preset.server, tmp_path, placer)


def sleeps(tmp_path: Path, name: str) -> list[str]:
    path = tmp_path / f"{name}.sleeps"
    return path.read_text().split("\n")[:-1] if path.exists() else []


@pytest.mark.parametrize(("weights_gib", "level"), [(1.0, 1), (2.0, 2)])
def test_a_gpu_model_parks_at_the_level_host_memory_allows_and_wakes(
        tmp_path: Path, weights_gib: float, level: int) -> None:
    """``park_memory_gib`` 3: 1 GiB of weights pin up to 2 GiB (power-of-two blocks) and
    fit beside the worker's own resident set: level 1; 2 GiB would pin 4: level 2. The
    engine is asked to sleep at that level (no ``SIGSTOP``: its processes run), the next
    request wakes it with no load and is answered, and the other model parks in turn (its
    weights' size unknown: level 2). On main a GPU model never parked: it stopped."""
    sup = gpu_supervisor(tmp_path, a={"model": weights(tmp_path, "a-weights", weights_gib)},
                         b={})

    async def scenario() -> None:
        a, b = sup.registry.entries["a"], sup.registry.entries["b"]
        assert await use(sup, "a") == "tok tok "
        pid_a = a.pid
        await until(lambda: a.resident_bytes > 0, 10, "a's memory is measured")
        assert await use(sup, "b") == "tok tok "
        assert (a.state, a.parked_level, a.pid) == ("parked", level, pid_a)
        assert sleeps(tmp_path, "a") == [f"sleep {level}"]
        assert psutil.STATUS_STOPPED not in statuses(sup, a)  # asleep, not stopped
        parks = [e for e in sup.events.recent if e["type"] == "park" and e["model"] == "a"]
        assert parks and parks[-1]["level"] == level
        assert await use(sup, "a") == "tok tok "  # woken: the same worker, no load
        assert (a.state, a.pid, a.loads, a.wakes, a.parked_level) == ("ready", pid_a, 1, 1, 0)
        assert sleeps(tmp_path, "a") == [f"sleep {level}", f"wake {level}"]
        assert (b.state, b.parked_level, b.loads) == ("parked", 2, 1)
        assert sleeps(tmp_path, "b") == ["sleep 2"]

    run(sup, scenario)


def test_a_busy_gpu_model_yields_then_parks_it_never_takes_turns(tmp_path: Path) -> None:
    """A GPU model's sleep frees its KV cache: a request kept through it is recomputed
    (prompt and answer so far) after the wake, so a turn shorter than that recompute
    throws it away again, each turn (a livelock with long contexts; review of 3b50b70).
    A long stream on ``a`` therefore runs to its end while ``b`` waits (``a`` yields),
    then ``a`` parks, idle (level 2 here), and ``b`` answers; nothing is recomputed."""
    sup = gpu_supervisor(tmp_path, {"park_quantum": 0.3, "swap_wait": 0.2},
                         a={"engine_args": {"tokens_per_second": 20}},
                         b={"engine_args": {"tokens_per_second": 50}})

    async def scenario() -> None:
        a = sup.registry.entries["a"]
        await use(sup, "b")
        long = asyncio.create_task(use(sup, "a", tokens=60))  # 3 s of tokens
        await until(lambda: a.state == "ready" and a.leases == 1, 30, "a serves")
        await asyncio.sleep(0.1)
        assert await use(sup, "b", tokens=5) == "tok " * 5
        assert long.done(), "a busy GPU model was put to sleep mid-stream"
        assert await long == "tok " * 60
        assert (a.state, a.parks, a.loads, a.evictions) == ("parked", 1, 1, 0)
        assert sleeps(tmp_path, "a") == ["sleep 2"]

    run(sup, scenario)


@pytest.mark.parametrize("max_parked", [1, 0])
def test_max_parked_models_bounds_gpu_parks_too(tmp_path: Path, max_parked: int) -> None:
    """``max_parked_models: 0``: a GPU model that makes room stops, as before parking (its
    engine never asked to sleep); 1: it parks."""
    sup = gpu_supervisor(tmp_path, {"max_parked_models": max_parked}, a={}, b={})

    async def scenario() -> None:
        a = sup.registry.entries["a"]
        await use(sup, "a")
        await use(sup, "b")
        if max_parked:
            assert (a.state, a.evictions, a.parks) == ("parked", 0, 1)
            assert sleeps(tmp_path, "a") == ["sleep 2"]
        else:
            assert (a.state, a.evictions, a.parks) == ("unloaded", 1, 0)
            assert sleeps(tmp_path, "a") == []

    run(sup, scenario)


def test_a_gpu_budget_the_sleeping_model_leaves_no_room_in_stops_it(tmp_path: Path) -> None:
    """``memory_budget_gib`` 80 on cuda:0, no model limit: ``b`` (50 GiB) fits beside ``a``
    (50) asleep, holding 1 (NVML): ``a`` parks. ``c`` (79.5) fits beside neither asleep
    (1 + 79.5 > 80): the parked ``a`` stops first, then ``b``, which never sleeps."""
    sup = gpu_supervisor(tmp_path, {"max_loaded_models": 0,
                                    "memory_budget_gib": {"cuda:0": 80}},
                         a={"memory_gib": 50}, b={"memory_gib": 50}, c={"memory_gib": 79.5})

    async def scenario() -> None:
        a, b, c = (sup.registry.entries[k] for k in "abc")
        await use(sup, "a")
        await use(sup, "b")
        assert (a.state, b.state) == ("parked", "ready")
        await use(sup, "c")
        assert (a.state, b.state, c.state) == ("unloaded", "unloaded", "ready")
        assert (a.evictions, b.evictions, b.parks) == (1, 1, 0)
        assert sleeps(tmp_path, "b") == []

    run(sup, scenario)


def test_a_parked_gpu_model_counts_by_what_nvml_says_it_holds(tmp_path: Path) -> None:
    """Budget 80 on cuda:0: ``a`` (50) parked holds 1 GiB (NVML's reading of its
    processes), so ``c`` (29) loads beside it and ``b`` (50): 1 + 50 + 29 <= 80, nothing
    stops. Counted by its footprint (50 + 50 + 29 > 80), the parked ``a`` stopped."""
    sup = gpu_supervisor(tmp_path, {"max_loaded_models": 0,
                                    "memory_budget_gib": {"cuda:0": 80}},
                         a={"memory_gib": 50}, b={"memory_gib": 50}, c={"memory_gib": 29})

    async def scenario() -> None:
        a, b, c = (sup.registry.entries[k] for k in "abc")
        await use(sup, "a")
        await use(sup, "b")  # 50 + 50 > 80: a parks
        assert (a.state, b.state) == ("parked", "ready")
        await use(sup, "c")
        assert (a.state, b.state, c.state, a.evictions) == ("parked", "ready", "ready", 0)

    run(sup, scenario)


def test_a_gpu_model_stopped_asleep_ends_its_kept_requests_at_once(tmp_path: Path) -> None:
    """A GPU engine asleep never drains (it is stopped asleep: waking needs GPU memory
    another model may hold), so its stop must not wait out ``drain_timeout`` first, the
    model holding its place as ``stopping`` all along, nor tell the client it was drained
    (review of 3b50b70, M3)."""
    sup = gpu_supervisor(tmp_path, {"drain_timeout": 60},
                         a={"engine_args": {"tokens_per_second": 20}})

    async def scenario() -> None:
        a = sup.registry.entries["a"]
        lease, link = await sup.acquire("a")
        stream = link.submit([Generate(id="g-long", prompt="hi",
                                       sampling=SamplingSpec(max_tokens=200))])
        await anext(stream)
        assert await sup.parker.park(a, "test", 2)
        assert a.state == "parked" and a.parked_level == 2
        began = time.monotonic()
        stop = sup.stopping(a)  # at once: its own wake (its paused request) must not run
        with pytest.raises(ModelUnavailable) as ended:
            async for _ in stream:
                pass
        await stop
        lease.release()
        assert time.monotonic() - began < 30, "the stop waited out drain_timeout"
        assert "drain" not in ended.value.message
        assert a.state == "unloaded"

    run(sup, scenario)


def test_a_sleep_that_fails_is_resumed_so_its_requests_drain(tmp_path: Path) -> None:
    """vLLM pauses its scheduler before it sleeps: a sleep that fails leaves it paused, and
    the stop that follows waited out ``drain_timeout`` (60 s here) for requests that could
    not move, then ended them with a 503. The engine is woken first: its stream drains
    whole (review of 3b50b70, M4)."""
    sup = gpu_supervisor(tmp_path, {"drain_timeout": 60},
                         a={"engine_args": {"tokens_per_second": 50, "sleep_fails": True}})

    async def scenario() -> None:
        a = sup.registry.entries["a"]
        lease, link = await sup.acquire("a")
        text = ""
        stream = link.submit([Generate(id="g-long", prompt="hi",
                                       sampling=SamplingSpec(max_tokens=50))])
        text += "".join(d.text for d in await anext(stream))
        began = time.monotonic()
        assert await sup.parker.park(a, "test", 2)  # failed: it stops instead
        async for deltas in stream:
            text += "".join(d.text for d in deltas)
        lease.release()
        assert text == "tok " * 50
        assert time.monotonic() - began < 30, "the paused engine waited out drain_timeout"
        await until(lambda: a.state == "unloaded", 30, "a stopped")
        assert sleeps(tmp_path, "a")[:2] == ["sleep 2 failed", "wake None"]

    run(sup, scenario)
