"""``EventBus``: what happens in the router, as small dicts, to whoever listens.

An event is a plain dict: ``type``, ``id`` (a counter, from 1), ``time`` (Unix seconds),
``model`` (or ``None``) and the type's own fields:

    state     a model's state changed: ``state``, ``pid``, and ``reason``, ``error``,
              ``exit_code`` where there is one
    load      a load finished: ``load_seconds``, ``load_phases``, ``pid``
    eviction  a model stops (or yields) to make room: ``for`` (the model that needs the
              room), ``action`` (``stop`` or ``yield``), ``reason`` (``policy.room.why``)
    request   one finished request: what its request-log line says (``key``: the name
              of the key that asked)
    batch     a batch changed (``router.batches.runner``): ``action`` (``created``,
              ``in_progress``, ``progress``, ``cancelling``, ``ended``), ``batch`` (its
              id), ``key`` (its owner's name), ``shape``, ``endpoint``, ``status``,
              ``total``, ``done`` and the counts ``succeeded``, ``errored``, ``canceled``,
              ``expired``
    dropped   (only to one subscriber) ``count`` events it was too slow to take

Publishing never waits: each subscriber has a bounded queue, and a subscriber that falls
behind loses its oldest events (counted, and told as a ``dropped`` event) instead of
holding the publisher, which is the supervisor or a request's relay. A new subscriber
first gets the last ``history`` events, so a page that connects sees what just happened.
Everything runs on the router's event loop; nothing here is thread-safe.

``request`` events come with every request and are mostly read by nobody: ``publish_with``
keeps such an event's arguments and makes its dict only when someone reads it (a
subscriber at once, the recent list when it is read). Its ``id`` and ``time`` are taken
when it is published either way.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Self

Event = dict[str, Any]

Fields = Callable[..., dict[str, Any]]
"""What makes a ``publish_with`` event's own fields from the arguments it kept."""


class Subscription:
    """One listener's bounded queue; iterate it (``async for``) or call ``get``."""

    def __init__(self, bus: EventBus, size: int) -> None:
        self._bus = bus
        self.queue: asyncio.Queue[Event] = asyncio.Queue(size)
        self.dropped = 0
        """Events lost since the last ``get`` told of them."""
        self.dropped_total = 0

    def offer(self, event: Event) -> None:
        """Queue ``event``; when full, the oldest queued event is dropped (and counted)."""
        if self.queue.full():
            self.queue.get_nowait()
            self.dropped += 1
            self.dropped_total += 1
        self.queue.put_nowait(event)

    async def get(self, timeout: float | None = None) -> Event | None:
        """The next event; a ``dropped`` event first if any were lost; ``None`` after
        ``timeout`` seconds without one."""
        if self.dropped:
            count, self.dropped = self.dropped, 0
            return {"type": "dropped", "id": None, "time": time.time(), "model": None,
                    "count": count}
        if self.queue.empty() and timeout is not None:
            try:
                return await asyncio.wait_for(self.queue.get(), timeout)
            except TimeoutError:
                return None
        return await self.queue.get()

    def close(self) -> None:
        self._bus.unsubscribe(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventBus:
    """In-process publish/subscribe of events (see the module docstring)."""

    def __init__(self, history: int = 200, queue_size: int = 1000) -> None:
        # Events, and ``publish_with``'s not made yet: (type, id, time, model, fields, args).
        self._recent: deque[Event | tuple[Any, ...]] = deque(maxlen=history)
        self.queue_size = queue_size
        self._subscribers: set[Subscription] = set()
        self._ids = itertools.count(1)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    @property
    def recent(self) -> list[Event]:
        """The last ``history`` events, oldest first."""
        recent = self._recent
        for i, event in enumerate(recent):
            if type(event) is tuple:
                recent[i] = _made(*event)
        return list(recent)  # type: ignore[arg-type]  # all made now

    def publish(self, type: str, model: str | None = None, **fields: Any) -> Event:
        """Make an event and hand it to every subscriber at once; never waits."""
        event: Event = {"type": type, "id": next(self._ids), "time": round(time.time(), 3),
                        "model": model, **fields}
        self._deliver(event)
        return event

    def publish_with(self, type: str, model: str | None, fields: Fields, *args: Any) -> None:
        """``publish`` an event whose own fields are ``fields(*args)``, made only when
        someone reads the event."""
        pending = (type, next(self._ids), time.time(), model, fields, args)
        if self._subscribers:
            self._deliver(_made(*pending))
        else:
            self._recent.append(pending)

    def _deliver(self, event: Event) -> None:
        self._recent.append(event)
        for sub in self._subscribers:
            sub.offer(event)

    def subscribe(self, replay: bool = True) -> Subscription:
        """A new subscription, holding the recent events first when ``replay``."""
        sub = Subscription(self, self.queue_size)
        if replay:
            for event in self.recent:
                sub.offer(event)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)


def _made(type: str, id: int, at: float, model: str | None, fields: Fields,
          args: tuple[Any, ...]) -> Event:
    return {"type": type, "id": id, "time": round(at, 3), "model": model, **fields(*args)}
