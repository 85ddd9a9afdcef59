"""A delta stream as Anthropic's Message: content blocks, stream events, the final body.

One state machine serves both ways of answering: each delta becomes block operations
(open a block, add to it, close it) that ``chunks`` renders as the documented stream
events and ``add`` only applies, so a stream and a body always hold the same blocks.

Stream grammar: ``message_start`` (the prompt's real token counts), then per block
``content_block_start`` → ``content_block_delta``… → ``content_block_stop`` with indexes
0, 1, 2… and one block open at a time (``thinking_delta`` then ``signature_delta`` before
a thinking block closes; ``text_delta``; one ``input_json_delta`` with a tool's whole
input as parsed, when its block closes, so that it always parses), then
``message_delta`` (``stop_reason``, cumulative ``output_tokens``) and ``message_stop``.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import msgspec

from router.api.sse import sse
from router.errors import APIError, anthropic_error
from router.workers.link import Usage
from shared.protocol import Delta

PING = sse({"type": "ping"}, "ping")

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def _signature(thinking: str) -> str:
    """An opaque signature for a thinking block, as clients expect one (they send it back;
    nothing here checks it)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def _input(arguments: str) -> Any:
    """A tool call's arguments as its ``input`` object ({} if the model wrote no object)."""
    try:
        value = msgspec.json.decode(arguments or "{}")
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesShaper:
    """Shapes one Messages response (a single choice)."""

    has_reasoning = True  # a ``thinking`` block

    def __init__(self, mid: str, model: str, stop_sequences: list[str]) -> None:
        self.mid = mid
        self.model = model
        self.stop_sequences = stop_sequences
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None  # the type of the open block (the last one)
        self.arguments: dict[int, list[str]] = {}  # per block index: tool input text
        self.calls: dict[int, int] = {}  # call index → block index
        self.events: list[tuple[str, dict[str, Any]]] | None = None  # None: not streaming
        self.started = False
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.finish: str | None = None
        self.stop_reason: str | int | None = None

    # -- block operations ---------------------------------------------------------------
    def _emit(self, event: str, payload: dict[str, Any]) -> None:
        if self.events is not None:
            self.events.append((event, payload))

    def _start(self, block: dict[str, Any]) -> int:
        self._stop()
        self.blocks.append(block)
        self.open = block["type"]
        index = len(self.blocks) - 1
        self._emit("content_block_start", {"type": "content_block_start", "index": index,
                                           "content_block": dict(block)})
        return index

    def _delta(self, index: int, delta: dict[str, Any]) -> None:
        self._emit("content_block_delta", {"type": "content_block_delta", "index": index,
                                           "delta": delta})

    def _stop(self) -> None:
        if self.open is None:
            return
        index = len(self.blocks) - 1
        block = self.blocks[index]
        if self.open == "thinking":
            block["signature"] = _signature(block["thinking"])
            self._delta(index, {"type": "signature_delta", "signature": block["signature"]})
        elif self.open == "tool_use":
            # The input as parsed, once, in stream and body alike: a model's invalid JSON
            # would make the SDKs' partial-JSON parsers throw (it becomes {} in both).
            block["input"] = _input("".join(self.arguments.get(index, ())))
            self._delta(index, {"type": "input_json_delta",
                                "partial_json": msgspec.json.encode(block["input"]).decode()})
        self._emit("content_block_stop", {"type": "content_block_stop", "index": index})
        self.open = None

    def _append(self, kind: str, key: str, text: str) -> None:
        if self.open != kind:
            self._start({"type": kind, key: ""} if kind == "text"
                        else {"type": kind, key: "", "signature": ""})
        index = len(self.blocks) - 1
        self.blocks[index][key] += text
        self._delta(index, {"type": f"{kind}_delta", key: text})

    def _apply(self, d: Delta) -> None:
        if d.prompt_tokens:
            self.prompt_tokens, self.cached_tokens = d.prompt_tokens, d.cached_tokens
        if d.reasoning:
            self._append("thinking", "thinking", d.reasoning)
        if d.text:
            self._append("text", "text", d.text)
        for c in d.tool_calls or ():
            if c.name is not None:
                index = self._start({"type": "tool_use",
                                     "id": f"toolu_{self.mid[4:]}_{len(self.calls)}",
                                     "name": c.name, "input": {}})
                self.calls[c.index] = index
            else:
                index = self.calls.get(c.index, -1)
            if index < 0 or not c.arguments:
                continue
            self.arguments.setdefault(index, []).append(c.arguments)
        if d.finish_reason is not None:
            self.finish, self.stop_reason = d.finish_reason, d.stop_reason

    # -- what the message says ---------------------------------------------------------
    def _stop_fields(self) -> dict[str, Any]:
        reason = _STOP_REASONS.get(self.finish or "stop", "end_turn")
        if reason == "end_turn" and self.calls:  # a named or forced call ends as "stop"
            reason = "tool_use"
        sequence = None
        if (reason == "end_turn" and isinstance(self.stop_reason, str)
                and self.stop_reason in self.stop_sequences):
            reason, sequence = "stop_sequence", self.stop_reason
        return {"stop_reason": reason, "stop_sequence": sequence}

    def _usage(self, output_tokens: int) -> dict[str, int]:
        return {"input_tokens": self.prompt_tokens - self.cached_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": self.cached_tokens,
                "output_tokens": output_tokens}

    def _message(self, content: list[dict[str, Any]], output_tokens: int,
                 stop: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.mid, "type": "message", "role": "assistant", "model": self.model,
                "content": content, **stop, "usage": self._usage(output_tokens)}

    # -- the relay's Shaper ------------------------------------------------------------
    def chunks(self, batch: list[Delta]) -> bytes:
        self.events = []
        for d in batch:
            self._apply(d)
        out = []
        if not self.started:
            self.started = True
            out.append(sse({"type": "message_start", "message": self._message(
                [], 0, {"stop_reason": None, "stop_sequence": None})}, "message_start"))
        out += [sse(payload, event) for event, payload in self.events]
        return b"".join(out)

    def close(self, usage: Usage) -> bytes:
        self.events = []
        self._stop()
        self._emit("message_delta", {"type": "message_delta", "delta": self._stop_fields(),
                                     "usage": self._usage(usage.completion)})
        self._emit("message_stop", {"type": "message_stop"})
        return b"".join(sse(payload, event) for event, payload in self.events)

    def error_event(self, err: APIError) -> bytes:
        return sse(anthropic_error(err)[1], "error")

    def add(self, batch: list[Delta]) -> None:
        for d in batch:
            self._apply(d)

    def body(self, usage: Usage) -> dict[str, Any]:
        self._stop()
        return self._message(self.blocks, usage.completion, self._stop_fields())
