"""``/v1/embeddings`` against a real pooling worker: ``smollm2-embed`` is the embedded
SmolLM2 run with vLLM's pooling runner (``task: embed``)."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import pytest

pytestmark = pytest.mark.integration


def test_embeddings_of_strings_token_ids_and_base64(client) -> None:  # type: ignore[no-untyped-def]
    out = client.embeddings.create(model="smollm2-embed",
                                   input=["The cat sat on the mat.", "A feline rested on a rug.",
                                          "Quarterly tax filing deadlines"])
    assert out.object == "list" and out.model == "smollm2-embed"
    assert [d.index for d in out.data] == [0, 1, 2]
    vectors = [d.embedding for d in out.data]
    assert {len(v) for v in vectors} == {576}
    assert out.usage.prompt_tokens == out.usage.total_tokens > 6

    def cos(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b)) / math.sqrt(
            sum(x * x for x in a) * sum(y * y for y in b))

    assert abs(cos(vectors[0], vectors[0]) - 1) < 1e-5
    assert cos(vectors[0], vectors[1]) > cos(vectors[0], vectors[2])  # related texts closer
    ids = client.embeddings.create(model="smollm2-embed", input=[[504, 2644, 3290]])
    assert len(ids.data[0].embedding) == 576 and ids.usage.prompt_tokens == 3
    raw = httpx.post(f"{client.base_url}embeddings", timeout=60, json={
        "model": "smollm2-embed", "input": "The cat sat on the mat.",
        "encoding_format": "base64"}).json()
    decoded = struct.unpack("<576f", base64.b64decode(raw["data"][0]["embedding"]))
    assert max(abs(a - b) for a, b in zip(decoded, vectors[0])) < 1e-4


def test_embedding_errors_are_400_naming_the_field(base_url: str) -> None:
    cases = [({"model": "smollm2-embed", "input": []}, "input"),
             ({"model": "smollm2-embed", "input": "x", "encoding_format": "hex"},
              "encoding_format"),
             ({"model": "smollm2-embed", "input": "x", "dimensions": 64}, "dimensions"),
             ({"model": "smollm2", "input": "x"}, "model")]  # a chat model does not embed
    for body, param in cases:
        r = httpx.post(f"{base_url}/embeddings", timeout=300, json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{base_url}/chat/completions", timeout=60, json={
        "model": "smollm2-embed", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
