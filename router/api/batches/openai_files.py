"""OpenAI's Files and Batches APIs.

    POST   /v1/files                      upload (multipart: ``file``, ``purpose``)
    GET    /v1/files                      list (``purpose``, ``limit``, ``order``, ``after``)
    GET    /v1/files/{file_id}            retrieve
    DELETE /v1/files/{file_id}            delete
    GET    /v1/files/{file_id}/content    the body (a batch's output or error file too)
    POST   /v1/batches                    create from an uploaded ``purpose: batch`` file
    GET    /v1/batches                    list (``limit``, ``after``), newest first
    GET    /v1/batches/{batch_id}         retrieve, with ``request_counts``
    DELETE /v1/batches/{batch_id}         delete an ended batch (ours: OpenAI has none)
    POST   /v1/batches/{batch_id}/cancel  cancel

A batch's input file is read and every line checked when the batch is made, a line at a
time off the event loop (``lines``): a file that is not JSONL, holds more than
``batch_max_lines`` lines or repeats a ``custom_id`` is a 400 naming the line; a line
that is not a request this server can run (not JSON, another ``url`` or method, no
``model``, a model the key may not use, ``stream`` or ``background``) becomes a line of
the error file with its reason, and the others run. Files and batches belong to the key
that made them (another key's id is a 404; an admin sees all); what they store counts
against the key's ``files_quota_mib``, and a key has at most ``batches_per_key`` batches
in flight (``checks.add_batch``). A create with an ``Idempotency-Key`` its key used
before answers the batch made then.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import FileResponse, Response, StreamingResponse
from starlette.routing import Route

from router.access.admission import principal_of
from router.api.batches.checks import (
    add_batch,
    idempotency_key,
    not_found,
    query_int,
    resolve_models,
    sees,
)
from router.api.batches.lines import rows, scan
from router.api.relay import Relay, protocol_route
from router.api.wire import JSONResponse, read_body
from router.batches.runner import BatchRunner
from router.batches.store import (
    ACTIVE,
    BatchRow,
    BatchStore,
    FileRow,
    Line,
    QuotaExceeded,
    new_id,
)
from router.errors import APIError, BadRequest, PayloadTooLarge
from shared.config import ServerConfig

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
             "/v1/rerank", "/v1/score")
"""What a batch's lines may ask (``/v1/rerank`` and ``/v1/score`` are ours)."""
PURPOSES = ("batch", "batch_output", "user_data", "fine-tune", "assistants", "vision",
            "evals")
_WINDOW = re.compile(r"^(\d+)([smh])$")
MAX_WINDOW = 7 * 24 * 3600


class CreateBatch(msgspec.Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None


def file_object(row: FileRow) -> dict[str, Any]:
    return {"id": row.id, "object": "file", "bytes": row.bytes,
            "created_at": int(row.created), "filename": row.filename,
            "purpose": row.purpose, "status": "processed"}


def batch_object(row: BatchRow) -> dict[str, Any]:
    times = {f"{status}_at": int(when) for status, when in row.times.items()}
    out: dict[str, Any] = {
        "id": row.id, "object": "batch", "endpoint": row.endpoint,
        "input_file_id": row.input_file, "completion_window": row.completion_window,
        "status": row.status, "created_at": int(row.created), "expires_at": int(row.expires),
        "request_counts": {"total": row.total, "completed": row.succeeded,
                           "failed": row.errored + row.canceled + row.expired},
    }
    if row.metadata is not None:
        out["metadata"] = row.metadata
    for name in ("in_progress_at", "finalizing_at", "completed_at", "failed_at",
                 "expired_at", "cancelling_at", "cancelled_at"):
        if name in times:
            out[name] = times[name]
    if row.output_file:
        out["output_file_id"] = row.output_file
    if row.error_file:
        out["error_file_id"] = row.error_file
    if row.errors:
        out["errors"] = {"object": "list", "data": row.errors}
    return out


class OpenAIShape:
    """A line's result as a line of OpenAI's output or error file."""

    def result(self, line: Line, status: int, body: bytes) -> tuple[str, str]:
        try:
            parsed: Any = json.loads(body)
        except ValueError:
            parsed = {"error": {"message": body.decode(errors="replace")[:500],
                                "type": "server_error", "param": None, "code": None}}
        state = "succeeded" if status == 200 else "errored"
        return state, json.dumps({
            "id": new_id("batch_req_"), "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": new_id("req_"),
                         "body": parsed},
            "error": None})

    def unrun(self, line: Line, state: str, message: str) -> str:
        code = {"expired": "batch_expired", "canceled": "batch_cancelled"}[state]
        return self.invalid(line.custom_id, code, message)

    @staticmethod
    def invalid(custom_id: str, code: str, message: str) -> str:
        return json.dumps({"id": new_id("batch_req_"), "custom_id": custom_id,
                           "response": None, "error": {"code": code, "message": message}})


class FilesAndBatches:
    """The Files and Batches endpoints over one store and runner."""

    def __init__(self, store: BatchStore, runner: BatchRunner, relay: Relay,
                 server: ServerConfig) -> None:
        self.store = store
        self.runner = runner
        self.relay = relay
        self.server = server
        self.shape = OpenAIShape()
        self._arriving: dict[str, int] = {}
        """Bytes of each key's uploads arriving now (``_Arriving``)."""

    def routes(self) -> list[Route]:
        return [
            protocol_route("/v1/files", self.files, methods=("GET", "POST")),
            protocol_route("/v1/files/{file_id}", self.file, methods=("GET", "DELETE")),
            protocol_route("/v1/files/{file_id}/content", self.content, methods=("GET",)),
            protocol_route("/v1/batches", self.batches, methods=("GET", "POST")),
            protocol_route("/v1/batches/{batch_id}", self.batch, methods=("GET", "DELETE")),
            protocol_route("/v1/batches/{batch_id}/cancel", self.cancel),
        ]

    # -- files -------------------------------------------------------------------------

    async def files(self, request: Request) -> Response:
        if request.method == "POST":
            return await self.upload(request)
        principal = principal_of(request.scope)
        limit = query_int(request, "limit", 10_000, 1, 10_000)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequest("'order' must be 'asc' or 'desc'", param="order")
        rows = await self.store.files(sees(principal), request.query_params.get("purpose"),
                                      request.query_params.get("after"), limit,
                                      newest_first=order == "desc")
        return JSONResponse(_page([file_object(r) for r in rows[:limit]], len(rows) > limit))

    async def upload(self, request: Request) -> Response:
        """Keep an upload: its file part is written once, as it arrives, to a spool in the
        files folder (``_SpoolOnce``), counted against ``files_max_mib`` and against what
        is left of the key's quota (its stored files and batches, and its other uploads
        arriving now) as the bytes come, then moved into place by one check-and-insert
        (``BatchStore.add_file``)."""
        principal = principal_of(request.scope)
        limit = int(self.server.files_max_mib * 2**20)
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit + FORM_SLACK:
            raise PayloadTooLarge(f"a file may have at most {limit} bytes "
                                  "(server.files_max_mib)")
        held = await self.store.held(principal.name)
        await asyncio.to_thread(self.store.folder.mkdir, parents=True, exist_ok=True)
        counted = _Arriving(self._arriving, principal.name, limit, held,
                            int(self.server.files_quota_mib * 2**20))
        parser = _SpoolOnce(request.headers, counted.stream(request), self.store.folder)
        try:
            try:
                form = await parser.parse()
            except MultiPartException as err:
                raise BadRequest(f"the body is not a multipart form: {err.message}",
                                 code="invalid_multipart") from None
            except (AssertionError, ValueError, KeyError) as err:  # python-multipart's
                raise BadRequest(f"the body is not a multipart form: {err}",
                                 code="invalid_multipart") from None
            finally:
                counted.done()
            purpose = form.get("purpose")
            upload = form.get("file")
            if not isinstance(purpose, str) or purpose not in PURPOSES:
                raise BadRequest(f"'purpose' must be one of {', '.join(PURPOSES)}",
                                 param="purpose")
            if not isinstance(upload, UploadFile) or parser.spool is None:
                raise BadRequest("a multipart field 'file' with the file is required",
                                 param="file")
            if upload.size is not None and upload.size > limit:
                raise PayloadTooLarge(f"a file may have at most {limit} bytes "
                                      "(server.files_max_mib)")
            await asyncio.to_thread(_synced, upload)
            try:
                row = await self.store.add_file(principal.name, _filename(upload), purpose,
                                                parser.spool)
            except QuotaExceeded as err:
                raise _over_quota(self.server, err) from None
        finally:
            parser.discard()
        return JSONResponse(file_object(row))

    async def _owned_file(self, request: Request) -> FileRow:
        fid = request.path_params["file_id"]
        row = await self.store.file(fid, sees(principal_of(request.scope)))
        if row is None:
            raise not_found("file", fid)
        return row

    async def file(self, request: Request) -> Response:
        row = await self._owned_file(request)
        if request.method == "DELETE":
            await self.store.delete_file(row.id, None)
            return JSONResponse({"id": row.id, "object": "file", "deleted": True})
        return JSONResponse(file_object(row))

    async def content(self, request: Request) -> Response:
        row = await self._owned_file(request)
        if row.kind == "upload":
            path = self.store.body_path(row.id)
            if not path.is_file():
                raise not_found("file", row.id)
            return FileResponse(path, media_type="application/octet-stream")
        assert row.batch is not None
        states = ("succeeded",) if row.kind == "output" else ("errored", "canceled", "expired")
        # Streamed a page at a time: a results file is never held whole.
        return StreamingResponse(await self.store.result_body(row.batch, states),
                                 media_type="application/octet-stream")

    # -- batches -----------------------------------------------------------------------

    async def batches(self, request: Request) -> Response:
        if request.method == "POST":
            return await self.create(request)
        limit = query_int(request, "limit", 20, 1, 100)
        rows = await self.store.batches(sees(principal_of(request.scope)), "openai",
                                        request.query_params.get("after"), None, limit)
        return JSONResponse(_page([batch_object(r) for r in rows[:limit]], len(rows) > limit))

    async def create(self, request: Request) -> Response:
        principal = principal_of(request.scope)
        req = await read_body(request, CreateBatch, self.server.max_body_bytes)
        if req.endpoint not in ENDPOINTS:
            raise BadRequest(f"endpoint '{req.endpoint}' cannot be batched here; one of "
                             f"{', '.join(ENDPOINTS)}", param="endpoint",
                             code="unsupported_endpoint")
        window = _window(req.completion_window)
        source = await self.store.file(req.input_file_id, sees(principal))
        if source is None or source.kind != "upload":
            raise not_found("file", req.input_file_id)
        if source.purpose != "batch":
            raise BadRequest(f"file '{source.id}' has purpose '{source.purpose}'; a batch's "
                             "input file needs purpose 'batch'", param="input_file_id")
        path = self.store.body_path(source.id)
        scanned = await asyncio.to_thread(scan, path, source.id, req.endpoint,
                                          self.server.batch_max_lines)
        models = await resolve_models(sorted(scanned.models), self.relay, principal)
        now = time.time()
        row = BatchRow(new_id("batch_"), principal.name, "openai", req.endpoint, source.id,
                       req.completion_window, "validating", now, now + window,
                       metadata=req.metadata)
        made = await add_batch(self.store, self.server, row, lambda: rows(
            path, source.id, req.endpoint, models, self.shape.invalid),
            idempotency_key(request))
        if made is row:
            self.runner.created(row)
        return JSONResponse(batch_object(made))

    async def _owned_batch(self, request: Request) -> BatchRow:
        bid = request.path_params["batch_id"]
        row = await self.store.batch(bid, sees(principal_of(request.scope)))
        if row is None or row.shape != "openai":
            raise not_found("batch", bid)
        return row

    async def batch(self, request: Request) -> Response:
        row = await self._owned_batch(request)
        if request.method == "DELETE":
            # Ours (OpenAI has none): what a batch stores counts against its key's files
            # quota, so an ended one can be removed, as a message batch can.
            if row.status in ACTIVE:
                raise BadRequest(f"batch '{row.id}' has not ended (status '{row.status}'); "
                                 "cancel it and wait for it to end before deleting it",
                                 code="batch_not_ended")
            await self.store.delete_batch(row.id, None)
            return JSONResponse({"id": row.id, "object": "batch.deleted", "deleted": True})
        return JSONResponse(batch_object(row))

    async def cancel(self, request: Request) -> Response:
        row = await self._owned_batch(request)
        cancelled = await self.store.request_cancel(row.id, None)
        assert cancelled is not None
        if cancelled.status != row.status:  # not cancelled (or ended) already
            self.runner.cancelling(cancelled)
        return JSONResponse(batch_object(cancelled))


def _page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def _window(text: str) -> int:
    found = _WINDOW.match(text)
    seconds = (int(found.group(1)) * {"s": 1, "m": 60, "h": 3600}[found.group(2)]
               if found else 0)
    if not 0 < seconds <= MAX_WINDOW:
        raise BadRequest(f"completion_window '{text[:20]}' must be a duration such as '24h' "
                         "(s, m or h; at most 168h)", param="completion_window")
    return seconds


FORM_SLACK = 2**16
"""Bytes of a multipart body beside its file (boundaries, part headers, ``purpose``)."""


class _Arriving:
    """An upload's body counted as it arrives, with the key's other uploads arriving
    now (``arriving``, by key: the store's API object holds it), against the file's
    ``limit`` and what is left of the key's ``quota`` (``held`` taken already): past
    either, ``PayloadTooLarge`` (413) before another byte is written. The check-and-insert
    that keeps the file counts exactly (``BatchStore.add_file``); this stops a body that
    cannot fit, and two that cannot fit together, while they arrive."""

    def __init__(self, arriving: dict[str, int], owner: str, limit: int, held: int,
                 quota: int) -> None:
        self.arriving = arriving
        self.owner = owner
        self.limit = limit
        self.room = quota - held
        self.quota = quota
        self.size = 0

    async def stream(self, request: Request) -> AsyncIterator[bytes]:
        async for chunk in request.stream():
            self.size += len(chunk)
            self.arriving[self.owner] = self.arriving.get(self.owner, 0) + len(chunk)
            if self.size > self.limit + FORM_SLACK:
                raise PayloadTooLarge(f"a file may have at most {self.limit} bytes "
                                      "(server.files_max_mib)")
            if self.arriving[self.owner] > self.room + FORM_SLACK:
                raise APIError(f"this key's files would exceed {self.quota / 2**20:g} MiB "
                               "(server.files_quota_mib, with its batches and the uploads "
                               "arriving now); delete some first", status=413,
                               type="invalid_request_error", code="files_quota_exceeded")
            yield chunk

    def done(self) -> None:
        left = self.arriving.get(self.owner, 0) - self.size
        if left > 0:
            self.arriving[self.owner] = left
        else:
            self.arriving.pop(self.owner, None)
        self.size = 0


class _SpoolOnce(MultiPartParser):
    """Starlette's multipart parser, whose file part is written straight into a spool
    in ``folder`` (``.upload-*``, locked while this router holds it: ``clear_spools``
    leaves it), not into a temporary file of its own that would be copied again."""

    def __init__(self, headers: Headers, stream: AsyncIterator[bytes], folder: Path) -> None:
        super().__init__(headers, stream, max_files=1, max_fields=8)  # type: ignore[arg-type]
        self.folder = folder
        self.spool: Path | None = None
        self._handle: BinaryIO | None = None

    def on_headers_finished(self) -> None:
        super().on_headers_finished()
        part = self._current_part
        if part.file is None:
            return
        part.file.file.close()  # starlette's own spool: never written
        fd, name = tempfile.mkstemp(dir=self.folder, prefix=".upload-")  # once an upload
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: never waits
        self.spool = Path(name)
        self._handle = os.fdopen(fd, "w+b")
        part.file.file = self._handle
        self._files_to_close_on_error.append(self._handle)  # type: ignore[arg-type]

    def discard(self) -> None:
        """Close the spool (its lock goes) and remove it unless it was kept."""
        if self._handle is not None:
            self._handle.close()
        if self.spool is not None:
            self.spool.unlink(missing_ok=True)


def _synced(upload: UploadFile) -> None:
    upload.file.flush()
    os.fsync(upload.file.fileno())


def _over_quota(server: ServerConfig, err: QuotaExceeded) -> APIError:
    return APIError(f"this key's files would exceed {server.files_quota_mib:g} MiB "
                    f"(server.files_quota_mib, with what its batches store; {err}); "
                    "delete some first", status=413, type="invalid_request_error",
                    code="files_quota_exceeded")


def _filename(upload: UploadFile) -> str:
    return Path(upload.filename or "upload.jsonl").name[:255] or "upload.jsonl"
