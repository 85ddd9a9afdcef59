"""The protocol-neutral relay: the one path every generation request takes.

    acquire (resolve + lease) → submit → wait for the first batch → stream or aggregate
    → release → request log

A protocol module supplies only its request decoding (into ``shared.protocol.Generate``)
and a ``Shaper``: how a delta stream becomes its chunks, closing events, in-band error
event and aggregated body. It adds no lifecycle, streaming or logging code; the relay
knows nothing of any protocol's shapes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.api.sse import EventStream
from router.api.wire import JSONResponse, disconnected, error_response, unless_disconnected
from router.errors import APIError, BadRequest, ClientGone, ClientTooSlow
from router.link import RequestStream, Usage, WorkerLink
from router.metrics import Metrics
from router.registry import Lease, ModelEntry
from router.supervisor import Supervisor
from shared.protocol import Delta, Generate

log = logging.getLogger("modelyard.requests")


class Shaper(Protocol):
    """How one protocol shapes one response's delta stream (built once the model is known)."""

    def chunks(self, batch: list[Delta]) -> bytes:
        """Stream: the bytes (SSE events) for one batch of deltas; may open the stream."""

    def close(self, usage: Usage) -> bytes:
        """Stream: the closing events (usage, stop, ``[DONE]`` ...)."""

    def error_event(self, err: APIError) -> bytes:
        """Stream: the in-band event for a failure after the stream began."""

    def add(self, batch: list[Delta]) -> None:
        """Aggregate: keep a batch for the body."""

    def body(self, usage: Usage) -> dict[str, Any]:
        """Aggregate: the whole response."""


ErrorBody = Callable[[APIError], dict[str, Any]]


def protocol_route(path: str, handler: Callable[[Request], Awaitable[Response]],
                   error_body: ErrorBody) -> Route:
    """A POST route whose errors take the protocol's own error shape."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as err:
            return error_response(err, error_body(err))

    return Route(path, endpoint, methods=["POST"])


class Relay:
    """Runs generation requests for every protocol module; see the module docstring."""

    def __init__(self, supervisor: Supervisor, metrics: Metrics | None = None) -> None:
        self.supervisor = supervisor
        self.metrics = metrics or Metrics(supervisor.registry)

    async def generate(self, request: Request, endpoint: str, model: str | None,
                       gens: list[Generate], streaming: bool,
                       shaper_for: Callable[[str], Shaper]) -> Response:
        """Relay ``gens`` (one client request) and answer as ``shaper_for(model id)`` shapes it."""
        usage = Usage()
        lease, link = await self._acquire(request, endpoint, model, "generate", streaming,
                                          usage)
        stream: RequestStream | None = None
        try:
            _refuse_oversized(lease.entry, gens)
            stream = link.submit(gens, usage)
            shaper = shaper_for(lease.entry.id)
            # Wait for the first output so that a refused request is a JSON 4xx, not a
            # stream that starts 200 and then carries an error; a client that leaves
            # meanwhile gives its place in the engine's queue back at once.
            first = await _first_batch(request, stream)
            usage.first_at = time.perf_counter()
        except BaseException as err:
            if stream is not None:
                stream.close()
            lease.release()
            if isinstance(err, APIError):  # ClientGone too: a 499 nobody reads
                self._log(endpoint, lease.entry.id, streaming, err.status, usage)
            raise
        if streaming:
            body = self._stream(stream, shaper, first, usage, lease, endpoint)
            return EventStream(body, self.supervisor.server.send_timeout)
        status = 200
        try:
            shaper.add(first)
            if not stream.exhausted:  # long answer: stop generating if the client leaves
                await unless_disconnected(request, self._drain(stream, shaper))
        except APIError as err:  # ClientGone (499) included
            status = err.status
            raise
        finally:
            stream.close()
            lease.release()
            self._log(endpoint, lease.entry.id, False, status, usage)
        return JSONResponse(shaper.body(usage))

    async def _acquire(self, request: Request | None, endpoint: str, model: str | None, task: str,
                       streaming: bool, usage: Usage) -> tuple[Lease, WorkerLink]:
        """The model's lease and link; a client that leaves while it waits (for a load or
        a slot) gives its place in the queue back at once (``ClientGone``)."""
        try:
            now = self.supervisor.acquire_now(model, task)
            if isinstance(now, tuple):
                return now
            waiting = self.supervisor.acquire(model, task)
            return await (waiting if request is None else unless_disconnected(request, waiting))
        except APIError as err:  # unknown model, queue full, load failed, gone: one line
            self._log(endpoint, model or "-", streaming, err.status, usage)
            raise

    @staticmethod
    async def _drain(stream: RequestStream, shaper: Shaper) -> None:
        async for batch in stream:
            shaper.add(batch)

    async def _stream(self, stream: RequestStream, shaper: Shaper, first: list[Delta],
                      usage: Usage, lease: Lease, endpoint: str) -> AsyncGenerator[bytes, None]:
        status = 200
        try:
            yield shaper.chunks(first)
            while True:
                try:
                    batch = await stream.__anext__()
                except StopAsyncIteration:
                    break
                except APIError as err:  # the worker failed mid-stream: tell the client in-band
                    status = err.status
                    yield shaper.error_event(err)
                    return
                yield shaper.chunks(batch)
            yield shaper.close(usage)
        except ClientTooSlow as err:  # thrown in by EventStream: a write timed out
            status = err.status
        except BaseException:
            status = 499  # the client went away (the generator was closed or cancelled)
            raise
        finally:
            stream.close()
            lease.release()
            self._log(endpoint, lease.entry.id, True, status, usage)

    def _log(self, endpoint: str, model: str, streaming: bool, status: int,
             usage: Usage) -> None:
        """One line and one count per request: what was asked, what came back, how fast."""
        now = time.perf_counter()
        self.metrics.request(endpoint, model, status, usage, now)
        ttft = (usage.first_at - usage.started) * 1000 if usage.first_at else 0.0
        decode = (usage.completion / (now - usage.first_at)
                  if usage.first_at and now > usage.first_at else 0.0)
        log.info("%s model=%s stream=%s status=%d prompt=%d cached=%d completion=%d "
                 "ttft_ms=%.0f decode_tps=%.1f total_ms=%.0f finish=%s", endpoint, model,
                 str(streaming).lower(), status, usage.prompt_tokens, usage.cached_tokens,
                 usage.completion, ttft, decode, (now - usage.started) * 1000,
                 ",".join(usage.finish) or "-")

    async def call(self, endpoint: str, model: str | None, task: str,
                   work: Callable[[WorkerLink], Awaitable[Any]]) -> tuple[ModelEntry, Any]:
        """A one-shot request (tokenize, embeddings ...): acquire, ``work(link)``, release."""
        usage = Usage()
        lease, link = await self._acquire(None, endpoint, model, task, False, usage)
        status = 200
        try:
            with lease:
                return lease.entry, await work(link)
        except APIError as err:
            status = err.status
            raise
        finally:
            self._log(endpoint, lease.entry.id, False, status, usage)


async def _first_batch(request: Request, stream: RequestStream) -> list[Delta]:
    """The stream's first batch; ``ClientGone`` (its generation cancelled) if the client
    leaves first. One watcher task, which ends the stream itself: cheaper than
    ``unless_disconnected``'s two tasks on the path every request takes."""
    def left(watch: asyncio.Future[None]) -> None:
        if not watch.cancelled():
            stream._fail(ClientGone())

    watch = asyncio.ensure_future(disconnected(request))
    watch.add_done_callback(left)
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return []
    finally:
        watch.cancel()


def _refuse_oversized(entry: ModelEntry, gens: list[Generate]) -> None:
    """A prompt longer than the worker's bound cannot fit the context: refuse it here,
    before megabytes cross the socket and stall the worker's other streams."""
    limit = entry.max_prompt_chars
    if not limit:
        return
    for gen in gens:
        size = len(gen.prompt or "") + sum(len(m.content or "") for m in gen.messages or ())
        if size > limit:
            raise BadRequest(
                f"This model's maximum context length is {entry.max_model_len} tokens; a "
                f"prompt of {size} characters cannot fit it. Please reduce the length of the "
                "prompt.", param="prompt" if gen.messages is None else "messages",
                code="context_length_exceeded")
