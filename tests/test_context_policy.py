"""``max_tokens_overflow`` (issue 23) with synthetic workers: when prompt + ``max_tokens``
exceed the context, Anthropic's Messages clamp ``max_tokens`` (a header and the request
log say so) and OpenAI's endpoints refuse, unless a model's preset says otherwise.
``test_anthropic`` checks the same on the real model."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import RouterProcess, running_router

pytestmark = pytest.mark.integration

PRESET = """
server: {host: 127.0.0.1, port: {port}, spare_workers: 0}
models:
  small: {model: /synthetic, engine: synthetic, max_model_len: 100}
  clamps: {model: /synthetic, engine: synthetic, max_model_len: 100,
           max_tokens_overflow: clamp}
  strict: {model: /synthetic, engine: synthetic, max_model_len: 100,
           max_tokens_overflow: {anthropic: reject, openai: clamp}}
"""
HI = [{"role": "user", "content": "hi"}]  # 5 tokens to the synthetic engine: 95 left
CLAMPED = "x-modelyard-max-tokens-clamped"


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with running_router(PRESET, tmp_path_factory.mktemp("policy"), "policy") as r:
        yield r


def post(r: RouterProcess, path: str, body: dict[str, object]) -> httpx.Response:
    return r.client.post(r.url + path, json=body, timeout=60)


def test_anthropic_clamps_and_openai_refuses_by_default(policy: RouterProcess) -> None:
    r = policy
    answer = post(r, "/v1/messages", {"model": "small", "max_tokens": 32000, "messages": HI})
    assert answer.status_code == 200, answer.text
    assert answer.headers[CLAMPED] == "95" and answer.json()["usage"]["output_tokens"] == 95
    with r.client.stream("POST", r.url + "/v1/messages", timeout=60, json={
            "model": "small", "max_tokens": 32000, "messages": HI, "stream": True}) as stream:
        assert stream.status_code == 200 and stream.headers[CLAMPED] == "95"
        assert "message_stop" in stream.read().decode()
    fits = post(r, "/v1/messages", {"model": "small", "max_tokens": 10, "messages": HI})
    assert fits.status_code == 200 and CLAMPED not in fits.headers
    for path, body in (("/v1/chat/completions", {"messages": HI, "max_tokens": 32000}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 32000}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 32000})):
        refused = post(r, path, {"model": "small", **body})
        assert refused.status_code == 400, (path, refused.text)
        assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert "max_tokens clamped to 95" in r.tail(200)


def test_a_preset_changes_the_policy_per_model_and_protocol(policy: RouterProcess) -> None:
    r = policy
    chat = post(r, "/v1/chat/completions", {"model": "clamps", "messages": HI,
                                            "max_tokens": 32000})
    assert chat.status_code == 200 and chat.headers[CLAMPED] == "95"
    assert chat.json()["usage"]["completion_tokens"] == 95
    responses = post(r, "/v1/responses", {"model": "clamps", "input": "hi",
                                          "max_output_tokens": 32000})
    assert responses.status_code == 200 and CLAMPED in responses.headers
    refused = post(r, "/v1/messages", {"model": "strict", "max_tokens": 32000, "messages": HI})
    assert refused.status_code == 400
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert post(r, "/v1/chat/completions", {"model": "strict", "messages": HI,
                                            "max_tokens": 32000}).status_code == 200
