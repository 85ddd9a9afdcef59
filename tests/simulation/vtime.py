"""Virtual time for the lifecycle simulation.

``VirtualTimeLoop`` is an asyncio loop whose clock jumps to the next timer whenever no
callback is ready, so a sleep costs no wall time and every run of a seed takes the same
path: nothing depends on how fast the machine is. ``virtual_time`` points the ``time``
module that ``router`` and ``shared`` modules imported at the same clock (they read
``time.monotonic()`` and ``time.time()`` directly). Work handed to a thread
(``asyncio.to_thread``) runs inline, in order.

Sockets are faked too (``tests.simulation.fakes``): a fake socket's descriptor is a
number above ``FAKE_FD_BASE``, and ``poke`` calls its reader as an edge-triggered
descriptor would.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import sys
import time as _time
from collections.abc import Callable, Iterator
from typing import Any

FAKE_FD_BASE = 1 << 20
EPOCH = 1_700_000_000.0
"""What ``time.time()`` reads at virtual monotonic time 0."""


class Deadlock(RuntimeError):
    """Nothing is ready and no timer is due: every task waits on something nobody sets."""


class VirtualClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start


class _ClockShim:
    """Stands in for the ``time`` module inside the router's modules."""

    def __init__(self, clock: VirtualClock) -> None:
        self._clock = clock

    def monotonic(self) -> float:
        return self._clock.now

    perf_counter = monotonic

    def time(self) -> float:
        return EPOCH + self._clock.now

    def monotonic_ns(self) -> int:
        return int(self._clock.now * 1e9)

    def sleep(self, seconds: float) -> None:
        raise AssertionError("a blocking time.sleep in the router's event loop")

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)


@contextlib.contextmanager
def virtual_time(clock: VirtualClock, packages: tuple[str, ...] = ("router", "shared")
                 ) -> Iterator[None]:
    """Point every imported module of ``packages`` that did ``import time`` at ``clock``."""
    shim = _ClockShim(clock)
    patched = [module for name, module in list(sys.modules.items())
               if name.split(".")[0] in packages and getattr(module, "time", None) is _time]
    for module in patched:
        module.time = shim  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in patched:
            module.time = _time  # type: ignore[attr-defined]


class _NoWaitSelector(selectors.SelectSelector):
    """Never waits: a wait for a timer moves the virtual clock instead. Real descriptors
    are registered (the loop's self-pipe) but never looked at: nothing in a simulation
    writes to one (no threads, no signal handlers), and a look costs a system call."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Deadlock("no callback ready and no timer scheduled")
        if timeout > 0:
            self.clock.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(selector=_NoWaitSelector(clock))
        self.clock = clock
        self._fake_readers: dict[int, tuple[Callable[..., Any], tuple[Any, ...]]] = {}

    def time(self) -> float:
        return self.clock.now

    def run_in_executor(self, executor: Any, func: Callable[..., Any],  # type: ignore[override]
                        *args: Any) -> asyncio.Future[Any]:
        future = self.create_future()
        try:
            future.set_result(func(*args))
        except Exception as err:  # noqa: BLE001  # handed to whoever awaits it, as a thread would
            future.set_exception(err)
        return future

    def add_reader(self, fd: Any, callback: Callable[..., Any], *args: Any) -> None:
        if isinstance(fd, int) and fd >= FAKE_FD_BASE:
            self._fake_readers[fd] = (callback, args)
            return
        super().add_reader(fd, callback, *args)

    def remove_reader(self, fd: Any) -> bool:
        if isinstance(fd, int) and fd >= FAKE_FD_BASE:
            return self._fake_readers.pop(fd, None) is not None
        return super().remove_reader(fd)

    def poke(self, fd: int) -> None:
        """A fake descriptor became readable: call its reader (next turn), if any."""
        reader = self._fake_readers.get(fd)
        if reader is not None:
            self.call_soon(reader[0], *reader[1])


def after_turns(loop: asyncio.AbstractEventLoop, turns: int, callback: Callable[..., Any],
                *args: Any) -> None:
    """Call ``callback`` ``turns`` loop turns from now, at the same (virtual) instant:
    events that a seed puts at one time land in every order of turns, where races live."""
    if turns <= 0:
        callback(*args)
    else:
        loop.call_soon(after_turns, loop, turns - 1, callback, *args)
