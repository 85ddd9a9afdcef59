"""Chat completions through the official openai SDK against real vLLM workers."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.conformance import validate

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


def sse_events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_chat_response_conforms(base_url: str) -> None:
    r = httpx.post(f"{base_url}/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": QUESTION, "max_tokens": 30, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    validate("CreateChatCompletionResponse", body)
    assert body["object"] == "chat.completion" and body["model"] == "smollm2"
    assert "Paris" in body["choices"][0]["message"]["content"]


def test_stream_chunks_conform_and_end_with_done(base_url: str) -> None:
    with httpx.stream("POST", f"{base_url}/chat/completions", timeout=120, json={
            "model": "smollm2", "messages": QUESTION, "max_tokens": 20, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len({c["id"] for c in chunks}) == 1
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("messages", [QUESTION, STORY])
def test_streamed_text_equals_non_streamed_at_temperature_0(client, messages) -> None:  # type: ignore[no-untyped-def]
    whole = client.chat.completions.create(model="smollm2", messages=messages,
                                           max_tokens=48, temperature=0)
    stream = client.chat.completions.create(model="smollm2", messages=messages,
                                            max_tokens=48, temperature=0, stream=True)
    parts, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason


def test_async_client_stream_and_non_stream(aclient) -> None:  # type: ignore[no-untyped-def]
    async def main() -> tuple[str, str]:
        async with aclient:
            whole_task = aclient.chat.completions.create(
                model="smollm2", messages=QUESTION, max_tokens=24, temperature=0)
            stream = await aclient.chat.completions.create(
                model="smollm2", messages=QUESTION, max_tokens=24, temperature=0, stream=True)
            parts = []
            async for chunk in stream:
                parts.extend(c.delta.content or "" for c in chunk.choices)
            whole = await whole_task
            return "".join(parts), whole.choices[0].message.content or ""
    streamed, whole = asyncio.run(main())
    assert streamed == whole and "Paris" in whole


def test_stop_sequence_ends_generation_and_is_not_returned(client) -> None:  # type: ignore[no-untyped-def]
    full = client.chat.completions.create(model="smollm2", messages=STORY, max_tokens=60,
                                          temperature=0).choices[0].message.content
    words = full.split()
    assert len(words) > 8, full
    stop = words[6]
    expected = full[:full.index(stop)]
    r = client.chat.completions.create(model="smollm2", messages=STORY, max_tokens=60,
                                       temperature=0, stop=[stop, "\u2603never"])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smollm2", messages=STORY, max_tokens=60, temperature=0, stop=stop,
            stream=True) if c.choices)
    assert streamed == expected and stop not in streamed


def test_max_completion_tokens_wins_over_max_tokens(client) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(model="smollm2", messages=STORY, max_tokens=30,
                                       max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length"


def test_finish_reason_stop_versus_length(client) -> None:  # type: ignore[no-untyped-def]
    natural = client.chat.completions.create(model="smollm2", messages=QUESTION,
                                             max_tokens=200, temperature=0)
    assert natural.choices[0].finish_reason == "stop"
    assert natural.usage.completion_tokens < 200
    cut = client.chat.completions.create(model="smollm2", messages=STORY, max_tokens=3,
                                         temperature=0)
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == 3


def test_usage_counts_match_tokens(client, base_url: str) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(model="smollm2", messages=STORY, max_tokens=20,
                                       temperature=0, logprobs=True)
    tokens = r.choices[0].logprobs.content
    assert r.usage.completion_tokens == len(tokens) == 20
    counted = httpx.post(f"{base_url}/tokenize", json={"model": "smollm2", "messages": STORY})
    assert r.usage.prompt_tokens == counted.json()["count"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "".join(t.token for t in tokens) == r.choices[0].message.content
    last = list(client.chat.completions.create(
        model="smollm2", messages=STORY, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))[-1]
    assert last.usage.prompt_tokens == r.usage.prompt_tokens
    assert last.usage.completion_tokens == r.usage.completion_tokens


def test_n_choices_and_top_logprobs(client, base_url: str) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 8, "temperature": 1.0,
            "seed": 7, "n": 3, "logprobs": True, "top_logprobs": 2}
    r = httpx.post(f"{base_url}/chat/completions", json=body, timeout=120).json()
    validate("CreateChatCompletionResponse", r)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert sum(len(c["logprobs"]["content"]) for c in r["choices"]) == r["usage"]["completion_tokens"]
    for c in r["choices"]:
        for t in c["logprobs"]["content"]:
            assert len(t["top_logprobs"]) == 2 and t["bytes"] == list(t["token"].encode())
    with httpx.stream("POST", f"{base_url}/chat/completions", timeout=120,
                      json={**body, "stream": True}) as s:
        chunks = [json.loads(e) for e in sse_events(s)[:-1]]
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)
    finished = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"])
    assert finished == [0, 1, 2]


def test_prefix_cache_hits_are_reported(client) -> None:  # type: ignore[no-untyped-def]
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: be kind." for i in range(120))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2)
    second = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens > 600
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_client_disconnect_cancels_generation_in_the_engine(base_url: str) -> None:
    with httpx.stream("POST", f"{base_url}/chat/completions", timeout=120, json={
            "model": "smollm2", "messages": STORY, "max_tokens": 1500, "stream": True,
            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in seen)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = httpx.get(f"{base_url}/models/smollm2").json()
        if m.get("worker_in_flight") == 0 and m["in_flight"] == 0:
            break
        time.sleep(0.2)
    assert m.get("worker_in_flight") == 0 and m["in_flight"] == 0, m
