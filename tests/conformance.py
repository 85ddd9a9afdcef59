"""Validate responses against OpenAI's official schemas (``../shared/conformance``).

The schema files come from openai/openai-openapi (MIT): ``openai-schemas.json`` (chat,
completions, models, errors: ``validate``), ``openai-responses-schemas.json`` (the
Responses API: ``validate_responses``) and ``openai-batch-schemas.json`` (Files, Batches
and the batch input/output lines: ``validate_batch``; ``tests/data/extract_batch_schemas.py``
regenerates it). ``tests/data`` keeps a copy of each so a clone without ``../shared`` still
tests, and the shared one wins when it is present.
"""

from __future__ import annotations

import copy
import json
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

_HERE = Path(__file__).resolve().parent
_CHAT = "openai-schemas.json"
_RESPONSES = "openai-responses-schemas.json"
_BATCH = "openai-batch-schemas.json"


@lru_cache(maxsize=3)
def _load(name: str) -> dict[str, Any]:
    for path in (_HERE.parents[1] / "shared" / "conformance" / name, _HERE / "data" / name):
        if path.is_file():
            doc: dict[str, Any] = json.loads(path.read_text())
            return doc
    raise FileNotFoundError(f"{name} not found")


@lru_cache(maxsize=1)
def _document() -> dict[str, Any]:
    doc = _load(_CHAT)
    # Streamed completions chunks carry "finish_reason": null until the last one, as the
    # live API sends them; the document's patch allows that for chat chunks only.
    doc = copy.deepcopy(doc)
    schemas = doc["components"]["schemas"]
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    fr = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    fr["type"] = ["string", "null"]
    fr["enum"] = [*fr["enum"], None]
    schemas["CompletionStreamChunk"] = chunk
    return doc


@cache
def _validator(name: str, document: str = _CHAT) -> Draft202012Validator:
    doc = _document() if document == _CHAT else _load(document)
    resource = Resource.from_contents(doc, default_specification=DRAFT202012)
    registry = Registry().with_resource("urn:openai", resource)
    return Draft202012Validator({"$ref": f"urn:openai#/components/schemas/{name}"},
                                registry=registry)


def validate_responses(name: str, payload: Any) -> None:
    """``validate`` against the Responses API's schemas (``Response``,
    ``ResponseStreamEvent``, ``ResponseItemList``, ``TokenCountsResource`` ...)."""
    validate(name, payload, _RESPONSES)


def validate_batch(name: str, payload: Any) -> None:
    """``validate`` against the Files and Batches schemas (``Batch``, ``ListBatchesResponse``,
    ``OpenAIFile``, ``ListFilesResponse``, ``DeleteFileResponse``, ``CreateBatchRequest``,
    and one line of a batch file: ``BatchRequestInput``, ``BatchRequestOutput``)."""
    validate(name, payload, _BATCH)


def validate(name: str, payload: Any, document: str = _CHAT) -> None:
    """Raise AssertionError listing every violation of ``#/components/schemas/<name>``."""
    errors = sorted(_validator(name, document).iter_errors(payload), key=lambda e: list(e.path))
    if errors:
        lines = [f"  at {'/'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in errors]
        raise AssertionError(f"{name} violates OpenAI's schema:\n" + "\n".join(lines)
                             + f"\npayload: {json.dumps(payload)[:2000]}")
