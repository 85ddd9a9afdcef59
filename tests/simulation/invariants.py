"""What must hold of a simulated run (``harness`` runs it): at quiescence, during it for
adapter models and parking, and after ``stop_all``. Each check reads the real
``Supervisor`` and returns its findings as lines; the few looks inside that they need
are the first functions here (adjust those if the router's insides move).

Parking's (``router.lifecycle.parking``), as the run goes and at quiescence:

- (a) a parked model's requests are answered or still queued/in flight, never lost:
  every client ends (the harness's own check), and a request a park paused ends with
  all its tokens unless its client left, its engine failed it, its worker died, or its
  model was stopping, failed or gone when it ended (``paused_request_violations``);
- (b) no model starts to run (``loading``, ``waking``) while ``max_loaded_models``
  others run (``RUNS``: ``parked`` runs nothing); and a parked model that stops with
  requests in flight runs them only where one more may run (its drain is an engine
  running): ``park_transition_violations``, at each state change;
- (c) a parked model's worker is paused and frozen (a GPU model's: asleep at the level
  the router chose, not frozen), a ready one's neither (each state change and
  operation, ``park_state_violations``), and no parked model's worker runs an engine
  step (``harness``, at each step);
- (d) each park keeps within ``max_parked_models`` and ``park_memory_gib`` (what the
  workers really hold); at quiescence no model is ``parking``/``waking``, no wake runs,
  and those limits hold unless a reload lowered them (``parked_violations``);
- (e) a model is parked, stopped or made to yield only for a model in the line for
  room; for a wake, one still parked whose worker lives (``eviction_violations``).

The checks of batch lines' priority are ``batch_watch.BatchWatch``'s; those of replicas
(r1-r8) are the last section here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from router.lifecycle.replica import Replica
from router.lifecycle.supervisor import Supervisor
from router.registry import ModelEntry, Slots
from router.workers.link import WorkerLink
from router.workers.placement import Placer
from shared.config import ModelSpec, parse_cores
from shared.protocol import Generate
from tests.simulation.fakes import GIB, SimNet, SimWorker
from tests.simulation.world import Op

RUNS = ("loading", "ready", "sleeping", "stopping", "parking", "waking")
"""States in which a model's engine takes room to run (``RoomMaker.loaded``); ``parked``
holds memory and no core."""
UNSETTLED = ("loading", "stopping", "parking", "waking")
"""States no model may be left in at quiescence."""

SETTLE_WITHIN = 40.0
"""Virtual seconds after every client answered for no model to be ``loading`` or
``stopping``."""


# -- the few looks inside that the invariants need -----------------------------------------
def slots_taken(slots: Slots | None, cap: int) -> int:
    """How many of a ``max_concurrent`` cap's slots are taken (or waited for): of its
    ``size``, which is ``cap`` times the replicas that serve (``Slots.resize``)."""
    if slots is None:
        return 0
    return slots.size - slots.free + slots.waiting


def held_placements(placer: Placer) -> set[str]:
    """Models the placer holds CPU cores for."""
    return set(placer._held)


def gpu_start_locks(placer: Placer) -> dict[int, asyncio.Lock]:
    """Each GPU's start lock, through the public ``start_locks``."""
    return {g: placer.start_locks(ModelSpec(id=f"probe{g}", model="/probe", device="cuda",
                                            gpus=[g]))[0] for g in placer.gpus}


def lifecycle_ids(sup: Supervisor) -> set[str]:
    """The models the supervisor keeps a worker, a load or a stop of."""
    return {*sup.running(), *sup._loads, *sup._stops}


def wakes_under_way(sup: Supervisor) -> set[str]:
    """The models with a wake task (``Parker.wake``) not yet done."""
    return {m for m, task in sup.parker._wakes.items() if not task.done()}


def sim_worker(sup: Supervisor, entry: ModelEntry) -> SimWorker | None:
    """``entry``'s running worker's simulated process, if it has one."""
    kept = sup.worker_of(entry)
    worker = getattr(kept.handle, "worker", None) if kept is not None else None
    return worker if isinstance(worker, SimWorker) else None


# -- the checks ----------------------------------------------------------------------------
def quiescent_violations(sup: Supervisor, entries: Iterable[ModelEntry],
                         slot_pools: Iterable[tuple[ModelEntry, Slots | None, int]],
                         net: SimNet) -> list[str]:
    """Once nothing more is asked: no lease, queue place, slot, yield or GPU start lock
    held, no model ``loading``/``stopping``, states match the workers kept, placements
    the running CPU workers, and every live worker process is the supervisor's."""
    entries = list(entries)
    out = []
    for entry in entries:
        if entry.leases:
            out.append(f"{entry.id}: {entry.leases} lease(s) held at quiescence")
        if entry.state in ("loading", "stopping"):
            out.append(f"{entry.id}: left '{entry.state}' ({SETTLE_WITHIN:g} s settle)")
        if entry.queued:
            out.append(f"{entry.id}: queued count {entry.queued} at quiescence")
        if entry.yield_to is not None:
            out.append(f"{entry.id}: still yields to {entry.yield_to}")
    for entry, slots, cap in slot_pools:
        taken = slots_taken(slots, cap)
        if taken:
            out.append(f"{entry.id}: {taken} of {cap} max_concurrent slot(s) taken at "
                       "quiescence")
    for gpu, lock in gpu_start_locks(sup.placer).items():
        if lock.locked():
            out.append(f"start lock of GPU {gpu} held at quiescence")
    running = sup.running()
    for model_id, worker in running.items():
        if worker.handle.returncode is not None:
            out.append(f"{model_id}: the supervisor keeps worker {worker.handle.pid}, "
                       f"which exited ({worker.handle.returncode})")
    current = set(sup.registry.entries.values())
    for entry in entries:
        if entry not in current and entry.id in sup.registry.entries:
            continue  # removed, then added again: its id names the new entry's worker
        kept = bool(sup.replicas_of(entry))  # any replica: the first may be gone
        if entry.state in ("ready", "sleeping", "parked") and not kept:
            out.append(f"{entry.id}: '{entry.state}' with no worker")
        if kept and entry.state not in ("ready", "sleeping", "parked", "stopping"):
            out.append(f"{entry.id}: '{entry.state}' but its worker is kept")
    cpu = {m for m, w in running.items() if w.spec is None or w.spec.device == "cpu"}
    held = held_placements(sup.placer)
    if held != cpu:
        out.append(f"placements {sorted(held)} != running CPU workers {sorted(cpu)}")
    known = {w.handle.pid for w in running.values()}
    for process in net.alive():
        if process.pid not in known:
            out.append(f"{process.model}: worker {process.pid} runs unknown to the "
                       "supervisor")
    return out


def adapter_violations(sup: Supervisor, adapters: Iterable[ModelEntry]) -> list[str]:
    """An adapter model's entry never holds what its base holds for it: a worker, a
    state of its own, a lease, a slot, a place in a queue or in the line for room."""
    out = []
    kept = lifecycle_ids(sup)
    for a in adapters:
        base = a.spec.base
        if a.replica is not None or a.pid is not None or a.node is not None:
            out.append(f"{a.id} (an adapter of {base}): a worker of its own "
                       f"(pid {a.pid}, replica {a.replica is not None})")
        if a.state != "unloaded":
            out.append(f"{a.id} (an adapter of {base}): state '{a.state}' of its own")
        if a.leases or a.queued:
            out.append(f"{a.id} (an adapter of {base}): {a.leases} lease(s), "
                       f"{a.queued} queued on its own entry")
        if a.slots is not None and (a.slots.free != a.slots.size or a.slots.waiting):
            out.append(f"{a.id} (an adapter of {base}): a max_concurrent slot of its own "
                       "taken")
        if a.yield_to is not None or a.room_since is not None:
            out.append(f"{a.id} (an adapter of {base}): in the line for room")
        if a.id in kept:
            out.append(f"{a.id} (an adapter of {base}): the supervisor keeps a worker, "
                       "load or stop of it")
    return out


def routing_violations(net: SimNet, asked: dict[str, Op], answered: set[str],
                       adapters: Iterable[ModelEntry], batch_priority: int) -> list[str]:
    """Each ``Generate`` went to one worker: the one of the model its request named,
    or for an adapter its base's, with the adapter as its ``lora``; a batch line's with
    ``batch_priority``, every other with 0 (served first)."""
    out = []
    bases = {a.id: a.spec.base for a in adapters}
    took: dict[str, list[int]] = {}
    for worker in net.workers:
        for gen_id, gen in worker.received.items():
            took.setdefault(gen_id, []).append(worker.pid)
            op = asked[gen_id]
            out += _misrouted(gen, op, worker.model, worker.pid, bases)
            priority = batch_priority if op.kind == "batch" else 0
            if gen.priority != priority:
                out.append(f"{gen_id} reached {worker.model}'s worker with priority "
                           f"{gen.priority}, not {priority}: {op}")
    for gen_id, pids in took.items():
        if len(pids) > 1:
            out.append(f"{gen_id} reached workers {pids}: {asked[gen_id]}")
    for gen_id in sorted(answered - set(took)):
        out.append(f"{gen_id} was answered, but no worker took it: {asked[gen_id]}")
    return out


def _misrouted(gen: Generate, op: Op, model: str, pid: int,
               bases: dict[str, str | None]) -> list[str]:
    """A finding if ``gen`` reached the wrong worker (``model``'s) or the wrong adapter."""
    lora, named = gen.lora, op.model
    wrong = (model != bases[named] or lora is None or lora.name != named if named in bases
             else model != named or lora is not None)
    if not wrong:
        return []
    what = f"adapter {named} (of {bases[named]})" if named in bases else named
    got = lora.name if lora else None
    return [f"{gen.id} for {what} went to {model}'s worker {pid} with lora {got}: {op}"]


def stopped_violations(sup: Supervisor, entries: Iterable[ModelEntry], net: SimNet
                       ) -> list[str]:
    """After ``stop_all``: no worker process runs or is kept, every model is down."""
    out = [f"{w.model}: worker {w.pid} still runs" for w in net.alive()]
    if sup.running():
        out.append(f"the supervisor still keeps workers of {sorted(sup.running())}")
    out += [f"{e.id}: '{e.state}'" for e in entries if e.state not in ("unloaded", "failed")]
    return out


# -- parking -------------------------------------------------------------------------------
ParkLimits = tuple[int, float | None]
"""``max_parked_models`` and ``park_memory_gib``, as they were when a park was decided."""


def park_limits(sup: Supervisor) -> ParkLimits:
    return sup.server.max_parked_models, sup.server.park_memory_gib


def _parked_limits(sup: Supervisor, entries: list[ModelEntry], what: str,
                   limits: ParkLimits, leaving: str | None = None) -> list[str]:
    """The parked (and parking) models within ``max_parked_models`` and, where set,
    ``park_memory_gib`` (what their workers hold), as ``limits`` give them. ``leaving``:
    a parked model whose wake the park made room for, which counts no more (it wakes in
    a few turns, with no await between: ``policy.park.may_park`` leaves it out too)."""
    most, memory = limits
    parked = [e for e in entries if e.state in ("parking", "parked") and e.id != leaving]
    out = []
    if len(parked) > most:
        out.append(f"{what}: {len(parked)} models parked ({sorted(e.id for e in parked)}), "
                   f"max_parked_models {most}")
    if memory is not None:
        held = sum(w.plan.resident_gib for e in parked if (w := sim_worker(sup, e)))
        if held * GIB > memory * GIB + 1:
            out.append(f"{what}: parked workers hold {held:g} GiB "
                       f"({sorted(e.id for e in parked)}), park_memory_gib {memory:g}")
    return out


def park_transition_violations(sup: Supervisor, entries: Iterable[ModelEntry], model: str,
                               before: str | None, state: str,
                               parked_for: tuple[str, ParkLimits] | None = None) -> list[str]:
    """(b) and (d) as ``model`` goes from ``before`` to ``state`` (just published);
    ``parked_for``: the model its park (if it parks) makes room for, and parking's limits
    when it was decided (a reload may lower them while it parks)."""
    entries = list(entries)
    moved = [e for e in entries if e.id == model and e.state == state]
    if not moved:
        return []
    entry = moved[0]
    out = []
    limit = sup.server.max_loaded_models
    others = sorted(e.id for e in entries if e is not entry and e.state in RUNS)
    if limit and state in ("loading", "waking") and len(others) >= limit:
        out.append(f"{model}: began {state} while {others} ran (max_loaded_models {limit})")
    if state == "parked":
        waker, limits = parked_for or (None, park_limits(sup))
        out += _parked_limits(sup, entries, f"{model} parked", limits,
                              waker if waker in wakes_under_way(sup) else None)
    return out


def thaw_violations(sup: Supervisor, entries: Iterable[ModelEntry], worker: SimWorker,
                    ending: bool) -> list[str]:
    """(b) as ``worker`` is thawed: a stopping model's paused requests drain only where
    one more model may run (``ending``: its stop is forced, or its drain's time is over:
    its requests end at once, and it resumes only to read ``Shutdown``)."""
    entries = list(entries)
    mine = [e for e in entries if sim_worker(sup, e) is worker]
    kept = sup.worker_of(mine[0]) if mine else None
    if not mine or kept is None or mine[0].state != "stopping" or ending:
        return []
    entry, limit = mine[0], sup.server.max_loaded_models
    others = sorted(e.id for e in entries if e is not entry and e.state in RUNS)
    if limit and kept.link.busy and len(others) >= limit:
        return [(f"{entry.id}: stopping, its parked worker resumed {len(worker.tasks)} "
                 f"request(s) while {others} ran (max_loaded_models {limit})")]
    return []


def park_state_violations(sup: Supervisor, entries: Iterable[ModelEntry]) -> list[str]:
    """(c): a parked model's worker is frozen, and paused exactly when the supervisor
    paused its engine (it had requests in flight: an idle engine is only frozen); a
    ready one's neither."""
    out = []
    for entry in entries:
        worker = sim_worker(sup, entry)
        kept = sup.worker_of(entry)
        if worker is None or worker.returncode is not None or kept is None:
            continue
        if entry.state == "parked" and entry.parked_level:
            # a GPU model asleep: its engine sleeps at the level decided, its processes run
            if worker.frozen or worker.level != entry.parked_level:
                out.append(f"{entry.id}: parked at level {entry.parked_level}, but its worker "
                           f"{worker.pid} is {'frozen' if worker.frozen else ''} asleep at "
                           f"{worker.level}")
        elif entry.state == "parked" and not (worker.frozen
                                              and worker.paused == kept.paused):
            out.append(f"{entry.id}: parked, but its worker {worker.pid} is "
                       f"{'not frozen' if not worker.frozen else 'paused: ' + str(worker.paused)}"
                       f" (the supervisor paused it: {kept.paused})")
        if entry.state == "ready" and (worker.paused or worker.frozen):
            out.append(f"{entry.id}: ready, but its worker {worker.pid} is "
                       f"{'frozen' if worker.frozen else 'paused'}")
    return out


def eviction_violations(sup: Supervisor, entries: Iterable[ModelEntry],
                        event: dict[str, Any]) -> list[str]:
    """(e): the model an eviction is for waits for room; a wake's is still parked, with
    a live worker."""
    name, victim, action = event["for"], event["model"], event["action"]
    waiting = [e for e in entries if e.id == name and e.room_since is not None]
    if not waiting:
        return [f"{victim}: {action} for {name}, which waits for no room"]
    entry = waiting[0]
    out = []
    if entry.state == "stopping":
        out.append(f"{victim}: {action} for {name}, which is stopping")
    if name in wakes_under_way(sup):
        worker = sim_worker(sup, entry)
        if entry.state != "parked" or worker is None or worker.returncode is not None:
            out.append(f"{victim}: {action} for {name}'s wake, but {name} is "
                       f"'{entry.state}'" + (" and its worker exited" if worker is not None
                                             and worker.returncode is not None else ""))
    return out


def parked_violations(sup: Supervisor, entries: Iterable[ModelEntry],
                      limits_lowered: bool = False) -> list[str]:
    """(d) at quiescence (the parked limits only if no reload lowered them since)."""
    entries = list(entries)
    out = [f"{e.id}: left '{e.state}' at quiescence" for e in entries
           if e.state in ("parking", "waking")]
    out += [f"{m}: a wake still under way at quiescence" for m in sorted(wakes_under_way(sup))]
    if not limits_lowered:
        out += _parked_limits(sup, entries, "at quiescence", park_limits(sup))
    return out


def paused_request_violations(net: SimNet, asked: dict[str, Op],
                              outcomes: dict[str, tuple[str, int, str]]) -> list[str]:
    """(a): each request a park paused ended with all its tokens, unless its client
    left, its engine failed it (``error``), its worker died with it (``exit``), or its
    model was stopping, failed, unloaded or gone as it ended."""
    out = []
    for worker in net.workers:
        for gen_id in sorted(worker.paused_gens):
            op = asked[gen_id]
            if gen_id not in outcomes:
                continue  # its client never ended: the harness says so
            kind, got, state = outcomes[gen_id]
            want = max(1, op.args["tokens"])
            if kind == "gone" or (kind == "ok" and got == want):
                continue
            if (worker.ended.get(gen_id) in ("error", "exit")
                    or state not in ("ready", "parking", "parked", "waking")):
                continue
            out.append(f"{gen_id}: a request {worker.model}'s park paused ended {kind} with "
                       f"{got} of {want} token(s) while {worker.model} was '{state}' "
                       f"(worker {worker.pid}: {worker.ended.get(gen_id, 'still running')}): "
                       f"{op}")
    return out


# -- replicas ------------------------------------------------------------------------------
# A model of several replicas (``world.add_replicas``), checked at each replica event, each
# route, each engine step and at quiescence:
#
# - (r1) a model's replicas run on disjoint cores (``VLLM_CPU_OMP_THREADS_BIND``) and GPUs
#   (``CUDA_VISIBLE_DEVICES``), each within the model's own, as the placer holds them;
# - (r2) never more replicas (starting or serving) than ``replicas.max`` of the spec they
#   started with, each numbered below it; at quiescence, a ready model runs at least
#   ``replicas.min`` unless one more finds no room;
# - (r3) a request is routed to a replica that serves (ready, not draining) whenever one
#   does, and its ``Generate`` reaches that replica;
# - (r4) the generations in flight on a model's replicas never outnumber its leases;
# - (r5) a crash's streams end with an error within ``CRASH_ENDS_WITHIN`` s; a stream its
#   replica finished reaches its client whole (the siblings of a crashed replica serve on);
# - (r6) a scale-down cuts no request: a replica drained for it finishes what it took;
# - (r7) a model that may run several replicas never parks;
# - (r8) no prefix index entry names a replica that is gone (its live slots are replicas
#   that run).

CRASH_ENDS_WITHIN = 2.0
"""Virtual seconds by which a request on a crashed replica has ended at its client."""


def placed_on(replica: Replica) -> tuple[set[int], set[int]]:
    """The cores and GPUs ``replica``'s placement put it on."""
    env = replica.placement
    cores = (parse_cores(env["VLLM_CPU_OMP_THREADS_BIND"])
             if env.get("VLLM_CPU_OMP_THREADS_BIND") else set())
    gpus = {int(g) for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g}
    return cores, gpus


def index_replicas(sup: Supervisor, entry: ModelEntry) -> set[int]:
    """The replica numbers ``entry``'s prefix index keeps live slots for."""
    index = sup.routes.indexes.get(entry.id)
    return set(index._slot) if index is not None else set()


def replica_violations(sup: Supervisor, entries: Iterable[ModelEntry]) -> list[str]:
    """(r1), (r2)'s bound and (r8), as things stand now."""
    out = []
    held = sup.placer._held
    for entry in {e.id: e for e in entries}.values():  # replicas are kept by model id
        replicas = list(sup.replicas_of(entry))
        if not replicas or all(r.spec is None or r.spec.replicas.max == 1 for r in replicas):
            continue
        taken: dict[str, set[int]] = {"core": set(), "GPU": set()}
        for r in replicas:
            cores, gpus = placed_on(r)
            for kind, mine in (("core", cores), ("GPU", gpus)):
                if mine & taken[kind]:
                    out.append(f"{entry.id}: (r1) replica {r.number} shares {kind}(s) "
                               f"{sorted(mine & taken[kind])} with a sibling")
                taken[kind] |= mine
            if cores and held.get(r.key) != cores:
                out.append(f"{entry.id}: (r1) replica {r.number} runs on cores "
                           f"{sorted(cores)}, the placer holds {held.get(r.key)} for it")
            assert r.spec is not None
            model_cores = (parse_cores(r.spec.cpu_cores) if r.spec.cpu_cores
                           else set(sup.placer.cores))
            if cores - model_cores or gpus - set(r.spec.gpus or ([0] if gpus else [])):
                out.append(f"{entry.id}: (r1) replica {r.number} placed outside its model's "
                           f"cores or GPUs: {r.placement}")
            if r.number >= r.spec.replicas.max:
                out.append(f"{entry.id}: (r2) replica {r.number} of replicas.max "
                           f"{r.spec.replicas.max}")
        for most in {r.spec.replicas.max for r in replicas if r.spec is not None}:
            live = [r.number for r in replicas if r.state != "draining"
                    and r.spec is not None and r.spec.replicas.max == most]
            if len(live) > most:
                out.append(f"{entry.id}: (r2) {len(live)} replicas {live} run, "
                           f"replicas.max {most}")
        stale = index_replicas(sup, entry) - {r.number for r in replicas}
        if stale:
            out.append(f"{entry.id}: (r8) its prefix index names replica(s) {sorted(stale)}, "
                       "which are gone")
    return out


def replica_park_violations(sup: Supervisor, model: str, state: str) -> list[str]:
    """(r7) as ``model`` enters ``state`` (``parking`` or ``parked``)."""
    entry = sup.registry.entries.get(model)
    if entry is not None and entry.spec.replicas.max > 1:
        most = entry.spec.replicas.max
        return [f"{model}: (r7) '{state}', though it may run {most} replicas"]
    return []


def route_violations(sup: Supervisor, entry: ModelEntry, chosen: WorkerLink,
                     gens: list[Generate]) -> list[str]:
    """(r3) as a request is routed: to a replica that serves, if one does."""
    replicas = list(sup.replicas_of(entry))
    serving = [r for r in replicas if r.serving]
    replica = next((r for r in replicas if r.link is chosen), None)
    if not serving or (replica is not None and replica.serving):
        return []
    ids = ",".join(g.id for g in gens)
    what = (f"replica {replica.number} ({replica.state}{', parked' if replica.parked else ''})"
            if replica is not None else "a link no replica has")
    served = [r.number for r in serving]
    return [f"{entry.id}: (r3) {ids} routed to {what} while {served} served"]


def in_flight_violations(sup: Supervisor, entries: Iterable[ModelEntry]) -> list[str]:
    """(r4): the generations in flight on a model's replicas never outnumber its leases."""
    out = []
    leases: dict[str, int] = {}
    for entry in entries:  # a model removed and added again: both entries' workers drain
        leases[entry.id] = leases.get(entry.id, 0) + entry.leases  # under its id
    for model, held in leases.items():
        replicas = sup._replicas.get(model)
        if replicas is None or len(replicas) < 2:
            continue
        flying = sum(len(r.link._routes) for r in replicas)
        if flying > held:
            out.append(f"{model}: (r4) {flying} generation(s) in flight on its replicas, "
                       f"{held} lease(s)")
    return out


def replica_request_violations(net: SimNet, asked: dict[str, Op],
                               outcomes: dict[str, tuple[str, int, str]],
                               ended_at: dict[str, float], stream_errors: set[str],
                               left: set[int], routes: dict[str, int],
                               retired: set[int], replicated: set[str]) -> list[str]:
    """(r3)'s second half, (r5) and (r6), over every ``Generate`` a replica of a model of
    several took (``left``: the operations whose client left, which may end anyhow)."""
    out = []
    for worker in net.workers:
        if worker.model not in replicated:
            continue
        for gen_id in sorted(worker.received):
            op = asked[gen_id]
            if gen_id in routes and routes[gen_id] != worker.pid:
                out.append(f"{gen_id}: (r3) routed to worker {routes[gen_id]}, reached "
                           f"{worker.key}'s worker {worker.pid}: {op}")
            if gen_id not in outcomes:
                continue  # its client never ended: the harness says so
            kind, got, state = outcomes[gen_id]
            if kind == "ok" and gen_id in stream_errors:
                kind = "an error event"  # a stream's status was sent: its end says it
            want = max(1, op.args["tokens"])
            ended, there = ended_at[gen_id], worker.ended.get(gen_id)
            if there == "exit" and worker.returncode not in (0, None):
                assert worker.exited_at is not None
                if kind == "ok":
                    out.append(f"{gen_id}: (r5) its replica {worker.key} crashed under it, "
                               f"yet it ended ok with {got} of {want} token(s): {op}")
                elif ended - worker.exited_at > CRASH_ENDS_WITHIN:
                    out.append(f"{gen_id}: (r5) its replica {worker.key} crashed at "
                               f"{worker.exited_at - 1000:.2f}, it ended "
                               f"{ended - worker.exited_at:.2f} s later: {op}")
            whole = kind == "gone" or id(op) in left or (kind == "ok" and got == want)
            if (there == "done" and not whole and state == "ready"
                    and (worker.exited_at is None or worker.exited_at > ended)):
                out.append(f"{gen_id}: (r5) {worker.key}'s worker {worker.pid} finished it, "
                           f"its client got {kind} with {got} of {want} token(s): {op}")
            if (worker.pid in retired and not whole and there != "error"
                    and state == "ready"):
                out.append(f"{gen_id}: (r6) cut by the scale-down of {worker.key} (worker "
                           f"{worker.pid}: {there or 'still running'}): {kind} with {got} of "
                           f"{want} token(s): {op}")
    return out


def min_violations(sup: Supervisor, entries: Iterable[ModelEntry]) -> list[str]:
    """(r2) at quiescence: a ready model runs ``replicas.min`` unless one more finds no
    room."""
    out = []
    for entry in entries:
        limits = entry.spec.replicas
        running = [r for r in sup.replicas_of(entry) if r.state != "draining"]
        if (entry.state == "ready" and entry in sup.registry.entries.values()
                and len(running) < limits.min and sup.replica_room(entry)):
            out.append(f"{entry.id}: (r2) ready with {len(running)} replica(s) at quiescence, "
                       f"replicas.min {limits.min}, and room for one more")
    return out


def replicas_settled(sup: Supervisor, entries: Iterable[ModelEntry]) -> bool:
    """No replica starts or drains, and no ready model is short of ``replicas.min`` with
    room for one more (the scaler would start one)."""
    for entry in entries:
        if sup.scaler.starting(entry) or any(r.state != "ready"
                                             for r in sup.replicas_of(entry)):
            return False
    return not min_violations(sup, entries)
