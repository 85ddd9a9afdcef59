"""OpenAI ``/v1/chat/completions`` and ``/v1/completions``.

Both endpoints run the same path: validate the body into ``Generate`` messages, acquire
the model, submit, and then either frame the delta stream as SSE or aggregate it into one
JSON body (generation is always streamed internally). A ``Choices`` object turns deltas
into the protocol's chunk and response shapes; the two protocols differ only there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from router.api.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_sampling,
    completion_prompts,
    completion_sampling,
)
from router.api.wire import (
    SSE_DONE,
    SSE_HEADERS,
    ClientGone,
    JSONResponse,
    encode_json,
    read_body,
    request_id,
    sse,
    unless_disconnected,
)
from router.errors import APIError, BadRequest
from router.link import RequestStream
from router.registry import Lease
from router.supervisor import Supervisor
from shared.config import ServerConfig
from shared.protocol import Delta, Generate, TokenLogprob

log = logging.getLogger("modelyard.router")


class Usage:
    """Token counts of one response, summed over its choices and prompts."""

    __slots__ = ("prompt", "cached", "completion")

    def __init__(self) -> None:
        self.prompt: dict[str, int] = {}
        self.cached: dict[str, int] = {}
        self.completion = 0

    def add(self, d: Delta) -> None:
        self.completion += d.tokens
        if d.finish_reason is not None:
            self.prompt[d.id] = d.prompt_tokens
            self.cached[d.id] = d.cached_tokens

    def body(self) -> dict[str, Any]:
        prompt = sum(self.prompt.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion,
                "total_tokens": prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


class Choices:
    """How one protocol shapes deltas; subclasses are chat and completions."""

    object_chunk = ""
    object_full = ""

    def __init__(self, rid: str, model: str, n_choices: int) -> None:
        self.rid = rid
        self.model = model
        self.created = int(time.time())
        self.texts: list[list[str]] = [[] for _ in range(n_choices)]
        self.aggregate = True
        """Keep text and logprobs for one JSON body; a stream needs only usage and finish."""
        self.finish: list[str | None] = [None] * n_choices
        self.usage = Usage()
        self._head = b""

    def frame(self, choices: list[bytes], tail: bytes = b"") -> bytes:
        if not self._head:  # every chunk starts the same way: encode that part once
            head = encode_json({"id": self.rid, "object": self.object_chunk,
                                "created": self.created, "model": self.model})
            self._head = b"data: " + head[:-1] + b',"choices":['
        return self._head + b",".join(choices) + b"]" + tail + b"}\n\n"

    def add(self, d: Delta) -> Any:
        """Account one delta; return its protocol-shaped logprobs, if any."""
        raise NotImplementedError

    def chunks(self, batch: list[Delta]) -> bytes:
        raise NotImplementedError

    def response(self) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self) -> bytes:
        return self.frame([], b',"usage":' + encode_json(self.usage.body()))


class ChatChoices(Choices):
    object_chunk = "chat.completion.chunk"
    object_full = "chat.completion"

    def __init__(self, rid: str, model: str, n_choices: int, logprobs: bool) -> None:
        super().__init__(rid, model, n_choices)
        self.want_logprobs = logprobs
        self.logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n_choices)]
        self.started = [False] * n_choices

    @staticmethod
    def _logprob_items(items: list[TokenLogprob]) -> list[dict[str, Any]]:
        return [{"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.token),
                 "top_logprobs": [{"token": a.token, "logprob": a.logprob,
                                   "bytes": _bytes(a.token)} for a in t.top]}
                for t in items]

    def add(self, d: Delta) -> list[dict[str, Any]] | None:
        self.usage.add(d)
        items = self._logprob_items(d.logprobs) if self.want_logprobs and d.logprobs else None
        if self.aggregate:
            self.texts[d.index].append(d.text)
            if items:
                self.logprobs[d.index].extend(items)
        if d.finish_reason is not None:
            self.finish[d.index] = d.finish_reason
        return items

    def chunks(self, batch: list[Delta]) -> bytes:
        out: list[bytes] = []
        for d in batch:
            items = self.add(d)
            i = d.index
            if not self.started[i]:
                self.started[i] = True
                out.append(self.frame([encode_json({
                    "index": i, "delta": {"role": "assistant", "content": ""},
                    "finish_reason": None})]))
            if d.text or items:
                choice: dict[str, Any] = {"index": i, "delta": {"content": d.text},
                                          "finish_reason": None}
                if items:
                    choice["logprobs"] = {"content": items, "refusal": None}
                out.append(self.frame([encode_json(choice)]))
            if d.finish_reason is not None:
                out.append(self.frame([encode_json({"index": i, "delta": {},
                                                    "finish_reason": d.finish_reason})]))
        return b"".join(out)

    def response(self) -> dict[str, Any]:
        choices = []
        for i, parts in enumerate(self.texts):
            choices.append({
                "index": i, "finish_reason": self.finish[i] or "stop",
                "message": {"role": "assistant", "content": "".join(parts), "refusal": None},
                "logprobs": ({"content": self.logprobs[i], "refusal": None}
                             if self.want_logprobs else None)})
        return {"id": self.rid, "object": self.object_full, "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage.body()}


class CompletionChoices(Choices):
    object_chunk = "text_completion"
    object_full = "text_completion"

    def __init__(self, rid: str, model: str, n_choices: int, logprobs: bool,
                 echo: list[str] | None, n: int) -> None:
        super().__init__(rid, model, n_choices)
        self.want_logprobs = logprobs
        self.echo = echo  # per prompt; choice i belongs to prompt i // n
        self.n = n
        self.tokens: list[list[str]] = [[] for _ in range(n_choices)]
        self.token_logprobs: list[list[float]] = [[] for _ in range(n_choices)]
        self.top: list[list[dict[str, float]]] = [[] for _ in range(n_choices)]
        self.offsets: list[list[int]] = [[] for _ in range(n_choices)]
        self.chars = [0] * n_choices
        self.started = [False] * n_choices

    def add(self, d: Delta) -> dict[str, Any] | None:
        self.usage.add(d)
        i = d.index
        text = d.text
        if not self.started[i]:
            self.started[i] = True
            if self.echo is not None:
                text = self.echo[i // self.n] + text
        if self.aggregate:
            self.texts[i].append(text)
        lp = None
        if self.want_logprobs and d.logprobs:
            lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for t in d.logprobs:
                lp["tokens"].append(t.token)
                lp["token_logprobs"].append(t.logprob)
                lp["top_logprobs"].append({a.token: a.logprob for a in t.top})
                lp["text_offset"].append(self.chars[i])
                self.chars[i] += len(t.token)
            if self.aggregate:
                for key, store in (("tokens", self.tokens), ("token_logprobs", self.token_logprobs),
                                   ("top_logprobs", self.top), ("text_offset", self.offsets)):
                    store[i].extend(lp[key])
        if d.finish_reason is not None:
            self.finish[i] = d.finish_reason
        self._last_text = text
        return lp

    def chunks(self, batch: list[Delta]) -> bytes:
        out: list[bytes] = []
        for d in batch:
            lp = self.add(d)
            if self._last_text or lp or d.finish_reason is not None:
                out.append(self.frame([encode_json({
                    "index": d.index, "text": self._last_text, "logprobs": lp,
                    "finish_reason": d.finish_reason})]))
        return b"".join(out)

    def response(self) -> dict[str, Any]:
        choices = []
        for i, parts in enumerate(self.texts):
            lp = ({"tokens": self.tokens[i], "token_logprobs": self.token_logprobs[i],
                   "top_logprobs": self.top[i], "text_offset": self.offsets[i]}
                  if self.want_logprobs else None)
            choices.append({"index": i, "text": "".join(parts), "logprobs": lp,
                            "finish_reason": self.finish[i] or "stop"})
        return {"id": self.rid, "object": self.object_full, "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage.body()}


class OpenAIAPI:
    """The OpenAI generation endpoints, bound to a supervisor."""

    def __init__(self, supervisor: Supervisor, server: ServerConfig,
                 max_body_bytes: int) -> None:
        self.supervisor = supervisor
        self.server = server
        self.max_body_bytes = max_body_bytes

    def routes(self) -> list[Route]:
        return [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"])]

    async def chat(self, request: Request) -> Response:
        req = await read_body(request, ChatCompletionRequest, self.max_body_bytes)
        sampling, messages = chat_sampling(req)
        rid = f"chatcmpl-{request_id()}"
        gens = [Generate(id=rid, sampling=sampling, messages=messages,
                         add_generation_prompt=req.add_generation_prompt,
                         continue_final_message=req.continue_final_message)]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await self._run(request, req.model, gens, req.stream, include_usage,
                               lambda model: ChatChoices(rid, model, sampling.n, req.logprobs))

    async def completions(self, request: Request) -> Response:
        req = await read_body(request, CompletionRequest, self.max_body_bytes)
        sampling = completion_sampling(req)
        prompts = completion_prompts(req)
        rid = f"cmpl-{request_id()}"
        gens = []
        for i, prompt in enumerate(prompts):
            gid = rid if len(prompts) == 1 else f"{rid}-{i}"
            if isinstance(prompt, str):
                gens.append(Generate(id=gid, sampling=sampling, prompt=prompt))
            else:
                gens.append(Generate(id=gid, sampling=sampling, prompt_token_ids=prompt))
        echo = None
        if req.echo:
            if not all(isinstance(p, str) for p in prompts):
                raise BadRequest("'echo' needs text prompts", param="echo")
            echo = [p for p in prompts if isinstance(p, str)]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        n_choices = sampling.n * len(prompts)
        return await self._run(
            request, req.model, gens, req.stream, include_usage,
            lambda model: CompletionChoices(rid, model, n_choices, req.logprobs is not None,
                                            echo, sampling.n))

    async def _run(self, request: Request, model: str | None, gens: list[Generate],
                   streaming: bool, include_usage: bool, make: Any) -> Response:
        started = time.perf_counter()
        lease, link = await self.supervisor.acquire(model)
        stream: RequestStream | None = None
        try:
            stream = link.submit(gens)
            choices: Choices = make(lease.entry.id)
            choices.aggregate = not streaming
            try:
                # Wait for the first output so that a refused request is a JSON 4xx, not
                # an SSE stream that starts 200 and then carries an error.
                first = await stream.__anext__()
            except StopAsyncIteration:
                first = []
        except BaseException:
            if stream is not None:
                stream.close()
            lease.release()
            raise
        if streaming:
            body = self._sse(stream, choices, first, include_usage, lease, started)
            return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            for d in first:
                choices.add(d)
            if not stream.exhausted:  # long answer: stop generating if the client leaves
                await unless_disconnected(request, self._drain(stream, choices))
        except ClientGone:
            return Response(status_code=499)
        finally:
            stream.close()
            lease.release()
        self._log(choices, started, 200)
        return JSONResponse(choices.response())

    @staticmethod
    async def _drain(stream: RequestStream, choices: Choices) -> None:
        async for batch in stream:
            for d in batch:
                choices.add(d)

    async def _sse(self, stream: RequestStream, choices: Choices, first: list[Delta],
                   include_usage: bool, lease: Lease, started: float) -> AsyncIterator[bytes]:
        status = 200
        try:
            if first:
                yield choices.chunks(first)
            try:
                async for batch in stream:
                    yield choices.chunks(batch)
            except Exception as err:  # the worker failed mid-stream: tell the client in-band
                api = err if isinstance(err, APIError) else APIError(str(err))
                status = api.status
                yield sse(api.body())
                return
            if include_usage:
                yield choices.usage_chunk()
            yield SSE_DONE
        finally:
            stream.close()
            lease.release()
            self._log(choices, started, status)

    @staticmethod
    def _log(choices: Choices, started: float, status: int) -> None:
        usage = choices.usage.body()
        ms = (time.perf_counter() - started) * 1000
        log.info("%s model=%s status=%d prompt=%d completion=%d cached=%d %.0f ms "
                 "finish=%s", choices.rid, choices.model, status, usage["prompt_tokens"],
                 usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                 ms, ",".join(f or "-" for f in choices.finish))
