"""``SyntheticEngine``: a fixed-rate token emitter with no model behind it.

For router benchmarks and fault-injection tests ONLY (``engine: synthetic`` in a preset);
it never serves a user. It emits the word ``tok`` once per token, ``max_tokens`` times
(16 if unset), at ``engine_args.tokens_per_second`` per request (0: as fast as it can),
``engine_args.tokens_per_step`` tokens per delta, after a start of
``engine_args.start_seconds``. With ``engine_args.timestamps`` each
token is the ``time.monotonic_ns()`` of its creation instead, so a client can measure the
relay's added latency (the clock is shared by all processes of the machine). A
``cpu_cores`` placement pins the process (a vLLM worker leaves that to vLLM).

A request for a LoRA adapter emits the adapter's name instead of ``tok``.

It embeds texts by hashing their words and scores pairs (``/v1/rerank``, ``/v1/score``)
by the words they share; with an adapter, its name is one more word of each text embedded
and of each query scored, so an adapter's answer differs from its base's, the same every
time.
With ``engine_args.script`` (a list of turns) it answers the i-th request with the i-th
turn, round and round: ``{"text": "..."}`` (with ``"reasoning": "..."``, reasoning
before it, as a reasoning parser's), or ``{"tool_call": {"name": ..., "arguments":
{...}}}`` (finishing ``tool_calls``), so that a client's tool round trip can be scripted
(protocol tests with real agent CLIs; the real model runs the rest).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from shared.adapters import AdapterError, read_adapter
from shared.config import ModelSpec, parse_cores, serves_adapters
from shared.protocol import (
    AdapterState,
    Delta,
    Detokenize,
    Embed,
    Generate,
    LoraRef,
    Score,
    Tokenize,
    ToolCallDelta,
)
from worker.adapters import AdapterPool, adapter_error, check_adapter

MEDIA_TOKENS = 16
"""The prompt tokens of one image (audio, video) part."""


class SyntheticError(Exception):
    def __init__(self, message: str, *, param: str | None = None,
                 code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


class SyntheticEngine:
    """Synthetic: no model, for router benchmarks and fault injection only."""

    max_prompt_chars = 0  # no bound: its "tokens" are words

    def __init__(self, spec: ModelSpec) -> None:
        self.max_model_len = spec.max_model_len or 4096
        rate = float(spec.engine_args.get("tokens_per_second", 0))
        self._interval = 1.0 / rate if rate > 0 else 0.0
        self._per_step = int(spec.engine_args.get("tokens_per_step", 1))
        self._timestamps = bool(spec.engine_args.get("timestamps", False))
        self._script: list[dict[str, Any]] = list(spec.engine_args.get("script", []))
        self._turns = 0
        self._running = 0
        self._awake = asyncio.Event()
        self._awake.set()
        # Fault injection: a start that takes this long (blocking, as loading weights is).
        time.sleep(float(spec.engine_args.get("start_seconds", 0)))
        if spec.cpu_cores:
            os.sched_setaffinity(0, parse_cores(spec.cpu_cores))
        self._spec = spec
        self._adapter_load = float(spec.engine_args.get("adapter_load_seconds", 0))
        self.adapters_loaded: dict[int, LoraRef] = {}
        self.adapters = (AdapterPool(self._check_adapter, self._load_adapter,
                                     self._unload_adapter, self._listed,
                                     capacity=spec.max_cpu_loras or 1)
                         if serves_adapters(spec) else None)
        self.dead: str | None = None
        """Why the engine died (as vLLM's engine core does on an error inside a step)."""
        self.asleep: int | None = None
        """The level of the last ``sleep`` not yet woken from (0: parked)."""

    # Adapters: checked by their adapter_config.json only; a load takes
    # ``engine_args.adapter_load_seconds``; the engine keeps ``max_cpu_loras``, LRU. As
    # vLLM's, each step of an adapter's request needs its adapter in the engine, and
    # loads one the engine let go again from its folder, inside the step: a folder that
    # no longer reads there kills the engine.
    async def _check_adapter(self, ref: LoraRef) -> None:
        try:
            check_adapter(ref.path, self._spec.max_lora_rank or 0, None)
        except AdapterError as err:
            message, status, code = adapter_error(ref, err)
            raise SyntheticError(message, status=status, param="model", code=code) from None

    async def _load_adapter(self, ref: LoraRef) -> None:
        await asyncio.sleep(self._adapter_load)
        self._admit(ref)

    def _admit(self, ref: LoraRef) -> None:
        """``ref`` into the engine as its most recently used adapter; past
        ``max_cpu_loras``, the least recently used unpinned ones leave."""
        self.adapters_loaded.pop(ref.number, None)
        self.adapters_loaded[ref.number] = ref
        while len(self.adapters_loaded) > (self._spec.max_cpu_loras or 1):
            unpinned = [n for n, r in self.adapters_loaded.items() if not r.pinned]
            if not unpinned:
                break
            del self.adapters_loaded[unpinned[0]]

    async def _unload_adapter(self, number: int) -> None:
        self.adapters_loaded.pop(number, None)

    async def _listed(self) -> set[int]:
        return set(self.adapters_loaded)

    async def adapters_apply(self, load: list[LoraRef], unload: list[int]
                             ) -> list[AdapterState]:
        if self.adapters is None:
            if load:
                raise SyntheticError("this model serves no adapters", param="model",
                                     code="adapter_invalid")
            return []
        return await self.adapters.apply(load, unload)

    def _prompt_len(self, req: Generate | Tokenize) -> int:
        """Its "template": each message's words + 4, each tool call's words + 1, each
        media part ``MEDIA_TOKENS``, and the words of the tools' and template kwargs'
        JSON, so that a budget's count (``tokenize``) is the prompt it then reports."""
        if req.messages is not None:
            if not req.messages:
                raise SyntheticError("'messages' must contain at least one message",
                                     param="messages")
            size = sum(len((m.content or "").split()) + 4 for m in req.messages)
            for m in req.messages:
                if m.tool_calls:
                    size += sum(len(f"{c.name} {c.arguments}".split()) + 1
                                for c in m.tool_calls)
                if m.parts:
                    size += MEDIA_TOKENS * sum(p.type != "text" for p in m.parts)
            if req.tools:
                size += sum(len(msgspec.json.encode(t).split()) for t in req.tools)
            if req.template_kwargs:
                size += len(msgspec.json.encode(req.template_kwargs).split())
            return size
        if isinstance(req, Generate) and req.prompt_token_ids is not None:
            return len(req.prompt_token_ids)
        return len((req.prompt or "").split()) + 1

    async def tokenize(self, req: Tokenize) -> tuple[list[int], list[str] | None, int]:
        n = self._prompt_len(req)
        if req.count_only:
            return [], None, n
        return list(range(n)), (["tok"] * n if req.return_token_strs else None), n

    async def detokenize(self, req: Detokenize) -> str:
        return "tok " * len(req.token_ids)

    async def embed(self, req: Embed) -> tuple[list[list[float]], int]:
        """Unit vectors of ``dimensions`` (8 by default) counting each input's words (and
        an adapter's name) in buckets by their hash: scripted embeddings for protocol
        tests, no model."""
        size = req.dimensions or 8
        vectors, tokens = [], 0
        if req.count_only:
            return [], sum(len(item.split()) + 1 if isinstance(item, str) else len(item)
                           for item in req.inputs)
        async with self._adapter(req.lora):
            self._step(req.lora)
            for item in req.inputs:
                words = item.lower().split() if isinstance(item, str) else [str(t) for t in item]
                tokens += len(words) + (1 if isinstance(item, str) else 0)
                vector = [0.0] * size
                for word in words + ([req.lora.name] if req.lora is not None else []):
                    vector[zlib.crc32(word.encode()) % size] += 1.0
                norm = sum(x * x for x in vector) ** 0.5 or 1.0
                vectors.append([x / norm for x in vector])
        return vectors, tokens

    async def score(self, req: Score) -> tuple[list[float], int]:
        """The share of words a query (and an adapter's name) and a document have in
        common (Jaccard): scripted relevance for protocol tests, no model."""
        tokens = sum(len(t.split()) + 1 for t in [*req.queries, *req.documents])
        if req.count_only:
            return [], tokens
        queries = req.queries * len(req.documents) if len(req.queries) == 1 else req.queries
        extra = {req.lora.name} if req.lora is not None else set()
        scores = []
        async with self._adapter(req.lora):
            self._step(req.lora)
            for query, document in zip(queries, req.documents):
                a, b = set(query.lower().split()) | extra, set(document.lower().split())
                scores.append(len(a & b) / len(a | b) if a | b else 0.0)
        return scores, tokens

    async def _scripted(self, gen: Generate, prompt_len: int) -> AsyncIterator[list[Delta]]:
        turn = self._script[self._turns % len(self._script)]
        self._turns += 1
        call = turn.get("tool_call")
        if call is not None:
            yield [Delta(id=gen.id, tokens=1, finish_reason="tool_calls",
                         prompt_tokens=prompt_len, tool_calls=[ToolCallDelta(
                             index=0, id=f"call_{self._turns}", name=call["name"],
                             arguments=json.dumps(call.get("arguments", {})))])]
            return
        thought = str(turn.get("reasoning", "")).split(" ") if turn.get("reasoning") else []
        for i, word in enumerate(thought):
            yield [Delta(id=gen.id, reasoning=word + " ", tokens=1,
                         prompt_tokens=prompt_len if i == 0 else 0)]
        words = str(turn.get("text", "")).split(" ")
        for i, word in enumerate(words):
            last = i == len(words) - 1
            yield [Delta(id=gen.id, text=word + ("" if last else " "), tokens=1,
                         finish_reason="stop" if last else None,
                         prompt_tokens=prompt_len if last or i == 0 else 0)]

    def _step(self, ref: LoraRef | None) -> None:
        """An engine step of a request (with adapter ``ref``), as vLLM's."""
        if self.dead is not None:
            raise SyntheticError(self.dead, status=500)
        if ref is None:
            return
        if ref.number not in self.adapters_loaded:
            try:
                read_adapter(ref.path)
            except AdapterError as err:
                self.dead = f"engine dead: adapter {ref.name} failed to load in a step: {err}"
                raise SyntheticError(self.dead, status=500) from None
        self._admit(ref)

    @contextlib.asynccontextmanager
    async def _adapter(self, ref: LoraRef | None) -> AsyncIterator[None]:
        """Adapter ``ref`` (if any) held in the engine for the block, as vLLM's engine's."""
        if ref is None:
            yield
            return
        if self.adapters is None:
            raise SyntheticError("this model serves no adapters", param="model",
                                 code="adapter_invalid")
        async with self.adapters.held(ref):
            yield

    async def generate(self, gen: Generate) -> AsyncIterator[list[Delta]]:
        async with self._adapter(gen.lora):  # an adapter's request says the adapter's name
            async for batch in self._generate(gen, "tok" if gen.lora is None else gen.lora.name):
                yield batch

    async def _generate(self, gen: Generate, word: str) -> AsyncIterator[list[Delta]]:
        prompt_len = self._prompt_len(gen)
        self._step(gen.lora)
        if self._script:
            async for batch in self._scripted(gen, prompt_len):
                yield batch
            return
        if prompt_len >= self.max_model_len:
            raise SyntheticError("prompt longer than the context", param="messages",
                                 code="context_length_exceeded")
        room = self.max_model_len - prompt_len
        asked = gen.sampling.max_tokens
        if asked is not None and asked > room and not gen.sampling.clamp_max_tokens:
            raise SyntheticError(  # vLLM's wording (worker/engine.py)
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_len + asked} tokens ({prompt_len} in the "
                f"prompt, {asked} for the completion). Please reduce the length of the "
                "prompt or the completion.", param="max_tokens",
                code="context_length_exceeded")
        total = min(asked or 16, room)
        clamped = total if asked is not None and total < asked else 0
        sent = 0
        self._running += 1
        try:
            while sent < total:
                await self._awake.wait()
                if sent:
                    self._step(gen.lora)
                step = min(self._per_step, total - sent)
                sent += step
                done = sent == total
                text = f"{time.monotonic_ns()} " if self._timestamps else f"{word} " * step
                yield [Delta(id=gen.id, index=i, text=text, tokens=step,
                             finish_reason="length" if done else None,
                             prompt_tokens=prompt_len if done or sent == step else 0,
                             max_tokens=clamped if sent == step else 0)
                       for i in range(gen.sampling.n)]
                await asyncio.sleep(self._interval * step)
        finally:
            self._running -= 1

    async def abort(self, request_id: str) -> None:
        return None

    def in_flight(self) -> int:
        return self._running

    async def sleep(self, level: int) -> None:
        """Parked or asleep at any level: no step runs until ``wake``, and requests in
        flight are kept (as vLLM's paused scheduler keeps them, and its sleep mode with
        ``mode="keep"``: ``worker.engine``). The level is recorded (``asleep``, and a
        line in ``engine_args.sleep_log`` where set: tests read which level the router
        asked for)."""
        self._awake.clear()
        if self._spec.engine_args.get("sleep_fails"):
            # As vLLM can fail: its scheduler paused first, then the sleep itself fails
            # (fault injection: the router must resume it before it stops the model).
            self._note(f"sleep {level} failed")
            raise SyntheticError("sleep failed (engine_args.sleep_fails)", status=500)
        self.asleep = level
        self._note(f"sleep {level}")

    async def wake(self) -> None:
        level, self.asleep = self.asleep, None
        self._awake.set()
        self._note(f"wake {level}")

    def _note(self, line: str) -> None:
        path = self._spec.engine_args.get("sleep_log")
        if path:
            with open(path, "a", encoding="utf-8") as log:  # a line: no await in between
                log.write(line + "\n")

    def shutdown(self) -> None:
        return None
