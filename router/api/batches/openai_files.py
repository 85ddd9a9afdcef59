"""OpenAI's Files and Batches APIs.

    POST   /v1/files                      upload (multipart: ``file``, ``purpose``)
    GET    /v1/files                      list (``purpose``, ``limit``, ``order``, ``after``)
    GET    /v1/files/{file_id}            retrieve
    DELETE /v1/files/{file_id}            delete
    GET    /v1/files/{file_id}/content    the body (a batch's output or error file too)
    POST   /v1/batches                    create from an uploaded ``purpose: batch`` file
    GET    /v1/batches                    list (``limit``, ``after``), newest first
    GET    /v1/batches/{batch_id}         retrieve, with ``request_counts``
    POST   /v1/batches/{batch_id}/cancel  cancel

A batch's input file is read and every line checked when the batch is made: a file that
is not JSONL, holds more than ``batch_max_lines`` lines or repeats a ``custom_id`` is a
400 naming the line; a line that is not a request this server can run (not JSON, another
``url`` or method, no ``model``, a model the key may not use, ``stream: true``) becomes
a line of the error file with its reason, and the others run. Files and batches belong to
the key that made them (another key's id is a 404; an admin sees all).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message

from router.access.admission import Principal, principal_of
from router.api.batches.checks import Refused, not_found, query_int, request_model, sees
from router.api.relay import Relay, protocol_route
from router.api.wire import JSONResponse, read_body
from router.batches.runner import BatchRunner
from router.batches.store import BatchRow, BatchStore, FileRow, Line, QuotaExceeded, new_id
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

    def routes(self) -> list[Route]:
        return [
            protocol_route("/v1/files", self.files, methods=("GET", "POST")),
            protocol_route("/v1/files/{file_id}", self.file, methods=("GET", "DELETE")),
            protocol_route("/v1/files/{file_id}/content", self.content, methods=("GET",)),
            protocol_route("/v1/batches", self.batches, methods=("GET", "POST")),
            protocol_route("/v1/batches/{batch_id}", self.batch, methods=("GET",)),
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
        principal = principal_of(request.scope)
        limit = int(self.server.files_max_mib * 2**20)
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit + 2**16:
            raise PayloadTooLarge(f"a file may have at most {limit} bytes "
                                  "(server.files_max_mib)")
        self.store.folder.mkdir(parents=True, exist_ok=True)
        request = _bounded(request, limit + 2**16)  # a chunked body is counted as it comes
        try:
            async with request.form(max_files=1, max_fields=8) as form:
                purpose = form.get("purpose")
                upload = form.get("file")
                if not isinstance(purpose, str) or purpose not in PURPOSES:
                    raise BadRequest(f"'purpose' must be one of {', '.join(PURPOSES)}",
                                     param="purpose")
                if not isinstance(upload, UploadFile):
                    raise BadRequest("a multipart field 'file' with the file is required",
                                     param="file")
                spool = await _spool(upload, self.store.folder, limit)
        except (AssertionError, ValueError, KeyError) as err:  # python-multipart's refusals
            raise BadRequest(f"the body is not a multipart form: {err}",
                             code="invalid_multipart") from None
        try:
            row = await self.store.add_file(principal.name, _filename(upload), purpose, spool)
        except QuotaExceeded as err:
            raise APIError(f"this key's files would exceed {self.server.files_quota_mib:g} "
                           f"MiB (server.files_quota_mib; {err}); delete some first",
                           status=413, type="invalid_request_error",
                           code="files_quota_exceeded") from None
        finally:
            spool.unlink(missing_ok=True)
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
        text = await asyncio.to_thread(_read_text, self.store.body_path(source.id), source.id)
        lines = self.check_lines(text, req.endpoint, principal)
        now = time.time()
        row = BatchRow(new_id("batch_"), principal.name, "openai", req.endpoint, source.id,
                       req.completion_window, "validating", now, now + window,
                       metadata=req.metadata, total=len(lines),
                       errored=sum(ln.state == "errored" for ln in lines))
        await self.store.add_batch(row, lines)
        self.runner.created(row)
        return JSONResponse(batch_object(row))

    def check_lines(self, text: str, endpoint: str, principal: Principal) -> list[Line]:
        """Every line of a batch's input file, checked: a line this server cannot run is
        ``errored`` with its reason already (see the module doc)."""
        raw = [ln for ln in text.splitlines() if ln.strip()]
        if not raw:
            raise BadRequest("the input file holds no lines", param="input_file_id",
                             code="invalid_file")
        if len(raw) > self.server.batch_max_lines:
            raise BadRequest(f"the input file holds {len(raw)} lines; a batch may hold "
                             f"{self.server.batch_max_lines} (server.batch_max_lines)",
                             param="input_file_id", code="too_many_lines")
        lines: list[Line] = []
        seen: dict[str, int] = {}
        parsed_any = False
        for n, text_line in enumerate(raw, 1):
            try:
                item = json.loads(text_line)
            except ValueError:
                item = None
            if not isinstance(item, dict):
                lines.append(Line(n, f"line-{n}", "", "", "errored", self.shape.invalid(
                    f"line-{n}", "invalid_json", f"line {n} is not a JSON object")))
                continue
            parsed_any = True
            custom_id = item.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id:
                custom_id = f"line-{n}"
                reason: tuple[str, str] | None = ("missing_custom_id",
                                                  f"line {n} has no 'custom_id' string")
            else:
                if custom_id in seen:
                    raise BadRequest(f"line {n}: custom_id '{custom_id[:80]}' repeats line "
                                     f"{seen[custom_id]}'s; each must be unique",
                                     param="input_file_id", code="duplicate_custom_id")
                seen[custom_id] = n
                reason = None
            model = ""
            if reason is None:
                reason, model = self._check_request(item, endpoint, principal)
            if reason is not None:
                lines.append(Line(n, custom_id, model, "", "errored",
                                  self.shape.invalid(custom_id, *reason)))
            else:
                lines.append(Line(n, custom_id, model, json.dumps(item["body"])))
        if not parsed_any:
            raise BadRequest("the input file is not JSONL: no line is a JSON object",
                             param="input_file_id", code="invalid_file")
        return lines

    def _check_request(self, item: dict[str, Any], endpoint: str, principal: Principal
                       ) -> tuple[tuple[str, str] | None, str]:
        """Why a line's request cannot run (code, message), or ``None``; its model's id."""
        if item.get("method", "POST") != "POST":
            return ("invalid_method", f"method '{item.get('method')}': only POST"), ""
        if item.get("url") != endpoint:
            url = item.get("url")
            return ("invalid_url", f"url '{url}' is not the batch's endpoint '{endpoint}'"), ""
        found = request_model(item.get("body"), "body", self.relay, principal)
        if isinstance(found, Refused):
            return (found.code, found.message), ""
        return None, found

    async def _owned_batch(self, request: Request) -> BatchRow:
        bid = request.path_params["batch_id"]
        row = await self.store.batch(bid, sees(principal_of(request.scope)))
        if row is None or row.shape != "openai":
            raise not_found("batch", bid)
        return row

    async def batch(self, request: Request) -> Response:
        return JSONResponse(batch_object(await self._owned_batch(request)))

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


def _bounded(request: Request, limit: int) -> Request:
    """``request`` whose body, read through it, raises ``PayloadTooLarge`` past ``limit``
    bytes (Starlette spools a multipart body whole before a handler sees it)."""
    size = 0

    async def receive() -> Message:
        nonlocal size
        message = await request.receive()
        size += len(message.get("body", b""))
        if size > limit:
            raise PayloadTooLarge(f"a file may have at most {limit - 2**16} bytes "
                                  "(server.files_max_mib)")
        return message

    return Request(request.scope, receive)


def _filename(upload: UploadFile) -> str:
    return Path(upload.filename or "upload.jsonl").name[:255] or "upload.jsonl"


async def _spool(upload: UploadFile, folder: Path, limit: int) -> Path:
    """The upload copied to a temporary file in ``folder`` (at most ``limit`` bytes)."""
    fd, name = tempfile.mkstemp(dir=folder, prefix=".upload-")
    path = Path(name)
    size = 0
    try:
        with os.fdopen(fd, "wb") as out:
            while chunk := await upload.read(1 << 20):
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"a file may have at most {limit} bytes "
                                          "(server.files_max_mib)")
                await asyncio.to_thread(out.write, chunk)
            await asyncio.to_thread(os.fsync, out.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def _read_text(path: Path, file_id: str) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise not_found("file", file_id) from None
    except UnicodeDecodeError:
        raise BadRequest(f"file '{file_id}' is not UTF-8 text (JSONL)", param="input_file_id",
                         code="invalid_file") from None
