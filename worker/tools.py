"""What a forced tool choice constrains the output to (pure: no vLLM, no I/O).

With ``tool_choice: required`` the model must write a JSON array of calls, each
``{"name": <one tool's name>, "parameters": <that tool's parameters>}``; with a named
function it writes that function's arguments object alone. Both are enforced by vLLM's
structured output, so the arguments a client parses always validate against the tool's
own schema. (``vllm serve`` let ``"Paris"`` through for ``{"city": string}``.) The array's
keys are the ones vLLM's streaming scanner for required calls reads.
"""

from __future__ import annotations

from typing import Any

from shared.protocol import Tool

EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


def _parameters(tool: Tool) -> dict[str, Any]:
    return dict(tool.parameters) if tool.parameters else dict(EMPTY_OBJECT)


def required_calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """The schema of a ``required`` answer: one or more calls of the given tools."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        params = _parameters(tool)
        defs.update(params.pop("$defs", {}))  # refs must resolve from the root
        variants.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [tool.name]},
                                        "parameters": params},
                         "required": ["name", "parameters"],
                         "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_call_schema(tools: list[Tool], name: str) -> dict[str, Any]:
    """The schema of a named call's arguments; ``KeyError`` if no tool has that name."""
    for tool in tools:
        if tool.name == name:
            return _parameters(tool)
    raise KeyError(name)
