"""A spare's imports wait while a loaded model streams (issue 21): even at nice 19 they
took a serving model's 1-stream rate from 32 to 13.6 tokens/s for the first seconds after
every load. ``SparePool`` holds an importing spare (``SIGSTOP``) while its ``may_import``
says no, and lets it go on when that changes or when a load takes it."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

from router.registry import ModelRegistry
from router.workers.spares import SparePool
from router.workers.zygote import UNKNOWN_EXIT, PipeStdin
from shared.preset_loader import build_preset
from tests.test_lifecycle_races import run, until

F_SETPIPE_SZ = 1031  # fcntl's, Linux (Python 3.10+ names it only on some builds)

# An "import" of 40 steps of 10 ms, each a byte in the progress file, then ready.
IMPORTING = """
import os, sys, time
progress, fd = sys.argv[1], int(sys.argv[sys.argv.index("--ready-fd") + 1])
for _ in range(40):
    with open(progress, "a") as f:
        f.write("x")
    time.sleep(0.01)
os.write(fd, b"1")
sys.stdin.read()
"""


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_an_importing_spare_waits_while_models_stream_and_goes_on_when_they_stop(
        tmp_path: Path) -> None:
    registry = ModelRegistry(build_preset({"models": {"m": {"model": "/m"}}}))
    progress = tmp_path / "progress"
    streaming = [True]
    tasks: set[asyncio.Task[None]] = set()

    def spawn_task(coro: Any) -> None:
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def done() -> int:
        return len(progress.read_text()) if progress.exists() else 0

    async def go() -> None:
        pool = SparePool(1, registry, tmp_path, [sys.executable, "-c", IMPORTING,
                                                 str(progress)],
                         lambda: dict(os.environ), spawn_task,
                         may_import=lambda: not streaming[0])
        try:
            pool.replenish()
            await until(lambda: bool(pool._spares) and pool._spares[0].held, 5,
                        "the spare is held while a model streams")
            spare = pool._spares[0]
            assert state(spare.proc.pid) == "T"  # stopped, not merely slow
            before = done()
            await asyncio.sleep(0.3)
            assert done() == before < 40  # no step of its import while held
            streaming[0] = False  # the model is idle: the import goes on, to the end
            await until(spare.poll_ready, 10, "the spare finishes its import")
            assert done() == 40 and not spare.held
        finally:
            await pool.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(go())


def test_a_load_that_takes_a_held_spare_lets_it_go_on_at_once(tmp_path: Path) -> None:
    registry = ModelRegistry(build_preset({"models": {"m": {"model": "/m"}}}))
    tasks: set[asyncio.Task[None]] = set()

    def spawn_task(coro: Any) -> None:
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def go() -> None:
        pool = SparePool(1, registry, tmp_path, [sys.executable, "-c", IMPORTING,
                                                 str(tmp_path / "progress")],
                         lambda: dict(os.environ), spawn_task, may_import=lambda: False)
        try:
            pool.replenish()
            await until(lambda: bool(pool._spares) and pool._spares[0].held, 5,
                        "the spare is held")
            spare = await pool.take(registry.entries["m"].spec)
            assert spare is not None and not spare.held
            assert state(spare.proc.pid) != "T"
            spare.proc.kill()
            await spare.proc.wait()
        finally:
            await pool.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(go())


# A zygote with nothing to import: ``worker.zygote.serve`` as ``python -m worker --spare
# --zygote-fd`` runs it, and each spare it forks writes its stdin and its pid to a file
# named in argv, then exits with code 7 (``THREAD`` in argv: a thread runs before serve).
ZYGOTE = """
import os, sys, threading, time
from worker.zygote import serve
out = sys.argv[1]
ready = int(sys.argv[sys.argv.index("--ready-fd") + 1])
if "--zygote-fd" not in sys.argv:  # a spare started afresh (forks refused): one that waits
    os.write(ready, b"1")
    sys.stdin.read()
    sys.exit(0)
control = int(sys.argv[sys.argv.index("--zygote-fd") + 1])
if "THREAD" in sys.argv:
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
if "NICE" in sys.argv:  # imports at nice 19, as a spare's, for 3 seconds
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    time.sleep(3)
fork = os.fork
if "SLOW" in sys.argv:  # each fork is answered a second after the child exists
    os.fork = lambda: (lambda pid: pid and (time.sleep(1), pid)[1])(fork())
marker = out + ".died"
if "DIE_ONCE" in sys.argv and not os.path.exists(marker):
    def die():  # the first fork kills it (the OOM killer): its socket closes first
        open(marker, "w").close()
        os.close(control)
        time.sleep(2)
        os._exit(9)
    os.fork = die
os.write(ready, b"1")
router = serve(control, os.getpriority(os.PRIO_PROCESS, 0))
with open(out, "a") as f:
    f.write(f"{os.getpid()} {os.getsid(0)} {os.getppid()} {sys.stdin.read()}\\n")
sys.exit(7)
"""


def zygote_pool(tmp_path: Path, spawn_task: Any, *extra: str) -> SparePool:
    registry = ModelRegistry(build_preset({"models": {"m": {"model": "/m"}}}))
    return SparePool(1, registry, tmp_path, [sys.executable, "-c", ZYGOTE,
                                             str(tmp_path / "out"), *extra],
                     lambda: dict(os.environ), spawn_task, fork=True)


def tasks_of() -> tuple[set[asyncio.Task[None]], Any]:
    tasks: set[asyncio.Task[None]] = set()

    def spawn_task(coro: Any) -> None:
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return tasks, spawn_task


def test_spares_are_forked_from_the_zygote_and_reaped_through_it(tmp_path: Path) -> None:
    """Once the zygote has imported, each spare is a fork of it: ready at once, its own
    session, its stdin the boot the router writes, its exit code told by the zygote (it
    is not the router's child); a load that finds no spare left forks one on the spot."""
    tasks, spawn_task = tasks_of()
    registry_entry = ModelRegistry(build_preset({"models": {"m": {"model": "/m"}}})).entries["m"]

    async def go() -> None:
        pool = zygote_pool(tmp_path, spawn_task)
        try:
            pool.replenish()
            await until(lambda: bool(pool._spares), 30, "a spare is forked from the zygote")
            assert pool.zygote is not None
            zygote = pool.zygote.proc.pid
            first = await pool.take(registry_entry.spec)
            assert first is not None and first.forked and first.ready
            second = await pool.take(registry_entry.spec)  # none left: forked on the spot
            assert second is not None and second.forked and second.proc.pid != first.proc.pid
            for n, spare in enumerate((first, second)):
                stdin = spare.proc.stdin
                assert stdin is not None
                stdin.write(f"boot{n}".encode())
                stdin.close()
                assert await asyncio.wait_for(spare.proc.wait(), 10) == 7
            lines = sorted((tmp_path / "out").read_text().split("\n")[:-1])
            assert lines == sorted(f"{s.proc.pid} {s.proc.pid} {zygote} boot{n}"
                                   for n, s in enumerate((first, second))), lines
            # Both were reaped: a zombie would still be listed among its children.
            assert not any(p.status() == "zombie" for p in psutil.Process(zygote).children())
        finally:
            await pool.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(go())


def test_a_zygote_that_refuses_a_fork_gives_way_to_started_spares(tmp_path: Path) -> None:
    """A thread in the zygote (which a fork would not copy, with whatever lock it held)
    refuses the fork: the zygote is stopped and spares are started as processes."""
    tasks, spawn_task = tasks_of()

    async def go() -> None:
        pool = zygote_pool(tmp_path, spawn_task, "THREAD")
        try:
            pool.replenish()
            await until(lambda: not pool.fork and bool(pool._spares), 30,
                        "a spare started afresh after the refusal")
            assert pool.zygote is None and not pool._spares[0].forked
            await until(pool._spares[0].poll_ready, 30, "the started spare is ready")
        finally:
            await pool.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(go())


def test_a_forked_spare_outlives_its_zygote(tmp_path: Path) -> None:
    """The zygote dies (the OOM killer): the spare it forked does not (no parent-death
    signal ties it to the zygote), its exit is still seen (code unknown: the zygote that
    would reap it is gone), and another zygote is started."""
    tasks, spawn_task = tasks_of()

    async def go() -> None:
        pool = zygote_pool(tmp_path, spawn_task)
        try:
            pool.replenish()
            await until(lambda: bool(pool._spares), 30, "a spare is forked")
            assert pool.zygote is not None
            old = pool.zygote.proc.pid
            spare = pool._spares[0]
            os.kill(old, signal.SIGKILL)
            await until(lambda: pool.zygote is not None and pool.zygote.proc.pid != old, 10,
                        "another zygote")
            assert spare.proc.returncode is None and psutil.Process(spare.proc.pid).is_running()
            os.kill(spare.proc.pid, signal.SIGKILL)
            assert await asyncio.wait_for(spare.proc.wait(), 10) == UNKNOWN_EXIT
        finally:
            await pool.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(go())


def test_a_zygote_that_dies_mid_fork_is_replaced_not_given_up(tmp_path: Path) -> None:
    """A zygote gone in the middle of a fork (its socket closed before its exit was seen)
    did not refuse anything: it is replaced, and spares are still forked."""
    tasks, spawn_task = tasks_of()

    async def go() -> None:
        pool = zygote_pool(tmp_path, spawn_task, "DIE_ONCE")
        try:
            pool.replenish()
            await until(lambda: (tmp_path / "out.died").exists(), 30, "the first fork")
            await until(lambda: bool(pool._spares), 30, "a spare after the zygote's death")
            assert pool.fork and pool._spares[0].forked
        finally:
            await pool.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(go())


def test_a_load_cancelled_mid_fork_leaves_no_zombie(tmp_path: Path) -> None:
    """A load cancelled while the zygote forks its spare (an unload, a stop): the spare
    forked meanwhile gets no boot, exits, and is reaped; the next fork is answered with
    its own pid."""
    tasks, spawn_task = tasks_of()
    entry = ModelRegistry(build_preset({"models": {"m": {"model": "/m"}}})).entries["m"]

    async def go() -> None:
        pool = zygote_pool(tmp_path, spawn_task, "SLOW")
        pool.size = 0  # no spare kept: a load forks its own
        try:
            pool._starting = True
            await pool._start_process(zygote=True)
            pool._starting = False
            assert pool.zygote is not None
            zygote = pool.zygote
            await until(zygote.poll_ready, 30, "the zygote imported")
            load = asyncio.create_task(pool.take(entry.spec))
            await until(lambda: bool(psutil.Process(zygote.proc.pid).children()), 10,
                        "the fork under way")
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
            assert load.cancelled()  # (cancelled in the exchange, not after)
            await until(lambda: (tmp_path / "out").exists(), 10, "the cancelled spare exited")
            await until(lambda: not psutil.Process(zygote.proc.pid).children(), 10,
                        "the cancelled spare reaped (no zombie left in the zygote)")
            spare = await pool.take(entry.spec)
            assert spare is not None and spare.proc.stdin is not None
            spare.proc.stdin.write(b"boot")
            spare.proc.stdin.close()
            assert await asyncio.wait_for(spare.proc.wait(), 10) == 7
            assert f"{spare.proc.pid} {spare.proc.pid} {zygote.proc.pid} boot" in (
                tmp_path / "out").read_text().split("\n")
        finally:
            await pool.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(go())


async def importing_zygote(pool: SparePool) -> int:
    """Start ``pool``'s zygote alone (no spares to fork) and wait for its imports at nice
    19 (the fake zygote's ``NICE``); its pid."""
    pool.size = 0
    await pool._start_process(zygote=True)
    assert pool.zygote is not None
    pid = pool.zygote.proc.pid
    await until(lambda: os.getpriority(os.PRIO_PROCESS, pid) == 19, 10, "nice 19")
    return pid


def test_a_load_cancelled_while_the_zygote_imports_leaves_it_at_its_priority(
        tmp_path: Path) -> None:
    """A load that hurries the zygote's imports (its priority raised to the router's) and
    is cancelled meanwhile puts it back at nice 19: it must not import beside models."""
    tasks, spawn_task = tasks_of()
    entry = ModelRegistry(build_preset({"models": {"m": {"model": "/m"}}})).entries["m"]

    async def go() -> None:
        pool = zygote_pool(tmp_path, spawn_task, "NICE")
        try:
            pid = await importing_zygote(pool)
            load = asyncio.create_task(pool.take(entry.spec))
            mine = os.getpriority(os.PRIO_PROCESS, 0)
            await until(lambda: os.getpriority(os.PRIO_PROCESS, pid) in (mine, 19) and
                        load.done() is False, 10, "the load waits")
            await asyncio.sleep(0.2)
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
            assert os.getpriority(os.PRIO_PROCESS, pid) == 19
        finally:
            await pool.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(go())


def test_a_boot_longer_than_the_pipe_holds_does_not_block_the_router() -> None:
    """A forked spare's boot is written to its stdin pipe at ``close``: what the pipe does
    not take at once (4 KiB for a user past its pipe quota) waits for the reader, on the
    event loop, instead of blocking it until the spare reads (or for good, if it never
    does)."""
    read, write = os.pipe()
    fcntl.fcntl(write, F_SETPIPE_SZ, 4096)
    boot = os.urandom(48 * 1024)
    closed = threading.Event()
    got = bytearray()
    on_time: list[bool] = []

    def reader() -> None:
        on_time.append(closed.wait(10))  # the router's close returned (blocked: it did not)
        while chunk := os.read(read, 65536):
            got.extend(chunk)
        os.close(read)

    async def go() -> None:
        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        stdin = PipeStdin(write)
        stdin.write(boot)
        stdin.close()
        closed.set()
        await until(lambda: not thread.is_alive(), 20, "the reader read the boot to its EOF")
        assert on_time == [True], "close() blocked the event loop until the reader read"
        assert bytes(got) == boot

    run(go())


def test_two_loads_cancelled_while_the_zygote_imports_leave_it_at_its_priority(
        tmp_path: Path) -> None:
    """Two loads hurry the zygote's imports; the first cancelled must not put it back at
    nice 19 while the other still waits, nor the second restore the priority the first
    had raised it to."""
    tasks, spawn_task = tasks_of()
    entry = ModelRegistry(build_preset({"models": {"m": {"model": "/m"}}})).entries["m"]

    async def go() -> None:
        pool = zygote_pool(tmp_path, spawn_task, "NICE")
        try:
            pid = await importing_zygote(pool)
            mine = os.getpriority(os.PRIO_PROCESS, 0)
            first = asyncio.create_task(pool.take(entry.spec))
            await until(lambda: os.getpriority(os.PRIO_PROCESS, pid) == mine, 10, "hurried")
            second = asyncio.create_task(pool.take(entry.spec))
            await asyncio.sleep(0.1)
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            assert os.getpriority(os.PRIO_PROCESS, pid) == mine  # the second still waits
            second.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await second
            assert os.getpriority(os.PRIO_PROCESS, pid) == 19
        finally:
            await pool.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(go())


def test_health_documents_what_it_says_of_spares_and_the_zygote(tmp_path: Path) -> None:
    """``/health``'s schema names every field ``describe`` and ``describe_zygote`` give."""
    from router.api.openapi import build_document

    tasks, spawn_task = tasks_of()
    schema = build_document([], auth=True)["components"]["schemas"]["Health"]["properties"]

    async def go() -> None:
        pool = zygote_pool(tmp_path, spawn_task)
        try:
            pool.replenish()
            await until(lambda: bool(pool._spares), 30, "a spare is forked")
            described = pool.describe_zygote()
            assert described is not None and "zygote" in schema
            spare = schema["spares"]["items"]["properties"]
            assert set(described) == set(pool.describe()[0]) == set(spare)
            assert set(schema["zygote"]["anyOf"][0]["properties"]) == set(described)
        finally:
            await pool.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(go())


def test_a_kernel_without_pidfds_starts_spares_as_processes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before Linux 5.3 (no ``pidfd_open``) a zygote cannot watch the router nor the
    router wait for what it forked: spares are started as processes, as with
    ``fork_spares: false``, instead of a zygote that dies after its imports, three
    times after every load, and no spare at all."""
    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    tasks, spawn_task = tasks_of()

    async def go() -> None:
        pool = zygote_pool(tmp_path, spawn_task)
        try:
            pool.replenish()
            await until(lambda: bool(pool._spares) or pool.zygote is not None, 30,
                        "a spare or a zygote started")
            assert pool.zygote is None and not pool._spares[0].forked
        finally:
            await pool.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(go())


def test_a_zygote_that_cannot_get_its_socket_leaks_no_descriptor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of descriptors (EMFILE) at the zygote's socket pair: the ready pipe made just
    before is closed, and the failure counts (it was raised out of the task instead)."""
    def no_socket(*args: Any) -> Any:
        raise OSError(errno.EMFILE, "Too many open files")

    tasks, spawn_task = tasks_of()

    async def go() -> None:
        pool = zygote_pool(tmp_path, spawn_task)
        monkeypatch.setattr(socket, "socketpair", no_socket)
        before = set(os.listdir("/proc/self/fd"))
        try:
            await pool._start_process(zygote=True)
            assert pool.zygote is None and pool._failures == 1
            assert set(os.listdir("/proc/self/fd")) <= before
        finally:
            await pool.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(go())
