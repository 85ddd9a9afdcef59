"""The limits matrix (``router.access.limit_table``) walked against a real router: every
per-key limit × every way work enters, one cell per test.

A cell that holds is driven past its limit that way, with a key of its own and a small
limit, and must be refused in its protocol's shape (a status and code; for a batch line
the error file's line, for a message batch request its ``errored`` result; for a
background response its ``failed`` state, or a 429 at its create); where it is cheap a
cell first shows its key works within the limit, so a refusal for another reason cannot
pass. A cell that does not apply is stated with
its reason; where that is a decision (a batch line is not counted by ``rpm`` or
``max_concurrent``) the cell's driver checks it. A cell of ``LIMITS`` × ``WAYS`` missing
from the table, a cell that holds without a driver here, or an enforcer whose name no
longer exists fails.

One router with synthetic models serves the whole module (each token one word; ``slow``
writes 5 tokens a second, so a stream of it stays open while a cell looks).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.access import limit_table
from router.access.limit_table import CLOSED, LIMITS, SETTINGS, TABLE, WAYS
from shared.config import ServerConfig
from tests.conftest import RouterProcess, running_router

ADMIN = "k-admin-limits-7f3a"
IN_FLIGHT = 1
"""The per-key bound on batches in flight this router runs with."""
PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  cache_dir: {cache}
  admin_api_keys: [k-admin-limits-7f3a]
  auth_failures_per_minute: 0
  batch_model_concurrency: 4
  files_quota_mib: 0.02  # 20 KiB a key
  responses_store_items: 2
{extra}
models:
  m: {model: /synthetic, engine: synthetic}
  other: {model: /synthetic, engine: synthetic}
  slow: {model: /synthetic, engine: synthetic, engine_args: {tokens_per_second: 5}}
  vectors: {model: /synthetic, engine: synthetic, task: embed}
  ranker: {model: /synthetic, engine: synthetic, task: score}
"""
HI = [{"role": "user", "content": "hi"}]
LONG = " ".join(["word"] * 200)
"""A prompt no budget of ``BUDGET`` tokens can hold (200 tokens, 1 000 bytes)."""
BUDGET = [{"tokens": 60, "period": "day"}]
ENDED = ("completed", "failed", "expired", "cancelled")


class Router:
    """The module's router, its admin key, and a key per cell."""

    def __init__(self, process: RouterProcess) -> None:
        self.process = process
        self.client = httpx.Client(base_url=process.url, timeout=60)

    def call(self, key: str, method: str, path: str, body: object = None,
             **kw: Any) -> httpx.Response:
        return self.client.request(method, path, json=body,
                                   headers={"Authorization": f"Bearer {key}"}, **kw)

    def key(self, name: str, **spec: Any) -> str:
        made = self.call(ADMIN, "POST", "/v1/keys", {"name": name, **spec})
        assert made.status_code == 201, made.text
        secret: str = made.json()["key"]
        return secret

    # -- the ways in -------------------------------------------------------------------

    def chat(self, key: str, model: str = "m", stream: bool = False,
             content: str = "hi", max_tokens: int = 4) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "stream": stream}
        if not stream:
            return self.call(key, "POST", "/v1/chat/completions", body)
        with self.client.stream("POST", "/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as got:
            got.read()
            return got

    def background(self, key: str, model: str = "m", text: str = "hi",
                   max_tokens: int = 4) -> httpx.Response:
        return self.call(key, "POST", "/v1/responses", {
            "model": model, "input": text, "max_output_tokens": max_tokens,
            "background": True})

    def response_ended(self, key: str, rid: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.call(key, "GET", f"/v1/responses/{rid}")
            assert got.status_code == 200, got.text
            if got.json()["status"] not in ("queued", "in_progress"):
                return dict(got.json())
            time.sleep(0.1)
        raise TimeoutError(f"response {rid} still running")

    def upload(self, key: str, data: bytes) -> httpx.Response:
        return self.client.post("/v1/files", files={"file": ("in.jsonl", data)},
                                data={"purpose": "batch"},
                                headers={"Authorization": f"Bearer {key}"})

    def create_batch(self, key: str, endpoint: str, bodies: list[dict[str, Any]]
                     ) -> httpx.Response:
        lines = [{"custom_id": f"line-{n}", "method": "POST", "url": endpoint, "body": b}
                 for n, b in enumerate(bodies)]
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = self.upload(key, data)
        assert uploaded.status_code == 200, uploaded.text
        return self.call(key, "POST", "/v1/batches", {
            "input_file_id": uploaded.json()["id"], "endpoint": endpoint,
            "completion_window": "24h"})

    def batch(self, key: str, endpoint: str, bodies: list[dict[str, Any]]
              ) -> list[dict[str, Any]]:
        """Each line's output or error-file line, in line order (the batch, polled and
        read with the admin key, so the cell's key spends nothing more)."""
        made = self.create_batch(key, endpoint, bodies)
        assert made.status_code == 200, made.text
        batch = self.ended(f"/v1/batches/{made.json()['id']}", "status", ENDED)
        assert batch["status"] == "completed", batch
        out: dict[str, dict[str, Any]] = {}
        for file_id in (batch.get("output_file_id"), batch.get("error_file_id")):
            if file_id:
                text = self.call(ADMIN, "GET", f"/v1/files/{file_id}/content").text
                for line in text.splitlines():
                    item = json.loads(line)
                    out[item["custom_id"]] = item
        return [out[f"line-{n}"] for n in range(len(bodies))]

    def create_message_batch(self, key: str, params: list[dict[str, Any]]) -> httpx.Response:
        return self.call(key, "POST", "/v1/messages/batches", {"requests": [
            {"custom_id": f"req-{n}", "params": p} for n, p in enumerate(params)]})

    def message_batch(self, key: str, params: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each request's result, in order."""
        made = self.create_message_batch(key, params)
        assert made.status_code == 200, made.text
        path = f"/v1/messages/batches/{made.json()['id']}"
        self.ended(path, "processing_status", ("ended",))
        got = self.call(ADMIN, "GET", path + "/results")
        assert got.status_code == 200, got.text
        out = {item["custom_id"]: item["result"]
               for item in map(json.loads, got.text.splitlines())}
        return [out[f"req-{n}"] for n in range(len(params))]

    def ended(self, path: str, field: str, states: tuple[str, ...],
              timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.call(ADMIN, "GET", path)
            assert got.status_code == 200, got.text
            if got.json()[field] in states:
                return dict(got.json())
            time.sleep(0.1)
        raise TimeoutError(f"{path} still {got.json()[field]}")

    @contextlib.contextmanager
    def held_stream(self, key: str) -> Iterator[None]:
        """A stream of ``key``'s on ``slow``, begun (its first bytes read) and open."""
        body = {"model": "slow", "messages": HI, "max_tokens": 200, "stream": True}
        with self.client.stream("POST", "/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as got:
            assert got.status_code == 200, got.read()
            chunks = got.iter_bytes()  # kept: a generator let go closes the connection
            next(chunks)
            yield


# -- what a refusal looks like, per protocol ----------------------------------------------

def refused(got: httpx.Response, status: int, code: str) -> None:
    assert got.status_code == status, got.text
    assert got.json()["error"]["code"] == code, got.text


def line_refused(item: dict[str, Any], code: str, status: int | None = None) -> None:
    """An error-file line: refused at the create (``error.code``) or, with ``status``,
    refused when it ran (the handler's answer)."""
    if item.get("error"):
        assert item["error"]["code"] == code, item
        return
    assert status is not None, item
    assert item["response"]["status_code"] == status, item
    assert item["response"]["body"]["error"]["code"] == code, item


def line_ok(item: dict[str, Any]) -> None:
    assert not item.get("error") and item["response"]["status_code"] == 200, item


def request_errored(result: dict[str, Any], kind: str) -> None:
    assert result["type"] == "errored", result
    assert result["error"]["error"]["type"] == kind, result


def chat_line(model: str = "m", content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, **extra}


def message(model: str = "m", content: str = "hi") -> dict[str, Any]:
    return {"model": model, "max_tokens": 4,
            "messages": [{"role": "user", "content": content}]}


# -- the drivers: one per cell that holds (and per decision that a cell does not) ---------

Driver = Callable[[Router, str], None]
DRIVERS: dict[tuple[str, str], Driver] = {}


def cell(limit: str, way: str) -> Callable[[Driver], Driver]:
    def register(driver: Driver) -> Driver:
        assert (limit, way) not in DRIVERS
        DRIVERS[limit, way] = driver
        return driver
    return register


# models: a key limited to ``m`` asks for ``other``
@cell("models", "request")
def _(r: Router, name: str) -> None:
    key = r.key(name, models=["m"])
    assert r.chat(key).status_code == 200
    refused(r.chat(key, model="other"), 404, "model_not_found")


@cell("models", "stream")
def _(r: Router, name: str) -> None:
    key = r.key(name, models=["m"])
    assert r.chat(key, stream=True).status_code == 200
    refused(r.chat(key, model="other", stream=True), 404, "model_not_found")


@cell("models", "background")
def _(r: Router, name: str) -> None:
    key = r.key(name, models=["m"])
    assert r.background(key).status_code == 200
    refused(r.background(key, model="other"), 404, "model_not_found")


@cell("models", "batch")
def _(r: Router, name: str) -> None:
    key = r.key(name, models=["m"])
    ok, other = r.batch(key, "/v1/chat/completions", [chat_line(), chat_line("other")])
    line_ok(ok)
    line_refused(other, "model_not_found", 404)


@cell("models", "message_batch")
def _(r: Router, name: str) -> None:
    key = r.key(name, models=["m"])
    ok, other = r.message_batch(key, [message(), message("other")])
    assert ok["type"] == "succeeded", ok
    assert other["type"] == "errored", other
    assert other["error"]["error"]["type"] in ("invalid_request_error", "not_found_error"), other
    assert "model" in other["error"]["error"]["message"], other


# rpm: 2 requests a minute; the third that way is a 429
@cell("rpm", "request")
def _(r: Router, name: str) -> None:
    key = r.key(name, rpm=2)
    assert [r.chat(key).status_code for _ in range(2)] == [200, 200]
    refused(r.chat(key), 429, "rate_limit_exceeded")


@cell("rpm", "stream")
def _(r: Router, name: str) -> None:
    key = r.key(name, rpm=2)
    assert [r.chat(key, stream=True).status_code for _ in range(2)] == [200, 200]
    refused(r.chat(key, stream=True), 429, "rate_limit_exceeded")


@cell("rpm", "background")
def _(r: Router, name: str) -> None:
    key = r.key(name, rpm=2)
    assert [r.background(key).status_code for _ in range(2)] == [200, 200]
    refused(r.background(key), 429, "rate_limit_exceeded")


@cell("rpm", "upload")
def _(r: Router, name: str) -> None:
    key = r.key(name, rpm=2)
    assert [r.upload(key, b"{}\n").status_code for _ in range(2)] == [200, 200]
    refused(r.upload(key, b"{}\n"), 429, "rate_limit_exceeded")


@cell("rpm", "batch")
def _(r: Router, name: str) -> None:
    """Does not apply: the upload and the create take two of 3; four lines all run."""
    key = r.key(name, rpm=3)
    for item in r.batch(key, "/v1/chat/completions", [chat_line()] * 4):
        line_ok(item)


@cell("rpm", "message_batch")
def _(r: Router, name: str) -> None:
    """Does not apply: the create takes one of 2; three requests all run."""
    key = r.key(name, rpm=2)
    for result in r.message_batch(key, [message()] * 3):
        assert result["type"] == "succeeded", result


# tpm: 10 tokens a minute; one request of 5 + 16 tokens spends them, then that way is a 429
def _spent(r: Router, name: str) -> str:
    key = r.key(name, tpm=10)
    assert r.chat(key, max_tokens=16).status_code == 200  # 5 + 16 tokens: the minute's
    return key


@cell("tpm", "request")
def _(r: Router, name: str) -> None:
    refused(r.chat(_spent(r, name)), 429, "rate_limit_exceeded")


@cell("tpm", "stream")
def _(r: Router, name: str) -> None:
    refused(r.chat(_spent(r, name), stream=True), 429, "rate_limit_exceeded")


@cell("tpm", "background")
def _(r: Router, name: str) -> None:
    key = _spent(r, name)
    made = r.background(key)
    assert made.status_code in (200, 429), made.text
    if made.status_code == 429:  # refused at the create: as good
        refused(made, 429, "rate_limit_exceeded")
        return
    ended = r.response_ended(key, made.json()["id"])
    assert ended["status"] == "failed", ended
    assert ended["error"]["code"] == "rate_limit_exceeded", ended


@cell("tpm", "batch")
def _(r: Router, name: str) -> None:
    (item,) = r.batch(_spent(r, name), "/v1/chat/completions", [chat_line()])
    line_refused(item, "rate_limit_exceeded", 429)


@cell("tpm", "message_batch")
def _(r: Router, name: str) -> None:
    (result,) = r.message_batch(_spent(r, name), [message()])
    request_errored(result, "rate_limit_error")


# max_concurrent: 1; a stream of the key's holds it
@cell("max_concurrent", "request")
def _(r: Router, name: str) -> None:
    key = r.key(name, max_concurrent=1)
    with r.held_stream(key):
        refused(r.chat(key), 429, "rate_limit_exceeded")


@cell("max_concurrent", "stream")
def _(r: Router, name: str) -> None:
    key = r.key(name, max_concurrent=1)
    with r.held_stream(key):
        refused(r.chat(key, stream=True), 429, "rate_limit_exceeded")


@cell("max_concurrent", "background")
def _(r: Router, name: str) -> None:
    """A background run holds its key's place until it ends: the next create and any
    request are 429s; following and cancelling it are not counted."""
    key = r.key(name, max_concurrent=1)
    made = r.background(key, model="slow", max_tokens=200)
    assert made.status_code == 200, made.text
    refused(r.background(key), 429, "rate_limit_exceeded")
    refused(r.chat(key), 429, "rate_limit_exceeded")
    rid = made.json()["id"]
    assert r.call(key, "POST", f"/v1/responses/{rid}/cancel").status_code == 200
    assert r.response_ended(key, rid)["status"] == "cancelled"
    assert r.chat(key).status_code == 200


@cell("max_concurrent", "upload")
def _(r: Router, name: str) -> None:
    key = r.key(name, max_concurrent=1)
    with r.held_stream(key):
        refused(r.upload(key, b"{}\n"), 429, "rate_limit_exceeded")


@cell("max_concurrent", "batch")
def _(r: Router, name: str) -> None:
    """Does not apply: with its lines running, the key's own request still gets in."""
    key = r.key(name, max_concurrent=1)
    made = r.create_batch(key, "/v1/chat/completions",
                          [chat_line("slow", max_tokens=10)] * 2)
    assert made.status_code == 200, made.text
    path = f"/v1/batches/{made.json()['id']}"
    r.ended(path, "status", ("in_progress", *ENDED))
    assert r.chat(key).status_code == 200
    assert r.ended(path, "status", ENDED)["request_counts"]["completed"] == 2


# budgets: 60 tokens a day; a prompt of 200 words cannot fit
@cell("budget_generation", "request")
def _(r: Router, name: str) -> None:
    key = r.key(name, budgets=BUDGET)
    assert r.chat(key).status_code == 200
    refused(r.chat(key, content=LONG), 429, "budget_exceeded")


@cell("budget_generation", "stream")
def _(r: Router, name: str) -> None:
    key = r.key(name, budgets=BUDGET)
    refused(r.chat(key, content=LONG, stream=True), 429, "budget_exceeded")


@cell("budget_generation", "background")
def _(r: Router, name: str) -> None:
    key = r.key(name, budgets=BUDGET)
    made = r.background(key, text=LONG)
    assert made.status_code in (200, 429), made.text
    if made.status_code == 429:  # refused at the create: as good
        refused(made, 429, "budget_exceeded")
        return
    ended = r.response_ended(key, made.json()["id"])
    assert ended["status"] == "failed", ended
    assert ended["error"]["code"] == "rate_limit_exceeded", ended
    assert "budget" in ended["error"]["message"], ended


@cell("budget_generation", "batch")
def _(r: Router, name: str) -> None:
    key = r.key(name, budgets=BUDGET)
    ok, long = r.batch(key, "/v1/chat/completions", [chat_line(), chat_line(content=LONG)])
    line_ok(ok)
    line_refused(long, "budget_exceeded", 429)


@cell("budget_generation", "message_batch")
def _(r: Router, name: str) -> None:
    key = r.key(name, budgets=BUDGET)
    (result,) = r.message_batch(key, [message(content=LONG)])
    request_errored(result, "rate_limit_error")


@cell("budget_embeddings", "request")
def _(r: Router, name: str) -> None:
    key = r.key(name, budgets=BUDGET)
    assert r.call(key, "POST", "/v1/embeddings", {"model": "vectors", "input": "hi"}
                  ).status_code == 200
    refused(r.call(key, "POST", "/v1/embeddings", {"model": "vectors", "input": LONG}),
            429, "budget_exceeded")


@cell("budget_embeddings", "batch")
def _(r: Router, name: str) -> None:
    key = r.key(name, budgets=BUDGET)
    (item,) = r.batch(key, "/v1/embeddings", [{"model": "vectors", "input": LONG}])
    line_refused(item, "budget_exceeded", 429)


@cell("budget_scoring", "request")
def _(r: Router, name: str) -> None:
    key = r.key(name, budgets=BUDGET)
    assert r.call(key, "POST", "/v1/score", {"model": "ranker", "text_1": "a",
                                             "text_2": ["a"]}).status_code == 200
    refused(r.call(key, "POST", "/v1/score", {"model": "ranker", "text_1": LONG,
                                              "text_2": [LONG]}), 429, "budget_exceeded")
    refused(r.call(key, "POST", "/v1/rerank", {"model": "ranker", "query": LONG,
                                               "documents": [LONG]}), 429, "budget_exceeded")


@cell("budget_scoring", "batch")
def _(r: Router, name: str) -> None:
    key = r.key(name, budgets=BUDGET)
    (item,) = r.batch(key, "/v1/score", [{"model": "ranker", "text_1": LONG,
                                          "text_2": [LONG]}])
    line_refused(item, "budget_exceeded", 429)


# files quota: 20 KiB a key
QUOTA = int(0.02 * 2**20)


@cell("files_quota", "upload")
def _(r: Router, name: str) -> None:
    key = r.key(name)
    assert r.upload(key, b" " * (QUOTA // 2)).status_code == 200
    refused(r.upload(key, b" " * (QUOTA - QUOTA // 2 + 1)), 413, "files_quota_exceeded")


@cell("files_quota", "batch")
def _(r: Router, name: str) -> None:
    """A file of 12 KiB is within the quota; the batch made of it stores as much again."""
    key = r.key(name)
    padding = "x" * (12 * 1024 // 3)
    made = r.create_batch(key, "/v1/chat/completions",
                          [chat_line(user=padding) for _ in range(3)])
    assert made.status_code in (413, 429), made.text
    assert "quota" in made.json()["error"]["code"], made.text


@cell("files_quota", "message_batch")
def _(r: Router, name: str) -> None:
    key = r.key(name)
    params = [message(content="x" * (QUOTA // 4)) for _ in range(5)]
    made = r.create_message_batch(key, params)
    assert made.status_code in (413, 429), made.text
    assert "quota" in made.json()["error"]["message"], made.text


# the store bound: 2 responses a key
def _kept(r: Router, key: str, ids: list[str], in_order: bool = True) -> None:
    """Of ``ids`` (three, stored in that order) the key finds 2, the first gone (only
    ``in_order``: a run that goes on writes its response again)."""
    found = [r.call(key, "GET", f"/v1/responses/{rid}").status_code for rid in ids]
    assert found.count(200) <= 2 and set(found) <= {200, 404}, found
    if in_order:
        assert found == [404, 200, 200], found


@cell("store_bound", "request")
def _(r: Router, name: str) -> None:
    key = r.key(name)
    made = [r.call(key, "POST", "/v1/responses", {"model": "m", "input": "hi",
                                                   "max_output_tokens": 4})
            for _ in range(3)]
    assert all(m.status_code == 200 for m in made), [m.text for m in made]
    _kept(r, key, [m.json()["id"] for m in made])


@cell("store_bound", "stream")
def _(r: Router, name: str) -> None:
    key = r.key(name)
    ids = []
    for _ in range(3):
        got = r.call(key, "POST", "/v1/responses", {"model": "m", "input": "hi",
                                                     "max_output_tokens": 4, "stream": True})
        assert got.status_code == 200, got.text
        created = next(json.loads(ln[6:]) for ln in got.text.splitlines()
                       if ln.startswith("data: ") and "response.created" in ln)
        ids.append(created["response"]["id"])
    _kept(r, key, ids)


@cell("store_bound", "background")
def _(r: Router, name: str) -> None:
    key = r.key(name)
    made = [r.background(key) for _ in range(3)]
    assert all(m.status_code == 200 for m in made), [m.text for m in made]
    ids = [m.json()["id"] for m in made]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until each has ended or is gone
        got = [r.call(key, "GET", f"/v1/responses/{rid}") for rid in ids]
        if all(g.status_code == 404 or g.json()["status"] not in ("queued", "in_progress")
               for g in got):
            break
        time.sleep(0.1)
    _kept(r, key, ids, in_order=False)


@cell("store_bound", "batch")
def _(r: Router, name: str) -> None:
    key = r.key(name)
    items = r.batch(key, "/v1/responses",
                    [{"model": "m", "input": "hi", "max_output_tokens": 4}] * 3)
    for item in items:
        line_ok(item)
    _kept(r, key, [item["response"]["body"]["id"] for item in items], in_order=False)


# batches in flight: the server's per-key bound (``SETTINGS``)
def _in_flight(r: Router, name: str, create: Callable[[str], httpx.Response],
               other: Callable[[str], httpx.Response], refusal: Callable[[Any], str],
               expected: str) -> None:
    """``IN_FLIGHT`` batches of one kind on ``slow`` (running), then one of ``other``'s:
    a 429, whose ``refusal(body)`` is ``expected``; the running ones are then cancelled."""
    setting = SETTINGS["batches_in_flight"]
    assert setting in ServerConfig.__struct_fields__, (
        f"the server has no per-key bound on batches in flight (server.{setting})")
    key = r.key(name)
    slow = [create(key) for _ in range(IN_FLIGHT)]
    assert all(made.status_code == 200 for made in slow), [m.text for m in slow]
    past = other(key)
    for made in slow:
        body = made.json()
        path = (f"/v1/batches/{body['id']}" if body.get("object") == "batch"
                else f"/v1/messages/batches/{body['id']}")
        r.call(ADMIN, "POST", path + "/cancel")
    assert past.status_code == 429, past.text
    assert refusal(past.json()) == expected, past.text


def _slow_batch(r: Router) -> Callable[[str], httpx.Response]:
    return lambda key: r.create_batch(key, "/v1/chat/completions",
                                      [chat_line("slow", max_tokens=200)])


def _slow_message_batch(r: Router) -> Callable[[str], httpx.Response]:
    return lambda key: r.create_message_batch(key, [{**message("slow"), "max_tokens": 200}])


@cell("batches_in_flight", "batch")
def _(r: Router, name: str) -> None:
    _in_flight(r, name, _slow_message_batch(r), _slow_batch(r),
               lambda body: body["error"]["code"], "too_many_batches")


@cell("batches_in_flight", "message_batch")
def _(r: Router, name: str) -> None:
    _in_flight(r, name, _slow_batch(r), _slow_message_batch(r),
               lambda body: body["error"]["type"], "rate_limit_error")


# -- the module's router --------------------------------------------------------------------

@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    setting = SETTINGS["batches_in_flight"]
    extra = (f"  {setting}: {IN_FLIGHT}" if setting in ServerConfig.__struct_fields__
             else "")
    cache = tmp_path_factory.mktemp("limits-cache")
    with running_router(PRESET, tmp_path_factory.mktemp("limits"), "limits",
                        {"cache": str(cache), "extra": extra}) as process:
        r = Router(process)
        yield r
        r.client.close()


# -- the matrix ---------------------------------------------------------------------------

def test_every_limit_meets_every_way_in() -> None:
    assert limit_table.missing() == []
    holding = {c for c, rule in TABLE.items() if rule.holds}
    assert sorted(holding - DRIVERS.keys()) == [], "a cell that holds without a driver"
    assert sorted(DRIVERS.keys() - TABLE.keys()) == [], "a driver for no cell"
    for rule in [*TABLE.values(), *CLOSED.values()]:
        if rule.enforcer is not None:
            module, _, path = rule.enforcer.partition(":")
            found: Any = importlib.import_module(module)
            for part in path.split(".") if path else ():
                found = getattr(found, part)  # an enforcer renamed: the table says so
    for limit in SETTINGS:
        assert limit in LIMITS


def test_the_security_page_prints_the_limits_as_they_are() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    shown = page.split("<!-- limits-table:start -->\n", 1)[1].split(
        "\n<!-- limits-table:end -->", 1)[0]
    assert shown == limit_table.markdown(), (
        "docs/security.md's limits matrix: paste `python -m router.access limits`")


CELLS = [(limit, way) for limit in LIMITS for way in WAYS]


@pytest.mark.parametrize(("limit", "way"), CELLS, ids=[f"{c[0]}-{c[1]}" for c in CELLS])
def test_the_cell(router: Router, limit: str, way: str) -> None:
    rule = TABLE.get((limit, way))
    assert rule is not None, f"{limit} × {way} has no cell in router.access.limit_table"
    driver = DRIVERS.get((limit, way))
    if driver is None:
        assert not rule.holds, f"{limit} × {way} holds, but nothing here drives it"
        return  # does not apply, and the reason is all there is to it
    driver(router, f"c-{limit}-{way}".replace("_", "-"))


def test_a_batch_line_opens_no_stream_and_no_background_run(router: Router) -> None:
    """The closed ways in (``CLOSED``): a line's stream or background run would outlive
    the line, beside the batch's limits, its cancel and its key's revocation."""
    key = router.key("c-closed", max_concurrent=1)
    streamed, background = router.batch(key, "/v1/responses", [
        {"model": "slow", "input": "hi", "max_output_tokens": 200, "stream": True},
        {"model": "slow", "input": "hi", "max_output_tokens": 200, "background": True}])
    line_refused(streamed, "invalid_body")
    assert background.get("error") or background["response"]["status_code"] == 400, (
        f"a batch line started a background response: {background}")
    if background.get("error"):
        line_refused(background, "invalid_body")
    assert router.chat(key).status_code == 200  # nothing of the key's is left running
    assert set(CLOSED) == {"a stream from a batch line",
                           "a background response from a batch line"}
