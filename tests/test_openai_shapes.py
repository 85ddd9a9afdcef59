"""Deltas → OpenAI chunks and bodies, checked against the official schemas (no server)."""

from __future__ import annotations

import json

from router.api.openai import ChatChoices, CompletionChoices
from router.errors import BadRequest, ModelNotFound
from shared.protocol import Delta, TokenLogprob, TopLogprob
from tests.conformance import validate


def events(data: bytes) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")]


def lp(tok: str) -> list[TokenLogprob]:
    return [TokenLogprob(tok, -0.1, [TopLogprob(tok, -0.1), TopLogprob("x", -2.0)])]


def test_chat_chunks_and_body() -> None:
    c = ChatChoices("chatcmpl-1", "m", 2, logprobs=True)
    out = c.chunks([Delta(id="r", index=0, text="Hel", tokens=1, logprobs=lp("Hel")),
                    Delta(id="r", index=1, text="Yo", tokens=1, logprobs=lp("Yo"))])
    out += c.chunks([Delta(id="r", index=0, text="lo", tokens=1, logprobs=lp("lo"),
                           finish_reason="stop", prompt_tokens=5, cached_tokens=2),
                     Delta(id="r", index=1, text="", tokens=1, finish_reason="length",
                           prompt_tokens=5, cached_tokens=2)])
    out += c.usage_chunk()
    chunks = events(out)
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)
    roles = [ch["choices"][0]["index"] for ch in chunks
             if ch["choices"] and ch["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 4,
                                   "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 2}}
    body = c.response()
    validate("CreateChatCompletionResponse", body)
    assert [ch["message"]["content"] for ch in body["choices"]] == ["Hello", "Yo"]
    assert [ch["finish_reason"] for ch in body["choices"]] == ["stop", "length"]


def test_completion_chunks_body_echo_and_offsets() -> None:
    c = CompletionChoices("cmpl-1", "m", 2, logprobs=True, echo=["A: ", "B: "], n=1)
    out = c.chunks([Delta(id="r-0", index=0, text="x", tokens=1, logprobs=lp("x")),
                    Delta(id="r-1", index=1, text="yz", tokens=1, logprobs=lp("yz"),
                          finish_reason="stop", prompt_tokens=3)])
    out += c.chunks([Delta(id="r-0", index=0, text="w", tokens=1, logprobs=lp("w"),
                           finish_reason="length", prompt_tokens=4)])
    for chunk in events(out):
        validate("CompletionStreamChunk", chunk)
    body = c.response()
    validate("CreateCompletionResponse", body)
    assert [ch["text"] for ch in body["choices"]] == ["A: xw", "B: yz"]
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 7


def test_error_bodies_conform() -> None:
    validate("ErrorResponse", BadRequest("bad", param="n").body())
    validate("ErrorResponse", ModelNotFound("no").body())
