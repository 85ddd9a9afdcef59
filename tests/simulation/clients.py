"""The simulation's clients, as the router sees them: what the relay uses of a Starlette
request (``SimRequest``: its scope and its disconnect), a protocol's ``Shaper`` that only
counts (``SimShaper``), and each operation's ``Client``: its task and how it ended.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from router.errors import APIError
from router.workers.link import Usage
from shared.protocol import Delta
from tests.simulation.world import Op


class SimRequest:
    """What the relay uses of a Starlette request: ``receive`` (for disconnects) and
    ``scope`` (no key: the open server's principal; a batch line's names its batch)."""

    def __init__(self) -> None:
        self.scope: dict[str, Any] = {}
        self.gone = asyncio.Event()
        self.streaming: asyncio.Task[Any] | None = None

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


class SimShaper:
    has_reasoning = False  # loading progress, if asked for, as comments

    def __init__(self) -> None:
        self.deltas = 0
        self.errored = False
        """The stream ended with an error event (its response had begun: a 200)."""

    def chunks(self, batch: list[Delta]) -> bytes:
        self.deltas += len(batch)
        return b"c"

    def close(self, usage: Usage) -> bytes:
        return b"end"

    def error_event(self, err: APIError) -> bytes:
        self.errored = True
        return b"error"

    def add(self, batch: list[Delta]) -> None:
        self.deltas += len(batch)

    def body(self, usage: Usage) -> dict[str, Any]:
        return {"deltas": self.deltas}


@dataclass
class Client:
    op: Op
    task: asyncio.Task[str]
    left: bool = False
    """The harness made it leave (cancelled its task)."""
    lines: dict[asyncio.Task[None], None] = field(default_factory=dict)
    """A batch's lines in flight, in the order they began (a set's order would follow
    the tasks' addresses, which differ from one process to the next: a seed would not
    replay the same way)."""

    def outcome(self) -> str:
        if not self.task.done():
            return "pending"
        if self.task.cancelled():
            return "left" if self.left else "cancelled"
        err = self.task.exception()
        if err is None:
            return self.task.result()
        if isinstance(err, APIError):
            return f"{err.status} {type(err).__name__}"
        return f"raised {type(err).__name__}: {err}"
