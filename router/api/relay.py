"""The protocol-neutral relay: the one path every generation request takes.

    acquire (resolve + lease) → submit → wait for the first batch → stream or aggregate
    → release → request log

A protocol module supplies only its request decoding (into ``shared.protocol.Generate``)
and a ``Shaper``: how a delta stream becomes its chunks, closing events, in-band error
event and aggregated body. It adds no lifecycle, streaming or logging code; the relay
knows nothing of any protocol's shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.access.admission import BATCH_SCOPE_KEY, KeyRevoked, Keys, Principal, principal_of
from router.access.buckets import TokensPerMinute
from router.access.budgets import Budgets, Reservation
from router.access.ledger import Ledger
from router.api import progress
from router.api.sse import EventStream
from router.api.wire import JSONResponse, disconnected, error_response, unless_disconnected
from router.errors import APIError, BadRequest, ClientGone, ClientTooSlow
from router.lifecycle.prefix_index import session_key
from router.lifecycle.supervisor import Supervisor
from router.observe.metrics import Metrics
from router.registry import Lease, ModelEntry
from router.workers.link import RequestStream, Usage, WorkerLink
from shared.config import clamps_max_tokens
from shared.protocol import Delta, Generate, LoraRef, Tokenize

log = logging.getLogger("modelyard.requests")


class Shaper(Protocol):
    """How one protocol shapes one response's delta stream (built once the model is known)."""

    def chunks(self, batch: list[Delta]) -> bytes:
        """Stream: the bytes (SSE events) for one batch of deltas; may open the stream."""

    def close(self, usage: Usage) -> bytes:
        """Stream: the closing events (usage, stop, ``[DONE]`` ...)."""

    def error_event(self, err: APIError) -> bytes:
        """Stream: the in-band event for a failure after the stream began."""

    has_reasoning: bool
    """Stream: whether ``chunks`` writes a delta's ``reasoning`` (where loading progress
    may go: ``router.api.progress``)."""

    def add(self, batch: list[Delta]) -> None:
        """Aggregate: keep a batch for the body."""

    def body(self, usage: Usage) -> dict[str, Any]:
        """Aggregate: the whole response."""


def protocol_route(path: str, handler: Callable[[Request], Awaitable[Response]],
                   methods: tuple[str, ...] = ("POST",)) -> Route:
    """A route whose errors take the error shape of the protocol serving ``path``
    (``router.errors.shaped``)."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as err:
            return error_response(err, request.scope["path"])

    return Route(path, endpoint, methods=list(methods))


BATCH_PRIORITY = 1
"""A batch line's ``Generate.priority``; a client's own requests have 0, which a
priority-scheduling engine serves first."""


class Relay:
    """Runs generation requests for every protocol module; see the module docstring."""

    def __init__(self, supervisor: Supervisor, metrics: Metrics | None = None,
                 ledger: Ledger | None = None) -> None:
        self.supervisor = supervisor
        self.metrics = metrics or Metrics(supervisor.registry)
        self.ledger = ledger
        self.tpm = TokensPerMinute()
        self.budgets = Budgets(ledger, supervisor.registry) if ledger is not None else None
        self._reserved: dict[Usage, Reservation] = {}
        """Budget holds of requests in flight, settled by their log line (``_log``, just
        after their ledger row) or, on a path that ended without one, by ``_settle``."""
        self.keys: Keys | None = None
        self._generating: dict[str, set[RequestStream]] = {}
        """Generations in flight by key name: a revocation fails them (``follow_keys``)."""

    def follow_keys(self, keys: Keys) -> None:
        """End a key's generations in flight once it is revoked (``Keys.on_revoked``):
        a stream gets its protocol's in-band error event (a 401, ``key_revoked``), an
        answer not begun (a background response's, a batch line's) fails with it. Nothing
        is checked per token: the revocation comes to the streams."""
        self.keys = keys
        keys.on_revoked(self._revoked)

    def _revoked(self, names: frozenset[str]) -> None:
        for name in names:
            for stream in self._generating.pop(name, ()):
                stream._fail(KeyRevoked())

    def _follow(self, stream: RequestStream, key: str) -> None:
        """Count ``stream`` among ``key``'s generations; one whose key was revoked while
        it waited for its model fails at once."""
        keys = self.keys
        if keys is None or not key:
            return  # no keys followed (an app without admission), or the open server's
        if keys.required and keys.current(key) is None and not keys.unknown(key):
            stream._fail(KeyRevoked())
            return
        self._generating.setdefault(key, set()).add(stream)

    def _close(self, stream: RequestStream) -> None:
        stream.close()
        held = self._generating.get(stream.usage.key)
        if held is not None:
            held.discard(stream)
            if not held:
                del self._generating[stream.usage.key]

    keepalive_every = 5.0
    """Seconds between keep-alive events on a stream that waits for a cold model."""

    async def generate(self, request: Request, endpoint: str, model: str | None,
                       gens: list[Generate], streaming: bool,
                       shaper_for: Callable[[str], Shaper], *,
                       keepalive: bytes = b"", keep_alive: float | None = None,
                       user: str | None = None) -> Response:
        """Relay ``gens`` (one client request) and answer as ``shaper_for(model id)`` shapes it.

        A stream for a model that is not ready yet begins at once (status 200) when the
        protocol gives a ``keepalive`` event (Anthropic's ``ping``): the client sees it
        every few seconds while the model loads. A stream whose model must load (or wake)
        and that asked for loading progress (``router.api.progress``: the preset, or the
        request's header) begins at once too, with a line that says how far the load is,
        and another every second: an SSE comment, or (``reasoning``) the protocol's own
        reasoning, written by its shaper before the answer. Once such a stream has begun, a failure
        to start (the load failed or timed out, the model was unloaded meanwhile) can no
        longer be an HTTP status: it arrives as the protocol's in-band error event
        (``Shaper.error_event``, as a worker lost mid-stream does), and the stream ends.
        A full queue is refused before any stream begins, with its status. Any other
        request waits without a word and fails with its status. ``keep_alive``
        (seconds; the request's own) is ``_keep_alive``'s.
        """
        principal = principal_of(request.scope)
        usage = Usage(principal.name, request.scope.get(BATCH_SCOPE_KEY))
        header = _scope_header(request.scope, SESSION_HEADER)
        if header or user:  # a model of several replicas keeps a session on one
            usage.session = session_key(principal.name, header.decode("latin-1")
                                        if header else None, user=user)
        if principal.limits.models:  # first: nothing else may tell that a model exists
            model = self._visible(model, principal, endpoint, streaming, usage)
        self._refuse_known_oversized(model, gens, endpoint, streaming, usage)
        if principal.limits.budgets or principal.limits.tpm:
            await self._within_limits(principal, model, gens, endpoint, streaming, usage)
        try:
            return await self._generate(request, endpoint, model, gens, streaming, shaper_for,
                                        keepalive, keep_alive, principal, usage)
        except BaseException:
            self._settle(usage)  # an end without its log line (cancelled; a bug)
            raise

    async def _generate(self, request: Request, endpoint: str, model: str | None,
                        gens: list[Generate], streaming: bool,
                        shaper_for: Callable[[str], Shaper], keepalive: bytes,
                        keep_alive: float | None, principal: Principal, usage: Usage
                        ) -> Response:
        if streaming:
            now = self._now(endpoint, model, "generate", True, usage)
            if isinstance(now, tuple):
                lease, link = now
            else:  # not ready, or no free slot: only here are the preset and header read
                name = self._model_id(model)  # an adapter's, where ``now`` is its base
                cold = shaper_for(name)
                beat = self._beat(request, now, keepalive, cold)
                if beat is not None:
                    body = self._cold_stream(name, model, gens, cold, *beat, usage, endpoint,
                                             keep_alive, principal)
                    return EventStream(body, self.supervisor.server.send_timeout)
                lease, link = await self._wait(request, endpoint, model, "generate", True,
                                               usage)
        else:
            lease, link = await self._acquire(request, endpoint, model, "generate", streaming,
                                              usage)
        self._keep_alive(lease, keep_alive, principal)
        stream, first = await self._start(lease, link, gens, usage, endpoint, streaming, request)
        shaper = shaper_for(lease.name)
        # A clamp is known by the first batch, before any header is sent.
        extra = {CLAMPED_HEADER: str(usage.clamped)} if usage.clamped else None
        if streaming:
            body = self._stream(stream, shaper, first, usage, lease, endpoint)
            return EventStream(body, self.supervisor.server.send_timeout, extra)
        status = 200
        try:
            shaper.add(first)
            if not stream.exhausted:  # long answer: stop generating if the client leaves
                await unless_disconnected(request, self._drain(stream, shaper))
        except APIError as err:  # ClientGone (499) included
            status = err.status
            raise
        except asyncio.CancelledError:  # no answer (a batch line cut, the router stopping)
            status = 499
            raise
        finally:
            self._close(stream)
            lease.release()
            if status == 200:  # counted and logged once the answer is written
                asyncio.get_running_loop().call_soon(
                    self._log, endpoint, lease.name, False, status, usage,
                    time.perf_counter())
            else:  # before the answer: ``HotPath`` asks whether it was counted
                self._log(endpoint, lease.name, False, status, usage)
        return JSONResponse(shaper.body(usage), headers=extra)

    def _refuse_known_oversized(self, model: str | None, gens: list[Generate], endpoint: str,
                                streaming: bool, usage: Usage) -> None:
        """A prompt past the bound its model's worker gave when it last ran is refused
        before anything waits for that model: it never starts (evicting another) or takes a
        slot only to be refused. A model never run yet has no bound: ``_start`` checks."""
        try:
            entry = self.supervisor.registry.resolve(model)
        except APIError:
            return  # ``_acquire`` says so, with its log line
        try:
            _refuse_oversized(entry, gens)  # an adapter's bound is its base's
        except APIError as err:
            self._log(endpoint, entry.id, streaming, err.status, usage)
            raise

    def _keep_alive(self, lease: Lease, seconds: float | None, principal: Principal) -> None:
        """A request's ``keep_alive`` (``None``: it had none), as Ollama's: the latest admin
        request's is the model's idle limit (``0`` stops it once idle, ``-1`` keeps it)
        until the next admin request, whose own (or, without one, the preset's ``ttl``)
        takes over: one request never makes every later one a cold start. Any other key's
        only keeps the model loaded up to ``keep_alive_max`` seconds after this request:
        it never stops or pins a model others use, nor outlives the admin's bound."""
        if principal.admin:
            lease.entry.keep_alive = seconds
        elif seconds is not None:
            bound = self.supervisor.server.keep_alive_max
            lease.keep_for = bound if seconds < 0 else min(seconds, bound)

    async def _start(self, lease: Lease, link: WorkerLink, gens: list[Generate], usage: Usage,
                     endpoint: str, streaming: bool, request: Request | None
                     ) -> tuple[RequestStream, list[Delta]]:
        """Submit ``gens`` and wait for the first output, so that a refused request is a
        JSON 4xx, not a stream that starts 200 and then carries an error; a client that
        leaves meanwhile (seen here when ``request`` is given) gives its place in the
        engine's queue back at once. On failure the stream is closed, the lease released
        and an ``APIError`` logged."""
        stream: RequestStream | None = None
        try:
            if self._reserved:  # a key with a budget: its prompt counted before it runs
                await self._count(link, gens, usage)
            if clamps_max_tokens(lease.entry.spec, PROTOCOLS.get(endpoint, "openai")):
                for gen in gens:
                    gen.sampling.clamp_max_tokens = True
            if lease.adapter is not None:
                for gen in gens:
                    gen.lora = lease.adapter.lora
            if usage.batch is not None:  # after any other request (vLLM: lower first)
                for gen in gens:
                    gen.priority = BATCH_PRIORITY
            _refuse_oversized(lease.entry, gens)
            # No await from the choice of replica to the submit: it is where they went.
            link = self.supervisor.route(lease.entry, link, gens, usage.session)
            stream = link.submit(gens, usage)
            self._follow(stream, usage.key)
            first = await _first_batch(request, stream)
            usage.first_at = time.perf_counter()
            return stream, first
        except BaseException as err:
            if stream is not None:
                self._close(stream)
            lease.release()
            if isinstance(err, APIError):  # ClientGone too: a 499 nobody reads
                self._log(endpoint, lease.name, streaming, err.status, usage)
            raise

    def _beat(self, request: Request, entry: ModelEntry, keepalive: bytes, shaper: Shaper
              ) -> tuple[Callable[[], bytes], float] | None:
        """What a stream for ``entry``'s model, which is not ready or has no free slot,
        writes while it waits, and how often: loading progress if it asked for it and the
        model must load or wake (comments, or lines of reasoning that ``shaper`` writes as
        its protocol's, where it has reasoning), else the protocol's ``keepalive``;
        ``None``: the request waits before its response begins (its queue is full, say: a
        429)."""
        server = self.supervisor.server
        if entry.queued >= server.max_queue_depth:
            return None  # refused by ``acquire`` at once: with its status, not in-band
        chosen = progress.mode(request.scope, entry, server) if entry.state != "ready" \
            else "off"
        if chosen == "reasoning" and shaper.has_reasoning:
            lines = progress.LoadProgress(entry)
            return (lambda: shaper.chunks([lines.delta()])), progress.EVERY
        if chosen != "off":  # comments; reasoning where the protocol has none
            return progress.LoadProgress(entry), progress.EVERY
        if keepalive:
            return (lambda: keepalive), self.keepalive_every
        return None

    async def _cold_stream(self, model_id: str, model: str | None, gens: list[Generate],
                           shaper: Shaper, beat: Callable[[], bytes], every: float,
                           usage: Usage, endpoint: str, keep_alive: float | None,
                           principal: Principal) -> AsyncGenerator[bytes, None]:
        """A stream that begins before its model is ready: ``beat()`` at once and every
        ``every`` seconds until it is, then as ``_stream``. A client that leaves
        meanwhile cancels the wait (and its place). A failure to start is the shaper's
        ``error_event``: the status (200) went with the first beat."""
        waiting = asyncio.ensure_future(self.supervisor.acquire(model, "generate"))
        try:
            yield beat()  # at once: the client knows the request is taken
            while not waiting.done():
                await asyncio.wait((waiting,), timeout=every)
                if not waiting.done():
                    yield beat()
        except BaseException as err:  # gone, or too slow to read a keep-alive
            # Nothing awaited here: Starlette cancels a stream whose client left by an anyio
            # cancel scope, which cancels every await after it too (this log line and the
            # budget hold it settles were lost). The wait ends by the cancel, or it got in
            # first: then its lease goes back.
            waiting.cancel()
            waiting.add_done_callback(_release_if_acquired)
            self._log(endpoint, model_id, True,
                      err.status if isinstance(err, APIError) else 499, usage)
            if isinstance(err, ClientTooSlow):
                return
            raise
        try:
            lease, link = waiting.result()
        except APIError as err:  # the model could not be started: the stream has begun
            self._log(endpoint, model_id, True, err.status, usage)
            yield shaper.error_event(err)
            return
        self._keep_alive(lease, keep_alive, principal)
        try:
            stream, first = await self._start(lease, link, gens, usage, endpoint, True, None)
        except APIError as err:
            yield shaper.error_event(err)
            return
        except BaseException:
            self._log(endpoint, model_id, True, 499, usage)
            raise
        rest = self._stream(stream, shaper, first, usage, lease, endpoint)
        try:
            async for chunk in rest:
                yield chunk
        except ClientTooSlow as err:  # thrown in by EventStream: hand it to ``_stream``
            with contextlib.suppress(StopAsyncIteration, ClientTooSlow):
                await rest.athrow(err)
        finally:
            await rest.aclose()

    def _now(self, endpoint: str, model: str | None, task: str, streaming: bool,
             usage: Usage) -> tuple[Lease, WorkerLink] | ModelEntry:
        """``Supervisor.acquire_now``; its refusal logged. A key limited to some models
        comes here with the exact id ``_visible`` found among them."""
        try:
            return self.supervisor.acquire_now(model, task, batch=usage.batch is not None)
        except APIError as err:  # unknown model, wrong task
            self._log(endpoint, self._model_id(model), streaming, err.status, usage)
            raise

    async def _within_limits(self, principal: Principal, model: str | None,
                             gens: list[Generate], endpoint: str, streaming: bool,
                             usage: Usage, least: int = 0) -> None:
        """A 429 (logged) for a key past its tokens per minute, or for a request that does
        not fit what one of its budgets has left (each prompt at its least; a one-shot
        request's input ``least`` tokens); else what ``gens`` may spend is held
        (``Budgets.reserve``, which may lower their ``max_tokens``: then ``usage.clamped``
        says so) until the request's log line settles it. Its prompt is counted once its
        model's worker is known (``_count``)."""
        try:
            entry = self.supervisor.registry.resolve(model)
        except APIError:
            return  # an unknown model: ``_now`` answers and logs it
        limits = principal.limits
        wait = self.tpm.wait(principal.name, limits.tpm) if limits.tpm else 0
        try:
            if wait:
                raise APIError(f"this key's {limits.tpm} tokens per minute are spent; retry "
                               f"in {wait} s", status=429, type="rate_limit_error",
                               code="rate_limit_exceeded", retry_after=wait)
            if limits.budgets and self.budgets is not None:
                asked = [gen.sampling.max_tokens for gen in gens]
                clamp = clamps_max_tokens(entry.spec, PROTOCOLS.get(endpoint, "openai"))
                held = await self.budgets.reserve(principal.name, limits.budgets, entry,
                                                  gens, clamp, least)
                if held.state is not None:
                    self._reserved[usage] = held
                usage.clamped = _clamped(gens, asked)
        except APIError as err:
            self._log(endpoint, entry.id, streaming, err.status, usage)
            raise

    async def _count(self, link: WorkerLink, gens: list[Generate], usage: Usage) -> None:
        """The hold of a request of a key with a budget (``usage``'s, if it has one not
        counted yet), now with its prompts as the worker counts them (``Tokenize``: the
        prompt the engine will run); ``BudgetExceeded`` if it no longer fits."""
        held = self._reserved.get(usage)
        if held is None or held.counted or self.budgets is None:
            return
        counts = await asyncio.gather(*(_prompt_tokens(link, gen) for gen in gens))
        self.budgets.recount(held, counts)
        usage.clamped = _clamped(gens, [asked for asked, _ in held.asked])

    def _settle(self, usage: Usage) -> None:
        """Drop ``usage``'s budget hold, if it has one still (its row is recorded)."""
        held = self._reserved.pop(usage, None)
        if held is not None:
            held.settle()

    def resolve_for(self, model: str | None, principal: Principal) -> ModelEntry:
        """The model ``model`` names, as ``principal`` may know it: one its ``models``
        globs leave out does not exist for it, and a 404 lists only those it may use."""
        limits = principal.limits
        entry = self.supervisor.registry.resolve(model, limits.allows if limits.models
                                                 else None)
        assert limits.allows(entry.names)  # resolve matched among these only
        return entry

    def _visible(self, model: str | None, principal: Principal, endpoint: str,
                 streaming: bool, usage: Usage) -> str:
        """The id of the model ``model`` names among those ``principal`` may use (every
        later look-up by that exact id finds the same model); else ``resolve_for``'s 404,
        logged (under ``-``: the key may not know the model)."""
        try:
            return self.resolve_for(model, principal).id
        except APIError as err:
            self._log(endpoint, "-", streaming, err.status, usage)
            raise

    def _model_id(self, model: str | None) -> str:
        """The id a refused request's ``model`` names, for its log line, count and event;
        ``-`` for a name that fits no model (a client's own words are never kept: they
        could be megabytes)."""
        try:
            return self.supervisor.registry.resolve(model).id
        except APIError:
            return "-"

    async def _acquire(self, request: Request | None, endpoint: str, model: str | None, task: str,
                       streaming: bool, usage: Usage) -> tuple[Lease, WorkerLink]:
        """The model's lease and link; a client that leaves while it waits (for a load or
        a slot) gives its place in the queue back at once (``ClientGone``)."""
        now = self._now(endpoint, model, task, streaming, usage)
        if isinstance(now, tuple):
            return now
        return await self._wait(request, endpoint, model, task, streaming, usage)

    async def _wait(self, request: Request | None, endpoint: str, model: str | None, task: str,
                    streaming: bool, usage: Usage) -> tuple[Lease, WorkerLink]:
        """``_acquire`` for a model ``_now`` found not ready or without a free slot."""
        try:
            waiting = self.supervisor.acquire(model, task, batch=usage.batch is not None)
            if request is None:
                return await waiting
            return await unless_disconnected(request, waiting, _release)
        except APIError as err:  # unknown model, queue full, load failed, gone: one line
            self._log(endpoint, self._model_id(model), streaming, err.status, usage)
            raise

    @staticmethod
    async def _drain(stream: RequestStream, shaper: Shaper) -> None:
        async for batch in stream:
            shaper.add(batch)

    async def _stream(self, stream: RequestStream, shaper: Shaper, first: list[Delta],
                      usage: Usage, lease: Lease, endpoint: str) -> AsyncGenerator[bytes, None]:
        status = 200
        try:
            yield shaper.chunks(first)
            while True:
                try:
                    batch = await stream.__anext__()
                except StopAsyncIteration:
                    break
                except APIError as err:  # the worker failed mid-stream: tell the client in-band
                    status = err.status
                    yield shaper.error_event(err)
                    return
                yield shaper.chunks(batch)
            yield shaper.close(usage)
        except ClientTooSlow as err:  # thrown in by EventStream: a write timed out
            status = err.status
        except BaseException:
            status = 499  # the client went away (the generator was closed or cancelled)
            raise
        finally:
            self._close(stream)
            lease.release()
            self._log(endpoint, lease.name, True, status, usage)

    def _log(self, endpoint: str, model: str, streaming: bool, status: int,
             usage: Usage, now: float = 0.0) -> None:
        """One line and one count per request: what was asked, what came back, how fast
        (``now``: when it ended, if not now)."""
        now = now or time.perf_counter()
        self.metrics.request(endpoint, model, status, usage, now)
        # A batch line that ended unanswered is a row as any request is: held with its
        # line (``Ledger.hold``), it is written with the line's ``canceled`` result (its
        # batch stopped: the tokens were spent) or dropped by the runner (cut short for a
        # person's request, or the router stopping: the line runs again, charged then).
        if self.ledger is not None:
            self.ledger.record(usage.key, model, endpoint, status, usage.prompt_tokens,
                               usage.cached_tokens, usage.completion, now - usage.started)
        self._settle(usage)  # after the row: a concurrent reservation sees one or the other
        if usage.key and (usage.prompt or usage.completion):
            self.tpm.spend(usage.key, usage.prompt_tokens + usage.completion)
        if log.isEnabledFor(logging.INFO):  # its arguments cost more than the check
            ttft, decode, total = _timings(usage, now)
            log.info("%s model=%s stream=%s status=%d prompt=%d cached=%d completion=%d "
                     "ttft_ms=%.0f decode_tps=%.1f total_ms=%.0f finish=%s", endpoint, model,
                     "true" if streaming else "false", status, usage.prompt_tokens,
                     usage.cached_tokens, usage.completion, ttft, decode, total,
                     ",".join(usage.finish) or "-")
            if usage.clamped:
                log.info("%s model=%s max_tokens clamped to %d: the prompt left no more of "
                         "the context, or the key's budget no more", endpoint, model,
                         usage.clamped)
        # Made only if someone reads it (``EventBus.publish_with``); ``usage`` is not
        # touched again once its request is logged.
        self.supervisor.events.publish_with("request", model, _request_event, endpoint,
                                            streaming, status, usage, now)

    async def call(self, request: Request, endpoint: str, model: str | None, task: str,
                   work: Callable[[WorkerLink, LoraRef | None], Awaitable[Any]],
                   prompt_tokens: Callable[[Any], int] | None = None,
                   count: Callable[[WorkerLink, LoraRef | None], Awaitable[int]] | None = None
                   ) -> tuple[ModelEntry, Any]:
        """A one-shot request (tokenize, embeddings ...): acquire (a client that leaves
        while it waits gives its place back), ``work(link, lora)`` (``lora``: the adapter
        the request named, on its base's ``link``; a tokenizer's is its base's), release.
        ``prompt_tokens`` reads what the result spent, for the log, the ledger and budgets;
        a request that spends (embeddings, scores) gives ``count``, the tokens ``work``
        will spend as the worker counts them before it runs: for a key with a budget, a
        token is held before its model is acquired and that count once it is, before
        ``work`` (``BudgetExceeded`` if it does not fit)."""
        principal = principal_of(request.scope)
        usage = Usage(principal.name, request.scope.get(BATCH_SCOPE_KEY))
        if principal.limits.models:  # first: nothing else may tell that a model exists
            model = self._visible(model, principal, endpoint, False, usage)
        if principal.limits.budgets or principal.limits.tpm:
            await self._within_limits(principal, model, [], endpoint, False, usage,
                                      least=1 if count is not None else 0)
        try:
            lease, link = await self._acquire(request, endpoint, model, task, False, usage)
        except BaseException:
            self._settle(usage)  # an end without its log line (cancelled)
            raise
        status = 200
        try:
            with lease:
                lora = None if lease.adapter is None else lease.adapter.lora
                held = self._reserved.get(usage) if self._reserved else None
                if count is not None and held is not None and self.budgets is not None:
                    self.budgets.recount(held, [], await count(link, lora))
                result = await work(self.supervisor.route(lease.entry, link), lora)
                if prompt_tokens is not None:
                    usage.prompt[endpoint] = prompt_tokens(result)
                return lease.adapter or lease.entry, result
        except APIError as err:
            status = err.status
            raise
        except asyncio.CancelledError:  # no answer (a batch line cut, the router stopping)
            status = 499
            raise
        finally:
            self._log(endpoint, lease.name, False, status, usage)


def _scope_header(scope: MutableMapping[str, Any], name: bytes) -> bytes | None:
    """A request header's raw value from its ASGI scope (a batch line's scope has none)."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


def _release(acquired: tuple[Lease, WorkerLink]) -> None:
    acquired[0].release()


def _release_if_acquired(waited: asyncio.Future[tuple[Lease, WorkerLink]]) -> None:
    """A wait for a lease, cancelled: the lease, if it came all the same, goes back."""
    if not waited.cancelled() and waited.exception() is None:
        _release(waited.result())


def _timings(usage: Usage, now: float) -> tuple[float, float, float]:
    """Time to first token (ms), decode tokens/s and total time (ms) of a request that
    ended at ``now``."""
    ttft = (usage.first_at - usage.started) * 1000 if usage.first_at else 0.0
    decode = (usage.completion / (now - usage.first_at)
              if usage.first_at and now > usage.first_at else 0.0)
    return ttft, decode, (now - usage.started) * 1000


def _request_event(endpoint: str, streaming: bool, status: int, usage: Usage,
                   now: float) -> dict[str, Any]:
    """A ``request`` event's fields: what its log line says."""
    ttft, decode, total = _timings(usage, now)
    return {"key": usage.key, "endpoint": endpoint, "stream": streaming, "status": status,
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
            "completion_tokens": usage.completion, "ttft_ms": round(ttft, 1),
            "decode_tps": round(decode, 1), "total_ms": round(total, 1),
            "finish": list(usage.finish) or None}


WATCH_AFTER = 0.05
"""Seconds a request waits for its first batch before a task watches for its client
leaving. A relay under load answers sooner (first batch p99 22 ms at 64 connections in
the relay benchmark), and then no task is made at all; a longer wait, a model's queue or
prefill, is watched from then on (a client gone in the first 50 ms costs that much)."""


async def _first_batch(request: Request | None, stream: RequestStream) -> list[Delta]:
    """The stream's first batch; ``ClientGone`` (its generation cancelled) if the client
    (when ``request`` is given) leaves first. One watcher task, started only once the
    wait passes ``WATCH_AFTER``, ends the stream itself: cheaper than
    ``unless_disconnected``'s two tasks on the path every request takes."""
    if request is None:
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            return []
    watch: asyncio.Future[None] | None = None

    def left(done: asyncio.Future[None]) -> None:
        if not done.cancelled():
            stream._fail(ClientGone())

    def start() -> None:
        nonlocal watch
        watch = asyncio.ensure_future(disconnected(request))
        watch.add_done_callback(left)

    timer = asyncio.get_running_loop().call_later(WATCH_AFTER, start)
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return []
    finally:
        timer.cancel()
        if watch is not None:
            watch.cancel()


async def _prompt_tokens(link: WorkerLink, gen: Generate) -> int:
    """The tokens ``gen``'s prompt takes in its engine: its token ids, or the worker's
    count of the prompt it renders (``Tokenize``, ``count_only``)."""
    if gen.prompt_token_ids is not None:
        return len(gen.prompt_token_ids)
    counted = await link.tokenize(Tokenize(
        id=f"count-{gen.id}", messages=gen.messages, prompt=gen.prompt, tools=gen.tools,
        add_generation_prompt=gen.add_generation_prompt,
        continue_final_message=gen.continue_final_message,
        template_kwargs=gen.template_kwargs, count_only=True))
    return counted.count


def _clamped(gens: list[Generate], asked: list[int | None]) -> int:
    """The least ``max_tokens`` a budget lowered one of ``gens`` to from what it asked
    (``asked``, a number); 0: none."""
    lowered = [gen.sampling.max_tokens or 0 for gen, was in zip(gens, asked, strict=True)
               if was is not None and gen.sampling.max_tokens != was]
    return min(lowered, default=0)


PROTOCOLS = {"messages": "anthropic", "responses": "responses"}
"""Endpoints by the protocol whose ``max_tokens_overflow`` applies (any other: openai)."""
CLAMPED_HEADER = "x-modelyard-max-tokens-clamped"
"""On a response whose ``max_tokens`` was clamped: what it became."""
SESSION_HEADER = b"x-session-id"
"""A client's name for its conversation: a model of several replicas serves its requests
on one replica while it is not overloaded (its cache holds the conversation)."""


def _refuse_oversized(entry: ModelEntry, gens: list[Generate]) -> None:
    """A prompt longer than the worker's bound cannot fit the context: refuse it here,
    before megabytes cross the socket and stall the worker's other streams."""
    limit = entry.max_prompt_chars
    if not limit:
        return
    for gen in gens:
        size = len(gen.prompt or "") + sum(len(m.content or "") for m in gen.messages or ())
        if size > limit:
            at_least = size * (entry.max_model_len or 1) // limit  # no token is longer
            raise BadRequest(
                f"This model's maximum context length is {entry.max_model_len} tokens. "
                f"However, your prompt contains at least {at_least} tokens ({size} "
                "characters), which leaves no room for output. Please reduce the length of "
                "the prompt.", param="prompt" if gen.messages is None else "messages",
                code="context_length_exceeded")

