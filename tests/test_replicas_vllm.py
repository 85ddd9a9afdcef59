"""Replicas of the embedded model with real vLLM, over HTTP with the official SDK (issue 35's
"done when"): two replicas on a core each serve concurrent streams (their pids differ);
prefix routing keeps a conversation's turns on one replica, where its cached tokens grow,
while another conversation lands on the other; a replica killed mid-stream ends its
stream within 2 s with an error, every following request succeeds on the other, and it
restarts; a queue adds a replica and idling takes it away.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from tests.conftest import RouterProcess, running_router

pytestmark = pytest.mark.integration

TWO = """
server:
  host: 127.0.0.1
  port: {port}
  load_timeout: 600
models:
  smol:
    model: "builtin:smollm2"
    dtype: float32
    max_model_len: 2048
    kv_cache_gib: 1
    cpu_cores: "0-1"
    replicas: {min: 2, max: 2, cooldown: 1}
    load_on_startup: true
"""

SCALED = """
server:
  host: 127.0.0.1
  port: {port}
  load_timeout: 600
models:
  smol:
    model: "builtin:smollm2"
    dtype: float32
    max_model_len: 1024
    kv_cache_gib: 1
    cpu_cores: "0-1"
    max_concurrent: 1
    replicas: {min: 1, max: 2, up_wait: 0.5, up_after: 0.5, cooldown: 1, idle: 4}
    load_on_startup: true
"""


def replicas(r: RouterProcess) -> list[dict[str, Any]]:
    return list(r.client.get(f"{r.url}/v1/models/smol").json().get("replicas", []))


def wait_replicas(r: RouterProcess, count: int, timeout: float = 300) -> list[dict[str, Any]]:
    """Until exactly ``count`` replicas run, every one ready: them."""
    deadline = time.monotonic() + timeout
    while True:
        now = replicas(r)
        if len(now) == count and all(x["state"] == "ready" for x in now):
            return now
        assert time.monotonic() < deadline, (now, r.tail())
        time.sleep(0.5)


def completed(r: RouterProcess) -> dict[int, int]:
    return {x["number"]: x["completed"] for x in replicas(r)}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with running_router(TWO, tmp_path_factory.mktemp("replicas"), "replicas") as r:
        wait_replicas(r, 2)
        yield r


def client(r: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{r.url}/v1", api_key="x", max_retries=0, timeout=600)


def streams_reach_both(r: RouterProcess) -> None:
    """Four concurrent streams with their own prompts: both replicas serve some."""
    before = completed(r)
    c = client(r)

    def stream(i: int) -> int:
        tokens = 0
        for chunk in c.chat.completions.create(
                model="smol", max_tokens=24, stream=True, temperature=0,
                messages=[{"role": "user", "content": f"Count to ten, attempt {i}."}]):
            tokens += bool(chunk.choices and chunk.choices[0].delta.content)
        return tokens

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(n > 0 for n in pool.map(stream, range(4)))
    after = completed(r)
    assert all(after[n] > before[n] for n in (0, 1)), (before, after)  # both served


def kill_one_mid_stream(r: RouterProcess, victim: dict[str, Any]) -> None:
    """A stream on each replica; ``victim``'s worker killed: its stream ends within 2 s
    with the error, four requests that follow succeed, the other stream ends whole."""
    c = client(r)

    def stream(i: int) -> str:
        out = ""
        for chunk in c.chat.completions.create(
                model="smol", max_tokens=400, stream=True, temperature=0,
                extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": f"Tell me a long story, number {i}."}]):
            out += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        return out

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(stream, i) for i in range(2)]
        deadline = time.monotonic() + 120
        while not all(x["in_flight"] >= 1 for x in replicas(r)):
            assert time.monotonic() < deadline, replicas(r)
            time.sleep(0.05)
        killed = time.monotonic()
        psutil.Process(victim["pid"]).kill()
        done, _ = concurrent.futures.wait(streams, return_when="FIRST_COMPLETED")
        assert time.monotonic() - killed < 2.0
        (lost,) = done
        with pytest.raises(openai.APIError, match="exited unexpectedly"):
            lost.result()
        for i in range(4):  # every following request succeeds, on the other replica
            reply = c.chat.completions.create(
                model="smol", max_tokens=4, messages=[{"role": "user", "content": f"Hi {i}"}])
            assert reply.choices[0].message.content is not None
        other = next(s for s in streams if s is not lost)
        assert other.result(timeout=600)  # the other replica's stream ended whole


def test_two_replicas_on_a_core_each_serve_concurrent_streams(two: RouterProcess) -> None:
    running = wait_replicas(two, 2)
    assert len({x["pid"] for x in running}) == 2
    assert sorted(x["placement"]["VLLM_CPU_OMP_THREADS_BIND"] for x in running) == ["0", "1"]
    streams_reach_both(two)


def test_a_conversation_stays_on_its_replica_and_its_cache_grows(two: RouterProcess) -> None:
    c = client(two)

    def conversation(name: str) -> tuple[list[int], list[int]]:
        history: list[dict[str, str]] = [
            {"role": "system", "content": f"You are {name}, a terse assistant. " * 12}]
        went, cached = [], []
        for turn in range(4):
            history.append({"role": "user", "content": f"{name}, question {turn}: "
                            + "what is the capital of France? " * 20})
            before = completed(two)
            reply = c.chat.completions.create(model="smol", messages=history,  # type: ignore[arg-type]
                                              max_tokens=8, temperature=0)
            after = completed(two)
            (number,) = [n for n in after if after[n] > before.get(n, 0)]
            went.append(number)
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            cached.append(reply.usage.prompt_tokens_details.cached_tokens or 0)
            history.append({"role": "assistant", "content": reply.choices[0].message.content
                            or ""})
        return went, cached

    first, first_cached = conversation("Ada")
    second, second_cached = conversation("Bob")
    assert len(set(first)) == 1 and len(set(second)) == 1, (first, second)
    assert first[0] != second[0], (first, second)  # Bob's first turn matched nothing
    for cached in (first_cached, second_cached):  # each turn finds the last one cached
        assert all(later >= earlier for earlier, later in itertools.pairwise(cached)), cached
        assert 0 < cached[1] < cached[-1], cached


def test_a_killed_replica_ends_its_stream_the_other_serves_and_it_restarts(
        two: RouterProcess) -> None:
    victim = next(x for x in wait_replicas(two, 2) if x["number"] == 1)
    kill_one_mid_stream(two, victim)
    again = wait_replicas(two, 2)
    assert next(x for x in again if x["number"] == 1)["pid"] != victim["pid"]


def test_a_queue_adds_a_replica_and_idling_removes_it(tmp_path: Path) -> None:
    with running_router(SCALED, tmp_path, "scaled") as r:
        wait_replicas(r, 1)
        c = client(r)

        def ask(i: int) -> None:
            c.chat.completions.create(model="smol", max_tokens=48, temperature=0,
                                      extra_body={"ignore_eos": True},
                                      messages=[{"role": "user", "content": f"Story {i}."}])

        deadline = time.monotonic() + 300
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            # One slot a replica: three requests wait, the queue adds replica 1.
            while len(replicas(r)) < 2 or not all(x["state"] == "ready"
                                                  for x in replicas(r)):
                assert time.monotonic() < deadline, (replicas(r), r.tail())
                list(pool.map(ask, range(4)))
            list(pool.map(ask, range(4)))
        assert all(x["completed"] > 0 for x in replicas(r)), replicas(r)
        wait_replicas(r, 1, timeout=60)  # idle 4 s: drained back to one
