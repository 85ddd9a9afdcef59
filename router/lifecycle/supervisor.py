"""``Supervisor``: starts, watches, reaps, evicts and stops worker processes; never HTTP.

A request ``acquire``s a model: the name is resolved and a ``Lease`` taken before any
``await``, so the reaper and the evictor (which skip leased models) can never stop a model
between a request's resolution and its last byte. If the model is not running, one load
task per model starts it and every waiting request shares it; a waiter that times out
does not cancel a load others still wait for.

Lifecycle: ``unloaded → loading → ready ⇄ sleeping → stopping → unloaded``, ``ready →
parking → parked → waking → ready`` (``router.lifecycle.parking``), and ``failed`` (exit
code and log tail kept) after a crash or a failed start. A request to a
``failed`` model starts it again, after an exponential backoff while failures repeat.

Who gets room and who idles is policy (``router.lifecycle.policy``: plain functions, no awaits);
the supervisor owns the executors that act on it, ``RoomMaker`` (park, evict, yield),
``Parker`` (park, wake) and ``IdleReaper`` (stop, sleep, wake), and each model's running
workers, its ``ReplicaSet`` (``replicas_of``, ``worker_of``: one replica per model for
now).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import msgspec
import zmq

from router.errors import (
    APIError,
    BadRequest,
    ModelNotFound,
    ModelUnavailable,
    TooManyRequests,
    WorkerLost,
)
from router.lifecycle.idle_reaper import IdleReaper
from router.lifecycle.parking import Parker
from router.lifecycle.policy import room
from router.lifecycle.policy.park import RESIDENT_STATES
from router.lifecycle.policy.scale import backoff_seconds, scales
from router.lifecycle.replica import Replica, ReplicaSet, link_of, ready_link, replica_key
from router.lifecycle.room_maker import RoomMaker
from router.lifecycle.routing import Routes
from router.lifecycle.scaler import Scaler
from router.observe.events import EventBus
from router.registry import Lease, ModelEntry, ModelRegistry
from router.workers.backends import Backend, SpawnError
from router.workers.backends.local import LocalBackend, LocalHandle
from router.workers.backends.ray_cluster import RayBackend
from router.workers.link import WorkerLink
from router.workers.placement import Placer, fits, replica_spec, runs_beside
from router.workers.processes import engine_phases, log_tail
from router.workers.spares import SparePool
from router.workers.worker_start import base_env, model_env, worker_boot, worker_command
from shared.config import SERVED_BY, TASK_NAMES, ModelSpec, ServerConfig, restart_needed
from shared.protocol import Generate, Ready

log = logging.getLogger("modelyard.router")
_generation = itertools.count(1)
POLL = 0.05  # seconds between looks at state that has no event of its own


class Supervisor:
    """The one executor of the models' lifecycle: asks policy (``router.lifecycle.policy``), then
    spawns, stops, sleeps and wakes workers through a backend (module docstring)."""

    def __init__(self, registry: ModelRegistry, server: ServerConfig, runtime_dir: Path,
                 placer: Placer | None = None, events: EventBus | None = None) -> None:
        self.registry = registry
        self.events = events or EventBus()
        self._published: dict[str, tuple[str, int | None]] = {}
        self.server = server
        self.runtime_dir = runtime_dir
        self.placer = placer or Placer()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._replicas: dict[str, ReplicaSet] = {}
        """Each model's running replicas (``replicas_of``), by model id: a model with
        none has no set here."""
        self._loads: dict[str, asyncio.Task[WorkerLink]] = {}
        self._stops: dict[str, asyncio.Task[None]] = {}
        """Each model's one stop under way (``stopping``)."""
        self._reaper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._removed: set[ModelEntry] = set()
        """Models a reload removed whose workers still drain."""
        self._closing = False
        self.rooms = RoomMaker(registry, self._removed, server, self.placer, self.events,
                               self.worker_of, self.stop, POLL,
                               lambda victim, why, level: self.parker.park(victim, why,
                                                                           level))
        self.parker = Parker(self.events, self.worker_of, self._publish_state, self.stopping,
                             self.rooms.make, self._spawn_task)
        self.idler = IdleReaper(registry, server, POLL, self._publish_state, self.stopping,
                                self._spawn_task, self.replicas_of)
        self.scaler = Scaler(registry, self.replicas_of, self.add_replica, self.retire_replica,
                             self.replica_room, self.stopping)
        self._scaling: asyncio.Task[None] | None = None
        self.routes = Routes()
        """Where requests to a model of several replicas go (``route``), and its memory."""
        self.spares = SparePool(server.spare_workers, registry, runtime_dir,
                                worker_command(server, spare=True), base_env, self._spawn_task,
                                self._spares_may_import, server.fork_spares)
        self.backends: dict[str, Backend] = {
            "local": LocalBackend(self.spares, lambda: worker_command(server), base_env)}
        if any(entry.spec.backend == "ray" for entry in registry):
            self.backends["ray"] = RayBackend(server.ray_address, worker_command(server)[3:],
                                              server.load_timeout)

    def _spares_may_import(self) -> bool:
        """A spare imports while no model streams, or while a load waits (for it)."""
        return bool(self._loads) or not any(
            e.busy for e in self.registry)

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._background.discard)

    # -- workers: a model's replicas (at most one each for now: ``ReplicaSet``) ---------
    def replicas_of(self, entry: ModelEntry) -> ReplicaSet:
        """``entry``'s running replicas (an empty set if it runs none)."""
        return self._replicas.get(entry.id) or ReplicaSet(entry.id)

    def worker_of(self, entry: ModelEntry) -> Replica | None:
        """``entry``'s running worker, if it has one (its first replica)."""
        replicas = self._replicas.get(entry.id)
        return replicas.first() if replicas is not None else None

    def running(self) -> dict[str, Replica]:
        """Every running replica, by its key (replica 0's: its model's id)."""
        return {r.key: r for replicas in self._replicas.values() for r in replicas}

    def add_worker(self, entry: ModelEntry, worker: Replica) -> None:
        replicas = self._replicas.setdefault(entry.id, ReplicaSet(entry.id))
        replicas.add(worker)
        entry.replica_count = len(replicas)

    def remove_worker(self, entry: ModelEntry, worker: Replica) -> None:
        """Forget ``worker`` (a newer one of ``entry``'s stays)."""
        replicas = self._replicas.get(entry.id)
        if replicas is not None and replicas.remove(worker):
            entry.replica_count = len(replicas)
            if not replicas:
                del self._replicas[entry.id]
                self.routes.drop(entry.id)  # no engine of it runs: nor do their caches

    def _publish_state(self, entry: ModelEntry, reason: str | None = None) -> None:
        """Tell the event bus of ``entry``'s state, if it changed since last told."""
        now = (entry.state, entry.pid)
        if self._published.get(entry.id) == now:
            return
        self._published[entry.id] = now
        failed = entry.state == "failed"
        self.events.publish("state", entry.id, state=entry.state, pid=entry.pid,
                            node=entry.node, placement=entry.placement or None,
                            **({"reason": reason} if reason else {}),
                            **({"error": entry.error, "exit_code": entry.exit_code}
                               if failed else {}))

    def log_path(self, entry: ModelEntry, number: int = 0) -> Path:
        """The model's worker log, replica ``number``'s (every start appends to it; it may
        not exist yet): ``<id>.log`` for the first, ``<id>.<n>.log`` for the others."""
        name = re.sub(r'[^A-Za-z0-9_.-]', '_', entry.id)[:100]
        return self.runtime_dir / (f"{name}.{number}.log" if number else f"{name}.log")

    def start(self) -> None:
        """Begin idle reaping and start the ``load_on_startup`` models."""
        ray = self.backends.get("ray")
        if isinstance(ray, RayBackend):
            ray.connect()  # blocks ~2 s, once, before the router serves
        self._reaper = asyncio.create_task(self.idler.run(), name="reaper")
        if any(scales(e.spec.replicas) for e in self.registry):
            self._scale()
        self.spares.replenish()  # first: a load_on_startup model takes it as it is
        for entry in self.startup_models():
            self.start_loading(entry)

    def _scale(self) -> None:
        """Run the scaler from now on (once a model may have other than one replica: at
        start, or when a model a reload gave ``replicas`` is ready)."""
        if self._scaling is None and not self._closing:
            self._scaling = asyncio.create_task(self.scaler.run(), name="scaler")

    def startup_models(self) -> list[ModelEntry]:
        """The models started with the router: ``load_on_startup`` ones and ``preload``
        (an adapter there: its base)."""
        preload = {self.registry.serving(self.registry.named(name)).id
                   for name in self.server.preload}
        return [e for e in self.registry if e.spec.load_on_startup or e.id in preload]

    # -- requests ----------------------------------------------------------------------
    async def acquire(self, name: str | None, task: str = "any", batch: bool = False
                      ) -> tuple[Lease, WorkerLink]:
        """Resolve ``name``, lease the model and make sure its worker is ready.

        ``task`` (``generate``, ``embed``, ``score``: ``SERVED_BY``) must be what the
        model's preset serves, so a request for the wrong kind of model is refused
        without loading it. A ``batch`` line's lease waits for a slot behind every other
        request (``Slots``) and is no one's demand (``Lease``).
        """
        now = self.acquire_now(name, task, batch)
        if isinstance(now, tuple):
            return now
        named = self.registry.resolve(name)  # an adapter's name: its base is ``now``
        if now.yield_to is not None:  # it makes room for another: wait, unleased
            try:
                async with asyncio.timeout(self.server.load_timeout):
                    while now.yield_to is not None:
                        await asyncio.sleep(POLL)
            except TimeoutError:
                raise ModelUnavailable(f"model '{now.id}' was making room for another model "
                                       f"for {self.server.load_timeout:g} s") from None
        # before any await: from here on nothing reaps this model
        lease = Lease(now, named if named is not now else None, batch)
        try:
            await self._take_slot(lease)
            return lease, await self.ensure_ready(now, batch)
        except BaseException:
            lease.release()
            raise

    def acquire_now(self, name: str | None, task: str = "any",
                    batch: bool = False) -> tuple[Lease, WorkerLink] | ModelEntry:
        """``acquire`` without waiting: the lease and link of a ready model with a free
        slot, else the resolved entry for ``acquire`` to wait on."""
        named = self.registry.resolve(name)
        entry = self.registry.serving(named)  # an adapter is served by its base's worker
        if task != "any" and entry.spec.task != task and entry.spec.task not in SERVED_BY[task]:
            what = TASK_NAMES[entry.spec.task]  # an adapter's task is its base's
            if named is not entry:
                what = f"a LoRA adapter of '{entry.id}', {what}"
            raise BadRequest(f"model '{named.id}' is {what}; it cannot serve this endpoint",
                             param="model", code="wrong_model_task")
        slots, link = entry.slots, link_of(entry)
        if (entry.state == "ready" and link is not None and entry.yield_to is None
                and (slots is None or slots.try_take(batch))):
            lease = Lease(entry, named if named is not entry else None, batch)
            lease.slot = slots
            return lease, link
        return entry

    async def _take_slot(self, lease: Lease) -> None:
        """One of the model's ``max_concurrent`` slots; wait in its queue for one."""
        entry, slots = lease.entry, lease.entry.slots
        if slots is None or slots.try_take(lease.batch):
            lease.slot = slots
            return
        if not lease.batch and entry.queued >= self.server.max_queue_depth:
            raise TooManyRequests(f"model '{entry.id}' serves {entry.spec.max_concurrent} "
                                  f"requests and {entry.queued} more wait; retry later")
        queued = not lease.batch  # batch lines: bounded by their runner, not the queue
        entry.queued += queued
        try:
            # A cancel (a client gone) always lands here as CancelledError, and ``take``
            # passes on a slot it was handed meanwhile: nothing is kept by nobody.
            async with asyncio.timeout(self.server.load_timeout):
                await slots.take(later=lease.batch)
        except TimeoutError:
            raise ModelUnavailable(f"model '{entry.id}' had no free slot within "
                                   f"{self.server.load_timeout:g} s") from None
        finally:
            entry.queued -= queued
        lease.slot = slots  # no await since ``take``: the lease gives it back from here

    async def ensure_ready(self, entry: ModelEntry, batch: bool = False) -> WorkerLink:
        """Wait (bounded) until ``entry`` serves: load it, wake it, or find it room
        (``batch``: for a batch line, ``start_loading``)."""
        if (link := ready_link(entry)) is not None:
            return link
        if entry.queued >= self.server.max_queue_depth:
            raise TooManyRequests(f"{entry.queued} requests already wait for model "
                                  f"'{entry.id}'; retry later")
        entry.queued += 1
        try:
            # ``asyncio.timeout``, not ``wait_for``: on 3.11 ``wait_for`` returns a result
            # that arrives in the turn it is cancelled, and the cancel is lost.
            async with asyncio.timeout(self.server.load_timeout):
                if entry.state == "sleeping":
                    await asyncio.shield(self.idler.wake(entry))
                    if (link := ready_link(entry)) is not None:
                        return link
                task = self.start_loading(entry, batch)
                try:
                    return await asyncio.shield(task)
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if task.cancelled() and not (current and current.cancelling()):
                        # the shared load was cancelled (an unload), not this request
                        raise ModelUnavailable(f"model '{entry.id}' was unloaded while it "
                                               "was loading") from None
                    raise
        except TimeoutError:
            raise ModelUnavailable(f"model '{entry.id}' did not become ready within "
                                   f"{self.server.load_timeout:g} s") from None
        finally:
            entry.queued -= 1

    def start_loading(self, entry: ModelEntry,
                      batch: bool = False) -> asyncio.Task[WorkerLink]:
        """The model's one load task, started now if none is running. ``batch``: asked
        for by a batch line; a load only batch lines asked for takes only room no person
        uses (``ModelEntry.batch_load``)."""
        if entry.removed:
            raise ModelNotFound(f"The model '{entry.id}' was removed from the configuration",
                                param="model")
        task = self._loads.get(entry.id)
        if task is None:
            entry.batch_load = batch
            task = asyncio.create_task(self._load(entry), name=f"load-{entry.id}")
            self._loads[entry.id] = task
            task.add_done_callback(self._load_done)
        elif not batch:
            entry.batch_load = False  # someone else waits for it too
        return task

    def _load_done(self, task: asyncio.Task[WorkerLink]) -> None:
        for model_id, running in list(self._loads.items()):
            if running is task:
                del self._loads[model_id]
                self._keep_up(self.registry.entries.get(model_id))
        if not task.cancelled():
            task.exception()  # retrieved here: a load nobody awaits still ends quietly

    def _keep_up(self, entry: ModelEntry | None) -> None:
        """A start-up model that failed to start or crashed is started again (after the
        backoff, which its load waits): a router taken out of rotation gets no request
        that would restart it, and its readiness probe starts nothing."""
        if (entry is not None and entry.state == "failed" and not self._closing
                and not entry.removed and entry in self.startup_models()):
            self.start_loading(entry)

    # -- starting ----------------------------------------------------------------------
    async def _load(self, entry: ModelEntry) -> WorkerLink:
        if entry.state in RESIDENT_STATES:  # resident: its wake is enough
            wake = self.parker.wake(entry)
            try:
                await asyncio.shield(wake)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not wake.cancelled() or (current is not None and current.cancelling()):
                    raise
                # The wake was ended (a crash, a stop, a reload's restart), not this load:
                # its waiters wait for that to finish, then start the model again.
            if (link := ready_link(entry)) is not None:
                return link
        # A request during a stop, or while a crashed worker is reaped, waits, then restarts.
        while entry.state == "stopping" or (entry.state != "ready"
                                            and self.worker_of(entry) is not None):
            await asyncio.sleep(POLL)
        if (link := ready_link(entry)) is not None:
            return link
        delay = backoff_seconds(entry.failures) - (time.monotonic() - entry.failed_at)
        if delay > 0:
            log.info("model %s: restart backoff %.1f s after %d failure(s)", entry.id,
                     delay, entry.failures)
            await asyncio.sleep(delay)
        if entry.removed:  # a reload took it out while this load waited: it never loads again
            raise ModelNotFound(f"The model '{entry.id}' was removed from the configuration",
                                param="model")
        try:
            await self.rooms.make(entry)
            entry.restarts += entry.state == "failed"  # a start after a crash or failed start
            # No await between finding room and claiming it: two loads cannot both fit.
            entry.state, entry.error, entry.exit_code = "loading", None, None
            entry.load_started = 0.0  # the spawn, after the start locks, sets it
            entry.keep_alive = None  # a request's keep_alive was its last worker's (Ollama's)
            self._publish_state(entry)
            async with contextlib.AsyncExitStack() as held:
                for lock in self.placer.start_locks(entry.spec):
                    await held.enter_async_context(lock)  # each one held is let go
                return await self._spawn(entry)
        except asyncio.CancelledError:
            if entry.state == "loading":
                entry.state = "unloaded"
                self._publish_state(entry, "load cancelled")
            raise

    async def _spawn(self, entry: ModelEntry, number: int = 0, extra: bool = False
                     ) -> WorkerLink:
        """Start replica ``number`` of ``entry`` and wait until it serves. The model's load
        starts its first (``extra`` false: the model's state, timings and failures are
        this start's); an ``extra`` one joins a model that already serves (``add_replica``)
        and touches only its own record: its failure is logged, not the model's."""
        started, started_wall = time.monotonic(), time.time()
        if not extra:
            entry.load_started = started
        spec = entry.spec  # what this worker serves, whatever a reload makes of the entry
        backend = self.backends[spec.backend or "local"]
        own = replica_spec(spec, number, spec.replicas.max, self.placer.cores)
        key = replica_key(entry.id, number)
        log_path = self.log_path(entry, number)
        offset = log_path.stat().st_size if log_path.exists() else 0
        link: WorkerLink | None = None
        try:
            link = WorkerLink(self._ctx, backend.endpoint(self.runtime_dir, next(_generation)),
                              entry.id)
            placement = backend.place(own, self.placer, key)
            if not extra:
                entry.placement = placement
            bound = link
            siblings = [r.handle for r in self.replicas_of(entry) if r.number != number]
            handle = await backend.spawn(
                own, lambda own_log: worker_boot(own, placement, self.placer, bound, own_log),
                log_path, model_env(own, placement), siblings)  # (Ray: placed by them)
        except asyncio.CancelledError:  # an unload while the process started
            if link is not None:
                link.close("load cancelled")
            self.placer.release(key)
            raise  # _load marks the model unloaded
        except (OSError, ValueError, zmq.ZMQError, SpawnError) as err:  # nothing started
            reason = f"could not start its worker: {type(err).__name__}: {err}"
            if link is not None:
                link.close(reason)
            self.placer.release(key)
            if extra:
                self._replica_failed(entry, number, reason)
            else:
                self._failed(entry, reason, "", None)
                log.error("model %s: %s", entry.id, reason)
            raise ModelUnavailable(f"model '{entry.id}' {reason}") from None
        spare = handle.from_spare
        log.info("model %s: %sworker pid %d on %s starting%s (%s)", entry.id,
                 f"replica {number}: " if number else "", handle.pid, handle.node,
                 " from a spare" if spare else "",
                 " ".join(f"{k}={v}" for k, v in placement.items()))
        worker = Replica(handle, link, spec=spec, number=number)
        worker.placement = placement
        self.add_worker(entry, worker)
        if not extra:
            entry.pid, entry.node = handle.pid, handle.node
            self._publish_state(entry)
        self._publish_replica(entry, worker)
        exited = asyncio.create_task(handle.wait())
        ready = asyncio.create_task(self._serving(entry, link))
        try:
            # Bounded: a hung engine start must not hold the start lock (and its GPUs).
            await asyncio.wait({exited, ready}, timeout=self.server.load_timeout,
                               return_when=asyncio.FIRST_COMPLETED)
            started_ok = ready.done() and not ready.cancelled() and ready.exception() is None
            # The engine logged its own timings before it was ready: part of the load's
            # answer, there when the load returns.
            if started_ok:
                await handle.sync_log()
            found = (await asyncio.to_thread(engine_phases, worker.log_path, offset)
                     if started_ok else {})
        except asyncio.CancelledError:
            exited.cancel()
            ready.cancel()
            await self._reap(entry, worker, "load cancelled")
            raise
        if started_ok:
            exited.cancel()
            info = ready.result()
            worker.state, worker.last_used = "ready", time.monotonic()
            if extra:
                self._size_slots(entry)
                self._publish_replica(entry, worker)
                log.info("model %s: replica %d ready in %.1f s (pid %d)", entry.id, number,
                         worker.last_used - started, handle.pid)
            else:
                entry.state, entry.replica = "ready", worker
                for served in (entry, *self.registry.adapters_of(entry)):
                    served.max_model_len = info.max_model_len
                    served.max_prompt_chars = info.max_prompt_chars
                entry.loaded_at = time.time()
                entry.last_used = entry.turn_at = worker.last_used
                entry.load_seconds = round(entry.last_used - started, 3)
                entry.loads += 1
                phases = ({("spare" if spare else "spawn"):
                           round(max(0.0, info.booted_at - started_wall), 3)}
                          if info.booted_at else {})
                entry.load_phases = {**phases, **info.phases, **found}
                self._publish_state(entry)
                self._publish_replica(entry, worker)
            handle.note_children()
            worker.watcher = asyncio.create_task(self._watch(entry, worker))
            if not extra:
                self.parker.measure(entry)  # what a park of it would hold
                self._log_ready(entry, worker)
                if scales(entry.spec.replicas):
                    self._scale()
                self.scaler.fill(entry)  # the replicas its ``replicas.min`` asks for
            if isinstance(handle, LocalHandle):
                self.spares.worker_ready()  # this host can start workers (again)
            self.spares.replenish()  # the spare's place, now the start no longer needs the CPU
            return link
        ready.cancel()
        exited.cancel()
        failure = (ready.exception() if ready.done() and not ready.cancelled() else None)
        code = handle.returncode
        reason = (str(failure) if failure else
                  f"worker exited with code {code}" if code is not None
                  else f"worker exited: {handle.lost}" if handle.lost
                  else f"worker did not become ready within {self.server.load_timeout:g} s")
        await self._reap(entry, worker, reason)
        tail = await asyncio.to_thread(log_tail, log_path)
        if extra:
            self._replica_failed(entry, number, f"{reason}\n{tail}".strip())
            raise ModelUnavailable(f"model '{entry.id}': replica {number} failed to start: "
                                   f"{reason}")
        self._failed(entry, reason, tail, handle.returncode)  # after the reap: it has one
        log.error("model %s: failed to start: %s", entry.id, entry.error)
        raise ModelUnavailable(f"model '{entry.id}' failed to start: {reason}")

    async def _serving(self, entry: ModelEntry, link: WorkerLink) -> Ready:
        """The worker's ``Ready``, once its base's adapters are back in its engine: until
        then the load is not done, so a worker that dies or hangs while they load fails
        the load (within ``load_timeout``) as one that dies before ``Ready`` does."""
        info = await link.wait_ready()
        await self._restore_adapters(entry, link)
        return info

    async def _restore_adapters(self, entry: ModelEntry, link: WorkerLink) -> None:
        """A base's pinned adapters, and those its last worker served (the most recently
        used, as many as its engine keeps), loaded before it serves: a restart (crash,
        reload) keeps their first requests as fast as before. One that no longer loads
        is left out: its requests get the reason."""
        adapters = self.registry.adapters_of(entry)
        used = sorted((a for a in adapters if a.last_used and not a.spec.pinned),
                      key=lambda a: a.last_used, reverse=True)
        keep = [a for a in adapters if a.spec.pinned] + used
        for adapter in keep[: entry.spec.max_cpu_loras or 0]:
            assert adapter.lora is not None
            try:
                entry.adapters_loaded = await link.adapters([adapter.lora])
            except APIError as err:
                log.warning("model %s: adapter %s not restored: %s", entry.id, adapter.id,
                            err.message)

    def _log_ready(self, entry: ModelEntry, worker: Replica) -> None:
        """Publish and log a finished load with its phases."""
        self.events.publish("load", entry.id, load_seconds=entry.load_seconds,
                            load_phases=entry.load_phases, pid=worker.handle.pid)
        log.info("model %s: ready in %.1f s (pid %d): %s", entry.id, entry.load_seconds or 0,
                 worker.handle.pid, ", ".join(f"{k} {v:.2f} s"
                                            for k, v in entry.load_phases.items()))

    def _failed(self, entry: ModelEntry, reason: str, tail: str, code: int | None,
                served: bool = False) -> None:
        """Record a failed start or a crash. A worker that completed a request was
        healthy, so its crash starts a new streak instead of lengthening the backoff."""
        if served:
            entry.failures = 0
        entry.failures += 1
        entry.failed_at = time.monotonic()
        entry.state, entry.exit_code = "failed", code
        entry.error = f"{reason}\n{tail}".strip()
        self._publish_state(entry, reason)

    async def _watch(self, entry: ModelEntry, worker: Replica) -> None:
        code = await worker.gone()
        if worker not in self.replicas_of(entry):
            return
        reason = (f"worker exited unexpectedly with code {code}" if code is not None
                  else f"worker exited unexpectedly: {worker.handle.lost}" if worker.handle.lost
                  else "worker exited unexpectedly: its link to the router dropped (no "
                       "heartbeat; its node may be gone)")
        worker.link.fail(WorkerLost(f"model '{entry.id}': {reason}"))  # streams end now
        if worker.state == "draining":
            return  # ``retire_replica`` owns the rest: its drain ends at once
        others = [r for r in self.replicas_of(entry) if r is not worker and r.serving]
        if entry.state in ("ready", "sleeping") and others:
            # One replica of several: the model serves on, its requests go to the others
            # from now on (before any await), and the scaler starts it again (a sleeping
            # model's once it is woken: failed, its others would run on unowned, and
            # every load would wait for them to go).
            log.error("model %s: replica %d: %s", entry.id, worker.number, reason)
            worker.state = "draining"
            self._replica_failed(entry, worker.number, reason, code,
                                 served=worker.link.completed > 0)
            await self._reap(entry, worker, reason)
            return
        self.parker.cancel(entry)  # a wake under way parks no one for it any more
        if entry.state == "stopping":
            return  # stop() owns the rest; with its streams ended, its drain ends at once
        log.error("model %s: %s", entry.id, reason)
        # Recorded before any await: a request arriving meanwhile sees 'failed' and starts
        # a reload, which waits for this reap and is not overwritten by it.
        self._failed(entry, reason, "", code, served=worker.link.completed > 0)
        entry.replica = None
        self.scaler.cancel(entry)  # replicas still starting go with it
        await self._reap(entry, worker, reason)
        tail = await asyncio.to_thread(log_tail, worker.log_path)
        if entry.state == "failed" and entry.exit_code == code:
            entry.error = f"{reason}\n{tail}".strip()
        self._keep_up(entry)

    async def _reap(self, entry: ModelEntry, worker: Replica, reason: str) -> None:
        """Make sure the worker and its children are gone; forget them."""
        if worker.state != "starting":
            worker.state = "draining"  # routed nothing more, whatever follows
        await worker.handle.kill()
        worker.link.close(reason)
        self.remove_worker(entry, worker)
        self.placer.release(worker.key)
        self.routes.forget(entry.id, worker.number)  # its engine's cache is gone with it
        self._hand_over(entry, worker)
        self._publish_replica(entry, worker, gone=True)

    def _hand_over(self, entry: ModelEntry, worker: Replica) -> None:
        """``worker`` serves no more (drains or is gone): the model is named by its
        lowest-numbered replica that serves (``ModelEntry.replica``, and the pid, node
        and placement shown), or by none, and its slots are those of the ones left."""
        if entry.replica is worker:
            serving = self.replicas_of(entry).serving()
            entry.replica = serving[0] if serving else None
        if entry.pid == worker.handle.pid:
            first = entry.replica
            if isinstance(first, Replica):
                entry.pid, entry.node = first.handle.pid, first.handle.node
                entry.placement = first.placement
            else:
                entry.pid = entry.node = None
        self._size_slots(entry)

    def _size_slots(self, entry: ModelEntry) -> None:
        """``max_concurrent`` is each replica's: the model's slots are that times the
        replicas that serve (at least one's: a model loading has its first's)."""
        if entry.slots is not None and entry.spec.max_concurrent:
            serving = len(self.replicas_of(entry).serving())
            entry.slots.resize(entry.spec.max_concurrent * max(1, serving))

    def _replica_failed(self, entry: ModelEntry, number: int, reason: str,
                        code: int | None = None, served: bool = False) -> None:
        """A replica that is not the model's last failed to start or crashed: the model
        serves on; the event and the log say why, and the scaler backs off before it
        starts one again (``served``: it had completed requests, a new streak)."""
        entry.replica_failures += 1
        self.scaler.failed(entry, served)
        self.events.publish("replica", entry.id, replica=number, state="failed",
                            error=reason, exit_code=code)
        log.error("model %s: replica %d failed: %s", entry.id, number, reason)

    def _publish_replica(self, entry: ModelEntry, worker: Replica, gone: bool = False) -> None:
        """Tell the event bus of a replica's state (models of several replicas only: a
        model of one has its ``state`` events, as before replicas)."""
        if entry.spec.replicas.max > 1:
            self.events.publish("replica", entry.id, replica=worker.number,
                                state="stopped" if gone else worker.state,
                                pid=worker.handle.pid, node=worker.handle.node,
                                placement=worker.placement or None)

    # -- replicas: more than one worker of a model --------------------------------------
    async def add_replica(self, entry: ModelEntry, number: int) -> None:
        """Start replica ``number`` of a model that serves (the scaler's ``add``), on its
        own share of the model's cores or GPUs; returns once it serves."""
        own = replica_spec(entry.spec, number, entry.spec.replicas.max, self.placer.cores)
        async with contextlib.AsyncExitStack() as held:
            for lock in self.placer.start_locks(own):
                await held.enter_async_context(lock)
            # Not stopped or crashed while it waited, and not to restart: a reload changed
            # replicas.max (the cores are cut anew) while the first replica loaded.
            if entry.state == "ready" and not self._outdated(entry):
                await self._spawn(entry, number, extra=True)

    def _outdated(self, entry: ModelEntry) -> bool:
        """``entry``'s running worker was started with a spec the current one cannot be
        served by (a reload changed it): it restarts."""
        worker = self.worker_of(entry)
        return worker is not None and (worker.spec is None
                                       or restart_needed(worker.spec, entry.spec))

    async def retire_replica(self, entry: ModelEntry, worker: Replica) -> None:
        """Drain ``worker`` (no new request goes to it from now: no await before) and
        stop it once its last request is done (or ``drain_timeout`` passed)."""
        if worker.state == "draining" or worker not in self.replicas_of(entry):
            return
        worker.state = "draining"
        self._hand_over(entry, worker)
        self._publish_replica(entry, worker)
        await self._stop_worker(entry, worker)

    def replica_room(self, entry: ModelEntry) -> bool:
        """One more replica of ``entry`` fits beside what runs, as the room policy counts
        (each replica one of ``max_loaded_models``, its footprint in the budgets): free
        room only, the scaler never stops or parks another model for a replica."""
        # Starts not spawned yet count: ``fill`` asks again before they are.
        taken = {r.number for r in self.replicas_of(entry)} | self.scaler.pending(entry)
        count = entry.spec.replicas.max
        number = next((n for n in range(count) if n not in taken), None)
        if number is None:
            return False

        def own(n: int) -> ModelSpec:  # its share of the GPUs: what its memory is on
            return replica_spec(entry.spec, n, count, self.placer.cores)

        # Siblings under names of their own: the checks leave out the spec's own id.
        siblings = [msgspec.structs.replace(own(n), id=f"{entry.id}#{n}") for n in taken]
        running = [*room.specs(self.rooms.loaded(entry)), *siblings]
        parked = [e.spec for e in self.rooms.parked(entry)]
        return fits(own(number), running, self.server, self.placer.gpus, parked=parked)

    def links_of(self, entry: ModelEntry) -> list[WorkerLink]:
        """The links of every replica of ``entry`` that serves (what an adapter's load or
        unload goes to: each engine holds its own); none while the model is not ready."""
        if entry.state != "ready":
            return []
        serving = self.replicas_of(entry).serving()
        if serving:
            return [r.link for r in serving]
        link = link_of(entry)
        return [link] if link is not None else []

    def route(self, entry: ModelEntry, link: WorkerLink, gens: list[Generate] | None = None,
              session: bytes | None = None) -> WorkerLink:
        """The link of the replica of ``entry`` that serves this request (``link``, the one
        ``acquire`` gave, for a model of one replica: one ``len()`` decides that). Chosen
        with no await before the caller submits (``policy.route``); the prompt's blocks
        and session are recorded where it went."""
        replicas = self._replicas.get(entry.id)
        if replicas is None:
            return link
        only: Replica | None
        if len(replicas) < 2:
            only = replicas.first()
        else:
            serving = replicas.serving()
            if len(serving) > 1:
                return self.routes.pick(entry, serving, gens, session).link
            only = serving[0] if serving else None
        if only is None or not only.serving:
            return link
        # The one left, not ``link``: the replica that named the model at the lease may
        # have been drained or reaped since. Marked used: else the scaler finds the only
        # replica of a model in steady use idle (``min: 0`` stops it).
        only.last_used = time.monotonic()
        return only.link

    # -- stopping ----------------------------------------------------------------------
    async def stop(self, entry: ModelEntry, *, force: bool = False, grace: float = 1.0) -> None:
        """Stop a model's worker. In-flight requests finish first (up to
        ``drain_timeout``) unless ``force``, which ends them with a 503 at once. Requests
        that arrive meanwhile wait and start the model again.

        A stop, once begun, is never cancelled by whoever waits for it: it runs as the
        model's one stop task (``stopping``), which every caller awaits shielded. A caller
        that comes while one runs waits for that one (its ``force`` is not applied)."""
        await asyncio.shield(self.stopping(entry, force=force, grace=grace))

    def stopping(self, entry: ModelEntry, *, force: bool = False,
                 grace: float = 1.0) -> asyncio.Task[None]:
        """The model's one stop task, begun now if none runs."""
        task = self._stops.get(entry.id)
        if task is None or task.done():
            self.parker.cancel(entry)  # a wake under way parks no one for it any more
            load = self._loads.get(entry.id)  # one begun later waits for this stop
            if entry.state in RESIDENT_STATES:
                # A load of a resident model only waits for its wake, ended above: it is
                # not cancelled, and its waiters start the model again after this stop
                # (``_load``), as for a ready model's; marked now, a park under way wakes
                # no one (it would wait for room for a stopped one).
                load = None
            if load is None and self.worker_of(entry) is not None:
                # Now, not in the task's first turn: a request that comes meanwhile (after
                # a reload's answer, say) must not lease the worker that is to stop.
                self._mark_stopping(entry)
            task = asyncio.create_task(self._stop(entry, load, force, grace),
                                       name=f"stop-{entry.id}")
            self._stops[entry.id] = task
            task.add_done_callback(self._stop_done)
        return task

    def _stop_done(self, task: asyncio.Task[None]) -> None:
        for model_id, running in list(self._stops.items()):
            if running is task:
                del self._stops[model_id]
        if not task.cancelled() and task.exception() is not None:  # retrieved: logged here
            log.error("%s failed", task.get_name(), exc_info=task.exception())

    async def _stop(self, entry: ModelEntry, load: asyncio.Task[WorkerLink] | None,
                    force: bool, grace: float) -> None:
        if load is not None:  # loading, or still in its backoff or waiting for room
            load.cancel()
            await asyncio.wait({load})  # its own cleanup reaps what it started
        self.scaler.cancel(entry)  # replicas still starting: reaped as they were cancelled
        await self.scaler.wait_starts(entry)
        worker = self.worker_of(entry)
        if worker is None:
            entry.yield_to = None
            if entry.state != "failed":
                entry.state = "unloaded"
                self._publish_state(entry)
            return
        self._mark_stopping(entry)
        await self._finish_stop(entry, worker, force, grace)

    def _mark_stopping(self, entry: ModelEntry) -> None:
        if entry.state != "stopping":
            entry.state = "stopping"
            self._publish_state(entry)

    async def _finish_stop(self, entry: ModelEntry, worker: Replica, force: bool = False,
                           grace: float = 1.0) -> None:
        """The rest of a stop, once ``entry`` is marked ``stopping``: its workers stopped
        (``_stop_worker``; a model's replicas all at once, each on its own drain deadline
        from now: one after the other, a stop took a drain for each), the model
        ``unloaded`` once every one is gone."""
        began = time.monotonic()
        others = [r for r in self.replicas_of(entry) if r is not worker]
        if others:
            await asyncio.gather(*(self._stop_worker(entry, r, force, grace)
                                   for r in (worker, *others)))
        else:
            await self._stop_worker(entry, worker, force, grace)
        entry.state, entry.yield_to = "unloaded", None
        self._publish_state(entry)
        log.info("model %s: stopped in %.2f s", entry.id, time.monotonic() - began)

    async def _stop_worker(self, entry: ModelEntry, worker: Replica, force: bool = False,
                           grace: float = 1.0) -> None:
        """Stop one worker of ``entry``: drain (unless ``force``), then ``Shutdown`` (the
        worker kills its own process group at once), and after ``grace`` seconds the
        group is killed from here."""
        began = time.monotonic()
        deadline = began + self.server.drain_timeout
        # (A GPU engine asleep never drains: it is stopped asleep, its requests end now.)
        while (worker.parked and worker.link.busy and not force and not entry.parked_level
               and worker.handle.returncode is None and time.monotonic() < deadline
               and not runs_beside(entry.spec, [e.spec for e in self.rooms.loaded(entry)],
                                   self.server)):
            # Its paused requests drain only where one more model may run (it holds its
            # place: ``stopping`` counts as running); none by the deadline: they end.
            await asyncio.sleep(POLL)
        # A parked one resumes to drain and exit; a GPU one asleep is stopped as it is.
        resumed = await self.parker.thaw(entry, worker)
        if not force and resumed:
            while (worker.link.busy and worker.handle.returncode is None
                   and time.monotonic() < deadline):
                await asyncio.sleep(POLL)
        ended = None
        if worker.link.busy:
            ended = ModelUnavailable(f"model '{entry.id}' was unloaded" if force or not resumed
                                     else f"model '{entry.id}' was unloaded after a "
                                     f"{self.server.drain_timeout:g} s drain")
        try:
            # Shutdown first: once the link has failed it sends nothing, and the engine
            # would go on generating for nobody until SIGTERM.
            worker.link.shutdown()
            if ended is not None:
                worker.link.fail(ended)
            async with asyncio.timeout(grace):
                await worker.handle.wait()
        except (TimeoutError, APIError):
            log.warning("model %s: worker did not exit within %g s of Shutdown; killing",
                        entry.id, grace)
        await self._reap(entry, worker, "model unloaded")  # kills the group if it lives

    # -- reloading ---------------------------------------------------------------------
    def retire(self, entry: ModelEntry) -> None:
        """A reload removed ``entry`` (no name resolves to it any more): its requests in
        flight finish (up to ``drain_timeout``), then its worker stops."""
        self._removed.add(entry)

        async def drain() -> None:
            try:
                await self.stop(entry)
            finally:
                self._removed.discard(entry)

        self._spawn_task(drain())

    def refresh(self, entry: ModelEntry, load: bool) -> None:
        """A reload changed ``entry``'s spec: a worker started with a spec the new one
        cannot be served by stops once its requests in flight are done (new requests wait
        meanwhile, then load the new spec); with ``load``, or if it was serving, the
        model loads again at once."""
        # A parked model serves no one now: it loads again when asked for, not at once
        # (which would take the cores from the model in use).
        serving = entry.state in ("loading", "ready", "sleeping", "waking")

        if scales(entry.spec.replicas):  # a router-only change (``min: 0``) restarts nothing
            self._scale()
        if entry.id not in self._loads and self._outdated(entry):
            # Begun before the reload answers (a stop marks the model ``stopping`` at
            # once): no later request leases the worker of the old spec.
            self.stopping(entry)

        async def restart() -> None:
            starting = self._loads.get(entry.id)
            if starting is not None and entry.state == "loading":
                await asyncio.wait({starting})  # its waiters get the worker they waited for
            if self._outdated(entry):
                log.info("model %s: its spec changed; restarting once its requests are done",
                         entry.id)
                await self.stop(entry)  # the one begun above, if it was
            if (load or serving) and not entry.removed and not self._closing:
                self.start_loading(entry)

        self._spawn_task(restart())

    async def stop_all(self) -> None:
        self._closing = True  # a reload's restart under way loads nothing more
        if self._reaper is not None:
            self._reaper.cancel()
        if self._scaling is not None:
            self._scaling.cancel()
        await self.spares.close(zygote=False)  # it reaps the workers it forked
        for task in list(self._loads.values()):
            task.cancel()
        await asyncio.gather(*(self.stop(e) for e in (*self.registry, *self._removed)
                               if self.worker_of(e) is not None), return_exceptions=True)
        await self.spares.close()
        self._ctx.destroy(linger=0)  # closes any socket a cancelled start left behind
        for backend in self.backends.values():
            backend.close()
