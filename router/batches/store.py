"""``BatchStore``: uploaded files, batches and their lines in the router's database
(``router.access.database``: SQLite, or PostgreSQL shared by several routers); an uploaded
file's body under the cache dir (``<cache_dir>/files/<id>``).

A batch's lines are copied into the database when it is made, each with its state
(``pending`` until it has run, then ``succeeded``, ``errored``, ``canceled`` or
``expired``) and, once it has one, its result: the line of the output or error file, as
text. A line's result is written once, by an update of a ``pending`` line only, so a
line that ran twice (its router died before it wrote) is answered once; output and error
files are those rows in line order, made when they are read: every ``custom_id`` once,
whatever restarts happened on the way.

A batch is run by one router at a time: the one whose lease (``runner``,
``lease_until``) is current. A router takes free batches and those whose lease ran out
(``claim``), and renews its own while it runs them.

Every row has an owner, the name of the key that made it; the API asks with the caller's
name (``None``: an admin, who sees all), so another key's id is not found.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.access.database import Conn, Database
from router.access.ledger import INSERT as USAGE_INSERT
from router.access.ledger import Row as UsageRow

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
"""Statuses of a batch that still has a runner's work to do."""
LINE_STATES = ("succeeded", "errored", "canceled", "expired")
"""What a line can end as (``pending`` before): Anthropic's result types, whose counts
both shapes report."""

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS files (
        id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL,
        filename TEXT NOT NULL, bytes BIGINTEGER NOT NULL, created DOUBLE NOT NULL,
        batch TEXT, kind TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS files_owner ON files (owner, created)",
    """CREATE TABLE IF NOT EXISTS batches (
        id TEXT PRIMARY KEY, owner TEXT NOT NULL, shape TEXT NOT NULL,
        endpoint TEXT NOT NULL, input_file TEXT, completion_window TEXT NOT NULL,
        status TEXT NOT NULL, created DOUBLE NOT NULL, expires DOUBLE NOT NULL,
        times TEXT NOT NULL, metadata TEXT, errors TEXT,
        output_file TEXT, error_file TEXT, total INTEGER NOT NULL,
        succeeded INTEGER NOT NULL, errored INTEGER NOT NULL, canceled INTEGER NOT NULL,
        expired INTEGER NOT NULL, runner TEXT, lease_until DOUBLE)""",
    "CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner, created)",
    "CREATE INDEX IF NOT EXISTS batches_status ON batches (status)",
    """CREATE TABLE IF NOT EXISTS batch_lines (
        batch TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL,
        model TEXT NOT NULL, body TEXT NOT NULL, state TEXT NOT NULL, result TEXT,
        PRIMARY KEY (batch, line))""",
    # What a batch stores, counted against its owner's files quota, and the create's
    # Idempotency-Key. A table of its own (not new columns of ``batches``), so a database
    # made before it only gains a table: batches made before it count nothing.
    """CREATE TABLE IF NOT EXISTS batch_stored (
        batch TEXT PRIMARY KEY, owner TEXT NOT NULL, bytes BIGINTEGER NOT NULL,
        idempotency_key TEXT)""",
    "CREATE INDEX IF NOT EXISTS batch_stored_owner ON batch_stored (owner)",
    ("CREATE UNIQUE INDEX IF NOT EXISTS batch_stored_idempotency ON batch_stored "
    "(owner, idempotency_key)"),
    # The runner pages a batch's pending lines model by model, in line order
    # (``pending_models``, ``pending_page``): this index is that order.
    "CREATE INDEX IF NOT EXISTS batch_lines_pending ON batch_lines (batch, state, model, line)",
)
PAGE_LINES = 256
"""Lines read at once: what a runner holds of a batch (``pending_page``) and what a read of
its results holds (``result_pages``), whatever the batch's size."""

_BATCH_COLUMNS = ("id", "owner", "shape", "endpoint", "input_file", "completion_window",
                  "status", "created", "expires", "times", "metadata", "errors",
                  "output_file", "error_file", "total", "succeeded", "errored", "canceled",
                  "expired")
_FILE_COLUMNS = ("id", "owner", "purpose", "filename", "bytes", "created", "batch", "kind")


_LINE_INSERT = ("INSERT INTO batch_lines (batch, line, custom_id, model, body, state, result) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)")


def new_id(prefix: str) -> str:
    """A random id (never guessable: it opens the object, for its owner)."""
    return prefix + secrets.token_hex(12)


@dataclass
class FileRow:
    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    created: float
    batch: str | None = None
    kind: str = "upload"
    """``upload`` (a body on disk), ``output`` or ``error`` (a batch's lines)."""


@dataclass
class BatchRow:
    id: str
    owner: str
    shape: str
    """``openai`` or ``anthropic``: which API made it (and shapes it)."""
    endpoint: str
    input_file: str | None
    completion_window: str
    status: str
    created: float
    expires: float
    times: dict[str, float] = field(default_factory=dict)
    """When it reached each status after ``validating`` (``in_progress``, ...)."""
    metadata: dict[str, Any] | None = None
    errors: list[dict[str, Any]] | None = None
    output_file: str | None = None
    error_file: str | None = None
    total: int = 0
    succeeded: int = 0
    errored: int = 0
    canceled: int = 0
    expired: int = 0

    @property
    def done(self) -> int:
        return self.succeeded + self.errored + self.canceled + self.expired

    def values(self) -> tuple[Any, ...]:
        return (self.id, self.owner, self.shape, self.endpoint, self.input_file,
                self.completion_window, self.status, self.created, self.expires,
                json.dumps(self.times), _dumps(self.metadata), _dumps(self.errors),
                self.output_file, self.error_file, self.total, self.succeeded, self.errored,
                self.canceled, self.expired)

    @classmethod
    def of(cls, row: Sequence[Any]) -> BatchRow:
        values = dict(zip(_BATCH_COLUMNS, row, strict=True))
        values["times"] = json.loads(values["times"])
        values["metadata"] = _loads(values["metadata"])
        values["errors"] = _loads(values["errors"])
        values["input_file"] = values["input_file"]
        return cls(**values)


@dataclass
class Line:
    """A line of a batch as it is stored: its request (``body``, the JSON text) for the
    model ``model`` (its resolved id), and, once it ran, its ``state`` and ``result``."""

    line: int
    custom_id: str
    model: str
    body: str
    state: str = "pending"
    result: str | None = None


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _owned(owner: str | None) -> tuple[str, tuple[Any, ...]]:
    return ("", ()) if owner is None else (" AND owner = ?", (owner,))


class QuotaExceeded(Exception):
    """An upload or a batch past its key's ``files_quota_mib``."""


class TooManyBatches(Exception):
    """A batch past its key's ``batches_per_key`` in flight."""


CHUNK = 1000
"""Lines written to the database in one statement while a batch is made: its lines are
read from their source as they are written, never all held at once."""


def _stored_bytes(line: Line) -> int:
    return len(line.custom_id) + len(line.body) + len(line.result or "")


def _owner_lock(conn: Conn, owner: str) -> None:
    """Hold ``owner``'s quota lock until the transaction ends: PostgreSQL's READ
    COMMITTED would let two routers' check-and-insert pass the quota together. SQLite's
    one connection (one thread) runs them one at a time already."""
    if conn.postgres:
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(?))", (f"files:{owner}",))


def _held(conn: Conn, owner: str) -> int:
    """Bytes ``owner``'s quota holds: its uploads and what its batches stored."""
    rows = conn.execute(
        "SELECT (SELECT COALESCE(SUM(bytes), 0) FROM files WHERE owner = ? AND "
        "kind = 'upload') + (SELECT COALESCE(SUM(bytes), 0) FROM batch_stored WHERE "
        "owner = ?)", (owner, owner))
    return int(rows[0][0])


class BatchStore:
    """Files and batches in ``db``; upload bodies under ``folder``."""

    page_lines = PAGE_LINES
    """Lines a read of a batch's lines returns at most (``pending_page``,
    ``result_pages``)."""

    def __init__(self, db: Database, folder: Path, quota_bytes: int) -> None:
        self.db = db
        self.folder = folder
        self.quota_bytes = quota_bytes

    # -- files -----------------------------------------------------------------------

    def body_path(self, file_id: str) -> Path:
        return self.folder / file_id

    async def add_file(self, owner: str, filename: str, purpose: str,
                       spool: Path) -> FileRow:
        """Keep the upload ``spool`` (a temporary file in ``folder``, moved into place) as
        ``owner``'s file, unless it would take the key past its quota."""
        size = spool.stat().st_size
        row = FileRow(new_id("file-"), owner, purpose, filename, size, time.time())

        def add(conn: Conn) -> None:
            with conn.atomic():  # the check and the insert, one at a time per owner
                _owner_lock(conn, owner)
                held = _held(conn, owner)
                if held + size > self.quota_bytes:
                    raise QuotaExceeded(f"{held} bytes stored already")
                conn.execute(f"INSERT INTO files ({', '.join(_FILE_COLUMNS)}) VALUES "
                             f"({', '.join('?' for _ in _FILE_COLUMNS)})",
                             (row.id, owner, purpose, filename, size, row.created, None,
                              "upload"))
                os.replace(spool, self.body_path(row.id))  # last: a failed insert keeps none

        await self.db.run(add)
        return row

    async def held(self, owner: str) -> int:
        """Bytes of ``owner``'s files quota taken: its uploads and its batches' lines."""
        return await self.db.run(lambda c: _held(c, owner))

    def clear_spools(self) -> int:
        """Remove the upload spools (``.upload-*``) a router killed mid-upload left
        behind; how many. A spool is locked while its upload runs (the lock goes with its
        process, kill -9 too), so another router's upload in the same folder is left."""
        gone = 0
        for path in self.folder.glob(".upload-*"):
            try:
                with path.open("rb") as handle:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    path.unlink(missing_ok=True)
            except OSError:  # locked (an upload runs) or gone meanwhile
                continue
            gone += 1
        return gone

    async def file(self, file_id: str, owner: str | None) -> FileRow | None:
        where, args = _owned(owner)
        rows = await self.db.run(lambda c: c.execute(
            f"SELECT {', '.join(_FILE_COLUMNS)} FROM files WHERE id = ?{where}",
            (file_id, *args)))
        return FileRow(*rows[0]) if rows else None

    async def files(self, owner: str | None, purpose: str | None, after: str | None,
                    limit: int, newest_first: bool) -> list[FileRow]:
        """A page of files: ``limit`` + 1 rows, so the caller knows whether more follow."""
        where, args = _owned(owner)
        if purpose:
            where, args = where + " AND purpose = ?", (*args, purpose)
        order = "DESC" if newest_first else "ASC"
        if after:
            where += (f" AND (created, id) {'<' if newest_first else '>'} "
                      "(SELECT created, id FROM files WHERE id = ?)")
            args = (*args, after)
        rows = await self.db.run(lambda c: c.execute(
            f"SELECT {', '.join(_FILE_COLUMNS)} FROM files WHERE 1 = 1{where} "
            f"ORDER BY created {order}, id {order} LIMIT ?", (*args, limit + 1)))
        return [FileRow(*r) for r in rows]

    async def delete_file(self, file_id: str, owner: str | None) -> bool:
        where, args = _owned(owner)
        gone = await self.db.run(lambda c: c.execute(
            f"DELETE FROM files WHERE id = ?{where} RETURNING kind", (file_id, *args)))
        if gone and gone[0][0] == "upload":
            self.body_path(file_id).unlink(missing_ok=True)
        return bool(gone)

    async def result_pages(self, batch_id: str, states: Sequence[str]
                           ) -> AsyncGenerator[list[str], None]:
        """The result lines of ``batch_id``'s lines in ``states``, in line order, a page
        (``page_lines``) at a time (each page one read off the event loop): a results file of any size is
        sent without being held whole."""
        marks = ", ".join("?" for _ in states)
        sql = (f"SELECT line, result FROM batch_lines WHERE batch = ? AND line > ? AND "
               f"state IN ({marks}) ORDER BY line LIMIT ?")
        after, size = -1, self.page_lines
        while True:
            args = (batch_id, after, *states, size)
            rows = await self.db.run(lambda c, args=args: c.execute(sql, args))  # type: ignore[misc]
            if not rows:
                return
            yield [r[1] for r in rows]
            if len(rows) < size:
                return
            after = rows[-1][0]

    async def result_body(self, batch_id: str, states: Sequence[str]
                          ) -> AsyncIterator[bytes]:
        """``result_pages`` as the bytes of a JSONL file. The first page is read here,
        before any answer begins (the database away: a 503, not a cut file); the rest as
        the client takes them."""
        pages = self.result_pages(batch_id, states)
        try:
            first: list[str] = await anext(pages, [])
        except BaseException:
            await pages.aclose()
            raise

        async def body() -> AsyncIterator[bytes]:
            try:
                if first:
                    yield "".join(f"{ln}\n" for ln in first).encode()
                async for page in pages:
                    yield "".join(f"{ln}\n" for ln in page).encode()
            finally:
                await pages.aclose()

        return body()

    # -- batches ---------------------------------------------------------------------

    async def add_batch(self, batch: BatchRow, lines: Sequence[Line]) -> None:
        """``batch`` and its lines, in one transaction."""
        def add(conn: Conn) -> None:
            with conn.atomic():
                conn.execute(f"INSERT INTO batches ({', '.join(_BATCH_COLUMNS)}) VALUES "
                             f"({', '.join('?' for _ in _BATCH_COLUMNS)})", batch.values())
                conn.many("INSERT INTO batch_lines (batch, line, custom_id, model, body, "
                          "state, result) VALUES (?, ?, ?, ?, ?, ?, ?)",
                          [(batch.id, ln.line, ln.custom_id, ln.model, ln.body, ln.state,
                            ln.result) for ln in lines])

        await self.db.run(add)

    async def add_batch_checked(self, batch: BatchRow, lines: Callable[[], Iterable[Line]],
                                max_in_flight: int, idempotency_key: str | None = None
                                ) -> BatchRow:
        """``batch`` and its ``lines`` (read as they are written, ``CHUNK`` at a time, on
        the database's thread; ``total`` and ``errored`` counted from them) in one
        transaction, unless: its owner has ``max_in_flight`` batches in flight already
        (``TooManyBatches``), or what they store would take the owner past its files
        quota (``QuotaExceeded``). With an ``idempotency_key`` the owner used before, the
        batch made then, and nothing new."""
        owner = batch.owner

        def add(conn: Conn) -> BatchRow:
            with conn.atomic():
                _owner_lock(conn, owner)
                if idempotency_key is not None:
                    made = conn.execute(
                        f"SELECT {', '.join('b.' + c for c in _BATCH_COLUMNS)} FROM "
                        "batch_stored s JOIN batches b ON b.id = s.batch WHERE "
                        "s.owner = ? AND s.idempotency_key = ?", (owner, idempotency_key))
                    if made:
                        return BatchRow.of(made[0])
                in_flight = int(conn.execute(
                    f"SELECT COUNT(*) FROM batches WHERE owner = ? AND status IN "
                    f"({', '.join('?' for _ in ACTIVE)})", (owner, *ACTIVE))[0][0])
                if in_flight >= max_in_flight:
                    raise TooManyBatches(f"{in_flight} batches in flight")
                room = self.quota_bytes - _held(conn, owner)
                stored = total = errored = 0
                chunk: list[tuple[Any, ...]] = []
                for ln in lines():
                    total += 1
                    errored += ln.state == "errored"
                    stored += _stored_bytes(ln)
                    if stored > room:  # stop reading at once: the rest is not stored
                        raise QuotaExceeded(f"{self.quota_bytes - room} bytes stored already")
                    chunk.append((batch.id, ln.line, ln.custom_id, ln.model, ln.body,
                                  ln.state, ln.result))
                    if len(chunk) >= CHUNK:
                        conn.many(_LINE_INSERT, chunk)
                        chunk = []
                if chunk:
                    conn.many(_LINE_INSERT, chunk)
                batch.total, batch.errored = total, errored
                conn.execute(f"INSERT INTO batches ({', '.join(_BATCH_COLUMNS)}) VALUES "
                             f"({', '.join('?' for _ in _BATCH_COLUMNS)})", batch.values())
                conn.execute("INSERT INTO batch_stored (batch, owner, bytes, idempotency_key) "
                             "VALUES (?, ?, ?, ?)", (batch.id, owner, stored, idempotency_key))
                return batch

        return await self.db.run(add)

    async def batch(self, batch_id: str, owner: str | None) -> BatchRow | None:
        where, args = _owned(owner)
        rows = await self.db.run(lambda c: c.execute(
            f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches WHERE id = ?{where}",
            (batch_id, *args)))
        return BatchRow.of(rows[0]) if rows else None

    async def batches(self, owner: str | None, shape: str | None, after: str | None,
                      before: str | None, limit: int) -> list[BatchRow]:
        """A page, newest first: ``limit`` + 1 rows, so the caller knows whether more
        follow. ``after``: older than that id; ``before``: newer (then oldest first)."""
        where, args = _owned(owner)
        if shape:
            where, args = where + " AND shape = ?", (*args, shape)
        order = "DESC"
        if after:
            where += " AND (created, id) < (SELECT created, id FROM batches WHERE id = ?)"
            args = (*args, after)
        elif before:
            where += " AND (created, id) > (SELECT created, id FROM batches WHERE id = ?)"
            args, order = (*args, before), "ASC"
        rows = await self.db.run(lambda c: c.execute(
            f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches WHERE 1 = 1{where} "
            f"ORDER BY created {order}, id {order} LIMIT ?", (*args, limit + 1)))
        return [BatchRow.of(r) for r in rows]

    async def request_cancel(self, batch_id: str, owner: str | None) -> BatchRow | None:
        """Mark an unfinished batch ``cancelling`` (its runner cancels it); the batch as it
        is then, or ``None`` where there is none of ``owner``'s."""
        where, args = _owned(owner)
        now = time.time()

        def cancel(conn: Conn) -> list[Any]:
            rows = conn.execute(f"SELECT times FROM batches WHERE id = ?{where} AND status "
                                "IN ('validating', 'in_progress')", (batch_id, *args))
            if rows:
                times = {**json.loads(rows[0][0]), "cancelling": now}
                conn.execute("UPDATE batches SET status = 'cancelling', times = ? WHERE id = ? "
                             "AND status IN ('validating', 'in_progress')",
                             (json.dumps(times), batch_id))
            return conn.execute(f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches WHERE "
                                f"id = ?{where}", (batch_id, *args))

        rows = await self.db.run(cancel)
        return BatchRow.of(rows[0]) if rows else None

    async def delete_batch(self, batch_id: str, owner: str | None) -> bool:
        """Remove an ended batch, its lines and its result files."""
        where, args = _owned(owner)

        def delete(conn: Conn) -> bool:
            gone = conn.execute(f"DELETE FROM batches WHERE id = ?{where} AND status NOT IN "
                                f"({', '.join('?' for _ in ACTIVE)}) RETURNING id",
                                (batch_id, *args, *ACTIVE))
            if gone:
                conn.execute("DELETE FROM batch_lines WHERE batch = ?", (batch_id,))
                conn.execute("DELETE FROM batch_stored WHERE batch = ?", (batch_id,))
                conn.execute("DELETE FROM files WHERE batch = ?", (batch_id,))
            return bool(gone)

        return await self.db.run(delete)

    # -- what a runner does ----------------------------------------------------------

    async def claim(self, runner: str, lease: float) -> list[BatchRow]:
        """Take every active batch that no other runner's current lease holds, renewing
        ``runner``'s own; the batches ``runner`` now holds, oldest first."""
        now = time.time()
        marks = ", ".join("?" for _ in ACTIVE)

        def claim(conn: Conn) -> list[Any]:
            conn.execute(f"UPDATE batches SET runner = ?, lease_until = ? WHERE status IN "
                         f"({marks}) AND (runner IS NULL OR runner = ? OR lease_until < ?)",
                         (runner, now + lease, *ACTIVE, runner, now))
            return conn.execute(f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches WHERE "
                                f"runner = ? AND status IN ({marks}) ORDER BY created, id",
                                (runner, *ACTIVE))

        return [BatchRow.of(r) for r in await self.db.run(claim)]

    async def release(self, runner: str) -> None:
        """Let go of ``runner``'s leases (a clean shutdown: another router may go on)."""
        await self.db.run(lambda c: c.execute(
            "UPDATE batches SET runner = NULL, lease_until = NULL WHERE runner = ?",
            (runner,)))

    async def pending_models(self, batch_id: str) -> list[tuple[str, int]]:
        """The models ``batch_id``'s pending lines name, each with its first such line."""
        rows = await self.db.run(lambda c: c.execute(
            "SELECT model, MIN(line) FROM batch_lines WHERE batch = ? AND state = 'pending' "
            "GROUP BY model", (batch_id,)))
        return [(str(r[0]), int(r[1])) for r in rows]

    async def pending_page(self, batch_id: str, models: Sequence[str] | None,
                           after: int) -> list[Line]:
        """At most ``page_lines`` of ``batch_id``'s pending lines after line ``after``, of
        the models ``models`` (``None``: any), in line order."""
        args = tuple(models or ())
        where = "" if models is None else f" AND model IN ({', '.join('?' for _ in args)})"
        rows = await self.db.run(lambda c: c.execute(
            "SELECT line, custom_id, model, body FROM batch_lines WHERE batch = ? AND "
            f"state = 'pending'{where} AND line > ? ORDER BY line LIMIT ?",
            (batch_id, *args, after, self.page_lines)))
        return [Line(*r) for r in rows]

    async def finish(self, batch_id: str, runner: str, done: Sequence[Line],
                     usage: Mapping[int, Sequence[UsageRow]] | None = None) -> int:
        """Write the results of ``done`` (lines still pending only) and count them in
        the batch, in one transaction, if ``runner`` still holds the batch; the lines
        written. ``usage``: each line's ledger rows (``Ledger.hold``), written in the same
        transaction for the lines written only: a line's run is charged if and only if
        its result is the one kept."""
        usage = usage or {}

        def finish(conn: Conn) -> int:
            with conn.atomic():
                if not conn.execute("SELECT 1 FROM batches WHERE id = ? AND runner = ?",
                                    (batch_id, runner)):
                    return 0  # taken over (its lease ran out): the new runner writes
                counts = dict.fromkeys(LINE_STATES, 0)
                stored = 0
                for ln in done:
                    if conn.execute("UPDATE batch_lines SET state = ?, result = ? WHERE "
                                    "batch = ? AND line = ? AND state = 'pending' "
                                    "RETURNING line", (ln.state, ln.result, batch_id, ln.line)):
                        counts[ln.state] += 1
                        stored += len((ln.result or "").encode())
                        if usage.get(ln.line):
                            conn.many(USAGE_INSERT, usage[ln.line])
                # Results are stored bytes of the owner's too: its files quota counts them
                # (a batch made before ``batch_stored`` has no row, and counts nothing).
                conn.execute("UPDATE batch_stored SET bytes = bytes + ? WHERE batch = ?",
                             (stored, batch_id))
                conn.execute("UPDATE batches SET " + ", ".join(
                    f"{state} = {state} + ?" for state in LINE_STATES) + " WHERE id = ?",
                    (*counts.values(), batch_id))
                return sum(counts.values())

        return await self.db.run(finish)

    async def set_status(self, batch: BatchRow, status: str, runner: str,
                         **files: str | None) -> None:
        """Move ``batch`` to ``status`` (and name its result files), if ``runner`` still
        holds it."""
        batch.status = status
        batch.times[status] = time.time()
        for name, value in files.items():
            setattr(batch, name, value)
        await self.db.run(lambda c: c.execute(
            "UPDATE batches SET status = ?, times = ?, output_file = ?, error_file = ?, "
            "errors = ? WHERE id = ? AND runner = ?",
            (status, json.dumps(batch.times), batch.output_file, batch.error_file,
             _dumps(batch.errors), batch.id, runner)))

    async def add_result_file(self, batch: BatchRow, kind: str, states: Sequence[str],
                              filename: str) -> str | None:
        """A file of ``batch``'s result lines in ``states`` (none: no file); its id."""
        marks = ", ".join("?" for _ in states)
        rows = await self.db.run(lambda c: c.execute(
            f"SELECT COUNT(*), COALESCE(SUM(LENGTH(result)), 0) FROM batch_lines WHERE "
            f"batch = ? AND state IN ({marks})", (batch.id, *states)))
        count, size = int(rows[0][0]), int(rows[0][1])
        if not count:
            return None
        file_id = new_id("file-")
        row = (file_id, batch.owner, "batch_output", filename, size + count, time.time(),
               batch.id, kind)
        await self.db.run(lambda c: c.execute(
            f"INSERT INTO files ({', '.join(_FILE_COLUMNS)}) VALUES "
            f"({', '.join('?' for _ in _FILE_COLUMNS)})", row))
        return file_id
