"""Bad input gets an OpenAI-shaped 4xx, never a 500, and never disturbs other requests."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conformance import validate

pytestmark = pytest.mark.integration
HI = [{"role": "user", "content": "Say hi."}]


def post(base_url: str, path: str, **kw) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.post(f"{base_url}{path}", timeout=60, **kw)


@pytest.mark.parametrize("body,status,param", [
    (b'{"model": "smollm2", "messages": [', 400, None),                       # malformed JSON
    (b'', 400, None),                                                          # empty body
    (b'[1, 2]', 400, None),                                                    # not an object
    ({"model": "smollm2"}, 400, "messages"),                                  # missing field
    ({"model": "smollm2", "messages": "hi"}, 400, "messages"),               # wrong type
    ({"model": "smollm2", "messages": []}, 400, "messages"),                 # empty messages
    ({"model": "smollm2", "messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ({"model": "smollm2", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ({"model": "smollm2", "messages": HI, "temperature": -0.5}, 400, "temperature"),
    ({"model": "smollm2", "messages": HI, "temperature": "hot"}, 400, "temperature"),
    ({"model": "smollm2", "messages": HI, "n": 0}, 400, "n"),
    ({"model": "smollm2", "messages": HI, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "smollm2", "messages": HI, "top_p": 1.5}, 400, "top_p"),
    ({"model": "smollm2", "messages": HI, "top_logprobs": 3}, 400, "top_logprobs"),
    ({"model": "smollm2", "messages": HI, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0]"),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400,
     None),                                                                    # invalid UTF-8
    ({"model": "smollm2", "messages": HI, "seed": 2**63}, 400, "seed"),       # beyond int64
    ({"model": "smollm2", "messages": HI, "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    ({"model": "smollm2", "messages": HI, "tool_choice": "required"}, 400, "tool_choice"),
    # Unbounded inputs are bounded (each of these was accepted before):
    ({"model": "smollm2", "messages": HI, "stop": ["x" * 1001]}, 400, "stop"),
    ({"model": "smollm2", "messages": HI, "stop_token_ids": [1] * 1025}, 400, "stop_token_ids"),
    ({"model": "smollm2", "messages": HI, "logit_bias": {"012": 1, "12": -1}}, 400,
     "logit_bias"),                                    # two spellings of one token
    ({"model": "smollm2", "messages": HI * 10_001}, 400, "messages"),
    ({"model": "smollm2", "messages": HI, "tools": [
        {"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, 400, "tools"),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], '
     b'"chat_template_kwargs": {"a": ' + b"[" * 10_000 + b"]" * 10_000 + b"}}", 400, None),
    ({"model": "smollm2", "messages": HI, "max_tokens": 4096}, 400, "max_tokens"),  # > context
    # Refused by vLLM's own checks in the worker, not by the router:
    ({"model": "smollm2", "messages": HI, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"model": "smollm2", "messages": HI, "stop_token_ids": [99999999]}, 400, "stop_token_ids"),
])
def test_bad_chat_bodies_get_400_naming_the_field(base_url: str, body, status: int,  # type: ignore[no-untyped-def]
                                                  param: str | None) -> None:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = post(base_url, "/chat/completions", **kw)
    assert r.status_code == status, r.text
    validate("ErrorResponse", r.json())
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_bad_completion_bodies(base_url: str) -> None:
    for body, param in [({"model": "smollm2", "prompt": ""}, "prompt"),
                        ({"model": "smollm2", "prompt": [1.5]}, "prompt"),
                        ({"model": "smollm2", "prompt": "x", "logprobs": 50}, "logprobs"),
                        ({"model": "smollm2", "prompt": [99999999]}, "prompt"),
                        ({"model": "smollm2", "prompt": [2**70]}, None),  # no int64 fits
                        ({"model": "smollm2", "prompt": ["a"] * 300, "n": 4}, "n")]:
        r = post(base_url, "/completions", json=body)
        assert r.status_code == 400, r.text
        validate("ErrorResponse", r.json())
        assert r.json()["error"]["param"] == param


def test_prompt_longer_than_context_is_400(client) -> None:  # type: ignore[no-untyped-def]
    long = "word " * 3000
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": long}])
    assert info.value.status_code == 400
    validate("ErrorResponse", info.value.response.json())
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):  # streaming too: JSON 400, not a broken stream
        client.chat.completions.create(model="smollm2", stream=True,
                                       messages=[{"role": "user", "content": long}])


def test_unknown_path_and_method_are_openai_shaped(base_url: str) -> None:
    r = httpx.get(f"{base_url}/nothing-here")
    assert r.status_code == 404
    validate("ErrorResponse", r.json())
    r = httpx.get(f"{base_url}/chat/completions")
    assert r.status_code == 405
    validate("ErrorResponse", r.json())


def test_bad_requests_do_not_disturb_a_running_stream(client, base_url: str) -> None:  # type: ignore[no-untyped-def]
    stream = client.chat.completions.create(model="smollm2", messages=HI, max_tokens=40,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    parts = []
    for i, chunk in enumerate(stream):
        parts.extend(c.delta.content or "" for c in chunk.choices)
        if i == 3:
            for _ in range(5):
                assert post(base_url, "/chat/completions", content=b"{oops").status_code == 400
    assert len(parts) > 30
