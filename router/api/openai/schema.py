"""OpenAI request bodies as msgspec Structs, and their translation to ``shared.protocol``.

Decoding with types gives field errors for free; the functions below add the range checks
OpenAI documents. Every documented field is honoured or answered with a 400
``unsupported_parameter`` naming it; ``user``, ``metadata``, ``store``, ``service_tier``,
``prompt_cache_key``, ``prompt_cache_retention``, ``prompt_cache_options``,
``safety_identifier`` and ``verbosity`` have no meaning here and are accepted and ignored. Unknown fields are ignored, as OpenAI
and vLLM do.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from router.errors import BadRequest
from shared.protocol import (
    ChatMessage,
    Constraint,
    ContentPart,
    Generate,
    SamplingSpec,
    Tool,
    ToolCall,
)

Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
"""Every integer a client sends must fit the wire protocol (and OpenAI's own int64)."""

MAX_MESSAGES = 10_000
MAX_TOOLS = 128  # OpenAI's own limit
MAX_STOP_CHARS = 1_000
MAX_TOKEN_IDS = 1_024  # stop_token_ids, logit_bias entries
MAX_CHOICES = 1_024
"""Choices one request may ask for (prompts × n): each is allocated before any runs."""


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ImageURL(msgspec.Struct, kw_only=True):
    url: str
    detail: str | None = None


class InputAudio(msgspec.Struct, kw_only=True):
    data: str
    format: str | None = None


class RequestPart(msgspec.Struct, kw_only=True):
    """One part of a message's ``content`` array, as OpenAI's clients send it."""

    type: str
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None
    refusal: str | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(msgspec.Struct, kw_only=True):
    id: str = ""
    type: str = "function"
    function: FunctionCall


class RequestMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[RequestPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    function_call: FunctionCall | None = None
    """Legacy: an assistant turn that called a function."""


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionDefinition


class FunctionName(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionName


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's extension: constrain the output by exactly one of these."""

    json: dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: str | float | None, param: str = "keep_alive") -> float | None:
    """Ollama's per-request ``keep_alive``: seconds as a number, or a duration such as
    ``"10m"``, ``"1h30m"``, ``"45s"``; negative: keep the model loaded for good; 0: stop
    it once this request is done. ``None``: not given."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if body and all(c.isdigit() or c == "." for c in body):
        try:
            return sign * float(body)
        except ValueError:
            pass  # "1.2.3": the message below
    parts = _DURATION.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise BadRequest(f"'{param}' must be seconds or a duration such as '10m' or '1h', "
                         f"got '{value}'", param=param, code="invalid_value")
    return sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields shared by chat and completions (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    keep_alive: str | float | None = None
    """Ollama's: how long the model stays loaded after this request (``keep_alive_seconds``)."""
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
    stop_token_ids: Annotated[list[Int64], msgspec.Meta(max_length=MAX_TOKEN_IDS)] | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[RequestMessage], msgspec.Meta(max_length=MAX_MESSAGES)]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[ToolParam], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[list[FunctionDefinition],
                         msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    function_call: str | FunctionName | None = None
    reasoning_effort: str | None = None
    # fields OpenAI documents that this server cannot honour: a 400 names them
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None


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


def _invalid(message: str, param: str) -> BadRequest:
    return BadRequest(message, param=param, code="invalid_value")


# The checks below every request passes build their messages only when one fails: an
# f-string per check per request was a third of a chat request's validation.


def _range(value: float | None, lo: float, hi: float, param: str) -> None:
    if value is not None and not lo <= value <= hi:
        raise _invalid(f"'{param}' must be between {lo:g} and {hi:g}, got {value:g}", param)


def check_free_json(value: Any, param: str) -> None:
    """Free-form JSON (tool parameters, template kwargs, schemas) crosses the msgpack wire
    too: an integer beyond int64 there is a 400 naming the field, not an encoder error.
    Iterative: the value may nest as deep as the decoder allows."""
    if value is None:  # the usual case: the field was not given
        return
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif type(item) is int and not -(2**63) <= item < 2**63:
            raise BadRequest(f"'{param}' holds an integer that does not fit in 64 bits",
                             param=param, code="invalid_value")


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    _check(len(stops) <= 64, "'stop' may hold at most 64 sequences", "stop")
    _check(all(stops), "'stop' sequences must not be empty", "stop")
    if not all(len(s) <= MAX_STOP_CHARS for s in stops):
        raise _invalid(f"'stop' sequences may be at most {MAX_STOP_CHARS} characters long",
                       "stop")
    return stops


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    _check(len(bias) <= MAX_TOKEN_IDS, f"'logit_bias' may hold at most {MAX_TOKEN_IDS} "
           "entries", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        # Canonical decimal only: "012" and "12" would silently name the same token.
        # isdigit() alone takes '²' and '٣', which int() refuses or reads as another id.
        _check(key.isascii() and key.isdigit() and int(key) < 2**63 and key == str(int(key)),
               f"'logit_bias' keys must be token ids, got '{key}'", "logit_bias")
        _range(value, -100, 100, "logit_bias")
        out[int(key)] = value
    return out


def basic_sampling(temperature: float | None, top_p: float | None, max_tokens: int | None,
                   max_param: str = "max_tokens") -> SamplingSpec:
    """The sampling fields every protocol has, checked: ``max_param`` names the token cap
    as the protocol calls it."""
    _range(temperature, 0, 2, "temperature")
    _check(top_p is None or 0 < top_p <= 1, "'top_p' must be in (0, 1]", "top_p")
    if max_tokens is not None and not max_tokens >= 1:
        raise _invalid(f"'{max_param}' must be at least 1, got {max_tokens}", max_param)
    return SamplingSpec(max_tokens=max_tokens, temperature=temperature, top_p=top_p)


def _common(req: _Sampling, max_tokens: int | None) -> SamplingSpec:
    spec = basic_sampling(req.temperature, req.top_p, max_tokens)
    if not 1 <= req.n <= 128:
        raise _invalid(f"'n' must be between 1 and 128, got {req.n}", "n")
    _range(req.presence_penalty, -2, 2, "presence_penalty")
    _range(req.frequency_penalty, -2, 2, "frequency_penalty")
    _range(req.min_p, 0, 1, "min_p")
    _check(req.repetition_penalty is None or req.repetition_penalty > 0,
           "'repetition_penalty' must be > 0", "repetition_penalty")
    _check(req.top_k is None or req.top_k == -1 or req.top_k >= 0,
           "'top_k' must be -1, 0 or positive", "top_k")
    _check(req.min_tokens >= 0, "'min_tokens' must be >= 0", "min_tokens")
    if max_tokens is not None and not req.min_tokens <= max_tokens:
        raise _invalid(f"'min_tokens' ({req.min_tokens}) must not exceed 'max_tokens' "
                       f"({max_tokens})", "min_tokens")
    spec.top_k, spec.min_p, spec.seed = req.top_k, req.min_p, req.seed
    spec.presence_penalty, spec.frequency_penalty = req.presence_penalty, req.frequency_penalty
    spec.repetition_penalty = req.repetition_penalty
    spec.stop, spec.stop_token_ids = _stop_list(req.stop), req.stop_token_ids or []
    spec.n, spec.ignore_eos, spec.min_tokens = req.n, req.ignore_eos, req.min_tokens
    spec.logit_bias = _logit_bias(req.logit_bias)
    return spec


def flatten_message(message: RequestMessage, i: int) -> ChatMessage:
    """One OpenAI message as the wire's ``ChatMessage``: text parts joined, media kept."""
    if message.role not in _ROLES:
        raise _invalid(f"unknown role '{message.role}'", f"messages[{i}].role")
    content = message.content
    parts: list[ContentPart] = []
    media = False
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type in ("text", "input_text") and part.text is not None:
                parts.append(ContentPart(type="text", text=part.text))
            elif part.type == "refusal" and part.refusal is not None:
                parts.append(ContentPart(type="text", text=part.refusal))
            elif part.type == "image_url" and part.image_url is not None:
                parts.append(ContentPart(type="image_url", url=part.image_url.url))
                media = True
            elif part.type == "input_audio" and part.input_audio is not None:
                parts.append(ContentPart(type="input_audio", data=part.input_audio.data,
                                         format=part.input_audio.format))
                media = True
            else:
                raise BadRequest(f"content part type '{part.type}' is not supported (or lacks "
                                 "its field)", param=f"messages[{i}].content[{j}]",
                                 code="unsupported_content")
        content = "".join(p.text or "" for p in parts)
    if content is None and message.role in ("user", "system", "developer"):
        raise BadRequest(f"messages[{i}] needs content", param=f"messages[{i}].content")
    calls = None
    if message.tool_calls:
        calls = [ToolCall(id=c.id or f"call_{i}_{k}", name=c.function.name,
                          arguments=_arguments_text(c.function.arguments))
                 for k, c in enumerate(message.tool_calls)]
    elif message.function_call is not None:  # legacy functions: one call, answered by name
        calls = [ToolCall(id=f"call_{i}", name=message.function_call.name,
                          arguments=_arguments_text(message.function_call.arguments))]
    role = message.role
    tool_call_id = message.tool_call_id
    if role == "function":  # legacy result of a function call: a tool message
        role, tool_call_id = "tool", tool_call_id or f"call_{i - 1}"
    # Most chat templates know "system" but not OpenAI's newer "developer" role.
    role = "system" if role == "developer" else role
    return ChatMessage(role=role, content=content, name=message.name,
                       tool_call_id=tool_call_id, tool_calls=calls,
                       parts=parts if media else None)


def _arguments_text(arguments: str | dict[str, Any]) -> str:
    return arguments if isinstance(arguments, str) else msgspec.json.encode(arguments).decode()


def _tools(req: ChatCompletionRequest, gen: Generate) -> None:
    """Set ``gen``'s tools and tool choice from ``tools``/``tool_choice`` or the legacy
    ``functions``/``function_call``."""
    if req.functions is not None and req.tools is not None:
        raise BadRequest("give 'tools' or the legacy 'functions', not both", param="functions")
    legacy = req.functions is not None
    for k, t in enumerate(req.tools or []):
        if t.type != "function":
            raise BadRequest(f"tool type '{t.type}' is not supported (function only)",
                             param=f"tools[{k}].type", code="unsupported_parameter")
    defs = ([(f"functions[{k}].parameters", d) for k, d in enumerate(req.functions or [])]
            if legacy else [(f"tools[{k}].function.parameters", t.function)
                            for k, t in enumerate(req.tools or [])])
    choice = req.function_call if legacy else req.tool_choice
    named = (None if choice is None or isinstance(choice, str) else
             choice.function.name if isinstance(choice, NamedToolChoice) else choice.name)
    set_tools(gen, defs, choice if isinstance(choice, str) else None, named,
              req.parallel_tool_calls, "function_call" if legacy else "tool_choice")


def set_tools(gen: Generate, defs: list[tuple[str, FunctionDefinition]], choice: str | None,
              named: str | None, parallel: bool | None, param: str) -> None:
    """Set ``gen``'s tools (each definition with the field its ``parameters`` came from),
    tool choice (``choice``, or the function ``named``) and ``parallel_tool_calls``;
    ``param`` is the field that holds the choice."""
    names = [d.name for _, d in defs]
    tools = None
    if defs:
        if len(set(names)) != len(names):
            raise BadRequest("tool names must be unique", param="tools")
        for where, d in defs:
            check_free_json(d.parameters, where)
        tools = [Tool(name=d.name, description=d.description, parameters=d.parameters,
                      strict=d.strict) for _, d in defs]
    gen.tools = tools
    gen.parallel_tool_calls = parallel is not False
    if named is not None:
        _check(named in names, f"'{param}' names '{named}', which is not among the tools", param)
        gen.tool_choice, gen.tool_name = "function", named
    elif choice is None:
        gen.tool_choice = "auto" if tools else "none"
    else:
        _check(choice in ("auto", "none", "required"), f"'{param}' must be 'auto', 'none', "
               f"'required' or a named function, got '{choice}'", param)
        gen.tool_choice = choice
    if not tools and gen.tool_choice not in ("none", "auto"):  # as OpenAI
        raise BadRequest(f"'{param}' requires 'tools'", param=param, code="invalid_value")


def _constraint(req: ChatCompletionRequest) -> Constraint | None:
    rf, so = req.response_format, req.structured_outputs
    if rf is not None and rf.type != "text":
        if so is not None:
            raise BadRequest("give 'response_format' or 'structured_outputs', not both",
                             param="structured_outputs")
        return format_constraint(rf.type, rf.json_schema.schema if rf.json_schema else None,
                                 "response_format", "response_format.json_schema.schema")
    return structured_constraint(so)


def format_constraint(kind: str, schema: dict[str, Any] | None, param: str,
                      schema_field: str) -> Constraint | None:
    """OpenAI's output format (``text``, ``json_object``, ``json_schema`` with the schema
    at ``schema_field``) as a constraint; ``param`` is the field that holds it."""
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(json_object=True, param=param)
    if kind == "json_schema":
        _check(isinstance(schema, dict), f"'{schema_field}' must be a JSON schema object", param)
        return Constraint(json=schema, param=param)
    raise BadRequest(f"unknown {param} type '{kind}'", param=param, code="invalid_value")


def structured_constraint(so: StructuredOutputs | None) -> Constraint | None:
    """vLLM's ``structured_outputs`` extension: exactly one kind of constraint."""
    if so is None:
        return None
    c = Constraint(json=so.json, json_object=bool(so.json_object), regex=so.regex,
                   choice=so.choice, grammar=so.grammar, param="structured_outputs")
    given = sum((so.json is not None, bool(so.json_object), so.regex is not None,
                 so.choice is not None, so.grammar is not None))
    _check(given == 1, "'structured_outputs' takes exactly one of json, json_object, "
           "regex, choice, grammar", "structured_outputs")
    return c


_UNSUPPORTED = ("audio", "prediction", "web_search_options", "moderation")


def chat_generate(req: ChatCompletionRequest, rid: str) -> Generate:
    """Validate a chat request into the one ``Generate`` that answers it."""
    _check(bool(req.messages), "'messages' must contain at least one message", "messages")
    for field in _UNSUPPORTED:
        if getattr(req, field) is not None:
            raise BadRequest(f"'{field}' is not supported by this server", param=field,
                             code="unsupported_parameter")
    if req.modalities is not None and set(req.modalities) - {"text"}:
        raise BadRequest("only the 'text' modality is supported", param="modalities",
                         code="unsupported_parameter")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    spec = _common(req, max_tokens)
    if req.top_logprobs is not None:
        _range(req.top_logprobs, 0, 20, "top_logprobs")
        _check(req.logprobs, "'top_logprobs' requires 'logprobs': true", "top_logprobs")
    spec.logprobs = req.logprobs
    spec.top_logprobs = req.top_logprobs or 0
    gen = Generate(id=rid, sampling=spec,
                   messages=[flatten_message(m, i) for i, m in enumerate(req.messages)],
                   add_generation_prompt=req.add_generation_prompt,
                   continue_final_message=req.continue_final_message)
    _tools(req, gen)
    gen.constraint = _constraint(req)
    if gen.constraint is not None and gen.tool_choice in ("required", "function"):
        raise BadRequest("a forced tool choice already constrains the output; drop "
                         "'response_format'", param="response_format")
    check_free_json(req.chat_template_kwargs, "chat_template_kwargs")
    if gen.constraint is not None:
        check_free_json(gen.constraint.json, gen.constraint.param)
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    gen.template_kwargs = kwargs or None
    return gen


def text_or_token_lists(raw: str | list[Any], param: str) -> list[str | list[int]]:
    """A string, a list of token ids, or a list of strings or of token-id lists (what
    completions' ``prompt`` and embeddings' ``input`` take): one item per text."""
    if isinstance(raw, str):
        items: list[str | list[int]] = [raw]
    elif raw and all(type(x) is int for x in raw):
        items = [list(raw)]
    else:
        items = []
        for x in raw:
            ok = isinstance(x, str) or (isinstance(x, list) and x
                                        and all(type(t) is int for t in x))
            _check(bool(ok), f"'{param}' must be a string, a list of token ids, or a list of "
                   "strings or of token-id lists", param)
            items.append(x)
    _check(bool(items) and all(len(x) > 0 for x in items), f"'{param}' must not be empty",
           param)
    return items


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
