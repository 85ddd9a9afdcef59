"""Overhead vs vLLM: the embedded model behind ``vllm serve`` and behind modelyard, same
engine arguments and cores, measured alternately in one run (1 and 16 concurrent
streams, fixed prompt, ``ignore_eos``, 128 tokens).

Targets: modelyard/vLLM tokens/s >= 0.98; TTFT p50 added <= 2 ms.
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

from bench.common import PROMPT, PY, Server, free_port, modelyard, pct, report, streams
from shared.config import ModelSpec
from worker.engine import auto_dtype, cpu_flags
from worker.materialize import resolve_model_path

TOKENS = 128
ROUNDS = 3
CORES = "0-1"

PRESET = f"""
server: {{host: 127.0.0.1, port: {{port}}}}
models:
  smollm2: {{model: "builtin:smollm2", cpu_cores: "{CORES}", max_model_len: 2048,
             kv_cache_gib: 1, load_on_startup: true}}
"""


def vllm_serve() -> Server:
    folder = resolve_model_path("builtin:smollm2", None)
    dtype = auto_dtype(ModelSpec(id="smollm2", model=folder), cpu_flags())
    port = free_port()
    return Server([PY, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                   "--served-model-name", "smollm2", "--enforce-eager", "--max-model-len",
                   "2048", "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
                   "--disable-uvicorn-access-log"], port,
                  env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": CORES},
                  name="vllm")


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
    with vllm_serve() as vllm, modelyard(PRESET) as yard:
        vllm.wait("/v1/models")
        yard.wait("/v1/models/smollm2", lambda m: m.get("state") == "ready")
        targets = {"vllm": vllm.url + "/v1/completions", "modelyard": yard.url + "/v1/completions"}
        for url in targets.values():  # warm both (first-request allocations)
            asyncio.run(streams(url, body, 2))
        result: dict[str, Any] = {"tokens": TOKENS, "rounds": ROUNDS, "cores": CORES}
        rows = [("streams", "server", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99")]
        for concurrency in (1, 16):
            runs: dict[str, list[Any]] = {name: [] for name in targets}
            for r in range(ROUNDS):
                order = list(targets) if r % 2 == 0 else list(reversed(targets))
                for name in order:
                    runs[name].append(asyncio.run(streams(targets[name], body, concurrency)))
            stats: dict[str, Any] = {name: summarize(runs[name], concurrency)
                                     for name in targets}
            stats["ratio_tokens_per_s"] = round(
                stats["modelyard"]["tokens_per_s"] / stats["vllm"]["tokens_per_s"], 3)
            stats["ttft_p50_added_ms"] = round(
                stats["modelyard"]["ttft_p50_ms"] - stats["vllm"]["ttft_p50_ms"], 2)
            result[f"streams_{concurrency}"] = stats
            for name in targets:
                s = stats[name]
                rows.append((str(concurrency), name, f"{s['tokens_per_s']:.1f}",
                             f"{s['ttft_p50_ms']:.1f} ms", f"{s['ttft_p99_ms']:.1f} ms",
                             f"{s['itl_p50_ms']:.1f} ms", f"{s['itl_p99_ms']:.1f} ms"))
            rows.append((str(concurrency), "ratio", f"{stats['ratio_tokens_per_s']:.3f}",
                         f"{stats['ttft_p50_added_ms']:+.1f} ms", "", "", ""))
    report("overhead", result, rows)


if __name__ == "__main__":
    main()
