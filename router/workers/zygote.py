"""The router's side of the zygote (``worker/zygote.py``, a spare that forks spares):
``ZygoteLink``, its socket, and ``ForkedProcess``, one spare it forked as asyncio's
``Process`` looks to its users (``pid``, ``returncode``, ``stdin``, ``wait``).

The stdlib has no way to wait for a process that is not our child; Linux's pidfd is one:
readable once the process has exited, for any process. The zygote reaps a child only when
asked (``Reap``), so between ``Forked`` and ``Reap`` the pid names that child (alive or a
zombie) and ``pidfd_open`` cannot open someone else. The exchange is a blocking
``SOCK_SEQPACKET`` round trip (a fork takes ~10 ms) in a thread, one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import msgspec

from shared.zygote import MAX_MESSAGE, Fork, Forked, Reap, Reaped, Refused, Reply, Request

UNKNOWN_EXIT = -1
"""A forked process's exit code where the zygote could not tell it (it died first)."""
EXCHANGE_TIMEOUT = 30.0  # seconds a fork or a reap may take before the zygote is given up
_decode: Callable[[bytes], Reply] = msgspec.json.Decoder(Reply).decode
_encode = msgspec.json.Encoder().encode
T = TypeVar("T")


class ZygoteError(Exception):
    """The zygote is gone, or its link broke (a timeout, a closed socket, a reply out of
    turn): it is to be replaced."""


class ZygoteRefused(ZygoteError):
    """The zygote lives and refused a fork (a thread started in it): spares are started as
    processes from then on."""


class PipeStdin:
    """The write end of a forked process's stdin, written at ``close`` (its boot, a few
    KiB) without blocking: what the pipe does not take at once (a pipe holds 64 KiB, but
    4 KiB once this user has used ``/proc/sys/fs/pipe-user-pages-soft``, and a chat
    template can be long) is written as the process reads it, from the event loop, so a
    process that does not read (stuck after its fork) cannot stop the router."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        self._data = bytearray()

    def write(self, data: bytes) -> None:
        self._data += data

    def close(self) -> None:
        """Raises ``BrokenPipeError`` where the process is gone already."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        view = memoryview(bytes(self._data))
        self._data.clear()
        try:
            os.set_blocking(fd, False)
            view = _write(fd, view)
        except BaseException:
            os.close(fd)
            raise
        if not view:
            os.close(fd)
            return
        loop = asyncio.get_running_loop()

        def more() -> None:
            nonlocal view
            try:
                view = _write(fd, view)
            except OSError:  # it exited: nobody reads it now
                view = view[:0]
            if not view:
                loop.remove_writer(fd)
                os.close(fd)

        loop.add_writer(fd, more)


def _write(fd: int, view: memoryview) -> memoryview:
    """What is left of ``view`` once the pipe took what it could now."""
    with contextlib.suppress(BlockingIOError):
        while view:
            view = view[os.write(fd, view):]
    return view


class ForkedProcess:
    """A process the zygote forked, waited for through its pidfd and reaped by the
    zygote."""

    def __init__(self, pid: int, stdin_fd: int, zygote: ZygoteLink) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = PipeStdin(stdin_fd)
        self._zygote = zygote
        self._exited = asyncio.Event()
        self._pidfd = os.pidfd_open(pid)  # not reaped until we ask: the pid is still its
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._pidfd, self._on_exit)
        self._reaping: asyncio.Task[None] | None = None

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        with contextlib.suppress(OSError):  # a boot left unwritten: nobody reads it now
            self.stdin.close()  # (raised here, it would leave ``wait`` waiting for good)
        self._reaping = self._loop.create_task(self._reap())

    async def _reap(self) -> None:
        code = await self._zygote.reap(self.pid)
        self.returncode = UNKNOWN_EXIT if code is None else code
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode


class ZygoteLink:
    """The router's end of a zygote's socket: once the zygote's imports are done, each
    ``fork`` makes a spare of it, ready at once.

    An exchange, once sent, runs to its end whoever waits for it: a caller cancelled
    meanwhile (a load unloaded) must neither let the next request go out before this one's
    reply came back (it would take that reply) nor drop a ``Forked`` (the child would stay
    a zombie in the zygote, never reaped). One that failed closes the link: a reply that
    came late would answer the next request."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(EXCHANGE_TIMEOUT)
        self._sock: socket.socket | None = sock
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()  # exchanges whose caller left

    @property
    def broken(self) -> bool:
        """An exchange failed (or ``close``): no more go out."""
        return self._sock is None

    def _run(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _ask(self, request: Request, fds: list[int]) -> Reply:
        data = _encode(request)
        async with self._lock:
            sock = self._sock
            if sock is None:
                raise ZygoteError("the link to the zygote is closed")

            def exchange() -> bytes:
                socket.send_fds(sock, [data], fds)
                return sock.recv(MAX_MESSAGE)

            try:
                reply = await asyncio.to_thread(exchange)
            except OSError as err:  # a timeout too
                self.close()
                raise ZygoteError(f"{type(err).__name__}: {err}") from None
            if not reply:
                self.close()
                raise ZygoteError("the zygote closed its socket")
        return _decode(reply)

    async def fork(self) -> ForkedProcess:
        """A new spare; ``ZygoteRefused``, or ``ZygoteError`` (the zygote is gone or its
        link broke). A caller cancelled meanwhile leaves the fork to end: the spare it
        made gets no boot (EOF), exits, and is reaped."""
        task = self._run(self._fork())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_abandon)
            raise

    async def _fork(self) -> ForkedProcess:
        read, write = os.pipe()
        try:
            try:
                reply = await self._ask(Fork(), [read])
            finally:
                os.close(read)  # (only once the exchange has sent it)
            if isinstance(reply, Refused):
                raise ZygoteRefused(reply.reason)
            if not isinstance(reply, Forked):
                self.close()
                raise ZygoteError(f"a reply out of turn: {reply!r}")
            try:
                return ForkedProcess(reply.pid, write, self)
            except OSError as err:  # pidfd_open: it cannot have been reaped, so this is odd
                self.close()
                raise ZygoteError(f"{type(err).__name__}: {err}") from None
        except BaseException:
            os.close(write)
            raise

    async def reap(self, pid: int) -> int | None:
        """``pid``'s exit code (it exited); ``None`` where the zygote cannot tell."""
        try:  # (a zygote gone: its children were reparented and reaped by another)
            reply = await asyncio.shield(self._run(self._ask(Reap(pid=pid), [])))
        except ZygoteError:
            return None
        return reply.code if isinstance(reply, Reaped) else None

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


def _abandon(task: asyncio.Task[ForkedProcess]) -> None:
    """A fork whose caller was cancelled: its spare gets EOF for a boot and exits (its
    pidfd then has the zygote reap it)."""
    if not task.cancelled() and task.exception() is None:
        stdin = task.result().stdin
        with contextlib.suppress(OSError):
            stdin.close()
