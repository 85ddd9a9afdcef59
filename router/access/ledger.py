"""``Ledger``: one row per finished request in the router's database (``usage``).

A request's row (time, key name, model id, endpoint, status, prompt/cached/completion
tokens, seconds) is appended to a bounded queue on the event loop, nothing more: a task
writes what the queue holds every ``FLUSH_EVERY`` seconds (sooner once ``FLUSH_ROWS``
wait), in one transaction on the database's own thread, and once more at shutdown. So a
SIGTERM loses nothing and a kill -9 at most the last second's rows. While the database is
away (``DatabaseUnavailable``) the rows stay queued and the next flush after it returns
writes them, each once: a batch leaves the queue while it is written and comes back to
its front only if its write failed. No row is ever dropped: a row dropped is spend the
database never sees, which a key with a budget could spend again once it returns. The
queue is bounded instead by what it admits: once ``QUEUE_MAX`` rows wait (``full``: the
database away for minutes), budgets admit no request of a key with a budget
(``router.access.budgets.LedgerFull``, a 503) until the queue drains; requests of keys
without one go on and their rows are kept all the same, counted (``overflow``) and logged
(about 200 bytes a row: a million of them, 200 MB).

Budgets (``router.access.budgets``) read the sums and see each row as it is recorded
(``on_record``).

A batch line's rows are not queued: they are held with the line (``hold``, ``BATCH_LINE``)
until its result is written, and written in the same transaction
(``router.batches.store.BatchStore.finish``), so a line run again after a kill -9 (its
result was never written) is charged once: for the run whose result counts.
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import contextvars
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from router.access.database import Conn, Database

log = logging.getLogger("modelyard.router")

FLUSH_EVERY = 1.0
FLUSH_ROWS = 2_000
QUEUE_MAX = 200_000
"""Rows waiting (queued or being written) past which no budgeted request is admitted."""

Row = tuple[float, str, str, str, int, int, int, int, float]
COLUMNS = ("time", "key", "model", "endpoint", "status", "prompt_tokens", "cached_tokens",
           "completion_tokens", "seconds")
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS usage (
        time DOUBLE NOT NULL, key TEXT NOT NULL, model TEXT NOT NULL,
        endpoint TEXT NOT NULL, status INTEGER NOT NULL,
        prompt_tokens BIGINTEGER NOT NULL, cached_tokens BIGINTEGER NOT NULL,
        completion_tokens BIGINTEGER NOT NULL, seconds DOUBLE NOT NULL)""",
    # One index: a key's spending and usage are read by key and time. Queries over every
    # key scan the table (a month of a busy router: a few hundred ms), and writes, which
    # every request makes, keep one index instead of two (1.7 against 2.3 us a row).
    "CREATE INDEX IF NOT EXISTS usage_key_time ON usage (key, time)",
)
BATCH_LINE: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "modelyard_batch_line", default=None)
"""The batch line (batch id, line) a task runs, if any: set by the batch runner in the
line's own task, read by ``Ledger.record`` (the relay logs in that task, or in a callback
it schedules, which carries the task's context)."""
GROUPS = ("key", "model", "endpoint", "day")
INSERT = (f"INSERT INTO usage ({', '.join(COLUMNS)}) "
          f"VALUES ({', '.join('?' for _ in COLUMNS)})")


def period_bounds(period: str, now: float) -> tuple[float, float]:
    """The UTC calendar ``period`` (day, week from Monday, month) around ``now``."""
    today = datetime.fromtimestamp(now, UTC).replace(hour=0, minute=0, second=0,
                                                     microsecond=0)
    if period == "day":
        start, end = today, today + timedelta(days=1)
    elif period == "week":
        start = today - timedelta(days=today.weekday())
        end = start + timedelta(days=7)
    else:
        start = today.replace(day=1)
        end = start + timedelta(days=calendar.monthrange(start.year, start.month)[1])
    return start.timestamp(), end.timestamp()


class Ledger:
    """The ``usage`` table of ``db``: ``record`` per request, ``flush``, ``query``."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._queue: deque[Row] = deque()
        self._wake = asyncio.Event()
        self.overflow = 0
        """Rows recorded while ``QUEUE_MAX`` already waited (kept, not dropped)."""
        self.written = 0
        self._writer: asyncio.Task[None] | None = None
        self._flushing = asyncio.Lock()
        self._writing: list[list[Row]] = []
        """Batches being written (out of the queue, not yet known to be committed)."""
        self.on_record: Callable[[float, str, str, int], None] | None = None
        """Called with each row's (time, key, model, prompt+completion tokens) as it is
        queued (``router.access.budgets``)."""
        self._held: dict[tuple[str, int], list[Row]] = {}
        """Rows of batch lines whose results are not written yet (``hold``)."""

    def start(self) -> None:
        self._writer = asyncio.create_task(self._write(), name="ledger")

    def record(self, key: str, model: str, endpoint: str, status: int, prompt: int,
               cached: int, completion: int, seconds: float) -> None:
        """Queue one request's row (the event loop does nothing more)."""
        now = time.time()
        row = (now, key, model, endpoint, status, prompt, cached, completion, round(seconds, 4))
        if self.on_record is not None:
            self.on_record(now, key, model, prompt + completion)
        line = BATCH_LINE.get() if self._held else None
        held = self._held.get(line) if line is not None else None
        if held is not None:  # a batch line's: written with its result (``hold``)
            held.append(row)
            return
        if len(self._queue) >= QUEUE_MAX:
            self._overflowed()
        self._queue.append(row)
        if len(self._queue) >= FLUSH_ROWS:
            self._wake.set()

    def hold(self, batch: str, line: int) -> None:
        """A run of ``batch``'s ``line`` begins: the rows it records (``BATCH_LINE``) are
        held, not queued, until its result is written with them (``held``, ``let_go``).
        An earlier run's rows, never written, go: only the run whose result counts is
        charged."""
        self._held[(batch, line)] = []

    def held(self, batch: str, line: int) -> list[Row]:
        """The rows held for ``batch``'s ``line`` (to be written with its result)."""
        return self._held.get((batch, line), [])

    def let_go(self, batch: str, line: int) -> None:
        """``batch``'s ``line`` has its result written (and its rows with it, or another
        run's were): its rows are no longer held."""
        self._held.pop((batch, line), None)

    def let_go_batch(self, batch: str) -> None:
        """Whatever ``batch``'s lines still hold here (lines cut short and left pending,
        or written by another runner) is let go: run again, they are charged then."""
        for held in [k for k in self._held if k[0] == batch]:
            del self._held[held]

    async def _write(self) -> None:
        away = False
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FLUSH_EVERY):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
            except Exception as err:  # noqa: BLE001  # either driver's, or unavailable: the rows wait
                if not away:  # once per outage, not once a second
                    log.warning("usage ledger: cannot write to %s (rows wait in memory): %s",
                                self.db.shown, err)
                away = True
            else:
                if away:
                    log.warning("usage ledger: %s answers again; queued rows written",
                                self.db.shown)
                away = False

    async def flush(self) -> None:
        """Write every queued row (one transaction). The rows leave the queue while they
        are written: a row recorded meanwhile waits for the next flush, and a failed
        write puts its rows back in front (``_settle``), so a row is written once
        however long its caller waits. Raises what the write raised (the rows are
        queued again) or, past the database's wait, ``DatabaseUnavailable`` (the rows
        are still being written, and settle when that ends)."""
        async with self._flushing:
            if not self._queue:
                return
            rows = list(self._queue)
            self._queue.clear()
            self._writing.append(rows)
            done = self.db.submit(lambda conn: conn.many(INSERT, rows))
            done.add_done_callback(functools.partial(self._settle, rows))
            await self.db.bounded(done)

    def _settle(self, rows: list[Row], done: asyncio.Future[None]) -> None:
        """A batch's write has ended (on the event loop, before its flush resumes)."""
        self._writing.remove(rows)
        if not done.cancelled() and done.exception() is None:
            self.written += len(rows)
            return
        self._queue.extendleft(reversed(rows))  # oldest first, as they were

    @property
    def unwritten(self) -> int:
        """Rows not yet committed: queued, or being written."""
        return len(self._queue) + sum(len(batch) for batch in self._writing)

    @property
    def full(self) -> bool:
        """Whether ``QUEUE_MAX`` rows wait: no budgeted request is admitted until fewer do."""
        return self.unwritten >= QUEUE_MAX

    def _overflowed(self) -> None:
        self.overflow += 1
        if self.overflow in (1, 1000) or self.overflow % 100_000 == 0:
            log.error("usage ledger: %d row(s) wait for the database: keys with a budget "
                      "are refused until it takes them; %d row(s) recorded past the bound "
                      "(kept)", len(self._queue), self.overflow)

    async def close(self) -> None:
        """Stop the writer and write what is left (the router's shutdown)."""
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        try:
            await self.flush()
        except Exception as err:  # noqa: BLE001  # either driver's
            log.error("usage ledger: %d row(s) not written at shutdown: %s",
                      len(self._queue), err)

    async def query(self, group_by: Sequence[str], start: float, end: float,
                    key: str | None = None, models: Sequence[str] | None = None
                    ) -> list[dict[str, Any]]:
        """Sums per group (of ``GROUPS``) of the rows in [start, end), of ``key`` only
        when given, of the model ids ``models`` only when given. Rows still queued are
        written first."""
        await self.flush()
        return await self.db.run(lambda conn: _sums(conn, group_by, start, end, key, models))

    def unwritten_since(self) -> float | None:
        """The time of the oldest row not yet committed (queued, or being written); None
        when every row is. Every row before it is in the database."""
        oldest = [batch[0][0] for batch in self._writing] + (
            [self._queue[0][0]] if self._queue else []) + [
            rows[0][0] for rows in self._held.values() if rows]
        return min(oldest) if oldest else None


def _day(conn: Conn) -> str:
    if conn.postgres:
        return "to_char(to_timestamp(time) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"
    return "strftime('%Y-%m-%d', time, 'unixepoch')"


def _sums(conn: Conn, group_by: Sequence[str], start: float, end: float,
          key: str | None, models: Sequence[str] | None = None) -> list[dict[str, Any]]:
    columns = [(_day(conn) if g == "day" else g) for g in group_by]
    select = [f"{c} AS {g}" for c, g in zip(columns, group_by, strict=True)]
    where = "time >= ? AND time < ?" + (" AND key = ?" if key is not None else "")
    params: list[Any] = [start, end] + ([key] if key is not None else [])
    if models is not None:
        where += f" AND model IN ({', '.join('?' for _ in models) or 'NULL'})"
        params += list(models)
    sums = ["COUNT(*)", "SUM(prompt_tokens)", "SUM(cached_tokens)", "SUM(completion_tokens)",
            "SUM(seconds)"]
    sql = f"SELECT {', '.join(select + sums)} FROM usage WHERE {where}"
    if columns:
        sql += f" GROUP BY {', '.join(columns)} ORDER BY {', '.join(columns)}"
    out = []
    for row in conn.execute(sql, params):
        *groups, requests, prompt, cached, completion, seconds = row
        if not requests:
            continue  # no rows: one all-NULL sum row
        out.append({**dict(zip(group_by, groups, strict=True)), "requests": int(requests),
                    "prompt_tokens": int(prompt), "cached_tokens": int(cached),
                    "completion_tokens": int(completion),
                    "seconds": round(float(seconds), 3)})
    return out
