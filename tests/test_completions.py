"""Legacy completions through the openai SDK and raw HTTP."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conformance import validate

pytestmark = pytest.mark.integration
PROMPT = "The three primary colors are"


def test_completion_conforms_and_streams_the_same_text(client, base_url: str) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    whole = httpx.post(f"{base_url}/completions", json=body, timeout=120).json()
    validate("CreateCompletionResponse", whole)
    with httpx.stream("POST", f"{base_url}/completions", timeout=120,
                      json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        validate("CompletionStreamChunk", chunk)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    sdk = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0)
    assert sdk.choices[0].text == whole["choices"][0]["text"]


def test_default_max_tokens_is_16_like_openai(client) -> None:  # type: ignore[no-untyped-def]
    r = client.completions.create(model="smollm2", prompt=PROMPT, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_several_prompts_token_prompts_and_echo(client) -> None:  # type: ignore[no-untyped-def]
    single = [client.completions.create(model="smollm2", prompt=p, max_tokens=6, temperature=0)
              for p in (PROMPT, "Once upon a time")]
    batch = client.completions.create(model="smollm2", prompt=[PROMPT, "Once upon a time"],
                                      max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in single]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    ids = httpx.post(f"{client.base_url}tokenize",
                     json={"model": "smollm2", "prompt": PROMPT}).json()["tokens"]
    by_ids = client.completions.create(model="smollm2", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == single[0].choices[0].text
    echoed = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + single[0].choices[0].text


def test_completion_logprobs(base_url: str) -> None:
    r = httpx.post(f"{base_url}/completions", timeout=120, json={
        "model": "smollm2", "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
        "logprobs": 2}).json()
    validate("CreateCompletionResponse", r)
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == r["usage"]["completion_tokens"] == 5
    assert all(len(top) <= 2 for top in lp["top_logprobs"])
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    assert lp["text_offset"][0] == 0
