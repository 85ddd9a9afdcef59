"""LoRA adapters registered at run time: ``POST /v1/models/adapters`` makes the adapter
folder at a path a model its base serves, ``DELETE /v1/models/adapters/{name}`` drops one
made so (admin keys only: ``router.access.rules``).

A path is taken only inside the server's ``adapter_roots`` or a base's ``adapters_dir``,
links followed (so no ``..`` or link leads out); with none set, every registration is
refused. The folder is checked before it is accepted: a LoRA with weights, its rank
within the base's ``max_lora_rank``, pinned adapters fewer than the base's ``max_cpu_loras``;
a running base loads it at once, so its worker's check of the tensors against the model
answers the request. A reload keeps registered adapters while their base serves them
(``ModelRegistry.reconfigure``); a restart forgets them.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.access.admission import principal_of
from router.api.admin import AdminAPI
from router.api.wire import JSONResponse, read_body
from router.errors import APIError, BadRequest
from shared.adapters import AdapterError, AdapterInfo, read_adapter, within

log = logging.getLogger("modelyard.router")

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class AdapterRegistration(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/models/adapters``: the model ``name`` (any case unlike every other
    model's names) that base ``base`` (an exact id) serves with the adapter at ``path``."""

    name: Name
    base: str
    path: str
    """An absolute path to the adapter's folder (peft's ``save_pretrained``)."""
    aliases: Annotated[list[Name], msgspec.Meta(max_length=64)] = []
    pinned: bool = False


class AdapterAPI:
    def __init__(self, admin: AdminAPI) -> None:
        self.admin = admin
        self.supervisor = admin.supervisor
        self.registry = admin.registry

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models/adapters", self.register, methods=["POST"]),
            Route("/v1/models/adapters/{name:path}", self.remove, methods=["DELETE"]),
        ]

    def roots(self) -> list[str]:
        """Where a registered adapter may lie: ``adapter_roots`` and every ``adapters_dir``."""
        return [*self.supervisor.server.adapter_roots,
                *(e.spec.adapters_dir for e in self.registry if e.spec.adapters_dir)]

    async def register(self, request: Request) -> Response:
        """Check the adapter and register it (201 with its model object); a running base
        loads it first, and its worker's refusal is the answer (nothing is kept)."""
        body = await read_body(request, AdapterRegistration, self.admin.max_body_bytes)
        self.registry.check_adapter(body.name, body.base, body.aliases, body.pinned)
        path, info = await asyncio.to_thread(_folder, body, self.roots())
        entry = self.registry.register(body.name, body.base, path, body.aliases,
                                       body.pinned, info.rank)  # checked again: we awaited
        base = self.registry.serving(entry)
        if entry.lora is not None:
            try:
                for link in self.admin.supervisor.links_of(base):  # each replica's engine
                    base.adapters_loaded = await link.adapters([entry.lora])
            except APIError:
                self.registry.drop(entry)
                raise
        log.info("adapter %s registered: %s on %s (rank %d%s)", entry.id, path, base.id,
                 info.rank, ", pinned" if body.pinned else "")
        return JSONResponse(self.admin.adapter_object(entry, principal_of(request.scope)),
                            status_code=201)

    async def remove(self, request: Request) -> Response:
        """Drop a registered adapter (OpenAI's model deletion answer); a running base
        unloads it."""
        entry = self.registry.unregister(request.path_params["name"])
        base = self.registry.serving(entry)
        if entry.lora is not None:
            try:
                for link in self.admin.supervisor.links_of(base):  # each replica's engine
                    base.adapters_loaded = await link.adapters(unload=[entry.lora.number])
            except APIError as err:
                # Its number is never used again, so at worst the engine's LRU holds an
                # adapter nobody can name until the base restarts.
                log.warning("adapter %s: not unloaded from %s: %s", entry.id, base.id,
                            err.message)
        log.info("adapter %s removed", entry.id)
        return JSONResponse({"id": entry.id, "object": "model", "deleted": True})


def _folder(body: AdapterRegistration, roots: list[str]) -> tuple[str, AdapterInfo]:
    """``body.path`` resolved (links followed) and read, if it lies inside ``roots``; else
    a 400 naming the adapter and the reason. Blocking: file system calls."""
    where = f"adapter '{body.name}'"
    if not Path(body.path).is_absolute():
        raise BadRequest(f"{where}: path '{body.path}' is not absolute", param="path",
                         code="adapter_invalid")
    try:
        real = Path(body.path).resolve()
    except (ValueError, RuntimeError, OSError) as err:  # a NUL byte; a loop of links
        raise BadRequest(f"{where}: path '{body.path}' names no folder: {err}",
                         param="path", code="adapter_invalid") from None
    if not roots or not within(real, roots):
        raise BadRequest(f"{where}: path outside the allowed roots (adapter_roots"
                         + (", or a base's adapters_dir)" if roots else
                            ": none is set, so no adapter can be registered)"),
                         param="path", code="adapter_path_not_allowed")
    try:
        return str(real), read_adapter(real)
    except AdapterError as err:
        raise BadRequest(f"{where}: {err}", param="path", code="adapter_invalid") from None
