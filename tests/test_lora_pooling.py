"""A LoRA adapter of a pooling model, on real vLLM: the embedded SmolLM2 run with the
pooling runner (``task: embed``) serves embeddings and scores with an adapter applied,
as peft's model computes them. One router, one worker, a few requests."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.lora_adapters import base_path, make_adapters
from tests.conftest import RouterProcess, running_router

pytestmark = pytest.mark.integration

PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  load_timeout: 600
  spare_workers: 0
models:
  vectors:
    model: "builtin:smollm2"
    task: embed
    dtype: float32
    max_model_len: 512
    max_loras: 1
    max_cpu_loras: 2
  a8: {base: vectors, adapter: {a8}}
"""

TEXT = "The cat sat on the mat."
DOCUMENTS = ["A feline rested on a rug.", "Quarterly tax filing deadlines"]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_adapters(tmp_path_factory.mktemp("adapters"), {"a8": (8, 4)})


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory,
           made: dict[str, Path]) -> Iterator[RouterProcess]:
    with running_router(PRESET, tmp_path_factory.mktemp("lora-pooling"), "lora-pooling",
                        {"a8": str(made["a8"])}) as r:
        yield r


def post(r: RouterProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = r.client.post(f"{r.url}{path}", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == body["model"]
    return dict(answer.json())


def embed(r: RouterProcess, model: str, inputs: list[Any]) -> list[list[float]]:
    return [item["embedding"] for item in post(r, "/v1/embeddings",
                                               {"model": model, "input": inputs})["data"]]


def last_token_embedding(adapter: Path | None, ids: list[int]) -> list[float]:
    """What vLLM's pooling runner makes of a causal LM (the last token's final hidden
    state, normalised), computed by transformers, with peft's ``adapter`` on top."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(base_path(), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    return [float(x) for x in torch.nn.functional.normalize(hidden, dim=0)]


def cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(
        sum(x * x for x in a) * sum(y * y for y in b))


def test_an_adapter_of_an_embedding_model_embeds_and_scores_with_its_weights(
        router: RouterProcess, made: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(base_path()).encode(TEXT)
    base, tuned = embed(router, "vectors", [ids])[0], embed(router, "a8", [ids])[0]
    assert max(abs(x - y) for x, y in zip(base, tuned)) > 0.01  # the adapter ran
    assert embed(router, "a8", [ids])[0] == tuned  # and the same every time
    for served, adapter in ((base, None), (tuned, made["a8"])):
        expected = last_token_embedding(adapter, ids)
        assert max(abs(x - y) for x, y in zip(served, expected)) < 2e-3, adapter

    # /v1/score of an embedding model: the cosine of the adapter's own embeddings
    vectors = embed(router, "a8", [TEXT, *DOCUMENTS])
    scored = post(router, "/v1/score", {"model": "a8", "text_1": TEXT, "text_2": DOCUMENTS})
    assert [d["score"] for d in scored["data"]] == pytest.approx(
        [cos(vectors[0], v) for v in vectors[1:]], abs=1e-4)
    of_base = post(router, "/v1/score", {"model": "vectors", "text_1": TEXT,
                                         "text_2": DOCUMENTS})
    assert [d["score"] for d in of_base["data"]] != pytest.approx(
        [d["score"] for d in scored["data"]], abs=1e-4)
    ranked = post(router, "/v1/rerank", {"model": "a8", "query": TEXT, "documents": DOCUMENTS})
    assert sorted(r["relevance_score"] for r in ranked["results"]) == pytest.approx(
        sorted(d["score"] for d in scored["data"]), abs=1e-4)
    models = httpx.get(f"{router.url}/v1/models/a8", timeout=60).json()
    assert models["state"] in ("resident", "cpu"), models  # loaded into its base's engine
