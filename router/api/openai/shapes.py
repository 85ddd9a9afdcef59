"""What OpenAI's chat and completions shapes share: chunk framing, usage, stream end,
in-band errors, logprob items."""

from __future__ import annotations

import time
from typing import Any

from router.api.sse import SSE_DONE, encode_json, sse
from router.errors import APIError
from router.workers.link import Usage
from shared.protocol import Delta, TokenLogprob


def usage_body(usage: Usage) -> dict[str, Any]:
    prompt = usage.prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": usage.completion,
            "total_tokens": prompt + usage.completion,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def logprob_items(items: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's logprobs ``content`` entries."""
    return [{"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.token),
             "top_logprobs": [{"token": a.token, "logprob": a.logprob,
                               "bytes": _bytes(a.token)} for a in t.top]}
            for t in items]


class OpenAIShaper:
    """Chunk framing and stream end for one OpenAI response (subclass: chat, completions)."""

    object_chunk = ""
    has_reasoning = False
    """Legacy completions have no reasoning field (chat's shaper has, and says so)."""

    def __init__(self, rid: str, model: str, include_usage: bool) -> None:
        self.rid = rid
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())
        self._head = b""

    def frame(self, choices: list[bytes], tail: bytes = b"") -> bytes:
        if not self._head:  # every chunk starts the same way: encode that part once
            head = encode_json({"id": self.rid, "object": self.object_chunk,
                                "created": self.created, "model": self.model})
            self._head = b"data: " + head[:-1] + b',"choices":['
        return self._head + b",".join(choices) + b"]" + tail + b"}\n\n"

    def close(self, usage: Usage) -> bytes:
        if not self.include_usage:
            return SSE_DONE
        return self.frame([], b',"usage":' + encode_json(usage_body(usage))) + SSE_DONE

    def error_event(self, err: APIError) -> bytes:
        return sse(err.body())

    def chunks(self, batch: list[Delta]) -> bytes:
        raise NotImplementedError

    def add(self, batch: list[Delta]) -> None:
        raise NotImplementedError
