"""Deltas into OpenAI Responses shapes: output items, the Response object, stream events.

One response has one choice. Its output is a sequence of items, each opened when the kind
of output changes: a ``reasoning`` item (``reasoning_text`` content), a ``message`` (one
``output_text`` part), one ``function_call`` item per tool call. Streaming, every event
carries ``sequence_number`` from 0, as OpenAI sends them::

    response.created, response.in_progress
    per item: response.output_item.added
              message:   content_part.added, output_text.delta ..., output_text.done,
                         content_part.done
              reasoning: content_part.added, reasoning_text.delta ..., reasoning_text.done,
                         content_part.done
              call:      function_call_arguments.delta ..., function_call_arguments.done
              response.output_item.done (the complete item)
    response.completed | response.incomplete (``max_output_tokens``) | response.failed
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from router.api.openai.shapes import logprob_items
from router.api.sse import sse
from router.errors import APIError
from router.workers.link import Usage
from shared.protocol import Delta, ToolCallDelta


def usage_body(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    """Responses' usage: ``input_tokens`` includes the cached ones."""
    return {"input_tokens": usage.prompt_tokens,
            # no explicit cache writes here (OpenAI's prompt_cache_options); the schema
            # requires the field
            "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": usage.completion,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion}


def error_code(err: APIError) -> str:
    """A Response's ``error.code``: one of the few OpenAI defines for a failed response."""
    if err.status == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if err.status == 400 else "server_error"


class _Item:
    """One output item being assembled."""

    __slots__ = ("call_id", "id", "index", "kind", "logprobs", "name", "pieces")

    def __init__(self, kind: str, index: int, item_id: str) -> None:
        self.kind = kind  # "message", "reasoning" or "function_call"
        self.index = index
        self.id = item_id
        self.pieces: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.call_id = ""
        self.name = ""

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def part(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": self.text}
        return {"type": "output_text", "text": self.text, "annotations": [],
                "logprobs": self.logprobs}

    def body(self, status: str, opening: bool = False) -> dict[str, Any]:
        """The item as ``output`` holds it (``opening``: as ``output_item.added`` shows it)."""
        if self.kind == "function_call":
            return {"id": self.id, "type": "function_call", "status": status,
                    "call_id": self.call_id, "name": self.name,
                    "arguments": "" if opening else self.text}
        content = [] if opening else [self.part()]
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content,
                    "status": status}
        return {"id": self.id, "type": "message", "role": "assistant", "status": status,
                "content": content}


class ResponseShaper:
    """Shapes one response's deltas (``relay.Shaper``): stream events or the Response
    object. ``echo`` holds the request's settings the object repeats; ``on_done`` gets the
    final object (completed, incomplete or failed), to store it."""

    has_reasoning = True  # a ``reasoning`` item

    def __init__(self, rid: str, echo: dict[str, Any], *, streaming: bool,
                 logprobs: bool = False, created_at: int | None = None,
                 on_done: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.rid = rid
        self.echo = echo
        self.streaming = streaming
        self.want_logprobs = logprobs
        self.created_at = int(time.time()) if created_at is None else created_at
        self.on_done = on_done
        self.model = ""
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}
        self.finish: str | None = None
        self.reasoning_tokens = 0
        self.seq = 0
        self.started = False
        self._out: list[bytes] = []

    def bind(self, model: str) -> ResponseShaper:
        """The shaper for the model the relay resolved (``shaper_for``)."""
        self.model = model
        return self

    # -- the Response object -------------------------------------------------------------
    def response(self, status: str, usage: dict[str, Any] | None = None,
                 error: APIError | None = None) -> dict[str, Any]:
        """The Response object now: ``status`` and the items so far."""
        body: dict[str, Any] = {
            "id": self.rid, "object": "response", "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": ({"code": error_code(error), "message": error.message}
                      if error is not None else None),
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "model": self.model,
            "output": [item.body(self._status(item, status)) for item in self.items],
            **self.echo,
        }
        if usage is not None:  # the schema allows no null here: left out until known
            body["usage"] = usage
        return body

    def _status(self, item: _Item, status: str) -> str:
        """An item's status: the open (last) one ends as the response does."""
        if item is not self.open or status == "completed":
            return "completed"
        return "in_progress" if status in ("queued", "in_progress") else "incomplete"

    def _final(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    # -- events ------------------------------------------------------------------------
    def _emit(self, kind: str, **fields: Any) -> None:
        if self.streaming:
            self._out.append(sse({"type": kind, **fields, "sequence_number": self.seq},
                                 event=kind))
            self.seq += 1

    def _flush(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out

    def _start(self) -> None:
        self.started = True
        self._emit("response.created", response=self.response("in_progress"))
        self._emit("response.in_progress", response=self.response("in_progress"))

    def _add(self, kind: str, prefix: str, name: str = "", call_id: str = "") -> _Item:
        """Close the open item and open a new one of ``kind`` (a call's ``name`` and
        ``call_id`` are known when it opens)."""
        self._close("completed")
        index = len(self.items)
        item = self.open = _Item(kind, index, f"{prefix}_{self.rid[5:]}_{index}")
        item.name, item.call_id = name, call_id
        self.items.append(item)
        self._emit("response.output_item.added", output_index=item.index,
                   item=item.body("in_progress", opening=True))
        if kind != "function_call":
            self._emit("response.content_part.added", item_id=item.id,
                       output_index=item.index, content_index=0,
                       part={**item.part(), "text": ""})
        return item

    def _close(self, status: str) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            self._emit("response.function_call_arguments.done", **where, name=item.name,
                       arguments=item.text)
        elif item.kind == "reasoning":
            self._emit("response.reasoning_text.done", **where, content_index=0,
                       text=item.text)
        else:
            self._emit("response.output_text.done", **where, content_index=0, text=item.text,
                       logprobs=item.logprobs)
        if item.kind != "function_call":
            self._emit("response.content_part.done", **where, content_index=0,
                       part=item.part())
        self._emit("response.output_item.done", output_index=item.index,
                   item=item.body(status))

    def _feed(self, d: Delta) -> None:
        if d.reasoning:
            item = self.open if self.open and self.open.kind == "reasoning" else \
                self._add("reasoning", "rs")
            item.pieces.append(d.reasoning)
            self._emit("response.reasoning_text.delta", item_id=item.id,
                       output_index=item.index, content_index=0, delta=d.reasoning)
            if not d.text and not d.tool_calls:  # a delta of reasoning only: its tokens
                self.reasoning_tokens += d.tokens
        if d.text:
            item = self.open if self.open and self.open.kind == "message" else \
                self._add("message", "msg")
            item.pieces.append(d.text)
            logprobs = logprob_items(d.logprobs) if self.want_logprobs and d.logprobs else []
            item.logprobs.extend(logprobs)
            self._emit("response.output_text.delta", item_id=item.id, output_index=item.index,
                       content_index=0, delta=d.text, logprobs=logprobs)
        for piece in d.tool_calls or ():
            self._call(piece)
        if d.finish_reason is not None:
            self.finish = d.finish_reason

    def _call(self, piece: ToolCallDelta) -> None:
        item = self.calls.get(piece.index)
        if item is None or piece.name is not None:  # a call's first piece names it
            item = self.calls[piece.index] = self._add(
                "function_call", "fc", piece.name or "",
                piece.id or f"call_{self.rid[5:]}_{piece.index}")
        if piece.arguments:
            item.pieces.append(piece.arguments)
            self._emit("response.function_call_arguments.delta", item_id=item.id,
                       output_index=item.index, delta=piece.arguments)

    # -- relay.Shaper ------------------------------------------------------------------
    def chunks(self, batch: list[Delta]) -> bytes:
        if not self.started:
            self._start()
        for d in batch:
            self._feed(d)
        return self._flush()

    def close(self, usage: Usage) -> bytes:
        if not self.started:
            self._start()
        status = self._final()
        response = self.response(status, usage_body(usage, self.reasoning_tokens))
        self._close("incomplete" if status == "incomplete" else "completed")
        self._emit(f"response.{status}", response=response)
        self._done(response)
        return self._flush()

    def error_event(self, err: APIError) -> bytes:
        """A failure after the stream began: ``response.failed`` with the output so far."""
        if not self.started:
            self._start()
        response = self.response("failed", error=err)
        self._close("incomplete")
        self._emit("response.failed", response=response)
        self._done(response)
        return self._flush()

    def add(self, batch: list[Delta]) -> None:
        for d in batch:
            self._feed(d)

    def body(self, usage: Usage) -> dict[str, Any]:
        response = self.response(self._final(), usage_body(usage, self.reasoning_tokens))
        self._done(response)
        return response

    def _done(self, response: dict[str, Any]) -> None:
        if self.on_done is not None:
            self.on_done(response)
