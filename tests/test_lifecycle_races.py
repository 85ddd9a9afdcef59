"""Lifecycle races found by review, each caught here without vLLM or a real worker.

The supervisor's process work is replaced by stand-ins (a load is ``ready`` at once, a
stop takes a set time), as in ``test_scheduling``; the link test uses a real ZeroMQ
socket and a real TCP connection on 127.0.0.1. Each test names the defect whose old
behaviour (at 651c79a) it catches; a test of a suspected defect that proved unfounded
stays as a guard and says so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from router.errors import ModelUnavailable
from router.placement import GIB, GpuMemory, Placer
from router.registry import ModelEntry, ModelRegistry
from router.supervisor import Supervisor
from shared.config import build_preset


class FakeLink:
    busy = False


def supervisor(tmp_path: Path, models: dict[str, dict[str, Any]], placer: Placer | None = None,
               stop_seconds: float = 0.01, **server: Any) -> Supervisor:
    """A supervisor whose loads start no process (ready after 10 ms) and whose stops
    take ``stop_seconds`` (a drain, a worker's exit)."""
    server = {"max_loaded_models": 1, "spare_workers": 0, **server}
    preset = build_preset({"server": server,
                           "models": {k: {"model": f"/{k}", **v} for k, v in models.items()}})
    sup = Supervisor(ModelRegistry(preset), preset.server, tmp_path,
                     placer or Placer(cores={0}, gpus={}))
    pids = iter(range(1000, 2000))

    async def spawn(entry: ModelEntry) -> Any:
        await asyncio.sleep(0.01)
        pid = next(pids)
        sup._workers[entry.id] = SimpleNamespace(  # type: ignore[assignment]
            handle=SimpleNamespace(pids=lambda: {pid}))
        entry.state, entry.link = "ready", FakeLink()  # type: ignore[assignment]
        entry.loaded_at, entry.last_used, entry.load_seconds = time.time(), time.monotonic(), 5
        return entry.link

    async def finish_stop(entry: ModelEntry, worker: Any, force: bool = False,
                          grace: float = 1.0) -> None:
        await asyncio.sleep(stop_seconds)
        del sup._workers[entry.id]
        entry.state, entry.link, entry.yield_to = "unloaded", None, None

    sup._spawn = spawn  # type: ignore[method-assign]
    sup._finish_stop = finish_stop  # type: ignore[method-assign]
    return sup


def run(coro: Awaitable[None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(30):
            await coro

    asyncio.run(bounded())


async def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.005)
    del what  # named for the reader of a failure's traceback


def idle(entry: ModelEntry) -> None:
    """Make ``entry`` look unused for a while: the first model a load evicts."""
    entry.last_used -= 60


# -- defect 1: a stop, once begun, is never cancelled by whoever waits for it ------------

@pytest.mark.parametrize("how", ["unload", "retire"])
def test_unloading_a_model_that_makes_room_lets_its_victims_stop_finish(
        tmp_path: Path, how: str) -> None:
    """Defect 1: ``_make_room`` awaited ``stop(victim)`` in the load's own task, so
    unloading (or a reload retiring) the loading model cancelled the victim's stop
    halfway: the victim stayed ``stopping`` with its worker for good, its requests spun
    until their timeout and an unload of it never returned."""
    sup = supervisor(tmp_path, {"victim": {}, "newcomer": {}}, stop_seconds=0.3,
                     load_timeout=2)

    async def go() -> None:
        victim, newcomer = sup.registry.entries["victim"], sup.registry.entries["newcomer"]
        lease, _ = await sup.acquire("victim")
        lease.release()
        idle(victim)
        waiter = asyncio.create_task(sup.acquire("newcomer"))
        await until(lambda: victim.state == "stopping", 2, "the victim's stop begins")
        if how == "unload":
            await sup.stop(newcomer)  # cancels the newcomer's load, in its _make_room
        else:
            sup.retire(newcomer)
            await until(lambda: newcomer not in sup._removed, 2, "the retired model stops")
        with pytest.raises(ModelUnavailable):
            await waiter
        await until(lambda: victim.state == "unloaded", 2, "the victim's stop ends")
        assert "victim" not in sup._workers and newcomer.state == "unloaded"
        async with asyncio.timeout(2):  # the victim serves again, and unloads again
            lease, _ = await sup.acquire("victim")
            lease.release()
            await sup.stop(victim)
        assert victim.state == "unloaded" and not sup._stops

    run(go())


def test_every_caller_of_a_stop_shares_it_and_none_cancels_it(tmp_path: Path) -> None:
    """Defect 1: a second ``stop`` polled for the first, and cancelling the first
    caller cancelled the stop itself."""
    sup = supervisor(tmp_path, {"m": {}}, stop_seconds=0.2)

    async def go() -> None:
        entry = sup.registry.entries["m"]
        lease, _ = await sup.acquire("m")
        lease.release()
        first = asyncio.create_task(sup.stop(entry))
        await until(lambda: entry.state == "stopping", 1, "the stop begins")
        second = asyncio.create_task(sup.stop(entry))
        await asyncio.sleep(0.05)
        first.cancel()  # the unload's client left: the stop goes on
        await asyncio.wait({first})
        async with asyncio.timeout(1):
            await second
        assert entry.state == "unloaded" and "m" not in sup._workers

    run(go())


# -- defect 2: a multi-GPU load cancelled between its start locks ------------------------

def test_a_load_cancelled_while_waiting_for_its_second_gpu_lock_lets_the_first_go(
        tmp_path: Path) -> None:
    """Defect 2: ``_load`` took its start locks one by one before its ``try``, so a load
    cancelled while it waited for the second kept the first for good: no model could
    start on that GPU again."""
    gpus = {g: GpuMemory(g, 80 * GIB, 80 * GIB) for g in (0, 1)}
    sup = supervisor(tmp_path, {"wide": {"device": "cuda", "gpus": [0, 1]}},
                     placer=Placer(cores={0}, gpus=gpus, process_memory=lambda pids: {}))

    async def go() -> None:
        entry = sup.registry.entries["wide"]
        first, second = sup.placer.start_locks(entry.spec)
        await second.acquire()  # another worker starts on GPU 1
        waiter = asyncio.create_task(sup.acquire("wide"))
        await until(first.locked, 2, "the load holds GPU 0's lock")
        await sup.stop(entry)  # an unload while it waits for GPU 1's
        with pytest.raises(ModelUnavailable):
            await waiter
        assert not first.locked(), "GPU 0's start lock is held by a load that is gone"
        second.release()
        async with asyncio.timeout(2):
            lease, _ = await sup.acquire("wide")
        lease.release()
        assert not first.locked() and not second.locked()

    run(go())
