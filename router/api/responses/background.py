"""``BackgroundRuns``: responses created with ``background: true``.

Each runs through the relay like any request, for a client that stays connected until the
response is cancelled: its ``Request`` reads ``http.disconnect`` only then, so the relay's
own disconnect handling (give back a queue place, cancel the generation) is the cancel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.types import Message

from router.access.admission import PRINCIPAL_SCOPE_KEY, Principal


class _Run:
    __slots__ = ("gone", "task")

    def __init__(self, task: asyncio.Task[None], gone: asyncio.Event) -> None:
        self.task = task
        self.gone = gone


class BackgroundRuns:
    """The background responses still running, by response id."""

    def __init__(self) -> None:
        self._runs: dict[str, _Run] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._runs

    def start(self, rid: str, run: Callable[[Request], Awaitable[None]],
              principal: Principal) -> None:
        """Run ``run(request)`` as a task; ``request`` is the client it relays for, asking
        as ``principal`` (the key that created it)."""
        gone = asyncio.Event()

        async def receive() -> Message:
            await gone.wait()
            return {"type": "http.disconnect"}

        request = Request({"type": "http", "method": "POST", "path": "/v1/responses",
                           "headers": [], "query_string": b"",
                           PRINCIPAL_SCOPE_KEY: principal}, receive)

        async def main() -> None:
            await run(request)

        task = asyncio.create_task(main(), name=f"background {rid}")
        self._runs[rid] = _Run(task, gone)  # held until done: the loop keeps weak references
        task.add_done_callback(lambda _: self._runs.pop(rid, None))

    async def cancel(self, rid: str) -> None:
        """Cancel ``rid``'s run, if it is running, and wait until it has ended."""
        run = self._runs.get(rid)
        if run is None:
            return
        run.gone.set()
        await asyncio.wait({run.task})  # a canceller that leaves does not cancel the run

    async def cancel_all(self) -> None:
        """Cancel every run (the server is stopping) and wait until they have ended."""
        await asyncio.gather(*(self.cancel(rid) for rid in list(self._runs)))
