"""``POST /v1/chat/completions``: the request into ``Generate``, deltas into OpenAI's shapes.

Streaming: one ``chat.completion.chunk`` per delta (a role chunk opens each choice; a
delta's reasoning, answer text, tool-call pieces and logprobs share one chunk), then an
empty-delta chunk with the finish reason. Non-streaming: one ``chat.completion`` with
``reasoning_content``, ``tool_calls`` (or the legacy ``function_call``) assembled.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from router.api.openai.schema import ChatCompletionRequest, chat_generate, keep_alive_seconds
from router.api.openai.shapes import OpenAIShaper, logprob_items, usage_body
from router.api.relay import Relay
from router.api.sse import encode_json
from router.api.wire import read_body, request_id
from router.workers.link import Usage
from shared.protocol import Delta


class _Call:
    """One tool call of one choice, assembled from its pieces."""

    __slots__ = ("arguments", "id", "name")

    def __init__(self) -> None:
        self.id = ""
        self.name = ""
        self.arguments: list[str] = []


class ChatShaper(OpenAIShaper):
    object_chunk = "chat.completion.chunk"
    has_reasoning = True  # ``delta.reasoning_content``

    def __init__(self, rid: str, model: str, n_choices: int, logprobs: bool,
                 include_usage: bool = False, legacy_functions: bool = False,
                 tools: bool = False) -> None:
        super().__init__(rid, model, include_usage)
        self.want_logprobs = logprobs
        self.legacy = legacy_functions
        self.tools = tools
        self.started = [False] * n_choices
        self.texts: list[list[str]] = [[] for _ in range(n_choices)]
        self.reasoning: list[list[str]] = [[] for _ in range(n_choices)]
        self.calls: list[dict[int, _Call]] = [{} for _ in range(n_choices)]
        self.logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n_choices)]
        self.finish: list[str | None] = [None] * n_choices

    def _finish(self, reason: str) -> str:
        return "function_call" if reason == "tool_calls" and self.legacy else reason

    # -- stream ------------------------------------------------------------------------
    def _tool_chunk(self, d: Delta) -> dict[str, Any]:
        assert d.tool_calls is not None
        if self.legacy:  # the legacy shape has one call and no index or id
            c = d.tool_calls[0]
            return {"function_call": {k: v for k, v in (("name", c.name),
                                                         ("arguments", c.arguments)) if v is not None}}
        out = []
        for c in d.tool_calls:
            fn: dict[str, str] = {"arguments": c.arguments}
            item: dict[str, Any] = {"index": c.index, "function": fn}
            if c.name is not None:
                fn["name"] = c.name
                item["id"] = c.id or f"call_{self.rid}_{c.index}"
                item["type"] = "function"
            out.append(item)
        return {"tool_calls": out}

    def chunks(self, batch: list[Delta]) -> bytes:
        out: list[bytes] = []
        for d in batch:
            i = d.index
            if not self.started[i]:
                self.started[i] = True
                out.append(self.frame([encode_json({
                    "index": i, "delta": {"role": "assistant", "content": ""},
                    "finish_reason": None})]))
            delta: dict[str, Any] = {}
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
            if d.text:
                delta["content"] = d.text
            if d.tool_calls:
                delta.update(self._tool_chunk(d))
            items = logprob_items(d.logprobs) if self.want_logprobs and d.logprobs else None
            if not delta and d.tokens and not self.tools:
                # A step whose token has no text yet (part of a character) is a chunk too,
                # as ``vllm serve`` sends it: clients time tokens by chunks. Not where a
                # tool call's markup may be what the parser holds back (vLLM skips those).
                delta["content"] = ""
            if delta or items:
                choice: dict[str, Any] = {"index": i, "delta": delta, "finish_reason": None}
                if items:
                    delta.setdefault("content", "")
                    choice["logprobs"] = {"content": items, "refusal": None}
                out.append(self.frame([encode_json(choice)]))
            if d.finish_reason is not None:
                out.append(self.frame([encode_json({
                    "index": i, "delta": {}, "finish_reason": self._finish(d.finish_reason)})]))
        return b"".join(out)

    # -- aggregate ---------------------------------------------------------------------
    def add(self, batch: list[Delta]) -> None:
        for d in batch:
            i = d.index
            if d.text:
                self.texts[i].append(d.text)
            if d.reasoning:
                self.reasoning[i].append(d.reasoning)
            for c in d.tool_calls or ():
                call = self.calls[i].setdefault(c.index, _Call())
                if c.name is not None:
                    call.name = c.name
                    call.id = c.id or f"call_{self.rid}_{c.index}"
                call.arguments.append(c.arguments)
            if self.want_logprobs and d.logprobs:
                self.logprobs[i].extend(logprob_items(d.logprobs))
            if d.finish_reason is not None:
                self.finish[i] = d.finish_reason

    def _message(self, i: int) -> dict[str, Any]:
        text = "".join(self.texts[i])
        calls = [c for _, c in sorted(self.calls[i].items())]
        message: dict[str, Any] = {"role": "assistant",
                                   "content": text if text or not calls else None,
                                   "refusal": None}
        if self.reasoning[i]:
            message["reasoning_content"] = "".join(self.reasoning[i])
        if calls and self.legacy:
            message["function_call"] = {"name": calls[0].name,
                                        "arguments": "".join(calls[0].arguments)}
        elif calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name,
                                                   "arguments": "".join(c.arguments)}}
                                     for c in calls]
        return message

    def body(self, usage: Usage) -> dict[str, Any]:
        choices = [{"index": i, "finish_reason": self._finish(self.finish[i] or "stop"),
                    "message": self._message(i),
                    "logprobs": ({"content": self.logprobs[i], "refusal": None}
                                 if self.want_logprobs else None)}
                   for i in range(len(self.texts))]
        return {"id": self.rid, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": usage_body(usage)}


async def chat_completions(relay: Relay, request: Request, max_body: int) -> Response:
    req = await read_body(request, ChatCompletionRequest, max_body)
    rid = f"chatcmpl-{request_id()}"
    gen = chat_generate(req, rid)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    legacy = req.functions is not None  # answer in the legacy function_call shape too
    return await relay.generate(
        request, "chat", req.model, [gen], req.stream,
        lambda model: ChatShaper(rid, model, gen.sampling.n, req.logprobs, include_usage,
                                 legacy, tools=bool(gen.tools)),
        keep_alive=keep_alive_seconds(req.keep_alive), user=req.user)

