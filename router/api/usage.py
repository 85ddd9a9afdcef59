"""``GET /v1/usage``: the usage ledger (``router.access.ledger``), summed.

``group_by`` (comma-separated, of ``key``, ``model``, ``endpoint``, ``day``; default
``key,model``), ``start`` and ``end`` (Unix seconds, or a UTC date or time in ISO 8601;
default: this calendar month so far) and ``key`` (a key's name). An admin or a viewer
sees every key's usage; any other key only its own (naming another is a 403). While the
database is away it is a 503 (``database.DatabaseUnavailable``, code
``database_unavailable``), never a 500.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.access.admission import principal_of
from router.access.ledger import GROUPS, Ledger, period_bounds
from router.api.wire import JSONResponse
from router.errors import APIError, BadRequest
from router.registry import ModelRegistry


def _when(request: Request, name: str, default: float) -> float:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(raw)  # 3.11 takes a trailing Z
    except ValueError:
        raise BadRequest(f"'{name}' must be Unix seconds or an ISO 8601 date or time, not "
                         f"{raw[:40]!r}", param=name) from None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()


class UsageAPI:
    def __init__(self, ledger: Ledger, registry: ModelRegistry) -> None:
        self.ledger = ledger
        self.registry = registry

    def routes(self) -> list[Route]:
        return [Route("/v1/usage", self.usage, methods=["GET"])]

    async def usage(self, request: Request) -> Response:
        principal = principal_of(request.scope)
        group_by = [g.strip() for g in
                    request.query_params.get("group_by", "key,model").split(",") if g.strip()]
        unknown = [g for g in group_by if g not in GROUPS]
        if unknown or len(set(group_by)) != len(group_by):
            raise BadRequest(f"'group_by' takes distinct fields of {', '.join(GROUPS)}",
                             param="group_by")
        now = time.time()
        start = _when(request, "start", period_bounds("month", now)[0])
        end = _when(request, "end", now + 1)
        key = request.query_params.get("key")
        if not principal.sees_all:
            if key is not None and key != principal.name:
                raise APIError("a key sees only its own usage", status=403,
                               type="invalid_request_error", param="key",
                               code="insufficient_permissions")
            key = principal.name
        models = None
        if principal.limits.models:  # rows of a model outside its globs do not exist for it
            models = [e.id for e in self.registry if principal.limits.allows(e.names)]
        rows = await self.ledger.query(group_by, start, end, key, models)
        return JSONResponse({"object": "list", "start": start, "end": end,
                             "group_by": group_by, "data": rows})
