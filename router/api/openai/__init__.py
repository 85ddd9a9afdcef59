"""OpenAI's HTTP API on the relay: chat, completions, embeddings, tokenize/detokenize.

Each endpoint decodes its body (``schema``) into ``shared.protocol`` messages and hands
them to the relay with its shaper (``chat``, ``completions``); errors keep OpenAI's
``{"error": {...}}`` shape, which is also the router's default.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import ClassVar, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.api.openai.chat import chat_completions
from router.api.openai.completions import completions
from router.api.openai.embeddings import embeddings
from router.api.openai.tokens import detokenize, tokenize
from router.api.relay import Relay, protocol_route


class Handler(Protocol):
    """An endpoint: its relay, the request, the largest body it may read."""

    def __call__(self, relay: Relay, request: Request, max_body: int) -> Awaitable[Response]: ...


class OpenAIAPI:
    """OpenAI's endpoints, bound to one relay."""

    ENDPOINTS: ClassVar[dict[str, Handler]] = {
        "/v1/chat/completions": chat_completions,
        "/v1/completions": completions,
        "/v1/embeddings": embeddings,
        "/v1/tokenize": tokenize,
        "/v1/detokenize": detokenize,
    }

    def __init__(self, relay: Relay, max_body_bytes: int) -> None:
        self.relay = relay
        self.max_body_bytes = max_body_bytes

    def handlers(self) -> dict[str, Callable[[Request], Awaitable[Response]]]:
        """Each path's handler, bound to this relay and body limit (no error shaping)."""
        return {path: functools.partial(h, self.relay, max_body=self.max_body_bytes)
                for path, h in self.ENDPOINTS.items()}

    def routes(self) -> list[Route]:
        return [protocol_route(path, h) for path, h in self.handlers().items()]
