"""A batch's input file (JSONL) read line by line, off the event loop.

A create reads the file twice, each time a line at a time: ``scan`` (on a thread of the
loop's) checks what makes the whole file a 400 (not UTF-8, no JSON object in it, more
than ``batch_max_lines`` lines, a ``custom_id`` twice) and gathers the model names its
lines ask for, which the handler resolves for the key on the loop (the registry is the
loop's); ``rows`` (on the database's thread, while the batch's rows are written) gives
each line as it is stored, a line this server cannot run ``errored`` with its reason.
Each line is decoded with msgspec into its envelope (``InputLine``), its ``body`` kept
as the raw JSON text it came as (``msgspec.Raw``: never decoded into objects and encoded
again) and only its head (``checks.BodyHead``) read; so memory is one line and the
``custom_id`` seen, not the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from router.api.batches.checks import Refused, body_head, body_model, not_found
from router.batches.store import Line
from router.errors import BadRequest


class InputLine(msgspec.Struct):
    """One line of a batch's input file, as OpenAI's batch input is written."""

    custom_id: Any = None
    method: Any = "POST"
    url: Any = None
    body: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


_LINE = msgspec.json.Decoder(InputLine)


@dataclass
class Scan:
    """What ``scan`` found: the lines (non-blank) and the model names they ask for."""

    total: int = 0
    models: set[str] = field(default_factory=set)


Invalid = Callable[[str, str, str], str]
"""The error-file line of a refused line: ``(custom_id, code, message)``."""


def _lines(path: Path, file_id: str) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines of ``path``, numbered from 1."""
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        raise not_found("file", file_id) from None
    with handle:
        n = 0
        for raw in handle:
            if raw.strip():
                n += 1
                yield n, raw


def _check(n: int, raw: bytes, endpoint: str) -> tuple[str, tuple[str, str] | str, bytes]:
    """A line's ``custom_id`` (``line-<n>`` where it has none), its refusal (code,
    message) or the model name it asks for, and its body's JSON text."""
    try:
        item = _LINE.decode(raw)
    except msgspec.DecodeError:  # not JSON, or not an object
        return f"line-{n}", ("invalid_json", f"line {n} is not a JSON object"), b""
    if not isinstance(item.custom_id, str) or not item.custom_id:
        return f"line-{n}", ("missing_custom_id", f"line {n} has no 'custom_id' string"), b""
    body = bytes(item.body)
    if item.method != "POST":
        return item.custom_id, ("invalid_method", f"method '{item.method}': only POST"), body
    if item.url != endpoint:
        return item.custom_id, ("invalid_url", (f"url '{item.url}' is not the batch's "
                                               f"endpoint '{endpoint}'")), body
    found = body_model(body_head(body), "body")
    if isinstance(found, Refused):
        return item.custom_id, (found.code, found.message), body
    return item.custom_id, found, body


def scan(path: Path, file_id: str, endpoint: str, max_lines: int) -> Scan:
    """The file checked as a whole (see the module doc; a 400 naming the line)."""
    found = Scan()
    seen: dict[str, int] = {}
    objects = False
    for n, raw in _lines(path, file_id):
        if n > max_lines:
            raise BadRequest(f"the input file holds more than {max_lines} lines; a batch "
                             f"may hold {max_lines} (server.batch_max_lines)",
                             param="input_file_id", code="too_many_lines")
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest(f"file '{file_id}' is not UTF-8 text (JSONL): line {n}",
                             param="input_file_id", code="invalid_file") from None
        found.total = n
        custom_id, outcome, _ = _check(n, raw, endpoint)
        if not (isinstance(outcome, tuple) and outcome[0] == "invalid_json"):
            objects = True
        if not (isinstance(outcome, tuple) and outcome[0] in ("invalid_json",
                                                              "missing_custom_id")):
            if custom_id in seen:
                raise BadRequest(f"line {n}: custom_id '{custom_id[:80]}' repeats line "
                                 f"{seen[custom_id]}'s; each must be unique",
                                 param="input_file_id", code="duplicate_custom_id")
            seen[custom_id] = n
        if isinstance(outcome, str):
            found.models.add(outcome)
    if not found.total:
        raise BadRequest("the input file holds no lines", param="input_file_id",
                         code="invalid_file")
    if not objects:
        raise BadRequest("the input file is not JSONL: no line is a JSON object",
                         param="input_file_id", code="invalid_file")
    return found


def rows(path: Path, file_id: str, endpoint: str, models: dict[str, str | Refused],
         invalid: Invalid) -> Iterator[Line]:
    """Each line of a file ``scan`` passed, as it is stored: its model's id (``models``:
    each name's, as the key may use it) and its body, or ``errored`` with its reason."""
    for n, raw in _lines(path, file_id):
        custom_id, outcome, body = _check(n, raw, endpoint)
        if isinstance(outcome, str):
            model = models.get(outcome) or Refused("model_not_found", outcome)
            if isinstance(model, str):
                yield Line(n, custom_id, model, body.decode())
                continue
            outcome = (model.code, model.message)
        yield Line(n, custom_id, "", "", "errored", invalid(custom_id, *outcome))
