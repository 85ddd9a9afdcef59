"""Review of the CPU park (issue 37): defects found by reading the park branch, each as a
test that fails on it (synthetic workers, as ``tests/test_parking.py``)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

from router.errors import ModelUnavailable
from router.lifecycle.supervisor import Supervisor
from router.registry import ModelEntry
from router.workers.backends.local import LocalHandle
from tests.test_parking import run, supervisor, until, use


def test_a_lower_priority_paused_stream_is_not_starved_by_a_busy_higher_one(
        tmp_path: Path) -> None:
    """``lo``'s stream is parked mid-answer when ``hi`` (priority 1) wants the cores and
    ``lo``'s quantum is over. Its paused stream asks for the next turn at once, but
    ``room.decide`` parks a busy model whose turn is over only for a model of at least its
    priority: ``hi`` never yields to ``lo`` while ``hi`` has work, so ``lo``'s stream
    (already half answered) waits as long as ``hi`` is busy; under steady traffic until
    the wake's ``load_timeout`` (900 s), then ``_wake_done`` stops ``lo`` and, ``hi``
    still holding the room, the stream ends mid-answer with a 503 after ``drain_timeout``.
    Before parking ``lo``'s stream always finished (a busy model yields: it keeps serving
    what it has). The issue: a quantum bounds the longest any request waits, and paused
    streams never error. One key that may use ``hi`` can do this to everyone on ``lo``."""
    sup = supervisor(tmp_path, {"park_quantum": 0.3},
                     lo={"engine_args": {"tokens_per_second": 20}},
                     hi={"priority": 1, "engine_args": {"tokens_per_second": 20}})

    async def scenario() -> None:
        lo = sup.registry.entries["lo"]
        await use(sup, "hi")  # loaded once: the switches below are parks and wakes
        long = asyncio.create_task(use(sup, "lo", tokens=40))  # 2 s of tokens alone
        await until(lambda: lo.state == "ready" and lo.leases == 1, 30, "lo serves")
        await asyncio.sleep(0.4)  # past lo's quantum
        busy = asyncio.create_task(use(sup, "hi", tokens=300))  # 15 s: hi stays busy
        try:
            await until(lambda: lo.parks >= 1, 10, "lo is parked for hi")
            # Many quanta of 0.3 s: lo's paused stream must have had a turn by now.
            await until(lambda: lo.wakes >= 1 or long.done(), 6,
                        "lo's paused stream gets a turn while hi stays busy")
        finally:
            busy.cancel()
            long.cancel()
            await asyncio.gather(busy, long, return_exceptions=True)

    run(sup, scenario)


async def a_request_waits_for_its_wake(
        sup: Supervisor) -> tuple[ModelEntry, asyncio.Task[str], asyncio.Task[str]]:
    """``a`` parked for ``b``, ``b`` streaming within its 60 s turn, and a request for
    ``a`` waiting for its wake: ``a``, ``b``'s stream and the waiting request."""
    a, b = sup.registry.entries["a"], sup.registry.entries["b"]
    await use(sup, "a")
    await use(sup, "b")
    assert a.state == "parked"
    stream = asyncio.create_task(use(sup, "b", tokens=40))  # 2 s; b's turn is 60 s
    await until(lambda: b.leases == 1, 10, "b serves")
    waiting = asyncio.create_task(use(sup, "a"))
    await until(lambda: a.queued == 1, 10, "a request waits for a's wake")
    return a, stream, waiting


def test_a_request_waiting_for_a_parked_model_that_crashes_loads_it_again(
        tmp_path: Path) -> None:
    """A request waits for ``a``'s wake (``b`` holds the cores, within its quantum); ``a``'s
    parked worker is killed. ``_watch`` cancels the wake (``Parker.cancel``), and
    ``_load`` awaits it shielded, so the load task itself ends cancelled and
    ``ensure_ready`` answers 503 "was unloaded while it was loading". A crash of a model
    not parked, or of one loading, restarts it for its waiting requests; so must this
    (the issue: a parked model's requests are answered or queued, never lost)."""
    sup = supervisor(tmp_path, {"park_quantum": 60},
                     a={}, b={"engine_args": {"tokens_per_second": 20}})

    async def scenario() -> None:
        a, stream, waiting = await a_request_waits_for_its_wake(sup)
        assert a.pid is not None
        os.kill(a.pid, signal.SIGKILL)
        try:
            assert await waiting == "tok tok "  # once b's stream is done: a loads again
        except ModelUnavailable as err:
            raise AssertionError(f"the waiting request was lost: {err.message}") from None
        await stream
        assert a.loads == 2

    run(sup, scenario)


GROUP = textwrap.dedent("""
    import os, sys, time
    from shared.lifeline import guard_group
    guard = guard_group()  # as worker/__main__ does for a vLLM engine
    engine = os.fork()  # EngineCore: in the worker's group, watching no parent
    if engine == 0:
        while True:
            time.sleep(1)
    print(guard, engine, flush=True)
    while True:
        time.sleep(1)
""")


def test_a_parked_group_ends_when_its_worker_dies_with_the_router(tmp_path: Path) -> None:
    """``LocalHandle.freeze`` SIGSTOPs the worker's whole process group, and with it the
    group's guard (``shared.lifeline.guard_group``), the one process that kills
    EngineCore once the worker has exited. A router killed (SIGKILL, the OOM killer that
    parking's held memory makes likelier) while a model is parked: its worker dies of its
    parent-death signal (SIGKILL ends a stopped process), but the guard, stopped, never
    wakes to kill the group, and EngineCore stays stopped for ever, holding the model's
    memory. Without parking the guard kills it within milliseconds."""
    leader = subprocess.Popen([sys.executable, "-c", GROUP], cwd=os.getcwd(),
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert leader.stdout is not None
        guard, engine = (int(p) for p in leader.stdout.readline().split())
        handle = LocalHandle(SimpleNamespace(pid=leader.pid, returncode=None),  # type: ignore[arg-type]
                             tmp_path / "w.log")
        handle.note_children()  # as the supervisor does once the worker is ready
        assert handle.freeze(True)  # (on 055fae1: ``kill_tree`` of the whole group)
        time.sleep(0.2)
        assert psutil.Process(engine).status() == psutil.STATUS_STOPPED
        os.kill(leader.pid, signal.SIGKILL)  # the router died: PR_SET_PDEATHSIG
        leader.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if psutil.Process(engine).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"EngineCore (pid {engine}) outlived its parked worker: "
                                 f"{psutil.Process(engine).status()}; guard {guard}: "
                                 f"{psutil.Process(guard).status()}")
    finally:
        try:
            os.killpg(leader.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


NAMES = textwrap.dedent("""
    import os, signal
    from shared.lifeline import guard_group
    os.setpgid(0, 0)  # a group leader, as the router starts a worker
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core: the parent runs on
    for _ in range(20):
        guard = guard_group()
        with open(f"/proc/{guard}/comm") as comm:
            print(comm.read().strip(), flush=True)
        os.kill(guard, signal.SIGKILL)
        os.waitpid(guard, 0)
""")


def test_the_guard_bears_its_name_once_guard_group_returns() -> None:
    """``LocalHandle.freeze`` spares the guard by its name. The test above failed in CI
    (the guard stopped with the rest): on a busy host the parent runs on after ``fork``
    and the guard had not yet renamed itself when the worker went on (here, on one core, every
    guard was still ``python`` on 1ed4268)."""
    out = subprocess.run([sys.executable, "-c", NAMES], cwd=os.getcwd(), capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out == ["modelyard-guard"] * 20, out


def test_host_memory_pressure_stops_a_stale_parked_model_before_the_running_one() -> None:
    """Default preset (no ``memory_budget_gib``, no ``park_memory_gib``): memory is short
    on this host, so the running model ``a`` may not park for ``new``. ``stale``, parked
    and unused for an hour, is what ``docs/lifecycle.md`` says stops first ("when memory
    is what is short, a parked model with nothing in flight stops first"; the issue:
    "under pressure it stops parked workers by its existing cost rules ... recency"). But
    ``room.decide`` looks for idle parked models only where a memory *budget* is what
    refuses (``within_budgets``); host memory never is, so ``a``, used a minute ago, is
    stopped (a whole load to get back) and ``stale`` keeps its memory for ever (ttl 0):
    with ``max_parked_models`` 4, four stale parks make every later switch a full swap."""
    from types import SimpleNamespace

    from router.lifecycle.policy import park, room
    from router.registry import ModelEntry
    from shared.preset_loader import build_preset

    preset = build_preset({"server": {"max_loaded_models": 1},
                           "models": {k: {"model": f"/{k}"} for k in ("new", "a", "stale")}})
    m = {k: ModelEntry(spec=spec) for k, spec in preset.models.items()}
    now, wall, gib = 10_000.0, 2e9, 1024 ** 3
    new, a, stale = m["new"], m["a"], m["stale"]
    new.room_since = now - 1
    for entry, state, idle_for in ((a, "ready", 60.0), (stale, "parked", 3600.0)):
        entry.state, entry.leases = state, 0
        entry.replica = SimpleNamespace(busy=False)
        entry.loaded_at, entry.last_used, entry.load_seconds = wall - 7200, now - idle_for, 5.0
        entry.resident_bytes = 10 * gib
    # 64 GiB, 12 GiB available: parking ``a`` for ``new`` (never measured: 1 GiB of KV
    # cache + ``UNKNOWN_NEED_GIB`` expected) would leave 9 GiB, under the 20 % margin
    # (12.8 GiB); stopping ``stale`` gives back 10 GiB.
    memory = park.HostMemory(total=64 * gib, available=12 * gib)
    decision = room.decide(new, [new], [a], preset.server, {}, {}, now=now, wall=wall,
                           waited=0.0, parked=[stale], memory=memory, parking=True)
    chosen = decision.victim.id if decision.victim is not None else None
    assert chosen == "stale", f"{decision.action} {chosen}: {decision.why}"


def test_a_reload_that_changes_a_parked_models_spec_does_not_take_the_cores_from_one_in_use(
        tmp_path: Path) -> None:
    """``Supervisor.refresh`` counts a parked model as ``serving``, so a reload that
    changes its spec loads it again at once, nobody having asked for it: the load needs
    room, and the model people use (``b``) is parked or stopped for it. Before parking
    the model that made room was ``unloaded``, and a reload left it so. A preset edit
    touching the specs of the (up to ``max_parked_models``) parked models thus costs that
    many loads on the cores of the model in use."""
    import msgspec

    sup = supervisor(tmp_path, a={"engine_args": {"tokens_per_second": 0}}, b={})

    async def scenario() -> None:
        a, b = sup.registry.entries["a"], sup.registry.entries["b"]
        await use(sup, "a")
        await use(sup, "b")
        assert a.state == "parked" and b.state == "ready"
        a.spec = msgspec.structs.replace(a.spec, engine_args={"tokens_per_second": 1000})
        sup.refresh(a, load=False)
        await until(lambda: a.state in ("unloaded", "loading", "ready"), 10, "a stops")
        await asyncio.sleep(1.0)  # a restart, if any, has begun
        assert a.state == "unloaded" and a.loads == 1, (a.state, a.loads)
        assert b.state == "ready" and b.parks == 0, (b.state, b.parks)

    run(sup, scenario)


def test_a_request_waiting_for_a_parked_models_wake_survives_a_reload_of_its_spec(
        tmp_path: Path) -> None:
    """As the crash above, through a reload: ``refresh`` of a model whose load is under
    way waits for it when ``loading`` ("its waiters get the worker they waited for"), but
    a parked model's load is its wake, the stop cancels it, and the request waiting for
    it gets 503 "was unloaded while it was loading"; it should wait for the new spec's
    worker, as a request that came a moment later does."""
    import msgspec

    sup = supervisor(tmp_path, {"park_quantum": 60},
                     a={}, b={"engine_args": {"tokens_per_second": 20}})

    async def scenario() -> None:
        a, stream, waiting = await a_request_waits_for_its_wake(sup)
        a.spec = msgspec.structs.replace(a.spec, engine_args={"tokens_per_second": 1000})
        sup.refresh(a, load=False)
        try:
            assert await waiting == "tok tok "
        except ModelUnavailable as err:
            raise AssertionError(f"the waiting request was lost: {err.message}") from None
        await stream

    run(sup, scenario)


def test_a_model_never_measured_is_not_expected_to_take_only_2_gib(tmp_path: Path) -> None:
    """Default preset (``park_memory_gib`` unset): ``may_park`` lets ``a`` park for ``b``
    while this host's available memory less what ``b`` is expected to take stays above 20 %.
    ``b`` never ran, so ``expected_bytes`` takes its KV cache and ``UNKNOWN_NEED_GIB`` (2
    GiB) whatever its weights: a 7B model in bf16 (15 GiB of safetensors) on a 32 GiB
    host with 14 GiB available is expected to take 3 GiB, ``a`` (16 GiB) parks, and ``b``
    loads 16 GiB into 14: swap, or the OOM killer ends a worker (the largest). Before
    parking ``a`` stopped and ``b`` fitted. The weights'
    size on disk is known before the load and is the floor of what a worker holds."""
    from router.lifecycle.policy import park
    from router.lifecycle.room_maker import weights_on_disk
    from router.registry import ModelEntry
    from shared.preset_loader import build_preset

    weights = tmp_path / "b"
    weights.mkdir()
    with open(weights / "model.safetensors", "wb") as f:
        f.truncate(15 * 1024 ** 3)  # sparse: nothing written
    (weights / "config.json").write_text("{}")
    preset = build_preset({"server": {"max_loaded_models": 1},
                           "models": {"a": {"model": "/a"}, "b": {"model": str(weights)}}})
    a, b = (ModelEntry(spec=preset.models[k]) for k in ("a", "b"))
    b.weights_bytes = weights_on_disk(str(weights))  # as the room maker reads it, once
    gib = 1024 ** 3
    a.state, a.resident_bytes = "ready", 16 * gib
    memory = park.HostMemory(total=32 * gib, available=14 * gib)
    assert not park.may_park(a, b, [a], preset.server, memory), (
        f"b expected to take {park.expected_bytes(b) / gib:g} GiB")
