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
    __slots__ = ("gone", "owner", "task")

    def __init__(self, task: asyncio.Task[None], gone: asyncio.Event, owner: str) -> None:
        self.task = task
        self.gone = gone
        self.owner = owner


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
        # held until done: the loop keeps weak references
        self._runs[rid] = _Run(task, gone, principal.name)
        task.add_done_callback(lambda _: self._runs.pop(rid, None))

    def revoked(self, names: frozenset[str]) -> None:
        """Keys ``names`` were revoked (``Keys.on_revoked``): their runs end now, as a
        cancel would end them. One that generates has already failed (the relay ends a
        revoked key's generations: ``failed``); one still waiting for its model is
        cancelled here (``cancelled``), rather than when the model is ready."""
        for run in self._runs.values():
            if run.owner in names:
                run.gone.set()

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
