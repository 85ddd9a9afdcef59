"""LoRA adapters: many fine-tunes on one engine, against the base alone and against
fine-tunes served as full models. One run, side by side:

1. Throughput: 16 streams spread over 8 rank-8 adapters (``max_loras: 8``) against 16
   streams of the base on an engine without LoRA (target >= 0.7x), and of the base on the
   same LoRA engine (what serving adapters costs the base's own users); 1 stream too.
2. First use of a rank-8 adapter: the worker's load (check + load into the engine,
   target <= 1 s) and what it adds to the first request's time to first token (against
   the next request's for the same adapter).
3. Two fine-tunes alternating under ``max_loaded_models: 1``: as two adapters of one base
   against two full models (loads, requests completed, p50 latency).

The adapters are made with peft from random weights (``bench/lora_adapters.py``).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import PROMPT, Server, StreamStats, modelyard, one_stream, pct, report
from bench.lora_adapters import make_adapters

ADAPTERS = 8
STREAMS = 16
PER_LANE = 2
MAX_TOKENS = 64
FRESH = 3
ALTERNATIONS = 10

BASE = """  {name}:
    model: "builtin:smollm2"
    cpu_cores: "0-1"
    max_model_len: 1024
    max_num_seqs: 32
"""


def preset(models: str, **server: Any) -> str:
    extra = "".join(f", {k}: {v}" for k, v in server.items())
    return ("server: {host: 127.0.0.1, port: {port}, spare_workers: 0" + extra + "}\n"
            "models:\n" + models)


def adapter_lines(base: str, folders: dict[str, Path]) -> str:
    return "".join(f"  {name}: {{base: {base}, adapter: {path}}}\n"
                   for name, path in folders.items())


async def spread(url: str, models: list[str], concurrency: int) -> tuple[StreamStats, float]:
    """``concurrency`` lanes, lane i streaming ``PER_LANE`` completions of model i mod n."""
    stats = StreamStats()
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def lane(i: int) -> None:
            body = {"model": models[i % len(models)], "prompt": PROMPT,
                    "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
            for _ in range(PER_LANE):
                await one_stream(client, url + "/v1/completions", body, stats)
        start = time.perf_counter()
        await asyncio.gather(*(lane(i) for i in range(concurrency)))
        return stats, time.perf_counter() - start


def measure(yard: Server, models: list[str], concurrency: int) -> dict[str, Any]:
    asyncio.run(spread(yard.url, models, concurrency))  # warm: adapters loaded, caches hot
    stats, seconds = asyncio.run(spread(yard.url, models, concurrency))
    assert not stats.errors, f"{stats.errors} streams failed; see {yard.log.name}"
    return {"tokens_per_s": round(stats.tokens / seconds, 1),
            "itl_p50_ms": round(pct(stats.itl, 50) * 1000, 1),
            "itl_p99_ms": round(pct(stats.itl, 99) * 1000, 1),
            "ttft_p50_ms": round(pct(stats.ttft, 50) * 1000, 1)}


def first_token(yard: Server, model: str) -> float:
    stats = StreamStats()

    async def one() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            await one_stream(client, yard.url + "/v1/completions",
                             {"model": model, "prompt": PROMPT, "max_tokens": 4}, stats)

    asyncio.run(one())
    assert stats.ttft, f"no token from {model}; see {yard.log.name}"
    return stats.ttft[0]


def throughput_and_first_use(folders: dict[str, Path]) -> dict[str, Any]:
    mixed = {k: v for k, v in list(folders.items())[:ADAPTERS]}
    fresh = list(folders)[ADAPTERS:ADAPTERS + FRESH]
    out: dict[str, Any] = {}
    with modelyard(preset(BASE.format(name="plain")), name="lora-plain") as yard:
        yard.wait("/health")
        yard.wait("/v1/models/plain", ok=lambda m: True)
        out["base_no_lora_16"] = measure(yard, ["plain"], STREAMS)
        out["base_no_lora_1"] = measure(yard, ["plain"], 1)
    models = BASE.format(name="base") + "    max_loras: 8\n    max_cpu_loras: 16\n"
    models += adapter_lines("base", {**mixed, **{k: folders[k] for k in fresh}})
    with modelyard(preset(models), name="lora-mixed") as yard:
        yard.wait("/health")
        out["adapters_16_over_8"] = measure(yard, list(mixed), STREAMS)
        out["base_on_lora_engine_16"] = measure(yard, ["base"], STREAMS)
        out["adapter_1"] = measure(yard, [next(iter(mixed))], 1)
        out["base_on_lora_engine_1"] = measure(yard, ["base"], 1)
        first, again, loads = [], [], []
        for name in fresh:
            first.append(first_token(yard, name))
            again.append(first_token(yard, name))
            listed = httpx.get(f"{yard.url}/v1/models/{name}").json()
            loads.append(float(listed["load_seconds"]))
        out["first_use"] = {
            "load_s": [round(x, 3) for x in loads],
            "load_s_median": round(statistics.median(loads), 3),
            "first_ttft_ms": [round(x * 1000, 1) for x in first],
            "next_ttft_ms": [round(x * 1000, 1) for x in again],
            "added_ttft_ms_median": round(statistics.median(
                a - b for a, b in zip(first, again)) * 1000, 1)}
    return out


def alternate(yard: Server, names: list[str]) -> dict[str, Any]:
    def loads() -> int:
        return sum(int(m.get("loads", 0))
                   for m in httpx.get(f"{yard.url}/v1/models").json()["data"])

    before, took, done = loads(), [], 0
    for i in range(ALTERNATIONS):
        start = time.monotonic()
        r = httpx.post(f"{yard.url}/v1/completions", timeout=900, json={
            "model": names[i % 2], "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        took.append(time.monotonic() - start)
        done += r.status_code == 200
    return {"requests": ALTERNATIONS, "completed": done, "loads": loads() - before,
            "p50_s": round(statistics.median(took), 3), "total_s": round(sum(took), 1)}


def alternation(folders: dict[str, Path]) -> dict[str, Any]:
    two = dict(list(folders.items())[:2])
    models = (BASE.format(name="base") + adapter_lines("base", two)
              + BASE.format(name="full-a") + BASE.format(name="full-b"))
    with modelyard(preset(models, max_loaded_models=1, spare_workers=1),
                   name="lora-swap") as yard:
        yard.wait("/health")
        httpx.post(f"{yard.url}/v1/models/load", json={"model": "base"}, timeout=900)
        adapters = alternate(yard, list(two))
        httpx.post(f"{yard.url}/v1/models/load", json={"model": "full-a"}, timeout=900)
        full = alternate(yard, ["full-a", "full-b"])
    return {"two_adapters": adapters, "two_full_models": full}


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    folders = make_adapters(folder, {f"ft{i}": (8, 100 + i)
                                     for i in range(ADAPTERS + FRESH)})
    result = throughput_and_first_use(folders)
    result["alternating"] = alternation(folders)
    plain = result["base_no_lora_16"]["tokens_per_s"]
    result["ratio_adapters_vs_base_16"] = round(
        result["adapters_16_over_8"]["tokens_per_s"] / plain, 3)
    result["ratio_base_on_lora_engine_vs_base_16"] = round(
        result["base_on_lora_engine_16"]["tokens_per_s"] / plain, 3)
    result["ratio_adapter_vs_base_1"] = round(
        result["adapter_1"]["tokens_per_s"] / result["base_no_lora_1"]["tokens_per_s"], 3)
    alt = result["alternating"]

    def line(kind: str) -> str:
        return " / ".join(str(alt[kind][k]) for k in ("loads", "completed", "p50_s"))

    rows = [("what", "value"),
            ("16 streams over 8 adapters / base without LoRA (target >= 0.7)",
             str(result["ratio_adapters_vs_base_16"])),
            ("16 streams of the base on the LoRA engine / without",
             str(result["ratio_base_on_lora_engine_vs_base_16"])),
            ("1 stream, adapter / base without LoRA", str(result["ratio_adapter_vs_base_1"])),
            ("first use of a rank-8 adapter: load (s, target <= 1)",
             str(result["first_use"]["load_s_median"])),
            ("  added time to first token (ms)",
             str(result["first_use"]["added_ttft_ms_median"])),
            ("alternating, 2 adapters: loads / completed / p50 (s)", line("two_adapters")),
            ("alternating, 2 full models: loads / completed / p50 (s)",
             line("two_full_models"))]
    report("lora", result, rows)


if __name__ == "__main__":
    main()
