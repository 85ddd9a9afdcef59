"""Ray nodes for the Ray backend's tests: ``ray_head`` (``ray start --head``, 2 CPUs) and
``ray_second_node`` (a second node on this host joining it, 2 CPUs and a ``second``
resource), each in a session of its own and a mount namespace where ``ray_runtime_dir``
(the router's runtime dir) is an empty tmpfs: as on a real cluster, a node does not see
the router's files. At the end every process of a node's session is killed, and none is
left. Import the fixtures a module uses (``tests/test_backends.py``,
``tests/test_replicas_ray.py``): each module gets its own cluster."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT, free_port

RAY = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
       "--object-store-memory=100000000", "--disable-usage-stats"]


def _session_members(sid: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == sid:
                found.append(process)
        except (psutil.Error, OSError):
            pass  # gone while we looked
    return found


def _ray_node(args: list[str], runtime_dir: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """``ray start --block`` with ``args``, in a session and mount namespace of its own
    where ``runtime_dir`` is an empty tmpfs; returns once the node runs."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    # The mount stays in the namespace (private propagation); a user namespace where
    # mounting needs one (not root).
    own_namespace = ["unshare", "--mount", "--propagation", "private",
                     *(["--map-root-user"] if os.getuid() else []), "--",
                     "sh", "-c", 'mount -t tmpfs modelyard-test "$0" && exec "$@"',
                     str(runtime_dir), *RAY, *args]
    with open(log_path, "wb") as log:
        node = subprocess.Popen(own_namespace, cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while b"Ray runtime started" not in log_path.read_bytes():
            assert node.poll() is None and time.monotonic() < deadline, \
                log_path.read_text(errors="replace")[-3000:]
            time.sleep(0.3)
    except BaseException:
        _end_node(node)
        raise
    return node


def _end_node(node: subprocess.Popen[bytes]) -> None:
    """Stop a node's ``ray start`` and kill every process of its session."""
    os.killpg(node.pid, signal.SIGTERM)
    try:
        node.wait(5)
    except subprocess.TimeoutExpired:
        pass  # killed with the rest below
    left: list[psutil.Process] = []
    for _ in range(50):
        left = [p for p in _session_members(node.pid) if p.status() != psutil.STATUS_ZOMBIE]
        if not left:
            break
        for process in left:
            try:
                process.kill()
            except psutil.Error:
                pass  # exited meanwhile
        time.sleep(0.2)
    node.wait(10)
    assert not left, [p.pid for p in left]


@pytest.fixture(scope="module")
def ray_runtime_dir() -> Iterator[Path]:
    """The ray router's runtime dir, which its Ray nodes do not see."""
    path = Path(tempfile.mkdtemp(prefix="myrt", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_temp_dir() -> Iterator[Path]:
    """Ray's temp dir (its logs and sockets: the paths must stay short), removed after."""
    path = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head(ray_runtime_dir: Path, ray_temp_dir: Path) -> Iterator[str]:
    """``ray start --head`` (2 CPUs, 100 MB object store, no dashboard): its address."""
    port = free_port()
    head = _ray_node(["--head", f"--port={port}", "--num-cpus=2",
                      "--include-dashboard=false", f"--temp-dir={ray_temp_dir}"],
                     ray_runtime_dir, ray_temp_dir / "head.log")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        _end_node(head)


@pytest.fixture(scope="module")
def ray_second_node(ray_head: str, ray_runtime_dir: Path, ray_temp_dir: Path
                    ) -> Iterator[str]:
    """A second node on this host joining ``ray_head`` (2 CPUs, a ``second`` resource);
    the head's address. Both nodes have this host's address: tell them apart by their
    ids (``/v1/models``' ``node_id``). It ends before the head."""
    node = _ray_node([f"--address={ray_head}", "--num-cpus=2",
                      '--resources={"second": 1}'],
                     ray_runtime_dir, ray_temp_dir / "second.log")
    try:
        yield ray_head
    finally:
        _end_node(node)
