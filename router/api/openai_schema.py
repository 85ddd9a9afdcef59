"""OpenAI request bodies as msgspec Structs, and their translation to ``shared.protocol``.

Decoding with types gives field errors for free; ``validate`` adds the range checks
OpenAI documents. Unknown fields are ignored, as OpenAI and vLLM do.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from router.errors import BadRequest
from shared.protocol import ChatMessage, SamplingSpec


Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
"""Every integer a client sends must fit the wire protocol (and OpenAI's own int64)."""


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class RequestMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[Any] | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields shared by chat and completions (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: Int64 | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    stop_token_ids: list[Int64] | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[RequestMessage]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]
    """A string, a list of token ids, or a list of either (msgspec allows one array type)."""
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None


_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise BadRequest(message, param=param, code="invalid_value")


def _range(value: float | None, lo: float, hi: float, param: str) -> None:
    if value is not None:
        _check(lo <= value <= hi, f"'{param}' must be between {lo:g} and {hi:g}, got {value:g}",
               param)


def _stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    _check(len(stops) <= 64, "'stop' may hold at most 64 sequences", "stop")
    _check(all(stops), "'stop' sequences must not be empty", "stop")
    return stops


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        _check(key.isdigit() and int(key) < 2**63, f"'logit_bias' keys must be token ids, "
               f"got '{key}'", "logit_bias")
        _range(value, -100, 100, "logit_bias")
        out[int(key)] = value
    return out


def _common(req: _Sampling, max_tokens: int | None) -> SamplingSpec:
    _range(req.temperature, 0, 2, "temperature")
    _check(req.top_p is None or 0 < req.top_p <= 1, "'top_p' must be in (0, 1]", "top_p")
    _check(1 <= req.n <= 128, f"'n' must be between 1 and 128, got {req.n}", "n")
    _range(req.presence_penalty, -2, 2, "presence_penalty")
    _range(req.frequency_penalty, -2, 2, "frequency_penalty")
    _range(req.min_p, 0, 1, "min_p")
    _check(req.repetition_penalty is None or req.repetition_penalty > 0,
           "'repetition_penalty' must be > 0", "repetition_penalty")
    _check(req.top_k is None or req.top_k == -1 or req.top_k >= 0,
           "'top_k' must be -1, 0 or positive", "top_k")
    _check(max_tokens is None or max_tokens >= 1,
           f"'max_tokens' must be at least 1, got {max_tokens}", "max_tokens")
    _check(req.min_tokens >= 0, "'min_tokens' must be >= 0", "min_tokens")
    _check(max_tokens is None or req.min_tokens <= max_tokens,
           f"'min_tokens' ({req.min_tokens}) must not exceed 'max_tokens' ({max_tokens})",
           "min_tokens")
    return SamplingSpec(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, min_p=req.min_p, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        seed=req.seed, stop=_stop_list(req.stop), stop_token_ids=req.stop_token_ids or [],
        n=req.n, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
        logit_bias=_logit_bias(req.logit_bias))


def flatten_message(message: RequestMessage, i: int) -> ChatMessage:
    _check(message.role in _ROLES, f"unknown role '{message.role}'", f"messages[{i}].role")
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type not in ("text", "input_text") or part.text is None:
                raise BadRequest(f"content part type '{part.type}' is not supported by this "
                                 "server (text only)", param=f"messages[{i}].content[{j}]",
                                 code="unsupported_content")
            texts.append(part.text)
        content = "".join(texts)
    if content is None and message.role in ("user", "system", "developer"):
        raise BadRequest(f"messages[{i}] needs content", param=f"messages[{i}].content")
    # Most chat templates know "system" but not OpenAI's newer "developer" role.
    role = "system" if message.role == "developer" else message.role
    return ChatMessage(role=role, content=content, name=message.name,
                       tool_call_id=message.tool_call_id)


def chat_sampling(req: ChatCompletionRequest) -> tuple[SamplingSpec, list[ChatMessage]]:
    """Validate a chat request; return its sampling spec and flattened messages."""
    _check(bool(req.messages), "'messages' must contain at least one message", "messages")
    if req.tools:
        raise BadRequest("tool calling is not supported yet", param="tools",
                         code="unsupported_parameter")
    if req.tool_choice not in (None, "none", "auto"):  # as OpenAI: a choice needs tools
        raise BadRequest("'tool_choice' requires 'tools'", param="tool_choice",
                         code="invalid_value")
    if req.response_format is not None and req.response_format.type != "text":
        raise BadRequest(f"response_format '{req.response_format.type}' is not supported yet",
                         param="response_format", code="unsupported_parameter")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    spec = _common(req, max_tokens)
    if req.top_logprobs is not None:
        _range(req.top_logprobs, 0, 20, "top_logprobs")
        _check(req.logprobs, "'top_logprobs' requires 'logprobs': true", "top_logprobs")
    spec.logprobs = req.logprobs
    spec.top_logprobs = req.top_logprobs or 0
    return spec, [flatten_message(m, i) for i, m in enumerate(req.messages)]


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request: one string or token list per prompt."""
    p = req.prompt
    if isinstance(p, str):
        prompts: list[str | list[int]] = [p]
    elif p and all(type(x) is int for x in p):
        prompts = [list(p)]
    else:
        prompts = []
        for x in p:
            ok = isinstance(x, str) or (isinstance(x, list) and x
                                        and all(type(t) is int for t in x))
            _check(bool(ok), "'prompt' must be a string, a list of token ids, or a list of "
                   "strings or of token-id lists", "prompt")
            prompts.append(x)
    _check(bool(prompts) and all(len(x) > 0 for x in prompts),
           "'prompt' must not be empty", "prompt")
    return prompts


def completion_sampling(req: CompletionRequest) -> SamplingSpec:
    if req.suffix:
        raise BadRequest("'suffix' is not supported", param="suffix",
                         code="unsupported_parameter")
    _check(req.best_of is None or req.best_of == req.n,
           "'best_of' other than 'n' is not supported", "best_of")
    spec = _common(req, req.max_tokens)
    if req.logprobs is not None:
        _range(req.logprobs, 0, 20, "logprobs")
        spec.logprobs = True
        spec.top_logprobs = req.logprobs
    return spec
