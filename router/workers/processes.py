"""Worker processes as the operating system sees them: their log's tail, their
descendants and process group, signalling them, and the engine's own start timings from
their log. Pure functions; the supervisor and the spare pool call them."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import psutil


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def descendants(pid: int) -> list[psutil.Process]:
    """A process's descendants as psutil objects, which refuse to signal a recycled pid."""
    try:
        found: list[psutil.Process] = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    return found


def signal_all(processes: list[psutil.Process], sig: int) -> None:
    for process in processes:
        try:
            process.send_signal(sig)
        except psutil.Error:
            pass  # exited already, or its pid now names another process: leave it


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a worker's process group and any descendant that left it. Only for a worker
    not yet waited for: until then its pid, the group's id, cannot name anyone else."""
    children = descendants(pid)
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # group already gone
    signal_all(children, sig)


def group_members(pgid: int, born_after: float, born_before: float) -> list[psutil.Process]:
    """Processes left in a dead worker's group (an EngineCore it started). Born while the
    worker lived: a stranger that later got the worker's pid as its group id is not."""
    found = []
    for process in psutil.process_iter():
        try:
            if (os.getpgid(process.pid) == pgid
                    and born_after - 1 <= process.create_time() <= born_before):
                found.append(process)
        except (psutil.Error, OSError):
            pass  # gone while we looked, or not ours to see
    return found


_ENGINE_LINES = (
    ("weights", re.compile(rb"Loading weights took ([\d.]+) s")),
    ("kv_cache_and_warmup",
     re.compile(rb"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")),
)


def engine_phases(log_path: Path, offset: int) -> dict[str, float]:
    """The engine's own timings of a start, from what vLLM logged after ``offset``."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read(8 << 20)
    except OSError:
        return {}
    found = {}
    for name, pattern in _ENGINE_LINES:
        match = pattern.search(text)
        if match:
            found[name] = float(match.group(1))
    return found
