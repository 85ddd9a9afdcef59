"""``tool_strict_level``: the structural tag that holds ``tool_choice: auto`` calls, checked
on xgrammar's own matcher with SmolLM2's tokenizer (no engine), the repeat check of
``worker/outputs.py`` on vLLM's hermes parser, and the preset key.

On 0d84075 none of this existed: an ``auto`` answer was sampled free, and the model could
name ``Paris`` as a tool, write arguments that are not JSON, or go on after its call.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared.config import STRUCTURAL_TAG_PARSERS, ConfigError, auto_tool_calls
from shared.preset_loader import load_preset
from shared.protocol import Delta

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"timezone": {"type": "string"}},
         "required": ["timezone"], "additionalProperties": False}


def call(name: str, args: str, newline: bool = True) -> str:
    nl = "\n" if newline else ""
    return f'<tool_call>{nl}{{"name": "{name}", "arguments": {args}}}{nl}</tool_call>'


PARIS = call("get_weather", '{"city": "Paris"}')
TOKYO = call("get_time", '{"timezone": "Asia/Tokyo"}')


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from worker.materialize import resolve_model_path
    return AutoTokenizer.from_pretrained(resolve_model_path("builtin:smollm2", None))


def grammar(tokenizer: Any, strict: dict[str, bool | None], parallel: bool = True,
            level: bool = True) -> tuple[Any, tuple[str, ...]]:
    """The engine's tag for two tools (``strict``: each tool's own flag; ``level``: the
    preset's ``parameter``), compiled by xgrammar."""
    import xgrammar as xgr

    from worker.engine import _auto_call_tag
    tools = [{"name": "get_weather", "parameters": WEATHER, "strict": strict["get_weather"]},
             {"name": "get_time", "parameters": CLOCK, "strict": strict["get_time"]}]
    for t in tools:  # as VllmEngine.auto_call_constraint decides
        t["strict"] = level if t["strict"] is None else t["strict"]
    built = _auto_call_tag("hermes", tools, parallel)
    assert built is not None
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))
    return compiler.compile_structural_tag(built[0]), built[1]


def accepts(compiled: Any, tokenizer: Any, text: str) -> bool:
    """Whether the grammar lets the model write ``text`` and then end its answer."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    return bool(matcher.accept_string(text)) and (
        matcher.is_terminated() or matcher.accept_token(tokenizer.eos_token_id))


def test_a_text_answer_stays_free_and_a_call_is_held_to_declared_tools(tokenizer: Any) -> None:
    g, ends = grammar(tokenizer, {"get_weather": None, "get_time": None})
    assert ends == ("}\n</tool_call>", "}</tool_call>")
    for free in ["The weather in Paris is sunny.", "", "I'd use a tool: `get_weather`.",
                 PARIS, "Let me check.\n" + PARIS, PARIS + "\n" + TOKYO,
                 call("get_weather", '{"city": "Lyon"}', newline=False)]:
        assert accepts(g, tokenizer, free), free
    for broken in [call("Paris", '{"city": "Paris"}'),                   # undeclared tool
                   call("get_weather", '{ db: { #countryInfoId: 12345}}'),  # not JSON
                   call("get_weather", '{"town": "Paris"}'),              # not its schema
                   call("get_weather", '{"city": 75}'),
                   PARIS + " and more words",                             # text after a call
                   "<tool_call>\nget_weather(Paris)\n</tool_call>"]:
        assert not accepts(g, tokenizer, broken), broken


def test_one_call_only_without_parallel_calls(tokenizer: Any) -> None:
    g, _ = grammar(tokenizer, {"get_weather": None, "get_time": None}, parallel=False)
    assert accepts(g, tokenizer, PARIS)
    assert not accepts(g, tokenizer, PARIS + "\n" + TOKYO)


def test_a_tools_own_strict_wins_over_the_level(tokenizer: Any) -> None:
    # Level ``function`` (arguments free) with a strict tool: that tool's arguments pinned.
    g, _ = grammar(tokenizer, {"get_weather": True, "get_time": None}, level=False)
    assert not accepts(g, tokenizer, call("get_weather", '{"town": "Paris"}'))
    assert accepts(g, tokenizer, call("get_time", '{"zone": 9}'))
    assert not accepts(g, tokenizer, call("get_thing", '{}'))  # the name still held
    # Level ``parameter`` with ``strict: false``: that tool's arguments are any JSON.
    g, _ = grammar(tokenizer, {"get_weather": False, "get_time": None})
    assert accepts(g, tokenizer, call("get_weather", '{"town": "Paris"}'))
    assert not accepts(g, tokenizer, call("get_weather", '{"town": Paris}'))
    assert not accepts(g, tokenizer, call("get_time", '{"zone": 9}'))


def parse(tokenizer: Any, pieces: list[str]) -> tuple[Any, list[Delta]]:
    """Feed ``pieces`` through an ``OutputParser`` on vLLM's hermes parser."""
    from shared.protocol import Generate, SamplingSpec, Tool
    from worker.engine import _auto_call_tag, _scan_required, _tool_parser_class, _vllm_request
    from worker.outputs import OutputParser
    gen = Generate(id="t", tools=[Tool(name="get_weather", parameters=WEATHER),
                                  Tool(name="get_time", parameters=CLOCK)],
                   tool_choice="auto", sampling=SamplingSpec())
    request = _vllm_request(gen)
    built = _auto_call_tag("hermes", [{"name": "get_weather", "parameters": WEATHER,
                                       "strict": True}], True)
    assert built is not None
    parser = OutputParser("auto", None, _tool_parser_class("hermes")(tokenizer, request.tools),
                          None, request, _scan_required, built[1])
    deltas = []
    for k, piece in enumerate(pieces):
        d = Delta(id="t", index=0, text=piece)
        parser.feed(d, tokenizer.encode(piece), k == len(pieces) - 1)
        deltas.append(d)
        if parser.repeated:
            break
    return parser, deltas


def test_the_turn_ends_at_the_first_repeated_call(tokenizer: Any) -> None:
    """The model, its call made, makes it again: ``repeated`` once the second one closes,
    not before (two different calls are not a repeat)."""
    parser, deltas = parse(tokenizer, ["Sure.\n", PARIS[:20], PARIS[20:], "\n", TOKYO,
                                       "\n", PARIS[:30], PARIS[30:], "\n", TOKYO])
    assert parser.repeated and parser.closed == 3 and len(deltas) == 8
    names = [c.name for d in deltas for c in d.tool_calls or [] if c.name]
    assert names == ["get_weather", "get_time", "get_weather"]
    parser, _ = parse(tokenizer, [PARIS, "\n", TOKYO])
    assert not parser.repeated and parser.closed == 2
    # The same tool with other arguments is no repeat either.
    parser, _ = parse(tokenizer, [PARIS, "\n", call("get_weather", '{"city": "Lyon"}')])
    assert not parser.repeated


def test_the_list_of_parsers_with_a_structural_tag_is_vllms() -> None:
    from vllm.tool_parsers import ToolParserManager

    theirs = {name for name in ToolParserManager.list_registered()
              if ToolParserManager.get_tool_parser(name).structural_tag_model is not None}
    assert theirs == STRUCTURAL_TAG_PARSERS


def _preset(tmp_path: Any, model: str) -> Any:
    path = tmp_path / "p.yaml"
    path.write_text("models:\n  m:\n    model: /x\n" + model)
    return path


def test_the_preset_key(tmp_path: Any) -> None:
    spec = load_preset(_preset(tmp_path, "    tool_parser: hermes\n")).models["m"]
    assert auto_tool_calls(spec) == "parameter"
    spec = load_preset(_preset(tmp_path, "    tool_parser: hermes\n"
                                         "    tool_strict_level: function\n")).models["m"]
    assert auto_tool_calls(spec) == "function"
    spec = load_preset(_preset(tmp_path, "    tool_parser: pythonic\n")).models["m"]
    assert auto_tool_calls(spec) == "unconstrained"
    assert auto_tool_calls(load_preset(_preset(tmp_path, "")).models["m"]) is None
    # The tag would hold a reasoning model's thinking too: not yet.
    spec = load_preset(_preset(tmp_path, "    tool_parser: hermes\n"
                                         "    reasoning_parser: qwen3\n")).models["m"]
    assert auto_tool_calls(spec) == "unconstrained"
    ini = tmp_path / "p.ini"
    ini.write_text("[m]\nmodel = /x\ntool_parser = hermes\ntool_strict_level = auto\n")
    assert auto_tool_calls(load_preset(ini).models["m"]) == "auto"
    for body, words in [
            ("    tool_parser: pythonic\n    tool_strict_level: parameter\n",
             "tool parser 'pythonic' has no structural tag"),
            ("    tool_strict_level: function\n", "needs 'tool_parser'"),
            (("    tool_parser: hermes\n    reasoning_parser: qwen3\n"
             "    tool_strict_level: parameter\n"), "not with a 'reasoning_parser'"),
            ("    tool_parser: hermes\n    tool_strict_level: everything\n",
             "tool_strict_level")]:
        with pytest.raises(ConfigError, match=words):
            load_preset(_preset(tmp_path, body))


def test_a_repeat_needs_the_arguments_to_be_equal_as_json(tokenizer: Any) -> None:
    spaced = call("get_weather", json.dumps({"city": "Paris"}, indent=2))
    parser, _ = parse(tokenizer, [PARIS, "\n", spaced])
    assert parser.repeated
