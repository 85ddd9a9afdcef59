"""How much a client may ask, checked as ASGI middleware before any handler runs.

    ConnectionCap      at most ``max_connections`` requests in flight; more get a 503
    ProxyHeaders       (uvicorn's) ``X-Forwarded-For`` believed only from ``trusted_proxies``
    KeyGuard           (``admission.py``) 401/403 without a key
    RateLimit          a token bucket per client; an empty one gets a 429 with Retry-After

``middleware_stack`` builds them in that order, outermost first: a refused request costs
nothing further in, and a stranger without a key never takes a token from a bucket.
``/health`` is never capped or limited, so monitoring still sees an overloaded router.

How long a client may take is kept below them, in the router's uvicorn protocol
(``http_protocol``): headers and body within ``read_timeout`` (a late body is a 408 from
``RouterCycle.receive``), the keep-alive timeout between requests, and a response it does
not read dropped after ``send_timeout``.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import ClassVar

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn._types import ASGIReceiveEvent, ASGISendEvent, HTTPRequestEvent
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from router.access import AccessRules
from router.admission import (
    OPEN_PATHS,
    KeyGuard,
    Keys,
    client_address,
    principal_of,
    send_error,
)
from router.errors import APIError
from shared.config import ServerConfig

MAX_CLIENTS = 65_536
"""Buckets kept at most; about 260 bytes each (a full-length IPv6 address), so the
limiter stays under 20 MB."""


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


def uvicorn_backstop(max_connections: int) -> int:
    """uvicorn's ``limit_concurrency``, a little above ``max_connections``: uvicorn counts
    open connections (idle keep-alive ones too) and refuses in plain text, so it only
    catches what ``ConnectionCap`` cannot see (connections that never finish a request)."""
    return max_connections + max(16, max_connections // 8)


_defaults: tuple[object, bytes] = (None, b"")
"""uvicorn's default headers (``date``, ``server``: a new list each second) as they are
written, checked once per list instead of once per response."""


def _default_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    global _defaults
    if _defaults[0] is not headers:
        for name, value in headers:
            if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header.")
        _defaults = (headers, b"".join(name.lower() + b": " + value + b"\r\n"
                                       for name, value in headers))
    return _defaults[1]


_valid_names: set[bytes] = set()
_valid_values: set[bytes] = set()
"""Header names and values a response has sent already, so found valid: most responses
repeat the same few (``content-type: application/json``), and a set lookup costs less than
uvicorn's regex search of each."""


def _remember(valid: set[bytes], item: bytes) -> None:
    if len(valid) >= 4096:  # bounded: values such as lengths and ids keep coming
        valid.clear()
    valid.add(item)


class RouterCycle(RequestResponseCycle):
    """uvicorn's request cycle (0.54) with the router's changes:

    - a response's head (its status line and headers) waits for its body's first write,
      so a small answer leaves in one write and one TCP segment, not two; a stream's head
      goes at the end of the event-loop turn if no chunk came in it;
    - ``receive`` raises the 408 (``request_timeout``) once the protocol's sweep found the
      body late (``body_late``): the handler is inside ``read_body`` then, and the app's
      error handling answers it like any other error;
    - ``respond`` writes a whole response without its two ASGI messages;
    - uvicorn's header checks run once per default-header list and once per header name
      or value sent (``_default_block``, ``_remember``), not for every response.
    """

    body_late = 0.0  # the read_timeout that passed, once it has
    _head: bytes | None = None

    async def receive(self) -> ASGIReceiveEvent:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            if self.body_late:
                raise _late(self.body_late)
            self.flow.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        if self.body_late and self.more_body:
            raise _late(self.body_late)
        message: HTTPRequestEvent = {"type": "http.request", "body": bytes(self.body),
                                     "more_body": self.more_body}
        self.body = bytearray()
        return message

    def _flush_head(self) -> None:
        head, self._head = self._head, None
        if head is not None and not self.transport.is_closing():
            self.transport.write(head)

    async def send(self, message: ASGISendEvent) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError("Expected ASGI message 'http.response.start', but got "
                                   f"'{message['type']}'.")
            self._start(message["status"], message.get("headers", ()))
        elif not self.response_complete:
            if message["type"] != "http.response.body":
                raise RuntimeError("Expected ASGI message 'http.response.body', but got "
                                   f"'{message['type']}'.")
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"Unexpected ASGI message '{message['type']}' sent, after "
                               "response already completed.")

    async def respond(self, status: int, headers: Iterable[tuple[bytes, bytes]],
                      body: bytes | memoryview) -> None:
        """A whole response, as ``send`` of its start and its only body message would
        write it, without the two messages (``router.api.hotpath`` answers so)."""
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if self.response_started:
            raise RuntimeError("Unexpected response after the response started.")
        self._start(status, headers)
        self._body(body if type(body) is bytes else bytes(body), False)

    def _start(self, status_code: int, headers: Iterable[tuple[bytes, bytes]]) -> None:
        self.response_started = True
        self.waiting_for_100_continue = False
        if self.access_log:
            self.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(self.scope),
                                    self.scope["method"],
                                    get_path_with_query_string(self.scope),
                                    self.scope["http_version"], status_code)
        content = [STATUS_LINE[status_code], _default_block(self.default_headers)]
        has_connection_close = False
        for name, value in headers:
            if name not in _valid_names:
                if HEADER_RE.search(name):
                    raise RuntimeError("Invalid HTTP header name.")
                _remember(_valid_names, name)
            if value not in _valid_values:
                if HEADER_VALUE_RE.search(value):
                    raise RuntimeError("Invalid HTTP header value.")
                _remember(_valid_values, value)
            name = name.lower()
            if name == b"content-length" and self.chunked_encoding is None:
                self.expected_content_length = int(value.decode())
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection" and b"close" in [
                    token.lower().strip() for token in value.split(b",")]:
                self.keep_alive = False
                has_connection_close = True
            content.extend([name, b": ", value, b"\r\n"])
        if not self.keep_alive and not has_connection_close:
            content.append(b"connection: close\r\n")
        if (self.chunked_encoding is None and self.scope["method"] != "HEAD"
                and status_code not in (204, 304)):
            self.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self._head = b"".join(content)
        if self.chunked_encoding or self.scope["method"] == "HEAD" or status_code in (204, 304):
            asyncio.get_running_loop().call_soon(self._flush_head)  # a body may be far off

    def _body(self, body: bytes, more_body: bool) -> None:
        head = self._head  # None once out: every chunk of a stream after the first
        self._head = None
        if self.scope["method"] == "HEAD":
            self.expected_content_length = 0
            data = b""
        elif self.chunked_encoding:
            data = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more_body:
                data += b"0\r\n\r\n"
        else:
            if len(body) > self.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= len(body)
            data = body
        if head is not None:
            data = head + data
        if data:
            self.transport.write(data)
        if not more_body:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()


def _late(seconds: float) -> APIError:
    return APIError(f"the request body did not arrive within {seconds:g} s", status=408,
                    type="invalid_request_error", code="request_timeout")


def http_protocol(read_timeout: float,
                  server: ServerConfig | None = None) -> type[HttpToolsProtocol]:
    """uvicorn's HTTP protocol with the router's changes:

    - each response's head leaves with its body (``RouterCycle``);
    - when ``read_timeout`` is set, a request's headers must be complete within that many
      seconds of the connection opening or of the request's first byte, or the connection
      is closed (uvicorn itself times out only idle connections between requests: one that
      sends nothing after connecting, or its headers a byte at a time, is held for ever);
      and its body must be complete within that many seconds of its headers, or the
      handler reading it gets a 408 (``RouterCycle``);
    - when ``server`` is given, what a client does not read is dropped after its
      ``send_timeout`` (read live: a reload changes it): once the transport's buffer has
      held bytes for that long without shrinking (the client took none of them), the
      connection is aborted and its buffer freed, whether the router closed it or not.
      Without it a whole non-streamed answer stays in the router's memory for as long as
      its client keeps the connection open and unread (an answer is written at once, and
      uvicorn only pauses the next write). A client reading slowly but steadily is never
      cut. A stream is left to ``EventStream``'s own ``send_timeout`` (the same figure),
      which ends its generation and stops writing to it;
    - these deadlines and the keep-alive timeout between requests are kept by one sweep of
      the open connections every quarter of the shortest (a second at most), not by timers
      armed and cancelled for every request: a request only stores the time. A deadline
      is never early and at most that quarter late.

    A fork, since no maintained option covers these: uvicorn times out only idle
    connections, and Starlette sees only the ASGI ``send``, which returns before the bytes
    leave.
    """

    class RouterProtocol(HttpToolsProtocol):
        _open: ClassVar[set[RouterProtocol]] = set()
        _sweep: ClassVar[asyncio.TimerHandle | None] = None
        _tick: ClassVar[float] = 1.0
        # Loop times: since when the headers (of the connection's first request, or of
        # the request whose first byte came) are awaited; since when the body is; since
        # when the connection has been idle between requests. 0: not waiting.
        _headers_since = 0.0
        _body_since = 0.0
        _idle_since = 0.0
        # Since when the transport's buffer has held bytes and not shrunk (0: empty or
        # shrinking), and its size then.
        _unread_since = 0.0
        _unread_size = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            cls = type(self)
            cls._open.add(self)
            if read_timeout:
                self._headers_since = self.loop.time()
            if cls._sweep is None:  # the first connection (or the first since all closed)
                send_timeout = server.send_timeout if server is not None else 0.0
                cls._tick = min((1.0, *(t / 4 for t in (read_timeout, self.timeout_keep_alive,
                                                        send_timeout)
                                        if t > 0)))
                cls._sweep = self.loop.call_later(cls._tick, cls._sweep_all, self.loop)

        @classmethod
        def _sweep_all(cls, loop: asyncio.AbstractEventLoop) -> None:
            now = loop.time()
            for protocol in list(cls._open):
                protocol._check(now)
            cls._sweep = loop.call_later(cls._tick, cls._sweep_all, loop) if cls._open else None

        def _check(self, now: float) -> None:
            if server is not None and self._unread(now, server.send_timeout):
                self.transport.abort()  # its buffer goes now, and connection_lost follows
                return
            if self.transport.is_closing():
                return
            idle = self._idle_since
            if (idle and now - idle >= self.timeout_keep_alive
                    or read_timeout and self._headers_since
                    and now - self._headers_since >= read_timeout):
                self.transport.close()
            elif read_timeout and self._body_since and now - self._body_since >= read_timeout:
                self._body_since = 0.0
                cycle = self.cycle
                if cycle is None or cycle.response_started:  # nobody waits for this body
                    self.transport.close()
                elif isinstance(cycle, RouterCycle):
                    cycle.body_late = read_timeout
                    cycle.message_event.set()  # a handler reading the body raises the 408

        def _unread(self, now: float, send_timeout: float) -> bool:
            """Whether bytes written to this connection have waited ``send_timeout`` with
            none of them taken by its client: the transport's buffer has not shrunk since
            (only the client's reading shrinks it). A stream is left to its
            ``EventStream``, which times out its own writes, ends its generation and stops
            writing (what it leaves is bounded: the buffer's high-water mark and a chunk)."""
            size = self.transport.get_write_buffer_size()
            if not size:
                self._unread_since = 0.0
                return False
            if not self._unread_since or size < self._unread_size:  # new bytes, or progress
                self._unread_since, self._unread_size = now, size
                return False
            self._unread_size = size
            cycle = self.cycle
            streaming = (cycle is not None and cycle.response_started
                         and not cycle.response_complete)
            return not streaming and now - self._unread_since >= send_timeout

        def data_received(self, data: bytes) -> None:
            self._idle_since = 0.0
            super().data_received(data)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            # The first request keeps the connection's deadline.
            if read_timeout and not self._headers_since:
                self._headers_since = self.loop.time()

        def on_headers_complete(self) -> None:
            if read_timeout:
                self._headers_since = 0.0
                self._body_since = self.loop.time()
            super().on_headers_complete()
            cycle = self.cycle  # this request's (uvicorn queues it if one is pipelined)
            if cycle is not None:
                cycle.__class__ = RouterCycle

        def on_message_complete(self) -> None:
            self._body_since = 0.0
            super().on_message_complete()

        def on_response_complete(self) -> None:  # uvicorn 0.54's, with no timer
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            self._unset_keepalive_if_required()
            self.flow.resume_reading()
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            else:  # the sweep closes the connection after ``timeout_keep_alive`` idle
                self._idle_since = self.loop.time()

        def connection_lost(self, exc: Exception | None) -> None:
            type(self)._open.discard(self)
            super().connection_lost(exc)

    return RouterProtocol


class _Bucket:
    __slots__ = ("stamp", "tokens")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp


class TokenBuckets:
    """One token bucket per client: ``size`` tokens, refilled at ``per_minute`` a minute,
    one taken per request.

    Memory is bounded: at most ``max_clients`` buckets, least recently seen dropped first.
    A dropped bucket has refilled to full (so forgetting it changes nothing) unless more
    than ``max_clients`` clients were seen within one refill period (``size / rate``);
    only a client cycling through addresses gets there, and a new address would give it a
    fresh bucket anyway.

    Written here rather than taken from ``limits``: that library offers fixed, moving and
    sliding windows, not a bucket with a burst and a steady refill (what
    ``rate_limit_burst`` promises and ``Retry-After`` is computed from); its in-memory
    moving window keeps a timestamp per request, its storage has no bound on clients,
    and each check is a call through its storage layer, where this is two floats and a
    dict move per request on the hot path (``make bench BENCH=ledger``).
    """

    def __init__(self, per_minute: int, burst: int = 0, max_clients: int = MAX_CLIENTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.size = float(burst or per_minute)
        self.rate = per_minute / 60.0  # tokens per second
        self.max_clients = max_clients
        self.clock = clock
        self._buckets: OrderedDict[Hashable, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, client: Hashable) -> int:
        """Take a token for ``client``: the whole tokens left, or -1 when there was none."""
        now = self.clock()
        bucket = self._buckets.get(client)
        if bucket is None:
            if len(self._buckets) >= self.max_clients:
                self._buckets.popitem(last=False)
            bucket = self._buckets[client] = _Bucket(self.size, now)
        else:
            self._buckets.move_to_end(client)
            bucket.tokens = min(self.size, bucket.tokens + (now - bucket.stamp) * self.rate)
            bucket.stamp = now
        if bucket.tokens < 1.0:
            return -1
        bucket.tokens -= 1.0
        return int(bucket.tokens)

    def empty(self, client: Hashable) -> bool:
        """Whether ``client``'s next ``take`` would be refused (takes nothing)."""
        bucket = self._buckets.get(client)
        if bucket is None:
            return False
        return min(self.size, bucket.tokens + (self.clock() - bucket.stamp) * self.rate) < 1.0

    def retry_after(self, client: Hashable) -> int:
        """Whole seconds (at least 1) until ``client``'s next token, after a refused take."""
        bucket = self._buckets[client]
        return max(1, math.ceil((1.0 - bucket.tokens) / self.rate))


class TokensPerMinute:
    """Each key's tokens per minute (its ``tpm``) as a bucket of ``tpm`` tokens refilled at
    that rate: a request is admitted while its key's bucket holds any, and its prompt
    and completion tokens are taken once it is done (the last one may overdraw; the
    next waits until the bucket is above zero again). Only keys with a ``tpm`` have one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[str, tuple[_Bucket, float]] = {}  # key -> (bucket, per second)

    def _refilled(self, key: str) -> _Bucket | None:
        found = self._buckets.get(key)
        if found is None:
            return None
        bucket, rate = found
        now = self.clock()
        bucket.tokens = min(rate * 60, bucket.tokens + (now - bucket.stamp) * rate)
        bucket.stamp = now
        return bucket

    def wait(self, key: str, tpm: int) -> int:
        """0 if ``key`` may send a request now, else whole seconds until it may."""
        bucket = self._refilled(key)
        if bucket is None:
            self._buckets[key] = (_Bucket(float(tpm), self.clock()), tpm / 60.0)
            return 0
        self._buckets[key] = (bucket, tpm / 60.0)  # a changed tpm applies from now
        return 0 if bucket.tokens > 0 else max(1, math.ceil(-bucket.tokens / (tpm / 60.0)))

    def spend(self, key: str, tokens: int) -> None:
        """A finished request of ``key`` used ``tokens``."""
        bucket = self._refilled(key)
        if bucket is not None:
            bucket.tokens -= tokens


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
