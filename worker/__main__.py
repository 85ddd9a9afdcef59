"""``python -m worker``: one model's worker process, started by the router.

What the worker serves comes as one JSON ``WorkerBoot`` on stdin (its model's spec, the
router's address and key, its environment), never on the command line, where every user
could read it. With ``--spare`` the process first imports vLLM and torch, then waits for
its boot: the router keeps such a spare ready and turns it into the next model's worker.
vLLM starts EngineCore children, so everything runs under the ``__main__`` guard. The
worker and the processes its engine starts die with the router (``shared.lifeline``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import resource
import select
import signal
import sys
import threading
import time

import msgspec
import uvloop

from shared.config import WorkerBoot
from shared.lifeline import die_with_parent, guard_group, set_parent_death_signal
from worker.server import WorkerServer

log = logging.getLogger("modelyard.worker")
SHUTDOWN_GRACE = 15.0  # seconds engine.shutdown() may take before the group is killed


CHILDREN_DIE_WITH_IT = "MODELYARD_CHILDREN_DIE_WITH_WORKER"
"""Set by the Ray backend's actor: Ray's raylet SIGKILLs a dead actor's child (this
worker), which then cannot end its process group, so each process forked from here on
(EngineCore, and its own children) gets SIGKILL when the process that forked it dies."""


def _children_die_with_us() -> None:
    forking = [0]  # the pid of the process that forks (this worker, or EngineCore)

    def in_child() -> None:
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != forking[0]:  # it died before the line above took effect
            os.kill(os.getpid(), signal.SIGKILL)

    os.register_at_fork(before=lambda: forking.__setitem__(0, os.getpid()),
                        after_in_child=in_child)


def _end_group(*_: object) -> None:
    """Kill this worker and its EngineCore children at once.

    Used while the engine loads (a blocking call, so the event loop cannot run a graceful
    handler) and as a watchdog if a graceful shutdown hangs. Only when the router made us
    a process-group leader: a worker started by hand must not kill its shell's group.
    """
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os._exit(1)


def _take_output(path: str) -> None:
    """Send this process's stdout and stderr (and its children's) to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


class Phases:
    """Seconds each step of a start took, sent to the router in ``Ready``."""

    def __init__(self, imported_at: float) -> None:
        self.booted_at = time.time()  # when this process learned its model
        self.imported_at = imported_at  # when vLLM and torch were imported (0: not yet)
        self.mark = self.booted_at
        self.seconds: dict[str, float] = {}

    def done(self, name: str) -> None:
        now = time.time()
        self.seconds[name] = round(now - self.mark, 3)
        self.mark = now


SPARE_NICE = 19
"""A spare's CPU priority while it has no model: its imports (~10 s of a core) take only
the time loaded models leave idle. Two OpenMP threads serving a model slowed 4-7x when an
import at equal priority took one of their cores after every load."""


def _can_raise_priority(nice: int) -> bool:
    """Whether this process may later go back to ``nice`` (root, or ``RLIMIT_NICE``)."""
    limit = resource.getrlimit(resource.RLIMIT_NICE)[0]
    return os.geteuid() == 0 or limit == resource.RLIM_INFINITY or 20 - nice <= limit


def _import_in_background(zygote: bool) -> int:
    """Lower this spare's priority until its boot arrives on stdin, then restore it on every
    thread, so the model it is given (and a spare taken before its imports are done) runs
    at the router's priority. Left as it is where the priority could not be restored. A
    zygote starts no thread (it forks): each spare it forks restores the priority it
    returns, its own."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice >= SPARE_NICE or not _can_raise_priority(nice):
        return nice
    os.setpriority(os.PRIO_PROCESS, 0, SPARE_NICE)
    if zygote:
        return nice

    def restore() -> None:
        select.select([sys.stdin.fileno()], [], [])  # the boot (or EOF): read by main()
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that has just ended
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)

    threading.Thread(target=restore, name="spare-priority", daemon=True).start()
    return nice


def _import_vllm() -> float:
    """Import what a vLLM engine needs (a spare does this before it has a model)."""
    from worker.engine import preload

    preload()
    return time.time()


async def _main(args: argparse.Namespace, boot: WorkerBoot, phases: Phases,
                router: int | None) -> int:
    spec = boot.spec
    parent = os.getppid()
    server = WorkerServer(boot.endpoint, spec.id, boot.router_key)
    signal.signal(signal.SIGTERM, _end_group)
    try:
        if spec.engine == "synthetic":
            from worker.synthetic import SyntheticEngine, SyntheticError

            engine, error = SyntheticEngine(spec), SyntheticError
            phases.done("engine")  # its ``start_seconds``, timed as a real engine's start
        else:
            from worker.engine import RequestError, VllmEngine
            from worker.materialize import resolve_model_path

            if not phases.imported_at:
                phases.imported_at = _import_vllm()
            # imported before the boot came (a spare): none of this start's time
            phases.seconds["imports"] = round(max(0.0, phases.imported_at - phases.mark), 3)
            phases.mark = max(phases.mark, phases.imported_at)
            # Loading weights blocks; nothing else runs in this process until it is done.
            path = resolve_model_path(spec.model, args.cache_dir)
            phases.done("model_files")
            engine, error = VllmEngine.start(spec, path), RequestError  # type: ignore[assignment]
            phases.done("engine")
    except Exception as err:  # any start failure is reported to the router, then we exit
        log.exception("model %s failed to start", spec.id)
        server.fail(f"{type(err).__name__}: {err}")
        await asyncio.sleep(0.2)  # let the frame leave before the socket closes
        server.close()
        return 1
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop)
    try:
        await server.serve(engine, error, parent, phases.seconds, phases.booted_at, router)
    finally:
        if spec.engine != "synthetic" and os.getpgid(0) == os.getpid():
            # A fast stop: the router drained this worker before its Shutdown, so there is
            # nothing to finish; the engine's processes die with the group at once (vLLM's
            # own shutdown of them took ~6 s).
            log.info("model %s: stopping", spec.id)
            _end_group()
        watchdog = threading.Timer(SHUTDOWN_GRACE, _end_group)
        watchdog.daemon = True
        watchdog.start()
        engine.shutdown()
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m worker")
    parser.add_argument("--spare", action="store_true",
                        help="import vLLM and torch first, then wait for a model on stdin")
    parser.add_argument("--ready-fd", type=int, default=None,
                        help="with --spare: write one byte here once the imports are done")
    parser.add_argument("--zygote-fd", type=int, default=None,
                        help="with --spare: after the imports, fork spares for the router "
                        "over this socket (worker/zygote.py)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    die_with_parent()
    if os.environ.get(CHILDREN_DIE_WITH_IT) == "1":
        _children_die_with_us()
    zygote = args.spare and args.zygote_fd is not None
    nice = _import_in_background(zygote) if args.spare else 0
    imported_at = _import_vllm() if args.spare else 0.0
    if args.ready_fd is not None:
        with contextlib.suppress(OSError):  # the router stopped listening: it gave us a model
            os.write(args.ready_fd, b"1")
        os.close(args.ready_fd)
    router = None  # a pidfd of the router, where the router is not our parent
    if zygote:
        from worker.zygote import serve

        router = serve(args.zygote_fd, nice)  # returns in a spare it forked
        imported_at = time.time()  # nothing of this spare's start went to imports
    data = sys.stdin.buffer.read()
    if not data:  # the router is gone (or stopped this spare) before it gave us a model
        sys.exit(0)
    boot = msgspec.json.decode(data, type=WorkerBoot)
    phases = Phases(imported_at)
    if boot.log_path:
        _take_output(boot.log_path)
    if boot.spec.engine != "synthetic":  # its engine starts processes: they end with it
        guard_group(router)
    os.environ.update(boot.env)  # before any engine reads it (placement, the model's env)
    # uvloop, as vLLM's own API server runs: the stdlib loop's Python ``_run_once`` cost the
    # synthetic worker about half its time per request.
    sys.exit(uvloop.run(_main(args, boot, phases, router)))


if __name__ == "__main__":
    main()
