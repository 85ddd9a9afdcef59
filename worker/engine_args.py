"""What a model's vLLM engine is started with: ``engine_args_for`` turns a preset into the
``AsyncEngineArgs`` keywords (dtype, runner, context, structured outputs, GPU memory).

Pure, and imports no vLLM: the router's benchmarks and the tests read it without an engine.
"""

from __future__ import annotations

import os
from typing import Any

from shared.config import ModelSpec, serves_adapters, sleep_mode


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass  # not Linux: assume no native bf16
    return set()


def auto_dtype(spec: ModelSpec, flags: set[str]) -> str:
    """``dtype: auto`` on a CPU without native bf16 means float32.

    Measured here (AVX2, no AVX-512): SmolLM2 prefill ran at 45 tokens/s in bf16 and
    220 tokens/s in float32; decode was 14.7 vs 12.6 tokens/s. Time to first token wins.
    """
    if spec.dtype != "auto" or spec.device != "cpu":
        return spec.dtype
    return "auto" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def engine_args_for(spec: ModelSpec, model_path: str,
                    flags: set[str] | None = None) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` keywords a preset asks for (pure given ``flags``)."""
    eager = spec.enforce_eager if spec.enforce_eager is not None else spec.device == "cpu"
    args: dict[str, Any] = {
        "model": model_path,
        "served_model_name": [spec.id],
        "dtype": auto_dtype(spec, cpu_flags() if flags is None else flags),
        "enforce_eager": eager,
        "enable_prefix_caching": spec.enable_prefix_caching,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "disable_log_stats": True,
        # A request's priority orders the waiting ones (lower first) and what is preempted
        # under KV-cache pressure (higher first): a batch's lines (``Generate.priority``
        # 1) wait behind every client's own request (0), which keeps arrival order.
        "scheduling_policy": "priority",
    }
    if spec.pipeline_parallel_size > 1:
        args["pipeline_parallel_size"] = spec.pipeline_parallel_size
    if spec.backend == "ray" and spec.tensor_parallel_size * spec.pipeline_parallel_size > 1:
        # Ranks that may span nodes: vLLM's Ray executor places them in its own placement
        # group on the cluster the worker's actor runs in (RAY_ADDRESS, set by the actor).
        args["distributed_executor_backend"] = "ray"
    if spec.max_model_len:
        args["max_model_len"] = spec.max_model_len
    if spec.max_num_seqs:
        args["max_num_seqs"] = spec.max_num_seqs
    # Compact JSON for every JSON constraint (tool calls, response_format): with free
    # whitespace a small model at a high temperature can spend its whole budget on
    # newlines and never close the object. vLLM reads this per engine, not per request,
    # and only for the xgrammar and guidance backends.
    args["structured_outputs_config"] = {"backend": "xgrammar", "disable_any_whitespace": True}
    if spec.task == "embed":  # a decoder turned into a pooling model (last-token embeddings)
        args["runner"] = "pooling"
        args["convert"] = "embed"
    elif spec.task in ("score", "classify"):  # a sequence classifier; a decoder converted
        args["runner"] = "pooling"
        args["convert"] = "classify"
    if serves_adapters(spec):  # LoRA adapters on top (ModelSpec.base names this model)
        args.update(enable_lora=True, max_loras=spec.max_loras,
                    max_cpu_loras=spec.max_cpu_loras, max_lora_rank=spec.max_lora_rank)
    if spec.device == "cuda":
        # Every GPU engine can sleep: a model that makes room parks through vLLM's sleep
        # mode (``router.lifecycle.policy.park``), and so does ``idle_action: sleep``. A
        # preset turns it off with ``engine_args: {enable_sleep_mode: false}``, and torch's
        # expandable segments do (``sleep_mode``): then it stops instead of parking.
        if sleep_mode(spec, os.environ):
            args["enable_sleep_mode"] = True
        if spec.gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = spec.gpu_memory_utilization
        if spec.kv_cache_memory_bytes is not None:
            args["kv_cache_memory_bytes"] = spec.kv_cache_memory_bytes
    args.update(spec.engine_args)
    return args
