"""The status page: ``GET /`` and its assets under ``/static/`` (``router/static``).

Plain HTML, CSS and JavaScript, no build step and nothing fetched from elsewhere. The
page holds no data: it reads ``/v1/models`` once, then follows ``/v1/events`` and the
worker logs, sending the API key the operator typed as ``Authorization``. So the page and
its assets need no key (``router.access.admission``), and every route it calls still does.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent.parent / "static"
STATIC_PREFIX = "/static"


class StatusPage:
    def __init__(self, directory: Path = STATIC) -> None:
        self.directory = directory
        self._index = (directory / "index.html").read_bytes()  # at build time: a wheel
        # without its page fails at start, not at the first visit

    def routes(self) -> list[BaseRoute]:
        return [Route("/", self.index, methods=["GET"]),
                Mount(STATIC_PREFIX, StaticFiles(directory=self.directory), name="static")]

    async def index(self, request: Request) -> Response:
        return Response(self._index, media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})
