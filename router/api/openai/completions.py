"""``POST /v1/completions``: prompts into ``Generate`` messages, deltas into OpenAI's
``text_completion`` chunks and body (echo, legacy logprobs with text offsets)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from router.api.openai.schema import (
    MAX_CHOICES,
    CompletionRequest,
    completion_sampling,
    keep_alive_seconds,
    text_or_token_lists,
)
from router.api.openai.shapes import OpenAIShaper, usage_body
from router.api.relay import Relay
from router.api.sse import encode_json
from router.api.wire import read_body, request_id
from router.errors import BadRequest
from router.workers.link import Usage
from shared.protocol import Delta, Generate


class CompletionShaper(OpenAIShaper):
    object_chunk = "text_completion"

    def __init__(self, rid: str, model: str, n_choices: int, logprobs: bool,
                 echo: list[str] | None, n: int, include_usage: bool = False) -> None:
        super().__init__(rid, model, include_usage)
        self.want_logprobs = logprobs
        self.echo = echo  # per prompt; choice i belongs to prompt i // n
        self.n = n
        self.texts: list[list[str]] = [[] for _ in range(n_choices)]
        self.tokens: list[list[str]] = [[] for _ in range(n_choices)]
        self.token_logprobs: list[list[float]] = [[] for _ in range(n_choices)]
        self.top: list[list[dict[str, float]]] = [[] for _ in range(n_choices)]
        self.offsets: list[list[int]] = [[] for _ in range(n_choices)]
        self.finish: list[str | None] = [None] * n_choices
        self.chars = [0] * n_choices
        self.started = [False] * n_choices

    def _text(self, d: Delta) -> str:
        if self.started[d.index] or self.echo is None:
            self.started[d.index] = True
            return d.text
        self.started[d.index] = True
        return self.echo[d.index // self.n] + d.text

    def _logprobs(self, d: Delta) -> dict[str, list[Any]] | None:
        if not (self.want_logprobs and d.logprobs):
            return None
        i = d.index
        lp: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}
        for t in d.logprobs:
            lp["tokens"].append(t.token)
            lp["token_logprobs"].append(t.logprob)
            lp["top_logprobs"].append({a.token: a.logprob for a in t.top})
            lp["text_offset"].append(self.chars[i])
            self.chars[i] += len(t.token)
        return lp

    def chunks(self, batch: list[Delta]) -> bytes:
        out: list[bytes] = []
        for d in batch:
            text = self._text(d)
            lp = self._logprobs(d)
            # A step whose token has no text yet (part of a character) is a chunk too,
            # as ``vllm serve`` sends it: clients time tokens by chunks (vLLM's own
            # benchmark client: one such step skipped read as a gap twice as long).
            if text or lp or d.finish_reason is not None or d.tokens:
                finish = None if d.finish_reason is None else _finish(d.finish_reason)
                out.append(self.frame([encode_json({
                    "index": d.index, "text": text, "logprobs": lp, "finish_reason": finish})]))
        return b"".join(out)

    def add(self, batch: list[Delta]) -> None:
        for d in batch:
            i = d.index
            self.texts[i].append(self._text(d))
            lp = self._logprobs(d)
            if lp is not None:
                self.tokens[i].extend(lp["tokens"])
                self.token_logprobs[i].extend(lp["token_logprobs"])
                self.top[i].extend(lp["top_logprobs"])
                self.offsets[i].extend(lp["text_offset"])
            if d.finish_reason is not None:
                self.finish[i] = d.finish_reason

    def body(self, usage: Usage) -> dict[str, Any]:
        choices = []
        for i, parts in enumerate(self.texts):
            lp = ({"tokens": self.tokens[i], "token_logprobs": self.token_logprobs[i],
                   "top_logprobs": self.top[i], "text_offset": self.offsets[i]}
                  if self.want_logprobs else None)
            choices.append({"index": i, "text": "".join(parts), "logprobs": lp,
                            "finish_reason": _finish(self.finish[i] or "stop")})
        return {"id": self.rid, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": usage_body(usage)}


def _finish(reason: str) -> str:
    """Completions know stop and length; a tool call is not possible here."""
    return "length" if reason == "length" else "stop"


async def completions(relay: Relay, request: Request, max_body: int) -> Response:
    req = await read_body(request, CompletionRequest, max_body)
    sampling = completion_sampling(req)
    prompts = text_or_token_lists(req.prompt, "prompt")
    if len(prompts) * sampling.n > MAX_CHOICES:
        raise BadRequest(f"{len(prompts)} prompts × n={sampling.n} asks for more than "
                         f"{MAX_CHOICES} choices", param="n", code="invalid_value")
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
    return await relay.generate(
        request, "completions", req.model, gens, req.stream,
        lambda model: CompletionShaper(rid, model, n_choices, req.logprobs is not None,
                                       echo, sampling.n, include_usage),
        keep_alive=keep_alive_seconds(req.keep_alive), user=req.user)
