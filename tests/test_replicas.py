"""Replicas of one model (issue 35), on synthetic workers driven in-process: each replica
on its own core, requests routed among the ready ones (a conversation stays where its
prefix went, a session where it went), a replica's crash ends only its own streams and it
comes back, the scaler adds one under a queue and drains one at idle, a stop stops all.
The same with real vLLM over HTTP: ``tests/test_replicas_vllm.py``."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from router.errors import WorkerLost
from router.lifecycle.supervisor import Supervisor
from router.observe.metrics import Metrics
from router.registry import ModelEntry, ModelRegistry
from router.workers.placement import Placer
from shared.preset_loader import build_preset
from shared.protocol import ChatMessage, Generate, SamplingSpec
from tests.conftest import running_router
from tests.test_adapter_registration import make_adapter
from tests.test_parking import until


def supervisor(tmp_path: Path, server: dict[str, Any] | None = None,
               **models: dict[str, Any]) -> Supervisor:
    preset = build_preset({"server": {"spare_workers": 0, **(server or {})},
                           "models": {name: spec if "base" in spec else {
                               "model": "/synthetic", "engine": "synthetic",
                               "cpu_cores": "0-1", **spec}
                                      for name, spec in models.items()}})
    return Supervisor(ModelRegistry(preset), preset.server, tmp_path,
                      Placer(cores={0, 1}, gpus={}))


def run(sup: Supervisor, scenario: Any, timeout: float = 90) -> None:
    async def main() -> None:
        sup.start()
        try:
            await asyncio.wait_for(scenario(), timeout)
        finally:
            await sup.stop_all()

    asyncio.run(main())


async def use(sup: Supervisor, name: str, tokens: int = 2, prompt: str = "hi",
              messages: list[ChatMessage] | None = None, session: bytes | None = None
              ) -> int:
    """One whole generation on ``name``, routed as the relay routes one: the number of
    the replica that served it."""
    lease, link = await sup.acquire(name)
    try:
        gen = Generate(id=f"g-{time.monotonic_ns()}", sampling=SamplingSpec(max_tokens=tokens),
                       **({"messages": messages} if messages else {"prompt": prompt}))
        link = sup.route(lease.entry, link, [gen], session)
        number = next(r.number for r in sup.replicas_of(lease.entry) if r.link is link)
        async for _ in link.submit([gen]):
            pass
        return number
    finally:
        lease.release()


def ready_replicas(sup: Supervisor, entry: ModelEntry) -> list[int]:
    return [r.number for r in sup.replicas_of(entry) if r.state == "ready"]


def test_two_replicas_run_on_their_own_cores_and_both_serve(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, m={"replicas": 2, "engine_args": {"tokens_per_second": 50}})

    async def scenario() -> None:
        entry = sup.registry.entries["m"]
        await use(sup, "m")  # the load starts replica 0, then replica 1 at once
        await until(lambda: ready_replicas(sup, entry) == [0, 1], 30, "both replicas ready")
        replicas = list(sup.replicas_of(entry))
        assert len({r.handle.pid for r in replicas}) == 2
        assert [r.placement["VLLM_CPU_OMP_THREADS_BIND"] for r in replicas] == ["0", "1"]
        assert replicas[1].log_path.name == "m.1.log" and replicas[0].log_path.name == "m.log"
        served = await asyncio.gather(*(use(sup, "m", tokens=20, prompt=f"p{i} " * 50)
                                        for i in range(4)))
        assert set(served) == {0, 1}, served  # least loaded spreads distinct prompts
        assert entry.slots is not None and entry.slots.size == 2 * entry.spec.max_concurrent
        metrics = Metrics(sup.registry)
        metrics.watch_replicas(sup.replicas_of)
        text = generate_latest(metrics.registry).decode()
        assert 'modelyard_model_replicas{model="m",state="ready"} 2.0' in text
        for n in (0, 1):
            assert f'modelyard_replica_in_flight{{model="m",replica="{n}"}} 0.0' in text
            assert f'modelyard_replica_prompt_tokens_total{{model="m",replica="{n}"}}' in text

    run(sup, scenario)


def test_a_conversation_stays_on_its_replica_while_another_lands_on_the_other(
        tmp_path: Path) -> None:
    sup = supervisor(tmp_path, m={"replicas": 2})

    async def turns(name: str) -> list[int]:
        history: list[ChatMessage] = [ChatMessage(role="system",
                                                  content=f"You are {name}. " * 40)]
        went = []
        for turn in range(4):
            history.append(ChatMessage(role="user", content=f"{name} turn {turn} " * 20))
            went.append(await use(sup, "m", messages=history))
            history.append(ChatMessage(role="assistant", content="tok tok"))
        return went

    async def scenario() -> None:
        entry = sup.registry.entries["m"]
        await use(sup, "m")
        await until(lambda: ready_replicas(sup, entry) == [0, 1], 30, "both replicas ready")
        first = await turns("alice")
        second = await turns("bob")
        assert len(set(first)) == 1 and len(set(second)) == 1, (first, second)
        assert first[0] != second[0]  # bob's first turn matched nothing: the other one
        # A session goes where it went, whatever its prompt.
        sticky = [await use(sup, "m", prompt=f"unrelated {i} " * 30, session=b"s1")
                  for i in range(4)]
        assert len(set(sticky)) == 1, sticky

    run(sup, scenario)


def test_a_model_of_one_replica_routes_without_an_index(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, m={})

    async def scenario() -> None:
        for _ in range(3):
            assert await use(sup, "m", messages=[ChatMessage(role="user", content="x" * 600)],
                             session=b"s") == 0
        assert sup.routes.indexes == {}  # nothing hashed, nothing recorded

    run(sup, scenario)


def test_a_replica_killed_mid_stream_ends_only_its_streams_and_comes_back(
        tmp_path: Path) -> None:
    sup = supervisor(tmp_path, m={"replicas": {"min": 2, "max": 2, "cooldown": 0.2},
                                  "engine_args": {"tokens_per_second": 20}})

    async def scenario() -> None:
        entry = sup.registry.entries["m"]
        await use(sup, "m")
        await until(lambda: ready_replicas(sup, entry) == [0, 1], 30, "both replicas ready")
        streams = [asyncio.create_task(use(sup, "m", tokens=60, prompt=f"long {i} " * 40))
                   for i in range(2)]
        await until(lambda: all(r.link.in_flight == 1 for r in sup.replicas_of(entry)), 10,
                    "a stream on each replica")
        victim = sup.replicas_of(entry).numbered(1)
        assert victim is not None
        old_pid = victim.handle.pid
        killed = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        done, _ = await asyncio.wait(streams, return_when=asyncio.FIRST_COMPLETED)
        assert time.monotonic() - killed < 2.0
        (lost,) = done
        with pytest.raises(WorkerLost):
            lost.result()
        assert entry.state == "ready"  # the model never stopped serving
        assert [await use(sup, "m") for _ in range(4)] == [0, 0, 0, 0]
        survivor = next(s for s in streams if s is not lost)
        assert await survivor == 0  # the other replica's stream ends whole
        await until(lambda: ready_replicas(sup, entry) == [0, 1], 30, "replica 1 restarted")
        again = sup.replicas_of(entry).numbered(1)
        assert again is not None and again.handle.pid != old_pid
        assert entry.replica_failures == 1 and entry.failures == 0

    run(sup, scenario)


def test_a_queue_adds_a_replica_and_idling_drains_it(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, m={
        "replicas": {"min": 1, "max": 2, "up_wait": 0.1, "up_after": 0.1, "cooldown": 0.2,
                     "idle": 0.5},
        "max_concurrent": 1, "engine_args": {"tokens_per_second": 20}})

    async def scenario() -> None:
        entry = sup.registry.entries["m"]
        await use(sup, "m")
        assert ready_replicas(sup, entry) == [0]
        await asyncio.sleep(0.6)  # no queue: nothing added
        assert ready_replicas(sup, entry) == [0]
        served = await asyncio.gather(*(use(sup, "m", tokens=20, prompt=f"q{i}")
                                        for i in range(6)))  # 1 s each, one at a time
        assert 1 in served, served  # the queue brought replica 1, which served some
        # The one idle longest goes (either); the other serves on, as the model's worker.
        await until(lambda: len(sup.replicas_of(entry)) == 1, 10, "an idle replica drained")
        (left,) = sup.replicas_of(entry)
        assert entry.state == "ready" and entry.replica is left and entry.pid == left.handle.pid
        assert await use(sup, "m") == left.number

    run(sup, scenario)


def test_min_zero_lets_the_last_replica_go_and_the_next_request_loads_it_again(
        tmp_path: Path) -> None:
    sup = supervisor(tmp_path, m={"replicas": {"min": 0, "max": 2, "idle": 0.3,
                                               "cooldown": 0.1}},
                     kept={"replicas": {"min": 0, "max": 2, "idle": 0.3, "cooldown": 0.1},
                           "cpu_cores": "0-1"})

    async def scenario() -> None:
        m = sup.registry.entries["m"]
        await use(sup, "m")
        await until(lambda: m.state == "unloaded", 10, "the idle model stopped")
        assert not sup.replicas_of(m) and m.loads == 1
        assert await use(sup, "m") == 0 and m.loads == 2  # loaded again, as a cold model
        # An admin's keep_alive of -1 (forever) holds the last one (``hold_last``).
        kept = sup.registry.entries["kept"]
        await use(sup, "kept")
        kept.keep_alive = -1
        await asyncio.sleep(1.0)
        assert kept.state == "ready" and len(sup.replicas_of(kept)) == 1

    run(sup, scenario)


def test_every_replica_engine_gets_the_adapters_and_a_restart_restores_them(
        tmp_path: Path) -> None:
    folder = make_adapter(tmp_path / "ad")
    sup = supervisor(tmp_path, m={"replicas": {"min": 2, "max": 2, "cooldown": 0.2},
                                  "max_loras": 2},
                     a={"base": "m", "adapter": str(folder)})

    async def scenario() -> None:
        m, adapter = sup.registry.entries["m"], sup.registry.adapters["a"]
        assert adapter.lora is not None
        await use(sup, "m")
        await until(lambda: ready_replicas(sup, m) == [0, 1], 30, "both replicas ready")
        links = sup.links_of(m)
        assert len(links) == 2
        for link in links:  # as an admin's load of the adapter does
            await link.adapters([adapter.lora])
        for link in links:
            assert [a.number for a in await link.adapters()] == [adapter.lora.number]
        lease, _ = await sup.acquire("a")  # used: a restart restores it
        lease.release()
        victim = sup.replicas_of(m).numbered(1)
        assert victim is not None
        os.kill(victim.handle.pid, signal.SIGKILL)
        await until(lambda: (r := sup.replicas_of(m).numbered(1)) is not None
                    and r is not victim and r.state == "ready", 30, "replica 1 restarted")
        again = sup.replicas_of(m).numbered(1)
        assert again is not None
        assert [a.number for a in await again.link.adapters()] == [adapter.lora.number]

    run(sup, scenario)


def test_replicas_count_against_max_loaded_models(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, {"max_loaded_models": 2}, m={"replicas": 2}, n={})

    async def scenario() -> None:
        m = sup.registry.entries["m"]
        await use(sup, "n")
        await use(sup, "m")
        await asyncio.sleep(1.0)  # its second replica would be a third worker
        assert ready_replicas(sup, m) == [0] and sup.scaler.starting(m) == 0

    run(sup, scenario)


def test_another_models_load_counts_each_replica_against_max_loaded_models(
        tmp_path: Path) -> None:
    """``m`` runs two replicas and ``max_loaded_models`` is 2: ``n`` needs the room of
    both (on the code before, ``m`` counted once and ``n`` loaded beside it: three
    workers where two may run)."""
    sup = supervisor(tmp_path, {"max_loaded_models": 2}, m={"replicas": 2}, n={})

    async def scenario() -> None:
        m = sup.registry.entries["m"]
        await use(sup, "m")
        await until(lambda: ready_replicas(sup, m) == [0, 1], 30, "both replicas ready")
        await use(sup, "n")
        assert m.state == "unloaded" and not sup.replicas_of(m)

    run(sup, scenario)


def test_a_stop_stops_every_replica(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, m={"replicas": 2})

    async def scenario() -> None:
        entry = sup.registry.entries["m"]
        await use(sup, "m")
        await until(lambda: ready_replicas(sup, entry) == [0, 1], 30, "both replicas ready")
        pids = [r.handle.pid for r in sup.replicas_of(entry)]
        await sup.stop(entry)
        assert entry.state == "unloaded" and not sup.replicas_of(entry)
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)

    run(sup, scenario)


SESSIONS = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
models:
  m:
    model: /synthetic
    engine: synthetic
    cpu_cores: "0-1"
    replicas: 2
    load_on_startup: true
"""


def test_a_session_header_user_or_anthropic_user_id_keeps_requests_on_one_replica(
        tmp_path: Path) -> None:
    """Over HTTP: unrelated prompts of one session (``x-session-id``, OpenAI's ``user``,
    Anthropic's ``metadata.user_id``) all go to the replica the first went to."""
    with running_router(SESSIONS, tmp_path, "sessions") as r:
        deadline = time.monotonic() + 60
        while len([x for x in r.client.get(f"{r.url}/v1/models/m").json().get(
                "replicas", []) if x["state"] == "ready"]) < 2:
            assert time.monotonic() < deadline, r.tail()
            time.sleep(0.2)

        def served(ask: Any, i: int) -> int:
            before = {x["number"]: x["completed"]
                      for x in r.client.get(f"{r.url}/v1/models/m").json()["replicas"]}
            reply = ask(i)
            assert reply.status_code == 200, reply.text
            after = {x["number"]: x["completed"]
                     for x in r.client.get(f"{r.url}/v1/models/m").json()["replicas"]}
            (number,) = [n for n in after if after[n] > before[n]]
            return number

        def chat(i: int, **extra: Any) -> Any:
            headers = extra.pop("headers", {})
            return r.client.post(f"{r.url}/v1/chat/completions", headers=headers, json={
                "model": "m", "max_tokens": 2, **extra,
                "messages": [{"role": "user", "content": f"unrelated {i} " * 40}]})

        def messages(i: int) -> Any:
            return r.client.post(f"{r.url}/v1/messages", json={
                "model": "m", "max_tokens": 2, "metadata": {"user_id": "u-7"},
                "messages": [{"role": "user", "content": f"other {i} " * 40}]})

        for ask in (lambda i: chat(i, headers={"x-session-id": "s-1"}),
                    lambda i: chat(i, user="alice"), messages):
            went = [served(ask, i) for i in range(5)]
            assert len(set(went)) == 1, went
        # Without a session, unrelated prompts spread (the least recently routed).
        assert len({served(chat, 100 + i) for i in range(4)}) == 2


def test_a_model_that_scales_to_zero_alone_has_its_scaler(tmp_path: Path) -> None:
    """``replicas: {min: 0}`` (one replica at most) stops its last after ``idle`` s: the
    scaler must run though no model may run several (it ran only if one could)."""
    sup = supervisor(tmp_path, m={"replicas": {"min": 0, "idle": 0.5}})

    async def main() -> None:
        sup.start()
        try:
            assert sup._scaling is not None
        finally:
            await sup.stop_all()

    asyncio.run(main())
