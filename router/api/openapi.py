"""``GET /openapi.json``: an OpenAPI 3.1 description of every route the router serves.

Request bodies are the msgspec Structs the handlers decode (``schema_components``), so
the document cannot drift from what is accepted. Response bodies are written here, after
OpenAI's official schemas (same required fields) plus modelyard's own fields. The paths
are the app's routes at the first request: a route missing from ``OPERATIONS`` is still
listed (with only the error responses), and ``tests/test_fuzz.py`` fails on it.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from router.access.admission import OPEN_PATHS, Keys
from router.access.key_store import KeyCreate
from router.api.adapters import AdapterRegistration
from router.api.admin import ModelAction
from router.api.anthropic.schema import CountTokensRequest, MessagesRequest
from router.api.batches.message_batches import CreateMessageBatch
from router.api.batches.openai_files import CreateBatch
from router.api.openai.embeddings import EmbeddingRequest
from router.api.openai.schema import ChatCompletionRequest, CompletionRequest
from router.api.openai.tokens import DetokenizeRequest, TokenizeRequest
from router.api.responses.schema import CreateResponseRequest, ResponseInput
from router.api.scoring import RerankRequest, ScoreRequest

Schema = dict[str, Any]
_REF = "#/components/schemas/{name}"


def _ref(name: str) -> Schema:
    return {"$ref": _REF.format(name=name)}


def _obj(required: dict[str, Schema], optional: dict[str, Schema] | None = None) -> Schema:
    return {"type": "object", "properties": {**required, **(optional or {})},
            "required": list(required)}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


_INT: Schema = {"type": "integer"}
_BOOL: Schema = {"type": "boolean"}
_STR: Schema = {"type": "string"}
_NUM: Schema = {"type": "number"}


def _const(value: str) -> Schema:
    return {"type": "string", "enum": [value]}


def _array(items: Schema) -> Schema:
    return {"type": "array", "items": items}


_SPARE = _obj({"pid": _INT, "ready": _BOOL, "held": _BOOL, "forked": _BOOL, "rss_mib": _NUM,
               "age_seconds": _NUM})  # ``router.workers.spares._describe``
_CHAT_LOGPROBS = _nullable(_obj({"content": _nullable(_array(_obj(
    {"token": _STR, "logprob": _NUM, "bytes": _nullable(_array(_INT)),
     "top_logprobs": _array(_obj({"token": _STR, "logprob": _NUM,
                                  "bytes": _nullable(_array(_INT))}))})))},
    {"refusal": _nullable(_array({}))}))

RESPONSES: dict[str, Schema] = {
    "Error": _obj({"message": _STR, "type": _STR, "param": _nullable(_STR),
                   "code": _nullable(_STR)}),
    "ErrorResponse": _obj({"error": _ref("Error")}),
    "Usage": _obj({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT},
                  {"prompt_tokens_details": _obj({}, {"cached_tokens": _INT})}),
    "ChatCompletion": _obj({
        "id": _STR, "object": _const("chat.completion"), "created": _INT, "model": _STR,
        "choices": _array(_obj({
            "index": _INT,
            "finish_reason": {"type": "string", "enum": [
                "stop", "length", "tool_calls", "content_filter", "function_call"]},
            "message": _obj(
                {"role": _const("assistant"), "content": _nullable(_STR),
                 "refusal": _nullable(_STR)},
                {"reasoning_content": _STR,
                 "tool_calls": _array(_obj({"id": _STR, "type": _const("function"),
                                            "function": _obj({"name": _STR,
                                                              "arguments": _STR})})),
                 "function_call": _obj({"name": _STR, "arguments": _STR})}),
            "logprobs": _CHAT_LOGPROBS})),
    }, {"usage": _ref("Usage")}),
    "ChatCompletionChunk": _obj({
        "id": _STR, "object": _const("chat.completion.chunk"), "created": _INT, "model": _STR,
        "choices": _array(_obj({
            "index": _INT,
            "delta": _obj({}, {
                "role": _const("assistant"), "content": _nullable(_STR),
                "reasoning_content": _STR,
                "tool_calls": _array(_obj({"index": _INT}, {
                    "id": _STR, "type": _const("function"),
                    "function": _obj({}, {"name": _STR, "arguments": _STR})})),
                "function_call": _obj({}, {"name": _STR, "arguments": _STR})}),
            "finish_reason": _nullable({"type": "string", "enum": [
                "stop", "length", "tool_calls", "content_filter", "function_call"]})},
            {"logprobs": _CHAT_LOGPROBS})),
    }, {"usage": _ref("Usage")}),
    "CompletionChunk": _obj({
        "id": _STR, "object": _const("text_completion"), "created": _INT, "model": _STR,
        "choices": _array(_obj({
            "index": _INT, "text": _STR,
            "finish_reason": _nullable({"type": "string", "enum": ["stop", "length"]}),
            "logprobs": _nullable({"type": "object"})})),
    }, {"usage": _ref("Usage")}),
    "Completion": _obj({
        "id": _STR, "object": _const("text_completion"), "created": _INT, "model": _STR,
        "choices": _array(_obj({
            "index": _INT, "text": _STR,
            "finish_reason": {"type": "string", "enum": ["stop", "length", "content_filter"]},
            "logprobs": _nullable(_obj({}, {
                "tokens": _array(_STR), "token_logprobs": _array(_NUM),
                "top_logprobs": _array({"type": "object", "additionalProperties": _NUM}),
                "text_offset": _array(_INT)}))})),
    }, {"usage": _ref("Usage")}),
    "EmbeddingList": _obj({
        "object": _const("list"), "model": _STR,
        "data": _array(_obj({"object": _const("embedding"), "index": _INT,
                             "embedding": {"anyOf": [_array(_NUM), _STR]}})),
        "usage": _obj({"prompt_tokens": _INT, "total_tokens": _INT})}),
    "RerankList": _obj({
        "id": _STR, "model": _STR,
        "results": _array(_obj({"index": _INT, "relevance_score": _NUM},
                               {"document": _obj({"text": _STR})})),
        "usage": _obj({"prompt_tokens": _INT, "total_tokens": _INT}),
        "meta": _obj({"api_version": _obj({"version": _STR}),
                      "billed_units": _obj({"search_units": _INT}),
                      "tokens": _obj({"input_tokens": _INT, "output_tokens": _INT})})}),
    "ScoreList": _obj({
        "id": _STR, "object": _const("list"), "created": _INT, "model": _STR,
        "data": _array(_obj({"index": _INT, "object": _const("score"), "score": _NUM})),
        "usage": _obj({"prompt_tokens": _INT, "total_tokens": _INT,
                       "completion_tokens": _INT})}),
    "TokenizeResult": _obj({"model": _STR, "count": _INT, "max_model_len": _INT,
                            "tokens": _array(_INT)}, {"token_strs": _array(_STR)}),
    "DetokenizeResult": _obj({"model": _STR, "prompt": _STR}),
    "Model": _obj({"id": _STR, "object": _const("model"), "created": _INT, "owned_by": _STR},
                  {"state": {"type": "string", "enum": [
                      "unloaded", "loading", "ready", "sleeping", "parking", "parked",
                      "waking", "stopping", "failed"]},
                   "aliases": _array(_STR), "engine": _STR, "task": _STR, "device": _STR,
                   "pid": _INT, "in_flight": _INT, "queued": _INT, "ttl": _NUM,
                   "failures": _INT, "max_model_len": _INT, "load_seconds": _NUM,
                   "load_phases": {"type": "object", "additionalProperties": _NUM},
                   "loads": _INT, "evictions": _INT, "keep_alive": _NUM,
                   "pinned": {"type": "boolean"}, "priority": _INT,
                   "loaded_at": _INT, "idle_seconds": _NUM, "placement": {"type": "object"},
                   "node": {"type": "string"}, "backend": {"type": "string"},
                   "exit_code": _INT, "error": _STR, "worker_in_flight": _INT,
                   "replicas": _array(_obj({"number": _INT, "pid": _INT, "node": _STR,
                                            "state": _STR, "in_flight": _INT,
                                            "completed": _INT},
                                           {"placement": {"type": "object"},
                                            "node_id": _STR,  # a Ray node's id
                                            "cached_share": _NUM}))}),
    "ModelDeleted": _obj({"id": _STR, "object": _const("model"),
                          "deleted": {"type": "boolean"}}),
    "ModelList": _obj({"object": _const("list"), "data": _array(_ref("Model"))},
                      {"models": _array(_ref("CodexModel"))}),
    # Codex's ModelInfo (router.api.codex_catalog): its required fields, and the rest sent
    "CodexModel": _obj({"slug": _STR, "display_name": _STR,
                        "supported_reasoning_levels": _array(_obj({"effort": _STR,
                                                                   "description": _STR})),
                        "shell_type": _STR, "visibility": _STR,
                        "supported_in_api": {"type": "boolean"}, "priority": _INT,
                        "model_messages": _obj({"instructions_template": _STR}),
                        "support_verbosity": {"type": "boolean"},
                        "truncation_policy": _obj({"mode": _STR, "limit": _INT}),
                        "experimental_supported_tools": _array(_STR)},
                       {"description": _STR, "supports_reasoning_summaries": {"type": "boolean"},
                        "apply_patch_tool_type": {"type": "null"},
                        "supports_parallel_tool_calls": {"type": "boolean"},
                        "context_window": _INT, "max_context_window": _INT}),
    "ModelOrList": {"anyOf": [_ref("Model"), _ref("ModelList")]},
    "AnthropicError": _obj({"type": _const("error"),
                            "error": _obj({"type": _STR, "message": _STR})}),
    "AnthropicMessage": _obj({
        "id": _STR, "type": _const("message"), "role": _const("assistant"), "model": _STR,
        "content": _array(_obj({"type": {"type": "string", "enum": [
            "text", "thinking", "tool_use"]}}, {
            "text": _STR, "thinking": _STR, "signature": _STR, "id": _STR, "name": _STR,
            "input": {"type": "object"}})),
        "stop_reason": _nullable({"type": "string", "enum": [
            "end_turn", "max_tokens", "stop_sequence", "tool_use"]}),
        "stop_sequence": _nullable(_STR),
        "usage": _obj({"input_tokens": _INT, "output_tokens": _INT},
                      {"cache_read_input_tokens": _INT, "cache_creation_input_tokens": _INT}),
    }),
    "AnthropicStreamEvent": _obj({"type": {"type": "string", "enum": [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop", "ping", "error"]}}),
    "AnthropicTokenCount": _obj({"input_tokens": _INT}),
    "Response": _obj({
        "id": _STR, "object": _const("response"), "created_at": _INT,
        "status": {"type": "string", "enum": [
            "completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]},
        "model": _STR, "error": _nullable(_obj({"code": _STR, "message": _STR})),
        "incomplete_details": _nullable(_obj({"reason": _STR})),
        "instructions": _nullable(_STR), "metadata": {"type": "object"},
        "output": _array(_obj({"id": _STR, "type": {"type": "string", "enum": [
            "message", "reasoning", "function_call"]}})),
        "tools": _array({"type": "object"}),
        "tool_choice": {"anyOf": [_STR, {"type": "object"}]},
        "parallel_tool_calls": {"type": "boolean"},
        "temperature": _nullable(_NUM), "top_p": _nullable(_NUM),
    }, {"usage": _obj({"input_tokens": _INT, "output_tokens": _INT, "total_tokens": _INT}),
        "completed_at": _nullable(_INT), "previous_response_id": _nullable(_STR),
        "max_output_tokens": _nullable(_INT), "store": {"type": "boolean"},
        "background": {"type": "boolean"}, "text": {"type": "object"},
        "reasoning": _nullable({"type": "object"}), "truncation": _STR}),
    "ResponseStreamEvent": _obj({"type": _STR, "sequence_number": _INT}),
    "ResponseItemList": _obj({"object": _const("list"), "data": _array(_obj({"id": _STR})),
                              "first_id": _STR, "last_id": _STR,
                              "has_more": {"type": "boolean"}}),
    "ResponseTokenCount": _obj({"object": _const("response.input_tokens"),
                                "input_tokens": _INT}),
    "ResponseDeleted": _obj({"id": _STR, "object": _const("response"),
                             "deleted": {"type": "boolean"}}),
    "Health": _obj({"status": _STR}, {
        "models": {"type": "object", "additionalProperties": _STR},
        "spares": _array(_SPARE),
        "zygote": _nullable(_SPARE),  # the spare that forks the others (fork_spares)
        "tasks": _INT}),
    "Event": _obj({"type": {"type": "string", "enum": [
        "hello", "activity", "state", "load", "eviction", "request", "batch", "park", "wake",
        "replica", "dropped"]},
        "id": _nullable(_INT), "time": _NUM, "model": _nullable(_STR)}),
    "EventList": _obj({"object": _const("list"), "data": _array(_ref("Event"))}),
    "LogLines": _obj({"object": _const("list"), "model": _STR, "data": _array(_STR)}),
    "Key": _obj({"name": _STR, "role": {"type": "string", "enum": ["admin", "user", "viewer"]},
                 "spec": {"type": "object"}, "created": _NUM},
                {"revoked": _nullable(_NUM)}),
    "KeyList": _obj({"object": _const("list"), "data": _array(_ref("Key"))}),
    "KeyCreated": _obj({"name": _STR, "role": _STR, "spec": {"type": "object"},
                        "created": _NUM, "key": _STR}, {"revoked": {"type": "null"}}),
    "KeyRevoked": _obj({"name": _STR, "revoked": {"type": "boolean", "enum": [True]}}),
    "UsageReport": _obj({
        "object": _const("list"), "start": _NUM, "end": _NUM, "group_by": _array(_STR),
        "data": _array(_obj({"requests": _INT, "prompt_tokens": _INT, "cached_tokens": _INT,
                             "completion_tokens": _INT, "seconds": _NUM},
                            {"key": _STR, "model": _STR, "endpoint": _STR, "day": _STR}))}),
    "LogLine": _obj({"model": _STR, "line": _STR}),
    "ConfigReload": _obj({"source": _STR, "added": _array(_STR), "removed": _array(_STR),
                          "changed": _array(_STR), "unchanged": _array(_STR),
                          "changed_keys": {"type": "object",
                                           "additionalProperties": _array(_STR)},
                          "applied": _array(_STR), "restart_required": _array(_STR)}),
    "Ready": _obj({"ready": {"type": "boolean"}},
                  {"models": {"type": "object", "additionalProperties": _STR}}),
    "File": _obj({"id": _STR, "object": _const("file"), "bytes": _INT, "created_at": _INT,
                  "filename": _STR, "purpose": _STR, "status": _STR}),
    "FileList": _obj({"object": _const("list"), "data": _array(_ref("File")),
                      "first_id": _nullable(_STR), "last_id": _nullable(_STR),
                      "has_more": {"type": "boolean"}}),
    "FileDeleted": _obj({"id": _STR, "object": _const("file"),
                         "deleted": {"type": "boolean"}}),
    "BatchDeleted": _obj({"id": _STR, "object": _const("batch.deleted"),
                          "deleted": {"type": "boolean"}}),
    "Batch": _obj({"id": _STR, "object": _const("batch"), "endpoint": _STR,
                   "input_file_id": _STR, "completion_window": _STR, "status": _STR,
                   "created_at": _INT, "expires_at": _INT,
                   "request_counts": _obj({"total": _INT, "completed": _INT, "failed": _INT})},
                  {"output_file_id": _STR, "error_file_id": _STR, "in_progress_at": _INT,
                   "finalizing_at": _INT, "completed_at": _INT, "failed_at": _INT,
                   "expired_at": _INT, "cancelling_at": _INT, "cancelled_at": _INT,
                   "metadata": {"type": "object", "additionalProperties": _STR},
                   "errors": _obj({"object": _const("list"), "data": _array({})})}),
    "BatchList": _obj({"object": _const("list"), "data": _array(_ref("Batch")),
                       "first_id": _nullable(_STR), "last_id": _nullable(_STR),
                       "has_more": {"type": "boolean"}}),
    "MessageBatch": _obj({
        "id": _STR, "type": _const("message_batch"),
        "processing_status": {"type": "string", "enum": ["in_progress", "canceling", "ended"]},
        "request_counts": _obj({"processing": _INT, "succeeded": _INT, "errored": _INT,
                                "canceled": _INT, "expired": _INT}),
        "created_at": _STR, "expires_at": _STR, "ended_at": _nullable(_STR),
        "cancel_initiated_at": _nullable(_STR), "archived_at": _nullable(_STR),
        "results_url": _nullable(_STR)}),
    "MessageBatchList": _obj({"data": _array(_ref("MessageBatch")),
                              "has_more": {"type": "boolean"}, "first_id": _nullable(_STR),
                              "last_id": _nullable(_STR)}),
    "MessageBatchDeleted": _obj({"id": _STR, "type": _const("message_batch_deleted")}),
}

_ERRORS = {
    "400": "The body, a field or a value is wrong (the error's `param` names it)",
    "404": "No such model (or path)",
    "405": "Method not allowed on this path",
    "408": "The body did not arrive within `read_timeout`",
    "413": "The body exceeds `max_body_bytes`",
    "415": "The Content-Type is not application/json",
    "429": "The model's wait queue is full, or the client's rate limit is spent (see "
           "Retry-After)",
    "502": "The worker died while serving the request",
    "503": "The model could not be started or loaded in time, or the server is at "
           "`max_connections` (see Retry-After)",
}
_BODY_ERRORS = {"408", "413", "415"}
_ANTHROPIC_ERRORS = {"529": "The model's wait queue is full, or the server is at "
                            "`max_connections` (Anthropic's `overloaded_error`)"}
_AUTH_ERRORS = {"401": "Missing or invalid API key",
                "403": "This endpoint needs an admin key"}


def _event(chunk: str, anthropic: bool = False) -> Schema:
    """One server-sent event of a stream of ``chunk``s: a chunk, an in-band error (the
    worker failed mid-stream), or the closing ``[DONE]`` (Anthropic's events are named
    and end with ``message_stop``)."""
    if anthropic:
        payload = {"type": "string", "contentMediaType": "application/json",
                   "contentSchema": _ref(chunk)}
        return _obj({"event": _STR, "data": payload})
    payload = {"type": "string", "contentMediaType": "application/json",
               "contentSchema": {"anyOf": [_ref(chunk), _ref("ErrorResponse")]}}
    return _obj({"data": {"anyOf": [{"const": "[DONE]"}, payload]}})


class Operation(msgspec.Struct, frozen=True):
    """One route's description: what it takes and what a success looks like."""

    summary: str
    body: type | None = None
    ok: str | None = None  # response schema name, or None for a plain-text body
    streams: str | None = None  # 200 may be text/event-stream of these chunks
    accepted: bool = False  # 202 when asked not to wait
    text: bool = False  # 200 is text/plain (Prometheus exposition)
    anthropic: bool = False  # errors in Anthropic's shape; a full queue is 529
    named_events: bool = False  # a stream of named events (OpenAI Responses), no [DONE]
    html: bool = False  # 200 is text/html (the status page)
    query: dict[str, Schema] | None = None  # query parameters, all optional
    created: bool = False  # success is a 201
    conflict: str | None = None  # what a 409 means here
    jsonl: bool = False  # 200 is application/x-jsonl (JSON lines)


_GENERATE = ("Generation: the model's worker runs it; `\"stream\": true` answers with "
             "server-sent events ending in `data: [DONE]`")

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/chat/completions"): Operation(
        f"Chat completion. {_GENERATE}", ChatCompletionRequest, "ChatCompletion", "ChatCompletionChunk"),
    ("POST", "/v1/completions"): Operation(
        f"Text completion. {_GENERATE}", CompletionRequest, "Completion", "CompletionChunk"),
    ("POST", "/v1/embeddings"): Operation(
        "Embeddings from a model with `task: embed`", EmbeddingRequest, "EmbeddingList"),
    **{("POST", path): Operation(
        "Documents ranked by relevance to a query (Cohere's and Jina's shape), from a model "
        "with `task: score`, `classify` or `embed`", RerankRequest, "RerankList")
       for path in ("/v1/rerank", "/v2/rerank", "/rerank")},
    **{("POST", path): Operation(
        "Scores of text pairs, 1:1, 1:N or N:N (vLLM's shape), from a model with `task: "
        "score`, `classify` or `embed`", ScoreRequest, "ScoreList")
       for path in ("/v1/score", "/score")},
    ("POST", "/v1/tokenize"): Operation(
        "Token ids of a prompt, or of chat messages rendered by the model's template",
        TokenizeRequest, "TokenizeResult"),
    ("POST", "/v1/detokenize"): Operation(
        "Text of token ids", DetokenizeRequest, "DetokenizeResult"),
    ("POST", "/v1/messages"): Operation(
        "Anthropic Messages (also as `?beta=true`); `\"stream\": true` answers with "
        "Anthropic's named server-sent events", MessagesRequest, "AnthropicMessage",
        "AnthropicStreamEvent", anthropic=True),
    ("POST", "/v1/messages/count_tokens"): Operation(
        "Anthropic's token count of a conversation, from the model's template and tokenizer",
        CountTokensRequest, "AnthropicTokenCount", anthropic=True),
    ("POST", "/v1/responses"): Operation(
        "OpenAI Responses; `\"stream\": true` answers with named server-sent events, "
        "`\"background\": true` with a `queued` response to poll", CreateResponseRequest,
        "Response", "ResponseStreamEvent", named_events=True),
    ("POST", "/v1/responses/input_tokens"): Operation(
        "The input tokens a response to this input would count, from the model's template",
        ResponseInput, "ResponseTokenCount"),
    ("GET", "/v1/responses/{response_id}"): Operation("A stored response", None, "Response"),
    ("DELETE", "/v1/responses/{response_id}"): Operation(
        "Forget a stored response (cancelling it if it runs in the background)", None,
        "ResponseDeleted"),
    ("GET", "/v1/responses/{response_id}/input_items"): Operation(
        "A stored response's input items, earlier turns included (`limit`, `order`, "
        "`after`, `before`)", None, "ResponseItemList"),
    ("POST", "/v1/responses/{response_id}/cancel"): Operation(
        "Cancel a background response", None, "Response"),
    ("GET", "/v1/models"): Operation(
        "Every configured model and its state; with `client_version` (Codex's), Codex's "
        "metadata of the generation models too (`models`)", None, "ModelList",
        query={"client_version": _STR}),
    ("GET", "/v1/models/{model_id}"): Operation(
        "One model by exact id (aliases are for requests)", None, "Model"),
    ("POST", "/v1/models/load"): Operation(
        "Start a model's worker (or several, given a list, in order); with `\"wait\": "
        "false` answer 202 at once", ModelAction,
        "ModelOrList", accepted=True),
    ("POST", "/v1/models/unload"): Operation(
        "Stop a model's worker, or several (drain, or `\"force\": true`)", ModelAction,
        "ModelOrList"),
    ("POST", "/v1/models/adapters"): Operation(
        "Register a LoRA adapter folder by path (inside `adapter_roots` or a base's "
        "`adapters_dir`) as a model its base serves (an admin key); checked against the "
        "base first, and loaded into it at once when it runs", AdapterRegistration, "Model",
        created=True, conflict="A model is already known by the name or an alias"),
    ("DELETE", "/v1/models/adapters/{name}"): Operation(
        "Remove an adapter registered with `POST /v1/models/adapters` (an admin key); a "
        "running base unloads it", None, "ModelDeleted"),
    ("POST", "/v1/config/reload"): Operation(
        "Read the preset file again and apply what changed (a 400 names file, model and "
        "key of a file that does not load; the running config stays)", None, "ConfigReload"),
    ("GET", "/health"): Operation(
        "Liveness (never needs a key); with a valid key also every model's state and the "
        "spare workers", None, "Health"),
    ("GET", "/health/ready"): Operation(
        "Readiness: 200 once every start-up model (`load_on_startup`, `preload`) has "
        "loaded, else a 503 error with `ready` beside it (never needs a key); with a valid "
        "key the error names the models not ready, and `models` gives every start-up "
        "model's state", None, "Ready"),
    ("GET", "/metrics"): Operation("Prometheus metrics (text exposition format)", text=True),
    ("GET", "/v1/metrics"): Operation("The same metrics as one JSON object, per model"),
    ("GET", "/openapi.json"): Operation("This document", None, None),
    ("GET", "/v1/events"): Operation(
        "The router's events (model states, loads with their phases, evictions with their "
        "reason, one summary per request, batches made, progressing and ended): the recent "
        "ones as JSON, or with `Accept: "
        "text/event-stream` a stream of named events that goes on (a comment every 15 s)",
        None, "EventList", "Event", named_events=True,
        query={"replay": {"type": "string", "enum": ["0", "1", "true", "false"]}}),
    ("GET", "/v1/models/{model_id}/logs"): Operation(
        "The last `lines` lines of a model's worker log; with `follow=1` a stream of "
        "`line` events, those lines first, then each line as it is written",
        None, "LogLines", "LogLine", named_events=True,
        query={"lines": {"type": "integer", "minimum": 0, "maximum": 10000},
               "follow": {"type": "string", "enum": ["0", "1", "true", "false"]}}),
    ("GET", "/"): Operation("The status page (HTML; its assets are under /static/)",
                            html=True),
    ("GET", "/v1/keys"): Operation("The named API keys (an admin key; never a secret)",
                                   None, "KeyList"),
    ("POST", "/v1/keys"): Operation(
        "Make a named key (an admin key); its secret is answered once, as `key`", KeyCreate,
        "KeyCreated"),
    ("DELETE", "/v1/keys/{name}"): Operation("Revoke a named key (an admin key)", None,
                                             "KeyRevoked"),
    ("GET", "/v1/files"): Operation(
        "The key's files (an admin: every key's), newest first (`purpose`, `limit`, "
        "`order`, `after`)", None, "FileList"),
    ("POST", "/v1/files"): Operation(
        "Upload a file: a multipart form with `file` and `purpose` (`batch` for a batch's "
        "JSONL input)", None, "File"),
    ("GET", "/v1/files/{file_id}"): Operation("A file", None, "File"),
    ("DELETE", "/v1/files/{file_id}"): Operation("Delete a file", None, "FileDeleted"),
    ("GET", "/v1/files/{file_id}/content"): Operation(
        "A file's body (a batch's output or error file: one JSON line per request)", None,
        None),
    ("GET", "/v1/batches"): Operation(
        "The key's batches (an admin: every key's), newest first (`limit`, `after`)", None,
        "BatchList"),
    ("POST", "/v1/batches"): Operation(
        "Run an uploaded JSONL file of requests to one endpoint as a batch, when the "
        "models have room, behind every client's own requests", CreateBatch, "Batch"),
    ("GET", "/v1/batches/{batch_id}"): Operation("A batch and its progress", None, "Batch"),
    ("DELETE", "/v1/batches/{batch_id}"): Operation(
        "Delete a batch that has ended, with its lines and result files (ours: what a "
        "batch stores counts against its key's files quota)", None, "BatchDeleted"),
    ("POST", "/v1/batches/{batch_id}/cancel"): Operation(
        "Cancel a batch: lines not run yet are answered `batch_cancelled`", None, "Batch"),
    ("GET", "/v1/messages/batches"): Operation(
        "Anthropic Message Batches: the key's (an admin: every key's), newest first "
        "(`limit`, `after_id`, `before_id`)", None, "MessageBatchList", anthropic=True),
    ("POST", "/v1/messages/batches"): Operation(
        "Run Messages requests as an Anthropic Message Batch, when the models have room, "
        "behind every client's own requests", CreateMessageBatch, "MessageBatch",
        anthropic=True),
    ("GET", "/v1/messages/batches/{message_batch_id}"): Operation(
        "A Message Batch and its progress", None, "MessageBatch", anthropic=True),
    ("DELETE", "/v1/messages/batches/{message_batch_id}"): Operation(
        "Delete a Message Batch that has ended, with its results", None,
        "MessageBatchDeleted", anthropic=True),
    ("POST", "/v1/messages/batches/{message_batch_id}/cancel"): Operation(
        "Cancel a Message Batch: requests not run yet end `canceled`", None,
        "MessageBatch", anthropic=True),
    ("GET", "/v1/messages/batches/{message_batch_id}/results"): Operation(
        "An ended Message Batch's results: one JSON line per request (`custom_id`, "
        "`result`), `application/x-jsonl`", None, None, anthropic=True, jsonl=True),
    ("GET", "/v1/usage"): Operation(
        "Usage from the ledger, summed per group: every key's for an admin or a viewer, "
        "else the key's own", None, "UsageReport",
        query={"group_by": _STR, "start": _STR, "end": _STR, "key": _STR}),
}


def _version() -> str:
    try:
        return importlib.metadata.version("modelyard")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "0.0.0"


def _openapi_path(path: str) -> str:
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", path)  # "{model_id:path}" -> "{model_id}"


def _json(schema: Schema) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _operation(method: str, path: str, op: Operation, auth: bool) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": "OK"}
    if op.text:
        ok["content"] = {"text/plain": {"schema": _STR}}
    elif op.html:
        ok["content"] = {"text/html": {"schema": _STR}}
    elif op.jsonl:
        ok["content"] = {"application/x-jsonl": {"schema": _STR}}
    elif op.ok is not None:
        ok["content"] = _json(_ref(op.ok))
        if op.streams is not None:
            ok["content"]["text/event-stream"] = {
                "schema": _event(op.streams, op.anthropic or op.named_events)}
    else:
        ok["content"] = _json({"type": "object"})
    responses: dict[str, Any] = {"201" if op.created else "200": ok}
    if op.accepted and op.ok is not None:
        responses["202"] = {"description": "Loading has started",
                            "content": _json(_ref(op.ok))}
    errors = {k: v for k, v in _ERRORS.items() if op.body is not None or k not in _BODY_ERRORS}
    if auth and path not in OPEN_PATHS:
        errors.update(_AUTH_ERRORS)
    if op.anthropic:
        errors.update(_ANTHROPIC_ERRORS)
    if op.conflict is not None:
        errors["409"] = op.conflict
    error = "AnthropicError" if op.anthropic else "ErrorResponse"
    for status, description in sorted(errors.items()):
        responses[status] = {"description": description, "content": _json(_ref(error))}
    out: dict[str, Any] = {"summary": op.summary, "responses": responses}
    if op.body is not None:
        out["requestBody"] = {"required": True, "content": _json(_ref(op.body.__name__))}
    params = re.findall(r"\{(\w+)\}", path)
    if params or op.query:
        out["parameters"] = [{"name": p, "in": "path", "required": True, "schema": _STR}
                             for p in params]
    if auth and path in OPEN_PATHS:
        out["security"] = []
    return out


def build_document(routes: list[BaseRoute], auth: bool) -> dict[str, Any]:
    """The OpenAPI document for ``routes``; ``auth``: the server requires API keys."""
    bodies = sorted({op.body for op in OPERATIONS.values() if op.body is not None},
                    key=lambda t: t.__name__)
    _, components = msgspec.json.schema_components(bodies, ref_template=_REF)
    clash = set(components) & set(RESPONSES)
    assert not clash, f"request and response schemas share names: {clash}"
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route):
            continue
        path = _openapi_path(route.path)
        for method in sorted(route.methods or ()):
            if method == "HEAD":  # Starlette answers HEAD for every GET route
                continue
            op = OPERATIONS.get((method, path), Operation("(undescribed)"))
            paths.setdefault(path, {})[method.lower()] = _operation(method, path, op, auth)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "modelyard", "version": _version(),
                 "description": "OpenAI-compatible multi-model server. Errors are "
                                "OpenAI-shaped: {\"error\": {message, type, param, code}}."},
        "paths": paths,
        "components": {"schemas": {**components, **RESPONSES}},
    }
    if auth:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
        doc["security"] = [{"bearer": []}, {"apiKey": []}]
    return doc


class OpenAPIDocument:
    """Serves ``build_document`` for the app's routes, built at the first request while
    keys are required (or not): keys turn on with a reload or a first named key (never
    off until a restart)."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self._bodies: dict[bool, bytes] = {}

    def routes(self) -> list[Route]:
        return [Route("/openapi.json", self.serve, methods=["GET"])]

    async def serve(self, request: Request) -> Response:
        auth = self.keys.required
        if auth not in self._bodies:  # the app's routes are final by the first request
            self._bodies[auth] = msgspec.json.encode(build_document(request.app.routes, auth))
        return Response(self._bodies[auth], media_type="application/json")
