"""Per-choice output parsing: answer text, reasoning and tool calls apart.

vLLM's parser objects are built by ``engine.py`` (the only module that imports vLLM) and
handed in; this module only drives them, delta by delta.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from shared.protocol import Delta, ToolCallDelta


class OutputParser:
    """Splits one choice's streamed output into answer text, reasoning and tool calls.

    Runs vLLM's own parsers (they keep per-request state, hence one instance per choice)
    on each delta: the reasoning parser first, then, on what it leaves as content, the
    tool parser (``auto``), vLLM's scanner of a forced JSON array (``required``), or
    nothing but the arguments themselves (a named function). On the last delta whatever
    a streaming parser still holds back is flushed, if its non-streaming reading agrees.
    """

    def __init__(self, mode: str, tool_name: str | None, tool_parser: Any,
                 reasoning_parser: Any, request: Any,
                 scan_required: Callable[[str, str], Any],
                 call_ends: tuple[str, ...] = ()) -> None:
        self.mode = mode
        self.scan_required = scan_required
        self.tool_name = tool_name
        self.tools = tool_parser
        self.reasoning = reasoning_parser
        self.request = request
        self.text, self.ids = "", []  # type: tuple[str, list[int]]
        self.content, self.content_ids = "", []  # type: tuple[str, list[int]]
        self.sent_reasoning = ""
        self.sent_content = ""
        self.called = False
        self.call_ends = call_ends
        """What closes one ``auto`` call, where its grammar says (else no repeat check)."""
        self.closed = 0
        self._ends_seen_to = 0  # content before it was searched for call ends already
        self.repeated = False
        """The last closed call repeats an earlier one of this answer, name and arguments:
        the engine ends the turn there."""

    def feed(self, d: Delta, token_ids: Any, last: bool) -> None:
        """Rewrite ``d`` (its ``text`` is the raw delta) into its parsed parts."""
        delta_text, delta_ids = d.text, list(token_ids)
        prev_text, prev_ids = self.text, self.ids
        self.text, self.ids = prev_text + delta_text, prev_ids + delta_ids
        content, content_ids = delta_text, delta_ids
        if self.reasoning is not None:
            msg = self.reasoning.extract_reasoning_streaming(
                prev_text, self.text, delta_text, prev_ids, self.ids, delta_ids)
            d.reasoning = (msg.reasoning or "") if msg else ""
            content = (msg.content or "") if msg else ""
            content_ids = delta_ids if content else []
            self.sent_reasoning += d.reasoning
            if last:
                more_reasoning, more_content = self._reasoning_rest(content)
                d.reasoning += more_reasoning
                content += more_content
        calls: list[ToolCallDelta] = []
        d.text = self._content(content, content_ids, calls)
        if last and self.mode == "auto" and not self.called:
            final = self.tools.extract_tool_calls(self.content, self.request)
            rest = final.content or ""
            if not final.tools_called and rest.startswith(self.sent_content):
                d.text += rest[len(self.sent_content):]  # text held back as a possible tag
                self.sent_content = rest
        if calls:
            d.tool_calls = calls

    def _reasoning_rest(self, content: str) -> tuple[str, str]:
        reasoning, final_content = self.reasoning.extract_reasoning(self.text, self.request)
        reasoning, final_content = reasoning or "", final_content or ""
        streamed_content = self.content + content
        if reasoning.startswith(self.sent_reasoning) and \
                final_content.startswith(streamed_content):
            more = reasoning[len(self.sent_reasoning):]
            self.sent_reasoning = reasoning
            return more, final_content[len(streamed_content):]
        return "", ""

    def _content(self, delta: str, ids: list[int], calls: list[ToolCallDelta]) -> str:
        """Feed answer-side text to the tool parsing; return what is plain text."""
        prev = self.content
        self.content += delta
        self.content_ids = self.content_ids + ids
        if self.mode == "none" or not delta:
            self.sent_content += delta
            return delta
        if self.mode == "function":
            calls.append(ToolCallDelta(index=0, arguments=delta) if self.called else
                         ToolCallDelta(index=0, id=_call_id(), name=self.tool_name,
                                       arguments=delta))
            self.called = True
            return ""
        if self.mode == "required":
            msg = self.scan_required(prev, self.content)
        else:
            msg = self.tools.extract_tool_calls_streaming(
                prev, self.content, delta, self.content_ids[:len(self.content_ids) - len(ids)],
                self.content_ids, ids, self.request)
        if msg is None:
            return ""
        for tc in msg.tool_calls:
            fn = tc.function
            name = fn.name if fn else None
            self.called = self.called or name is not None
            calls.append(ToolCallDelta(index=tc.index, id=tc.id, name=name,
                                       arguments=(fn.arguments or "") if fn else ""))
        text = msg.content or ""
        self.sent_content += text
        if self.call_ends:
            self._check_repeat()
        return text

    def _check_repeat(self) -> None:
        """Whether the calls closed so far hold one twice (``repeated``)."""
        # Only what the last delta may have completed is searched: an end that lies
        # wholly in the content searched before was counted then.
        searched, self._ends_seen_to = self._ends_seen_to, len(self.content)
        closed = self.closed + sum(self.content.count(end, max(0, searched - len(end) + 1))
                                   for end in self.call_ends)
        if closed <= self.closed:
            return
        self.closed = closed
        cut = max(self.content.rfind(end) + len(end) for end in self.call_ends
                  if end in self.content)
        found = self.tools.extract_tool_calls(self.content[:cut], self.request)
        seen = set()
        for call in found.tool_calls if found.tools_called else []:
            try:
                args = json.dumps(json.loads(call.function.arguments), sort_keys=True)
            except ValueError:
                return
            if (call.function.name, args) in seen:
                self.repeated = True
                return
            seen.add((call.function.name, args))


def _call_id() -> str:
    """An id in the form vLLM's parsers give their calls."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"
