"""Parking a real vLLM worker (issue 37): a stream parked three times for 10 s in its
middle (its engine's scheduler paused between steps, every process of the worker stopped)
ends with the very tokens it gives alone; vLLM's own liveness checks, the worker's and
the router's survive stops of that length; a parked worker spends no CPU.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psutil
import pytest

from router.lifecycle.supervisor import Supervisor
from router.registry import ModelEntry, ModelRegistry
from router.workers.placement import Placer
from shared.preset_loader import build_preset
from shared.protocol import Generate, SamplingSpec
from tests.test_parking import run

PAUSES = 3
PAUSE_SECONDS = 10.0
TOKENS = 48


def cpu_seconds(pids: set[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


@pytest.mark.integration
def test_a_stream_parked_for_30_s_ends_with_the_tokens_it_gives_alone(tmp_path: Path) -> None:
    preset = build_preset({
        "server": {"spare_workers": 0, "load_timeout": 600},
        "models": {"m": {"model": "builtin:smollm2", "max_model_len": 512,
                         "kv_cache_gib": 1}}})
    sup = Supervisor(ModelRegistry(preset), preset.server, tmp_path, Placer())
    entry: ModelEntry = sup.registry.entries["m"]

    async def generate(gen_id: str, during: asyncio.Event | None = None) -> tuple[str, int]:
        """The text and the token count of one greedy generation."""
        lease, link = await sup.acquire("m")
        try:
            text, tokens = "", 0
            async for deltas in link.submit([Generate(
                    id=gen_id, prompt="Tell me a long story about a lighthouse.",
                    sampling=SamplingSpec(max_tokens=TOKENS, temperature=0.0,
                                          ignore_eos=True))]):
                for d in deltas:
                    text, tokens = text + d.text, tokens + d.tokens
                if during is not None and tokens >= 4:
                    during.set()
            return text, tokens
        finally:
            lease.release()

    async def scenario() -> None:
        alone = await generate("alone")
        assert alone[1] == TOKENS and alone[0]
        started = asyncio.Event()
        stream = asyncio.create_task(generate("parked", started))
        await asyncio.wait_for(started.wait(), 120)
        worker = sup.worker_of(entry)
        assert worker is not None
        pids = worker.handle.pids()
        for _ in range(PAUSES):
            await sup.parker.park(entry, "test")
            # Its paused stream asks for its next turn at once, and with no other model
            # here it would get it at once: the test keeps it parked instead.
            sup.parker.cancel(entry)
            assert entry.state == "parked"
            before = cpu_seconds(pids)
            await asyncio.sleep(PAUSE_SECONDS)
            assert cpu_seconds(pids) == before  # stopped: not one tick
            assert not stream.done()
            began = time.monotonic()
            await sup.parker.wake(entry)
            assert entry.state == "ready", f"woken in {time.monotonic() - began:.3f} s"
            await asyncio.sleep(0.3)  # a few steps of its turn
        assert await asyncio.wait_for(stream, 300) == alone
        assert entry.loads == 1 and entry.parks == PAUSES and entry.wakes == PAUSES
        assert await generate("after") == alone  # the engine serves on as before

    run(sup, scenario, timeout=900)
