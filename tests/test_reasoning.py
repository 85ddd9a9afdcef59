"""Reasoning and template variables against real workers: ``smollm2-b`` runs vLLM's
``olmo3`` reasoning parser (``<think>`` … ``</think>`` as plain text, which SmolLM2's
vocabulary can spell); the model's text is forced by a regex so the parser runs for real."""

from __future__ import annotations

import httpx
import pytest

from tests.conformance import validate

pytestmark = pytest.mark.integration

ASK = [{"role": "user", "content": "Say hello."}]
FORCED = {"structured_outputs": {"regex": r"<think>[a-z ]{5,30}</think>[A-Za-z ]{3,30}"}}


def test_reasoning_content_is_apart_from_content(client) -> None:  # type: ignore[no-untyped-def]
    out = client.chat.completions.create(model="smollm2-b", messages=ASK, max_tokens=60,
                                         extra_body=FORCED)
    validate("CreateChatCompletionResponse", out.model_dump(exclude_unset=True))
    message = out.model_dump()["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"]
    for text in (message["reasoning_content"], message["content"]):
        assert "<think>" not in text and "</think>" not in text


def test_reasoning_streams_as_its_own_deltas(client) -> None:  # type: ignore[no-untyped-def]
    stream = client.chat.completions.create(model="smollm2-b", messages=ASK, max_tokens=60,
                                            stream=True, extra_body=FORCED)
    kinds, reasoning, content = [], "", ""
    for chunk in stream:
        validate("CreateChatCompletionStreamResponse", chunk.model_dump(exclude_unset=True))
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            if delta.get("reasoning_content"):
                kinds.append("reasoning")
                reasoning += delta["reasoning_content"]
            if delta.get("content"):
                kinds.append("content")
                content += delta["content"]
    assert reasoning and content and "think>" not in reasoning + content
    assert kinds.index("content") > kinds.index("reasoning")
    assert "reasoning" not in kinds[kinds.index("content"):], "reasoning first, then the answer"


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(base_url: str) -> None:
    def count(**extra: object) -> int:
        r = httpx.post(f"{base_url}/tokenize", timeout=60,
                       json={"model": "smollm2", "messages": ASK, **extra})
        assert r.status_code == 200, r.text
        return int(r.json()["count"])

    plain = count()
    # The test template closes an empty <think> block when thinking is off.
    assert count(chat_template_kwargs={"enable_thinking": False}) > plain
    assert count(chat_template_kwargs={"enable_thinking": True}) == plain

    def prompt_tokens(**extra: object) -> int:
        r = httpx.post(f"{base_url}/chat/completions", timeout=60, json={
            "model": "smollm2", "messages": ASK, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])

    assert prompt_tokens(reasoning_effort="high") > prompt_tokens() == plain
