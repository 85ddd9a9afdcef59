"""Anthropic's Message Batches API, on the same store and runner as OpenAI's batches.

    POST   /v1/messages/batches                              create: ``{"requests": [...]}``
    GET    /v1/messages/batches                              list (``after_id``,
                                                             ``before_id``, ``limit``),
                                                             newest first
    GET    /v1/messages/batches/{message_batch_id}           retrieve
    POST   /v1/messages/batches/{message_batch_id}/cancel    cancel
    DELETE /v1/messages/batches/{message_batch_id}           delete (an ended batch only)
    GET    /v1/messages/batches/{message_batch_id}/results   JSONL, one line per request,
                                                             once the batch has ended

A batch's requests come in the body (``{"custom_id", "params"}``, ``params`` a Messages
request body) and run as ``POST /v1/messages`` lines. A body with no request, more than
``batch_max_lines``, or a ``custom_id`` twice is a 400; a request that is not one this
server can run (``params`` not an object, ``stream: true``, no ``model``, a model the key
may not use) is ``errored`` at once with an ``invalid_request_error``, and the others run.
A body is bounded by ``files_max_mib`` as an uploaded file is (and ``max_body_bytes``);
the files quota, ``batches_per_key`` and ``Idempotency-Key`` hold as for OpenAI's
batches (``checks.add_batch``).
A batch is ``in_progress`` until the runner has answered every request, ``canceling``
after a cancel until then, and ``ended`` after; ``results_url`` is a relative path (the
SDK appends it to its ``base_url``), so the results come from this server. A batch
belongs to the key that made it (another key's id is a 404; an admin sees all); errors
take Anthropic's shape (``router.errors.shaped``, by the ``/v1/messages`` prefix).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from router.access.admission import principal_of
from router.api.batches.checks import (
    Refused,
    add_batch,
    body_head,
    body_model,
    idempotency_key,
    not_found,
    query_int,
    resolve_models,
    sees,
)
from router.api.relay import Relay, protocol_route
from router.api.wire import JSONResponse, read_body
from router.batches.runner import BatchRunner
from router.batches.store import ACTIVE, LINE_STATES, BatchRow, BatchStore, Line, new_id
from router.errors import APIError, BadRequest, PayloadTooLarge, anthropic_error
from shared.config import ServerConfig

WINDOW = 24 * 3600
"""Seconds a message batch may run before what has not run expires (Anthropic's 24 h)."""
RESULTS_MEDIA = "application/x-jsonl"


class MessageBatchItem(msgspec.Struct, forbid_unknown_fields=True):
    """One request of a batch: ``params`` is checked by ``checks.body_model`` (a bad one is
    an errored line, not a refused batch) and by the Messages handler when it runs."""

    custom_id: Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    params: Annotated[msgspec.Raw, msgspec.Meta(
        description="A Messages request body (no stream); kept as its JSON text")]


class CreateMessageBatch(msgspec.Struct, forbid_unknown_fields=True):
    requests: Annotated[list[MessageBatchItem], msgspec.Meta(min_length=1)]


def _rfc3339(when: float | None) -> str | None:
    if when is None:
        return None
    return datetime.fromtimestamp(when, UTC).isoformat(timespec="microseconds") \
        .replace("+00:00", "Z")


def processing_status(row: BatchRow) -> str:
    if row.status == "cancelling":
        return "canceling"
    return "in_progress" if row.status in ACTIVE else "ended"


def message_batch(row: BatchRow) -> dict[str, Any]:
    """``row`` as Anthropic's ``MessageBatch``: counts as they stand (a request that has
    ended is counted as what it ended as at once, the rest as ``processing``)."""
    ended = processing_status(row) == "ended"
    return {
        "id": row.id, "type": "message_batch", "processing_status": processing_status(row),
        "request_counts": {"processing": row.total - row.done, "succeeded": row.succeeded,
                           "errored": row.errored, "canceled": row.canceled,
                           "expired": row.expired},
        "created_at": _rfc3339(row.created), "expires_at": _rfc3339(row.expires),
        "ended_at": _rfc3339(row.times.get(row.status)) if ended else None,
        "cancel_initiated_at": _rfc3339(row.times.get("cancelling")),
        "archived_at": None,
        "results_url": f"/v1/messages/batches/{row.id}/results" if ended else None,
    }


class AnthropicShape:
    """A line's result as a line of Anthropic's results file."""

    def result(self, line: Line, status: int, body: bytes) -> tuple[str, str]:
        try:
            parsed: Any = json.loads(body)
        except ValueError:
            parsed = None
        if status == 200 and isinstance(parsed, dict):
            return "succeeded", _line(line.custom_id, {"type": "succeeded", "message": parsed})
        if not (isinstance(parsed, dict) and parsed.get("type") == "error"):
            text = body.decode(errors="replace")[:500] or f"the request failed ({status})"
            parsed = anthropic_error(APIError(text, status=status))[1]
        return "errored", _line(line.custom_id, {"type": "errored", "error": parsed})

    def unrun(self, line: Line, state: str, message: str) -> str:
        return _line(line.custom_id, {"type": state})

    @staticmethod
    def invalid(custom_id: str, message: str) -> str:
        """A request refused before it ran, as the Messages handler would answer a 400."""
        return _line(custom_id, {"type": "errored",
                                 "error": anthropic_error(BadRequest(message))[1]})


def _line(custom_id: str, result: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "result": result})


class MessageBatches:
    """The Message Batches endpoints over one store and runner."""

    def __init__(self, store: BatchStore, runner: BatchRunner, relay: Relay,
                 server: ServerConfig) -> None:
        self.store = store
        self.runner = runner
        self.relay = relay
        self.server = server
        self.shape = AnthropicShape()

    def routes(self) -> list[Route]:
        base = "/v1/messages/batches"
        one = base + "/{message_batch_id}"
        return [
            protocol_route(base, self.batches, methods=("GET", "POST")),
            protocol_route(one, self.batch, methods=("GET", "DELETE")),
            protocol_route(one + "/cancel", self.cancel),
            protocol_route(one + "/results", self.results, methods=("GET",)),
        ]

    async def batches(self, request: Request) -> Response:
        if request.method == "POST":
            return await self.create(request)
        limit = query_int(request, "limit", 20, 1, 1000)
        after, before = (request.query_params.get(n) for n in ("after_id", "before_id"))
        rows = await self.store.batches(sees(principal_of(request.scope)), "anthropic",
                                        after, None if after else before, limit)
        page = rows[:limit]
        if before and not after:
            page.reverse()  # the store gives the newer ones oldest first
        data = [message_batch(r) for r in page]
        return JSONResponse({"data": data, "has_more": len(rows) > limit,
                             "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None})

    async def create(self, request: Request) -> Response:
        principal = principal_of(request.scope)
        # A message batch is a file sent in the body: ``files_max_mib`` bounds it as it
        # bounds an upload (and ``max_body_bytes`` any body).
        limit = min(self.server.max_body_bytes, int(self.server.files_max_mib * 2**20))
        try:
            req = await read_body(request, CreateMessageBatch, limit, off_loop=True)
        except PayloadTooLarge:
            raise PayloadTooLarge(f"a message batch may have at most {limit} bytes (an "
                                  "uploaded file's server.files_max_mib, within "
                                  "server.max_body_bytes)") from None
        names = await asyncio.to_thread(self.check_requests, req.requests)
        models = await resolve_models(sorted(names), self.relay, principal)
        now = time.time()
        row = BatchRow(new_id("msgbatch_"), principal.name, "anthropic", "/v1/messages",
                       None, "24h", "validating", now, now + WINDOW)
        made = await add_batch(self.store, self.server, row,
                               lambda: self.rows(req.requests, models),
                               idempotency_key(request))
        if made is row:
            self.runner.created(row)
        return JSONResponse(message_batch(made))

    def check_requests(self, requests: list[MessageBatchItem]) -> set[str]:
        """What makes the whole batch a 400 (see the module doc), checked; the model
        names its requests ask for (off the event loop: it reads each one's head)."""
        if len(requests) > self.server.batch_max_lines:
            raise BadRequest(f"the batch holds {len(requests)} requests; a batch may hold "
                             f"{self.server.batch_max_lines} (server.batch_max_lines)",
                             param="requests", code="too_many_lines")
        names: set[str] = set()
        seen: dict[str, int] = {}
        for n, item in enumerate(requests):
            if item.custom_id in seen:
                raise BadRequest(f"requests[{n}]: custom_id '{item.custom_id}' repeats "
                                 f"requests[{seen[item.custom_id]}]'s; each must be unique",
                                 param=f"requests[{n}].custom_id",
                                 code="duplicate_custom_id")
            seen[item.custom_id] = n
            found = body_model(body_head(bytes(item.params)), "params")
            if isinstance(found, str):
                names.add(found)
        return names

    def rows(self, requests: list[MessageBatchItem], models: dict[str, str | Refused]
             ) -> Iterator[Line]:
        """Each request as a line: one this server cannot run ``errored`` with its
        reason already (see the module doc); ``models``: each name's id for the key."""
        for n, item in enumerate(requests):
            params = bytes(item.params)
            found = body_model(body_head(params), "params")
            if isinstance(found, str):
                found = models.get(found) or Refused("model_not_found", found)
            if isinstance(found, Refused):
                yield Line(n + 1, item.custom_id, "", "", "errored",
                           self.shape.invalid(item.custom_id, found.message))
            else:
                yield Line(n + 1, item.custom_id, found, params.decode())

    async def _owned(self, request: Request) -> BatchRow:
        bid = request.path_params["message_batch_id"]
        row = await self.store.batch(bid, sees(principal_of(request.scope)))
        if row is None or row.shape != "anthropic":
            raise not_found("message_batch", bid)
        return row

    async def batch(self, request: Request) -> Response:
        row = await self._owned(request)
        if request.method == "DELETE":
            if row.status in ACTIVE:
                raise BadRequest(f"message batch '{row.id}' has not ended (processing_status "
                                 f"'{processing_status(row)}'); cancel it and wait for it to "
                                 "end before deleting it", code="batch_not_ended")
            await self.store.delete_batch(row.id, None)
            return JSONResponse({"id": row.id, "type": "message_batch_deleted"})
        return JSONResponse(message_batch(row))

    async def cancel(self, request: Request) -> Response:
        row = await self._owned(request)
        cancelled = await self.store.request_cancel(row.id, None)
        if cancelled is None:  # deleted meanwhile
            raise not_found("message_batch", row.id)
        if cancelled.status != row.status:  # not cancelled (or ended) already
            self.runner.cancelling(cancelled)
        return JSONResponse(message_batch(cancelled))

    async def results(self, request: Request) -> Response:
        row = await self._owned(request)
        if row.status in ACTIVE:
            raise BadRequest(f"message batch '{row.id}' has not ended (processing_status "
                             f"'{processing_status(row)}'); its results come once it has "
                             "ended (results_url is set then)", code="batch_not_ended")
        # Streamed a page at a time: a results file is never held whole.
        return StreamingResponse(await self.store.result_body(row.id, LINE_STATES),
                                 media_type=RESULTS_MEDIA)
