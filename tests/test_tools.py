"""Tool calling against a real worker: ``smollm2`` runs a ChatML template with Hermes-style
tools (``builtin:chatml-tools``, ``shared/templates/``) and vLLM's ``hermes`` parser.

``auto`` is made deterministic by forcing the model's text with a ``structured_outputs``
regex, so vLLM's parser runs on real output; ``required`` and named choices are sampled at
temperature 1.0 and must produce arguments that validate against the tool's schema every
time.
"""

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

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 24},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object",
         "properties": {"timezone": {"type": "string", "minLength": 1, "maxLength": 32}},
         "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time",
                                           "description": "Current time in a time zone",
                                           "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
# What the model is forced to write in auto mode: text, then one Hermes tool call.
FORCED = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
          r'\{"city": "Paris", "unit": "celsius"\}\}\n</tool_call>')


def check_calls(calls: list[Any]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])


def test_required_and_named_arguments_validate_20_of_20(aclient) -> None:  # type: ignore[no-untyped-def]
    async def ask(choice: Any) -> Any:
        # One call each (parallel_tool_calls: false caps the array at one item), so the
        # token budget always covers it: at temperature 1.0 this model may otherwise go on
        # writing calls until "length" cuts the last one short.
        return await aclient.chat.completions.create(
            model="smollm2", messages=ASK, tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, temperature=1.0, max_tokens=120)

    async def run() -> list[Any]:
        named = {"type": "function", "function": {"name": "get_time"}}
        return await asyncio.gather(*[ask("required") for _ in range(20)],
                                    *[ask(named) for _ in range(20)])

    answers = asyncio.run(run())
    for i, out in enumerate(answers):
        validate("CreateChatCompletionResponse", out.model_dump(exclude_unset=True))
        choice = out.choices[0]
        check_calls(choice.message.tool_calls)
        assert len(choice.message.tool_calls) == 1
        if i < 20:
            assert choice.finish_reason == "tool_calls"
        else:  # a named function: exactly that one, and a plain stop, as OpenAI answers
            assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
            assert choice.finish_reason == "stop"
        assert not choice.message.content


def test_required_streams_conforming_tool_call_chunks(client) -> None:  # type: ignore[no-untyped-def]
    stream = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
        temperature=0, max_tokens=400, stream=True)
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in stream:
        validate("CreateChatCompletionStreamResponse", chunk.model_dump(exclude_unset=True))
        for choice in chunk.choices:
            assert not choice.delta.content
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "args": ""})
                if tc.id:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"], call["name"] = tc.id, tc.function.name
                call["args"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert sorted(calls) == list(range(len(calls)))
    for call in calls.values():
        assert call["id"] and call["name"] in SCHEMAS
        jsonschema.validate(json.loads(call["args"]), SCHEMAS[call["name"]])


def test_auto_parses_the_models_call_and_keeps_markup_out_of_content(client) -> None:  # type: ignore[no-untyped-def]
    out = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, max_tokens=80,
        extra_body={"structured_outputs": {"regex": FORCED}})
    validate("CreateChatCompletionResponse", out.model_dump(exclude_unset=True))
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_auto_streams_text_before_the_call_then_its_pieces(client) -> None:  # type: ignore[no-untyped-def]
    stream = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, max_tokens=80, stream=True,
        extra_body={"structured_outputs": {"regex": FORCED}})
    order, text, args, names, finish = [], "", "", [], None
    for chunk in stream:
        validate("CreateChatCompletionStreamResponse", chunk.model_dump(exclude_unset=True))
        for choice in chunk.choices:
            if choice.delta.content:
                order.append("text")
                text += choice.delta.content
            for tc in choice.delta.tool_calls or []:
                order.append("call")
                names += [tc.function.name] if tc.function.name else []
                args += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert text == "Let me check.\n" and "<tool_call>" not in text
    assert order.index("call") > 0 and "text" not in order[order.index("call"):]
    assert order.count("call") > 2, "arguments arrive in several pieces"
    assert names == ["get_weather"]
    assert json.loads(args) == {"city": "Paris", "unit": "celsius"}
    assert finish == "tool_calls"


def test_round_trip_renders_calls_and_results_through_the_template(client, base_url: str) -> None:  # type: ignore[no-untyped-def]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    r = httpx.post(f"{base_url}/tokenize", timeout=60,
                   json={"model": "smollm2", "messages": history, "tools": TOOLS})
    assert r.status_code == 200, r.text
    prompt = httpx.post(f"{base_url}/detokenize", timeout=60,
                        json={"model": "smollm2", "tokens": r.json()["tokens"]}).json()["prompt"]
    # The call the assistant made and the tool's answer both reach the model.
    assert '"name": "get_weather"' in prompt and '"city": "Paris"' in prompt
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in prompt
    assert '"name": "get_time"' in prompt  # the tools themselves are in the system turn
    out = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS,
                                         tool_choice="none", max_tokens=20, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls


def test_legacy_functions_map_onto_tools(client) -> None:  # type: ignore[no-untyped-def]
    out = client.chat.completions.create(
        model="smollm2", messages=ASK, functions=[t["function"] for t in TOOLS],
        function_call={"name": "get_weather"}, temperature=1.0, max_tokens=120)
    validate("CreateChatCompletionResponse", out.model_dump(exclude_unset=True))
    message = out.choices[0].message
    assert message.function_call.name == "get_weather" and not message.tool_calls
    jsonschema.validate(json.loads(message.function_call.arguments), WEATHER)


def test_tool_requests_the_server_cannot_honour_are_400(base_url: str) -> None:
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "smollm2", "tool_choice"),
        ({"tools": [{"type": "web_search"}]}, "smollm2", "tools[0].function"),
        ({"tools": [{"type": "custom", "function": TOOLS[0]["function"]}]}, "smollm2",
         "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "smollm2", "tool_choice"),
        # smollm2-b has no tool_parser, so it cannot decide to call a tool by itself
        ({"tools": TOOLS}, "smollm2-b", "tool_choice"),
    ]
    for extra, model, param in cases:
        r = httpx.post(f"{base_url}/chat/completions", timeout=300,
                       json={"model": model, "messages": ASK, "max_tokens": 5, **extra})
        assert r.status_code == 400, (extra, r.text)
        validate("ErrorResponse", r.json())
        assert r.json()["error"]["param"] == param, r.text
        assert re.search(r"\w", r.json()["error"]["message"])


AGENT_ASKS = ["What is the weather in Paris? Use the tool.",
              "What time is it in Tokyo? Use the tool."]


def _auto_verdict(content: str, calls: list[tuple[str, str]], finish: str | None) -> str:
    """``call`` (every call declared, its arguments valid JSON of its schema), ``text``,
    or what is broken."""
    if "<tool_call>" in content or "</tool_call>" in content:
        return f"markup in content: {content!r}"
    for name, args in calls:
        if name not in SCHEMAS:
            return f"undeclared tool {name!r}"
        try:
            jsonschema.validate(json.loads(args), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError) as err:
            return f"arguments {args!r} of {name}: {err}"
    if bool(calls) != (finish == "tool_calls"):
        return f"finish_reason {finish} with {len(calls)} calls"
    return "call" if calls else "text"


def test_auto_calls_name_declared_tools_with_valid_arguments(aclient) -> None:  # type: ignore[no-untyped-def]
    """``tool_choice: auto`` as agents send it, streamed and not, at temperature 1.0 with
    ``logit_bias`` pushing ``<`` (the first token of ``<tool_call>``), so that the model
    starts calls and writes markup everywhere: with the default ``tool_strict_level``
    (``parameter``: hermes has a structural tag) every answer is a text or a call of a
    declared tool with valid arguments (7 of 10 unstreamed ones here). With the tag off
    (``tool_strict_level: auto``, as every request was on 0d84075) 8 of 10 such answers
    left ``<tool_call>`` markup in ``content``. One call each
    (``parallel_tool_calls: false``), so ``max_tokens`` never cuts one short."""
    async def ask(seed: int, stream: bool) -> str:
        body: dict[str, Any] = {
            "model": "smollm2", "tools": TOOLS, "temperature": 1.0, "seed": seed,
            "max_tokens": 300, "parallel_tool_calls": False, "logit_bias": {"44": 5},
            "messages": [{"role": "user", "content": AGENT_ASKS[seed % 2]}]}
        if not stream:
            out = await aclient.chat.completions.create(**body)
            validate("CreateChatCompletionResponse", out.model_dump(exclude_unset=True))
            m = out.choices[0].message
            return _auto_verdict(m.content or "", [(c.function.name, c.function.arguments)
                                                   for c in m.tool_calls or []],
                                 out.choices[0].finish_reason)
        content, calls, finish = "", {}, None  # type: tuple[str, dict[int, list[str]], Any]
        async for chunk in await aclient.chat.completions.create(**body, stream=True):
            validate("CreateChatCompletionStreamResponse", chunk.model_dump(exclude_unset=True))
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for tc in choice.delta.tool_calls or []:
                    call = calls.setdefault(tc.index, ["", ""])
                    call[0] += tc.function.name or ""
                    call[1] += tc.function.arguments or ""
                finish = choice.finish_reason or finish
        return _auto_verdict(content, [(n, a) for n, a in calls.values()], finish)

    async def run() -> list[str]:
        return list(await asyncio.gather(*(ask(seed, stream) for seed in range(10)
                                           for stream in (False, True))))

    verdicts = asyncio.run(run())
    broken = [v for v in verdicts if v not in ("call", "text")]
    assert not broken, broken
    assert verdicts.count("call") >= 5, verdicts  # the bias makes it call


def test_models_say_how_auto_calls_are_held(base_url: str) -> None:
    models = {m["id"]: m for m in httpx.get(f"{base_url}/models", timeout=30).json()["data"]}
    assert models["smollm2"]["tool_parser"] == "hermes"
    assert models["smollm2"]["auto_tool_calls"] == "parameter"
    assert "auto_tool_calls" not in models["smollm2-b"]  # no tool_parser: no auto calls
