"""The errors a client can see, drawn once.

    APIError                 any error answered as OpenAI's {"error": {...}} object
    ├── BadRequest           400  invalid_request_error (body, field or value is wrong)
    ├── ModelNotFound        404  invalid_request_error, code model_not_found
    ├── ClientTooSlow        408  the client did not read its stream (nobody sees it)
    ├── ClientGone           499  the client disconnected first (nobody sees it)
    ├── PayloadTooLarge      413  invalid_request_error
    ├── TooManyRequests      429  a model's wait queue is full (Retry-After)
    ├── ModelUnavailable     503  the model could not be started / loaded in time
    └── WorkerLost           502  the worker died while serving the request

Everything else that escapes a handler is a bug and becomes a 500 ``server_error``.

``shaped(err, path)`` draws an error as the protocol of ``path`` shows errors: OpenAI's
object everywhere but Anthropic's Messages endpoints, which get Anthropic's
``{"type": "error", "error": {"type", "message"}}`` with its own error types (and 529
``overloaded_error`` for a full queue). Middleware and handlers both answer through it, so
a 401 or 413 on ``/v1/messages`` reads as the Anthropic SDK expects.
"""

from __future__ import annotations

import re
from typing import Any


class APIError(Exception):
    status = 500
    type = "server_error"
    default_code: str | None = None

    retry_after = 1
    """Seconds a 429, 503 or 529 asks the client to wait (``Retry-After``)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None, type: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if retry_after is not None:
            self.retry_after = retry_after
        self.code = code if code is not None else self.default_code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


ANTHROPIC_PREFIX = "/v1/messages"
"""Paths under this answer errors in Anthropic's shape."""

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                    413: "request_too_large", 429: "rate_limit_error",
                    529: "overloaded_error"}


_PROMPT_TOO_LONG = re.compile(r"maximum context length is (\d+) tokens\. However, your "
                              r"prompt contains (?:at least )?(\d+) tokens")


def anthropic_error(err: APIError) -> tuple[int, dict[str, Any]]:
    """``err``'s status and body as Anthropic's API would answer them. A prompt that does
    not fit the context is told in Anthropic's words, which its clients read to compact
    a conversation: ``prompt is too long: N tokens > M maximum``."""
    overloaded = isinstance(err, TooManyRequests) or err.code == "server_overloaded"
    status = 529 if overloaded else err.status
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    message = err.message
    if err.code == "context_length_exceeded" and (m := _PROMPT_TOO_LONG.search(message)):
        message = f"prompt is too long: {m[2]} tokens > {m[1]} maximum"
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def shaped(err: APIError, path: str) -> tuple[int, dict[str, Any]]:
    """``err``'s status and body in the error shape of the protocol serving ``path``."""
    if path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error(err)
    return err.status, err.body()


class BadRequest(APIError):
    status = 400
    type = "invalid_request_error"


class ModelNotFound(APIError):
    status = 404
    type = "invalid_request_error"
    default_code = "model_not_found"


class ClientTooSlow(APIError):
    status = 408
    type = "timeout_error"
    default_code = "client_too_slow"


class ClientGone(APIError):
    status = 499
    type = "invalid_request_error"
    default_code = "client_closed"

    def __init__(self, message: str = "the client closed the connection") -> None:
        super().__init__(message)


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"
    default_code = "payload_too_large"


class TooManyRequests(APIError):
    status = 429
    type = "rate_limit_error"
    default_code = "queue_full"


class ModelUnavailable(APIError):
    status = 503
    type = "model_unavailable"
    default_code = "model_unavailable"


class WorkerLost(APIError):
    status = 502
    type = "server_error"
    default_code = "worker_lost"
