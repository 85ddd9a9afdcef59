"""Loading progress for a stream that waits for its model: SSE comment lines, or reasoning.

``comments``::

    : modelyard loading smollm2 phase=engine 62%
    : modelyard loading smollm2 12s

A comment (a line that begins with ``:``) is no event: the OpenAI and Anthropic SDKs,
and browsers' ``EventSource``, skip it, so nothing reaches a message's content or
reasoning. ``reasoning`` (as llama-swap's ``sendLoadingState``) writes one line a beat as
the protocol's own reasoning, which chat UIs (Open WebUI ...) show while the answer has
not begun::

    Loading smollm2: engine 62% (4 s)
    Loading smollm2 (12 s)
    Waking smollm2 (0 s)

in chat's ``delta.reasoning_content``, an Anthropic ``thinking`` block, a Responses
``reasoning`` item: a ``Delta`` of reasoning only and no tokens (``LoadProgress.delta``)
that the protocol's shaper writes as any other, so the answer's text never holds it and
no usage counts it; the model's own reasoning, if any, follows it. A protocol without a
reasoning channel (legacy completions: ``Shaper.has_reasoning``) gets the comments.
Asked for by the preset (the server's ``loading_progress``, a model's own over it) or by
a request's ``X-Modelyard-Loading-Progress: comments``, ``reasoning`` or ``off`` header,
which wins; any other value of the header leaves the preset's choice. The relay writes
the lines (``Relay._cold_stream``); this module says whether and what.

The percent is an estimate: the time since this load's worker began to start, against
the model's last load (``ModelEntry.load_seconds``), cut into the worker's successive
phases (``load_phases``: ``spawn`` or ``spare``, ``imports``, ``model_files``,
``engine``; the engine's own ``weights`` and ``kv_cache_and_warmup`` lie inside
``engine`` and are not counted twice). It stays below 100 % until the model is ready.
A model never loaded before, or a load still waiting for room or a start lock, gets the
seconds the request has waited instead.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from router.registry import ModelEntry
from shared.config import ServerConfig
from shared.protocol import Delta

Mode = Literal["off", "comments", "reasoning"]

HEADER = "x-modelyard-loading-progress"
"""A request's own choice, ``comments``, ``reasoning`` or ``off``, over the preset's."""
_HEADER = HEADER.encode()
_MODES: dict[bytes, Mode] = {b"off": "off", b"comments": "comments",
                             b"reasoning": "reasoning"}

EVERY = 1.0
"""Seconds between two progress lines."""

WAKING = ("sleeping", "parking", "parked", "waking")
"""States of a model whose worker is resident and is woken, not loaded."""

SEQUENTIAL = ("spawn", "spare", "imports", "model_files", "engine")
"""The load phases that follow each other, in order (others lie inside one of them)."""


def mode(scope: Mapping[str, Any], entry: ModelEntry, server: ServerConfig) -> Mode:
    """The progress the request of ``scope``, for ``entry``'s model, asked for (its
    header, else the model's ``loading_progress``, else the server's)."""
    headers: Iterable[tuple[bytes, bytes]] = scope.get("headers", ())
    for name, value in headers:
        if name == _HEADER:
            choice = _MODES.get(value.strip().lower())
            if choice is not None:
                return choice
            break  # a value it does not know: the preset decides
    return entry.spec.loading_progress or server.loading_progress


def wanted(scope: Mapping[str, Any], entry: ModelEntry, server: ServerConfig) -> bool:
    """Whether the request of ``scope`` asked for progress of any kind (``mode``)."""
    return mode(scope, entry, server) != "off"


def estimate(entry: ModelEntry, now: float) -> tuple[str, int] | None:
    """The phase ``entry``'s load is probably in at ``now`` (``time.monotonic``) and the
    percent done, from its last load's phases; ``None`` when there is nothing to go by
    (no load running or started yet, or none finished before)."""
    total = entry.load_seconds
    if entry.state != "loading" or not entry.load_started or not total:
        return None
    steps = [(name, entry.load_phases[name]) for name in SEQUENTIAL
             if name in entry.load_phases]
    if not steps:
        return None
    elapsed = max(0.0, now - entry.load_started)
    percent = min(99, int(elapsed * 100 / total))
    # The router's own part (after ``Ready``) counts to the last phase.
    steps[-1] = (steps[-1][0], steps[-1][1] + max(0.0, total - sum(s for _, s in steps)))
    passed = 0.0
    for name, seconds in steps:
        passed += seconds
        if elapsed < passed:
            return name, percent
    return steps[-1][0], percent


class LoadProgress:
    """The progress lines of one request that waits for ``entry``'s model (since it was
    made): one per call, a comment (``__call__``) or a line of reasoning (``delta``)."""

    __slots__ = ("entry", "since")

    def __init__(self, entry: ModelEntry) -> None:
        self.entry = entry
        self.since = time.monotonic()

    def __call__(self) -> bytes:
        entry, now = self.entry, time.monotonic()
        waited = f"{round(now - self.since)}s"
        if entry.state == "ready":  # loaded: the request waits for a slot now
            doing, how = "waiting", waited
        elif entry.state in WAKING:
            doing, how = "waking", waited
        else:
            found = estimate(entry, now)
            doing, how = "loading", f"phase={found[0]} {found[1]}%" if found else waited
        return f": modelyard {doing} {entry.id} {how}\n\n".encode()

    def text(self) -> str:
        """One line for a person: which model, what it is doing, how far, how long."""
        entry, now = self.entry, time.monotonic()
        waited = f"({round(now - self.since)} s)"
        if entry.state == "ready":  # loaded: the request waits for a slot now
            return f"Waiting for {entry.id}: every slot is busy {waited}"
        if entry.state in WAKING:
            return f"Waking {entry.id} {waited}"
        found = estimate(entry, now)
        if found is not None:
            return f"Loading {entry.id}: {found[0]} {found[1]}% {waited}"
        if entry.state == "loading" and not entry.load_started:
            return f"Loading {entry.id}: waiting for its turn to start {waited}"
        return f"Loading {entry.id} {waited}"

    def delta(self) -> Delta:
        """``text`` as reasoning (one line of it) of a response's first choice: no tokens,
        so usage never counts it."""
        return Delta(id="", reasoning=self.text() + "\n")
