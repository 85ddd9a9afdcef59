"""A plain user key's large batches against the router (issue 38, finding 2), on a
synthetic model (no inference cost worth the name: what is measured is the router):

1. One ``MIB`` MiB, ``LINES``-line batch input file uploaded by a user key.
2. ``CREATES`` batches made from it, one after another (after a one-line batch, not
   measured: the first request's own costs are not the creates'), while ``/health`` is asked every
   ``HEALTH_EVERY`` seconds: how long ``/health`` took at most and at p99 during the
   creates (target: at most 50 ms: a create's lines are checked off the event loop), and
   how long each create took.
3. The router's RSS (its own process, not its workers) before the creates, after them,
   and ``SETTLE`` seconds later while the runner holds the batches (target: growth at
   most 64 MiB, whatever the batch size).

``BENCH_HOSTILE_MIB`` and ``BENCH_HOSTILE_LINES`` make a small run (a smoke test:
``BENCH_HOSTILE_MIB=2 BENCH_HOSTILE_LINES=2000``); the figures of record are at 40 MiB
and 40 000 lines. The router has a cache dir (database, files) of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from typing import Any

import httpx
import psutil

from bench.common import Server, modelyard, pct, report

MIB = float(os.environ.get("BENCH_HOSTILE_MIB", "40"))
LINES = int(os.environ.get("BENCH_HOSTILE_LINES", "40000"))
CREATES = 4
HEALTH_EVERY = 0.005
SETTLE = float(os.environ.get("BENCH_HOSTILE_SETTLE", "10"))
ADMIN = "k-admin-hostile-bench"

PRESET = """server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  cache_dir: "{cache}"
  admin_api_keys: [k-admin-hostile-bench]
  files_max_mib: 128
  files_quota_mib: 4096
  batch_max_lines: 100000
models:
  m: {model: /synthetic, engine: synthetic, engine_args: {tokens_per_second: 20}}
"""


def batch_file() -> bytes:
    """``LINES`` chat lines of about ``MIB`` MiB together."""
    pad = max(0, int(MIB * 2**20 / LINES) - 190)
    lines = []
    for i in range(LINES):
        body = {"model": "m", "max_tokens": 4,
                "messages": [{"role": "user", "content": f"{i} " + "x" * pad}]}
        lines.append(json.dumps({"custom_id": f"line-{i}", "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}))
    return ("\n".join(lines) + "\n").encode()


def rss_mib(server: Server) -> float:
    return float(psutil.Process(server.proc.pid).memory_info().rss / 2**20)


async def create_while_watched(client: httpx.AsyncClient, url: str, key: str,
                               file_id: str) -> tuple[float, list[float], str]:
    """One create, with ``/health`` asked meanwhile: the create's seconds, each
    ``/health``'s seconds, and the batch's id."""
    done = asyncio.Event()
    latencies: list[float] = []

    async def watch() -> None:
        while not done.is_set():
            started = time.perf_counter()
            (await client.get(f"{url}/health")).raise_for_status()
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(HEALTH_EVERY)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.05)  # the watcher is asking before the create starts
    started = time.perf_counter()
    made = await client.post(f"{url}/v1/batches", headers={"Authorization": f"Bearer {key}"},
                             json={"input_file_id": file_id, "completion_window": "24h",
                                   "endpoint": "/v1/chat/completions"}, timeout=600)
    took = time.perf_counter() - started
    done.set()
    await watcher
    made.raise_for_status()
    return took, latencies, str(made.json()["id"])


async def run(server: Server, key: str, file_id: str, warm_id: str) -> dict[str, Any]:
    creates: list[float] = []
    health: list[float] = []
    per_create: list[dict[str, float]] = []
    async with httpx.AsyncClient(timeout=60) as client:
        # Not measured: the connection opened, and a first (one-line) create, so the
        # figures are the large creates', not a first request's.
        await create_while_watched(client, server.url, key, warm_id)
        await asyncio.sleep(1)
        before = rss_mib(server)
        for _ in range(CREATES):
            took, latencies, _ = await create_while_watched(client, server.url, key, file_id)
            creates.append(took)
            health.extend(latencies)
            per_create.append({"create_s": round(took, 3),
                               "health_max_ms": round(max(latencies) * 1000, 1)})
        after = rss_mib(server)
        await asyncio.sleep(SETTLE)
        settled = rss_mib(server)
    return {
        "file_mib": MIB, "lines": LINES, "creates": CREATES,
        "health_max_ms": round(max(health) * 1000, 1),
        "health_p99_ms": round(pct(health, 99) * 1000, 1),
        "health_samples": len(health),
        "create_s_max": round(max(creates), 3),
        "rss_before_mib": round(before, 1), "rss_after_creates_mib": round(after, 1),
        "rss_settled_mib": round(settled, 1),
        "rss_growth_mib": round(max(after, settled) - before, 1),
        "per_create": per_create,
    }


def main() -> None:
    cache = tempfile.mkdtemp(prefix="bench-hostile-")
    try:
        with modelyard(PRESET.replace("{cache}", cache), name="hostile") as server:
            server.wait("/health")
            admin = {"Authorization": f"Bearer {ADMIN}"}
            made = httpx.post(f"{server.url}/v1/keys", headers=admin, timeout=30,
                              json={"name": "hostile-bench"})
            made.raise_for_status()
            key = made.json()["key"]
            body = batch_file()
            uploaded = httpx.post(f"{server.url}/v1/files", timeout=600,
                                  headers={"Authorization": f"Bearer {key}"},
                                  data={"purpose": "batch"},
                                  files={"file": ("lines.jsonl", body)})
            uploaded.raise_for_status()
            del body
            warm = httpx.post(f"{server.url}/v1/files", timeout=60,
                              headers={"Authorization": f"Bearer {key}"},
                              data={"purpose": "batch"},
                              files={"file": ("warm.jsonl", json.dumps({
                                  "custom_id": "warm", "method": "POST",
                                  "url": "/v1/chat/completions", "body": {
                                      "model": "m", "max_tokens": 1,
                                      "messages": [{"role": "user", "content": "hi"}]}})
                                  .encode())})
            warm.raise_for_status()
            result = asyncio.run(run(server, key, uploaded.json()["id"], warm.json()["id"]))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    report("hostile", result, [
        ("figure", "value", "target"),
        ("/health max during creates", f"{result['health_max_ms']} ms", "<= 50 ms"),
        ("/health p99 during creates", f"{result['health_p99_ms']} ms", ""),
        ("slowest create", f"{result['create_s_max']} s", ""),
        ("router RSS growth", f"{result['rss_growth_mib']} MiB", "<= 64 MiB"),
    ])


if __name__ == "__main__":
    main()
