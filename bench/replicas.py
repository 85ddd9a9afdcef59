"""Replicas of one model, side by side in one run (issue 35): what two replicas routed by
prefix give a conversational load against round robin and against one worker alone, what
two one-core replicas give at 16 streams against one two-core worker, and what the
router spends per routing decision.

1. The routing decision's cost first, while no server runs: ``bench.route_cost.run`` over
   2 replicas with 10 000 conversations indexed (µs per decision, wall and CPU).
2. Three routers, one at a time (never two sets of engines at once), on the embedded model
   and cores ``CORES``: (a) ``one_worker``: ``replicas: 1`` on both cores; (b) ``prefix``:
   ``replicas: 2`` (one core each), ``routing: {strategy: prefix}``; (c) ``round_robin``:
   the same two replicas routed in turn. Each is started afresh for each of ``REPS``
   repetitions, in an order that rotates (a b c, b c a, c a b), so no configuration always
   runs first or last and no cache outlives its repetition; each waits until
   ``/v1/models`` lists its replicas ready, then one short request per replica warms them.
3. The workload, on each router in each repetition: ``SESSIONS`` chat sessions at once,
   each ``TURNS`` turns in sequence, streamed, ``temperature: 0``, ``ANSWER_TOKENS``
   tokens a turn (``ignore_eos``: every configuration decodes the same amount). A
   repetition's sessions share one system prompt of about ``SYSTEM_CHARS`` characters
   (several of the router's 256-byte blocks); each turn adds a user message of
   ``USER_CHARS`` characters of the session's own and, after it, the answer: the history
   grows. A repetition's text is the same for (a), (b) and (c), and another repetition's
   is other text. With ``BENCH_REPLICAS_SESSION_HEADER`` on (the default) each request
   names its session in ``x-session-id``, as a chat client would. Per request: time to
   first token and the usage's ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``;
   per repetition: the share of prompt tokens served from the cache (Σcached / Σprompt),
   TTFT p50 and p90; and which replicas were busy (``/v1/models`` sampled every
   ``SAMPLE_EVERY`` s: each replica's most requests in flight and its share of them).
   Targets, as ratios within a repetition (median and spread over the repetitions):
   (b)'s cache share >= 0.9x (a)'s, (b)'s TTFT p50 <= 0.7x (c)'s.
4. Throughput, on routers (a) and (b) after their workload, once per repetition:
   ``STREAMS`` streamed completions at once, each its own prompt (so the prefix routing of
   (b) spreads them by load), ``STREAM_TOKENS`` tokens each (``ignore_eos``): tokens/s and
   inter-token p99 of one replica on two cores against two replicas on one core each (on
   a 2-core host that is all two cores allow: each replica has one).

``make bench BENCH=replicas`` takes about 12 minutes on a 2-core host with the defaults
(nine router starts of 20-40 s each, nine workloads of about 30 s, six throughput rounds
of about 10 s). ``BENCH_REPLICAS_REPS``, ``BENCH_REPLICAS_SESSIONS`` and
``BENCH_REPLICAS_TURNS`` make a smaller run (a try, not the figure); ``BENCH_REPLICAS_MODEL``,
``BENCH_REPLICAS_ENGINE`` and ``BENCH_REPLICAS_ENGINE_ARGS`` try this file's code on the
synthetic engine (which reports no cached tokens).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import statistics
import time
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from bench import route_cost
from bench.common import PROMPT, Server, StreamStats, modelyard, one_stream, pct, report
from router.cli import GC_THRESHOLD
from shared.config import ModelSpec
from worker.engine_args import auto_dtype, cpu_flags

SESSIONS = int(os.environ.get("BENCH_REPLICAS_SESSIONS", "8"))
TURNS = int(os.environ.get("BENCH_REPLICAS_TURNS", "6"))
REPS = int(os.environ.get("BENCH_REPLICAS_REPS", "3"))
SESSION_HEADER = os.environ.get("BENCH_REPLICAS_SESSION_HEADER", "1") != "0"
SYSTEM_CHARS = 1_500
USER_CHARS = (200, 400)
ANSWER_TOKENS = tuple(int(n) for n in
                      os.environ.get("BENCH_REPLICAS_ANSWERS", "16-48").split("-"))
"""Tokens of each answer: one number, or ``LOW-HIGH`` (each turn's drawn from the
repetition's seed, the same for every configuration)."""
STREAMS = 16
STREAM_TOKENS = 128
CORES = "0-1"
MODEL_ID = "smollm2"
MODEL = os.environ.get("BENCH_REPLICAS_MODEL", "builtin:smollm2")
ENGINE = os.environ.get("BENCH_REPLICAS_ENGINE", "vllm")
ENGINE_ARGS = os.environ.get("BENCH_REPLICAS_ENGINE_ARGS", "{}")
SAMPLE_EVERY = 0.25
READY_TIMEOUT = 600.0
SETTLE = 2.0
"""Seconds after a router stopped before the next starts: an EngineCore spins for about a
second after its last step (``bench/overhead.py``)."""
CACHE_TARGET = 0.9
TTFT_TARGET = 0.7
T = TypeVar("T")


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    replicas: int
    strategy: str
    throughput: bool
    """Whether the 16-stream throughput is measured on this router too."""


CONFIGS = (
    Config("one_worker", "(a) one worker on two cores", 1, "prefix", True),
    Config("prefix", "(b) two replicas, one core each, prefix routing", 2, "prefix", True),
    Config("round_robin", "(c) two replicas, one core each, round robin", 2, "round_robin",
           False),
)
THROUGHPUT = {"one_worker": "one_replica_two_cores", "prefix": "two_replicas_one_core_each"}
"""The throughput figures' names, by the router they are measured on."""


def preset(config: Config) -> str:
    """The router's preset for ``config`` (``{port}`` is filled by ``bench.common``)."""
    return f"""server:
  host: 127.0.0.1
  port: {{port}}
  spare_workers: 0
models:
  {MODEL_ID}:
    model: "{MODEL}"
    engine: {ENGINE}
    engine_args: {ENGINE_ARGS}
    cpu_cores: "{CORES}"
    max_model_len: 2048
    kv_cache_gib: 1
    load_on_startup: true
    replicas: {config.replicas}
    routing:
      strategy: {config.strategy}
"""


def order(rep: int) -> list[Config]:
    """The configurations in repetition ``rep``'s order: a b c, b c a, c a b, ..."""
    k = rep % len(CONFIGS)
    return [*CONFIGS[k:], *CONFIGS[:k]]


def conversations(rep: int) -> tuple[str, list[list[str]]]:
    """Repetition ``rep``'s system prompt and each session's user turns. The repetition's
    number opens the system prompt, so its first block differs from any other's."""
    rng = random.Random(f"replicas-{rep}")
    system = (f"Repetition {rep}. You are a patient assistant who answers in one short "
              f"sentence. Notes: " + route_cost.text(rng, SYSTEM_CHARS))
    users = [[f"Session {s}, turn {t}: " + route_cost.text(rng, rng.randint(*USER_CHARS))
              for t in range(TURNS)] for s in range(SESSIONS)]
    return system, users


@dataclass
class Turn:
    """One request's outcome, read from its stream (``read``)."""

    started: float
    ttft: float | None = None
    text: list[str] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    def read(self, data: dict[str, Any], now: float) -> None:
        """One ``data:`` event of a chat completion stream (with ``include_usage``)."""
        if "error" in data:
            self.error = str(data["error"])
            return
        for choice in data.get("choices") or ():
            if self.ttft is None:
                self.ttft = now - self.started
            self.text.append(choice.get("delta", {}).get("content") or "")
        usage = data.get("usage")
        if usage:
            self.prompt_tokens = int(usage["prompt_tokens"])
            details = usage.get("prompt_tokens_details") or {}
            self.cached_tokens = int(details.get("cached_tokens") or 0)

    def finish(self) -> None:
        """Fail closed: a stream without a first token or its usage is an error."""
        if self.error is None and (self.ttft is None or self.prompt_tokens is None):
            self.error = "no first token" if self.ttft is None else "no usage"

    @property
    def ok(self) -> bool:
        return self.error is None


def answer_tokens(rep: int) -> list[list[int]]:
    """Each session's answer lengths in repetition ``rep``, turn by turn."""
    rng = random.Random(f"answers-{rep}")
    low, high = ANSWER_TOKENS[0], ANSWER_TOKENS[-1]
    return [[rng.randint(low, high) for _ in range(TURNS)] for _ in range(SESSIONS)]


def chat_body(messages: list[dict[str, str]], tokens: int) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": messages, "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def ask(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]],
              session: str | None, tokens: int) -> Turn:
    headers = {"x-session-id": session} if session and SESSION_HEADER else {}
    turn = Turn(started=time.perf_counter())
    try:
        async with client.stream("POST", url + "/v1/chat/completions",
                                 json=chat_body(messages, tokens),
                                 headers=headers) as r:
            if r.status_code != 200:
                turn.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return turn
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    turn.read(json.loads(line.removeprefix("data: ")), time.perf_counter())
    except httpx.HTTPError as err:
        turn.error = f"{type(err).__name__}: {err}"
        return turn
    turn.finish()
    return turn


async def session(client: httpx.AsyncClient, url: str, system: str, users: list[str],
                  name: str, answers: list[int]) -> list[Turn]:
    """One session's turns in sequence, each answer added to the history; a failed turn
    ends the session (its history would not be the one asked about)."""
    messages = [{"role": "system", "content": system}]
    turns: list[Turn] = []
    for user, tokens in zip(users, answers, strict=True):
        messages.append({"role": "user", "content": user})
        turn = await ask(client, url, messages, name, tokens)
        turns.append(turn)
        if not turn.ok:
            break
        messages.append({"role": "assistant", "content": "".join(turn.text)})
    return turns


async def workload(url: str, rep: int) -> list[Turn]:
    system, users = conversations(rep)
    answers = answer_tokens(rep)
    limits = httpx.Limits(max_connections=SESSIONS + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        done = await asyncio.gather(*(session(client, url, system, own, f"rep{rep}-s{s}",
                                              answers[s])
                                      for s, own in enumerate(users)))
    return [t for turns in done for t in turns]


def replicas_of(models: dict[str, Any], model: str = MODEL_ID) -> list[dict[str, Any]]:
    """``model``'s replicas as ``GET /v1/models`` lists them (an admin's view): its
    ``replicas`` objects, or, where it lists none, the model itself as replica 0."""
    for m in models.get("data", ()):
        if m.get("id") == model:
            listed = m.get("replicas")
            if listed is not None:
                return list(listed)
            return [{"number": 0, "pid": m.get("pid"), "state": m.get("state"),
                     "in_flight": m.get("in_flight", 0)}]
    return []


class Sampler:
    """Each replica's requests in flight, read from ``/v1/models`` while a load runs."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.most: dict[int, int] = {}
        self.total: dict[int, int] = {}

    def add(self, replicas: Iterable[dict[str, Any]]) -> None:
        for r in replicas:
            n, now = int(r["number"]), int(r.get("in_flight") or 0)
            self.most[n] = max(self.most.get(n, 0), now)
            self.total[n] = self.total.get(n, 0) + now

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                try:
                    self.add(replicas_of((await client.get(self.url + "/v1/models")).json()))
                except (httpx.HTTPError, ValueError):
                    pass  # one missed sample; the next one counts
                await asyncio.sleep(SAMPLE_EVERY)

    def figures(self) -> dict[str, list[Any]]:
        numbers = sorted(self.most)
        whole = sum(self.total.values())
        return {"in_flight_max": [self.most[n] for n in numbers],
                "in_flight_share": [round(self.total[n] / whole, 2) if whole else 0.0
                                    for n in numbers]}


async def sampled(url: str, load: Awaitable[T]) -> tuple[T, dict[str, list[Any]]]:
    """``await load`` with a ``Sampler`` beside it."""
    sampler = Sampler(url)
    task = asyncio.create_task(sampler.run())
    try:
        out: T = await load
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return out, sampler.figures()


def workload_figures(turns: Sequence[Turn]) -> dict[str, Any]:
    """One repetition's figures on one router."""
    ok = [t for t in turns if t.ok]
    prompt = sum(t.prompt_tokens or 0 for t in ok)
    cached = sum(t.cached_tokens or 0 for t in ok)
    ttft = [t.ttft for t in ok if t.ttft is not None]
    return {
        "requests": len(turns), "errors": len(turns) - len(ok), "prompt_tokens": prompt,
        "cached_tokens": cached, "cache_share": round(cached / prompt, 3) if prompt else 0.0,
        "ttft_p50_ms": round(pct(ttft, 50) * 1000, 1),
        "ttft_p90_ms": round(pct(ttft, 90) * 1000, 1)}


def spread(values: Sequence[float], digits: int = 3) -> dict[str, float]:
    return {"median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "max": round(max(values), digits)}


def ratio(mine: Sequence[float], theirs: Sequence[float]) -> dict[str, Any]:
    """Ratios ``mine / theirs`` measured side by side (same repetition), and their spread."""
    per = [round(a / b, 3) if b else float("nan") for a, b in zip(mine, theirs, strict=True)]
    return {**spread(per), "per_rep": per}


async def throughput_round(url: str, rnd: int) -> tuple[StreamStats, float]:
    """``STREAMS`` streamed completions at once, each its own prompt."""
    stats = StreamStats()
    limits = httpx.Limits(max_connections=STREAMS + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(one_stream(client, url + "/v1/completions", {
            "model": MODEL_ID, "prompt": f"Stream {i} of round {rnd}. {PROMPT}",
            "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True}, stats)
            for i in range(STREAMS)))
        return stats, time.perf_counter() - started


def throughput_figures(stats: StreamStats, seconds: float) -> dict[str, Any]:
    return {"tokens_per_s": round(STREAM_TOKENS * STREAMS / seconds, 1),
            "ttft_p50_ms": round(pct(stats.ttft, 50) * 1000, 1),
            "itl_p50_ms": round(pct(stats.itl, 50) * 1000, 1),
            "itl_p99_ms": round(pct(stats.itl, 99) * 1000, 1),
            "errors": stats.errors}


def wait_replicas(yard: Server, count: int) -> list[dict[str, Any]]:
    """``/v1/models`` until ``count`` replicas are ready; fail closed on fewer (a preset
    the router does not run as asked would measure something else)."""
    deadline = time.monotonic() + READY_TIMEOUT
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        if yard.proc.poll() is not None:
            raise RuntimeError(f"the router exited; see {yard.log.name}")
        try:
            seen = replicas_of(httpx.get(yard.url + "/v1/models", timeout=5).json())
        except (httpx.HTTPError, ValueError):
            seen = []  # not up yet
        if len(seen) == count and all(r.get("state") == "ready" for r in seen):
            return seen
        time.sleep(0.5)
    raise TimeoutError(f"{count} ready replicas not listed by /v1/models (last seen: {seen}); "
                       f"see {yard.log.name}")


def warm(url: str, count: int) -> None:
    """One short request per replica at once (distinct prompts: no prefix to follow, so
    every strategy spreads them), taking first-request costs out of the measure."""
    async def go() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            answers = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json={
                "model": MODEL_ID, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": f"Warm-up {i}: say hello."}]})
                for i in range(count)))
        for answer in answers:
            answer.raise_for_status()
    asyncio.run(go())


def one_router(config: Config, rep: int, position: int) -> tuple[dict[str, Any],
                                                                  dict[str, Any] | None]:
    """Repetition ``rep`` on a fresh router of ``config``: its workload's figures and, for
    the throughput configurations, its throughput round's."""
    with modelyard(preset(config), name=f"replicas-{config.key}") as yard:
        listed = wait_replicas(yard, config.replicas)
        start_s = round(time.monotonic() - yard.started, 1)
        warm(yard.url, config.replicas)
        turns, busy = asyncio.run(sampled(yard.url, workload(yard.url, rep)))
        for turn in turns:  # the results file counts them; the reasons are said here
            if turn.error is not None:
                print(f"repetition {rep + 1}, {config.key}: a request failed: {turn.error}",
                      flush=True)
        figures = {"order": position, "start_s": start_s, "replicas_ready": len(listed),
                   "distinct_pids": len({r.get("pid") for r in listed}),
                   **workload_figures(turns), **busy}
        streamed = None
        if config.throughput:
            (stats, seconds), busy = asyncio.run(sampled(yard.url,
                                                         throughput_round(yard.url, rep)))
            streamed = {**throughput_figures(stats, seconds), **busy}
    time.sleep(SETTLE)
    return figures, streamed


def route_decision() -> dict[str, Any]:
    """``bench/route_cost.py``'s measure over 2 replicas, under the router's GC settings."""
    rng = random.Random(35)
    systems = [route_cost.text(rng, 1_500) for _ in range(route_cost.SYSTEMS)]
    before = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD, 20, 20)
    load = round(os.getloadavg()[0], 2)
    try:
        r = route_cost.run(2, rng, systems)
    finally:
        gc.set_threshold(*before)
    return {"replicas": 2, "prompts_indexed": route_cost.PROMPTS,
            "decisions": route_cost.DECISIONS, "load_average_1m": load,
            **{k: r[k] for k in ("decision_us_p50", "decision_us_p99", "decision_cpu_us_p50",
                                 "decision_cpu_us_p99", "hash_us_p50", "indexed_blocks")}}


def host() -> dict[str, Any]:
    flags = cpu_flags()
    return {"avx512": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "dtype": auto_dtype(ModelSpec(id=MODEL_ID, model=MODEL), flags)}


def assemble(runs: dict[str, list[dict[str, Any]]],
             streamed: dict[str, list[dict[str, Any]]],
             decision: dict[str, Any]) -> dict[str, Any]:
    """The results file's figures from each configuration's repetitions (``runs``, in
    repetition order), the throughput rounds (``streamed``) and the routing decision."""
    configs: dict[str, Any] = {}
    for c in CONFIGS:
        reps = runs[c.key]
        ttft = {k: [r[k] for r in reps] for k in ("ttft_p50_ms", "ttft_p90_ms")}
        configs[c.key] = {
            "label": c.label, "replicas": c.replicas, "routing": c.strategy, "reps": reps,
            "cache_share": spread([r["cache_share"] for r in reps]),
            "ttft_p50_ms": spread(ttft["ttft_p50_ms"], 1),
            "ttft_p90_ms": spread(ttft["ttft_p90_ms"], 1),
            "errors": sum(r["errors"] for r in reps)}
    share = {k: [r["cache_share"] for r in runs[k]] for k in ("prefix", "one_worker")}
    p50 = {k: [r["ttft_p50_ms"] for r in runs[k]] for k in ("prefix", "round_robin")}
    cache = ratio(share["prefix"], share["one_worker"])
    ttft_p50 = ratio(p50["prefix"], p50["round_robin"])
    ratios = {  # a target is met when the median of the repetitions' ratios meets it
        "cache_share_prefix_vs_one_worker": {
            **cache, "target": f">= {CACHE_TARGET}", "met": cache["median"] >= CACHE_TARGET},
        "ttft_p50_prefix_vs_round_robin": {
            **ttft_p50, "target": f"<= {TTFT_TARGET}", "met": ttft_p50["median"] <= TTFT_TARGET}}
    throughput: dict[str, Any] = {"streams": STREAMS, "tokens": STREAM_TOKENS}
    for key, name in THROUGHPUT.items():
        rounds = streamed[key]
        throughput[name] = {
            "rounds": rounds, "tokens_per_s": spread([r["tokens_per_s"] for r in rounds], 1),
            "itl_p99_ms": spread([r["itl_p99_ms"] for r in rounds], 1)}
    one, two = (streamed[k] for k in THROUGHPUT)
    # no target: what two replicas of one core make of the same two cores
    throughput["ratio_tokens_per_s"] = ratio([r["tokens_per_s"] for r in two],
                                             [r["tokens_per_s"] for r in one])
    throughput["ratio_itl_p99"] = ratio([r["itl_p99_ms"] for r in two],
                                        [r["itl_p99_ms"] for r in one])
    return {"sessions": SESSIONS, "turns": TURNS, "answer_tokens": list(ANSWER_TOKENS),
            "system_chars": SYSTEM_CHARS, "user_chars": f"{USER_CHARS[0]}-{USER_CHARS[1]}",
            "repetitions": len(runs["one_worker"]), "cores": CORES,
            "session_header": SESSION_HEADER, "model": MODEL, "engine": ENGINE,
            "host": host(), "configs": configs, "ratios": ratios, "throughput": throughput,
            "route_decision": decision}


def rows(result: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The table printed at the end of a run."""
    def said(s: dict[str, Any]) -> str:
        return f"{s['median']} ({s['min']}-{s['max']})"

    out: list[tuple[Any, ...]] = [("what", f"median (min-max) of {result['repetitions']}")]
    for c in result["configs"].values():
        out += [(f"{c['label']}: cache share", said(c["cache_share"])),
                (f"{c['label']}: TTFT p50 / p90 ms",
                 f"{said(c['ttft_p50_ms'])} / {said(c['ttft_p90_ms'])}, errors {c['errors']}")]
    for name, r in result["ratios"].items():
        out.append((f"{name} (target {r['target']})", f"{said(r)}, met: {r['met']}"))
    t = result["throughput"]
    for name in THROUGHPUT.values():
        out.append((f"{STREAMS} streams, {name}: tokens/s, ITL p99 ms",
                    f"{said(t[name]['tokens_per_s'])}, {said(t[name]['itl_p99_ms'])}"))
    d = result["route_decision"]
    out += [("two replicas / one worker: tokens/s", said(t["ratio_tokens_per_s"])),
            ("two replicas / one worker: ITL p99", said(t["ratio_itl_p99"])),
            ("routing decision p50 / CPU p99 µs",
             f"{d['decision_us_p50']} / {d['decision_cpu_us_p99']}")]
    return out


def main() -> None:
    decision = route_decision()  # first: no server is running yet
    runs: dict[str, list[dict[str, Any]]] = {c.key: [] for c in CONFIGS}
    streamed: dict[str, list[dict[str, Any]]] = {k: [] for k in THROUGHPUT}
    for rep in range(REPS):
        for position, config in enumerate(order(rep), 1):
            began = time.monotonic()
            figures, rnd = one_router(config, rep, position)
            runs[config.key].append(figures)
            if rnd is not None:
                streamed[config.key].append(rnd)
            print(f"repetition {rep + 1}, {config.key}: {figures}, throughput {rnd} "
                  f"({time.monotonic() - began:.0f} s)", flush=True)
    result = assemble(runs, streamed, decision)
    report("replicas", result, rows(result))


if __name__ == "__main__":
    main()
