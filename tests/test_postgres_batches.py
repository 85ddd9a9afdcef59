"""Batches on PostgreSQL shared by two routers (issue 29): the one that took a batch runs
it, and the other takes it over when it dies. A module of its own: its own PostgreSQL
server (``tests.test_postgres.Postgres``), so no other test's routers, which serve other
models, share the database and take the batch over."""

from __future__ import annotations

import time

import pytest

from tests import test_postgres
from tests.conftest import running_router
from tests.test_postgres import ADMIN, Postgres, PostgresRouter

postgres = test_postgres.postgres  # the fixture (module-scoped): a server of this module's own

pytestmark = pytest.mark.integration


BATCH_PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  admin_api_keys: [k-admin-pg-31]
  database_url: "{database}"
  cache_dir: "{cache}"
  batch_model_concurrency: 2
models:
  slow: {model: /synthetic, engine: synthetic, engine_args: {tokens_per_second: 10}}
"""


def test_a_batch_is_taken_over_when_its_router_dies(
        postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two routers on one database (and one cache dir, where uploads lie): the one that
    took a batch runs it; killed (-9) mid-way, the other takes it over once its lease
    ran out (``router.batches.runner.LEASE``), and every ``custom_id`` is answered once."""
    import json

    from router.batches.runner import LEASE

    workdir = tmp_path_factory.mktemp("pg-batch")
    subst = {"database": postgres.url, "cache": str(tmp_path_factory.mktemp("pg-cache"))}
    lines = "".join(json.dumps({
        "custom_id": f"t-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "slow", "max_tokens": 10,
                 "messages": [{"role": "user", "content": "hi"}]}}) + "\n" for i in range(16))
    with running_router(BATCH_PRESET, workdir, "pg-batch-b", subst, PostgresRouter) as b:
        with running_router(BATCH_PRESET, workdir, "pg-batch-a", subst, PostgresRouter) as a:
            a.client.headers["Authorization"] = b.client.headers["Authorization"] = \
                f"Bearer {ADMIN}"
            made = a.client.post(f"{a.url}/v1/files", data={"purpose": "batch"}, timeout=60,
                                 files={"file": ("in.jsonl", lines.encode())})
            batch = a.client.post(f"{a.url}/v1/batches", timeout=60, json={
                "input_file_id": made.json()["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"}).json()
            deadline = time.monotonic() + 30
            while a.client.get(f"{a.url}/v1/batches/{batch['id']}").json()[
                    "request_counts"]["completed"] < 2:
                assert time.monotonic() < deadline, a.tail()
                time.sleep(0.1)
            assert a.proc is not None
            a.proc.kill()
            a.proc.wait()
        killed = time.monotonic()
        deadline = killed + LEASE + 60
        while True:
            got = b.client.get(f"{b.url}/v1/batches/{batch['id']}").json()
            if got["status"] == "completed":
                break
            assert time.monotonic() < deadline, (got, b.tail())
            time.sleep(0.5)
        errors = b.client.get(f"{b.url}/v1/files/{got.get('error_file_id')}/content").text
        assert got["request_counts"] == {"total": 16, "completed": 16, "failed": 0}, errors[:600]
        out = b.client.get(f"{b.url}/v1/files/{got['output_file_id']}/content").text
        ids = [json.loads(ln)["custom_id"] for ln in out.splitlines()]
        assert sorted(ids) == sorted(f"t-{i}" for i in range(16))  # each once
