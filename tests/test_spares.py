"""A spare's imports wait while a loaded model streams (issue 21): even at nice 19 they
took a serving model's 1-stream rate from 32 to 13.6 tokens/s for the first seconds after
every load. ``SparePool`` holds an importing spare (``SIGSTOP``) while its ``may_import``
says no, and lets it go on when that changes or when a load takes it."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from router.registry import ModelRegistry
from router.workers.spares import SparePool
from shared.config import build_preset
from tests.test_lifecycle_races import run, until

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
            spare = await pool.take(registry.entries["m"])
            assert spare is not None and not spare.held
            assert state(spare.proc.pid) != "T"
            spare.proc.kill()
            await spare.proc.wait()
        finally:
            await pool.close()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(go())
