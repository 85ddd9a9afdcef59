"""``modelyard batches list|show|cancel`` against a running router with synthetic models:
a table of the key's batches, one batch as JSON, a cancel that ends a running batch
``cancelled``; the key from ``--key`` or ``MODELYARD_API_KEY``; another key's batch and a
router that is not there are errors (exit status 1) with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from router.cli import main
from tests.conftest import ROOT, RouterProcess, free_port, running_router
from tests.test_batches import client, finished, line, upload

ALICE, BOB = "k-alice-cli-1a", "k-bob-cli-2b"
PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  cache_dir: {cache}
  api_keys: [k-alice-cli-1a, k-bob-cli-2b]
  admin_api_keys: [k-admin-cli-3c]  # else every key is an admin's
  batch_model_concurrency: 1
models:
  fast: {model: /synthetic, engine: synthetic}
  slow: {model: /synthetic, engine: synthetic, engine_args: {tokens_per_second: 10}}
"""


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with running_router(PRESET, tmp_path_factory.mktemp("batches-cli"), "batches-cli",
                        {"cache": str(tmp_path_factory.mktemp("batches-cli-cache"))}) as r:
        yield r


def test_list_show_and_cancel(router: RouterProcess, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    c = client(router, ALICE)
    quick = c.batches.create(input_file_id=upload(c, [line("q-0", model="fast"),
                                                      line("q-1", model="fast")]),
                             endpoint="/v1/chat/completions", completion_window="24h")
    assert finished(c, quick.id).status == "completed"
    slow = c.batches.create(input_file_id=upload(c, [line(f"s-{i}", model="slow",
                                                          max_tokens=30) for i in range(8)]),
                            endpoint="/v1/chat/completions", completion_window="24h")
    url = ["batches", "--url", router.url]

    assert main([*url, "--key", ALICE, "list"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split() == ["id", "status", "done", "failed", "endpoint", "created"]
    by_id = {row.split()[0]: row.split() for row in rows[1:]}
    assert list(by_id) == [slow.id, quick.id]  # newest first
    assert by_id[quick.id][1:5] == ["completed", "2/2", "0", "/v1/chat/completions"]
    assert by_id[slow.id][1] in ("validating", "in_progress")

    assert main([*url, "--key", ALICE, "show", quick.id]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["id"] == quick.id and shown["object"] == "batch"
    assert shown["request_counts"] == {"total": 2, "completed": 2, "failed": 0}

    monkeypatch.setenv("MODELYARD_API_KEY", ALICE)  # the key from the environment
    assert main([*url, "cancel", slow.id]) == 0
    assert json.loads(capsys.readouterr().out)["status"] in ("cancelling", "cancelled")
    done = finished(c, slow.id)
    assert done.status == "cancelled" and done.request_counts.completed < 8, done

    monkeypatch.setenv("MODELYARD_API_KEY", BOB)  # another key: its own (none)
    assert main([*url, "list"]) == 0
    assert capsys.readouterr().out == "no batches\n"
    assert main([*url, "show", quick.id]) == 1
    assert f"HTTP 404: No such batch: '{quick.id}'" in capsys.readouterr().err
    assert main([*url, "--key", "k-wrong", "list"]) == 1
    assert "HTTP 401" in capsys.readouterr().err
    assert main(["batches", "--url", f"http://127.0.0.1:{free_port()}", "list"]) == 1
    assert "modelyard: http://127.0.0.1:" in capsys.readouterr().err


def test_the_installed_command_reads_its_url_and_key_from_the_environment(
        router: RouterProcess) -> None:
    env = dict(os.environ, MODELYARD_URL=router.url, MODELYARD_API_KEY=BOB)
    ran = subprocess.run([sys.executable, "-m", "router", "batches", "list"], check=False,
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, "no batches\n", "")
