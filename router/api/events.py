"""What an operator watches: ``GET /v1/events`` (the event bus as server-sent events) and
``GET /v1/models/{id}/logs`` (a worker's log: its last lines, then, with ``follow``, the
lines as they are written).

Both stream only when asked (``Accept: text/event-stream`` for events, ``follow=1`` for
logs); otherwise they answer JSON at once, so a plain ``GET`` never hangs. A stream sends
a comment every ``keepalive_every`` seconds (proxies and browsers keep it open) and ends
when the client goes: Starlette cancels the body on ``http.disconnect``. A stream whose
client stops reading is ended by ``EventStream``'s ``send_timeout``, never blocking the
bus, which drops the slow subscriber's oldest events meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.access.admission import Principal, principal_of, still_admitted
from router.api.sse import EventStream, encode_json
from router.api.wire import JSONResponse
from router.errors import BadRequest, ModelNotFound
from router.lifecycle.supervisor import Supervisor
from router.observe.events import Event, EventBus, Subscription

MAX_LINES = 10_000
TAIL_BYTES = 4 << 20
"""How far back from a log's end its last lines are looked for."""
LONGEST_LINE = 64 << 10
"""A line with no newline after this many bytes is sent as it is (a progress bar)."""
KEEPALIVE = b": keep-alive\n\n"
LOG_READERS = 2
"""Threads that read logs for every follower together: they never take the default
executor's threads, which the supervisor needs to reap workers."""


def seen_by(event: Event, principal: Principal,
            names_of: Callable[[str], list[str]] = lambda model: [model]) -> Event | None:
    """``event`` as ``principal`` may see it: nothing of a model outside its globs
    (``names_of``: a model id's names); an admin or a viewer, whole; a user, its own
    requests and batches only, and a failure's reason without the log tail under it (a
    worker's log can quote other users' prompts). Another key's batch is shown as its
    per-key metrics are (``router.api.metrics``): to an admin or a viewer held to no
    model globs, whose lines could be of any model."""
    if event["type"] == "batch" and event.get("key") != principal.name and (
            not principal.sees_all or principal.limits.models):
        return None
    model = event.get("model")
    if principal.limits.models and model and model != "-" and not principal.limits.allows(
            names_of(model)):
        return None  # a model outside the key's globs does not exist for it
    other = event.get("for")  # an eviction names the model it made room for
    if principal.limits.models and other and not principal.limits.allows(names_of(other)):
        event = {**event, "for": "-", "reason": "room for another model"}
    if principal.sees_all:
        return event
    if event["type"] == "request":
        return event if event.get("key") == principal.name else None
    if event.get("error"):
        return {**event, "error": first_line(event["error"])}
    return event


def first_line(text: str) -> str:
    return text.split("\n", 1)[0]


def sse_event(event: Event) -> bytes:
    head = f"id: {event['id']}\n" if event.get("id") is not None else ""
    return (head + f"event: {event['type']}\n").encode() + b"data: " + encode_json(event) + b"\n\n"


def last_lines(path: Path, count: int) -> tuple[list[str], int, int]:
    """The last ``count`` lines of ``path`` (at most ``TAIL_BYTES`` back), the offset
    after the last complete line, and the file's inode (0: there is no file yet)."""
    try:
        with open(path, "rb") as f:
            inode = os.fstat(f.fileno()).st_ino
            end = f.seek(0, os.SEEK_END)
            start = max(0, end - TAIL_BYTES)
            f.seek(start)
            data = f.read(end - start)
    except FileNotFoundError:
        return [], 0, 0
    complete = data.rfind(b"\n") + 1  # a partial last line is sent once it ends
    lines = data[:complete].decode("utf-8", "replace").splitlines()
    if start > 0 and lines:
        lines = lines[1:]  # the first may be cut
    return lines[-count:] if count else [], start + complete, inode


class LogFollower:
    """Reads what is appended to a log after ``offset``, line by line; a log replaced
    (another inode) or truncated (shorter than read so far) is read again from its start."""

    def __init__(self, path: Path, offset: int, inode: int) -> None:
        self.path = path
        self.offset = offset
        self.inode = inode
        self._partial = b""

    def read(self) -> list[str]:
        """Complete lines written since the last call (blocking; run it in a thread)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if st.st_ino != self.inode or st.st_size < self.offset:
            self.inode, self.offset, self._partial = st.st_ino, 0, b""
        if st.st_size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = self._partial + f.read(min(st.st_size - self.offset, TAIL_BYTES))
        self.offset += len(data) - len(self._partial)
        complete = data.rfind(b"\n") + 1
        self._partial = data[complete:]
        lines = data[:complete].decode("utf-8", "replace").splitlines()
        if len(self._partial) > LONGEST_LINE:
            lines.append(self._partial.decode("utf-8", "replace"))
            self._partial = b""
        return lines


def _query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise BadRequest(f"query parameter '{name}' must be an integer from {low} to {high}",
                         param=name, code="invalid_value")
    return value


def _query_bool(request: Request, name: str) -> bool:
    raw = request.query_params.get(name, "0")
    if raw in ("1", "true"):
        return True
    if raw in ("0", "false"):
        return False
    raise BadRequest(f"query parameter '{name}' must be 1 or 0 (true or false)", param=name,
                     code="invalid_value")


class EventsAPI:
    """``/v1/events`` and ``/v1/models/{id}/logs``."""

    keepalive_every = 15.0
    activity_every = 1.0
    """Seconds between looks at each model's in-flight and queued counts (they change per
    request, which publishes nothing until it ends)."""
    log_poll = 0.2

    def __init__(self, supervisor: Supervisor, bus: EventBus) -> None:
        self.supervisor = supervisor
        self.bus = bus
        self._readers = ThreadPoolExecutor(LOG_READERS, thread_name_prefix="modelyard-logs")

    def close(self) -> None:
        """The server stops: no more log reads (a follower's stream ends with it)."""
        self._readers.shutdown(wait=False, cancel_futures=True)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/events", self.events, methods=["GET"]),
            # Before admin's "/v1/models/{model_id:path}", which would take it.
            Route("/v1/models/{model_id:path}/logs", self.logs, methods=["GET"]),
        ]

    async def events(self, request: Request) -> Response:
        replay = _query_bool(request, "replay") if "replay" in request.query_params else True
        principal = principal_of(request.scope)
        # Taken together, with no await between: the replay and the live events neither
        # overlap nor leave a gap.
        recent = [seen for e in self.bus.recent
                  if (seen := seen_by(e, principal, self._names)) is not None] if replay else []
        if "text/event-stream" not in request.headers.get("accept", ""):
            return JSONResponse({"object": "list", "data": recent})
        sub = self.bus.subscribe(replay=False)
        return EventStream(self._event_stream(sub, recent, principal,
                                              still_admitted(request.scope)),
                           self.supervisor.server.send_timeout)

    def _names(self, model: str) -> list[str]:
        """A model's id and aliases (an id no longer configured: itself)."""
        return self.supervisor.registry.names_of(model)

    def _activity(self, principal: Principal) -> dict[str, dict[str, int]]:
        return {e.id: {"in_flight": e.leases, "queued": e.queued}
                for e in self.supervisor.registry if principal.limits.allows(e.names)}

    async def _event_stream(self, sub: Subscription, recent: list[Event],
                            principal: Principal, admitted: Callable[[], bool]
                            ) -> AsyncGenerator[bytes, None]:
        """The recent events (marked ``replayed``), then ``hello`` (live from here on, with
        every model's state and counts now), then events as they are published, and
        ``activity`` when a model's in-flight or queued count changed."""
        loop = asyncio.get_running_loop()
        sent = self._activity(principal)
        quiet_since = loop.time()
        try:
            if recent:
                yield b"".join(sse_event({**e, "replayed": True}) for e in recent)
            yield sse_event({"type": "hello", "id": None, "time": round(time.time(), 3),
                             "model": None, "activity": sent,
                             "states": {e.id: {"state": e.state, "pid": e.pid}
                                        for e in self.supervisor.registry
                                        if principal.limits.allows(e.names)}})
            while True:
                event = await sub.get(timeout=self.activity_every)
                if not admitted():  # its key was revoked (or changed) meanwhile: it ends
                    return
                if event is not None and (
                        event := seen_by(event, principal, self._names)) is not None:
                    yield sse_event(event)
                    quiet_since = loop.time()
                now = self._activity(principal)
                if now != sent:
                    sent = now
                    yield sse_event({"type": "activity", "id": None,
                                     "time": round(time.time(), 3), "model": None,
                                     "activity": now})
                    quiet_since = loop.time()
                elif loop.time() - quiet_since >= self.keepalive_every:
                    yield KEEPALIVE
                    quiet_since = loop.time()
        finally:
            sub.close()

    async def logs(self, request: Request) -> Response:
        lines = _query_int(request, "lines", 100, 0, MAX_LINES)
        follow = _query_bool(request, "follow")
        name = request.path_params["model_id"]
        entry = self.supervisor.registry.entries.get(name)
        if entry is None or not principal_of(request.scope).limits.allows(entry.names):
            # exact ids, as GET /v1/models/{id}; one outside the key's globs does not exist
            raise ModelNotFound(f"The model '{name}' does not exist", param="model")
        path = self.supervisor.log_path(entry)
        found, offset, inode = await asyncio.get_running_loop().run_in_executor(
            self._readers, last_lines, path, lines)
        if not follow:
            return JSONResponse({"object": "list", "model": entry.id, "data": found})
        follower = LogFollower(path, offset, inode)
        return EventStream(self._log_stream(entry.id, found, follower,
                                            still_admitted(request.scope)),
                           self.supervisor.server.send_timeout)

    async def _log_stream(self, model: str, first: list[str], follower: LogFollower,
                          admitted: Callable[[], bool]) -> AsyncGenerator[bytes, None]:
        loop = asyncio.get_running_loop()
        quiet_since = loop.time()
        pending = first
        while admitted():  # a key revoked meanwhile: the stream ends
            if pending:
                yield b"".join(b"event: line\ndata: " + encode_json({"model": model, "line": line})
                               + b"\n\n" for line in pending)
                quiet_since = loop.time()
            elif loop.time() - quiet_since >= self.keepalive_every:
                yield KEEPALIVE
                quiet_since = loop.time()
            await asyncio.sleep(self.log_poll)
            try:
                pending = await loop.run_in_executor(self._readers, follower.read)
            except OSError:  # unreadable for a moment (being replaced): look again next time
                pending = []
