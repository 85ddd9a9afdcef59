"""What every benchmark shares: servers as subprocesses, a streaming load generator,
percentiles, and the JSON + table report written to ``bench/results/<name>.json``."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx

from worker.materialize import link_builtins

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PY = sys.executable
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def machine() -> dict[str, Any]:
    with open("/proc/cpuinfo") as cpuinfo:
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo
                      if line.startswith("model name")), platform.processor())
    return {"cpus": os.cpu_count(), "cpu": model,
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "python": platform.python_version()}


def commit() -> dict[str, str]:
    """The commit of the router tree measured (``BENCH_TREE`` or this one), for the
    performance page to name; none where it is not a git checkout."""
    done = subprocess.run(["git", "-C", str(TREE), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    return {"commit": done.stdout.strip()} if done.returncode == 0 else {}


def report(name: str, result: dict[str, Any], rows: Sequence[tuple[Any, ...]]) -> None:
    """Write ``bench/results/<name>.json``; print the JSON and a small table."""
    result = {"benchmark": name, "machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M"),
              **commit(), **result}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    sys.stdout.flush()


class Server:
    """A server process (modelyard or ``vllm serve``) on a free port, stopped on exit."""

    def __init__(self, cmd: list[str], port: int, env: dict[str, str] | None = None,
                 cpus: set[int] | None = None, name: str = "server",
                 cwd: Path = ROOT) -> None:
        self.port = port
        self.database: Path | None = None
        """A modelyard router's SQLite database (``modelyard``)."""
        # Kept open (and on disk) while the server runs; closed by __exit__.
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix=f"bench-{name}-", suffix=".log", delete=False)
        full_env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(env or {}))
        preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=self.log,
                                     stderr=subprocess.STDOUT, preexec_fn=preexec,  # noqa: PLW1509  # no threads yet
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait(self, path: str, ok: Any = None, timeout: float = 600,
             headers: dict[str, str] | None = None) -> float:
        """Poll ``path`` until it answers 200 (and ``ok(json)``); seconds since start."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited; see {self.log.name}")
            try:
                r = httpx.get(self.url + path, timeout=2, headers=headers)
                if r.status_code == 200 and (ok is None or ok(r.json())):
                    return time.monotonic() - self.started
            except (httpx.HTTPError, ValueError):
                pass  # not up yet
            time.sleep(0.1)
        raise TimeoutError(f"{self.url}{path} not ready; see {self.log.name}")

    def wait_port(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)  # not listening yet
        raise TimeoutError(f"port {self.port} not open; see {self.log.name}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


TREE = Path(os.environ.get("BENCH_TREE") or ROOT)
"""The tree whose router ``modelyard`` starts: this one, or (``BENCH_TREE``) another
checkout with the same venv, to compare two trees side by side with one benchmark."""


def modelyard(preset: str, name: str = "modelyard", cpus: set[int] | None = None,
              env: dict[str, str] | None = None) -> Server:
    """A router serving ``preset`` with a cache dir and a database of its own (a temporary
    folder): what a benchmark makes (batches, files, usage rows, keys) never lands in the
    user's ``~/.cache/modelyard/modelyard.db``. The embedded model's folder is the shared
    cache's, linked in (``link_builtins``): it is converted once, not by every router."""
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    path = folder / "preset.yaml"
    path.write_text(preset.replace("{port}", str(port)))
    link_builtins(preset, folder / "cache")
    (folder / "cache").mkdir(exist_ok=True)
    server = Server([PY, "-m", "router", "serve", "--config", str(path), "--log-level",
                     "warning", "--cache-dir", str(folder / "cache"),
                     "--database-url", f"sqlite:///{folder / 'modelyard.db'}"],
                    port, env=env, cpus=cpus, name=name, cwd=TREE)
    server.database = folder / "modelyard.db"
    return server


@dataclass
class StreamStats:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0


async def one_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                     stats: StreamStats) -> None:
    """One streamed completion; records TTFT, inter-token gaps and chunk count."""
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                stats.errors += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if last is None:
                    stats.ttft.append(now - start)
                else:
                    stats.itl.append(now - last)
                last = now
                stats.tokens += 1
    except httpx.HTTPError:
        stats.errors += 1


async def streams(url: str, body: dict[str, Any], concurrency: int,
                  per_client: int = 1) -> tuple[StreamStats, float]:
    """``concurrency`` clients each run ``per_client`` streams; returns stats and seconds."""
    stats = StreamStats()
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def lane() -> None:
            for _ in range(per_client):
                await one_stream(client, url, body, stats)
        start = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        return stats, time.perf_counter() - start
