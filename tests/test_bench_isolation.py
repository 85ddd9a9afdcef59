"""Benchmarks and tests keep to themselves (issue 38): a benchmark's router and a test's
write their database, uploaded files and usage rows into a cache of their own, never into
the user's ``~/.cache/modelyard`` (whose status page then showed a stranger's batches);
the embedded model's folder is still the shared one, linked in, converted once."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from bench.common import modelyard
from shared.config import CACHE_VARIABLE, default_cache_dir
from worker.materialize import link_builtins

SYNTHETIC = """server: {host: 127.0.0.1, port: {port}, spare_workers: 0}
models:
  m: {model: /synthetic, engine: synthetic}
"""


def users_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "modelyard"


def test_a_tests_routers_and_apps_have_a_cache_of_the_sessions_own(own_cache: Path) -> None:
    """On main 1a1e9ee an app or router a test made without a ``cache_dir`` used the
    user's cache: its database, batch files and runner lock."""
    assert os.environ.get(CACHE_VARIABLE) == str(own_cache)
    assert default_cache_dir() == own_cache != users_cache()


@pytest.mark.integration
def test_a_benchmark_router_has_a_cache_and_database_of_its_own() -> None:
    """On main 1a1e9ee ``bench.common.modelyard`` started the router on the default cache
    dir: a benchmark's batches, files and usage rows went into the user's database."""
    with modelyard(SYNTHETIC, name="isolation") as yard:
        yard.wait("/health")
        assert yard.database is not None
        made = httpx.post(f"{yard.url}/v1/files", timeout=30, data={"purpose": "batch"},
                          files={"file": ("in.jsonl", b'{"custom_id": "a"}\n')})
        assert made.status_code == 200, made.text
        answer = httpx.post(f"{yard.url}/v1/chat/completions", timeout=30, json={
            "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200, answer.text
        files = yard.database.parent / "cache" / "files"
        assert (files / made.json()["id"]).is_file()
    assert yard.database.is_file() and not yard.database.is_relative_to(users_cache())


def test_a_linked_cache_holds_the_shared_embedded_model(tmp_path: Path) -> None:
    """``link_builtins`` links the shared cache's converted model into a router's own
    cache, and converts nothing where told not to and it is not there."""
    shared = tmp_path / "shared"
    (shared / "smollm2-135m-instruct").mkdir(parents=True)
    (shared / "smollm2-135m-instruct" / "config.json").write_text("{}")
    own = tmp_path / "own"
    env = os.environ.get(CACHE_VARIABLE)
    os.environ[CACHE_VARIABLE] = str(shared)
    try:
        link_builtins("models: {a: {model: builtin:smollm2}}", own, convert=False)
        link_builtins("models: {b: {model: /synthetic}}", tmp_path / "none", convert=False)
    finally:
        if env is None:
            os.environ.pop(CACHE_VARIABLE, None)
        else:
            os.environ[CACHE_VARIABLE] = env
    linked = own / "smollm2-135m-instruct"
    assert linked.is_symlink() and (linked / "config.json").is_file()
    assert not (tmp_path / "none").exists()
