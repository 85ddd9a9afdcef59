"""The access table (``router.access.rules.TABLE``) as a matrix over the app's real route table:
every route and method × every kind of caller × every state of the keys, in-process
(httpx's ASGI transport; synthetic models, never started: admission decides before a
model is touched). What the matrix states, in words:

- a route without a row fails here (and is refused to everyone at run time);
- a caller the row admits is never answered 401 or 403; one it leaves out gets 401 (no
  valid key: none, a wrong one, a revoked one) or 403 (a role the row leaves out);
- no change of keys, config or database state ever widens access: once keys are
  required, revoking the last named key, a reload that drops the preset's keys, or a
  database that stops answering leaves every keyless cell a 401;
- no response a key can read names a model outside its globs or another key.

Findings of issue 26 reproduced here (each fails on 96966e8): 1 (revoking the last named
key opened the server to a keyless admin), 2 (a reload without keys turned them off),
4 (``/metrics`` showed every key to a user key), 11 (a limited key learnt other models
from a 404, ``/health``, a background create and ``/logs``), 12 (preset user keys were
admins beside named admin keys).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.routing import Mount, Route

from router.access.database import Database, DatabaseUnavailable
from router.access.key_store import SCHEMA as KEY_TABLES
from router.access.key_store import KeySpec, KeyStore
from router.access.rules import ROLES, TABLE, AccessRules, markdown
from router.app import build_app
from shared.preset_loader import load_preset
from tests.conftest import running_router

PRESET_USER, PRESET_ADMIN = "k-preset-user-51c", "k-preset-admin-9ad"
PRESET = """
server:
  host: 127.0.0.1
  port: 1
  spare_workers: 0
  auth_failures_per_minute: 0  # wrong keys on purpose, many
  database_url: sqlite:///{db}
{keys}
models:
  m: {{model: /synthetic, engine: synthetic}}
  secret-model: {{model: /synthetic, engine: synthetic, aliases: [hidden]}}
"""
WHO = ("none", "wrong", "revoked", "viewer", "limited", "user", "admin")
"""The callers: no key, a key nobody made, a revoked named key, then one key per role (a
user limited to model ``m`` too)."""


@dataclass
class Server:
    """An app in its lifespan, and the secret of each kind of caller it knows."""

    app: Any
    keys: dict[str, str | None] = field(default_factory=dict)
    store: KeyStore | None = None

    async def ask(self, method: str, path: str, key: str | None,
                  body: bytes | None = None) -> httpx.Response:
        transport = httpx.ASGITransport(app=self.app, client=("10.9.9.9", 5000))
        headers = {"authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, headers=headers, content=body)


def preset_text(db: Path, user: bool, admin: bool) -> str:
    keys = ([f"  api_keys: [{PRESET_USER}]"] if user else []) + (
        [f"  admin_api_keys: [{PRESET_ADMIN}]"] if admin else [])
    return PRESET.format(db=db, keys="\n".join(keys))


@contextlib.asynccontextmanager
async def serving(tmp: Path, *, preset_user: bool, preset_admin: bool,
                  named: tuple[str, ...] = ()) -> AsyncIterator[Server]:
    """An app with the preset's keys asked for and the named keys ``named`` (of ``admin``,
    ``user``, ``limited``, ``viewer``, ``revoked``) in its database before it starts."""
    db = tmp / "modelyard.db"
    path = tmp / "preset.yaml"
    path.write_text(preset_text(db, preset_user, preset_admin))
    server = Server(app=None)
    server.keys = dict.fromkeys(WHO)
    server.keys["wrong"] = "my-nobody-made-this-key"
    if preset_user:
        server.keys["user"] = PRESET_USER
    if preset_admin:
        server.keys["admin"] = PRESET_ADMIN
    database = Database(f"sqlite:///{db}", KEY_TABLES)
    store = KeyStore(database)
    roles = {"admin": "admin", "user": "user", "limited": "user", "viewer": "viewer",
             "revoked": "user"}
    for who in named:
        spec = KeySpec(models=["m"]) if who == "limited" else KeySpec()
        _, secret = await store.create(f"named-{who}", roles[who], spec)
        server.keys[who] = secret
        if who == "revoked":
            await store.revoke("named-revoked")
    database.close()
    server.app = build_app(load_preset(str(path)))
    async with server.app.router.lifespan_context(server.app):
        yield server


def concrete(path: str) -> str:
    """A request path for a route's template (a stored response nobody made, model m)."""
    path = path.replace("{model_id:path}", "m").replace("{response_id}", "resp_nobody")
    return path.replace("{name:path}", "named-nobody").replace("{name}", "named-nobody")


def cells(app: Any) -> list[tuple[str, str, str]]:
    """Every (method, request path, route path) of the app's real route table."""
    out = []
    for route in app.routes:
        if isinstance(route, Mount):
            out.append(("GET", route.path + "/index.js", route.path))
        elif isinstance(route, Route):
            for method in sorted(route.methods or ()):
                if method != "HEAD":
                    out.append((method, concrete(route.path), route.path))
    return out


def expected(role_of: str | None, method: str, template: str, required: bool) -> set[int]:
    """The statuses admission may answer: ``{0}`` stands for "past admission" (anything
    but 401 and 403)."""
    rule = TABLE[(method, template)]
    if not required:
        return {0}
    role = role_of or "anonymous"
    if rule.allows(role):
        return {0}
    return {401} if role_of is None else {403}


async def check_matrix(server: Server, role_of: dict[str, str | None], required: bool,
                       state: str) -> list[str]:
    """Every cell against ``expected``; the cells that disagree, described."""
    wrong = []
    for method, path, template in cells(server.app):
        body = b"{" if method in ("POST", "DELETE") else None  # 400 once admitted
        for who in WHO:
            key = server.keys[who]
            if key is None:
                continue  # no such caller in this state
            got = (await server.ask(method, path, key, body)).status_code
            want = expected(role_of[who], method, template, required)
            seen = got if got in (401, 403) else 0
            if seen not in want:
                wrong.append(f"{state}: {who} {method} {path}: {got}, want {want}")
    return wrong


ROLE_OF: dict[str, str | None] = {"none": None, "wrong": None, "revoked": None,
                                  "viewer": "viewer", "limited": "user", "user": "user",
                                  "admin": "admin"}


def test_every_route_has_a_row_and_the_table_keeps_its_promises(tmp_path: Path) -> None:
    async def go() -> None:
        async with serving(tmp_path, preset_user=False, preset_admin=True) as server:
            rules = AccessRules(server.app.routes)
            assert rules.missing() == []
            templates = {(m, p) for m, _, p in cells(server.app)}
            assert set(TABLE) == templates, "rows for routes that do not exist"
            # A route added without a row is refused to everyone, the admin too.
            extra = AccessRules([*server.app.routes, Route("/v1/new", lambda r: None)])
            assert sorted(extra.missing()) == ["GET /v1/new", "HEAD /v1/new"]
            assert not extra.rule("GET", "/v1/new").roles
            # Starlette routes by the path after a root path: so does the table.
            mounted = {"type": "http", "method": "POST", "path": "/api/v1/models/load",
                       "root_path": "/api"}
            assert rules.rule_for(mounted).roles == {"admin"}
    asyncio.run(go())
    # What the table must say whatever else changes in it.
    for (method, path), rule in TABLE.items():
        if "anonymous" in rule.roles:
            assert path in ("/", "/static", "/health", "/health/ready"), path
        if path.startswith(("/v1/keys", "/v1/config", "/v1/models/load",
                            "/v1/models/unload")):
            assert rule.roles == {"admin"}, path
        if method != "GET":
            assert "viewer" not in rule.roles, (method, path)
        assert rule.roles <= set(ROLES) and "admin" in rule.roles, path


STATES: dict[str, dict[str, Any]] = {
    "open": {"preset_user": False, "preset_admin": False},
    "preset keys only": {"preset_user": True, "preset_admin": True},
    "named keys only": {"preset_user": False, "preset_admin": False,
                        "named": ("admin", "user", "limited", "viewer", "revoked")},
    "both": {"preset_user": True, "preset_admin": True,
             "named": ("user", "limited", "viewer", "revoked")},
}


@pytest.mark.parametrize("state", list(STATES))
def test_the_matrix(state: str, tmp_path: Path) -> None:
    async def go() -> list[str]:
        async with serving(tmp_path, **STATES[state]) as server:
            return await check_matrix(server, ROLE_OF, state != "open", state)
    assert asyncio.run(go()) == []


def test_revoking_the_last_named_key_never_opens_the_server(tmp_path: Path) -> None:
    """Finding 1: root, the only key, revoked itself; then a keyless request made an
    admin key. Now the last admin key cannot be revoked (409), and once every other
    named key is revoked keys stay required."""
    async def go() -> list[str]:
        async with serving(tmp_path, preset_user=False, preset_admin=False,
                           named=("admin", "user")) as server:
            root, user = server.keys["admin"], server.keys["user"]
            refused = await server.ask("DELETE", "/v1/keys/named-admin", root)
            assert refused.status_code == 409, refused.text
            assert refused.json()["error"]["code"] == "last_admin_key"
            assert (await server.ask("GET", "/v1/models", root)).status_code == 200
            gone = await server.ask("DELETE", "/v1/keys/named-user", root)
            assert gone.status_code == 200, gone.text
            assert (await server.ask("GET", "/v1/models", user)).status_code == 401
            made = await server.ask("POST", "/v1/keys", None,
                                    b'{"name": "mallory", "role": "admin"}')
            assert made.status_code == 401, made.text
            server.keys = {**dict.fromkeys(WHO), "wrong": "my-wrong", "revoked": user,
                           "admin": root}
            wrong = await check_matrix(server, ROLE_OF, True, "last named key revoked")
            # Behind the router's back (another router, SQL by hand): no key is left.
            await server.app.state.keys_api.store.db.run(lambda conn: conn.execute(
                "UPDATE api_keys SET revoked = 1"))
            await server.app.state.keys_api.refresh()
            server.keys.update(admin=None, revoked=root)
            return wrong + await check_matrix(server, ROLE_OF, True, "no key left")
    assert asyncio.run(go()) == []


def test_with_a_preset_admin_the_last_named_key_goes_and_keys_stay_required(
        tmp_path: Path) -> None:
    async def go() -> list[str]:
        async with serving(tmp_path, preset_user=False, preset_admin=True,
                           named=("admin", "viewer")) as server:
            for name in ("named-admin", "named-viewer"):
                done = await server.ask("DELETE", f"/v1/keys/{name}", PRESET_ADMIN)
                assert done.status_code == 200, done.text
            server.keys = {**dict.fromkeys(WHO), "wrong": "my-wrong",
                           "revoked": server.keys["viewer"], "admin": PRESET_ADMIN}
            return await check_matrix(server, ROLE_OF, True, "every named key revoked")
    assert asyncio.run(go()) == []


def reload(server: Server, tmp: Path, *, user: bool, admin: bool) -> Callable[[], Any]:
    async def go() -> httpx.Response:
        (tmp / "preset.yaml").write_text(preset_text(tmp / "modelyard.db", user, admin))
        key = server.keys["admin"]
        return await server.ask("POST", "/v1/config/reload", key)
    return go


def test_a_reload_that_drops_the_preset_keys_keeps_keys_required(tmp_path: Path) -> None:
    """Finding 2: a reload without ``api_keys`` answered ``applied: ['api_keys']`` and a
    keyless ``POST /v1/keys`` made an admin. Now, with a named admin left, the dropped
    keys open nothing at once and keys stay required; with none left the reload is
    refused (400) and nothing changes."""
    async def go() -> list[str]:
        async with serving(tmp_path, preset_user=True, preset_admin=True) as server:
            refused = await reload(server, tmp_path, user=False, admin=False)()
            assert refused.status_code == 400, refused.text
            assert (await server.ask("GET", "/v1/keys", PRESET_ADMIN)).status_code == 200
        async with serving(tmp_path, preset_user=True, preset_admin=True,
                           named=("admin", "viewer")) as server:
            answer = await reload(server, tmp_path, user=False, admin=False)()
            assert answer.status_code == 200, answer.text
            assert "api_keys" in answer.json()["applied"]
            made = await server.ask("POST", "/v1/keys", None,
                                    b'{"name": "mallory", "role": "admin"}')
            assert made.status_code == 401, made.text
            for dropped in (PRESET_USER, PRESET_ADMIN):
                assert (await server.ask("GET", "/v1/models", dropped)).status_code == 401
            server.keys.update(user=None, wrong=PRESET_USER, revoked=PRESET_ADMIN)
            return await check_matrix(server, ROLE_OF, True, "reload dropped the preset keys")
    assert asyncio.run(go()) == []


def test_a_reload_that_adds_an_admin_key_demotes_plain_keys_for_good(tmp_path: Path) -> None:
    """Finding 12's cousin: a preset's plain keys are its admins only while no admin key
    exists; once one has (a reload adding one here), dropping it again never promotes
    them back while the router runs."""
    async def go() -> list[str]:
        async with serving(tmp_path, preset_user=True, preset_admin=False) as server:
            server.keys["admin"] = PRESET_USER  # one user: it is the admin
            assert (await server.ask("GET", "/v1/keys", PRESET_USER)).status_code == 200
            answer = await reload(server, tmp_path, user=True, admin=True)()
            assert answer.status_code == 200, answer.text
            server.keys.update(admin=PRESET_ADMIN, user=PRESET_USER)
            wrong = await check_matrix(server, ROLE_OF, True, "reload added an admin key")
            # Dropping the admin key again would leave none: refused, nothing changes.
            assert (await reload(server, tmp_path, user=True, admin=False)()).status_code == 400
            assert (await server.ask("GET", "/v1/keys", PRESET_USER)).status_code == 403
            assert (await server.ask("GET", "/v1/keys", PRESET_ADMIN)).status_code == 200
            return wrong
    assert asyncio.run(go()) == []


def test_preset_plain_keys_are_users_beside_a_named_admin(tmp_path: Path) -> None:
    """Finding 12: with no ``admin_api_keys``, a preset key made an admin key although a
    named admin key existed."""
    async def go() -> None:
        async with serving(tmp_path, preset_user=True, preset_admin=False,
                           named=("admin",)) as server:
            made = await server.ask("POST", "/v1/keys", PRESET_USER,
                                    b'{"name": "sneaky", "role": "admin"}')
            assert made.status_code == 403, made.text
    asyncio.run(go())


def test_a_database_that_stops_answering_widens_nothing(tmp_path: Path) -> None:
    """The store away: the keys' refresh fails and what was known stays (never more)."""
    async def go() -> list[str]:
        async with serving(tmp_path, preset_user=True, preset_admin=True,
                           named=("user", "limited", "viewer", "revoked")) as server:
            async def away(work: Any) -> Any:
                raise DatabaseUnavailable("the database is away")
            database = server.app.state.keys_api.store.db
            database.run = away  # every statement fails from here on
            with contextlib.suppress(Exception):
                await server.app.state.keys_api.refresh()
            wrong = await check_matrix(server, ROLE_OF, True, "database away")
            server.app.state.keys.set_named(())  # past key_store.STALE_MAX: dropped
            named = {who: server.keys[who] for who in ("limited", "viewer")}
            server.keys.update(limited=None, viewer=None, user=PRESET_USER,
                               revoked=named["viewer"], wrong=named["limited"])
            return wrong + await check_matrix(server, ROLE_OF, True, "database away long")
    assert asyncio.run(go()) == []


def test_a_limited_key_learns_nothing_of_other_models_or_keys(tmp_path: Path) -> None:
    """Finding 11 (the 404 listed every id, ``/health`` every model, a background create
    named the model it resolved to, a viewer limited to ``m`` read another model's log)
    and finding 4 (``/metrics`` carried every key's series to a user key)."""
    async def go() -> None:
        async with serving(tmp_path, preset_user=True, preset_admin=True,
                           named=("user", "limited", "viewer")) as server:
            limited, user = server.keys["limited"], server.keys["user"]
            # Another key's traffic, so that there is something to leak.
            for model in (b"m", b"secret-model"):  # served: counted per key and model
                done = await server.ask("POST", "/v1/chat/completions", PRESET_USER,
                                        b'{"model": "%s", "max_tokens": 2, "messages": '
                                        b'[{"role": "user", "content": "hi"}]}' % model)
                assert done.status_code == 200, done.text
            await server.ask("POST", "/v1/chat/completions", user, b'{"model": "nope"}')
            unknown = await server.ask("POST", "/v1/chat/completions", limited,
                                       b'{"model": "nope", "messages": '
                                       b'[{"role": "user", "content": "hi"}]}')
            assert unknown.status_code == 404, unknown.text
            assert "Available: m" in unknown.text and "secret" not in unknown.text
            background = await server.ask(
                "POST", "/v1/responses", limited,
                b'{"model": "secr", "input": "hi", "background": true}')
            assert background.status_code == 404 and "secret-model" not in background.text
            viewer_limited = await limited_viewer(server)
            for key in (limited, viewer_limited):
                logs = await server.ask("GET", "/v1/models/secret-model/logs", key)
                assert logs.status_code in (403, 404), logs.text
            for method, path, _ in cells(server.app):
                if method != "GET" or path.startswith("/static"):
                    continue
                for key in (limited, viewer_limited):
                    text = (await server.ask(method, path, key)).text
                    assert not re.search(r"secret-model|hidden", text), (path, text[:300])
                text = (await server.ask(method, path, user)).text
                label = server.app.state.keys.preset[key_digest(PRESET_USER)].name
                assert label not in text and "named-limited" not in text, (path, text[:300])
    asyncio.run(go())


def key_digest(key: str) -> bytes:
    from router.access.key_store import key_digest as digest
    return digest(key.encode())


async def limited_viewer(server: Server) -> str:
    made = await server.ask("POST", "/v1/keys", PRESET_ADMIN,
                            b'{"name": "dash-m", "role": "viewer", "models": ["m"]}')
    assert made.status_code == 201, made.text
    secret: str = made.json()["key"]
    return secret


def test_preset_key_labels_are_keyed_and_stable(tmp_path: Path) -> None:
    """Finding 4: a preset key's label was 12 hex of its unsalted SHA-256, so an offline
    dictionary guess matched it. Now it is an HMAC under the database's secret: the
    same across restarts, and not the SHA-256's."""
    import hashlib

    async def label() -> str:
        async with serving(tmp_path, preset_user=True, preset_admin=True) as server:
            name: str = server.app.state.keys.preset[key_digest(PRESET_USER)].name
            return name

    first, again = asyncio.run(label()), asyncio.run(label())
    assert first == again and first.startswith("key-")
    assert first != "key-" + hashlib.sha256(PRESET_USER.encode()).hexdigest()[:12]


def test_the_security_page_prints_the_table_as_it_is() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    shown = page.split("<!-- access-table:start -->\n", 1)[1].split(
        "\n<!-- access-table:end -->", 1)[0]
    assert shown == markdown(), "docs/security.md's role table: paste `python -m router.access`"


# -- what a hostile review of the first version found ---------------------------------

def test_a_limited_key_cannot_tell_hidden_names_from_unknown_ones(tmp_path: Path) -> None:
    """A name matching two hidden models answered 'ambiguous: it matches <both ids>', a
    hidden default answered with its id, and a hidden model's substring answered
    differently from a name matching nothing: enough to enumerate them."""
    async def go() -> None:
        async with serving(tmp_path, preset_user=False, preset_admin=True,
                           named=("limited",)) as server:
            limited = server.keys["limited"]
            answers = {}
            for name in ("zzz", "secret", "SECRET-MODEL", "hid", "e", None):
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
                if name is not None:
                    body["model"] = name
                got = await server.ask("POST", "/v1/chat/completions", limited,
                                       json.dumps(body).encode())
                answers[name] = (got.status_code, got.json()["error"]["message"].replace(
                    f"'{name}'", "'NAME'"))
            assert answers.pop(None)[0] == 404
            assert len(set(answers.values())) == 1, answers
            assert answers["zzz"] == (404, "The model 'NAME' does not exist. Available: m")
    asyncio.run(go())


def test_two_admins_revoking_each_other_at_once_leave_one(tmp_path: Path) -> None:
    async def go() -> None:
        async with serving(tmp_path, preset_user=False, preset_admin=False,
                           named=("admin",)) as server:
            other = await server.ask("POST", "/v1/keys", server.keys["admin"],
                                     b'{"name": "named-admin2", "role": "admin"}')
            assert other.status_code == 201, other.text
            both = await asyncio.gather(
                server.ask("DELETE", "/v1/keys/named-admin2", server.keys["admin"]),
                server.ask("DELETE", "/v1/keys/named-admin", other.json()["key"]))
            assert sorted(r.status_code for r in both) in ([200, 401], [200, 409]), \
                [r.text for r in both]
            listed = await server.app.state.keys_api.store.listed()
            assert [k.name for k in listed if k.role == "admin" and not k.revoked]
    asyncio.run(go())


def test_a_reload_that_would_leave_no_admin_key_is_refused(tmp_path: Path) -> None:
    async def go() -> None:
        async with serving(tmp_path, preset_user=True, preset_admin=True,
                           named=("admin",)) as server:
            gone = await server.ask("DELETE", "/v1/keys/named-admin", PRESET_ADMIN)
            assert gone.status_code == 200, gone.text
            server.keys["admin"] = PRESET_ADMIN
            refused = await reload(server, tmp_path, user=True, admin=False)()
            assert refused.status_code == 400, refused.text
            assert "no admin key" in refused.json()["error"]["message"]
            assert (await server.ask("GET", "/v1/keys", PRESET_ADMIN)).status_code == 200
    asyncio.run(go())


def test_a_key_row_edited_by_hand_shuts_only_itself(tmp_path: Path) -> None:
    """One row whose limits did not decode made every refresh fail: a key revoked at the
    same time kept working (and past STALE_MAX every named key, admins too, stopped)."""
    async def go() -> None:
        async with serving(tmp_path, preset_user=False, preset_admin=True,
                           named=("user", "limited", "viewer")) as server:
            def edit(conn: Any) -> None:
                conn.execute("UPDATE api_keys SET spec = ? WHERE name = 'named-limited'",
                             ('{"models": "m"}',))
                conn.execute("UPDATE api_keys SET role = 'Admin' WHERE name = 'named-viewer'")
                conn.execute("UPDATE api_keys SET revoked = 1 WHERE name = 'named-user'")
            await server.app.state.keys_api.store.db.run(edit)
            await server.app.state.keys_api.refresh()
            for who in ("user", "limited", "viewer"):
                got = await server.ask("GET", "/v1/models", server.keys[who])
                assert got.status_code == 401, (who, got.text)
            assert (await server.ask("GET", "/v1/keys", PRESET_ADMIN)).status_code == 200
    asyncio.run(go())


def test_strangers_never_share_a_rate_limit_bucket(tmp_path: Path) -> None:
    async def go() -> list[int]:
        async with serving(tmp_path, preset_user=False, preset_admin=True) as server:
            server.app.state.supervisor.server.rate_limit_per_minute = 3
            statuses = []
            for n in range(5):
                transport = httpx.ASGITransport(app=server.app, client=(f"10.0.0.{n}", 1))
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                    statuses.append((await c.get("/health")).status_code)
                    statuses.append((await c.get("/static/status.js")).status_code)
            return statuses
    assert asyncio.run(go()) == [200] * 10


REVOKE_PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  admin_api_keys: [k-access-admin-0c1]
models:
  m: {model: /synthetic, engine: synthetic}
"""


@pytest.mark.integration
def test_a_revoked_keys_open_streams_end(tmp_path: Path) -> None:
    """A viewer's ``/v1/events`` stream (and its log follow) went on after the key was
    revoked, carrying every key's requests."""
    with running_router(REVOKE_PRESET, tmp_path, "revoke") as r:
        admin = {"authorization": "Bearer k-access-admin-0c1"}
        made = r.client.post(f"{r.url}/v1/keys", json={"name": "dash", "role": "viewer"},
                             headers=admin)
        assert made.status_code == 201, made.text
        viewer = {"authorization": f"Bearer {made.json()['key']}",
                  "accept": "text/event-stream"}
        with httpx.Client(timeout=30) as client:
            streams = [client.stream("GET", f"{r.url}{path}", headers=viewer)
                       for path in ("/v1/events", "/v1/models/m/logs?follow=1")]
            opened = [s.__enter__() for s in streams]
            try:
                assert [o.status_code for o in opened] == [200, 200]
                revoked = r.client.delete(f"{r.url}/v1/keys/dash", headers=admin)
                assert revoked.status_code == 200, revoked.text
                deadline = time.monotonic() + 10
                for response in opened:  # each ends by itself; keep-alives come meanwhile
                    for _ in response.iter_raw():
                        assert time.monotonic() < deadline, "the revoked key's stream goes on"
            finally:
                for s in streams:
                    s.__exit__(None, None, None)


def test_the_cli_never_revokes_the_last_named_admin_key(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """Whatever preset it is given (its admin keys need not be the routers' own)."""
    from router.cli import main

    async def make() -> None:
        async with serving(tmp_path, preset_user=False, preset_admin=True,
                           named=("admin", "user")):
            pass
    asyncio.run(make())
    url = f"sqlite:///{tmp_path / 'modelyard.db'}"
    config = str(tmp_path / "preset.yaml")  # it has an admin key: not counted
    assert main(["keys", "-c", config, "--database-url", url, "revoke", "named-user"]) == 0
    assert main(["keys", "-c", config, "--database-url", url, "revoke", "named-admin"]) == 1
    assert "last admin key" in capsys.readouterr().err
