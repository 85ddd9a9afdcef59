"""Messages between the router and a worker, encoded as msgpack with msgspec.

Router → worker: ``Generate``, ``Cancel``, ``Tokenize``, ``Detokenize``, ``Embed``,
``Score``, ``Ping``, ``Shutdown``, ``Sleep``, ``Wake``, ``Adapters``.
Worker → router: ``Ready``, ``Deltas``, ``TokenizeResult``, ``DetokenizeResult``,
``Embeddings``, ``Scores``, ``Error``, ``Pong``, ``AdapterStates``.

Nothing here is shaped like any public protocol: the router's protocol modules (OpenAI,
and the next ones) translate to and from these.

Every struct is ``array_like`` (no field names on the wire) with ``omit_defaults`` and
``gc=False``, as vLLM's own engine client does: the per-token path stays small and cheap.
One ``Deltas`` message carries the deltas of every request that advanced in one engine
step, instead of one message per token.
"""

from __future__ import annotations

from typing import Any

import msgspec

_WIRE = {"array_like": True, "omit_defaults": True, "gc": False}
# Tagged messages name their tag field "kind" so that Error may carry OpenAI's "type".
_MSG = {**_WIRE, "tag_field": "kind"}


class SamplingSpec(msgspec.Struct, **_WIRE):
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
    clamp_max_tokens: bool = False
    """A ``max_tokens`` over what the context leaves the prompt is lowered to it (and the
    first delta says so, ``Delta.max_tokens``) instead of refused."""


class ToolCall(msgspec.Struct, omit_defaults=True, gc=False):
    """A call the assistant made earlier in the conversation (history, not output)."""

    id: str
    name: str
    arguments: str = "{}"
    """JSON text, as the model wrote it."""


class ContentPart(msgspec.Struct, omit_defaults=True, gc=False):
    """One part of a message's content: text, or media for a multimodal model."""

    type: str
    """``text``, ``image_url``, ``input_audio``, ``video_url`` ..."""
    text: str | None = None
    url: str | None = None
    data: str | None = None
    format: str | None = None


class ChatMessage(msgspec.Struct, omit_defaults=True, gc=False):
    """One chat turn. ``content`` is its text (parts joined); ``parts`` keeps every part
    in order, only when some part is not text.

    Encoded as a map: it is nested data, not a per-token message.
    """

    role: str
    content: str | None = None
    name: str | None = None
    tool_call_id: str | None = None
    """For ``role: tool``: the call this message answers."""
    tool_calls: list[ToolCall] | None = None
    parts: list[ContentPart] | None = None


class Tool(msgspec.Struct, omit_defaults=True, gc=False):
    """A function the model may call; ``parameters`` is its JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    """The client's own ``strict``: ``True`` pins the arguments to ``parameters`` whatever
    the model's ``tool_strict_level``; ``False`` leaves them free; ``None``: the level says."""


class Constraint(msgspec.Struct, omit_defaults=True, gc=False):
    """Structured output: exactly one field is set (vLLM's ``StructuredOutputsParams``)."""

    json: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    param: str = "response_format"
    """The request field it came from, named by errors (it is protocol-specific)."""


class LoraRef(msgspec.Struct, **_WIRE):
    """A LoRA adapter a request (``Generate``, ``Embed``, ``Score``) runs with: its model
    name, the router's number for it (stable while the router lives; a new folder under
    one name gets a new number) and its folder."""

    name: str
    number: int
    path: str
    pinned: bool = False
    """Never leaves the engine's pool of loaded adapters."""


class Generate(msgspec.Struct, tag="generate", **_MSG):
    """Start a generation. Exactly one of ``messages``, ``prompt``, ``prompt_token_ids``."""

    id: str
    sampling: SamplingSpec
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    priority: int = 0
    tools: list[Tool] | None = None
    tool_choice: str = "auto"
    """``auto``, ``none``, ``required``, or ``function`` (then ``tool_name`` is the one)."""
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    constraint: Constraint | None = None
    template_kwargs: dict[str, Any] | None = None
    """Extra chat-template variables (``enable_thinking``, ``reasoning_effort`` ...)."""
    lora: LoraRef | None = None
    """The adapter on top of the base model; loaded into the engine on its first use."""


class Cancel(msgspec.Struct, tag="cancel", **_MSG):
    """Abort a generation (client went away)."""

    id: str


class Tokenize(msgspec.Struct, tag="tokenize", **_MSG):
    """Tokenize a prompt or render-and-tokenize a chat, without generating."""

    id: str
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[Tool] | None = None
    template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    """As ``Generate``'s: the chat renders as that generate's prompt does."""
    count_only: bool = False
    """Answer ``TokenizeResult.count`` alone (no ids): a budget's count of a prompt
    before it runs (``router.access.budgets``)."""


class Detokenize(msgspec.Struct, tag="detokenize", **_MSG):
    id: str
    token_ids: list[int]


class Embed(msgspec.Struct, tag="embed", **_MSG):
    """Embed each input (text or token ids) with a pooling model."""

    id: str
    inputs: list[str | list[int]]
    dimensions: int | None = None
    lora: LoraRef | None = None
    """The adapter on top of the base model, as ``Generate.lora``."""
    count_only: bool = False
    """Answer the prompt tokens the embedding would take (``Embeddings.prompt_tokens``),
    no vectors: a budget's count before it runs."""


class Score(msgspec.Struct, tag="score", **_MSG):
    """Score (query, document) pairs with a pooling model: a cross-encoder's relevance
    (``task: score`` or ``classify``) or the cosine of the two texts' embeddings
    (``task: embed``). ``queries`` holds one query, paired with every document, or one
    query per document."""

    id: str
    queries: list[str]
    documents: list[str]
    max_tokens_per_doc: int = 0
    """Each document cut to this many tokens before it is paired (0: not cut)."""
    lora: LoraRef | None = None
    """The adapter on top of the base model, as ``Generate.lora``."""
    count_only: bool = False
    """Answer the prompt tokens the scoring would take (``Scores.prompt_tokens``), no
    scores: a budget's count before it runs."""


class Ping(msgspec.Struct, tag="ping", **_MSG):
    id: str


class Shutdown(msgspec.Struct, tag="shutdown", **_MSG):
    pass


class Sleep(msgspec.Struct, tag="sleep", **_MSG):
    """Take the engine off its device; answered with ``Pong``. ``level`` 0 parks it on
    any device: its scheduler pauses between two steps and keeps every request in
    flight, its KV and prefix cache (vLLM's ``pause_generation(mode="keep",
    clear_cache=False)``); 1 and 2 are vLLM's sleep mode (GPU only): weights offloaded
    to host memory (1) or dropped (2), the KV cache freed."""

    id: str
    level: int = 1


class Wake(msgspec.Struct, tag="wake", **_MSG):
    """Leave a ``Sleep`` of any level; answered with ``Pong`` once the engine serves
    again (a parked one goes on with the requests it kept)."""

    id: str


class Adapters(msgspec.Struct, tag="adapters", **_MSG):
    """Load ``load`` into the engine (checked against the model first), then unload the
    adapters numbered ``unload``; answered with ``AdapterStates`` (nothing to do: a
    listing)."""

    id: str
    load: list[LoraRef] = []
    unload: list[int] = []


ToWorker = (Generate | Cancel | Tokenize | Detokenize | Embed | Score | Ping | Shutdown | Sleep
            | Wake | Adapters)


class TopLogprob(msgspec.Struct, **_WIRE):
    token: str
    logprob: float


class TokenLogprob(msgspec.Struct, **_WIRE):
    """Log probability of one sampled token and, if asked, its top alternatives."""

    token: str
    logprob: float
    top: list[TopLogprob] = []


class ToolCallDelta(msgspec.Struct, **_WIRE):
    """A piece of a tool call the model is making: the first piece of call ``index``
    carries ``id`` and ``name``; later ones carry argument text only."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class Delta(msgspec.Struct, **_WIRE):
    """New output of one choice of one request since its previous delta.

    ``finish_reason`` is set on the choice's last delta. The choice's first and last
    deltas carry the prompt's token counts (``usage``; a stream's start tells it, as
    Anthropic's ``message_start`` does). ``tokens`` counts the new token ids. ``text`` is
    answer text only: reasoning and tool calls, parsed by the worker, travel apart.
    ``finish_reason`` is ``stop``, ``length``, ``tool_calls`` or ``abort``.
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
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] | None = None
    max_tokens: int = 0
    """On a choice's first delta, when the request's ``max_tokens`` was clamped: what it
    became (``SamplingSpec.clamp_max_tokens``)."""


class Ready(msgspec.Struct, tag="ready", **_MSG):
    """The engine is up; sent once, after start-up."""

    model: str
    max_model_len: int
    pid: int
    max_prompt_chars: int = 0
    """No prompt longer than this (in characters) can fit the context: the router refuses
    one without sending it (0: no bound known)."""
    phases: dict[str, float] = {}
    """Seconds each step of the worker's start took (``imports``, ``model_files``,
    ``engine``), from when it learned its model."""
    booted_at: float = 0.0
    """Wall-clock time the worker learned its model (the router measures its spawn or a
    spare's hand-over up to here)."""


class Deltas(msgspec.Struct, tag="deltas", **_MSG):
    items: list[Delta]


class TokenizeResult(msgspec.Struct, tag="tokens", **_MSG):
    id: str
    token_ids: list[int]
    max_model_len: int
    token_strs: list[str] | None = None
    count: int = 0
    """The prompt tokens the engine would run: ``len(token_ids)``, or with media the
    context (no more can run; its media's own count is not known before it runs)."""


class DetokenizeResult(msgspec.Struct, tag="text", **_MSG):
    id: str
    text: str


class Embeddings(msgspec.Struct, tag="embeddings", **_MSG):
    id: str
    vectors: list[list[float]]
    prompt_tokens: int


class Scores(msgspec.Struct, tag="scores", **_MSG):
    id: str
    scores: list[float]
    """One per pair, in the pairs' order."""
    prompt_tokens: int


class Error(msgspec.Struct, tag="error", **_MSG):
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


class Pong(msgspec.Struct, tag="pong", **_MSG):
    id: str
    in_flight: int = 0


class AdapterState(msgspec.Struct, **_WIRE):
    number: int
    name: str
    load_seconds: float
    """Its last load: checked against the model and loaded into the engine."""
    pinned: bool = False
    loads: int = 1
    """Loads since the engine started (one per time it entered the engine's pool)."""


class AdapterStates(msgspec.Struct, tag="adapter_states", **_MSG):
    """The adapters loaded in the engine now, least recently used first."""

    id: str
    loaded: list[AdapterState] = []


ToRouter = (Ready | Deltas | TokenizeResult | DetokenizeResult | Embeddings | Scores | Error
            | Pong | AdapterStates)


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
