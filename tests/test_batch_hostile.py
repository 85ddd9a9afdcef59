"""Batches and uploads against a hostile key (issue 38, findings 1 and 2): a plain user
key with ``max_concurrent: 2`` on a router with synthetic models tries to escape its
limits through batch lines (``background: true``), to grow the router's storage past its
files quota through batches made from one file or message batches, to hold unbounded
batches in flight, and to make two batches of one create retried after a lost answer.

The tests that start a router (or PostgreSQL) are marked ``integration``; their
models are synthetic. Every test here but ``test_a_plain_background_response_keeps_its_keys_place`` (which
states what already held) failed on 1a1e9ee; each says how."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import RouterProcess, running_router

ADMIN = "k-admin-hostile-9z"
PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  cache_dir: {cache}
  admin_api_keys: [k-admin-hostile-9z]
  batch_model_concurrency: 4
  max_connections: 8
  files_max_mib: 0.1
  files_quota_mib: 0.25
  batches_per_key: 2

models:
  m: {model: /synthetic, engine: synthetic}
  slow: {model: /synthetic, engine: synthetic, engine_args: {tokens_per_second: 5}}
"""


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    cache = tmp_path_factory.mktemp("hostile-cache")
    with running_router(PRESET, tmp_path_factory.mktemp("hostile"), "hostile",
                        {"cache": str(cache)}) as r:
        yield r


def call(r: RouterProcess, key: str, method: str, path: str, body: Any = None,
         **kwargs: Any) -> httpx.Response:
    return r.client.request(method, r.url + path, json=body, timeout=60,
                            headers={"Authorization": f"Bearer {key}",
                                     **kwargs.pop("headers", {})}, **kwargs)


def new_key(r: RouterProcess, name: str, **limits: Any) -> str:
    made = call(r, ADMIN, "POST", "/v1/keys", {"name": name, **limits})
    assert made.status_code in (200, 201), made.text
    key: str = made.json()["key"]
    return key


def upload(r: RouterProcess, key: str, items: list[Any]) -> httpx.Response:
    text = "".join(json.dumps(i) + "\n" for i in items).encode()
    return r.client.post(f"{r.url}/v1/files", headers={"Authorization": f"Bearer {key}"},
                         data={"purpose": "batch"}, files={"file": ("in.jsonl", text)},
                         timeout=60)


def create(r: RouterProcess, key: str, file_id: str, endpoint: str = "/v1/chat/completions",
           headers: dict[str, str] | None = None) -> httpx.Response:
    return call(r, key, "POST", "/v1/batches", {"input_file_id": file_id, "endpoint": endpoint,
                                                "completion_window": "24h"},
                headers=headers or {})


def finished(r: RouterProcess, key: str, batch_id: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        got: dict[str, Any] = call(r, key, "GET", f"/v1/batches/{batch_id}").json()
        if got["status"] in ("completed", "failed", "expired", "cancelled"):
            return got
        assert time.monotonic() < deadline, got
        time.sleep(0.2)


def lines_of(r: RouterProcess, key: str, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = call(r, key, "GET", f"/v1/files/{file_id}/content").text
    return [json.loads(t) for t in text.splitlines()]


def chat_line(custom_id: str, model: str = "m", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 2, **body}}


def in_flight(r: RouterProcess, model: str) -> int:
    """Requests the router's metrics count in flight on ``model`` now."""
    text = call(r, ADMIN, "GET", "/metrics").text
    total = 0.0
    for row in text.splitlines():
        if row.startswith("modelyard_model_in_flight{") and f'model="{model}"' in row:
            total += float(row.rsplit(" ", 1)[1])
    return int(total)


# -- finding 1: a batch line in the background ------------------------------------------

@pytest.mark.integration
def test_a_background_batch_line_is_an_error_line_and_starts_nothing(
        router: RouterProcess) -> None:
    """The issue's shape: a key with ``max_concurrent: 2`` and a 30-line ``/v1/responses``
    batch whose lines ask ``background: true``, on a 5 tok/s model. On 1a1e9ee the batch
    was ``completed`` at once with 30 ``queued`` responses as its results and 30
    generations running at interactive priority; here each line is an error line."""
    r = router
    key = new_key(r, "hostile-background", max_concurrent=2)
    items = [{"custom_id": f"bg-{i}", "method": "POST", "url": "/v1/responses",
              "body": {"model": "slow", "input": "tell me a long story", "background": True,
                       "max_output_tokens": 200}} for i in range(30)]
    made = upload(r, key, items)
    assert made.status_code in (200, 201), made.text
    batch = create(r, key, made.json()["id"], "/v1/responses")
    assert batch.status_code == 200, batch.text
    done = finished(r, key, batch.json()["id"])
    assert done["request_counts"] == {"total": 30, "completed": 0, "failed": 30}, done
    errors = lines_of(r, key, done.get("error_file_id"))
    assert sorted(e["custom_id"] for e in errors) == sorted(f"bg-{i}" for i in range(30))
    for e in errors:
        assert e["response"] is None and e["error"]["code"] == "invalid_body", e
        assert "background" in e["error"]["message"]
    assert lines_of(r, key, done.get("output_file_id")) == []
    assert in_flight(r, "slow") == 0


@pytest.mark.integration
def test_a_plain_background_response_keeps_its_keys_place(router: RouterProcess) -> None:
    """Not a batch line: a background response counts against its key's
    ``max_concurrent`` while it runs (its create's place is kept), so a key at its limit
    is refused a third background response and a chat (429) until one ends. This held on
    1a1e9ee already; it is here so the batch guard above cannot be taken for it."""
    r = router
    key = new_key(r, "hostile-plain-background", max_concurrent=2)
    body = {"model": "slow", "input": "a long story", "background": True,
            "max_output_tokens": 500}
    ids = []
    for _ in range(2):
        made = call(r, key, "POST", "/v1/responses", body)
        assert made.status_code == 200 and made.json()["status"] == "queued", made.text
        ids.append(made.json()["id"])
    third = call(r, key, "POST", "/v1/responses", body)
    assert third.status_code == 429, third.text
    chat = call(r, key, "POST", "/v1/chat/completions",
                {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 1})
    assert chat.status_code == 429, chat.text
    for rid in ids:  # reading and cancelling are not counted: the key can stop its runs
        cancelled = call(r, key, "POST", f"/v1/responses/{rid}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    deadline = time.monotonic() + 10
    while call(r, key, "POST", "/v1/chat/completions",
               {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1}).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_the_responses_handler_refuses_background_from_a_batch_line() -> None:
    """Defence in depth: were a line's check to miss ``background``, the Responses
    handler refuses it (400) for a request marked as a batch line, before anything is
    stored or started. On 1a1e9ee it answered ``queued`` and left a run behind."""
    import asyncio
    from types import SimpleNamespace

    from router.access.admission import BATCH_SCOPE_KEY, PRINCIPAL_SCOPE_KEY
    from router.api.responses import ResponsesAPI
    from router.errors import BadRequest

    class NoRelay:
        metrics = SimpleNamespace(registry=SimpleNamespace(register=lambda _: None))

        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the relay was asked for {name}")

    api = ResponsesAPI(NoRelay(), 1 << 20)  # type: ignore[arg-type]
    body = json.dumps({"model": "m", "input": "hi", "background": True}).encode()

    async def ask() -> None:
        from starlette.requests import Request
        from starlette.types import Message

        async def receive() -> Message:
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/v1/responses", "headers": [
            (b"content-type", b"application/json")], "query_string": b"",
            PRINCIPAL_SCOPE_KEY: SimpleNamespace(name="k", admin=False),
            BATCH_SCOPE_KEY: "batch_x"}
        with pytest.raises(BadRequest) as err:
            await api.create(Request(scope, receive))
        assert err.value.param == "background"

    asyncio.run(ask())
    assert not api.store


# -- finding 2: what a key's batches store and hold --------------------------------------

def padded_lines(prefix: str, count: int, size: int, model: str = "m") -> list[Any]:
    """``count`` chat lines of about ``size`` bytes each (a long user message)."""
    return [chat_line(f"{prefix}-{i}", model, messages=[
        {"role": "user", "content": "x" * (size - 140)}]) for i in range(count)]


@pytest.mark.integration
def test_one_file_cannot_feed_batches_past_the_files_quota(router: RouterProcess) -> None:
    """The files quota counts what batches store (their copied lines), not only uploads:
    a 100 KB file fits a 0.25 MiB quota, and so does one batch made from it, but not a
    second. On 1a1e9ee every create was accepted (the quota saw one file)."""
    r = router
    key = new_key(r, "hostile-quota")
    made = upload(r, key, padded_lines("q", 100, 1000))
    assert made.status_code == 200, made.text
    first = create(r, key, made.json()["id"])
    assert first.status_code == 200, first.text
    second = create(r, key, made.json()["id"])
    assert second.status_code == 413, second.text
    assert second.json()["error"]["code"] == "files_quota_exceeded"
    again = upload(r, key, padded_lines("u", 80, 1000))  # nor an upload beside them
    assert again.status_code == 413, again.text
    listed = call(r, key, "GET", "/v1/batches").json()["data"]
    assert [b["id"] for b in listed] == [first.json()["id"]]
    # Deleting an ended batch (ours: OpenAI has no such route) gives its room back.
    finished(r, key, first.json()["id"])
    gone = call(r, key, "DELETE", f"/v1/batches/{first.json()['id']}")
    assert gone.status_code == 200 and gone.json()["deleted"] is True, gone.text
    assert call(r, key, "GET", f"/v1/batches/{first.json()['id']}").status_code == 404
    assert create(r, key, made.json()["id"]).status_code == 200


@pytest.mark.integration
def test_a_batchs_results_count_against_the_files_quota(router: RouterProcess) -> None:
    """A 30-line file of a few KB whose lines each ask for 8 choices of 300 tokens: the
    batch's results (about 330 KB) are stored bytes of its key too, so once it has ended
    past the 0.25 MiB quota even a 1 KB upload is refused, until the batch is deleted.
    Before, only the file and the copied lines counted: the results stored ~20x the
    quota, and uploads went on being accepted."""
    r = router
    key = new_key(r, "hostile-results")
    made = upload(r, key, [chat_line(f"r-{i}", n=8, max_tokens=300) for i in range(30)])
    assert made.status_code == 200, made.text
    batch = create(r, key, made.json()["id"])
    assert batch.status_code == 200, batch.text
    done = finished(r, key, batch.json()["id"])
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 30, done
    small = upload(r, key, [chat_line("s")])
    assert small.status_code == 413, small.text
    assert small.json()["error"]["code"] == "files_quota_exceeded"
    gone = call(r, key, "DELETE", f"/v1/batches/{batch.json()['id']}")
    assert gone.status_code == 200, gone.text
    assert upload(r, key, [chat_line("s")]).status_code == 200


@pytest.mark.integration
def test_a_key_holds_at_most_batches_per_key_in_flight(router: RouterProcess) -> None:
    """``batches_per_key: 2``: a third batch while two are in flight is a 429 in each
    API's shape, and one cancelled (ended) makes room. On 1a1e9ee all were accepted."""
    r = router
    key = new_key(r, "hostile-in-flight")
    file_id = upload(r, key, [chat_line(f"s-{i}", "slow", max_tokens=400)
                              for i in range(2)]).json()["id"]
    ids = []
    for _ in range(2):
        made = create(r, key, file_id)
        assert made.status_code == 200, made.text
        ids.append(made.json()["id"])
    third = create(r, key, file_id)
    assert third.status_code == 429, third.text
    assert third.json()["error"]["code"] == "too_many_batches"
    message = call(r, key, "POST", "/v1/messages/batches", {"requests": [
        {"custom_id": "a", "params": {"model": "m", "max_tokens": 1,
                                      "messages": [{"role": "user", "content": "hi"}]}}]})
    assert message.status_code == 429, message.text
    assert message.json()["type"] == "error"  # Anthropic's shape
    assert message.json()["error"]["type"] == "rate_limit_error"
    call(r, key, "POST", f"/v1/batches/{ids[0]}/cancel")
    assert finished(r, key, ids[0])["status"] == "cancelled"
    assert create(r, key, file_id).status_code == 200
    early = call(r, key, "DELETE", f"/v1/batches/{ids[1]}")  # in flight: not deleted
    assert early.status_code == 400 and early.json()["error"]["code"] == "batch_not_ended"
    call(r, key, "POST", f"/v1/batches/{ids[1]}/cancel")


@pytest.mark.integration
def test_a_message_batch_is_bounded_like_a_file(router: RouterProcess) -> None:
    """``files_max_mib: 0.1``: a message batch of about 200 KB is a 413, as an upload of
    that size is. On 1a1e9ee it was accepted (only ``max_body_bytes`` bounded it)."""
    r = router
    key = new_key(r, "hostile-message-batch")
    requests = [{"custom_id": f"r{i}", "params": {
        "model": "m", "max_tokens": 1,
        "messages": [{"role": "user", "content": "x" * 2000}]}} for i in range(100)]
    big = call(r, key, "POST", "/v1/messages/batches", {"requests": requests})
    assert big.status_code == 413, big.text
    assert big.json()["type"] == "error" and "files_max_mib" in big.json()["error"]["message"]
    small = call(r, key, "POST", "/v1/messages/batches", {"requests": requests[:10]})
    assert small.status_code == 200, small.text


@pytest.mark.integration
def test_a_create_retried_with_its_idempotency_key_makes_one_batch(
        router: RouterProcess) -> None:
    """A create whose answer was lost, sent again with the same ``Idempotency-Key``,
    answers the batch made the first time; another key's same value is its own. On
    1a1e9ee the retry made a second batch."""
    r = router
    key, other = new_key(r, "hostile-retry"), new_key(r, "hostile-retry-other")
    file_id = upload(r, key, [chat_line("i-0")]).json()["id"]
    headers = {"Idempotency-Key": "create-once-1"}
    first = create(r, key, file_id, headers=headers)
    again = create(r, key, file_id, headers=headers)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert again.json()["id"] == first.json()["id"]
    assert len(call(r, key, "GET", "/v1/batches").json()["data"]) == 1
    theirs = create(r, other, upload(r, other, [chat_line("i-0")]).json()["id"],
                    headers=headers)
    assert theirs.status_code == 200 and theirs.json()["id"] != first.json()["id"]
    message = {"requests": [{"custom_id": "a", "params": {
        "model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}}]}
    finished(r, key, first.json()["id"])
    one = call(r, key, "POST", "/v1/messages/batches", message,
               headers={"Idempotency-Key": "message-once"})
    two = call(r, key, "POST", "/v1/messages/batches", message,
               headers={"Idempotency-Key": "message-once"})
    assert one.status_code == 200 and two.json()["id"] == one.json()["id"]
    long = create(r, key, file_id, headers={"Idempotency-Key": "k" * 256})
    assert long.status_code == 400, long.text


# -- uploads -------------------------------------------------------------------------------

@pytest.mark.integration
def test_upload_spools_a_killed_router_left_are_removed_at_start(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A router killed (-9) mid-upload leaves its ``.upload-*`` spool in the files folder;
    the next start removes it, but not a spool another live process holds (locked, as an
    upload in progress holds its own). On 1a1e9ee the stale spool stayed for good."""
    import fcntl

    cache = tmp_path_factory.mktemp("spool-cache")
    folder = cache / "files"
    folder.mkdir()
    (folder / ".upload-stale1").write_bytes(b"x" * 1000)
    live = folder / ".upload-live"
    with live.open("wb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with running_router(PRESET, tmp_path_factory.mktemp("spools"), "spools",
                            {"cache": str(cache)}):
            assert not (folder / ".upload-stale1").exists()
            assert live.exists()


@pytest.mark.integration
def test_an_upload_leaves_no_spool_behind(router: RouterProcess) -> None:
    """An upload refused on the way (past ``files_max_mib``, or not a form) or kept leaves
    no ``.upload-*`` spool in the files folder."""
    r = router
    key = new_key(r, "hostile-spools")
    cache = next(ln for ln in r.preset.read_text().splitlines() if "cache_dir:" in ln)
    folder = Path(cache.split(":", 1)[1].strip()) / "files"
    assert upload(r, key, [chat_line("k")]).status_code == 200
    big = r.client.post(f"{r.url}/v1/files", headers={"Authorization": f"Bearer {key}"},
                        data={"purpose": "batch"}, files={"file": ("b.jsonl", b"x" * 200_000)},
                        timeout=60)
    assert big.status_code == 413, big.text
    bad = call(r, key, "POST", "/v1/files", content=b"--x\r\nnot a form",
               headers={"Content-Type": "multipart/form-data; boundary=x"})
    assert bad.status_code == 400, bad.text
    assert list(folder.glob(".upload-*")) == []


@pytest.mark.integration
def test_concurrent_uploads_on_postgresql_cannot_pass_the_quota_together(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Four routers' stores on one PostgreSQL database, sixteen uploads at once of one key
    whose quota fits one: exactly one is kept (the check and the insert are one
    transaction under the key's lock). On 1a1e9ee (a sum, then an insert, each its own
    statement under READ COMMITTED) several passed."""
    import asyncio

    from router.access.database import Database
    from router.batches.store import SCHEMA, BatchStore, QuotaExceeded
    from tests.test_postgres import Postgres

    server = Postgres()
    server.pg_ctl("start")
    try:
        folder = tmp_path_factory.mktemp("pg-files")

        async def race() -> int:
            dbs = [Database(server.url, SCHEMA) for _ in range(4)]
            stores = [BatchStore(db, folder, 150) for db in dbs]
            spools = []
            for i in range(16):
                spool = folder / f".upload-{i}"
                spool.write_bytes(b"x" * 100)
                spools.append(spool)
            for store in stores:  # the schema made before the race
                await store.files("racer", None, None, 1, newest_first=True)
            got = await asyncio.gather(*(
                stores[i % 4].add_file("racer", f"f{i}", "batch", spool)
                for i, spool in enumerate(spools)), return_exceptions=True)
            for db in dbs:
                db.close()
            assert all(not isinstance(g, BaseException) or isinstance(g, QuotaExceeded)
                       for g in got), got
            return sum(not isinstance(g, BaseException) for g in got)

        assert asyncio.run(race()) == 1
    finally:
        server.pg_ctl("-m", "immediate", "stop", check=False)
        shutil.rmtree(server.home, ignore_errors=True)


# -- a batch's input file, line by line (``router.api.batches.lines``) --------------------

def _scan_rows(tmp_path: Path, text: bytes, max_lines: int = 5) -> list[Any]:
    from router.api.batches.checks import Refused
    from router.api.batches.lines import rows, scan

    path = tmp_path / "in.jsonl"
    path.write_bytes(text)
    found = scan(path, "file-x", "/v1/chat/completions", max_lines)
    models: dict[str, str | Refused] = {name: f"id-{name}" for name in found.models}
    models.pop("hidden", None)
    return list(rows(path, "file-x", "/v1/chat/completions", models,
                     lambda cid, code, message: json.dumps([cid, code, message])))


def test_an_input_file_at_and_past_its_bounds(tmp_path: Path) -> None:
    """``batch_max_lines`` lines pass (blank ones not counted), one more is a 400; a file
    that is not UTF-8, holds no JSON object or repeats a ``custom_id`` is a 400."""
    from router.errors import BadRequest

    one = (json.dumps(chat_line("a")) + "\n").encode()
    five = b"".join(one.replace(b'"a"', f'"a{i}"'.encode()) + b"\n\n" for i in range(5))
    assert len(_scan_rows(tmp_path, five)) == 5
    for text, code in ((five + one, "too_many_lines"), (one + one, "duplicate_custom_id"),
                       (b"\xff\xfe" + one, "invalid_file"), (b"[1]\n{no\n", "invalid_file"),
                       (b"\n  \n", "invalid_file")):
        with pytest.raises(BadRequest) as err:
            _scan_rows(tmp_path, text)
        assert err.value.code == code, (text[:40], err.value.message)


def test_each_line_is_kept_as_it_came_or_refused_with_its_reason(tmp_path: Path) -> None:
    """A line's body is stored as the JSON text it came as (never decoded and encoded
    again); a line that cannot run is an error line with its reason."""
    kept = b'{"model": "m",   "messages": [], "x": 1.50, "y": "\\u00e9"}'
    lines = [b'{"custom_id": "ok", "url": "/v1/chat/completions", "body": ' + kept + b"}",
             json.dumps(chat_line("bg", background=True)).encode(),
             json.dumps(chat_line("st", stream=1)).encode(),
             json.dumps(chat_line("hid", "hidden")).encode(),
             json.dumps({**chat_line("get"), "method": "GET"}).encode(),
             json.dumps({**chat_line("url"), "url": "/v1/embeddings"}).encode(),
             json.dumps({"custom_id": "nobody", "url": "/v1/chat/completions",
                         "body": [1]}).encode(),
             json.dumps({"custom_id": "nomodel", "url": "/v1/chat/completions",
                         "body": {"model": ""}}).encode(),
             json.dumps({"url": "/v1/chat/completions", "body": {"model": "m"}}).encode(),
             b"{broken"]
    got = _scan_rows(tmp_path, b"\n".join(lines) + b"\n", max_lines=20)
    assert got[0].body == kept.decode() and got[0].model == "id-m" and got[0].state == "pending"
    reasons = {ln.custom_id: json.loads(ln.result)[1] for ln in got[1:]}
    assert reasons == {"bg": "invalid_body", "st": "invalid_body", "hid": "model_not_found",
                       "get": "invalid_method", "url": "invalid_url",
                       "nobody": "invalid_body", "nomodel": "missing_model",
                       "line-9": "missing_custom_id", "line-10": "invalid_json"}
    assert all(ln.state == "errored" and ln.body == "" for ln in got[1:])


def test_a_database_made_before_batch_stored_gains_it(tmp_path: Path) -> None:
    """A SQLite file made by 1a1e9ee's schema (no ``batch_stored``) is opened by this
    one: the table is made, an old batch counts nothing, and a new batch is counted and
    found again by its ``Idempotency-Key``."""
    import asyncio

    from router.access.database import Database
    from router.batches.store import (
        SCHEMA,
        BatchRow,
        BatchStore,
        Line,
        QuotaExceeded,
        TooManyBatches,
    )

    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = [s for s in SCHEMA if "batch_stored" not in s]
    assert len(old) == len(SCHEMA) - 3

    async def made_before() -> None:
        db = Database(url, old)
        store = BatchStore(db, tmp_path, 10_000)
        await store.add_batch(BatchRow("batch_old", "k", "openai", "/v1/chat/completions",
                                       None, "24h", "completed", 1.0, 2.0, total=1),
                              [Line(1, "a", "m", '{"model": "m"}')])
        db.close()

    async def opened_now() -> None:
        db = Database(url, SCHEMA)
        store = BatchStore(db, tmp_path, 10_000)
        assert await store.held("k") == 0
        row = BatchRow("batch_new", "k", "openai", "/v1/chat/completions", None, "24h",
                       "validating", 1.0, 2.0)
        made = await store.add_batch_checked(
            row, lambda: [Line(1, "b", "m", '{"model": "m"}')], 8, "once")
        assert made is row and row.total == 1
        assert await store.held("k") == len("b") + len('{"model": "m"}')
        again = BatchRow("batch_again", "k", "openai", "/v1/chat/completions", None, "24h",
                         "validating", 1.0, 2.0)
        found = await store.add_batch_checked(again, list, 8, "once")
        assert found.id == "batch_new"
        # Refused part-way (past the quota after CHUNK lines were written, or past
        # batches_per_key): nothing of it is left.
        big = [Line(n, f"c{n}", "m", "x" * 3) for n in range(1, 2001)]  # ~8 bytes each
        with pytest.raises(QuotaExceeded):
            await store.add_batch_checked(BatchRow(
                "batch_big", "k", "openai", "/v1/chat/completions", None, "24h",
                "validating", 1.0, 2.0), lambda: big, 8)
        with pytest.raises(TooManyBatches):
            await store.add_batch_checked(BatchRow(
                "batch_many", "k", "openai", "/v1/chat/completions", None, "24h",
                "validating", 1.0, 2.0), list, 1)
        left = await db.run(lambda c: c.execute(
            "SELECT (SELECT COUNT(*) FROM batch_lines WHERE batch IN ('batch_big', "
            "'batch_many')) + (SELECT COUNT(*) FROM batches WHERE id IN ('batch_big', "
            "'batch_many')) + (SELECT COUNT(*) FROM batch_stored WHERE batch IN "
            "('batch_big', 'batch_many'))"))
        assert left[0][0] == 0
        db.close()

    asyncio.run(made_before())
    asyncio.run(opened_now())


def test_an_upload_is_written_once_into_its_spool(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A 3 MiB file part goes straight into the ``.upload-*`` spool in the files folder,
    as it arrives: starlette's own temporary file (which 1a1e9ee's upload filled, then
    copied into the folder) is never written."""
    import asyncio
    import tempfile

    import starlette.formparsers
    from starlette.datastructures import Headers, UploadFile

    from router.api.batches.openai_files import _SpoolOnce

    written: list[int] = []

    class Watched(tempfile.SpooledTemporaryFile):  # type: ignore[type-arg]
        def write(self, data: bytes) -> int:  # type: ignore[override]
            written.append(len(data))
            return int(super().write(data))

    monkeypatch.setattr(starlette.formparsers, "SpooledTemporaryFile", Watched)
    data = b"0123456789abcdef" * (3 * 2**16)
    boundary = "spool-once"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch'
            f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="a.jsonl"\r\n\r\n').encode() + data + f"\r\n--{boundary}--\r\n".encode()

    async def chunks() -> Any:
        for at in range(0, len(body), 65536):
            yield body[at:at + 65536]

    async def parse() -> None:
        parser = _SpoolOnce(Headers({"content-type": f"multipart/form-data; boundary={boundary}"}),
                            chunks(), tmp_path)
        form = await parser.parse()
        upload = form.get("file")
        assert isinstance(upload, UploadFile) and upload.size == len(data)
        assert parser.spool is not None and parser.spool.parent == tmp_path
        assert parser.spool.name.startswith(".upload-")
        upload.file.flush()
        assert parser.spool.read_bytes() == data
        parser.discard()
        assert not parser.spool.exists()

    asyncio.run(parse())
    assert written == []
