"""The database layer when its database is away (issue 26), on SQLite in-process: a
statement that cannot run is a ``DatabaseUnavailable`` (503), a connection that broke is
replaced and the schema made again, the ledger keeps its rows until they are written
(each once), and named keys serve from the last read for ``STALE_MAX`` seconds only.

On 96966e8 the ledger test failed: after the file came back empty the router's one
connection read "no such table: usage" for ever (the schema is made on connecting, and
it never connected again), so no queued row was written; the unusable file was a raw
``sqlite3.DatabaseError`` (a 500), not a 503.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from router.access import database
from router.access.database import Database, DatabaseUnavailable
from router.access.key_store import SCHEMA as KEY_TABLES
from router.access.key_store import KeySpec, KeyStore, follow
from router.access.ledger import SCHEMA as LEDGER_TABLES
from router.access.ledger import Ledger


def spoil(path: Path) -> None:
    """Overwrite the database's files in place (the open connection's inodes)."""
    for found in path.parent.iterdir():
        with found.open("r+b") as f:
            f.write(b"not a db" * 1024)


def empty(path: Path) -> None:
    """A new, empty database (no tables) in the file; its WAL files removed (not
    truncated: a connection still mapping the index would die of SIGBUS)."""
    for found in path.parent.iterdir():
        if found != path:
            found.unlink()
    path.write_bytes(b"")


def usage_rows(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM usage").fetchone()[0])


def test_an_unusable_database_is_a_503_and_an_emptied_one_is_made_again(
        tmp_path: Path) -> None:
    path = tmp_path / "db" / "modelyard.db"
    db = Database(f"sqlite:///{path}", KEY_TABLES)
    store = KeyStore(db)

    async def scenario() -> None:
        await store.create("alice", "user", KeySpec())
        spoil(path)
        with pytest.raises(DatabaseUnavailable) as away:
            await store.active()
        assert away.value.status == 503
        assert away.value.body()["error"]["code"] == "database_unavailable"
        empty(path)
        assert await store.active() == []  # a new connection, and the table again
        await store.create("bob", "user", KeySpec())
        assert [k.name for k in await store.listed()] == ["bob"]

    try:
        asyncio.run(scenario())
    finally:
        db.close()


def test_a_directory_that_cannot_be_made_is_a_503(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    db = Database(f"sqlite:///{tmp_path / 'file' / 'modelyard.db'}", KEY_TABLES)
    try:
        with pytest.raises(DatabaseUnavailable):
            asyncio.run(KeyStore(db).active())
    finally:
        db.close()


def test_ledger_rows_wait_for_the_database_and_are_written_once(tmp_path: Path) -> None:
    path = tmp_path / "db" / "modelyard.db"
    db = Database(f"sqlite:///{path}", LEDGER_TABLES)
    ledger = Ledger(db)

    def record(n: int) -> None:
        for _ in range(n):
            ledger.record("alice", "m", "chat", 200, 5, 0, 2, 0.01)

    async def scenario() -> None:
        record(3)
        await ledger.flush()
        spoil(path)
        record(4)
        with pytest.raises(DatabaseUnavailable):
            await ledger.flush()
        with pytest.raises(DatabaseUnavailable):
            await ledger.flush()  # a second failure keeps them too
        empty(path)
        record(2)
        await ledger.flush()
        await ledger.flush()  # nothing left: nothing written twice

    try:
        asyncio.run(scenario())
    finally:
        db.close()
    # The 3 rows before were in the file that was emptied; the 6 since are all there.
    assert usage_rows(path) == 6
    assert (ledger.written, ledger.overflow) == (9, 0)


def test_a_flush_past_its_wait_writes_its_rows_once(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that outlasts ``RUN_TIMEOUT`` (another process holds the write lock) is a
    503 for its caller but goes on: its rows are written when the lock is let go, and
    neither kept for a second write nor lost."""
    path = tmp_path / "modelyard.db"
    db = Database(f"sqlite:///{path}", LEDGER_TABLES)
    ledger = Ledger(db)
    monkeypatch.setattr(database, "RUN_TIMEOUT", 0.2)

    async def scenario() -> None:
        ledger.record("alice", "m", "chat", 200, 5, 0, 2, 0.01)
        await ledger.flush()  # connected: the table exists
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # the write lock, held
        try:
            for _ in range(5):
                ledger.record("alice", "m", "chat", 200, 5, 0, 2, 0.01)
            with pytest.raises(DatabaseUnavailable, match="did not answer"):
                await ledger.flush()
            ledger.record("alice", "m", "chat", 200, 5, 0, 2, 0.01)
        finally:
            other.execute("COMMIT")
            other.close()
        while ledger.written < 6:  # the batch, still being written
            await asyncio.sleep(0.05)
        await ledger.flush()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        db.close()
    assert usage_rows(path) == 7
    assert ledger.written == 7


def test_named_keys_serve_from_the_last_read_for_stale_max_then_open_nothing() -> None:
    """``follow`` on a clock of its own: each refresh takes 10 s; the database is away
    from the second one on, for 8 refreshes, then answers, then is away again."""
    now = 0.0
    script = ["ok"] + ["away"] * 8 + ["ok"] + ["away"] * 3
    log: list[str] = []
    done = asyncio.Event()

    async def refresh() -> None:
        nonlocal now
        now += 10
        step = script.pop(0) if script else "end"
        if not script:
            done.set()
        if step != "ok":
            raise DatabaseUnavailable("away")
        log.append(f"read at {now:g}")

    async def scenario() -> None:
        task = asyncio.create_task(follow(refresh, lambda: log.append(f"dropped at {now:g}"),
                                          every=0, stale_max=60, clock=lambda: now))
        await done.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    # Read at 10; away from 20: dropped once the last read is over 60 s old (at 80),
    # once; read again at 100; away from 110, not yet 60 s at 130.
    assert log == ["read at 10", "dropped at 80", "read at 100"]


def test_a_batch_being_written_stays_unwritten_until_it_is_committed(tmp_path: Path) -> None:
    """Budgets count the database's rows before ``unwritten_since`` and this router's
    from it: a batch out of the queue but not yet committed must stay on this side (it
    was on neither when the two helpers' changes first met)."""
    async def go() -> None:
        ledger = Ledger(Database(f"sqlite:///{tmp_path / 'd.db'}", LEDGER_TABLES))
        ledger.record("k", "m", "chat", 200, 3, 0, 4, 0.1)
        first = ledger.unwritten_since()
        assert first is not None
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ledger.db.submit = lambda work: gate  # type: ignore[method-assign,assignment,return-value]
        flushing = asyncio.create_task(ledger.flush())
        await asyncio.sleep(0.01)
        assert not ledger._queue and ledger.unwritten_since() == first
        gate.set_result(None)
        await flushing
        assert ledger.unwritten_since() is None
        ledger.db.close()
    asyncio.run(go())
