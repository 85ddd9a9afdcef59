"""One seed's world: its preset (models, server limits, GPUs), how chaotic its workers
are, and its schedule of operations (see ``harness``).

Some worlds (``ADAPTER_WORLDS``) give one model 1-3 LoRA adapter models (preset entries
``{base, adapter}``, folders from ``adapter_folders``), and maybe an ``adapters_dir``
whose folders requests name as ``<base>/<folder>``; then some requests, loads, unloads
and reloads name an adapter. Some (``BATCH_WORLDS``) get batches (``add_batches``).
Some (``MOMENT_WORLDS``) have clients that leave at a moment of their model rather than
at a time (``add_moments``). Every world parks (``add_parking``: its limits, its host's
memory), and some time-slice two CPU models under ``max_loaded_models: 1``
(``SLICE_WORLDS``), or crash, unload, reload or load a model as it parks or wakes
(``STATE_OP_WORLDS``). Those draws come from random streams of their own, so a world
without adapters, batches, such clients or parking ops has the schedule its seed always
gave. Seeds from ``REPLICA_SEEDS`` up are replica worlds (``add_replicas``, from a stream
of its own too): no seed below has a model of several replicas.
"""

from __future__ import annotations

import atexit
import functools
import json
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.lifecycle.policy.room import BATCH_QUIET
from router.workers.placement import GIB, GpuMemory
from tests.simulation.fakes import Q, quantum


@dataclass
class Op:
    at: float
    kind: str
    model: str
    args: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.args.items())
        return f"{self.at:6.2f} {self.kind:7} {self.model} {extra}".rstrip()


@dataclass
class World:
    seed: int
    raw: dict[str, Any]
    chaos: float
    ops: list[Op]
    gpus: dict[int, GpuMemory]
    host_gib: float = 64.0
    """This host's memory (``SimNet.host_memory``: what parking without
    ``park_memory_gib`` reads)."""

    def describe(self) -> str:
        server = {k: v for k, v in self.raw["server"].items() if k != "spare_workers"}
        lines = [f"server {server} chaos {self.chaos} host {self.host_gib:g} GiB"]
        for name, body in self.raw["models"].items():
            lines.append(f"  {name}: {shown_body(body)}")
        return "\n".join(lines)


def shown_body(body: dict[str, Any]) -> dict[str, Any]:
    """A model's preset entry for a trace: its folders by their last name."""
    return {k: Path(v).name if k in ("adapter", "adapters_dir") else v
            for k, v in body.items() if k != "model"}


ADAPTER_WORLDS = 0.35
"""The share of worlds with adapter models."""
BATCH_WORLDS = 0.4
"""The share of worlds with batches."""
ADAPTER_RANKS = {"a8": 8, "b8": 8, "c16": 16, "d32": 32}
"""The declared adapters' folders and ranks (a switch to ``d32`` raises its base's
``max_lora_rank``: a restart)."""
MOMENT_WORLDS = 0.5
"""The share of worlds whose clients may leave at a moment (``add_moments``)."""
SLICE_WORLDS = 0.3
"""The share of worlds where two CPU models share ``max_loaded_models: 1`` and many
requests, long streams among them, alternate between them (time slicing)."""
STATE_OP_WORLDS = 0.7
"""The share of worlds with operations that happen as a model enters a parking state."""
PARK_STATES = ("parking", "parked", "waking")
"""The states a ``on_state`` operation waits for."""
MOMENTS = ("slot", "lease", "load")
"""The moments a client may leave at, on its model (an adapter's: its base): a
``max_concurrent`` slot given back, a lease granted (``acquire_now``, or ``acquire``
returning), a load ending (the model ready, or failed). A cancel that lands in such a
turn is where hand-overs leak."""
REPLICA_SEEDS = 5_000_000
"""Seeds from here up are replica worlds (``add_replicas``): the world the seed gives
otherwise, with one or two of its models given replicas. No seed below has one: their
worlds and traces are what they were before replicas."""
REPLICA_STATES = ("starting", "ready", "draining")
"""The replica states a ``on_replica`` operation waits for (a replica's own events: one
starting, one serving, one drained for a scale-down)."""
LATE_REPLICAS = 0.2
"""The share of replica worlds whose models get their replicas from a reload."""
CONVERSATIONS = 3
"""Conversations a replica world's requests belong to (their prompts share a prefix of
several index blocks, and grow turn by turn: prefix routing has something to find)."""
FOUND = ("f0", "f1")
"""The folders in the ``adapters_dir`` a base may have."""


@functools.cache
def adapter_folders() -> Path:
    """A folder made once per process: ``lib/<name>`` for each of ``ADAPTER_RANKS`` and
    ``found/<name>`` for each of ``FOUND``, each a minimal LoRA adapter (its config and an
    empty weights file: only the synthetic engine and ``SimWorker`` ever see them)."""
    root = Path(tempfile.mkdtemp(prefix="sim-adapters"))
    atexit.register(shutil.rmtree, root, True)
    for folder, rank in [*(("lib/" + n, r) for n, r in ADAPTER_RANKS.items()),
                         *(("found/" + n, 8) for n in FOUND)]:
        path = root / folder
        path.mkdir(parents=True)
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
             "target_modules": ["q_proj"]}))
        (path / "adapter_model.safetensors").write_bytes(b"")
    return root


def make_world(seed: int) -> World:
    rng = random.Random(seed)
    gpus = {g: GpuMemory(g, 80 * GIB, 79 * GIB) for g in (0, 1)}
    budget = rng.random() < 0.3
    models: dict[str, dict[str, Any]] = {}
    for i in range(rng.randint(2, 4)):
        body: dict[str, Any] = {"model": f"/sim/m{i}"}
        if rng.random() < 0.5:
            on = rng.choice([[0], [1], [0, 1], [0, 1]])
            body.update(device="cuda", gpus=on, tensor_parallel_size=len(on))
            if rng.random() < 0.4:
                body["idle_action"] = "sleep"
            if budget:
                body["memory_gib"] = rng.choice([30, 50, 70]) * len(on)
        body["max_concurrent"] = rng.choice([0, 1, 1, 2, 4])
        if rng.random() < 0.25:
            body["priority"] = 5
        if rng.random() < 0.08:
            body["pinned"] = True
        if rng.random() < 0.15:
            body["min_resident"] = 0.5
        ttl = rng.choice([None, None, 0.5, 2.0])
        if ttl is not None:
            body["ttl"] = ttl
        models[f"m{i}"] = body
    server: dict[str, Any] = {
        "spare_workers": 0,
        "max_loaded_models": rng.choice([0, 1, 1, 2, 2, 3]),
        "load_timeout": rng.choice([1.5, 3.0]),
        "drain_timeout": rng.choice([0.3, 1.0]),
        "swap_wait": rng.choice([0.2, 0.6]),
        "max_queue_depth": rng.choice([2, 4, 32]),
        "ttl": rng.choice([0.0, 0.0, 1.0, 3.0]),
    }
    if budget:
        server["memory_budget_gib"] = {"cuda:0": 80, "cuda:1": 80, "cpu": rng.choice([4, 6])}
    chaos = rng.choice([0.0, 0.3, 1.0])
    names = list(models)
    horizon = rng.choice([3.0, 6.0, 10.0])
    ops: list[Op] = []
    for _ in range(rng.randint(10, 60)):
        if ops and rng.random() < 0.3:
            at = ops[-1].at  # a burst: same instant, same loop turns
        else:
            at = round(rng.uniform(0, horizon) / Q) * Q
        kind = rng.choices(["request", "load", "unload", "crash", "reload"],
                           [70, 6, 8, 5, 4])[0]
        model = rng.choice(names)
        args: dict[str, Any] = {}
        if kind == "request":
            if rng.random() < 0.03:
                model = "nope"
            args = {"via": "relay" if rng.random() < 0.6 else "direct",
                    "tokens": rng.randint(1, 20), "stream": rng.random() < 0.6}
            if rng.random() < 0.5:
                args["leave"] = quantum(rng, 60)
                args["turns"] = rng.randint(0, 6)  # loop turns after that instant
            if rng.random() < 0.15:
                args["keep_alive"] = rng.choice([0.0, -1.0, 1.0])
            if args["via"] == "relay" and args["stream"] and rng.random() < 0.3:
                args["cold"] = True  # the stream begins at once, with keep-alive events
        elif kind == "load":
            args = {"wait": rng.random() < 0.5}
        elif kind == "unload":
            args = {"force": rng.random() < 0.3}
        elif kind == "reload":
            args = {"change": rng.choice(["restart", "router_only", "remove", "restore",
                                          "limit"])}
            if args["change"] == "limit":
                args["max_loaded_models"] = rng.choice([0, 1, 2])
        ops.append(Op(at, kind, model, args))
    ops.sort(key=lambda op: op.at)
    arng = random.Random(seed * 104729 + 3)
    if arng.random() < ADAPTER_WORLDS:
        add_adapters(arng, models, ops)
    brng = random.Random(seed * 15485863 + 5)
    if brng.random() < BATCH_WORLDS:
        add_batches(brng, list(models), ops)
    mrng = random.Random(seed * 49979687 + 11)
    if mrng.random() < MOMENT_WORLDS:
        add_moments(mrng, ops)
    prng = random.Random(seed * 32452843 + 17)
    host_gib = add_parking(prng, server, models, ops)
    if seed >= REPLICA_SEEDS:
        add_replicas(random.Random(seed * 67867967 + 23), server, models, ops)
    return World(seed, {"server": server, "models": models}, chaos, ops, gpus, host_gib)


def add_parking(rng: random.Random, server: dict[str, Any], models: dict[str, dict[str, Any]],
                ops: list[Op]) -> float:
    """Parking's limits (``max_parked_models`` 0-3 or the default, ``park_memory_gib``
    unset or small enough to stop some, a short ``park_quantum``), this host's memory
    (returned), and maybe time slicing (``SLICE_WORLDS``), operations as a model parks
    or wakes (``STATE_OP_WORLDS``) and reloads that lower parking's limits (memory
    pressure)."""
    if rng.random() < 0.85:
        server["max_parked_models"] = rng.choice([0, 1, 1, 2, 3])
    server["park_quantum"] = rng.choice([0.2, 0.3, 0.5, 1.0])
    memory = rng.choice([None, None, 1.0, 2.0, 4.0])
    if memory is not None:
        server["park_memory_gib"] = memory
    host_gib = rng.choice([6.0, 12.0, 64.0])
    bases = [n for n, body in models.items() if "base" not in body]
    last = max((op.at for op in ops), default=1.0)
    if rng.random() < SLICE_WORLDS and len(bases) >= 2:
        server["max_loaded_models"] = 1
        pair = rng.sample(bases, 2)
        for name in pair:  # on this host's cores: they park
            for key in ("device", "gpus", "tensor_parallel_size", "idle_action", "memory_gib"):
                models[name].pop(key, None)
        at = round(rng.uniform(0, last / 2) / Q) * Q
        for i in range(rng.randint(6, 20)):
            at += quantum(rng, 8)
            args: dict[str, Any] = {"via": "relay" if rng.random() < 0.6 else "direct",
                                    "tokens": rng.choice([rng.randint(5, 20),
                                                          rng.randint(30, 80)]),
                                    "stream": rng.random() < 0.7}
            if rng.random() < 0.1:
                args.update(leave=quantum(rng, 60), turns=rng.randint(0, 4))
            ops.append(Op(at, "request", pair[i % 2], args))
    cpu = [n for n in bases if models[n].get("device") != "cuda"] or bases  # these park
    if rng.random() < STATE_OP_WORLDS:
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice(["crash", "crash", "unload", "reload", "load"])
            args = {"on_state": rng.choice(PARK_STATES), "turns": rng.randint(0, 4),
                    "within": quantum(rng, 160, 40)}
            if kind == "unload":
                args["force"] = rng.random() < 0.3
            elif kind == "reload":
                args["change"] = rng.choice(["restart", "remove", "router_only"])
            elif kind == "load":
                args["wait"] = rng.random() < 0.5
            ops.append(Op(round(rng.uniform(0, last) / Q) * Q, kind, rng.choice(cpu), args))
    for _ in range(rng.choice([0, 0, 1, 2])):  # memory pressure: parking's limits lowered
        change: dict[str, Any] = (
            {"max_parked_models": rng.choice([0, 1])} if rng.random() < 0.5
            else {"park_memory_gib": rng.choice([0.5, 1.0, 2.0])})
        ops.append(Op(round(rng.uniform(0, last) / Q) * Q, "reload", rng.choice(bases),
                      {"change": "park", **change}))
    ops.sort(key=lambda op: op.at)
    return host_gib


def add_adapters(rng: random.Random, models: dict[str, dict[str, Any]], ops: list[Op]) -> None:
    """Give one model adapter models, and point some of ``ops`` at them."""
    base_id = rng.choice(list(models))
    base = models[base_id]
    lib = adapter_folders() / "lib"
    small = rng.random() < 0.3  # one batch slot and a tiny CPU pool: adapters come and go
    if small:
        base.update(max_loras=1, max_cpu_loras=rng.choice([1, 2]))
    declared = []
    for i in range(rng.randint(1, 3)):
        name = f"ad{i}"
        body: dict[str, Any] = {"base": base_id,
                                "adapter": str(lib / rng.choice(["a8", "b8", "c16"]))}
        if not small and rng.random() < 0.2:
            body["pinned"] = True  # at most 3 of the default 4 batch slots
        models[name] = body
        declared.append(name)
    names = list(declared)
    if rng.random() < 0.3:
        base["adapters_dir"] = str(adapter_folders() / "found")
        names += [f"{base_id}/{folder}" for folder in FOUND]
    for op in ops:
        if op.kind in ("request", "load", "unload") and op.model != "nope" and \
                rng.random() < 0.4:
            op.model = rng.choice(names)
    last = max((op.at for op in ops), default=1.0)
    for _ in range(rng.randint(0, 3)):  # reloads that add, change or remove adapters
        change = rng.choice(["remove", "restore", "restart", "router_only"])
        ops.append(Op(round(rng.uniform(0, last) / Q) * Q, "reload",
                      rng.choice(declared), {"change": change}))
    ops.sort(key=lambda op: op.at)


def add_batches(rng: random.Random, names: list[str], ops: list[Op]) -> None:
    """Give the schedule 1-4 batches: each runs 1-5 lines on one of ``names`` (maybe an
    adapter), ``at_once`` at a time, through the relay (as the runner does) or straight
    through ``Supervisor.acquire_now``/``acquire``. Half share an instant with a request
    (a slot then frees with both kinds of waiter), and some worlds have a late phase that
    begins ``BATCH_QUIET`` s after the last operation: batches may fill room no person
    uses any more, while a few requests come back."""
    last = max((op.at for op in ops), default=1.0)
    late = rng.random() < 0.3
    end = last + BATCH_QUIET + 3.0 if late else last
    requests = [op for op in ops if op.kind == "request" and op.model != "nope"]
    for _ in range(rng.randint(1, 4)):
        if requests and rng.random() < 0.5:
            near = rng.choice(requests)
            at, model = near.at, near.model if rng.random() < 0.7 else rng.choice(names)
        else:
            at, model = round(rng.uniform(0, end) / Q) * Q, rng.choice(names)
        args: dict[str, Any] = {
            "via": "relay" if rng.random() < 0.6 else "direct", "lines": rng.randint(1, 5),
            "at_once": rng.choice([1, 1, 2, 3]), "tokens": rng.randint(1, 15),
            "patience": quantum(rng, 60)}  # how long a line may wait to start: its expiry
        if rng.random() < 0.2:  # cancelled
            args["leave"] = quantum(rng, 80)
            args["turns"] = rng.randint(0, 6)
        ops.append(Op(at, "batch", model, args))
    if late:
        for _ in range(rng.randint(0, 3)):  # people come back while batches run
            at = round(rng.uniform(last + BATCH_QUIET, end) / Q) * Q
            ops.append(Op(at, "request", rng.choice(names),
                          {"via": "relay" if rng.random() < 0.6 else "direct",
                           "tokens": rng.randint(1, 20), "stream": rng.random() < 0.6}))
    ops.sort(key=lambda op: op.at)


def add_moments(rng: random.Random, ops: list[Op]) -> None:
    """Make some batches (half of those that do not leave) and some requests (of those
    that do not leave) leave at a moment of their model (``MOMENTS``): the first one at
    least ``after`` s after they begin, ``turns`` loop turns after it. A batch leaves as
    ``router.batches.runner`` stops one: its lines in flight are cancelled, then ``again``
    turns later the batch's task (and, by its task group, any line still running)."""
    for op in ops:
        if "leave" in op.args or op.kind not in ("batch", "request") or op.model == "nope":
            continue
        if rng.random() < (0.5 if op.kind == "batch" else 0.15):
            op.args.update(leave_on=rng.choice(MOMENTS), after=quantum(rng, 20),
                           turns=rng.randint(0, 6))
            if op.kind == "batch":
                op.args["again"] = rng.randint(0, 4)


def conversation_prompt(conversation: int, turn: int) -> str:
    """Turn ``turn`` of conversation ``conversation``: a shared system prompt, the
    conversation's own opening, then its turns so far (each prompt begins with the last)."""
    system = "You are the simulated assistant. " * 12
    return (system + f"Conversation {conversation}. " * 12
            + "".join(f"turn {t} of {conversation}; " * 6 for t in range(turn + 1)))


def draw_replicas(rng: random.Random, cores: int) -> int | dict[str, Any]:
    """A ``replicas`` value for a model with ``cores`` cores (or GPUs) to share: ``N``, or
    ``{min, max, ...}`` with small clocks (the scaler acts within a world's seconds)."""
    most = rng.randint(2, cores)
    if rng.random() < 0.3:
        return most
    return {"min": rng.choice([0, 1, 1, 2]) if most >= 2 else 1, "max": most,
            "up_wait": rng.choice([0.0, 0.1, 0.3]), "up_after": rng.choice([0.0, 0.1, 0.5]),
            "cooldown": rng.choice([0.0, 0.2, 1.0]), "idle": rng.choice([0.3, 1.0, 3.0])}


def add_replicas(rng: random.Random, server: dict[str, Any],
                 models: dict[str, dict[str, Any]], ops: list[Op]) -> None:
    """Give one or two models (not adapters) replicas (``draw_replicas``): a CPU model
    its own ``cpu_cores`` to share or the host's four, a GPU model both GPUs; small
    ``max_concurrent`` (a queue forms: the scaler adds replicas), maybe a routing
    strategy. Then bursts of requests to them (conversations' prompts, some with a
    session), crashes aimed at one replica (mid-stream: during a burst), and operations
    that happen as a replica of them starts, becomes ready or drains for a scale-down
    (``on_replica``): a crash (a start that fails, a replica lost as it serves), an
    unload (while a replica drains), a reload that changes ``replicas``. In some worlds
    (``LATE_REPLICAS``) no model has replicas until a reload gives them theirs."""
    late = rng.random() < LATE_REPLICAS
    bases = [n for n, body in models.items() if "base" not in body]
    chosen = rng.sample(bases, 2 if len(bases) >= 2 and rng.random() < 0.3 else 1)
    if rng.random() < 0.6:
        server["max_loaded_models"] = rng.choice([0, len(bases) + 3])
    last = max((op.at for op in ops), default=1.0)
    for name in chosen:
        body = models[name]
        if body.get("device") == "cuda":
            body.update(gpus=[0, 1], tensor_parallel_size=1)
            if "memory_gib" in body:
                body["memory_gib"] = rng.choice([20, 30])
            cores = 2
        else:
            where = rng.choice(["0-3", "0-1", None])
            if where is not None:
                body["cpu_cores"] = where
            cores = 2 if where == "0-1" else 4
        body["replicas"] = draw_replicas(rng, cores)
        if isinstance(body["replicas"], dict) and body["replicas"]["min"] == 0:
            body.pop("pinned", None)  # a pinned model never scales to zero
        body["max_concurrent"] = rng.choice([0, 1, 1, 2])
        if rng.random() < 0.4:
            body["routing"] = {"strategy": rng.choice(["prefix", "least_loaded",
                                                       "round_robin"]),
                               "balance_abs": rng.choice([1, 2, 4])}
        turns = [0] * CONVERSATIONS
        for _ in range(rng.randint(1, 3)):  # bursts: a queue, then replicas serving it
            at = round(rng.uniform(0, last) / Q) * Q
            for _ in range(rng.randint(3, 10)):
                conversation = rng.randrange(CONVERSATIONS)
                args: dict[str, Any] = {
                    "via": "relay" if rng.random() < 0.8 else "direct",
                    "tokens": rng.randint(5, 40), "stream": rng.random() < 0.7,
                    "prompt": [conversation, turns[conversation]]}
                turns[conversation] += 1
                if args["via"] == "relay" and rng.random() < 0.3:
                    args["session"] = f"s{conversation}"
                if rng.random() < 0.1:
                    args.update(leave=quantum(rng, 40), turns=rng.randint(0, 4))
                ops.append(Op(at + quantum(rng, 4), "request", name, args))
            if rng.random() < 0.5:  # a replica lost mid-stream
                ops.append(Op(at + quantum(rng, 30, 2), "crash", name,
                              {"replica": rng.randrange(cores)}))
        for _ in range(rng.randint(0, 3)):
            kind = rng.choice(["crash", "crash", "unload", "reload"])
            state = rng.choice(REPLICA_STATES)
            args = {"on_replica": state, "turns": rng.randint(0, 4),
                    "within": quantum(rng, 200, 40)}
            if kind == "unload":
                args["force"] = rng.random() < 0.3
            elif kind == "reload":
                args.update(change="replicas", replicas=draw_replicas(rng, cores))
            ops.append(Op(round(rng.uniform(0, last) / Q) * Q, kind, name, args))
        if rng.random() < 0.3:
            ops.append(Op(round(rng.uniform(0, last) / Q) * Q, "reload", name,
                          {"change": "replicas", "replicas": draw_replicas(rng, cores)}))
        if late:
            ops.append(Op(round(rng.uniform(0, last / 2) / Q) * Q, "reload", name,
                          {"change": "replicas", "replicas": body.pop("replicas")}))
    ops.sort(key=lambda op: op.at)
