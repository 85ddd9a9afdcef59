"""Anthropic Messages without a worker: request translation, the block state machine and
the stream grammar it writes, error shapes."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from router.api.anthropic.schema import MessagesRequest, conversation, messages_generate
from router.api.anthropic.shaper import MessagesShaper
from router.errors import APIError, BadRequest, TooManyRequests, shaped
from router.workers.link import Usage
from shared.protocol import Delta, ToolCallDelta


def request(**body: Any) -> MessagesRequest:
    body.setdefault("max_tokens", 64)
    return msgspec.json.decode(json.dumps(body), type=MessagesRequest)


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for frame in raw.decode().split("\n\n"):
        if frame:
            head, data = frame.split("\n")
            out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def check_grammar(evs: list[tuple[str, dict[str, Any]]]) -> None:
    """Anthropic's documented order: message_start, then blocks 0, 1, 2… one open at a
    time, each start → deltas → stop, then message_delta and message_stop."""
    names = [e for e, _ in evs if e != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    open_index, next_index = None, 0
    for event, data in evs:
        assert data["type"] == event
        if event == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index, next_index = data["index"], next_index + 1
        elif event == "content_block_delta":
            assert data["index"] == open_index
        elif event == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        elif event == "message_delta":
            assert open_index is None


def test_system_everywhere_becomes_one_leading_system_message() -> None:
    req = request(system=[{"type": "text", "text": "Be brief."}], messages=[
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}]},
    ])
    msgs = conversation(req)
    assert [m.role for m in msgs] == ["system", "user"]
    assert msgs[0].content == "Be brief.\n\nAnswer in French."


def test_tool_round_trip_history_maps_to_calls_and_tool_messages() -> None:
    req = request(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "use the tool", "signature": "x"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
             "content": [{"type": "text", "text": "timeout"}]},
            {"type": "text", "text": "Try again?"}]},
    ], tools=[{"name": "get_weather", "input_schema": {"type": "object"}},
              {"type": "web_search_20250305", "name": "web_search"}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True})
    gen = messages_generate(req, "msg_1")
    roles = [m.role for m in gen.messages or []]
    assert roles == ["user", "assistant", "tool", "user"]
    assistant, tool = (gen.messages or [])[1:3]
    assert assistant.content == "Checking." and assistant.tool_calls is not None
    assert assistant.tool_calls[0].arguments == '{"city":"Paris"}'
    assert tool.tool_call_id == "toolu_1" and tool.content == "Error:\ntimeout"
    assert [t.name for t in gen.tools or []] == ["get_weather"]  # Anthropic's own tools left out
    assert gen.tool_choice == "required" and gen.parallel_tool_calls is False


def test_prefill_continues_the_last_assistant_turn_and_thinking_turns_on() -> None:
    gen = messages_generate(request(
        messages=[{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1,"}],
        thinking={"type": "enabled", "budget_tokens": 1024}), "msg_1")
    assert gen.continue_final_message and not gen.add_generation_prompt
    assert gen.template_kwargs == {"enable_thinking": True}
    gen = messages_generate(request(
        messages=[{"role": "user", "content": "Count"}], output_config={
            "effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}}),
        "msg_2")
    assert gen.template_kwargs == {"reasoning_effort": "low"}
    assert gen.constraint is not None and gen.constraint.json == {"type": "object"}
    assert gen.constraint.param == "output_config.format"


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "g"}},
     "tool_choice.name"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64"}}]}]}, "messages[0].content[0].source"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": {
        "format": {"type": "regex"}}}, "output_config.format"),
    ({"messages": [{"role": "user", "content": "x"}], "output_format": {
        "type": "json_schema", "schema": {}}, "tools": [{"name": "f", "input_schema": {}}],
      "tool_choice": {"type": "any"}}, "output_format"),
])
def test_bad_requests_name_their_field(body: dict[str, Any], param: str) -> None:
    body.setdefault("max_tokens", 8)
    with pytest.raises(BadRequest) as info:
        messages_generate(request(**body), "msg_1")
    assert info.value.param == param


def run(shaper: MessagesShaper, batches: list[list[Delta]], completion: int
        ) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
    """The stream's events and the body an aggregating shaper gives for the same deltas."""
    usage = Usage()
    usage.completion = completion
    raw = b"".join(shaper.chunks(b) for b in batches) + shaper.close(usage)
    twin = MessagesShaper(shaper.mid, shaper.model, shaper.stop_sequences)
    for b in batches:
        twin.add(b)
    return events(raw), twin.body(usage)


def test_thinking_text_and_tool_calls_stream_as_contiguous_blocks() -> None:
    batches = [
        [Delta(id="r", reasoning="Think", prompt_tokens=30, cached_tokens=16)],
        [Delta(id="r", reasoning="ing.", text="Sure.")],
        [Delta(id="r", tool_calls=[ToolCallDelta(index=0, id="x", name="a",
                                                 arguments='{"q": ')])],
        [Delta(id="r", tool_calls=[ToolCallDelta(index=0, arguments='"1"}'),
                                   ToolCallDelta(index=1, id="y", name="b")])],
        [Delta(id="r", finish_reason="tool_calls", prompt_tokens=30, cached_tokens=16)],
    ]
    evs, body = run(MessagesShaper("msg_abc", "m", []), batches, 9)
    check_grammar(evs)
    start = evs[0][1]["message"]
    assert start["usage"]["input_tokens"] == 14 and start["usage"]["cache_read_input_tokens"] == 16
    kinds = [d["content_block"]["type"] for e, d in evs if e == "content_block_start"]
    assert kinds == ["thinking", "text", "tool_use", "tool_use"]
    deltas = [d["delta"]["type"] for e, d in evs if e == "content_block_delta"]
    assert deltas == ["thinking_delta", "thinking_delta", "signature_delta", "text_delta",
                      "input_json_delta", "input_json_delta"]
    end = evs[-2][1]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == 9
    assert [b["type"] for b in body["content"]] == kinds
    assert body["content"][0]["thinking"] == "Thinking." and body["content"][0]["signature"]
    assert body["content"][2]["input"] == {"q": "1"} and body["content"][3]["input"] == {}
    assert body["content"][2]["id"].startswith("toolu_")
    assert body["stop_reason"] == "tool_use" and body["usage"]["output_tokens"] == 9


def test_a_tool_input_streams_as_the_body_has_it_even_when_the_model_wrote_bad_json() -> None:
    """On 651c79a the stream forwarded the model's text as ``input_json_delta`` (an SDK's
    partial-JSON parser throws on ``{"q": 1,,}``) while the body said ``{}``."""
    batches = [
        [Delta(id="r", prompt_tokens=3, tool_calls=[
            ToolCallDelta(index=0, id="x", name="good", arguments='{"q": '),
        ])],
        [Delta(id="r", tool_calls=[ToolCallDelta(index=0, arguments='"1"}'),
                                   ToolCallDelta(index=1, id="y", name="bad",
                                                 arguments='{"q": 1,,}')])],
        [Delta(id="r", finish_reason="tool_calls", prompt_tokens=3)],
    ]
    evs, body = run(MessagesShaper("msg_abc", "m", []), batches, 4)
    check_grammar(evs)
    streamed: dict[int, str] = {}
    for event, data in evs:
        if event == "content_block_delta" and data["delta"]["type"] == "input_json_delta":
            streamed[data["index"]] = streamed.get(data["index"], "") + data["delta"][
                "partial_json"]
    assert {i: json.loads(text) for i, text in streamed.items()} == {
        i: block["input"] for i, block in enumerate(body["content"])}
    assert body["content"][0]["input"] == {"q": "1"} and body["content"][1]["input"] == {}


@pytest.mark.parametrize("finish,stop_reason,expected", [
    ("stop", "END", ("stop_sequence", "END")),
    ("stop", None, ("end_turn", None)),
    ("stop", 2, ("end_turn", None)),         # the EOS token id, not a client's sequence
    ("length", None, ("max_tokens", None)),
])
def test_stop_reasons(finish: str, stop_reason: Any, expected: tuple[str, Any]) -> None:
    evs, body = run(MessagesShaper("msg_1", "m", ["END"]),
                    [[Delta(id="r", text="hi", prompt_tokens=3)],
                     [Delta(id="r", finish_reason=finish, stop_reason=stop_reason)]], 2)
    check_grammar(evs)
    assert (body["stop_reason"], body["stop_sequence"]) == expected
    assert (evs[-2][1]["delta"]["stop_reason"], evs[-2][1]["delta"]["stop_sequence"]) == expected


def test_errors_take_anthropics_shape_under_messages_only() -> None:
    status, body = shaped(TooManyRequests("queue full"), "/v1/messages")
    assert status == 529 and body == {"type": "error", "error": {
        "type": "overloaded_error", "message": "queue full"}}
    assert shaped(BadRequest("x"), "/v1/messages/count_tokens")[1]["error"]["type"] == \
        "invalid_request_error"
    assert shaped(APIError("k", status=401), "/v1/messages")[1]["error"]["type"] == \
        "authentication_error"
    assert shaped(APIError("boom"), "/v1/messages")[1]["error"]["type"] == "api_error"
    assert shaped(TooManyRequests("queue full"), "/v1/chat/completions")[0] == 429
    event = MessagesShaper("msg_1", "m", []).error_event(APIError("lost", status=502))
    assert events(event) == [("error", {"type": "error", "error": {
        "type": "api_error", "message": "lost"}})]
