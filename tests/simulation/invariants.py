"""What must hold of a simulated run (``harness`` runs it): at quiescence, during it for
adapter models, and after ``stop_all``. Each check reads the real ``Supervisor`` and
returns its findings as lines; the few looks inside that they need are the first
functions here (adjust those if the router's insides move).

The checks of batch lines' priority are ``batch_watch.BatchWatch``'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from router.lifecycle.supervisor import Supervisor
from router.registry import ModelEntry, Slots
from router.workers.placement import Placer
from shared.config import ModelSpec
from shared.protocol import Generate
from tests.simulation.fakes import SimNet
from tests.simulation.world import Op

SETTLE_WITHIN = 40.0
"""Virtual seconds after every client answered for no model to be ``loading`` or
``stopping``."""


# -- the few looks inside that the invariants need -----------------------------------------
def slots_taken(slots: Slots | None, cap: int) -> int:
    """How many of a ``max_concurrent`` cap's slots are taken (or waited for)."""
    if slots is None:
        return 0
    return cap - slots.free + slots.waiting


def held_placements(placer: Placer) -> set[str]:
    """Models the placer holds CPU cores for."""
    return set(placer._held)


def gpu_start_locks(placer: Placer) -> dict[int, asyncio.Lock]:
    """Each GPU's start lock, through the public ``start_locks``."""
    return {g: placer.start_locks(ModelSpec(id=f"probe{g}", model="/probe", device="cuda",
                                            gpus=[g]))[0] for g in placer.gpus}


def lifecycle_ids(sup: Supervisor) -> set[str]:
    """The models the supervisor keeps a worker, a load or a stop of."""
    return {*sup._workers, *sup._loads, *sup._stops}


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
    running = dict(sup._workers)
    for model_id, worker in running.items():
        if worker.handle.returncode is not None:
            out.append(f"{model_id}: the supervisor keeps worker {worker.handle.pid}, "
                       f"which exited ({worker.handle.returncode})")
    current = set(sup.registry.entries.values())
    for entry in entries:
        if entry not in current and entry.id in sup.registry.entries:
            continue  # removed, then added again: its id names the new entry's worker
        if entry.state in ("ready", "sleeping", "parked") and entry.id not in running:
            out.append(f"{entry.id}: '{entry.state}' with no worker")
        if entry.id in running and entry.state not in ("ready", "sleeping", "parked",
                                                        "stopping"):
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
        if a.link is not None or a.pid is not None or a.node is not None:
            out.append(f"{a.id} (an adapter of {base}): a worker of its own "
                       f"(pid {a.pid}, link {a.link is not None})")
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
    if sup._workers:
        out.append(f"the supervisor still keeps workers of {sorted(sup._workers)}")
    out += [f"{e.id}: '{e.state}'" for e in entries if e.state not in ("unloaded", "failed")]
    return out
