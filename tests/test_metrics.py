"""Prometheus metrics: counting, labels, the per-model gauges, ``/metrics`` and ``/v1/metrics``.

Unit tests need no worker; the integration test counts what it sends to the shared router.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from router.api.metrics import endpoint_name
from router.lifecycle.supervisor import Supervisor
from router.observe.metrics import Metrics, quantile, snapshot
from router.registry import ModelRegistry
from router.workers.link import Usage
from router.workers.placement import Placer
from shared.preset_loader import build_preset

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """Every sample of an exposition, keyed by name and labels (parsed by prometheus_client)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def models(default: str | None = None) -> ModelRegistry:
    server = {"default_model": default} if default else {}
    return ModelRegistry(build_preset({"server": server, "models": {
        "chat-a": {"model": "/a", "aliases": ["alpha"]},
        "chat-b": {"model": "/b"},
        "embed": {"model": "/e", "task": "embed"},
    }}))


def usage(prompt: int, completion: int, cached: int = 0, choices: int = 1,
          ttft: float = 0.5, started: float = 100.0) -> Usage:
    u = Usage()
    u.started, u.first_at, u.completion = started, started + ttft, completion
    for i in range(choices):
        u.prompt[f"g{i}"] = prompt // choices
        u.cached[f"g{i}"] = cached // choices
        u.finish.append("stop")
    return u


def exposition(metrics: Metrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


# -- unit ------------------------------------------------------------------------------
def test_requests_tokens_and_latencies_are_counted_once_each() -> None:
    m = Metrics(models())
    m.request("chat", "chat-a", 200, usage(10, 11, cached=4, ttft=0.5), now=102.5)
    m.request("chat", "chat-a", 200, usage(6, 1, ttft=0.2), now=100.2)  # one token: no ITL
    m.request("completions", "chat-a", 499, usage(0, 3), now=101.0)
    m.request("chat", "chat-a", 400, Usage())
    found = samples(exposition(m))
    assert value(found, "modelyard_requests_total", model="chat-a", endpoint="chat",
                 status="200") == 2
    assert value(found, "modelyard_requests_total", model="chat-a", endpoint="chat",
                 status="400") == 1
    assert value(found, "modelyard_requests_total", model="chat-a", endpoint="completions",
                 status="499") == 1
    assert value(found, "modelyard_prompt_tokens_total", model="chat-a") == 16
    assert value(found, "modelyard_cached_tokens_total", model="chat-a") == 4
    assert value(found, "modelyard_completion_tokens_total", model="chat-a") == 15
    # TTFT for all three that produced output; end-to-end and ITL for the successes only
    assert value(found, "modelyard_time_to_first_token_seconds_count", model="chat-a") == 3
    assert value(found, "modelyard_request_seconds_count", model="chat-a",
                 endpoint="chat") == 2
    assert value(found, "modelyard_request_seconds_sum", model="chat-a",
                 endpoint="chat") == pytest.approx(2.7)
    # (102.5 - 100.5) s over the 10 tokens after the first
    assert value(found, "modelyard_inter_token_seconds_count", model="chat-a") == 1
    assert value(found, "modelyard_inter_token_seconds_sum", model="chat-a") == \
        pytest.approx(0.2)


def test_inter_token_latency_is_per_choice() -> None:
    m = Metrics(models())
    # two choices of 5 tokens each, decoded side by side in 2 s: 0.5 s per token
    m.request("chat", "chat-a", 200, usage(8, 10, choices=2, ttft=1.0), now=103.0)
    found = samples(exposition(m))
    assert value(found, "modelyard_inter_token_seconds_sum", model="chat-a") == \
        pytest.approx(0.5)


def test_labels_are_declared_model_ids_whatever_the_client_sent() -> None:
    m = Metrics(models())
    m.request("chat", "alpha", 429, Usage())        # an alias: the model it names
    m.request("chat", "no-such-model", 404, Usage())
    m.request("chat", "a-client-made-up-name", 404, Usage())
    m.request("chat", "chat", 404, Usage())         # ambiguous substring
    m.request("chat", "-", 400, Usage())            # no model named
    found = samples(exposition(m))
    assert value(found, "modelyard_requests_total", model="chat-a", endpoint="chat",
                 status="429") == 1
    assert value(found, "modelyard_requests_total", model="-", endpoint="chat",
                 status="404") == 3
    assert {dict(labels)["model"] for name, labels in found
            if name == "modelyard_requests_total"} == {"chat-a", "-"}


def test_model_gauges_are_read_from_the_registry_at_scrape_time() -> None:
    reg = models()
    m = Metrics(reg)
    a = reg.entries["chat-a"]
    a.state, a.leases, a.queued, a.load_seconds, a.restarts, a.evictions = \
        "ready", 3, 1, 12.5, 2, 4
    found = samples(exposition(m))
    assert value(found, "modelyard_model_state", model="chat-a", state="ready") == 1
    assert value(found, "modelyard_model_state", model="chat-a", state="loading") == 0
    assert value(found, "modelyard_model_state", model="chat-b", state="unloaded") == 1
    assert value(found, "modelyard_model_in_flight", model="chat-a") == 3
    assert value(found, "modelyard_model_queued", model="chat-a") == 1
    assert value(found, "modelyard_model_load_seconds", model="chat-a") == 12.5
    assert ("modelyard_model_load_seconds", frozenset({("model", "chat-b")})) not in found
    assert value(found, "modelyard_model_restarts_total", model="chat-a") == 2
    assert value(found, "modelyard_model_evictions_total", model="chat-a") == 4
    a.state, a.leases = "stopping", 0
    found = samples(exposition(m))
    assert value(found, "modelyard_model_state", model="chat-a", state="stopping") == 1
    assert value(found, "modelyard_model_in_flight", model="chat-a") == 0


def test_json_snapshot_matches_the_exposition() -> None:
    reg = models()
    m = Metrics(reg)
    reg.entries["chat-a"].state = "ready"
    for ttft in (0.1, 0.2, 0.3, 3.0):
        m.request("chat", "chat-a", 200, usage(5, 4, ttft=ttft), now=105.0)
    m.request("embeddings", "embed", 200, Usage())
    body = m.snapshot()
    a = body["models"]["chat-a"]
    assert a["state"] == "ready" and a["in_flight"] == 0 and a["queued"] == 0
    assert a["restarts"] == 0 and a["evictions"] == 0
    assert a["requests"] == {"chat": {"200": 4}}
    assert a["tokens"] == {"prompt": 20, "cached": 0, "completion": 16}
    ttft = a["time_to_first_token_seconds"]
    assert ttft["count"] == 4 and ttft["sum"] == pytest.approx(3.6)
    assert ttft["avg"] == pytest.approx(0.9)
    assert 0.1 <= ttft["p50"] <= 0.25 and 2.5 <= ttft["p99"] <= 5.0
    assert a["request_seconds"]["chat"]["count"] == 4
    assert body["models"]["embed"]["requests"] == {"embeddings": {"200": 1}}
    assert body["models"]["chat-b"]["state"] == "unloaded"
    # the text a scraper sees gives the same JSON
    assert snapshot(text_string_to_metric_families(exposition(m))) == body


def test_each_metrics_object_has_its_own_registry() -> None:
    first, second = Metrics(models()), Metrics(models())
    first.request("chat", "chat-a", 200, Usage())
    assert value(samples(exposition(second)), "modelyard_requests_total", model="chat-a",
                 endpoint="chat", status="200") == 0


def test_quantile_interpolates_like_prometheus() -> None:
    buckets = [(1.0, 2.0), (2.0, 6.0), (math.inf, 8.0)]
    assert quantile(0.25, buckets) == pytest.approx(1.0)   # rank 2: the first bucket's top
    assert quantile(0.5, buckets) == pytest.approx(1.5)    # rank 4: halfway through (1, 2]
    assert quantile(0.99, buckets) == 2.0                  # in +Inf: the highest finite bound
    assert quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None


def test_endpoint_names_match_the_relays() -> None:
    assert [endpoint_name(p) for p in ("/v1/chat/completions", "/v1/completions",
                                       "/v1/embeddings", "/v1/tokenize")] == \
        ["chat", "completions", "embeddings", "tokenize"]


def test_every_request_is_counted_once_through_the_app() -> None:
    """The wiring in ``build_app``, no worker: refusals before the relay (a bad body), in
    the relay (an unknown model, the wrong kind of model), and the endpoints."""
    from router.app import build_app

    preset = build_preset({"models": {"chat-a": {"model": "/a"},
                                      "embed": {"model": "/e", "task": "embed"}}})
    with TestClient(build_app(preset)) as client:
        sent = [
            client.post("/v1/chat/completions", content=b"{not json"),
            client.post("/v1/chat/completions", json={"model": "chat-a", "messages": []}),
            client.post("/v1/chat/completions",
                        json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
            client.post("/v1/completions", json={"model": "embed", "prompt": "x"}),
            client.post("/v1/embeddings", json={"model": "chat-a", "input": "x"}),
        ]
        assert [r.status_code for r in sent] == [400, 400, 404, 400, 400]
        scrape = client.get("/metrics")
        assert scrape.status_code == 200
        assert scrape.headers["content-type"].startswith("text/plain")
        found = samples(scrape.text)
        body = client.get("/v1/metrics").json()
        om = client.get("/metrics", headers={"accept": "application/openmetrics-text"})
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        assert om.text.endswith("# EOF\n")
    expected = {("-", "chat", "400"): 2, ("-", "chat", "404"): 1,
                ("embed", "completions", "400"): 1, ("chat-a", "embeddings", "400"): 1}
    counted = {(dict(labels)["model"], dict(labels)["endpoint"], dict(labels)["status"]): v
               for (name, labels), v in found.items() if name == "modelyard_requests_total"}
    assert counted == expected
    assert body["models"]["-"]["requests"] == {"chat": {"400": 2, "404": 1}}
    assert body["models"]["embed"]["requests"] == {"completions": {"400": 1}}
    assert body["models"]["chat-a"]["state"] == "unloaded"


def test_metrics_need_a_key_when_keys_are_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    from router.app import build_app

    monkeypatch.delenv("MODELYARD_API_KEYS", raising=False)
    preset = build_preset({"server": {"api_keys": ["sk-test"]},
                           "models": {"chat-a": {"model": "/a"}}})
    with TestClient(build_app(preset)) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/v1/metrics").status_code == 401
        key = {"authorization": "Bearer sk-test"}
        assert client.get("/metrics", headers=key).status_code == 200
        assert client.get("/v1/metrics", headers=key).status_code == 200


def test_evictions_count_models_stopped_for_room(tmp_path: Path) -> None:
    preset = build_preset({"server": {"max_loaded_models": 1, "max_parked_models": 0},
                           "models": {"old": {"model": "/o"}, "new": {"model": "/n"}}})
    sup = Supervisor(ModelRegistry(preset), preset.server, tmp_path, Placer(cores={0}, gpus={}))
    old, new = sup.registry.entries["old"], sup.registry.entries["new"]
    old.state, old.last_used = "ready", time.monotonic()

    async def stop(entry: Any, **kw: Any) -> None:
        entry.state = "unloaded"

    sup.rooms.stop = stop
    asyncio.run(sup.rooms.make(new))
    assert old.evictions == 1 and new.evictions == 0
    sup._ctx.term()


# -- integration -----------------------------------------------------------------------
@pytest.mark.integration
def test_counters_equal_the_requests_sent(router: Any, client: Any) -> None:
    """Done when (issue 8): ``/metrics`` parses with prometheus_client's parser and its
    counters equal the requests this test sent. The router is shared: read before and after."""
    import openai

    scrape = router.client.get(router.url + "/metrics")
    assert scrape.status_code == 200
    before = samples(scrape.text)
    messages = [{"role": "user", "content": "Say hi."}]

    plain = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8,
                                           temperature=0)
    stream_usage = None
    for chunk in client.chat.completions.create(
            model="smol", messages=messages, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}):
        if chunk.usage is not None:
            stream_usage = chunk.usage
    completion = client.completions.create(model="smollm2", prompt="The sky is",
                                           max_tokens=8, temperature=0)
    with pytest.raises(openai.BadRequestError):  # refused in the relay: wrong kind of model
        client.chat.completions.create(model="smollm2-embed", messages=messages, max_tokens=8)
    with pytest.raises(openai.BadRequestError):  # refused before the relay: a bad body
        client.chat.completions.create(model="smollm2", messages=[], max_tokens=8)
    # A 404 cannot happen here: this router's default_model answers unknown names.
    assert stream_usage is not None

    scrape = router.client.get(router.url + "/metrics")
    after = samples(scrape.text)
    body: dict[str, Any] = router.client.get(router.url + "/v1/metrics").json()

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    requests = {key: after[key] - before.get(key, 0.0) for key in after
                if key[0] == "modelyard_requests_total" and after[key] != before.get(key)}
    assert {tuple(sorted(labels)): v for (_, labels), v in requests.items()} == {
        (("endpoint", "chat"), ("model", "smollm2"), ("status", "200")): 2,
        (("endpoint", "completions"), ("model", "smollm2"), ("status", "200")): 1,
        (("endpoint", "chat"), ("model", "smollm2-embed"), ("status", "400")): 1,
        (("endpoint", "chat"), ("model", "-"), ("status", "400")): 1,
    }
    answers = [plain.usage, stream_usage, completion.usage]
    assert delta("modelyard_prompt_tokens_total", model="smollm2") == \
        sum(u.prompt_tokens for u in answers if u is not None)
    assert delta("modelyard_completion_tokens_total", model="smollm2") == \
        sum(u.completion_tokens for u in answers if u is not None)
    assert delta("modelyard_time_to_first_token_seconds_count", model="smollm2") == 3
    assert delta("modelyard_request_seconds_count", model="smollm2", endpoint="chat") == 2
    assert delta("modelyard_request_seconds_count", model="smollm2",
                 endpoint="completions") == 1
    assert value(after, "modelyard_model_state", model="smollm2", state="ready") == 1
    assert value(after, "modelyard_model_in_flight", model="smollm2") == 0
    # vLLM's own count, asked at the scrape: nothing left running in the engine
    assert value(after, "modelyard_model_engine_in_flight", model="smollm2") == 0

    # /v1/metrics, read right after, agrees with the exposition
    smol = body["models"]["smollm2"]
    assert smol["state"] == "ready" and smol["in_flight"] == 0 and smol["queued"] == 0
    assert smol["engine_in_flight"] == 0
    assert smol["requests"]["chat"]["200"] == value(
        after, "modelyard_requests_total", model="smollm2", endpoint="chat", status="200")
    assert smol["tokens"]["completion"] == value(after, "modelyard_completion_tokens_total",
                                                 model="smollm2")
    assert smol["time_to_first_token_seconds"]["count"] == value(
        after, "modelyard_time_to_first_token_seconds_count", model="smollm2")
    assert body["models"]["-"]["requests"]["chat"]["400"] == value(
        after, "modelyard_requests_total", model="-", endpoint="chat", status="400")


def test_batch_lines_are_counted_by_state_and_the_runners_batches_read_at_scrape() -> None:
    m = Metrics(models())
    running: list[tuple[str, str, int]] = [("in_progress", "key-alice", 7),
                                           ("cancelling", "key-bob", 2),
                                           ("in_progress", "", 1)]
    m.watch_batches(lambda: running)
    m.batch_lines("key-alice", "succeeded", 3)
    m.batch_lines("key-alice", "errored")
    m.batch_lines("", "canceled")  # no keys: counted, no per-key series
    found = samples(exposition(m))
    assert value(found, "modelyard_batch_lines_total", state="succeeded") == 3
    assert value(found, "modelyard_batch_lines_total", state="errored") == 1
    assert value(found, "modelyard_batch_lines_total", state="canceled") == 1
    assert ("modelyard_batch_lines_total", frozenset({("state", "expired")})) in found
    assert value(found, "modelyard_key_batch_lines_total", key="key-alice",
                 state="succeeded") == 3
    assert {dict(labels)["key"] for name, labels in found
            if name == "modelyard_key_batch_lines_total"} == {"key-alice"}
    assert value(found, "modelyard_batches", status="in_progress") == 2
    assert value(found, "modelyard_batches", status="cancelling") == 1
    assert ("modelyard_batches", frozenset({("status", "finalizing")})) in found  # a 0
    assert value(found, "modelyard_batch_lines_pending") == 10
    assert value(found, "modelyard_key_batch_lines_pending", key="key-alice") == 7
    running.clear()  # read again at the next scrape
    found = samples(exposition(m))
    assert value(found, "modelyard_batches", status="in_progress") == 0
    assert value(found, "modelyard_batch_lines_pending") == 0
    assert ("modelyard_key_batch_lines_pending", frozenset({("key", "key-alice")})) \
        not in found


def test_batch_statuses_and_line_states_are_the_stores() -> None:
    from router.batches.store import ACTIVE, LINE_STATES
    from router.observe.metrics import BATCH_ACTIVE, BATCH_LINE_STATES

    assert set(BATCH_ACTIVE) == set(ACTIVE) and BATCH_LINE_STATES == LINE_STATES


def test_another_keys_batch_series_are_hidden_as_its_request_series() -> None:
    from router.access.admission import Principal
    from router.access.key_store import KeySpec
    from router.api.metrics import MetricsAPI

    m = Metrics(models())
    m.watch_batches(lambda: [("in_progress", "key-alice", 4), ("in_progress", "key-bob", 5)])
    m.batch_lines("key-alice", "succeeded")
    m.batch_lines("key-bob", "succeeded")
    api = MetricsAPI(m)

    def keys_seen(principal: Principal) -> set[str]:
        from prometheus_client import generate_latest

        text = generate_latest(api.seen_by(principal)).decode()  # type: ignore[arg-type]
        return {dict(labels)["key"] for name, labels in samples(text)
                if name in ("modelyard_key_batch_lines_total",
                            "modelyard_key_batch_lines_pending")}

    assert keys_seen(Principal("key-alice", "user")) == {"key-alice"}
    assert keys_seen(Principal("key-alice", "viewer", KeySpec(models=["chat-a"]))) == {
        "key-alice"}
    assert keys_seen(Principal("key-carol", "viewer")) == {"key-alice", "key-bob"}
    assert keys_seen(Principal("key-admin", "admin")) == {"key-alice", "key-bob"}
