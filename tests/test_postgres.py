"""Two routers on one PostgreSQL database (issue 22): one set of named keys, one ledger,
one budget. The test starts its own server from Debian's packages (``initdb`` in a temp
dir, a free port, trust authentication on 127.0.0.1) and stops it afterwards.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RouterProcess, free_port, running_router

pytestmark = pytest.mark.integration

ADMIN = "k-admin-pg-31"
PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  admin_api_keys: [k-admin-pg-31]
  database_url: "{database}"
models:
  m: {model: /synthetic, engine: synthetic}
"""


def _as_postgres(command: list[str]) -> list[str]:
    """PostgreSQL's tools refuse to run as root: as root, run them as ``postgres``."""
    return ["runuser", "-u", "postgres", "--", *command] if os.getuid() == 0 else command


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    assert found, "PostgreSQL is not installed (system-packages.txt: postgresql)"
    bin_dir = Path(found[-1]).parent
    home = Path(tempfile.mkdtemp(prefix="modelyard-pg-"))
    data, sockets = home / "data", home / "run"
    sockets.mkdir()
    if os.getuid() == 0:
        shutil.chown(home, "postgres")
        shutil.chown(sockets, "postgres")
    port = free_port()
    subprocess.run(_as_postgres([str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres",
                                 "--auth=trust", "-E", "UTF8"]),
                   check=True, capture_output=True, timeout=120)
    subprocess.run(_as_postgres([
        str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(home / "server.log"), "-w",
        "-o", f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1", "start"]),
        check=True, capture_output=True, timeout=120)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(_as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-m",
                                     "immediate", "stop"]), capture_output=True, timeout=60,
                       check=False)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def two_routers(postgres: str, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[RouterProcess, RouterProcess]]:
    workdir = tmp_path_factory.mktemp("pg")
    subst = {"database": postgres}
    with running_router(PRESET, workdir, "a", subst) as a, \
            running_router(PRESET, workdir, "b", subst) as b:
        yield a, b


def call(r: RouterProcess, key: str, method: str, path: str,
         body: object = None) -> httpx.Response:
    return r.client.request(method, r.url + path, json=body, timeout=60,
                            headers={"Authorization": f"Bearer {key}"})


def test_two_routers_share_keys_usage_and_one_budget(
        two_routers: tuple[RouterProcess, RouterProcess]) -> None:
    a, b = two_routers
    made = call(a, ADMIN, "POST", "/v1/keys", {
        "name": "shared-budget", "budgets": [{"tokens": 100, "period": "day"}]})
    assert made.status_code == 201, made.text
    key = made.json()["key"]
    # Router b takes the key made on router a within its refresh (2 s).
    deadline = time.monotonic() + 10
    while call(b, key, "GET", "/v1/models").status_code != 200:
        assert time.monotonic() < deadline, "router b never saw the key"
        time.sleep(0.2)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}
    for router in (a, b):  # 35 tokens each, one on each router: 70 of 100
        answer = call(router, key, "POST", "/v1/chat/completions", chat)
        assert answer.status_code == 200, answer.text
    # A request holds up to 48 (``router.budgets``): each router alone has 65 left, and
    # refuses it only once it counts the other's 35.
    # Each router writes its rows within 1 s and trusts a read for 2 s: both refuse then.
    time.sleep(3.5)
    for router in (a, b):
        refused = call(router, key, "POST", "/v1/chat/completions", chat)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "budget_exceeded"
    # One ledger: either router sums both routers' rows (another's within its 1 s flush).
    time.sleep(1.5)
    for router in (a, b):
        rows = call(router, key, "GET", "/v1/usage?group_by=key,endpoint").json()["data"]
        chats = [row for row in rows if row["endpoint"] == "chat"]
        assert len(chats) == 1 and chats[0]["key"] == "shared-budget", rows
        assert chats[0]["completion_tokens"] == 60  # the refused requests generated none
        assert chats[0]["requests"] == 4  # the two refusals are in the ledger too
    # Revoked on b: a refuses it within its refresh.
    assert call(b, ADMIN, "DELETE", "/v1/keys/shared-budget").status_code == 200
    deadline = time.monotonic() + 10
    while call(a, key, "GET", "/v1/models").status_code != 401:
        assert time.monotonic() < deadline, "router a still takes the revoked key"
        time.sleep(0.2)
