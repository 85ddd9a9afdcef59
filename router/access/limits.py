"""How much a client may ask, checked as ASGI middleware before any handler runs.

    ConnectionCap      at most ``max_connections`` requests in flight; more get a 503
    ProxyHeaders       (uvicorn's) ``X-Forwarded-For`` believed only from ``trusted_proxies``
    KeyGuard           (``admission.py``) 401/403 without a key
    RateLimit          a token bucket per client; an empty one gets a 429 with Retry-After

``middleware_stack`` builds them in that order, outermost first: a refused request costs
nothing further in, and a stranger without a key never takes a token from a bucket.
``/health`` is never capped or limited, so monitoring still sees an overloaded router.

How long a client may take is kept below them, in the router's uvicorn protocol
(``router.api.http_protocol``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from router.access.admission import (
    OPEN_PATHS,
    KeyGuard,
    Keys,
    client_address,
    principal_of,
    send_error,
)
from router.access.buckets import TokenBuckets
from router.access.rules import AccessRules
from router.errors import APIError
from shared.config import ServerConfig


def middleware_stack(server: ServerConfig, keys: Keys, rules: AccessRules) -> list[Middleware]:
    """The admission middleware for ``server``, outermost first (see the module doc)."""
    stack = [Middleware(ConnectionCap, max_connections=server.max_connections)]
    if server.trusted_proxies:  # uvicorn's own is turned off: it trusts 127.0.0.1 by default
        stack.append(Middleware(ProxyHeadersMiddleware,
                                trusted_hosts=server.trusted_proxies))
    # Always there: named keys can turn keys on in a running router.
    failures = (TokenBuckets(server.auth_failures_per_minute)
                if server.auth_failures_per_minute else None)
    stack.append(Middleware(KeyGuard, keys=keys, rules=rules, failures=failures))
    stack.append(Middleware(RateLimit, server=server))
    return stack


def _counted(path: str) -> bool:
    """Whether a request on ``path`` counts against its key's ``max_concurrent``: all do
    but those on a stored response (``/v1/responses/{id}`` and below), which hold no
    model and are how a key follows and stops the background runs that fill its limit."""
    return not path.startswith("/v1/responses/") or path == "/v1/responses/input_tokens"


class RateLimit:
    """ASGI middleware: per-client request limits. A client is the request's key (its
    principal's name) when keys are required, else its address (after
    ``trusted_proxies``).

    - Requests per minute: the key's ``rpm``, else the server's ``rate_limit_per_minute``,
      as a token bucket; an empty one answers 429 (``rate_limit_exceeded``) with
      ``Retry-After``, and every answer carries OpenAI's ``x-ratelimit-limit-requests`` and
      ``x-ratelimit-remaining-requests``.
    - Requests at once: the key's ``max_concurrent``; one more is a 429 at once (a stream
      counts until its last byte, a background response until it ends: its create keeps
      its place, ``KeyPlace``). Reading, cancelling or deleting a stored response is not
      counted, so a key at its limit can still follow and stop its background runs.
    """

    def __init__(self, app: ASGIApp, server: ServerConfig) -> None:
        self.app = app
        self.server = server
        self._buckets: dict[int, TokenBuckets] = {}
        self._in_flight: dict[str, int] = {}

    def _buckets_for(self, per_minute: int) -> TokenBuckets:
        buckets = self._buckets.get(per_minute)
        if buckets is None:
            burst = (self.server.rate_limit_burst
                     if per_minute == self.server.rate_limit_per_minute else 0)
            buckets = self._buckets[per_minute] = TokenBuckets(per_minute, burst)
        return buckets

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        principal = principal_of(scope)
        per_minute = principal.limits.rpm or self.server.rate_limit_per_minute
        at_once = principal.limits.max_concurrent if _counted(scope["path"]) else 0
        if not per_minute and not at_once:
            await self.app(scope, receive, send)
            return
        # A key's name; without one (an open server, or a keyless probe of an open path),
        # the address: strangers never share one bucket.
        client: str = principal.name or client_address(scope)
        extra: list[tuple[bytes, bytes]] = []
        if per_minute:
            buckets = self._buckets_for(per_minute)
            limit = (b"x-ratelimit-limit-requests", str(per_minute).encode())
            left = buckets.take(client)
            if left < 0:
                wait = buckets.retry_after(client)
                await send_error(send, APIError(
                    f"rate limit of {per_minute} requests per minute reached; "
                    f"retry in {wait} s", status=429, type="rate_limit_error",
                    code="rate_limit_exceeded"), scope["path"],
                    [(b"retry-after", str(wait).encode()), limit,
                     (b"x-ratelimit-remaining-requests", b"0")])
                return
            extra = [limit, (b"x-ratelimit-remaining-requests", str(left).encode())]
        if at_once and self._in_flight.get(client, 0) >= at_once:
            await send_error(send, APIError(
                f"this key may have {at_once} requests in flight at once; retry when one "
                "is done", status=429, type="rate_limit_error",
                code="rate_limit_exceeded"), scope["path"], [(b"retry-after", b"1")])
            return

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start" and extra:
                message["headers"] = [*message.get("headers", ()), *extra]
            await send(message)

        if not at_once:
            await self.app(scope, receive, send_counted)
            return
        self._in_flight[client] = self._in_flight.get(client, 0) + 1
        place = scope[KEY_PLACE_SCOPE_KEY] = KeyPlace(self, client)
        try:
            await self.app(scope, receive, send_counted)
        finally:
            if not place.kept:
                self.give_back(client)

    def give_back(self, client: str) -> None:
        """One of ``client``'s requests (or work one left running) has ended."""
        if (still := self._in_flight[client] - 1):
            self._in_flight[client] = still
        else:
            del self._in_flight[client]


KEY_PLACE_SCOPE_KEY = "modelyard.key_place"
"""Where a request's scope carries its place among its key's ``max_concurrent``
(``KeyPlace``), when its key has that limit."""


class KeyPlace:
    """A request's place among its key's ``max_concurrent`` requests: given back when its
    handler returns, unless the handler ``keep``s it for work it leaves running (a
    background response), which then gives it back itself when it ends."""

    __slots__ = ("client", "kept", "limit")

    def __init__(self, limit: RateLimit, client: str) -> None:
        self.limit = limit
        self.client = client
        self.kept = False

    def keep(self) -> Callable[[], None]:
        """Hand the place on; call what this returns, once, when that work ends."""
        self.kept = True
        return functools.partial(self.limit.give_back, self.client)


CAP_SCOPE_KEY = "modelyard.connection_cap"
"""Where a request's scope carries the ``ConnectionCap`` that counts it."""


class ConnectionCap:
    """ASGI middleware: at most ``max_connections`` requests in flight (``/health`` aside);
    more get a 503 (``server_overloaded``) with ``Retry-After`` at once. A request counts
    until its handler returns, which for a stream is after its last byte; work a handler
    leaves running (a background response) counts while it runs (``hold``)."""

    def __init__(self, app: ASGIApp, max_connections: int) -> None:
        self.app = app
        self.max_connections = max_connections
        self.in_flight = 0

    def overloaded(self) -> APIError:
        return APIError(f"the server is serving its maximum of {self.max_connections} "
                        "requests; retry shortly", status=503, type="server_error",
                        code="server_overloaded")

    def hold(self) -> None:
        """Count one more request in flight, one that outlives its handler, until
        ``let_go``; ``APIError`` (503) if the cap is reached (the caller's own request
        counts too)."""
        if self.in_flight >= self.max_connections:
            raise self.overloaded()
        self.in_flight += 1

    def let_go(self) -> None:
        self.in_flight -= 1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_connections:
            await send_error(send, self.overloaded(), scope["path"], [(b"retry-after", b"1")])
            return
        scope[CAP_SCOPE_KEY] = self
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
