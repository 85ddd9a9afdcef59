"""Faults, reported as "N of N":

1. kill -9 of a worker mid-stream, 100 times (``synthetic`` engine for volume) and a few
   times with real vLLM workers: clients that got a terminal error within 2 s, and next
   requests that succeeded.
2. 500 streamed requests, 20 % of clients disconnecting mid-stream: the engine's and the
   router's in-flight counts back to 0, no leaked tasks or sockets.
3. Router SIGTERM and SIGKILL: worker and EngineCore processes left behind.
4. A 30 MiB prompt sent beside a real vLLM stream, several times: refused by the router
   (its megabytes never reach the worker), and the neighbour stream's longest gap while
   it was being sent and refused, against that stream's median gap (target < 1 s).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import signal
import statistics
import sys
import time
from typing import Any

import httpx
import psutil

from bench.common import modelyard, report

KILLS_SYNTHETIC = 100
KILLS_REAL = 3
SYNTH = """
server: {host: 127.0.0.1, port: {port}, max_queue_depth: 10000}
models:
  synth: {model: none, engine: synthetic, load_on_startup: true, max_model_len: 100000,
          engine_args: {tokens_per_second: 100}}
"""
REAL = """
server: {host: 127.0.0.1, port: {port}}
models:
  smollm2: {model: "builtin:smollm2", load_on_startup: true, max_model_len: 1024}
"""
HI = [{"role": "user", "content": "Tell me a story."}]
MAX_TOKENS = 960
"""Within the real model's 1024 tokens with the prompt: an OpenAI request past its context
is refused, not clamped (``max_tokens_overflow``), and the kills need streams that run."""


async def _stream_until_end(client: httpx.AsyncClient, url: str, model: str,
                            first: asyncio.Event) -> float:
    """Stream until the response ends; return the time it ended (monotonic). ``first`` is
    set at its first token, or when it ends without one (a refusal)."""
    body = {"model": model, "messages": HI, "max_tokens": MAX_TOKENS, "stream": True,
            "ignore_eos": True}
    try:
        async with client.stream("POST", url, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    first.set()
                if '"error"' in line:
                    return time.monotonic()
    except httpx.HTTPError:
        pass  # a cut connection is a terminal error too
    finally:
        first.set()
    return time.monotonic()


async def _blocking_request(client: httpx.AsyncClient, url: str, model: str) -> tuple[int, float]:
    body = {"model": model, "messages": HI, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    try:
        r = await client.post(url, json=body)
        return r.status_code, time.monotonic()
    except httpx.HTTPError:
        return 0, time.monotonic()


async def kill_cycles(base: str, model: str, cycles: int) -> dict[str, Any]:
    url = base + "/v1/chat/completions"
    in_time = clients = next_ok = 0
    worst = 0.0
    async with httpx.AsyncClient(timeout=900) as client:
        for _ in range(cycles):
            pid = (await client.get(f"{base}/v1/models/{model}")).json().get("pid")
            if pid is None:  # not running: a plain request starts it
                await client.post(url, json={"model": model, "messages": HI, "max_tokens": 1})
                pid = (await client.get(f"{base}/v1/models/{model}")).json()["pid"]
            first = asyncio.Event()
            stream = asyncio.create_task(_stream_until_end(client, url, model, first))
            blocking = asyncio.create_task(_blocking_request(client, url, model))
            await first.wait()
            await asyncio.sleep(0.2)
            killed = time.monotonic()
            psutil.Process(pid).kill()
            ends = [await stream, (await blocking)[1]]
            for end in ends:
                clients += 1
                worst = max(worst, end - killed)
                in_time += end - killed < 2.0
            r = await client.post(url, json={"model": model, "messages": HI, "max_tokens": 2})
            next_ok += r.status_code == 200
    return {"clients_terminal_error_within_2s": f"{in_time} of {clients}",
            "worst_seconds_to_error": round(worst, 3),
            "next_request_succeeded": f"{next_ok} of {cycles}"}


async def disconnects(base: str, router_pid: int, total: int = 500,
                      share: float = 0.2) -> dict[str, Any]:
    url = base + "/v1/chat/completions"
    router = psutil.Process(router_pid)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=60)) as client:
        await client.post(url, json={"model": "synth", "messages": HI, "max_tokens": 2})
        before = {"fds": router.num_fds(),
                  "tasks": (await client.get(f"{base}/health")).json()["tasks"]}
        rng = random.Random(7)
        plan = [rng.random() < share for _ in range(total)]
        sem = asyncio.Semaphore(50)

        async def one(leave_early: bool) -> bool:
            async with sem:
                body = {"model": "synth", "messages": HI, "max_tokens": 50, "stream": True}
                async with client.stream("POST", url, json=body) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: {")
                        if leave_early and n == 3:
                            return False  # closing the response disconnects mid-stream
                    return True
        completed = sum(await asyncio.gather(*(one(p) for p in plan)))
    await asyncio.sleep(1.0)
    async with httpx.AsyncClient(timeout=30) as client:
        model = (await client.get(f"{base}/v1/models/synth")).json()
        health = (await client.get(f"{base}/health")).json()
    after = {"fds": router.num_fds(), "tasks": health["tasks"]}
    return {"requests": total, "disconnected": sum(plan), "completed": completed,
            "engine_in_flight_after": model.get("worker_in_flight"),
            "router_in_flight_after": model["in_flight"],
            "router_fds_before_after": [before["fds"], after["fds"]],
            "router_tasks_before_after": [before["tasks"], after["tasks"]]}


HUGE_ROUNDS = 5
# Sent from its own process with http.client, whose ``sendall`` copies nothing and holds no
# lock the measuring client needs (httpx's sync write re-slices what is left after each
# send: quadratic copying, all on these two cores).
_SEND_HUGE = """
import http.client, json, sys, time
body = json.dumps({"model": sys.argv[3], "messages": [
    {"role": "user", "content": "lorem ipsum " * ((30 << 20) // 12)}]}).encode()
sys.stdout.write("ready\\n"); sys.stdout.flush(); sys.stdin.readline()
conn = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=300)
sent = time.monotonic()
conn.request("POST", "/v1/chat/completions", body=body,
             headers={"content-type": "application/json"})
r = conn.getresponse()
print(json.dumps({"status": r.status, "error": json.loads(r.read()).get("error"),
                  "sent": sent, "answered": time.monotonic()}))
"""


async def huge_prompt(base: str, model: str, rounds: int = HUGE_ROUNDS) -> dict[str, Any]:
    """Each round: a warm-up stream (a young CPU engine pauses at its first runs of a
    length), then the same stream with the 30 MiB request sent at its 6th token."""
    url = base + "/v1/chat/completions"
    host, port = base.removeprefix("http://").split(":")
    body = {"model": model, "messages": HI, "max_tokens": 80, "temperature": 0,
            "stream": True, "ignore_eos": True}
    worst: list[float] = []
    medians: list[float] = []
    by_router = 0
    async with httpx.AsyncClient(timeout=300) as client:
        async def arrivals(sender: asyncio.subprocess.Process | None) -> list[float]:
            seen: list[float] = []
            async with client.stream("POST", url, json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        seen.append(time.monotonic())
                        if sender is not None and len(seen) == 6:
                            assert sender.stdin is not None
                            sender.stdin.write(b"go\n")
            return seen
        for _ in range(rounds):
            sender = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _SEND_HUGE, host, port, model,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            assert sender.stdout is not None
            await sender.stdout.readline()  # its 30 MiB body is built
            await arrivals(None)
            seen = await arrivals(sender)
            answer = json.loads((await sender.communicate())[0])
            error = answer["error"] or {}
            # The router's refusal counts the characters; the worker's would not.
            by_router += (answer["status"] == 400 and error.get("code") ==
                          "context_length_exceeded" and "characters)" in error["message"])
            gaps = [(a, b - a) for a, b in itertools.pairwise(seen)]
            during = [gap for a, gap in gaps
                      if a + gap >= answer["sent"] and a <= answer["answered"]]
            worst.append(max(during, default=0.0))
            medians.append(statistics.median(gap for _, gap in gaps))
    return {"rounds": rounds, "refused_by_router": f"{by_router} of {rounds}",
            "longest_gap_during_refusal_s": [round(w, 3) for w in worst],
            "median_gap_s": round(statistics.median(medians), 3),
            "target_longest_gap_s": 1.0}


def orphans() -> dict[str, str]:
    out = {}
    routers = {how: modelyard(REAL, name=f"orphans-{how}") for how in ("SIGTERM", "SIGKILL")}
    try:
        for server in routers.values():
            server.wait("/v1/models/smollm2", lambda m: m.get("state") == "ready", timeout=900)
        for how, server in routers.items():
            tree = psutil.Process(server.proc.pid).children(recursive=True)
            server.proc.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGKILL)
            server.proc.wait(60)
            _, alive = psutil.wait_procs(tree, timeout=15)
            out[how] = f"{len(tree) - len(alive)} of {len(tree)} processes gone"
    finally:
        for server in routers.values():
            server.stop(signal.SIGKILL)
    return out


def main() -> None:
    result: dict[str, Any] = {}
    with modelyard(SYNTH) as yard:
        yard.wait("/v1/models/synth", lambda m: m.get("state") == "ready")
        result["kill9_synthetic"] = asyncio.run(kill_cycles(yard.url, "synth", KILLS_SYNTHETIC))
        result["disconnect_20_percent"] = asyncio.run(disconnects(yard.url, yard.proc.pid))
    with modelyard(REAL) as yard:
        yard.wait("/v1/models/smollm2", lambda m: m.get("state") == "ready", timeout=900)
        result["kill9_real_vllm"] = asyncio.run(kill_cycles(yard.url, "smollm2", KILLS_REAL))
        result["huge_prompt"] = asyncio.run(huge_prompt(yard.url, "smollm2"))
    result["router_signals"] = orphans()
    k, d = result["kill9_synthetic"], result["disconnect_20_percent"]
    r = result["kill9_real_vllm"]
    rows = [("fault", "outcome"),
            ("kill -9 synthetic: error within 2 s", k["clients_terminal_error_within_2s"]),
            ("kill -9 synthetic: next request ok", k["next_request_succeeded"]),
            ("kill -9 vLLM: error within 2 s", r["clients_terminal_error_within_2s"]),
            ("kill -9 vLLM: next request ok", r["next_request_succeeded"]),
            ("20% disconnect: in flight after", (f"engine {d['engine_in_flight_after']}, "
                                                 f"router {d['router_in_flight_after']}")),
            ("20% disconnect: fds / tasks", (f"{d['router_fds_before_after']} / "
                                             f"{d['router_tasks_before_after']}")),
            *[(f"router {how}", v) for how, v in result["router_signals"].items()],
            ("30 MiB prompt: refused by the router", result["huge_prompt"]["refused_by_router"]),
            ("30 MiB prompt: neighbour's longest gap (s, target < 1)",
             " ".join(map(str, result["huge_prompt"]["longest_gap_during_refusal_s"]))),
            ("30 MiB prompt: neighbour's median gap (s)",
             str(result["huge_prompt"]["median_gap_s"]))]
    report("faults", result, rows)


if __name__ == "__main__":
    main()
