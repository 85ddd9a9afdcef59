"""When a model gains or loses a replica (``decide``; the scaler acts on it).

Peers scale on waiting requests, not on utilisation (production-stack and llm-d through
KEDA on ``num_requests_waiting``, Dynamo's planner one worker per interval), and so does
this: one replica is added when the model's oldest waiting request, batch lines aside, has
waited ``replicas.up_wait`` s and that has lasted ``replicas.up_after`` s (``pressure``),
while fewer than ``replicas.max`` run, none is starting, and the room policy finds free
room (``ScaleView.room``: the scaler never stops or parks another model for a replica).
One replica that has served nothing for ``replicas.idle`` s is removed while more than
``replicas.min`` run and nobody waits; it drains (takes no new request, ends when its
last does), so no request is ever cut. Each change waits ``replicas.cooldown`` s after the
one before: a new replica needs seconds to relieve the queue, and counting again at once
would overshoot. ``min: 0`` lets the last replica go too (unless something else holds the
model: ``ScaleView.hold_last``); the next request loads the model as a cold one, so a model
with no replica is never the scaler's to start.

Plain values in, a decision out, deterministic for a clock value: the scaler builds the
view from the model's replicas and queue, and the lifecycle simulation and unit tests
(``tests/test_scale.py``) drive it alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from shared.config import Replicas


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the policy reads of one replica."""

    number: int
    """Its place among the model's replicas (0 to ``max - 1``): its share of the cores."""
    state: Literal["starting", "ready", "parked", "draining"]
    leases: int
    """Requests it serves now, batch lines included."""
    last_used: float
    """When its last request ended, or it became ready (the clock ``now`` is on)."""


@dataclass(frozen=True, slots=True)
class Waiter:
    """A request waiting for the model: since when, and whether it is a batch line."""

    since: float
    batch: bool = False


@dataclass(frozen=True, slots=True)
class ScaleView:
    """One model as the scaler sees it at ``now``."""

    replicas: Sequence[ReplicaView]
    waiters: Sequence[Waiter] = ()
    pressure_since: float | None = None
    """``pressure``'s answer: since when the queue has been long enough to add one."""
    room: bool = False
    """The room policy finds free room for one more replica (no eviction, no park)."""
    last_change: float | None = None
    """When the scaler last added or removed one of this model's replicas."""
    hold_last: bool = False
    """Something else keeps the model loaded (pinned, a ``keep_alive``, a request's
    ``kept_until``): with ``min: 0`` the last replica still stays."""


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """``add`` a replica as number ``replica``, or drain and stop replica ``replica``."""

    action: Literal["add", "remove"]
    replica: int
    why: Literal["min", "queue", "idle", "max"]
    """``min``/``max``: fewer or more run than the preset allows; ``queue``: requests
    wait; ``idle``: a replica has served nothing for ``replicas.idle`` s."""


BACKOFF_MAX = 30.0


def backoff_seconds(failures: int) -> float:
    """Seconds before a worker that failed ``failures`` times in a row starts again: 0
    before the first failure, then 0.5 s, 1 s, 2 s, … up to 30 s (a model's restart after
    a crash or a failed start; a replica's start after its own)."""
    return 0.0 if failures <= 0 else min(BACKOFF_MAX, 0.5 * 2 ** (failures - 1))


def scales(replicas: Replicas) -> bool:
    """Whether a model may run other than one replica (``replicas.max`` above 1, or
    ``min: 0``): the scaler's to watch; a model of exactly one worker runs as before."""
    return replicas.max > 1 or replicas.min != 1


def head_since(waiters: Iterable[Waiter]) -> float | None:
    """Since when the oldest waiting request that is not a batch line has waited (batch
    lines use capacity nobody waits for: they never add a replica)."""
    return min((w.since for w in waiters if not w.batch), default=None)


def pressure(previous: float | None, waiters: Iterable[Waiter], now: float,
             limits: Replicas) -> float | None:
    """Since when the oldest waiting request has waited at least ``up_wait`` without a
    break, as seen at this tick and the one before (``previous``, this function's last
    answer): ``None`` while it has not. A queue that just became long counts from the
    moment its head crossed ``up_wait``, not from the tick that saw it."""
    head = head_since(waiters)
    if head is None or now - head < limits.up_wait:
        return None
    return previous if previous is not None else head + limits.up_wait


def _cooling(view: ScaleView, now: float, limits: Replicas) -> bool:
    return view.last_change is not None and now - view.last_change < limits.cooldown


def _free_number(view: ScaleView, limits: Replicas) -> int | None:
    """The lowest number no replica holds (a draining one still holds its cores)."""
    taken = {r.number for r in view.replicas}
    return next((n for n in range(limits.max) if n not in taken), None)


def decide(limits: Replicas, view: ScaleView, now: float) -> ScaleDecision | None:
    """One change to the model's replicas now, or ``None``. At most one at a time: none
    while a replica starts or drains (a change takes effect before the next is weighed)."""
    running = [r for r in view.replicas if r.state != "draining"]
    if not running:  # unloaded (or scaled to zero): a request loads it, not the scaler
        return None
    if any(r.state in ("starting", "draining") for r in view.replicas):
        return None
    if len(running) > limits.max:  # a reload lowered max: drain the least busy
        victim = min(running, key=lambda r: (r.leases, -r.number))
        return ScaleDecision("remove", victim.number, "max")
    if _cooling(view, now, limits):
        return None
    number = _free_number(view, limits)
    # A parked replica is woken by the room policy first; room is free room only.
    if (number is not None and len(running) < limits.max and view.room
            and not any(r.state == "parked" for r in running)):
        if len(running) < limits.min:
            return ScaleDecision("add", number, "min")
        if (view.pressure_since is not None
                and now - view.pressure_since >= limits.up_after):
            return ScaleDecision("add", number, "queue")
    floor = max(limits.min, 1 if view.hold_last else 0)
    if len(running) <= floor or head_since(view.waiters) is not None:
        return None
    idle = [r for r in running if r.state == "ready" and r.leases == 0
            and now - r.last_used >= limits.idle]
    if not idle:
        return None
    victim = min(idle, key=lambda r: (r.last_used, -r.number))  # the longest idle
    return ScaleDecision("remove", victim.number, "idle")
