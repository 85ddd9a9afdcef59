"""Router relay capacity: the router pinned to core 0 with the ``synthetic`` engine (no
model) on core 1; wrk (also on core 1) drives streamed chat requests and tiny
non-streaming ones at 1, 16 and 64 connections. The same wrk runs against a bare
starlette+uvicorn app on core 0 give the framework's own limit in the same run. Added
latency (worker send → client receive) comes from timestamped synthetic tokens. py-spy
samples the router under streaming load to show where its time goes.

Targets: >= 50 000 chunks/s, non-streaming requests/s >= 45 % of the bare app's, added
latency p50 <= 0.2 ms. Added latency is the router's p50 (stamp → client read) less the
bare app's, whose chunks carry the time they were written, read by the same client.

The machine's speed drifts (a VM's neighbours): each point alternates router and bare
``ROUNDS`` times and reports the medians and the median of the per-round shares. The run
also measures the floor the router's link sets: a CURVE ZeroMQ round trip between the
two cores with nothing else in it (``zmq_round_trip_us``). At one connection a request
takes the bare app's round trip plus at least that one, so the router's share there
cannot exceed ``one_connection_ceiling`` even with no Python work at all.
"""

from __future__ import annotations

import asyncio
import collections
import json
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import zmq

from bench.common import PY, TREE, Server, free_port, modelyard, pct, report

TOKENS = 200
SECONDS = 4
ROUNDS = 3
CONCURRENCY = (1, 16, 64)
ROUTER_CPU, LOAD_CPU = 0, 1

KEY = os.environ.get("BENCH_API_KEY", "")
"""With it, the router requires this key and every request shows it (keys, the usage
ledger and per-key metrics all on the request's path)."""
PRESET = f"""
server: {{host: 127.0.0.1, port: {{port}}, max_queue_depth: 100000
         {f', api_keys: ["{KEY}"]' if KEY else ''}}}
models:
  synth: {{model: none, engine: synthetic, cpu_cores: "{LOAD_CPU}", load_on_startup: true,
          max_model_len: 100000}}
  synth-ts: {{model: none, engine: synthetic, cpu_cores: "{LOAD_CPU}", load_on_startup: true,
             max_model_len: 100000, engine_args: {{timestamps: true, tokens_per_second: 100}}}}
"""
CHAT = {"model": "synth", "messages": [{"role": "user", "content": "hi"}]}
HEADERS = {"Authorization": f"Bearer {KEY}"} if KEY else {}


def wrk(url: str, body: dict[str, Any], connections: int) -> dict[str, float]:
    script = Path(tempfile.mkdtemp()) / "post.lua"
    script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                      + (f'wrk.headers["Authorization"] = "Bearer {KEY}"\n' if KEY else "")
                      + f"wrk.body = {json.dumps(json.dumps(body))}\n")
    out = subprocess.run(["taskset", "-c", str(LOAD_CPU), "wrk", "-t1", f"-c{connections}",
                          f"-d{SECONDS}s", "-s", str(script), url],
                         capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors:.*", out)
    return {"requests_per_s": rps, "non_2xx": int(bad.group(1)) if bad else 0,
            "socket_errors": errors.group(0) if errors else ""}  # type: ignore[dict-item]


async def latency(url: str, concurrency: int, per_client: int = 3) -> list[float]:
    """Milliseconds from the server stamping a token (the synthetic worker, or the bare
    app) to this client reading it."""
    samples: list[float] = []
    body = {"model": "synth-ts", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 100, "stream": True}
    async with httpx.AsyncClient(timeout=60, headers=HEADERS) as client:
        async def lane() -> None:
            for _ in range(per_client):
                async with client.stream("POST", url, json=body) as r:
                    async for line in r.aiter_lines():
                        now = time.monotonic_ns()
                        if line.startswith("data: {") and '"content":"' in line:
                            stamp = line.split('"content":"', 1)[1].split(" ", 1)[0]
                            if stamp.isdigit():
                                samples.append((now - int(stamp)) / 1e6)
        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return samples


def profile(pid: int, url: str) -> list[dict[str, Any]]:
    """py-spy self-time shares of the router's top functions under streaming load."""
    if shutil.which("py-spy") is None and not Path(PY).with_name("py-spy").exists():
        return [{"function": "py-spy not installed", "share": 0}]
    spy = shutil.which("py-spy") or str(Path(PY).with_name("py-spy"))
    out = Path(tempfile.mkdtemp()) / "router.txt"
    proc = subprocess.Popen([spy, "record", "-p", str(pid), "-d", str(SECONDS - 2), "-r", "200",
                             "-f", "raw", "-o", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wrk(url, {**CHAT, "max_tokens": TOKENS, "stream": True}, 16)
    proc.wait(30)
    counts: collections.Counter[str] = collections.Counter()
    for line in out.read_text().splitlines() if out.exists() else []:
        stack, _, n = line.rpartition(" ")
        counts[stack.split(";")[-1]] += int(n)
    total = sum(counts.values()) or 1
    return [{"function": fn, "share": round(n / total, 3)} for fn, n in counts.most_common(12)]


def _echo(endpoint: str, server_key: bytes, cpu: int) -> None:
    """The worker's side of ``zmq_round_trip``: send back every message until ``b""``."""
    os.sched_setaffinity(0, {cpu})
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.curve_serverkey = server_key
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(endpoint)
    while message := sock.recv():
        sock.send(message)
    sock.close(0)
    ctx.term()


def zmq_round_trip(n: int = 5000) -> float:
    """Median microseconds of a 200-byte CURVE round trip over ``ipc://`` between the
    router's core and the worker's, blocking reads, as the router's link is set up."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    public, secret = zmq.curve_keypair()
    sock.curve_server, sock.curve_secretkey, sock.curve_publickey = True, secret, public
    endpoint = f"ipc://{tempfile.mkdtemp()}/rt.sock"
    sock.bind(endpoint)
    echo = multiprocessing.get_context("spawn").Process(
        target=_echo, args=(endpoint, public, LOAD_CPU))
    echo.start()
    os.sched_setaffinity(0, {ROUTER_CPU})
    try:
        payload, samples = b"x" * 200, []
        for i in range(n + 200):
            start = time.perf_counter_ns()
            sock.send(payload)
            sock.recv()
            if i >= 200:  # warm-up: the handshake and first wake-ups
                samples.append((time.perf_counter_ns() - start) / 1000)
        sock.send(b"")
    finally:
        os.sched_setaffinity(0, {LOAD_CPU})
        echo.join(10)
        sock.close(0)
        ctx.term()
    return statistics.median(samples)


def main() -> None:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (make bench installs it with apt-get)")
    os.sched_setaffinity(0, {LOAD_CPU})
    result: dict[str, Any] = {"tokens_per_stream": TOKENS, "seconds_per_point": SECONDS,
                              "router_cpu": ROUTER_CPU, "load_cpu": LOAD_CPU,
                              "api_key": bool(KEY), "tree": str(TREE)}
    rows = [("what", "conns", "router", "bare", "share")]
    bare_port = free_port()
    with Server([PY, "-m", "bench.bare_app", str(bare_port)], bare_port, cpus={ROUTER_CPU},
                name="bare") as bare, modelyard(
                    PRESET, cpus={ROUTER_CPU},
                    # its usage ledger (SQLite in the cache dir) in a dir of its own
                    env={"XDG_CACHE_HOME": tempfile.mkdtemp(prefix="bench-cache-")}) as yard:
        bare.wait_port()
        yard.wait("/health", lambda h: set(h["models"].values()) == {"ready"}, timeout=120,
                  headers=HEADERS)
        chat_url = yard.url + "/v1/chat/completions"
        wrk(chat_url, {**CHAT, "max_tokens": 4}, 4)  # warm-up
        # (label, key, router body, bare path, units per request)
        cases = [("chunks/s", "stream", {**CHAT, "max_tokens": TOKENS, "stream": True},
                  f"/sse?n={TOKENS}", TOKENS),
                 ("req/s", "requests", {**CHAT, "max_tokens": 1}, "/json", 1)]
        for label, key, body, bare_path, per_request in cases:
            for conns in CONCURRENCY:
                ys, bs = [], []
                for _ in range(ROUNDS):
                    ys.append(wrk(chat_url, body, conns))
                    bs.append(wrk(bare.url + bare_path, {"x": 1}, conns))
                router_rates = [y["requests_per_s"] * per_request for y in ys]
                bare_rates = [b["requests_per_s"] * per_request for b in bs]
                router_rate = round(statistics.median(router_rates))
                bare_rate = round(statistics.median(bare_rates))
                share = round(statistics.median(
                    r / max(1.0, b) for r, b in zip(router_rates, bare_rates)), 3)
                result[f"{key}_{conns}"] = {
                    "router_per_s": router_rate, "bare_per_s": bare_rate,
                    "share_of_bare": share, "shares": [round(r / max(1.0, b), 3) for r, b
                                                       in zip(router_rates, bare_rates)],
                    "router_errors": sum(y["non_2xx"] for y in ys)}
                rows.append((label, str(conns), str(router_rate), str(bare_rate), f"{share:.0%}"))
        rtt = zmq_round_trip()
        bare_rtt = 1e6 / max(1, result["requests_1"]["bare_per_s"])
        result["zmq_round_trip_us"] = round(rtt, 1)
        result["one_connection_ceiling"] = round(bare_rtt / (bare_rtt + rtt), 3)
        rows.append(("zmq rtt us", "1", f"{rtt:.0f}", f"{bare_rtt:.0f}",
                     f"max {result['one_connection_ceiling']:.0%}"))
        for conns in (1, 16):
            # Stamp to client read through the router (worker → ZeroMQ → relay → HTTP)
            # and through the bare app (HTTP only): the difference is what the router adds.
            lat = asyncio.run(latency(chat_url, conns))
            base = asyncio.run(latency(bare.url + "/sse-stamped", conns))
            added = pct(lat, 50) - pct(base, 50)
            result[f"added_latency_{conns}"] = {
                "p50_ms": round(added, 3), "router_p50_ms": round(pct(lat, 50), 3),
                "router_p99_ms": round(pct(lat, 99), 3), "bare_p50_ms": round(pct(base, 50), 3),
                "bare_p99_ms": round(pct(base, 99), 3), "samples": len(lat)}
            rows.append(("latency ms", str(conns), f"p50 {pct(lat, 50):.3f}",
                         f"p50 {pct(base, 50):.3f}", f"+{added:.3f}"))
        result["router_profile"] = profile(yard.proc.pid, chat_url)
    report("relay", result, rows)


if __name__ == "__main__":
    main()
