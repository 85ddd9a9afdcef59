"""The bare-framework baseline for the relay benchmark: starlette + uvicorn (uvloop,
httptools) answering a trivial JSON POST and streaming N SSE chunks, nothing else.

``python -m bench.bare_app PORT``
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

CHUNK = (b'data: {"id":"x","object":"chat.completion.chunk","created":0,"model":"m",'
         b'"choices":[{"index":0,"delta":{"content":"tok "},"finish_reason":null}]}\n\n')


async def json_post(request: Request) -> Response:
    await request.body()
    return Response(b'{"ok":true}', media_type="application/json")


async def sse_post(request: Request) -> Response:
    await request.body()
    n = int(request.query_params.get("n", "200"))

    async def body() -> AsyncIterator[bytes]:
        for _ in range(n):
            yield CHUNK
        yield b"data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream")


async def sse_stamped(request: Request) -> Response:
    """100 chunks at 100/s, each carrying the ``monotonic_ns`` at which it was written: the
    framework's own share of the relay benchmark's added latency."""
    await request.body()

    async def body() -> AsyncIterator[bytes]:
        for _ in range(100):
            await asyncio.sleep(0.01)
            yield CHUNK.replace(b'"tok ', b'"%d ' % time.monotonic_ns())
        yield b"data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream")


app = Starlette(routes=[Route("/json", json_post, methods=["POST"]),
                        Route("/sse", sse_post, methods=["POST"]),
                        Route("/sse-stamped", sse_stamped, methods=["POST"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
                access_log=False, loop="uvloop", http="httptools")
