"""``Database``: the router's own tables (named keys; next, the usage ledger) in SQLite
(the standard library's, WAL) or PostgreSQL (psycopg 3), where several routers share
them.

One connection, on one thread of its own: the event loop never waits on a query, and
the loop's default executor (which the supervisor reaps workers with) is never taken.
SQL is written once with ``?`` placeholders and the column types ``DOUBLE`` and
``BIGINTEGER``; for PostgreSQL the placeholders become ``%s`` and the types their
PostgreSQL names. Each module that keeps a table declares it (``key_store.SCHEMA``,
``ledger.SCHEMA``); the database creates what it is given, where missing, on connecting.
"""

from __future__ import annotations

import asyncio
import importlib
import re
import sqlite3
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
Row = tuple[Any, ...]

_PG_TYPES = (("DOUBLE", "DOUBLE PRECISION"), ("BIGINTEGER", "BIGINT"))
_SQLITE_TYPES = (("DOUBLE", "REAL"), ("BIGINTEGER", "INTEGER"))


def default_url(cache_dir: str | None) -> str:
    """SQLite under the cache dir (``server.cache_dir``, else ``~/.cache/modelyard``)."""
    from worker.materialize import default_cache_dir  # no vLLM import: a path helper

    base = Path(cache_dir) if cache_dir else default_cache_dir()
    return f"sqlite:///{base / 'modelyard.db'}"


class Conn:
    """A connection as the thread that owns it uses it: ``execute`` commits at once;
    ``many`` runs one statement over many rows in one transaction."""

    def __init__(self, raw: Any, postgres: bool) -> None:
        self.raw = raw
        self.postgres = postgres

    def sql(self, text: str) -> str:
        for ours, theirs in (_PG_TYPES if self.postgres else _SQLITE_TYPES):
            text = text.replace(ours, theirs)
        return text.replace("?", "%s") if self.postgres else text

    def execute(self, text: str, params: Sequence[Any] = ()) -> list[Row]:
        cursor = self.raw.execute(self.sql(text), tuple(params))
        rows = list(cursor.fetchall()) if cursor.description else []
        if not self.postgres:
            self.raw.commit()
        return rows

    def many(self, text: str, rows: Sequence[Sequence[Any]]) -> None:
        if self.postgres:
            with self.raw.transaction(), self.raw.cursor() as cursor:
                cursor.executemany(self.sql(text), rows)
        else:
            with self.raw:  # one transaction
                self.raw.executemany(self.sql(text), rows)


class Database:
    """``url``: ``sqlite:///path`` or ``postgresql://...``. Opened on first use, on its
    thread; the tables of ``schema`` are created there where missing."""

    def __init__(self, url: str, schema: Sequence[str] = ()) -> None:
        self.url = url
        self.schema = schema
        self.postgres = url.startswith(("postgresql://", "postgres://"))
        if not self.postgres and not url.startswith("sqlite:///"):
            raise ValueError(f"database_url {url!r}: not sqlite:///PATH or postgresql://...")
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="modelyard-db")
        self._conn: Conn | None = None

    @property
    def shown(self) -> str:
        """The URL for logs: a password in it is replaced by ``***``."""
        return re.sub(r"(://[^:/@]*:)[^/]*@", r"\1***@", self.url)

    def _connect(self) -> Conn:
        if self.postgres:
            psycopg = importlib.import_module("psycopg")  # only where a server is named
            conn = Conn(psycopg.connect(self.url, autocommit=True), postgres=True)
        else:
            path = Path(self.url.removeprefix("sqlite:///"))
            path.parent.mkdir(parents=True, exist_ok=True)
            raw = sqlite3.connect(path, timeout=30, check_same_thread=False)
            raw.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer
            conn = Conn(raw, postgres=False)
        for statement in self.schema:
            conn.execute(statement)
        return conn

    async def run(self, work: Callable[[Conn], T]) -> T:
        """``work(conn)`` on the database's thread, awaited."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._run, work)

    def _run(self, work: Callable[[Conn], T]) -> T:
        if self._conn is None:
            self._conn = self._connect()
        return work(self._conn)

    def close(self) -> None:
        def shut(_: Conn) -> None:
            if self._conn is not None:
                self._conn.raw.close()
                self._conn = None

        if self._conn is not None:
            self._thread.submit(shut, self._conn).result()
        self._thread.shutdown(wait=True)
