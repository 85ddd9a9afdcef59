"""What a worker is started with: its command line, its environment, its boot (stdin)."""

from __future__ import annotations

import os
import sys

import msgspec

from router.access.admission import KEYS_VARIABLE
from router.workers.link import WorkerLink
from router.workers.placement import Placer
from shared.config import ModelSpec, ServerConfig, WorkerBoot


def worker_command(server: ServerConfig, spare: bool = False) -> list[str]:
    """The worker's command line: nothing secret, since every user can read it in ``ps``
    (the model's spec goes over the worker's stdin: ``worker_boot``)."""
    cmd = [sys.executable, "-m", "worker", "--log-level", server.log_level]
    if spare:
        cmd.append("--spare")
    if server.cache_dir:
        cmd += ["--cache-dir", server.cache_dir]
    return cmd


def base_env() -> dict[str, str]:
    """Every local worker's environment before its model's: ours without the API keys,
    and an offline hub."""
    env = dict(os.environ)
    env.pop(KEYS_VARIABLE, None)  # a worker (and all it runs: vLLM, a model's code) has no use for them
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched from a hub unless asked
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def model_env(spec: ModelSpec, placement: dict[str, str]) -> dict[str, str]:
    """What the model adds to its worker's environment: its ``env``, then its placement
    (the only part shown in ``/v1/models`` and logs)."""
    return {**spec.env, **placement}


def worker_boot(spec: ModelSpec, placement: dict[str, str], placer: Placer,
                link: WorkerLink, log_path: str = "") -> bytes:
    """What the worker reads from stdin: its spec (``env`` apart), its link's address and
    key, the environment its model adds, and for a spare, where its output goes now."""
    env = model_env(spec, placement)
    spec = msgspec.structs.replace(spec, env={})
    fraction = placer.gpu_memory_utilization(spec)
    if fraction != spec.gpu_memory_utilization:
        spec = msgspec.structs.replace(spec, gpu_memory_utilization=fraction)
    return msgspec.json.encode(WorkerBoot(
        spec=spec, router_key=link.key, endpoint=link.endpoint,
        env=env, log_path=log_path))
