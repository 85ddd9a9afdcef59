"""Anthropic Messages request bodies as msgspec Structs, and their translation to
``shared.protocol``.

A conversation becomes the same ``ChatMessage`` list a chat completion gives the worker:
``system`` (a string, text blocks, or ``role: "system"`` messages anywhere, as Claude Code
sends them) becomes one leading system message; an assistant's ``tool_use`` blocks become
its tool calls; a user's ``tool_result`` blocks become tool messages (before the rest of
that user turn); ``thinking`` and ``redacted_thinking`` blocks in history are accepted and
left out (the worker's template renders no earlier reasoning). Unknown fields are ignored,
as Anthropic's API does; an unknown block type is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from router.api.openai.schema import MAX_MESSAGES, MAX_STOP_CHARS, MAX_TOOLS, Int64, check_free_json
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


class Source(msgspec.Struct, kw_only=True):
    """An image's ``source``: ``base64`` (``media_type`` + ``data``) or ``url``."""

    type: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class Block(msgspec.Struct, kw_only=True):
    """One content block of any type; which fields matter depends on ``type``."""

    type: str
    text: str | None = None
    source: Source | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool = False
    thinking: str | None = None


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Block]


class ToolDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    strict: bool | None = None
    """Anthropic's strict tool use: the input always validates against ``input_schema``."""


class ToolChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(msgspec.Struct, kw_only=True):
    type: str
    budget_tokens: Int64 | None = None


class JsonFormat(msgspec.Struct, kw_only=True):
    type: str
    schema: dict[str, Any] | None = None


class OutputConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None
    format: JsonFormat | None = None


class _Conversation(msgspec.Struct, kw_only=True):
    """What ``count_tokens`` and ``messages`` share: everything that makes the prompt."""

    model: str | None = None
    messages: Annotated[list[Message], msgspec.Meta(max_length=MAX_MESSAGES)]
    system: str | list[Block] | None = None
    tools: Annotated[list[ToolDef], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class CountTokensRequest(_Conversation, kw_only=True):
    pass


class MessagesRequest(_Conversation, kw_only=True):
    max_tokens: Int64
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    metadata: Any = None
    output_format: JsonFormat | None = None
    """The structured-outputs beta's place for ``output_config.format``."""
    keep_alive: str | float | None = None
    """Ollama's: how long the model stays loaded after this request."""


def _fail(message: str, param: str) -> BadRequest:
    return BadRequest(message, param=param, code="invalid_value")


def _text(blocks: str | list[Block] | None, param: str) -> str:
    """Text of a string or of text blocks (``system``, a ``system`` message)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    for j, b in enumerate(blocks):
        if b.type != "text" or b.text is None:
            raise _fail(f"'{param}' takes text blocks only, got '{b.type}'", f"{param}[{j}]")
    return "\n".join(b.text or "" for b in blocks)


def _image(block: Block, param: str) -> ContentPart:
    src = block.source
    if src is not None and src.type == "base64" and src.data and src.media_type:
        return ContentPart(type="image_url", url=f"data:{src.media_type};base64,{src.data}")
    if src is not None and src.type == "url" and src.url:
        return ContentPart(type="image_url", url=src.url)
    raise _fail("an image block needs a 'source' of type 'base64' (with 'media_type' and "
                "'data') or 'url' (with 'url')", f"{param}.source")


def _message(role: str, parts: list[ContentPart], **fields: Any) -> ChatMessage:
    """A ``ChatMessage`` of ``parts``: text joined, the parts kept only when some is media."""
    media = any(p.type != "text" for p in parts)
    text = "\n".join(p.text or "" for p in parts if p.type == "text")
    return ChatMessage(role=role, content=text, parts=parts if media else None, **fields)


def _parts(blocks: list[Block], param: str) -> list[ContentPart]:
    """Text and image blocks (a user turn's rest, a tool result's content)."""
    parts = []
    for j, b in enumerate(blocks):
        if b.type == "text" and b.text is not None:
            parts.append(ContentPart(type="text", text=b.text))
        elif b.type == "image":
            parts.append(_image(b, f"{param}[{j}]"))
        else:
            raise BadRequest(f"content block type '{b.type}' is not supported here (or lacks "
                             "its field)", param=f"{param}[{j}]", code="unsupported_content")
    return parts


def _user(blocks: list[Block], param: str) -> list[ChatMessage]:
    """A user turn: its tool results as tool messages, then the rest as one user message."""
    out: list[ChatMessage] = []
    rest: list[Block] = []
    for j, b in enumerate(blocks):
        if b.type != "tool_result":
            rest.append(b)
            continue
        if not b.tool_use_id:
            raise _fail("a tool_result block needs 'tool_use_id'", f"{param}[{j}].tool_use_id")
        content = b.content
        parts = ([ContentPart(type="text", text=content or "")]
                 if content is None or isinstance(content, str)
                 else _parts(content, f"{param}[{j}].content"))
        if b.is_error:  # chat templates have no error flag: the model reads it instead
            parts.insert(0, ContentPart(type="text", text="Error:"))
        out.append(_message("tool", parts, tool_call_id=b.tool_use_id))
    if rest:
        out.append(_message("user", _parts(rest, param)))
    return out


def _assistant(blocks: list[Block], i: int, param: str) -> ChatMessage:
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, b in enumerate(blocks):
        if b.type == "text" and b.text is not None:
            texts.append(b.text)
        elif b.type == "tool_use" and b.name:
            calls.append(ToolCall(id=b.id or f"toolu_{i}_{j}", name=b.name,
                                  arguments=msgspec.json.encode(
                                      b.input if b.input is not None else {}).decode()))
        elif b.type not in ("thinking", "redacted_thinking"):
            raise BadRequest(f"content block type '{b.type}' is not supported in an assistant "
                             "turn (or lacks its field)", param=f"{param}[{j}]",
                             code="unsupported_content")
    return ChatMessage(role="assistant", content="".join(texts), tool_calls=calls or None)


def conversation(req: _Conversation) -> list[ChatMessage]:
    """The request's system prompt and turns as the wire's chat messages."""
    system = [_text(req.system, "system")] if req.system else []
    turns: list[ChatMessage] = []
    for i, m in enumerate(req.messages):
        param = f"messages[{i}].content"
        if m.role == "system":  # Claude Code sends these; templates want one, first
            system.append(_text(m.content, param))
        elif m.role == "user":
            turns += ([ChatMessage(role="user", content=m.content)]
                      if isinstance(m.content, str) else _user(m.content, param))
        elif m.role == "assistant":
            turns.append(ChatMessage(role="assistant", content=m.content)
                         if isinstance(m.content, str) else _assistant(m.content, i, param))
        else:
            raise _fail(f"unknown role '{m.role}' (user, assistant or system)",
                        f"messages[{i}].role")
    if not turns:
        raise _fail("'messages' must contain at least one user or assistant message",
                    "messages")
    head = [ChatMessage(role="system", content="\n\n".join(system))] if system else []
    return head + turns


def tools(req: _Conversation) -> tuple[list[Tool] | None, str, str | None, bool]:
    """``tools``, ``tool_choice`` (auto/none/required/function), the named tool and
    whether calls may be parallel. Anthropic's own tool types (``bash_…``, ``web_search_…``
    without an ``input_schema``) run on Anthropic's side and are left out."""
    defs = [t for t in req.tools or [] if t.input_schema is not None or t.type in (None,
                                                                                    "custom")]
    names = [t.name for t in defs]
    if len(set(names)) != len(names):
        raise _fail("tool names must be unique", "tools")
    for k, t in enumerate(req.tools or []):
        check_free_json(t.input_schema, f"tools[{k}].input_schema")
    found = [Tool(name=t.name, description=t.description,
                  parameters=t.input_schema or {"type": "object", "properties": {}},
                  strict=t.strict)
             for t in defs] or None
    choice = req.tool_choice
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    if choice is None or choice.type == "auto":
        return found, "auto" if found else "none", None, parallel
    if choice.type == "none":
        return found, "none", None, parallel
    if not found:
        raise _fail(f"tool_choice '{choice.type}' requires 'tools'", "tool_choice")
    if choice.type == "any":
        return found, "required", None, parallel
    if choice.type == "tool":
        if choice.name not in names:
            raise _fail(f"tool_choice names '{choice.name}', which is not among the tools",
                        "tool_choice.name")
        return found, "function", choice.name, parallel
    raise _fail(f"tool_choice type must be 'auto', 'any', 'tool' or 'none', got "
                f"'{choice.type}'", "tool_choice.type")


_THINKING = ("enabled", "disabled", "adaptive", "between_tools")


def template_kwargs(req: _Conversation) -> dict[str, Any] | None:
    """``thinking`` turns the template's thinking on or off (``enable_thinking``);
    ``output_config.effort`` is the template's ``reasoning_effort``, as chat's is."""
    kwargs: dict[str, Any] = {}
    if req.thinking is not None:
        if req.thinking.type not in _THINKING:
            raise _fail(f"thinking type must be one of {', '.join(_THINKING)}, got "
                        f"'{req.thinking.type}'", "thinking.type")
        kwargs["enable_thinking"] = req.thinking.type != "disabled"
    if req.output_config is not None and req.output_config.effort is not None:
        kwargs["reasoning_effort"] = req.output_config.effort
    return kwargs or None


def _constraint(req: MessagesRequest) -> Constraint | None:
    """Structured outputs: ``output_config.format`` (or the beta's ``output_format``)."""
    config = req.output_config.format if req.output_config is not None else None
    fmt, param = (config, "output_config.format") if config is not None else \
        (req.output_format, "output_format")
    if fmt is None:
        return None
    if fmt.type != "json_schema" or not isinstance(fmt.schema, dict):
        raise _fail(f"'{param}' must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}",
                    param)
    check_free_json(fmt.schema, f"{param}.schema")
    return Constraint(json=fmt.schema, param=param)


def _sampling(req: MessagesRequest) -> SamplingSpec:
    if req.max_tokens < 1:
        raise _fail(f"'max_tokens' must be at least 1, got {req.max_tokens}", "max_tokens")
    if req.temperature is not None and not 0 <= req.temperature <= 1:
        raise _fail("'temperature' must be between 0 and 1", "temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise _fail("'top_p' must be in (0, 1]", "top_p")
    if req.top_k is not None and req.top_k < 0:
        raise _fail("'top_k' must be >= 0", "top_k")
    stops = req.stop_sequences or []
    if len(stops) > 64 or not all(stops) or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise _fail(f"'stop_sequences' takes at most 64 non-empty sequences of at most "
                    f"{MAX_STOP_CHARS} characters", "stop_sequences")
    return SamplingSpec(max_tokens=req.max_tokens, temperature=req.temperature,
                        top_p=req.top_p, top_k=req.top_k or None, stop=list(stops))


def messages_generate(req: MessagesRequest, rid: str) -> Generate:
    """Validate a Messages request into the one ``Generate`` that answers it. A last
    assistant turn is a prefill: the answer continues it."""
    messages = conversation(req)
    prefill = messages[-1].role == "assistant"
    gen = Generate(id=rid, sampling=_sampling(req), messages=messages,
                   add_generation_prompt=not prefill, continue_final_message=prefill,
                   template_kwargs=template_kwargs(req))
    gen.tools, gen.tool_choice, gen.tool_name, gen.parallel_tool_calls = tools(req)
    gen.constraint = _constraint(req)
    if gen.constraint is not None and gen.tool_choice in ("required", "function"):
        raise _fail("a forced tool choice already constrains the output; drop the output "
                    "format", gen.constraint.param)
    return gen
