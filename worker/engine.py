"""The one module that imports vLLM: an ``AsyncLLM`` and what turns requests into its inputs.

A vLLM upgrade touches this file only. ``VllmEngine`` renders chats with the model's own
chat template, tokenizes, builds ``SamplingParams`` and yields ``Delta`` lists; the worker
server around it knows nothing of vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from shared.adapters import AdapterError
from shared.config import ModelSpec, auto_tool_calls, serves_adapters
from shared.protocol import (
    AdapterState,
    ChatMessage,
    ContentPart,
    Delta,
    Detokenize,
    Embed,
    Generate,
    LoraRef,
    Score,
    Tokenize,
    TokenLogprob,
    TopLogprob,
)
from worker.adapters import AdapterPool, ModelShape, adapter_error, check_adapter, refusal
from worker.engine_args import engine_args_for
from worker.outputs import OutputParser
from worker.tools import named_call_schema, required_calls_schema

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


def preload() -> None:
    """Import what starting an engine needs, so that a spare worker has it done."""
    import torch  # noqa: F401
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401


def fork_engine_processes() -> None:
    """Make vLLM fork its EngineCore and executor processes instead of spawning them.

    vLLM's CPU platform forces ``spawn``, so each of the two children imports vLLM and
    torch again (about 7 s each here). This worker has both imported and has run no
    OpenMP region yet (a fork after one can deadlock in libgomp), and the children use
    nothing of its own sockets or threads. Measured on this machine: the engine was
    ready 7.8 s after ``from_engine_args`` instead of 22.1 s, with identical output.
    A forked child binds its OpenMP threads itself (``worker.cpu_binding``): the
    variables vLLM binds them with are read by libgomp only when a process loads it.
    """
    import multiprocessing.context

    import vllm.v1.engine.utils as engine_utils
    import vllm.v1.executor.multiproc_executor as executor
    from vllm.utils import system_utils

    from worker.cpu_binding import bind_openmp_threads, cores_from_env

    class BoundForkProcess(multiprocessing.context.ForkProcess):
        def run(self) -> None:
            cores = cores_from_env(os.environ)  # set by vLLM for its executor alone
            if cores:
                bind_openmp_threads(cores)
            super().run()

    class BoundForkContext(multiprocessing.context.ForkContext):
        Process = BoundForkProcess

    context = BoundForkContext()
    for module in (system_utils, engine_utils, executor):
        module.get_mp_context = lambda: context  # type: ignore[attr-defined]


def fix_cpu_lora_ops() -> None:
    """Put ``worker.lora_ops`` in place of vLLM's CPU LoRA ops, which give a base-model
    request in a batch with adapters the last adapter's weights. Called in the worker
    (a forked engine inherits it) and, as a ``vllm.general_plugins`` entry point
    (pyproject.toml), in every process vLLM starts."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.lora.ops.torch_ops.lora_ops as torch_ops
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.punica_wrapper import punica_cpu

    from worker import lora_ops

    for module in (torch_ops, punica_cpu):
        for name, op in lora_ops.OPS.items():
            if hasattr(module, name):
                setattr(module, name, op)
    punica_cpu.PunicaWrapperCPU.add_lora_linear = lora_ops.add_lora_linear  # type: ignore[assignment]
    # The ops keep a step's row plan and float32 weights until these change.
    for cls, method, forget in ((punica_cpu.PunicaWrapperCPU, "update_metadata",
                                 lora_ops.forget_plans),
                                (LoRAModelManager, "activate_adapter",
                                 lora_ops.forget_weights)):
        original = getattr(cls, method)
        if getattr(original, "_modelyard", False):
            continue  # the worker's own call, then the plugin's: once is enough

        def then_forget(*args: Any, _original: Any = original, _forget: Any = forget,
                        **kwargs: Any) -> Any:
            result = _original(*args, **kwargs)
            if result is not False:  # activate_adapter: False when it was active already
                _forget()
            return result

        then_forget._modelyard = True  # type: ignore[attr-defined]
        setattr(cls, method, then_forget)


class VllmEngine:
    """One vLLM ``AsyncLLM`` serving one model (generation, or embeddings for ``task: embed``)."""

    def __init__(self, llm: Any, spec: ModelSpec) -> None:
        from vllm.sampling_params import RequestOutputKind

        self._llm = llm
        self._asleep: int | None = None
        """The level of the last ``sleep`` not yet woken from (0: parked)."""
        self._spec = spec
        self._delta_kind = RequestOutputKind.DELTA
        self.task = spec.task
        self.tokenizer = llm.get_tokenizer()
        self.model_config = llm.model_config
        self.max_model_len: int = llm.model_config.max_model_len
        # Defaults from the model's generation_config.json, as `vllm serve` applies them,
        # under the preset's own (``sampling_defaults``); a request's parameters win.
        self._defaults: dict[str, Any] = ({
            **llm.model_config.get_diff_sampling_param(),
            **{k: v for k, v in msgspec.structs.asdict(spec.sampling_defaults).items()
               if v is not None and k != "max_tokens"}} if spec.task == "generate" else {})
        # Unlike generation_config's max_new_tokens (a cap, as in `vllm serve`), the
        # preset's fills only a request that names no limit.
        self._default_max_tokens = spec.sampling_defaults.max_tokens
        self._chat_template = spec.chat_template
        self._tool_parser = _tool_parser_class(spec.tool_parser)
        self._auto_calls = auto_tool_calls(spec)
        self._reasoning_parser = _reasoning_parser_class(spec.reasoning_parser)
        self._cross_encoder: Any = None  # vLLM's pair renderer, made on the first score
        self._pair_tokens: Any = None
        # Rendering and tokenizing run here, off the event loop, so a huge prompt does
        # not stall the model's other streams; one thread, as HF tokenizers are not
        # meant to be shared across threads.
        self._render_pool = ThreadPoolExecutor(1, thread_name_prefix="render")
        # No token stands for more than 4 bytes per character of its vocabulary string,
        # so a text needs at least len(text) / _max_token_chars tokens.
        self._max_token_chars = max(len(t) for t in self.tokenizer.get_vocab()) * 4
        self.max_prompt_chars = self.max_model_len * self._max_token_chars
        self.adapters: AdapterPool | None = None
        if serves_adapters(spec):
            assert spec.max_cpu_loras is not None  # set with max_loras (serves_adapters)
            self.adapters = AdapterPool(self._check_adapter, self._load_adapter,
                                        self._unload_adapter, self._listed_adapters,
                                        capacity=spec.max_cpu_loras)
            config = llm.model_config.hf_config
            heads = config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
            self._shape = ModelShape(layers=config.num_hidden_layers, sizes=frozenset({
                config.hidden_size, getattr(config, "intermediate_size", 0),
                heads * head_dim, getattr(config, "num_key_value_heads", heads) * head_dim,
                config.vocab_size}))

    @classmethod
    def start(cls, spec: ModelSpec, model_path: str) -> VllmEngine:
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = engine_args_for(spec, model_path)
        if isinstance(kwargs.get("structured_outputs_config"), dict):
            kwargs["structured_outputs_config"] = StructuredOutputsConfig(
                **kwargs["structured_outputs_config"])
        args = AsyncEngineArgs(**kwargs)
        if spec.device == "cpu" and spec.fork_engine:
            fork_engine_processes()
        if serves_adapters(spec):
            fix_cpu_lora_ops()
        llm = AsyncLLM.from_engine_args(args)
        return cls(llm, spec)

    # -- prompts (these run in the render thread) -----------------------------------
    def _conversation(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """Messages as the OpenAI-style dicts vLLM's chat utilities take."""
        out: list[dict[str, Any]] = []
        for i, m in enumerate(messages):
            turn: dict[str, Any] = {"role": m.role, "content": m.content or ""}
            if m.parts:
                turn["content"] = [self._part(p, i, j) for j, p in enumerate(m.parts)]
            if m.name is not None:
                turn["name"] = m.name
            if m.tool_call_id is not None:
                turn["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                turn["tool_calls"] = [{"id": c.id, "type": "function",
                                       "function": {"name": c.name, "arguments": c.arguments}}
                                      for c in m.tool_calls]
            out.append(turn)
        return out

    def _part(self, part: ContentPart, i: int, j: int) -> dict[str, Any]:
        if part.type == "text":
            return {"type": "text", "text": part.text or ""}
        if not self.model_config.is_multimodal_model:
            raise RequestError(f"content part type '{part.type}' needs a multimodal model; "
                               f"'{self._spec.id}' reads text only",
                               param=f"messages[{i}].content[{j}]", code="unsupported_content")
        if part.type == "input_audio":
            return {"type": "input_audio",
                    "input_audio": {"data": part.data or "", "format": part.format or "wav"}}
        return {"type": part.type, part.type: {"url": part.url or ""}}

    def _render_chat(self, req: Generate | Tokenize) -> tuple[str, Any]:
        """The chat as prompt text, and its media (``None`` without any) for the engine."""
        from vllm.renderers.chat_utils import parse_chat_messages
        from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template

        assert req.messages is not None
        if not req.messages:
            raise RequestError("'messages' must contain at least one message", param="messages")
        cont = req.continue_final_message
        messages: Any = self._conversation(req.messages)
        media = any(m.parts for m in req.messages)
        try:
            # Templates of multimodal models take content as a list of parts.
            content_format: Any = (resolve_chat_template_content_format(
                self._chat_template, None, "auto", self.tokenizer,
                model_config=self.model_config) if media else "string")
            conversation, mm_data, _ = parse_chat_messages(messages, self.model_config,
                                                           content_format)
            tools = ([{"type": "function", "function": msgspec.to_builtins(t)}
                      for t in req.tools] if req.tools else None)
            text: str = safe_apply_chat_template(
                self.model_config, self.tokenizer, conversation, tools=tools,
                chat_template=self._chat_template, tokenize=False,
                add_generation_prompt=req.add_generation_prompt and not cont,
                continue_final_message=cont, **(req.template_kwargs or {}))
        except RequestError:
            raise
        except Exception as err:  # noqa: BLE001  # a template's own checks (roles, order) are user errors
            raise RequestError(f"chat template rejected the messages: {err}",
                               param="messages") from None
        return text, mm_data or None

    def _check_size(self, text: str) -> None:
        """Refuse, without tokenizing, a text that cannot fit the context (a 30 MiB prompt
        is refused in microseconds instead of seconds of tokenizing; the router checks the
        same bound before sending, this covers what a template adds)."""
        if len(text) > self.max_prompt_chars:
            raise _too_long(self.max_model_len, f"at least {len(text) // self._max_token_chars}")

    def prompt(self, gen: Generate | Tokenize, add_special_tokens: bool = True
               ) -> tuple[list[int], Any]:
        """Token ids of a request's prompt, and the media of its chat (or ``None``)."""
        if gen.messages is not None:
            text, media = self._render_chat(gen)
            self._check_size(text)
            ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
            return ids, media
        if isinstance(gen, Generate) and gen.prompt_token_ids is not None:
            return self._in_vocabulary(gen.prompt_token_ids, "prompt"), None
        if gen.prompt is not None:
            self._check_size(gen.prompt)
            ids = self.tokenizer.encode(gen.prompt, add_special_tokens=add_special_tokens)
            return ids, None
        raise RequestError("a prompt or messages are required", param="prompt")

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._render_pool, fn, *args)

    async def tokenize(self, req: Tokenize) -> tuple[list[int], list[str] | None, int]:
        """The prompt's ids (and their strings, if asked) and the tokens the engine would
        run for it: with media, the context (vLLM's processor expands each item's
        placeholder to a count known only once it runs; no prompt runs past the context)."""
        if req.count_only and any(m.parts for m in req.messages or ()):
            return [], None, self.max_model_len  # not rendered: its media fetched once, to run
        ids, media = await self._off_loop(self.prompt, req, req.add_special_tokens)
        strs = (self.tokenizer.convert_ids_to_tokens(ids)
                if req.return_token_strs and not req.count_only else None)
        return ids, strs, len(ids) if media is None else max(len(ids), self.max_model_len)

    def _in_vocabulary(self, ids: list[int], param: str) -> list[int]:
        """``ids`` (copied), or a 400 naming ``param`` for the first one not a token."""
        vocab = len(self.tokenizer)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is out of vocabulary (size {vocab})",
                               param=param)
        return list(ids)

    async def detokenize(self, req: Detokenize) -> str:
        ids = self._in_vocabulary(req.token_ids, "tokens")
        text: str = await self._off_loop(self.tokenizer.decode, ids)
        return text

    # -- sampling --------------------------------------------------------------------
    def sampling_params(self, gen: Generate, prompt_len: int, skip_special: bool,
                        auto_calls: Any = None) -> Any:
        """vLLM's ``SamplingParams`` for ``gen``; ``auto_calls``: the structured output
        that holds ``tool_choice: auto`` calls (``auto_call_constraint``), if any."""
        from vllm import SamplingParams

        spec = gen.sampling
        if prompt_len >= self.max_model_len:
            raise _too_long(self.max_model_len, str(prompt_len))
        room = self.max_model_len - prompt_len
        if spec.max_tokens is not None and spec.max_tokens > room and not spec.clamp_max_tokens:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + spec.max_tokens} tokens ({prompt_len} in the "
                f"prompt, {spec.max_tokens} for the completion). Please reduce the length of "
                "the prompt or the completion.", param="max_tokens",
                code="context_length_exceeded")
        chosen = {k: v for k, v in msgspec.structs.asdict(spec).items()
                  if v is not None and k in _OPTIONAL_SAMPLING}
        kwargs = {**self._defaults, **chosen}
        asked = spec.max_tokens if spec.max_tokens is not None else self._default_max_tokens
        kwargs["max_tokens"] = min(v for v in (room, asked, self._defaults.get("max_tokens")) if v)
        kwargs.update(
            n=spec.n, stop=spec.stop or None, stop_token_ids=spec.stop_token_ids or None,
            ignore_eos=spec.ignore_eos, min_tokens=spec.min_tokens,
            logprobs=spec.top_logprobs if spec.logprobs else None,
            logit_bias=spec.logit_bias, output_kind=self._delta_kind,
            skip_special_tokens=skip_special,
            structured_outputs=self._structured(gen) or auto_calls)
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as err:
            raise RequestError(str(err)) from None

    @staticmethod
    def _structured(gen: Generate) -> Any:
        from vllm.sampling_params import StructuredOutputsParams

        if gen.tools and gen.tool_choice == "required":
            return StructuredOutputsParams(
                json=required_calls_schema(gen.tools, gen.parallel_tool_calls))
        if gen.tools and gen.tool_choice == "function":
            try:
                schema = named_call_schema(gen.tools, gen.tool_name or "")
            except KeyError:
                raise RequestError(f"tool_choice names '{gen.tool_name}', which is not in "
                                   "'tools'", param="tool_choice") from None
            return StructuredOutputsParams(json=schema)
        c = gen.constraint
        if c is None:
            return None
        return StructuredOutputsParams(json=c.json, regex=c.regex, choice=c.choice,
                                       grammar=c.grammar,
                                       json_object=True if c.json_object else None)

    def auto_call_constraint(self, gen: Generate) -> tuple[Any, tuple[str, ...]]:
        """vLLM's structural tag for a call the model may start under ``tool_choice: auto``
        (``tool_strict_level``) and the strings that close a call, or ``(None, ())``: the
        text before a call stays free; once the model writes its call trigger, it must
        name a declared tool, and with ``strict`` arguments (the level's ``parameter``, or
        the tool's own ``strict: true``) write arguments that validate against that
        tool's schema. After its calls, the turn ends: more calls or the end of the
        answer, never more text. With ``response_format`` the format wins, as before."""
        from vllm.sampling_params import StructuredOutputsParams

        if not gen.tools or gen.tool_choice != "auto" or gen.constraint is not None \
                or self._auto_calls not in ("auto", "function", "parameter"):
            return None, ()
        pinned = self._auto_calls == "parameter"
        tools = [{**msgspec.to_builtins(t), "strict": pinned if t.strict is None else t.strict}
                 for t in gen.tools]
        if self._auto_calls == "auto" and not any(t["strict"] for t in tools):
            return None, ()  # as vLLM's own ``auto`` level: only a strict tool turns it on
        tag = _auto_call_tag(self._tool_parser.structural_tag_model, tools,
                             gen.parallel_tool_calls)
        if tag is None:
            return None, ()
        return StructuredOutputsParams(structural_tag=tag[0]), tag[1]

    def _output_parser(self, gen: Generate, call_ends: tuple[str, ...] = ()
                       ) -> Callable[[], OutputParser] | None:
        """A factory of per-choice output parsers, or None when text passes through;
        ``call_ends``: what closes a constrained ``auto`` call (``OutputParser``)."""
        tools = bool(gen.tools) and gen.tool_choice != "none"
        if gen.messages is None or (not tools and self._reasoning_parser is None):
            return None
        tool_parser = None
        if tools and gen.tool_choice == "auto":
            if self._tool_parser is None:
                raise RequestError(
                    f"model '{self._spec.id}' has no tool_parser in its preset, so it cannot "
                    "choose tools itself; use tool_choice 'required' or a named function",
                    param="tool_choice", code="unsupported_parameter")
            tool_parser = self._tool_parser
        request: Any = _vllm_request(gen) if tool_parser or self._reasoning_parser else None
        mode = gen.tool_choice if tools else "none"
        reasoning_parser = self._reasoning_parser
        return lambda: OutputParser(
            mode, gen.tool_name,
            tool_parser(self.tokenizer, request.tools) if tool_parser else None,
            reasoning_parser(self.tokenizer) if reasoning_parser else None, request,
            _scan_required, call_ends if gen.sampling.n == 1 else ())

    # -- generation ------------------------------------------------------------------
    async def generate(self, gen: Generate) -> AsyncIterator[list[Delta]]:
        """Yield the new output of each engine step as deltas (one per advanced choice)."""
        if self.task != "generate":
            raise RequestError(f"model '{self._spec.id}' is a pooling model (task "
                               f"'{self.task}'); it does not generate", param="model",
                               code="wrong_model_task")
        ids, media = await self._off_loop(self.prompt, gen)
        async with self._lora_request(gen.lora) as lora:
            async for deltas in self._generate(gen, ids, media, lora):
                yield deltas

    async def _generate(self, gen: Generate, ids: list[int], media: Any, lora: Any
                        ) -> AsyncIterator[list[Delta]]:
        from vllm.exceptions import GracefulHTTPError, VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.inputs.engine import tokens_input

        auto_calls, call_ends = self.auto_call_constraint(gen)
        make_parser = self._output_parser(gen, call_ends)
        # Tool markup may be a special token; the parser must see it to cut it out.
        params = self.sampling_params(gen, len(ids), skip_special=make_parser is None,
                                      auto_calls=auto_calls)
        parsers: dict[int, OutputParser] = {}
        want_logprobs = gen.sampling.logprobs
        top_n = gen.sampling.top_logprobs
        # With media, vLLM's input processor expands the placeholders it finds in ids.
        prompt = (tokens_input(ids) if media is None else
                  TokensPrompt(prompt_token_ids=ids, multi_modal_data=media))
        outputs = self._llm.generate(prompt, params, gen.id, priority=gen.priority,
                                     lora_request=lora)
        counted: set[int] = set()  # choices whose first delta told the prompt's size
        clamped = (params.max_tokens if gen.sampling.max_tokens is not None
                   and params.max_tokens < gen.sampling.max_tokens else 0)
        try:
            async for out in outputs:
                deltas: list[Delta] = []
                for choice in out.outputs:
                    d = Delta(id=gen.id, index=choice.index, text=choice.text,
                              tokens=len(choice.token_ids))
                    if choice.index not in counted:  # a stream's start reports it (Anthropic)
                        counted.add(choice.index)
                        d.prompt_tokens = len(out.prompt_token_ids or ids)
                        d.cached_tokens = out.num_cached_tokens or 0
                        d.max_tokens = clamped
                    if make_parser is not None:
                        parser = parsers.get(choice.index)
                        if parser is None:
                            parser = parsers[choice.index] = make_parser()
                        parser.feed(d, choice.token_ids, choice.finish_reason is not None)
                    if want_logprobs and choice.logprobs:
                        d.logprobs = self._logprobs(choice.token_ids, choice.logprobs, top_n)
                    if choice.finish_reason == "abort":
                        # The engine gave up on the request: an error, not a quiet "stop".
                        yield deltas
                        raise RequestError("the engine aborted this generation", status=503,
                                           code="generation_aborted")
                    repeated = make_parser is not None and parsers[choice.index].repeated
                    if repeated and choice.finish_reason is None:
                        # A small model, its call made, calls it again and again until
                        # max_tokens cuts the last one: the turn ends at the first repeat.
                        d.finish_reason = "tool_calls"
                        # This step's tokens may have begun one more call: not sent.
                        closed = parsers[choice.index].closed
                        d.tool_calls = [c for c in d.tool_calls or [] if c.index < closed] or None
                        d.prompt_tokens = len(out.prompt_token_ids or ids)
                        d.cached_tokens = out.num_cached_tokens or 0
                        deltas.append(d)
                        yield deltas
                        await outputs.aclose()  # vLLM aborts the request
                        return
                    if choice.finish_reason is not None:
                        d.finish_reason = _finish_reason(choice.finish_reason)
                        parser = parsers.get(choice.index)
                        # As OpenAI: "tool_calls" when the model chose to call (auto or
                        # required); a call the client named ends as a plain "stop".
                        if d.finish_reason == "stop" and parser is not None and \
                                parser.called and parser.mode != "function":
                            d.finish_reason = "tool_calls"
                        d.stop_reason = choice.stop_reason
                        d.prompt_tokens = len(out.prompt_token_ids or ids)
                        d.cached_tokens = out.num_cached_tokens or 0
                    deltas.append(d)
                yield deltas
        # vLLM's own request checks (token ids in the vocabulary, min_tokens, ...) and its
        # admission limits are refusals the client can act on, not engine failures.
        except VLLMClientError as err:
            param = getattr(err, "parameter", None)
            if param is None and (gen.constraint or auto_calls is not None
                                  or gen.tool_choice in ("required", "function")):
                # vLLM compiles the constraint when the request is added: a schema,
                # regex or grammar it cannot compile is the likeliest refusal.
                param = gen.constraint.param if gen.constraint else "tools"
            # vLLM's own words may only say "Invalid structural tag specification.":
            # xgrammar's reason (say, an unsupported schema type) is in the cause.
            cause = f": {err.__cause__}" if err.__cause__ is not None else ""
            raise RequestError(str(err) + cause, param=param) from None
        except GracefulHTTPError as err:
            raise RequestError(err.message, status=int(err.http_status),
                               code="engine_busy") from None

    async def embed(self, req: Embed) -> tuple[list[list[float]], int]:
        """One vector per input, and the number of prompt tokens embedded."""
        if self.task != "embed":
            raise RequestError(f"model '{self._spec.id}' does not serve embeddings (its "
                               "preset needs 'task: embed')", param="model",
                               code="wrong_model_task")
        prompts = []
        for i, item in enumerate(req.inputs):
            ids, _ = (await self._off_loop(self.prompt, Tokenize(id="", prompt=item))
                      if isinstance(item, str) else
                      (self._in_vocabulary(item, "input"), None))
            if len(ids) > self.max_model_len:
                raise RequestError(f"input {i} has {len(ids)} tokens; this model embeds at "
                                   f"most {self.max_model_len}", param="input",
                                   code="context_length_exceeded")
            prompts.append(ids)
        if req.count_only:
            return [], sum(len(p) for p in prompts)
        async with self._lora_request(req.lora) as lora:
            vectors = await self._pool(req.id, self._embed_inputs(prompts, req.dimensions),
                                       "dimensions", lora)
        return [v.tolist() for v in vectors], sum(len(p) for p in prompts)

    async def _pool(self, request_id: str, inputs: list[tuple[Any, Any]],
                    param: str | None = None, lora: Any = None) -> list[Any]:
        """The pooling runner's output (a tensor) for each (engine input, ``PoolingParams``),
        in order, with adapter ``lora`` (a ``LoRARequest``, held by the caller); vLLM's
        refusals are 400s naming ``param`` unless they name their own."""
        from vllm.exceptions import VLLMClientError

        async def one(i: int, engine_input: Any, params: Any) -> Any:
            result = None
            async for out in self._llm.encode(engine_input, params, f"{request_id}-{i}",
                                              lora_request=lora):
                result = out
            assert result is not None
            return result.outputs.data

        try:
            return list(await asyncio.gather(*(one(i, *item) for i, item in enumerate(inputs))))
        except (VLLMClientError, ValueError) as err:
            raise RequestError(str(err), param=getattr(err, "parameter", None) or param) from None

    def _embed_inputs(self, prompts: list[list[int]], dimensions: int | None = None
                      ) -> list[tuple[Any, Any]]:
        from vllm import PoolingParams
        from vllm.inputs.engine import tokens_input

        params = PoolingParams(task="embed", dimensions=dimensions)
        return [(tokens_input(ids), params) for ids in prompts]

    async def score(self, req: Score) -> tuple[list[float], int]:
        """One score per (query, document) pair, and the prompt tokens it took: a
        cross-encoder's relevance (``task: score``/``classify``; the pair rendered as vLLM's
        ``/score`` renders it: the preset's ``chat_template`` as a score template, else
        the model's own pairing) or the cosine of the two embeddings (``task: embed``)."""
        if self.task not in ("score", "classify", "embed"):
            raise RequestError(f"model '{self._spec.id}' does not score pairs (its preset "
                               "needs 'task: score')", param="model", code="wrong_model_task")
        if req.max_tokens_per_doc >= self.max_model_len:
            raise RequestError(f"'max_tokens_per_doc' must be less than the model's context "
                               f"({self.max_model_len} tokens)", param="max_tokens_per_doc")
        queries = req.queries * len(req.documents) if len(req.queries) == 1 else req.queries
        if self.task == "embed":
            return await self._cosines(req, queries)
        pairs = await self._off_loop(self._pairs, queries, req.documents, req.max_tokens_per_doc)
        if req.count_only:
            return [], sum(len(prompt["prompt_token_ids"]) for prompt, _ in pairs)
        async with self._lora_request(req.lora) as lora:
            outputs = await self._pool(req.id, pairs, lora=lora)
        scores = []
        for out in outputs:
            if out.numel() != 1:
                raise RequestError(f"model '{self._spec.id}' classifies into {out.numel()} "
                                   "labels; a score needs a model with one", param="model",
                                   code="wrong_model_task")
            scores.append(float(out.reshape(()).item()))
        return scores, sum(len(prompt["prompt_token_ids"]) for prompt, _ in pairs)

    def _pairs(self, queries: list[str], documents: list[str], max_doc: int
               ) -> list[tuple[Any, Any]]:
        """Each pair as an engine input and its ``PoolingParams``, rendered by vLLM's own
        cross-encoder code (in the render thread): a score template, separator tokens or
        token types, as the model needs."""
        from vllm import PoolingParams
        from vllm.exceptions import VLLMClientError

        if self._cross_encoder is None:
            from vllm.entrypoints.pooling.scoring.io_processor import CrossEncoderIOProcessor
            from vllm.entrypoints.pooling.scoring.protocol import RerankRequest
            from vllm.renderers.chat_utils import ChatTemplateConfig

            self._cross_encoder = CrossEncoderIOProcessor(  # type: ignore[no-untyped-call]
                self._llm.vllm_config, self._llm.renderer,
                ChatTemplateConfig(chat_template=self._chat_template))
            self._pair_tokens = RerankRequest(query="", documents=[]).build_tok_params(
                self.model_config)
        inputs = []
        for i, (query, document) in enumerate(zip(queries, documents)):
            try:
                rendered = self._cross_encoder.render({
                    "data_1": query, "data_2": document,
                    "chat_template": self._cross_encoder.chat_template,
                    "max_tokens_per_query": 0, "max_tokens_per_doc": max_doc,
                    "tok_params": self._pair_tokens, "prompt_extras": None,
                    "skip_mm_cache": False, "params": PoolingParams(task="classify"),
                    "lora_requests": None, "priorities": 0})
            except (VLLMClientError, ValueError) as err:  # a pair past the context, ...
                message = str(err.args[0]) if err.args else str(err)
                raise RequestError(f"pair {i}: {message}", param="documents",
                                   code="context_length_exceeded"
                                   if "context length" in message else None) from None
            inputs.append((rendered["prompts"], rendered["params"]))
        return inputs

    async def _cosines(self, req: Score, queries: list[str]) -> tuple[list[float], int]:
        """A bi-encoder's scores: each distinct query and document embedded once."""
        texts = list(dict.fromkeys([*(("query", q) for q in queries),
                                    *(("document", d) for d in req.documents)]))
        prompts = []
        for role, text in texts:
            ids, _ = await self._off_loop(self.prompt, Tokenize(id="", prompt=text))
            if role == "document" and req.max_tokens_per_doc:
                ids = ids[:req.max_tokens_per_doc]
            if len(ids) > self.max_model_len:
                raise RequestError(f"a {role} has {len(ids)} tokens; this model embeds at "
                                   f"most {self.max_model_len}", param=f"{role}s",
                                   code="context_length_exceeded")
            prompts.append(ids)
        if req.count_only:
            return [], sum(len(p) for p in prompts)
        async with self._lora_request(req.lora) as lora:
            vectors = dict(zip(texts, await self._pool(req.id, self._embed_inputs(prompts),
                                                       lora=lora)))
        scores = []
        for query, document in zip(queries, req.documents):
            a, b = vectors["query", query].float(), vectors["document", document].float()
            scores.append(float((a @ b) / max(float(a.norm() * b.norm()), 1e-12)))
        return scores, sum(len(p) for p in prompts)

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

    def in_flight(self) -> int:
        """Requests vLLM itself still holds: proof that cancelled ones really ended."""
        return int(self._llm.get_num_unfinished_requests())

    async def sleep(self, level: int) -> None:
        """Level 0 parks (``shared.protocol.Sleep``): the scheduler pauses between steps,
        requests in flight and the caches are kept. 1 and 2: vLLM's sleep mode, with its
        requests in flight kept too (``mode="keep"``; its default, ``"abort"``, would end
        them): vLLM 0.32 pauses the scheduler between two steps, and freeing the KV cache
        moves its running requests back to the waiting queue (their tokens so far kept,
        the in-flight step's output dropped rather than sent twice), to be recomputed
        after the wake: a request leased just before a park, or batch lines parked for a
        person, go on paying a prefill, not an error (a busy GPU model does not take
        turns: ``router.lifecycle.policy.room``)."""
        if level == 0:
            await self._llm.pause_generation(mode="keep", clear_cache=False)
        else:
            await self._llm.sleep(level=level, mode="keep")
        self._asleep = level

    async def wake(self) -> None:
        """Leave the last ``sleep``. From level 2 the weights were dropped: their memory
        comes back first, they are read from the model's files again (vLLM's
        ``reload_weights``), and only then the KV cache, whose wake resumes the scheduler,
        so no kept request steps with weights not yet read (vLLM's own order, in
        ``vllm/snapshot/server.py``). Adapters are loaded again after any level."""
        level, self._asleep = self._asleep, None
        if level is None:
            return  # awake already (a second wake: a stop's after a wake's)
        if level == 0:
            await self._llm.resume_generation()
            return
        if level >= 2:
            await self._llm.wake_up(tags=["weights"])
            await self._llm.collective_rpc("reload_weights")
            await self._llm.wake_up(tags=["kv_cache"])
        else:
            await self._llm.wake_up()
        if self.adapters is not None:
            await self.adapters.reload_all()

    # -- LoRA adapters -------------------------------------------------------------------
    async def _check_adapter(self, ref: LoraRef) -> None:
        assert self._spec.max_lora_rank is not None  # set with max_loras (serves_adapters)
        try:
            await asyncio.to_thread(check_adapter, ref.path, self._spec.max_lora_rank,
                                    self._shape)
        except AdapterError as err:
            message, status, code = adapter_error(ref, err)
            raise RequestError(message, status=status, param="model", code=code) from None

    async def _load_adapter(self, ref: LoraRef) -> None:
        from vllm.exceptions import VLLMServerError
        from vllm.lora.request import LoRARequest

        try:
            # a pinned adapter is pinned in the pool (it never leaves the engine), not
            # with vLLM's pin_lora, which keeps it in a batch slot for good: with every
            # slot so held (max_loras: 1), the engine dies on the next other adapter
            await self._llm.add_lora(LoRARequest(ref.name, ref.number, ref.path))
        except VLLMServerError:
            raise  # the engine died: not the adapter's fault
        except Exception as err:  # noqa: BLE001  # vLLM's refusal of the files
            # (a ValueError in this process; from the engine core's, a bare Exception)
            log.warning("adapter %s (%s) refused by the engine: %s", ref.name, ref.path, err)
            raise RequestError(refusal(ref, err), param="model",
                               code="adapter_invalid") from None

    async def _unload_adapter(self, number: int) -> None:
        await self._llm.remove_lora(number)

    async def _listed_adapters(self) -> set[int]:
        return set(await self._llm.list_loras())

    async def adapters_apply(self, load: list[LoraRef], unload: list[int]
                             ) -> list[AdapterState]:
        if self.adapters is None:
            if load:
                raise RequestError(f"model '{self._spec.id}' serves no adapters (set "
                                   "max_loras on it)", param="model", code="adapter_invalid")
            return []
        return await self.adapters.apply(load, unload)

    @contextlib.asynccontextmanager
    async def _lora_request(self, ref: LoraRef | None) -> AsyncIterator[Any]:
        """vLLM's ``LoRARequest`` for adapter ``ref`` (None for none), the adapter held in
        the engine until the block ends."""
        if ref is None:
            yield None
            return
        if self.adapters is None:
            raise RequestError(f"model '{self._spec.id}' serves no adapters", param="model",
                               code="adapter_invalid")
        from vllm.lora.request import LoRARequest

        async with self.adapters.held(ref):
            yield LoRARequest(ref.name, ref.number, ref.path)

    def shutdown(self) -> None:
        self._llm.shutdown()


def _too_long(max_model_len: int, prompt_tokens: str) -> RequestError:
    return RequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt contains {prompt_tokens} tokens, which leaves no room for output. Please "
        "reduce the length of the prompt.", param="messages", code="context_length_exceeded")


def _finish_reason(vllm_reason: str) -> str:
    """vLLM says stop, length or abort; the caller turns an abort into an error."""
    return "length" if vllm_reason == "length" else "stop"


def _tool_parser_class(name: str | None) -> Any:
    if name is None:
        return None
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.get_tool_parser(name)


def _reasoning_parser_class(name: str | None) -> Any:
    if name is None:
        return None
    from vllm.reasoning import ReasoningParserManager

    return ReasoningParserManager.get_reasoning_parser(name)


def _vllm_request(gen: Generate) -> Any:
    """The vLLM request object its parsers read (tools, tool_choice, skip_special_tokens)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    tools: Any = [{"type": "function", "function": msgspec.to_builtins(t)}
                  for t in gen.tools or []]
    return ChatCompletionRequest.model_validate(
        {"messages": [], "tools": tools or None, "tool_choice": "auto" if tools else "none",
         "skip_special_tokens": False})


def _auto_call_tag(model: str, tools: list[dict[str, Any]], parallel: bool
                   ) -> tuple[str, tuple[str, ...]] | None:
    """The structural tag (JSON) of ``auto`` calls in ``model``'s format (vLLM's registry)
    for ``tools`` (each with its ``strict`` decided), ending the answer after the calls,
    and the strings that close one call (none known: ``()``).

    vLLM's own tag for ``auto`` (triggered tags) lets free text follow a call, where a
    small model rambles on for thousands of tokens; here, after the first call only more
    calls may follow (or none, if ``parallel`` is false), then the end of the answer. A
    format whose tag has another shape is used as vLLM builds it."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel
    from xgrammar.structural_tag import (
        SequenceFormat,
        StructuralTag,
        TagsWithSeparatorFormat,
        TriggeredTagsFormat,
    )

    params = [ChatCompletionToolsParam.model_validate({"type": "function", "function": t})
              for t in tools]
    # At FUNCTION, vLLM keeps each tool's own ``strict``, which ``tools`` already decided.
    tag = get_model_structural_tag(model, params, "auto", reasoning=False,
                                   strict_level=ToolStrictLevel.FUNCTION)
    if tag is None:
        return None
    calls = tag.format
    ends: tuple[str, ...] = ()
    if isinstance(calls, TriggeredTagsFormat) and calls.tags:
        first = calls.model_copy(update={"stop_after_first": True})
        tag = StructuralTag(format=first if not parallel else SequenceFormat(elements=[
            first, TagsWithSeparatorFormat(tags=calls.tags, separator="\n")]))
        ends = tuple(sorted({e for t in calls.tags
                             for e in ([t.end] if isinstance(t.end, str) else
                                       t.end if isinstance(t.end, list) else [])}))
    return json.dumps(tag.model_dump()), ends


def _scan_required(previous: str, current: str) -> Any:
    """vLLM's reading of a forced ``required`` array: the call pieces ``current`` adds."""
    from vllm.tool_parsers.streaming import extract_required_tool_call_streaming

    msg, _ = extract_required_tool_call_streaming(
        previous_text=previous, current_text=current, tool_call_idx=None,
        tool_call_id_type="random")
    return msg


_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "seed")
