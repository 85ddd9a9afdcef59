"""OpenAI Responses request bodies as msgspec Structs, and their translation to
``shared.protocol.Generate``.

``input`` is a string or a list of items; every item is normalised into the one
``ResponseItem`` shape the store keeps and ``input_items`` lists (ids assigned, text as
content parts), and the conversation (``previous_response_id``'s items and output, then
this input) becomes chat messages through chat's own ``flatten_message``. Function
tools, ``tool_choice``, ``text.format`` and sampling are checked by the helpers chat
uses. Tools of other types (web_search, file_search, mcp, custom ...) are accepted and
ignored; fields OpenAI documents that this server cannot honour (``conversation``,
``prompt``, ``truncation: auto``) are a 400 naming them; unknown fields are ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec

from router.api.openai.schema import (
    MAX_MESSAGES,
    MAX_TOOLS,
    FunctionDefinition,
    ImageURL,
    Int64,
    RequestMessage,
    RequestPart,
    StructuredOutputs,
    basic_sampling,
    check_free_json,
    flatten_message,
    format_constraint,
    set_tools,
    structured_constraint,
)
from router.api.wire import request_id
from router.errors import BadRequest
from shared.protocol import ChatMessage, Generate, SamplingSpec, ToolCall


class ResponsePart(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One content part of an item, as sent and as kept: ``input_text``, ``input_image``,
    ``output_text``, ``refusal``, ``reasoning_text``, ``summary_text`` ..."""

    type: str
    text: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class ResponseItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One input item: a message (``type`` may be left out), ``function_call``,
    ``function_call_output``, ``reasoning``, or any item a client keeps in its history
    (``custom_tool_call``, ``local_shell_call``, ``mcp_call``, ``web_search_call`` ...; see
    ``normalize``). Normalised, it is what ``input_items`` lists."""

    type: str | None = None
    id: str | None = None
    role: str | None = None
    content: str | list[ResponsePart] | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ResponsePart] | None = None
    summary: list[ResponsePart] | None = None
    encrypted_content: str | None = None
    input: str | None = None
    """A ``custom_tool_call``'s free-form input."""
    action: dict[str, Any] | None = None
    """A ``local_shell_call``'s (``exec``: ``command``, ``working_directory`` ...), a
    ``computer_call``'s or a ``web_search_call``'s action."""
    server_label: str | None = None
    """An ``mcp_*`` item's server."""


class ResponseTool(msgspec.Struct, kw_only=True):
    """A tool; only ``function`` tools reach the model, other types are ignored."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseToolChoice(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``{"type": "function", "name": ...}`` or ``{"type": "allowed_tools", "mode": ...,
    "tools": [...]}``."""

    type: str
    name: str | None = None
    mode: str | None = None
    tools: list[dict[str, Any]] | None = None


class ResponseTextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str = "text"
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseTextParam(msgspec.Struct, kw_only=True, omit_defaults=True):
    format: ResponseTextFormat | None = None
    verbosity: str | None = None


class ResponseReasoning(msgspec.Struct, kw_only=True, omit_defaults=True):
    effort: str | None = None
    summary: str | None = None


class ResponseInput(msgspec.Struct, kw_only=True):
    """What decides a response's prompt: ``POST /v1/responses/input_tokens`` takes this."""

    model: str | None = None
    input: str | Annotated[list[ResponseItem], msgspec.Meta(max_length=MAX_MESSAGES)] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: Annotated[list[ResponseTool], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | ResponseToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponseTextParam | None = None
    reasoning: ResponseReasoning | None = None
    truncation: str | None = None
    # fields OpenAI documents that this server cannot honour: a 400 names them
    conversation: Any = None
    # vLLM extension, as chat has it
    structured_outputs: StructuredOutputs | None = None


class CreateResponseRequest(ResponseInput, kw_only=True):
    """``POST /v1/responses``."""

    stream: bool = False
    store: bool | None = None
    background: bool | None = None
    keep_alive: str | float | None = None
    """Ollama's: how long the model stays loaded after this request."""
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: Int64 | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    prompt: Any = None


_ROLES = ("user", "system", "developer", "assistant")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_SUMMARIES = ("auto", "concise", "detailed")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _bad(message: str, param: str, code: str = "invalid_value") -> BadRequest:
    return BadRequest(message, param=param, code=code)


def _missing(item: ResponseItem, fields: tuple[str, ...], at: str) -> None:
    for field in fields:
        if getattr(item, field) is None:
            raise _bad(f"'{at}.{field}' is required for a '{item.type}' item", f"{at}.{field}")


def _message_parts(item: ResponseItem, at: str) -> list[ResponsePart]:
    """A message's content as parts: input parts for user/system/developer turns, output
    text (with ``annotations`` and ``logprobs``) for assistant turns."""
    assistant = item.role == "assistant"
    content = item.content
    if content is None:
        raise _bad(f"'{at}.content' is required", f"{at}.content")
    raw = [ResponsePart(type="input_text", text=content)] if isinstance(content, str) else content
    parts = []
    for j, part in enumerate(raw):
        where = f"{at}.content[{j}]"
        if part.type in _TEXT_PARTS and part.text is not None:
            parts.append(ResponsePart(type="output_text", text=part.text, annotations=[],
                                      logprobs=[])
                         if assistant else ResponsePart(type="input_text", text=part.text))
        elif part.type == "refusal" and part.refusal is not None and assistant:
            parts.append(ResponsePart(type="refusal", refusal=part.refusal))
        elif part.type == "input_image" and part.image_url is not None and not assistant:
            parts.append(ResponsePart(type="input_image", image_url=part.image_url,
                              detail=part.detail or "auto"))
        else:
            raise _bad(f"content part type '{part.type}' is not supported in a"
                       f"{'n assistant' if assistant else ' ' + str(item.role)} message (or "
                       "lacks its field; images need 'image_url')", where,
                       "unsupported_content")
    return parts


def normalize(raw: str | list[ResponseItem]) -> list[ResponseItem]:
    """The request's ``input`` as items with ids, statuses and content parts: what the store
    keeps and ``input_items`` lists. Every check on an item is here, so that a stored item
    always translates."""
    if isinstance(raw, str):
        raw = [ResponseItem(role="user", content=raw)]
    if not raw:
        raise _bad("'input' must hold at least one item", "input")
    items = []
    for i, item in enumerate(raw):
        at = f"input[{i}]"
        kind = item.type or "message"
        if kind == "message":
            if item.role not in _ROLES:
                raise _bad(f"'{at}.role' must be one of {', '.join(_ROLES)}", f"{at}.role")
            items.append(ResponseItem(type="message", id=item.id or f"msg_{request_id()}",
                              role=item.role, content=_message_parts(item, at),
                              status="completed"))
        elif kind == "function_call":
            _missing(item, ("call_id", "name", "arguments"), at)
            items.append(ResponseItem(type=kind, id=item.id or f"fc_{request_id()}",
                              call_id=item.call_id, name=item.name, arguments=item.arguments,
                              status="completed"))
        elif kind == "function_call_output":
            _missing(item, ("call_id", "output"), at)
            items.append(ResponseItem(type=kind, id=item.id or f"fco_{request_id()}",
                              call_id=item.call_id, output=_output_text(item.output, at),
                              status="completed"))
        elif kind == "reasoning":
            content = ([ResponsePart(type="reasoning_text", text=item.content)]
                       if isinstance(item.content, str) else item.content)
            items.append(ResponseItem(type=kind, id=item.id or f"rs_{request_id()}",
                              summary=item.summary or [], content=content,
                              encrypted_content=item.encrypted_content))
        elif kind in _CALLS:  # a tool call of another kind: rendered as a call
            items.append(ResponseItem(
                type=kind, id=item.id or f"{_CALLS[kind]}_{request_id()}",
                call_id=item.call_id or item.id, name=item.name, input=item.input,
                arguments=item.arguments, action=item.action,
                server_label=item.server_label, status=item.status or "completed",
                output=(None if item.output is None else _output_text(item.output, at))))
        elif kind in _OUTPUTS:
            items.append(ResponseItem(
                type=kind, id=item.id or f"{_CALLS[kind.removesuffix('_output')]}o_"
                                         f"{request_id()}",
                call_id=item.call_id or item.id, output=_output_text(item.output, at),
                status=item.status or "completed"))
        else:  # web_search_call, item_reference, mcp_list_tools ...: kept, not in the prompt
            items.append(ResponseItem(type=kind, id=item.id or f"item_{request_id()}",
                                      call_id=item.call_id, name=item.name,
                                      action=item.action, server_label=item.server_label,
                                      status=item.status))
    return items


_CALLS = {"custom_tool_call": "ctc", "local_shell_call": "lsh", "mcp_call": "mcp"}
"""Calls of other kinds than ``function_call`` a client keeps in its history (Codex, the
Agents SDK), with their id prefixes: each becomes the assistant's tool call in the
prompt, and its ``*_output`` item (or an ``mcp_call``'s own ``output``) the tool's turn."""


_OUTPUTS = frozenset({"function_call_output", *(f"{kind}_output" for kind in _CALLS)})
"""Items whose ``output`` is a tool's turn in the prompt."""


def _call_arguments(item: ResponseItem) -> str:
    """A call's arguments as the model sees them: JSON, whatever the call's kind."""
    if item.arguments is not None:
        return item.arguments
    if item.action is not None:
        return json.dumps(item.action)
    if item.input is not None:
        return json.dumps({"input": item.input})
    return "{}"


def _output_text(output: str | list[ResponsePart] | None, at: str) -> str:
    """A function's result as the text a tool message carries."""
    if isinstance(output, str):
        return output
    texts = []
    for j, part in enumerate(output or []):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise _bad(f"function_call_output part type '{part.type}' is not supported (text "
                       "only)", f"{at}.output[{j}]", "unsupported_content")
        texts.append(part.text)
    return "".join(texts)


def _chat_part(part: ResponsePart) -> RequestPart:
    if part.type == "input_image":
        return RequestPart(type="image_url", image_url=ImageURL(url=part.image_url or ""))
    if part.type == "refusal":
        return RequestPart(type="refusal", refusal=part.refusal)
    return RequestPart(type="text", text=part.text)


def chat_messages(items: list[ResponseItem], instructions: str | None) -> list[ChatMessage]:
    """The conversation as chat turns: ``instructions`` first, as a system turn; a function
    call joins the assistant turn just before it (text, then its calls), a function's
    output is a tool turn. Reasoning items have no chat turn (templates drop past reasoning)."""
    out: list[ChatMessage] = []
    if instructions:
        out.append(ChatMessage(role="system", content=instructions))
    for i, item in enumerate(items):
        if item.type == "message":
            parts = item.content if isinstance(item.content, list) else []
            message = RequestMessage(role=item.role or "user",
                                     content=[_chat_part(p) for p in parts])
            out.append(flatten_message(message, i))
        elif item.type == "function_call" or item.type in _CALLS:
            name = item.name or ("local_shell" if item.type == "local_shell_call" else "tool")
            call = ToolCall(id=item.call_id or "", name=name, arguments=_call_arguments(item))
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", tool_calls=[call]))
            if item.type == "mcp_call" and isinstance(item.output, str):  # its own result
                out.append(ChatMessage(role="tool", content=item.output,
                                       tool_call_id=item.call_id))
        elif item.type in _OUTPUTS:
            text = item.output if isinstance(item.output, str) else ""
            out.append(ChatMessage(role="tool", content=text, tool_call_id=item.call_id))
    return out


def _tools(req: ResponseInput, gen: Generate) -> None:
    """Function tools and the tool choice onto ``gen``; other tool types are ignored."""
    defs = []
    for k, tool in enumerate(req.tools or []):
        if tool.type != "function":
            continue  # hosted tools (web_search, file_search, mcp, custom ...): not run here
        if not tool.name:
            raise _bad(f"'tools[{k}].name' is required for a function tool", f"tools[{k}].name")
        defs.append((f"tools[{k}].parameters", FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.parameters,
            strict=tool.strict)))
    given, choice, named = req.tool_choice, None, None
    if isinstance(given, str):
        choice = given
    elif given is not None and given.type == "function":
        if not given.name:
            raise _bad("'tool_choice.name' is required", "tool_choice.name")
        named = given.name
    elif given is not None and given.type == "allowed_tools":
        if given.mode not in (None, "auto", "required"):
            raise _bad("'tool_choice.mode' must be 'auto' or 'required'", "tool_choice.mode")
        allowed = {t.get("name") for t in given.tools or [] if t.get("type") == "function"}
        defs = [(where, d) for where, d in defs if d.name in allowed]
        choice = given.mode or "auto"
    elif given is not None:
        raise _bad(f"tool_choice type '{given.type}' names a tool this server does not run "
                   "(function tools only)", "tool_choice", "unsupported_parameter")
    set_tools(gen, defs, choice, named, req.parallel_tool_calls, "tool_choice")


def _unsupported(req: ResponseInput) -> None:
    fields = ["conversation"] + (["prompt"] if isinstance(req, CreateResponseRequest) else [])
    for field in fields:
        if getattr(req, field) is not None:
            raise _bad(f"'{field}' is not supported by this server", field,
                       "unsupported_parameter")
    if req.truncation not in (None, "disabled"):
        raise _bad("only 'truncation': 'disabled' is supported (a prompt too long for the "
                   "context is refused)", "truncation", "unsupported_parameter")


def prompt_generate(req: ResponseInput, rid: str,
                    prior: list[ResponseItem]) -> tuple[Generate, list[ResponseItem]]:
    """The ``Generate`` for ``req`` (default sampling) after ``prior``, the conversation so
    far; and the conversation's items including this input (what the store keeps)."""
    _unsupported(req)
    if req.input is None:
        raise _bad("'input' is required", "input")
    items = prior + normalize(req.input)
    gen = Generate(id=rid, sampling=SamplingSpec(),
                   messages=chat_messages(items, req.instructions))
    _tools(req, gen)
    fmt = req.text.format if req.text else None
    gen.constraint = (format_constraint(fmt.type, fmt.schema, "text.format", "text.format.schema")
                      if fmt is not None else None)
    if req.structured_outputs is not None:
        if gen.constraint is not None:
            raise _bad("give 'text.format' or 'structured_outputs', not both",
                       "structured_outputs")
        gen.constraint = structured_constraint(req.structured_outputs)
    if gen.constraint is not None and gen.tool_choice in ("required", "function"):
        raise _bad("a forced tool choice already constrains the output; drop "
                   f"'{gen.constraint.param}'", gen.constraint.param)
    if gen.constraint is not None:
        check_free_json(gen.constraint.json, gen.constraint.param)
    effort = req.reasoning.effort if req.reasoning else None
    if effort not in (None, *_EFFORTS):
        raise _bad(f"'reasoning.effort' must be one of {', '.join(_EFFORTS)}", "reasoning.effort")
    if req.reasoning and req.reasoning.summary not in (None, *_SUMMARIES):
        raise _bad(f"'reasoning.summary' must be one of {', '.join(_SUMMARIES)}",
                   "reasoning.summary")
    gen.template_kwargs = {"reasoning_effort": effort} if effort is not None else None
    return gen, items


def create_generate(req: CreateResponseRequest, rid: str,
                    prior: list[ResponseItem]) -> tuple[Generate, list[ResponseItem]]:
    """``prompt_generate`` plus sampling, and the checks only a create has."""
    if req.background and req.stream:
        raise _bad("'background' with 'stream' is not supported by this server; poll "
                   "GET /v1/responses/{id} instead", "background", "unsupported_parameter")
    if req.background and req.store is False:
        raise _bad("'background' needs 'store': true", "store")
    if req.metadata is not None:
        _metadata(req.metadata)
    gen, items = prompt_generate(req, rid, prior)
    spec = basic_sampling(req.temperature, req.top_p, req.max_output_tokens, "max_output_tokens")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise _bad(f"'top_logprobs' must be between 0 and 20, got {req.top_logprobs}",
                   "top_logprobs")
    spec.logprobs = "message.output_text.logprobs" in (req.include or ())
    spec.top_logprobs = (req.top_logprobs or 0) if spec.logprobs else 0
    gen.sampling = spec
    return gen, items


def _metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > 16:
        raise _bad("'metadata' may hold at most 16 keys", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise _bad("'metadata' keys may be 64 characters long and values 512",
                       f"metadata.{key[:64]}")


def _choice_echo(choice: str | ResponseToolChoice | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice or "auto"
    if choice.type == "allowed_tools":
        return {"type": "allowed_tools", "mode": choice.mode or "auto",
                "tools": choice.tools or []}
    return {"type": choice.type, "name": choice.name}


def echo(req: CreateResponseRequest, gen: Generate) -> dict[str, Any]:
    """The request's settings as the Response object repeats them."""
    fmt = req.text.format if req.text and req.text.format else ResponseTextFormat()
    if fmt.type == "json_schema" and fmt.name is None:
        fmt = msgspec.structs.replace(fmt, name="response")
    tools = [{"type": "function", "name": t.name, "description": t.description,
              "parameters": t.parameters, "strict": t.strict}
             for t in req.tools or [] if t.type == "function"]
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": gen.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": msgspec.to_builtins(req.reasoning) if req.reasoning else None,
        "store": req.store is not False,
        "temperature": req.temperature,
        "text": {"format": {"type": fmt.type, **msgspec.to_builtins(fmt)}},
        "tool_choice": _choice_echo(req.tool_choice),
        "tools": tools,
        "top_p": req.top_p,
        "truncation": "disabled",
        "background": bool(req.background),
    }
