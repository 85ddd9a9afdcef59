"""``Database``: the router's own tables (named keys, the usage ledger) in SQLite (the
standard library's, WAL) or PostgreSQL (psycopg 3), where several routers share them.

Queries run on threads of the database's own (one for SQLite, ``POOL_SIZE`` for
PostgreSQL): the event loop never waits on a query, and the loop's default executor
(which the supervisor reaps workers with) is never taken. SQL is written once with ``?``
placeholders and the column types ``DOUBLE`` and ``BIGINTEGER``; for PostgreSQL the
placeholders become ``%s`` and the types their PostgreSQL names (``Conn.sql``: a dozen
statements, none built from user input but ``IN`` lists of ``?``, do not need SQLAlchemy
Core's dialects, a dependency far larger than what it would replace; psycopg offers no
``?`` paramstyle of its own). Each module that keeps
a table declares it (``key_store.SCHEMA``, ``ledger.SCHEMA``); the database creates what
it is given, where missing, on every new connection.

When the database is away (a restart, a crash, a full disk) nothing hangs and nothing
is a 500:

- PostgreSQL connections come from a ``psycopg_pool.ConnectionPool``, which checks a
  connection before handing it out (a round trip) and replaces a broken one in the
  background; SQLite keeps one connection and reopens it after an error.
- Every ``run`` either succeeds, or is run once more on a fresh connection after a
  connection error, or raises ``DatabaseUnavailable``: an ``APIError`` that handlers let
  through as a 503 (``service_unavailable``, code ``database_unavailable``). A new
  connection waits at most ``CONNECT_TIMEOUT`` seconds (``AWAY_WAIT`` while the last
  statement found the database away), and ``run`` waits at most
  ``RUN_TIMEOUT`` for its answer (a statement on a server that stopped answering goes
  on on its thread; the caller is told at once).
- A ``work`` that is retried runs twice: it must be safe to run again (the keys' and the
  ledger's are: a read, a revoke, an insert checked for its name, one transaction of
  usage rows). Only a connection lost between a COMMIT and its answer can write a
  transaction twice; psycopg cannot tell that case from one that wrote nothing.

What callers do with it: the named keys keep their last good snapshot for
``key_store.STALE_MAX`` seconds, then named keys open nothing until the store answers
again (``key_store.follow``); ``/v1/keys`` and ``/v1/usage`` answer 503; the ledger
keeps its rows queued and writes them when the database returns (``router.access.ledger``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import re
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from router.errors import APIError
from shared.config import default_cache_dir

T = TypeVar("T")
Row = tuple[Any, ...]

log = logging.getLogger("modelyard.router")

_PG_TYPES = (("DOUBLE", "DOUBLE PRECISION"), ("BIGINTEGER", "BIGINT"))
_SQLITE_TYPES = (("DOUBLE", "REAL"), ("BIGINTEGER", "INTEGER"))

POOL_SIZE = 4
"""PostgreSQL connections (and threads) at most: the key refresh, the ledger's writer
and budget reads, ``/v1/usage`` and ``/v1/keys`` never wait for each other."""
CONNECT_TIMEOUT = 5.0
"""Seconds a statement waits for a connection (a new one: libpq's ``connect_timeout``)."""
AWAY_WAIT = 0.5
"""Seconds a statement waits for a connection while the last one found the database
away: the pool goes on trying in the background, and a request (a budget's read at
admission, ``/v1/usage``) is not held ``CONNECT_TIMEOUT`` for each one."""
RECONNECT_FOR = 5.0
"""Seconds the pool goes on replacing a lost connection in the background before a
statement's own wait starts a fresh attempt (its back-off doubles from 1 s: never let it
grow to minutes after a long outage)."""
RUN_TIMEOUT = 30.0
"""Seconds ``run`` waits for an answer before it raises ``DatabaseUnavailable``."""
_SCHEMA_LOCK = 0x6D6F64656C  # "model": the advisory lock the schema is created under
SQLITE_BUSY = 10.0
"""Seconds SQLite waits for another process's write lock (``modelyard keys``)."""


class DatabaseUnavailable(APIError):
    """A statement could not run: the database is away or did not answer in time. A
    handler lets it through: the client gets a 503 and may retry."""

    status = 503
    type = "service_unavailable"
    default_code = "database_unavailable"
    retry_after = 2


def default_url(cache_dir: str | None) -> str:
    """SQLite under the cache dir (``server.cache_dir``, else ``~/.cache/modelyard``)."""
    base = Path(cache_dir) if cache_dir else default_cache_dir()
    return f"sqlite:///{base / 'modelyard.db'}"


class Conn:
    """A connection as the thread that holds it uses it: ``execute`` commits at once
    (inside ``atomic``, at its end); ``many`` runs one statement over many rows in one
    transaction."""

    def __init__(self, raw: Any, postgres: bool) -> None:
        self.raw = raw
        self.postgres = postgres
        self._atomic = False

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """The statements run inside, one transaction: all written, or none (inside
        another, part of that one)."""
        if self._atomic:
            yield
            return
        self._atomic = True
        try:
            with self.raw.transaction() if self.postgres else self.raw:
                yield  # SQLite's connection commits at the block's end, or rolls back
        finally:
            self._atomic = False

    def sql(self, text: str) -> str:
        for ours, theirs in (_PG_TYPES if self.postgres else _SQLITE_TYPES):
            text = text.replace(ours, theirs)
        return text.replace("?", "%s") if self.postgres else text

    def execute(self, text: str, params: Sequence[Any] = ()) -> list[Row]:
        cursor = self.raw.execute(self.sql(text), tuple(params))
        rows = list(cursor.fetchall()) if cursor.description else []
        if not self.postgres and not self._atomic:
            self.raw.commit()
        return rows

    def many(self, text: str, rows: Sequence[Sequence[Any]]) -> None:
        with self.atomic():
            if self.postgres:
                with self.raw.cursor() as cursor:
                    cursor.executemany(self.sql(text), rows)
            else:
                self.raw.executemany(self.sql(text), rows)


class Database:
    """``url``: ``sqlite:///path`` or ``postgresql://...``. Opened on first use; the
    tables of ``schema`` are created where missing on each new connection."""

    def __init__(self, url: str, schema: Sequence[str] = ()) -> None:
        self.url = url
        self.schema = schema
        self.postgres = url.startswith(("postgresql://", "postgres://"))
        if not self.postgres and not url.startswith("sqlite:///"):
            raise ValueError(f"database_url {url!r}: not sqlite:///PATH or postgresql://...")
        self._threads = ThreadPoolExecutor(POOL_SIZE if self.postgres else 1,
                                           thread_name_prefix="modelyard-db")
        self._opening = threading.Lock()
        self._pool: Any = None  # psycopg_pool.ConnectionPool, opened on first use
        self._sqlite: Conn | None = None  # SQLite's one connection (its one thread's)
        self._away = False  # the last statement found the database away

    @property
    def shown(self) -> str:
        """The URL for logs: a password in it is replaced by ``***``."""
        return re.sub(r"(://[^:/@]*:)[^/]*@", r"\1***@", self.url)

    def submit(self, work: Callable[[Conn], T]) -> asyncio.Future[T]:
        """``work(conn)`` started on the database's threads; its future ends with what
        it returned or raised (``DatabaseUnavailable`` for a database away), however
        long its callers wait."""
        return asyncio.wrap_future(self._threads.submit(self._run, work))

    async def run(self, work: Callable[[Conn], T], timeout: float | None = None) -> T:
        """``work(conn)`` on the database's threads, awaited at most ``timeout`` seconds
        (default ``RUN_TIMEOUT``)."""
        return await self.bounded(self.submit(work), timeout)

    async def bounded(self, done: asyncio.Future[T], timeout: float | None = None) -> T:
        """``done`` (from ``submit``) awaited at most ``timeout`` seconds (default
        ``RUN_TIMEOUT``); the work goes on after a timeout, and its future still tells
        how it ended."""
        timeout = RUN_TIMEOUT if timeout is None else timeout
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(done)
        except TimeoutError:
            raise DatabaseUnavailable(f"the database {self.shown} did not answer within "
                                      f"{timeout:g} s") from None

    def _run(self, work: Callable[[Conn], T]) -> T:
        try:
            done = self._run_retried(work)
        except DatabaseUnavailable:
            self._away = True
            raise
        self._away = False
        return done

    def _run_retried(self, work: Callable[[Conn], T]) -> T:
        run = self._run_postgres if self.postgres else self._run_sqlite
        try:
            return run(work)
        except Exception as err:
            if not self._lost(err):
                raise
            log.warning("database %s: %s; once more on a new connection", self.shown,
                        str(err).strip())
        try:
            return run(work)
        except Exception as err:
            if not self._lost(err):
                raise
            raise DatabaseUnavailable(f"the database {self.shown} is unavailable: "
                                      f"{str(err).strip() or type(err).__name__}") from err

    def _run_postgres(self, work: Callable[[Conn], T]) -> T:
        pool_errors = importlib.import_module("psycopg_pool")
        pool = self._open_pool()
        wait = AWAY_WAIT if self._away else CONNECT_TIMEOUT
        try:
            with pool.connection(timeout=wait) as raw:
                return work(Conn(raw, postgres=True))
        except pool_errors.PoolTimeout as err:  # the pool tried meanwhile: no second wait
            raise DatabaseUnavailable(f"the database {self.shown} is unavailable: no "
                                      f"connection within {wait:g} s") from err

    def _open_pool(self) -> Any:
        with self._opening:
            if self._pool is None:
                # Only where a server is named: SQLite users never import psycopg.
                psycopg_pool = importlib.import_module("psycopg_pool")
                self._pool = psycopg_pool.ConnectionPool(
                    self.url, min_size=1, max_size=POOL_SIZE, open=False,
                    name="modelyard", timeout=CONNECT_TIMEOUT,
                    reconnect_timeout=RECONNECT_FOR,
                    check=psycopg_pool.ConnectionPool.check_connection,
                    configure=self._create_schema,
                    kwargs={"autocommit": True, "connect_timeout": round(CONNECT_TIMEOUT),
                            # a server that went away without a word (its host or the
                            # network) is noticed in about 20 s, not hours
                            "keepalives": 1, "keepalives_idle": 5,
                            "keepalives_interval": 5, "keepalives_count": 3})
                # The pool logs each failed attempt (several a second while the server
                # is away); the ledger and the key refresh say it once per outage.
                logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
                self._pool.open(wait=False)
            return self._pool

    def _create_schema(self, raw: Any) -> None:
        conn = Conn(raw, postgres=self.postgres)
        if not self.postgres:
            for statement in self.schema:
                conn.execute(statement)
            return
        # Two connections creating one table at once collide in PostgreSQL's catalog
        # (IF NOT EXISTS does not hold off a concurrent CREATE): one at a time, across
        # this router's pool and every other router's.
        with raw.transaction():
            raw.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            for statement in self.schema:
                raw.execute(conn.sql(statement))

    def _run_sqlite(self, work: Callable[[Conn], T]) -> T:
        if self._sqlite is None:
            path = Path(self.url.removeprefix("sqlite:///"))
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise DatabaseUnavailable(f"the database {self.shown} is unavailable: "
                                          f"{err}") from err
            raw = sqlite3.connect(path, timeout=SQLITE_BUSY, check_same_thread=False)
            try:
                raw.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer
                self._create_schema(raw)
            except BaseException:
                raw.close()
                raise
            self._sqlite = Conn(raw, postgres=False)
        try:
            return work(self._sqlite)
        except Exception as err:
            if self._lost(err):
                self._sqlite.raw.close()  # reopened by the next statement
                self._sqlite = None
            raise

    def _lost(self, err: Exception) -> bool:
        """Whether ``err`` is of a connection lost or a database away (the others, a
        name taken or a bug, go to the caller as they are)."""
        if isinstance(err, DatabaseUnavailable):
            return False  # decided already (the pool waited its time)
        if self.postgres:
            # The server closed or refused the connection, or did not answer.
            return isinstance(err, importlib.import_module("psycopg").OperationalError)
        # A file that cannot be opened or read, a closed connection, "no such table"
        # after the file was replaced; an integrity error is the caller's.
        return (isinstance(err, sqlite3.DatabaseError)
                and not isinstance(err, sqlite3.IntegrityError))

    def close(self) -> None:
        """Close the connections (the router's shutdown; a statement still running
        ends first)."""
        def shut_sqlite() -> None:
            if self._sqlite is not None:
                self._sqlite.raw.close()
                self._sqlite = None

        if not self.postgres:
            self._threads.submit(shut_sqlite).result()
        self._threads.shutdown(wait=True)
        with self._opening:
            if self._pool is not None:
                self._pool.close(timeout=CONNECT_TIMEOUT)
                self._pool = None

