"""Loading progress (issues 27, 37): SSE comment lines, or the protocol's reasoning, to a
stream that waits for its model.

Synthetic workers whose engine takes ``start_seconds`` to start stand in for a model
that loads slowly; each test unloads its model first, so its request finds it cold.
The official SDKs must parse such a stream as if the comments were not there; with
``reasoning`` they must find the progress in the reasoning (chat's
``delta.reasoning_content``, an Anthropic ``thinking`` block, a Responses ``reasoning``
item) and the answer's text exactly as the model wrote it.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import openai
import pytest

from router.api import progress
from router.registry import ModelEntry
from shared.config import ConfigError
from shared.preset_loader import build_preset, parse_ini, parse_yaml
from tests.conformance import validate, validate_responses
from tests.conftest import RouterProcess, running_router

HEADER = {"X-Modelyard-Loading-Progress": "comments"}
COMMENT = re.compile(rb"^: modelyard loading (\S+) (?:phase=(\w+) (\d+)%|(\d+)s)$")
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


# -- the preset key ---------------------------------------------------------------------
def test_loading_progress_in_yaml_and_ini() -> None:
    yaml = build_preset(parse_yaml("server: {loading_progress: comments}\nmodels:\n"
                                   "  m: {model: /x}\n  n: {model: /x, loading_progress: off}\n",
                                   "t.yaml"), "t.yaml")
    ini = build_preset(parse_ini("[server]\nloading_progress = comments\n[m]\nmodel = /x\n"
                                 "[n]\nmodel = /x\nloading_progress = off\n", "t.ini"), "t.ini")
    for preset in (yaml, ini):
        assert preset.server.loading_progress == "comments"
        assert preset.models["m"].loading_progress is None  # the server's
        assert preset.models["n"].loading_progress == "off"
    assert build_preset({"models": {"m": {"model": "/x"}}}).server.loading_progress == "off"


@pytest.mark.parametrize(("text", "fragment"), [
    ("server: {loading_progress: on}\nmodels: {m: {model: /x}}\n",
     "[server]: key 'loading_progress'"),
    ("models: {m: {model: /x, loading_progress: percent}}\n",
     "model 'm': key 'loading_progress'"),
    ("defaults: {loading_progress: on}\nmodels: {m: {model: /x}}\n",
     "model 'm': key 'loading_progress': expected off, comments or reasoning"),
])
def test_a_bad_loading_progress_names_its_key(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        build_preset(parse_yaml(text, "t.yaml"), "t.yaml")


# -- whether, and what --------------------------------------------------------------------
def entry(server: dict[str, Any] | None = None, **model: Any) -> tuple[ModelEntry, Any]:
    preset = build_preset({"server": server or {}, "models": {"m": {"model": "/x", **model}}})
    return ModelEntry(preset.models["m"]), preset.server


@pytest.mark.parametrize(("server", "model", "header", "wanted"), [
    ("off", None, None, False),
    ("comments", None, None, True),
    ("comments", "off", None, False),
    ("off", "comments", None, True),
    ("off", None, b"comments", True),
    ("comments", "comments", b"off", False),
    ("off", None, b" Comments ", True),
    ("comments", None, b"loud", True),  # a value it does not know: the preset decides
    ("off", None, b"loud", False),
])
def test_the_header_wins_over_the_model_over_the_server(
        server: str, model: str | None, header: bytes | None, wanted: bool) -> None:
    e, config = entry({"loading_progress": server}, **(
        {"loading_progress": model} if model else {}))
    headers = [(b"content-type", b"application/json")]
    if header is not None:
        headers.append((b"x-modelyard-loading-progress", header))
    assert progress.wanted({"headers": headers}, e, config) is wanted


def test_the_estimate_follows_the_last_load_phases() -> None:
    e, _ = entry()
    e.state, e.load_started = "loading", 100.0
    assert progress.estimate(e, 101.0) is None  # never loaded: nothing to go by
    # spawn 1 s, engine 8 s, 1 s of the router's own (counted to the last phase);
    # the engine's inner timings are inside ``engine`` and do not add up.
    e.load_seconds = 10.0
    e.load_phases = {"spawn": 1.0, "engine": 8.0, "weights": 5.0, "kv_cache_and_warmup": 2.0}
    assert progress.estimate(e, 100.5) == ("spawn", 5)
    assert progress.estimate(e, 106.2) == ("engine", 62)
    assert progress.estimate(e, 109.5) == ("engine", 95)
    assert progress.estimate(e, 130.0) == ("engine", 99)  # slower than last time: never 100
    e.load_started = 0.0  # waiting for room or a start lock: no clock of its own yet
    assert progress.estimate(e, 101.0) is None
    e.state, e.load_started = "ready", 100.0
    assert progress.estimate(e, 101.0) is None


def test_the_lines_are_sse_comments() -> None:
    e, _ = entry()
    e.load_seconds, e.load_phases = 4.0, {"spawn": 1.0, "engine": 3.0}
    line = progress.LoadProgress(e)
    assert line() == b": modelyard loading m 0s\n\n"  # no load running yet
    e.state, e.load_started = "loading", line.since
    assert line() == b": modelyard loading m phase=spawn 0%\n\n"
    e.state = "sleeping"
    assert line() == b": modelyard waking m 0s\n\n"
    e.state = "ready"  # loaded, and the request waits for a slot
    assert line() == b": modelyard waiting m 0s\n\n"


@pytest.mark.parametrize(("server", "model", "header", "mode"), [
    ("off", None, b"reasoning", "reasoning"),
    ("reasoning", None, b"off", "off"),
    ("reasoning", None, None, "reasoning"),
    ("off", "reasoning", None, "reasoning"),
    ("reasoning", "comments", None, "comments"),
    ("comments", None, b" Reasoning", "reasoning"),
    ("reasoning", None, b"comments", "comments"),
    ("reasoning", None, b"thoughts", "reasoning"),  # unknown: the preset decides
])
def test_reasoning_is_a_mode_as_comments_are(
        server: str, model: str | None, header: bytes | None, mode: str) -> None:
    e, config = entry({"loading_progress": server}, **(
        {"loading_progress": model} if model else {}))
    headers = [] if header is None else [(b"x-modelyard-loading-progress", header)]
    assert progress.mode({"headers": headers}, e, config) == mode
    assert progress.wanted({"headers": headers}, e, config) is (mode != "off")


def test_reasoning_in_yaml_and_ini() -> None:
    yaml = build_preset(parse_yaml("server: {loading_progress: reasoning}\nmodels:\n"
                                   "  m: {model: /x, loading_progress: reasoning}\n",
                                   "t.yaml"), "t.yaml")
    ini = build_preset(parse_ini("[server]\nloading_progress = reasoning\n[m]\nmodel = /x\n"
                                 "loading_progress = reasoning\n", "t.ini"), "t.ini")
    for preset in (yaml, ini):
        assert preset.server.loading_progress == "reasoning"
        assert preset.models["m"].loading_progress == "reasoning"


def test_the_reasoning_lines_say_which_model_what_how_far_how_long() -> None:
    e, _ = entry()
    e.load_seconds, e.load_phases = 4.0, {"spawn": 1.0, "engine": 3.0}
    line = progress.LoadProgress(e)
    assert line.text() == "Loading m (0 s)"  # no load running yet
    e.state = "loading"  # waiting for a start lock: no clock of its own yet
    assert line.text() == "Loading m: waiting for its turn to start (0 s)"
    e.load_started = line.since
    assert line.text() == "Loading m: spawn 0% (0 s)"
    e.load_started = line.since - 2.5
    assert line.text() == "Loading m: engine 62% (0 s)"
    e.state = "sleeping"
    assert line.text() == "Waking m (0 s)"
    e.state = "ready"
    assert line.text() == "Waiting for m: every slot is busy (0 s)"
    line.since -= 12
    assert line.text() == "Waiting for m: every slot is busy (12 s)"
    delta = line.delta()  # reasoning only, of the first choice, and no tokens
    assert delta.reasoning == line.text() + "\n"
    assert (delta.index, delta.text, delta.tokens, delta.prompt_tokens) == (0, "", 0, 0)
    assert delta.finish_reason is None and not delta.tool_calls


# -- against a router ---------------------------------------------------------------------
PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  load_timeout: 120
  max_queue_depth: 1
defaults: {engine: synthetic, model: /synthetic, engine_args: {start_seconds: 2}}
models:
  slow: {}
  fresh: {}
  opted: {loading_progress: comments}
  broken: {engine_args: {start_seconds: never}}
  queued: {engine_args: {start_seconds: 600}}
  fails: {engine_args: {start_seconds: never}}  # its own restart backoff, not broken's
  scripted: {engine_args: {start_seconds: 2, script: [{text: "Hello from the model."}]}}
  thinker:
    engine_args:
      start_seconds: 2
      script: [{reasoning: "Two and two make four.", text: "It is four."}]
  reasoned:
    loading_progress: reasoning
    engine_args: {start_seconds: 2, script: [{text: "Hello from the model."}]}
"""


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with running_router(PRESET, tmp_path_factory.mktemp("progress"), "progress") as r:
        yield r


def cold(r: RouterProcess, model: str) -> None:
    """``model`` stopped, so that the next request for it waits for a load."""
    answer = r.client.post(f"{r.url}/v1/models/unload", json={"model": model})
    assert answer.status_code == 200, answer.text
    assert answer.json()["state"] == "unloaded"


def raw_stream(r: RouterProcess, path: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, list[bytes]]:
    """The status and the lines of a streamed answer, as they came."""
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", r.url + path, json={**body, "stream": True}, headers=headers) as got:
        return got.status_code, b"".join(got.iter_bytes()).split(b"\n")


def comments(lines: list[bytes]) -> list[bytes]:
    return [line for line in lines if line.startswith(b":")]


def before_first_data(lines: list[bytes]) -> list[bytes]:
    first = next(i for i, line in enumerate(lines)
                 if line.startswith((b"data:", b"event:")))
    return lines[:first]


@pytest.mark.integration
def test_openai_sdk_parses_a_cold_stream_with_comments(router: RouterProcess) -> None:
    cold(router, "slow")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="slow", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        stream=True, extra_headers=HEADER))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    warm = client.chat.completions.create(
        model="slow", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert text == warm.choices[0].message.content == "tok " * 5
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(not getattr(c.choices[0].delta, "reasoning_content", None)
               for c in chunks if c.choices)


@pytest.mark.integration
def test_the_comments_come_before_the_first_event(router: RouterProcess) -> None:
    """A model never loaded gives the seconds waited; once it has loaded, its next load
    gives the phase and percent, estimated from the last one's phases."""
    for load in ("first", "second"):
        cold(router, "fresh")
        status, lines = raw_stream(router, "/v1/chat/completions", {"model": "fresh", **CHAT},
                                   HEADER)
        assert status == 200
        waited = comments(lines)
        assert waited and waited == comments(before_first_data(lines)), lines
        found = [COMMENT.match(line) for line in waited]
        assert all(found), waited
        assert {m.group(1) for m in found if m} == {b"fresh"}
        if load == "first":
            assert all(m.group(4) is not None for m in found if m), waited
        else:
            percents = [int(m.group(3)) for m in found if m and m.group(3)]
            assert percents and percents == sorted(percents) and percents[-1] < 100, waited
            assert {m.group(2) for m in found if m and m.group(2)} <= {b"spawn", b"engine"}
        assert b"data: [DONE]" in lines


@pytest.mark.integration
def test_without_opt_in_a_cold_stream_has_no_comments(router: RouterProcess) -> None:
    cold(router, "slow")
    status, lines = raw_stream(router, "/v1/chat/completions", {"model": "slow", **CHAT})
    assert status == 200 and not comments(lines) and b"data: [DONE]" in lines


@pytest.mark.integration
def test_the_preset_opts_in_and_the_header_opts_out(router: RouterProcess) -> None:
    cold(router, "opted")
    _, lines = raw_stream(router, "/v1/chat/completions", {"model": "opted", **CHAT})
    assert comments(lines) and all(COMMENT.match(line) for line in comments(lines))
    cold(router, "opted")
    _, lines = raw_stream(router, "/v1/completions",
                          {"model": "opted", "prompt": "hi", "max_tokens": 5},
                          {"X-Modelyard-Loading-Progress": "off"})
    assert not comments(lines) and b"data: [DONE]" in lines


@pytest.mark.integration
def test_a_request_not_streamed_is_unchanged(router: RouterProcess) -> None:
    cold(router, "slow")
    got = router.client.post(f"{router.url}/v1/chat/completions", headers=HEADER,
                             json={"model": "slow", **CHAT}, timeout=120)
    assert got.status_code == 200 and got.headers["content-type"] == "application/json"
    assert got.json()["choices"][0]["message"]["content"] == "tok " * 5


@pytest.mark.integration
def test_anthropic_sdk_parses_a_cold_stream_with_comments(router: RouterProcess) -> None:
    from anthropic import Anthropic

    cold(router, "slow")
    with Anthropic(base_url=router.url, api_key="unused", max_retries=0,
                   timeout=120) as client, client.messages.stream(
            model="slow", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
            extra_headers=HEADER) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "tok " * 5 and final.stop_reason == "max_tokens"
    cold(router, "slow")
    _, lines = raw_stream(router, "/v1/messages", {"model": "slow", "max_tokens": 5,
                                                   "messages": CHAT["messages"]}, HEADER)
    waited = before_first_data(lines)
    # the comments stand in for the protocol's own keep-alive (``ping``) while it loads
    assert comments(waited) and all(COMMENT.match(line) for line in comments(waited))
    assert lines[len(waited)] == b"event: message_start"


@pytest.mark.integration
def test_responses_stream_parses_with_comments(router: RouterProcess) -> None:
    cold(router, "slow")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    events = list(client.responses.create(model="slow", input="hi", max_output_tokens=5,
                                          stream=True, extra_headers=HEADER))
    # the synthetic engine always stops at its token limit: ``incomplete``
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == "tok " * 5


@pytest.mark.integration
def test_a_load_that_fails_after_the_comments_is_an_error_event(
        router: RouterProcess) -> None:
    """The status (200) went with the first comment: the failure is OpenAI's in-band
    error event, which the SDK raises."""
    status, lines = raw_stream(router, "/v1/chat/completions", {"model": "broken", **CHAT},
                               HEADER)
    assert status == 200 and comments(lines)
    errors = [line for line in lines if line.startswith(b"data: {\"error\"")]
    assert len(errors) == 1 and b"failed to start" in errors[0], lines
    assert not any(line.startswith(b"data: {\"id\"") for line in lines)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="broken"):
        list(client.chat.completions.create(
            model="broken", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            stream=True, extra_headers=HEADER))
    # without comments nothing has begun: the failure is the response's status
    failed = router.client.post(f"{router.url}/v1/chat/completions",
                                json={"model": "broken", "stream": True, **CHAT}, timeout=120)
    assert failed.status_code == 503, failed.text


@pytest.mark.integration
def test_a_full_queue_is_refused_with_its_status_before_any_comment(
        router: RouterProcess) -> None:
    """A stream that could only end in-band with a 429 is not begun: the status says it."""
    body = b'{"model": "queued", "messages": [{"role": "user", "content": "hi"}]}'
    with socket.create_connection(("127.0.0.1", router.port)) as waiting:
        waiting.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Type: application/json\r\nContent-Length: "
                        + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while router.client.get(f"{router.url}/v1/models/queued").json()["queued"] < 1:
            assert time.monotonic() < deadline, "the first request never queued"
            time.sleep(0.05)
        openai_style = router.client.post(
            f"{router.url}/v1/chat/completions", headers=HEADER,
            json={"model": "queued", "stream": True, **CHAT})
        assert openai_style.status_code == 429, openai_style.text
        assert openai_style.json()["error"]["type"] == "rate_limit_error"
        anthropic_style = router.client.post(  # its pings would have begun the stream
            f"{router.url}/v1/messages", json={"model": "queued", "max_tokens": 5,
                                               "stream": True, "messages": CHAT["messages"]})
        assert anthropic_style.status_code == 529, anthropic_style.text
        assert anthropic_style.json()["error"]["type"] == "overloaded_error"


# -- reasoning ----------------------------------------------------------------------------
REASONING = {"X-Modelyard-Loading-Progress": "reasoning"}
SAID = "Hello from the model."
"""What ``scripted`` (and ``reasoned``) answer: 4 tokens, one per word."""
LINE = re.compile(r"^Loading (\S+)(?:: (?:(\w+) (\d+)%|waiting for its turn to start))? "
                  r"\(\d+ s\)$")


def progress_lines(reasoning: str, model: str) -> list[str]:
    """The lines of ``reasoning`` that a wait for ``model``'s load wrote (each checked),
    and nothing else: the reasoning is progress only, line by line."""
    assert reasoning.endswith("\n"), reasoning
    lines = reasoning[:-1].split("\n")
    found = [LINE.match(line) for line in lines]
    assert all(found), lines
    assert {m.group(1) for m in found if m} == {model}
    return lines


def sse_events(lines: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """The ``(event, data)`` pairs of a raw stream (``event`` empty where none was named;
    ``[DONE]`` left out)."""
    out, name = [], ""
    for line in lines:
        if line.startswith(b"event: "):
            name = line[7:].decode()
        elif line.startswith(b"data: {"):
            out.append((name, msgspec.json.decode(line[6:])))
            name = ""
    return out


@pytest.mark.integration
def test_openai_sdk_reads_the_wait_as_reasoning_content(router: RouterProcess) -> None:
    """Chat: the progress lines are ``delta.reasoning_content`` chunks, before the answer,
    each chunk valid as OpenAI's; the answer is the model's own words and the usage
    counts only its tokens."""
    cold(router, "scripted")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    chunks = list(client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}, extra_headers=REASONING))
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk.model_dump(exclude_unset=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = [(d.model_extra or {}).get("reasoning_content") or "" for d in deltas]
    said = [d.content or "" for d in deltas]
    assert "".join(said) == SAID
    first_word = next(i for i, text in enumerate(said) if text)
    assert not any(thought[first_word:])  # all of it before the answer
    assert progress_lines("".join(thought), "scripted")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    warm = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "hi"}])
    assert warm.choices[0].message.content == SAID
    assert warm.usage is not None and warm.usage.completion_tokens == 4
    assert not (warm.choices[0].message.model_extra or {}).get("reasoning_content")


@pytest.mark.integration
def test_anthropic_sdk_reads_the_wait_as_a_thinking_block(router: RouterProcess) -> None:
    """Messages: a ``thinking`` block (signed) holds the progress, then the ``text``
    block the model's words, with contiguous indexes; ``output_tokens`` counts the
    model's tokens only."""
    from anthropic import Anthropic

    cold(router, "scripted")
    with Anthropic(base_url=router.url, api_key="unused", max_retries=0,
                   timeout=120) as client, client.messages.stream(
            model="scripted", max_tokens=50, messages=[{"role": "user", "content": "hi"}],
            extra_headers=REASONING) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == SAID
    assert [block.type for block in final.content] == ["thinking", "text"]
    thinking, answer = final.content
    assert thinking.type == "thinking" and answer.type == "text"
    assert progress_lines(thinking.thinking, "scripted") and thinking.signature
    assert answer.text == SAID and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 4 and final.usage.input_tokens > 0
    cold(router, "scripted")
    status, lines = raw_stream(router, "/v1/messages", {
        "model": "scripted", "max_tokens": 50, "messages": CHAT["messages"]}, REASONING)
    assert status == 200 and not comments(lines)
    events = sse_events(lines)
    assert events[0][0] == "message_start"
    opened = [(d["index"], d["content_block"]["type"]) for e, d in events
              if e == "content_block_start"]
    assert opened == [(0, "thinking"), (1, "text")]
    kinds = [(e, d.get("index"), d.get("delta", {}).get("type")) for e, d in events]
    assert kinds.index(("content_block_delta", 0, "signature_delta")) \
        < kinds.index(("content_block_stop", 0, None)) \
        < kinds.index(("content_block_start", 1, None))


@pytest.mark.integration
def test_responses_sdk_reads_the_wait_as_a_reasoning_item(router: RouterProcess) -> None:
    """Responses: a ``reasoning`` item holds the progress, then the ``message`` item the
    model's words; every event valid as OpenAI's; no reasoning token counted."""
    cold(router, "scripted")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    with client.responses.stream(model="scripted", input="hi",
                                 extra_headers=REASONING) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == SAID
    reasoning = final.output[0]
    assert reasoning.type == "reasoning" and reasoning.content is not None
    progress_lines("".join(part.text for part in reasoning.content), "scripted")
    assert final.usage is not None and final.usage.output_tokens == 4
    assert final.usage.output_tokens_details.reasoning_tokens == 0
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert said == SAID
    cold(router, "scripted")
    status, lines = raw_stream(router, "/v1/responses", {"model": "scripted", "input": "hi"},
                               REASONING)
    raw = sse_events(lines)
    assert status == 200 and not comments(lines)
    for name, event in raw:
        assert event["type"] == name
        validate_responses("ResponseStreamEvent", event)
    assert [e["sequence_number"] for _, e in raw] == list(range(len(raw)))
    validate_responses("Response", raw[-1][1]["response"])


@pytest.mark.integration
def test_the_model_reasoning_follows_the_progress(router: RouterProcess) -> None:
    """A model that reasons: its reasoning comes after the progress in the same
    channel, the answer after both, and every shape stays valid."""
    from anthropic import Anthropic

    thought, said = "Two and two make four. ", "It is four."
    cold(router, "thinker")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    chunks = list(client.chat.completions.create(
        model="thinker", messages=[{"role": "user", "content": "hi"}], stream=True,
        extra_headers=REASONING))
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk.model_dump(exclude_unset=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning.endswith("\n" + thought)
    progress_lines(reasoning[:-len(thought)], "thinker")
    assert "".join(d.content or "" for d in deltas) == said
    cold(router, "thinker")
    with Anthropic(base_url=router.url, api_key="unused", max_retries=0,
                   timeout=120) as anthropic, anthropic.messages.stream(
            model="thinker", max_tokens=50, messages=[{"role": "user", "content": "hi"}],
            extra_headers=REASONING) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text"]
    thinking, answer = final.content
    assert thinking.type == "thinking" and answer.type == "text"
    assert thinking.thinking.endswith("\n" + thought) and answer.text == said
    progress_lines(thinking.thinking[:-len(thought)], "thinker")
    cold(router, "thinker")
    with client.responses.stream(model="thinker", input="hi",
                                 extra_headers=REASONING) as responses:
        final_response = responses.get_final_response()
    assert [item.type for item in final_response.output] == ["reasoning", "message"]
    assert final_response.output_text == said
    item = final_response.output[0]
    assert item.type == "reasoning" and item.content is not None
    text = "".join(part.text for part in item.content)
    assert text.endswith("\n" + thought)
    progress_lines(text[:-len(thought)], "thinker")
    assert final_response.usage is not None
    assert final_response.usage.output_tokens_details.reasoning_tokens == 5  # the model's


@pytest.mark.integration
def test_the_preset_says_reasoning_and_the_header_says_off(router: RouterProcess) -> None:
    cold(router, "reasoned")
    _, lines = raw_stream(router, "/v1/chat/completions", {"model": "reasoned", **CHAT})
    thought = "".join(d["choices"][0]["delta"].get("reasoning_content", "")
                      for _, d in sse_events(lines) if d.get("choices"))
    assert progress_lines(thought, "reasoned") and not comments(lines)
    cold(router, "reasoned")
    _, lines = raw_stream(router, "/v1/chat/completions", {"model": "reasoned", **CHAT},
                          {"X-Modelyard-Loading-Progress": "off"})
    events = sse_events(lines)
    assert not comments(lines) and b"data: [DONE]" in lines
    assert not any(d["choices"][0]["delta"].get("reasoning_content")
                   for _, d in events if d.get("choices"))
    assert "".join(d["choices"][0]["delta"].get("content") or ""
                   for _, d in events if d.get("choices")) == SAID


@pytest.mark.integration
def test_legacy_completions_get_comments_for_reasoning(router: RouterProcess) -> None:
    """``/v1/completions`` has no reasoning field: the progress is comment lines there."""
    cold(router, "scripted")
    status, lines = raw_stream(router, "/v1/completions",
                               {"model": "scripted", "prompt": "hi", "max_tokens": 5},
                               REASONING)
    assert status == 200 and comments(lines)
    assert comments(lines) == comments(before_first_data(lines))
    assert all(COMMENT.match(line) for line in comments(lines))
    for _, chunk in sse_events(lines):
        validate("CompletionStreamChunk", chunk)
    assert "".join(d["choices"][0]["text"] for _, d in sse_events(lines)) == SAID


@pytest.mark.integration
def test_a_load_that_fails_after_reasoning_is_an_error_event(
        router: RouterProcess) -> None:
    """The progress went out as reasoning; the failed load ends each protocol's stream
    with its in-band error, which its SDK raises."""
    from anthropic import Anthropic, APIStatusError

    status, lines = raw_stream(router, "/v1/chat/completions", {"model": "fails", **CHAT},
                               REASONING)
    events = sse_events(lines)
    assert status == 200 and not comments(lines)
    assert events[-1][1]["error"]["message"] and "failed to start" in events[-1][1][
        "error"]["message"]
    before = [d["choices"][0]["delta"] for _, d in events[:-1]]
    assert any(delta.get("reasoning_content") for delta in before)  # the progress
    assert not any(delta.get("content") for delta in before)  # and no answer
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    with pytest.raises(openai.APIError, match="fails"):
        list(client.chat.completions.create(
            model="fails", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            stream=True, extra_headers=REASONING))
    with Anthropic(base_url=router.url, api_key="unused", max_retries=0,
                   timeout=120) as anthropic, pytest.raises(APIStatusError, match="fails"), \
            anthropic.messages.stream(
                model="fails", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                extra_headers=REASONING) as stream:
        list(stream)
    _, lines = raw_stream(router, "/v1/responses", {"model": "fails", "input": "hi"},
                          REASONING)
    events = sse_events(lines)
    for _, event in events:
        validate_responses("ResponseStreamEvent", event)
    assert events[-1][0] == "response.failed"
    failed = events[-1][1]["response"]
    assert "fails" in failed["error"]["message"]
    assert [item["type"] for item in failed["output"]] == ["reasoning"]
