"""How relevant documents are to a query, for RAG pipelines: ``POST /v1/rerank`` (also
``/rerank`` and ``/v2/rerank``) in Cohere's and Jina's shape, and ``POST /v1/score``
(also ``/score``) in vLLM's. A model whose preset says ``task: score`` or ``classify``
scores each pair as a cross-encoder; one with ``task: embed`` by the cosine of the two
texts' embeddings (as ``vllm serve`` does); any other is a 400 naming ``model``.

Rerank answers carry both dialects: Jina's and vLLM's ``model`` and ``usage``, Cohere's
``id`` and ``meta``, each result's ``index``, ``relevance_score`` and (unless
``return_documents`` is false) ``document``, best first.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.api.openai.schema import Int64
from router.api.relay import Relay, protocol_route
from router.api.wire import JSONResponse, read_body
from router.errors import BadRequest
from router.workers.link import WorkerLink
from shared.protocol import LoraRef, Score

MAX_DOCUMENTS = 1000
"""Documents in one request, Cohere's own limit."""

Document = str | dict[str, Any]


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: list[Document]
    model: str | None = None
    top_n: Int64 | None = None
    return_documents: bool = True
    max_tokens_per_doc: Int64 = 0
    rank_fields: list[str] | None = None
    """Cohere v1: the fields of object documents that are ranked (default ``text``)."""


class ScoreRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``/score``: one side against the other, 1:1, 1:N or N:N, under any of the
    names vLLM has given the two sides."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    max_tokens_per_doc: Int64 = 0


SCORE_SIDES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
               ("data_1", "data_2"))


def document_texts(documents: list[Document], rank_fields: list[str] | None) -> list[str]:
    """Each document's text: a string as it is; an object's ``text`` field, or its
    ``rank_fields`` as ``field: value`` lines (Cohere v1)."""
    if not documents:
        raise BadRequest("'documents' must hold at least one document", param="documents")
    if len(documents) > MAX_DOCUMENTS:
        raise BadRequest(f"'documents' may hold at most {MAX_DOCUMENTS} documents",
                         param="documents")
    fields = rank_fields or ["text"]
    texts = []
    for i, doc in enumerate(documents):
        if isinstance(doc, str):
            texts.append(doc)
            continue
        missing = [f for f in fields if not isinstance(doc.get(f), str)]
        if missing:
            raise BadRequest(f"document {i} has no string field '{missing[0]}'",
                             param=f"documents[{i}].{missing[0]}")
        texts.append(doc[fields[0]] if len(fields) == 1 else
                     "\n".join(f"{f}: {doc[f]}" for f in fields))
    return texts


def score_sides(req: ScoreRequest) -> tuple[list[str], list[str]]:
    """The two sides of a ``/score`` request, each as a list; 1:1, 1:N or N:N."""
    given = {name for pair in SCORE_SIDES for name in pair if getattr(req, name) is not None}
    pair = next((p for p in SCORE_SIDES if given == set(p)), None)
    if pair is None:
        half = next((p for p in SCORE_SIDES if given and given < set(p)), None)
        if half is not None:
            missing = (set(half) - given).pop()
            raise BadRequest(f"'{missing}' is required with '{given.pop()}'", param=missing)
        raise BadRequest("give the two sides as one pair of fields: 'text_1' and 'text_2', "
                         "'queries' and 'documents' (or 'items'), or 'data_1' and 'data_2'",
                         param="text_1")
    first, second = pair
    sides = []
    for name in pair:
        value = getattr(req, name)
        value = [value] if isinstance(value, str) else value
        if not value:
            raise BadRequest(f"'{name}' must hold at least one text", param=name)
        if len(value) > MAX_DOCUMENTS:
            raise BadRequest(f"'{name}' may hold at most {MAX_DOCUMENTS} texts", param=name)
        sides.append(value)
    if len(sides[0]) > 1 and len(sides[0]) != len(sides[1]):
        raise BadRequest(f"'{first}' holds {len(sides[0])} texts and '{second}' "
                         f"{len(sides[1])}: give one '{first}' or as many as '{second}'",
                         param=first)
    return sides[0], sides[1]


def _check_max_tokens_per_doc(value: int) -> None:
    if value < 0:
        raise BadRequest("'max_tokens_per_doc' must be at least 0 (0: documents are not cut)",
                         param="max_tokens_per_doc")


class ScoringAPI:
    """The rerank and score endpoints, bound to one relay."""

    def __init__(self, relay: Relay, max_body_bytes: int) -> None:
        self.relay = relay
        self.max_body_bytes = max_body_bytes

    def routes(self) -> list[Route]:
        handlers: dict[str, Callable[[Request], Awaitable[Response]]] = {
            "/v1/rerank": self.rerank, "/v2/rerank": self.rerank, "/rerank": self.rerank,
            "/v1/score": self.score, "/score": self.score}
        return [protocol_route(path, h) for path, h in handlers.items()]

    async def _scores(self, request: Request, endpoint: str, model: str | None,
                      message: Score) -> tuple[str, Any]:
        async def work(link: WorkerLink, lora: LoraRef | None) -> Any:
            message.lora = lora
            return await link.score(message)

        async def count(link: WorkerLink, lora: LoraRef | None) -> int:
            counted = await link.score(msgspec.structs.replace(
                message, id=f"{message.id}-count", lora=lora, count_only=True))
            return counted.prompt_tokens

        entry, result = await self.relay.call(request, endpoint, model, "score", work,
                                              lambda result: result.prompt_tokens, count)
        return entry.id, result

    async def rerank(self, request: Request) -> Response:
        req = await read_body(request, RerankRequest, self.max_body_bytes)
        texts = document_texts(req.documents, req.rank_fields)
        if req.top_n is not None and req.top_n < 0:
            raise BadRequest("'top_n' must be at least 0 (0: every document)", param="top_n")
        _check_max_tokens_per_doc(req.max_tokens_per_doc)
        rid = secrets.token_hex(12)
        model, result = await self._scores(request, "rerank", req.model, Score(
            id=f"rerank-{rid}", queries=[req.query], documents=texts,
            max_tokens_per_doc=req.max_tokens_per_doc))
        order = sorted(range(len(texts)), key=lambda i: -result.scores[i])  # stable on ties
        results = []
        for i in order[:req.top_n or None]:
            item: dict[str, Any] = {"index": i, "relevance_score": result.scores[i]}
            if req.return_documents:
                item["document"] = {"text": texts[i]}
            results.append(item)
        tokens = result.prompt_tokens
        version = "2" if request.scope["path"].startswith("/v2/") else "1"
        return JSONResponse({
            "id": f"rerank-{rid}", "model": model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "meta": {"api_version": {"version": version},
                     "billed_units": {"search_units": 1},
                     "tokens": {"input_tokens": tokens, "output_tokens": 0}}})

    async def score(self, request: Request) -> Response:
        req = await read_body(request, ScoreRequest, self.max_body_bytes)
        queries, documents = score_sides(req)
        _check_max_tokens_per_doc(req.max_tokens_per_doc)
        rid = secrets.token_hex(12)
        model, result = await self._scores(request, "score", req.model, Score(
            id=f"score-{rid}", queries=queries, documents=documents,
            max_tokens_per_doc=req.max_tokens_per_doc))
        tokens = result.prompt_tokens
        return JSONResponse({
            "id": f"score-{rid}", "object": "list", "created": int(time.time()),
            "model": model,
            "data": [{"index": i, "object": "score", "score": s}
                     for i, s in enumerate(result.scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})
