"""The lifecycle simulation: a seeded random schedule against the real ``Supervisor``.

One seed gives one world (``world.make_world``): a preset of 2-4 models (CPU and one- or
two-GPU, caps, priorities, pins, ttl, sleep), server limits (``max_loaded_models``,
memory budgets, short timeouts) and a schedule of operations at virtual times:

- ``request``: a client asks a model for ``tokens`` tokens, streamed or not, through the
  real ``Relay`` (``relay``: its disconnect watchers see the client leave) or straight
  through ``Supervisor.acquire`` / ``WorkerLink.submit`` / ``Lease.release``
  (some relay streams are ``cold``: they begin at once with keep-alive events, as the
  Anthropic endpoint's do)
  (``direct``: leaving cancels its task); ``leave`` seconds later it goes away, whatever
  it is doing then (queued for a slot, waiting for a load, at its first batch, mid-stream);
- ``load`` (``start_loading`` or acquire-and-release, as ``/v1/models/load``), ``unload``
  (``stop``, ``force`` or not), ``crash`` (the model's worker exits), ``reload``
  (``registry.reconfigure`` with one model changed, removed or restored, then
  ``retire``/``refresh`` as ``router.lifecycle.reload`` does, or ``max_loaded_models`` changed in
  place, as a reload applies a runtime key);
- ``batch``: a batch's ``lines`` for one model, as ``router.batches.runner`` runs them:
  each waits until ``RoomMaker.batch_may_run`` says yes (or the batch gives up), then
  leases at batch priority (``batch=True``: through the relay with the batch in its
  scope, or ``acquire_now``/``acquire``), ``at_once`` at a time; leaving cancels them.

Some clients leave at a moment of their model rather than at a time (``world.MOMENTS``:
the turn a slot is given back, a lease granted, a load ends), or some turns after it; a
batch then leaves as the runner stops one (its lines cancelled, then its task).

Some worlds have LoRA adapter models on one base (``world.add_adapters``): requests,
loads and unloads may name one (a load or unload of an adapter does what
``/v1/models/load`` and ``/unload`` do: ``WorkerLink.adapters`` on its base), and reloads
add, remove, re-point (a new folder) or re-pin them.

Workers fail as the seed says (``fakes.draw_plan``): spawn errors, hung or crashing
boots, engines that refuse to start, shutdowns ignored, failing sleeps, engine errors,
adapters that fail to load or kill the engine as they load.

Models park (``router.lifecycle.parking``) within each world's limits (``world.add_parking``):
a fake worker's engine pauses at ``Sleep(level=0)`` with its requests and its process
freezes (``fakes``); the host's memory is the simulated one (``host_memory``). Some
operations wait for a model to enter ``parking``, ``parked`` or ``waking`` (``on_state``,
``turns`` after, within ``within`` s): a crash (kill -9 of a frozen worker too), an
unload, a reload, a load; ``reload`` ``change=park`` lowers parking's limits in place.
Parking's invariants (``invariants``, (a)-(e)) are checked at each state change, eviction,
operation, engine step and thaw, and at quiescence, which waits for wakes too.

After the schedule nothing more is issued; every client must answer within a bounded
(virtual) time, the supervisor must settle, and then ``invariants`` checks: no lease or
``max_concurrent`` slot held, no GPU start lock held, no model left
``loading``/``stopping``, placements = running workers, every worker process known to
the supervisor; no adapter model holds a worker, a state, a lease, a slot or a load of
its own, and every ``Generate`` reached the worker of the model it named (an adapter's:
its base's, with the adapter as its ``lora``) at its priority (a batch line's after
others'); then ``stop_all`` must return and leave no process running. During the run no
adapter model has a state or load event, or is evicted, or has a model evicted for it;
and ``batch_watch.BatchWatch`` checks that batch lines yield to people: no slot goes to
a batch line while a client's request waits for one, batch leases are no one's demand,
a person's load never waits on batch lines, and a load only batch lines asked for never
takes the room of a model a person used within ``BATCH_QUIET``.

Seeds from ``world.REPLICA_SEEDS`` up are replica worlds (``world.add_replicas``): some
models run several replicas, each fake worker named by its replica's key (``m0#1``); a
``crash`` may name one (``replica``), and operations may wait for a replica of their model
to start, serve or drain (``on_replica``). Every request is routed as the relay routes it
(``Supervisor.route``, watched: ``_watch_routes``), and replica events, routes, engine
steps and quiescence check the replica invariants (``invariants``, r1-r8).

Run one seed: ``python -m tests.simulation.harness 1234`` (prints its trace), or
``SIM_SEED=1234 pytest tests/simulation -k one_seed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import hashlib
import logging
import os
import random
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from router.access.admission import BATCH_SCOPE_KEY
from router.api.relay import BATCH_PRIORITY, SESSION_HEADER, Relay
from router.api.wire import cancel_and_wait
from router.batches.runner import WAIT_FOR_ROOM
from router.errors import APIError
from router.lifecycle import room_maker
from router.lifecycle.replica import replica_key
from router.lifecycle.supervisor import Supervisor
from router.registry import Lease, ModelEntry, ModelRegistry
from router.workers.link import Usage, WorkerLink
from router.workers.placement import Placer
from shared import preset_loader
from shared.config import ConfigError, Preset
from shared.preset_loader import build_preset
from shared.protocol import Generate, SamplingSpec
from tests.simulation import invariants
from tests.simulation.batch_watch import BATCH_LINE, BatchWatch
from tests.simulation.clients import Client, SimRequest, SimShaper
from tests.simulation.fakes import Q, SimBackend, SimContext, SimNet, SimWorker
from tests.simulation.invariants import SETTLE_WITHIN
from tests.simulation.vtime import VirtualClock, VirtualTimeLoop, after_turns, virtual_time
from tests.simulation.world import (
    ADAPTER_RANKS,
    Op,
    World,
    conversation_prompt,
    make_world,
    shown_body,
)

ANSWER_WITHIN = 40.0
"""Virtual seconds after the last operation by which every client must have answered."""
STOP_ALL_WITHIN = 20.0
SHORT_TRACE = 80
MODEL_NAME = re.compile(r"\b(?:m|ad)\d\b")
HOST_CORES = frozenset({0, 1, 2, 3})
"""The simulated host's cores: the ``Placer``'s, and what the preset loader counts."""


# -- the harness's writes inside the supervisor -------------------------------------
@contextlib.contextmanager
def host_memory(net: SimNet) -> Iterator[None]:
    """This host's memory, as the room maker reads it (``psutil.virtual_memory``), is the
    simulated host's (``SimNet.host_memory``): a run never reads the real machine's."""
    names = vars(room_maker)  # its ``import psutil``, as ``virtual_time`` patches ``time``
    saved = names["psutil"]
    names["psutil"] = SimpleNamespace(virtual_memory=net.host_memory)
    try:
        yield
    finally:
        names["psutil"] = saved


class _HostOs:
    """The ``os`` the preset loader sees: the real one, but this host's cores are the
    simulated host's (``HOST_CORES``)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def sched_getaffinity(pid: int) -> set[int]:
        return set(HOST_CORES)


@contextlib.contextmanager
def host_cores() -> Iterator[None]:
    """This host's cores, as the preset loader counts them (a local CPU model's replicas
    need one each), are the simulated host's: a world is the same on any machine."""
    names = vars(preset_loader)
    saved = names["os"]
    names["os"] = _HostOs()
    try:
        yield
    finally:
        names["os"] = saved


def install_fakes(sup: Supervisor, net: SimNet) -> None:
    """Put the simulated world under ``sup``: its workers start through ``SimBackend``, and
    its links (real ``WorkerLink``s) get ``SimSocket``s from the ZeroMQ context they are
    made with. The harness's only writes inside the supervisor besides the watches'
    (``Simulation._watch_leases``, ``BatchWatch._watch_loads``); adjust here if they move."""
    sup._ctx.term()
    sup._ctx = SimContext(net)  # type: ignore[assignment]
    sup.backends["local"] = SimBackend(net)


@dataclass
class Result:
    seed: int
    violations: list[str]
    trace: str
    digest: str

    def report(self, short: bool = False) -> str:
        """The findings, how to replay them, and the trace (``short``: only the lines of
        the models the findings name, at most ``SHORT_TRACE`` of them)."""
        head = [f"seed {self.seed}: " + "; ".join(self.violations),
                (f"reproduce: SIM_SEED={self.seed} pytest tests/simulation -k one_seed -s "
                 f"(or python -m tests.simulation.harness {self.seed})")]
        lines = self.trace.splitlines()
        if short:
            named = set(MODEL_NAME.findall(" ".join(self.violations)))
            config = [line for line in lines if not line.startswith("    ")]
            events = [line for line in lines if line.startswith("    ")
                      and (not named or named & set(MODEL_NAME.findall(line)))
                      and "TooManyRequests" not in line]
            cut = len(events) - SHORT_TRACE
            lines = config + events[:SHORT_TRACE] + (
                [f"    ... {cut} more: run the seed alone for the whole trace"] if cut > 0 else [])
        return "\n".join(head + lines)


class _Recorder(logging.Handler):
    """Keeps the router's warnings for the trace, and its logged exceptions as findings."""

    def __init__(self, net: SimNet) -> None:
        super().__init__(logging.WARNING)
        self.net = net
        self.exceptions: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().splitlines()[0][:160]
        self.net.note(f"log {record.levelname.lower()}: {message}")
        if record.exc_info:
            self.exceptions.append(f"logged exception: {message}: {record.exc_info[1]!r}")


class Simulation:
    def __init__(self, world: World, loop: VirtualTimeLoop, runtime_dir: Path) -> None:
        self.world = world
        self.loop = loop
        self.net = SimNet(loop, random.Random(world.seed * 7919 + 1), world.chaos,
                          memory_seed=world.seed * 86028121 + 7)
        self.net.host_gib = world.host_gib
        self.net.on_step = self._on_step
        self.net.on_thaw = self._on_thaw
        preset = build_preset(world.raw)
        self.models = dict(preset.models)
        self.raw_models: dict[str, dict[str, Any]] = copy.deepcopy(world.raw["models"])
        """The preset's model entries as a reload would read them now."""
        self.removed_raw: dict[str, dict[str, dict[str, Any]]] = {}
        """Entries a reload took out, by the model named: a base with its adapters."""
        placer = Placer(cores=set(HOST_CORES), gpus=world.gpus, process_memory=lambda pids: {})
        self.sup = Supervisor(ModelRegistry(preset), preset.server, runtime_dir, placer)
        install_fakes(self.sup, self.net)
        self.seen: dict[str, str] = {}
        """Violations seen during the run: when each was first seen."""
        self._moments: dict[tuple[str, str], list[Callable[[], None]]] = {}
        """Clients waiting to leave at a (moment, model): what makes each leave."""
        self.watch = BatchWatch(self.sup, self._saw, self.loop.time,
                                lambda model: self.moment("slot", model))
        self._watch_leases()
        self.replica_world = any("replicas" in body for body in world.raw["models"].values()
                                 ) or any(op.args.get("change") == "replicas"
                                          for op in world.ops)
        """Some model may run several replicas (``world.add_replicas``)."""
        self.routes: dict[str, int] = {}
        """Each routed ``Generate`` id: the pid of the replica it was routed to."""
        self.ended_at: dict[str, float] = {}
        """When each ``Generate`` id's client ended."""
        self.retired: set[int] = set()
        """Pids of replicas drained for a scale-down (their ``draining`` event)."""
        self.left: set[int] = set()
        """The operations (``id``) whose client left: a stream may end with an error event
        then (the relay's watchers saw the client go)."""
        self.stream_errors: set[str] = set()
        """The ``Generate`` ids whose stream ended with an error event."""
        self._on_replica: dict[tuple[str, str], list[Op]] = {}
        """Operations armed to happen as a replica of a model enters a state."""
        self._watch_routes()
        self.watch.watch_slots(self.sup.registry)
        self.relay = Relay(self.sup)
        self._watch_events()
        self.clients: list[Client] = []
        self.entries: list[ModelEntry] = list(self.sup.registry)
        self.slot_pools: list[tuple[ModelEntry, Any, int]] = [
            (e, e.slots, e.spec.max_concurrent) for e in self.entries]
        self.loop_errors: list[str] = []
        self._ids = 0
        self.adapters: list[ModelEntry] = []
        """Every adapter model's entry the registry has held."""
        self.asked: dict[str, Op] = {}
        """Each request's ``Generate`` id: its operation."""
        self.answered: set[str] = set()
        """The ``Generate`` ids whose client got output."""
        self.outcomes: dict[str, tuple[str, int, str]] = {}
        """Each ``Generate`` id's end at its client: ``ok``, ``gone`` (it left) or the
        error, the tokens it got, and its model's state then."""
        self.states: dict[str, str] = {}
        """Each model's state as last published."""
        self._on_state: dict[tuple[str, str], list[Op]] = {}
        """Operations armed to happen as a model enters a state (``on_state``)."""
        self._armed_until = 0.0
        self.stopping_since: dict[str, float] = {}
        """When each model last began to stop."""
        self.forced: set[str] = set()
        """Models an unload with ``force`` stops (not yet down)."""
        self.parked_for: dict[str, tuple[str, invariants.ParkLimits]] = {}
        """Each model's last eviction: the model it was for, parking's limits then."""
        self._scheduled = False
        self.limits_lowered = False
        """A reload lowered parking's limits: models parked before may exceed them."""
        """Every operation was issued (armed ones too): none issues any more."""
        self._note_adapters()

    def _watch_events(self) -> None:
        """State changes and evictions go into the trace, as they happen."""
        sub = self.sup.events.subscribe(replay=False)

        def offer(event: dict[str, Any]) -> None:
            adapters = {a.id for a in self.adapters} | set(self.sup.registry.adapters)
            if event["model"] in adapters and event["type"] in ("state", "load", "eviction"):
                self._saw(f"{event['model']}: an adapter model got a '{event['type']}' "
                          f"event of its own: {event}")
            if event["type"] == "eviction" and (event["for"] in adapters
                                                or event["for"] == event["model"]):
                self._saw(f"{event['model']}: evicted for {event['for']}, an adapter model "
                          "or itself")
            if event["type"] == "replica":
                self._replica_event(event)
            if event["type"] == "state":
                if event["state"] in ("parking", "parked"):
                    for violation in invariants.replica_park_violations(
                            self.sup, event["model"], event["state"]):
                        self._saw(violation)
                why = f" ({event['reason']})" if event.get("reason") else ""
                self.net.note(f"{event['model']}: -> {event['state']}{why}")
                before = self.states.get(event["model"])
                if event["state"] in ("unloaded", "failed"):
                    self.forced.discard(event["model"])
                if event["state"] == "stopping" and before != "stopping":
                    self.stopping_since[event["model"]] = self.loop.time()
                self.states[event["model"]] = event["state"]
                if before != event["state"]:
                    for violation in invariants.park_transition_violations(
                            self.sup, self.entries, event["model"], before, event["state"],
                            self.parked_for.get(event["model"])):
                        self._saw(violation)
                    for op in self._on_state.pop((event["model"], event["state"]), []):
                        after_turns(self.loop, op.args["turns"], self._state_op, op,
                                    event["state"])
                if event["state"] in ("ready", "failed"):
                    self.moment("load", event["model"])
            elif event["type"] == "eviction":
                self.net.note(f"{event['model']}: {event['action']} for {event['for']}")
                self.parked_for[event["model"]] = (event["for"],
                                                   invariants.park_limits(self.sup))
                for violation in invariants.eviction_violations(self.sup, self.entries,
                                                                event):
                    self._saw(violation)
            for violation in invariants.park_state_violations(self.sup, self.entries):
                self._saw(violation)
            self.watch.on_event(event)

        sub.offer = offer  # type: ignore[method-assign]

    def _watch_leases(self) -> None:
        """A lease granted (``acquire_now``'s, or ``acquire`` returning: the relay and the
        batch watch call these through the supervisor) is a moment clients may leave at.
        Wrapped in the same frames: no loop turn is added."""
        sup = self.sup
        now, wait = sup.acquire_now, sup.acquire

        def acquire_now(name: str | None, task: str = "any",
                        batch: bool = False) -> tuple[Lease, WorkerLink] | ModelEntry:
            got = now(name, task, batch)
            if isinstance(got, tuple):
                self.moment("lease", got[0].entry.id)
            return got

        async def acquire(name: str | None, task: str = "any",
                          batch: bool = False) -> tuple[Lease, WorkerLink]:
            got = await wait(name, task, batch)
            self.moment("lease", got[0].entry.id)
            return got

        sup.acquire_now = acquire_now  # type: ignore[method-assign]
        sup.acquire = acquire  # type: ignore[method-assign]

    def _watch_routes(self) -> None:
        """Each request the relay (or a direct client, as every caller does) routes among
        a model's replicas: (r3) to one that serves, whenever one does; the pid it chose
        is kept (``routes``: its ``Generate`` must reach that one)."""
        sup = self.sup
        real = sup.route

        def route(entry: ModelEntry, link: WorkerLink, gens: list[Generate] | None = None,
                  session: bytes | None = None) -> WorkerLink:
            chosen = real(entry, link, gens, session)
            if self.replica_world:
                for violation in invariants.route_violations(sup, entry, chosen, gens or []):
                    self._saw(violation)
                replica = next((r for r in sup.replicas_of(entry) if r.link is chosen), None)
                for gen in gens or []:
                    if replica is not None:
                        self.routes[gen.id] = replica.handle.pid
            return chosen

        sup.route = route  # type: ignore[method-assign]

    def _replica_event(self, event: dict[str, Any]) -> None:
        """A replica's state (``Supervisor._publish_replica``, ``_replica_failed``): into
        the trace; r1, r2 and r8 checked; operations armed on it (``on_replica``) issued."""
        model, number, state = event["model"], event["replica"], event["state"]
        key = replica_key(model, number)
        self.net.note(f"{key}: replica -> {state}"
                      + (f" ({str(event.get('error')).splitlines()[0][:80]})"
                         if event.get("error") else ""))
        if state == "draining" and event.get("pid") is not None:
            self.retired.add(event["pid"])
        for violation in invariants.replica_violations(self.sup, self.entries):
            self._saw(violation)
        for op in self._on_replica.pop((model, state), []):
            after_turns(self.loop, op.args["turns"], self._replica_op, op, number, state,
                        event.get("pid"))

    def _replica_op(self, op: Op, number: int, state: str, pid: int | None) -> None:
        if self._scheduled:
            return
        self.net.note(f"as {replica_key(op.model, number)} became {state}: {op.kind} "
                      f"{op.model} ({op.args['turns']} turn(s) later)")
        if op.kind == "crash":  # that very replica, if it still runs
            for worker in self.net.workers:
                if worker.pid == pid and worker.returncode is None:
                    worker.exit(137, "simulated crash")
            return
        contextvars.Context().run(self.issue, op, True)

    def moment(self, kind: str, model: str) -> None:
        """A ``kind`` moment (``world.MOMENTS``) of ``model``: the clients waiting for it
        leave, each its ``turns`` loop turns from now (0: in this very call)."""
        for leave in self._moments.pop((kind, model), []):
            leave()

    def _leave_at_moment(self, client: Client, request: SimRequest) -> None:
        """Arm ``client`` to leave at its operation's ``leave_on`` moment of its model (an
        adapter's: its base), the first one ``after`` s from now."""
        op = client.op
        kind = op.args["leave_on"]
        try:
            model = self.sup.registry.serving(self.sup.registry.resolve(op.model)).id
        except APIError:
            return  # refused at once: nothing to leave

        def leave() -> None:
            if not client.task.done():
                self.net.note(f"{kind} of {model}: {op.kind} {op.model} @{op.at:g} leaves "
                              f"{op.args['turns']} turn(s) later")
                after_turns(self.loop, op.args["turns"], self._leave, client, request)

        def arm() -> None:
            if not client.task.done():
                self._moments.setdefault((kind, model), []).append(leave)

        self.loop.call_later(op.args["after"], arm)

    def _on_step(self, worker: SimWorker) -> None:
        """A worker's engine steps: its model must not be parked (its process is paused);
        (r4) its model's replicas run no more generations than it has leases."""
        if self.replica_world:
            for violation in invariants.in_flight_violations(self.sup, self.entries):
                self._saw(violation)
        for entry in self.entries:
            kept = self.sup.worker_of(entry)
            if (entry.state == "parked" and kept is not None
                    and getattr(kept.handle, "worker", None) is worker):
                self._saw(f"{entry.id}: its worker {worker.pid} runs an engine step while "
                          "the model is parked")

    def _on_thaw(self, worker: SimWorker) -> None:
        since = self.stopping_since.get(worker.model, self.loop.time())
        ending = (worker.model in self.forced
                  or self.loop.time() >= since + self.sup.server.drain_timeout)
        for violation in invariants.thaw_violations(self.sup, self.entries, worker, ending):
            self._saw(violation)

    def _arm(self, op: Op, armed_on: dict[tuple[str, str], list[Op]] | None = None,
             state: str | None = None) -> None:
        """``op`` happens as its model next enters ``on_state`` (or, with ``armed_on``,
        one of its replicas ``state``), within ``within`` s."""
        on = self._on_state if armed_on is None else armed_on
        what = op.args["on_state"] if state is None else state
        key = (op.model, what)
        on.setdefault(key, []).append(op)
        self._armed_until = max(self._armed_until, self.loop.time() + op.args["within"])

        def disarm() -> None:
            armed = on.get(key, [])
            if op in armed:
                armed.remove(op)
                self.net.note(f"disarmed (no {what} of {op.model}): {op}")

        self.loop.call_later(op.args["within"], disarm)

    def _state_op(self, op: Op, state: str) -> None:
        if self._scheduled:
            return  # the schedule's answers are being counted
        self.net.note(f"as {op.model} became {state}: {op.kind} {op.model} "
                      f"({op.args['turns']} turn(s) later)")
        # In a context of its own: the state change may be published from a batch line's
        # task, whose context would make what it starts a batch line's (``BATCH_LINE``).
        contextvars.Context().run(self.issue, op, True)

    # operations
    def issue(self, op: Op, now: bool = False) -> None:
        self._note_adapters()
        for violation in invariants.adapter_violations(self.sup, self.adapters):
            self._saw(violation)
        for violation in invariants.park_state_violations(self.sup, self.entries):
            self._saw(violation)
        self.watch.check()
        if "on_state" in op.args and not now:
            self._arm(op)
            return
        if "on_replica" in op.args and not now:
            self._arm(op, self._on_replica, op.args["on_replica"])
            return
        if op.kind == "crash":
            for worker in reversed(self.net.workers):
                if (worker.model == op.model and worker.returncode is None
                        and op.args.get("replica", worker.number) == worker.number):
                    worker.exit(137, "simulated crash")
                    break
            return
        if op.kind == "reload":
            self.reload(op)
            return
        request = SimRequest()
        if op.kind == "request":
            coro = self.request(op, request)
        elif op.kind == "batch":
            lines: dict[asyncio.Task[None], None] = {}
            coro = self.batch(op, lines)
        elif op.kind == "load":
            coro = self.load(op)
        else:
            coro = self.unload(op)
        client = Client(op, self.loop.create_task(coro))
        if op.kind == "batch":
            client.lines = lines
        self.clients.append(client)
        client.task.add_done_callback(
            lambda _: self.net.note(f"answer {op.kind} {op.model} @{op.at:g}: {client.outcome()}"))
        leave = op.args.get("leave")
        if leave is not None:
            self.loop.call_later(leave, after_turns, self.loop, op.args["turns"], self._leave,
                                 client, request)
        elif "leave_on" in op.args:
            self._leave_at_moment(client, request)

    def _leave(self, client: Client, request: SimRequest) -> None:
        if client.task.done():
            return
        self.net.note(f"leaves: {client.op.kind} {client.op.model} @{client.op.at:g}")
        self.left.add(id(client.op))
        request.gone.set()  # the relay's watchers see it
        if client.op.kind == "batch" and "leave_on" in client.op.args:
            # as ``BatchRunner`` stops a batch: each line in flight cancelled, then (its
            # ``finally``, or the batch's own task) once more
            for line in list(client.lines):
                line.cancel()
            after_turns(self.loop, client.op.args["again"], self._cancel, client)
        elif (client.op.args["via"] == "direct" or request.streaming is not None
                or client.op.kind == "batch"):
            # a direct client, Starlette cancelling a response that streams, or a batch
            # cancelled (its runner cancels its lines in flight)
            self._cancel(client)

    @staticmethod
    def _cancel(client: Client) -> None:
        client.left = client.task.cancel() or client.left

    def _generate(self, op: Op) -> Generate:
        self._ids += 1
        prompt = conversation_prompt(*op.args["prompt"]) if "prompt" in op.args else "hi"
        return Generate(id=f"g{self._ids}", prompt=prompt,
                        sampling=SamplingSpec(max_tokens=op.args["tokens"]))

    async def request(self, op: Op, request: SimRequest, batch: str | None = None) -> str:
        """A client's request, or with ``batch`` one line of that batch (as the runner
        calls the app's handlers: the batch in its scope, answered whole). How it ended
        is kept (``outcomes``)."""
        gen = self._generate(op)
        self.asked[gen.id] = op
        got: list[int] = [0]
        try:
            answer = await self._request(op, request, gen, got, batch)
        except asyncio.CancelledError:
            self.outcomes[gen.id] = ("gone", got[0], "")
            raise
        except APIError as err:
            self.outcomes[gen.id] = ("gone" if err.status == 499 else
                                     f"{err.status} {type(err).__name__}", got[0],
                                     self._state_of(op.model))
            raise
        finally:
            self.ended_at[gen.id] = self.loop.time()
        self.outcomes[gen.id] = ("ok", got[0], self._state_of(op.model))
        return answer

    def _state_of(self, name: str) -> str:
        """The state of the model that serves ``name`` now (``removed``: none does)."""
        try:
            return self.sup.registry.serving(self.sup.registry.resolve(name)).state
        except APIError:
            return "removed"

    async def _request(self, op: Op, request: SimRequest, gen: Generate, got: list[int],
                       batch: str | None) -> str:
        if op.args["via"] == "direct":
            lease, link = await (self._batch_lease(op.model) if batch is not None
                                 else self.sup.acquire(op.model, "generate"))
            if "keep_alive" in op.args:
                lease.entry.keep_alive = op.args["keep_alive"]
            if lease.adapter is not None:  # as the relay's ``_start``
                gen.lora = lease.adapter.lora
            if lease.batch:
                gen.priority = BATCH_PRIORITY
            stream = None
            try:
                # as every caller of ``acquire`` does (the relay's ``_start``, one-shot calls)
                link = self.sup.route(lease.entry, link, [gen])
                stream = link.submit([gen], Usage())
                async for deltas in stream:
                    got[0] += len(deltas)
                    self.answered.add(gen.id)
                return f"ok {got[0]}"
            finally:
                if stream is not None:
                    stream.close()
                lease.release()
        shapers: list[SimShaper] = []

        def shaper_for(model_id: str) -> SimShaper:
            shapers.append(SimShaper())
            return shapers[-1]

        if batch is not None:
            request.scope[BATCH_SCOPE_KEY] = batch
        if "session" in op.args:  # the conversation's name: x-session-id
            request.scope["headers"] = [(SESSION_HEADER, op.args["session"].encode())]
        streaming = op.args.get("stream", False)
        try:
            response = await self.relay.generate(
                request, "/sim", op.model, [gen], streaming, shaper_for,
                keep_alive=op.args.get("keep_alive"),
                keepalive=b"ping" if op.args.get("cold") else b"")
            if not streaming:
                return "ok json"
            request.streaming = asyncio.current_task()  # from now on leaving cancels it
            chunks = [chunk async for chunk in response.body_iterator]
            return f"ok stream of {len(chunks)}"
        finally:
            got[0] = sum(shaper.deltas for shaper in shapers)
            if got[0]:
                self.answered.add(gen.id)
            if any(shaper.errored for shaper in shapers):
                self.stream_errors.add(gen.id)

    async def _batch_lease(self, model: str) -> tuple[Lease, WorkerLink]:
        """As the relay's ``_acquire`` for a batch line: at once if it may, else wait."""
        now = self.watch.lease_now(model)
        if isinstance(now, tuple):
            return now
        return await self.sup.acquire(model, "generate", batch=True)

    async def batch(self, op: Op, in_flight: dict[asyncio.Task[None], None]) -> str:
        """A batch's lines for one model, as ``router.batches.runner`` runs a group: each
        line starts once ``RoomMaker.batch_may_run`` says yes (looking every
        ``WAIT_FOR_ROOM`` s; after ``patience`` s the batch gives up, as one expires),
        ``at_once`` at a time. Leaving cancels the lines in flight (a cancelled batch),
        which are ``in_flight``."""
        try:
            entry: ModelEntry | None = self.sup.registry.serving(
                self.sup.registry.resolve(op.model))
        except APIError:
            entry = None  # its lines fail as any request would
        at_once = asyncio.Semaphore(op.args["at_once"])
        outcomes: list[str] = []
        # Every line begun, in order: they end as a ``TaskGroup``'s tasks would, but a
        # cancel reaches them in this order, where a ``TaskGroup`` cancels in a set's
        # (the tasks' addresses: seed 102 ran two ways as the garbage collector ran
        # earlier or later and the memory it freed went to the next tasks).
        begun: dict[asyncio.Task[None], None] = {}

        def failed() -> list[Exception]:
            """What lines raised (a ``TaskGroup`` ends the rest at the first)."""
            return [err for line in begun if line.done() and not line.cancelled()
                    and isinstance(err := line.exception(), Exception)]

        try:
            for _ in range(op.args["lines"]):
                if failed() or not await self._batch_may_run(entry, op.args["patience"]):
                    break
                await at_once.acquire()
                line = self.loop.create_task(self._line(op, outcomes))
                line.add_done_callback(lambda _: at_once.release())
                begun[line] = None
                in_flight[line] = None
                line.add_done_callback(lambda done: in_flight.pop(done, None))
            while not all(line.done() for line in begun) and not failed():
                await asyncio.wait(begun, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            await cancel_and_wait(*begun)  # in the order they began
        if failed():
            raise ExceptionGroup("batch lines failed", failed())
        return (f"ok {len(begun)} of {op.args['lines']} line(s) run: "
                + ", ".join(sorted(outcomes)))

    async def _batch_may_run(self, entry: ModelEntry | None, patience: float) -> bool:
        """The runner's wait before each line: False once ``patience`` s went by."""
        waited = 0.0
        while entry is not None and not self.sup.rooms.batch_may_run(entry):
            if waited >= patience:
                return False
            await asyncio.sleep(WAIT_FOR_ROOM)  # a person uses the room it needs
            waited += WAIT_FOR_ROOM
        return True

    async def _line(self, op: Op, outcomes: list[str]) -> None:
        BATCH_LINE.set(True)  # this task's own context
        try:
            outcomes.append(await self.request(op, SimRequest(), batch=f"batch@{op.at:g}"))
        except APIError as err:  # the line's result: an error line
            outcomes.append(f"{err.status} {type(err).__name__}")

    async def load(self, op: Op) -> str:
        """As ``/v1/models/load`` (``router.api.admin``): an adapter loads its base, then
        itself into its base's engine."""
        entry = self.sup.registry.named(op.model)
        base = self.sup.registry.serving(entry)
        if not op.args["wait"]:
            if base.state != "ready":
                self.sup.start_loading(base)
            return "ok 202"
        lease, link = await self.sup.acquire(entry.id)
        try:
            if entry.lora is not None:  # into every replica's engine
                for each in self.sup.links_of(lease.entry) or [link]:
                    lease.entry.adapters_loaded = await each.adapters([entry.lora])
        finally:
            lease.release()
        return "ok loaded"

    async def unload(self, op: Op) -> str:
        """As ``/v1/models/unload``: an adapter leaves its base's engine; the base serves on."""
        entry = self.sup.registry.named(op.model)
        if entry.lora is not None:
            base = self.sup.registry.serving(entry)
            for link in self.sup.links_of(base):  # every replica's engine
                base.adapters_loaded = await link.adapters(unload=[entry.lora.number])
            return f"ok {base.id} {base.state}"
        if op.args["force"]:
            self.forced.add(entry.id)
        await self.sup.stop(entry, force=op.args["force"])
        return f"ok {entry.state}"

    def reload(self, op: Op) -> None:
        """What ``router.lifecycle.reload.Reloader._apply`` does with a new preset's models
        (``build_preset`` of the entries as changed: a base's adapters size it)."""
        change, name = op.args["change"], op.model
        if change == "limit":  # a runtime key: the live server config changes in place
            self.sup.server.max_loaded_models = op.args["max_loaded_models"]
            self.net.note(f"reload: max_loaded_models={op.args['max_loaded_models']}")
            return
        if change == "park":  # runtime keys too: parking's limits, lowered (pressure)
            for key in ("max_parked_models", "park_memory_gib"):
                if key in op.args:
                    setattr(self.sup.server, key, op.args[key])
                    self.limits_lowered = True
                    self.net.note(f"reload: {key}={op.args[key]}")
            return
        raw = copy.deepcopy(self.raw_models)
        removed = dict(self.removed_raw)
        if change == "restore":
            if not removed:
                return
            name = min(removed)
            raw.update(removed.pop(name))
        elif name not in raw:
            return
        elif change == "remove":
            bases = [n for n, body in raw.items() if "base" not in body]
            if bases == [name]:
                return
            # a base goes with its adapters, those a reload took out before included
            group = {n: body for n, body in raw.items() if n == name or body.get("base") == name}
            for taken in [n for n, g in removed.items() if g[n].get("base") == name]:
                group.update(removed.pop(taken))
            removed[name] = group
            for n in group:
                raw.pop(n, None)
        elif change == "restart":  # a key its worker reads; an adapter: a new folder
            body = raw[name]
            if "base" in body:
                folder = Path(body["adapter"])
                names = sorted(ADAPTER_RANKS)
                after = names[(names.index(folder.name) + 1) % len(names)]
                body["adapter"] = str(folder.parent / after)
            else:
                body["max_model_len"] = 2048 if body.get("max_model_len") != 2048 else 1024
        elif change == "replicas":  # router-only, unless replicas.max changes (a restart)
            raw[name]["replicas"] = op.args["replicas"]
        elif "base" in raw[name]:  # a router-only key of an adapter: pinned (or priority)
            body = raw[name]
            had = [body.pop(key) for key in ("pinned", "priority") if key in body]
            pinned = sum(bool(b.get("pinned")) for b in raw.values()
                         if b.get("base") == body["base"])
            if had:
                pass  # back to its base's
            elif pinned + 1 < raw[body["base"]].get("max_loras", 4):  # a slot stays unpinned
                body["pinned"] = True
            else:
                body["priority"] = 5
        else:
            raw[name]["ttl"] = 0.7
        try:
            models = build_preset({"server": self.world.raw["server"], "models": raw}).models
        except ConfigError as err:  # the Reloader refuses it: nothing changes
            self.net.note(f"reload refused: {err}")
            return
        self.raw_models, self.removed_raw = raw, removed
        changed = [n for n, spec in models.items() if n in self.models and self.models[n] != spec]
        before = {e.id: (e, e.slots) for e in self.sup.registry}
        self._note_adapters()
        added, gone = self.sup.registry.reconfigure(Preset(server=self.sup.server,
                                                           models=models))
        self._note_adapters()
        self.models = models
        self.entries += [e for e in added if e not in self.entries]
        self.watch.watch_slots(self.sup.registry)  # new entries, and new max_concurrent
        for entry in self.sup.registry:
            if before.get(entry.id, (None, None))[1] is not entry.slots or entry in added:
                self.slot_pools.append((entry, entry.slots, entry.spec.max_concurrent))
        for entry in gone:
            self.sup.retire(entry)
        for n in changed:
            if n in self.sup.registry.entries:  # an adapter model has no worker to refresh
                self.sup.refresh(self.sup.registry.entries[n], load=False)
        self.net.note(f"reload: {change} {name}: "
                      + ", ".join(f"{n} {shown_body(raw[n])}" for n in sorted(raw)
                                  if "base" in raw[n] or n == name))

    # the run
    async def run(self) -> list[str]:
        sup = self.sup
        sup.start()
        # Only worlds with batches look every Q: others run as their seed always ran.
        watching = (self.loop.create_task(self.watch.keep_checking())
                    if any(op.kind == "batch" for op in self.world.ops) else None)
        began = self.loop.time()
        for op in self.world.ops:
            delay = began + op.at - self.loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self.net.note(f"op {op}")
            self.issue(op)
        if self._armed_until > self.loop.time():  # operations armed on a model's state
            await asyncio.sleep(self._armed_until - self.loop.time() + Q)
        self._scheduled = True
        violations: list[str] = []
        tasks = [c.task for c in self.clients]
        if tasks:
            await asyncio.wait(tasks, timeout=ANSWER_WITHIN)
        for client in self.clients:
            outcome = client.outcome()
            if outcome == "pending":
                violations.append(f"client never answered ({ANSWER_WITHIN:g} s): {client.op}")
            elif outcome == "cancelled" or outcome.startswith("raised"):
                violations.append(f"client got {outcome}: {client.op}")
        # Settled: no model loading, stopping, parking, waking or waiting for room, and no
        # wake under way, for two looks in a row (work that a client left behind, such as
        # a cancelled task's cleanup, may take a few turns).
        deadline, calm = self.loop.time() + SETTLE_WITHIN, 0
        while calm < 2 and self.loop.time() < deadline:
            await asyncio.sleep(Q)
            busy = bool(invariants.wakes_under_way(sup)) or any(
                e.state in invariants.UNSETTLED or e.room_since is not None
                for e in self.entries) or (self.replica_world and not
                                           invariants.replicas_settled(sup, self.entries))
            calm = 0 if busy else calm + 1
        if watching is not None:
            watching.cancel()
            self.net.note(f"batch watch: {self.watch.summary()}")
        self.net.note("quiescent: invariants checked")
        self._note_adapters()
        self.watch.check()
        violations += invariants.quiescent_violations(sup, self.entries, self.slot_pools,
                                                      self.net)
        violations += invariants.parked_violations(sup, self.entries, self.limits_lowered)
        violations += invariants.paused_request_violations(self.net, self.asked,
                                                           self.outcomes)
        violations += self.watch.quiescent_violations(self.entries)
        violations += invariants.adapter_violations(sup, self.adapters)
        violations += invariants.routing_violations(self.net, self.asked, self.answered,
                                                    self.adapters, BATCH_PRIORITY)
        if self.replica_world:
            replicated = {e.id for e in self.entries if e.spec.replicas.max > 1} | {
                name for name, body in self.world.raw["models"].items() if "replicas" in body
            } | {op.model for op in self.world.ops if op.args.get("change") == "replicas"}
            violations += invariants.replica_violations(sup, self.entries)
            violations += invariants.min_violations(sup, self.entries)
            violations += invariants.replica_request_violations(
                self.net, self.asked, self.outcomes, self.ended_at, self.stream_errors,
                self.left, self.routes, self.retired, replicated)
        violations += [f"{v} (during the run, first at {at})" for v, at in self.seen.items()]
        self.net.note("stop_all")
        stop_all = asyncio.ensure_future(sup.stop_all())
        await asyncio.wait({stop_all}, timeout=STOP_ALL_WITHIN)
        if not stop_all.done():
            violations.append(f"stop_all did not return within {STOP_ALL_WITHIN:g} s")
            stop_all.cancel()
        else:
            stop_all.result()
            violations += [f"after stop_all: {v}" for v in
                           invariants.stopped_violations(sup, self.entries, self.net)]
        for client in self.clients:
            client.task.cancel()
        return violations

    def _saw(self, violation: str) -> None:
        self.seen.setdefault(violation, f"{self.loop.time() - 1000:.2f}")

    def _note_adapters(self) -> None:
        self.adapters += [a for a in self.sup.registry.adapters.values()
                          if a not in self.adapters]


def run_seed(seed: int) -> Result:
    """Simulate one seed; its violations (none: it passed), trace and a digest of the run."""
    world = make_world(seed)
    clock = VirtualClock()
    loop = VirtualTimeLoop(clock)
    router_log = logging.getLogger("modelyard")
    saved = router_log.level, router_log.propagate
    with (tempfile.TemporaryDirectory(prefix="sim") as tmp, virtual_time(clock), host_cores(),
          contextlib.ExitStack() as stack):
        asyncio.set_event_loop(loop)
        try:
            sim = Simulation(world, loop, Path(tmp))
            stack.enter_context(host_memory(sim.net))
            recorder = _Recorder(sim.net)
            router_log.addHandler(recorder)
            router_log.setLevel(logging.WARNING)
            router_log.propagate = False
            loop.set_exception_handler(
                lambda _, ctx: sim.loop_errors.append(f"loop: {ctx.get('message')}: "
                                                      f"{ctx.get('exception')!r}"))
            violations = loop.run_until_complete(sim.run())
            _cancel_all(loop)
        finally:
            router_log.removeHandler(recorder)
            router_log.setLevel(saved[0])
            router_log.propagate = saved[1]
            asyncio.set_event_loop(None)
            loop.close()
    violations += recorder.exceptions + sim.loop_errors
    trace = "\n".join([world.describe(), "what happened (virtual seconds):",
                       *(f"  {line}" for line in sim.net.log)])
    digest = hashlib.sha256("\n".join(sim.net.log).encode()).hexdigest()[:16]
    return Result(seed, violations, trace, digest)


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())


def main(argv: list[str]) -> int:
    """``python -m tests.simulation.harness SEED`` prints one seed's trace;
    ``... FIRST-LAST`` runs a range and prints a line per failing seed."""
    spec = argv[1] if len(argv) > 1 else "0"
    if "-" in spec:
        first, last = (int(x) for x in spec.split("-"))
        failed = 0
        for seed in range(first, last + 1):
            result = run_seed(seed)
            if result.violations:
                failed += 1
                print(f"{seed}: " + " | ".join(result.violations))
        print(f"{failed} of {last - first + 1} seeds failed")
        return 1 if failed else 0
    result = run_seed(int(spec))
    print(result.trace)
    print("violations:", *result.violations or ["none"], sep="\n  ")
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
