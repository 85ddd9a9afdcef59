"""The Files and Batches schemas load, accept minimal valid objects and refuse broken ones."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conformance import validate_batch


def _batch(**changes: Any) -> dict[str, Any]:
    batch: dict[str, Any] = {
        "id": "batch_abc123", "object": "batch", "endpoint": "/v1/chat/completions",
        "input_file_id": "file-abc123", "completion_window": "24h", "status": "validating",
        "created_at": 1711471533,
        "request_counts": {"total": 2, "completed": 0, "failed": 0},
    }
    batch.update(changes)
    return batch


def _file(**changes: Any) -> dict[str, Any]:
    file: dict[str, Any] = {
        "id": "file-abc123", "object": "file", "bytes": 120, "created_at": 1711471533,
        "filename": "requests.jsonl", "purpose": "batch", "status": "processed",
    }
    file.update(changes)
    return file


def test_minimal_objects_validate() -> None:
    validate_batch("Batch", _batch())
    validate_batch("ListBatchesResponse", {"object": "list", "data": [_batch()],
                                           "first_id": "batch_abc123",
                                           "last_id": "batch_abc123", "has_more": False})
    validate_batch("OpenAIFile", _file())
    validate_batch("ListFilesResponse", {"object": "list", "data": [_file()],
                                         "first_id": "file-abc123", "last_id": "file-abc123",
                                         "has_more": False})
    validate_batch("DeleteFileResponse", {"id": "file-abc123", "object": "file",
                                          "deleted": True})
    validate_batch("BatchRequestInput", {"custom_id": "r1", "method": "POST",
                                         "url": "/v1/chat/completions",
                                         "body": {"model": "m", "messages": []}})


def test_output_line_error_may_be_null() -> None:
    # The source declares it with OpenAPI 3.0's nullable, which the extraction rewrites.
    validate_batch("BatchRequestOutput", {
        "id": "batch_req_1", "custom_id": "r1", "error": None,
        "response": {"status_code": 200, "request_id": "req_1", "body": {"id": "x"}},
    })


@pytest.mark.parametrize(("name", "payload"), [
    ("Batch", _batch(status="bogus")),
    ("Batch", {k: v for k, v in _batch().items() if k != "id"}),
    ("Batch", _batch(object="list")),
    ("OpenAIFile", _file(purpose="nonsense")),
    ("OpenAIFile", {k: v for k, v in _file().items() if k != "bytes"}),
    ("BatchRequestInput", {"custom_id": "r1", "method": "GET", "url": "/v1/chat/completions"}),
    ("BatchRequestOutput", {"id": "batch_req_1", "custom_id": "r1", "response": "ok"}),
])
def test_broken_objects_raise(name: str, payload: dict[str, Any]) -> None:
    with pytest.raises(AssertionError, match=f"{name} violates"):
        validate_batch(name, payload)
