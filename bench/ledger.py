"""The usage ledger and the key checks (issue 22): what they cost a request, how fast a
month of one key's usage is summed, and what a kill -9 loses.

- ``per_request_us``: in-process, the admission layers (``KeyGuard`` with a key to
  look up, ``RateLimit``) around an app that does nothing, against the same app bare;
  and ``Ledger.record`` alone (queueing a row, all a request does on the loop).
- ``query_ms``: 1 000 000 rows (100 keys, 90 days, 8 models) in SQLite; one key's month
  summed per model and day through ``Ledger.query`` (target: < 100 ms).
- ``kill_9``: a router with a synthetic model answers requests from 16 clients for 3 s
  and is SIGKILLed; rows in the ledger against requests answered (rows are written once
  a second, so at most about a second's requests may be lost).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import signal
import sqlite3
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from starlette.routing import Route

from bench.common import modelyard, report
from router.access.admission import KeyGuard, Keys
from router.access.buckets import TokenBuckets
from router.access.budgets import Budgets
from router.access.database import Conn, Database
from router.access.key_store import Budget
from router.access.ledger import INSERT, SCHEMA, Ledger
from router.access.limits import RateLimit
from router.access.rules import AccessRules
from router.registry import ModelRegistry
from shared.config import ServerConfig
from shared.preset_loader import build_preset
from shared.protocol import ChatMessage, Generate, SamplingSpec

KEY = "k-bench-ledger"
ROWS = 1_000_000


async def _nothing(scope: Any, receive: Any, send: Any) -> None:
    pass


def per_request_us() -> dict[str, float]:
    """Microseconds the admission layers and the ledger add to one request."""
    keys = Keys([KEY, *(f"k-other-{i}" for i in range(50))], ["k-admin"])
    server = ServerConfig()
    rules = AccessRules([Route("/v1/chat/completions", _nothing, methods=["POST"])])
    guarded = KeyGuard(RateLimit(_nothing, server), keys, rules, TokenBuckets(20))
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-type", b"application/json"),
                         (b"authorization", f"Bearer {KEY}".encode())],
             "client": ("127.0.0.1", 5000)}
    n = 200_000

    async def timed(app: Any) -> float:
        started = time.perf_counter()
        for _ in range(n):
            await app(dict(scope), None, None)
        return (time.perf_counter() - started) / n * 1e6

    async def run() -> dict[str, float]:
        bare = min([await timed(_nothing) for _ in range(3)])
        with_keys = min([await timed(guarded) for _ in range(3)])
        ledger = Ledger(Database("sqlite:///" + tempfile.mktemp(suffix=".db"), SCHEMA))
        started = time.perf_counter()
        for _ in range(n):
            ledger.record("alice", "m", "chat", 200, 12, 0, 30, 0.25)
        record = (time.perf_counter() - started) / n * 1e6
        # A key with a budget: the hold at admission, the row, the settle at its end.
        budgets = Budgets(ledger, ModelRegistry(build_preset({"models": {
            "m": {"model": "/synthetic", "engine": "synthetic"}}})))
        entry = budgets.registry.entries["m"]
        daily = [Budget(tokens=10**12, period="day")]
        gens = [Generate(id="g", sampling=SamplingSpec(max_tokens=30),
                         messages=[ChatMessage(role="user", content="hi")])]
        started = time.perf_counter()
        for _ in range(n // 10):
            held = await budgets.reserve("alice", daily, entry, gens)
            ledger.record("alice", "m", "chat", 200, 12, 0, 30, 0.25)
            held.settle()
        budgeted = (time.perf_counter() - started) / (n // 10) * 1e6
        return {"admission_with_key": round(with_keys - bare, 2),
                "ledger_record": round(record, 2),
                "total": round(with_keys - bare + record, 2),
                "with_a_budget_reserve_record_settle": round(budgeted, 2)}

    return asyncio.run(run())


def query_ms() -> dict[str, Any]:
    path = Path(tempfile.mkdtemp(prefix="bench-ledger-")) / "ledger.db"
    db = Database(f"sqlite:///{path}", SCHEMA)
    ledger = Ledger(db)
    now = time.time()
    rng = random.Random(7)
    rows = [(now - rng.random() * 90 * 86400, f"key-{rng.randrange(100)}",
             f"model-{rng.randrange(8)}", "chat", 200, rng.randrange(2000), 0,
             rng.randrange(500), rng.random()) for _ in range(ROWS)]

    async def run() -> dict[str, Any]:
        ledger.start()
        started = time.perf_counter()
        for i in range(0, ROWS, 50_000):
            chunk = rows[i:i + 50_000]

            def insert(conn: Conn, chunk: list[Any] = chunk) -> None:
                conn.many(INSERT, chunk)

            await db.run(insert)
        load_s = time.perf_counter() - started
        start = now - 30 * 86400
        times, answer = [], []
        for _ in range(7):
            started = time.perf_counter()
            answer = await ledger.query(["model", "day"], start, now + 1, "key-42")
            times.append((time.perf_counter() - started) * 1000)
        return {"rows": ROWS, "insert_seconds": round(load_s, 1),
                "one_key_month_by_model_day_ms": round(statistics.median(times), 1),
                "groups": len(answer)}

    try:
        return asyncio.run(run())
    finally:
        db.close()


def kill_9() -> dict[str, Any]:
    preset = f"""
server: {{host: 127.0.0.1, port: {{port}}, spare_workers: 0, api_keys: ["{KEY}"],
         max_queue_depth: 10000}}
models:
  m: {{model: none, engine: synthetic, load_on_startup: true}}
"""
    answered = 0
    stop = threading.Event()
    lock = threading.Lock()
    with modelyard(preset) as yard:  # a database of its own (``modelyard``)
        yard.wait("/health/ready", timeout=120)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

        def client() -> None:
            nonlocal answered
            with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
                while not stop.is_set():
                    try:
                        ok = c.post(yard.url + "/v1/chat/completions", json=body
                                    ).status_code == 200
                    except httpx.HTTPError:
                        return  # the router is gone
                    if ok and not stop.is_set():
                        with lock:
                            answered += 1

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            for _ in range(16):
                pool.submit(client)
            time.sleep(3)
            with lock:
                stop.set()
                counted = answered
                yard.stop(signal.SIGKILL)
    assert yard.database is not None
    with sqlite3.connect(yard.database) as db:
        rows = db.execute("SELECT COUNT(*), MAX(time) - MIN(time) FROM usage "
                          "WHERE endpoint = 'chat' AND status = 200").fetchone()
    rate = counted / 3
    return {"answered": counted, "rows": rows[0], "lost": counted - rows[0],
            "requests_per_s": round(rate), "lost_seconds": round((counted - rows[0]) / rate, 2)}


def main() -> None:
    result = {"per_request_us": per_request_us(), "query": query_ms(), "kill_9": kill_9()}
    cost, query, killed = result["per_request_us"], result["query"], result["kill_9"]
    rows = [("what", "value"),
            ("admission with a key, us/request", str(cost["admission_with_key"])),
            ("ledger record, us/request", str(cost["ledger_record"])),
            ("one key's month of 1M rows, ms", str(query["one_key_month_by_model_day_ms"])),
            ("kill -9: rows lost / answered", f"{killed['lost']} / {killed['answered']}"),
            ("kill -9: seconds of requests lost", str(killed["lost_seconds"]))]
    report("ledger", result, rows)


if __name__ == "__main__":
    main()
