"""OpenAI's Responses API against real workers, with the official ``openai`` SDK.

Every Response object, item list and streamed event is validated against OpenAI's
Responses schemas (``tests/conformance.py``); streams are read raw with httpx where the
SDK would hide a field (``sequence_number``, the ``event:`` line). ``smollm2`` runs the
Hermes tools template; ``smollm2-b`` a reasoning parser. Generations stay short.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conformance import validate_responses
from tests.test_tools import CLOCK, SCHEMAS, WEATHER

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "get_time", "description": "Current time in a time zone",
          "parameters": CLOCK, "strict": True}]
ASK = "What is the weather in Paris right now?"
LONG = {"structured_outputs": {"regex": "[a-z]{3}( [a-z]{3}){400}"}}
"""Forces an answer far longer than any ``max_output_tokens`` these tests give."""
SHORT = {"structured_outputs": {"regex": "Hello, [a-z]{2,8}[.]"}}
"""Forces an answer that ends well within 16 tokens."""


def raw(response: Any) -> dict[str, Any]:
    """An SDK object as the server sent it."""
    body: dict[str, Any] = response.model_dump(exclude_unset=True)
    return body


def stream_events(base_url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed create's events, each checked: its ``event:`` line names its type, it
    validates, and ``sequence_number`` counts from 0."""
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{base_url}/responses", json={**body, "stream": True},
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == name
                assert event["sequence_number"] == len(events)
                validate_responses("ResponseStreamEvent", event)
                events.append(event)
    return events


def check_item_events(events: list[dict[str, Any]]) -> None:
    """Each output item opens, streams and closes in order, and its done item matches."""
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1]["response"]
    validate_responses("Response", final)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]
    for item in done:
        mine = [e for e in events if e.get("item_id") == item["id"]
                or e.get("item", {}).get("id") == item["id"]]
        steps = [e["type"].removeprefix("response.") for e in mine]
        assert steps[0] == "output_item.added" and steps[-1] == "output_item.done"
        deltas = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        if item["type"] == "function_call":
            assert deltas == item["arguments"]
            assert steps[-2] == "function_call_arguments.done"
        else:
            assert deltas == item["content"][0]["text"]
            assert steps[1] == "content_part.added" and steps[-2] == "content_part.done"


def test_create_get_input_items_delete(client, base_url: str) -> None:  # type: ignore[no-untyped-def]
    out = client.responses.create(model="smollm2", input="Say hello.", instructions="Be brief.",
                                  max_output_tokens=16, temperature=0,
                                  metadata={"case": "crud"})
    body = raw(out)
    validate_responses("Response", body)
    assert out.id.startswith("resp_") and out.model == "smollm2" and out.output_text
    assert out.status in ("completed", "incomplete")
    (message,) = out.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert message.content[0].annotations == []
    assert out.usage.input_tokens > out.usage.input_tokens_details.cached_tokens >= 0
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert body["metadata"] == {"case": "crud"} and body["instructions"] == "Be brief."

    got = client.responses.retrieve(out.id)
    assert raw(got) == body
    items = httpx.get(f"{base_url}/responses/{out.id}/input_items", timeout=30).json()
    validate_responses("ResponseItemList", items)
    (item,) = items["data"]
    assert item["role"] == "user" and item["content"] == [{"type": "input_text",
                                                           "text": "Say hello."}]
    assert [i.id for i in client.responses.input_items.list(out.id)] == [item["id"]]

    client.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)
    r = httpx.get(f"{base_url}/responses/{out.id}", timeout=30)
    assert r.status_code == 404
    validate_responses("ErrorResponse", r.json())


def test_stream_events_in_order_and_the_sdk_helper(client, base_url: str) -> None:  # type: ignore[no-untyped-def]
    events = stream_events(base_url, {"model": "smollm2", "input": "Say hello.",
                                      "max_output_tokens": 16, "temperature": 0})
    check_item_events(events)
    final = events[-1]["response"]
    assert final["usage"]["output_tokens"] > 0
    assert client.responses.retrieve(final["id"]).output_text == \
        final["output"][0]["content"][0]["text"]

    with client.responses.stream(model="smollm2", input="Say hello.", max_output_tokens=16,
                                 temperature=0, store=False, extra_body=SHORT) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        response = stream.get_final_response()
    assert text and response.output_text == text
    with pytest.raises(openai.NotFoundError):  # store: false
        client.responses.retrieve(response.id)


def test_max_output_tokens_is_incomplete(client, base_url: str) -> None:  # type: ignore[no-untyped-def]
    out = client.responses.create(model="smollm2", input="Spell.", max_output_tokens=16,
                                  extra_body=LONG)
    validate_responses("Response", raw(out))
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].status == "incomplete" and out.usage.output_tokens == 16
    events = stream_events(base_url, {"model": "smollm2", "input": "Spell.",
                                      "max_output_tokens": 16, **LONG})
    check_item_events(events)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_function_calls_required_and_named(client) -> None:  # type: ignore[no-untyped-def]
    for choice, names in (("required", set(SCHEMAS)),
                          ({"type": "function", "name": "get_time"}, {"get_time"})):
        out = client.responses.create(model="smollm2", input=ASK, tools=TOOLS,
                                      tool_choice=choice, parallel_tool_calls=False,
                                      temperature=0, max_output_tokens=120)
        validate_responses("Response", raw(out))
        (call,) = [item for item in out.output if item.type == "function_call"]
        assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
        assert call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_streamed_call_read_from_output_item_done(client, base_url: str) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "smollm2", "input": ASK, "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 120}
    events = stream_events(base_url, body)
    check_item_events(events)
    (call,) = [e["item"] for e in events if e["type"] == "response.output_item.done"
               and e["item"]["type"] == "function_call"]
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    with client.responses.stream(**{**body, "store": False}) as stream:
        calls = [e.item for e in stream if e.type == "response.output_item.done"
                 and e.item.type == "function_call"]
    assert [c.name for c in calls] == [call["name"]]


def test_previous_response_id_continues_the_conversation(client, base_url: str) -> None:  # type: ignore[no-untyped-def]
    first = client.responses.create(
        model="smollm2", input=ASK, tools=TOOLS, parallel_tool_calls=False, temperature=0,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=120)
    (call,) = [item for item in first.output if item.type == "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": "18 degrees and sunny"}
    second = client.responses.create(model="smollm2", previous_response_id=first.id,
                                     input=[result], tools=TOOLS, tool_choice="none",
                                     max_output_tokens=16, temperature=0)
    validate_responses("Response", raw(second))
    assert second.previous_response_id == first.id and second.output_text
    # The whole conversation is what the second response saw, newest first.
    items = httpx.get(f"{base_url}/responses/{second.id}/input_items", timeout=30).json()
    validate_responses("ResponseItemList", items)
    assert [i["type"] for i in items["data"]] == ["function_call_output", "function_call",
                                                  "message"]
    assert items["data"][1]["call_id"] == call.call_id
    page = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert [i.type for i in page.data] == ["message"] and page.has_more
    # The stored turns render as the same prompt as the conversation sent in full.
    spelled = [{"role": "user", "content": ASK},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments}, result]
    count = client.responses.input_tokens.count
    chained = count(model="smollm2", previous_response_id=first.id, input=[result],
                    tools=TOOLS).input_tokens
    assert chained == count(model="smollm2", input=spelled, tools=TOOLS).input_tokens
    assert chained == second.usage.input_tokens


def test_input_tokens_is_what_create_reports(client, base_url: str) -> None:  # type: ignore[no-untyped-def]
    ask = {"model": "smollm2", "instructions": "Answer in French.", "tools": TOOLS,
           "input": [{"role": "developer", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "input_text", "text": ASK}]}],
           "reasoning": {"effort": "low"}}
    r = httpx.post(f"{base_url}/responses/input_tokens", json=ask, timeout=60)
    assert r.status_code == 200, r.text
    validate_responses("TokenCountsResource", r.json())
    counted = r.json()["input_tokens"]
    out = client.responses.create(**ask, tool_choice="none", max_output_tokens=16)
    assert out.usage.input_tokens == counted > 0
    # reasoning.effort reaches the template as chat's reasoning_effort does
    plain = {k: v for k, v in ask.items() if k != "reasoning"}
    assert client.responses.input_tokens.count(**plain).input_tokens < counted


def test_tools_of_other_types_are_ignored(client) -> None:  # type: ignore[no-untyped-def]
    others: list[Any] = [
        {"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]},
        {"type": "mcp", "server_label": "x", "server_url": "https://example.invalid"},
        {"type": "custom", "name": "grep"}, {"type": "code_interpreter",
                                             "container": {"type": "auto"}},
        {"type": "a_tool_from_the_future", "whatever": [1, 2]}]
    out = client.responses.create(model="smollm2", input="Say hello.", tools=others,
                                  max_output_tokens=16, temperature=0)
    validate_responses("Response", raw(out))
    assert out.tools == [] and out.output_text


def test_a_codex_history_with_custom_and_shell_calls_is_answered(client: Any) -> None:
    """On 651c79a each of these items was a 400; Codex sends them back in later turns."""
    history: list[Any] = [
        {"role": "user", "content": "List the files."},
        {"type": "local_shell_call", "call_id": "s1", "status": "completed", "id": "lsh_1",
         "action": {"type": "exec", "command": ["ls"]}},
        {"type": "local_shell_call_output", "call_id": "s1", "output": "main.py"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch",
         "input": "*** Begin Patch\n*** End Patch"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        {"role": "user", "content": "What did you find?"}]
    out = client.responses.create(model="smollm2", input=history, max_output_tokens=8)
    validate_responses("Response", raw(out))
    assert out.status in ("completed", "incomplete") and out.usage.input_tokens > 20


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "hi", "temperature": 5}, 400, "temperature"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": "many"}, 400, "max_output_tokens"),
    ({}, 400, "input"),
    ({"input": 7}, 400, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400,
     "input[0].content[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400,
     "input[0].call_id"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400,
     "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, 400, "tools[0].name"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, 400, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400,
     "text.format"),
    ({"input": "hi", "truncation": "auto"}, 400, "truncation"),
    ({"input": "hi", "background": True, "stream": True}, 400, "background"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "hi", "model": "smollm2-embed"}, 400, "model"),
    ({"input": "word " * 4000}, 400, "input"),  # past the context: the worker's refusal
])
def test_bad_fields_are_errors_naming_them(base_url: str, body: dict[str, Any], status: int,
                                           param: str) -> None:
    r = httpx.post(f"{base_url}/responses", json={"model": "smollm2", **body}, timeout=60)
    assert r.status_code == status, r.text
    validate_responses("ErrorResponse", r.json())
    assert r.json()["error"]["param"] == param, r.text


def test_background_poll_and_cancel(client, base_url: str) -> None:  # type: ignore[no-untyped-def]
    queued = client.responses.create(model="smollm2", input="Say hello.", background=True,
                                     max_output_tokens=16, temperature=0)
    validate_responses("Response", raw(queued))
    assert queued.status == "queued" and queued.background
    deadline = time.monotonic() + 120
    while (got := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    validate_responses("Response", raw(got))
    assert got.status in ("completed", "incomplete") and got.output_text
    assert client.responses.cancel(queued.id).status == got.status  # finished: as it is

    long = client.responses.create(model="smollm2", input="Spell.", background=True,
                                   max_output_tokens=1500, extra_body=LONG)
    cancelled = client.responses.cancel(long.id)
    validate_responses("Response", raw(cancelled))
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    # vLLM aborts a cancelled request in its own next step: its count reaches 0 soon after
    # (a request left generating never would).
    deadline = time.monotonic() + 30
    while True:
        model = httpx.get(f"{base_url}/models/smollm2", timeout=30).json()
        if model["in_flight"] == 0 and model.get("worker_in_flight", 0) == 0:
            break
        assert time.monotonic() < deadline, model
        time.sleep(0.1)

    plain = client.responses.create(model="smollm2", input="Hi.", max_output_tokens=16)
    r = httpx.post(f"{base_url}/responses/{plain.id}/cancel", timeout=30)
    assert r.status_code == 400
    validate_responses("ErrorResponse", r.json())


def test_reasoning_item_before_the_message(base_url: str) -> None:
    forced = {"structured_outputs": {"regex": r"<think>[a-z ]{5,30}</think>[A-Za-z ]{3,30}"}}
    events = stream_events(base_url, {"model": "smollm2-b", "input": "Say hello.",
                                      "max_output_tokens": 60, **forced})
    check_item_events(events)
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    reasoning = final["output"][0]
    assert reasoning["id"].startswith("rs_") and reasoning["content"][0]["text"]
    answer = final["output"][1]["content"][0]["text"]
    assert "think>" not in reasoning["content"][0]["text"] + answer
    assert any(e["type"] == "response.reasoning_text.delta" for e in events)
    details = final["usage"]["output_tokens_details"]
    assert 0 < details["reasoning_tokens"] < final["usage"]["output_tokens"]


def test_store_shows_in_metrics(client, base_url: str) -> None:  # type: ignore[no-untyped-def]
    def figures() -> dict[str, float]:
        text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=30).text
        return {s.name: s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name.startswith("modelyard_responses_stored")}

    before = figures()
    out = client.responses.create(model="smollm2", input="Hi.", max_output_tokens=16)
    after = figures()
    assert after["modelyard_responses_stored"] == before["modelyard_responses_stored"] + 1
    assert after["modelyard_responses_stored_bytes"] > before["modelyard_responses_stored_bytes"]
    client.responses.delete(out.id)
    assert figures() == before
