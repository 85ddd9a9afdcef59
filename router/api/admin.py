"""modelyard's REST extensions and OpenAI's model list: ``/v1/models``, ``/v1/models/{id}``,
``/v1/models/load``, ``/v1/models/unload``, ``/v1/config/reload``, ``/health``
(liveness), ``/health/ready`` (readiness). No generation and no protocol
module's internals: those live in the protocol packages and the relay.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.access.admission import ANONYMOUS, Principal, principal_of
from router.api import codex_catalog
from router.api.events import first_line
from router.api.wire import JSONResponse, read_body
from router.errors import APIError, ModelNotFound, ModelUnavailable
from router.lifecycle.policy import idle
from router.lifecycle.reload import Reloader
from router.lifecycle.replica import link_of
from router.lifecycle.supervisor import Supervisor
from router.registry import ModelEntry
from shared.config import auto_tool_calls, serves_adapters


class ModelAction(msgspec.Struct, kw_only=True):
    model: str | Annotated[list[str], msgspec.Meta(min_length=1, max_length=64)]
    """One model, or several (answered as a list, in this order)."""
    wait: bool = True
    force: bool = False


class AdminAPI:
    def __init__(self, supervisor: Supervisor, max_body_bytes: int,
                 reloader: Reloader) -> None:
        self.supervisor = supervisor
        self.reloader = reloader
        self.registry = supervisor.registry
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/load", self.load, methods=["POST"]),
            Route("/v1/models/unload", self.unload, methods=["POST"]),
            Route("/v1/config/reload", self.reload, methods=["POST"]),
            Route("/v1/models/{model_id:path}", self.get_model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/health/ready", self.ready, methods=["GET"]),
        ]

    def model_object(self, entry: ModelEntry, principal: Principal) -> dict[str, Any]:
        """OpenAI's model object plus modelyard's fields (None values left out); for a key
        that is not an admin's, a failure's reason without its worker's log tail."""
        if entry.lora is not None:
            return self.adapter_object(entry, principal)
        now = time.monotonic()
        extra: dict[str, Any] = {
            "state": entry.state, "aliases": entry.spec.aliases,
            "engine": entry.spec.engine, "task": entry.spec.task,
            "device": entry.spec.device,
            "pid": entry.pid, "node": entry.node, "backend": entry.spec.backend,
            "in_flight": entry.leases, "queued": entry.queued,
            "ttl": idle.ttl(entry, self.supervisor.server), "failures": entry.failures,
            "loads": entry.loads, "evictions": entry.evictions,
            "parks": entry.parks or None, "wakes": entry.wakes or None,
            "parked_seconds": round(now - entry.parked_at, 3)
            if entry.state == "parked" else None,
            # Only while a worker holds it: the measure outlives the worker (the next
            # load's expected size, ``policy.park.expected_bytes``), the memory does not.
            "resident_mib": entry.resident_bytes // 2 ** 20 or None
            if self.supervisor.worker_of(entry) is not None and entry.state != "loading"
            else None,
            "keep_alive": entry.keep_alive, "pinned": entry.spec.pinned or None,
            "priority": entry.spec.priority or None,
            "max_model_len": entry.max_model_len, "load_seconds": entry.load_seconds,
            "load_phases": entry.load_phases or None,
            "loaded_at": int(entry.loaded_at) if entry.loaded_at else None,
            "idle_seconds": round(now - entry.last_used, 3) if entry.last_used else None,
            "placement": entry.placement or None, "exit_code": entry.exit_code,
            "sampling_defaults": msgspec.to_builtins(entry.spec.sampling_defaults) or None,
            "replicas": self.replica_objects(entry)
            if entry.spec.replicas.max > 1 else None,
            "tool_parser": entry.spec.tool_parser,
            "auto_tool_calls": auto_tool_calls(entry.spec),
            "error": entry.error if principal.sees_all or not entry.error
            else first_line(entry.error),
        }
        return {"id": entry.id, "object": "model", "created": self.created,
                "owned_by": entry.spec.owned_by,
                **{k: v for k, v in extra.items() if v is not None}}

    def replica_objects(self, entry: ModelEntry) -> list[dict[str, Any]]:
        """Each running replica of a model that may run several: where it runs, its state,
        its requests in flight and the share of its prompt tokens its cache served."""
        out = []
        for r in self.supervisor.replicas_of(entry):
            prompt = r.link.prompt_tokens
            out.append({"number": r.number, "pid": r.handle.pid, "node": r.handle.node,
                        **({"node_id": r.handle.node_id} if r.handle.node_id else {}),
                        "state": "parked" if r.parked else r.state,
                        "in_flight": r.link.in_flight, "completed": r.link.completed,
                        "placement": r.placement or None,
                        "cached_share": round(r.link.cached_tokens / prompt, 4)
                        if prompt else None})
        return out

    def adapter_object(self, entry: ModelEntry, principal: Principal) -> dict[str, Any]:
        """An adapter model as ``vllm serve`` lists one (``parent``: its base) with its
        ``state`` in its base's engine: ``resident`` (among the most recently used that
        fill the ``max_loras`` batch slots: vLLM 0.32 tells no more), ``cpu`` (loaded,
        further back in the engine's LRU), ``known`` (not loaded). Its folder only for an
        admin."""
        base = self.registry.serving(entry)
        loaded = base.adapters_loaded if base.state == "ready" else []
        numbers = [a.number for a in loaded]  # least recently used first
        assert entry.lora is not None
        state = "known"
        if entry.lora.number in numbers[-(base.spec.max_loras or 1):]:
            state = "resident"
        elif entry.lora.number in numbers:
            state = "cpu"
        mine = next((a for a in loaded if a.number == entry.lora.number), None)
        extra: dict[str, Any] = {
            "parent": base.id, "state": state, "aliases": entry.spec.aliases,
            "rank": entry.rank, "pinned": entry.spec.pinned or None,
            "adapter_loads": mine.loads if mine else None,
            "found": entry.found or None, "registered": entry.registered or None,
            "load_seconds": round(mine.load_seconds, 3) if mine else entry.load_seconds,
            "idle_seconds": round(time.monotonic() - entry.last_used, 3)
            if entry.last_used else None,
            "root": entry.lora.path if principal.admin else None,  # not a viewer's
        }
        if mine is not None:
            entry.load_seconds = extra["load_seconds"]  # kept for when it is unloaded
        return {"id": entry.id, "object": "model", "created": self.created,
                "owned_by": entry.spec.owned_by,
                **{k: v for k, v in extra.items() if v is not None}}

    async def _refresh_adapters(self, bases: list[ModelEntry]) -> None:
        """Ask each running base which adapters its engine holds (at most 2 s)."""
        async def ask(base: ModelEntry) -> None:
            link = link_of(base)
            if link is None:
                return
            try:
                base.adapters_loaded = await asyncio.wait_for(link.adapters(), 2)
            except (APIError, TimeoutError):
                pass  # busy or gone: the last answer stands

        await asyncio.gather(*(ask(b) for b in bases if b.state == "ready"
                               and serves_adapters(b.spec)))

    def _shown(self, principal: Principal) -> list[ModelEntry]:
        """The models ``principal`` may see, each base followed by its adapters."""
        shown: list[ModelEntry] = []
        for entry in self.registry:
            if _visible(entry, principal):
                shown.append(entry)
            shown += [a for a in self.registry.adapters_of(entry) if _visible(a, principal)]
        return shown

    async def list_models(self, request: Request) -> Response:
        """OpenAI's list; asked with Codex's ``client_version``, Codex's catalog of the
        same models beside it (``router.api.codex_catalog``)."""
        principal = principal_of(request.scope)
        shown = self._shown(principal)
        await self._refresh_adapters(list(self.registry))
        body: dict[str, Any] = {"object": "list",
                                "data": [self.model_object(e, principal) for e in shown]}
        if "client_version" in request.query_params:
            body["models"] = codex_catalog.catalog(shown)
        return JSONResponse(body)

    async def get_model(self, request: Request) -> Response:
        name = request.path_params["model_id"]
        entry = self.registry.entries.get(name) or self.registry.adapters.get(name)
        principal = principal_of(request.scope)
        if entry is None or not _visible(entry, principal):  # exact ids only
            raise ModelNotFound(f"The model '{name}' does not exist", param="model")
        if entry.lora is not None:
            await self._refresh_adapters([self.registry.serving(entry)])
            return JSONResponse(self.model_object(entry, principal))
        body = self.model_object(entry, principal)
        link = link_of(entry)
        if entry.state == "ready" and link is not None:
            try:  # the engine's own count: shows that cancelled requests really ended
                pong = await asyncio.wait_for(link.ping(), 2)
                body["worker_in_flight"] = pong.in_flight
            except (APIError, TimeoutError):
                pass  # worker busy or gone; the state field tells the rest
        return JSONResponse(body)

    def _entries(self, body: ModelAction) -> list[ModelEntry]:
        """Every named model, or a 404 before anything is done."""
        names = [body.model] if isinstance(body.model, str) else body.model
        return list({e.id: e for e in (self.registry.named(n)
                                       for n in names)}.values())

    def _answer(self, request: Request, body: ModelAction, entries: list[ModelEntry],
                status: int = 200) -> Response:
        principal = principal_of(request.scope)
        if isinstance(body.model, str):
            return JSONResponse(self.model_object(entries[0], principal), status_code=status)
        return JSONResponse({"object": "list",
                             "data": [self.model_object(e, principal) for e in entries]},
                            status_code=status)

    async def load(self, request: Request) -> Response:
        """Load one model or several, in order (each may evict the one before it when
        they do not fit together); ``"wait": false`` answers 202 at once."""
        body = await read_body(request, ModelAction, self.max_body_bytes)
        entries = self._entries(body)
        served = [self.registry.serving(e) for e in entries]  # an adapter's base
        if not body.wait and any(e.state != "ready" for e in served):
            for entry in served:
                if entry.state != "ready":
                    self.supervisor.start_loading(entry)
            return self._answer(request, body, entries, 202)
        for entry in entries:
            lease, link = await self.supervisor.acquire(entry.id)
            try:
                if entry.lora is not None:  # into its running base's engines
                    for each in self.supervisor.links_of(lease.entry) or [link]:
                        lease.entry.adapters_loaded = await each.adapters([entry.lora])
            finally:
                lease.release()
        return self._answer(request, body, entries)

    async def unload(self, request: Request) -> Response:
        """Stop models; an adapter leaves its base's engine (the base serves on)."""
        body = await read_body(request, ModelAction, self.max_body_bytes)
        entries = self._entries(body)
        await asyncio.gather(*(self._unload_adapter(e) if e.lora is not None
                               else self.supervisor.stop(e, force=body.force)
                               for e in entries))
        return self._answer(request, body, entries)

    async def _unload_adapter(self, adapter: ModelEntry) -> None:
        base = self.registry.serving(adapter)
        if adapter.lora is not None:
            for link in self.supervisor.links_of(base):
                base.adapters_loaded = await link.adapters(unload=[adapter.lora.number])

    async def reload(self, request: Request) -> Response:
        """Read the preset file again and apply it (``router/lifecycle/reload.py``); a file that does
        not load is a 400 naming file, model and key, and nothing changes."""
        return JSONResponse(await self.reloader.reload("POST /v1/config/reload"))

    async def health(self, request: Request) -> Response:
        """Liveness. Without a key (where keys are required) only ``status``: model ids
        and process ids are for those who hold one."""
        principal = principal_of(request.scope)
        if principal is ANONYMOUS:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok",
                             "models": {e.id: e.state for e in self.registry
                                        if _visible(e, principal)},
                             "spares": self.supervisor.spares.describe(),
                             "zygote": self.supervisor.spares.describe_zygote(),
                             "tasks": len(asyncio.all_tasks())})

    async def ready(self, request: Request) -> Response:
        """Readiness: 200 once every start-up model (``load_on_startup``, ``preload``) has
        loaded, else a 503 (naming the ones that have not, for a request with a key). One
        stopped on purpose since (ttl, eviction, unload) still counts: the next request
        loads it. One that crashed or failed to start does not; the supervisor starts it
        again itself. A pure read: a probe starts nothing."""
        models: dict[str, str] = {}
        waiting: list[str] = []
        principal = principal_of(request.scope)
        for entry in self.supervisor.startup_models():
            if not _visible(entry, principal):  # counted, never named
                waiting += [] if _started(entry) else ["a model"]
                continue
            models[entry.id] = entry.state
            if not _started(entry):
                waiting.append(f"{entry.id} ({entry.state})")
        shown = {} if principal is ANONYMOUS else {"models": models}
        if not waiting:
            return JSONResponse({"ready": True, **shown})
        err = ModelUnavailable("not ready: start-up model(s) " + ", ".join(waiting)
                               if shown else "not ready: start-up models are loading",
                               code="not_ready")
        return JSONResponse({**err.body(), "ready": False, **shown},
                            status_code=503, headers={"Retry-After": "1"})


def _started(entry: ModelEntry) -> bool:
    """A start-up model that has loaded (one stopped on purpose since counts)."""
    return entry.state in ("ready", "sleeping", "parking", "parked", "waking") or (
        entry.state in ("unloaded", "stopping") and entry.loads > 0)


def _visible(entry: ModelEntry, principal: Principal) -> bool:
    """A key limited to some models sees only those."""
    return principal.limits.allows(entry.names)
