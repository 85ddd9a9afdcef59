"""Regenerate ``openai-batch-schemas.json``: the Files and Batches part of OpenAI's OpenAPI
description (openai/openai-openapi, MIT), with every schema it references.

The API objects come from ``openapi.json`` at commit f85dbe2 (the one the other schema
files here come from). That description no longer defines the batch input and output
line formats, so ``BatchRequestInput`` and ``BatchRequestOutput`` come from the last
``openapi.yaml`` that did (commit 498c71d, same API version 2.3.0)::

    git -C openai-openapi show f85dbe2:openapi.json > openapi.json
    git -C openai-openapi show 498c71d:openapi.yaml > openapi-498c71d.yaml
    python tests/data/extract_batch_schemas.py openapi.json openapi-498c71d.yaml

Only one patch is applied, mechanically: OpenAPI 3.0's ``nullable: true`` becomes a JSON
Schema type union with ``"null"`` (``null`` added to an enum; a schema without ``type``
is wrapped in ``anyOf [..., {"type": "null"}]``), as in ``openai-schemas.json``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import yaml

# Schemas answered by /v1/files and /v1/batches, plus the batch request body.
API_ROOTS = ["Batch", "ListBatchesResponse", "CreateBatchRequest", "OpenAIFile",
             "ListFilesResponse", "DeleteFileResponse"]
# One line of a batch input file, and one of its output and error files.
LINE_ROOTS = ["BatchRequestInput", "BatchRequestOutput"]
SOURCE = ("openai/openai-openapi openapi.json (OpenAPI 3.1.0, API version 2.3.0, commit f85dbe2);"
          " BatchRequestInput and BatchRequestOutput from openapi.yaml (OpenAPI 3.0.0, API"
          " version 2.3.0, commit 498c71d), the last description that defines them")
PATCHES = [("OpenAPI 3.0 'nullable: true' rewritten as JSON Schema type unions"
            " (null added to enums)")]
OUTPUT = Path(__file__).resolve().parent / "openai-batch-schemas.json"

_REF = re.compile(r"^#/components/schemas/(.+)$")
# Keys that describe a schema rather than constrain it: they stay outside the anyOf.
_ANNOTATIONS = {"title", "description", "default", "example", "examples", "deprecated",
                "readOnly", "writeOnly"}


def load(path: Path) -> dict[str, Any]:
    text = path.read_text()
    doc: dict[str, Any] = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    return doc


def closure(schemas: dict[str, Any], roots: list[str]) -> dict[str, Any]:
    """The roots and every schema they reference, transitively."""
    found: dict[str, Any] = {}
    pending = list(roots)
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found[name] = schemas[name]
        pending.extend(_refs(schemas[name]))
    return found


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        out: list[str] = []
        for key, value in node.items():
            match = _REF.match(value) if key == "$ref" and isinstance(value, str) else None
            out.extend([match.group(1)] if match else _refs(value))
        return out
    if isinstance(node, list):
        return [name for item in node for name in _refs(item)]
    return []


def drop_nullable(node: Any) -> Any:
    """Rewrite every ``nullable`` (OpenAPI 3.0) as JSON Schema 2020-12 allows null."""
    if isinstance(node, list):
        return [drop_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: drop_nullable(value) for key, value in node.items() if key != "nullable"}
    if node.get("nullable") is not True:
        return out
    if "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"] if "null" not in types else types
        if "enum" in out and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
        return out
    outer = {key: value for key, value in out.items() if key in _ANNOTATIONS}
    inner = {key: value for key, value in out.items() if key not in _ANNOTATIONS}
    return {**outer, "anyOf": [inner, {"type": "null"}]}


def extract(api: dict[str, Any], lines: dict[str, Any]) -> dict[str, Any]:
    schemas = closure(api["components"]["schemas"], API_ROOTS)
    for name, schema in closure(lines["components"]["schemas"], LINE_ROOTS).items():
        if name in schemas and schemas[name] != schema:
            raise SystemExit(f"{name} differs between the two descriptions")
        schemas[name] = schema
    return {
        "source": SOURCE,
        "roots": API_ROOTS + LINE_ROOTS,
        "components": {"schemas": {name: drop_nullable(schemas[name])
                                   for name in sorted(schemas)}},
        "patches": PATCHES,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("openapi", type=Path, help="openapi.json at commit f85dbe2")
    parser.add_argument("lines_openapi", type=Path,
                        help="openapi.yaml at commit 498c71d (batch line formats)")
    parser.add_argument("-o", "--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    doc = extract(load(args.openapi), load(args.lines_openapi))
    args.output.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{args.output}: {len(doc['components']['schemas'])} schemas")


if __name__ == "__main__":
    main()
