"""The one module that imports vLLM: an ``AsyncLLM`` and what turns requests into its inputs.

A vLLM upgrade touches this file only. ``VllmEngine`` renders chats with the model's own
chat template, tokenizes, builds ``SamplingParams`` and yields ``Delta`` lists; the worker
server around it knows nothing of vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from shared.config import ModelSpec
from shared.protocol import (
    ChatMessage,
    Delta,
    Generate,
    SamplingSpec,
    Tokenize,
    TokenLogprob,
    TopLogprob,
)

log = logging.getLogger("modelyard.worker")


class RequestError(Exception):
    """A request the engine refuses; carries the OpenAI error fields for the client."""

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


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
    }
    if spec.max_model_len:
        args["max_model_len"] = spec.max_model_len
    if spec.max_num_seqs:
        args["max_num_seqs"] = spec.max_num_seqs
    if spec.device == "cuda":
        if spec.idle_action == "sleep":
            args["enable_sleep_mode"] = True
        if spec.gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = spec.gpu_memory_utilization
        if spec.kv_cache_memory_bytes is not None:
            args["kv_cache_memory_bytes"] = spec.kv_cache_memory_bytes
    args.update(spec.engine_args)
    return args


class VllmEngine:
    """One vLLM ``AsyncLLM`` serving one model."""

    def __init__(self, llm: Any, spec: ModelSpec) -> None:
        from vllm.sampling_params import RequestOutputKind

        self._llm = llm
        self._spec = spec
        self._delta_kind = RequestOutputKind.DELTA
        self.tokenizer = llm.get_tokenizer()
        self.max_model_len: int = llm.model_config.max_model_len
        # Defaults from the model's generation_config.json, as `vllm serve` applies them.
        self._defaults: dict[str, Any] = llm.model_config.get_diff_sampling_param()
        self._chat_template = spec.chat_template

    @classmethod
    def start(cls, spec: ModelSpec, model_path: str) -> VllmEngine:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**engine_args_for(spec, model_path))
        llm = AsyncLLM.from_engine_args(args)
        return cls(llm, spec)

    # -- prompts ---------------------------------------------------------------------
    def _render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                     continue_final_message: bool) -> list[int]:
        if not messages:
            raise RequestError("'messages' must contain at least one message", param="messages")
        conversation = [msgspec.to_builtins(m) for m in messages]
        for turn in conversation:  # templates index message['content'] as a string
            turn.setdefault("content", "")
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, chat_template=self._chat_template,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message)
        except Exception as err:  # a template's own checks (roles, order) are user errors
            raise RequestError(f"chat template rejected the messages: {err}",
                               param="messages") from None
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def prompt_ids(self, gen: Generate | Tokenize, add_special_tokens: bool = True) -> list[int]:
        if gen.messages is not None:
            cont = isinstance(gen, Generate) and gen.continue_final_message
            return self._render_chat(gen.messages, gen.add_generation_prompt, cont)
        if isinstance(gen, Generate) and gen.prompt_token_ids is not None:
            vocab = len(self.tokenizer)
            bad = next((t for t in gen.prompt_token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"token id {bad} is out of vocabulary (size {vocab})",
                                   param="prompt")
            return list(gen.prompt_token_ids)
        if gen.prompt is not None:
            ids: list[int] = self.tokenizer.encode(gen.prompt, add_special_tokens=add_special_tokens)
            return ids
        raise RequestError("a prompt or messages are required", param="prompt")

    def tokenize(self, req: Tokenize) -> tuple[list[int], list[str] | None]:
        ids = self.prompt_ids(req, req.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return ids, strs

    # -- sampling --------------------------------------------------------------------
    def sampling_params(self, spec: SamplingSpec, prompt_len: int) -> Any:
        from vllm import SamplingParams

        if prompt_len >= self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt contains {prompt_len} tokens, which leaves no room "
                "for output. Please reduce the length of the prompt.",
                param="messages", code="context_length_exceeded")
        room = self.max_model_len - prompt_len
        chosen = {k: v for k, v in msgspec.structs.asdict(spec).items()
                  if v is not None and k in _OPTIONAL_SAMPLING}
        kwargs = {**self._defaults, **chosen}
        kwargs["max_tokens"] = min(v for v in (room, spec.max_tokens,
                                                self._defaults.get("max_tokens")) if v)
        kwargs.update(
            n=spec.n, stop=spec.stop or None, stop_token_ids=spec.stop_token_ids or None,
            ignore_eos=spec.ignore_eos, min_tokens=spec.min_tokens,
            logprobs=spec.top_logprobs if spec.logprobs else None,
            logit_bias=spec.logit_bias, output_kind=self._delta_kind)
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as err:
            raise RequestError(str(err)) from None

    # -- generation ------------------------------------------------------------------
    async def generate(self, gen: Generate) -> AsyncIterator[list[Delta]]:
        """Yield the new output of each engine step as deltas (one per advanced choice)."""
        from vllm.exceptions import GracefulHTTPError, VLLMClientError
        from vllm.inputs.engine import tokens_input

        ids = self.prompt_ids(gen)
        params = self.sampling_params(gen.sampling, len(ids))
        want_logprobs = gen.sampling.logprobs
        top_n = gen.sampling.top_logprobs
        outputs = self._llm.generate(tokens_input(ids), params, gen.id, priority=gen.priority)
        try:
            async for out in outputs:
                deltas = []
                for choice in out.outputs:
                    d = Delta(id=gen.id, index=choice.index, text=choice.text,
                              tokens=len(choice.token_ids))
                    if want_logprobs and choice.logprobs:
                        d.logprobs = self._logprobs(choice.token_ids, choice.logprobs, top_n)
                    if choice.finish_reason is not None:
                        d.finish_reason = "length" if choice.finish_reason == "length" else "stop"
                        d.stop_reason = choice.stop_reason
                        d.prompt_tokens = len(ids)
                        d.cached_tokens = out.num_cached_tokens or 0
                    deltas.append(d)
                yield deltas
        # vLLM's own request checks (token ids in the vocabulary, min_tokens, ...) and its
        # admission limits are refusals the client can act on, not engine failures.
        except VLLMClientError as err:
            raise RequestError(str(err), param=getattr(err, "parameter", None)) from None
        except GracefulHTTPError as err:
            raise RequestError(err.message, status=int(err.http_status),
                               code="engine_busy") from None

    def _token_str(self, token_id: int, lp: Any) -> str:
        if lp.decoded_token is not None:
            return str(lp.decoded_token)
        return str(self.tokenizer.decode([token_id]))

    def _logprobs(self, token_ids: Any, positions: Any, top_n: int) -> list[TokenLogprob]:
        result = []
        for token_id, position in zip(token_ids, positions):
            chosen = position[token_id]
            top = sorted(position.items(), key=lambda kv: kv[1].rank or 0)[:top_n] if top_n else []
            result.append(TokenLogprob(
                token=self._token_str(token_id, chosen), logprob=max(chosen.logprob, -9999.0),
                top=[TopLogprob(self._token_str(t, lp), max(lp.logprob, -9999.0)) for t, lp in top]))
        return result

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def sleep(self, level: int) -> None:
        await self._llm.sleep(level=level)

    async def wake(self) -> None:
        await self._llm.wake_up()

    def shutdown(self) -> None:
        self._llm.shutdown()


_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "seed")
