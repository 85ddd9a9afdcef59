"""The simulated world below the supervisor: worker "processes", their ZeroMQ sockets and
the backend that starts them. All of it lives on the one (virtual-time) event loop.

- ``SimSocket`` / ``SimContext``: what ``WorkerLink`` uses of pyzmq (bind, send with
  ``SNDMORE``, ``recv``, ``FD``/``EVENTS``), so the real ``WorkerLink`` runs unchanged.
  A send with no live peer raises ``zmq.Again``, as a DEALER with no connection does.
- ``SimWorker``: a worker process as the router sees it through its socket: it boots
  (``Ready``), or hangs, crashes or reports a failed engine start; it streams ``Deltas``
  for ``Generate``, stops on ``Cancel``, answers ``Ping``/``Sleep``/``Wake`` and exits on
  ``Shutdown`` (or ignores it, to be killed). Its faults come from a ``FaultPlan`` drawn
  from the seed's random stream when it is spawned.
  A GPU model's park is ``Sleep(level=1|2)`` alone (``level``; vLLM's sleep mode with
  its requests kept: paused as below, never frozen).
  A park is as on a real host: ``Sleep(level=0)`` pauses its engine between two steps
  (``paused``: as vLLM's ``pause_generation(mode="keep")``, every request is kept and
  none gets a delta until ``Wake``), then ``SimHandle.freeze`` stops the "process"
  (``frozen``: as ``SIGSTOP``, it handles no message, runs no timer and sends nothing
  until thawed; what came meanwhile waits, in order). A kill still ends a frozen one.
  Each ``Generate`` a park paused is kept (``paused_gens``) with how it ended
  (``ended``), for the invariants.
  A worker of a base that serves adapters keeps an ``EnginePool`` of them, as
  ``worker.adapters.AdapterPool`` and vLLM do: it answers ``Adapters`` with
  ``AdapterStates`` and loads a ``Generate``'s ``lora`` before it generates; each
  ``Generate`` it took is kept in ``received`` (its ``lora``, its ``priority``) for the
  invariants.
- ``SimHandle`` / ``SimBackend``: the ``WorkerHandle`` and ``Backend`` shapes.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from router.workers.backends import Backend, SpawnError, WorkerHandle
from router.workers.backends.base import BootFor
from router.workers.placement import Placer
from shared.config import ModelSpec, WorkerBoot, serves_adapters
from shared.protocol import (
    Adapters,
    AdapterState,
    AdapterStates,
    Cancel,
    Delta,
    Deltas,
    Error,
    Generate,
    LoraRef,
    Ping,
    Pong,
    Ready,
    Shutdown,
    Sleep,
    Wake,
    worker_codec,
)
from tests.simulation.vtime import FAKE_FD_BASE, VirtualTimeLoop, after_turns

Q = 0.05
"""Every simulated delay is a multiple of this: events of different origins often fall in
the same loop turn, where races live."""


def quantum(rng: random.Random, most: int, least: int = 0) -> float:
    return rng.randint(least, most) * Q


@dataclass
class FaultPlan:
    """How one spawned worker behaves (drawn at spawn time)."""

    spawn_delay: float = 0.0
    spawn_error: bool = False
    boot: str = "ok"
    """``ok`` (Ready after ``boot_delay``), ``hang`` (never ready), ``crash`` (exits 1),
    ``refuse`` (sends the engine's failure, then exits 1)."""
    boot_delay: float = 0.1
    step: float = 0.05
    """Seconds between a generation's deltas."""
    shutdown: str = "exit"
    """``exit`` after ``shutdown_delay``, or ``ignore`` (the router kills it after grace)."""
    shutdown_delay: float = 0.0
    sleep_fails: bool = False
    engine_error_every: int = 0
    """Every n-th generate ends with an engine error (0: never)."""
    adapter_load: float = 0.0
    """Seconds an adapter takes to load into the engine."""
    adapter: str = "ok"
    """``ok``, ``refuse`` (every adapter load fails with a 400, as a bad folder does) or
    ``crash`` (the engine dies in its first adapter load)."""
    resident_gib: float = 1.0
    """What its processes hold (``SimHandle.resident_bytes``); drawn from a stream of its
    own (``SimNet.memory_rng``): the plans of older seeds stay as they were."""

    def brief(self) -> str:
        parts = [f"spawn+{self.spawn_delay:g}"]
        if self.spawn_error:
            return parts[0] + " SpawnError"
        parts.append(f"{self.boot}+{self.boot_delay:g}")
        parts.append(f"step {self.step:g}")
        parts.append(f"shutdown {self.shutdown}+{self.shutdown_delay:g}")
        if self.sleep_fails:
            parts.append("sleep fails")
        if self.engine_error_every:
            parts.append(f"engine error every {self.engine_error_every}")
        if self.adapter_load or self.adapter != "ok":
            parts.append(f"adapter {self.adapter}+{self.adapter_load:g}")
        return ", ".join(parts)


def draw_plan(rng: random.Random, chaos: float) -> FaultPlan:
    """A worker's behaviour; ``chaos`` (0..1) scales how often things go wrong."""
    plan = FaultPlan(spawn_delay=quantum(rng, 3), boot_delay=quantum(rng, 20, 1),
                     step=quantum(rng, 3, 1), shutdown_delay=quantum(rng, 6))
    if rng.random() < 0.15 * chaos:
        plan.spawn_error = True
    roll = rng.random()
    if roll < 0.08 * chaos:
        plan.boot = "hang"
    elif roll < 0.16 * chaos:
        plan.boot = "crash"
    elif roll < 0.22 * chaos:
        plan.boot = "refuse"
    if rng.random() < 0.2 * chaos:
        plan.shutdown = "ignore"
    plan.sleep_fails = rng.random() < 0.2 * chaos
    if rng.random() < 0.1 * chaos:
        plan.engine_error_every = rng.randint(2, 5)
    return plan


def draw_adapter_faults(rng: random.Random, chaos: float, plan: FaultPlan) -> None:
    """How a worker of a base that serves adapters loads them (drawn after ``draw_plan``,
    only for such a worker: the plans of worlds without adapters stay as they were)."""
    plan.adapter_load = quantum(rng, 6)
    roll = rng.random()
    if roll < 0.1 * chaos:
        plan.adapter = "crash"
    elif roll < 0.2 * chaos:
        plan.adapter = "refuse"


class SimNet:
    """One seed's world: the loop, the bound sockets, every worker ever spawned."""

    def __init__(self, loop: VirtualTimeLoop, rng: random.Random, chaos: float,
                 memory_seed: int = 0) -> None:
        self.loop = loop
        self.rng = rng
        self.chaos = chaos
        self.bound: dict[str, SimSocket] = {}
        self.sockets: list[SimSocket] = []
        self.workers: list[SimWorker] = []
        self.log: list[str] = []
        self.memory_rng = random.Random(memory_seed)
        """The workers' resident sizes (a stream apart from the faults' draws)."""
        self.host_gib = 64.0
        """This host's memory (``host_memory``), as the world sets it."""
        self.on_step: Any = lambda worker: None
        """Told of each generation step a worker runs (the harness checks it)."""
        self.on_thaw: Any = lambda worker: None
        """Told of each worker thawed (``SimHandle.freeze(False)``)."""
        self._fds = FAKE_FD_BASE
        self._pids = 40000

    def later(self, delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        """``call_later``, then 0-4 more loop turns (drawn from the seed)."""
        return self.loop.call_later(delay, after_turns, self.loop, self.rng.randint(0, 4),
                                    callback, *args)

    def note(self, text: str) -> None:
        self.log.append(f"{self.loop.time() - 1000:7.2f} {text}")

    def new_fd(self) -> int:
        self._fds += 1
        return self._fds

    def new_pid(self) -> int:
        self._pids += 1
        return self._pids

    def alive(self) -> list[SimWorker]:
        return [w for w in self.workers if w.returncode is None]

    def host_memory(self) -> Any:
        """What ``psutil.virtual_memory`` would say: ``host_gib`` less what the live
        workers hold."""
        total = int(self.host_gib * GIB)
        held = sum(int(w.plan.resident_gib * GIB) for w in self.alive())
        return _VirtualMemory(total, max(0, total - held))


GIB = 1024 ** 3


@dataclass(frozen=True)
class _VirtualMemory:
    total: int
    available: int


class _Frame:
    __slots__ = ("buffer",)

    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)

    def __len__(self) -> int:
        return len(self.buffer)


class SimSocket:
    """The router's DEALER socket of one ``WorkerLink``."""

    def __init__(self, net: SimNet) -> None:
        self.net = net
        self.fd = net.new_fd()
        self.endpoint = ""
        self.inbox: deque[bytes] = deque()
        self.partial: list[bytes] = []
        self.peer: SimWorker | None = None
        self.closed = False
        net.sockets.append(self)

    def setsockopt(self, option: int, value: Any) -> None:
        pass

    def bind(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.net.bound[endpoint] = self

    def getsockopt_string(self, option: int) -> str:
        return self.endpoint

    def getsockopt(self, option: int) -> int:
        if option == zmq.FD:
            return self.fd
        if option == zmq.EVENTS:
            return (zmq.POLLIN if self.inbox else 0) | zmq.POLLOUT
        return 0

    def send(self, data: bytes, flags: int = 0) -> None:
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        peer = self.peer
        if peer is None or peer.returncode is not None:
            self.partial.clear()  # ZeroMQ drops a message whose peer went away
            raise zmq.Again()
        self.partial.append(bytes(data))
        if not flags & zmq.SNDMORE:
            frames, self.partial = self.partial, []
            self.net.loop.call_soon(peer.deliver, frames)

    def recv(self, flags: int = 0, copy: bool = True) -> _Frame:
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        if not self.inbox:
            raise zmq.Again()
        return _Frame(self.inbox.popleft())

    def push(self, frame: bytes) -> None:
        """A frame from the worker."""
        if self.closed:
            return
        self.inbox.append(frame)
        if len(self.inbox) == 1:
            self.net.loop.poke(self.fd)

    def close(self, linger: int | None = None) -> None:
        if not self.closed:
            self.closed = True
            self.inbox.clear()
            if self.net.bound.get(self.endpoint) is self:
                del self.net.bound[self.endpoint]


class SimContext:
    """Stands in for the supervisor's ``zmq.Context``."""

    def __init__(self, net: SimNet) -> None:
        self.net = net

    def socket(self, kind: int) -> SimSocket:
        return SimSocket(self.net)

    def destroy(self, linger: int | None = None) -> None:
        for sock in self.net.sockets:
            sock.close()

    def term(self) -> None:
        self.destroy()


class EnginePool:
    """The adapters in one engine, least recently used first: each loaded once however
    many ask at once, pinned ones never dropped, the rest past ``max_cpu_loras`` dropped."""

    def __init__(self, worker: SimWorker, size: int) -> None:
        self.worker = worker
        self.size = size
        self.loaded: dict[int, AdapterState] = {}
        self._loading: dict[int, asyncio.Task[None]] = {}
        self._loads: dict[int, int] = {}

    async def ensure(self, ref: LoraRef) -> None:
        """Load ``ref`` unless it is loaded; raises ``AdapterRefused`` if it cannot be."""
        if ref.number in self.loaded:
            self.loaded[ref.number] = self.loaded.pop(ref.number)  # most recently used
            return
        loading = self._loading.get(ref.number)
        if loading is None:  # one of the worker's tasks: its exit ends it
            loading = self._loading[ref.number] = asyncio.ensure_future(self._load(ref))
            self.worker.calls[loading] = None
            loading.add_done_callback(self._loaded)
        await asyncio.shield(loading)

    def _loaded(self, loading: asyncio.Task[None]) -> None:
        self.worker.calls.pop(loading, None)
        for number, task in list(self._loading.items()):
            if task is loading:
                del self._loading[number]
        if not loading.cancelled():
            loading.exception()  # retrieved: every request that waited for it may be gone

    async def _load(self, ref: LoraRef) -> None:
        plan = self.worker.plan
        await asyncio.sleep(plan.adapter_load)
        await self.worker._awake()
        if plan.adapter == "crash":  # its waiters are the worker's tasks: cancelled
            self.worker.exit(1, f"engine died loading adapter {ref.name}")
            return
        if plan.adapter == "refuse":
            raise AdapterRefused(f"adapter '{ref.name}': simulated refusal")
        self._loads[ref.number] = self._loads.get(ref.number, 0) + 1
        self.loaded[ref.number] = AdapterState(number=ref.number, name=ref.name,
                                               load_seconds=plan.adapter_load,
                                               pinned=ref.pinned,
                                               loads=self._loads[ref.number])
        for number, state in list(self.loaded.items()):
            if len(self.loaded) <= self.size:
                break
            if not state.pinned and number != ref.number:
                del self.loaded[number]


class AdapterRefused(Exception):
    pass


class SimWorker:
    """One worker process (see the module docstring)."""

    def __init__(self, net: SimNet, model: str, endpoint: str, plan: FaultPlan,
                 spec: ModelSpec, key: str | None = None) -> None:
        self.net = net
        self.model = model
        self.key = key or model
        """The name it goes by (``replica.replica_key``): its model's id for replica 0 (as
        every worker's was before replicas: their traces stay as they were), ``m#n`` for
        replica n."""
        self.number = int(self.key.rpartition("#")[2]) if "#" in self.key else 0
        self.endpoint = endpoint
        self.plan = plan
        self.pid = net.new_pid()
        self.returncode: int | None = None
        self.exited_at: float | None = None
        """When (virtual) it exited."""
        self.waiters: list[asyncio.Future[int | None]] = []
        self.sock: SimSocket | None = None
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.codec = worker_codec()
        self.generated = 0
        self.asleep = False
        self.paused = False
        """Its engine is parked (``Sleep`` answered, no ``Wake`` since): no step."""
        self.stepping = 0
        """Engine steps under way (a sleep answers once they have ended)."""
        self._sleep_turns: deque[Sleep | Wake] = deque()
        """``Sleep``s and ``Wake``s received, not yet taken up."""
        self._sleep_under_way: asyncio.Future[None] | None = None
        """A sleep waiting for a step to end: a ``Sleep`` or ``Wake`` after it waits."""
        self.level: int | None = None
        """The level of the ``Sleep`` it answered last, until a ``Wake`` (1, 2: a GPU
        model's park through vLLM's sleep mode; its processes are not frozen)."""
        self.frozen = False
        """Its processes are stopped (``SimHandle.freeze``): it does nothing at all."""
        self._go = asyncio.Event()
        """Set while it is neither ``paused`` nor ``frozen``: its steps may run."""
        self._go.set()
        self._thawed = asyncio.Event()
        self._thawed.set()
        self._held: list[tuple[Any, tuple[Any, ...]]] = []
        """What came while it was frozen (messages, its own timers), to run once thawed."""
        self.paused_gens: set[str] = set()
        """The ``Generate`` ids in flight when a park paused its engine."""
        self.ended: dict[str, str] = {}
        """How each ``Generate`` ended here: ``done``, ``error``, ``cancel``, ``exit``."""
        self.shutdown_seen = False
        self.pool = (EnginePool(self, spec.max_cpu_loras or 1)
                     if serves_adapters(spec) else None)
        self.received: dict[str, Generate] = {}
        """Every ``Generate`` this worker took, by id: the adapter it asked for."""
        self.calls: dict[asyncio.Task[None], None] = {}
        """Its adapter calls and loads in flight, in the order they began (a dict: a set's
        order is the tasks' addresses, and a seed's run would depend on memory)."""
        self._boot: asyncio.TimerHandle | None = net.later(plan.boot_delay, self._run,
                                                           self._booted)
        net.workers.append(self)
        net.note(f"{self.key}: worker {self.pid} spawned ({plan.brief()})")

    def _booted(self) -> None:
        self._boot = None
        if self.returncode is not None:
            return
        if self.plan.boot == "hang":
            return
        if self.plan.boot == "crash":
            self.exit(1, "crashed while booting")
            return
        self.sock = self.net.bound.get(self.endpoint)
        if self.sock is None:  # its router end is gone (a cancelled load): nobody to serve
            return
        self.sock.peer = self
        if self.plan.boot == "refuse":
            self._send(Error(id="", message="simulated engine start failure", status=503,
                             type="model_unavailable"))
            self.net.later(Q, self.exit, 1, "engine failed to start")
            return
        self._send(Ready(model=self.model, max_model_len=4096, pid=self.pid))

    def _send(self, message: msgspec.Struct) -> None:
        if self.frozen:  # what it was doing as it stopped ends once it continues
            self._held.append((self._send, (message,)))
            return
        if self.returncode is None and self.sock is not None and self.sock.peer is self:
            self.sock.push(self.codec.encode(message))

    def _run(self, callback: Any, *args: Any) -> None:
        """Run one of its own timers' callbacks, or, while it is frozen, once thawed."""
        if self.returncode is not None:
            return
        if self.frozen:
            self._held.append((callback, args))
            return
        callback(*args)

    def _later(self, delay: float, callback: Any, *args: Any) -> None:
        self.net.later(delay, self._run, callback, *args)

    def freeze(self, frozen: bool) -> None:
        """``SIGSTOP`` / ``SIGCONT``: what came meanwhile runs once it continues."""
        if frozen == self.frozen:
            return
        self.frozen = frozen
        self.net.note(f"{self.key}: worker {self.pid} {'frozen' if frozen else 'thawed'}")
        self._update()
        if not frozen:
            held, self._held = self._held, []
            for callback, args in held:
                self.net.loop.call_soon(self._run, callback, *args)

    def _update(self) -> None:
        if self.paused or self.frozen:
            self._go.clear()
        else:
            self._go.set()
        if self.frozen:
            self._thawed.clear()
        else:
            self._thawed.set()

    async def _running(self) -> None:
        """Until its engine may step: not paused, not frozen."""
        while not self._go.is_set():
            await self._go.wait()

    async def _awake(self) -> None:
        """Until its process runs (not frozen; a paused engine still answers)."""
        while not self._thawed.is_set():
            await self._thawed.wait()

    def deliver(self, frames: list[bytes]) -> None:
        """A message (one router turn's frames) arrives; a frozen one reads it later."""
        if self.returncode is not None:
            return
        if self.frozen:
            self._held.append((self.deliver, (frames,)))
            return
        for frame in frames:
            if frame:
                self._handle(self.codec.decode(frame))

    def _handle(self, message: object) -> None:
        loop = self.net.loop
        if isinstance(message, Generate):
            if message.id in self.tasks:
                self._send(Error(id=message.id, message="duplicate request id", status=400))
                return
            self.received[message.id] = message
            if self.paused:
                self.paused_gens.add(message.id)
            self.tasks[message.id] = loop.create_task(self._generate(message))
        elif isinstance(message, Adapters):
            call = loop.create_task(self._adapters(message))
            self.calls[call] = None
            call.add_done_callback(lambda done: self.calls.pop(done, None))
        elif isinstance(message, Cancel):
            task = self.tasks.pop(message.id, None)
            if task is not None:
                self.ended.setdefault(message.id, "cancel")
                task.cancel()
        elif isinstance(message, Ping):
            self._send(Pong(id=message.id, in_flight=len(self.tasks)))
        elif isinstance(message, (Sleep, Wake)):
            # In the order they came, as the worker's lock runs them (timers due at the
            # same moment may fire in any order): each timer takes the oldest.
            self._sleep_turns.append(message)
            self._later(self.plan.boot_delay / 2, self._next_sleep_turn)
        elif isinstance(message, Shutdown):
            self.shutdown_seen = True
            if self.plan.shutdown == "exit":
                self._later(self.plan.shutdown_delay, self.exit, 0, "shut down")

    def _next_sleep_turn(self) -> None:
        self._slept_or_woken(self._sleep_turns.popleft())

    def _slept_or_woken(self, message: Sleep | Wake) -> None:
        if isinstance(message, Sleep) and self.plan.sleep_fails:
            self._send(Error(id=message.id, message="simulated: sleep mode unavailable"))
            return
        if self._sleep_under_way is not None and not self._sleep_under_way.done():
            # the worker runs Sleep and Wake one at a time, in the order they came
            call = asyncio.ensure_future(self._after(self._sleep_under_way, message))
            self.calls[call] = None
            call.add_done_callback(lambda done: self.calls.pop(done, None))
            return
        if isinstance(message, Sleep) and message.level and self.stepping:
            # vLLM's sleep pauses between two steps: it answers once the step under way
            # has ended (a level-0 park's processes are frozen instead, which holds it)
            self.paused = True
            self._update()
            call = asyncio.ensure_future(self._after_steps(message))
            self._sleep_under_way = call
            self.calls[call] = None
            call.add_done_callback(lambda done: self.calls.pop(done, None))
            return
        self.asleep = isinstance(message, Sleep)
        if isinstance(message, Sleep):
            # vLLM's pause (level 0), or its sleep mode with ``mode="keep"`` (1, 2: a GPU
            # model's park, ``worker.engine``): between two steps, every request kept
            # (none gets a delta until ``Wake``)
            self.paused = True
            self.paused_gens |= set(self.tasks)
            self.level = message.level
        elif isinstance(message, Wake):
            self.paused = False
            self.level = None
        self._update()
        self._send(Pong(id=message.id, in_flight=len(self.tasks)))

    async def _after_steps(self, message: Sleep) -> None:
        while self.stepping:
            await asyncio.sleep(self.plan.step / 4)
        self._sleep_under_way = None
        self._slept_or_woken(message)

    async def _after(self, sleeping: asyncio.Future[None], message: Sleep | Wake) -> None:
        await asyncio.wait([sleeping])
        self._slept_or_woken(message)

    async def _adapters(self, message: Adapters) -> None:
        """``worker.engine``'s ``adapters_apply``: load, then unload; the pool after."""
        if self.pool is None:
            if message.load:
                self._send(Error(id=message.id, message=f"model '{self.model}' serves no "
                                 "adapters (set max_loras on it)", status=400,
                                 code="adapter_invalid"))
            else:
                self._send(AdapterStates(id=message.id))
            return
        try:
            for ref in message.load:
                await self.pool.ensure(ref)
        except AdapterRefused as err:
            self._send(Error(id=message.id, message=str(err), status=400,
                             code="adapter_invalid"))
            return
        for number in message.unload:
            self.pool.loaded.pop(number, None)
        self._send(AdapterStates(id=message.id, loaded=list(self.pool.loaded.values())))

    async def _generate(self, gen: Generate) -> None:
        try:
            if gen.lora is not None:
                try:
                    if self.pool is None:  # as ``worker.engine`` answers it
                        raise AdapterRefused(f"model '{self.model}' serves no adapters")
                    await self.pool.ensure(gen.lora)
                except AdapterRefused as err:
                    self.ended[gen.id] = "error"
                    self._send(Error(id=gen.id, message=str(err), status=400,
                                     code="adapter_invalid"))
                    return
            self.generated += 1
            tokens = max(1, gen.sampling.max_tokens or 1)
            fails = (self.plan.engine_error_every
                     and self.generated % self.plan.engine_error_every == 0)
            for i in range(tokens):
                await self._running()  # a paused engine takes no step
                self.stepping += 1
                try:
                    await asyncio.sleep(self.plan.step)
                    await self._awake()  # a step under way when frozen ends once thawed
                    self.net.on_step(self)
                finally:
                    self.stepping -= 1
                if fails and i == tokens // 2:
                    self.ended[gen.id] = "error"
                    self._send(Error(id=gen.id, message="simulated engine error", status=500))
                    return
                last = i == tokens - 1
                self._send(Deltas(items=[Delta(
                    id=gen.id, text="x", tokens=1, finish_reason="length" if last else None,
                    prompt_tokens=3 if i == 0 or last else 0)]))
            self.ended[gen.id] = "done"
        finally:
            if self.tasks.get(gen.id) is asyncio.current_task():
                del self.tasks[gen.id]

    def exit(self, code: int, why: str = "") -> None:
        if self.returncode is not None:
            return
        self.returncode = code
        self.exited_at = self.net.loop.time()
        self.net.note(f"{self.key}: worker {self.pid} exited {code} ({why})"
                      + (" while frozen" if self.frozen else ""))
        self._held.clear()
        for gen_id in self.tasks:
            self.ended.setdefault(gen_id, "exit")
        if self._boot is not None:
            self._boot.cancel()
        for task in [*self.tasks.values(), *self.calls]:
            task.cancel()
        self.tasks.clear()
        if self.sock is not None and self.sock.peer is self:
            self.sock.peer = None
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(code)
        self.waiters.clear()


class SimHandle(WorkerHandle):
    def __init__(self, worker: SimWorker, log_path: Path, started_at: float) -> None:
        self.worker = worker
        self.pid = worker.pid
        self.node = "sim"
        self.log_path = log_path
        self.started_at = started_at

    @property
    def returncode(self) -> int | None:
        return self.worker.returncode

    async def wait(self) -> int | None:
        if self.worker.returncode is not None:
            return self.worker.returncode
        waiter: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self.worker.waiters.append(waiter)  # one per caller: a cancelled caller cancels its own
        return await waiter

    async def kill(self) -> None:
        self.worker.exit(-9, "killed")  # SIGKILL ends a stopped process too

    def freeze(self, frozen: bool) -> bool:
        if self.worker.returncode is not None:
            return False
        if not frozen and self.worker.frozen:
            self.worker.net.on_thaw(self.worker)
        self.worker.freeze(frozen)
        return True

    def resident_bytes(self) -> int:
        return int(self.worker.plan.resident_gib * GIB) if self.worker.returncode is None else 0


class SimBackend(Backend):
    """Starts ``SimWorker``s; replaces the supervisor's ``local`` backend."""

    name = "local"

    def __init__(self, net: SimNet) -> None:
        self.net = net
        self._keys: dict[str, str] = {}
        """The key each model's next worker is placed under (``place``), for its ``spawn``."""

    def place(self, spec: ModelSpec, placer: Placer, key: str) -> dict[str, str]:
        """As ``Backend.place``; the replica's key is kept for the ``spawn`` that follows
        (the supervisor calls the two with no await between: a worker's name in the
        trace is its replica's key)."""
        self._keys[spec.id] = key
        return super().place(spec, placer, key)

    def endpoint(self, runtime_dir: Path, number: int) -> str:
        return f"ipc://{runtime_dir}/sim{number}.sock"

    async def spawn(self, spec: ModelSpec, boot_for: BootFor, log_path: Path,
                    env: dict[str, str], siblings: Sequence[WorkerHandle] = ()
                    ) -> WorkerHandle:
        key = self._keys.pop(spec.id, spec.id)
        plan = draw_plan(self.net.rng, self.net.chaos)
        plan.resident_gib = self.net.memory_rng.choice([0.5, 1.0, 1.5, 2.0, 3.0])
        if plan.spawn_delay:
            await asyncio.sleep(plan.spawn_delay)
        if plan.spawn_error:
            self.net.note(f"{key}: spawn fails")
            raise SpawnError("simulated: the process could not start")
        boot = msgspec.json.decode(boot_for(""), type=WorkerBoot)
        if serves_adapters(spec):
            draw_adapter_faults(self.net.rng, self.net.chaos, plan)
        worker = SimWorker(self.net, spec.id, boot.endpoint, plan, boot.spec, key)
        return SimHandle(worker, log_path, self.net.loop.time())
