"""Parked workers (issue 37): a model that makes room keeps its memory and gives up its
cores, and wakes without a load; two models with work take turns; a parked worker that
dies is noticed; memory pressure stops instead of parking.

The workers are real processes running the ``synthetic`` engine (a paused scheduler and
stopped processes are what is tested, not a model's words); ``tests/test_parking_vllm.py``
does the same with vLLM.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psutil
from prometheus_client import generate_latest

from router.lifecycle.supervisor import Supervisor
from router.observe.metrics import Metrics
from router.registry import ModelEntry, ModelRegistry
from router.workers.placement import Placer
from shared.preset_loader import build_preset
from shared.protocol import Generate, SamplingSpec


def supervisor(tmp_path: Path, server: dict[str, Any] | None = None,
               **models: dict[str, Any]) -> Supervisor:
    # A ceiling of its own: whether a model parks must not hang on what else this host
    # runs meanwhile (the default reads its available memory).
    preset = build_preset({"server": {"max_loaded_models": 1, "spare_workers": 0,
                                      "park_memory_gib": 4, **(server or {})},
                           "models": {name: {"model": "/synthetic", "engine": "synthetic",
                                             **spec} for name, spec in models.items()}})
    return Supervisor(ModelRegistry(preset), preset.server, tmp_path, Placer(cores={0}, gpus={}))


def run(sup: Supervisor, scenario: Callable[[], Awaitable[None]],
        timeout: float = 60) -> None:
    async def main() -> None:
        sup.start()  # the idle reaper
        try:
            await asyncio.wait_for(scenario(), timeout)
        finally:
            await sup.stop_all()

    asyncio.run(main())


async def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout} s"
        await asyncio.sleep(0.01)


def statuses(sup: Supervisor, entry: ModelEntry) -> set[str]:
    """The process states of ``entry``'s worker and every process it started."""
    worker = sup.worker_of(entry)
    assert worker is not None
    out = set()
    for pid in worker.handle.pids():
        try:
            out.add(psutil.Process(pid).status())
        except psutil.NoSuchProcess:
            pass
    return out


async def use(sup: Supervisor, name: str, tokens: int = 2) -> str:
    """One whole generation of ``tokens`` on ``name``: its text."""
    lease, link = await sup.acquire(name)
    try:
        text = ""
        async for deltas in link.submit([Generate(id=f"g-{name}-{time.monotonic_ns()}",
                                                  prompt="hi",
                                                  sampling=SamplingSpec(max_tokens=tokens))]):
            text += "".join(d.text for d in deltas)
        return text
    finally:
        lease.release()


def test_a_model_that_makes_room_parks_and_wakes_without_a_load(tmp_path: Path) -> None:
    """On 1a1e9ee the model that made room stopped (``unloaded``), and each switch back
    was a whole load: here it parks (its processes stopped, its memory kept) and a
    request for it wakes it with no load, while the other parks in turn."""
    sup = supervisor(tmp_path, a={}, b={})
    metrics = Metrics(sup.registry)
    sup.parker.observe = metrics.switch

    async def scenario() -> None:
        a, b = sup.registry.entries["a"], sup.registry.entries["b"]
        assert await use(sup, "a") == "tok tok "
        pid_a = a.pid
        assert await use(sup, "b") == "tok tok "
        assert a.state == "parked" and b.state == "ready"
        assert a.pid == pid_a and statuses(sup, a) == {psutil.STATUS_STOPPED}
        assert psutil.STATUS_STOPPED not in statuses(sup, b)
        assert await use(sup, "a") == "tok tok "  # woken: the same worker, no load
        assert a.state == "ready" and a.pid == pid_a and a.loads == 1 and a.wakes == 1
        assert b.state == "parked" and b.loads == 1 and b.parks == 1
        assert psutil.STATUS_STOPPED not in statuses(sup, a)
        for _ in range(3):  # back and forth: still no load
            await use(sup, "b")
            await use(sup, "a")
        assert (a.loads, b.loads, a.evictions, b.evictions) == (1, 1, 0, 0)
        assert a.resident_bytes > 0  # measured as it parked: what may_park counts
        kinds = [(e["type"], e["model"], e.get("state")) for e in sup.events.recent]
        assert ("eviction", "a", None) in kinds and ("park", "a", None) in kinds
        assert kinds.index(("state", "a", "parking")) < kinds.index(("state", "a", "parked"))
        assert ("wake", "a", None) in kinds and ("state", "a", "waking") in kinds
        text = generate_latest(metrics.registry).decode()
        assert 'modelyard_model_switch_seconds_count{kind="wake",model="a"} 4.0' in text
        assert 'modelyard_model_state{model="b",state="parked"} 1.0' in text

    run(sup, scenario)


def test_two_models_with_work_take_turns_and_a_paused_stream_completes(
        tmp_path: Path) -> None:
    """A long stream on ``a`` is paused (parked mid-stream) once its turn of
    ``park_quantum`` is over and ``b`` waits; ``b`` answers while ``a``'s stream is still
    open, then ``a``'s stream goes on and ends whole. On 1a1e9ee ``b`` waited for
    ``swap_wait`` (40 s) or for ``a``'s stream to end."""
    sup = supervisor(tmp_path, {"park_quantum": 0.3},
                     a={"engine_args": {"tokens_per_second": 20}},
                     b={"engine_args": {"tokens_per_second": 50}})

    async def scenario() -> None:
        a = sup.registry.entries["a"]
        await use(sup, "b")  # loaded once: the switches below are parks and wakes
        long = asyncio.create_task(use(sup, "a", tokens=60))  # 3 s of tokens
        await until(lambda: a.state == "ready" and a.leases == 1, 30, "a serves")
        await asyncio.sleep(0.1)
        assert await use(sup, "b", tokens=5) == "tok " * 5
        assert not long.done()  # b answered in a's stream's middle
        assert a.parks >= 1
        assert await long == "tok " * 60  # paused, resumed, whole
        assert a.loads == 1 and sup.registry.entries["b"].loads == 1

    run(sup, scenario)


def test_a_parked_worker_killed_is_noticed_and_cleaned_up(tmp_path: Path) -> None:
    """kill -9 of a parked worker: the model is marked failed at once, every process it
    started (stopped too) is gone, and the next request loads it again."""
    sup = supervisor(tmp_path, a={}, b={})

    async def scenario() -> None:
        a = sup.registry.entries["a"]
        await use(sup, "a")
        await use(sup, "b")
        assert a.state == "parked"
        worker = sup.worker_of(a)
        assert worker is not None
        pids = worker.handle.pids()
        assert a.pid is not None
        os.kill(a.pid, signal.SIGKILL)
        await until(lambda: a.state == "failed", 5, "the death of a parked worker is seen")
        await until(lambda: sup.worker_of(a) is None, 5, "the worker is reaped")
        left = [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert left == []
        assert await use(sup, "a") == "tok tok "
        assert a.state == "ready" and a.loads == 2

    run(sup, scenario)


def test_a_memory_ceiling_stops_instead_of_parking(tmp_path: Path) -> None:
    """``park_memory_gib`` below what a worker holds: the model that makes room stops, as
    before parking; ``max_parked_models: 0`` too."""
    async def scenario(sup: Supervisor) -> None:
        a = sup.registry.entries["a"]
        await use(sup, "a")
        await until(lambda: a.resident_bytes > 0, 5, "a's memory is measured")
        await use(sup, "b")
        assert a.state == "unloaded" and a.evictions == 1 and a.parks == 0

    for server in ({"park_memory_gib": 0.001}, {"max_parked_models": 0, "park_memory_gib": None}):
        sup = supervisor(tmp_path, server, a={}, b={})
        run(sup, functools.partial(scenario, sup))


def test_a_parked_model_stops_cleanly_on_unload_and_on_its_ttl(tmp_path: Path) -> None:
    """A stop of a parked model continues its processes first, so its worker reads
    ``Shutdown`` and exits 0 (not killed after the grace); a parked model's idle ttl
    stops it too."""
    sup = supervisor(tmp_path, a={"ttl": 600}, b={}, c={"ttl": 3})

    async def scenario() -> None:
        a, c = sup.registry.entries["a"], sup.registry.entries["c"]
        await use(sup, "a")
        await use(sup, "b")
        assert a.state == "parked"
        worker = sup.worker_of(a)
        assert worker is not None
        await sup.stop(a)
        assert a.state == "unloaded" and worker.handle.returncode == 0
        await use(sup, "c")
        await use(sup, "b")
        assert c.state == "parked"
        await until(lambda: c.state == "unloaded", 10, "a parked model's ttl stops it")

    run(sup, scenario)
