"""``python -m worker``: one model's worker process, started by the router.

Arguments: ``--endpoint`` (the router's ZeroMQ address), ``--cache-dir``; the model's
spec comes as JSON on stdin, not on the command line, where every user could read it.
vLLM spawns an EngineCore child, so everything runs under the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import sys
import threading

import msgspec

from shared.config import WorkerBoot
from worker.server import WorkerServer

log = logging.getLogger("modelyard.worker")
SHUTDOWN_GRACE = 15.0  # seconds engine.shutdown() may take before the group is killed


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the router dies (a belt to the watcher's braces)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:  # not glibc Linux: the parent watcher in WorkerServer still works
        pass


def _end_group(*_: object) -> None:
    """Kill this worker and its EngineCore children at once.

    Used while the engine loads (a blocking call, so the event loop cannot run a graceful
    handler) and as a watchdog if a graceful shutdown hangs. Only when the router made us
    a process-group leader: a worker started by hand must not kill its shell's group.
    """
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os._exit(1)


async def _main(args: argparse.Namespace, boot: WorkerBoot) -> int:
    spec = boot.spec
    parent = os.getppid()
    server = WorkerServer(args.endpoint, spec.id, boot.router_key)
    signal.signal(signal.SIGTERM, _end_group)
    try:
        if spec.engine == "synthetic":
            from worker.synthetic import SyntheticEngine, SyntheticError

            engine, error = SyntheticEngine(spec), SyntheticError
        else:
            from worker.engine import RequestError, VllmEngine
            from worker.materialize import resolve_model_path

            # Loading weights blocks; nothing else runs in this process until it is done.
            path = resolve_model_path(spec.model, args.cache_dir)
            engine, error = VllmEngine.start(spec, path), RequestError  # type: ignore[assignment]
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
        await server.serve(engine, error, parent)
    finally:
        watchdog = threading.Timer(SHUTDOWN_GRACE, _end_group)
        watchdog.daemon = True
        watchdog.start()
        engine.shutdown()
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m worker")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _die_with_parent()
    boot = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerBoot)
    sys.exit(asyncio.run(_main(args, boot)))


if __name__ == "__main__":
    main()
