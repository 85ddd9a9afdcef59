"""Who may use the server: API keys, checked before anything else runs.

Keys come from the preset (``api_keys``, ``admin_api_keys``), a key file
(``api_key_file``) and the ``MODELYARD_API_KEYS`` environment variable (comma-separated).
When none is configured the server is open, as ``vllm serve`` is by default. A request
shows its key as ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key``
(Anthropic's). Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from router.api.sse import encode_json
from router.errors import APIError, shaped
from shared.config import ConfigError, ServerConfig

OPEN_PATHS = frozenset({"/health", "/health/ready", "/"})  # probes carry no key
OPEN_PREFIX = "/static/"
"""The status page and its assets hold no data; what the page calls needs a key."""
ADMIN_PATHS = frozenset({"/v1/models/load", "/v1/models/unload", "/v1/config/reload"})


class Keys:
    """The configured keys: ``user`` keys open the API, ``admin`` keys open everything."""

    def __init__(self, user: Iterable[str] = (), admin: Iterable[str] = ()) -> None:
        self.admin = [k.encode() for k in admin if k]
        self.user = [k.encode() for k in user if k] + self.admin

    @classmethod
    def load(cls, server: ServerConfig, source: str,
             environ: dict[str, str] | None = None) -> Keys:
        env = os.environ if environ is None else environ
        user = list(server.api_keys)
        user += [k.strip() for k in env.get("MODELYARD_API_KEYS", "").split(",")]
        if server.api_key_file:
            try:
                lines = Path(server.api_key_file).read_text(encoding="utf-8").splitlines()
            except OSError as err:
                raise ConfigError(f"{source}: [server]: key 'api_key_file': cannot read "
                                  f"{server.api_key_file}: {err.strerror}") from None
            user += [ln.split("#", 1)[0].strip() for ln in lines]
        return cls(user, server.admin_api_keys)

    @property
    def required(self) -> bool:
        return bool(self.user)

    @staticmethod
    def _matches(given: bytes, keys: list[bytes]) -> bool:
        found = False
        for key in keys:  # every key is compared: the time does not tell which matched
            found |= hmac.compare_digest(given, key)
        return found

    def allows(self, given: bytes | None, path: str) -> int:
        """200 if ``given`` opens ``path``, else the status to answer (401 or 403)."""
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIX):
            return 200
        if given is None or not self._matches(given, self.user):
            return 401
        if self.admin and path in ADMIN_PATHS and not self._matches(given, self.admin):
            return 403
        return 200


def presented_key(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return bytes(value[7:].strip())
        if name == b"x-api-key":
            return bytes(value.strip())
    return None


class KeyGuard:
    """ASGI middleware: a request without a key that opens its path gets a 401 (or 403)
    in its protocol's error shape and never reaches a handler."""

    def __init__(self, app: ASGIApp, keys: Keys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.required:
            await self.app(scope, receive, send)
            return
        status = self.keys.allows(presented_key(scope), scope["path"])
        if status == 200:
            await self.app(scope, receive, send)
            return
        message = ("this endpoint needs an admin key" if status == 403 else
                   "missing or invalid API key: send 'Authorization: Bearer <key>' or "
                   "'x-api-key: <key>'")
        await send_error(send, APIError(
            message, status=status, type="invalid_request_error",
            code="insufficient_permissions" if status == 403 else "invalid_api_key"),
            scope["path"], [(b"www-authenticate", b"Bearer")])


async def send_error(send: Send, err: APIError, path: str,
                     headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Answer ``err`` from ASGI middleware, before any handler, in the error shape of the
    protocol serving ``path``."""
    status, shape = shaped(err, path)
    body = encode_json(shape)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})
