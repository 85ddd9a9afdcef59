"""The zygote: a spare worker (``python -m worker --spare --zygote-fd N``) that imports vLLM
and torch once, then forks a spare for each ``Fork`` the router sends over its socket
(``shared/zygote.py``). A spare forked here is ready at once (~10 ms: a fork of a process
with torch imported) where one started afresh imports for ~8 s, so a load right after a
load, which took the spare there was, finds another.

A forked spare leaves this process at ``serve``'s return, in ``worker/__main__.py``'s
``main``, as a started spare would go on after its imports: it reads its boot from its
stdin (the pipe the router sent), becomes its own session, takes the router's priority
back, and watches the router through a pidfd (its parent is this zygote, so a parent-death
signal would tie it to the zygote's life instead: the zygote may die and the models it
forked serve on). The zygote reaps a child only when the router asks (``Reap``, once the
child's pidfd said it exited), so a pid the router holds names that child until then.

A fork copies only the calling thread. After ``worker.engine.preload`` this process has
two native threads besides its own, OpenBLAS's, which fork safely (OpenBLAS stops its
pool at fork); a Python thread, an initialised CUDA, or a thread count that grew (an
OpenMP pool: libgomp after a fork can deadlock) refuse the fork: the router then starts
spares afresh.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading

import msgspec

from shared.zygote import MAX_MESSAGE, Fork, Forked, Reap, Reaped, Refused, Reply, Request

_decode = msgspec.json.Decoder(Request).decode
_encode = msgspec.json.Encoder().encode


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _refusal(threads: int) -> str | None:
    """Why this process may not fork now, if it may not."""
    if threading.active_count() > 1:
        return f"{threading.active_count()} Python threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised"
    if _threads() > threads:
        return f"{_threads()} threads where there were {threads} after the imports"
    return None


def serve(control_fd: int, nice: int) -> int:
    """Fork spares until the router closes the socket (then exit). Returns only in a forked
    spare: a pidfd of the router, which the spare watches instead of its parent."""
    router = os.pidfd_open(os.getppid())  # the router started us: this names it
    threads = _threads()
    sock = socket.socket(fileno=control_fd)
    sock.set_inheritable(False)

    def reply(message: Reply) -> None:
        sock.send(_encode(message))

    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 1)
        except OSError:
            os._exit(0)
        if not data:
            os._exit(0)  # the router closed the socket: it stopped, or gave up on us
        try:
            request = _decode(data)
        except msgspec.ValidationError as err:
            reply(Refused(reason=f"unreadable request: {err}"))
            continue
        if isinstance(request, Reap):
            code: int | None = None
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(request.pid, os.WNOHANG)
                if pid:
                    code = os.waitstatus_to_exitcode(status)
            reply(Reaped(pid=request.pid, code=code))
            continue
        assert isinstance(request, Fork)
        reason = _refusal(threads) if fds else "no stdin came with the fork"
        if reason is not None:
            for fd in fds:
                os.close(fd)
            reply(Refused(reason=reason))
            continue
        pid = os.fork()
        if pid == 0:
            sock.close()
            os.setsid()  # a group of its own, as the router starts a worker
            os.dup2(fds[0], 0)
            os.close(fds[0])
            with contextlib.suppress(OSError):  # back to the router's priority
                os.setpriority(os.PRIO_PROCESS, 0, nice)
            return router
        os.close(fds[0])
        reply(Forked(pid=pid))
