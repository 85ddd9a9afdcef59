"""How a worker, and every process it starts, ends when the router that started it dies.

Both processes run a half of it (the router ``dies_with`` in the child it forks, the worker
the rest), so it lives in ``shared/``: standard library only, no asyncio, no vLLM.

A router killed with SIGKILL runs no code: nothing it started may outlive it, whatever
that process is doing at the moment (a spare starting Python or importing vLLM, a spare
the router holds with ``SIGSTOP``, a worker whose engine is loading, vLLM's EngineCore
and executor). Two kernel mechanisms do it, neither of which needs the dying process's
code to run:

- ``dies_with``: the router starts each worker with ``PR_SET_PDEATHSIG`` set to SIGKILL
  in the child between its fork and its exec, so it holds from the first instruction of
  the worker's Python (the router may hold a spare with ``SIGSTOP`` right away, and a
  stopped process runs none of its own code); the child then checks that the router is
  still its parent, which closes the gap before the ``prctl``. SIGKILL ends even a
  stopped process: the SIGTERM the worker asked for itself before stayed pending on a
  held spare, and a spare stopped or killed before its first line had none at all. The
  signal fires when the thread that forked exits: the router forks from its event loop,
  which runs in its main thread.
- ``guard_group``: a worker that will start processes (vLLM forks or spawns EngineCore,
  which forks or spawns its executor; EngineCore watches no parent, and a spawned child
  runs no fork hook of ours) first forks a small guard into its process group, which
  waits on a pidfd of the worker and SIGKILLs the whole group once the worker has
  exited, however it ended (the router's death, a crash, the OOM killer).

Polling the parent (``psutil`` or ``os.getppid`` every half second, as
``WorkerServer._watch_parent`` still does) cannot do this alone: a stopped process runs
no poll, a spare polls nothing until its boot, a main thread in a long C call keeps the
GIL from a watcher thread, and a poll that does run can only end the process it runs in.

``preexec_fn`` is not safe in general in a process with threads (the router has some):
the child runs Python between fork and exec, and code that takes a lock another thread
held at the fork deadlocks. ``dies_with``'s function takes none: one ``prctl`` through a
ctypes function resolved before the fork (no ``dlsym`` in the child), ``getppid``, and
``_exit``. A wrapper program (util-linux ``setpriv --pdeathsig``) would leave a window
between its exec and its ``prctl`` in which a held spare has no parent-death signal.
``prctl`` is called through ctypes on the C library already loaded: a system call, no
dependency (``python-prctl`` would add a compiled package for two calls).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import time
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_PR_GET_PDEATHSIG = 2
_PR_SET_NAME = 15


def _resolve_prctl() -> Callable[..., int] | None:
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl  # the libc loaded
    except (OSError, AttributeError):  # no prctl (not Linux): the parent poll still runs
        return None
    return prctl


_prctl = _resolve_prctl()


def set_parent_death_signal(sig: int) -> None:
    """Ask Linux to send ``sig`` to this process when its parent thread exits (0: none)."""
    if _prctl is not None:
        _prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(sig))


def parent_death_signal() -> int:
    """The signal this process gets when its parent dies (0: none)."""
    sig = ctypes.c_int(0)
    if _prctl is not None:
        _prctl(ctypes.c_int(_PR_GET_PDEATHSIG), ctypes.byref(sig))
    return sig.value


def dies_with(parent: int) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child SIGKILLed when ``parent`` (the process that
    forks it, from its main thread) dies, or exit at once if it has died already."""
    if _prctl is None:
        return lambda: None
    prctl, option, kill = _prctl, ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL)

    def in_child() -> None:
        prctl(option, kill)
        if os.getppid() != parent:  # it died before the line above took effect
            os._exit(1)

    return in_child


def die_with_parent() -> None:
    """A worker the router started has SIGKILL as its parent-death signal already
    (``dies_with``); one started otherwise (by hand, by a Ray actor) gets SIGTERM, which it
    handles by ending its process group."""
    if not parent_death_signal():
        set_parent_death_signal(signal.SIGTERM)


def guard_group(router: int | None = None) -> int | None:
    """Fork the process that SIGKILLs this worker's process group once the worker has
    exited, or once the process the pidfd ``router`` names has (a spare forked by the
    zygote: the router is not its parent, so no parent-death signal ends it); its pid.
    Only for a worker the router made a group leader (one started by hand must not kill
    its shell's group). Call it before the engine starts any process
    (a spare has vLLM imported by then, with a few native threads: the forked guard takes
    none of their locks, as it makes nothing but system calls)."""
    worker = os.getpid()
    if os.getpgid(0) != worker:
        return None
    watch: int | None
    try:
        watch = os.pidfd_open(worker)  # opened here: it names this worker, whatever follows
    except OSError:  # Linux before 5.3: the guard polls its parent instead
        watch = None
    named, told = os.pipe()
    pid = os.fork()
    if pid:
        os.close(told)
        if watch is not None:
            os.close(watch)
        # Return once the guard bears its name: the router's freeze (SIGSTOP of the group
        # but its guard) tells it by name, and a guard not yet scheduled (a busy host: the
        # parent runs on after a fork) was stopped with the rest, so never killed them.
        os.read(named, 1)  # b"" if it died first
        os.close(named)
        return pid
    try:
        os.close(named)
        set_parent_death_signal(0)  # a fork hook may have set one: it must outlive the worker
        if _prctl is not None:
            _prctl(ctypes.c_int(_PR_SET_NAME), ctypes.c_char_p(b"modelyard-guard"))
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # it ends with the worker, not before
        os.write(told, b"1")
        os.close(told)
        if watch is not None:  # readable once the process has exited
            select.select([watch] + ([router] if router is not None else []), [], [])
        else:
            while os.getppid() == worker:
                time.sleep(0.1)
    finally:
        with contextlib.suppress(OSError):  # nothing is left of the group
            os.killpg(worker, signal.SIGKILL)  # this guard too
        os._exit(0)
