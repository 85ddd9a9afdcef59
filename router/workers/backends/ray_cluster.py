"""``ray``: each worker is a ``python -m worker`` process owned by a ``WorkerHost`` actor
that Ray places on a node with the resources its preset asks (``num_cpus``, ``num_gpus``,
``resources``).

The router's link binds a TCP port on the router's node address; the worker connects to
it with the link's CURVE key (minted per worker, handed over in the actor call that
starts it), so the port admits nobody else. The actor watches its process; a worker whose
actor dies gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``) and kills its process
group, and Ray kills the actors of a router (its driver) that dies, so nothing outlives
the router on any node.

A worker's output goes to a file on its own node (unlinked: nothing is left there when its
actor ends). The router shares no filesystem with the node: its ``RayHandle`` copies the
output, as it comes, into the model's log in the router's runtime dir, where logs,
failure tails and ``load_phases`` read it as they read a local worker's.

Each replica of a model is a worker of its own actor, on its own link. Where it goes
among the nodes follows ``replicas.placement`` and the nodes its running siblings are on
(``RayBackend.actor_options``): a preference Ray drops for any node that fits where no
preferred one has room, so a replica never waits for a node its siblings hold.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from router.access.admission import KEYS_VARIABLE
from router.workers.backends.base import Backend, BootFor, SpawnError, WorkerHandle
from router.workers.placement import Placer
from shared.config import ModelSpec

log = logging.getLogger("modelyard.router")
EXIT_POLL = 0.05  # seconds between the actor's looks at its process
LOG_CHUNK = 1 << 20  # the most of a worker's output one copy call brings
LOG_WAIT = 1.0  # seconds a copy call waits for new output before it answers empty
NODE_LABEL = "ray.io/node-id"  # the label Ray gives every node: its id


def _ray() -> Any:
    """The ``ray`` module, imported on first use: a router with only local models never
    pays for it (and its API is untyped)."""
    return importlib.import_module("ray")


class WorkerHost:
    """A Ray actor that runs one worker process on its node and reports its exit."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None  # the worker's output, a file on this node with no name

    async def start(self, args: list[str], env: dict[str, str],
                    boot: bytes) -> tuple[str, str, int]:
        """Start the worker, write its boot; its node's address and id, and its pid."""
        ray = _ray()
        full = {**os.environ, **env}
        full.pop(KEYS_VARIABLE, None)  # a local Ray instance inherits the router's
        full.setdefault("HF_HUB_OFFLINE", "1")
        full.setdefault("TOKENIZERS_PARALLELISM", "false")
        full["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address  # vLLM's Ray executor
        full["MODELYARD_CHILDREN_DIE_WITH_WORKER"] = "1"  # see worker/__main__.py
        self._log = tempfile.TemporaryFile(  # noqa: SIM115  # held as long as the actor
            prefix="modelyard-worker-", suffix=".log")
        # The worker's parent (for PR_SET_PDEATHSIG) is the thread that starts it: the
        # actor's event loop thread, which lives as long as the actor.
        self._proc = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-m", "worker", *args], stdin=subprocess.PIPE,
            stdout=self._log, stderr=subprocess.STDOUT, env=full, start_new_session=True)
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(boot)
            self._proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died meanwhile: wait() reports its exit
        context = ray.get_runtime_context()
        return ray.util.get_node_ip_address(), context.get_node_id(), self._proc.pid

    async def read_log(self, offset: int, wait: float) -> bytes:
        """The worker's output from ``offset`` on (at most ``LOG_CHUNK``); when there is
        none yet, waits up to ``wait`` seconds for some while the worker runs."""
        if self._log is None:
            return b""
        deadline = time.monotonic() + wait
        while True:
            chunk = os.pread(self._log.fileno(), LOG_CHUNK, offset)
            if (chunk or time.monotonic() >= deadline
                    or self._proc is None or self._proc.poll() is not None):
                return chunk
            await asyncio.sleep(EXIT_POLL)

    async def wait(self) -> int:
        """The worker's exit code, once it exits."""
        assert self._proc is not None
        while (code := self._proc.poll()) is None:
            await asyncio.sleep(EXIT_POLL)
        return code

    async def kill(self) -> None:
        """Kill the worker's process group (its engine's processes with it)."""
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone already
        while self._proc.poll() is None:
            await asyncio.sleep(EXIT_POLL)


class RayHandle(WorkerHandle):
    def __init__(self, actor: Any, pid: int, node: str, log_path: Path,
                 node_id: str = "") -> None:
        self.actor = actor
        self.pid = pid
        self.node = node
        self.node_id = node_id
        self.log_path = log_path
        self.started_at = time.time()
        self._code: int | None = None
        self._lost = ""
        self._copied = 0  # how much of the worker's output the log holds
        self._copying = asyncio.Lock()
        self._follow = asyncio.create_task(self._follow_log(), name=f"ray-log-{pid}")
        self._exit = asyncio.create_task(self._watch(), name=f"ray-exit-{pid}")

    async def _copy(self, wait: float) -> bool:
        """Append the worker's next output to the log; whether more may be ready."""
        async with self._copying:
            chunk = await self.actor.read_log.remote(self._copied, wait)
            if chunk:
                with open(self.log_path, "ab") as log_file:  # noqa: ASYNC230  # a local append
                    log_file.write(chunk)
                self._copied += len(chunk)
            return len(chunk) == LOG_CHUNK

    async def _follow_log(self) -> None:
        ray = _ray()
        try:
            while True:
                await self._copy(LOG_WAIT)
        except ray.exceptions.RayError:
            pass  # the actor is gone: what it still held is lost with its node

    async def sync_log(self) -> None:
        ray = _ray()
        try:
            async with asyncio.timeout(5):
                while await self._copy(0.0):
                    pass
        except (ray.exceptions.RayError, TimeoutError):
            pass  # the actor is gone or stuck: the log keeps what it has

    async def _watch(self) -> int | None:
        ray = _ray()
        try:
            code = int(await self.actor.wait.remote())
        except ray.exceptions.RayError as err:  # the actor, or its node, died
            self._lost = f"its Ray actor died ({type(err).__name__})"
            self._follow.cancel()
            return None
        await self.sync_log()  # its last words, before anyone reads its failure's tail
        self._follow.cancel()
        self._code = code
        return code

    @property
    def returncode(self) -> int | None:
        return self._code if self._exit.done() else None

    @property
    def lost(self) -> str:
        return self._lost

    async def wait(self) -> int | None:
        return await asyncio.shield(self._exit)

    async def kill(self) -> None:
        ray = _ray()
        if not self._exit.done():
            try:
                async with asyncio.timeout(5):
                    await self.actor.kill.remote()
            except (ray.exceptions.RayError, TimeoutError):
                pass  # the actor is gone or stuck: killing it below ends its worker too
            else:
                await self.sync_log()  # the output it holds goes with it
        ray.kill(self.actor, no_restart=True)  # its worker, if alive, gets PDEATHSIG
        self._exit.cancel()
        self._follow.cancel()


class RayBackend(Backend):
    """Workers as Ray actors on the cluster at ``address`` (``None``: a local instance
    started for the router's lifetime). Joined once, at the router's start."""

    name = "ray"

    def __init__(self, address: str | None, worker_args: list[str],
                 load_timeout: float) -> None:
        self.address = address
        self.worker_args = worker_args
        self.load_timeout = load_timeout
        self._host: Any = None
        self.node_ip = ""

    def connect(self) -> None:
        """Join the cluster (blocks ~2 s; before the router serves)."""
        ray = _ray()
        if not ray.is_initialized():
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.WARNING, configure_logging=False)
        self._host = ray.remote(WorkerHost)
        self.node_ip = ray.util.get_node_ip_address()
        log.info("ray: joined %s as node %s; cluster resources %s", self.address or
                 "a local instance", self.node_ip, ray.cluster_resources())

    def endpoint(self, runtime_dir: Path, number: int) -> str:
        return f"tcp://{self.node_ip}:*"

    def place(self, spec: ModelSpec, placer: Placer, key: str) -> dict[str, str]:
        """Ray picks the node and its GPUs (``CUDA_VISIBLE_DEVICES``, which the worker
        inherits from its actor); cores are pinned only where the preset names them."""
        if spec.device == "cuda":
            return {}
        env = {"VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib)}  # else vLLM takes most RAM
        if spec.cpu_cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_cores
        return env

    @staticmethod
    def actor_options(spec: ModelSpec, siblings: Sequence[str] = ()) -> dict[str, Any]:
        """The resources the worker's actor reserves on its node, and the nodes it
        prefers: ``siblings`` are the node ids of the model's other running replicas,
        lowest-numbered first. ``spread`` prefers a node that runs none of them, ``pack``
        the first one's node; where no such node has room now (or exists), Ray's
        ``fallback_strategy`` takes any node that fits, as it would without replicas."""
        ranks = spec.tensor_parallel_size * spec.pipeline_parallel_size
        gpus = spec.num_gpus
        if gpus is None:  # several ranks: vLLM's Ray executor reserves their GPUs itself
            gpus = float(spec.tensor_parallel_size) if spec.device == "cuda" and ranks == 1 else 0.0
        options: dict[str, Any] = {
            "num_cpus": 1.0 if spec.num_cpus is None else spec.num_cpus,
            "num_gpus": gpus, "resources": dict(spec.resources)}
        labels = dict(spec.label_selector)
        nodes = list(dict.fromkeys(n for n in siblings if n))
        # A preset that names the node itself has placed the replicas: its word stands.
        if nodes and NODE_LABEL not in labels:
            where = (nodes[0] if spec.replicas.placement == "pack"
                     else f"!in({','.join(nodes)})")
            # The preference is a label selector (Ray's ``ray.io/node-id``, on every
            # node) with the preset's own labels as the fallback: tried on a node without
            # room now as on none at all (a one-node cluster spreads nothing).
            options["label_selector"] = {**labels, NODE_LABEL: where}
            options["fallback_strategy"] = [{"label_selector": labels}]
        elif labels:
            options["label_selector"] = labels
        return options

    async def spawn(self, spec: ModelSpec, boot_for: BootFor, log_path: Path,
                    env: dict[str, str], siblings: Sequence[WorkerHandle] = ()
                    ) -> WorkerHandle:
        ray = _ray()
        if self._host is None:
            raise SpawnError("the ray backend is not connected")
        options = self.actor_options(spec, [h.node_id for h in siblings])
        actor = self._host.options(max_restarts=0, max_concurrency=8, **options).remote()
        try:
            # Pending until a node with the resources has room: bounded like any start.
            async with asyncio.timeout(self.load_timeout):
                node, node_id, pid = await actor.start.remote(self.worker_args, env,
                                                              boot_for(""))
        except (ray.exceptions.RayError, TimeoutError) as err:
            ray.kill(actor, no_restart=True)
            raise SpawnError(f"its Ray actor did not start: {type(err).__name__}: {err}") from None
        except asyncio.CancelledError:
            ray.kill(actor, no_restart=True)
            raise
        log.info("model %s: Ray placed its worker on node %s (%s) (%s)", spec.id, node,
                 node_id, options)
        return RayHandle(actor, int(pid), str(node), log_path, str(node_id))

    def close(self) -> None:
        ray = _ray()
        if ray.is_initialized():
            ray.shutdown()
