"""Swaps: how long a user waits for a model that is not running, and whether two models
on the same cores spend their time swapping or serving (issue 37).

Two ids of the embedded model on cores 0-1, ``max_loaded_models: 1``, one spare worker,
parking on (its defaults). In one run:

1. Cold start: a never-loaded model's first streamed token through modelyard, with a
   spare worker ready, against ``vllm serve``'s start-to-first-token (target <= 0.35x).
2. One closed-loop client alone on one model for ``ALONE_SECONDS``: its requests/s.
3. Two closed-loop clients, one per model, for ``WORKLOAD_SECONDS``: requests/s against
   (2) (target >= 0.8x), loads after the first two (target 0), the longest wait (<= 5 s).
4. Single requests alternating between the two models, against single requests on one
   model: the medians (target: alternating <= one model's + 0.1 s).
5. Wakes of a parked model (the ``wake`` events of 3 and 4, the router's own seconds):
   p50 / p99 of the resume (target p99 <= 0.1 s, over >= 20), and of the whole wait its
   requests saw (the events' ``waited``: the line for room, the other's turn included).
6. Three models in a memory ceiling that holds two (``park_memory_gib``: one parked
   worker's resident set, 1.5x): the third stops one (it does not park); then the
   stopped one is asked for right after that load (its spare not ready yet) against a
   start with a ready spare (target <= 1.5x).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import httpx

from bench.coldstart import first_token, vllm_start_to_first_token
from bench.common import PROMPT, Server, modelyard, pct, report

ALONE_SECONDS = 60
WORKLOAD_SECONDS = 150
SINGLES = 40
MODEL = """  {name}: {{model: "builtin:smollm2", cpu_cores: "0-1", max_model_len: 2048,
          kv_cache_gib: 1}}
"""
PRESET = """
server: {host: 127.0.0.1, port: {port}, max_loaded_models: 1}
models:
""" + MODEL.format(name="swap-a") + MODEL.format(name="swap-b")
CEILING_PRESET = """
server: {host: 127.0.0.1, port: {port}, max_loaded_models: 1, park_memory_gib: CEILING}
models:
""" + "".join(MODEL.format(name=f"mem-{x}") for x in "abc")
BODY = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}


def spare_ready(yard: Server, timeout: float = 300) -> None:
    yard.wait("/health", ok=lambda h: any(s["ready"] for s in h["spares"]), timeout=timeout)


def model(yard: Server, name: str) -> dict[str, Any]:
    return dict(httpx.get(f"{yard.url}/v1/models/{name}").json())


def count_loads(yard: Server) -> int:
    models = httpx.get(f"{yard.url}/v1/models").json()["data"]
    return sum(int(m.get("loads", 0)) for m in models)


class Wakes:
    """The router's ``wake`` events (its own seconds: the resume, and ``waited``, from the
    first waiting request), read from ``GET /v1/events`` (the last 200 events) often
    enough that none is missed."""

    def __init__(self, yard: Server) -> None:
        self.yard = yard
        self.seen: set[int] = set()
        self.seconds: list[float] = []
        self.waited: list[float] = []

    async def read(self, http: httpx.AsyncClient) -> None:
        events = (await http.get(f"{self.yard.url}/v1/events")).json()["data"]
        for e in events:
            if e["type"] == "wake" and e["id"] not in self.seen:
                self.seen.add(e["id"])
                self.seconds.append(float(e["seconds"]))
                self.waited.append(float(e["waited"]))

    async def follow(self, http: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            await self.read(http)
            await asyncio.sleep(1.0)


async def closed_loop(yard: Server, models: list[str], seconds: float,
                      wakes: Wakes) -> dict[str, Any]:
    """One client per model in ``models``, each sending its next request as the last
    one ends, for ``seconds``."""
    waits: dict[str, list[float]] = {m: [] for m in models}
    errors = 0
    until = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient, name: str) -> None:
        nonlocal errors
        while time.monotonic() < until:
            start = time.monotonic()
            r = await http.post(f"{yard.url}/v1/completions", json={"model": name, **BODY})
            if r.status_code == 200:
                waits[name].append(time.monotonic() - start)
            else:
                errors += 1

    async with httpx.AsyncClient(timeout=900) as http:
        await asyncio.gather(*(client(http, m) for m in models), wakes.follow(http, until))
        await wakes.read(http)
    every = [w for v in waits.values() for w in v]
    return {"requests": len(every), "requests_per_s": round(len(every) / seconds, 3),
            "per_model": {k: len(v) for k, v in waits.items()}, "errors": errors,
            "longest_wait_s": round(max(every), 2), "median_s": round(statistics.median(every), 3)}


async def singles(yard: Server, names: list[str], wakes: Wakes) -> list[float]:
    """``SINGLES`` requests one after another, cycling through ``names``: each one's
    seconds."""
    out = []
    async with httpx.AsyncClient(timeout=900) as http:
        for i in range(SINGLES):
            start = time.monotonic()
            r = await http.post(f"{yard.url}/v1/completions",
                                json={"model": names[i % len(names)], **BODY})
            r.raise_for_status()
            out.append(time.monotonic() - start)
            if i % 10 == 9:
                await wakes.read(http)
        await wakes.read(http)
    return out


def request_seconds(yard: Server, name: str) -> float:
    start = time.monotonic()
    httpx.post(f"{yard.url}/v1/completions", json={"model": name, **BODY},
               timeout=900).raise_for_status()
    return time.monotonic() - start


def ceiling(resident_mib: float) -> dict[str, Any]:
    """Three models in a memory ceiling that holds one parked worker beside the running
    one: who stops, and the start right after a load against one with a spare ready."""
    gib = round(resident_mib * 1.5 / 1024, 2)
    with modelyard(CEILING_PRESET.replace("CEILING", str(gib)), name="swap-ceiling") as yard:
        yard.wait("/health")
        spare_ready(yard)
        request_seconds(yard, "mem-a")
        spare_ready(yard)
        request_seconds(yard, "mem-b")  # a parks
        spare_ready(yard)
        ready_spare = request_seconds(yard, "mem-c")  # one parked model stops: no room
        states = {m: model(yard, m)["state"] for m in ("mem-a", "mem-b", "mem-c")}
        stopped = next(m for m, state in states.items() if state == "unloaded")
        right_after = request_seconds(yard, stopped)  # its spare is not ready yet
        return {"park_memory_gib": gib, "states_after_third": states,
                "start_with_ready_spare_s": round(ready_spare, 2),
                "start_right_after_a_load_s": round(right_after, 2),
                "ratio_right_after_vs_ready_spare": round(right_after / ready_spare, 2)}


def main() -> None:
    vllm = vllm_start_to_first_token()
    with modelyard(PRESET, name="swap") as yard:
        yard.wait("/health")
        spare_ready(yard)
        cold = first_token(yard.url, "swap-a")
        cold_phases = model(yard, "swap-a").get("load_phases", {})
        spare_ready(yard)
        first_token(yard.url, "swap-b")  # a parks; both are loaded from here on
        resident = float(model(yard, "swap-a").get("resident_mib", 0))
        loads_before = count_loads(yard)
        wakes = Wakes(yard)
        alone = asyncio.run(closed_loop(yard, ["swap-a"], ALONE_SECONDS, wakes))
        two = asyncio.run(closed_loop(yard, ["swap-a", "swap-b"], WORKLOAD_SECONDS, wakes))
        two["loads"] = count_loads(yard) - loads_before
        two["ratio_vs_alone"] = round(two["requests_per_s"] / alone["requests_per_s"], 3)
        one_model = asyncio.run(singles(yard, ["swap-a"], wakes))
        alternating = asyncio.run(singles(yard, ["swap-a", "swap-b"], wakes))
        loads_after = count_loads(yard) - loads_before
        parked = {m: model(yard, m) for m in ("swap-a", "swap-b")}
    memory = ceiling(resident)
    w, waited = wakes.seconds, wakes.waited
    result: dict[str, Any] = {
        "vllm_start_to_first_token_s": round(vllm, 2),
        "modelyard_cold_first_token_s": round(cold, 2),
        "ratio_cold_vs_vllm": round(cold / vllm, 3),
        "cold_load_phases_s": cold_phases,
        "resident_mib_per_worker": resident,
        f"one_client_alone_{ALONE_SECONDS}s": alone,
        f"two_clients_two_models_{WORKLOAD_SECONDS}s": two,
        "singles_one_model_median_s": round(statistics.median(one_model), 3),
        "singles_alternating_median_s": round(statistics.median(alternating), 3),
        "alternating_minus_one_model_s": round(statistics.median(alternating)
                                               - statistics.median(one_model), 3),
        "loads_after_the_first_two": loads_after,
        "wakes": len(w), "wake_p50_s": round(pct(w, 50), 4), "wake_p99_s": round(pct(w, 99), 4),
        "wake_max_s": round(max(w, default=float("nan")), 4),
        "wake_wait_p50_s": round(pct(waited, 50), 4),
        "wake_wait_p99_s": round(pct(waited, 99), 4),
        "wake_wait_max_s": round(max(waited, default=float("nan")), 4),
        "parks_wakes": {m: {"parks": o.get("parks", 0), "wakes": o.get("wakes", 0)}
                        for m, o in parked.items()},
        "memory_ceiling": memory,
    }
    rows = [("what", "value"),
            ("vllm serve start → first token (s)", f"{vllm:.1f}"),
            ("modelyard cold → first token, spare ready (s)", f"{cold:.1f}"),
            ("ratio (target <= 0.35)", f"{cold / vllm:.3f}"),
            (f"one client alone, {ALONE_SECONDS} s: requests/s", alone["requests_per_s"]),
            (f"two clients, two models, {WORKLOAD_SECONDS} s: requests/s",
             two["requests_per_s"]),
            ("  ratio to one alone (target >= 0.8)", two["ratio_vs_alone"]),
            ("  loads after the first two (target 0)", loads_after),
            ("  longest wait (s, target <= 5)", two["longest_wait_s"]),
            ("single requests, one model: median s", result["singles_one_model_median_s"]),
            ("single requests alternating: median s (target <= one model + 0.1)",
             result["singles_alternating_median_s"]),
            (f"wake of a parked model, {len(w)} wakes: p50 / p99 s (target p99 <= 0.1)",
             f"{result['wake_p50_s']} / {result['wake_p99_s']}"),
            ("  its requests' whole wait (room included): p50 / p99 s",
             f"{result['wake_wait_p50_s']} / {result['wake_wait_p99_s']}"),
            ("three models, a ceiling for two: states after the third",
             str(memory["states_after_third"])),
            ("  start right after a load / with a ready spare (target <= 1.5)",
             memory["ratio_right_after_vs_ready_spare"])]
    report("swap", result, rows)


if __name__ == "__main__":
    main()
