"""``bench/replicas.py``'s parts that need no server (issue 35): the workload it sends, the
presets it starts routers with, how it reads a stream and counts the cache, the figures
and ratios it writes, and the performance page's table of them. The benchmark itself runs
real vLLM (``make bench BENCH=replicas``); these keep what it reports honest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import __main__ as bench_main
from bench import replicas, report
from router.lifecycle.prefix_index import BLOCK, prompt_blocks
from router.workers.placement import replica_spec
from shared.preset_loader import load_preset
from tests.test_docs import figures

ROOT = Path(__file__).resolve().parents[1]


def test_a_repetition_is_sessions_of_growing_turns_on_one_shared_system_prompt() -> None:
    system, users = replicas.conversations(0)
    assert len(users) == replicas.SESSIONS == 8 and all(len(u) == replicas.TURNS == 6
                                                        for u in users)
    assert len(system) >= replicas.SYSTEM_CHARS and len(system.encode()) >= 4 * BLOCK
    turns = [t for u in users for t in u]
    assert len(set(turns)) == len(turns)  # every session's turns its own
    low, high = replicas.USER_CHARS
    assert all(low <= len(t.split(": ", 1)[1]) <= high + 10 for t in turns)
    assert replicas.conversations(0) == (system, users)  # (a), (b), (c) get the same text


def test_another_repetition_shares_no_block_with_the_last() -> None:
    """Its system prompt's first block differs, so a cache left from an earlier one (if a
    router were reused) would not help it."""
    first, second = (replicas.conversations(rep)[0].encode() for rep in (0, 1))
    assert prompt_blocks(first).hashes[0] != prompt_blocks(second).hashes[0]


def test_the_order_rotates_so_each_configuration_runs_once_in_each_place() -> None:
    orders = [[c.key for c in replicas.order(rep)] for rep in range(3)]
    assert orders[0] == ["one_worker", "prefix", "round_robin"]
    for place in range(3):
        assert sorted(o[place] for o in orders) == ["one_worker", "prefix", "round_robin"]


@pytest.mark.parametrize("config", replicas.CONFIGS, ids=lambda c: c.key)
def test_each_preset_loads_as_asked_with_a_core_per_replica(
        config: replicas.Config, tmp_path: Path) -> None:
    path = tmp_path / "preset.yaml"
    path.write_text(replicas.preset(config).replace("{port}", "8080"))
    spec = load_preset(path).models[replicas.MODEL_ID]
    assert (spec.replicas.min, spec.replicas.max) == (config.replicas, config.replicas)
    assert spec.routing.strategy == config.strategy
    assert spec.cpu_cores == "0-1" and spec.load_on_startup
    cores = [replica_spec(spec, n, config.replicas).cpu_cores for n in range(config.replicas)]
    assert cores == (["0-1"] if config.replicas == 1 else ["0", "1"])


def chunk(content: str | None = None, role: bool = False) -> dict[str, Any]:
    delta: dict[str, Any] = {"content": content}
    if role:
        delta["role"] = "assistant"
    return {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def test_a_turn_reads_its_first_token_text_and_cached_tokens_from_the_stream() -> None:
    turn = replicas.Turn(started=10.0)
    turn.read(chunk("", role=True), 10.25)
    turn.read(chunk("Hello"), 10.3)
    turn.read(chunk(" there"), 10.4)
    turn.read({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
              10.5)
    turn.read({"id": "c", "choices": [], "usage": {
        "prompt_tokens": 700, "completion_tokens": 2, "total_tokens": 702,
        "prompt_tokens_details": {"cached_tokens": 512}}}, 10.6)
    turn.finish()
    assert turn.ok and turn.ttft == pytest.approx(0.25)
    assert "".join(turn.text) == "Hello there"
    assert (turn.prompt_tokens, turn.cached_tokens) == (700, 512)


def test_a_stream_without_usage_or_with_an_error_event_is_a_failed_turn() -> None:
    no_usage = replicas.Turn(started=0.0)
    no_usage.read(chunk("Hi"), 0.1)
    no_usage.finish()
    assert no_usage.error == "no usage"
    failed = replicas.Turn(started=0.0)
    failed.read(chunk("Hi"), 0.1)
    failed.read({"error": {"message": "worker crashed", "type": "server_error"}}, 0.2)
    failed.finish()
    assert failed.error is not None and "worker crashed" in failed.error
    silent = replicas.Turn(started=0.0)
    silent.finish()
    assert silent.error == "no first token"


def turn(ttft: float, prompt: int, cached: int, error: str | None = None) -> replicas.Turn:
    return replicas.Turn(started=0.0, ttft=ttft, prompt_tokens=prompt, cached_tokens=cached,
                         error=error)


def test_the_cache_share_is_cached_over_prompt_tokens_of_the_requests_that_succeeded() -> None:
    turns = [turn(0.1, 400, 0), turn(0.2, 600, 512), turn(0.3, 1000, 768),
             turn(9.0, 5000, 0, error="HTTP 503")]
    got = replicas.workload_figures(turns)
    assert got["requests"] == 4 and got["errors"] == 1
    assert (got["prompt_tokens"], got["cached_tokens"]) == (2000, 1280)
    assert got["cache_share"] == 0.64
    assert (got["ttft_p50_ms"], got["ttft_p90_ms"]) == (200.0, 300.0)


def test_replicas_are_read_from_the_model_list_or_the_model_is_replica_zero() -> None:
    listed = {"data": [{"id": "other"}, {"id": "smollm2", "state": "ready", "replicas": [
        {"number": 0, "pid": 11, "state": "ready", "in_flight": 2},
        {"number": 1, "pid": 12, "state": "loading", "in_flight": 0}]}]}
    assert [r["pid"] for r in replicas.replicas_of(listed)] == [11, 12]
    alone = {"data": [{"id": "smollm2", "state": "ready", "pid": 7, "in_flight": 3}]}
    assert replicas.replicas_of(alone) == [{"number": 0, "pid": 7, "state": "ready",
                                            "in_flight": 3}]
    assert replicas.replicas_of({"data": []}) == []


def test_the_sampler_keeps_each_replicas_most_in_flight_and_its_share() -> None:
    sampler = replicas.Sampler("http://unused")
    sampler.add([{"number": 0, "in_flight": 3}, {"number": 1, "in_flight": 1}])
    sampler.add([{"number": 1, "in_flight": 4}, {"number": 0, "in_flight": 0}])
    assert sampler.figures() == {"in_flight_max": [3, 4], "in_flight_share": [0.38, 0.62]}


def rep(share: float, p50: float, position: int) -> dict[str, Any]:
    return {"order": position, "start_s": 21.5, "replicas_ready": 2, "distinct_pids": 2,
            "requests": 48, "errors": 0, "prompt_tokens": 30_000,
            "cached_tokens": int(30_000 * share), "cache_share": share,
            "ttft_p50_ms": p50, "ttft_p90_ms": p50 * 2.5, "in_flight_max": [5, 4],
            "in_flight_share": [0.55, 0.45]}


def rnd(rate: float, p99: float) -> dict[str, Any]:
    return {"tokens_per_s": rate, "ttft_p50_ms": 310.5, "itl_p50_ms": 60.2, "itl_p99_ms": p99,
            "errors": 0, "in_flight_max": [16], "in_flight_share": [1.0]}


def result() -> dict[str, Any]:
    runs = {"one_worker": [rep(0.8, 400.0, 1), rep(0.82, 410.0, 3), rep(0.78, 390.0, 2)],
            "prefix": [rep(0.76, 250.0, 2), rep(0.8, 260.0, 1), rep(0.7, 300.0, 3)],
            "round_robin": [rep(0.45, 500.0, 3), rep(0.5, 520.0, 2), rep(0.4, 380.0, 1)]}
    streamed = {"one_worker": [rnd(230.0, 90.0), rnd(240.0, 95.0), rnd(235.0, 80.0)],
                "prefix": [rnd(210.0, 99.0), rnd(250.0, 95.0), rnd(200.0, 120.0)]}
    decision = {"replicas": 2, "prompts_indexed": 10_000, "decisions": 2_000,
                "load_average_1m": 1.2, "decision_us_p50": 46.8, "decision_us_p99": 410.3,
                "decision_cpu_us_p50": 47.4, "decision_cpu_us_p99": 132.5,
                "hash_us_p50": 27.6, "indexed_blocks": 93_943}
    return replicas.assemble(runs, streamed, decision)


def test_the_targets_are_ratios_within_a_repetition_and_their_median() -> None:
    r = result()
    cache, ttft = (r["ratios"][k] for k in ("cache_share_prefix_vs_one_worker",
                                            "ttft_p50_prefix_vs_round_robin"))
    assert cache["per_rep"] == [0.95, 0.976, 0.897]
    assert (cache["median"], cache["min"], cache["max"], cache["met"]) == (0.95, 0.897, 0.976,
                                                                          True)
    assert ttft["per_rep"] == [0.5, 0.5, 0.789]
    assert ttft["median"] == 0.5 and ttft["met"] and ttft["target"] == "<= 0.7"
    assert r["configs"]["prefix"]["ttft_p50_ms"] == {"median": 260.0, "min": 250.0,
                                                     "max": 300.0}
    t = r["throughput"]
    assert t["ratio_tokens_per_s"]["per_rep"] == [0.913, 1.042, 0.851]
    assert t["two_replicas_one_core_each"]["tokens_per_s"]["median"] == 210.0
    printed = dict(row[:2] for row in replicas.rows(r))
    assert printed["ttft_p50_prefix_vs_round_robin (target <= 0.7)"] == "0.5 (0.5-0.789), met: True"


def test_a_median_past_the_target_is_not_met() -> None:
    r = result()
    runs = {"one_worker": [rep(0.9, 400.0, 1)], "prefix": [rep(0.5, 300.0, 2)],
            "round_robin": [rep(0.5, 400.0, 3)]}
    r = replicas.assemble(runs, {"one_worker": [rnd(1.0, 1.0)], "prefix": [rnd(1.0, 1.0)]},
                          r["route_decision"])
    assert not r["ratios"]["cache_share_prefix_vs_one_worker"]["met"]
    assert not r["ratios"]["ttft_p50_prefix_vs_round_robin"]["met"]


def test_the_performance_page_shows_every_figure_of_the_results(tmp_path: Path) -> None:
    """What ``tests/test_docs.py`` asks of the committed results file once it exists, asked
    now of one made by ``assemble``: every figure in the block, with run and machine."""
    r = {"benchmark": "replicas", "machine": {"cpus": 2, "cpu": "Intel Xeon",
                                              "memory_gib": 23.5, "python": "3.11.7"},
         "when": "2026-11-28 12:00", "commit": "abc1234", **result()}
    block = report.replicas(r)
    missing = [(where, text) for where, text in figures(r) if text not in block]
    assert not missing
    assert "run of " in block and "machine: " in block
    assert "| TTFT p50, (b) / (c) | 0.5, 0.5, 0.789 | 0.5 (0.5 to 0.789) | <= 0.7 | yes |" \
        in block


def test_it_runs_with_make_bench_and_has_its_block_on_the_page() -> None:
    assert "replicas" in bench_main.ALL
    page = (ROOT / "docs" / "performance.md").read_text()
    assert "replicas" in report.names_on(page)


def test_main_runs_each_configuration_once_a_repetition_and_reports_them_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``main``'s loop without servers: each repetition starts the three routers in its
    rotated order, the throughput rounds come from (a) and (b) alone, and the results
    file keeps each configuration's repetitions in repetition order."""
    started: list[tuple[str, int, int]] = []

    def one_router(config: replicas.Config, rep_: int,
                   position: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        started.append((config.key, rep_, position))
        return (rep(0.5 + rep_ / 10, 100.0 + rep_, position),
                rnd(200.0 + rep_, 90.0) if config.throughput else None)

    written: dict[str, Any] = {}
    monkeypatch.setattr(replicas, "REPS", 3)
    monkeypatch.setattr(replicas, "one_router", one_router)
    monkeypatch.setattr(replicas, "route_decision", lambda: result()["route_decision"])
    monkeypatch.setattr(replicas, "report", lambda name, r, rows: written.update(r, name=name))
    replicas.main()
    assert [(k, p) for k, _, p in started] == [
        ("one_worker", 1), ("prefix", 2), ("round_robin", 3),
        ("prefix", 1), ("round_robin", 2), ("one_worker", 3),
        ("round_robin", 1), ("one_worker", 2), ("prefix", 3)]
    assert written["name"] == "replicas" and written["repetitions"] == 3
    assert [r["cache_share"] for r in written["configs"]["round_robin"]["reps"]] == [0.5, 0.6,
                                                                                     0.7]
    assert [r["order"] for r in written["configs"]["one_worker"]["reps"]] == [1, 3, 2]
    rounds = written["throughput"]["two_replicas_one_core_each"]["rounds"]
    assert [r["tokens_per_s"] for r in rounds] == [200.0, 201.0, 202.0]
