"""Rerank and score (issue 23): ``POST /v1/rerank`` (also ``/rerank`` and ``/v2/rerank``) in
Cohere's and Jina's shape, ``POST /v1/score`` (also ``/score``) in vLLM's.

The protocol's rules run on a synthetic engine, whose score is the share of words a query
and a document have in common. The real models are made here: ``smollm2-rerank`` is the
embedded SmolLM2 converted by vLLM into a sequence classifier (``convert: classify``, the
"yes" and "no" rows of its LM head as the classifier, as Qwen3-Reranker is served) with
the shipped ChatML score template; ``tiny-classifier`` a ``LlamaForSequenceClassification``
with one label and random weights (``task: classify``); ``smollm2-embed`` (the shared
router's) scores by the cosine of two embeddings. Each score must equal what transformers
(or the model's own embeddings) give for the same pair.

On 651c79a every endpoint here was a 404, and an embedding request spent no tokens of a
key's budget (its prompt tokens were never counted).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import RouterProcess, running_router

SYNTH_PRESET = """
server: {host: 127.0.0.1, port: {port}, spare_workers: 0, default_model: chat}
models:
  chat: {model: /synthetic, engine: synthetic}
  ranker: {model: /synthetic, engine: synthetic, task: score}
"""
QUERY = "where the cat sat"
DOCS = ["the cat sat on the mat", "dogs bark at night", "a cat and a dog",
        "the cat sat on the mat"]


def overlap(a: str, b: str) -> float:
    """The synthetic engine's score: the share of words two texts have in common."""
    x, y = set(a.lower().split()), set(b.lower().split())
    return len(x & y) / len(x | y)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with running_router(SYNTH_PRESET, tmp_path_factory.mktemp("scoring"), "scoring") as r:
        yield r


def post(r: RouterProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return r.client.post(r.url + path, json=body, timeout=120)


def check_vllm_shape(kind: str, body: dict[str, Any]) -> None:
    """``body`` parses as vLLM's own response type for ``/rerank`` or ``/score``."""
    from vllm.entrypoints.pooling.scoring.protocol import RerankResponse, ScoreResponse

    (RerankResponse if kind == "rerank" else ScoreResponse).model_validate(body, strict=True)


def test_rerank_orders_cuts_and_returns_documents(synthetic: RouterProcess) -> None:
    r = synthetic
    body = post(r, "/v1/rerank", {"model": "ranker", "query": QUERY, "documents": DOCS}).json()
    expected = sorted(range(len(DOCS)), key=lambda i: -overlap(QUERY, DOCS[i]))
    assert [x["index"] for x in body["results"]] == expected == [0, 3, 2, 1]  # ties keep order
    for x in body["results"]:
        assert x["relevance_score"] == pytest.approx(overlap(QUERY, DOCS[x["index"]]))
        assert x["document"] == {"text": DOCS[x["index"]]}
    assert re.fullmatch(r"rerank-[0-9a-f]{24}", body["id"]) and body["model"] == "ranker"
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    assert body["meta"]["billed_units"] == {"search_units": 1}
    assert body["meta"]["tokens"]["input_tokens"] == body["usage"]["prompt_tokens"]
    check_vllm_shape("rerank", body)

    cut = post(r, "/v1/rerank", {"model": "ranker", "query": QUERY, "documents": DOCS,
                                 "top_n": 2, "return_documents": False}).json()
    assert cut["results"] == [{"index": 0, "relevance_score": 0.5},
                              {"index": 3, "relevance_score": 0.5}]
    objects = post(r, "/v1/rerank", {"model": "ranker", "query": QUERY,
                                     "documents": [{"text": d, "id": n} for n, d in
                                                   enumerate(DOCS)]}).json()
    assert [x["index"] for x in objects["results"]] == expected
    fields = post(r, "/v1/rerank", {"model": "ranker", "query": "title cat", "rank_fields":
                                    ["title", "text"], "documents": [
                                        {"title": "dog", "text": "a dog"},
                                        {"title": "cat", "text": "a cat"}]}).json()
    assert [x["index"] for x in fields["results"]] == [1, 0]
    assert fields["results"][0]["document"]["text"] == "title: cat\ntext: a cat"
    for path, version in (("/rerank", "1"), ("/v2/rerank", "2")):
        other = post(r, path, {"model": "ranker", "query": QUERY, "documents": DOCS}).json()
        assert other["results"] == body["results"] and other["id"] != body["id"]
        assert other["meta"]["api_version"] == {"version": version}


def test_cohere_sdks_rerank_against_the_router(synthetic: RouterProcess) -> None:
    import cohere

    v2 = cohere.ClientV2(api_key="unused", base_url=synthetic.url, timeout=60)
    ranked = v2.rerank(model="ranker", query=QUERY, documents=DOCS, top_n=3)
    assert [x.index for x in ranked.results] == [0, 3, 2]
    assert ranked.results[2].relevance_score == pytest.approx(overlap(QUERY, DOCS[2]))
    v1 = cohere.Client(api_key="unused", base_url=synthetic.url, timeout=60)
    with_docs = v1.rerank(model="ranker", query=QUERY, documents=DOCS, top_n=1,
                          return_documents=True)
    assert with_docs.results[0].index == 0 and with_docs.results[0].document is not None
    assert with_docs.results[0].document.text == DOCS[0]
    assert with_docs.meta is not None and with_docs.meta.billed_units is not None
    assert with_docs.meta.billed_units.search_units == 1


def test_score_pairs_one_to_one_one_to_many_and_many_to_many(synthetic: RouterProcess) -> None:
    r = synthetic
    one_to_many = post(r, "/v1/score", {"model": "ranker", "text_1": QUERY,
                                        "text_2": DOCS}).json()
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2, 3]
    assert [d["score"] for d in one_to_many["data"]] == pytest.approx(
        [overlap(QUERY, d) for d in DOCS])
    assert {d["object"] for d in one_to_many["data"]} == {"score"}
    assert one_to_many["object"] == "list" and one_to_many["model"] == "ranker"
    assert re.fullmatch(r"score-[0-9a-f]{24}", one_to_many["id"])
    assert one_to_many["usage"]["completion_tokens"] == 0
    check_vllm_shape("score", one_to_many)
    pairwise = post(r, "/score", {"model": "ranker", "text_1": ["a b", "c d"],
                                  "text_2": ["a x", "c d"]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([1 / 3, 1.0])
    single = post(r, "/v1/score", {"model": "ranker", "text_1": "a b", "text_2": "b"}).json()
    assert [d["score"] for d in single["data"]] == pytest.approx([0.5])
    for first, second in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2")):
        named = post(r, "/v1/score", {"model": "ranker", first: QUERY, second: DOCS}).json()
        assert [d["score"] for d in named["data"]] == [d["score"] for d in one_to_many["data"]]


def test_bad_rerank_and_score_requests_are_400s_naming_the_field(
        synthetic: RouterProcess) -> None:
    r = synthetic
    rerank = {"model": "ranker", "query": QUERY, "documents": DOCS}
    cases = [
        ("/v1/rerank", {**rerank, "documents": []}, "documents"),
        ("/v1/rerank", {**rerank, "documents": ["x"] * 1001}, "documents"),
        ("/v1/rerank", {**rerank, "documents": ["x", {"title": "no text"}]},
         "documents[1].text"),
        ("/v1/rerank", {**rerank, "top_n": -1}, "top_n"),
        ("/v1/rerank", {**rerank, "max_tokens_per_doc": -2}, "max_tokens_per_doc"),
        ("/v1/rerank", {"model": "ranker", "documents": DOCS}, "query"),
        ("/v1/rerank", {**rerank, "model": "chat"}, "model"),  # a generation model
        ("/v1/score", {"model": "ranker", "text_1": "a"}, "text_2"),
        ("/v1/score", {"model": "ranker", "text_1": ["a", "b"], "text_2": ["c"]}, "text_1"),
        ("/v1/score", {"model": "ranker", "text_1": "a", "text_2": []}, "text_2"),
        ("/v1/score", {"model": "ranker", "text_1": "a", "documents": ["b"]}, "text_1"),
        ("/v1/score", {"model": "ranker"}, "text_1"),
        ("/v1/chat/completions", {"model": "ranker", "messages": [
            {"role": "user", "content": "hi"}]}, "model"),  # a scoring model
    ]
    for path, body, param in cases:
        answer = post(r, path, body)
        assert answer.status_code == 400, (path, body, answer.text)
        error = answer.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (
            body, error)
    wrong = post(r, "/v1/rerank", {**rerank, "model": "chat"}).json()["error"]
    assert wrong["code"] == "wrong_model_task" and "generation model" in wrong["message"]


def test_rerank_is_logged_and_counted(synthetic: RouterProcess) -> None:
    r = synthetic
    body = post(r, "/v1/rerank", {"model": "ranker", "query": QUERY, "documents": DOCS}).json()
    tokens = body["usage"]["prompt_tokens"]
    assert re.search(rf"rerank model=ranker stream=false status=200 prompt={tokens} ",
                     r.tail(50)), r.tail(20)
    metrics = r.client.get(r.url + "/metrics").text
    assert re.search(r'modelyard_requests_total\{[^}]*endpoint="rerank"[^}]*\} [1-9]', metrics)


# -- real models: vLLM's pooling runner --------------------------------------------------

REAL_PRESET = """
server: {host: 127.0.0.1, port: {port}, load_timeout: 600}
models:
  smollm2-rerank:
    model: "builtin:smollm2"
    task: score
    dtype: float32
    max_model_len: 1024
    chat_template: builtin:chatml-rerank
    engine_args:
      hf_overrides: {classifier_from_token: ["no", "yes"], method: from_2_way_softmax}
  tiny-classifier:
    model: "{classifier}"
    task: classify
    dtype: float32
    max_model_len: 512
"""
PASSAGES = ["Paris is the capital and largest city of France.",
            "Bananas are rich in potassium.",
            "The Eiffel Tower stands in Paris.",
            "Berlin is the capital of Germany."]
QUESTION = "What is the capital of France?"


def build_tiny_classifier(out: Path, tokenizer_dir: Path) -> Path:
    """A ``LlamaForSequenceClassification`` with one label and random weights (its head
    drawn wide, so that pairs score far apart), with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=2048, num_labels=1,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.materialize import resolve_model_path

    smollm2 = Path(resolve_model_path("builtin:smollm2", None))
    return build_tiny_classifier(tmp_path_factory.mktemp("cls") / "tiny", smollm2)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, classifier: Path
           ) -> Iterator[RouterProcess]:
    with running_router(REAL_PRESET, tmp_path_factory.mktemp("rerank"), "rerank",
                        {"classifier": str(classifier)}) as r:
        yield r


def reranker_reference(query: str, documents: list[str]) -> tuple[list[float], int]:
    """transformers' SmolLM2 as the converted reranker reads a pair: the shipped score
    template rendered, P("yes") against P("no") at its last token; and the tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.preset_loader import TEMPLATES
    from worker.materialize import resolve_model_path

    folder = resolve_model_path("builtin:smollm2", None)
    tok = AutoTokenizer.from_pretrained(folder)
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    template = (TEMPLATES / "chatml-rerank.jinja").read_text()
    yes, no = tok.convert_tokens_to_ids(["yes", "no"])
    scores, tokens = [], 0
    for doc in documents:
        text = tok.apply_chat_template([{"role": "query", "content": query},
                                        {"role": "document", "content": doc}],
                                       chat_template=template, tokenize=False)
        ids = tok(text)["input_ids"]
        tokens += len(ids)
        with torch.no_grad():
            logits = lm(torch.tensor([ids])).logits[0, -1]
        scores.append(float(torch.sigmoid(logits[yes] - logits[no])))
    return scores, tokens


def classifier_reference(folder: Path, query: str, documents: list[str]) -> list[float]:
    """transformers' reading of each (query, document) pair by the tiny classifier: the
    tokenizer's own pairing, the one label's logit through a sigmoid."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    scores = []
    for doc in documents:
        ids = tok(text=query, text_pair=doc)["input_ids"]
        with torch.no_grad():
            logit = model(torch.tensor([ids])).logits[0, 0]
        scores.append(float(torch.sigmoid(logit)))
    return scores


@pytest.mark.integration
def test_a_converted_decoder_reranks_as_transformers_scores(models: RouterProcess) -> None:
    expected, tokens = reranker_reference(QUESTION, PASSAGES)
    body = post(models, "/v1/rerank", {"model": "smollm2-rerank", "query": QUESTION,
                                       "documents": PASSAGES, "top_n": 3}).json()
    # The 135M model is no judge of relevance (its scores lie within 0.02 of each other):
    # what counts is that each is the model's, and the order follows them.
    scores = [x["relevance_score"] for x in body["results"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True), body
    assert len({x["index"] for x in body["results"]}) == 3
    for x in body["results"]:
        assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=2e-4)
    assert min(scores) >= sorted(expected)[1] - 2e-4  # the lowest-scored passage was cut
    assert body["usage"]["prompt_tokens"] == tokens
    check_vllm_shape("rerank", body)
    scored = post(models, "/v1/score", {"model": "smollm2-rerank", "text_1": QUESTION,
                                        "text_2": PASSAGES}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=2e-4)


@pytest.mark.integration
def test_a_sequence_classifier_scores_pairs_as_transformers_does(
        models: RouterProcess, classifier: Path) -> None:
    scored = post(models, "/v1/score", {"model": "tiny-classifier", "queries": QUESTION,
                                        "documents": PASSAGES}).json()
    assert scored["model"] == "tiny-classifier", scored
    expected = classifier_reference(classifier, QUESTION, PASSAGES)
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=2e-4)
    assert max(expected) - min(expected) > 0.05  # the pairs score apart: the test can fail
    ranked = post(models, "/v1/rerank", {"model": "tiny-classifier", "query": QUESTION,
                                         "documents": PASSAGES}).json()
    assert [x["index"] for x in ranked["results"]] == sorted(
        range(len(PASSAGES)), key=lambda i: -expected[i]), (ranked, expected)


@pytest.mark.integration
def test_pairs_past_the_context_are_a_400(models: RouterProcess) -> None:
    long_doc = "word " * 2000
    answer = post(models, "/v1/rerank", {"model": "smollm2-rerank", "query": QUESTION,
                                         "documents": ["short", long_doc]})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "documents", answer.text
    cut = post(models, "/v1/rerank", {"model": "smollm2-rerank", "query": QUESTION,
                                      "documents": ["short", long_doc],
                                      "max_tokens_per_doc": 20})
    assert cut.status_code == 200, cut.text
    too_far = post(models, "/v1/score", {"model": "smollm2-rerank", "text_1": "a",
                                         "text_2": "b", "max_tokens_per_doc": 5000})
    assert too_far.status_code == 400
    assert too_far.json()["error"]["param"] == "max_tokens_per_doc"


@pytest.mark.integration
def test_an_embedding_model_scores_by_the_cosine_of_its_embeddings(client) -> None:  # type: ignore[no-untyped-def]
    vectors = [d.embedding for d in client.embeddings.create(
        model="smollm2-embed", input=[QUESTION, *PASSAGES]).data]

    def cos(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b)) / math.sqrt(
            sum(x * x for x in a) * sum(y * y for y in b))

    scored = httpx.post(f"{client.base_url}score", timeout=300, json={
        "model": "smollm2-embed", "text_1": QUESTION, "text_2": PASSAGES}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(
        [cos(vectors[0], v) for v in vectors[1:]], abs=1e-4)
