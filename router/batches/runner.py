"""``BatchRunner``: runs the batches this router holds, line by line, through the app's
own protocol handlers, as their owner's key, at batch priority.

Each line is one request made in-process (``LineCaller``): the app's handlers below the
admission middleware, with the owner's principal as it is *now* (``Keys.current``): a
revoked key's batch stops, and what the key may use (its model globs, budgets, token
rate) applies to every line as to any request, which is recorded in the usage ledger as
any is. The request is marked as a batch line (``BATCH_SCOPE_KEY``): the relay gives it
batch priority (``router.api.relay``).

A batch's lines run grouped by model, a model already loaded first, so a batch over two
models under ``max_loaded_models: 1`` loads each once; they are read from the database a
page at a time as they are taken (``BatchStore.pending_page``), so a router holds one page
of a batch, whatever its size. A revoked owner's batch stops at once (``Keys.on_revoked``);
an owner that cannot be read (the database away past ``STALE_MAX``: ``Keys.unknown``) is
not revoked: its lines wait, and none fails. At most
``batch_model_concurrency`` lines of one model and ``batch_key_concurrency`` of one key
run at once, over every batch. Lines yield to people (``_allowed``, ``_Share``): the
moment a person's request is admitted on a model (``ModelEntry.person_hook``), the lines
running there are cut short, unanswered and uncharged, and none starts there until no
person's request is in flight; then the cut ones run again first, at most
``batch_shared_concurrency`` in such gaps. A line cut ``CUTS`` times runs to its end
beside whoever comes. Results are written every ``FLUSH_EVERY`` seconds (each
line once: ``BatchStore.finish``); a router that stops, cleanly or not, leaves the lines
it had not written pending, and whoever holds the batch next runs them.

What a batch does is told as ``batch`` events on the router's event bus (``tell``:
``created`` and ``cancelling`` from the API's handlers, ``in_progress``, ``progress`` at
most every ``PROGRESS_EVERY`` seconds while lines finish, and ``ended``), each with the
batch's id, owner (``key``), status and counts; and in the router's metrics: lines
counted by state as each finishes, and the batches held now with their pending lines,
read at each scrape (``active``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import IO, Any, Protocol

from starlette.types import ASGIApp, Message

from router.access.admission import BATCH_SCOPE_KEY, PRINCIPAL_SCOPE_KEY, Keys, Principal
from router.access.ledger import BATCH_LINE, Ledger
from router.batches.store import BatchRow, BatchStore, Line
from router.errors import APIError, ModelNotFound
from router.lifecycle.policy.room import BATCH_QUIET, wanted_in_person
from router.lifecycle.supervisor import Supervisor
from router.observe.metrics import ActiveBatch, Metrics
from router.registry import ModelEntry

log = logging.getLogger("modelyard.router")

LEASE = 30.0
"""Seconds a router's hold on a batch lasts unless renewed: how long a batch waits after
its router died before another takes it over."""
CLAIM_EVERY = 2.0
"""Seconds between looks for batches to run (and renewals of this router's leases)."""
FLUSH_EVERY = 0.5
"""Seconds between writes of finished lines' results."""
RETRIES = 3
"""Times a line answered 502 or 503 (a worker that died, the database away) runs again,
``RETRY_AFTER`` seconds later, doubling, before that answer is its result."""
RETRY_AFTER = 2.0
SHARE_LOOK = 0.5
"""Seconds between looks at a model's batch line limit while it is reached (a person's
request that ends wakes the lines waiting at once)."""
STARVED_AFTER = 5.0
"""Seconds a model's batch lines may wait with none starting or ending while people keep
its requests in flight without a gap: then one line runs beside them (``_allowed``), to
its end (never cut), so a person who never leaves a model idle slows its batches, never
stops them."""
GAP = 0.5
"""Seconds a model must have had no person's request in flight before batch lines start
in the gap: a line started in a shorter one would be cut by the person's next request,
most often in its prefill, the step that person's first token then waits behind."""
CUTS = 2
"""Times a person's request may cut one line short (``_Share.cut``); a line cut that often
runs to its end beside whoever comes next, so a person who leaves the model only short
gaps, each too short for a line to end in, still lets a batch go on: what a person pays
for it is one line's decode beside their request at most ``batch_shared_concurrency``
at a time, and a line's waste is bounded (its prompt is mostly in the engine's prefix
cache when it runs again)."""
WAIT_FOR_ROOM = 1.0
"""Seconds between looks at whether a batch's next model may run (``room.batch_may_run``)."""
PROGRESS_EVERY = 2.0
"""Seconds at least between a running batch's ``progress`` events (none while no line
finished since the last)."""


def batch_event(batch: BatchRow) -> dict[str, Any]:
    """A ``batch`` event's own fields: what a batch's owner may know of it at a glance."""
    return {"batch": batch.id, "key": batch.owner, "shape": batch.shape,
            "endpoint": batch.endpoint, "status": batch.status, "total": batch.total,
            "done": batch.done, "succeeded": batch.succeeded, "errored": batch.errored,
            "canceled": batch.canceled, "expired": batch.expired}


class Shape(Protocol):
    """How one API (OpenAI's batches, Anthropic's message batches) writes a line's
    result."""

    def result(self, line: Line, status: int, body: bytes) -> tuple[str, str]:
        """A line that ran: its state (``succeeded``, ``errored``) and result text."""

    def unrun(self, line: Line, state: str, message: str) -> str:
        """A line that will not run (``canceled``, ``expired``): its result text."""


def identity(folder: Path) -> str:
    """This router's name as a batch runner: the one kept in ``folder`` (under the cache
    dir) while no other live router holds it (a lock the system lets go of when its
    process dies, even by kill -9), so a router started again takes its batches back at
    once rather than after their leases run out; else a new one."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / ".runner.lock", "a+")  # noqa: SIM115  # held while we run
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return f"router-{secrets.token_hex(6)}"  # another router here, or no folder
    _held.append(lock)
    lock.seek(0)
    name = lock.read().strip()
    if not name:
        name = f"router-{secrets.token_hex(6)}"
        lock.write(name)
        lock.flush()
    return name


_held: list[IO[str]] = []
"""Open lock files (``identity``): closing one would let it go."""


class LineCaller:
    """Makes one request in-process: ``app`` is the app's stack below its admission
    middleware (``ModelyardApp.inner``), which the scope's principal has passed."""

    def __init__(self, app: Callable[[], ASGIApp]) -> None:
        self._app = app

    async def __call__(self, path: str, body: bytes, principal: Principal,
                       batch_id: str) -> tuple[int, bytes]:
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
            "raw_path": path.encode(), "root_path": "", "query_string": b"",
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 0), "server": ("modelyard-batch", 0), "state": {},
            PRINCIPAL_SCOPE_KEY: principal, BATCH_SCOPE_KEY: batch_id,
        }
        given = False
        status = 500
        chunks: list[bytes] = []

        async def receive() -> Message:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client never leaves; a cancel ends it
            raise AssertionError("unreachable")

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self._app()(scope, receive, send)
        return status, b"".join(chunks)


class _Share:
    """A model's batch lines in flight, over every batch, against a limit that changes
    (``BatchRunner._allowed``), and the calls of those lines a person's request cuts.

    A line cut short gives its place back and waits for it again ahead of every line not
    yet begun (``take(again=True)``), so a cut line runs again before new ones start."""

    __slots__ = ("_freed", "_waiting", "again", "calls", "cut_calls", "in_flight", "moved_at",
                 "person_left")

    def __init__(self) -> None:
        self.in_flight = 0
        self.again = 0
        """Cut lines waiting to run again: new lines wait behind them."""
        self.calls: set[asyncio.Future[tuple[int, bytes]]] = set()
        """Calls in flight that a person's request cuts (a line cut ``CUTS`` times is not
        among them: it runs to its end)."""
        self.cut_calls: set[asyncio.Future[tuple[int, bytes]]] = set()
        """Calls cut (cancelled) by ``cut``: their lines run again."""
        self._freed = asyncio.Event()
        self.moved_at = time.monotonic()
        """When a line last started or ended here, or began to wait where none was
        running or waiting (``STARVED_AFTER``)."""
        self._waiting = 0
        self.person_left = 0.0
        """When the last person's request in flight on the model ended (``GAP``)."""

    async def take(self, allowed: Callable[[], int], again: bool = False,
                   stopped: Callable[[], bool] = lambda: False) -> None:
        """Wait for a place and take it; ``stopped()`` (its batch stops) ends the wait
        too, the place taken all the same (its caller sees the stop and gives it back)."""
        if not self.in_flight and not self._waiting:
            self.moved_at = time.monotonic()  # the first to wait: its clock starts now
        self.again += again
        self._waiting += 1
        try:
            while (self.in_flight >= allowed() or (self.again and not again)) and not stopped():
                self._freed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(SHARE_LOOK):  # the limit may rise meanwhile
                        await self._freed.wait()
        finally:
            self.again -= again
            self._waiting -= 1
        self.in_flight += 1
        self.moved_at = time.monotonic()

    def give(self) -> None:
        self.in_flight -= 1
        self.moved_at = time.monotonic()
        self._freed.set()

    def starved(self) -> bool:
        """No line here has started or ended for ``STARVED_AFTER`` s."""
        return time.monotonic() - self.moved_at >= STARVED_AFTER

    async def requeue(self, allowed: Callable[[], int]) -> None:
        """A cut line: its place given back, then taken again once the limit allows,
        before any new line's. Its place is held again whatever ends the wait (the
        line's task gives it back when it ends, as every line's)."""
        self.give()
        try:
            await self.take(allowed, again=True)
        except BaseException:
            self.in_flight += 1
            raise

    def cut(self) -> None:
        """A person's request was admitted: every cuttable call in flight ends now."""
        for call in self.calls:
            if not call.done():
                self.cut_calls.add(call)
                call.cancel()
        self.calls.clear()

    def wake(self) -> None:
        """The limit may have risen (the last person's request ended): look again now."""
        self._freed.set()


class _Running:
    """One batch this router runs: its task and what stops it. ``batch``'s status and
    counts are kept current as its lines finish (what events and metrics tell; the
    database has the lines written)."""

    __slots__ = ("batch", "stop", "task", "told_at", "told_done")

    def __init__(self, batch: BatchRow, task: asyncio.Task[None]) -> None:
        self.batch = batch
        self.task = task
        self.stop: str | None = None
        """Why it stops early: ``canceled`` (its owner), ``expired`` or ``revoked``."""
        self.told_at = time.monotonic()
        self.told_done = batch.done
        """When its last ``progress`` (or ``in_progress``) event was told, and its count."""


class BatchRunner:
    """Runs the batches of ``store`` this router holds (see the module doc)."""

    def __init__(self, store: BatchStore, call: Callable[[str, bytes, Principal, str],
                                                         Awaitable[tuple[int, bytes]]],
                 keys: Keys, supervisor: Supervisor, shapes: dict[str, Shape],
                 metrics: Metrics, ledger: Ledger | None = None) -> None:
        self.store = store
        self.ledger = ledger
        """Where lines' usage rows are held until their results are written with them."""
        self.call = call
        self.keys = keys
        self.supervisor = supervisor
        self.registry = supervisor.registry
        server = supervisor.server
        self.server = server
        self.shapes = shapes
        self.events = supervisor.events
        self.metrics = metrics
        metrics.watch_batches(self.active)
        self.name = identity(store.folder)
        self._running: dict[str, _Running] = {}
        self._model_lines: dict[str, _Share] = {}
        self._key_lines: dict[str, asyncio.Semaphore] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        keys.on_revoked(self._revoked)

    def _revoked(self, names: frozenset[str]) -> None:
        """Keys ``names`` were revoked: their batches stop (the lines in flight are
        cancelled within a second, ``_run_group``) and end ``failed``."""
        for running in self._running.values():
            if running.batch.owner in names and running.stop is None:
                running.stop = "revoked"

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batch-runner")

    def wake(self) -> None:
        """Look for work now (a batch was made or cancelled)."""
        self._wake.set()

    def tell(self, batch: BatchRow, action: str) -> None:
        """Publish a ``batch`` event of ``batch`` as it stands (see the module doc)."""
        self.events.publish("batch", None, action=action, **batch_event(batch))

    def created(self, batch: BatchRow) -> None:
        """``batch`` was made (its refused lines ``errored`` already): told, counted, and
        run soon."""
        if batch.errored:
            self.metrics.batch_lines(batch.owner, "errored", batch.errored)
        self.tell(batch, "created")
        self.wake()

    def cancelling(self, batch: BatchRow) -> None:
        """Its owner cancelled ``batch`` (now ``cancelling``): told, and stopped soon."""
        self.tell(batch, "cancelling")
        self.wake()

    def active(self) -> list[ActiveBatch]:
        """The batches this router runs now: status, owner and lines still pending."""
        return [(r.batch.status, r.batch.owner, max(0, r.batch.total - r.batch.done))
                for r in self._running.values()]

    async def close(self) -> None:
        """Stop running (the router stops): lines that ran are written, the others stay
        pending for whoever holds the batch next, and the leases are let go."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        running = [r.task for r in self._running.values()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.store.release(self.name)

    async def _loop(self) -> None:
        while True:
            try:
                held = await self.store.claim(self.name, LEASE)
            except APIError as err:  # the database away: try again
                log.warning("batches: %s", err.message)
                held = []
            for batch in held:
                running = self._running.get(batch.id)
                if running is None:
                    task = asyncio.create_task(self._run(batch), name=f"batch {batch.id}")
                    self._running[batch.id] = _Running(batch, task)
                    task.add_done_callback(self._ended)
                elif batch.status == "cancelling" and running.stop is None:
                    running.stop = "canceled"
                    if running.batch.status == "in_progress":
                        running.batch.status = "cancelling"
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLAIM_EVERY):
                    await self._wake.wait()

    def _ended(self, task: asyncio.Task[None]) -> None:
        for bid, running in list(self._running.items()):
            if running.task is task:
                del self._running[bid]

    def _principal(self, owner: str) -> Principal | None:
        """The owner's principal as the keys stand now; ``None``: it no longer admits."""
        return self.keys.current(owner)

    async def _run(self, batch: BatchRow) -> None:
        try:
            await self._run_lines(batch)
        except asyncio.CancelledError:
            raise
        except APIError as err:  # the database away: the next claim goes on
            log.warning("batch %s: %s", batch.id, err.message)
        except Exception:
            log.exception("batch %s: runner failed", batch.id)
        finally:
            if self.ledger is not None:  # lines left pending: charged when they run again
                self.ledger.let_go_batch(batch.id)

    async def _run_lines(self, batch: BatchRow) -> None:
        me = self._running[batch.id]
        if batch.status == "validating":
            await self.store.set_status(batch, "in_progress", self.name)
            self.tell(batch, "in_progress")
        if batch.status == "cancelling":
            me.stop = "canceled"
        groups = [] if me.stop else await self._groups(batch.id)
        shape = self.shapes[batch.shape]
        done: list[Line] = []
        flusher = asyncio.create_task(self._flush_every(batch, me, done))
        try:
            for models in groups:
                await self._run_group(batch, me, models, shape, done)
                if me.stop:
                    break
        finally:
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
            await self._flush(batch, done)
        if me.stop:
            await self._end_unrun(batch, me.stop, shape, done)
        await self._finalize(batch, me.stop)

    async def _end_unrun(self, batch: BatchRow, stop: str, shape: Shape,
                         done: list[Line]) -> None:
        """The lines still pending of a batch that stops early, answered as its end says,
        a page at a time."""
        state = "expired" if stop == "expired" else "canceled"
        message = {"canceled": "the batch was cancelled before this request ran",
                   "expired": "the batch expired before this request ran",
                   "revoked": "the key that made the batch no longer admits requests"
                   }[stop]
        after = -1
        while rest := await self.store.pending_page(batch.id, None, after):
            done.extend(Line(ln.line, ln.custom_id, ln.model, "", state,
                             shape.unrun(ln, state, message)) for ln in rest)
            for _ in rest:
                self._finished(batch, state)
            await self._flush(batch, done)
            after = rest[-1].line  # not "pending again": a batch taken over stays pending

    async def _groups(self, batch_id: str) -> list[list[str]]:
        """The models ``batch_id``'s pending lines name, grouped by the model that serves
        them (an adapter's: its base's); a model ready now first, then in the order the
        batch first names them. Only names are held: the lines are paged
        (``_run_group``)."""
        firsts: dict[str, int] = {}
        groups: dict[str, list[str]] = defaultdict(list)
        for model, first in await self.store.pending_models(batch_id):
            served = self._served_by(model)
            groups[served].append(model)
            firsts[served] = min(first, firsts.get(served, first))
        ready = {e.id for e in self.registry if e.state == "ready"}
        return [groups[served] for served in sorted(
            groups, key=lambda served: (served not in ready, firsts[served]))]

    def _served_by(self, model: str) -> str:
        try:
            return self.registry.serving(self.registry.resolve(model)).id
        except ModelNotFound:
            return model  # gone since (a reload): its lines fail as any request would

    async def _pages(self, batch: BatchRow, models: list[str]) -> AsyncGenerator[Line, None]:
        """``batch``'s pending lines of ``models``, in line order, read a page
        (``BatchStore.page_lines``) at a time as they are taken: the runner holds one
        page of a batch, whatever its size (and the lines in flight)."""
        after = -1
        while page := await self.store.pending_page(batch.id, models, after):
            for line in page:
                yield line
            after = page[-1].line  # lines in flight are pending still: read after them

    async def _run_group(self, batch: BatchRow, me: _Running, models: list[str],
                         shape: Shape, done: list[Line]) -> None:
        model = self._served_by(models[0])
        per_model = self._model_lines.setdefault(model, _Share())
        per_key = self._key_lines.setdefault(
            batch.owner, asyncio.Semaphore(self.server.batch_key_concurrency))
        in_flight: set[asyncio.Task[None]] = set()
        entry = self.registry.entries.get(model)
        if entry is not None:
            entry.person_hook = self._person  # a person's request cuts the lines in flight

        def allowed() -> int:
            return self._allowed(entry, per_model)

        lines = self._pages(batch, models)
        try:
            async for line in lines:
                while entry is not None and not self.supervisor.rooms.batch_may_run(entry):
                    if self._should_stop(batch, me):
                        break
                    await asyncio.sleep(WAIT_FOR_ROOM)  # a person uses the room it needs
                await self._owner_known(batch, me)
                await per_key.acquire()
                try:
                    # a cancel or a revocation is seen while a person holds the model
                    await per_model.take(allowed, stopped=lambda: self._should_stop(batch, me))
                except BaseException:
                    per_key.release()
                    raise
                if self._should_stop(batch, me):
                    per_model.give()
                    per_key.release()
                    break
                task = asyncio.create_task(self._one(batch, line, shape, done, me, per_model,
                                                     allowed))

                def release(_: asyncio.Task[None]) -> None:
                    per_model.give()
                    per_key.release()

                task.add_done_callback(release)
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            while in_flight:
                if self._should_stop(batch, me):
                    for task in in_flight:
                        task.cancel()
                await asyncio.wait(in_flight, timeout=1.0)
        finally:
            await lines.aclose()
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    def _allowed(self, entry: ModelEntry | None, share: _Share | None = None) -> int:
        """Batch lines ``entry`` may run at once now: none while a person's request is in
        flight there (the lines running as it was admitted were cut, but those cut
        ``CUTS`` times, which go on); ``batch_shared_concurrency`` in the gaps of a
        person's use (no request of theirs in flight, one within ``BATCH_QUIET`` s), each
        cut when their next request comes, once the gap is ``GAP`` s long; else
        ``batch_model_concurrency``. Where people leave no such gap, one line once none
        has moved for ``STARVED_AFTER`` s. vLLM's
        priority orders its waiting requests, not who shares a step: every line in the
        engine's batch slows each step a person's tokens wait for, and its prefill is
        chunked in among them."""
        if entry is None:
            return self.server.batch_model_concurrency
        if self._beside_people(entry, share):  # one line, if none moved for STARVED_AFTER s
            return 1 if share is not None and share.starved() else 0
        if time.monotonic() - entry.interactive_at < BATCH_QUIET:
            return self.server.batch_shared_concurrency
        return self.server.batch_model_concurrency

    @staticmethod
    def _beside_people(entry: ModelEntry | None, share: _Share | None) -> bool:
        """Whether a line starting now on ``entry`` would run beside a person's request:
        one is in flight there, or the last ended less than ``GAP`` s ago."""
        return entry is not None and (wanted_in_person(entry) or (
            share is not None and time.monotonic() - share.person_left < GAP))

    def _person(self, entry: ModelEntry, arrived: bool) -> None:
        """``ModelEntry.person_hook``: a person's request was admitted on ``entry`` (its
        lines in flight are cut), or the last one there ended (they may run again)."""
        share = self._model_lines.get(entry.id)
        if share is not None:
            if arrived:
                share.cut()
            else:  # they may start once the gap is GAP s long
                share.person_left = time.monotonic()
                asyncio.get_running_loop().call_later(GAP, share.wake)

    def _should_stop(self, batch: BatchRow, me: _Running) -> bool:
        if me.stop is None and time.time() >= batch.expires:
            me.stop = "expired"
        return me.stop is not None

    async def _owner_known(self, batch: BatchRow, me: _Running) -> None:
        """Wait while whether ``batch``'s owner still admits cannot be read (the database
        away past ``STALE_MAX``: ``Keys.unknown``; a key made on another router after
        this one's last read: ``Keys.unseen``): an outage is not a revocation, so no line
        starts and none fails until the key reads again."""
        while ((self.keys.unknown(batch.owner) or self.keys.unseen(batch.owner, batch.created))
               and not self._should_stop(batch, me)):
            await asyncio.sleep(WAIT_FOR_ROOM)

    async def _one(self, batch: BatchRow, line: Line, shape: Shape, done: list[Line],
                   me: _Running, share: _Share, allowed: Callable[[], int]) -> None:
        await self._owner_known(batch, me)
        principal = self._principal(batch.owner)
        if principal is None:  # read, and revoked (or stopped meanwhile: left pending)
            if me.stop is None:
                me.stop = "revoked"
            return
        entry = self.registry.entries.get(self._served_by(line.model))
        if entry is not None and wanted_in_person(entry):
            await share.requeue(allowed)  # a person came since its place was taken
        if self.ledger is not None:  # its usage is written with its result (``_flush``)
            self.ledger.hold(batch.id, line.line)
            BATCH_LINE.set((batch.id, line.line))  # this task's own context
        attempt = cuts = 0
        while True:
            # a line let run beside people (starved) runs to its end: a cut only wastes it
            cuttable = cuts < CUTS and not self._beside_people(entry, share)
            got = await self._attempt(batch, line, principal, share, cuttable)
            # The relay logs an answer in a callback it schedules as it answers: let it run,
            # so the line's usage row is held before its result can be written.
            await asyncio.sleep(0)
            if got is None:  # a person's request cut it: again once theirs are done
                cuts += 1
                if self.ledger is not None:  # the cut run is not charged: its rows go
                    self.ledger.hold(batch.id, line.line)
                await share.requeue(allowed)
                await self._owner_known(batch, me)
                principal = self._principal(batch.owner)
                if principal is None:
                    if me.stop is None:
                        me.stop = "revoked"
                    return
                continue
            status, body = got
            if status == 503 and entry is not None and me.stop is None:
                waited = False
                while not self.supervisor.rooms.batch_may_run(entry) and me.stop is None:
                    waited = True  # its room is a person's now: a batch waits, never fails
                    await asyncio.sleep(WAIT_FOR_ROOM)
                if waited:
                    continue
            if status not in (502, 503) or attempt == RETRIES or me.stop is not None:
                break
            # the server's passing trouble (a worker died, the database away): again later
            await asyncio.sleep(RETRY_AFTER * 2**attempt)
            attempt += 1
        if status in (401, 502, 503) and me.stop is not None:
            return  # left pending: answered as the batch's end says (cancelled, revoked)
        state, text = shape.result(line, status, body)
        done.append(Line(line.line, line.custom_id, line.model, "", state, text))
        self._finished(batch, state)

    async def _attempt(self, batch: BatchRow, line: Line, principal: Principal,
                       share: _Share, cuttable: bool) -> tuple[int, bytes] | None:
        """One run of ``line``: its status and body; ``None``: a person's request cut it
        short (``_Share.cut``; ``cuttable``). A line cut short has no result, and its rows
        are dropped (``_one``: ``Ledger.hold`` again): it is answered, and charged, once,
        when it runs to its end. A line its batch's stop ends is charged for what it
        spent: its rows are written with its ``canceled`` result (``_end_unrun``)."""
        call = asyncio.ensure_future(self.call(batch.endpoint, line.body.encode(), principal,
                                               batch.id))
        if cuttable:
            share.calls.add(call)
        try:
            return await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if call not in share.cut_calls or (task is not None and task.cancelling()):
                raise  # this line's own end (its batch cancelled, the router stopping)
            return None
        finally:
            share.calls.discard(call)
            share.cut_calls.discard(call)

    def _finished(self, batch: BatchRow, state: str) -> None:
        """One of ``batch``'s lines ended as ``state``: in its counts and the metrics."""
        setattr(batch, state, getattr(batch, state) + 1)
        self.metrics.batch_lines(batch.owner, state)

    async def _flush_every(self, batch: BatchRow, me: _Running, done: list[Line]) -> None:
        while True:
            await asyncio.sleep(FLUSH_EVERY)
            try:
                await self._flush(batch, done)
            except APIError as err:  # the database away: they wait for the next flush
                log.warning("batch %s: results not written yet: %s", batch.id, err.message)
                continue
            now = time.monotonic()
            if batch.done != me.told_done and now - me.told_at >= PROGRESS_EVERY:
                me.told_at, me.told_done = now, batch.done
                self.tell(batch, "progress")

    async def _flush(self, batch: BatchRow, done: list[Line]) -> None:
        if not done:
            return
        taken = done[:]
        del done[: len(taken)]
        ledger = self.ledger
        usage = {} if ledger is None else {ln.line: ledger.held(batch.id, ln.line)
                                           for ln in taken}
        try:
            await self.store.finish(batch.id, self.name, taken, usage)
        except BaseException:
            done[:0] = taken  # written with the next flush (their usage rows still held)
            raise
        if ledger is not None:
            for ln in taken:
                ledger.let_go(batch.id, ln.line)

    async def _finalize(self, batch: BatchRow, stop: str | None) -> None:
        fresh = await self.store.batch(batch.id, None)
        if fresh is None:
            return
        await self.store.set_status(fresh, "finalizing", self.name)
        batch.status = "finalizing"
        files: dict[str, str | None] = {}
        if fresh.shape == "openai":
            files["output_file"] = await self.store.add_result_file(
                fresh, "output", ("succeeded",), f"{fresh.id}_output.jsonl")
            files["error_file"] = await self.store.add_result_file(
                fresh, "error", ("errored", "canceled", "expired"), f"{fresh.id}_error.jsonl")
        status = {None: "completed", "canceled": "cancelled", "expired": "expired",
                  "revoked": "failed"}[stop]
        if stop == "revoked":
            fresh.errors = [{"code": "key_not_admitted", "line": None,
                             "message": "the key that made the batch no longer admits "
                                        "requests", "param": None}]
        await self.store.set_status(fresh, status, self.name, **files)
        self.tell(fresh, "ended")
        log.info("batch %s %s: %d succeeded, %d errored, %d canceled, %d expired", fresh.id,
                 status, fresh.succeeded, fresh.errored, fresh.canceled, fresh.expired)

