"""``/metrics`` (Prometheus text, or OpenMetrics when the scraper asks) and ``/v1/metrics``
(the same figures as JSON, per model), and the wrapper that counts the requests a
protocol route refuses before they reach the relay.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.exposition import choose_encoder
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.access.admission import Principal, principal_of
from router.api.wire import JSONResponse
from router.errors import APIError
from router.lifecycle.replica import link_of
from router.observe.metrics import UNKNOWN_MODEL, Metrics, RequestMark, current_request, snapshot
from router.registry import ModelEntry
from router.workers.link import WorkerLink

Endpoint = Callable[[Request], Awaitable[Response]]


def endpoint_name(path: str) -> str:
    """The relay's name for a route's requests: the first segment after the version, if
    any (``/v1/chat/completions`` → ``chat``, ``/v2/rerank`` and ``/rerank`` → ``rerank``)."""
    return re.sub(r"^/(v\d+/)?", "", path).split("/")[0]


class SeenBy:
    """A registry's families with only the samples whose labels ``keep`` accepts (what
    ``prometheus_client``'s encoders and ``snapshot`` read: ``collect``)."""

    def __init__(self, registry: CollectorRegistry, keep: Callable[[dict[str, str]], bool]
                 ) -> None:
        self.registry = registry
        self.keep = keep

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [s for s in family.samples if self.keep(s.labels)]
            yield kept


class MetricsAPI:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def routes(self) -> list[Route]:
        return [
            Route("/metrics", self.exposition, methods=["GET"]),
            Route("/v1/metrics", self.snapshot, methods=["GET"]),
        ]

    async def exposition(self, request: Request) -> Response:
        await self.ask_engines()
        # prometheus_client picks the format: OpenMetrics if the scraper asks, else text
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(self.seen_by(principal_of(request.scope))),
                        media_type=content_type)

    async def snapshot(self, request: Request) -> Response:
        await self.ask_engines()
        return JSONResponse(snapshot(self.seen_by(principal_of(request.scope)).collect()))

    def seen_by(self, principal: Principal) -> SeenBy | CollectorRegistry:
        """The figures ``principal`` may read (``router.access.rules``): per-key series of its
        own key only unless it sees all (an admin or a viewer), and nothing of a model
        outside its globs."""
        if principal.sees_all and not principal.limits.models:
            return self.metrics.registry
        names = self.metrics.models.names_of  # a model's or an adapter's id and aliases

        def keep(labels: dict[str, str]) -> bool:
            key = labels.get("key")
            # Per-key series carry no model: a key limited to some models (a viewer too)
            # would read other models' traffic in another key's totals.
            if key is not None and key != principal.name and (
                    not principal.sees_all or principal.limits.models):
                return False
            model = labels.get("model")
            return (model is None or not principal.limits.models
                    or principal.limits.allows(names(model)))

        return SeenBy(self.metrics.registry, keep)

    async def ask_engines(self) -> None:
        """The engines' own figures, from every ready worker at once (a ping, which is not
        work: it keeps no model from its idle stop); a worker that does not answer within
        a second is left out of this scrape."""

        async def ask(entry: ModelEntry, link: WorkerLink) -> None:
            try:
                entry.engine_in_flight = (await asyncio.wait_for(link.ping(), 1)).in_flight
            except (APIError, TimeoutError):
                entry.engine_in_flight = None

        await asyncio.gather(*(ask(e, link) for e in self.metrics.models
                               if e.state == "ready" and (link := link_of(e)) is not None))

    def counted(self, routes: list[Route]) -> list[Route]:
        """``routes`` whose refusals before the relay (a body that does not decode, a bad
        field) are counted too; the relay counts every request it sees."""
        return [Route(r.path, self._counting(r.endpoint, endpoint_name(r.path)),
                      methods=r.methods) for r in routes]

    def _counting(self, inner: Endpoint, endpoint: str) -> Endpoint:
        async def counting(request: Request) -> Response:
            mark = RequestMark()
            token = current_request.set(mark)
            try:
                response = await inner(request)
            except Exception:
                if not mark.counted:  # a bug: the app's handler answers it with a 500
                    self.metrics.request(endpoint, UNKNOWN_MODEL, 500)
                raise
            finally:
                current_request.reset(token)
            # A stream is counted when it ends, after this returns; its status here is 200.
            if response.status_code >= 400 and not mark.counted:
                self.metrics.request(endpoint, UNKNOWN_MODEL, response.status_code)
            return response

        return counting
