"""Named API keys, kept hashed in the router's database (``router.access.database``).

A key has a name, a role (``admin``, ``user``, ``viewer``) and limits (``KeySpec``): the
models it may use (globs; none: all), requests and tokens per minute, requests at once.
Only its SHA-256 is stored; the secret (``my-`` and 43 random characters) is shown once,
by ``modelyard keys create`` or ``POST /v1/keys``. A revoked key stays listed (its name
stays taken: usage rows keep naming it) and opens nothing. Routers sharing one database
see a change within ``REFRESH`` seconds.

While the database is away a router keeps the named keys it last read for ``STALE_MAX``
seconds (a key revoked meanwhile still opens what it opened: the revocation cannot be
read); past that, named keys open nothing (``follow``) until a read succeeds again, and
the first read after the database returns takes every change made meanwhile. An outage is
not a revocation: past ``STALE_MAX`` a key is unknown (``Keys.set_stale``, ``Keys.unknown``),
and what it has running (a batch) waits rather than ends; only a read that lacks the key
ends its work (``Keys.on_revoked``). Keys are
not created or revoked while it is away (``/v1/keys`` answers 503).
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Literal

import msgspec

from router.access.database import Conn, Database

log = logging.getLogger("modelyard.router")

Role = Literal["admin", "user", "viewer"]
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
"""A key's name: it shows in usage and events, so it stays short and plain."""
REFRESH = 2.0
"""Seconds between a router's looks at the keys in its database."""
STALE_MAX = 60.0
"""Seconds a router serves named keys from its last good read while the database is
away; then they open nothing until it answers."""
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS api_keys (
        name TEXT PRIMARY KEY,
        digest TEXT NOT NULL UNIQUE,
        role TEXT NOT NULL,
        spec TEXT NOT NULL,
        created DOUBLE NOT NULL,
        revoked DOUBLE)""",
    """CREATE TABLE IF NOT EXISTS router_secrets (
        name TEXT PRIMARY KEY,
        value TEXT NOT NULL)""",
)
"""The keys' table (``spec``: a key's limits as JSON, ``KeySpec``), and the secrets the
routers sharing the database agree on (``label_secret``)."""


def key_digest(key: bytes) -> bytes:
    """What a key is known by: its SHA-256 (a key is random, so no salt or stretching is
    needed; the digest is compared, so the time does not tell how much of a guess
    matched)."""
    return hashlib.sha256(key).digest()


class Budget(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """At most ``tokens`` prompt+completion tokens per calendar ``period`` (UTC), on the
    models ``model`` (a glob of ids) names, else on every model."""

    tokens: Annotated[int, msgspec.Meta(ge=1)]
    period: Literal["day", "week", "month"]
    model: str | None = None


class KeySpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """What a key may do beside its role (every field optional; stored as JSON)."""

    models: list[str] = []
    """Model ids or aliases it may use, as globs (``llama-*``); none: every model."""
    rpm: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Requests per minute (0: the server's ``rate_limit_per_minute``, if any)."""
    tpm: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Prompt and completion tokens per minute (0: no limit)."""
    max_concurrent: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Requests in flight at once (0: no limit)."""
    budgets: list[Budget] = []
    """Token budgets per period (``router.access.ledger`` enforces them)."""

    def allows(self, names: list[str]) -> bool:
        """Whether a model known by ``names`` (its id and aliases) is one it may use."""
        return not self.models or any(fnmatch.fnmatchcase(n, glob)
                                      for glob in self.models for n in names)


class NamedKey(msgspec.Struct, kw_only=True):
    """A stored key as listed (never its secret or digest)."""

    name: str
    role: Role
    spec: KeySpec = msgspec.field(default_factory=KeySpec)
    created: float = 0.0
    revoked: float | None = None


class KeyCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The body of ``POST /v1/keys``."""

    name: str
    role: Role = "user"
    models: list[str] = []
    rpm: Annotated[int, msgspec.Meta(ge=0)] = 0
    tpm: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_concurrent: Annotated[int, msgspec.Meta(ge=0)] = 0
    budgets: list[Budget] = []

    def spec(self) -> KeySpec:
        return KeySpec(models=self.models, rpm=self.rpm, tpm=self.tpm,
                       max_concurrent=self.max_concurrent, budgets=self.budgets)


class KeyExists(Exception):
    """A key of that name exists (revoked or not)."""


class LastAdmin(Exception):
    """Revoking this key would leave no admin key: nobody could manage keys over REST."""


def new_secret() -> str:
    return "my-" + secrets.token_urlsafe(32)


_spec_json = msgspec.json.Encoder()
_spec_of = msgspec.json.Decoder(KeySpec)


class KeyStore:
    """The named keys of ``db``."""

    def __init__(self, db: Database) -> None:
        self.db = db

    @staticmethod
    def _create(conn: Conn, name: str, role: str, spec: KeySpec, digest: str) -> None:
        if conn.execute("SELECT 1 FROM api_keys WHERE name = ?", (name,)):
            raise KeyExists(name)
        conn.execute("INSERT INTO api_keys (name, digest, role, spec, created) "
                     "VALUES (?, ?, ?, ?, ?)",
                     (name, digest, role, _spec_json.encode(spec).decode(), time.time()))

    async def create(self, name: str, role: str, spec: KeySpec) -> tuple[NamedKey, str]:
        """A new key: what it is, and its secret (shown once, stored only hashed)."""
        if not NAME.fullmatch(name):
            raise ValueError(f"key name {name!r}: 1-64 letters, digits and _.@- "
                             "(starting with a letter or digit)")
        secret = new_secret()
        digest = key_digest(secret.encode()).hex()
        await self.db.run(lambda conn: self._create(conn, name, role, spec, digest))
        return NamedKey(name=name, role=role, spec=spec, created=time.time()), secret  # type: ignore[arg-type]

    async def revoke(self, name: str, other_admins: int = 0) -> bool:
        """Revoke ``name``; False if there is no such key (or it was revoked already).
        ``LastAdmin`` if it is an admin key and neither another named admin key nor any of
        ``other_admins`` (the preset's admin keys) would remain; one statement decides,
        so two routers revoking the last two admins at once cannot both succeed on
        SQLite (on PostgreSQL's read committed, nearly)."""
        def work(conn: Conn) -> bool:
            live = conn.execute("SELECT role FROM api_keys WHERE name = ? AND revoked IS NULL",
                                (name,))
            if not live:
                return False
            done = conn.execute(
                "UPDATE api_keys SET revoked = ? WHERE name = ? AND revoked IS NULL AND "
                "(role <> 'admin' OR ? > 0 OR EXISTS (SELECT 1 FROM api_keys AS other "
                "WHERE other.role = 'admin' AND other.revoked IS NULL AND other.name <> ?)) "
                "RETURNING name", (time.time(), name, other_admins, name))
            if not done:
                raise LastAdmin(name)
            return True

        return await self.db.run(work)

    async def label_secret(self) -> bytes:
        """The secret preset keys' labels are made with (``admission.key_label``): made
        once per database, so labels stay the same across restarts and routers."""
        def work(conn: Conn) -> bytes:
            conn.execute("INSERT INTO router_secrets (name, value) VALUES (?, ?) "
                         "ON CONFLICT (name) DO NOTHING", ("key_labels", secrets.token_hex(32)))
            rows = conn.execute("SELECT value FROM router_secrets WHERE name = ?",
                                ("key_labels",))
            return bytes.fromhex(rows[0][0])

        return await self.db.run(work)

    @staticmethod
    def _rows(conn: Conn) -> list[tuple[str, str, str, str, float, float | None]]:
        return [tuple(r) for r in conn.execute(
            "SELECT name, digest, role, spec, created, revoked FROM api_keys ORDER BY name")]

    @staticmethod
    def _listed(row: tuple[str, str, str, str, float, float | None]) -> NamedKey:
        name, _, role, spec, created, revoked = row
        return NamedKey(name=name, role=role, spec=_spec_of.decode(spec),  # type: ignore[arg-type]
                        created=created, revoked=revoked)

    async def listed(self) -> list[NamedKey]:
        return [key for row in await self.db.run(self._rows)
                if (key := self._read(row)) is not None]

    async def active(self) -> list[tuple[bytes, NamedKey]]:
        """Every key not revoked, with its digest (the router's refresh)."""
        return [(bytes.fromhex(row[1]), key) for row in await self.db.run(self._rows)
                if row[5] is None and (key := self._read(row)) is not None]

    @classmethod
    def _read(cls, row: tuple[str, str, str, str, float, float | None]) -> NamedKey | None:
        """A row as a key; None (logged) for one that does not read, as a row edited by
        hand may not: that key alone opens nothing, every other is read as usual."""
        try:
            if row[2] not in ("admin", "user", "viewer"):
                raise ValueError(f"no role {row[2]!r}")
            bytes.fromhex(row[1])
            return cls._listed(row)
        except (ValueError, msgspec.ValidationError) as err:
            log.error("named key %r: its row does not read (%s); it opens nothing", row[0], err)
            return None


async def follow(refresh: Callable[[], Awaitable[None]], drop: Callable[[], None], *,
                 every: float = REFRESH, stale_max: float = STALE_MAX,
                 clock: Callable[[], float] = time.monotonic) -> None:
    """Forever: ``refresh`` the named keys every ``every`` seconds (other routers and
    ``modelyard keys`` change them too). Once no refresh has succeeded for ``stale_max``
    seconds, ``drop`` them (named keys open nothing), once per outage, at most
    ``stale_max + every`` seconds after the last good read; the next refresh that
    succeeds brings them back as the database has them then."""
    fresh = clock()
    failing = dropped = False
    while True:
        await asyncio.sleep(every)
        try:
            # a database that does not answer is away too: never past the bound
            async with asyncio.timeout(max(fresh + stale_max - clock(), every)):
                await refresh()
        except Exception as err:  # noqa: BLE001  # unavailable, or a bug: the same rule
            err = err if str(err) else type(err).__name__  # type: ignore[assignment]
            if not failing:  # once per outage, not every ``every`` seconds
                log.warning("named keys: cannot read them (%s); the last read serves for "
                            "%g s", err, stale_max)
            failing = True
            if not dropped and clock() - fresh > stale_max:
                drop()
                dropped = True
                log.error("named keys: not read for %g s (%s); they open nothing until "
                          "the database answers", stale_max, err)
        else:
            fresh = clock()
            if failing:
                log.warning("named keys: read again")
            failing = dropped = False
