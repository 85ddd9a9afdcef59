"""``ResponseStore``: stored responses, for ``GET``, ``input_items`` and
``previous_response_id``, bounded in count, bytes and age.

Each entry is kept as JSON bytes (the Response object, and the conversation's input items,
prior turns included), so its size is exact, ``GET`` answers with the bytes as they are,
and a continuation decodes only the items it needs. Entries are ordered by their last
write; the oldest are dropped first, when they pass ``ttl`` or when a write would exceed
``max_items`` or ``max_bytes``. ``StoreCollector`` shows the count, the bytes and the
evictions in the router's Prometheus registry.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from router.api.responses.schema import ResponseItem

_json = msgspec.json.Encoder()


class _Head(msgspec.Struct):
    """The part of a stored Response object a continuation or a cancel reads."""

    status: str
    output: list[ResponseItem] = []
    background: bool | None = None


class Stored:
    """One stored response: its object and its conversation's input items, as JSON, and
    the name of the key that made it (its owner)."""

    __slots__ = ("expires", "items", "owner", "response")

    def __init__(self, response: bytes, items: bytes, expires: float, owner: str) -> None:
        self.response = response
        self.items = items
        self.expires = expires
        self.owner = owner

    @property
    def size(self) -> int:
        return len(self.response) + len(self.items)

    def head(self) -> _Head:
        return msgspec.json.decode(self.response, type=_Head)

    def input_items(self) -> list[ResponseItem]:
        return msgspec.json.decode(self.items, type=list[ResponseItem])

    def conversation(self) -> list[ResponseItem]:
        """What a response continuing this one starts from: its input, then its output."""
        return self.input_items() + self.head().output


class ResponseStore:
    """At most ``max_items`` responses and ``max_bytes`` of JSON, each kept ``ttl``
    seconds after its last write; the oldest go first."""

    def __init__(self, max_items: int = 10_000, max_bytes: int = 64 << 20, ttl: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self.bytes = 0
        self.evicted = {"expired": 0, "count": 0, "bytes": 0}
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        self.expire()
        return len(self._entries)

    def put(self, rid: str, response: dict[str, Any], items: bytes, owner: str = "") -> None:
        """Store (or replace) ``rid`` for ``owner`` (a key's name): its Response object and
        its items' JSON (``encode_items``). One larger than ``max_bytes`` by itself is not
        kept."""
        self.delete(rid)
        entry = Stored(_json.encode(response), items, self.clock() + self.ttl, owner)
        if entry.size > self.max_bytes:
            self.evicted["bytes"] += 1
            return
        self._entries[rid] = entry
        self.bytes += entry.size
        self.expire()
        while len(self._entries) > self.max_items:
            self._pop_oldest("count")
        while self.bytes > self.max_bytes:
            self._pop_oldest("bytes")

    def get(self, rid: str, owner: str = "") -> Stored | None:
        """``rid``, if ``owner`` made it: for any other key it does not exist."""
        self.expire()
        entry = self._entries.get(rid)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def expire(self) -> None:
        """Drop what has passed its ttl: the oldest writes, at the front."""
        now = self.clock()
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.expires > now:
                return
            self._pop_oldest("expired")

    def _pop_oldest(self, reason: str) -> None:
        _, entry = self._entries.popitem(last=False)
        self.bytes -= entry.size
        self.evicted[reason] += 1


def encode_items(items: list[ResponseItem]) -> bytes:
    return _json.encode(items)


class StoreCollector:
    """The store's figures for Prometheus, read at scrape time."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        count = len(self.store)  # expires first, so the bytes are current too
        yield GaugeMetricFamily("modelyard_responses_stored", "Responses held for GET and "
                                "previous_response_id", value=count)
        yield GaugeMetricFamily("modelyard_responses_stored_bytes", "Bytes of JSON those "
                                "responses and their input items take", value=self.store.bytes)
        evicted = CounterMetricFamily("modelyard_responses_evicted", "Stored responses "
                                      "dropped: past their ttl, or to stay within the count "
                                      "or byte bound", labels=["reason"])
        for reason, n in self.store.evicted.items():
            evicted.add_metric([reason], n)
        yield evicted
