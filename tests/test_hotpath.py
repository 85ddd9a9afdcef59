"""The hot path (``router/api/hotpath.py``) answers exactly as Starlette's path does, and a
client that leaves before its first batch still cancels its generation.

In-process: the app from ``build_app`` driven over ASGI, once with the hot path and once
with it emptied (every request then takes Starlette's routing), with a worker's end of
the socket in this process where a case needs one.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from starlette.applications import Starlette
from starlette.responses import Response

from router.api.hotpath import HOT_PATHS, HotPath
from router.api.relay import WATCH_AFTER, Relay
from router.api.wire import JSONResponse
from router.app import build_app
from router.workers.link import WorkerLink
from shared.preset_loader import build_preset
from shared.protocol import Cancel, Generate, worker_codec
from tests.conftest import connected_peer, from_router
from tests.test_limits import serve

ASGIMessage = MutableMapping[str, Any]
CHAT = b'{"model": "chat-a", "messages": [{"role": "user", "content": "hi"}]}'


def make_app(hot: bool, tmp_path: Path, **server: Any) -> Starlette:
    """``build_app`` for two declared models (no worker runs); ``hot=False`` empties the
    hot path, so its paths go through Starlette's router."""
    runtime = tmp_path / ("hot" if hot else "cold")
    runtime.mkdir(mode=0o700)
    app = build_app(build_preset({
        "server": {"runtime_dir": str(runtime), "max_body_bytes": 2000, **server},
        "models": {"chat-a": {"model": "/a"}, "embed": {"model": "/e", "task": "embed"}}}))
    app.middleware_stack = app.build_middleware_stack()
    layer: Any = app.middleware_stack
    while not isinstance(layer, HotPath):
        layer = layer.app
    if not hot:
        layer.handlers.clear()
    app.state.hot_path = layer
    return app


async def call(app: Starlette, path: str, body: bytes | list[bytes], *,
               method: str = "POST", headers: list[tuple[bytes, bytes]] | None = None,
               leave: Awaitable[None] | None = None,
               sent: list[ASGIMessage] | None = None) -> list[ASGIMessage]:
    """One request as uvicorn sends it: ``body`` (a list: a chunked upload), then
    ``http.disconnect`` once ``leave`` is done (by default, once the response ends);
    what the app sends goes in ``sent``, which is returned."""
    chunks = body if isinstance(body, list) else [body]
    if headers is None:
        headers = [(b"content-type", b"application/json")]
        if not isinstance(body, list):
            headers.append((b"content-length", str(len(body)).encode()))
    sent = [] if sent is None else sent
    ended = asyncio.Event()
    queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
             for i, c in enumerate(chunks)]

    async def receive() -> ASGIMessage:
        if queue:
            return queue.pop(0)
        await (leave if leave is not None else ended.wait())
        return {"type": "http.disconnect"}

    async def send(message: ASGIMessage) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            ended.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "headers": [(b"host", b"x"), *headers],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "state": {}}
    await app(scope, receive, send)
    return sent


def answer(sent: list[ASGIMessage]) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], list(start["headers"]), body


def chunked() -> list[bytes]:
    return [b'{"model": "chat-a", "messages": [{"role": "user", "content": "', b"x" * 1500,
            b"x" * 1500, b'"}]}']


CASES: list[tuple[str, bytes | list[bytes], list[tuple[bytes, bytes]] | None, str]] = [
    ("/v1/chat/completions", b"{not json", None, "POST"),
    ("/v1/chat/completions", b"", None, "POST"),
    ("/v1/chat/completions", b"   ", None, "POST"),
    ("/v1/chat/completions", b'{"model": "chat-a", "messages": "x"}', None, "POST"),
    ("/v1/chat/completions", b'{"model": "chat-a", "messages": []}', None, "POST"),
    ("/v1/chat/completions", (b'{"model": "nope", "messages": [{"role": "user", '
     b'"content": "x"}]}'), None, "POST"),
    ("/v1/chat/completions", (b'{"model": "embed", "messages": [{"role": "user", '
     b'"content": "x"}]}'), None, "POST"),
    ("/v1/chat/completions", b"[1, 2]", None, "POST"),
    ("/v1/chat/completions", (b'{"model": "chat-a", "messages": [{"role": "user", '
     b'"content": "x"}], "n": 0}'), None, "POST"),
    ("/v1/chat/completions", CHAT, [(b"content-type", b"text/plain; charset=utf-8")], "POST"),
    ("/v1/chat/completions", CHAT, [(b"content-type", b"application/json"),
                                    (b"content-length", b"999999")], "POST"),
    ("/v1/chat/completions", chunked(), None, "POST"),
    ("/v1/chat/completions", b"", None, "GET"),
    ("/v1/chat/completions/", CHAT, None, "POST"),
    ("/v1/completions", b'{"model": "chat-a"}', None, "POST"),
    ("/v1/completions", b'{"model": "chat-a", "prompt": [[1, 2]], "echo": true}', None,
     "POST"),
    ("/v1/completions", b'{"model": "chat-a", "prompt": ["a", "b"], "n": 200}', None, "POST"),
    ("/v1/completions", b'{"model": "embed", "prompt": "x"}', None, "POST"),
    ("/v1/completions", b'{"model": "chat-a", "prompt": "x", "max_tokens": -1}',
     [(b"content-type", b"application/vnd.api+json")], "POST"),
    ("/v1/completions", b"\xff\xfe", None, "POST"),
]


def test_the_hot_path_answers_as_starlette_does(tmp_path: Path) -> None:
    """Every refusal of the two hot endpoints (bad JSON, a field, 415, 413 declared and
    chunked, unknown or wrong model, 405, a trailing slash) is the same status, headers
    and body either way, and is counted the same; the hot path was the one taken."""

    async def run(hot: bool) -> tuple[list[Any], Any]:
        app = make_app(hot, tmp_path)
        taken: list[tuple[str, str]] = []
        starlette = app.state.hot_path.app

        async def through_starlette(scope: Any, receive: Any, send: Any) -> None:
            taken.append((scope["method"], scope["path"]))
            await starlette(scope, receive, send)

        app.state.hot_path.app = through_starlette
        answers = [answer(await call(app, path, body, method=method, headers=headers))
                   for path, body, headers, method in CASES]
        hot_cases = [(m, p) for p, _, _, m in CASES if m == "POST" and p in HOT_PATHS]
        if hot:  # only the others reached Starlette's router
            assert len(hot_cases) > 10 and not set(hot_cases) & set(taken), taken
        else:
            assert len(taken) == len(CASES)
        metrics = app.state.metrics.snapshot()
        return answers, metrics

    hot, hot_metrics = asyncio.run(run(True))
    cold, cold_metrics = asyncio.run(run(False))
    for case, h, c in zip(CASES, hot, cold, strict=True):
        assert h == c, case
    assert hot_metrics == cold_metrics
    assert {status for status, _, _ in hot} == {400, 404, 405, 307, 413, 415}
    assert hot_metrics["models"]["-"]["requests"]["chat"]["400"] >= 5


def raw_request(path: str, body: bytes | list[bytes], method: str,
                headers: list[tuple[bytes, bytes]] | None) -> bytes:
    """``call``'s request as the bytes a client sends (a list: chunked transfer)."""
    head = [b"%s %s HTTP/1.1" % (method.encode(), path.encode()), b"Host: x"]
    given = headers if headers is not None else [(b"content-type", b"application/json")]
    head += [name + b": " + value for name, value in given]
    if isinstance(body, list):
        head.append(b"Transfer-Encoding: chunked")
        payload = b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in body) + b"0\r\n\r\n"
    else:
        if headers is None or not any(n == b"content-length" for n, _ in headers):
            head.append(b"Content-Length: %d" % len(body))
        payload = body
    return b"\r\n".join(head) + b"\r\n\r\n" + payload


def test_the_hot_path_writes_the_same_bytes_as_starlette_over_http(tmp_path: Path) -> None:
    """Through the router's HTTP protocol, where the hot path writes a whole JSON answer
    with ``RouterCycle.respond`` instead of two ASGI messages: every case is the same
    bytes on the wire, and the same connection state (closed or kept)."""

    async def run(hot: bool) -> list[tuple[bytes, bool]]:
        app = make_app(hot, tmp_path)
        out = []
        for path, body, headers, method in CASES:
            transport = await serve(app, raw_request(path, body, method, headers))
            for _ in range(200):
                if transport.writes and b"\r\n\r\n" in b"".join(transport.writes):
                    break
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.01)  # anything written after the answer, too
            out.append((b"".join(transport.writes), transport.closed))
        return out

    hot, cold = asyncio.run(run(True)), asyncio.run(run(False))
    for case, h, c in zip(CASES, hot, cold, strict=True):
        assert h == c, case
    statuses = {int(raw.split(b" ", 2)[1]) for raw, _ in hot}
    assert statuses == {400, 404, 405, 307, 413, 415}, statuses


@pytest.mark.parametrize(("status", "headers", "media"), [
    (200, None, None), (400, None, None), (503, {"Retry-After": "1"}, None),
    (204, None, None), (200, None, "application/problem+json")])
def test_json_response_heads_as_starlette_s(status: int, headers: dict[str, str] | None,
                                            media: str | None) -> None:
    """``JSONResponse`` builds its usual two headers itself; every case reads as
    Starlette's own ``init_headers`` would have made it."""
    ours = JSONResponse({"a": 1}, status_code=status, headers=headers, media_type=media)
    theirs = Response(ours.body, status_code=status, headers=headers,
                      media_type=media or "application/json")
    assert ours.raw_headers == theirs.raw_headers


@pytest.mark.parametrize("hot", [True, False])
def test_a_bug_is_the_same_500_either_way(hot: bool, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Relay, "generate", broken)
    app = make_app(hot, tmp_path)
    sent: list[ASGIMessage] = []
    with pytest.raises(RuntimeError, match="a bug"):  # re-raised for uvicorn to log
        asyncio.run(call(app, "/v1/chat/completions", CHAT, sent=sent))
    status, headers, body = answer(sent)
    assert (status, body) == (500, (b'{"error":{"message":"internal error: RuntimeError",'
                                   b'"type":"server_error","param":null,"code":null}}'))
    assert headers == [(b"content-length", str(len(body)).encode()),
                       (b"content-type", b"application/json")]
    assert app.state.metrics.snapshot()["models"]["-"]["requests"] == {
        "chat": {"500": 1}}


def test_a_late_body_is_the_same_408_either_way(tmp_path: Path) -> None:
    """The router's HTTP protocol keeps the body deadline (``read_timeout``): a body still
    missing then is the same 408, closing the connection, on either path, not before the
    deadline and soon after it (the sweep runs every quarter of it)."""

    async def run(hot: bool) -> tuple[bytes, float, bool]:
        app = make_app(hot, tmp_path, read_timeout=0.2)
        start = time.monotonic()
        transport = await serve(app, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                                     b"Content-Type: application/json\r\n"
                                     b"Content-Length: 100\r\n\r\n{", read_timeout=0.2)
        while not transport.writes and time.monotonic() - start < 5:
            await asyncio.sleep(0.005)
        return b"".join(transport.writes), time.monotonic() - start, transport.closed

    (hot, hot_after, hot_closed), (cold, cold_after, cold_closed) = (
        asyncio.run(run(True)), asyncio.run(run(False)))
    assert hot == cold and hot.startswith(b"HTTP/1.1 408"), (hot, cold)
    head, _, body = hot.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower() and hot_closed and cold_closed
    assert msgspec.json.decode(body)["error"]["code"] == "request_timeout"
    # Never early; a sweep (0.05 s here) late, plus room for a busy CI machine.
    assert 0.2 <= hot_after < 0.6 and 0.2 <= cold_after < 0.6, (hot_after, cold_after)


Scenario = Callable[[Starlette, WorkerLink, Any], Awaitable[None]]


class LinkOnly:
    """A replica that is its link alone (no process): what ``link_of`` and policy read."""

    def __init__(self, link: WorkerLink) -> None:
        self.link = link

    @property
    def busy(self) -> bool:
        return self.link.busy


def with_worker_end(tmp_path: Path, hot: bool, scenario: Scenario) -> None:
    """``scenario(app, link, peer)`` with ``chat-a`` ready on a link whose worker's end
    (``peer``, a socket in this process) answers nothing unless told to."""

    async def run() -> None:
        app = make_app(hot, tmp_path)
        sup = app.state.supervisor
        endpoint = f"ipc://{tmp_path}/w-{hot}.sock"
        link = WorkerLink(sup._ctx, endpoint, "chat-a")
        peer = await connected_peer(sup._ctx, link, endpoint)
        entry = app.state.registry.entries["chat-a"]
        entry.state, entry.replica = "ready", LinkOnly(link)
        try:
            await scenario(app, link, peer)
        finally:
            link.close()
            peer.close(0)

    try:
        asyncio.run(run())
    finally:
        shutil.rmtree(tmp_path / ("hot" if hot else "cold"), ignore_errors=True)


async def received(peer: Any, count: int) -> list[object]:
    got: list[object] = []
    for _ in range(300):
        try:
            got.append(from_router(peer))
        except zmq.Again:
            if len(got) >= count:
                break
            await asyncio.sleep(0.01)
    return got


@pytest.mark.parametrize("hot", [True, False])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("after", [0.0, WATCH_AFTER * 10])
def test_leaving_before_the_first_batch_cancels_the_generation(
        tmp_path: Path, hot: bool, stream: bool, after: float) -> None:
    """At once (before the watcher would start) or later: the worker is told to cancel,
    the slot is free again and the request is counted as 499."""

    async def scenario(app: Starlette, link: WorkerLink, peer: Any) -> None:
        body = (b'{"model": "chat-a", "stream": %s, "messages": [{"role": "user", '
                b'"content": "hi"}]}' % (b"true" if stream else b"false"))
        leave = asyncio.ensure_future(asyncio.sleep(after))
        request = asyncio.ensure_future(call(app, "/v1/chat/completions", body, leave=leave))
        got = await received(peer, 2)
        await asyncio.wait_for(request, 5)
        assert [type(m) for m in got] == [Generate, Cancel]
        assert isinstance(got[0], Generate) and isinstance(got[1], Cancel)
        assert got[1].id == got[0].id
        entry = app.state.registry.entries["chat-a"]
        assert entry.leases == 0 and not link.busy
        counted = app.state.metrics.snapshot()["models"]["chat-a"]["requests"]
        assert counted == {"chat": {"499": 1}}

    with_worker_end(tmp_path, hot, scenario)


@pytest.mark.parametrize("hot", [True, False])
def test_a_one_batch_answer_is_the_same_either_way(tmp_path: Path, hot: bool) -> None:
    """The worker answers at once: a 200 with the chat body, no cancel, counted once."""
    from shared.protocol import Delta, Deltas

    async def scenario(app: Starlette, link: WorkerLink, peer: Any) -> None:
        request = asyncio.ensure_future(call(app, "/v1/chat/completions", CHAT))
        (gen,) = await received(peer, 1)
        assert isinstance(gen, Generate)
        peer.send(worker_codec().encode(Deltas(items=[Delta(id=gen.id, text="hello", tokens=1,
                                                   finish_reason="stop", prompt_tokens=3)])))
        status, headers, body = answer(await asyncio.wait_for(request, 5))
        assert status == 200
        assert headers == [(b"content-length", str(len(body)).encode()),
                           (b"content-type", b"application/json")]
        assert b'"content":"hello"' in body and b'"total_tokens":4' in body
        assert await received(peer, 0) == []  # nothing to cancel
        counted = app.state.metrics.snapshot()["models"]["chat-a"]["requests"]
        assert counted == {"chat": {"200": 1}}

    with_worker_end(tmp_path, hot, scenario)


def test_one_turns_requests_travel_as_one_message(tmp_path: Path) -> None:
    """``WorkerLink``: what is sent in one loop turn is one ZeroMQ message (a frame per
    request, then an empty frame), so the worker sees nothing until the turn ends; the
    next turn is a message of its own; closing the link still sends what it holds."""
    from shared.protocol import SamplingSpec, Shutdown

    async def scenario() -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        endpoint = f"ipc://{tmp_path}/w.sock"
        link = WorkerLink(ctx, endpoint, "m")
        peer = await connected_peer(ctx, link, endpoint)
        for i in range(3):
            link.submit([Generate(id=f"g{i}", prompt="p", sampling=SamplingSpec())])
        time.sleep(0.05)  # noqa: ASYNC251  # on purpose: the turn goes on, ZeroMQ runs
        with pytest.raises(zmq.Again):
            peer.recv(zmq.NOBLOCK)  # the turn is not over: nothing delivered
        await asyncio.sleep(0)  # the turn ends
        frames: list[Any] = []
        for _ in range(100):
            try:
                frames.append(peer.recv(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                if frames:
                    break
                await asyncio.sleep(0.01)
        assert [bool(f.more) for f in frames] == [True, True, True, False]
        assert frames[-1].bytes == b""
        assert [worker_codec().decode(f.bytes).id for f in frames[:3]] == ["g0", "g1", "g2"]
        link.cancel("g1")
        link.shutdown()
        link.close()  # before the turn ends: the Cancel and the Shutdown still go
        got = await received(peer, 2)
        assert [type(m) for m in got] == [Cancel, Shutdown]
        peer.close(0)
        ctx.term()

    asyncio.run(scenario())


def test_the_worker_skips_the_end_of_a_turn(caplog: pytest.LogCaptureFixture) -> None:
    """``WorkerServer._drain``: the empty frame that ends a router's turn is no message
    (and no "undecodable message" in the worker's log)."""
    from worker.server import WorkerServer

    handled: list[object] = []

    class Server(WorkerServer):
        def __init__(self) -> None:  # the socket only: no connection, no engine
            self._codec = worker_codec()
            self._drain_scheduled = False
            self._sock = FRAMES  # type: ignore[assignment]

        def _handle(self, message: object) -> None:
            handled.append(message)

    class Frames:
        def __init__(self, frames: list[bytes]) -> None:
            self.frames = [zmq.Frame(f) for f in frames]

        def recv(self, flags: int = 0, copy: bool = True) -> zmq.Frame:
            if not self.frames:
                raise zmq.Again
            return self.frames.pop(0)

    from shared.protocol import Ping, router_codec

    ping = router_codec().encode(Ping(id="p1"))
    FRAMES = Frames([ping, b"", ping, b""])
    Server()._drain()
    assert handled == [Ping(id="p1"), Ping(id="p1")]
    assert not caplog.records
