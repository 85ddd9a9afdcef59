"""Who may use the server: API keys, checked before anything else runs.

Keys come from the preset (``api_keys``, ``admin_api_keys``), a key file
(``api_key_file``) and the ``MODELYARD_API_KEYS`` environment variable (comma-separated).
When none is configured the server is open, as ``vllm serve`` is by default. A request
shows its key as ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key``
(Anthropic's). A key is known by its SHA-256 digest and never logged; it stands for a
``Principal`` (a name and a role), which the request carries to its handler.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from router.api.sse import encode_json
from router.errors import APIError, shaped
from router.key_store import KeySpec, NamedKey
from shared.config import ConfigError, ServerConfig

if TYPE_CHECKING:
    from router.limits import TokenBuckets

OPEN_PATHS = frozenset({"/health", "/health/ready", "/"})  # probes carry no key
OPEN_PREFIX = "/static/"
"""The status page and its assets hold no data; what the page calls needs a key."""
ADMIN_PATHS = frozenset({"/v1/models/load", "/v1/models/unload", "/v1/config/reload"})
KEYS_PATH = "/v1/keys"
KEYS_VARIABLE = "MODELYARD_API_KEYS"
"""Keys from the environment (comma-separated); never passed on to workers."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who asks: the name of the key a request showed, its role and its limits. The name
    owns what the request stores (stored responses, background runs): no other key sees
    those. Roles: ``admin`` (everything), ``user`` (the API, not ``admin_only`` paths),
    ``viewer`` (reads only: a dashboard's key)."""

    name: str
    role: str
    limits: KeySpec = field(default_factory=KeySpec)

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    @property
    def sees_all(self) -> bool:
        """Sees every key's events and failures' log tails (an admin or a viewer)."""
        return self.role in ("admin", "viewer")

    def may(self, method: str, path: str) -> bool:
        """Whether this principal may send ``method`` to ``path``."""
        if self.role == "admin":
            return True
        if path.startswith(KEYS_PATH):
            return False
        if self.role == "viewer":
            return method in ("GET", "HEAD")
        return not admin_only(path)


OPEN = Principal("", "admin")
"""Everyone, on a server with no keys: one user, who may do everything."""
ANONYMOUS = Principal("", "anonymous")
"""A request with no valid key to a path open without one (``/health``, the probes)."""
PRINCIPAL_SCOPE_KEY = "modelyard.principal"


def principal_of(scope: Scope) -> Principal:
    """The principal ``KeyGuard`` found for a request (``OPEN`` when keys are off)."""
    found: Principal = scope.get(PRINCIPAL_SCOPE_KEY, OPEN)
    return found


def key_digest(key: bytes) -> bytes:
    """What a key is known by: its SHA-256 (a key is random, so no salt or stretching is
    needed; the digest is compared, so the time does not tell how much of a guess
    matched)."""
    return hashlib.sha256(key).digest()


class Keys:
    """Every key, by digest: the preset's (``preset``: unnamed, called ``key-`` and the
    start of their digest) and the named keys of the database (``set_named``).

    Of the preset's, ``admin`` keys open everything; ``user`` keys open the API, and also
    the admin endpoints when no admin key is configured (then every key may do
    everything, as one user). A named key has the role it was made with."""

    def __init__(self, user: Iterable[str] = (), admin: Iterable[str] = ()) -> None:
        admins = [k for k in admin if k]
        self.preset: dict[bytes, Principal] = {}
        for key in user:
            if key:
                self._add(key, "user" if admins else "admin")
        for key in admins:
            self._add(key, "admin")
        self.named: dict[bytes, Principal] = {}
        self.principals = dict(self.preset)

    def _add(self, key: str, role: str) -> None:
        digest = key_digest(key.encode())
        self.preset[digest] = Principal(f"key-{digest.hex()[:12]}", role)

    def set_preset(self, preset: dict[bytes, Principal]) -> None:
        """The preset's keys after a reload (rotated in place: ``KeyGuard`` holds this)."""
        self.preset = preset
        self.principals = {**preset, **self.named}

    def set_named(self, named: Iterable[tuple[bytes, NamedKey]]) -> None:
        """The database's keys not revoked, as the last look found them."""
        self.named = {digest: Principal(key.name, key.role, key.spec) for digest, key in named}
        self.principals = {**self.preset, **self.named}

    @classmethod
    def load(cls, server: ServerConfig, source: str,
             environ: dict[str, str] | None = None) -> Keys:
        env = os.environ if environ is None else environ
        user = list(server.api_keys)
        user += [k.strip() for k in env.get(KEYS_VARIABLE, "").split(",")]
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
        return bool(self.principals)

    def identify(self, given: bytes | None) -> Principal | None:
        """The principal ``given`` (a presented key) belongs to; ``None``: no such key."""
        return None if given is None else self.principals.get(key_digest(given))


def presented_key(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return bytes(value[7:].strip())
        if name == b"x-api-key":
            return bytes(value.strip())
    return None


def client_address(scope: Scope) -> str:
    """The peer's address (after ``trusted_proxies``)."""
    client = scope.get("client")
    return str(client[0]) if client else ""  # no peer address: a unix socket, one client


class KeyGuard:
    """ASGI middleware: a request without a key that opens its path gets a 401 (or 403)
    in its protocol's error shape and never reaches a handler; one that has it carries
    its ``Principal`` on (``principal_of``). Wrong keys count against their address
    (``failures``): once its bucket is empty, any key from there gets a 429 unchecked,
    so keys cannot be guessed at speed."""

    def __init__(self, app: ASGIApp, keys: Keys, failures: TokenBuckets | None = None) -> None:
        self.app = app
        self.keys = keys
        self.failures = failures

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if not self.keys.required or not path or path.startswith(OPEN_PREFIX):
            await self.app(scope, receive, send)
            return
        address = client_address(scope)
        limited = self.failures is not None and self.failures.empty(address)
        if path in OPEN_PATHS:  # open to all; a valid key sees more there
            given = presented_key(scope)
            principal = None if given is None or limited else self.keys.identify(given)
            if principal is None and given is not None and self.failures is not None:
                self.failures.take(address)  # a wrong key counts here too: no oracle
            scope[PRINCIPAL_SCOPE_KEY] = principal or ANONYMOUS
            await self.app(scope, receive, send)
            return
        if limited:
            assert self.failures is not None
            wait = self.failures.retry_after(address)
            await send_error(send, APIError(
                f"too many requests with an invalid API key from this address; retry in "
                f"{wait} s", status=429, type="rate_limit_error", code="rate_limit_exceeded"),
                path, [(b"retry-after", str(wait).encode())])
            return
        principal = self.keys.identify(presented_key(scope))
        if principal is None:
            if self.failures is not None:
                self.failures.take(address)
            await send_error(send, APIError(
                "missing or invalid API key: send 'Authorization: Bearer <key>' or "
                "'x-api-key: <key>'", status=401, type="invalid_request_error",
                code="invalid_api_key"), path, [(b"www-authenticate", b"Bearer")])
            return
        if not principal.may(scope["method"], path):
            await send_error(send, APIError(
                "this endpoint needs an admin key" if principal.role == "user" else
                f"a {principal.role} key may not {scope['method']} {path}", status=403,
                type="invalid_request_error", code="insufficient_permissions"), path)
            return
        scope[PRINCIPAL_SCOPE_KEY] = principal
        await self.app(scope, receive, send)


def admin_only(path: str) -> bool:
    """Paths a user key does not open: loading, unloading, reloading, keys, workers' logs
    (which quote other users' prompts in vLLM's warnings)."""
    return (path in ADMIN_PATHS or path.startswith(KEYS_PATH)
            or (path.startswith("/v1/models/") and path.endswith("/logs")))


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
