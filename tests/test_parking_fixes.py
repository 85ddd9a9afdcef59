"""Review findings on the CPU park (issue 37, after 0483ec7), each as a test that fails on
it (synthetic workers, as ``tests/test_parking.py``; policy as ``tests/test_policy.py``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, cast

from router.access.admission import OPEN
from router.api.admin import AdminAPI
from router.lifecycle.policy import park, room
from router.lifecycle.supervisor import Supervisor
from shared.protocol import Generate, SamplingSpec
from tests.test_parking import run, supervisor, until, use
from tests.test_policy import NOW, WALL, models, running, waiting


def test_a_wake_tells_the_whole_wait_its_requests_saw_beside_the_resume(
        tmp_path: Path) -> None:
    """A request for parked ``a`` waits while ``b`` streams within its turn; then ``a``
    wakes. The ``wake`` event's ``seconds`` and ``switch_seconds{kind="wake"}`` time the
    resume alone, from after the line for room (bench/swap.py's figure), so on 0483ec7 an
    operator saw milliseconds for a wake a request waited seconds for. The event's
    ``waited`` and the ``wake_wait`` histogram tell that wait."""
    sup = supervisor(tmp_path, {"park_quantum": 60},
                     a={}, b={"engine_args": {"tokens_per_second": 20}})
    seen: list[tuple[str, str, float]] = []
    sup.parker.observe = lambda model, kind, seconds: seen.append((model, kind, seconds))

    async def scenario() -> None:
        a, b = sup.registry.entries["a"], sup.registry.entries["b"]
        await use(sup, "a")
        await use(sup, "b")
        assert a.state == "parked"
        stream = asyncio.create_task(use(sup, "b", tokens=40))  # 2 s; b's turn is 60 s
        await until(lambda: b.leases == 1, 10, "b serves")
        began = time.monotonic()
        assert await use(sup, "a") == "tok tok "  # a's wake waits for b's stream
        took = time.monotonic() - began
        await stream
        event = next(e for e in reversed(sup.events.recent)
                     if e["type"] == "wake" and e["model"] == "a")
        # b had more than a second of its stream left (20 tokens/s, 40 tokens): the
        # request waited at least that long, slower hosts only longer
        assert 1.0 <= event["waited"] <= took + 0.05
        assert event["seconds"] < event["waited"]
        wakes = [s for m, k, s in seen if (m, k) == ("a", "wake")]
        waits = [s for m, k, s in seen if (m, k) == ("a", "wake_wait")]
        assert len(wakes) == len(waits) == 1
        assert round(waits[0], 4) == event["waited"] and round(wakes[0], 4) == event["seconds"]

    run(sup, scenario)


async def use_as_the_relay(sup: Supervisor, name: str, tokens: int) -> str:
    """``use``, its stream closed as the relay closes it when its client goes (its
    generation cancelled, so nothing is in flight on the link any more)."""
    lease, link = await sup.acquire(name)
    stream = link.submit([Generate(id=f"g-{name}-{time.monotonic_ns()}", prompt="hi",
                                   sampling=SamplingSpec(max_tokens=tokens))])
    try:
        text = ""
        async for deltas in stream:
            text += "".join(d.text for d in deltas)
        return text
    finally:
        stream.close()
        lease.release()


def test_a_paused_request_cancelled_while_parked_wakes_no_one(tmp_path: Path) -> None:
    """``a``'s stream is paused mid-answer (parked once its turn is over and ``b`` waits);
    its client goes while ``a`` is parked. ``Parker._park`` had asked for ``a``'s next
    turn for that request, and on 0483ec7 the wake went on for no one: once ``b``'s own
    turn was over, ``b`` (still streaming) was parked and ``a`` woken, idle. A wake its
    paused requests alone asked for ends, unwoken, once none is left, and ``b`` keeps the
    cores; a later request wakes ``a`` as ever."""
    sup = supervisor(tmp_path, {"park_quantum": 1.0},
                     a={"engine_args": {"tokens_per_second": 20}},
                     b={"engine_args": {"tokens_per_second": 20}})

    async def scenario() -> None:
        a, b = sup.registry.entries["a"], sup.registry.entries["b"]
        await use(sup, "b")  # loaded once: the switches below are parks and wakes
        paused = asyncio.create_task(use_as_the_relay(sup, "a", 60))  # 3 s alone
        await until(lambda: a.state == "ready" and a.leases == 1, 30, "a serves")
        await asyncio.sleep(1.1)  # past a's turn
        busy = asyncio.create_task(use_as_the_relay(sup, "b", 200))  # 10 s: b stays busy
        try:
            await until(lambda: a.state == "parked" and b.state == "ready", 10,
                        "a is parked mid-stream for b")
            assert a.leases == 1 and not paused.done()
            paused.cancel()  # its client goes
            await asyncio.gather(paused, return_exceptions=True)
            assert a.leases == 0 and a.replica is not None and not a.busy
            wakes, parks = a.wakes, b.parks
            await asyncio.sleep(3.0)  # three of b's turns: on 0483ec7 a woke after one
            assert (a.state, a.wakes, b.state, b.parks) == ("parked", wakes, "ready", parks)
            assert await use(sup, "a") == "tok tok "  # asked for: it wakes (b parks)
            assert a.wakes == wakes + 1 and a.loads == 1
        finally:
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)

    run(sup, scenario)


def test_resident_mib_is_shown_only_while_a_worker_holds_it(tmp_path: Path) -> None:
    """``resident_mib`` in ``/v1/models`` is what the model's worker holds. On 0483ec7 it
    stayed after the model stopped (``ModelEntry.resident_bytes`` is kept, rightly, as
    the next load's expected size), so the listing showed memory nobody held."""
    sup = supervisor(tmp_path, a={}, b={})
    api = AdminAPI(sup, 1 << 20, cast(Any, None))

    async def scenario() -> None:
        a = sup.registry.entries["a"]
        await use(sup, "a")
        await until(lambda: a.resident_bytes > 0, 5, "a's memory is measured")
        assert api.model_object(a, OPEN)["resident_mib"] == a.resident_bytes // 2 ** 20
        await use(sup, "b")
        assert a.state == "parked"  # a parked worker holds it still
        assert api.model_object(a, OPEN)["resident_mib"] == a.resident_bytes // 2 ** 20
        await sup.stop(a)
        assert a.state == "unloaded" and a.resident_bytes > 0  # kept for the estimate
        assert "resident_mib" not in api.model_object(a, OPEN)

    run(sup, scenario)


def test_a_model_on_ray_stops_instead_of_parking() -> None:
    """A Ray worker's ``freeze`` can do nothing (``RayHandle``: its actor and link must go
    on) and this host cannot measure it (``resident_bytes`` 0). On 0483ec7 such a model
    parked all the same: an engine paused alone, still polling on its cores, and counted
    as holding nothing against ``park_memory_gib``, which it never filled. It stops, as
    before parking; the same model on this host parks."""
    for backend, action in (("ray", "evict"), ("local", "park")):
        m, server = models({"park_memory_gib": 4, "backend": backend}, a={}, b={})
        a, b = running(m["a"], idle_for=10.0), waiting(m["b"])
        assert a.spec.backend == backend
        assert park.may_park(a, b, [a], server, None) == (action == "park")
        decision = room.decide(b, [a, b], [a], server, {}, {}, now=NOW, wall=WALL,
                               waited=0.0, parked=[], parking=True)
        assert (decision.action, decision.victim) == (action, a)


def test_the_room_a_park_made_for_a_wake_is_its_own() -> None:
    """Simulation seed 800170 (on 1d77907's world): ``m2``, parked, wakes for a request;
    ``m1`` is parked for it (``max_parked_models: 1`` allows it only because ``m2``
    leaves the parked set). In the turns the park takes, a load of higher priority
    (``m0``) joins the line and, first by priority, takes the room the park freed: two
    parked past ``max_parked_models`` (past ``park_memory_gib`` likewise), and ``m2``'s
    requests waited on (to a 503 after ``load_timeout`` there). On 0483ec7 ``m0`` was
    first; the room a park made during a waiter's wait is that waiter's (``owed``)."""
    m, server = models({"max_parked_models": 1, "park_memory_gib": 4},
                       m0={"priority": 5}, m1={}, m2={})
    m0, m1, m2 = m["m0"], m["m1"], m["m2"]
    running(m2, state="parked", idle_for=5.0)
    waiting(m2, NOW - 0.3)  # its wake waits for room
    running(m1, state="parked", idle_for=0.2)
    m1.parked_for, m1.parked_at = "m2", NOW - 0.1  # parked for it, during its wait
    waiting(m0, NOW - 0.2)  # a higher priority joined the line meanwhile
    line = list(m.values())
    assert room.first_in_line(m2, line) and not room.first_in_line(m0, line)
    assert room.decide(m2, line, [], server, {}, {}, now=NOW, wall=WALL, waited=0.3,
                       parked=[m1, m2], parking=True).action == "fits"
    assert room.decide(m0, line, [], server, {}, {}, now=NOW, wall=WALL, waited=0.2,
                       parked=[m1, m2], parking=True) == room.WAIT
    # A park before this wait (an earlier wait of m2's, given up) makes no claim: the
    # line goes by priority again.
    m1.parked_at = NOW - 1.0
    assert room.first_in_line(m0, line) and not room.first_in_line(m2, line)
