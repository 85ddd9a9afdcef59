"""The router's uvicorn HTTP protocol: how long a client may take, below the admission
middleware (``router.access.limits``). Headers and body within ``read_timeout`` (a late body is
a 408 from ``RouterCycle.receive``), the keep-alive timeout between requests, and a
response it does not read dropped after ``send_timeout``; each response's head leaves
with its body. ``http_protocol`` says why this is a fork of uvicorn's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import ClassVar

from uvicorn._types import ASGIReceiveEvent, ASGISendEvent, HTTPRequestEvent
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from router.errors import APIError
from shared.config import ServerConfig


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
