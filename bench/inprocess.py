"""``python -m bench.inprocess``: vLLM's ``AsyncLLM`` driven in this process, no HTTP and
no router: the ceiling a server around the engine can approach.

It starts the engine with the arguments modelyard gives a preset (``--spec``, JSON), with
vLLM's own process start (spawn) rather than modelyard's fork, prints ``READY``, then
reads one number per line on stdin: that many concurrent streams of ``--tokens`` tokens
(``ignore_eos``). Each answer is one line, ``ANSWER`` and JSON: ``seconds``, ``ttft`` and
``itl`` lists.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from typing import Any

import msgspec

from shared.config import ModelSpec
from worker.engine_args import engine_args_for

_ids = itertools.count()
READY = "inprocess-ready"
ANSWER = "inprocess-answer"
"""Line prefixes of its own: vLLM logs to stdout too."""


async def one_stream(llm: Any, prompt: str, params: Any, out: dict[str, list[float]]) -> None:
    start = last = time.perf_counter()
    first = True
    async for _ in llm.generate(prompt, params, request_id=f"bench-{next(_ids)}"):
        now = time.perf_counter()
        out["ttft" if first else "itl"].append(now - (start if first else last))
        first, last = False, now


async def serve(spec: ModelSpec, path: str, prompt: str, tokens: int) -> None:
    from vllm import SamplingParams
    from vllm.config import StructuredOutputsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs = engine_args_for(spec, path)
    kwargs["structured_outputs_config"] = StructuredOutputsConfig(
        **kwargs["structured_outputs_config"])
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    print(READY, flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        out: dict[str, list[float]] = {"ttft": [], "itl": []}
        start = time.perf_counter()
        await asyncio.gather(*(one_stream(llm, prompt, params, out)
                               for _ in range(int(line))))
        print(ANSWER, json.dumps({"seconds": time.perf_counter() - start, **out}), flush=True)
    llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.inprocess")
    parser.add_argument("--spec", required=True, help="the model's ModelSpec as JSON")
    parser.add_argument("--path", required=True, help="the model's folder")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    spec = msgspec.json.decode(args.spec, type=ModelSpec)
    asyncio.run(serve(spec, args.path, args.prompt, args.tokens))


if __name__ == "__main__":
    main()
