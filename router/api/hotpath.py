"""``HotPath``: the hottest POST endpoints answered past Starlette's routing.

Starlette spends a request's time in layers that these endpoints do not need: the
exception middleware, the router's match over every route, the route's method check and
two exception-handling wrappers. ``HotPath`` is the innermost middleware: a POST to one
of its paths goes straight to the route's own endpoint (the same function Starlette
would call, so decoding, limits, counting and errors are the same code), and its errors
are answered by the same handlers; anything else goes on to Starlette.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.api.wire import api_error_handler, http_error_handler
from router.errors import APIError

HOT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
"""The endpoints every generation client calls (OpenAI's chat and completions)."""

Endpoint = Callable[[Request], Awaitable[Response]]


class HotPath:
    """ASGI middleware, innermost: a POST to one of ``routes``' paths runs its endpoint
    directly; an ``APIError`` or ``HTTPException`` it raises is answered as Starlette's
    exception middleware would (the app's handlers), anything else propagates to the
    app's server-error middleware, as it does through Starlette's router."""

    def __init__(self, app: ASGIApp, routes: Iterable[Route]) -> None:
        self.app = app
        self.endpoints: dict[str, Endpoint] = {
            r.path: r.endpoint for r in routes
            if r.path in HOT_PATHS and r.methods == {"POST"}}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = (self.endpoints.get(scope["path"])
                    if scope["type"] == "http" and scope["method"] == "POST"
                    and not scope.get("root_path") else None)
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        started = False

        async def sender(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            response = await endpoint(request)
            await response(scope, receive, sender)
        except (APIError, HTTPException) as exc:
            if started:
                raise RuntimeError("Caught handled exception, but response already "
                                   "started.") from exc
            handler = api_error_handler if isinstance(exc, APIError) else http_error_handler
            await (await handler(request, exc))(scope, receive, sender)
