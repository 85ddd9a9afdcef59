"""Anthropic's Messages API on the relay: ``POST /v1/messages`` (``?beta=true`` too, as
Claude Code calls it) and ``POST /v1/messages/count_tokens``.

Requests become the same ``Generate`` a chat completion does (``schema``); the delta
stream becomes Anthropic's content blocks and events (``shaper``). A stream for a model
that is still loading begins at once with a ``ping`` every few seconds. Errors under
``/v1/messages`` take Anthropic's shape (``router.errors.shaped``), the keys' 401 and the
limits' 429/529 included. ``x-api-key`` and ``Authorization: Bearer`` both carry a key;
``anthropic-version`` and ``anthropic-beta`` are accepted and not needed.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.api.anthropic.schema import (
    CountTokensRequest,
    MessagesRequest,
    conversation,
    messages_generate,
    template_kwargs,
    tools,
)
from router.api.anthropic.shaper import PING, MessagesShaper
from router.api.openai.schema import keep_alive_seconds
from router.api.relay import Relay, protocol_route
from router.api.wire import JSONResponse, read_body, request_id
from router.workers.link import WorkerLink
from shared.protocol import LoraRef, Tokenize


class AnthropicAPI:
    """Anthropic's endpoints, bound to one relay."""

    def __init__(self, relay: Relay, max_body_bytes: int) -> None:
        self.relay = relay
        self.max_body_bytes = max_body_bytes

    async def messages(self, request: Request) -> Response:
        req = await read_body(request, MessagesRequest, self.max_body_bytes)
        mid = f"msg_{request_id()}"
        gen = messages_generate(req, mid)
        stops = gen.sampling.stop
        return await self.relay.generate(
            request, "messages", req.model, [gen], req.stream,
            lambda model: MessagesShaper(mid, model, stops), keepalive=PING,
            keep_alive=keep_alive_seconds(req.keep_alive), user=_user_id(req.metadata))

    async def count_tokens(self, request: Request) -> Response:
        """Exact: the model's own template renders the conversation with its tools, as a
        ``messages`` request would, and its tokenizer counts it."""
        req = await read_body(request, CountTokensRequest, self.max_body_bytes)
        message = Tokenize(id=f"tok-{request_id()}", messages=conversation(req),
                           tools=tools(req)[0], template_kwargs=template_kwargs(req))

        async def work(link: WorkerLink, _: LoraRef | None) -> Any:
            return await link.tokenize(message)

        _, result = await self.relay.call(request, "messages", req.model, "generate", work)
        return JSONResponse({"input_tokens": len(result.token_ids)})

    def routes(self) -> list[Route]:
        return [protocol_route("/v1/messages", self.messages),
                protocol_route("/v1/messages/count_tokens", self.count_tokens)]


def _user_id(metadata: Any) -> str | None:
    """Anthropic's ``metadata.user_id`` (Claude Code sends one per session): the session a
    model of several replicas keeps on one."""
    if isinstance(metadata, dict):
        user = metadata.get("user_id")
        return user if isinstance(user, str) and user else None
    return None
