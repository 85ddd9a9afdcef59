"""The batch runner against a hostile key and a bad day (issue 38): a batch's lines paged
from the database (the runner holds one page, whatever the batch's size) and its results
streamed a page at a time (finding 2); a database outage past ``STALE_MAX`` is not a
revocation (finding 5); a revocation ends the key's streams, background responses and
batches; a batch line run again after a kill -9 is charged once.

In-process apps (``build_app`` in its lifespan, driven over ASGI) with synthetic workers.
No timing is asserted: deadlines are generous, and what is waited for is an event (a
status, an end).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.access.database import Conn
from router.app import build_app
from router.batches.runner import BatchRunner
from router.batches.store import BatchStore
from shared.preset_loader import load_preset

ADMIN = "k-admin-runner-7f3"
PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  runtime_dir: {runtime}
  cache_dir: {cache}
  admin_api_keys: [k-admin-runner-7f3]
  batch_model_concurrency: 4
models:
  m: {{model: /synthetic, engine: synthetic}}
  other: {{model: /synthetic, engine: synthetic}}
  slow: {{model: /synthetic, engine: synthetic, engine_args: {{tokens_per_second: 4}}}}
  slow-lines: {{model: /synthetic, engine: synthetic, engine_args: {{tokens_per_second: 4}}}}
  late: {{model: /synthetic, engine: synthetic, engine_args: {{start_seconds: 120}}}}
"""


@contextlib.contextmanager
def short_dir(name: str) -> Iterator[Path]:
    """A runtime dir short enough for worker socket paths (107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix=f"my-{name}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class App:
    """An app in its lifespan, asked over ASGI."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def ask(self, method: str, path: str, key: str = ADMIN, **kw: Any) -> httpx.Response:
        transport = httpx.ASGITransport(app=self.app, client=("10.1.1.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=60) as c:
            return await c.request(method, path, headers={"authorization": f"Bearer {key}"},
                                   **kw)


@contextlib.asynccontextmanager
async def serving(tmp: Path) -> AsyncIterator[App]:
    with short_dir("runner") as runtime:
        path = tmp / "preset.yaml"
        path.write_text(PRESET.format(port=1, runtime=runtime, cache=tmp / "cache"))
        app = build_app(load_preset(str(path)))
        async with app.router.lifespan_context(app):
            yield App(app)


def chat_line(custom_id: str, model: str, max_tokens: int = 3) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": max_tokens}}


async def make_batch(app: App, lines: list[dict[str, Any]], key: str = ADMIN) -> str:
    data = "".join(json.dumps(ln) + "\n" for ln in lines).encode()
    made = await app.ask("POST", "/v1/files", key, files={"file": ("in.jsonl", data)},
                         data={"purpose": "batch"})
    assert made.status_code == 200, made.text
    batch = await app.ask("POST", "/v1/batches", key, json={
        "input_file_id": made.json()["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    assert batch.status_code == 200, batch.text
    return str(batch.json()["id"])


async def ended(app: App, batch_id: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = (await app.ask("GET", f"/v1/batches/{batch_id}")).json()
        if got["status"] in ("completed", "failed", "expired", "cancelled"):
            return dict(got)
        await asyncio.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} still {got['status']}")


# -- finding 2: paged lines, streamed results ----------------------------------------------

PAGE = 7


def test_a_batch_is_run_and_read_a_page_at_a_time(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A 90-line batch over two models, with pages of 7 lines: every read of its lines'
    bodies (what the runner holds) and of its results (what a GET holds) returns at most
    a page, and still every line runs once and the output file has each custom_id once,
    in line order. On 1a1e9ee the runner read all 90 pending lines at once (and the
    output file was one read of 90 results)."""
    monkeypatch.setattr(BatchStore, "page_lines", PAGE, raising=False)
    bodies: list[int] = []
    results: list[int] = []
    execute = Conn.execute

    def counted(self: Conn, text: str, params: Any = ()) -> list[Any]:
        rows = execute(self, text, params)
        select = " ".join(text.split())
        if select.startswith("SELECT") and "FROM batch_lines" in select:
            if "body" in select.split("FROM")[0]:
                bodies.append(len(rows))
            elif "result" in select.split("FROM")[0] and "SUM" not in select:
                results.append(len(rows))
        return rows

    monkeypatch.setattr(Conn, "execute", counted)
    lines = [chat_line(f"line-{i}", "m" if i % 3 else "other") for i in range(90)]

    async def go() -> tuple[dict[str, Any], str]:
        async with serving(tmp_path) as app:
            bid = await make_batch(app, lines)
            batch = await ended(app, bid)
            assert batch["status"] == "completed", batch
            content = await app.ask("GET", f"/v1/files/{batch['output_file_id']}/content")
            assert content.status_code == 200
            return batch, content.text

    batch, text = asyncio.run(go())
    assert batch["request_counts"] == {"total": 90, "completed": 90, "failed": 0}
    out = [json.loads(t) for t in text.splitlines()]
    assert [o["custom_id"] for o in out] == [f"line-{i}" for i in range(90)]
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert all(o["response"]["body"]["object"] == "chat.completion" for o in out)
    assert bodies and max(bodies) <= PAGE, f"lines read at once: {bodies}"
    assert sum(bodies) >= 90  # every line was read, a page at a time
    assert results and max(results) <= PAGE, f"results read at once: {results}"
    import sqlite3  # the streamed file is the rows as a whole read gives them (1a1e9ee's)
    with contextlib.closing(sqlite3.connect(tmp_path / "cache" / "modelyard.db")) as db:
        whole = db.execute("SELECT result FROM batch_lines WHERE state = 'succeeded' "
                           "ORDER BY line").fetchall()
    assert text == "".join(f"{r[0]}\n" for r in whole)


# -- named keys: an outage is not a revocation; a revocation ends the key's work -----------

async def named_key(app: App, name: str) -> str:
    made = await app.ask("POST", "/v1/keys", json={"name": name, "role": "user"})
    assert made.status_code == 201, made.text
    return str(made.json()["key"])


async def until(check: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.1)


def test_a_database_outage_past_stale_max_does_not_fail_a_keys_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Named keys' reads fail past a (shortened) ``STALE_MAX``: the key opens nothing for
    new requests (fail closed, as before), but its running batch neither fails nor ends
    its lines; once the keys read again it goes on and completes, every line succeeded.
    On 1a1e9ee the runner took the dropped key for a revoked one: the batch ended
    ``failed`` with its pending lines cancelled ("no longer admits requests")."""
    import functools

    from router import app as app_module
    from router.access.database import DatabaseUnavailable
    from router.access.key_store import follow
    from router.api.keys import KeysAPI

    monkeypatch.setattr(app_module, "follow_keys",
                        functools.partial(follow, every=0.1, stale_max=0.4))
    away = asyncio.Event()
    refresh = KeysAPI.refresh

    async def flaky(self: KeysAPI) -> None:
        if away.is_set():
            raise DatabaseUnavailable("the database is away (the test's outage)")
        await refresh(self)

    monkeypatch.setattr(KeysAPI, "refresh", flaky)

    async def go() -> tuple[dict[str, Any], int]:
        async with serving(tmp_path) as app:
            carol = await named_key(app, "carol")
            keys = app.app.state.keys
            bid = await make_batch(app, [chat_line(f"c-{i}", "slow", 4) for i in range(8)],
                                   carol)
            # an outage while the batch runs, long past STALE_MAX
            await until(lambda: keys.current("carol") is not None, "carol read")
            away.set()
            await until(lambda: keys.current("carol") is None, "carol dropped")
            refused = await app.ask("POST", "/v1/chat/completions", carol, json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2})
            await asyncio.sleep(3.0)  # the lines that waited would have failed by now
            during = (await app.ask("GET", f"/v1/batches/{bid}")).json()
            assert during["status"] == "in_progress", during
            assert during["request_counts"]["failed"] == 0, during
            away.clear()
            return await ended(app, bid), refused.status_code

    batch, refused = asyncio.run(go())
    assert refused == 401  # fail closed: an unknown key admits no new request
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 8, "completed": 8, "failed": 0}


def test_a_revocation_ends_the_keys_stream_background_response_and_batch(
        tmp_path: Path) -> None:
    """A named key streams from a slow model (100 s of tokens) over OpenAI's and
    Anthropic's APIs, has a background response and a batch running on it; it is revoked:
    each stream ends with its protocol's in-band 401 (``key_revoked``; Anthropic's
    ``authentication_error``) and no ``[DONE]`` or ``message_stop``, the background
    response ends ``failed``, the batch ends ``failed`` (its lines not run: cancelled),
    each long before its tokens would have. On 1a1e9ee they all ran on to their end (the
    first stream was still running 30 s after the revocation)."""

    async def go() -> tuple[str, dict[str, Any], dict[str, Any]]:
        async with serving(tmp_path) as app:
            dave = await named_key(app, "dave")
            relay, responses = app.app.state.relay, app.app.state.responses
            stream = asyncio.create_task(app.ask("POST", "/v1/chat/completions", dave, json={
                "model": "slow", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 400, "stream": True}))
            messages = asyncio.create_task(app.ask("POST", "/v1/messages", dave, json={
                "model": "slow", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 400, "stream": True}))
            made = await app.ask("POST", "/v1/responses", dave, json={
                "model": "slow", "input": "hi", "max_output_tokens": 400,
                "background": True})
            assert made.status_code == 200, made.text
            rid = made.json()["id"]
            # on a model of its own: a person's stream on its model would cut its lines
            bid = await make_batch(app, [chat_line(f"d-{i}", "slow-lines", 400)
                                         for i in range(6)], dave)

            def generating() -> bool:  # both streams, the background response, a line
                flights = [s.usage.batch for s in relay._generating.get("dave", ())]
                return flights.count(None) >= 3 and len(flights) >= 4

            await until(generating, "dave's work generating", timeout=60)
            gone = await app.ask("DELETE", "/v1/keys/dave")
            assert gone.status_code == 200, gone.text
            async with asyncio.timeout(30):
                streamed = await stream
                anthropic = await messages
            assert streamed.status_code == 200 and anthropic.status_code == 200
            assert "event: error" in anthropic.text, anthropic.text[-400:]
            assert "authentication_error" in anthropic.text, anthropic.text[-400:]
            assert "message_stop" not in anthropic.text, anthropic.text[-400:]
            await until(lambda: rid not in responses.background, "background run ended")
            stored = responses.store.get(rid, "dave")
            return streamed.text, json.loads(stored.response), await ended(app, bid, 30)

    text, background, batch = asyncio.run(go())
    assert "key_revoked" in text and "[DONE]" not in text, text[-400:]
    assert background["status"] == "failed", background
    assert "revoked" in background["error"]["message"], background["error"]
    assert batch["status"] == "failed", batch
    assert batch["errors"]["data"][0]["code"] == "key_not_admitted", batch["errors"]
    assert batch["request_counts"]["completed"] == 0, batch


def test_a_revoked_keys_background_response_waiting_for_its_model_ends(
        tmp_path: Path) -> None:
    """A background response queued behind its model's load (two minutes) when its key is
    revoked ends then (``cancelled``), its connection and key place given back, not when
    the model is ready. On 1a1e9ee it waited for the load."""

    async def go() -> dict[str, Any]:
        async with serving(tmp_path) as app:
            erin = await named_key(app, "erin")
            responses = app.app.state.responses
            made = await app.ask("POST", "/v1/responses", erin, json={
                "model": "late", "input": "hi", "max_output_tokens": 4,
                "background": True})
            assert made.status_code == 200, made.text
            rid = made.json()["id"]
            await asyncio.sleep(0.5)  # its run waits for the load
            assert rid in responses.background
            gone = await app.ask("DELETE", "/v1/keys/erin")
            assert gone.status_code == 200, gone.text
            await until(lambda: rid not in responses.background, "background run ended", 60)
            return dict(json.loads(responses.store.get(rid, "erin").response))

    stored = asyncio.run(go())
    assert stored["status"] in ("cancelled", "failed"), stored


# -- a line run again after a kill -9 is charged once ------------------------------------

def test_a_line_run_again_after_the_router_died_is_charged_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A router runs a one-line batch and dies before it writes the line's result (its
    writes of results fail from then on, as a process killed would make none), while its
    usage ledger goes on as usual; a second router over the same database takes the batch
    and runs the line again. The usage table has that line once. On 1a1e9ee the first
    run's row was queued and written at once, apart from its result: the line was charged
    twice."""
    import sqlite3

    from router.access.database import DatabaseUnavailable

    dead = asyncio.Event()
    finish = BatchStore.finish

    async def dying(self: BatchStore, *args: Any, **kw: Any) -> int:
        if dead.is_set() or not args[2]:  # nothing written by a router that died
            raise DatabaseUnavailable("the router died before it wrote this")
        dead.set()
        raise DatabaseUnavailable("the router died before it wrote this")

    async def first() -> None:
        async with serving(tmp_path) as app:
            await make_batch(app, [chat_line("once", "m", 5)])
            async with asyncio.timeout(60):
                await dead.wait()
            # the ledger's writer goes on until the end (a kill -9 only loses its last second)

    async def second() -> dict[str, Any]:
        async with serving(tmp_path) as app:
            listed = (await app.ask("GET", "/v1/batches")).json()["data"]
            return await ended(app, listed[0]["id"])

    monkeypatch.setattr(BatchStore, "finish", dying)
    asyncio.run(first())
    monkeypatch.setattr(BatchStore, "finish", finish)
    batch = asyncio.run(second())
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
    with contextlib.closing(sqlite3.connect(tmp_path / "cache" / "modelyard.db")) as db:
        rows = db.execute("SELECT status, completion_tokens FROM usage WHERE "
                          "endpoint = 'chat'").fetchall()
    assert rows == [(200, 5)], rows


def test_a_batch_cancelled_while_its_lines_generate_is_charged_for_them(
        tmp_path: Path) -> None:
    """A key's 4-line batch generates on a slow model (4 tok/s, 400 tokens a line); after
    some seconds of tokens the key cancels it: its lines end ``canceled``, and the tokens
    they spent are in the usage table, one row a line at most (with its ``canceled``
    result). Before, a line ended by its batch's stop was a 499 the relay charged as if
    it were cut for a person: nothing, so a key that cancels its batches before their
    lines end (then makes another) spent past any budget and token rate without a row."""
    import sqlite3

    async def go() -> dict[str, Any]:
        async with serving(tmp_path) as app:
            eve = await named_key(app, "eve")
            relay = app.app.state.relay
            bid = await make_batch(app, [chat_line(f"e-{i}", "slow-lines", 400)
                                         for i in range(4)], eve)
            await until(lambda: len(relay._generating.get("eve", ())) == 4, "lines running",
                        timeout=60)
            await asyncio.sleep(2)  # ~8 tokens a line
            got = await app.ask("POST", f"/v1/batches/{bid}/cancel", eve)
            assert got.status_code == 200, got.text
            return await ended(app, bid, 30)

    batch = asyncio.run(go())
    assert batch["status"] == "cancelled", batch
    with contextlib.closing(sqlite3.connect(tmp_path / "cache" / "modelyard.db")) as db:
        rows = db.execute("SELECT status, completion_tokens FROM usage WHERE key = 'eve' "
                          "AND endpoint = 'chat'").fetchall()
    assert 1 <= len(rows) <= 4 and all(done > 0 for _, done in rows), rows


def test_a_batch_cancelled_while_a_person_holds_its_model_ends_at_once(
        tmp_path: Path) -> None:
    """An 8-line batch runs 4 lines on a slow model; a person's 15 s stream there cuts
    them; the key cancels its batch a second later: it is ``cancelled`` within 3 s, and
    the model's batch places are all back. Before, the runner waited for the model's next
    place (none while the person's request is in flight) before it looked at the stop:
    the batch stayed ``cancelling`` (and in the key's ``batches_per_key``) as long as
    people used the model."""

    async def go() -> tuple[list[str], int]:
        async with serving(tmp_path) as app:
            eve = await named_key(app, "eve")
            relay = app.app.state.relay
            bid = await make_batch(app, [chat_line(f"e-{i}", "slow", 400)
                                         for i in range(8)], eve)
            await until(lambda: len(relay._generating.get("eve", ())) == 4, "lines running",
                        timeout=60)
            person = asyncio.create_task(app.ask("POST", "/v1/chat/completions", json={
                "model": "slow", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 60, "stream": True}))
            await until(lambda: not relay._generating.get("eve"), "lines cut", timeout=10)
            got = await app.ask("POST", f"/v1/batches/{bid}/cancel", eve)
            assert got.status_code == 200, got.text
            seen: list[str] = []
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and "cancelled" not in seen:
                seen.append((await app.ask("GET", f"/v1/batches/{bid}", eve)).json()["status"])
                await asyncio.sleep(0.2)
            assert not person.done()
            person.cancel()
            runner = next(f.__self__ for f in app.app.state.keys._revoked_listeners
                          if isinstance(getattr(f, "__self__", None), BatchRunner))
            return seen, runner._model_lines["slow"].in_flight

    seen, places = asyncio.run(go())
    assert seen[-1] == "cancelled", seen
    assert places == 0, places


def test_a_write_of_results_that_fails_once_loses_no_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16-line batch; the first write of its results fails (the database away for a
    moment), the next ones work: every line runs once, and results are written again
    within a few flushes. Before, the failed write ended the flusher: every later result
    was held in memory until the batch's end, which then raised the old failure, so all of
    them were dropped and every line ran twice (a blip a run: the batch never ends)."""
    from router.access.database import DatabaseUnavailable
    from router.batches.runner import LineCaller

    finish = BatchStore.finish
    failed = asyncio.Event()
    writes: list[int] = []

    async def blip(self: BatchStore, *args: Any, **kw: Any) -> int:
        if args[2] and not failed.is_set():
            failed.set()
            raise DatabaseUnavailable("the database is away for a moment")
        if args[2]:
            writes.append(len(args[2]))
        return await finish(self, *args, **kw)

    calls = 0
    call = LineCaller.__call__

    async def counted(self: LineCaller, *args: Any) -> tuple[int, bytes]:
        nonlocal calls
        calls += 1
        return await call(self, *args)

    monkeypatch.setattr(BatchStore, "finish", blip)
    monkeypatch.setattr(LineCaller, "__call__", counted)

    async def go() -> dict[str, Any]:
        async with serving(tmp_path) as app:
            bid = await make_batch(app, [chat_line(f"l-{i}", "slow", 4) for i in range(16)])
            return await ended(app, bid, 90)

    batch = asyncio.run(go())
    assert batch["request_counts"] == {"total": 16, "completed": 16, "failed": 0}, batch
    assert calls == 16, calls
    assert failed.is_set() and sum(writes) == 16 and len(writes) > 1, writes


# -- units: the keys' standing, the ledger's held rows -----------------------------------

def test_keys_tell_an_outage_from_a_revocation() -> None:
    """Past ``STALE_MAX`` (``set_stale``) named keys open nothing and are ``unknown``, and
    nobody is told of a revocation; a read that lacks a key tells its revocation, also
    when that read ends an outage; a key revoked before the outage is not unknown."""
    from router.access.admission import Keys
    from router.access.key_store import NamedKey

    def key(name: str) -> tuple[bytes, NamedKey]:
        return name.encode().ljust(32, b"."), NamedKey(name=name, role="user")

    keys = Keys(admin=["k-admin"])
    told: list[frozenset[str]] = []
    keys.on_revoked(told.append)
    keys.set_named([key("a"), key("b"), key("c")])
    keys.set_named([key("a"), key("b")])  # c revoked
    assert told == [frozenset({"c"})]
    keys.set_stale()
    assert keys.current("a") is None and keys.unknown("a") and keys.unknown("b")
    assert not keys.unknown("c")  # revoked before the outage: revoked
    assert keys.identify(b"a") is None
    assert told == [frozenset({"c"})]  # an outage is not a revocation
    keys.set_named([key("a")])  # the database answers: b was revoked meanwhile
    assert told == [frozenset({"c"}), frozenset({"b"})]
    assert keys.current("a") is not None and not keys.unknown("a") and not keys.unknown("b")


def test_a_key_made_after_the_last_read_is_unseen_not_revoked() -> None:
    """A batch made on another router sharing the database, by a key made there after
    this router's last read: the key is ``unseen`` (its lines wait) until a read, which
    either finds it or tells that it is not there; a key this router knows, or one read
    after the batch was made, is never unseen. Before, the runner that claimed such a
    batch first took its owner for revoked and failed the batch."""
    import time as clock

    from router.access.admission import Keys
    from router.access.key_store import NamedKey

    keys = Keys(admin=["k-admin"])
    keys.set_named([(b"a".ljust(32, b"."), NamedKey(name="a", role="user"))])
    made = clock.time() + 1  # a batch made after that read
    assert keys.unseen("new", made) and not keys.unseen("a", made)
    assert not keys.unseen("new", keys.read_at - 1)  # read since: not there is not there
    keys.set_named([(b"a".ljust(32, b"."), NamedKey(name="a", role="user")),
                    (b"new".ljust(32, b"."), NamedKey(name="new", role="user"))])
    assert not keys.unseen("new", made - 1) and keys.current("new") is not None


def test_a_batch_lines_rows_are_held_until_its_result_is_written(tmp_path: Path) -> None:
    """A row recorded in a batch line's context is held, not queued: unwritten (budgets
    count it from memory) until its result's write takes it; a new run of the line drops
    the rows of a run whose result was never written; other rows are queued as before."""
    from router.access.database import Database
    from router.access.ledger import BATCH_LINE, Ledger
    from router.access.ledger import SCHEMA as LEDGER_TABLES

    async def go() -> None:
        ledger = Ledger(Database(f"sqlite:///{tmp_path / 'd.db'}", LEDGER_TABLES))

        async def line_run(tokens: int) -> None:
            ledger.hold("b1", 0)
            BATCH_LINE.set(("b1", 0))
            ledger.record("k", "m", "chat", 200, 1, 0, tokens, 0.1)

        await asyncio.create_task(line_run(7))
        assert not ledger._queue and ledger.unwritten_since() is not None
        await asyncio.create_task(line_run(9))  # the first run's result never written
        assert [r[7] for r in ledger.held("b1", 0)] == [9]
        ledger.record("k", "m", "chat", 200, 1, 0, 2, 0.1)  # not a batch line: queued
        assert len(ledger._queue) == 1
        ledger.let_go("b1", 0)
        assert ledger.held("b1", 0) == []
        await ledger.flush()
        assert ledger.unwritten_since() is None
        ledger.db.close()

    asyncio.run(go())


def test_a_person_who_never_leaves_a_gap_slows_a_batch_but_never_stops_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """People keep the slow model busy without a gap (two looping streams, overlapping);
    a 4-line batch of short lines there still ends ``completed`` while they do: once no
    line has moved for ``STARVED_AFTER`` (1 s here) one runs beside them. Before, no line
    ever started while a person's request was in flight: the batch stayed ``in_progress``
    with nothing done for as long as people kept the model busy."""
    from router.batches import runner as runner_module

    monkeypatch.setattr(runner_module, "STARVED_AFTER", 1.0, raising=False)

    async def go() -> tuple[dict[str, Any], int]:
        async with serving(tmp_path) as app:
            relay = app.app.state.relay
            busy = asyncio.Event()
            asked = 0

            async def person(delay: float) -> None:
                nonlocal asked
                await asyncio.sleep(delay)
                while not busy.is_set():
                    asked += 1
                    await app.ask("POST", "/v1/chat/completions", json={
                        "model": "slow", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 8, "stream": True})

            people = [asyncio.create_task(person(d)) for d in (0.0, 1.0)]
            await until(lambda: any(s.usage.batch is None
                                    for ss in relay._generating.values() for s in ss),
                        "a person generating")
            bid = await make_batch(app, [chat_line(f"p-{i}", "slow", 2) for i in range(4)])
            try:
                batch = await ended(app, bid, 60)
                still = all(not p.done() for p in people)
            finally:
                busy.set()
                await asyncio.gather(*people, return_exceptions=True)
            assert still
            return batch, asked

    batch, asked = asyncio.run(go())
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 4, "completed": 4, "failed": 0}, batch
    assert asked >= 4, asked
