"""Who may use the server: API keys, checked before anything else runs.

Keys come from the preset (``api_keys``, ``admin_api_keys``), a key file
(``api_key_file``) and the ``MODELYARD_API_KEYS`` environment variable (comma-separated).
When none is configured (and the database holds no named key) the server is open, as
``vllm serve`` is by default; ``Keys`` says how that can change (only towards closed). A request
shows its key as ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key``
(Anthropic's). A key is known by its SHA-256 digest and never logged; it stands for a
``Principal`` (a name and a role), which the request carries to its handler.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send

from router.access.key_store import KeySpec, NamedKey, key_digest
from router.access.rules import AccessRules
from router.errors import APIError, shaped
from shared.config import ConfigError, ServerConfig

if TYPE_CHECKING:
    from router.access.buckets import TokenBuckets

OPEN_PATHS = frozenset({"/health", "/health/ready", "/"})
"""Probes and the status page: never rate-limited or capped (``router.access.limits``); who may call what is
``router.access.rules.TABLE``."""
KEYS_VARIABLE = "MODELYARD_API_KEYS"
"""Keys from the environment (comma-separated); never passed on to workers."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who asks: the name of the key a request showed, its role and its limits. The name
    owns what the request stores (stored responses, background runs): no other key sees
    those. Roles: ``admin``, ``user``, ``viewer`` (``router.access.rules`` says what each may call)."""

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


_json = msgspec.json.Encoder()  # error bodies of the middleware (send_error)

OPEN = Principal("", "admin")
"""Everyone, on a server with no keys: one user, who may do everything."""
ANONYMOUS = Principal("", "anonymous")
"""A request with no valid key to a path open without one (``/health``, the probes)."""
PRINCIPAL_SCOPE_KEY = "modelyard.principal"
BATCH_SCOPE_KEY = "modelyard.batch"
"""In a request's scope: the batch whose line it is (``router.batches.runner``), which
the relay runs at batch priority."""
KEYS_SCOPE_KEY = "modelyard.keys"


class KeyRevoked(APIError):
    """The key a request (a stream, a background response, a batch line) runs as was
    revoked while it ran: its work ends (``Keys.on_revoked``)."""

    status = 401
    type = "invalid_request_error"
    default_code = "key_revoked"

    def __init__(self) -> None:
        super().__init__("the API key of this request was revoked; its work ends")


def principal_of(scope: Scope) -> Principal:
    """The principal ``KeyGuard`` found for a request (``OPEN`` when keys are off)."""
    found: Principal = scope.get(PRINCIPAL_SCOPE_KEY, OPEN)
    return found


def still_admitted(scope: Scope) -> Callable[[], bool]:
    """For a long answer (a stream): whether the request's key still admits it
    (``Keys.admits``), asked as the answer goes on."""
    keys: Keys | None = scope.get(KEYS_SCOPE_KEY)
    if keys is None:  # no KeyGuard in front: an app built without admission (tests)
        return lambda: True
    principal = principal_of(scope)
    return lambda: keys.admits(principal)


def key_label(secret: bytes, digest: bytes) -> str:
    """A preset key's name in logs, usage, events and metrics: ``key-`` and 12 hex of an
    HMAC of its digest under the router's secret (``KeyStore.label_secret``, one per
    database): stable across restarts, and no offline guess of a weak preset key can be
    checked against a label without that secret."""
    return "key-" + hmac.new(secret, digest, hashlib.sha256).hexdigest()[:12]


class Keys:
    """Every key, by digest: the preset's (``preset``: unnamed, labelled by ``key_label``)
    and the named keys of the database (``set_named``).

    Of the preset's, ``admin`` keys open everything; ``user`` keys open the API, and are
    admins only while no admin key of any kind has been seen since start (a preset with
    plain ``api_keys`` is one user, as before). A named key has the role it was made with.

    Fail closed, whatever changes while the router runs: ``required`` turns on when the
    first key appears (at start from the preset and the store, or by a named key made
    later) and never turns off until a restart; once an admin key has been seen, preset
    ``user`` keys stay users. A revocation, a reload or a database outage only ever takes
    access away."""

    def __init__(self, user: Iterable[str] = (), admin: Iterable[str] = (),
                 secret: bytes | None = None) -> None:
        self.secret = secret or secrets.token_bytes(32)
        """Labels' HMAC key: a random one until the database's is known (``use_secret``)."""
        self._user = [key_digest(k.encode()) for k in user if k]
        self._admin = [key_digest(k.encode()) for k in admin if k]
        self.named: dict[bytes, Principal] = {}
        self.required = False
        """Whether a request needs a key: latched on (see the class doc)."""
        self._users_are_users = False
        """Latched on once an admin key was seen: preset ``user`` keys are never promoted."""
        self.stale = False
        """Whether the named keys could not be read for ``key_store.STALE_MAX`` seconds
        (``set_stale``): they open nothing, and whether each is revoked is unknown."""
        self._read: frozenset[str] = frozenset()
        """Names of the named keys at the last read of the database."""
        self.read_at = 0.0
        """When (``time.time()``) the named keys were last read from the database."""
        self._revoked_listeners: list[Callable[[frozenset[str]], None]] = []
        self._build()

    def _build(self) -> None:
        if self._admin or any(p.admin for p in self.named.values()):
            self._users_are_users = True
        preset: dict[bytes, Principal] = {}
        user_role = "user" if self._users_are_users else "admin"
        for digest in self._user:
            preset[digest] = Principal(key_label(self.secret, digest), user_role)
        for digest in self._admin:
            preset[digest] = Principal(key_label(self.secret, digest), "admin")
        self.preset = preset
        self.principals = {**preset, **self.named}
        self._by_name = {p.name: p for p in self.principals.values()}
        self.required = self.required or bool(self.principals)

    @property
    def preset_digests(self) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """The preset's user and admin keys, by digest (a reload compares these)."""
        return frozenset(self._user), frozenset(self._admin)

    def use_secret(self, secret: bytes) -> None:
        """Label the preset's keys with the database's secret (at start)."""
        self.secret = secret
        self._build()

    def set_preset(self, other: Keys) -> None:
        """The preset's keys after a reload, from ``other`` (rotated in place: ``KeyGuard``
        holds this object). Keys dropped stop working at once; keys stay required."""
        known_before = set(self._by_name)
        self._user, self._admin = list(other._user), list(other._admin)
        self._build()
        self._tell_revoked(known_before)

    def set_named(self, named: Iterable[tuple[bytes, NamedKey]]) -> None:
        """The database's keys not revoked, as the last look found them. Names the last
        read had and this one has not are revoked: ``on_revoked``'s listeners are told
        (a name that only went unread in an outage is told once the database says so)."""
        known_before = {p.name for p in self.preset.values()} | self._read
        self.named = {digest: Principal(key.name, key.role, key.spec) for digest, key in named}
        self.stale = False
        self.read_at = time.time()
        self._read = frozenset(p.name for p in self.named.values())
        self._build()
        self._tell_revoked(known_before)

    def set_stale(self) -> None:
        """The named keys could not be read for ``key_store.STALE_MAX`` seconds: they open
        nothing (fail closed) until a read succeeds, but none is revoked: ``unknown``
        tells their work (a batch's lines) to wait rather than end."""
        self.named = {}
        self.stale = True
        self._build()

    def unknown(self, name: str) -> bool:
        """Whether the key named ``name`` opens nothing now only because the database
        cannot be read (``set_stale``): it was there at the last read. A key revoked
        before the outage is not unknown: it is revoked."""
        return self.stale and name in self._read

    def unseen(self, name: str, since: float) -> bool:
        """Whether the key named ``name`` may be one this router has not read yet: it
        knows no such key, and has not read the database since ``since`` (a batch made
        on another router sharing the database, with a key made there after this one's
        last read). Its work waits for the next read rather than ending as revoked."""
        return name not in self._by_name and self.read_at < since

    def on_revoked(self, listener: Callable[[frozenset[str]], None]) -> None:
        """Call ``listener`` with the names of keys that no longer open anything (a
        revocation read from the database, a reload that drops preset keys), at once:
        what those keys have running (streams, background responses, batches) ends."""
        self._revoked_listeners.append(listener)

    def _tell_revoked(self, known_before: set[str]) -> None:
        gone = frozenset(known_before - self._by_name.keys())
        if gone:
            for listener in self._revoked_listeners:
                listener(gone)

    @property
    def preset_admins(self) -> int:
        """The preset's keys that are admins (a named admin's revocation leaves them)."""
        return sum(1 for p in self.preset.values() if p.admin)

    def admits(self, principal: Principal) -> bool:
        """Whether a request admitted as ``principal`` would still be: its key is still
        there with the same role and limits (a stream checks this as it goes on, so a
        revoked key's open streams end)."""
        return not self.required or self._by_name.get(principal.name) == principal

    def current(self, name: str) -> Principal | None:
        """The key named ``name`` as it stands now (a batch's owner, whose lines run as it
        does today); ``None`` when it no longer opens anything. On a server without keys,
        its one user (``OPEN``), whose name is empty."""
        if not self.required:
            return OPEN if name == "" else None
        return self._by_name.get(name) if name else None

    def keeps_an_admin(self, other: Keys) -> bool:
        """Whether the preset keys of ``other`` (a reload's) with today's named keys
        leave an admin key, where one is today."""
        if not any(p.admin for p in self.principals.values()):
            return True  # none today: nothing to keep
        users, admins = other.preset_digests
        return bool(admins) or (bool(users) and not self._users_are_users) or any(
            p.admin for p in self.named.values())

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
    """ASGI middleware that enforces ``router.access.rules.TABLE``: a request whose key (or lack
    of one) the route's row does not admit gets a 401 (no valid key) or a 403 (a role the
    row leaves out; a route without a row) in its protocol's error shape and never reaches
    a handler; one admitted carries its ``Principal`` on (``principal_of``). Wrong keys
    count against their address (``failures``): once its bucket is empty, any key from
    there gets a 429 unchecked, so keys cannot be guessed at speed."""

    def __init__(self, app: ASGIApp, keys: Keys, rules: AccessRules,
                 failures: TokenBuckets | None = None) -> None:
        self.app = app
        self.keys = keys
        self.rules = rules
        self.failures = failures

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # no route takes a WebSocket: refused before any key
            await send({"type": "websocket.close", "code": 1008})
            return
        scope[KEYS_SCOPE_KEY] = self.keys
        path = scope["path"]
        method = scope.get("method", "WEBSOCKET")
        rule = self.rules.rule_for(scope)
        if not rule.roles:
            await send_error(send, APIError(
                f"{method} {path} has no access rule: refused to every key",
                status=403, type="invalid_request_error", code="no_access_rule"), path)
            return
        if not self.keys.required:
            await self.app(scope, receive, send)  # one user, who is admin (``OPEN``)
            return
        address = client_address(scope)
        limited = self.failures is not None and self.failures.empty(address)
        if rule.allows("anonymous"):  # open to all; a valid key sees more there
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
        if not rule.allows(principal.role):
            await send_error(send, APIError(
                "this endpoint needs an admin key" if rule.roles == {"admin"} else
                f"a {principal.role} key may not {method} {path}", status=403,
                type="invalid_request_error", code="insufficient_permissions"), path)
            return
        scope[PRINCIPAL_SCOPE_KEY] = principal
        await self.app(scope, receive, send)


async def send_error(send: Send, err: APIError, path: str,
                     headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Answer ``err`` from ASGI middleware, before any handler, in the error shape of the
    protocol serving ``path``."""
    status, shape = shaped(err, path)
    body = _json.encode(shape)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})
