"""What both batch APIs (OpenAI's batches, Anthropic's message batches) check the same
way: a line's request (its body an object, neither streamed nor in the background, naming
a model the key may use), whose batches a caller sees, a listing's integer query values,
and an id not found."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request

from router.access.admission import Principal
from router.api.relay import Relay
from router.batches.store import BatchRow, BatchStore, Line, QuotaExceeded, TooManyBatches
from router.errors import APIError, BadRequest
from shared.config import ServerConfig


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a batch line cannot run: ``code`` (OpenAI's error-file code) and ``message``."""

    code: str
    message: str


class BodyHead(msgspec.Struct):
    """What a batch line's check reads of its request body: the rest is skipped (and
    kept as it came, never decoded into objects and encoded again)."""

    model: Any = None
    stream: Any = None
    background: Any = None


_HEAD = msgspec.json.Decoder(BodyHead)


def body_head(raw: bytes) -> BodyHead | None:
    """The head of a request body's JSON text; ``None`` where it is not a JSON object."""
    try:
        return _HEAD.decode(raw) if raw else None
    except msgspec.DecodeError:  # ValidationError too: not an object
        return None


def body_model(head: BodyHead | None, field: str) -> str | Refused:
    """The model name a batch line's request (the line's ``field``) names, or why the
    line cannot run, whatever the key (no registry read: safe off the event loop)."""
    if head is None:
        return Refused("invalid_body", f"'{field}' must be a JSON object")
    if head.stream:
        return Refused("invalid_body", "'stream' is not supported in a batch")
    if head.background:
        # A background response outlives its line: it would run beside the batch, outside
        # the batch's limits (its line concurrency, its key's max_concurrent, cancel).
        return Refused("invalid_body", "'background' is not supported in a batch: a "
                       "batch line already runs without its client")
    if not isinstance(head.model, str) or not head.model:
        return Refused("missing_model", f"'{field}.model' must name a model")
    return head.model


RESOLVE_TURN = 256
"""Model names resolved in one turn of the event loop (a file may name one per line)."""


async def resolve_models(names: Iterable[str], relay: Relay, principal: Principal
                         ) -> dict[str, str | Refused]:
    """Each model name's id as ``principal`` may use it now, or why not (on the loop:
    the registry is the loop's; ``RESOLVE_TURN`` names a turn, so a file naming a model
    on each of its lines does not hold the loop)."""
    found: dict[str, str | Refused] = {}
    for n, name in enumerate(names, 1):
        try:
            found[name] = relay.resolve_for(name, principal).id
        except APIError as err:
            found[name] = Refused(err.code or "model_not_found", err.message)
        if n % RESOLVE_TURN == 0:
            await asyncio.sleep(0)
    return found


def sees(principal: Principal) -> str | None:
    """The owner whose rows a caller may see: its own; an admin's ``None`` (all)."""
    return None if principal.admin else principal.name


def not_found(kind: str, ident: str) -> APIError:
    return APIError(f"No such {kind}: '{ident}'", status=404, type="invalid_request_error",
                    param="id", code=f"{kind}_not_found")


def query_int(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        raise BadRequest(f"'{name}' must be an integer between {lo} and {hi}, got "
                         f"'{raw[:20]}'", param=name, code="invalid_value")
    return int(raw)


IDEMPOTENCY_HEADER = "idempotency-key"
"""The header a create may carry so that one retried after its answer was lost (a
timeout, a dropped connection) makes one batch: the first's, answered again. The OpenAI
and Anthropic SDKs send none of their own (``x-stainless-retry-count`` counts tries, it
names no request): pass one, ``extra_headers={"Idempotency-Key": ...}``."""
IDEMPOTENCY_MAX = 255


def idempotency_key(request: Request) -> str | None:
    """The create's ``Idempotency-Key``, if it sent one (a 400 past 255 characters)."""
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is None:
        return None
    if not 0 < len(key) <= IDEMPOTENCY_MAX:
        raise BadRequest(f"the Idempotency-Key header must have 1 to {IDEMPOTENCY_MAX} "
                         "characters", param=IDEMPOTENCY_HEADER, code="invalid_value")
    return key


async def add_batch(store: BatchStore, server: ServerConfig, row: BatchRow,
                    lines: Callable[[], Iterable[Line]], idempotency: str | None
                    ) -> BatchRow:
    """``row`` made with its ``lines`` (``BatchStore.add_batch_checked``), or the batch
    the key made with ``idempotency`` before; a 429 past ``batches_per_key`` in flight, a
    413 past the files quota (what batches store counts)."""
    try:
        return await store.add_batch_checked(row, lines, server.batches_per_key, idempotency)
    except TooManyBatches as err:
        raise APIError(f"this key may have {server.batches_per_key} batches in flight "
                       f"(server.batches_per_key; {err}); retry when one has ended or "
                       "cancel one", status=429, type="rate_limit_error",
                       code="too_many_batches") from None
    except QuotaExceeded as err:
        raise APIError(f"this batch's lines would take this key's files past "
                       f"{server.files_quota_mib:g} MiB (server.files_quota_mib counts "
                       f"uploads and what batches store; {err}); delete some first",
                       status=413, type="invalid_request_error",
                       code="files_quota_exceeded") from None
