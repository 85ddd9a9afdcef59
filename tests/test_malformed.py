"""Malformed requests, by hand: each gets a 4xx with OpenAI's error body, and the real
model serves normally afterwards (same worker, nothing lost).

Every one is refused before generation (by the router, or by the worker's checks before
the engine), so the list is cheap to run against the shared router. Models other than
``smollm2`` are never named: a refusal must not start a worker. No case names an unknown
model: with a ``default_model`` such a name resolves to the default (and an unload of it
would stop the shared model).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conformance import validate
from tests.conftest import RouterProcess

pytestmark = pytest.mark.integration

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
TOKENIZE, DETOKENIZE = "/v1/tokenize", "/v1/detokenize"
LOAD, UNLOAD = "/v1/models/load", "/v1/models/unload"
HI = [{"role": "user", "content": "hi"}]
BIG, SMALL = 2**63, -(2**63) - 1  # one past int64 at each end
DEEP = 10_000


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "smollm2", "messages": HI, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "smollm2", "prompt": "hi", **fields}


def nested(open_: bytes, close: bytes) -> bytes:
    return open_ * DEEP + close * DEEP


def case(name: str, path: str, body: Any, *, method: str = "POST", status: int | None = None,
         headers: dict[str, str] | None = None) -> Any:
    """One request: ``body`` as bytes is sent as is, anything else as JSON."""
    return pytest.param(method, path, body, headers, status, id=name)


CASES = [
    # -- not JSON, or not an object ----------------------------------------------------
    case("chat-truncated-json", CHAT, b'{"model": "smollm2", "messages": [', status=400),
    case("chat-empty-body", CHAT, b"", status=400),
    case("chat-whitespace-body", CHAT, b" \r\n\t ", status=400),
    case("chat-json-null", CHAT, b"null", status=400),
    case("chat-json-array", CHAT, b"[]", status=400),
    case("chat-json-string", CHAT, b'"hello"', status=400),
    case("chat-json-number", CHAT, b"42", status=400),
    case("chat-trailing-garbage", CHAT, json.dumps(chat()).encode() + b" }", status=400),
    case("chat-nan-literal", CHAT, b'{"messages": [], "temperature": NaN}', status=400),
    case("chat-single-quotes", CHAT, b"{'messages': []}", status=400),
    case("chat-invalid-utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
         status=400),
    case("chat-cesu8-surrogate-bytes", CHAT,
         b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', status=400),
    case("chat-lone-high-surrogate", CHAT,
         b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', status=400),
    case("chat-lone-low-surrogate", CHAT,
         b'{"messages": [{"role": "user", "content": "\\udc00b"}]}', status=400),
    case("chat-surrogate-in-key", CHAT, b'{"\\udfff": 1, "messages": []}', status=400),
    case("chat-bom-prefixed", CHAT, b"\xef\xbb\xbf" + json.dumps(chat()).encode(), status=400),
    case("chat-number-out-of-range", CHAT, b'{"messages": [], "temperature": 1e400}',
         status=400),
    case("chat-huge-integer-literal", CHAT,
         b'{"messages": [], "max_tokens": 1' + b"0" * 400 + b"}", status=400),
    # -- nesting -------------------------------------------------------------------------
    case("chat-deep-arrays-in-messages", CHAT,
         b'{"model": "smollm2", "messages": ' + nested(b"[", b"]") + b"}", status=400),
    case("chat-deep-objects-in-kwargs", CHAT,
         b'{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], '
         b'"chat_template_kwargs": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}",
         status=400),
    case("chat-deep-arrays-in-tool-parameters", CHAT, b'{"model": "smollm2", "messages": '
         b'[{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": '
         b'{"name": "f", "parameters": {"p": ' + nested(b"[", b"]") + b"}}}]}", status=400),
    case("tokenize-deep-arrays", TOKENIZE, b'{"prompt": ' + nested(b"[", b"]") + b"}",
         status=400),
    # -- wrong types ---------------------------------------------------------------------
    case("chat-missing-messages", CHAT, {"model": "smollm2"}, status=400),
    case("chat-messages-string", CHAT, chat(messages="hi"), status=400),
    case("chat-messages-empty", CHAT, chat(messages=[]), status=400),
    case("chat-role-int", CHAT, chat(messages=[{"role": 1, "content": "x"}]), status=400),
    case("chat-role-unknown", CHAT, chat(messages=[{"role": "root", "content": "x"}]),
         status=400),
    case("chat-content-int", CHAT, chat(messages=[{"role": "user", "content": 5}]),
         status=400),
    case("chat-content-part-unknown", CHAT,
         chat(messages=[{"role": "user", "content": [{"type": "video", "video": "x"}]}]),
         status=400),
    case("chat-model-int", CHAT, chat(model=7), status=400),
    case("chat-n-float", CHAT, chat(n=1.5), status=400),
    case("chat-max-tokens-bool", CHAT, chat(max_tokens=True), status=400),
    case("chat-stream-string", CHAT, chat(stream="yes"), status=400),
    case("chat-stop-int", CHAT, chat(stop=3), status=400),
    case("chat-tools-not-list", CHAT, chat(tools={"type": "function"}), status=400),
    case("chat-response-format-unknown", CHAT, chat(response_format={"type": "xml"}),
         status=400),
    case("chat-structured-outputs-two", CHAT,
         chat(structured_outputs={"regex": "a+", "choice": ["a"]}), status=400),
    case("chat-tool-choice-unknown-tool", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice={"type": "function", "function": {"name": "g"}}), status=400),
    # -- int64 extremes and huge counts -------------------------------------------------
    case("chat-max-tokens-2^63", CHAT, chat(max_tokens=BIG), status=400),
    case("chat-max-tokens-below-int64", CHAT, chat(max_tokens=SMALL), status=400),
    case("chat-max-tokens-int64-max", CHAT, chat(max_tokens=BIG - 1), status=400),
    case("chat-max-tokens-int64-min", CHAT, chat(max_tokens=-(2**63)), status=400),
    case("chat-max-completion-tokens-2^63", CHAT, chat(max_completion_tokens=BIG), status=400),
    case("chat-seed-2^63", CHAT, chat(seed=BIG), status=400),
    case("chat-seed-below-int64", CHAT, chat(seed=SMALL), status=400),
    case("chat-n-2^63", CHAT, chat(n=BIG), status=400),
    case("chat-n-billion", CHAT, chat(n=10**9), status=400),
    case("chat-n-negative", CHAT, chat(n=-1), status=400),
    case("chat-top-logprobs-2^63", CHAT, chat(logprobs=True, top_logprobs=BIG), status=400),
    case("chat-top-k-int64-min", CHAT, chat(top_k=-(2**63)), status=400),
    case("chat-min-tokens-int64-max", CHAT, chat(min_tokens=BIG - 1, max_tokens=5),
         status=400),
    case("chat-logit-bias-key-2^63", CHAT, chat(logit_bias={str(BIG): 1}), status=400),
    case("chat-logit-bias-key-negative", CHAT, chat(logit_bias={"-1": 1}), status=400),
    case("chat-logit-bias-key-superscript", CHAT, chat(logit_bias={"\u00b2": 1}), status=400),
    case("chat-logit-bias-key-arabic-digit", CHAT, chat(logit_bias={"\u0663": 1}),
         status=400),
    case("chat-logit-bias-value-2^63", CHAT, chat(logit_bias={"1": BIG}), status=400),
    case("chat-logit-bias-value-string", CHAT, chat(logit_bias={"1": "up"}), status=400),
    case("chat-stop-token-ids-2^63", CHAT, chat(stop_token_ids=[BIG]), status=400),
    case("chat-tool-parameters-2^63", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "maxLength": BIG}}}]), status=400),
    case("chat-template-kwargs-below-int64", CHAT, chat(chat_template_kwargs={"x": [SMALL]}),
         status=400),
    case("chat-json-schema-2^63", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"maxItems": BIG}}}),
         status=400),
    case("chat-stop-65-sequences", CHAT, chat(stop=["s"] * 65), status=400),
    case("chat-unicode-garbage-role", CHAT, chat(messages=[
        {"role": "\u0000\ufffd\u202e\U0001f4a9" * 50, "content": "x"}]), status=400),
    case("chat-huge-role", CHAT, chat(messages=[{"role": "u" * 100_000, "content": "x"}]),
         status=400),
    case("chat-model-list", CHAT, chat(model=["smollm2"]), status=400),
    # -- completions ---------------------------------------------------------------------
    case("completions-missing-prompt", COMPLETIONS, {"model": "smollm2"}, status=400),
    case("completions-prompt-int", COMPLETIONS, completion(prompt=5), status=400),
    case("completions-prompt-empty-list", COMPLETIONS, completion(prompt=[]), status=400),
    case("completions-prompt-empty-token-list", COMPLETIONS, completion(prompt=[[]]),
         status=400),
    case("completions-prompt-mixed-list", COMPLETIONS, completion(prompt=[[1, "a"]]),
         status=400),
    case("completions-prompt-token-2^63", COMPLETIONS, completion(prompt=[1, BIG]),
         status=400),
    case("completions-prompt-token-negative", COMPLETIONS, completion(prompt=[1, -1]),
         status=400),
    case("completions-prompt-token-beyond-vocab", COMPLETIONS, completion(prompt=[10**9]),
         status=400),
    case("completions-million-prompts", COMPLETIONS, completion(prompt=["x"] * 1_000_000),
         status=400),
    case("completions-million-token-lists", COMPLETIONS,
         completion(prompt=[[1]] * 1_000_000), status=400),
    case("completions-max-tokens-2^63", COMPLETIONS, completion(max_tokens=BIG), status=400),
    case("completions-max-tokens-zero", COMPLETIONS, completion(max_tokens=0), status=400),
    case("completions-best-of-2^63", COMPLETIONS, completion(best_of=BIG), status=400),
    case("completions-logprobs-21", COMPLETIONS, completion(logprobs=21), status=400),
    case("completions-suffix", COMPLETIONS, completion(suffix="end"), status=400),
    case("completions-echo-token-prompt", COMPLETIONS, completion(prompt=[1, 2], echo=True),
         status=400),
    # -- embeddings (the generation model refuses them: no embedding worker starts) ------
    case("embeddings-missing-input", EMBEDDINGS, {"model": "smollm2"}, status=400),
    case("embeddings-empty-list", EMBEDDINGS, {"model": "smollm2", "input": []}, status=400),
    case("embeddings-token-2^63", EMBEDDINGS, {"model": "smollm2", "input": [BIG]},
         status=400),
    case("embeddings-2049-inputs", EMBEDDINGS, {"model": "smollm2", "input": ["a"] * 2049},
         status=400),
    case("embeddings-encoding-hex", EMBEDDINGS,
         {"model": "smollm2", "input": "a", "encoding_format": "hex"}, status=400),
    case("embeddings-dimensions-zero", EMBEDDINGS,
         {"model": "smollm2", "input": "a", "dimensions": 0}, status=400),
    case("embeddings-dimensions-2^63", EMBEDDINGS,
         {"model": "smollm2", "input": "a", "dimensions": BIG}, status=400),
    case("embeddings-on-generation-model", EMBEDDINGS, {"model": "smollm2", "input": "a"},
         status=400),
    # -- tokenize / detokenize -----------------------------------------------------------
    case("tokenize-neither", TOKENIZE, {"model": "smollm2"}, status=400),
    case("tokenize-both", TOKENIZE, {"model": "smollm2", "prompt": "a", "messages": HI},
         status=400),
    case("tokenize-prompt-int", TOKENIZE, {"model": "smollm2", "prompt": 1}, status=400),
    case("tokenize-tool-parameters-2^63", TOKENIZE, {"model": "smollm2", "messages": HI,
         "tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": BIG}}}]},
         status=400),
    case("tokenize-template-kwargs-2^63", TOKENIZE,
         {"model": "smollm2", "prompt": "a", "chat_template_kwargs": {"x": BIG}}, status=400),
    case("detokenize-missing-tokens", DETOKENIZE, {"model": "smollm2"}, status=400),
    case("detokenize-token-2^63", DETOKENIZE, {"model": "smollm2", "tokens": [BIG]},
         status=400),
    case("detokenize-token-below-int64", DETOKENIZE, {"model": "smollm2", "tokens": [SMALL]},
         status=400),
    case("detokenize-token-string", DETOKENIZE, {"model": "smollm2", "tokens": ["a"]},
         status=400),
    case("detokenize-token-negative", DETOKENIZE, {"model": "smollm2", "tokens": [-1]},
         status=400),
    case("detokenize-token-beyond-vocab", DETOKENIZE, {"model": "smollm2", "tokens": [10**9]},
         status=400),
    # -- admin -----------------------------------------------------------------------------
    case("load-empty-object", LOAD, {}, status=400),
    case("load-model-int", LOAD, {"model": 1}, status=400),
    case("load-wait-string", LOAD, {"model": "smollm2", "wait": "yes"}, status=400),
    case("load-model-null", LOAD, {"model": None}, status=400),
    case("unload-model-list-of-ints", UNLOAD, {"model": [1]}, status=400),
    case("unload-model-empty-list", UNLOAD, {"model": []}, status=400),
    case("load-model-unknown-in-list", LOAD, {"model": ["smollm2", "nope"]}, status=404),
    case("unload-force-string", UNLOAD, {"model": "smollm2", "force": "yes"}, status=400),
    case("unload-bad-json", UNLOAD, b"{model: smollm2}", status=400),
    # -- content types, sizes ----------------------------------------------------------
    case("chat-text-plain", CHAT, json.dumps(chat()).encode(),
         headers={"content-type": "text/plain"}, status=415),
    case("chat-form-urlencoded", CHAT, b"model=smollm2&messages=hi",
         headers={"content-type": "application/x-www-form-urlencoded"}, status=415),
    case("chat-multipart", CHAT, b"--x\r\n\r\nhi\r\n--x--\r\n",
         headers={"content-type": "multipart/form-data; boundary=x"}, status=415),
    case("load-xml", LOAD, b"<model>smollm2</model>",
         headers={"content-type": "application/xml"}, status=415),
    case("chat-latin1-charset", CHAT, '{"messages": [{"role": "user", "content": "caf\xe9"}]}'
         .encode("latin-1"), headers={"content-type": "application/json; charset=latin-1"},
         status=400),
    case("chat-over-body-limit", CHAT, b"{" + b" " * (32 * 1024 * 1024) + b"}", status=413),
    # -- methods and paths -------------------------------------------------------------
    case("chat-get", CHAT, None, method="GET", status=405),
    case("completions-put", COMPLETIONS, json.dumps(completion()).encode(), method="PUT",
         status=405),
    case("models-delete", "/v1/models", None, method="DELETE", status=405),
    case("health-post", "/health", b"{}", method="POST", status=405),
    case("load-get", LOAD, None, method="GET", status=404),  # read as model id "load"
    case("unknown-path", "/v1/does-not-exist", b"{}", status=404),
    case("unknown-model-id", "/v1/models/nope\u00e9", None, method="GET", status=404),
    case("openai-path-without-v1", "/chat/completions", json.dumps(chat()).encode(),
         status=404),
]


@pytest.fixture(scope="module")
def smollm2_pid(router: RouterProcess) -> int:
    """The worker before any malformed request: it must be the same one afterwards."""
    router.wait_model("smollm2")
    pid = router.client.get(f"{router.url}/v1/models/smollm2").json()["pid"]
    assert isinstance(pid, int)
    return pid


def test_at_least_sixty_cases() -> None:
    assert len(CASES) >= 60


@pytest.mark.parametrize("method,path,body,headers,status", CASES)
def test_malformed_request_gets_openai_4xx(router: RouterProcess, smollm2_pid: int,
                                           method: str, path: str, body: Any,
                                           headers: dict[str, str] | None,
                                           status: int | None) -> None:
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    if headers is None and content is not None and not isinstance(body, bytes):
        headers = {"content-type": "application/json"}
    r = router.client.request(method, router.url + path, content=content, headers=headers,
                              timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    if status is not None:
        assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json"), r.headers
    payload = r.json()
    validate("ErrorResponse", payload)
    assert set(payload["error"]) == {"message", "type", "param", "code"}, payload
    assert payload["error"]["message"], payload


def test_a_normal_request_still_succeeds(router: RouterProcess, smollm2_pid: int) -> None:
    """Last in the file: the real model answers, from the same worker process."""
    r = router.client.post(f"{router.url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    validate("CreateChatCompletionResponse", r.json())
    assert r.json()["choices"][0]["message"]["content"]
    model = router.client.get(f"{router.url}/v1/models/smollm2").json()
    assert model["state"] == "ready" and model["pid"] == smollm2_pid, model
