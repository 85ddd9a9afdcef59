"""API keys against a real router (issue 8): every endpoint but /health needs a key when
any is set, either header works, admin endpoints need an admin key, keys are never logged.

Its model is never loaded: a request is refused or admitted before any model is touched.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conformance import validate
from tests.conftest import RouterProcess, running_router

pytestmark = pytest.mark.integration

USER, ADMIN, FROM_ENV, FROM_FILE = "k-user-1f3a", "k-admin-77c2", "k-env-90b1", "k-file-4e5d"
PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  api_keys: [k-user-1f3a]
  admin_api_keys: [k-admin-77c2]
  api_key_file: {key_file}
  auth_failures_per_minute: 0  # its tests send many wrong keys on purpose
models:
  smollm2: {model: "builtin:smollm2", cpu_cores: "0", max_model_len: 512}
"""
PROTECTED = [("GET", "/v1/models", None), ("GET", "/v1/models/smollm2", None),
             ("POST", "/v1/chat/completions", {"model": "smollm2", "messages": []}),
             ("POST", "/v1/completions", {"model": "smollm2", "prompt": ""}),
             ("POST", "/v1/embeddings", {"model": "smollm2", "input": []}),
             ("POST", "/v1/tokenize", {"model": "smollm2"}),
             ("POST", "/v1/detokenize", {"model": "smollm2", "tokens": "x"}),
             ("POST", "/v1/models/load", {"model": "smollm2", "wait": False}),
             ("POST", "/v1/models/unload", {"model": "smollm2"}),
             ("GET", "/v1/no-such-path", None)]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    workdir = tmp_path_factory.mktemp("keys")
    key_file = workdir / "keys.txt"
    key_file.write_text(f"# lab keys\n{FROM_FILE}  # alice\n\n")
    os.environ["MODELYARD_API_KEYS"] = f"{FROM_ENV}, "
    try:
        with running_router(PRESET, workdir, "keys", {"key_file": str(key_file)}) as r:
            yield r
    finally:
        del os.environ["MODELYARD_API_KEYS"]


def call(r: RouterProcess, method: str, path: str, body: object,
         headers: dict[str, str] | None = None) -> httpx.Response:
    return r.client.request(method, r.url + path, json=body, headers=headers)


def test_every_endpoint_but_health_needs_a_key(keyed: RouterProcess) -> None:
    assert call(keyed, "GET", "/health", None).status_code == 200
    for method, path, body in PROTECTED:
        for headers in (None, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"},
                        {"Authorization": USER}):  # a bare key without "Bearer"
            r = call(keyed, method, path, body, headers)
            assert r.status_code == 401, (method, path, headers, r.text)
            validate("ErrorResponse", r.json())
            assert r.json()["error"]["code"] == "invalid_api_key"


def test_either_header_and_every_key_source_opens_the_api(keyed: RouterProcess) -> None:
    for key in (USER, ADMIN, FROM_ENV, FROM_FILE):
        for headers in ({"Authorization": f"Bearer {key}"}, {"x-api-key": key}):
            assert call(keyed, "GET", "/v1/models", None, headers).status_code == 200, key
    # Admitted requests go on to the handlers: a bad body is still the usual 400.
    r = call(keyed, "POST", "/v1/chat/completions", {"model": "smollm2", "messages": []},
             {"Authorization": f"Bearer {USER}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with openai.OpenAI(base_url=keyed.url + "/v1", api_key=USER, max_retries=0) as good:
        assert [m.id for m in good.models.list()] == ["smollm2"]
    with openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0) as bad, \
            pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_anthropics_endpoints_answer_anthropics_401(keyed: RouterProcess) -> None:
    import anthropic

    for path in ("/v1/messages", "/v1/messages?beta=true", "/v1/messages/count_tokens"):
        r = call(keyed, "POST", path, {"model": "smollm2", "messages": []},
                 {"x-api-key": "wrong", "anthropic-version": "2023-06-01"})
        assert r.status_code == 401, (path, r.text)
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
    with anthropic.Anthropic(base_url=keyed.url, api_key="nope", max_retries=0) as bad, \
            pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="smollm2", max_tokens=4,
                            messages=[{"role": "user", "content": "hi"}])
    # The right key in x-api-key (the SDK's header) reaches the handler: an empty
    # conversation is refused there, in Anthropic's shape, before any model is touched.
    with anthropic.Anthropic(base_url=keyed.url, api_key=USER, max_retries=0) as good, \
            pytest.raises(anthropic.BadRequestError) as info:
        good.messages.create(model="smollm2", max_tokens=4, messages=[])
    assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_a_budgets_hold_is_the_prompt_the_engine_counts(keyed: RouterProcess) -> None:
    """A named key with a 300-token daily budget on the real model: a chat whose prompt
    (a long message and two tools) takes more than that is refused, the refusal naming
    the real vLLM worker's count of it (``Tokenize`` with ``count_only``), the same count
    ``/v1/tokenize`` gives for those messages and tools; the key's "hi" then fits, and its
    usage row holds what the engine ran."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    made = call(keyed, "POST", "/v1/keys", {"name": "thrifty-real", "budgets": [
        {"tokens": 300, "period": "day"}]}, admin)
    assert made.status_code == 201, made.text
    key = {"Authorization": f"Bearer {made.json()['key']}"}
    tools = [{"type": "function", "function": {
        "name": name, "description": f"Look up the {name} of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}} for name in ("weather", "population")]
    messages = [{"role": "user", "content": "Tell me about Paris. " * 60}]
    # the model's first use here: its load may take a while on busy cores
    counted = keyed.client.request("POST", keyed.url + "/v1/tokenize", json={
        "model": "smollm2", "messages": messages, "tools": tools}, headers=admin, timeout=600)
    assert counted.status_code == 200, counted.text
    count = counted.json()["count"]
    assert count > 300
    refused = call(keyed, "POST", "/v1/chat/completions", {
        "model": "smollm2", "messages": messages, "tools": tools, "max_tokens": 4}, key)
    assert refused.status_code == 429, refused.text
    assert f"its prompt of {count} tokens" in refused.json()["error"]["message"], refused.text
    hi = call(keyed, "POST", "/v1/chat/completions", {
        "model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4}, key)
    assert hi.status_code == 200, hi.text
    assert 0 < hi.json()["usage"]["prompt_tokens"] < 50


def test_loading_and_unloading_need_an_admin_key(keyed: RouterProcess) -> None:
    body = {"model": "smollm2"}
    r = call(keyed, "POST", "/v1/models/unload", body, {"Authorization": f"Bearer {USER}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_permissions"
    r = call(keyed, "POST", "/v1/models/unload", body, {"x-api-key": ADMIN})
    assert r.status_code == 200 and r.json()["state"] == "unloaded"


def test_keys_never_reach_the_log(keyed: RouterProcess) -> None:
    log = Path(keyed.log_path).read_text()
    assert "API key(s) required" in log
    for key in (USER, ADMIN, FROM_ENV, FROM_FILE):
        assert key not in log
