"""``local``: each worker is a subprocess of the router on this host (a spare, if one
fits), in a process group of its own, killed with its engine's processes, and with them
when the router dies, however it dies (``shared.lifeline``)."""

from __future__ import annotations

import asyncio
import os
import platform
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from router.workers.backends.base import Backend, BootFor, WorkerHandle
from router.workers.processes import descendants, group_members, kill_tree, signal_all
from router.workers.spares import Proc, SparePool
from shared.config import ModelSpec
from shared.lifeline import dies_with

GUARD_NAME = "modelyard-guard"
"""The name ``shared.lifeline.guard_group`` gives the worker's guard process."""


def _name(process: psutil.Process) -> str:
    try:
        return str(process.name())
    except psutil.Error:
        return ""  # gone: a signal to it is a no-op


class LocalHandle(WorkerHandle):
    def __init__(self, proc: Proc, log_path: Path,
                 started_at: float | None = None, from_spare: bool = False) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.node = platform.node() or "localhost"
        self.log_path = log_path
        self.started_at = started_at or time.time()
        self.from_spare = from_spare
        self.descendants: list[psutil.Process] = []

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int | None:
        return await self.proc.wait()

    def note_children(self) -> None:
        self.descendants = descendants(self.pid)

    def pids(self) -> set[int]:
        return {self.pid, *(p.pid for p in self.descendants)}

    def freeze(self, frozen: bool) -> bool:
        # The worker and the processes it started (noted as it became ready: no scan of
        # /proc on the event loop), never its guard (``shared.lifeline.guard_group``): a
        # stopped guard could not kill the engine's processes once the worker died with
        # its router, and they would stay stopped, holding the model's memory, for good.
        if self.proc.returncode is not None:
            return False  # exited: its pid may name someone else now
        sig = signal.SIGSTOP if frozen else signal.SIGCONT
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        signal_all([p for p in self.descendants if _name(p) != GUARD_NAME], sig)
        return True

    def resident_bytes(self) -> int:
        # Proportional set sizes: the engine's processes are forked from the worker and
        # share its pages (torch, vLLM), which resident set sizes count once per process
        # (4 GiB summed for SmolLM2's worker where it holds ~1.5 GiB).
        total = 0
        for pid in self.pids():
            try:
                info = psutil.Process(pid).memory_full_info()
            except psutil.Error:
                continue  # gone meanwhile: it holds nothing
            total += int(getattr(info, "pss", info.rss))  # PSS is Linux's
        return total

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.descendants += descendants(self.pid)
            kill_tree(self.pid, signal.SIGKILL)
            await self.proc.wait()
        # EngineCore children may outlive the worker, in its group or out of it.
        await asyncio.to_thread(self._kill_leftovers)

    def _kill_leftovers(self) -> None:
        """Kill its known descendants and members of its group born while it lived."""
        signal_all(self.descendants + group_members(self.pid, self.started_at, time.time()),
                   signal.SIGKILL)


class LocalBackend(Backend):
    name = "local"

    def __init__(self, spares: SparePool, command: Callable[[], list[str]],
                 base_env: Callable[[], dict[str, str]]) -> None:
        self.spares = spares
        self.command = command
        self.base_env = base_env

    def endpoint(self, runtime_dir: Path, number: int) -> str:
        # A socket path must fit in 107 bytes, so its name does not depend on the model's.
        return f"ipc://{runtime_dir}/w{number}.sock"

    async def spawn(self, spec: ModelSpec, boot_for: BootFor, log_path: Path,
                    env: dict[str, str], siblings: Sequence[WorkerHandle] = ()
                    ) -> WorkerHandle:
        # ``siblings`` all run on this host too: their cores are apart (``replica_spec``).
        spare = await self.spares.take(spec)
        if spare is not None:  # already running, vLLM imported: give it the model
            if not spare.forked:  # (a forked one's is the zygote's)
                spare.log_path.unlink(missing_ok=True)
            handle = LocalHandle(spare.proc, log_path, spare.started_at, from_spare=True)
        else:
            with open(log_path, "ab") as log_file:  # noqa: ASYNC230  # a local append
                proc = await asyncio.create_subprocess_exec(
                    *self.command(), stdin=asyncio.subprocess.PIPE,
                    stdout=log_file, stderr=asyncio.subprocess.STDOUT,
                    env={**self.base_env(), **env}, start_new_session=True,
                    preexec_fn=dies_with(os.getpid()))  # shared.lifeline
            handle = LocalHandle(proc, log_path)
        stdin = handle.proc.stdin
        assert stdin is not None
        try:
            boot = boot_for(str(log_path) if spare else "")
        except BaseException:  # nobody else knows of the process, blocked on its stdin
            await handle.kill()
            raise
        try:
            stdin.write(boot)
            stdin.close()  # the worker reads to the end: one JSON document
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died meanwhile: the supervisor sees its exit
        return handle
