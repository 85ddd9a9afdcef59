"""Messages between the router and a worker, encoded as msgpack with msgspec.

Router → worker: ``Generate``, ``Cancel``, ``Tokenize``, ``Ping``, ``Shutdown``, ``Sleep``,
``Wake``.
Worker → router: ``Ready``, ``Deltas``, ``TokenizeResult``, ``Error``, ``Pong``.

Every struct is ``array_like`` (no field names on the wire) with ``omit_defaults`` and
``gc=False``, as vLLM's own engine client does: the per-token path stays small and cheap.
One ``Deltas`` message carries the deltas of every request that advanced in one engine
step, instead of one message per token.
"""

from __future__ import annotations

from typing import Union

import msgspec

_WIRE = {"array_like": True, "omit_defaults": True, "gc": False}
# Tagged messages name their tag field "kind" so that Error may carry OpenAI's "type".
_MSG = {**_WIRE, "tag_field": "kind"}


class SamplingSpec(msgspec.Struct, **_WIRE):  # type: ignore[call-arg]
    """The sampling parameters a worker turns into ``vllm.SamplingParams``.

    ``None`` means "the model's default" (vLLM reads ``generation_config.json``).
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None


class ChatMessage(msgspec.Struct, omit_defaults=True, gc=False):
    """One chat turn, already flattened to text by the protocol module that received it.

    Encoded as a map so that ``msgspec.to_builtins`` gives exactly the dict a chat
    template expects.
    """

    role: str
    content: str | None = None
    name: str | None = None
    tool_call_id: str | None = None


class Generate(msgspec.Struct, tag="generate", **_MSG):  # type: ignore[call-arg]
    """Start a generation. Exactly one of ``messages``, ``prompt``, ``prompt_token_ids``."""

    id: str
    sampling: SamplingSpec
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    priority: int = 0


class Cancel(msgspec.Struct, tag="cancel", **_MSG):  # type: ignore[call-arg]
    """Abort a generation (client went away)."""

    id: str


class Tokenize(msgspec.Struct, tag="tokenize", **_MSG):  # type: ignore[call-arg]
    """Tokenize a prompt or render-and-tokenize a chat, without generating."""

    id: str
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class Ping(msgspec.Struct, tag="ping", **_MSG):  # type: ignore[call-arg]
    id: str


class Shutdown(msgspec.Struct, tag="shutdown", **_MSG):  # type: ignore[call-arg]
    pass


class Sleep(msgspec.Struct, tag="sleep", **_MSG):  # type: ignore[call-arg]
    """Put the engine in vLLM sleep mode (GPU only); answered with ``Pong``."""

    id: str
    level: int = 1


class Wake(msgspec.Struct, tag="wake", **_MSG):  # type: ignore[call-arg]
    """Leave sleep mode; answered with ``Pong`` once the engine serves again."""

    id: str


ToWorker = Union[Generate, Cancel, Tokenize, Ping, Shutdown, Sleep, Wake]


class TopLogprob(msgspec.Struct, **_WIRE):  # type: ignore[call-arg]
    token: str
    logprob: float


class TokenLogprob(msgspec.Struct, **_WIRE):  # type: ignore[call-arg]
    """Log probability of one sampled token and, if asked, its top alternatives."""

    token: str
    logprob: float
    top: list[TopLogprob] = []


class Delta(msgspec.Struct, **_WIRE):  # type: ignore[call-arg]
    """New output of one choice of one request since its previous delta.

    ``finish_reason`` is set on the choice's last delta, which also carries the prompt's
    token counts (needed for ``usage``). ``tokens`` counts the new token ids.
    """

    id: str
    index: int = 0
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


class Ready(msgspec.Struct, tag="ready", **_MSG):  # type: ignore[call-arg]
    """The engine is up; sent once, after start-up."""

    model: str
    max_model_len: int
    pid: int


class Deltas(msgspec.Struct, tag="deltas", **_MSG):  # type: ignore[call-arg]
    items: list[Delta]


class TokenizeResult(msgspec.Struct, tag="tokens", **_MSG):  # type: ignore[call-arg]
    id: str
    token_ids: list[int]
    max_model_len: int
    token_strs: list[str] | None = None


class Error(msgspec.Struct, tag="error", **_MSG):  # type: ignore[call-arg]
    """A request failed (``id`` set) or the worker cannot go on (``id`` empty).

    ``status``, ``type``, ``param`` and ``code`` follow OpenAI's error object, so the
    router can pass a worker's validation error (say, a prompt longer than the context)
    to the client unchanged.
    """

    id: str
    message: str
    status: int = 500
    type: str = "server_error"
    param: str | None = None
    code: str | None = None


class Pong(msgspec.Struct, tag="pong", **_MSG):  # type: ignore[call-arg]
    id: str
    in_flight: int = 0


ToRouter = Union[Ready, Deltas, TokenizeResult, Error, Pong]


class Codec:
    """One reusable msgpack encoder and a decoder for the messages one side receives."""

    def __init__(self, receives: type) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[object] = msgspec.msgpack.Decoder(receives)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, frame: bytes | memoryview) -> object:
        return self._decoder.decode(frame)


def router_codec() -> Codec:
    """The router's codec: encodes ``ToWorker``, decodes ``ToRouter``."""
    return Codec(ToRouter)  # type: ignore[arg-type]


def worker_codec() -> Codec:
    """The worker's codec: encodes ``ToRouter``, decodes ``ToWorker``."""
    return Codec(ToWorker)  # type: ignore[arg-type]
