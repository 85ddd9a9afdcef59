"""Lifecycle races found by review, each caught here without vLLM or a real worker.

The supervisor's process work is replaced by stand-ins (a load is ``ready`` 10 ms after
it has room, a stop takes a set time), as in ``test_scheduling``; the link test uses a
real ZeroMQ socket and real TCP connections on 127.0.0.1, and the backend and spare
tests start small ``python -c`` processes. Each test names the defect whose old
behaviour (at 651c79a) it catches, and every one of them failed there.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq
from starlette.requests import Request

from router.access.admission import OPEN
from router.api.relay import Relay
from router.api.wire import unless_disconnected
from router.errors import ClientGone, ModelUnavailable
from router.lifecycle.supervisor import Supervisor
from router.registry import ModelEntry, ModelRegistry
from router.workers.link import Usage, WorkerLink
from router.workers.placement import GIB, GpuMemory, Placer
from shared.preset_loader import build_preset
from tests.conftest import connected_peer
from tests.test_scheduling import supervisor as scheduling_supervisor


def supervisor(tmp_path: Path, models: dict[str, dict[str, Any]], placer: Placer | None = None,
               stop_seconds: float = 0.01, **server: Any) -> Supervisor:
    """``tests.test_scheduling``'s supervisor whose loads and stops start no process."""
    return scheduling_supervisor(tmp_path, models, placer, stop_seconds, **server)[0]


def run(coro: Awaitable[None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(30):
            await coro

    asyncio.run(bounded())


async def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not check():
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout} s") from None


def idle(entry: ModelEntry) -> None:
    """Make ``entry`` look unused for a while: the first model a load evicts."""
    entry.last_used -= 60


# -- defect 1: a stop, once begun, is never cancelled by whoever waits for it ------------

@pytest.mark.parametrize("how", ["unload", "retire"])
def test_unloading_a_model_that_makes_room_lets_its_victims_stop_finish(
        tmp_path: Path, how: str) -> None:
    """Defect 1: ``_make_room`` (now ``RoomMaker.make``) awaited ``stop(victim)`` in the
    load's own task, so unloading (or a reload retiring) the loading model cancelled the
    victim's stop halfway: the victim stayed ``stopping`` with its worker for good, its
    requests spun until their timeout and an unload of it never returned."""
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
            await sup.stop(newcomer)  # cancels the newcomer's load, in its RoomMaker.make
        else:
            sup.retire(newcomer)
            await until(lambda: newcomer not in sup._removed, 2, "the retired model stops")
        with pytest.raises(ModelUnavailable):
            await waiter
        await until(lambda: victim.state == "unloaded", 2, "the victim's stop ends")
        assert "victim" not in sup.running() and newcomer.state == "unloaded"
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
        assert entry.state == "unloaded" and "m" not in sup.running()

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


# -- defect 3: a client that leaves in the turn its slot frees ---------------------------

def leaving_request() -> tuple[Request, asyncio.Event]:
    """A request whose client leaves when the returned event is set."""
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []},
                   receive), gone


ORDERS = [("free", k) for k in range(4)] + [("leave", k) for k in range(4)]
"""Which happens first, the slot freeing or the client leaving, and how many loop turns
later the other: every interleaving of the two within a few turns."""


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def assert_nothing_held(sup: Supervisor, entry: ModelEntry) -> None:
    assert (entry.leases, entry.queued) == (0, 0), f"{entry.leases} leases, {entry.queued} queued"
    now = sup.acquire_now(entry.id)
    assert isinstance(now, tuple), "the model's only slot is held by nobody"
    now[0].release()


@pytest.mark.parametrize("order", ORDERS)
def test_a_client_leaving_as_its_slot_frees_leaks_no_lease_or_slot(
        tmp_path: Path, order: tuple[str, int]) -> None:
    """Defect 3: ``unless_disconnected`` cancelled the waiting ``acquire`` without
    awaiting it, and ``wait_for`` (Python 3.11) returns a result whose cancel lands in the
    same turn: the lease and the only ``max_concurrent`` slot were kept by nobody, and the
    model never served again."""
    sup = supervisor(tmp_path, {"m": {"max_concurrent": 1}})
    first, turns = order

    async def go() -> None:
        entry = sup.registry.entries["m"]
        held, _ = await sup.acquire("m")
        request, gone = leaving_request()
        waiter = asyncio.create_task(unless_disconnected(request, sup.acquire("m")))
        await until(lambda: entry.queued == 1, 1, "the second request waits for a slot")
        (held.release if first == "free" else gone.set)()
        for _ in range(turns):
            await asyncio.sleep(0)
        (gone.set if first == "free" else held.release)()
        try:
            lease, _ = await waiter  # it may have got in first: then it is its to release
            lease.release()
        except ClientGone:
            pass
        await settle()
        assert_nothing_held(sup, entry)
        async with asyncio.timeout(1):  # the model still serves
            lease, _ = await sup.acquire("m")
        lease.release()

    run(go())


@pytest.mark.parametrize("order", ORDERS)
def test_a_cold_stream_left_as_its_slot_frees_leaks_no_lease_or_slot(
        tmp_path: Path, order: tuple[str, int]) -> None:
    """Defect 3: the relay's ``_cold_stream`` (a stream that begins before its model
    serves) cancelled its ``acquire`` without awaiting it when the client left, and
    released only a lease that had already arrived: one arriving in the same turn leaked
    with its slot."""
    sup = supervisor(tmp_path, {"m": {"max_concurrent": 1}})
    relay = Relay(sup)
    first, turns = order

    async def go() -> None:
        entry = sup.registry.entries["m"]
        held, _ = await sup.acquire("m")
        body = relay._cold_stream("m", "m", [], None,  # type: ignore[arg-type]
                                  lambda: b": ping\n\n", 5.0, Usage(), "/v1/messages", None,
                                  OPEN)
        assert await body.__anext__() == b": ping\n\n"
        await until(lambda: entry.queued == 1, 1, "the stream waits for a slot")
        if first == "free":
            held.release()
            for _ in range(turns):
                await asyncio.sleep(0)
            await body.aclose()  # the client left
        else:
            closing = asyncio.create_task(body.aclose())
            for _ in range(turns):
                await asyncio.sleep(0)
            held.release()
            await closing
        await settle()
        assert_nothing_held(sup, entry)

    run(go())


CANCELS = [(turns, again) for turns in range(8) for again in (None, 0, 2)]
"""Loop turns between a slot freeing and the waiting line's cancel, and whether (and how
many turns later) a second cancel comes, as ``BatchRunner`` gives (its stop, then its
``finally``): every turn of the hand-over's window."""


@pytest.mark.parametrize("cancels", CANCELS,
                         ids=lambda c: f"turns{c[0]}-" + ("once" if c[1] is None else f"again{c[1]}"))
def test_a_batch_line_cancelled_as_its_slot_frees_leaks_no_lease_or_slot(
        tmp_path: Path, cancels: tuple[int, int | None]) -> None:
    """Issue 38, finding 7: a batch line waited in ``Slots``' batch line (through the
    relay's ``_wait``: ``unless_disconnected``) while a person's request held the only
    slot; the person's request ended, the slot went to the line, and the line's task was
    cancelled (its batch cancelled) in that very turn. ``unless_disconnected`` then
    awaited its two tasks' ends, the cancel landed in that await, and the lease that had
    come was never released: the slot was kept for good, and every later request waited
    and got 503. (Simulation seeds 734837 and 737328.) Failed before the fix (12 of
    24): a cancel 3 to 5 turns after the slot freed (the line's ``acquire`` had returned,
    its watch was being awaited), and a second cancel 2 turns after a first one 0 to 2
    turns after it (the first cancel's cleanup awaited, the second landed there)."""
    sup = supervisor(tmp_path, {"m": {"max_concurrent": 1}})
    relay = Relay(sup)
    turns, again = cancels

    async def go() -> None:
        entry = sup.registry.entries["m"]
        held, _ = await sup.acquire("m")
        request, _ = leaving_request()  # its client stays: the line is cancelled instead
        line = asyncio.create_task(relay._wait(request, "/v1/chat/completions", "m",
                                               "generate", False, Usage(batch="batch_1")))
        assert entry.slots is not None
        await until(lambda: entry.slots is not None and entry.slots.waiting == 1, 1,
                    "the batch line waits for a slot")
        held.release()  # the person's request ends: its slot goes to the batch line
        for _ in range(turns):
            await asyncio.sleep(0)
        line.cancel()
        if again is not None:
            for _ in range(again):
                await asyncio.sleep(0)
            line.cancel()
        try:
            lease, _ = await line  # it may have ended first: then the lease is its to give
            lease.release()
        except asyncio.CancelledError:
            pass
        await settle()
        assert_nothing_held(sup, entry)
        assert entry.batch_leases == 0 and entry.slots.free == 1
        async with asyncio.timeout(1):  # the model still serves a person
            lease, _ = await sup.acquire("m")
        lease.release()

    run(go())


def test_a_one_shot_call_left_while_queued_gives_its_place_back(tmp_path: Path) -> None:
    """``Relay.call`` (embeddings, rerank, score, tokenize) did not watch its client while
    it waited (06a074e): a client gone stayed in the model's queue, and its work still ran
    once a slot freed."""
    sup = supervisor(tmp_path, {"m": {"max_concurrent": 1}})
    relay = Relay(sup)
    ran: list[object] = []

    async def work(link: object, lora: object) -> object:
        ran.append(link)
        return link

    async def go() -> None:
        entry = sup.registry.entries["m"]
        held, _ = await sup.acquire("m")
        request, gone = leaving_request()
        call = asyncio.create_task(relay.call(request, "embeddings", "m", "any", work))
        await until(lambda: entry.queued == 1, 1, "the call waits for a slot")
        gone.set()
        with pytest.raises(ClientGone):
            async with asyncio.timeout(1):
                await call
        held.release()
        await settle()
        assert ran == []
        assert_nothing_held(sup, entry)

    run(go())


def test_slots_go_in_line_and_a_cancelled_waiter_passes_its_slot_on() -> None:
    """Defect 3: the ``asyncio.Semaphore`` was taken by ``_value -= 1`` (a private
    attribute); ``Slots`` is first come, first served and loses no slot to a cancel."""
    from router.registry import Slots  # (new with the fix)

    async def go() -> None:
        slots = Slots(1)
        assert slots.try_take() and not slots.try_take()
        a = asyncio.create_task(slots.take())
        b = asyncio.create_task(slots.take())
        await settle()
        assert slots.waiting == 2 and slots.free == 0
        slots.give()  # handed to ``a``, which is cancelled before it runs
        a.cancel()
        assert not slots.try_take()  # a newcomer does not pass the line
        await asyncio.wait({a})
        async with asyncio.timeout(1):
            await b  # ``a``'s slot went on to ``b``
        assert slots.free == 0 and slots.waiting == 0
        slots.give()
        assert slots.free == 1 and slots.try_take()

    run(go())


# -- defect 4: a port scan of a tcp:// link ----------------------------------------------

def test_a_stranger_connecting_to_a_tcp_link_does_not_make_its_worker_lost() -> None:
    """Defect 4: every ZeroMQ ``EVENT_DISCONNECTED`` of a tcp:// link (Ray workers)
    counted as the worker's loss, and libzmq emits one for every failed handshake: any
    TCP connection to the link's port (a port scan) failed a healthy worker's streams."""

    async def go() -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        link = WorkerLink(ctx, "tcp://127.0.0.1:*", "remote")
        peer = await connected_peer(ctx, link, link.endpoint)
        try:
            port = int(link.endpoint.rsplit(":", 1)[1])
            for payload in (b"", b"GET / HTTP/1.0\r\n\r\n", b"\xff" + b"\0" * 8 + b"\x7f"):
                with socket.create_connection(("127.0.0.1", port), timeout=2) as stranger:
                    if payload:
                        stranger.sendall(payload)
                    await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # every stranger's handshake failed and was reported
            assert link.disconnected is not None
            assert not link.disconnected.done(), "a stranger's connection lost the worker"
            peer.close(0)  # the worker's own connection drops: that is a loss
            async with asyncio.timeout(5):
                await asyncio.shield(link.disconnected)
        finally:
            link.close()
            peer.close(0)
            ctx.destroy(linger=0)

    run(go())


# -- defect 5 (suspected) ----------------------------------------------------------------

def test_two_loads_cannot_both_take_the_last_room_across_a_gpu_reading(
        tmp_path: Path) -> None:
    """Defect 5a (confirmed): ``_make_room`` (now ``RoomMaker.make``) listed the loaded
    models and checked the line before awaiting the sleeping models' GPU reading (a thread),
    then judged ``fits`` with that list: a load that claimed room meanwhile was not counted,
    and two loads took the last room together."""

    def slow_reading(pids: set[int]) -> dict[int, float]:
        time.sleep(0.2)  # NVML, under load
        return {}

    gpus = {0: GpuMemory(0, 80 * GIB, 80 * GIB)}
    sup = supervisor(tmp_path, {"asleep": {"device": "cuda", "pinned": True},
                                "a": {}, "b": {"priority": 5}},
                     placer=Placer(cores={0}, gpus=gpus, process_memory=slow_reading),
                     max_loaded_models=2, load_timeout=1.5)

    async def go() -> None:
        asleep = sup.registry.entries["asleep"]
        lease, _ = await sup.acquire("asleep")
        lease.release()
        asleep.state = "sleeping"  # its idle sleep
        a = asyncio.create_task(sup.acquire("a"))
        await asyncio.sleep(0.05)  # a reads the GPUs ...
        b = asyncio.create_task(sup.acquire("b"))  # ... and b, first in line, too
        most = 0
        for _ in range(100):
            most = max(most, sum(e.state in ("loading", "ready", "sleeping", "stopping")
                                 for e in sup.registry))
            await asyncio.sleep(0.01)
        for task in (a, b):
            task.cancel()
        got = await asyncio.gather(a, b, return_exceptions=True)
        for result in got:
            if isinstance(result, tuple):
                result[0].release()
        assert most <= 2, f"{most} models held room where max_loaded_models is 2"

    run(go())


def test_a_worker_whose_boot_cannot_be_written_is_not_left_running(tmp_path: Path) -> None:
    """Defect 5b (confirmed): ``LocalBackend.spawn`` started the process (or took a
    spare), then ``boot_for`` raised: the process, blocked on its stdin, was left running
    with nobody to stop it."""
    from router.workers.backends.local import LocalBackend
    from router.workers.spares import SparePool

    preset = build_preset({"server": {"spare_workers": 0},
                           "models": {"m": {"model": "/m", "engine": "synthetic"}}})
    registry = ModelRegistry(preset)
    command = [sys.executable, "-c", "import sys, time; sys.stdin.read(); time.sleep(60)"]

    def boot_for(log_path: str) -> bytes:
        raise ValueError("no boot for you")

    async def go() -> None:
        spares = SparePool(0, registry, tmp_path, command, dict, lambda coro: None)
        backend = LocalBackend(spares, lambda: command, dict)
        before = {p.pid for p in psutil.Process().children()}
        with pytest.raises(ValueError):
            await backend.spawn(registry.entries["m"].spec, boot_for, tmp_path / "m.log", {})
        born = [p for p in psutil.Process().children() if p.pid not in before]
        await asyncio.sleep(0.2)
        alive = [p for p in born if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for p in alive:
            p.kill()
        assert not alive, f"worker process {[p.pid for p in alive]} left running"

    run(go())


def test_background_responses_count_against_max_connections(tmp_path: Path) -> None:
    """Defect 5d (suspected, confirmed): a background response ran after its create
    request's handler returned, outside ``max_connections``: any number of them could
    run at once. Each now counts until it ends (the load here never finishes)."""
    from starlette.testclient import TestClient

    from router.app import build_app

    preset = build_preset({"server": {"max_connections": 2, "spare_workers": 0,
                                      "runtime_dir": str(tmp_path / "run")},
                           "models": {"m": {"model": "/m"}}})
    app = build_app(preset)

    async def never_ready(entry: ModelEntry) -> Any:
        await asyncio.sleep(3600)

    app.state.supervisor._spawn = never_ready
    body = {"model": "m", "input": "hi", "background": True}
    with TestClient(app) as client:
        first = client.post("/v1/responses", json=body)
        assert first.status_code == 200 and first.json()["status"] == "queued", first.text
        assert client.get("/v1/models").status_code == 200  # the run and this one: 2
        second = client.post("/v1/responses", json=body)
        assert second.status_code == 503, "a second background run past max_connections"
        assert second.json()["error"]["code"] == "server_overloaded"
        rid = first.json()["id"]
        assert client.post(f"/v1/responses/{rid}/cancel").status_code == 200
        again = client.post("/v1/responses", json=body)
        assert again.status_code == 200, again.text  # the cancelled run counts no more
        client.post(f"/v1/responses/{again.json()['id']}/cancel")


def test_log_followers_leave_the_default_executor_to_the_supervisor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect 5e (suspected, confirmed when reads are slow): every log follower read its
    log in the default executor every 0.2 s, so followers of a log on a slow disk took
    all its threads, and the supervisor's reap (``asyncio.to_thread``) waited behind
    them. Log reads now have threads of their own."""
    from concurrent.futures import ThreadPoolExecutor

    from router.api.events import EventsAPI, LogFollower
    from router.observe.events import EventBus

    def slow_read(self: LogFollower) -> list[str]:
        time.sleep(0.3)  # a log on a busy or network disk
        return []

    monkeypatch.setattr(LogFollower, "read", slow_read)
    sup = supervisor(tmp_path, {"m": {}})
    api = EventsAPI(sup, EventBus())
    api.log_poll = 0.01
    sup.log_path(sup.registry.entries["m"]).write_text("starting\n")

    async def follow() -> None:
        async for _ in api._log_stream("m", [], LogFollower(
                sup.log_path(sup.registry.entries["m"]), 0, 0)):
            pass

    async def go() -> None:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(4))
        followers = [asyncio.create_task(follow()) for _ in range(8)]
        await asyncio.sleep(0.2)  # every follower is reading
        slowest = 0.0
        for _ in range(5):
            began = time.monotonic()
            await asyncio.to_thread(lambda: None)  # what ``_reap`` waits for
            slowest = max(slowest, time.monotonic() - began)
            await asyncio.sleep(0.05)
        for task in followers:
            task.cancel()
        await asyncio.wait(followers)
        assert slowest < 0.1, f"a thread for the supervisor took {slowest:.2f} s"
        api.close()

    run(go())


SPARE = """
import os, sys, time
count, fd = sys.argv[1], int(sys.argv[sys.argv.index("--ready-fd") + 1])
n = len(open(count).read()) if os.path.exists(count) else 0
open(count, "a").write("x")  # one byte a start: never read half-written
if n == 2:  # the third comes up ready and waits for its model
    os.write(fd, b"1")
    sys.stdin.read()
    time.sleep(60)
sys.exit(3)
"""


def test_spares_start_again_after_one_came_up_ready(tmp_path: Path) -> None:
    """Defect 5c (suspected, confirmed): ``SparePool`` counted spares that died unused
    and never forgot them, so three deaths over the router's whole life (a full disk
    once, an OOM kill later) stopped spares for good. A spare that comes up ready, or a
    worker of this host that becomes ready, now starts the count again."""
    import os

    from router.workers.spares import SparePool

    preset = build_preset({"server": {"spare_workers": 1}, "models": {"m": {"model": "/m"}}})
    registry = ModelRegistry(preset)
    count = tmp_path / "count"
    tasks: set[asyncio.Task[None]] = set()

    def spawn_task(coro: Any) -> None:
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def started() -> int:
        return len(count.read_text()) if count.exists() else 0

    async def go() -> None:
        pool = SparePool(1, registry, tmp_path, [sys.executable, "-c", SPARE, str(count)],
                         lambda: dict(os.environ), spawn_task)
        try:
            pool.replenish()  # two die, the third comes up ready
            await until(lambda: started() == 3 and bool(pool._spares)
                        and pool._spares[0].poll_ready(), 10, "a spare is ready")
            spare = await pool.take(registry.entries["m"].spec)
            assert spare is not None and spare.ready
            spare.proc.kill()
            await spare.proc.wait()
            pool.replenish()  # its place: these die again
            await until(lambda: started() >= 6 and not tasks, 10,
                        "three more spares are tried after the ready one")
            await asyncio.sleep(0.3)
            assert started() == 6 and not pool._spares  # then it stops, as before
            pool.worker_ready()  # a worker started on this host
            pool.replenish()
            await until(lambda: started() == 7, 10, "spares are tried again")
        finally:
            await pool.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(go())


def test_a_wake_sent_while_the_worker_still_falls_asleep_leaves_it_awake(
        tmp_path: Path) -> None:
    """The worker's Sleep/Wake race (suspected, confirmed): the worker ran each Sleep and
    Wake as its own task at once, so a Wake that came while a Sleep still ran (a request
    just after the idle sleep began) finished first, the Sleep after it, and the engine
    stayed asleep while the router counted it ready. They now run in the order sent."""
    from shared.protocol import Sleep, Wake
    from worker.server import WorkerServer

    class Engine:
        awake = True

        async def sleep(self, level: int) -> None:
            await asyncio.sleep(0.2)  # vLLM offloads the weights
            self.awake = False

        async def wake(self) -> None:
            await asyncio.sleep(0.01)
            self.awake = True

        def in_flight(self) -> int:
            return 0

    async def go() -> None:
        server = WorkerServer(f"ipc://{tmp_path}/w.sock", "m", zmq.curve_keypair()[0].decode())
        engine = Engine()
        replies: list[object] = []
        server._engine = engine  # type: ignore[assignment]
        server._send = replies.append  # type: ignore[method-assign]
        try:
            server._handle(Sleep(id="s", level=1))
            server._handle(Wake(id="w"))
            await until(lambda: len(replies) == 2, 2, "both are answered")
            assert [getattr(r, "id", None) for r in replies] == ["s", "w"]
            assert engine.awake, "the engine is asleep after its Wake was answered"
        finally:
            server._ctx.destroy(linger=0)

    run(go())
