"""How much a key may do, stated once: every limit a key carries × every way work enters.

``rules.TABLE`` says who may call a route; this table says, for each per-key limit
(``LIMITS``) and each way a key's work enters the router (``WAYS``), whether the limit
holds there and which code holds it, or why it does not apply (``Cell``). A batch line
runs in-process below the admission middleware as its owner's key
(``router.batches.runner.LineCaller``), so what the middleware enforces (``rpm``,
``max_concurrent``) does not reach it, and what the relay enforces (model globs, token
rate, budgets) does: the table says so cell by cell. ``CLOSED`` names the ways work must
never enter (work that would outlive a batch line).

The generated test (``tests/test_limit_matrix.py``) walks every cell against a real
router with synthetic models: a cell that holds is driven past its limit that way and
must be refused in its protocol's shape; a cell missing from the table, or a limit or way
without its cells, fails it. ``python -m router.access`` prints it (``markdown``) into
``docs/security.md``, which the test keeps equal.

Nothing here is enforced by reading the table: each enforcer named is the code that
holds the limit, and the test checks the name still exists. Bounds of the whole server,
not of a key (``max_connections``, ``max_queue_depth``, ``batch_model_concurrency``), are
not in it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Cell:
    """One limit on one way in: ``enforcer`` (``module:attribute``, or a module) holds it
    as ``how`` says, or, with no enforcer, ``how`` says why it does not apply."""

    enforcer: str | None
    how: str

    @property
    def holds(self) -> bool:
        return self.enforcer is not None


LIMITS: dict[str, str] = {
    "models": "the model globs a key may use (`KeySpec.models`)",
    "rpm": "requests per minute (`KeySpec.rpm`, else `rate_limit_per_minute`)",
    "tpm": "prompt + completion tokens per minute (`KeySpec.tpm`)",
    "max_concurrent": "requests in flight at once (`KeySpec.max_concurrent`)",
    "budget_generation": "`budgets` on generation (chat, completions, messages, responses)",
    "budget_embeddings": "`budgets` on embeddings",
    "budget_scoring": "`budgets` on score and rerank",
    "files_quota": "what a key stores as files: uploads and the batches made of them "
                   "(`files_quota_mib`)",
    "store_bound": "a key's stored responses (`responses_store_items`, "
                   "`responses_store_mib`)",
    "batches_in_flight": "batches a key may have in flight at once, both kinds together "
                         "(`batches_per_key`)",
}
"""Every limit a key carries: its own (``KeySpec``) and the server's per-key bounds."""

SETTINGS: dict[str, str] = {
    "files_quota": "files_quota_mib",
    "store_bound": "responses_store_items",
    "batches_in_flight": "batches_per_key",
}
"""The server's setting (``ServerConfig``) of each per-key bound that is not a key's own
(the others are ``KeySpec`` fields of the limit's name, ``budgets`` for the budgets)."""

WAYS: dict[str, str] = {
    "request": "a request answered whole",
    "stream": "a streamed request (`stream: true`)",
    "background": "a background response (`POST /v1/responses`, `background: true`)",
    "batch": "an OpenAI batch: its create, and each line (in-process, as the owner's key)",
    "message_batch": "an Anthropic message batch: its create, and each request in it",
    "upload": "a file upload (`POST /v1/files`)",
}
"""Every way a key's work enters the router."""

# Who holds what (named once, used in many cells).
_RATE = "router.access.limits:RateLimit"
_VISIBLE = "router.api.relay:Relay.resolve_for"
_TOKENS = "router.api.relay:Relay._within_limits"
_RESERVE = "router.access.budgets:Budgets.reserve"
_CHECKS = "router.api.batches.checks"  # what both batch APIs check of a line
_STORE = "router.api.responses.store:ResponseStore.put"
_FILES = "router.batches.store:BatchStore"

_BELOW = ("a line runs in-process below the admission middleware (`LineCaller`): the "
          "create is one request; the key's lines in flight are bounded by "
          "`batch_key_concurrency` instead, at batch priority")
_NO_TOKENS = "spends no tokens"
_NOT_GENERATION = "generates nothing"
_NO_FILE = "stores no file (a stored response is under the store bound)"
_NOT_A_BATCH = "is not a batch"
_NO_RESPONSES = "stores nothing in the responses store (its results are the batch's)"


def _holds(enforcer: str, how: str) -> Cell:
    return Cell(enforcer, how)


def _not(why: str) -> Cell:
    return Cell(None, why)


TABLE: dict[tuple[str, str], Cell] = {
    # -- model globs: first, so nothing else tells that a model exists ------------------
    ("models", "request"): _holds(_VISIBLE, "a model outside the globs is a 404 "
                                            "`model_not_found`"),
    ("models", "stream"): _holds(_VISIBLE, "a 404 before the stream begins"),
    ("models", "background"): _holds(_VISIBLE, "a 404 at the create, before anything is "
                                               "stored or run"),
    ("models", "batch"): _holds(_CHECKS, "the line is refused at the create "
                                         "(`model_not_found` in the error file), and "
                                         "checked again as it runs, as the key is then"),
    ("models", "message_batch"): _holds(_CHECKS, "the request is `errored` at the create, "
                                                 "and checked again as it runs"),
    ("models", "upload"): _not("a file names no model: its lines are checked when a batch "
                               "is made of it"),
    # -- requests per minute: the middleware's token bucket -----------------------------
    ("rpm", "request"): _holds(_RATE, "429 `rate_limit_exceeded` with `Retry-After`"),
    ("rpm", "stream"): _holds(_RATE, "429 before the stream begins"),
    ("rpm", "background"): _holds(_RATE, "the create is a request: 429"),
    ("rpm", "batch"): _not(_BELOW),
    ("rpm", "message_batch"): _not(_BELOW),
    ("rpm", "upload"): _holds(_RATE, "an upload is a request: 429"),
    # -- tokens per minute: the relay, before a model is asked --------------------------
    ("tpm", "request"): _holds(_TOKENS, "429 `rate_limit_exceeded` once the minute's tokens "
                                        "are spent"),
    ("tpm", "stream"): _holds(_TOKENS, "429 before the stream begins"),
    ("tpm", "background"): _holds(_TOKENS, "the run is refused: the response ends `failed` "
                                           "with `rate_limit_exceeded`"),
    ("tpm", "batch"): _holds(_TOKENS, "the line's result is the 429"),
    ("tpm", "message_batch"): _holds(_TOKENS, "the request is `errored` "
                                              "(`rate_limit_error`)"),
    ("tpm", "upload"): _not(_NO_TOKENS),
    # -- requests in flight: the middleware's count; a background run keeps its place ---
    ("max_concurrent", "request"): _holds(_RATE, "one more is a 429 at once"),
    ("max_concurrent", "stream"): _holds(_RATE, "a stream counts until its last byte"),
    ("max_concurrent", "background"): _holds(
        "router.access.limits:KeyPlace.keep", "the run keeps its create's place until it "
        "ends: a create or request past the limit is a 429, never queued"),
    ("max_concurrent", "batch"): _not(_BELOW + "; a line cannot start work that outlives "
                                      "it (see the closed ways)"),
    ("max_concurrent", "message_batch"): _not(_BELOW),
    ("max_concurrent", "upload"): _holds(_RATE, "an upload is a request in flight"),
    # -- budgets: held before the request runs, by endpoint kind -------------------------
    ("budget_generation", "request"): _holds(_RESERVE, "429 `budget_exceeded` when the "
                                                       "request cannot fit what is left"),
    ("budget_generation", "stream"): _holds(_RESERVE, "429 before the stream begins"),
    ("budget_generation", "background"): _holds(_RESERVE, "the run is refused: the "
                                                          "response ends `failed` with "
                                                          "`budget_exceeded`"),
    ("budget_generation", "batch"): _holds(_RESERVE, "the line's result is the 429"),
    ("budget_generation", "message_batch"): _holds(_RESERVE, "the request is `errored` "
                                                             "(`rate_limit_error`)"),
    ("budget_generation", "upload"): _not(_NOT_GENERATION),
    ("budget_embeddings", "request"): _holds(_RESERVE, "the input is held before it is "
                                                       "embedded: 429 `budget_exceeded`"),
    ("budget_embeddings", "stream"): _not("embeddings are never streamed"),
    ("budget_embeddings", "background"): _not("only a response runs in the background"),
    ("budget_embeddings", "batch"): _holds(_RESERVE, "the line's result is the 429"),
    ("budget_embeddings", "message_batch"): _not("a message batch runs Messages only"),
    ("budget_embeddings", "upload"): _not(_NO_TOKENS),
    ("budget_scoring", "request"): _holds(_RESERVE, "the texts are held before they are "
                                                    "scored: 429 `budget_exceeded`"),
    ("budget_scoring", "stream"): _not("scores are never streamed"),
    ("budget_scoring", "background"): _not("only a response runs in the background"),
    ("budget_scoring", "batch"): _holds(_RESERVE, "the line's result is the 429"),
    ("budget_scoring", "message_batch"): _not("a message batch runs Messages only"),
    ("budget_scoring", "upload"): _not(_NO_TOKENS),
    # -- what a key stores ----------------------------------------------------------------
    ("files_quota", "request"): _not(_NO_FILE),
    ("files_quota", "stream"): _not(_NO_FILE),
    ("files_quota", "background"): _not(_NO_FILE),
    ("files_quota", "batch"): _holds(_FILES, "the lines a batch stores, and its results "
                                             "as they are written, count with the file it "
                                             "was made of: a create past the quota is "
                                             "refused (`files_quota_exceeded`)"),
    ("files_quota", "message_batch"): _holds(_FILES, "its requests and results are "
                                                     "stored as the key's and count: a "
                                                     "create past the quota is refused"),
    ("files_quota", "upload"): _holds(_FILES + ".add_file", "413 `files_quota_exceeded`, as the bytes "
                                              "arrive"),
    ("store_bound", "request"): _holds(_STORE, "the key's least recently used response "
                                               "goes first: never more than the bound"),
    ("store_bound", "stream"): _holds(_STORE, "as a request"),
    ("store_bound", "background"): _holds(_STORE, "as a request, from its `queued` state "
                                                  "on"),
    ("store_bound", "batch"): _holds(_STORE, "a `/v1/responses` line is stored as its "
                                             "owner's, in the same bound"),
    ("store_bound", "message_batch"): _not(_NO_RESPONSES),
    ("store_bound", "upload"): _not("a file is under the files quota"),
    ("batches_in_flight", "request"): _not(_NOT_A_BATCH),
    ("batches_in_flight", "stream"): _not(_NOT_A_BATCH),
    ("batches_in_flight", "background"): _not(_NOT_A_BATCH),
    ("batches_in_flight", "batch"): _holds(_FILES, "a create past the bound is a 429 "
                                                   "`too_many_batches`, nothing stored"),
    ("batches_in_flight", "message_batch"): _holds(_FILES, "a create past the bound is a "
                                                           "429 (both kinds count)"),
    ("batches_in_flight", "upload"): _not("an upload is not a batch (its bytes are under "
                                          "the files quota)"),
}
"""Every limit × every way in (``LIMITS`` × ``WAYS``) → ``Cell``."""

CLOSED: dict[str, Cell] = {
    "a stream from a batch line": _holds(
        _CHECKS, "refused at the create: the line is errored `invalid_body`"),
    "a background response from a batch line": _holds(
        _CHECKS, "refused at the create (`invalid_body`), and by the Responses handler for "
        "any batch line: its run would outlive the batch's limits, cancel and revocation"),
}
"""Ways work must never enter, and what closes each."""


def missing() -> list[str]:
    """Cells of ``LIMITS`` × ``WAYS`` without a row, and rows of neither (the test wants
    none)."""
    wanted = {(limit, way) for limit in LIMITS for way in WAYS}
    return ([f"{limit} × {way}: no cell" for limit, way in sorted(wanted - TABLE.keys())]
            + [f"{limit} × {way}: no such limit or way"
               for limit, way in sorted(TABLE.keys() - wanted)])


def markdown() -> str:
    """The matrix as Markdown: a grid at a glance, what its names mean, then each cell's
    how or why."""
    lines = [f"| limit | {' | '.join(WAYS)} |", "|---" * (len(WAYS) + 1) + "|"]
    for limit in LIMITS:
        marks = " | ".join("holds" if TABLE[limit, way].holds else "—" for way in WAYS)
        lines.append(f"| `{limit}` | {marks} |")
    lines += ["", *(f"- `{limit}`: {text}" for limit, text in LIMITS.items()),
              *(f"- `{way}`: {text}" for way, text in WAYS.items()), ""]
    lines += ["| limit | way in | | how it holds, or why it does not apply |",
              "|---|---|---|---|"]
    for (limit, way), cell in TABLE.items():
        state = f"holds: `{cell.enforcer}`" if cell.holds else "does not apply"
        lines.append(f"| `{limit}` | `{way}` | {state} | {cell.how} |")
    lines += ["", "| closed way in | closed by | how |", "|---|---|---|"]
    lines += [f"| {way} | `{cell.enforcer}` | {cell.how} |" for way, cell in CLOSED.items()]
    return "\n".join(lines)
