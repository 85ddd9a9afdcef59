"""HTTP plumbing every protocol module shares: typed body decoding, JSON responses, error
responses, and client-disconnect detection (SSE framing is ``sse.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from router.errors import APIError, BadRequest, ClientGone, PayloadTooLarge, shaped

log = logging.getLogger("modelyard.router")
T = TypeVar("T")
_json = msgspec.json.Encoder()
_AT = re.compile(r" - at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


_ID_PREFIX = secrets.token_hex(6)
_ID_COUNTER = itertools.count(1)


def request_id() -> str:
    """Unique within a router run (a random prefix and a counter); cheaper than uuid4."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):010x}"


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _json.encode(content)

    def init_headers(self, headers: Mapping[str, str] | None = None) -> None:
        if (headers is None and self.media_type == "application/json"
                and self.status_code >= 200 and self.status_code not in (204, 304)):
            # the usual answer: Starlette's two headers, without its general case
            self.raw_headers = [(b"content-length", b"%d" % len(self.body)),
                                (b"content-type", b"application/json")]
        else:
            super().init_headers(headers)


def error_response(err: APIError, path: str = "") -> JSONResponse:
    """``err`` as a response, in the error shape of the protocol serving ``path``."""
    status, body = shaped(err, path)
    headers = ({"Retry-After": str(err.retry_after)} if status in (429, 503, 529) else
               {"Connection": "close"} if status == 408 else None)  # a body never came
    return JSONResponse(body, status_code=status, headers=headers)


def _param_of(message: str) -> str | None:
    m = _MISSING.search(message)
    if m:
        at = _AT.search(message)
        prefix = at.group(1) if at and at.group(1) else ""
        return f"{prefix}.{m.group(1)}" if prefix else m.group(1)
    at = _AT.search(message)
    return at.group(1) or None if at else None


async def read_body(request: Request, kind: type[T], limit: int, off_loop: bool = False) -> T:
    """Read and decode a JSON body into ``kind``; errors name the offending field.
    ``off_loop``: decoded on a thread (a body that may be tens of MiB, a message batch's,
    would hold the event loop for tens of milliseconds)."""
    content_type = content_length = None
    for name, value in request.scope["headers"]:  # one pass; the first of each counts
        if name == b"content-type" and content_type is None:
            content_type = value.decode("latin-1")
        elif name == b"content-length" and content_length is None:
            content_length = value.decode("latin-1")
    media = (content_type or "").split(";", 1)[0].strip().lower()
    declared = content_length or ""
    if media and media != "application/json" and not media.endswith("+json"):
        # No header is taken as JSON (bare clients); a form or text body is a client mistake.
        raise APIError(f"Content-Type '{media}' is not supported; send application/json",
                       status=415, type="invalid_request_error", code="unsupported_media_type")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")
    body = await _receive_body(request, limit)
    if not body.strip():
        raise BadRequest("request body is empty; expected a JSON object", code="invalid_json")
    try:
        if off_loop:
            return await asyncio.to_thread(msgspec.json.decode, body, type=kind)
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as err:
        text = str(err)
        raise BadRequest(_AT.sub("", text) + (f" (at '{_param_of(text)}')" if _param_of(text)
                                               else ""),
                         param=_param_of(text), code="invalid_type") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as err:  # invalid UTF-8 is the latter
        raise BadRequest(f"request body is not valid JSON: {err}", code="invalid_json") from None
    except RecursionError:  # msgspec's own depth guard on deeply nested untyped values
        raise BadRequest("request body nests too deeply", code="invalid_json") from None


async def _receive_body(request: Request, limit: int) -> bytes:
    """The body's messages joined, as ``Request.body`` reads them (a client that leaves
    first is Starlette's ``ClientDisconnect``), counted against ``limit`` as they arrive
    (a declared length was checked before; a chunked upload is counted here)."""
    message = await request.receive()
    if message["type"] == "http.request" and not message.get("more_body", False):
        body: bytes = message.get("body", b"")  # the whole body in one message: the usual
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        return body
    chunks: list[bytes] = []
    size = 0
    while message["type"] != "http.disconnect":
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
        message = await request.receive()
    raise ClientDisconnect()


async def disconnected(request: Request) -> None:
    """Returns when the client has gone away (its body already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T],
                              undo: Callable[[T], object] | None = None) -> T:
    """Await ``work`` but cancel it, raising ``ClientGone``, if the client goes away.

    Every task cancelled here is awaited, as a task group awaits its children: ``work``
    ends by the cancel (and cleans up after itself), or it finished first and its result
    is returned. When this wait is itself cancelled, however often and in whichever turn
    (a batch's line is cancelled by its batch's stop, then by its runner's ``finally``;
    a cancel may land in the very turn ``work``'s result arrives), a result that came all
    the same goes to ``undo`` (a lease is released), since nobody else will see it."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected(request))
    try:
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(task, watch)
    except BaseException:
        if (undo is not None and task.done() and not task.cancelled()
                and task.exception() is None):
            undo(task.result())
        raise
    if task.cancelled():
        raise ClientGone
    return task.result()


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancel ``tasks`` (those not done yet, in their order) and wait until each has ended.
    A cancel of this wait is raised once they have (as ``TaskGroup`` does): a task left
    running by a second cancel could still hand over a lease that nobody would give back."""
    for task in tasks:
        task.cancel()
    cancelled = False
    while not all(task.done() for task in tasks):
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc, request.url.path)


async def http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = APIError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code,
                   type="invalid_request_error", code=code)
    response = error_response(err, request.url.path)
    response.headers.update(exc.headers or {})  # a 405 says what is Allow-ed
    return response


async def server_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(APIError(f"internal error: {type(exc).__name__}"), request.url.path)
