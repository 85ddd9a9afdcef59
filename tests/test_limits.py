"""Admission limits (issue 8): a token bucket per client, X-Forwarded-For only from trusted
proxies, a cap on requests in flight, a deadline for request bodies.

Unit tests drive the buckets with a fake clock and the middleware in-process; the
integration tests start their own routers, whose model is never loaded (every request
here is answered before a model is touched).
"""

from __future__ import annotations

import asyncio
import socket
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.access.admission import Keys
from router.access.buckets import MAX_CLIENTS, TokenBuckets
from router.access.limits import ConnectionCap, middleware_stack
from router.access.rules import ROLES, AccessRules, Rule
from router.api.http_protocol import http_protocol
from shared.config import ServerConfig
from tests.conformance import validate
from tests.conftest import RouterProcess, running_router


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the buckets ---------------------------------------------------------------------------

def test_a_burst_gets_exactly_the_limit_then_waits_for_the_next_token() -> None:
    clock = FakeClock()
    buckets = TokenBuckets(5, clock=clock)
    assert [buckets.take("a") for _ in range(6)] == [4, 3, 2, 1, 0, -1]
    assert buckets.retry_after("a") == 12  # 5 a minute: one token every 12 s
    clock.now += 6
    assert buckets.take("a") == -1 and buckets.retry_after("a") == 6
    clock.now += 6
    assert buckets.take("a") == 0 and buckets.take("a") == -1
    clock.now += 11.9
    assert buckets.take("a") == -1 and buckets.retry_after("a") == 1  # never 0
    assert buckets.take("b") == 4  # another client, its own bucket


def test_burst_is_the_bucket_size_and_refill_never_overflows_it() -> None:
    clock = FakeClock()
    buckets = TokenBuckets(60, burst=3, clock=clock)
    assert [buckets.take("a") for _ in range(4)] == [2, 1, 0, -1]
    assert buckets.retry_after("a") == 1
    clock.now += 3600  # an hour idle refills to the burst, not to 3600 tokens
    assert [buckets.take("a") for _ in range(4)] == [2, 1, 0, -1]
    clock.now += 0.5  # half a token is not a request
    assert buckets.take("a") == -1
    clock.now += 0.5
    assert buckets.take("a") == 0


def test_memory_is_bounded_under_many_distinct_clients() -> None:
    clock = FakeClock()
    buckets = TokenBuckets(5, max_clients=10_000, clock=clock)
    for i in range(25_000):
        buckets.take(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}")
        if i % 100 == 0:
            buckets.take("kept")  # seen recently: never the one dropped
    assert len(buckets) == 10_000
    assert buckets.take("kept") == -1  # still tracked, not a fresh bucket
    assert buckets.take("10.0.0.0") == 4  # the oldest went first and starts full again

    tracemalloc.start()
    big = TokenBuckets(5, clock=clock)
    for i in range(MAX_CLIENTS + 20_000):
        big.take(f"2001:db8:1234:5678:9abc:def0:{i >> 16:04x}:{i & 0xffff:04x}")
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(big) == MAX_CLIENTS
    assert size < 20 * 2**20, size  # the documented bound


# -- the middleware in-process ---------------------------------------------------------

async def whoami(request: Request) -> Response:
    assert request.client is not None
    return PlainTextResponse(request.client.host)


def stacked(keys: Keys | None = None, **server: object) -> Starlette:
    config = msgspec.convert(server, ServerConfig)
    routes = [Route("/whoami", whoami), Route("/health", whoami)]
    rules = AccessRules(routes, {("GET", "/whoami"): Rule(frozenset({"user", "admin"}), ""),
                                 ("GET", "/health"): Rule(frozenset(ROLES), "")})
    return Starlette(routes=routes, middleware=middleware_stack(config, keys or Keys(), rules))


def ask(app: Starlette, peer: str, xff: list[str] | None = None,
        path: str = "/whoami") -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=(peer, 4321))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            headers = [("x-forwarded-for", v) for v in xff or []]
            return await c.get(path, headers=headers)
    return asyncio.run(go())


@pytest.mark.parametrize("trusted,peer,xff,client", [
    ([], "127.0.0.1", ["6.6.6.6"], "127.0.0.1"),                      # nobody trusted
    (["10.0.0.0/8"], "127.0.0.1", ["6.6.6.6"], "127.0.0.1"),          # peer not trusted
    (["127.0.0.1"], "127.0.0.1", ["6.6.6.6"], "6.6.6.6"),
    (["127.0.0.1"], "127.0.0.1", ["6.6.6.6, 1.2.3.4"], "1.2.3.4"),    # right-most untrusted
    (["127.0.0.1", "10.0.0.0/8"], "127.0.0.1", ["6.6.6.6, 1.2.3.4, 10.9.8.7"], "1.2.3.4"),
    (["10.0.0.0/8"], "10.1.2.3", ["1.2.3.4", "10.3.3.3"], "1.2.3.4"),  # two header lines
    (["10.0.0.0/8"], "10.1.2.3", ["10.7.7.7"], "10.7.7.7"),  # all trusted: the left-most
    (["2001:db8::/32"], "2001:db8::1", ["2001:db9::5"], "2001:db9::5"),
    (["127.0.0.1"], "127.0.0.1", [], "127.0.0.1"),
])
def test_forwarded_for_is_believed_only_from_trusted_proxies(
        trusted: list[str], peer: str, xff: list[str], client: str) -> None:
    r = ask(stacked(trusted_proxies=trusted), peer, xff)
    assert r.status_code == 200 and r.text == client


def test_the_rate_limit_counts_the_forwarded_client() -> None:
    app = stacked(rate_limit_per_minute=2, trusted_proxies=["127.0.0.1"])
    assert [ask(app, "127.0.0.1", ["1.1.1.1"]).status_code for _ in range(3)] == [200, 200, 429]
    assert ask(app, "127.0.0.1", ["2.2.2.2"]).status_code == 200
    assert ask(app, "127.0.0.1", []).status_code == 200  # the proxy itself
    for _ in range(5):
        assert ask(app, "127.0.0.1", ["1.1.1.1"], "/health").status_code == 200


def test_a_request_counts_against_the_cap_until_its_body_ends() -> None:
    release = asyncio.Event()
    sent: list[Message] = []

    async def streaming(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b""})

    async def collect(message: Message) -> None:
        sent.append(message)

    async def nothing() -> Message:
        return {"type": "http.request", "body": b""}

    async def go() -> None:
        cap = ConnectionCap(streaming, max_connections=1)
        scope: Scope = {"type": "http", "path": "/v1/chat/completions", "headers": []}
        stream = asyncio.create_task(cap(scope, nothing, collect))
        await asyncio.sleep(0.01)
        assert cap.in_flight == 1 and len(sent) == 2  # headers and a chunk are out
        await cap(scope, nothing, collect)  # a second one is refused while it streams
        assert sent[2]["status"] == 503
        assert (b"retry-after", b"1") in sent[2]["headers"]
        body = msgspec.json.decode(sent[3]["body"])
        assert body["error"]["code"] == "server_overloaded"
        release.set()
        await stream
        assert cap.in_flight == 0

    asyncio.run(go())


# -- against real routers ----------------------------------------------------------------

MODELS = """
models:
  smollm2: {model: "builtin:smollm2", cpu_cores: "0", max_model_len: 512}
"""
KEYED = """
server:
  port: {port}
  api_keys: [k-limit-a, k-limit-b]
  rate_limit_per_minute: 5
""" + MODELS
BY_ADDRESS = """
server:
  port: {port}
  rate_limit_per_minute: 5
  trusted_proxies: [{trusted}]
""" + MODELS
CAPPED = """
server:
  port: {port}
  max_connections: 2
  read_timeout: 1
  keep_alive_timeout: 2
""" + MODELS


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with running_router(KEYED, tmp_path_factory.mktemp("limits"), "keyed") as r:
        yield r


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with running_router(CAPPED, tmp_path_factory.mktemp("limits"), "capped") as r:
        yield r


def models(r: RouterProcess, key: str | None = None,
           xff: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if xff:
        headers["X-Forwarded-For"] = xff
    return r.client.get(r.url + "/v1/models", headers=headers)


def assert_limited(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    validate("ErrorResponse", r.json())
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(r.headers["retry-after"]) <= 12
    assert r.headers["x-ratelimit-remaining-requests"] == "0"


@pytest.mark.integration
def test_a_burst_gets_exactly_the_limit_then_429(keyed: RouterProcess) -> None:
    answers = [models(keyed, "k-limit-a") for _ in range(5)]
    assert [a.status_code for a in answers] == [200] * 5
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == \
        ["4", "3", "2", "1", "0"]
    assert answers[0].headers["x-ratelimit-limit-requests"] == "5"
    assert_limited(models(keyed, "k-limit-a"))
    # Each key has its own bucket, whatever address it comes from.
    assert [models(keyed, "k-limit-b").status_code for _ in range(6)] == [200] * 5 + [429]
    # A stranger is refused by the key check and takes no token; /health is never limited.
    for _ in range(8):
        assert models(keyed, "k-wrong").status_code == 401
        assert keyed.client.get(keyed.url + "/health").status_code == 200


@pytest.mark.integration
@pytest.mark.parametrize("trusted,honoured", [("10.0.0.0/8", False), ("127.0.0.1", True)])
def test_forwarded_for_from_the_router_peer(tmp_path: Path, trusted: str,
                                            honoured: bool) -> None:
    with running_router(BY_ADDRESS, tmp_path, "xff", {"trusted": trusted}) as r:
        answers = [models(r, xff=f"192.0.2.{i}").status_code for i in range(6)]
        if honoured:  # six clients behind the proxy, one request each
            assert answers == [200] * 6
            assert [models(r, xff="192.0.2.0").status_code for _ in range(4)] == [200] * 4
            assert_limited(models(r, xff="192.0.2.0"))
            assert_limited(models(r, xff="192.0.2.77, 192.0.2.0"))  # right-most untrusted
        else:  # the header is ignored: all six are 127.0.0.1
            assert answers == [200] * 5 + [429]
            assert_limited(models(r))


def slow_request(port: int, body_start: bytes = b"{") -> socket.socket:
    """A chat request that announces 100 body bytes and sends ``body_start`` of them."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n" + body_start)
    return sock


def read_answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """Status line and body of the answer, reading until the server closes."""
    sock.settimeout(10)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


@pytest.mark.integration
def test_the_cap_answers_503_and_slow_bodies_get_408(capped: RouterProcess) -> None:
    start = time.monotonic()
    held = [slow_request(capped.port) for _ in range(2)]
    try:
        time.sleep(0.2)  # both are in their handlers, waiting for their bodies
        r = models(capped)
        assert r.status_code == 503, r.text
        validate("ErrorResponse", r.json())
        assert r.json()["error"]["code"] == "server_overloaded"
        assert r.headers["retry-after"] == "1"
        assert capped.client.get(capped.url + "/health").status_code == 200  # not capped
        for sock in held:  # the deadline ends them and closes their connections
            head, body = read_answer(sock)
            assert head.startswith(b"HTTP/1.1 408"), head
            assert b"connection: close" in head.lower()
            assert msgspec.json.decode(body)["error"]["code"] == "request_timeout"
        assert 0.9 < time.monotonic() - start < 5
    finally:
        for sock in held:
            sock.close()
    assert models(capped).status_code == 200  # their places are free again


@pytest.mark.integration
def test_a_trickling_body_gets_408_at_the_deadline(capped: RouterProcess) -> None:
    sock = slow_request(capped.port, b"")
    start = time.monotonic()
    try:
        sock.settimeout(0.25)
        answer = b""
        for _ in range(40):  # a byte every 0.25 s: always arriving, never done in time
            try:
                sock.sendall(b" ")
                answer += sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break  # the router closed the connection
            if b"\r\n\r\n" in answer:
                break
        elapsed = time.monotonic() - start
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert 0.9 < elapsed < 3, elapsed
    finally:
        sock.close()


def closed_after(sock: socket.socket, trickle: bytes = b"") -> float:
    """Seconds until the router closes ``sock``, sending ``trickle`` every 0.25 s."""
    start = time.monotonic()
    sock.settimeout(0.25)
    try:
        while time.monotonic() - start < 10:
            try:
                if trickle:
                    sock.sendall(trickle)
                if sock.recv(65536) == b"":
                    break
            except TimeoutError:
                continue
            except OSError:
                break  # reset by the router
    finally:
        sock.close()
    return time.monotonic() - start


@pytest.mark.integration
def test_connections_that_never_finish_their_headers_are_closed(capped: RouterProcess) -> None:
    silent = socket.create_connection(("127.0.0.1", capped.port))
    assert 0.9 < closed_after(silent) < 3  # read_timeout, not uvicorn's "never"
    trickling = socket.create_connection(("127.0.0.1", capped.port))
    trickling.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n")
    assert 0.9 < closed_after(trickling, b"X-A: b\r\n") < 3
    # Between requests the keep-alive timeout rules, not the header deadline.
    kept = socket.create_connection(("127.0.0.1", capped.port))
    kept.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
    kept.settimeout(5)
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    assert 1.8 < closed_after(kept) < 4


class _RecordingTransport(asyncio.Transport):
    """What uvicorn's protocol writes, one entry per ``write`` (a send syscall each)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def serve(app: ASGIApp, request: bytes, read_timeout: float = 5.0) -> _RecordingTransport:
    """Feed ``request`` to the router's HTTP protocol (``http_protocol``) on a recording
    transport; the app runs in this loop from the next turn."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    config = Config(app, http=http_protocol(read_timeout), log_level="warning")
    config.load()
    transport = _RecordingTransport()
    protocol = config.http_protocol_class(config=config, server_state=ServerState(),  # type: ignore[call-arg]
                                          app_state={})
    protocol.connection_made(transport)
    protocol.data_received(request)
    return transport


def test_a_small_response_leaves_in_one_write_and_a_stream_s_head_at_once() -> None:
    """uvicorn writes the status line and headers, then the body: two send calls (two TCP
    segments, two wake-ups of the client) per answer. The head now waits for the body's
    first write in the same event-loop turn; a stream whose body comes later gets its
    head at the end of the turn, before the body."""

    async def small(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def later(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            await asyncio.sleep(0.1)
            yield b"data: 1\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/small", small), Route("/later", later)])
    get = b"GET %s HTTP/1.1\r\nHost: t\r\n\r\n"

    async def run() -> tuple[list[bytes], list[bytes], list[bytes]]:
        one = await serve(app, get % b"/small")
        streamed = await serve(app, get % b"/later")
        await asyncio.sleep(0.05)
        head = list(streamed.writes)  # the stream's head has gone, its body not yet
        await asyncio.sleep(0.2)
        return one.writes, head, streamed.writes

    one, head, streamed = asyncio.run(run())
    assert len(one) == 1, one
    assert one[0].startswith(b"HTTP/1.1 200") and one[0].endswith(b"\r\n\r\nok")
    assert len(head) == 1 and head[0].startswith(b"HTTP/1.1 200"), head
    assert head[0].endswith(b"\r\n\r\n"), head
    assert streamed[0] == head[0] and b"data: 1" in b"".join(streamed[1:]), streamed
