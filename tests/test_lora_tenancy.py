"""LoRA adapters are models to keys, budgets and the records: a key's globs and budgets
apply per adapter name, and the usage ledger, request events and metrics carry the
adapter's name, not its base's. Synthetic workers: an adapter's request answers with the
adapter's name as each word, so which adapter ran is visible; an embedding base's adapter
counts its name as one more word of what it embeds or scores."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RouterProcess, running_router

pytestmark = pytest.mark.integration

ADMIN = "k-admin-lora"
PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  admin_api_keys: [k-admin-lora]
models:
  base: {model: /synthetic, engine: synthetic, max_loras: 2}
  pirate: {base: base, adapter: {pirate}, aliases: [arr]}
  poet: {base: base, adapter: {poet}}
  vectors: {model: /synthetic, engine: synthetic, task: embed, max_loras: 2}
  tuned: {base: vectors, adapter: {tuned}}
  qwen: {model: /synthetic, engine: synthetic, adapters_dir: {found}}
"""


def folder(path: Path) -> Path:
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    tmp = tmp_path_factory.mktemp("lora-tenancy")
    subst = {name: str(folder(tmp / name)) for name in ("pirate", "poet", "tuned")}
    found = tmp / "found"
    found.mkdir()
    folder(found / "llama-tuned")
    for name, fault in (("sixteen", {"lora_alpha": "sixteen"}), ("five", {"target_modules": 5})):
        config = json.loads((folder(found / name) / "adapter_config.json").read_text())
        (found / name / "adapter_config.json").write_text(json.dumps({**config, **fault}))
    subst["found"] = str(found)
    with running_router(PRESET, tmp, "lora-tenancy", subst) as r:
        yield r


def call(r: RouterProcess, key: str, method: str, path: str, body: object = None
         ) -> httpx.Response:
    return r.client.request(method, r.url + path, json=body, timeout=60,
                            headers={"Authorization": f"Bearer {key}"})


def chat(r: RouterProcess, key: str, model: str, max_tokens: int = 3) -> httpx.Response:
    return call(r, key, "POST", "/v1/chat/completions",
                {"model": model, "max_tokens": max_tokens,
                 "messages": [{"role": "user", "content": "hi"}]})


def make_key(r: RouterProcess, name: str, **spec: object) -> str:
    made = call(r, ADMIN, "POST", "/v1/keys", {"name": name, **spec})
    assert made.status_code == 201, made.text
    return str(made.json()["key"])


def test_an_adapter_is_served_by_its_base_under_its_own_name(router: RouterProcess) -> None:
    answer = chat(router, ADMIN, "pirate").json()
    assert answer["model"] == "pirate"
    assert answer["choices"][0]["message"]["content"].split() == ["pirate"] * 3
    assert chat(router, ADMIN, "base").json()["choices"][0]["message"]["content"].split() \
        == ["tok"] * 3


def test_a_keys_globs_name_adapters_like_any_model(router: RouterProcess) -> None:
    only = make_key(router, "parrot", models=["pirate"])
    assert chat(router, only, "pirate").status_code == 200
    for other in ("base", "poet"):
        refused = chat(router, only, other)
        assert refused.status_code == 404, refused.text  # as if it did not exist
        assert refused.json()["error"]["message"].endswith("Available: pirate")
    ids = [m["id"] for m in call(router, only, "GET", "/v1/models").json()["data"]]
    assert ids == ["pirate"]
    listed = call(router, only, "GET", "/v1/models/pirate").json()
    assert listed["parent"] == "base" and "root" not in listed  # its folder: admins only
    assert call(router, only, "GET", "/v1/models/poet").status_code == 404
    assert call(router, only, "POST", "/v1/models/unload",
                {"model": "pirate"}).status_code == 403


def test_a_budget_on_an_adapter_counts_that_adapter_only(router: RouterProcess) -> None:
    key = make_key(router, "bard", budgets=[{"tokens": 20, "period": "day", "model": "poet"}])
    codes = [chat(router, key, "poet", max_tokens=5).status_code for _ in range(6)]
    assert 429 in codes, codes
    assert chat(router, key, "pirate", max_tokens=5).status_code == 200  # not poet's budget
    rows = call(router, key, "GET", "/v1/usage?group_by=model").json()["data"]
    by_model = {row["model"]: row for row in rows}
    assert set(by_model) == {"poet", "pirate"}, rows
    assert by_model["poet"]["prompt_tokens"] + by_model["poet"]["completion_tokens"] <= 20


def test_events_and_metrics_carry_the_adapters_name(router: RouterProcess) -> None:
    chat(router, ADMIN, "poet")
    metrics = call(router, ADMIN, "GET", "/metrics").text
    assert 'model="poet"' in metrics
    events = call(router, ADMIN, "GET", "/v1/events").json()["data"]
    assert any(e.get("type") == "request" and e.get("model") == "poet" for e in events), events


def test_an_adapters_alias_and_its_folder_as_other_models_names(router: RouterProcess) -> None:
    """A key whose glob names an adapter's alias reads that adapter's figures, as a
    model's alias shows its figures; a viewer (not an admin) never reads its folder."""
    alias = make_key(router, "arr-only", models=["arr"])
    assert chat(router, alias, "arr").json()["model"] == "pirate"
    assert 'model="pirate"' in call(router, alias, "GET", "/metrics").text
    assert "pirate" in call(router, alias, "GET", "/v1/metrics").text
    viewer = make_key(router, "watcher", role="viewer")
    for body in [call(router, viewer, "GET", "/v1/models/pirate").json(),
                 *call(router, viewer, "GET", "/v1/models").json()["data"]]:
        assert "root" not in body, body
    assert "root" in call(router, ADMIN, "GET", "/v1/models/pirate").json()


def test_an_embedding_bases_adapter_embeds_and_scores_under_its_own_name(
        router: RouterProcess) -> None:
    key = make_key(router, "embedder")

    def embed(model: str) -> dict[str, object]:
        answer = call(router, key, "POST", "/v1/embeddings",
                      {"model": model, "input": ["a red fox", "a blue sea"]})
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    base, tuned = embed("vectors"), embed("tuned")
    assert base["model"] == "vectors" and tuned["model"] == "tuned"
    vectors = [[item["embedding"] for item in answer["data"]]  # type: ignore[attr-defined]
               for answer in (base, tuned)]
    assert vectors[0] != vectors[1]  # the adapter ran, not the base alone
    assert [item["embedding"] for item in embed("tuned")["data"]] == vectors[1]  # type: ignore[attr-defined]
    scores = {}
    for model in ("vectors", "tuned"):
        answer = call(router, key, "POST", "/v1/score",
                      {"model": model, "text_1": "a red fox", "text_2": ["a red fox", "sea"]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == model
        scores[model] = [item["score"] for item in answer.json()["data"]]
    assert scores["vectors"] != scores["tuned"], scores
    ranked = call(router, key, "POST", "/v1/rerank",
                  {"model": "tuned", "query": "a red fox", "documents": ["sea", "a red fox"]})
    assert ranked.status_code == 200, ranked.text
    assert ranked.json()["model"] == "tuned"
    assert ranked.json()["results"][0]["index"] == 1
    rows = call(router, key, "GET", "/v1/usage?group_by=model").json()["data"]
    by_model = {row["model"]: row for row in rows}
    assert set(by_model) == {"vectors", "tuned"}, rows  # never its base's name
    assert by_model["tuned"]["requests"] == 4 and by_model["tuned"]["prompt_tokens"] > 0, rows
    assert 'model="tuned"' in call(router, ADMIN, "GET", "/metrics").text


def test_a_generation_bases_adapter_is_refused_on_embeddings_and_scores(
        router: RouterProcess) -> None:
    for path, body in (("/v1/embeddings", {"input": "hi"}),
                       ("/v1/score", {"text_1": "hi", "text_2": "ho"})):
        refused = call(router, ADMIN, "POST", path, {"model": "pirate", **body})
        assert refused.status_code == 400, refused.text  # never the base's vectors
        error = refused.json()["error"]
        assert error["code"] == "wrong_model_task" and error["param"] == "model", error
        assert "adapter of 'base'" in error["message"], error
    tuned = call(router, ADMIN, "POST", "/v1/chat/completions",
                 {"model": "tuned", "messages": [{"role": "user", "content": "hi"}]})
    assert tuned.status_code == 400 and tuned.json()["error"]["code"] == "wrong_model_task"


def test_a_found_adapter_is_a_keys_by_its_id_never_by_its_folders_name(
        router: RouterProcess) -> None:
    """``qwen``'s ``adapters_dir`` holds ``llama-tuned``: a key limited to ``llama-*`` may
    not reach it (nor so the qwen base) by the folder's name, found before or not, and a
    key limited to ``qwen*`` may."""
    llama = make_key(router, "llamas", models=["llama-*"])
    qwen = make_key(router, "qwens", models=["qwen*"])
    for found_first in (False, True):
        if found_first:
            assert chat(router, ADMIN, "qwen/llama-tuned").status_code == 200
        for name in ("llama-tuned", "qwen/llama-tuned"):
            refused = chat(router, llama, name)
            assert refused.status_code == 404, refused.text  # as any model it may not use
            assert refused.json()["error"]["code"] == "model_not_found", refused.text
        ids = [m["id"] for m in call(router, llama, "GET", "/v1/models").json()["data"]]
        assert ids == [], ids
        assert call(router, llama, "GET", "/v1/models/qwen/llama-tuned").status_code == 404
        for name in ("llama-tuned", "qwen/llama-tuned"):
            answer = chat(router, qwen, name)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "qwen/llama-tuned"


def test_a_found_folders_malformed_config_is_a_400_naming_the_field(
        router: RouterProcess) -> None:
    """A request naming ``base/folder`` whose ``adapter_config.json`` has a value of the
    wrong type is refused naming the field (and the folder by its last name only)."""
    key = make_key(router, "namer", models=["qwen*"])
    for name, field in (("qwen/sixteen", "$.lora_alpha"), ("qwen/five", "$.target_modules")):
        refused = chat(router, key, name)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "adapter_invalid" and field in error["message"], error
        assert str(router.preset.parent) not in error["message"], error
    assert chat(router, key, "qwen").status_code == 200  # its base serves on
