"""What routing among a model's replicas costs the router per request (issue 35), in-process
and without a server: the prefix index (``router.lifecycle.prefix_index``) and the route
policy (``router.lifecycle.policy.route``) as the router would call them.

One decision: the request's canonical bytes and chained block hashes
(``prompt_bytes`` + ``prompt_blocks``), the index's match and session (``hint``),
``choose``, and recording where it went (``routed``). ``PROMPTS`` conversations of about
3 000 characters (one of ``SYSTEMS`` system prompts of about 1 500, then their own turns)
are routed first, so the index holds their prefixes; then ``DECISIONS`` requests of about
4 000 characters are timed one by one: half a conversation's next turn, half a new
conversation, half with a session (``user``), with random loads. Over 2 and 8 replicas.
Wall time and the thread's CPU time per decision: on a shared machine the wall p99 holds
the other processes' turns on the cores (``load_average_1m`` says how busy it was).
Also what ``forget`` (a replica's crash: its slot marked dead) and ``sweep`` (the pass that
clears dead slots' bits, once slots run out) cost at that size, and the index's memory
per block.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import time
import tracemalloc
from typing import Any

from bench.common import pct, report
from router.cli import GC_THRESHOLD
from router.lifecycle.policy.route import ReplicaLoad, choose
from router.lifecycle.prefix_index import (
    PrefixIndex,
    PromptBlocks,
    prompt_blocks,
    prompt_bytes,
    seed_of,
    session_key,
)
from shared.config import Routing
from shared.protocol import ChatMessage, Generate, SamplingSpec

PROMPTS = 10_000
DECISIONS = 2_000
SYSTEMS = 50
REPLICAS = (2, 8)
MAX_LOAD = 6
WORDS = ("the", "model", "router", "replica", "cache", "prefix", "token", "block", "engine",
         "request", "stream", "batch", "queue", "worker", "memory", "answer", "question",
         "system", "user", "assistant", "tool", "call")


def text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def conversation(rng: random.Random, systems: list[str], chars: int) -> list[ChatMessage]:
    messages = [ChatMessage(role="system", content=rng.choice(systems))]
    size, turn = len(messages[0].content or ""), 0
    while size < chars:
        content = text(rng, rng.randint(200, 600))
        messages.append(ChatMessage(role="assistant" if turn % 2 else "user", content=content))
        size += len(content)
        turn += 1
    return messages


def request(messages: list[ChatMessage]) -> Generate:
    return Generate(id="bench", sampling=SamplingSpec(), messages=messages)


def decide(index: PrefixIndex, routing: Routing, replicas: list[ReplicaLoad],
           g: Generate, session: bytes | None) -> tuple[int, PromptBlocks]:
    """One routing decision, as the router makes it for a model with > 1 replica."""
    blocks = prompt_blocks(prompt_bytes(g), seed_of(g.lora, g.tools, g.template_kwargs))
    choice = choose(replicas, routing, index.hint(blocks, session))
    assert choice is not None
    index.routed(choice.replica, blocks, session)
    return choice.replica, blocks


def run(count: int, rng: random.Random, systems: list[str]) -> dict[str, Any]:
    routing, index = Routing(), PrefixIndex()
    seq = dict.fromkeys(range(count), 0)
    history: list[list[ChatMessage]] = []
    kept: list[PromptBlocks] = []

    def loads() -> list[ReplicaLoad]:
        return [ReplicaLoad(n, in_flight=rng.randint(0, MAX_LOAD), routed_seq=s)
                for n, s in seq.items()]

    for i in range(PROMPTS):
        messages = conversation(rng, systems, 3_000)
        replica, blocks = decide(index, routing, loads(), request(messages), None)
        seq[replica] = i + 1
        history.append(messages)
        kept.append(blocks)

    gc.collect()
    gc.freeze()  # as the router does after start-up (router/cli.py)
    decision_us: list[float] = []
    cpu_us: list[float] = []
    hash_us: list[float] = []
    why: dict[str, int] = {}
    sizes: list[int] = []
    for i in range(DECISIONS):
        if i % 2:
            messages = history[rng.randrange(PROMPTS)] + [
                ChatMessage(role="user", content=text(rng, 1_000))]
        else:
            messages = conversation(rng, systems, 4_000)
        g = request(messages)
        session = session_key("bench", user=f"user-{rng.randrange(1000)}") if i % 4 < 2 else None
        replicas = loads()
        cpu = time.thread_time_ns()
        started = time.perf_counter_ns()
        blocks = prompt_blocks(prompt_bytes(g), seed_of(g.lora, g.tools, g.template_kwargs))
        hashed = time.perf_counter_ns()
        choice = choose(replicas, routing, index.hint(blocks, session))
        assert choice is not None
        index.routed(choice.replica, blocks, session)
        done = time.perf_counter_ns()
        cpu_us.append((time.thread_time_ns() - cpu) / 1000)
        seq[choice.replica] = PROMPTS + i + 1
        decision_us.append((done - started) / 1000)
        hash_us.append((hashed - started) / 1000)
        why[choice.why] = why.get(choice.why, 0) + 1
        sizes.append(blocks.size)
    gc.unfreeze()

    blocks_held = len(index)
    started = time.perf_counter_ns()
    index.forget(0)
    forget_us = (time.perf_counter_ns() - started) / 1e3
    started = time.perf_counter_ns()
    index.sweep()
    sweep_ms = (time.perf_counter_ns() - started) / 1e6
    return {
        "decision_us_p50": round(statistics.median(decision_us), 1),
        "decision_us_p99": round(pct(decision_us, 99), 1),
        "decision_cpu_us_p50": round(statistics.median(cpu_us), 1),
        "decision_cpu_us_p99": round(pct(cpu_us, 99), 1),
        "hash_us_p50": round(statistics.median(hash_us), 1),
        "match_choose_record_us_p50": round(
            statistics.median(d - h for d, h in zip(decision_us, hash_us, strict=True)), 1),
        "indexed_blocks": blocks_held,
        "forget_one_replica_us": round(forget_us, 1),
        "sweep_ms": round(sweep_ms, 1),
        "chosen_by": dict(sorted(why.items())),
        "prompt_bytes_p50": int(statistics.median(sizes)),
    }


def memory_per_block(rng: random.Random) -> float:
    """Bytes the index takes per block it holds (tracemalloc, random hashes)."""
    index = PrefixIndex(blocks=100_000)
    hashes = [rng.getrandbits(64) for _ in range(100_000)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for start in range(0, len(hashes), 16):
        index.insert(start % 8, PromptBlocks(tuple(hashes[start:start + 16]), 16 * 256))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return round(used / len(index), 1)


def main() -> None:
    gc.set_threshold(GC_THRESHOLD, 20, 20)  # the router's (router/cli.py)
    rng = random.Random(35)
    systems = [text(rng, 1_500) for _ in range(SYSTEMS)]
    result: dict[str, Any] = {"prompts_indexed": PROMPTS, "decisions": DECISIONS,
                              "systems": SYSTEMS,
                              "load_average_1m": round(os.getloadavg()[0], 2)}
    rows: list[tuple[Any, ...]] = [("replicas", "decision p50 µs", "p99 µs", "CPU p50 µs",
                                    "CPU p99 µs", "hashing p50 µs", "blocks", "sweep ms")]
    for count in REPLICAS:
        r = run(count, rng, systems)
        result[f"replicas_{count}"] = r
        rows.append((count, r["decision_us_p50"], r["decision_us_p99"],
                     r["decision_cpu_us_p50"], r["decision_cpu_us_p99"], r["hash_us_p50"],
                     r["indexed_blocks"], r["sweep_ms"]))
    result["index_bytes_per_block"] = memory_per_block(rng)
    report("route_cost", result, rows)


if __name__ == "__main__":
    main()
