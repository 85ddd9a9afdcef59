"""Token buckets: the arithmetic under the request and token limits, no ASGI.

``TokenBuckets`` (one bucket per client, a request a token: ``RateLimit`` and the wrong-key
counter of ``KeyGuard``) and ``TokensPerMinute`` (a key's ``tpm``, spent by the relay as
requests end). Apart from ``limits.py`` so that ``admission.py`` and ``limits.py`` need not
import each other.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

MAX_CLIENTS = 65_536
"""Buckets kept at most; about 260 bytes each (a full-length IPv6 address), so the
limiter stays under 20 MB."""


class _Bucket:
    __slots__ = ("stamp", "tokens")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp


class TokenBuckets:
    """One token bucket per client: ``size`` tokens, refilled at ``per_minute`` a minute,
    one taken per request.

    Memory is bounded: at most ``max_clients`` buckets, least recently seen dropped first.
    A dropped bucket has refilled to full (so forgetting it changes nothing) unless more
    than ``max_clients`` clients were seen within one refill period (``size / rate``);
    only a client cycling through addresses gets there, and a new address would give it a
    fresh bucket anyway.

    Written here rather than taken from ``limits``: that library offers fixed, moving and
    sliding windows, not a bucket with a burst and a steady refill (what
    ``rate_limit_burst`` promises and ``Retry-After`` is computed from); its in-memory
    moving window keeps a timestamp per request, its storage has no bound on clients,
    and each check is a call through its storage layer, where this is two floats and a
    dict move per request on the hot path (``make bench BENCH=ledger``).
    """

    def __init__(self, per_minute: int, burst: int = 0, max_clients: int = MAX_CLIENTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.size = float(burst or per_minute)
        self.rate = per_minute / 60.0  # tokens per second
        self.max_clients = max_clients
        self.clock = clock
        self._buckets: OrderedDict[Hashable, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, client: Hashable) -> int:
        """Take a token for ``client``: the whole tokens left, or -1 when there was none."""
        now = self.clock()
        bucket = self._buckets.get(client)
        if bucket is None:
            if len(self._buckets) >= self.max_clients:
                self._buckets.popitem(last=False)
            bucket = self._buckets[client] = _Bucket(self.size, now)
        else:
            self._buckets.move_to_end(client)
            bucket.tokens = min(self.size, bucket.tokens + (now - bucket.stamp) * self.rate)
            bucket.stamp = now
        if bucket.tokens < 1.0:
            return -1
        bucket.tokens -= 1.0
        return int(bucket.tokens)

    def empty(self, client: Hashable) -> bool:
        """Whether ``client``'s next ``take`` would be refused (takes nothing)."""
        bucket = self._buckets.get(client)
        if bucket is None:
            return False
        return min(self.size, bucket.tokens + (self.clock() - bucket.stamp) * self.rate) < 1.0

    def retry_after(self, client: Hashable) -> int:
        """Whole seconds (at least 1) until ``client``'s next token, after a refused take."""
        bucket = self._buckets[client]
        return max(1, math.ceil((1.0 - bucket.tokens) / self.rate))


class TokensPerMinute:
    """Each key's tokens per minute (its ``tpm``) as a bucket of ``tpm`` tokens refilled at
    that rate: a request is admitted while its key's bucket holds any, and its prompt
    and completion tokens are taken once it is done (the last one may overdraw; the
    next waits until the bucket is above zero again). Only keys with a ``tpm`` have one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[str, tuple[_Bucket, float]] = {}  # key -> (bucket, per second)

    def _refilled(self, key: str) -> _Bucket | None:
        found = self._buckets.get(key)
        if found is None:
            return None
        bucket, rate = found
        now = self.clock()
        bucket.tokens = min(rate * 60, bucket.tokens + (now - bucket.stamp) * rate)
        bucket.stamp = now
        return bucket

    def wait(self, key: str, tpm: int) -> int:
        """0 if ``key`` may send a request now, else whole seconds until it may."""
        bucket = self._refilled(key)
        if bucket is None:
            self._buckets[key] = (_Bucket(float(tpm), self.clock()), tpm / 60.0)
            return 0
        self._buckets[key] = (bucket, tpm / 60.0)  # a changed tpm applies from now
        return 0 if bucket.tokens > 0 else max(1, math.ceil(-bucket.tokens / (tpm / 60.0)))

    def spend(self, key: str, tokens: int) -> None:
        """A finished request of ``key`` used ``tokens``."""
        bucket = self._refilled(key)
        if bucket is not None:
            bucket.tokens -= tokens
