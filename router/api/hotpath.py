"""``HotPath``: the hottest POST endpoints served in one layer, in front of Starlette.

Starlette spends a request's time in layers that these endpoints do not need: its
server-error and exception middleware, the router's match over every route, the route's
method check, two exception-handling wrappers, a ``send`` wrapper per layer; and the
protocol route's own wrappers (error shaping, counting) add three more. ``HotPath`` sits
just inside the admission middleware (``router.access.limits.middleware_stack``): a POST to one
of its paths runs its handler directly and does, in one place, what those layers would
have done with it; any other request goes on to Starlette.

    the layer it stands for      what it does here
    protocol_route               an ``APIError`` becomes the path's error response
    MetricsAPI.counted           a refusal the relay did not count is counted (or a 500)
    ServerErrorMiddleware        a bug: logged, a JSON 500 if nothing was sent, re-raised
    Response.__call__            a JSON answer is written whole (``RouterCycle.respond``)
                                 when ``send`` is uvicorn's cycle's own

``tests/test_hotpath.py`` holds both paths to the same answers, headers and counts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from router.api.http_protocol import RouterCycle
from router.api.metrics import endpoint_name
from router.api.wire import JSONResponse, error_response, server_error_handler
from router.errors import APIError
from router.observe.metrics import UNKNOWN_MODEL, Metrics, RequestMark, current_request

HOT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
"""The endpoints every generation client calls (OpenAI's chat and completions)."""

Endpoint = Callable[[Request], Awaitable[Response]]


class HotPath:
    """ASGI middleware in front of the Starlette app ``app``: a POST to a path of
    ``handlers`` runs that handler (a protocol's endpoint, unwrapped: it raises
    ``APIError`` for what the client did wrong) here."""

    def __init__(self, app: ASGIApp, handlers: dict[str, Endpoint], metrics: Metrics) -> None:
        self.app = app
        self.handlers = {path: (handler, endpoint_name(path))
                         for path, handler in handlers.items() if path in HOT_PATHS}
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot = (self.handlers.get(scope["path"])
               if scope["type"] == "http" and scope["method"] == "POST"
               and not scope.get("root_path") else None)
        if hot is None:
            await self.app(scope, receive, send)
            return
        handler, endpoint = hot
        request = Request(scope, receive, send)
        mark = RequestMark()
        token = current_request.set(mark)
        try:
            response = await handler(request)
        except APIError as err:
            response = error_response(err, scope["path"])
        except Exception as exc:
            if not mark.counted:
                self.metrics.request(endpoint, UNKNOWN_MODEL, 500)
            await (await server_error_handler(request, exc))(scope, receive, send)
            raise  # for uvicorn to log, as Starlette's server-error middleware does
        finally:
            current_request.reset(token)
        # A stream is counted when it ends, after this; its status here is 200.
        if response.status_code >= 400 and not mark.counted:
            self.metrics.request(endpoint, UNKNOWN_MODEL, response.status_code)
        # Sending starts with the response's first message; a failure after that has
        # nothing left to answer (Starlette's middleware would send no 500 either).
        cycle = getattr(send, "__self__", None)  # uvicorn's, unless a middleware wraps it
        if (type(response) is JSONResponse and response.background is None
                and type(cycle) is RouterCycle):
            await cycle.respond(response.status_code, response.raw_headers, response.body)
        else:
            await response(scope, receive, send)
