"""Who may call what, stated once.

``TABLE`` maps every route of the app (method and path template, as Starlette declares
them) to the roles that may call it and what such a caller sees of other keys' work.
``KeyGuard`` (``admission.py``) enforces it before any handler runs; the matrix test
(``tests/test_access.py``) walks the app's real route table against it, so a route added
without a row fails there and is refused at run time (403 ``no_access_rule``); the docs
print it (``markdown``).

Roles, from least to most:

- ``anonymous``: no valid key, on a server that requires keys (probes, the status page).
- ``viewer``: reads only (a dashboard's key).
- ``user``: the API (generation, its own stored objects).
- ``admin``: everything.

A server that requires no key has one user, who is admin (``vllm serve`` is open so).
Whether keys are required is decided at start (``Keys.required``) and only ever turns
on while the router runs, never off: no revocation, reload or database outage opens it.

What a caller sees is enforced by the handlers, by one rule each: a key limited to some
models (``KeySpec.models``) sees nothing of the others (lists, 404s, health, logs,
events, metrics); a user key sees its own requests, usage and stored objects only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from starlette.routing import BaseRoute, Match, Mount, Route
from starlette.types import Scope

ROLES = ("anonymous", "viewer", "user", "admin")


@dataclass(frozen=True, slots=True)
class Rule:
    """Who may call a route (``roles``) and what of others they see there (``sees``)."""

    roles: frozenset[str]
    sees: str

    def allows(self, role: str) -> bool:
        return role in self.roles


def _rule(roles: str, sees: str) -> Rule:
    return Rule(frozenset(roles.split()), sees)


OPEN = "anonymous viewer user admin"
READ = "viewer user admin"
API = "user admin"
ADMIN = "admin"

ALLOWED_MODELS = "the models its globs allow"
GENERATE = _rule(API, f"{ALLOWED_MODELS}; nothing of other keys")
OWN_OBJECT = "its own stored responses (any other id is a 404)"
OWN_FILES = "its own files (any other id is a 404); an admin: every key's"
OWN_BATCHES = "its own batches (any other id is a 404); an admin: every key's"

TABLE: dict[tuple[str, str], Rule] = {
    # The status page and its files hold no data; what the page calls needs a key.
    ("GET", "/"): _rule(OPEN, "nothing (a static page)"),
    ("GET", "/static"): _rule(OPEN, "nothing (the page's files)"),
    ("GET", "/health"): _rule(OPEN, "without a key: the status alone; with one: the states "
                                    f"of {ALLOWED_MODELS}"),
    ("GET", "/health/ready"): _rule(OPEN, "without a key: ready or not; with one: the "
                                          f"start-up models among {ALLOWED_MODELS}"),
    ("GET", "/openapi.json"): _rule(READ, "the API's shape"),
    # Generation and the protocols' helpers.
    ("POST", "/v1/chat/completions"): GENERATE,
    ("POST", "/v1/completions"): GENERATE,
    ("POST", "/v1/embeddings"): GENERATE,
    ("POST", "/v1/tokenize"): GENERATE,
    ("POST", "/v1/detokenize"): GENERATE,
    ("POST", "/v1/messages"): GENERATE,
    ("POST", "/v1/messages/count_tokens"): GENERATE,
    ("POST", "/v1/responses"): _rule(API, f"{ALLOWED_MODELS}; {OWN_OBJECT}"),
    ("POST", "/v1/responses/input_tokens"): GENERATE,
    ("GET", "/v1/responses/{response_id}"): _rule(READ, OWN_OBJECT),
    ("DELETE", "/v1/responses/{response_id}"): _rule(API, OWN_OBJECT),
    ("GET", "/v1/responses/{response_id}/input_items"): _rule(READ, OWN_OBJECT),
    ("POST", "/v1/responses/{response_id}/cancel"): _rule(API, OWN_OBJECT),
    ("POST", "/v1/rerank"): GENERATE,
    ("POST", "/v2/rerank"): GENERATE,
    ("POST", "/rerank"): GENERATE,
    ("POST", "/v1/score"): GENERATE,
    ("POST", "/score"): GENERATE,
    # Files and batches: each belongs to the key that made it.
    ("GET", "/v1/files"): _rule(READ, OWN_FILES),
    ("POST", "/v1/files"): _rule(API, OWN_FILES),
    ("GET", "/v1/files/{file_id}"): _rule(READ, OWN_FILES),
    ("DELETE", "/v1/files/{file_id}"): _rule(API, OWN_FILES),
    ("GET", "/v1/files/{file_id}/content"): _rule(READ, OWN_FILES),
    ("GET", "/v1/batches"): _rule(READ, OWN_BATCHES),
    ("POST", "/v1/batches"): _rule(API, f"{ALLOWED_MODELS} (each line's); {OWN_FILES}"),
    ("GET", "/v1/batches/{batch_id}"): _rule(READ, OWN_BATCHES),
    ("DELETE", "/v1/batches/{batch_id}"): _rule(API, OWN_BATCHES),
    ("POST", "/v1/batches/{batch_id}/cancel"): _rule(API, OWN_BATCHES),
    ("GET", "/v1/messages/batches"): _rule(READ, OWN_BATCHES),
    ("POST", "/v1/messages/batches"): _rule(API, f"{ALLOWED_MODELS} (each request's); "
                                                 "nothing of other keys"),
    ("GET", "/v1/messages/batches/{message_batch_id}"): _rule(READ, OWN_BATCHES),
    ("DELETE", "/v1/messages/batches/{message_batch_id}"): _rule(API, OWN_BATCHES),
    ("POST", "/v1/messages/batches/{message_batch_id}/cancel"): _rule(API, OWN_BATCHES),
    ("GET", "/v1/messages/batches/{message_batch_id}/results"): _rule(READ, OWN_BATCHES),
    # Models and what happens to them.
    ("GET", "/v1/models"): _rule(READ, ALLOWED_MODELS),
    ("GET", "/v1/models/{model_id:path}"): _rule(READ, ALLOWED_MODELS + "; a failure's log "
                                                 "tail: a viewer or an admin"),
    ("GET", "/v1/models/{model_id:path}/logs"): _rule(
        "viewer admin", ALLOWED_MODELS + " (a log can quote any user's prompt)"),
    ("GET", "/v1/events"): _rule(READ, f"events of {ALLOWED_MODELS}; a user: its own "
                                       "requests, a failure without its log tail"),
    ("POST", "/v1/models/load"): _rule(ADMIN, "everything"),
    ("POST", "/v1/models/unload"): _rule(ADMIN, "everything"),
    ("POST", "/v1/models/adapters"): _rule(ADMIN, "everything (a folder inside adapter_roots)"),
    ("DELETE", "/v1/models/adapters/{name:path}"): _rule(ADMIN, "everything (registered "
                                                         "adapters only)"),
    ("POST", "/v1/config/reload"): _rule(ADMIN, "everything"),
    # Keys, usage, metrics.
    ("GET", "/v1/keys"): _rule(ADMIN, "every named key (never a secret)"),
    ("POST", "/v1/keys"): _rule(ADMIN, "the new key's secret, once"),
    ("DELETE", "/v1/keys/{name}"): _rule(ADMIN, "everything (the last admin key stays)"),
    ("GET", "/v1/usage"): _rule(READ, "a user: its own rows; a viewer or an admin: every "
                                      "key's"),
    ("GET", "/metrics"): _rule(READ, f"figures of {ALLOWED_MODELS}; per-key series: a user "
                                     "its own, a viewer or an admin every key's"),
    ("GET", "/v1/metrics"): _rule(READ, f"figures of {ALLOWED_MODELS}"),
}
"""Every route: (method, path template) → ``Rule``. ``HEAD`` follows ``GET``."""

ANY_KEY = _rule(READ, "nothing: the path or method does not exist (404, 405)")
"""A request that matches no route: any valid key learns that, a stranger does not."""
NO_ROW = Rule(frozenset(), "a route without a row in TABLE: refused to everyone")


def rows_of(route: BaseRoute, table: dict[tuple[str, str], Rule]) -> dict[str, Rule | None]:
    """The rows of ``route``, per method (``None``: a method without a row)."""
    if isinstance(route, Mount):
        return {"GET": table.get(("GET", route.path)), "HEAD": table.get(("GET", route.path))}
    if isinstance(route, Route):
        methods = route.methods or {"GET"}
        return {m: table.get(("GET" if m == "HEAD" else m, route.path)) for m in methods}
    return {"": None}  # a kind of route this table does not know (a WebSocket): refused


class AccessRules:
    """``TABLE`` compiled against the app's routes, as Starlette matches them: the first
    route that matches path and method fully decides, else the first that matches the path
    (a 405: ``ANY_KEY``), else none (a 404: ``ANY_KEY``)."""

    def __init__(self, routes: Sequence[BaseRoute],
                 table: dict[tuple[str, str], Rule] = TABLE) -> None:
        self.routes = [(route, rows_of(route, table)) for route in routes]
        # Static paths decided by their own route (no earlier route matches them): one
        # dict look-up for the hot endpoints.
        self.exact: dict[tuple[str, str], Rule] = {}
        for route, rows in self.routes:
            if isinstance(route, Route) and "{" not in route.path:
                for method, rule in rows.items():
                    if self._scan(method, route.path) is route:
                        self.exact.setdefault((method, route.path), rule or NO_ROW)

    def _scan(self, method: str, path: str) -> BaseRoute | None:
        scope: Scope = {"type": "http", "method": method, "path": path, "root_path": ""}
        for route, _ in self.routes:
            if route.matches(scope)[0] is Match.FULL:
                return route
        return None

    def rule_for(self, scope: Scope) -> Rule:
        """The rule for an HTTP request's scope, on the path Starlette routes it by (after
        a ``root_path``, as ``starlette._utils.get_route_path`` strips it)."""
        path: str = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root) and path != root and path[len(root)] == "/":
            path = path[len(root):]
        elif root and path == root:
            path = ""
        return self.rule(scope.get("method", "WEBSOCKET"), path)  # no route has that method

    def rule(self, method: str, path: str) -> Rule:
        """The rule for ``method`` on the concrete ``path``."""
        found = self.exact.get((method, path))
        if found is not None:
            return found
        scope: Scope = {"type": "http", "method": method, "path": path, "root_path": ""}
        for route, rows in self.routes:
            if route.matches(scope)[0] is Match.FULL:
                return rows.get(method if not isinstance(route, Mount) else "GET") or NO_ROW
        return ANY_KEY  # a 404, or a 405 (a route that matches the path only)

    def missing(self) -> list[str]:
        """Routes and methods without a row (the matrix test wants none)."""
        return [f"{method} {getattr(route, 'path', route)}" for route, rows in self.routes
                for method, rule in rows.items() if rule is None]


def markdown(rows: Iterable[tuple[tuple[str, str], Rule]] = TABLE.items()) -> str:
    """The table as Markdown (README and docs print this)."""
    lines = ["| route | anonymous | viewer | user | admin | sees of others |",
             "|---|---|---|---|---|---|"]
    for (method, path), rule in rows:
        marks = " | ".join("yes" if r in rule.roles else "" for r in ROLES)
        lines.append(f"| `{method} {path}` | {marks} | {rule.sees} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
