"""Server-sent events framing, shared by every streaming protocol."""

from __future__ import annotations

from typing import Any

import msgspec

_json = msgspec.json.Encoder()

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def encode_json(payload: Any) -> bytes:
    return _json.encode(payload)


def sse(payload: Any, event: str | None = None) -> bytes:
    """One event carrying ``payload`` as JSON; ``event`` names it (Anthropic-style)."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + _json.encode(payload) + b"\n\n"
