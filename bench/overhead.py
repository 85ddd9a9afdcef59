"""Overhead vs vLLM: the embedded model behind ``vllm serve``, behind modelyard, and driven
in-process (``AsyncLLM``, no HTTP: ``bench/inprocess.py``), same engine arguments, dtype and
cores, measured alternately in one run (1 and 16 concurrent streams, fixed prompt,
``ignore_eos``, 128 tokens). Also modelyard's 1-stream rate right after its load, while the
replacement spare imports vLLM, against its own steady rate.

Targets (issue 21): modelyard/``vllm serve`` tokens/s >= 1.0 at 1 and 16 streams,
inter-token p99 <= 1.5x ``vllm serve``'s, TTFT p50 added <= 5 ms; modelyard/in-process
>= 0.8 at 16 streams.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any, Self

import httpx
import msgspec

from bench.common import (
    PROMPT,
    PY,
    ROOT,
    Server,
    StreamStats,
    free_port,
    modelyard,
    pct,
    report,
    streams,
)
from bench.inprocess import ANSWER, READY
from shared.config import ModelSpec
from worker.engine_args import auto_dtype, cpu_flags
from worker.materialize import resolve_model_path

TOKENS = 128
ROUNDS = 3
CORES = "0-1"
SETTLE = 2.0
"""Seconds between two measured runs: vLLM's EngineCore spins (``sched_yield``) for a second
after its last step, which took CPU from whichever server ran next (seen: +400 ms TTFT)."""
AFTER_LOAD_STREAMS = 3
"""1-stream requests measured at once after modelyard's load (its spare importing)."""

PRESET = f"""
server: {{host: 127.0.0.1, port: {{port}}, spare_workers: 1}}
models:
  smollm2: {{model: "builtin:smollm2", cpu_cores: "{CORES}", max_model_len: 2048,
             kv_cache_gib: 1, load_on_startup: true}}
"""
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": CORES}
Run = Callable[[int], tuple[StreamStats, float]]


def vllm_serve() -> Server:
    folder = resolve_model_path("builtin:smollm2", None)
    dtype = auto_dtype(ModelSpec(id="smollm2", model=folder), cpu_flags())
    port = free_port()
    return Server([PY, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                   "--served-model-name", "smollm2", "--enforce-eager", "--max-model-len",
                   "2048", "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
                   "--disable-uvicorn-access-log"], port,
                  env=ENV, name="vllm")


class InProcess:
    """``bench/inprocess.py`` as a subprocess: one JSON answer per number of streams."""

    def __init__(self) -> None:
        folder = resolve_model_path("builtin:smollm2", None)
        spec = ModelSpec(id="smollm2", model=folder, max_model_len=2048, kv_cache_gib=1,
                         cpu_cores=CORES)
        self.proc = subprocess.Popen(
            [PY, "-m", "bench.inprocess", "--spec", msgspec.json.encode(spec).decode(),
             "--path", folder, "--prompt", PROMPT, "--tokens", str(TOKENS)],
            cwd=ROOT, env={**os.environ, **ENV, "HF_HUB_OFFLINE": "1"}, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)

    def wait(self) -> None:
        assert self.proc.stdout is not None
        self._line(READY)

    def _line(self, prefix: str) -> str:
        """The next line of the engine's that starts with ``prefix`` (vLLM logs there too)."""
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            if line.startswith(prefix):
                return line
        raise RuntimeError("the in-process engine exited; see its output above")

    def run(self, concurrency: int) -> tuple[StreamStats, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{concurrency}\n")
        self.proc.stdin.flush()
        answer = json.loads(self._line(ANSWER).removeprefix(ANSWER))
        stats = StreamStats(ttft=answer["ttft"], itl=answer["itl"],
                            tokens=len(answer["ttft"]) + len(answer["itl"]))
        return stats, answer["seconds"]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def over_http(url: str, body: dict[str, Any]) -> Run:
    return lambda concurrency: asyncio.run(streams(url, body, concurrency))


def spares_ready(url: str) -> bool:
    return all(s["ready"] for s in httpx.get(url + "/health", timeout=5).json()["spares"])


def summarize(runs: list[tuple[Any, float]], concurrency: int) -> dict[str, float]:
    ttft = [t for s, _ in runs for t in s.ttft]
    itl = [t for s, _ in runs for t in s.itl]
    rates = [TOKENS * concurrency / seconds for _, seconds in runs]
    return {"tokens_per_s": round(statistics.mean(rates), 2),
            "ttft_p50_ms": round(pct(ttft, 50) * 1000, 2),
            "ttft_p99_ms": round(pct(ttft, 99) * 1000, 2),
            "itl_p50_ms": round(pct(itl, 50) * 1000, 2),
            "itl_p99_ms": round(pct(itl, 99) * 1000, 2),
            "errors": sum(s.errors for s, _ in runs)}


def main() -> None:
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True}
    with vllm_serve() as vllm, InProcess() as engine:
        vllm.wait("/v1/models")
        engine.wait()
        with modelyard(PRESET) as yard:
            yard.wait("/v1/models/smollm2", lambda m: m.get("state") == "ready")
            # At once: the spare that replaces the one this load took imports vLLM now. A
            # short request first takes the first request's own costs (allocations) out.
            over_http(yard.url + "/v1/completions", {**body, "max_tokens": 4})(1)
            after = [over_http(yard.url + "/v1/completions", body)(1)
                     for _ in range(AFTER_LOAD_STREAMS)]
            importing = not spares_ready(yard.url)
            deadline = time.monotonic() + 300
            while not spares_ready(yard.url) and time.monotonic() < deadline:
                time.sleep(1)
            measure(body, vllm, engine, yard, after, importing)


def measure(body: dict[str, Any], vllm: Server, engine: InProcess, yard: Server,
            after: list[tuple[StreamStats, float]], importing: bool) -> None:
    targets: dict[str, Run] = {
        "vllm": over_http(vllm.url + "/v1/completions", body),
        "modelyard": over_http(yard.url + "/v1/completions", body),
        "in_process": engine.run}
    for run in targets.values():  # warm each (first-request allocations)
        run(2)
    result: dict[str, Any] = {"tokens": TOKENS, "rounds": ROUNDS, "cores": CORES}
    rows = [("streams", "server", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99")]
    for concurrency in (1, 16):
        runs: dict[str, list[Any]] = {name: [] for name in targets}
        for r in range(ROUNDS):
            order = list(targets)[r % 3:] + list(targets)[:r % 3]
            for name in order:
                time.sleep(SETTLE)
                runs[name].append(targets[name](concurrency))
        stats: dict[str, Any] = {name: summarize(runs[name], concurrency) for name in targets}
        mine, theirs = stats["modelyard"], stats["vllm"]
        stats["ratio_tokens_per_s"] = round(mine["tokens_per_s"] / theirs["tokens_per_s"], 3)
        stats["ratio_in_process"] = round(
            mine["tokens_per_s"] / stats["in_process"]["tokens_per_s"], 3)
        stats["ratio_itl_p99"] = round(mine["itl_p99_ms"] / theirs["itl_p99_ms"], 2)
        stats["ttft_p50_added_ms"] = round(mine["ttft_p50_ms"] - theirs["ttft_p50_ms"], 2)
        result[f"streams_{concurrency}"] = stats
        for name in targets:
            s = stats[name]
            rows.append((str(concurrency), name, f"{s['tokens_per_s']:.1f}",
                         f"{s['ttft_p50_ms']:.1f} ms", f"{s['ttft_p99_ms']:.1f} ms",
                         f"{s['itl_p50_ms']:.1f} ms", f"{s['itl_p99_ms']:.1f} ms"))
        rows.append((str(concurrency), "ratio", f"{stats['ratio_tokens_per_s']:.3f}",
                     f"{stats['ttft_p50_added_ms']:+.1f} ms", "",
                     f"in-process {stats['ratio_in_process']:.3f}",
                     f"{stats['ratio_itl_p99']:.2f}x"))
    steady = result["streams_1"]["modelyard"]
    after_load = summarize(after, 1)
    result["after_load_1_stream"] = {
        **after_load, "spare_still_importing_after": importing,
        "ratio_to_steady": round(after_load["tokens_per_s"] / steady["tokens_per_s"], 3)}
    rows.append(("1", "after load", f"{after_load['tokens_per_s']:.1f}",
                 f"{after_load['ttft_p50_ms']:.1f} ms", f"{after_load['ttft_p99_ms']:.1f} ms",
                 f"{after_load['itl_p50_ms']:.1f} ms", f"{after_load['itl_p99_ms']:.1f} ms"))
    rows.append(("1", "after/steady", f"{result['after_load_1_stream']['ratio_to_steady']:.3f}",
                 "", "", "", "spare importing" if importing else "spare was ready"))
    report("overhead", result, rows)


if __name__ == "__main__":
    main()
