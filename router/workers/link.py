"""``WorkerLink``: the router's end of one worker's ZeroMQ socket.

It sends requests, reads every message the worker sends, and hands each request's deltas
to that request's ``RequestStream``. A worker's death fails every open stream at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from typing import cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from router.errors import APIError, BadRequest, ClientTooSlow, ModelUnavailable, WorkerLost
from shared.protocol import (
    Adapters,
    AdapterState,
    AdapterStates,
    Cancel,
    Delta,
    Deltas,
    Detokenize,
    DetokenizeResult,
    Embed,
    Embeddings,
    Error,
    Generate,
    LoraRef,
    Ping,
    Pong,
    Ready,
    Score,
    Scores,
    Shutdown,
    Sleep,
    Tokenize,
    TokenizeResult,
    Wake,
    router_codec,
)

log = logging.getLogger("modelyard.router")
_ids = itertools.count()
HEARTBEAT_IVL_MS = 300
HEARTBEAT_TIMEOUT_MS = 1000
"""TCP links (remote workers): ZeroMQ pings the worker every 0.3 s and drops a link silent
for 1 s, so a dead node's streams end within the 2 s a local worker's death takes."""
BUFFERED_PER_CHOICE = 64
"""Deltas a stream holds for its reader, per choice (at least 4096): a client that reads
no faster than that has its generation cancelled, so it cannot grow the router's memory."""


_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
"""The monitor events that tell the worker's connection from a stranger's."""


def _api_error(err: Error) -> APIError:
    return APIError(err.message, param=err.param, code=err.code, status=err.status,
                    type=err.type)


class Usage:
    """What one client request generated: token counts, finish reasons, timings.

    Counted as deltas arrive (``RequestStream._feed`` already looks at each one), so the
    relay's per-batch path does no second pass; the relay fills in the timings.
    """

    __slots__ = ("batch", "cached", "clamped", "completion", "finish", "first_at", "key",
                 "prompt", "session", "started")

    def __init__(self, key: str = "", batch: str | None = None) -> None:
        self.key = key
        """The name of the key that asked (``Principal.name``)."""
        self.batch = batch
        """The batch whose line this request is (``None``: a client's own)."""
        self.prompt: dict[str, int] = {}
        self.cached: dict[str, int] = {}
        self.completion = 0
        self.finish: list[str] = []
        self.started = time.perf_counter()
        self.first_at = 0.0
        self.clamped = 0
        """What ``max_tokens`` was clamped to (``SamplingSpec.clamp_max_tokens``); 0: not."""
        self.session: bytes | None = None
        """The session the request said it belongs to (``prefix_index.session_key``): a
        model of several replicas keeps a session's requests on one."""

    def add(self, delta: Delta) -> None:
        self.completion += delta.tokens
        if delta.prompt_tokens:  # a choice's first and last deltas
            self.prompt[delta.id] = delta.prompt_tokens
            self.cached[delta.id] = delta.cached_tokens
            if delta.max_tokens:
                self.clamped = delta.max_tokens
        if delta.finish_reason is not None:
            self.finish.append(delta.finish_reason)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt.values())

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached.values())


class RequestStream:
    """The deltas of one or more ``Generate`` requests that answer one client request.

    Several generates feed one stream when a completions request has several prompts;
    each one's choice indexes are shifted by its ``offset``. Iterating it yields batches:
    every delta that arrived since the last step, so a burst becomes one HTTP write. A
    worker error raises ``APIError``. ``close()`` cancels what has not finished.
    """

    __slots__ = ("_error", "_items", "_limit", "_link", "_open", "_waiter", "usage")

    def __init__(self, link: WorkerLink, usage: Usage) -> None:
        self.usage = usage
        self._link = link
        self._items: list[Delta] = []
        self._waiter: asyncio.Future[None] | None = None
        self._open: dict[str, int] = {}  # generate id -> choices not yet finished
        self._error: APIError | None = None
        self._limit = 4096

    @property
    def exhausted(self) -> bool:
        """Nothing left to read: every generate finished, no delta and no error pending."""
        return not self._open and not self._items and self._error is None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _feed(self, delta: Delta, offset: int) -> None:
        delta.index += offset
        self._items.append(delta)
        self.usage.add(delta)
        if len(self._items) > self._limit and self._open:
            self._fail(ClientTooSlow(f"the client read {len(self._items)} deltas behind its "
                                     "stream; generation cancelled"))
        if delta.finish_reason is not None:
            link = self._link
            link.prompt_tokens += delta.prompt_tokens  # a choice's last delta has its prompt's
            link.cached_tokens += delta.cached_tokens
            left = self._open.get(delta.id, 0) - 1
            if left <= 0:
                self._open.pop(delta.id, None)
                self._link._forget(delta.id)
            else:
                self._open[delta.id] = left
        self._wake()

    def _fail(self, error: APIError) -> None:
        if self._error is None:
            self._error = error
        for gen_id in self._open:  # siblings of a failed generate stop too
            self._link.cancel(gen_id)
        self._open.clear()
        self._wake()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[Delta]:
        while not self._items:
            if self._error is not None:
                raise self._error
            if not self._open:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None
        items, self._items = self._items, []
        return items

    def close(self) -> None:
        """Cancel every generation of this stream that is still running."""
        for gen_id in list(self._open):
            self._link.cancel(gen_id)
        self._open.clear()


class WorkerLink:
    """One bound DEALER socket per worker; the worker connects to it.

    The socket is a CURVE server with a fresh key pair: only a peer that knows its public
    key, given to the worker privately (``WorkerBoot`` over stdin), can connect, so no
    other process can read this worker's requests or answer them.

    The socket is a plain (not ``zmq.asyncio``) socket whose file descriptor is watched
    with ``loop.add_reader``: one wake-up drains every queued frame, with no Future per
    frame (pyzmq's asyncio layer cost a fifth of the router's time under load). ZeroMQ's
    descriptor is edge-triggered, so after sending, which may consume the edge, the
    link looks for frames itself.

    Everything sent in one event-loop turn travels as one ZeroMQ message: each request a
    frame (``SNDMORE``), then an empty frame at the turn's end. ZeroMQ's I/O thread, which
    shares the router's core, wakes once per turn instead of once per request, and the
    worker reads the turn's requests together and answers them in one ``Deltas``.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, model: str) -> None:
        self.endpoint = endpoint
        self.model = model
        self._codec = router_codec()
        self._sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        public, secret = zmq.curve_keypair()
        self.key = public.decode()
        """The public key a worker needs to connect: a secret between router and worker."""
        self._sock.curve_server = True
        self._sock.curve_secretkey = secret
        self._sock.curve_publickey = public
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self.disconnected: asyncio.Future[None] | None = None
        """TCP only: done when the connected worker's link drops (a closed connection, or
        no heartbeat for ``HEARTBEAT_TIMEOUT_MS``: a node that died sends nothing)."""
        self._monitor: zmq.Socket[bytes] | None = None
        self._accepted: set[int] = set()  # connections (fds) with no handshake seen yet
        self._peers: set[int] = set()
        """Live connections that may have completed the CURVE handshake: the worker's."""
        if endpoint.startswith("tcp://"):
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._sock.bind(endpoint)
        # ``tcp://10.0.0.5:*`` binds an ephemeral port: workers need the one it got.
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if endpoint.startswith("tcp://"):
            self.disconnected = asyncio.get_running_loop().create_future()
            self._monitor = self._sock.get_monitor_socket(_WATCHED)
            self._monitor_fd = cast(int, self._monitor.getsockopt(zmq.FD))
            asyncio.get_running_loop().add_reader(self._monitor_fd, self._read_monitor)
            self._read_monitor()  # arms the edge-triggered fd
        self._routes: dict[str, tuple[RequestStream, int]] = {}
        self._calls: dict[str, asyncio.Future[object]] = {}
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[Ready] = self._loop.create_future()
        self._fd = cast(int, self._sock.getsockopt(zmq.FD))
        self._loop.add_reader(self._fd, self._drain)
        self._drain_scheduled = False
        self._turn_open = False  # frames sent this turn, their message not yet ended
        self._closed = False
        self._failure: APIError | None = None
        self._probes = 0
        self.completed = 0
        """Generations this worker finished: proof it was healthy (resets crash backoff)."""
        self.prompt_tokens = 0
        """Prompt tokens of the choices it finished, and of those, the ones its engine
        found in its prefix cache (``cached_tokens``): a replica's cached share."""
        self.cached_tokens = 0

    def _read_monitor(self) -> None:
        """Drain the socket monitor's events (edge-triggered, like every ZeroMQ fd).

        Only the loss of the worker's own connection (one that completed the CURVE
        handshake) means the worker is gone. Anyone may open a TCP connection to the
        port (a port scan, a health probe), and ZeroMQ reports its end as a disconnect
        too. Its events name the connection (its fd) on accept and disconnect but not
        on handshake, so a handshake marks every connection accepted and not yet
        resolved as possibly the worker's: a stranger's that happened to be open then
        only delays the worker's loss until the stranger's own end.
        """
        assert self._monitor is not None and self.disconnected is not None
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, fd = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                self._accepted.add(fd)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._peers |= self._accepted
                self._accepted.clear()
            elif kind == zmq.EVENT_DISCONNECTED:
                self._accepted.discard(fd)  # a stranger's, or one that never spoke
                if fd in self._peers:
                    self._peers.discard(fd)
                    if not self._peers and not self.disconnected.done():
                        self.disconnected.set_result(None)

    async def wait_ready(self) -> Ready:
        return await asyncio.shield(self._ready)

    def _send(self, message: object) -> None:
        if self._failure is not None:
            raise self._failure
        try:
            # A frame of the turn's message: it waits in ZeroMQ's pipe, unseen by the I/O
            # thread, until ``_end_turn`` ends the message.
            self._sock.send(self._codec.encode(message),  # type: ignore[arg-type]
                            zmq.NOBLOCK | zmq.SNDMORE)
        except zmq.Again:  # no worker connected (yet, or any more): nobody to send to
            raise WorkerLost(f"model '{self.model}': its worker is not connected") from None
        except OverflowError:  # an integer the request schema did not bound
            raise BadRequest("an integer in the request does not fit in 64 bits",
                             code="invalid_value") from None
        if not self._turn_open:
            self._turn_open = True
            self._loop.call_soon(self._end_turn)

    def _end_turn(self) -> None:
        """End this loop turn's message with an empty frame (the worker skips it)."""
        if not self._turn_open or self._closed:
            return
        self._turn_open = False
        try:
            self._sock.send(b"", zmq.NOBLOCK)
        except zmq.Again:  # the worker went away mid-message: ZeroMQ dropped the message
            pass
        self._after_send()

    def _after_send(self) -> None:
        if not self._drain_scheduled and cast(int, self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def submit(self, gens: Sequence[Generate], usage: Usage | None = None) -> RequestStream:
        """Send generates whose deltas all flow into one returned stream."""
        stream = RequestStream(self, usage or Usage())
        offset = 0
        for gen in gens:
            self._routes[gen.id] = (stream, offset)
            stream._open[gen.id] = gen.sampling.n
            offset += gen.sampling.n
        stream._limit = max(4096, BUFFERED_PER_CHOICE * offset)
        sent = 0
        try:
            for gen in gens:
                self._send(gen)
                sent += 1
        except APIError:
            for i, gen in enumerate(gens):
                if i < sent:
                    self.cancel(gen.id)  # already running in the worker: stop it
                else:
                    self._routes.pop(gen.id, None)
            raise
        return stream

    def cancel(self, gen_id: str) -> None:
        if self._routes.pop(gen_id, None) is not None and self._failure is None:
            try:
                self._send(Cancel(id=gen_id))
            except WorkerLost:
                pass  # no worker connected: nothing runs there to cancel

    def _forget(self, gen_id: str) -> None:
        """A generate finished every choice."""
        if self._routes.pop(gen_id, None) is not None:
            self.completed += 1

    async def _call(self, message: Tokenize | Detokenize | Embed | Score | Ping | Sleep | Wake
                    | Adapters) -> object:
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._calls[message.id] = future
        try:
            self._send(message)
            return await future
        finally:
            self._calls.pop(message.id, None)

    async def tokenize(self, req: Tokenize) -> TokenizeResult:
        result = await self._call(req)
        assert isinstance(result, TokenizeResult)
        return result

    async def detokenize(self, req: Detokenize) -> str:
        result = await self._call(req)
        assert isinstance(result, DetokenizeResult)
        return result.text

    async def embed(self, req: Embed) -> Embeddings:
        result = await self._call(req)
        assert isinstance(result, Embeddings)
        return result

    async def score(self, req: Score) -> Scores:
        result = await self._call(req)
        assert isinstance(result, Scores)
        return result

    async def adapters(self, load: list[LoraRef] | None = None,
                       unload: list[int] | None = None) -> list[AdapterState]:
        """Load and unload LoRA adapters in the engine; the adapters loaded after."""
        result = await self._call(Adapters(id=f"adapters-{next(_ids)}", load=load or [],
                                           unload=unload or []))
        assert isinstance(result, AdapterStates)
        return result.loaded

    async def ping(self) -> Pong:
        self._probes += 1  # a look, not work: it keeps no model from its idle stop
        try:
            result = await self._call(Ping(id=f"ping-{next(_ids)}"))
        finally:
            self._probes -= 1
        assert isinstance(result, Pong)
        return result

    async def sleep(self, level: int = 1) -> None:
        await self._call(Sleep(id=f"sleep-{next(_ids)}", level=level))

    async def wake(self) -> None:
        await self._call(Wake(id=f"wake-{next(_ids)}"))

    @property
    def busy(self) -> bool:
        """Generations or calls (but pings) in flight on this worker."""
        return self.in_flight > 0

    @property
    def in_flight(self) -> int:
        """Generations and calls (but pings) in flight on this worker: its load, as
        routing among a model's replicas weighs it."""
        return len(self._routes) + len(self._calls) - self._probes

    def shutdown(self) -> None:
        """Ask the worker to exit cleanly (it aborts what it still runs)."""
        if self._failure is None:
            self._send(Shutdown())

    def _dispatch(self, message: object) -> None:
        if isinstance(message, Deltas):
            routes = self._routes
            for delta in message.items:
                route = routes.get(delta.id)
                if route is not None:  # else: cancelled; late deltas are dropped
                    route[0]._feed(delta, route[1])
        elif isinstance(message, Error):
            if not message.id:
                self.fail(ModelUnavailable(f"model '{self.model}' failed: {message.message}"))
            elif message.id in self._calls:
                call = self._calls[message.id]
                if not call.done():  # ``fail`` may have ended it (seen in the simulation)
                    call.set_exception(_api_error(message))
            else:
                route = self._routes.pop(message.id, None)
                if route is not None:
                    route[0]._fail(_api_error(message))
        elif isinstance(message, Ready):
            if not self._ready.done():
                self._ready.set_result(message)
        elif isinstance(message, (TokenizeResult, DetokenizeResult, Embeddings, Scores, Pong,
                                  AdapterStates)):
            future = self._calls.get(message.id)
            if future is not None and not future.done():
                future.set_result(message)

    def _drain(self) -> None:
        """Read and dispatch every frame waiting on the socket."""
        self._drain_scheduled = False
        if self._closed:
            return
        sock, decode, dispatch = self._sock, self._codec.decode, self._dispatch
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                message = decode(frame.buffer)
            except Exception as err:  # noqa: BLE001  # a bad frame is a worker bug; log it, keep the link
                log.error("undecodable message from worker %s: %s", self.model, err)
                continue
            dispatch(message)

    def fail(self, error: APIError) -> None:
        """End every open stream and call with ``error`` (the worker is gone)."""
        if self._failure is not None:
            return
        self._failure = error
        if not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # mark retrieved: nobody may be waiting yet
        for stream, _ in list(self._routes.values()):
            stream._fail(error)
        self._routes.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)

    def close(self, reason: str = "worker stopped") -> None:
        self.fail(WorkerLost(f"model '{self.model}': {reason}"))
        if not self._closed:
            self._end_turn()  # what was sent this turn (a Shutdown) still goes
            self._closed = True
            self._loop.remove_reader(self._fd)
            if self._monitor is not None:
                self._loop.remove_reader(self._monitor_fd)
                self._sock.disable_monitor()
                self._monitor.close(0)
            self._sock.close(0)
