"""``/v1/keys``: named API keys over REST (admin keys only; ``admission.KEYS_PATH``).

``GET /v1/keys`` lists them (never a secret or digest), ``POST /v1/keys`` makes one and
answers its secret, once, as ``key``; ``DELETE /v1/keys/{name}`` revokes one (never the
last admin key: a 409). The router
takes a change at once; other routers on the same database within ``REFRESH`` seconds.
"""

from __future__ import annotations

import asyncio

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.access.admission import Keys
from router.access.key_store import KeyCreate, KeyExists, KeyStore, LastAdmin
from router.api.wire import JSONResponse, read_body
from router.errors import APIError, BadRequest


class KeysAPI:
    def __init__(self, store: KeyStore, keys: Keys, max_body_bytes: int) -> None:
        self.store = store
        self.keys = keys
        self.max_body_bytes = max_body_bytes
        self._lock = asyncio.Lock()
        """Reads and writes of the keys one at a time: a read begun before a revocation
        never lands after it (the revoked key would open again until the next read)."""

    def routes(self) -> list[Route]:
        # One route for both methods, so that a 405 lists them both in Allow.
        return [Route("/v1/keys", self.keys_route, methods=["GET", "POST"]),
                Route("/v1/keys/{name}", self.revoke, methods=["DELETE"])]

    async def keys_route(self, request: Request) -> Response:
        if request.method == "POST":
            return await self.create(request)
        return await self.list_keys(request)

    async def start(self) -> None:
        """At start: the preset keys' labels from the database's secret, and its keys."""
        self.keys.use_secret(await self.store.label_secret())
        await self.refresh()

    async def refresh(self) -> None:
        """The database's keys into the guard's (``Keys.set_named``)."""
        async with self._lock:
            self.keys.set_named(await self.store.active())

    async def list_keys(self, request: Request) -> Response:
        listed = [msgspec.to_builtins(k) for k in await self.store.listed()]
        return JSONResponse({"object": "list", "data": listed})

    async def create(self, request: Request) -> Response:
        body = await read_body(request, KeyCreate, self.max_body_bytes)
        if body.name.startswith("key-"):  # the preset's unnamed keys are called so
            raise BadRequest("a key's name may not start with 'key-'", param="name")
        try:
            made, secret = await self.store.create(body.name, body.role, body.spec())
        except ValueError as err:
            raise BadRequest(str(err), param="name") from None
        except KeyExists:
            raise APIError(f"a key named '{body.name}' exists (names of revoked keys stay "
                           "taken)", status=409, type="invalid_request_error",
                           param="name", code="key_exists") from None
        await self.refresh()
        return JSONResponse({**msgspec.to_builtins(made), "key": secret}, status_code=201)

    async def revoke(self, request: Request) -> Response:
        name = request.path_params["name"]
        try:
            revoked = await self.store.revoke(name, self.keys.preset_admins)
        except LastAdmin:
            raise APIError(f"'{name}' is the last admin key: make another admin key before "
                           "revoking it", status=409, type="invalid_request_error",
                           param="name", code="last_admin_key") from None
        if not revoked:
            raise APIError(f"no key named '{name}' (or it is revoked already)", status=404,
                           type="invalid_request_error", param="name", code="key_not_found")
        await self.refresh()
        return JSONResponse({"name": name, "revoked": True})
