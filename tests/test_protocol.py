"""Router⇄worker messages survive a msgpack round trip through both codecs."""

from __future__ import annotations

import msgspec
import pytest

from shared.protocol import (
    Cancel,
    ChatMessage,
    Delta,
    Deltas,
    Error,
    Generate,
    Ping,
    Pong,
    Ready,
    SamplingSpec,
    Score,
    Scores,
    Shutdown,
    Tokenize,
    TokenizeResult,
    TokenLogprob,
    TopLogprob,
    router_codec,
    worker_codec,
)

TO_WORKER = [
    Generate(id="a", sampling=SamplingSpec(max_tokens=5, temperature=0.0, stop=["x"], n=2,
                                           logit_bias={5: -1.0}),
             messages=[ChatMessage(role="user", content="hi", name="bob")]),
    Generate(id="b", sampling=SamplingSpec(), prompt_token_ids=[1, 2, 3]),
    Cancel(id="a"), Tokenize(id="t", prompt="hello", return_token_strs=True), Ping(id="p"),
    Score(id="s", queries=["q"], documents=["a", "b"], max_tokens_per_doc=8), Shutdown(),
]
TO_ROUTER = [
    Ready(model="m", max_model_len=2048, pid=42),
    Deltas(items=[Delta(id="a", text="Hel", tokens=1),
                  Delta(id="a", index=1, text="lo", tokens=2, finish_reason="stop",
                        stop_reason="x", prompt_tokens=7, cached_tokens=4,
                        logprobs=[TokenLogprob("lo", -0.5, [TopLogprob("lo", -0.5)])])]),
    TokenizeResult(id="t", token_ids=[1, 2], max_model_len=2048, token_strs=["a", "b"]),
    Error(id="a", message="too long", status=400, type="invalid_request_error",
          param="messages", code="context_length_exceeded"),
    Pong(id="p", in_flight=3),
    Scores(id="s", scores=[0.25, 0.75], prompt_tokens=12),
]


@pytest.mark.parametrize("message", TO_WORKER, ids=lambda m: type(m).__name__)
def test_router_to_worker_round_trip(message: msgspec.Struct) -> None:
    assert worker_codec().decode(router_codec().encode(message)) == message


@pytest.mark.parametrize("message", TO_ROUTER, ids=lambda m: type(m).__name__)
def test_worker_to_router_round_trip(message: msgspec.Struct) -> None:
    assert router_codec().decode(worker_codec().encode(message)) == message


def test_deltas_are_compact_arrays_without_field_names() -> None:
    frame = worker_codec().encode(Deltas(items=[Delta(id="r1", text="x", tokens=1)]))
    assert b"text" not in frame and len(frame) < 28  # 11 fields, no names


def test_a_side_rejects_messages_meant_for_the_other() -> None:
    with pytest.raises(msgspec.ValidationError):
        router_codec().decode(router_codec().encode(Cancel(id="a")))
