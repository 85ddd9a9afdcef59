"""What both batch APIs (OpenAI's batches, Anthropic's message batches) check the same
way: a line's request (its body an object, neither streamed nor in the background, naming
a model the key may use), whose batches a caller sees, a listing's integer query values,
and an id not found."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from router.access.admission import Principal
from router.api.relay import Relay
from router.errors import APIError, BadRequest


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a batch line cannot run: ``code`` (OpenAI's error-file code) and ``message``."""

    code: str
    message: str


def request_model(body: object, field: str, relay: Relay, principal: Principal
                  ) -> str | Refused:
    """The id of the model a batch line's request ``body`` (the line's ``field``) names,
    as ``principal`` may use it now; or why the line cannot run. The rest of the body is
    the handler's to judge when the line runs (its refusal is the line's result)."""
    if not isinstance(body, dict):
        return Refused("invalid_body", f"'{field}' must be a JSON object")
    if body.get("stream"):
        return Refused("invalid_body", "'stream' is not supported in a batch")
    if body.get("background"):
        # A background response outlives its line: it would run beside the batch, outside
        # the batch's limits (its line concurrency, its key's max_concurrent, cancel).
        return Refused("invalid_body", "'background' is not supported in a batch: a "
                       "batch line already runs without its client")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return Refused("missing_model", f"'{field}.model' must name a model")
    try:
        return relay.resolve_for(model, principal).id
    except APIError as err:
        return Refused(err.code or "model_not_found", err.message)


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
