"""Swaps: how long a user waits for a model that is not loaded, and whether a mixed
workload spends its time swapping.

1. Cold start: a never-loaded model's first streamed token through modelyard, with a spare
   worker ready, against ``vllm serve``'s start-to-first-token (target <= 0.35x).
2. Swap with ``max_loaded_models: 1``: ``POST /v1/models/load`` of the other model (stop
   one, start the other; target <= 16 s), each with a spare ready.
3. Two closed-loop clients, one per model, sharing that one slot for 150 s: requests
   completed (target >= 230), loads (<= 4), the longest any request waited (<= 60 s).
Each model's per-phase start timeline comes from ``GET /v1/models/{id}`` (``load_phases``).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import httpx

from bench.coldstart import first_token, vllm_start_to_first_token
from bench.common import PROMPT, Server, modelyard, report

WORKLOAD_SECONDS = 150
SWAPS = 3
PRESET = """
server: {host: 127.0.0.1, port: {port}, max_loaded_models: 1}
models:
  swap-a: {model: "builtin:smollm2", cpu_cores: "0-1", max_model_len: 2048, kv_cache_gib: 1}
  swap-b: {model: "builtin:smollm2", cpu_cores: "0-1", max_model_len: 2048, kv_cache_gib: 1}
"""


def spare_ready(yard: Server, timeout: float = 120) -> None:
    yard.wait("/health", ok=lambda h: any(s["ready"] for s in h["spares"]), timeout=timeout)


def phases(yard: Server, model: str) -> dict[str, float]:
    return dict(httpx.get(f"{yard.url}/v1/models/{model}").json().get("load_phases", {}))


def load(yard: Server, model: str) -> float:
    start = time.monotonic()
    r = httpx.post(f"{yard.url}/v1/models/load", json={"model": model}, timeout=900)
    r.raise_for_status()
    return time.monotonic() - start


async def closed_loop(yard: Server, seconds: float) -> dict[str, Any]:
    """Two clients, one per model, each sending its next request as the last one ends."""
    waits: dict[str, list[float]] = {"swap-a": [], "swap-b": []}
    errors = 0
    until = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient, model: str) -> None:
        nonlocal errors
        while time.monotonic() < until:
            start = time.monotonic()
            r = await http.post(f"{yard.url}/v1/completions", json={
                "model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
            if r.status_code == 200:
                waits[model].append(time.monotonic() - start)
            else:
                errors += 1

    async with httpx.AsyncClient(timeout=900) as http:
        await asyncio.gather(client(http, "swap-a"), client(http, "swap-b"))
    every = waits["swap-a"] + waits["swap-b"]
    return {"requests": len(every), "per_model": {k: len(v) for k, v in waits.items()},
            "errors": errors, "longest_wait_s": round(max(every), 2),
            "median_s": round(statistics.median(every), 3)}


def count_loads(yard: Server) -> int:
    models = httpx.get(f"{yard.url}/v1/models").json()["data"]
    return sum(int(m.get("loads", 0)) for m in models)


def main() -> None:
    vllm = vllm_start_to_first_token()
    with modelyard(PRESET, name="swap") as yard:
        yard.wait("/health")
        spare_ready(yard)
        cold = first_token(yard.url, "swap-a")
        cold_phases = phases(yard, "swap-a")
        swaps, swap_phases = [], []
        for i in range(SWAPS):
            spare_ready(yard)
            model = "swap-b" if i % 2 == 0 else "swap-a"
            swaps.append(round(load(yard, model), 2))
            swap_phases.append(phases(yard, model))
        spare_ready(yard)
        loads_before = count_loads(yard)
        workload = asyncio.run(closed_loop(yard, WORKLOAD_SECONDS))
        workload["loads"] = count_loads(yard) - loads_before
    result: dict[str, Any] = {
        "vllm_start_to_first_token_s": round(vllm, 2),
        "modelyard_cold_first_token_s": round(cold, 2),
        "ratio_cold_vs_vllm": round(cold / vllm, 3),
        "cold_load_phases_s": cold_phases,
        "swap_s": swaps,
        "swap_load_phases_s": swap_phases,
        f"two_clients_one_slot_{WORKLOAD_SECONDS}s": workload,
    }
    rows = [("what", "value"),
            ("vllm serve start → first token (s)", f"{vllm:.1f}"),
            ("modelyard cold → first token, spare ready (s)", f"{cold:.1f}"),
            ("ratio (target <= 0.35)", f"{cold / vllm:.3f}"),
            ("swap: stop one, start the other (s, target <= 16)", " ".join(map(str, swaps))),
            (f"two clients, one slot, {WORKLOAD_SECONDS} s: requests (>= 230)",
             str(workload["requests"])),
            ("  loads (<= 4)", str(workload["loads"])),
            ("  longest wait (s, <= 60)", str(workload["longest_wait_s"]))]
    report("swap", result, rows)


if __name__ == "__main__":
    main()
