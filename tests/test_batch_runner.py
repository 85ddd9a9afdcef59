"""The batch runner against a hostile key and a bad day (issue 38): a batch's lines paged
from the database (the runner holds one page, whatever the batch's size) and its results
streamed a page at a time (finding 2); a database outage past ``STALE_MAX`` is not a
revocation (finding 5); a revocation ends the key's streams, background responses and
batches; a batch line run again after a kill -9 is charged once.

In-process apps (``build_app`` in its lifespan, driven over ASGI) with synthetic workers,
and one real router for a stream that must be read as it goes. No timing is asserted:
deadlines are generous, and what is waited for is an event (a status, an end).
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
from router.batches.store import BatchStore
from shared.config import load_preset
from tests.conftest import RouterProcess, running_router

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
