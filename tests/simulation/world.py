"""One seed's world: its preset (models, server limits, GPUs), how chaotic its workers
are, and its schedule of operations (see ``harness``)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

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

    def describe(self) -> str:
        server = {k: v for k, v in self.raw["server"].items() if k != "spare_workers"}
        lines = [f"server {server} chaos {self.chaos}"]
        for name, body in self.raw["models"].items():
            shown = {k: v for k, v in body.items() if k != "model"}
            lines.append(f"  {name}: {shown}")
        return "\n".join(lines)


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
    return World(seed, {"server": server, "models": models}, chaos, ops, gpus)
