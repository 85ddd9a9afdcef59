"""Route policy: which replica of a model serves a request. Plain functions over numbers
(each replica's load, what the prefix index matched, the session's replica): no state,
no clock, no supervisor; the caller keeps ``ReplicaLoad.routed_seq`` and the index.

``prefix`` (the default), after SGLang's cache-aware router: the session's replica, unless
it is overloaded; else the replica that was sent the longest prefix of this prompt, when
that covers at least ``min_prefix_share`` of it and the replica is not overloaded; else
the least loaded. A replica is overloaded when its load exceeds the least loaded one's by
``balance_abs`` and by ``balance_rel`` times (both: 5 against 1 is a lot, 40 against 36
is not; SGLang's rule, per model). ``least_loaded`` and ``round_robin`` ignore the hint,
for comparison and for those who want them. Ties go to the replica routed least recently,
then the lowest number: deterministic, and they spread an idle model's requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from shared.config import Routing  # the preset's knobs, checked where the preset loads

Why = Literal["only", "session", "prefix", "least_loaded", "round_robin"]


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica as routing sees it."""

    number: int
    in_flight: int = 0
    queued: int = 0
    """Requests that hold a lease on it but wait for its slot."""
    ready: bool = True
    draining: bool = False
    routed_seq: int = 0
    """The caller's sequence number of the last request routed to it (0: none yet)."""

    @property
    def load(self) -> int:
        return self.in_flight + self.queued

    @property
    def serving(self) -> bool:
        return self.ready and not self.draining


@dataclass(frozen=True, slots=True)
class RouteHint:
    """What the prefix index knows of a request (``PrefixIndex.hint``)."""

    session: int | None = None
    """The replica the request's session last went to."""
    matched: Mapping[int, int] = field(default_factory=dict)
    """Per replica, the bytes of this prompt it was sent as a prefix."""
    size: int = 0
    """The prompt's bytes."""

    def share(self, replica: int) -> float:
        return self.matched.get(replica, 0) / self.size if self.size else 0.0


@dataclass(frozen=True, slots=True)
class Choice:
    replica: int
    why: Why
    share: float = 0.0
    """The share of the prompt the chosen replica was sent as a prefix."""
    escaped: bool = False
    """The session's or a matching replica was passed over as overloaded."""


def overloaded(load: int, least: int, routing: Routing) -> bool:
    """``load`` is too far above the least loaded replica's to send it more."""
    return load - least >= routing.balance_abs and load >= routing.balance_rel * least


def choose(replicas: Sequence[ReplicaLoad], routing: Routing,
           hint: RouteHint | None = None) -> Choice | None:
    """The replica for a request, or ``None`` when none is ready and not draining."""
    serving = [r for r in replicas if r.serving]
    if not serving:
        return None
    if len(serving) == 1:
        return Choice(serving[0].number, "only", hint.share(serving[0].number) if hint else 0.0)
    if routing.strategy == "round_robin":
        turn = min(serving, key=lambda r: (r.routed_seq, r.number))
        return Choice(turn.number, "round_robin")
    least = min(r.load for r in serving)
    escaped = False
    if routing.strategy == "prefix" and hint is not None:
        if hint.session is not None:
            sticky = next((r for r in serving if r.number == hint.session), None)
            if sticky is not None:
                if not overloaded(sticky.load, least, routing):
                    return Choice(sticky.number, "session", hint.share(sticky.number))
                escaped = True
        best: ReplicaLoad | None = None
        for r in serving:
            seen = hint.matched.get(r.number, 0)
            if seen <= 0 or seen < routing.min_prefix_share * hint.size:
                continue
            if overloaded(r.load, least, routing):
                escaped = True
                continue
            if best is None or _prefix_order(r, seen) < _prefix_order(best, hint.matched[best.number]):
                best = r
        if best is not None:
            return Choice(best.number, "prefix", hint.share(best.number), escaped)
    fewest = min(serving, key=lambda r: (r.load, r.routed_seq, r.number))
    return Choice(fewest.number, "least_loaded", hint.share(fewest.number) if hint else 0.0,
                  escaped)


def _prefix_order(r: ReplicaLoad, seen: int) -> tuple[int, int, int, int]:
    """The longest match first, then the least loaded, routed least recently, lowest."""
    return (-seen, r.load, r.routed_seq, r.number)
