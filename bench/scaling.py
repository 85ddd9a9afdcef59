"""Concurrency scaling: aggregate output tokens/s through modelyard at 1, 4 and 16
concurrent streams (continuous batching must show). Target: 16 streams >= 8x one stream.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bench.common import PROMPT, modelyard, pct, report, streams

TOKENS = 128
PRESET = """
server: {host: 127.0.0.1, port: {port}}
models:
  smollm2: {model: "builtin:smollm2", cpu_cores: "0-1", max_model_len: 2048,
            kv_cache_gib: 1, load_on_startup: true}
"""


def main() -> None:
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True}
    result: dict[str, Any] = {"tokens_per_stream": TOKENS}
    rows = [("streams", "tokens/s", "x one stream", "TTFT p50", "ITL p50")]
    with modelyard(PRESET) as yard:
        yard.wait("/v1/models/smollm2", lambda m: m.get("state") == "ready")
        url = yard.url + "/v1/completions"
        asyncio.run(streams(url, body, 2))  # warm-up
        base = None
        for n in (1, 4, 16):
            stats, seconds = asyncio.run(streams(url, body, n, per_client=2))
            rate = TOKENS * n * 2 / seconds
            base = base or rate
            result[f"streams_{n}"] = {"tokens_per_s": round(rate, 1),
                                      "speedup": round(rate / base, 2),
                                      "ttft_p50_ms": round(pct(stats.ttft, 50) * 1000, 1),
                                      "itl_p50_ms": round(pct(stats.itl, 50) * 1000, 1),
                                      "errors": stats.errors}
            rows.append((str(n), f"{rate:.1f}", f"{rate / base:.2f}",
                         f"{pct(stats.ttft, 50) * 1000:.0f} ms",
                         f"{pct(stats.itl, 50) * 1000:.0f} ms"))
    report("scaling", result, rows)


if __name__ == "__main__":
    main()
