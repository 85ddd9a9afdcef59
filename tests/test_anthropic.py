"""Anthropic's Messages API against real workers, driven by the official ``anthropic`` SDK.

``smollm2`` (alias ``claude-sonnet``; tools: hermes) answers; ``smollm2-b`` is unloaded
first where a test needs a model that is still loading. The raw event streams are read
with httpx as well, to check the grammar the SDK relies on without showing it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

from tests.conftest import RouterProcess
from tests.test_anthropic_units import check_grammar

pytestmark = pytest.mark.integration

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 24}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
          "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
HEADERS = {"x-api-key": "unused", "anthropic-version": "2023-06-01"}


@pytest.fixture
def claude(router: RouterProcess) -> Iterator[Any]:
    from anthropic import Anthropic

    with Anthropic(base_url=router.url, api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def raw_events(router: RouterProcess, body: dict[str, Any], path: str = "/v1/messages"
               ) -> list[tuple[float, str, dict[str, Any]]]:
    """(seconds since the request, event, data) for every event of a streamed answer."""
    out = []
    start = time.monotonic()
    with httpx.stream("POST", router.url + path, json={**body, "stream": True},
                      headers=HEADERS, timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        event = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                out.append((time.monotonic() - start, event,
                            json.loads(line.removeprefix("data: "))))
    return out


def test_create_answers_a_versioned_claude_name_with_usage(claude: Any) -> None:
    msg = claude.messages.create(
        model="claude-sonnet-4-5-20250929", max_tokens=12, messages=ASK,
        system="You are terse.", metadata={"user_id": "u-1"},
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0})  # this SDK has no sampling arguments of its own
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == "smollm2"  # reached through the alias claude-sonnet
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.stop_sequence is None
    assert msg.usage.input_tokens > 0 and 0 < msg.usage.output_tokens <= 12


def test_stream_accumulates_the_final_message(claude: Any) -> None:
    # role "system" inside messages, as Claude Code sends it
    messages = [{"role": "system", "content": "Answer in one sentence."}, *ASK]
    with claude.messages.stream(model="claude-sonnet", max_tokens=16, messages=messages,
                                extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].type == "text" and final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.input_tokens > 0 and 0 < final.usage.output_tokens <= 16


def test_stream_events_follow_the_documented_grammar(router: RouterProcess) -> None:
    evs = raw_events(router, {"model": "smollm2", "max_tokens": 16, "messages": ASK,
                              "stop_sequences": ["\n"]}, "/v1/messages?beta=true")
    check_grammar([(e, d) for _, e, d in evs])
    start = evs[0][2]["message"]
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] > 0
    end = next(d for _, e, d in evs if e == "message_delta")
    assert end["usage"]["output_tokens"] > 0
    if end["delta"]["stop_reason"] == "stop_sequence":
        assert end["delta"]["stop_sequence"] == "\n"


def test_count_tokens_is_the_prompt_a_create_reports(claude: Any) -> None:
    ask = {"model": "smollm2", "messages": ASK, "system": "You are terse.", "tools": TOOLS}
    counted = claude.messages.count_tokens(**ask).input_tokens
    without_tools = claude.messages.count_tokens(
        model="smollm2", messages=ASK, system="You are terse.").input_tokens
    assert counted > without_tools > 0  # the tools are rendered into the prompt
    msg = claude.messages.create(max_tokens=4, **ask)
    # input_tokens is the uncached part; the prefix cache may have served the rest
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == counted


def test_tool_use_round_trip(claude: Any, router: RouterProcess) -> None:
    ask = {"model": "smollm2", "max_tokens": 120, "messages": ASK, "tools": TOOLS}
    hot = {"temperature": 1.0}  # a forced call must validate whatever is sampled
    # The raw stream: tool input arrives only as input_json_delta pieces.
    evs = raw_events(router, {**ask, **hot,
                              "tool_choice": {"type": "tool", "name": "get_weather"}})
    check_grammar([(e, d) for _, e, d in evs])
    starts = [d["content_block"] for _, e, d in evs if e == "content_block_start"]
    assert [b["type"] for b in starts] == ["tool_use"]
    assert starts[0]["input"] == {} and starts[0]["id"].startswith("toolu_")
    pieces = [d["delta"] for _, e, d in evs if e == "content_block_delta"]
    assert pieces and all(p["type"] == "input_json_delta" for p in pieces)
    jsonschema.validate(json.loads("".join(p["partial_json"] for p in pieces)), WEATHER)

    # The SDK parses the same pieces into the tool_use block's input.
    with claude.messages.stream(**ask, extra_body=hot, tool_choice={
            "type": "any", "disable_parallel_tool_use": True}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    (call,) = [b for b in final.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)

    # ... and the result goes back as a tool_result, answered with text.
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in final.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": "18 degrees and sunny"}]}]
    answer = claude.messages.create(model="smollm2", max_tokens=24, messages=history,
                                    tools=TOOLS, tool_choice={"type": "none"})
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")


def test_output_config_format_constrains_the_answer(claude: Any) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    msg = claude.messages.create(
        model="smollm2", max_tokens=40, messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(msg.content[0].text), schema)


def test_errors_are_anthropic_shaped(claude: Any, router: RouterProcess) -> None:
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="smollm2", max_tokens=8, messages=ASK,
                               extra_body={"temperature": 1.5})
    assert info.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "'temperature' must be between 0 and 1"}}
    r = httpx.post(router.url + "/v1/messages", headers=HEADERS,
                   json={"model": "smollm2", "messages": ASK})  # no max_tokens
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(router.url + "/v1/messages/batches", headers=HEADERS, json={})
    assert r.status_code == 400 and r.json()["type"] == "error"  # served: no "requests"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "requests" in r.json()["error"]["message"]


def test_claude_codes_32000_max_tokens_are_clamped_to_the_context(
        claude: Any, router: RouterProcess) -> None:
    """Claude Code sends ``max_tokens: 32000`` whatever the model: on 651c79a a 400 ("you
    requested 32 0xx tokens"); now what the 2 048-token context leaves, said in a header.
    OpenAI's endpoint still refuses, as OpenAI does."""
    raw = claude.messages.with_raw_response.create(
        model="smollm2", max_tokens=32000, messages=[{"role": "user", "content": "Hi"}],
        extra_body={"stop_sequences": ["."]})
    message = raw.parse()
    granted = int(raw.headers["x-modelyard-max-tokens-clamped"])
    assert 1900 < granted < 2048 - message.usage.input_tokens + 1
    assert message.usage.output_tokens <= granted
    events = raw_events(router, {"model": "smollm2", "max_tokens": 32000,
                                 "messages": [{"role": "user", "content": "Hi"}],
                                 "stop_sequences": ["."]})
    assert events[-1][1] == "message_stop"
    chat = httpx.post(router.url + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "max_tokens": 32000, "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_tokens"
    # A prompt that does not fit at all, in Anthropic's words (its clients compact on them).
    r = httpx.post(router.url + "/v1/messages", headers=HEADERS, timeout=60, json={
        "model": "smollm2", "max_tokens": 10,
        "messages": [{"role": "user", "content": "lighthouse " * 3000}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 2048 maximum", error["message"]), error


def test_a_cold_model_streams_pings_until_it_is_ready(claude: Any,
                                                      router: RouterProcess) -> None:
    r = router.client.post(router.url + "/v1/models/unload", json={"model": "smollm2-b"})
    assert r.status_code == 200 and r.json()["state"] == "unloaded"
    evs = raw_events(router, {"model": "smollm2-b", "max_tokens": 8, "messages": ASK})
    assert evs[0][1] == "ping" and evs[0][0] < 2, evs[:2]  # at once, not after the load
    first_start = next(t for t, e, _ in evs if e == "message_start")
    loaded = router.client.get(f"{router.url}/v1/models/smollm2-b").json()["load_seconds"]
    assert first_start >= 0.8 * loaded > 2, (first_start, loaded)  # it waited for the load
    pings = [t for t, e, _ in evs if e == "ping"]
    assert len(pings) == 1 + int(loaded // 5) or len(pings) == 2 + int(loaded // 5), pings
    check_grammar([(e, d) for _, e, d in evs])
    # The SDK ignores pings; a warm model answers without any.
    with claude.messages.stream(model="smollm2-b", max_tokens=8, messages=ASK) as s:
        assert s.get_final_message().usage.output_tokens > 0
