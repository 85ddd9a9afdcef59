"""``Ledger``: one row per finished request in the router's database (``usage``), and the
token budgets of named keys enforced from it.

A request's row (time, key name, model id, endpoint, status, prompt/cached/completion
tokens, seconds) is appended to a bounded queue on the event loop, nothing more: a task
writes what the queue holds every ``FLUSH_EVERY`` seconds (sooner once ``FLUSH_ROWS``
wait), in one transaction on the database's own thread, and once more at shutdown. So a
SIGTERM loses nothing and a kill -9 at most the last second's rows. While the database is
away (``DatabaseUnavailable``) the rows stay queued and the next flush after it returns
writes them, each once: a batch leaves the queue while it is written and comes back to
its front only if its write failed. A queue past ``QUEUE_MAX`` (the database away for
minutes) drops its oldest rows, counted (``dropped``) and logged.

Budgets: a named key's ``budgets`` cap its prompt+completion tokens per calendar day,
ISO week or month (UTC), over every model or those a glob names. ``spent`` reads the
current period's sum from the database (every router's rows: routers sharing a
database share budgets) at most every ``SPENT_EVERY`` seconds per key, plus what this
router recorded since; past a budget a request gets a 429 naming it and its reset. With
the database away a budget is checked against the last spend read (plus this router's
rows since), and serving goes on.
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import fnmatch
import functools
import logging
import time
from collections import deque
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from router.database import Conn, Database
from router.key_store import Budget

log = logging.getLogger("modelyard.router")

FLUSH_EVERY = 1.0
FLUSH_ROWS = 2_000
QUEUE_MAX = 200_000
SPENT_EVERY = 2.0
"""Seconds a key's spend read from the database is trusted (plus this router's own rows
since): another router's requests count against a shared budget within this."""

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
        self.dropped = 0
        self.written = 0
        self._writer: asyncio.Task[None] | None = None
        self._flushing = asyncio.Lock()
        # Budgets: (key, period, model glob) -> (period start, tokens in the database then,
        # when read); this router's rows since are added from ``_recent``.
        self._spent: dict[tuple[str, str, str], tuple[float, int, float]] = {}
        self._recent: deque[tuple[float, str, str, int]] = deque()
        """This router's token rows since a budget was first checked (none are kept until
        then: a router without budgets does nothing more per request)."""
        self._budgets = False

    def start(self) -> None:
        self._writer = asyncio.create_task(self._write(), name="ledger")

    def record(self, key: str, model: str, endpoint: str, status: int, prompt: int,
               cached: int, completion: int, seconds: float) -> None:
        """Queue one request's row (the event loop does nothing more)."""
        now = time.time()
        self._queue.append((now, key, model, endpoint, status, prompt, cached, completion,
                            round(seconds, 4)))
        if self._budgets and (prompt or completion):
            self._recent.append((now, key, model, prompt + completion))
            while self._recent[0][0] < now - 2 * SPENT_EVERY:  # older than any cached read
                self._recent.popleft()
        if len(self._queue) > QUEUE_MAX:
            self._queue.popleft()
            self.dropped += 1
            if self.dropped in (1, 1000) or self.dropped % 100_000 == 0:
                log.error("usage ledger: %d row(s) dropped: the database does not keep up",
                          self.dropped)
        if len(self._queue) >= FLUSH_ROWS:
            self._wake.set()

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
            done = self.db.submit(lambda conn: conn.many(INSERT, rows))
            done.add_done_callback(functools.partial(self._settle, rows))
            await self.db.bounded(done)

    def _settle(self, rows: list[Row], done: asyncio.Future[None]) -> None:
        """A batch's write has ended (on the event loop, before its flush resumes)."""
        if not done.cancelled() and done.exception() is None:
            self.written += len(rows)
            return
        self._queue.extendleft(reversed(rows))  # oldest first, as they were
        while len(self._queue) > QUEUE_MAX:
            self._queue.popleft()
            self.dropped += 1
            if self.dropped in (1, 1000) or self.dropped % 100_000 == 0:
                log.error("usage ledger: %d row(s) dropped: the database does not keep up",
                          self.dropped)

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

    async def over_budget(self, key: str, budgets: Sequence[Budget], model: str,
                          names: list[str]) -> tuple[Budget, float] | None:
        """The first of ``budgets`` that applies to this model (``names``: its id and
        aliases) and is spent for ``key``, with when its period resets; else None."""
        self._budgets = True  # rows from here on are counted in ``spent``'s reads since
        now = time.time()
        for budget in budgets:
            if budget.model and not any(fnmatch.fnmatchcase(n, budget.model) for n in names):
                continue
            start, end = period_bounds(budget.period, now)
            if await self.spent(key, budget, start, now) >= budget.tokens:
                return budget, end
        return None

    async def spent(self, key: str, budget: Budget, start: float, now: float) -> int:
        """``key``'s tokens since ``start`` on the models ``budget`` covers."""
        slot = (key, budget.period, budget.model or "")
        known = self._spent.get(slot)
        if known is None or known[0] != start or now - known[2] >= SPENT_EVERY:
            try:
                await self.flush()  # this router's rows are in the sum, none twice
                read = await self.db.run(lambda conn: _tokens(conn, key, budget.model, start))
            except Exception as err:  # noqa: BLE001  # either driver's: serve on what is known
                log.warning("usage ledger: cannot read %s's spending: %s", key, err)
                if known is None or known[0] != start:
                    return sum(t for at, k, _, t in self._recent if k == key and at >= start)
            else:
                known = self._spent[slot] = (start, read, now)
        since = sum(tokens for at, k, model, tokens in self._recent
                    if at >= known[2] and k == key
                    and (not budget.model or fnmatch.fnmatchcase(model, budget.model)))
        return known[1] + since


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


def _tokens(conn: Conn, key: str, model_glob: str | None, start: float) -> int:
    """Prompt and completion tokens of ``key`` since ``start`` (on models the glob names)."""
    if model_glob:
        rows = conn.execute("SELECT model, SUM(prompt_tokens + completion_tokens) FROM usage "
                            "WHERE key = ? AND time >= ? GROUP BY model", (key, start))
        return sum(int(n or 0) for model, n in rows if fnmatch.fnmatchcase(model, model_glob))
    rows = conn.execute("SELECT SUM(prompt_tokens + completion_tokens) FROM usage "
                        "WHERE key = ? AND time >= ?", (key, start))
    return int(rows[0][0] or 0) if rows else 0
