"""OpenAI's Responses API on the relay.

    POST   /v1/responses                      create (JSON, SSE, or background: true)
    GET    /v1/responses/{id}                 a stored response
    DELETE /v1/responses/{id}                 forget it (cancelling it if it runs)
    GET    /v1/responses/{id}/input_items     its conversation's input items, paged
    POST   /v1/responses/{id}/cancel          cancel a background response
    POST   /v1/responses/input_tokens         what a create would report as input_tokens

A create decodes its body (``schema``) into one ``Generate`` and hands it to the relay
with a ``ResponseShaper`` (``shaper``), which calls back with the final Response object;
unless ``store`` is false, that object and the conversation's items go to the bounded
``ResponseStore`` (``store``), where ``previous_response_id`` finds them. A background
response runs through the relay as a request whose client leaves only when it is
cancelled (``background``). Errors keep OpenAI's ``{"error": {...}}`` shape.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.access.admission import BATCH_SCOPE_KEY, principal_of
from router.access.limits import CAP_SCOPE_KEY, KEY_PLACE_SCOPE_KEY, ConnectionCap, KeyPlace
from router.api.openai.schema import keep_alive_seconds
from router.api.relay import Relay, protocol_route
from router.api.responses.background import BackgroundRuns
from router.api.responses.schema import (
    CreateResponseRequest,
    ResponseInput,
    ResponseItem,
    create_generate,
    echo,
    prompt_generate,
)
from router.api.responses.shaper import ResponseShaper
from router.api.responses.store import ResponseStore, StoreCollector, Stored, encode_items
from router.api.wire import JSONResponse, read_body, request_id
from router.errors import APIError, BadRequest, ClientGone
from router.workers.link import WorkerLink
from shared.protocol import Generate, LoraRef, Tokenize

log = logging.getLogger("modelyard.router")

ENDPOINT = "responses"
"""The relay's name for these requests (logs and metrics)."""


def _not_found(rid: str, param: str | None = None,
               code: str | None = None) -> APIError:
    return APIError(f"Response with id '{rid}' not found.", status=404,
                    type="invalid_request_error", param=param, code=code)


def _as_input(err: APIError) -> APIError:
    """The relay and the worker name a chat's field ``messages`` (too long for the
    context, refused by the template); here the client sent it as ``input``."""
    if err.param is not None and err.param.startswith("messages"):
        err.param = "input"
    return err


def _query_int(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        raise BadRequest(f"'{name}' must be an integer between {lo} and {hi}, got '{raw}'",
                         param=name, code="invalid_value")
    return int(raw)


class ResponsesAPI:
    """The Responses endpoints, bound to one relay and one store (whose figures it adds to
    the relay's metrics registry)."""

    def __init__(self, relay: Relay, max_body_bytes: int,
                 store: ResponseStore | None = None) -> None:
        self.relay = relay
        self.max_body_bytes = max_body_bytes
        self.store = store if store is not None else ResponseStore()  # an empty one is falsy
        self.background = BackgroundRuns()
        relay.metrics.registry.register(StoreCollector(self.store))

    def routes(self) -> list[Route]:
        return [
            protocol_route("/v1/responses", self.create),
            protocol_route("/v1/responses/input_tokens", self.input_tokens),
            # one route for both methods, so that a 405 lists them both in Allow
            protocol_route("/v1/responses/{response_id}", self.by_id, methods=("GET", "DELETE")),
            protocol_route("/v1/responses/{response_id}/input_items", self.input_items,
                           methods=("GET",)),
            protocol_route("/v1/responses/{response_id}/cancel", self.cancel),
        ]

    def _prior(self, previous_response_id: str | None, owner: str) -> list[ResponseItem]:
        """The conversation ``previous_response_id`` ended with (its items and output)."""
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id, owner)
        if stored is None:
            raise APIError(f"Previous response with id '{previous_response_id}' not found.",
                           status=404, type="invalid_request_error",
                           param="previous_response_id", code="previous_response_not_found")
        if stored.head().status in ("queued", "in_progress"):
            raise BadRequest(f"Previous response with id '{previous_response_id}' is still "
                             "in progress.", param="previous_response_id")
        return stored.conversation()

    async def create(self, request: Request) -> Response:
        req = await read_body(request, CreateResponseRequest, self.max_body_bytes)
        if req.background and request.scope.get(BATCH_SCOPE_KEY):
            # Fail closed even if a line's check missed it: a batch line's call holds no
            # connection cap nor key place to keep, and a run it left would outlive the
            # batch's own limits, its cancel and its key's revocation.
            raise BadRequest("'background' is not supported in a batch line",
                             param="background", code="unsupported_parameter")
        rid = f"resp_{secrets.token_hex(24)}"  # not guessable: the id opens it (for its owner)
        owner = principal_of(request.scope).name
        gen, items = create_generate(req, rid, self._prior(req.previous_response_id, owner))
        store = req.store is not False
        kept = encode_items(items) if store else b""

        def done(response: dict[str, Any]) -> None:
            if store:
                self.store.put(rid, response, kept, owner)

        shaper = ResponseShaper(rid, echo(req, gen), streaming=req.stream,
                                logprobs=gen.sampling.logprobs, on_done=done)
        if req.background:
            return self._start_background(request, req.model, gen, shaper, kept)
        try:
            return await self.relay.generate(request, ENDPOINT, req.model, [gen], req.stream,
                                             shaper.bind,
                                             keep_alive=keep_alive_seconds(req.keep_alive))
        except APIError as err:
            raise _as_input(err) from None

    def _start_background(self, creating: Request, model: str | None, gen: Generate,
                          shaper: ResponseShaper, items: bytes) -> Response:
        """Answer ``queued`` at once and run the response without its client. The run
        counts against ``max_connections`` (``ConnectionCap.hold``) and against its key's
        ``max_concurrent`` (the create's place, ``KeyPlace.keep``) until it ends: a create
        past either limit was refused before this ran (503 or 429), as a foreground
        request is, rather than queued behind the key's other runs."""
        rid = shaper.rid
        owner = principal_of(creating.scope)
        shaper.bind(self.relay.resolve_for(model, owner).id)  # unknown to the key: 404 now
        cap: ConnectionCap | None = creating.scope.get(CAP_SCOPE_KEY)
        if cap is not None:
            cap.hold()  # 503 at the cap: nothing stored, nothing started
        queued = shaper.response("queued")
        self.store.put(rid, queued, items, owner.name)
        place: KeyPlace | None = creating.scope.get(KEY_PLACE_SCOPE_KEY)
        give_back = place.keep() if place is not None else None

        async def run(request: Request) -> None:
            try:
                await relay(request)
            finally:
                if cap is not None:
                    cap.let_go()
                if give_back is not None:
                    give_back()

        async def relay(request: Request) -> None:
            self.store.put(rid, shaper.response("in_progress"), items, owner.name)
            try:  # the shaper stores the final object itself (``on_done``)
                await self.relay.generate(request, ENDPOINT, model, [gen], False, shaper.bind)
            except ClientGone:  # cancelled: the relay has stopped the generation
                self.store.put(rid, shaper.response("cancelled"), items, owner.name)
            except APIError as err:
                self.store.put(rid, shaper.response("failed", error=err), items, owner.name)
            except Exception as err:  # a bug, and no caller to answer: record it and log it
                log.exception("background response %s failed", rid)
                failure = APIError(f"internal error: {type(err).__name__}")
                self.store.put(rid, shaper.response("failed", error=failure), items, owner.name)

        self.background.start(rid, run, owner)
        return JSONResponse(queued)

    def _stored(self, request: Request) -> tuple[str, Stored]:
        """The response the path names, if this request's key made it (else a 404)."""
        rid = request.path_params["response_id"]
        stored = self.store.get(rid, principal_of(request.scope).name)
        if stored is None:
            raise _not_found(rid)
        return rid, stored

    async def by_id(self, request: Request) -> Response:
        if request.method == "DELETE":
            return await self.delete(request)
        return await self.retrieve(request)

    async def retrieve(self, request: Request) -> Response:
        _, stored = self._stored(request)
        if request.query_params.get("stream", "false").lower() != "false":
            raise BadRequest("streaming a stored response again is not supported",
                             param="stream", code="unsupported_parameter")
        return Response(stored.response, media_type="application/json")

    async def delete(self, request: Request) -> Response:
        rid, _ = self._stored(request)
        await self.background.cancel(rid)
        self.store.delete(rid, principal_of(request.scope).name)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    async def cancel(self, request: Request) -> Response:
        rid, stored = self._stored(request)
        if not stored.head().background:
            raise BadRequest("Cannot cancel a synchronous response.", param="response_id")
        await self.background.cancel(rid)  # a finished one is answered as it is
        final = self.store.get(rid, stored.owner)
        if final is None:
            raise _not_found(rid)
        return Response(final.response, media_type="application/json")

    async def input_items(self, request: Request) -> Response:
        """The conversation's input items (earlier turns included), newest first unless
        ``order=asc``; ``limit`` (1-100, default 20), ``after`` and ``before`` page."""
        _, stored = self._stored(request)
        limit = _query_int(request, "limit", 20, 1, 100)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequest(f"'order' must be 'asc' or 'desc', got '{order}'", param="order",
                             code="invalid_value")
        items = stored.input_items()
        if order == "desc":
            items.reverse()
        ids = [item.id for item in items]
        for name in ("after", "before"):
            at = request.query_params.get(name)
            if at is not None and at not in ids:
                raise BadRequest(f"'{name}' names no item of this response: '{at}'",
                                 param=name, code="invalid_value")
        after, before = request.query_params.get("after"), request.query_params.get("before")
        start = ids.index(after) + 1 if after is not None else 0
        end = ids.index(before) if before is not None else len(items)
        page = items[start:min(end, start + limit)]
        data = msgspec.to_builtins(page)
        return JSONResponse({"object": "list", "data": data,
                             "first_id": data[0]["id"] if data else "",
                             "last_id": data[-1]["id"] if data else "",
                             "has_more": start + limit < end})

    async def input_tokens(self, request: Request) -> Response:
        """The prompt's token count as the model's template renders this input with its
        tools: what a create with the same fields reports as ``usage.input_tokens``."""
        body = await read_body(request, ResponseInput, self.max_body_bytes)
        gen, _ = prompt_generate(body, f"count-{request_id()}",
                                 self._prior(body.previous_response_id,
                                             principal_of(request.scope).name))
        message = Tokenize(id=gen.id, messages=gen.messages, tools=gen.tools,
                           template_kwargs=gen.template_kwargs, add_generation_prompt=True)

        async def work(link: WorkerLink, _: LoraRef | None) -> Any:
            return await link.tokenize(message)

        try:
            _, result = await self.relay.call(request, ENDPOINT, body.model, "generate", work)
        except APIError as err:
            raise _as_input(err) from None
        return JSONResponse({"object": "response.input_tokens",
                             "input_tokens": len(result.token_ids)})
