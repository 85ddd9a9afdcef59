"""Routers on a PostgreSQL database: two share one set of named keys, one ledger, one
budget (issue 22); one survives its database's restarts under traffic (issue 26). The
tests start their own server from Debian's packages (``initdb`` in a temp dir, a free
port, trust authentication on 127.0.0.1), restart and stop it, and stop it afterwards.

On 96966e8 the restart test failed: after ``pg_ctl restart -m fast`` a key revoked with
``modelyard keys revoke`` still opened the API (the router's one connection was closed
and never renewed), ``/v1/usage`` was a 500, and no row made after the restart reached
the ``usage`` table. (Before issue 26 the routers here ran on SQLite: the test's
``--database-url`` overrode the preset's.)
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, RouterProcess, free_port, running_router

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


class Postgres:
    """A PostgreSQL server of the test's own, in ``home``; ``pg_ctl`` drives it."""

    def __init__(self) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        assert found, "PostgreSQL is not installed (system-packages.txt: postgresql)"
        self.bin_dir = Path(found[-1]).parent
        self.home = Path(tempfile.mkdtemp(prefix="modelyard-pg-"))
        self.data, sockets = self.home / "data", self.home / "run"
        sockets.mkdir()
        if os.getuid() == 0:
            shutil.chown(self.home, "postgres")
            shutil.chown(sockets, "postgres")
        self.port = free_port()
        self.options = f"-p {self.port} -k {sockets} -c listen_addresses=127.0.0.1"
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        subprocess.run(_as_postgres([str(self.bin_dir / "initdb"), "-D", str(self.data),
                                     "-U", "postgres", "--auth=trust", "-E", "UTF8"]),
                       check=True, capture_output=True, timeout=120)

    def pg_ctl(self, *args: str, check: bool = True) -> None:
        subprocess.run(_as_postgres([str(self.bin_dir / "pg_ctl"), "-D", str(self.data),
                                     "-l", str(self.home / "server.log"), "-w",
                                     "-o", self.options, *args]),
                       check=check, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    server = Postgres()
    server.pg_ctl("start")
    try:
        yield server
    finally:
        server.pg_ctl("-m", "immediate", "stop", check=False)
        shutil.rmtree(server.home, ignore_errors=True)


class PostgresRouter(RouterProcess):
    """``RouterProcess`` on the preset's database (``RouterProcess`` names a SQLite one
    of its own on the command line, which wins over the preset's)."""

    def start(self) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.log = open(self.log_path, "wb")  # noqa: SIM115  # the router's stdout until stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router", "serve", "--config", str(self.preset)],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def postgres_router(workdir: Path, name: str, postgres: Postgres) -> Iterator[RouterProcess]:
    with running_router(PRESET, workdir, name, {"database": postgres.url},
                        PostgresRouter) as r:
        yield r


@pytest.fixture(scope="module")
def two_routers(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[RouterProcess, RouterProcess]]:
    workdir = tmp_path_factory.mktemp("pg")
    with postgres_router(workdir, "a", postgres) as a, \
            postgres_router(workdir, "b", postgres) as b:
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
    # A request holds 35 (its prompt as its worker counts it, and max_tokens:
    # ``router.access.budgets``): each router alone has 65 left, and refuses it only once it
    # counts the other's 35.
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


class Traffic:
    """Chat requests with ``key``, one after another on a thread, until ``stop``; counts
    the answers by status (a connection error counts as 0)."""

    def __init__(self, r: RouterProcess, key: str) -> None:
        self.r, self.key = r, key
        self.statuses: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    status = client.post(self.r.url + "/v1/chat/completions", json=chat,
                                         headers={"Authorization": f"Bearer {self.key}"}
                                         ).status_code
                except httpx.HTTPError:
                    status = 0
                self.statuses[status] = self.statuses.get(status, 0) + 1
                time.sleep(0.002)  # a steady stream, not a benchmark

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join(60)
        return self.statuses


def usage_rows(postgres: Postgres, key: str) -> int:
    import psycopg

    with psycopg.connect(postgres.url, connect_timeout=5) as conn:
        found = conn.execute("SELECT COUNT(*) FROM usage WHERE key = %s AND status = 200",
                             (key,)).fetchone()
    assert found is not None
    return int(found[0])


def wait_for(check: object, what: str, r: RouterProcess, timeout: float = 30) -> float:
    """Seconds until ``check()`` holds (at most ``timeout``, else the router's log)."""
    start = time.monotonic()
    while not check():  # type: ignore[operator]
        assert time.monotonic() - start < timeout, f"{what}\n{r.tail()}"
        time.sleep(0.1)
    return time.monotonic() - start


def test_a_router_survives_its_database_restarting_under_traffic(
        postgres: Postgres, tmp_path: Path) -> None:
    """``pg_ctl restart -m fast`` and a stop/start under a stream of requests: a key
    revoked after the restart is refused within a few refreshes; while the server is
    away ``/v1/usage`` and the key endpoints answer 503 (the OpenAI shape) and requests
    with a named key go on from the last read; every request answered 200 has its row
    in the ``usage`` table once the server is back, none twice."""
    with postgres_router(tmp_path, "restarts", postgres) as r:
        keys = {}
        for name in ("alice", "traffic-26"):
            made = call(r, ADMIN, "POST", "/v1/keys", {"name": name})
            assert made.status_code == 201, made.text
            keys[name] = made.json()["key"]
        assert call(r, keys["alice"], "GET", "/v1/models").status_code == 200
        traffic = Traffic(r, keys["traffic-26"])
        try:
            time.sleep(1)
            postgres.pg_ctl("-m", "fast", "restart")
            # The router's connections died with the server; modelyard keys makes a
            # new one. The router's next refreshes must see the revocation.
            revoked = subprocess.run(
                [sys.executable, "-m", "router", "keys", "--config", str(r.preset),
                 "revoke", "alice"], check=False, cwd=ROOT, capture_output=True, text=True,
                timeout=60)
            assert revoked.returncode == 0, revoked.stderr
            took = wait_for(lambda: call(r, keys["alice"], "GET", "/v1/models"
                                         ).status_code == 401,
                            "the router still takes a key revoked after the restart", r)
            print(f"revocation after the restart refused in {took:.2f} s")

            postgres.pg_ctl("-m", "fast", "stop")
            asked = time.monotonic()
            away = call(r, ADMIN, "GET", "/v1/usage")
            print(f"/v1/usage while away: {away.status_code} in "
                  f"{time.monotonic() - asked:.2f} s")
            assert away.status_code == 503, away.text
            error = away.json()["error"]
            assert error["code"] == "database_unavailable", error
            assert set(error) == {"message", "type", "param", "code"}
            made = call(r, ADMIN, "POST", "/v1/keys", {"name": "while-away"})
            assert made.status_code == 503, made.text
            assert call(r, ADMIN, "DELETE", "/v1/keys/traffic-26").status_code == 503
            # The last read serves the named keys (STALE_MAX is far off).
            assert call(r, keys["traffic-26"], "GET", "/v1/models").status_code == 200
            assert call(r, keys["alice"], "GET", "/v1/models").status_code == 401
            time.sleep(3)  # rows pile up in the router's queue meanwhile
            postgres.pg_ctl("start")
            took = wait_for(lambda: call(r, ADMIN, "GET", "/v1/usage").status_code == 200,
                            "/v1/usage never answered again", r)
            print(f"/v1/usage answered 200 again {took:.2f} s after the server did")
            time.sleep(1)
        finally:
            statuses = traffic.stop()
        print(f"requests during the restarts by status: {statuses}")
        assert set(statuses) == {200}, statuses  # serving never stopped
        # The ledger writes once a second: every 200 is there within a few flushes.
        ok = statuses[200]
        wait_for(lambda: usage_rows(postgres, "traffic-26") >= ok,
                 f"rows lost: {usage_rows(postgres, 'traffic-26')} of {ok}", r)
        assert usage_rows(postgres, "traffic-26") == ok  # and none twice
        assert "Traceback" not in r.tail(400), r.tail(400)

