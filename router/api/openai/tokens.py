"""``POST /v1/tokenize`` (a prompt, or chat messages with tools rendered by the model's
template) and ``POST /v1/detokenize``, as vLLM's server offers them."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from router.api.openai.schema import (
    Int64,
    RequestMessage,
    ToolParam,
    check_free_json,
    flatten_message,
)
from router.api.relay import Relay
from router.api.wire import JSONResponse, read_body, request_id
from router.errors import BadRequest
from router.workers.link import WorkerLink
from shared.protocol import Detokenize, LoraRef, Tokenize, Tool


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[RequestMessage] | None = None
    tools: list[ToolParam] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[Int64]
    model: str | None = None


async def tokenize(relay: Relay, request: Request, max_body: int) -> Response:
    body = await read_body(request, TokenizeRequest, max_body)
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("give exactly one of 'prompt' and 'messages'", param="prompt")
    messages = ([flatten_message(m, i) for i, m in enumerate(body.messages)]
                if body.messages is not None else None)
    check_free_json(body.chat_template_kwargs, "chat_template_kwargs")
    for k, t in enumerate(body.tools or []):
        check_free_json(t.function.parameters, f"tools[{k}].function.parameters")
    tools = [Tool(name=t.function.name, description=t.function.description,
                  parameters=t.function.parameters) for t in body.tools or []] or None
    message = Tokenize(id=f"tok-{request_id()}", prompt=body.prompt, messages=messages,
                       add_special_tokens=body.add_special_tokens,
                       add_generation_prompt=body.add_generation_prompt,
                       return_token_strs=body.return_token_strs, tools=tools,
                       template_kwargs=body.chat_template_kwargs)

    async def work(link: WorkerLink, _: LoraRef | None) -> Any:
        return await link.tokenize(message)

    entry, result = await relay.call(request, "tokenize", body.model, "any", work)
    out: dict[str, Any] = {"model": entry.id, "count": len(result.token_ids),
                           "max_model_len": result.max_model_len, "tokens": result.token_ids}
    if result.token_strs is not None:
        out["token_strs"] = result.token_strs
    return JSONResponse(out)


async def detokenize(relay: Relay, request: Request, max_body: int) -> Response:
    body = await read_body(request, DetokenizeRequest, max_body)
    message = Detokenize(id=f"detok-{request_id()}", token_ids=list(body.tokens))

    async def work(link: WorkerLink, _: LoraRef | None) -> Any:
        return await link.detokenize(message)

    entry, text = await relay.call(request, "detokenize", body.model, "any", work)
    return JSONResponse({"model": entry.id, "prompt": text})
