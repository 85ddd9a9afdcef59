"""GPU park (issue 37): at which level of vLLM's sleep mode a GPU model parks, and when it
stops instead, over fake NVML and host readings (``router.lifecycle.policy.gpu_park``,
``policy.park.park_level``, ``policy.room.decide``); no process, no GPU. Parking of real
(synthetic) workers is in ``tests/test_gpu_park_workers.py``.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from router.lifecycle.policy import gpu_park, idle, park, room
from router.registry import ModelEntry
from router.workers.placement import ASLEEP_GIB, GpuMemory
from shared.config import ServerConfig
from shared.preset_loader import build_preset
from worker.engine_args import engine_args_for

GIB = 1024 ** 3
NOW, WALL = 10_000.0, 2e9
H100 = {0: GpuMemory(0, 80 * GIB, 79 * GIB)}


def entries(server: dict[str, Any] | None = None, **specs: dict[str, Any]
            ) -> tuple[dict[str, ModelEntry], ServerConfig]:
    preset = build_preset({"server": {"max_loaded_models": 1, **(server or {})},
                           "models": {k: {"model": f"/{k}", "device": "cuda", "gpus": [0],
                                          **v} for k, v in specs.items()}})
    return {k: ModelEntry(spec=s) for k, s in preset.models.items()}, preset.server


def ready(entry: ModelEntry, weights_gib: float = 0, resident_gib: float = 1) -> ModelEntry:
    """``entry`` loaded 100 s ago, idle 10 s, its weights on disk and its worker's host
    memory measured."""
    entry.state, entry.replica = "ready", SimpleNamespace(busy=False)
    entry.loaded_at, entry.last_used, entry.load_seconds = WALL - 100, NOW - 10, 5.0
    entry.weights_bytes, entry.resident_bytes = int(weights_gib * GIB), int(resident_gib * GIB)
    return entry


def host(total_gib: float, available_gib: float) -> park.HostMemory:
    return park.HostMemory(int(total_gib * GIB), int(available_gib * GIB))


# -- the plain level function (what the probe runs on a GPU machine's readings) -----------

def test_level_1_where_host_memory_holds_the_pinned_weights_level_2_where_not() -> None:
    """16 GiB of weights (8B, bf16) pin up to 32 GiB (power-of-two blocks): on a 128 GiB
    host with 100 GiB available, 100 - 2 - 32 = 66 >= 25.6 (20 %): level 1; with 50
    available, 50 - 2 - 32 = 16 < 25.6: level 2, though 16 GiB (1x) would have fit."""
    w = 16 * GIB
    assert gpu_park.pinned_bytes(w) == 32 * GIB
    assert gpu_park.sleep_level(w, need_bytes=2 * GIB, host=host(128, 100)) == 1
    assert gpu_park.sleep_level(w, need_bytes=2 * GIB, host=host(128, 50)) == 2
    # the pinned copy's rounding is what tips it: at 1x it would have been level 1
    assert 50 - 2 - 16 >= 0.2 * 128
    # unknown weights (a hub id): level 2, never a guess at what to pin
    assert gpu_park.sleep_level(0, need_bytes=0, host=host(128, 100)) == 2
    # not even level 2: the model that needs room would leave less than the margin
    assert gpu_park.sleep_level(w, need_bytes=30 * GIB, host=host(128, 50)) is None
    assert gpu_park.sleep_level(w, need_bytes=0, host=None) is None  # not read: no park


def test_under_park_memory_gib_the_pinned_copy_counts_against_the_ceiling() -> None:
    w, ceiling = 4 * GIB, 12 * GIB
    assert gpu_park.sleep_level(w, need_bytes=0, host=None, ceiling=ceiling,
                                held=3 * GIB) == 1  # 3 + 8 <= 12
    assert gpu_park.sleep_level(w, need_bytes=0, host=None, ceiling=ceiling,
                                held=5 * GIB) == 2  # 5 + 8 > 12, 5 <= 12
    assert gpu_park.sleep_level(w, need_bytes=0, host=None, ceiling=ceiling,
                                held=13 * GIB) is None


def test_the_gpu_must_hold_the_model_that_needs_room_after_the_sleep() -> None:
    """NVML says 10 GiB free; the sleeping model holds 70 now and 1 asleep: 79 for a
    model that asks 72 (0.9 of 80). With 2 free (another process's), 71 < 72."""
    need, now, asleep = {"cuda:0": 72.0}, {"cuda:0": 70.0}, {"cuda:0": 1.0}
    assert gpu_park.gpu_room_after_sleep(need, {"cuda:0": 10.0}, now, asleep)
    assert not gpu_park.gpu_room_after_sleep(need, {"cuda:0": 2.0}, now, asleep)
    assert gpu_park.gpu_room_after_sleep(need, {}, now, asleep)  # no reading: budgets


def test_the_level_policy_imports_no_msgspec() -> None:
    """The GPU probe runs it, and the NVML readers, where only torch and pynvml are."""
    code = ("import sys; import router.lifecycle.policy.gpu_park, router.workers.nvml; "
            "bad = [m for m in ('msgspec', 'starlette', 'zmq') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- park_level over the entries ---------------------------------------------------------

def test_park_level_reads_host_memory_for_a_gpu_model() -> None:
    m, server = entries(a={"memory_gib": 40}, b={"memory_gib": 40})
    a, b = ready(m["a"], weights_gib=16), m["b"]
    assert park.park_level(a, b, [a], server, host(128, 100), gpus=H100) == 1
    assert park.park_level(a, b, [a], server, host(128, 50), gpus=H100) == 2
    assert park.park_level(a, b, [a], server, host(128, 20), gpus=H100) is None
    assert park.may_park(a, b, [a], server, host(128, 50))  # no longer refused: cuda


def test_a_gpu_park_that_leaves_the_budget_no_room_stops() -> None:
    """Budget 80 GiB on cuda:0: ``a`` (50) asleep holds ``ASLEEP_GIB``, so ``b`` (50)
    fits beside it; ``c`` (79.5) does not (1 + 79.5 > 80): ``a`` stops for it."""
    m, server = entries({"max_loaded_models": 0, "memory_budget_gib": {"cuda:0": 80}},
                        a={"memory_gib": 50}, b={"memory_gib": 50}, c={"memory_gib": 79.5})
    a = ready(m["a"], weights_gib=1)
    memory = host(128, 100)
    assert park.park_level(a, m["b"], [a], server, memory, gpus=H100) == 1
    assert ASLEEP_GIB + 79.5 > 80
    assert park.park_level(a, m["c"], [a], server, memory, gpus=H100) is None
    # NVML's free memory now: 79 + (50 - 1) back holds b; with 0 free, 0 + 49 < 50
    full = {0: GpuMemory(0, 80 * GIB, 0)}
    assert park.park_level(a, m["b"], [a], server, memory, gpus=H100, gpus_now=H100) == 1
    assert park.park_level(a, m["b"], [a], server, memory, gpus=H100, gpus_now=full) is None


def test_max_parked_models_and_sleep_mode_off_keep_stopping() -> None:
    m, server = entries({"max_parked_models": 0}, a={}, b={})
    a = ready(m["a"], weights_gib=1)
    assert park.park_level(a, m["b"], [a], server, host(128, 100), gpus=H100) is None
    m, server = entries(a={"engine_args": {"enable_sleep_mode": False}}, b={})
    a = ready(m["a"], weights_gib=1)
    assert not park.sleeps(a.spec)
    assert park.park_level(a, m["b"], [a], server, host(128, 100), gpus=H100) is None
    assert engine_args_for(a.spec, "/a")["enable_sleep_mode"] is False
    assert engine_args_for(m["b"].spec, "/b")["enable_sleep_mode"] is True  # every GPU model


def test_expandable_segments_keep_sleep_mode_off_and_the_model_stopping(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's sleep-mode allocator refuses to start beside torch's expandable segments: a
    GPU model whose environment asks for them starts without sleep mode (it would not
    start at all), and the room policy, by the same rule, stops it instead of parking."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    m, server = entries(a={"env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}},
                        b={})
    a = ready(m["a"], weights_gib=1)
    assert "enable_sleep_mode" not in engine_args_for(a.spec, "/a")
    assert not park.sleeps(a.spec)
    assert park.park_level(a, m["b"], [a], server, host(128, 100), gpus=H100) is None
    assert park.sleeps(m["b"].spec)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512, expandable_segments:true")
    assert not park.sleeps(m["b"].spec)  # the router's (and so every worker's) own
    assert "enable_sleep_mode" not in engine_args_for(m["b"].spec, "/b")


def test_a_level_1_parked_model_counts_its_pinned_weights_against_host_memory() -> None:
    """``park_memory_gib`` 10: ``a`` parked at level 1 holds 1 GiB resident and 2 x 3 GiB
    pinned = 7; ``b`` (1 resident, 3 of weights) may then park at level 2 only (7 + 1 +
    6 > 10), and the reaper, past a lowered ceiling, counts the same 7."""
    m, server = entries({"park_memory_gib": 10}, a={}, b={}, c={})
    a, b = ready(m["a"], weights_gib=3), ready(m["b"], weights_gib=3)
    a.state, a.parked_level = "parked", 1
    assert park.host_held(a) == 7 * GIB
    assert park.park_level(b, m["c"], [a, b], server, None, gpus=H100) == 2
    a.parked_level = 2
    assert park.host_held(a) == 1 * GIB
    assert park.park_level(b, m["c"], [a, b], server, None, gpus=H100) == 1  # 1 + 1 + 6
    a.parked_level = 1
    _, low = entries({"park_memory_gib": 6}, a={})
    assert [d.entry for d in idle.due([a], NOW, low)] == [a]  # 7 > 6: it stops


@pytest.mark.parametrize(("available", "level"), [(100, 1), (50, 2)])
def test_decide_parks_a_gpu_model_at_the_level_the_host_allows(available: float,
                                                               level: int) -> None:
    """Both ways room is short: ``max_loaded_models`` (1) and a GPU budget (80 GiB, no
    model limit); the decision carries the level the ``Parker`` sends."""
    for server_keys in ({"max_loaded_models": 1},
                        {"max_loaded_models": 0, "memory_budget_gib": {"cuda:0": 80}}):
        m, server = entries(server_keys, a={"memory_gib": 50}, b={"memory_gib": 50})
        a, b = ready(m["a"], weights_gib=16), m["b"]
        b.room_since = NOW - 1
        decision = room.decide(b, [b], [a], server, H100, {}, now=NOW, wall=WALL, waited=0,
                               parked=[], memory=host(128, available), parking=True)
        assert (decision.action, decision.victim, decision.level) == ("park", a, level), \
            server_keys



def test_the_worker_asks_vllm_to_keep_requests_and_reloads_weights_after_level_2() -> None:
    """What ``VllmEngine`` sends vLLM (a fake ``AsyncLLM``; no engine runs): sleep with
    ``mode="keep"`` (its default, ``abort``, ends the streams a busy model parks with);
    a level-1 wake in one call; a level-2 wake wakes the weights' memory, reads them
    from disk, then wakes the KV cache (which resumes the scheduler: nothing steps on
    weights not yet read). On main: ``sleep(level=...)`` alone, and a bare ``wake_up``."""
    import asyncio

    from worker.engine import VllmEngine

    calls: list[tuple[Any, ...]] = []

    class Llm:
        async def sleep(self, level: int = 1, mode: str = "abort") -> None:
            calls.append(("sleep", level, mode))

        async def wake_up(self, tags: list[str] | None = None) -> bool:
            calls.append(("wake_up", tags))
            return True

        async def collective_rpc(self, method: str) -> list[Any]:
            calls.append(("rpc", method))
            return []

    engine = VllmEngine.__new__(VllmEngine)
    engine._llm = Llm()
    engine._asleep, engine.adapters = None, None

    async def cycle(level: int) -> None:
        await engine.sleep(level)
        await engine.wake()

    asyncio.run(cycle(1))
    assert calls == [("sleep", 1, "keep"), ("wake_up", None)]
    calls.clear()
    asyncio.run(cycle(2))
    assert calls == [("sleep", 2, "keep"), ("wake_up", ["weights"]),
                     ("rpc", "reload_weights"), ("wake_up", ["kv_cache"])]


def test_a_parked_gpu_models_wake_waits_for_the_gpu_memory_it_gave_back() -> None:
    """``a`` (48 GiB) asleep holds 1 GiB, ``d`` (48 GiB) runs, NVML reads 31 GiB free, and
    no budget is set: the wake would ask ``wake_up`` for 47 GiB more and fail (its paused
    requests ending with the stop). It does not fit; ``d``, idle, parks for it. With
    enough free it fits (review of 3b50b70, M1)."""
    m, server = entries({"max_loaded_models": 2}, a={"memory_gib": 48}, d={"memory_gib": 48})
    a, d = ready(m["a"], weights_gib=16), ready(m["d"], weights_gib=16)
    a.state, a.parked_level, a.room_since = "parked", 1, NOW - 1
    mem = host(128, 100)
    short = {0: GpuMemory(0, 80 * GIB, 31 * GIB)}
    decision = room.decide(a, [a], [d], server, H100, {"a": {"cuda:0": 1.0}}, now=NOW,
                           wall=WALL, waited=0, parked=[], memory=mem, parking=True,
                           gpus_now=short)
    assert (decision.action, decision.victim) == ("park", d)
    roomy = {0: GpuMemory(0, 80 * GIB, 47 * GIB)}
    assert room.decide(a, [a], [d], server, H100, {"a": {"cuda:0": 1.0}}, now=NOW, wall=WALL,
                       waited=0, parked=[], memory=mem, parking=True,
                       gpus_now=roomy).action == "fits"


def test_level_2_only_where_the_weights_can_be_read_again_and_level_1_only_here() -> None:
    """A level-2 wake reads the weights again in place (``reload_weights``): a load format
    vLLM cannot reload, or a draft model (its weights would wake uninitialised), stops
    instead of parking at 2; a Ray model (another node's memory, neither read nor
    counted here) parks at 2 at most (review of 3b50b70, M2, M6)."""
    mem = host(128, 100)
    for args in ({"load_format": "tensorizer"}, {"speculative_config": {"method": "ngram"}}):
        m, server = entries(a={"engine_args": args}, b={})
        a = ready(m["a"], weights_gib=0)  # a hub id: level 2 where it can
        assert not park.reloads_weights(a.spec)
        assert park.park_level(a, m["b"], [a], server, mem, gpus=H100) is None
        a.weights_bytes = GIB
        assert park.park_level(a, m["b"], [a], server, mem, gpus=H100) == 1
    m, server = entries(a={"backend": "ray"}, b={})
    a = ready(m["a"], weights_gib=1)
    assert park.park_level(a, m["b"], [a], server, mem, gpus=H100) == 2
    m, server = entries(a={}, b={})
    assert park.park_level(ready(m["a"], weights_gib=1), m["b"], [m["a"]], server, mem,
                           gpus=H100) == 1


@pytest.mark.parametrize("off", [False, 0, None, ""])
def test_sleep_mode_is_off_for_any_false_value_as_vllm_reads_it(off: object) -> None:
    """``engine_args`` reach vLLM as they are: ``enable_sleep_mode: 0`` turns sleep mode
    off there, so the router must not park the model through a sleep (review, M7)."""
    m, _ = entries(a={"engine_args": {"enable_sleep_mode": off}})
    assert not park.sleeps(m["a"].spec)


def test_a_gpu_sleep_may_take_as_long_as_pinning_its_weights() -> None:
    """A fixed 60 s refused every first level-1 park past ~70 GB of weights (pinning ran
    ~1.2 GB/s on the H200); the bound grows with them (review, M4)."""
    from router.lifecycle.parking import SLEEP_TIMEOUT, sleep_timeout
    assert sleep_timeout(0) == SLEEP_TIMEOUT
    assert sleep_timeout(140 * 10**9) >= 140 / 1.2 + SLEEP_TIMEOUT


def test_the_switch_histogram_reaches_a_gpu_models_slow_wakes_and_parks() -> None:
    """Its buckets ended at 5 s: a level-2 wake (11 s for 8B on the H200), a first
    level-1 park (14 s, pinning) and a whole wait all read as +Inf (review, L3)."""
    from prometheus_client import generate_latest

    from router.observe.metrics import Metrics
    from router.registry import ModelRegistry
    preset = build_preset({"models": {"a": {"model": "/a"}}})
    metrics = Metrics(ModelRegistry(preset))
    metrics.switch("a", "wake", 11.1)
    text = generate_latest(metrics.registry).decode()
    assert 'modelyard_model_switch_seconds_bucket{kind="wake",le="5.0",model="a"} 0.0' in text
    assert 'modelyard_model_switch_seconds_bucket{kind="wake",le="30.0",model="a"} 1.0' in text
