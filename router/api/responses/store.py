"""``ResponseStore``: stored responses, for ``GET``, ``input_items`` and
``previous_response_id``, bounded per key in count, bytes and age, and all keys together.

Each entry is kept as JSON bytes (the Response object, and the conversation's input items,
prior turns included), so its size is exact, ``GET`` answers with the bytes as they are,
and a continuation decodes only the items it needs.

Every key (the owner, a principal's name) has its own ``cachetools.TTLCache``: at most
``max_items`` responses and ``max_bytes`` of JSON, each kept ``ttl`` seconds after its
last write, the least recently used dropped first. One key's writes therefore never drop
another key's responses. All keys together hold at most ``total_items`` and
``total_bytes`` (by default ``TOTAL_FACTOR`` times a key's bounds): past either, the key
holding the most loses its least recently used. ``StoreCollector`` shows the count, the
bytes and the evictions in the router's Prometheus registry.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
from cachetools import TTLCache
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from router.api.responses.schema import ResponseItem

_json = msgspec.json.Encoder()

TOTAL_FACTOR = 8
"""All keys together hold at most this many times one key's bounds (by default)."""


class _Head(msgspec.Struct):
    """The part of a stored Response object a continuation or a cancel reads."""

    status: str
    output: list[ResponseItem] = []
    background: bool | None = None


class Stored:
    """One stored response: its object and its conversation's input items, as JSON, and
    the name of the key that made it (its owner)."""

    __slots__ = ("items", "owner", "response")

    def __init__(self, response: bytes, items: bytes, owner: str) -> None:
        self.response = response
        self.items = items
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


def _size(entry: Stored) -> int:
    return entry.size


class _KeyCache(TTLCache[str, Stored, float]):
    """One key's responses: ``TTLCache`` keeps the byte bound (``getsizeof``) and the
    age; it has one size measure, so ``ResponseStore.put`` keeps the count bound. Every
    removal it makes is counted in ``evicted``, by reason."""

    def __init__(self, max_bytes: int, ttl: float, clock: Callable[[], float],
                 evicted: dict[str, int]) -> None:
        super().__init__(max_bytes, ttl, timer=clock, getsizeof=_size)
        self.evicted = evicted

    def expire(self, time: float | None = None) -> list[tuple[str, Stored]]:
        gone = super().expire(time)
        self.evicted["expired"] += len(gone)
        return gone

    def popitem(self) -> tuple[str, Stored]:
        """The least recently used, dropped to make room within the byte bound (cachetools
        calls it so)."""
        return self.drop_oldest("bytes")

    def drop_oldest(self, reason: str) -> tuple[str, Stored]:
        dropped = super().popitem()
        self.evicted[reason] += 1
        return dropped


def _bytes_of(cache: _KeyCache) -> int:
    return int(cache.currsize)  # typed float: a getsizeof may return one; ours are ints


class ResponseStore:
    """Per key: at most ``max_items`` responses and ``max_bytes`` of JSON, each kept
    ``ttl`` seconds after its last write, the least recently used first; all keys
    together at most ``total_items`` and ``total_bytes``, taken from the key holding the
    most (see the module doc)."""

    def __init__(self, max_items: int = 10_000, max_bytes: int = 64 << 20, ttl: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic, *,
                 total_items: int | None = None, total_bytes: int | None = None) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self.total_items = TOTAL_FACTOR * max_items if total_items is None else total_items
        self.total_bytes = TOTAL_FACTOR * max_bytes if total_bytes is None else total_bytes
        self.evicted = {"expired": 0, "count": 0, "bytes": 0, "total": 0}
        self._keys: dict[str, _KeyCache] = {}

    def __len__(self) -> int:
        self.expire()
        return sum(len(cache) for cache in self._keys.values())

    @property
    def bytes(self) -> int:
        """The JSON held, all keys together (what has passed its ttl included, until
        ``expire``)."""
        return sum(map(_bytes_of, self._keys.values()))

    def put(self, rid: str, response: dict[str, Any], items: builtins.bytes,
            owner: str = "") -> None:
        """Store (or replace) ``rid`` for ``owner`` (a key's name): its Response object and
        its items' JSON (``encode_items``). One larger than ``max_bytes`` by itself is not
        kept, nor is anything when ``max_items`` is 0."""
        self.delete(rid, owner)
        entry = Stored(_json.encode(response), items, owner)
        if entry.size > min(self.max_bytes, self.total_bytes) or not self.max_items:
            self.evicted["bytes" if self.max_items else "count"] += 1
            return
        cache = self._keys.get(owner)
        if cache is None:
            cache = self._keys[owner] = _KeyCache(self.max_bytes, self.ttl, self.clock,
                                                  self.evicted)
        cache[rid] = entry  # drops this key's least recently used past max_bytes
        while len(cache) > self.max_items:
            cache.drop_oldest("count")
        self._within_total()

    def _within_total(self) -> None:
        """Drop from the key holding the most until all keys are within the totals."""
        while sum(len(cache) for cache in self._keys.values()) > self.total_items:
            self._largest(len).drop_oldest("total")
        while self.bytes > self.total_bytes:
            self._largest(_bytes_of).drop_oldest("total")
        self._forget_empty()

    def _largest(self, measure: Callable[[_KeyCache], int]) -> _KeyCache:
        return max(self._keys.values(), key=measure)

    def get(self, rid: str, owner: str = "") -> Stored | None:
        """``rid``, if ``owner`` made it: for any other key it does not exist."""
        cache = self._keys.get(owner)
        if cache is None:
            return None
        found: Stored | None = cache.get(rid)
        return found

    def delete(self, rid: str, owner: str = "") -> bool:
        """Forget ``owner``'s ``rid``; whether it was there."""
        cache = self._keys.get(owner)
        if cache is None or cache.pop(rid, None) is None:
            return False
        if not cache:
            del self._keys[owner]
        return True

    def expire(self) -> None:
        """Drop what has passed its ttl, and the keys left with nothing."""
        for cache in self._keys.values():
            cache.expire()
        self._forget_empty()

    def _forget_empty(self) -> None:
        for owner in [owner for owner, cache in self._keys.items() if not cache]:
            del self._keys[owner]


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
                                      "dropped: past their ttl, to stay within a key's count "
                                      "or byte bound, or within all keys' total",
                                      labels=["reason"])
        for reason, n in self.store.evicted.items():
            evicted.add_metric([reason], n)
        yield evicted
