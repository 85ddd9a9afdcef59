"""The scaling policy alone (``router.lifecycle.policy.scale``): a replica is added on a
queue that lasts, into free room only, and removed after it idles, never below ``min``,
one change per ``cooldown``."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from router.lifecycle.policy.scale import (
    ReplicaView,
    ScaleDecision,
    ScaleView,
    Waiter,
    decide,
    head_since,
    pressure,
)
from shared.config import Replicas

LIMITS = Replicas(min=1, max=3, idle=30.0, up_wait=1.0, up_after=2.0, cooldown=10.0)


def ready(number: int, leases: int = 0, last_used: float = 0.0) -> ReplicaView:
    return ReplicaView(number=number, state="ready", leases=leases, last_used=last_used)


def view(replicas: Sequence[ReplicaView], **kw: object) -> ScaleView:
    return ScaleView(replicas=replicas, **kw)  # type: ignore[arg-type]


def test_pressure_starts_when_the_oldest_person_has_waited_up_wait() -> None:
    assert pressure(None, [], 100.0, LIMITS) is None
    assert pressure(None, [Waiter(99.5)], 100.0, LIMITS) is None  # waited 0.5 s < 1 s
    # seen at 100 s, the head crossed up_wait at 98.5 s: pressure counts from then
    assert pressure(None, [Waiter(99.8), Waiter(97.5)], 100.0, LIMITS) == 98.5
    assert pressure(98.5, [Waiter(99.0)], 100.5, LIMITS) == 98.5  # held since: kept
    assert pressure(98.5, [Waiter(100.2)], 100.5, LIMITS) is None  # a break: starts over


def test_batch_lines_alone_make_no_pressure() -> None:
    lines = [Waiter(0.0, batch=True), Waiter(1.0, batch=True)]
    assert head_since(lines) is None
    assert pressure(None, lines, 500.0, LIMITS) is None
    assert head_since([*lines, Waiter(7.0)]) == 7.0


def test_a_queue_adds_one_replica_once_it_lasted_up_after() -> None:
    base = view([ready(0, leases=4)], room=True)
    assert decide(LIMITS, view(base.replicas, room=True, pressure_since=100.0), 101.9) is None
    assert decide(LIMITS, view(base.replicas, room=True, pressure_since=100.0), 102.0) == \
        ScaleDecision("add", 1, "queue")


def test_ticks_add_at_the_moment_the_queue_has_lasted() -> None:
    """Ticks every 0.25 s over a queue whose head came at t = 10: it waits up_wait (1 s),
    then that lasts up_after (2 s): the first add is at t = 13, not a tick sooner."""
    since: float | None = None
    added = None
    for tick in range(80):
        now = 10.0 + tick * 0.25
        waiters = [Waiter(10.0), Waiter(now)]
        since = pressure(since, waiters, now, LIMITS)
        got = decide(LIMITS, view([ready(0, leases=8)], waiters=waiters, room=True,
                                  pressure_since=since), now)
        if got is not None:
            added = now, got
            break
    assert added == (13.0, ScaleDecision("add", 1, "queue"))


def test_batch_lines_waiting_never_add_a_replica() -> None:
    since: float | None = None
    for tick in range(200):
        now = tick * 0.5
        lines = [Waiter(0.0, batch=True)]
        since = pressure(since, lines, now, LIMITS)
        assert decide(LIMITS, view([ready(0, leases=16)], waiters=lines, room=True,
                                   pressure_since=since), now) is None


@pytest.mark.parametrize("why", ["no room", "at max", "starting", "cooling", "parked",
                                 "draining"])
def test_a_queue_adds_nothing_when(why: str) -> None:
    replicas = [ready(0, leases=4), ready(1, leases=4)]
    kw: dict[str, object] = {"room": True, "pressure_since": 0.0, "last_change": None}
    if why == "no room":
        kw["room"] = False
    elif why == "at max":
        replicas.append(ready(2, leases=4))
    elif why == "starting":
        replicas.append(ReplicaView(2, "starting", 0, 0.0))
    elif why == "cooling":
        kw["last_change"] = 95.0
    elif why == "parked":
        replicas = [ReplicaView(0, "parked", 0, 0.0)]
    elif why == "draining":
        replicas.append(ReplicaView(2, "draining", 1, 0.0))
    assert decide(LIMITS, view(replicas, **kw), 100.0) is None
    if why == "cooling":  # and once it has cooled down, it adds
        assert decide(LIMITS, view(replicas, **kw), 105.0) == ScaleDecision("add", 2, "queue")


def test_an_added_replica_takes_the_lowest_free_number() -> None:
    got = decide(LIMITS, view([ready(2, leases=3), ready(0, leases=3)], room=True,
                              pressure_since=0.0), 50.0)
    assert got == ScaleDecision("add", 1, "queue")


def test_below_min_adds_without_a_queue_but_only_into_room() -> None:
    limits = Replicas(min=2, max=3)
    assert decide(limits, view([ready(0)], room=True), 1.0) == ScaleDecision("add", 1, "min")
    assert decide(limits, view([ready(0)], room=False), 1.0) is None


def test_an_unloaded_model_is_not_the_scalers_to_start() -> None:
    waiters = [Waiter(0.0)]
    assert decide(Replicas(min=0, max=3), view([], waiters=waiters, room=True,
                                               pressure_since=0.0), 100.0) is None
    assert decide(Replicas(min=2, max=3), view([], room=True), 100.0) is None


def test_the_longest_idle_replica_goes_after_idle_seconds() -> None:
    replicas = [ready(0, leases=2, last_used=0.0), ready(1, last_used=60.0),
                ready(2, last_used=50.0)]
    assert decide(LIMITS, view(replicas), 79.9) is None  # replica 2 idle 29.9 s
    assert decide(LIMITS, view(replicas), 80.0) == ScaleDecision("remove", 2, "idle")
    # replica 0 was used longest ago but serves two requests: never cut
    assert decide(LIMITS, view(replicas[:2]), 1000.0) == ScaleDecision("remove", 1, "idle")


@pytest.mark.parametrize("why", ["at min", "a person waits", "cooling", "starting",
                                 "draining"])
def test_an_idle_replica_stays_when(why: str) -> None:
    replicas = [ready(0, last_used=0.0), ready(1, last_used=0.0)]
    kw: dict[str, object] = {}
    limits = LIMITS
    if why == "at min":
        limits = Replicas(min=2, max=3)
    elif why == "a person waits":
        kw["waiters"] = [Waiter(99.0)]
    elif why == "cooling":
        kw["last_change"] = 95.0
    elif why == "starting":
        replicas.append(ReplicaView(2, "starting", 0, 0.0))
    elif why == "draining":
        replicas.append(ReplicaView(2, "draining", 0, 0.0))
    assert decide(limits, view(replicas, **kw), 100.0) is None


def test_batch_lines_waiting_do_not_keep_an_idle_replica() -> None:
    replicas = [ready(0, leases=1), ready(1, last_used=0.0)]
    got = decide(LIMITS, view(replicas, waiters=[Waiter(0.0, batch=True)]), 100.0)
    assert got == ScaleDecision("remove", 1, "idle")


def test_min_zero_lets_the_last_replica_go_unless_held() -> None:
    limits = Replicas(min=0, max=2, idle=5.0)
    assert decide(limits, view([ready(0, last_used=0.0)]), 5.0) == \
        ScaleDecision("remove", 0, "idle")
    assert decide(limits, view([ready(0, last_used=0.0)], hold_last=True), 5.0) is None
    assert decide(LIMITS, view([ready(0, last_used=0.0)]), 1000.0) is None  # min 1


def test_above_max_drains_the_least_busy_even_while_cooling() -> None:
    limits = Replicas(min=1, max=2)
    replicas = [ready(0, leases=3), ready(1, leases=1), ready(2, leases=1)]
    got = decide(limits, view(replicas, last_change=99.0), 100.0)
    assert got == ScaleDecision("remove", 2, "max")  # ties: the highest number goes


def test_the_same_view_and_clock_give_the_same_answer() -> None:
    replicas = [ready(0, leases=1, last_used=3.0), ready(1, last_used=4.0)]
    answers = {decide(LIMITS, view(replicas, room=True, pressure_since=1.0), 40.0)
               for _ in range(5)}
    assert len(answers) == 1
