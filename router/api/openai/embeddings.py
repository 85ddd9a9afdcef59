"""``POST /v1/embeddings``: text or token-id inputs to a model whose preset says
``task: embed``; vectors as floats or base64 (little-endian float32, as OpenAI sends)."""

from __future__ import annotations

import base64
import struct
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from router.api.openai.schema import Int64, text_or_token_lists
from router.api.relay import Relay
from router.api.wire import JSONResponse, read_body, request_id
from router.errors import BadRequest
from router.workers.link import WorkerLink
from shared.protocol import Embed, LoraRef

MAX_INPUTS = 2048  # OpenAI's own limit on one request's inputs


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list[Any]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: Int64 | None = None
    user: str | None = None


def embedding_inputs(raw: str | list[Any]) -> list[str | list[int]]:
    inputs = text_or_token_lists(raw, "input")
    if len(inputs) > MAX_INPUTS:
        raise BadRequest(f"'input' may hold at most {MAX_INPUTS} items", param="input",
                         code="invalid_value")
    return inputs


def _encode(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def embeddings(relay: Relay, request: Request, max_body: int) -> Response:
    req = await read_body(request, EmbeddingRequest, max_body)
    if req.encoding_format not in ("float", "base64"):
        raise BadRequest("'encoding_format' must be 'float' or 'base64'",
                         param="encoding_format", code="invalid_value")
    if req.dimensions is not None and req.dimensions < 1:
        raise BadRequest("'dimensions' must be at least 1", param="dimensions",
                         code="invalid_value")
    message = Embed(id=f"emb-{request_id()}", inputs=embedding_inputs(req.input),
                    dimensions=req.dimensions)

    async def work(link: WorkerLink, lora: LoraRef | None) -> Any:
        message.lora = lora
        return await link.embed(message)

    async def count(link: WorkerLink, lora: LoraRef | None) -> int:
        counted = await link.embed(msgspec.structs.replace(
            message, id=f"{message.id}-count", lora=lora, count_only=True))
        return counted.prompt_tokens

    entry, result = await relay.call(request, "embeddings", req.model, "embed", work,
                                     lambda result: result.prompt_tokens, count)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(result.vectors)]
    return JSONResponse({"object": "list", "data": data, "model": entry.id,
                         "usage": {"prompt_tokens": result.prompt_tokens,
                                   "total_tokens": result.prompt_tokens}})
