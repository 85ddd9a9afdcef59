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
    frees its model) and the connection is closed without the end of the body.
    """

    def __init__(self, body: AsyncGenerator[bytes, None], send_timeout: float) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self._body = body
        self._send_timeout = send_timeout

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(None) as deadline:
                async for chunk in self._body:
                    deadline.reschedule(loop.time() + self._send_timeout)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    deadline.reschedule(None)  # waiting for the model is not the client's fault
        except TimeoutError:
            slow = ClientTooSlow(f"the client read nothing for {self._send_timeout:g} s")
            with contextlib.suppress(StopAsyncIteration):
                await self._body.athrow(slow)
            await self._body.aclose()
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
