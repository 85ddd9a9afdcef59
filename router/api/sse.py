"""Server-sent events framing, shared by every streaming protocol."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Send

from router.errors import ClientTooSlow

_json = msgspec.json.Encoder()

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def encode_json(payload: Any) -> bytes:
    return _json.encode(payload)


def sse(payload: Any, event: str | None = None) -> bytes:
    """One event carrying ``payload`` as JSON; ``event`` names it (Anthropic-style)."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + _json.encode(payload) + b"\n\n"


class EventStream(StreamingResponse):
    """An SSE response whose every write must finish within ``send_timeout`` seconds.

    A client that stops reading fills the socket and a write waits; past the timeout,
    ``ClientTooSlow`` is thrown into the body generator (which cancels its generation and
    frees its model) and the connection is closed without the end of the body. One
    watchdog timer per response checks the write in progress, so a chunk costs two
    attribute stores, not a timer of its own.
    """

    def __init__(self, body: AsyncGenerator[bytes, None], send_timeout: float,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={**SSE_HEADERS, **headers} if headers else SSE_HEADERS)
        self._body = body
        self._send_timeout = send_timeout
        self._sending_since = 0.0  # loop time a write began; 0: no write in progress
        self._timed_out = False

    def _watch(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
        since = self._sending_since
        if since and loop.time() - since >= self._send_timeout:
            self._timed_out = True
            task.cancel()
            return
        wait = self._send_timeout - (loop.time() - since) if since else self._send_timeout
        self._watchdog = loop.call_later(wait, self._watch, loop, task)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._watchdog = loop.call_later(self._send_timeout, self._watch, loop, task)
        try:
            async for chunk in self._body:
                self._sending_since = loop.time()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._sending_since = 0.0  # waiting for the model is not the client's fault
        except asyncio.CancelledError:
            if not self._timed_out:
                raise
            task.uncancel()
            slow = ClientTooSlow(f"the client read nothing for {self._send_timeout:g} s")
            with contextlib.suppress(StopAsyncIteration, ClientTooSlow):  # it may have ended
                await self._body.athrow(slow)
            await self._body.aclose()
            return
        finally:
            self._watchdog.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
