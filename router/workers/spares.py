"""``SparePool``: worker processes kept started with vLLM and torch imported and no model.

A spare is ``python -m worker --spare``: it imports, writes one byte to its ready pipe,
then blocks reading its ``WorkerBoot`` on stdin. ``take`` hands one to a load (the
supervisor writes the boot); ``replenish`` starts another, one at a time, in the
background. A spare that dies unused is logged and replaced, up to ``FAILURES_MAX`` in a
row; a spare that came up ready, or any worker of this host that became ready, starts the
count again (what killed them, a full disk or memory, may have passed).

A spare's imports are held (``SIGSTOP``) while ``may_import`` says no: while a loaded model
streams and no load waits for a worker. Even at nice 19 (and under ``SCHED_IDLE``, tried)
an import beside a serving model took a 1-stream rate from 32 to 13.6 tokens/s for the
first ~4 s after every load: not CPU time but the core's shared resources. A held spare
still dies with the router: it is started with SIGKILL as its parent-death signal, which
a stopped process cannot hold off (``shared.lifeline``).

With ``fork`` (the preset's ``fork_spares``, default on) the pool starts one spare of that
kind, the zygote (``worker/zygote.py``), paced the same way, and once its imports are done
forks each spare from it in ~10 ms, ready at once: the spare that replaces one a load took
is there before the next load. ``take`` forks one on the spot when none is left. A zygote
that refuses a fork (a thread started in it) is stopped, and spares are started as
processes from then on; one that dies is replaced as a spare is (``FAILURES_MAX``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol

import psutil

from router.registry import ModelRegistry
from router.workers.processes import group_members, kill_tree, log_tail, signal_all
from router.workers.zygote import ForkedProcess, ZygoteError, ZygoteLink, ZygoteRefused
from shared.config import ModelSpec
from shared.lifeline import dies_with

log = logging.getLogger("modelyard.router")
FAILURES_MAX = 3  # spares that die unused in a row before no more are started
PACE = 0.05  # seconds between looks at whether an importing spare may go on


class Stdin(Protocol):
    def write(self, data: bytes) -> None: ...
    def close(self) -> None: ...


class Proc(Protocol):
    """What the router uses of a worker's process: asyncio's ``Process``, or a
    ``ForkedProcess`` (a spare the zygote forked)."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def stdin(self) -> Stdin | None: ...
    async def wait(self) -> int: ...


class Spare:
    """A started worker process with vLLM imported, waiting on stdin for its model. It
    writes one byte to ``ready_fd``'s pipe once its imports are done (a forked spare has
    none: it is ready from the start)."""

    def __init__(self, proc: Proc, log_path: Path, ready_fd: int | None) -> None:
        self.proc = proc
        self.log_path = log_path
        self.started_at = time.time()
        self._ready_fd: int | None = ready_fd
        self.ready = ready_fd is None
        self.forked = isinstance(proc, ForkedProcess)
        """Its output went to the zygote's log until it took its model's."""
        self.held = False
        """Stopped (``SIGSTOP``) until a model stops streaming or a load needs it."""
        self.hurried = 0
        """Loads waiting for the zygote's imports, at the router's priority meanwhile."""
        self.nice = 0
        """The zygote's priority before the first of them raised it (restored after)."""

    def hold(self, held: bool) -> None:
        """Stop or continue the process (its imports); a process already gone is left."""
        if held != self.held and self.proc.returncode is None:
            try:
                os.kill(self.proc.pid, signal.SIGSTOP if held else signal.SIGCONT)
            except ProcessLookupError:  # it died: its watcher reports it
                return
            self.held = held

    def poll_ready(self) -> bool:
        """Whether its imports are done (it said so on its pipe)."""
        if self._ready_fd is not None:
            try:
                said = os.read(self._ready_fd, 1)
            except BlockingIOError:
                return False
            self.ready = said == b"1"
            self.close()
        return self.ready

    def close(self) -> None:
        if self._ready_fd is not None:
            os.close(self._ready_fd)
            self._ready_fd = None


class SparePool:
    """Up to ``size`` spares for the models of ``registry`` that can use one."""

    def __init__(self, size: int, registry: ModelRegistry, runtime_dir: Path,
                 command: list[str], env: Callable[[], dict[str, str]],
                 spawn_task: Callable[[Coroutine[Any, Any, None]], None],
                 may_import: Callable[[], bool] = lambda: True, fork: bool = False) -> None:
        self.size = size
        self.fork = fork and _has_pidfd()
        if fork and not self.fork:
            log.warning("fork_spares: this kernel has no pidfd (Linux 5.3+), which a forked "
                        "spare needs (the router waits for it, it watches the router); "
                        "spares are started as processes")
        self.zygote: Spare | None = None
        self._link: ZygoteLink | None = None
        self.may_import = may_import
        self.registry = registry
        self.runtime_dir = runtime_dir
        self.command = command
        self.env = env
        self._spawn_task = spawn_task
        self._spares: list[Spare] = []
        self._starting = False
        self._failures = 0
        self._closing = False
        self._count = 0

    @staticmethod
    def fits(spec: ModelSpec) -> bool:
        """A spare can become the worker of ``spec``: a vLLM model without an ``env`` of its
        own. Libraries read some variables at import (``HF_HOME``, ``HF_HUB_OFFLINE``),
        which a spare did before it knew its model, and a variable set afterwards is not
        in its process environment as ``/proc`` shows it; such a model gets a fresh
        process, which has its environment from the start."""
        return spec.engine == "vllm" and not spec.env and spec.backend != "ray"

    def replenish(self) -> None:
        """Keep ``size`` spares, started one at a time in the background (and a zygote,
        even with ``size`` spares kept: a load that takes them all forks another)."""
        if (self._starting or self._closing or not self.size
                or self._failures >= FAILURES_MAX
                or not any(self.fits(e.spec) for e in self.registry)):
            return
        if self.fork and self.zygote is not None and not self.zygote.ready:
            return  # its pacing calls this once its imports are done
        if self.fork and self._link is not None and self._link.broken:
            return  # the zygote was stopped: its watcher calls this once it has exited
        if len(self._spares) >= self.size and not (self.fork and self.zygote is None):
            return
        self._starting = True
        self._spawn_task(self._start())

    async def _start(self) -> None:
        try:
            if not self.fork:
                await self._start_process()
            elif self.zygote is None:
                await self._start_process(zygote=True)  # it forks spares once it is ready
            else:
                forked = await self._fork()
                if forked is not None:
                    self._spares.append(forked)
                    self._spawn_task(self._watch(forked))
        finally:
            self._starting = False
        self.replenish()

    async def _start_process(self, zygote: bool = False) -> None:
        """Start a spare process (or the zygote); one pipe tells when its imports are done."""
        self._count += 1
        log_path = self.runtime_dir / (f"zygote{self._count}.log" if zygote
                                       else f"spare{self._count}.log")
        ready_fd: int | None = None
        told_fd: int | None = None
        ours: socket.socket | None = None
        theirs: socket.socket | None = None
        try:  # (EMFILE: each descriptor made so far is closed, and the failure counts)
            ready_fd, told_fd = os.pipe()
            os.set_blocking(ready_fd, False)
            if zygote:
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            extra = ["--zygote-fd", str(theirs.fileno())] if theirs is not None else []
            with open(log_path, "ab") as log_file:  # noqa: ASYNC230  # a local append: no wait
                proc = await asyncio.create_subprocess_exec(
                    *self.command, "--ready-fd", str(told_fd), *extra,
                    stdin=asyncio.subprocess.DEVNULL if zygote else asyncio.subprocess.PIPE,
                    stdout=log_file, stderr=asyncio.subprocess.STDOUT, env=self.env(),
                    start_new_session=True,
                    pass_fds=(told_fd,) + ((theirs.fileno(),) if theirs is not None else ()),
                    preexec_fn=dies_with(os.getpid()))  # dies with us, held or not
        except (OSError, ValueError) as err:
            if ready_fd is not None:
                os.close(ready_fd)
            if ours is not None:
                ours.close()
            self._failures += 1
            log.error("could not start a spare worker: %s: %s", type(err).__name__, err)
            return
        finally:
            if told_fd is not None:
                os.close(told_fd)
            if theirs is not None:
                theirs.close()
        spare = Spare(proc, log_path, ready_fd)
        if ours is not None:
            self.zygote, self._link = spare, ZygoteLink(ours)
            log.info("zygote pid %d starting (spares are forked from it)", proc.pid)
        else:
            self._spares.append(spare)
            log.info("spare worker pid %d starting", proc.pid)
        self._spawn_task(self._watch(spare))
        self._spawn_task(self._pace(spare))

    async def _fork(self) -> Spare | None:
        """A spare forked from the zygote; ``None`` (and processes from now on) where it
        refused, and ``None`` where it is gone (its watcher starts another)."""
        zygote, link = self.zygote, self._link
        assert zygote is not None and link is not None
        try:
            proc = await link.fork()
        except ZygoteRefused as err:
            if self.zygote is zygote:
                log.warning("the zygote (pid %d) refused a fork: %s; spares are started as "
                            "processes from now on", zygote.proc.pid, err)
                self.fork = False
                self._end_zygote()
            return None
        except ZygoteError as err:  # gone, or its link broke: its watcher starts another
            if self.zygote is zygote:
                log.error("the zygote (pid %d) failed a fork: %s; it is stopped",
                          zygote.proc.pid, err)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(zygote.proc.pid, signal.SIGKILL)  # (a link broken, it lives)
            return None
        log.info("spare worker pid %d forked from the zygote", proc.pid)
        return Spare(proc, zygote.log_path, None)

    def _end_zygote(self) -> None:
        zygote, link = self.zygote, self._link
        self.zygote = self._link = None
        if zygote is not None:
            zygote.close()
            with contextlib.suppress(ProcessLookupError):
                os.kill(zygote.proc.pid, signal.SIGKILL)
        if link is not None:
            link.close()

    def _kept(self, spare: Spare) -> bool:
        return spare in self._spares or spare is self.zygote

    async def _pace(self, spare: Spare) -> None:
        """Until ``spare`` is ready (or taken, or gone): hold its imports while
        ``may_import`` says no. A zygote ready forks the spares."""
        while self._kept(spare) and spare.proc.returncode is None and not spare.poll_ready():
            spare.hold(not self.may_import())
            await asyncio.sleep(PACE)
        if self._kept(spare):
            spare.hold(False)
        if spare is self.zygote and spare.ready:
            self.replenish()

    async def _watch(self, spare: Spare) -> None:
        code = await spare.proc.wait()
        what = "spare worker"
        if spare is self.zygote:
            what = "the zygote"
            self._end_zygote()
        elif spare in self._spares:
            self._spares.remove(spare)
        else:
            return  # it became a worker, or it was stopped
        spare.close()
        self._failures += 1
        last = await asyncio.to_thread(log_tail, spare.log_path, 5)
        log.error("%s pid %d exited unused with code %s%s\n%s", what, spare.proc.pid, code,
                  "; no more spares are started until a worker starts"
                  if self._failures >= FAILURES_MAX else "",
                  last)
        await asyncio.to_thread(lambda: signal_all(group_members(
            spare.proc.pid, spare.started_at, time.time()), signal.SIGKILL))
        self.replenish()

    async def take(self, spec: ModelSpec) -> Spare | None:
        """A live spare for the worker of ``spec``, if one fits it (one being started is
        waited for: its process exists within milliseconds); a ready one first."""
        if not self.fits(spec):
            return None
        while self._starting and not self._spares:
            await asyncio.sleep(0.01)
        self._spares.sort(key=lambda spare: not spare.poll_ready())
        while self._spares:
            spare = self._spares.pop(0)
            spare.close()
            spare.hold(False)  # a load needs it now: its imports go on at once
            if spare.proc.returncode is None:
                if spare.ready:
                    self._failures = 0  # spares can start here: a new streak from now
                return spare
        return await self._fork_now()

    async def _fork_now(self) -> Spare | None:
        """A spare forked for a load that found none: once the zygote's imports are done
        (they go on at once, at the router's priority, as a taken spare's do)."""
        zygote = self.zygote
        if not self.fork or zygote is None or self._closing:
            return None
        zygote.hold(False)
        if not zygote.poll_ready():
            try:  # the first load that hurries it notes its priority, the last restores it
                if not zygote.hurried:
                    zygote.nice = os.getpriority(os.PRIO_PROCESS, zygote.proc.pid)
                    _renice(zygote.proc.pid, os.getpriority(os.PRIO_PROCESS, 0))
            except OSError:
                pass  # gone: its watcher says so
            else:
                zygote.hurried += 1
                try:
                    while (zygote is self.zygote and zygote.proc.returncode is None
                           and not zygote.poll_ready()):
                        await asyncio.sleep(PACE)
                finally:  # a load cancelled too: it must not import beside models
                    zygote.hurried -= 1
                    if not zygote.hurried:  # (lowering a priority is always allowed)
                        _renice(zygote.proc.pid, zygote.nice)
        if zygote is not self.zygote or not zygote.ready:
            return None  # it died: a fresh process
        return await self._fork()  # (its exit is reaped whoever waits: ``ForkedProcess``)

    def worker_ready(self) -> None:
        """A worker of this host became ready: spares can start again, whatever killed
        them before (the supervisor calls ``replenish`` next)."""
        self._failures = 0

    def describe(self) -> list[dict[str, Any]]:
        """The spares' pids, readiness and resident memory (``/health``)."""
        return [d for d in map(_describe, self._spares) if d is not None]

    def describe_zygote(self) -> dict[str, Any] | None:
        """The zygote, as ``describe`` a spare (``/health``); ``None`` without one."""
        return _describe(self.zygote) if self.zygote is not None else None

    async def close(self, zygote: bool = True) -> None:
        """Stop every spare (the server is stopping); start no more. With ``zygote``
        false the zygote is left, to reap the workers it forked until they have
        stopped (a second ``close`` stops it)."""
        self._closing = True
        spares, self._spares = self._spares, []  # their watchers see them stopped, not dead
        for spare in spares:
            spare.close()
            kill_tree(spare.proc.pid)
        await asyncio.gather(*(spare.proc.wait() for spare in spares))
        if zygote and self.zygote is not None:
            proc = self.zygote.proc
            self._end_zygote()  # its own pid alone: ``kill_tree`` would take its children
            await proc.wait()


def _describe(spare: Spare) -> dict[str, Any] | None:
    try:
        rss = psutil.Process(spare.proc.pid).memory_info().rss
    except psutil.Error:
        return None
    return {"pid": spare.proc.pid, "ready": spare.poll_ready(), "held": spare.held,
            "forked": spare.forked, "rss_mib": round(rss / 2**20, 1),
            "age_seconds": round(time.time() - spare.started_at, 1)}


def _renice(pid: int, nice: int) -> None:
    """Set every thread of ``pid`` to ``nice`` where we may (raising a priority needs root
    or ``RLIMIT_NICE``: without, it stays as it was); a process gone is left."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return  # (never raised: from a ``finally`` it would replace a cancellation)
    for tid in tids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)


def _has_pidfd() -> bool:
    """Whether this kernel opens pidfds (Linux 5.3+): without, a zygote dies at its first
    line after its imports, and with it every forked spare there would have been."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (OSError, AttributeError):  # ENOSYS; (AttributeError: not Linux)
        return False
    return True
