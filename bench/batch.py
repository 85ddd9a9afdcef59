"""Batches that fill idle capacity, never in the way. One run, on one loaded model (the
embedded one), ``REPS`` times over:

1. A person alone: one short streamed chat a second, ``CHATS`` of them; time to first
   token and between tokens.
2. The same person for ``CHATS`` more chats while a batch of ``LINES`` lines runs on the
   same model: the same figures, and the batch's lines per second meanwhile (then it is
   cancelled). Each repetition's ratios beside / alone (targets: p99 of each at most
   1.5x), and their median with the spread (min, max) over the repetitions: with 30
   chats a p99 is the slowest one, and one slow baseline made a ratio look flat.

Then once:

3. The batch's throughput with no one else (after ``BATCH_QUIET`` s without a person's
   request): the same ``LINES`` lines as a batch, against
4. the same lines sent by a client at concurrency 16 (target: at least 0.8x).

Every line and chat asks for a fixed number of tokens (``ignore_eos``). ``make bench
BENCH=batch`` takes about 30 minutes with the defaults (the person's 6 x 200 chats at one
a second are 20 of them); ``BENCH_BATCH_CHATS``, ``BENCH_BATCH_REPS`` and
``BENCH_BATCH_LINES`` make a smaller run (a try, not the figure).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from typing import Any

import httpx

from bench.common import Server, StreamStats, modelyard, one_stream, pct, report
from router.lifecycle.policy.room import BATCH_QUIET

LINES = int(os.environ.get("BENCH_BATCH_LINES", "2000"))
TOKENS = 16
CHAT_TOKENS = 24
CLIENT_CONCURRENCY = 16
CHATS = int(os.environ.get("BENCH_BATCH_CHATS", "200"))
"""A person's chats in each phase (alone, beside the batch) of each repetition."""
REPS = int(os.environ.get("BENCH_BATCH_REPS", "3"))
MODEL = os.environ.get("BENCH_BATCH_MODEL", "builtin:smollm2")
"""The model served. A try of this file's code alone: ``BENCH_BATCH_MODEL=/synthetic
BENCH_BATCH_ENGINE=synthetic BENCH_BATCH_ENGINE_ARGS='{tokens_per_second: 50}'``."""
ENGINE = os.environ.get("BENCH_BATCH_ENGINE", "vllm")
ENGINE_ARGS = os.environ.get("BENCH_BATCH_ENGINE_ARGS", "{}")

PRESET = """server: {host: 127.0.0.1, port: {port}, spare_workers: 0, preload: [smollm2]}
models:
  smollm2:
    model: "MODEL"
    engine: ENGINE
    engine_args: ENGINE_ARGS
    cpu_cores: "0-1"
    max_model_len: 1024
    max_num_seqs: 32
""".replace("MODEL", MODEL).replace("ENGINE_ARGS", ENGINE_ARGS).replace("ENGINE", ENGINE)


def chat(i: int, tokens: int) -> dict[str, Any]:
    return {"model": "smollm2", "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": f"Write a line about the number {i}."}]}


def batch_file(first: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST",
                               "url": "/v1/chat/completions", "body": chat(i, TOKENS)}) + "\n"
                   for i in range(first, first + LINES)).encode()


def start_batch(yard: Server, first: int) -> str:
    made = httpx.post(f"{yard.url}/v1/files", timeout=60, data={"purpose": "batch"},
                      files={"file": ("lines.jsonl", batch_file(first))})
    made.raise_for_status()
    batch = httpx.post(f"{yard.url}/v1/batches", timeout=60, json={
        "input_file_id": made.json()["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    batch.raise_for_status()
    return str(batch.json()["id"])


def batch_state(yard: Server, batch_id: str) -> dict[str, Any]:
    got: dict[str, Any] = httpx.get(f"{yard.url}/v1/batches/{batch_id}", timeout=60).json()
    return got


def wait_running(yard: Server, batch_id: str) -> None:
    while batch_state(yard, batch_id)["request_counts"]["completed"] < 1:
        time.sleep(0.1)


async def person(url: str, chats: int, first: int = 0) -> StreamStats:
    """``chats`` streamed chats, one a second (each begun a second after the last began,
    or at once when the last took longer)."""
    stats = StreamStats()
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(first, first + chats):
            began = time.monotonic()
            await one_stream(client, url + "/v1/chat/completions", chat(i, CHAT_TOKENS), stats)
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - began)))
    return stats


def figures(stats: StreamStats) -> dict[str, Any]:
    return {"chats": len(stats.ttft), "errors": stats.errors,
            "ttft_p50_ms": round(pct(stats.ttft, 50) * 1000, 1),
            "ttft_p99_ms": round(pct(stats.ttft, 99) * 1000, 1),
            "itl_p50_ms": round(pct(stats.itl, 50) * 1000, 1),
            "itl_p99_ms": round(pct(stats.itl, 99) * 1000, 1)}


def finished(yard: Server, batch_id: str) -> bool:
    return batch_state(yard, batch_id)["status"] in ("completed", "failed", "cancelled",
                                                    "expired")


def batch_run(yard: Server, batch_id: str) -> dict[str, Any]:
    state = batch_state(yard, batch_id)
    seconds = state["completed_at"] - state["in_progress_at"]
    done = state["request_counts"]["completed"]
    return {"status": state["status"], "lines": done,
            "failed": state["request_counts"]["failed"], "seconds": seconds,
            "lines_per_s": round(done / max(seconds, 1), 2)}


async def client_run(url: str, first: int) -> dict[str, Any]:
    """The batch's lines sent by a client, ``CLIENT_CONCURRENCY`` at once."""
    todo = iter(range(first, first + LINES))
    done = failed = 0
    limits = httpx.Limits(max_connections=CLIENT_CONCURRENCY + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def lane() -> None:
            nonlocal done, failed
            for i in todo:
                r = await client.post(url + "/v1/chat/completions", json=chat(i, TOKENS))
                done += r.status_code == 200
                failed += r.status_code != 200
        began = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(CLIENT_CONCURRENCY)))
        seconds = time.perf_counter() - began
    return {"lines": done, "failed": failed, "seconds": round(seconds, 1),
            "lines_per_s": round(done / seconds, 2)}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2)}


def repetition(yard: Server, n: int) -> dict[str, Any]:
    """One repetition of 1. and 2. (the module doc)."""
    rep: dict[str, Any] = {"person_alone": figures(asyncio.run(person(yard.url, CHATS)))}
    busy = start_batch(yard, n * LINES)
    wait_running(yard, busy)
    began, done_before = time.monotonic(), batch_state(yard, busy)["request_counts"]
    beside = asyncio.run(person(yard.url, CHATS, first=CHATS))
    took = time.monotonic() - began
    done_after = batch_state(yard, busy)["request_counts"]
    httpx.post(f"{yard.url}/v1/batches/{busy}/cancel", timeout=60).raise_for_status()
    rep["person_beside_batch"] = figures(beside)
    lines = done_after["completed"] - done_before["completed"]
    rep["batch_beside_person"] = {"status": "cancelled after", "lines": lines,
                                  "failed": done_after["failed"] - done_before["failed"],
                                  "seconds": round(took, 1),
                                  "lines_per_s": round(lines / took, 2)}
    while not finished(yard, busy):
        time.sleep(0.5)
    alone_p, beside_p = rep["person_alone"], rep["person_beside_batch"]
    rep["ratio_ttft_p99"] = round(beside_p["ttft_p99_ms"] / alone_p["ttft_p99_ms"], 2)
    rep["ratio_itl_p99"] = round(beside_p["itl_p99_ms"] / alone_p["itl_p99_ms"], 2)
    return rep


def main() -> None:
    out: dict[str, Any] = {"lines": LINES, "tokens_per_line": TOKENS,
                           "chat_tokens": CHAT_TOKENS, "chats_per_phase": CHATS,
                           "repetitions": REPS}
    with modelyard(PRESET, name="batch") as yard:
        yard.wait("/v1/models/smollm2", ok=lambda m: m.get("state") == "ready")
        asyncio.run(person(yard.url, 3, first=10**6))  # warm
        out["reps"] = [repetition(yard, n) for n in range(REPS)]
        time.sleep(BATCH_QUIET + 1)  # no one's request lately: the batch may use it all
        alone = start_batch(yard, REPS * LINES)
        while not finished(yard, alone):
            time.sleep(0.5)
        out["batch_alone"] = batch_run(yard, alone)
        out["client_16"] = asyncio.run(client_run(yard.url, (REPS + 1) * LINES))
    out["ratio_ttft_p99"] = spread([r["ratio_ttft_p99"] for r in out["reps"]])
    out["ratio_itl_p99"] = spread([r["ratio_itl_p99"] for r in out["reps"]])
    out["ratio_batch_vs_client_16"] = round(
        out["batch_alone"]["lines_per_s"] / out["client_16"]["lines_per_s"], 3)

    def said(ratio: dict[str, float]) -> str:
        return f"{ratio['median']} ({ratio['min']}-{ratio['max']})"

    of = f"median (min-max) of {REPS} (target <= 1.5)"
    rows = [("what", "value"),
            (f"person's TTFT p99 beside a batch / alone, {of}", said(out["ratio_ttft_p99"])),
            (f"person's inter-token p99 beside a batch / alone, {of}",
             said(out["ratio_itl_p99"])),
            ("batch alone / a client at concurrency 16, lines/s (target >= 0.8)",
             str(out["ratio_batch_vs_client_16"])),
            ("batch beside the person, lines/s",
             ", ".join(str(r["batch_beside_person"]["lines_per_s"]) for r in out["reps"]))]
    report("batch", out, rows)


if __name__ == "__main__":
    main()
