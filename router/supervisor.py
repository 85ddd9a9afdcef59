"""``Supervisor``: starts, watches and stops worker processes; never touches HTTP.

A request ``acquire``s a model: the name is resolved, a lease taken, and the worker
started if it is not running (the request waits, bounded by ``load_timeout``). One load
task per model does the starting, so concurrent requests share it and a waiter that
times out does not kill a load others still wait for. A worker's exit fails its open
streams at once and marks the model ``failed``; the next request starts it again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

import msgspec
import psutil
import zmq.asyncio

from router.errors import ModelUnavailable, WorkerLost
from router.link import WorkerLink
from router.placement import Placer
from router.registry import Lease, ModelEntry, ModelRegistry
from shared.config import ServerConfig

log = logging.getLogger("modelyard.router")
_generation = itertools.count(1)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a worker's whole process group and any descendant that left it."""
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # group already gone
    for child in descendants:
        try:
            child.send_signal(sig)
        except psutil.Error:
            pass  # already exited


class _Worker:
    """What the supervisor keeps per running worker process."""

    def __init__(self, proc: asyncio.subprocess.Process, link: WorkerLink, log_path: Path,
                 descendants: list[int]) -> None:
        self.proc = proc
        self.link = link
        self.log_path = log_path
        self.descendants = descendants
        self.watcher: asyncio.Task[None] | None = None


class Supervisor:
    def __init__(self, registry: ModelRegistry, server: ServerConfig, runtime_dir: Path,
                 placer: Placer | None = None) -> None:
        self.registry = registry
        self.server = server
        self.runtime_dir = runtime_dir
        self.placer = placer or Placer()
        self._ctx = zmq.asyncio.Context()
        self._workers: dict[str, _Worker] = {}
        self._loads: dict[str, asyncio.Task[WorkerLink]] = {}

    # -- requests ----------------------------------------------------------------------
    async def acquire(self, name: str | None) -> tuple[Lease, WorkerLink]:
        """Resolve ``name``, lease the model and make sure its worker is ready."""
        entry = self.registry.resolve(name)
        lease = Lease(entry)
        try:
            link = await self.ensure_ready(entry)
        except BaseException:
            lease.release()
            raise
        return lease, link

    def start_loading(self, entry: ModelEntry) -> asyncio.Task[WorkerLink]:
        """The model's one load task, started now if none is running."""
        task = self._loads.get(entry.id)
        if task is None:
            task = asyncio.create_task(self._load(entry), name=f"load-{entry.id}")
            self._loads[entry.id] = task
            task.add_done_callback(self._load_done)
        return task

    def _load_done(self, task: asyncio.Task[WorkerLink]) -> None:
        for model_id, running in list(self._loads.items()):
            if running is task:
                del self._loads[model_id]
        if not task.cancelled():
            task.exception()  # retrieved here: a load nobody awaits still ends quietly

    async def ensure_ready(self, entry: ModelEntry) -> WorkerLink:
        if entry.state == "ready" and entry.link is not None:
            return entry.link
        task = self.start_loading(entry)
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.server.load_timeout)
        except TimeoutError:
            raise ModelUnavailable(f"model '{entry.id}' did not become ready within "
                                   f"{self.server.load_timeout:g} s") from None

    # -- starting ----------------------------------------------------------------------
    def _command(self, entry: ModelEntry, endpoint: str) -> list[str]:
        cmd = [sys.executable, "-m", "worker", "--endpoint", endpoint,
               "--spec", msgspec.json.encode(entry.spec).decode(),
               "--log-level", self.server.log_level]
        if self.server.cache_dir:
            cmd += ["--cache-dir", self.server.cache_dir]
        return cmd

    def worker_env(self, entry: ModelEntry) -> dict[str, str]:
        """The full environment a worker starts with: ours, offline hub, its placement."""
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched from a hub unless asked
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        placement = self.placer.place(entry.spec)
        entry.placement = placement
        env.update(placement)
        return env

    async def _load(self, entry: ModelEntry) -> WorkerLink:
        while entry.state == "stopping":  # a request during a stop waits, then restarts
            await asyncio.sleep(0.05)
        if entry.state == "ready" and entry.link is not None:
            return entry.link
        entry.state, entry.error, entry.exit_code = "loading", None, None
        started = time.monotonic()
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", entry.id)
        endpoint = f"ipc://{self.runtime_dir}/{safe}-{next(_generation)}.sock"
        log_path = self.runtime_dir / f"{safe}.log"
        link = WorkerLink(self._ctx, endpoint, entry.id)
        env = self.worker_env(entry)
        with open(log_path, "ab") as log_file:
            proc = await asyncio.create_subprocess_exec(
                *self._command(entry, endpoint), stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file, stderr=asyncio.subprocess.STDOUT, env=env,
                start_new_session=True)
        log.info("model %s: worker pid %d starting (%s)", entry.id, proc.pid,
                 " ".join(f"{k}={v}" for k, v in entry.placement.items()))
        worker = _Worker(proc, link, log_path, [])
        self._workers[entry.id] = worker
        entry.pid = proc.pid
        exited = asyncio.create_task(proc.wait())
        ready = asyncio.create_task(link.wait_ready())
        try:
            await asyncio.wait({exited, ready}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            exited.cancel()
            ready.cancel()
            await self._reap(entry, worker, "load cancelled")
            raise
        if ready.done() and not ready.cancelled() and ready.exception() is None:
            exited.cancel()
            info = ready.result()
            entry.state = "ready"
            entry.link = link
            entry.max_model_len = info.max_model_len
            entry.loaded_at = time.time()
            entry.load_seconds = round(time.monotonic() - started, 3)
            entry.last_used = time.monotonic()
            try:
                worker.descendants = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            except psutil.Error:
                worker.descendants = []
            worker.watcher = asyncio.create_task(self._watch(entry, worker))
            log.info("model %s: ready in %.1f s (pid %d)", entry.id, entry.load_seconds, proc.pid)
            return link
        ready.cancel()
        reason = (str(ready.exception()) if ready.done() and not ready.cancelled()
                  and ready.exception() else f"worker exited with code {proc.returncode}")
        await self._reap(entry, worker, reason)
        tail = await asyncio.to_thread(_tail, log_path)
        entry.state, entry.error = "failed", f"{reason}\n{tail}".strip()
        entry.exit_code = proc.returncode
        log.error("model %s: failed to start: %s", entry.id, entry.error)
        raise ModelUnavailable(f"model '{entry.id}' failed to start: {reason}")

    async def _watch(self, entry: ModelEntry, worker: _Worker) -> None:
        code = await worker.proc.wait()
        if self._workers.get(entry.id) is not worker:
            return
        if entry.state == "stopping":
            return  # stop() owns the rest
        tail = await asyncio.to_thread(_tail, worker.log_path)
        reason = f"worker exited unexpectedly with code {code}"
        log.error("model %s: %s", entry.id, reason)
        worker.link.fail(WorkerLost(f"model '{entry.id}': {reason}"))
        await self._reap(entry, worker, reason)
        entry.state, entry.exit_code = "failed", code
        entry.error = f"{reason}\n{tail}".strip()

    async def _reap(self, entry: ModelEntry, worker: _Worker, reason: str) -> None:
        """Make sure the worker and its children are gone; forget them."""
        if worker.proc.returncode is None:
            kill_tree(worker.proc.pid, signal.SIGKILL)
            await worker.proc.wait()
        kill_tree(worker.proc.pid, signal.SIGKILL)  # EngineCore children may outlive it
        for pid in worker.descendants:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass  # already gone, as it should be
        worker.link.close(reason)
        if self._workers.get(entry.id) is worker:
            del self._workers[entry.id]
        self.placer.release(entry.id)
        if entry.link is worker.link:
            entry.link = None
        entry.pid = None

    # -- stopping ----------------------------------------------------------------------
    async def stop(self, entry: ModelEntry, grace: float = 10.0) -> None:
        """Stop a model's worker: ask it to exit, then TERM, then KILL its process tree."""
        worker = self._workers.get(entry.id)
        if worker is None:
            if entry.state != "failed":
                entry.state = "unloaded"
            return
        entry.state = "stopping"
        try:
            worker.link.shutdown()
            await asyncio.wait_for(worker.proc.wait(), grace)
        except (TimeoutError, WorkerLost, ModelUnavailable):
            kill_tree(worker.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(worker.proc.wait(), 5)
            except TimeoutError:
                log.warning("model %s: worker ignored SIGTERM; killing", entry.id)
        await self._reap(entry, worker, "model unloaded")
        entry.state = "unloaded"
        log.info("model %s: stopped", entry.id)

    async def stop_all(self) -> None:
        for task in list(self._loads.values()):
            task.cancel()
        await asyncio.gather(*(self.stop(e) for e in self.registry
                               if e.id in self._workers), return_exceptions=True)
        self._ctx.term()
