"""``build_app``: the one factory that wires registry, supervisor and protocol modules."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.types import ASGIApp

from router.access.admission import Keys
from router.access.database import Database, default_url
from router.access.key_store import SCHEMA as KEY_TABLES
from router.access.key_store import KeyStore
from router.access.key_store import follow as follow_keys
from router.access.ledger import SCHEMA as LEDGER_TABLES
from router.access.ledger import Ledger
from router.access.limits import middleware_stack
from router.access.rules import AccessRules
from router.api.adapters import AdapterAPI
from router.api.admin import AdminAPI
from router.api.anthropic import AnthropicAPI
from router.api.batches.message_batches import AnthropicShape, MessageBatches
from router.api.batches.openai_files import FilesAndBatches, OpenAIShape
from router.api.events import EventsAPI
from router.api.hotpath import HotPath
from router.api.keys import KeysAPI
from router.api.metrics import MetricsAPI
from router.api.openai import OpenAIAPI
from router.api.openapi import OpenAPIDocument
from router.api.relay import Relay
from router.api.responses import ResponsesAPI
from router.api.responses.store import ResponseStore
from router.api.scoring import ScoringAPI
from router.api.status import StatusPage
from router.api.usage import UsageAPI
from router.api.wire import api_error_handler, http_error_handler, server_error_handler
from router.batches.runner import BatchRunner, LineCaller
from router.batches.store import SCHEMA as BATCH_TABLES
from router.batches.store import BatchStore
from router.errors import APIError, ModelNotFound
from router.lifecycle.reload import Reloader
from router.lifecycle.supervisor import Supervisor
from router.observe.events import EventBus
from router.observe.metrics import Metrics
from router.registry import ModelRegistry
from router.workers.placement import Placer, check_budgets
from shared.config import ConfigError, Preset, default_cache_dir

log = logging.getLogger("modelyard.router")


def check_runtime_dir(path: Path, source: str) -> None:
    """Worker sockets live here: whoever can enter it can talk to the workers."""
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{source}: [server]: key 'runtime_dir': {path} must belong to this "
                          f"user and be closed to others (chmod 700); it is "
                          f"{stat.filemode(st.st_mode)}, owner uid {st.st_uid}")
    if len(str(path)) > 80:  # a socket path must fit in 107 bytes
        raise ConfigError(f"{source}: [server]: key 'runtime_dir': {path} is longer than 80 "
                          "characters, too long for the workers' socket paths")


class ModelyardApp(Starlette):
    """Starlette behind modelyard's own outer layers, ``front`` (outermost first): the
    admission middleware, then ``HotPath``, which serves the hottest endpoints itself and
    hands every other request to Starlette's stack (server errors, exceptions, routes)."""

    def __init__(self, *, front: list[Middleware], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.front = front
        self._inner: ASGIApp | None = None

    def inner(self) -> ASGIApp:
        """The stack below ``front``: what a request admitted already goes through (a
        batch's line, ``router.batches.runner.LineCaller``)."""
        if self.middleware_stack is None:
            self.middleware_stack = self.build_middleware_stack()
        assert self._inner is not None
        return self._inner

    def build_middleware_stack(self) -> ASGIApp:
        app = self._inner = super().build_middleware_stack()
        for cls, args, kwargs in reversed(self.front):
            app = cls(app, *args, **kwargs)
        return app


def build_app(preset: Preset, *, watch_config: bool = False,
              overrides: dict[str, Any] | None = None) -> ModelyardApp:
    """The app serving ``preset``; workers start on demand and stop on shutdown.
    ``POST /v1/config/reload`` and SIGHUP reload ``preset.source`` (and, with
    ``watch_config``, a change of the file does); ``overrides``: server keys the command
    line set, which win over the file at every reload."""
    server = preset.server
    registry = ModelRegistry(preset)
    for name in server.preload:
        try:
            registry.named(name)
        except ModelNotFound as err:
            raise ConfigError(f"{preset.source}: [server]: key 'preload': {err.message}") from None
    keys = Keys.load(server, preset.source)
    placer = Placer()
    check_budgets(preset.models.values(), server, placer.gpus)
    own_runtime_dir = server.runtime_dir is None
    runtime_dir = Path(server.runtime_dir or tempfile.mkdtemp(prefix="modelyard-"))
    runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_runtime_dir(runtime_dir, preset.source)
    events = EventBus()
    supervisor = Supervisor(registry, server, runtime_dir, placer, events)
    metrics = MetricsAPI(Metrics(registry))
    database = Database(server.database_url or default_url(server.cache_dir),
                        KEY_TABLES + LEDGER_TABLES + BATCH_TABLES)
    ledger = Ledger(database)
    supervisor.parker.observe = metrics.metrics.switch
    metrics.metrics.watch_replicas(supervisor.replicas_of)
    relay = Relay(supervisor, metrics.metrics, ledger)
    relay.follow_keys(keys)  # a revoked key's generations end at once
    openai = OpenAIAPI(relay, server.max_body_bytes)
    anthropic = AnthropicAPI(relay, server.max_body_bytes)
    responses = ResponsesAPI(relay, server.max_body_bytes, ResponseStore(
        server.responses_store_items, int(server.responses_store_mib * 2**20),
        server.responses_store_ttl))
    keys.on_revoked(responses.background.revoked)  # after the relay's: see ``revoked``
    watch = EventsAPI(supervisor, events)
    reloader = Reloader(preset.source, preset, supervisor, keys, overrides)
    admin = AdminAPI(supervisor, server.max_body_bytes, reloader)
    named = KeysAPI(KeyStore(database), keys, server.max_body_bytes)
    batch_store = BatchStore(database, Path(server.cache_dir or default_cache_dir()) / "files",
                             int(server.files_quota_mib * 2**20))
    runner = BatchRunner(batch_store, LineCaller(lambda: app.inner()), keys, supervisor,
                         {"openai": OpenAIShape(), "anthropic": AnthropicShape()},
                         metrics.metrics, ledger)
    batches = FilesAndBatches(batch_store, runner, relay, server)
    message_batches = MessageBatches(batch_store, runner, relay, server)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        log.info("modelyard: %d model(s) from %s; runtime dir %s; %s", len(registry.entries),
                 preset.source, runtime_dir,
                 f"{len(keys.principals)} API key(s) required" if keys.required else "no API keys")
        try:
            # Before the first request: a named key works at once, and a server whose
            # keys cannot be read does not start open.
            await named.start()
            ledger.start()
        except Exception:
            log.error("modelyard: cannot use the database %s (server.database_url); "
                      "not starting", database.shown)
            raise
        # While the database is away the last read serves STALE_MAX s, then named keys
        # open nothing until it answers (router.access.key_store.follow).
        following = asyncio.create_task(follow_keys(named.refresh, keys.set_stale),
                                        name="named-keys")
        supervisor.start()
        reloader.start(watch_config)
        spools = await asyncio.to_thread(batch_store.clear_spools)
        if spools:
            log.info("files: removed %d upload spools a stopped router left", spools)
        runner.start()
        try:
            yield
        finally:
            following.cancel()
            await runner.close()  # lines that ran are written; the rest wait for a runner
            reloader.close()
            watch.close()
            await responses.background.cancel_all()
            await supervisor.stop_all()
            if own_runtime_dir:
                shutil.rmtree(runtime_dir, ignore_errors=True)
            await ledger.close()  # SIGTERM loses no row
            database.close()

    routes = (metrics.counted(openai.routes() + anthropic.routes() + responses.routes()
                              + ScoringAPI(relay, server.max_body_bytes).routes())
              + batches.routes() + message_batches.routes()
              + watch.routes() + AdapterAPI(admin).routes() + admin.routes() + named.routes()
              + UsageAPI(ledger, registry).routes() + metrics.routes()
              + OpenAPIDocument(keys).routes() + StatusPage().routes())
    rules = AccessRules(routes)
    if rules.missing():  # refused to everyone (403 no_access_rule); tests/test_access fails
        log.error("routes without a row in router.access.rules.TABLE: %s", rules.missing())
    app = ModelyardApp(
        routes=routes,
        lifespan=lifespan,
        front=[*middleware_stack(server, keys, rules),
               Middleware(HotPath, handlers=openai.handlers(), metrics=metrics.metrics)],
        exception_handlers={APIError: api_error_handler, HTTPException: http_error_handler,
                            Exception: server_error_handler},
    )
    app.state.supervisor = supervisor
    app.state.registry = registry
    app.state.metrics = metrics.metrics
    app.state.events = events
    app.state.reloader = reloader
    app.state.runtime_dir = runtime_dir
    app.state.rules = rules
    app.state.keys = keys
    app.state.keys_api = named
    app.state.relay = relay
    app.state.responses = responses
    return app
