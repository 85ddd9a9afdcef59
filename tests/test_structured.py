"""Structured output against a real worker: ``response_format`` (``json_object``,
``json_schema``) and vLLM's ``structured_outputs`` (choice, regex, grammar)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import jsonschema
import pytest

from tests.conformance import validate

pytestmark = pytest.mark.integration

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "enum": ["cat", "dog", "fish"]}}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
FORMAT = {"type": "json_schema",
          "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def test_json_schema_validates_20_of_20_at_temperature_1(aclient) -> None:  # type: ignore[no-untyped-def]
    async def run() -> list[Any]:
        return await asyncio.gather(*[aclient.chat.completions.create(
            model="smollm2", messages=ASK, response_format=FORMAT, temperature=1.0,
            max_tokens=120) for _ in range(20)])

    for out in asyncio.run(run()):
        validate("CreateChatCompletionResponse", out.model_dump(exclude_unset=True))
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def test_json_schema_streamed_and_n_3(client) -> None:  # type: ignore[no-untyped-def]
    stream = client.chat.completions.create(model="smollm2", messages=ASK, response_format=FORMAT,
                                            temperature=1.0, max_tokens=120, n=3, stream=True)
    texts = ["", "", ""]
    for chunk in stream:
        validate("CreateChatCompletionStreamResponse", chunk.model_dump(exclude_unset=True))
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_choice_regex_and_grammar(client) -> None:  # type: ignore[no-untyped-def]
    def ask(**kw: Any) -> str:
        out = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=60,
                                             temperature=1.0, **kw)
        return str(out.choices[0].message.content)

    whole = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=400,
                                           temperature=0, response_format={"type": "json_object"})
    assert whole.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(str(whole.choices[0].message.content)), dict)
    assert ask(extra_body={"structured_outputs": {"choice": ["yes", "no"]}}) in ("yes", "no")
    assert re.fullmatch(r"[A-Z]{3}-\d{2}",
                        ask(extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-\d{2}"}}))
    grammar = 'root ::= "ok" | "not ok"'
    assert ask(extra_body={"structured_outputs": {"grammar": grammar}}) in ("ok", "not ok")


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    {"response_format": {"type": "json_schema",
                         "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
    {"response_format": {"type": "xml"}},
])
def test_invalid_response_format_is_400_naming_it(base_url: str, extra: dict[str, Any]) -> None:
    r = httpx.post(f"{base_url}/chat/completions", timeout=60,
                   json={"model": "smollm2", "messages": ASK, "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    assert r.json()["error"]["param"] == "response_format"


def test_two_structured_output_kinds_at_once_is_400(base_url: str) -> None:
    r = httpx.post(f"{base_url}/chat/completions", timeout=60, json={
        "model": "smollm2", "messages": ASK, "max_tokens": 5,
        "structured_outputs": {"regex": "a+", "choice": ["a"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
