"""The Responses API without a server: request translation, the shaper's events and
objects (checked against OpenAI's Responses schemas), the bounded store, background runs."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router.access.admission import Principal, principal_of
from router.api.responses import shaper as shaper_module
from router.api.responses.background import BackgroundRuns
from router.api.responses.schema import (
    CreateResponseRequest,
    ResponseItem,
    chat_messages,
    create_generate,
    echo,
    normalize,
)
from router.api.responses.shaper import ResponseShaper
from router.api.responses.store import ResponseStore, StoreCollector, encode_items
from router.errors import BadRequest, WorkerLost
from router.workers.link import Usage
from shared.protocol import Delta, TokenLogprob, ToolCallDelta, TopLogprob
from tests.conformance import validate_responses

TOOL = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}


def request(**body: Any) -> CreateResponseRequest:
    return msgspec.json.decode(json.dumps({"model": "m", **body}), type=CreateResponseRequest)


def refused(**body: Any) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        create_generate(request(**body), "resp_x", [])
    return info.value


def events(data: bytes) -> list[dict[str, Any]]:
    """SSE frames as events, each checked: its ``event:`` line names its type and it
    validates against OpenAI's ``ResponseStreamEvent``."""
    out = []
    for frame in data.decode().split("\n\n"):
        if frame:
            name, payload = frame.split("\n")
            event = json.loads(payload.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            validate_responses("ResponseStreamEvent", event)
            out.append(event)
    return out


def shaped(batches: list[list[Delta]], streaming: bool, **req: Any
           ) -> tuple[bytes, dict[str, Any], list[dict[str, Any]]]:
    """What the relay does with a delta stream; the bytes, the final object, what was stored."""
    r = request(input="hi", **req)
    gen, _ = create_generate(r, "resp_abc", [])
    stored: list[dict[str, Any]] = []
    shaper = ResponseShaper("resp_abc", echo(r, gen), streaming=streaming,
                            logprobs=gen.sampling.logprobs, on_done=stored.append).bind("m")
    usage, out = Usage(), b""
    for batch in batches:
        for d in batch:
            usage.add(d)
        if streaming:
            out += shaper.chunks(batch)
        else:
            shaper.add(batch)
    if streaming:
        out += shaper.close(usage)
    final = events(out)[-1]["response"] if streaming else shaper.body(usage)
    validate_responses("Response", final)
    return out, final, stored


MIXED = [[Delta(id="r", reasoning="hm", tokens=2, prompt_tokens=9, cached_tokens=4)],
         [Delta(id="r", reasoning=" ok", text="Hi", tokens=2)],
         [Delta(id="r", tokens=1, tool_calls=[ToolCallDelta(index=0, id="call_7",
                                                            name="get_time")])],
         [Delta(id="r", tokens=3, tool_calls=[ToolCallDelta(index=0, arguments='{"tz": 1}')],
                finish_reason="tool_calls", prompt_tokens=9, cached_tokens=4)]]


def test_stream_events_carry_sequence_numbers_and_items_in_order() -> None:
    r = request(input="hi", tools=[TOOL])
    gen, _ = create_generate(r, "resp_abc", [])
    stored: list[dict[str, Any]] = []
    shaper = ResponseShaper("resp_abc", echo(r, gen), streaming=True,
                            on_done=stored.append).bind("m")
    usage, out = Usage(), b""
    for batch in MIXED:
        for d in batch:
            usage.add(d)
        out += shaper.chunks(batch)
    out += shaper.close(usage)
    evs = events(out)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert [e["type"].removeprefix("response.") for e in evs] == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta",
        "reasoning_text.delta", "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
        "output_item.done", "completed"]
    final = evs[-1]["response"]
    validate_responses("Response", final)
    assert stored == [final]
    reasoning, message, call = final["output"]
    assert reasoning["id"].startswith("rs_") and reasoning["content"] == [
        {"type": "reasoning_text", "text": "hm ok"}]
    assert message["id"].startswith("msg_") and message["content"] == [
        {"type": "output_text", "text": "Hi", "annotations": [], "logprobs": []}]
    assert call == {"id": call["id"], "type": "function_call", "status": "completed",
                    "call_id": "call_7", "name": "get_time", "arguments": '{"tz": 1}'}
    assert call["id"].startswith("fc_")
    assert final["usage"] == {"input_tokens": 9, "output_tokens": 8, "total_tokens": 17,
                              "input_tokens_details": {"cached_tokens": 4,
                                                       "cache_write_tokens": 0},
                              "output_tokens_details": {"reasoning_tokens": 2}}
    assert final["status"] == "completed" and final["completed_at"] >= final["created_at"]
    assert [e["item"] for e in evs if e["type"] == "response.output_item.done"] == \
        final["output"]
    # A call's item names it from the start: the SDK's stream helper matches items by it.
    added = [e["item"] for e in evs if e["type"] == "response.output_item.added"]
    assert {k: added[2][k] for k in ("call_id", "name", "arguments")} == {
        "call_id": "call_7", "name": "get_time", "arguments": ""}


def test_aggregate_body_equals_the_streamed_final_object(monkeypatch: pytest.MonkeyPatch) -> None:
    # Both objects stamp ``completed_at`` with the clock's second: a second boundary
    # between the two calls made them differ (seen once in a full unit run).
    monkeypatch.setattr(shaper_module.time, "time", lambda: 1_800_000_000.5)
    r = request(input="hi", tools=[TOOL])
    gen, _ = create_generate(r, "resp_abc", [])
    streamed = ResponseShaper("resp_abc", echo(r, gen), streaming=True, created_at=1).bind("m")
    whole = ResponseShaper("resp_abc", echo(r, gen), streaming=False, created_at=1).bind("m")
    usage = Usage()
    for batch in MIXED:
        for d in batch:
            usage.add(d)
        streamed.chunks(batch)
        whole.add(batch)
    final = events(streamed.close(usage))[-1]["response"]
    assert whole.body(usage) == final


def test_length_is_incomplete_and_the_open_item_too() -> None:
    r = request(input="hi", max_output_tokens=2)
    gen, _ = create_generate(r, "resp_abc", [])
    shaper = ResponseShaper("resp_abc", echo(r, gen), streaming=True).bind("m")
    usage = Usage()
    batch = [Delta(id="r", text="a b", tokens=2, finish_reason="length", prompt_tokens=3)]
    usage.add(batch[0])
    evs = events(shaper.chunks(batch) + shaper.close(usage))
    final = evs[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["completed_at"] is None
    assert final["response"]["output"][0]["status"] == "incomplete"
    assert evs[-2]["item"]["status"] == "incomplete"


def test_worker_failure_mid_stream_is_response_failed() -> None:
    r = request(input="hi")
    gen, _ = create_generate(r, "resp_abc", [])
    stored: list[dict[str, Any]] = []
    shaper = ResponseShaper("resp_abc", echo(r, gen), streaming=True,
                            on_done=stored.append).bind("m")
    out = shaper.chunks([Delta(id="r", text="par", tokens=1)])
    evs = events(out + shaper.error_event(WorkerLost("the worker died")))
    failed = evs[-1]
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "the worker died"}
    assert failed["response"]["output"][0]["status"] == "incomplete"
    assert "usage" not in failed["response"]
    assert stored == [failed["response"]]


def test_logprobs_when_included() -> None:
    lp = [TokenLogprob("Hi", -0.5, [TopLogprob("Hi", -0.5), TopLogprob("Yo", -1.0)])]
    batches = [[Delta(id="r", text="Hi", tokens=1, logprobs=lp, finish_reason="stop")]]
    out, final, _ = shaped(batches, True, include=["message.output_text.logprobs"],
                           top_logprobs=2)
    (delta,) = [e for e in events(out) if e["type"] == "response.output_text.delta"]
    assert delta["logprobs"][0]["token"] == "Hi"
    part = final["output"][0]["content"][0]
    assert part["logprobs"][0]["top_logprobs"][1]["token"] == "Yo"


def test_request_translation() -> None:
    r = request(instructions="Be brief.", tools=[TOOL, {"type": "web_search"}],
                tool_choice={"type": "function", "name": "get_time"},
                reasoning={"effort": "high"}, max_output_tokens=32, temperature=0.5,
                input=[{"role": "developer", "content": "Use metric."},
                       {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                    {"type": "input_text", "text": "b"}]},
                       {"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": "Let me see."}]},
                       {"type": "reasoning", "summary": []},
                       {"type": "function_call", "call_id": "c1", "name": "get_time",
                        "arguments": "{}"},
                       {"type": "function_call_output", "call_id": "c1",
                        "output": [{"type": "input_text", "text": "noon"}]}])
    gen, items = create_generate(r, "resp_x", [])
    assert [(m.role, m.content) for m in gen.messages or []] == [
        ("system", "Be brief."), ("system", "Use metric."), ("user", "ab"),
        ("assistant", "Let me see."), ("tool", "noon")]
    assert gen.messages is not None and gen.messages[3].tool_calls is not None
    assert [(c.id, c.name) for c in gen.messages[3].tool_calls] == [("c1", "get_time")]
    assert gen.messages[4].tool_call_id == "c1"
    assert [t.name for t in gen.tools or []] == ["get_time"]  # web_search: ignored
    assert (gen.tool_choice, gen.tool_name) == ("function", "get_time")
    assert gen.template_kwargs == {"reasoning_effort": "high"}
    assert (gen.sampling.max_tokens, gen.sampling.temperature) == (32, 0.5)
    listed = {"object": "list", "data": msgspec.to_builtins(items), "has_more": False,
              "first_id": items[0].id, "last_id": items[-1].id}
    validate_responses("ResponseItemList", listed)
    assert [i.id[:3] for i in items] == ["msg", "msg", "msg", "rs_", "fc_", "fco"]


def test_text_format_and_allowed_tools() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    gen, _ = create_generate(request(input="hi", text={"format": {
        "type": "json_schema", "name": "a", "schema": schema}}), "resp_x", [])
    assert gen.constraint is not None and gen.constraint.json == schema
    assert gen.constraint.param == "text.format"
    gen, _ = create_generate(request(input="hi", text={"format": {"type": "json_object"}}),
                             "resp_x", [])
    assert gen.constraint is not None and gen.constraint.json_object
    other = {**TOOL, "name": "other"}
    gen, _ = create_generate(request(input="hi", tools=[TOOL, other], tool_choice={
        "type": "allowed_tools", "mode": "required",
        "tools": [{"type": "function", "name": "other"}]}), "resp_x", [])
    assert [t.name for t in gen.tools or []] == ["other"] and gen.tool_choice == "required"


def test_echo_validates_as_the_response_object() -> None:
    r = request(input="hi", tools=[TOOL], tool_choice="none", reasoning={"effort": "low"},
                text={"format": {"type": "json_schema", "schema": {"type": "object"}}},
                metadata={"k": "v"}, store=False)
    gen, _ = create_generate(r, "resp_x", [])
    shaper = ResponseShaper("resp_x", echo(r, gen), streaming=False).bind("m")
    body = shaper.response("queued")
    validate_responses("Response", body)
    assert body["text"]["format"]["name"] == "response" and body["store"] is False
    assert body["tool_choice"] == "none" and body["metadata"] == {"k": "v"}


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "output_audio"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image",
                                                   "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "top_p": 0}, "top_p"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "tools": [TOOL, TOOL]}, "tools"),
    ({"input": "x", "tools": [{**TOOL, "parameters": {"n": 2**64}}]}, "tools[0].parameters"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "none"}},
     "tool_choice.mode"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "reasoning": {"summary": ""}}, "reasoning.summary"),
    ({"input": "x", "tools": [TOOL], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_object"}},
      "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "background": True, "store": False}, "store"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
])
def test_bad_requests_name_the_field(body: dict[str, Any], param: str) -> None:
    assert refused(**body).param == param


def test_store_bounds_count_bytes_and_age() -> None:
    now = [0.0]
    store = ResponseStore(max_items=3, max_bytes=10_000, ttl=60, clock=lambda: now[0])
    items = encode_items(normalize("hello"))
    for i in range(4):
        store.put(f"resp_{i}", {"id": f"resp_{i}", "status": "completed", "output": []}, items)
    assert len(store) == 3 and store.get("resp_0") is None  # the oldest went first
    assert store.evicted["count"] == 1
    kept = [store.get(f"resp_{i}") for i in (1, 2, 3)]
    assert store.bytes == sum(e.size for e in kept if e is not None)
    big = {"id": "resp_big", "status": "completed", "output": [], "pad": "x" * 5_000}
    store.put("resp_big", big, items)
    assert store.bytes <= 10_000 and store.get("resp_big") is not None
    store.put("resp_huge", {**big, "pad": "x" * 20_000}, items)  # alone over the cap: not kept
    assert store.get("resp_huge") is None and store.evicted["bytes"] >= 1
    now[0] = 61.0
    assert len(store) == 0 and store.bytes == 0 and store.evicted["expired"] >= 1
    store.put("resp_a", {"id": "resp_a", "status": "completed", "output": []}, items)
    assert store.delete("resp_a") and not store.delete("resp_a") and store.bytes == 0


def test_stored_conversation_is_input_then_output() -> None:
    store = ResponseStore()
    output = [{"id": "fc_1", "type": "function_call", "status": "completed", "call_id": "c",
               "name": "f", "arguments": "{}"}]
    store.put("resp_1", {"id": "resp_1", "status": "completed", "output": output},
              encode_items(normalize("hi")))
    stored = store.get("resp_1")
    assert stored is not None
    assert [i.type for i in stored.conversation()] == ["message", "function_call"]
    assert stored.conversation()[1] == ResponseItem(
        type="function_call", id="fc_1", status="completed", call_id="c", name="f",
        arguments="{}")


def test_store_collector_shows_count_bytes_and_evictions() -> None:
    store = ResponseStore(max_items=1)
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    items = encode_items(normalize("hi"))
    store.put("resp_1", {"status": "completed"}, items)
    store.put("resp_2", {"status": "completed"}, items)
    text = generate_latest(registry).decode()
    assert "modelyard_responses_stored 1.0" in text
    assert f"modelyard_responses_stored_bytes {float(store.bytes)}" in text
    assert 'modelyard_responses_evicted_total{reason="count"} 1.0' in text


def test_background_run_ends_when_cancelled() -> None:
    async def scenario() -> list[str]:
        runs = BackgroundRuns()
        seen: list[str] = []

        async def run(req: Any) -> None:
            assert principal_of(req.scope) is alice  # it asks as the key that made it
            seen.append((await req.receive())["type"])  # the relay's disconnect watch

        alice = Principal("alice", "user")
        runs.start("resp_1", run, alice)
        await asyncio.sleep(0)
        assert "resp_1" in runs
        await runs.cancel("resp_1")
        await asyncio.sleep(0)
        assert "resp_1" not in runs
        await runs.cancel("resp_1")  # not running: nothing to do
        return seen

    assert asyncio.run(scenario()) == ["http.disconnect"]


def test_routes_through_the_app_without_a_worker() -> None:
    """``build_app``'s wiring: errors in OpenAI's shape, naming the field; a 405 lists
    both methods of ``/v1/responses/{id}``; the store's figures in ``/metrics``."""
    from starlette.testclient import TestClient

    from router.app import build_app
    from shared.preset_loader import build_preset

    preset = build_preset({"models": {"chat-a": {"model": "/a"}}})
    with TestClient(build_app(preset)) as client:
        bad = client.post("/v1/responses", json={"model": "chat-a", "input": "x",
                                                 "temperature": 9})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/input_items"),
                             ("POST", "/cancel")):
            r = client.request(method, f"/v1/responses/resp_nope{path}")
            assert r.status_code == 404, (method, path, r.text)
            validate_responses("ErrorResponse", r.json())
        r = client.put("/v1/responses/resp_nope")
        assert r.status_code == 405 and {"GET", "DELETE"} <= set(
            r.headers["allow"].replace(" ", "").split(","))
        assert "modelyard_responses_stored 0.0" in client.get("/metrics").text


def test_every_history_item_codex_and_the_agents_sdk_send_is_taken() -> None:
    """On 651c79a each of these was a 400 ("input item type ... is not supported"): Codex
    sends its custom and shell calls back in later turns. Calls become the assistant's
    tool calls and their outputs tool turns; the rest is kept and left out of the prompt."""
    raw = msgspec.json.decode(json.dumps([
        {"role": "user", "content": "fix the bug"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch",
         "input": "*** Begin Patch\n*** End Patch"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"},
        {"type": "local_shell_call", "call_id": "s1", "status": "completed",
         "action": {"type": "exec", "command": ["ls", "-a"]}},
        {"type": "local_shell_call_output", "call_id": "s1", "output": ".  ..  main.py"},
        {"type": "mcp_call", "id": "m1", "name": "search", "server_label": "docs",
         "arguments": "{\"q\": \"x\"}", "output": "3 results"},
        {"type": "web_search_call", "id": "ws1", "status": "completed",
         "action": {"type": "search", "query": "vllm"}},
        {"type": "item_reference", "id": "msg_earlier"},
        {"type": "mcp_list_tools", "id": "ml1", "server_label": "docs"},
        {"type": "image_generation_call", "id": "ig1", "status": "completed"},
    ]), type=list[ResponseItem])
    items = normalize(raw)
    assert [i.type for i in items] == [
        "message", "custom_tool_call", "custom_tool_call_output", "local_shell_call",
        "local_shell_call_output", "mcp_call", "web_search_call", "item_reference",
        "mcp_list_tools", "image_generation_call"]
    assert items[7].id == "msg_earlier" and items[1].input.startswith("*** Begin Patch")  # type: ignore[union-attr]
    chat = chat_messages(items, None)
    assert [m.role for m in chat] == ["user", "assistant", "tool", "assistant", "tool",
                                      "assistant", "tool"]
    calls = [c for m in chat for c in m.tool_calls or []]
    assert [(c.id, c.name) for c in calls] == [("c1", "apply_patch"), ("s1", "local_shell"),
                                               ("m1", "search")]
    assert json.loads(calls[0].arguments) == {"input": "*** Begin Patch\n*** End Patch"}
    assert json.loads(calls[1].arguments)["command"] == ["ls", "-a"]
    assert [(m.tool_call_id, m.content) for m in chat if m.role == "tool"] == [
        ("c1", "Done!"), ("s1", ".  ..  main.py"), ("m1", "3 results")]
    # Kept as given in the store, and listed back, as the client sent them.
    again = msgspec.json.decode(encode_items(items), type=list[ResponseItem])
    assert again[6].action == {"type": "search", "query": "vllm"}
