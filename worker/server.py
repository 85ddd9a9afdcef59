"""The worker's ZeroMQ loop: receive router messages, run them on the engine, send replies.

Deltas of all requests are gathered into one ``Deltas`` message per event-loop turn: the
engine's output handler wakes every request's generator in the same turn, so one engine
step becomes one message instead of one per request.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Protocol, cast

import zmq

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
    worker_codec,
)

log = logging.getLogger("modelyard.worker")


class Engine(Protocol):
    """What the server needs of an engine (``VllmEngine`` or the synthetic one)."""

    max_model_len: int
    max_prompt_chars: int

    def generate(self, gen: Generate) -> Any: ...  # AsyncIterator[list[Delta]]
    async def tokenize(self, req: Tokenize) -> tuple[list[int], list[str] | None, int]: ...
    async def detokenize(self, req: Detokenize) -> str: ...
    async def embed(self, req: Embed) -> tuple[list[list[float]], int]: ...
    async def score(self, req: Score) -> tuple[list[float], int]: ...
    async def abort(self, request_id: str) -> None: ...
    def in_flight(self) -> int: ...
    async def sleep(self, level: int) -> None: ...
    async def wake(self) -> None: ...
    async def adapters_apply(self, load: list[Any], unload: list[int]
                             ) -> list[AdapterState]: ...
    def shutdown(self) -> None: ...


class WorkerServer:
    """Serves one engine to one router over a DEALER socket."""

    def __init__(self, endpoint: str, model: str, router_key: str) -> None:
        self._engine: Engine
        self._request_error: type[Exception] = Exception
        self._model = model
        self._codec = worker_codec()
        # A plain socket read through loop.add_reader, as the router's WorkerLink does:
        # no Future per frame. Sends never block (unlimited high-water mark).
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on output
        self._sock.setsockopt(zmq.RCVHWM, 0)
        # The router's socket admits only peers that know its key (CURVE).
        self._sock.curve_serverkey = router_key.encode()
        self._sock.curve_publickey, self._sock.curve_secretkey = zmq.curve_keypair()
        self._sock.connect(endpoint)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._outbox: list[Delta] = []
        self._flush_scheduled = False
        self._drain_scheduled = False
        self._stopping = asyncio.Event()
        self._sleep_turns = asyncio.Lock()
        """Sleep and Wake run one at a time, in the order they came (a lock is FIFO): a
        Wake sent while a Sleep still runs must not finish first and leave it asleep."""

    def _send(self, message: Any) -> None:
        self._sock.send(self._codec.encode(message), zmq.NOBLOCK)
        # ZeroMQ's descriptor is edge-triggered and a send may consume the edge.
        if not self._drain_scheduled and cast(int, self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _emit(self, deltas: list[Delta]) -> None:
        self._outbox.extend(deltas)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._outbox:
            items, self._outbox = self._outbox, []
            self._send(Deltas(items=items))

    async def _run_generate(self, gen: Generate) -> None:
        try:
            async for deltas in self._engine.generate(gen):
                self._emit(deltas)
        except asyncio.CancelledError:
            # Cancel from the router: closing the generator aborts the request in vLLM.
            raise
        except self._request_error as err:
            e: Any = err
            self._flush()  # keep order: deltas already produced go first
            self._send(Error(id=gen.id, message=e.message, status=e.status,
                             type="invalid_request_error" if e.status < 500
                             else "model_unavailable", param=e.param, code=e.code))
        except Exception as err:  # an engine failure ends this request, not the worker
            log.exception("request %s failed", gen.id)
            self._flush()
            self._send(Error(id=gen.id, message=f"engine error: {err}", status=500))
        finally:
            self._tasks.pop(gen.id, None)

    async def _answer(self, req: Tokenize | Detokenize | Embed | Score | Adapters) -> None:
        """Run a one-shot request (no stream) and send its result or its error."""
        reply: Any
        try:
            if isinstance(req, Tokenize):
                ids, strs, count = await self._engine.tokenize(req)
                reply = TokenizeResult(id=req.id, token_ids=[] if req.count_only else ids,
                                       token_strs=None if req.count_only else strs,
                                       max_model_len=self._engine.max_model_len, count=count)
            elif isinstance(req, Detokenize):
                reply = DetokenizeResult(id=req.id, text=await self._engine.detokenize(req))
            elif isinstance(req, Adapters):
                reply = AdapterStates(id=req.id, loaded=await self._engine.adapters_apply(
                    req.load, req.unload))
            elif isinstance(req, Embed):
                vectors, tokens = await self._engine.embed(req)
                reply = Embeddings(id=req.id, vectors=vectors, prompt_tokens=tokens)
            else:
                scores, tokens = await self._engine.score(req)
                reply = Scores(id=req.id, scores=scores, prompt_tokens=tokens)
        except self._request_error as err:
            e: Any = err
            reply = Error(id=req.id, message=e.message, status=e.status,
                          type="invalid_request_error", param=e.param, code=e.code)
        except Exception as err:  # an engine failure ends this request, not the worker
            log.exception("request %s failed", req.id)
            reply = Error(id=req.id, message=f"engine error: {err}", status=500)
        finally:
            self._tasks.pop(req.id, None)
        self._send(reply)

    def _handle(self, message: object) -> None:
        if isinstance(message, Generate):
            if message.id in self._tasks:
                self._send(Error(id=message.id, message="duplicate request id", status=400))
                return
            self._tasks[message.id] = asyncio.create_task(self._run_generate(message))
        elif isinstance(message, Cancel):
            task = self._tasks.pop(message.id, None)
            if task is not None:
                task.cancel()
        elif isinstance(message, (Tokenize, Detokenize, Embed, Score, Adapters)):
            self._tasks[message.id] = asyncio.create_task(self._answer(message))
        elif isinstance(message, Ping):
            self._send(Pong(id=message.id, in_flight=self._engine.in_flight()))
        elif isinstance(message, (Sleep, Wake)):
            asyncio.create_task(self._sleep_or_wake(message))
        elif isinstance(message, Shutdown):
            self._stopping.set()

    async def _sleep_or_wake(self, message: Sleep | Wake) -> None:
        try:
            async with self._sleep_turns:
                if isinstance(message, Sleep):
                    await self._engine.sleep(message.level)
                else:
                    await self._engine.wake()
        except Exception as err:  # noqa: BLE001  # e.g. sleep mode on a CPU: the router falls back to stop
            self._send(Error(id=message.id, message=f"{type(err).__name__}: {err}", status=500))
            return
        self._send(Pong(id=message.id, in_flight=self._engine.in_flight()))

    def _drain(self) -> None:
        self._drain_scheduled = False
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if not len(frame):  # the end of one of the router's turns (WorkerLink._end_turn)
                continue
            try:
                message = self._codec.decode(frame.buffer)
            except Exception as err:  # noqa: BLE001  # a frame we cannot read is a router bug; keep serving
                log.error("undecodable message from router: %s", err)
                continue
            self._handle(message)

    async def _watch_parent(self, parent: int, router: int | None) -> None:
        """Exit when the router is gone (it was killed and could not tell us): our parent,
        or, for a spare forked by the zygote, the process ``router`` (a pidfd) names."""
        if router is not None:
            gone = asyncio.Event()
            loop = asyncio.get_running_loop()
            loop.add_reader(router, gone.set)  # readable once it has exited
            try:
                await gone.wait()
            finally:
                loop.remove_reader(router)
            log.warning("router is gone; shutting down")
        else:
            while os.getppid() == parent:
                await asyncio.sleep(0.5)
            log.warning("router (pid %d) is gone; shutting down", parent)
        self._stopping.set()

    def fail(self, message: str) -> None:
        """Tell the router that the engine could not start."""
        self._send(Error(id="", message=message, status=503, type="model_unavailable"))

    async def serve(self, engine: Engine, request_error: type[Exception], parent_pid: int,
                    phases: dict[str, float] | None = None, booted_at: float = 0.0,
                    router: int | None = None) -> None:
        """Announce ``Ready`` and serve until ``Shutdown``, a signal, or the router's death.

        ``request_error`` is the engine's exception for a refused request; it must carry
        ``message``, ``status``, ``param`` and ``code``.
        """
        self._engine = engine
        self._request_error = request_error
        self._send(Ready(model=self._model, max_model_len=self._engine.max_model_len,
                         pid=os.getpid(), max_prompt_chars=self._engine.max_prompt_chars,
                         phases=phases or {}, booted_at=booted_at))
        loop = asyncio.get_running_loop()
        fd = cast(int, self._sock.getsockopt(zmq.FD))
        loop.add_reader(fd, self._drain)
        loop.call_soon(self._drain)  # frames may have queued while the engine loaded
        watcher = asyncio.create_task(self._watch_parent(parent_pid, router))
        await self._stopping.wait()
        loop.remove_reader(fd)
        watcher.cancel()
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self.close()

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()

    def stop(self) -> None:
        self._stopping.set()
