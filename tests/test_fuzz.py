"""Schemathesis over ``GET /openapi.json``: no 5xx, and every response matches the spec.

Mostly against a router whose models use the synthetic engine (cheap, so examples are
many); a small sample of chat and completions reaches a real vLLM worker (integration).
Besides schemathesis' own checks, every body is validated against OpenAI's official
schemas (``tests/conformance.py``): JSON answers, each SSE chunk, and error bodies.

A request refused with a 400 or 404 naming a top-level field is sent again without that
field (or with a sane value for a required one), a few times over: random bodies rarely
pass every range check, and this is what lets the fuzzing reach the workers.
"""

from __future__ import annotations

import json
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import ignored_auth, positive_data_acceptance

from router.access.rules import AccessRules
from router.api.openapi import build_document
from router.app import build_app
from router.errors import ANTHROPIC_PREFIX
from shared.preset_loader import build_preset, parse_yaml
from tests.conformance import validate, validate_responses
from tests.conftest import RouterProcess, running_router
from tests.test_anthropic_units import check_grammar

SYNTH_PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  default_model: synth
  load_timeout: 30
models:
  synth:
    model: none
    engine: synthetic
    load_on_startup: true
    max_model_len: 64
    engine_args: {tokens_per_step: 8}
  synth-embed:
    model: none
    engine: synthetic
    task: embed
"""

# The spec cannot say every rule (ranges, prompt xor messages, best_of == n, which model
# names exist), so a schema-valid body may still get a 400/404: that check is off.
EXCLUDED: list[schemathesis.CheckFunction] = [positive_data_acceptance]
REQUIRED = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi",
            "tokens": [1, 2]}
"""Required fields a repair sets to a sane value; any other refused field is dropped
(``model`` too: then the default model answers)."""
_SCHEMAS = {"/v1/chat/completions": ("CreateChatCompletionResponse",
                                     "CreateChatCompletionStreamResponse"),
            "/v1/completions": ("CreateCompletionResponse", "CompletionStreamChunk"),
            "/v1/models": ("ListModelsResponse", None),
            "/v1/models/{model_id}": ("Model", None)}


def check_anthropic_shapes(response: schemathesis.Response) -> None:
    """An Anthropic answer: its error shape, or a stream in the documented grammar."""
    content_type = response.headers.get("content-type", [""])[0]
    if response.status_code >= 400:
        body = json.loads(response.content)
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    elif content_type.startswith("text/event-stream") and not response.stream_cut_short:
        events = []
        for frame in response.content.decode().split("\n\n"):
            if frame:
                head, data = frame.split("\n")
                events.append((head.removeprefix("event: "),
                               json.loads(data.removeprefix("data: "))))
        if events[-1][0] != "error":
            check_grammar(events)


_RESPONSES_API = {"/v1/responses": "Response", "/v1/responses/{response_id}": "Response",
                  "/v1/responses/{response_id}/cancel": "Response",
                  "/v1/responses/{response_id}/input_items": "ResponseItemList",
                  "/v1/responses/input_tokens": "TokenCountsResource"}


def check_responses_shapes(path: str, response: schemathesis.Response) -> None:
    """A Responses API answer against OpenAI's Responses schemas: each named stream event
    (numbered from 0), or the JSON body."""
    content_type = response.headers.get("content-type", [""])[0]
    if response.status_code >= 400:
        validate_responses("ErrorResponse", json.loads(response.content))
    elif content_type.startswith("text/event-stream"):
        frames = [f for f in response.content.decode().split("\n\n") if f]
        if response.stream_cut_short:  # schemathesis stopped reading: the tail is partial
            frames = frames[:-1]
        for n, frame in enumerate(frames):
            head, data = frame.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert head == f"event: {event['type']}" and event["sequence_number"] == n
            validate_responses("ResponseStreamEvent", event)
    elif path in _RESPONSES_API:
        validate_responses(_RESPONSES_API[path], json.loads(response.content))


def check_openai_shapes(path: str, response: schemathesis.Response) -> None:
    """``response`` against OpenAI's official schemas, where one describes it."""
    if path.startswith(ANTHROPIC_PREFIX):
        check_anthropic_shapes(response)
        return
    if path.startswith("/v1/responses"):
        check_responses_shapes(path, response)
        return
    content_type = response.headers.get("content-type", [""])[0]
    if response.status_code >= 400:
        validate("ErrorResponse", json.loads(response.content))
        return
    body_schema, chunk_schema = _SCHEMAS.get(path, (None, None))
    if content_type.startswith("text/event-stream"):
        assert chunk_schema is not None, path
        events = [e for e in response.content.decode().split("\n\n") if e]
        if response.stream_cut_short:  # schemathesis stopped reading: the tail is partial
            events = events[:-1] + ["data: [DONE]"]
        assert events[-1] == "data: [DONE]", events[-3:]
        for event in events[:-1]:
            assert event.startswith("data: "), event
            payload = json.loads(event[6:])
            validate("ErrorResponse" if "error" in payload else chunk_schema, payload)
    elif body_schema is not None:
        validate(body_schema, json.loads(response.content))


def _repaired(body: dict[str, Any], param: str | None) -> dict[str, Any] | None:
    key = (param or "").split(".")[0].split("[")[0]
    if not key or key not in body:
        return None
    fixed = dict(body)
    if key in REQUIRED and fixed[key] != REQUIRED[key]:
        fixed[key] = REQUIRED[key]
    else:
        del fixed[key]
    return fixed


def call_and_check(case: schemathesis.Case[Any], base_url: str, *,
                   limit: dict[str, int] | None = None, repairs: int = 6,
                   headers: dict[str, str] | None = None,
                   check: Callable[[schemathesis.Response], None] | None = None) -> None:
    """Send ``case`` with every check (and ``check``, with ``headers``); then again,
    repaired, while a field is refused. ``limit`` caps integer fields (a real model on a
    CPU must answer quickly)."""
    for _ in range(repairs + 1):
        if limit and isinstance(case.body, dict):
            capped = {k: min(v, limit[k]) if k in limit and type(v) is int else v
                      for k, v in case.body.items()}
            if not any(type(capped.get(k)) is int for k in ("max_tokens",
                                                             "max_completion_tokens")):
                capped["max_tokens"] = limit["max_tokens"]  # unset or null: the context
            case.body = capped
        if headers:  # ours, not a generated credential
            case.headers = {k: v for k, v in (case.headers or {}).items()
                            if k.lower() not in ("authorization", "x-api-key")} | headers
        # With our key, schemathesis' ``ignored_auth`` takes it for a generated one.
        excluded = EXCLUDED + [ignored_auth] if headers else EXCLUDED
        response = case.call_and_validate(base_url, excluded_checks=excluded, timeout=120)
        check_openai_shapes(case.operation.path, response)
        if check is not None:
            check(response)
        body = case.body
        if not isinstance(body, dict):
            return
        streams = _SCHEMAS.get(case.operation.path, ("", None))[1] or \
            case.operation.path in ("/v1/messages", "/v1/responses")
        if response.status_code == 200 and streams and body.get("stream") is not True:
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        elif response.status_code in (400, 404):
            fixed = _repaired(body, json.loads(response.content)["error"].get("param"))
            if fixed is None:
                return
            body = fixed
        else:
            return
        case = case.operation.Case(body=body, media_type="application/json")


# -- synthetic engine: the whole API ---------------------------------------------------

def served_document(auth: bool = False) -> dict[str, Any]:
    """What ``/openapi.json`` serves for ``SYNTH_PRESET``, built in this process: the
    tests are parametrized at collection, before any router runs (the live document is
    checked against this one); ``auth``: as a server with keys serves it."""
    with tempfile.TemporaryDirectory() as runtime_dir:
        text = SYNTH_PRESET.replace("{port}", "0")
        raw = parse_yaml(text, "fuzz.yaml")
        raw["server"]["runtime_dir"] = runtime_dir
        app = build_app(build_preset(raw, "fuzz.yaml"))
        return build_document(app.routes, auth=auth)


def load_schema(phases: list[str], auth: bool = False) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_dict(served_document(auth))
    schema.config.phases.update(phases=phases)
    return schema


# A key made on this open server would turn keys on: every later case would be a 401.
# POST /v1/keys is tested in test_tenancy. The other paths left out are aliases, served by
# the same handler as /v1/rerank and /v1/score (test_scoring calls each): fuzzing them
# again only costs CI time.
SYNTHETIC = (load_schema(["examples", "coverage", "fuzzing"])
             .exclude(method="POST", path="/v1/keys")
             .exclude(path=["/rerank", "/v2/rerank", "/score"]))
FAST = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def synthetic_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with running_router(SYNTH_PRESET, tmp_path_factory.mktemp("fuzz"), "fuzz") as r:
        r.wait_model("synth", timeout=30)
        yield r


def test_every_route_is_described(synthetic_router: RouterProcess) -> None:
    doc = httpx.get(synthetic_router.url + "/openapi.json").json()
    assert doc == served_document()
    undescribed = [f"{m.upper()} {p}" for p, ops in doc["paths"].items()
                   for m, op in ops.items() if op["summary"] == "(undescribed)"]
    assert not undescribed, f"add these routes to router/api/openapi.py: {undescribed}"
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/tokenize",
            "/v1/detokenize", "/v1/models", "/v1/models/{model_id}", "/v1/models/load",
            "/v1/models/unload", "/health", "/openapi.json"} <= set(doc["paths"])
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    ref = chat["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    assert "messages" in doc["components"]["schemas"][ref]["required"]


@SYNTHETIC.parametrize()
@FAST
def test_fuzz_synthetic(case: schemathesis.Case[Any], synthetic_router: RouterProcess) -> None:
    call_and_check(case, synthetic_router.url)


# -- the same API once per role, on a server with keys ----------------------------------

FUZZ_ADMIN = "k-fuzz-admin-3d9e"
KEYED_PRESET = SYNTH_PRESET.replace("  load_timeout: 30\n", f"""  load_timeout: 30
  admin_api_keys: [{FUZZ_ADMIN}]
  auth_failures_per_minute: 0
""")
# Keys made or revoked mid-run would change the callers under the later cases.
KEYED = (load_schema(["fuzzing"], auth=True)
         .exclude(path=["/v1/keys", "/v1/keys/{name}", "/rerank", "/v2/rerank", "/score"]))


@pytest.fixture(scope="module")
def keyed_router(tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[RouterProcess, dict[str, str]]]:
    with running_router(KEYED_PRESET, tmp_path_factory.mktemp("fuzz-keyed"), "keyed") as r:
        keys = {"admin": FUZZ_ADMIN}
        for role in ("viewer", "user"):
            made = r.client.post(f"{r.url}/v1/keys", json={"name": f"fuzz-{role}", "role": role},
                                 headers={"authorization": f"Bearer {FUZZ_ADMIN}"})
            assert made.status_code == 201, made.text
            keys[role] = made.json()["key"]
        yield r, keys


RULES = AccessRules(build_app(build_preset(parse_yaml(
    SYNTH_PRESET.replace("{port}", "0"), "fuzz.yaml"), "fuzz.yaml")).routes)


@KEYED.parametrize()
@settings(max_examples=4, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@pytest.mark.parametrize("role", ["viewer", "user", "admin"])
def test_fuzz_as_each_role(case: schemathesis.Case[Any], role: str,
                           keyed_router: tuple[RouterProcess, dict[str, str]]) -> None:
    """Schemathesis once per role (a few fuzzed cases of each operation): no 5xx, every shape valid, and a 403 exactly
    where ``router.access.rules.TABLE`` leaves the role out (never a 401: the key is valid)."""
    r, keys = keyed_router

    def as_the_table_says(response: schemathesis.Response) -> None:
        path = httpx.URL(response.request.url).path
        allowed = RULES.rule(response.request.method or "GET", path).allows(role)
        assert response.status_code != 401, (role, path, response.text)
        assert (response.status_code == 403) == (not allowed), (role, path, response.text)

    call_and_check(case, r.url, headers={"authorization": f"Bearer {keys[role]}"},
                   check=as_the_table_says)


def test_load_then_force_unload_at_once(tmp_path: Path) -> None:
    """Found by schemathesis: a force unload while the worker is still starting was a 500
    (``zmq.Again`` from the Shutdown send) that left the model 'stopping' for good, every
    later request to it hanging; and a load cancelled that way left its socket open, so
    the router hung on SIGTERM (``zmq.Context.term``)."""
    with running_router(SYNTH_PRESET, tmp_path, "unload") as r:
        r.wait_model("synth", timeout=30)
        for _ in range(3):
            got = r.client.post(f"{r.url}/v1/models/load", json={"model": "synth",
                                                                  "wait": False})
            assert got.status_code in (200, 202), got.text
            got = r.client.post(f"{r.url}/v1/models/unload", json={"model": "synth",
                                                                    "force": True})
            assert got.status_code == 200, got.text
        got = r.client.post(f"{r.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                            timeout=30)
        assert got.status_code == 200, got.text
        assert r.proc is not None
        r.proc.send_signal(signal.SIGTERM)
        try:
            r.proc.wait(15)
        except subprocess.TimeoutExpired:
            r.proc.kill()
            pytest.fail("the router did not exit within 15 s of SIGTERM\n" + r.tail(10))


# -- a real vLLM worker: a sample of generation ----------------------------------------

# Coverage cases are the synthetic run's; here a sample of fuzzed generation requests.
REAL = load_schema(["fuzzing"]).include(path_regex=r"^/v1/(chat/)?completions$")
# A real model on a CPU: short answers, few choices (the extremes are the synthetic's).
REAL_LIMIT = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2, "min_tokens": 2,
              "top_logprobs": 3, "logprobs": 3}


@pytest.mark.integration
@REAL.parametrize()
@settings(max_examples=20, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_fuzz_real_model(case: schemathesis.Case[Any], router: RouterProcess) -> None:
    if isinstance(case.body, dict):
        if isinstance(case.body.get("model"), str):
            case.body = {**case.body, "model": "smollm2"}  # one worker, not four to start
        # The shared router serves every later test: a fuzzed keep_alive (0, say) would
        # leave its model stopped for them (seen in CI). The synthetic run fuzzes it.
        case.body.pop("keep_alive", None)
    call_and_check(case, router.url, limit=REAL_LIMIT)


def test_repair_names_top_level_fields() -> None:
    assert _repaired({"n": 0, "x": 1}, "n") == {"x": 1}
    assert _repaired({"messages": []}, "messages[0].role") == {"messages": REQUIRED["messages"]}
    assert _repaired({"n": 0}, None) is None

