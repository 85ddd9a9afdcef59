"""Model listing, name resolution, tokenize, health, and two workers at once."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.conformance import validate
from tests.conftest import RouterProcess, running_router

pytestmark = pytest.mark.integration
HI = [{"role": "user", "content": "Say hi."}]


def test_models_list_conforms(base_url: str) -> None:
    body = httpx.get(f"{base_url}/models").json()
    validate("ListModelsResponse", body)
    ids = {m["id"]: m for m in body["data"]}
    assert set(ids) == {"smollm2", "smollm2-b", "smollm2-embed", "tiny-vlm"}
    assert ids["smollm2"]["aliases"] == ["smol", "Tiny-Chat", "claude-sonnet"]
    assert ids["smollm2"]["state"] == "ready"
    one = httpx.get(f"{base_url}/models/smollm2").json()
    validate("Model", one)
    assert one["placement"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    missing = httpx.get(f"{base_url}/models/nope")
    assert missing.status_code == 404
    validate("ErrorResponse", missing.json())


@pytest.mark.parametrize("name,expected", [
    ("smollm2", "smollm2"),          # exact id
    ("smol", "smollm2"),             # exact alias
    ("tiny-chat", "smollm2"),        # case-insensitive alias
    ("SMOLLM2", "smollm2"),          # case-insensitive id
    ("llm2-b", "smollm2-b"),         # unique substring
    ("no-such-model", "smollm2"),    # default_model
])
def test_every_resolution_rule(client, name: str, expected: str) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(model=name, messages=HI, max_tokens=2)
    assert r.model == expected


def test_two_entries_run_as_two_workers_at_once(router: RouterProcess, client) -> None:  # type: ignore[no-untyped-def]
    def ask(model: str) -> str:
        return client.chat.completions.create(model=model, messages=HI, max_tokens=8,
                                              temperature=0).model
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answered = list(pool.map(ask, ["smol", "second-worker"]))
    assert answered == ["smollm2", "smollm2-b"]
    models = {m["id"]: m for m in httpx.get(f"{router.url}/v1/models").json()["data"]}
    assert models["smollm2"]["state"] == models["smollm2-b"]["state"] == "ready"
    assert models["smollm2"]["pid"] != models["smollm2-b"]["pid"]
    assert models["smollm2-b"]["max_model_len"] == 1024
    assert models["smollm2-b"]["placement"]["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_tokenize_and_health(base_url: str, router: RouterProcess) -> None:
    r = httpx.post(f"{base_url}/tokenize", json={"model": "smol", "prompt": "Hello world",
                                                 "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 2048
    assert "".join(r["token_strs"]).replace("\u0120", " ").endswith("world")
    health = httpx.get(f"{router.url}/health").json()
    assert health["status"] == "ok" and health["models"]["smollm2"] == "ready"


BARE_PRESET = """
server: {host: 127.0.0.1, port: {port}}
models:
  alpha-chat: {model: "builtin:smollm2"}
  alpha-code: {model: "builtin:smollm2", aliases: [coder]}
  broken: {model: /nonexistent/model/folder}
"""


@pytest.fixture(scope="module")
def bare_router(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A router without default_model; no worker is ever started in it."""
    with running_router(BARE_PRESET, tmp_path_factory.mktemp("bare"), "bare") as r:
        yield r


@pytest.mark.parametrize("name,code", [("gpt-4o", "model_not_found"),
                                       ("alpha", "model_ambiguous")])
def test_unknown_or_ambiguous_model_is_404_without_default(bare_router: RouterProcess,
                                                            name: str, code: str) -> None:
    r = httpx.post(f"{bare_router.url}/v1/chat/completions",
                   json={"model": name, "messages": HI})
    assert r.status_code == 404
    validate("ErrorResponse", r.json())
    assert r.json()["error"]["code"] == code and r.json()["error"]["param"] == "model"
    states = httpx.get(f"{bare_router.url}/health").json()["models"]
    assert states["alpha-chat"] == states["alpha-code"] == "unloaded"


def test_a_model_that_cannot_start_fails_with_its_reason(bare_router: RouterProcess) -> None:
    r = httpx.post(f"{bare_router.url}/v1/chat/completions", timeout=300,
                   json={"model": "broken", "messages": HI})
    assert r.status_code == 503, r.text
    validate("ErrorResponse", r.json())
    assert r.json()["error"]["code"] == "model_unavailable"
    m = httpx.get(f"{bare_router.url}/v1/models/broken").json()
    assert m["state"] == "failed" and m["exit_code"] != 0 and m["failures"] == 1
    assert "/nonexistent/model/folder" in m["error"]       # the worker log's tail is kept
    again = httpx.post(f"{bare_router.url}/v1/chat/completions", timeout=300,
                       json={"model": "broken", "messages": HI})
    assert again.status_code == 503                          # retried (after backoff), fails again
    assert httpx.get(f"{bare_router.url}/v1/models/broken").json()["failures"] == 2
