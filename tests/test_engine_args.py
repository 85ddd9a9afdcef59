"""What a preset turns into for vLLM (no engine is started)."""

from __future__ import annotations

from shared.config import ModelSpec
from worker.engine_args import engine_args_for

AVX2 = {"avx2", "fma"}
BF16 = {"avx2", "avx512f", "avx512_bf16"}


def test_cpu_defaults_eager_prefix_caching_and_float32_without_bf16() -> None:
    args = engine_args_for(ModelSpec(id="m", model="/m", max_model_len=2048), "/m", AVX2)
    assert args["enforce_eager"] is True and args["enable_prefix_caching"] is True
    assert args["dtype"] == "float32" and args["max_model_len"] == 2048
    assert args["served_model_name"] == ["m"]
    assert engine_args_for(ModelSpec(id="m", model="/m"), "/m", BF16)["dtype"] == "auto"
    assert engine_args_for(ModelSpec(id="m", model="/m", dtype="bfloat16"), "/m",
                           AVX2)["dtype"] == "bfloat16"


def test_gpu_args_and_passthrough() -> None:
    spec = ModelSpec(id="g", model="/g", device="cuda", tensor_parallel_size=2,
                     gpu_memory_utilization=0.5, engine_args={"max_num_batched_tokens": 8192})
    args = engine_args_for(spec, "/g", AVX2)
    assert args["enforce_eager"] is False and args["dtype"] == "auto"
    assert args["tensor_parallel_size"] == 2 and args["gpu_memory_utilization"] == 0.5
    assert args["max_num_batched_tokens"] == 8192
