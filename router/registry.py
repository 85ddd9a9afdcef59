"""``ModelRegistry``: the models a preset declares, their runtime state, and name resolution.

Resolution order: exact id, exact alias, case-insensitive id or alias, an adapter folder
in a base's ``adapters_dir``, unique case-insensitive substring of an id or alias, the
longest id or alias the name begins with (so ``claude-sonnet-4-5-20250929`` reaches an
alias ``claude-sonnet``), then the server's ``default_model`` (never for ``<base>/…``
of a base with an ``adapters_dir``: a missing adapter is a 404). For a key limited to some
models, only the models whose ``ModelEntry.names`` its globs match exist: an adapter found
in an ``adapters_dir`` by its id ``<base>/<folder>`` alone, never by its folder's name.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, Self

import msgspec

from router.errors import APIError, BadRequest, ModelNotFound
from shared.adapters import AdapterError, folder_in, read_adapter, stamp
from shared.config import ModelSpec, Preset, serves_adapters
from shared.protocol import AdapterState, LoraRef

DEMAND_SECONDS = 300.0
"""The window of a model's recent request rate (its eviction cost)."""


class Slots:
    """A model's ``max_concurrent`` slots: taken in arrival order, never lost.

    A slot freed while others wait goes straight to the first waiter (``free`` does not
    rise), so a newcomer cannot pass the line. A waiter cancelled after it was handed a
    slot passes it on: a client that leaves in the very turn its slot frees leaks nothing.

    Batch lines (``later``) wait in a line of their own, served only when nobody waits in
    the first: a batch takes a slot only when no interactive request waits for it.
    """

    __slots__ = ("_later", "_since", "_waiters", "free", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.free = size
        """Slots no one holds; below 0 after a ``resize`` down, until enough come back."""
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._later: collections.deque[asyncio.Future[None]] = collections.deque()
        self._since: dict[asyncio.Future[None], float] = {}
        """When (``time.monotonic``) each waiter began to wait (the scaler's queue wait)."""

    @property
    def waiting(self) -> int:
        """Waiters still without a slot (batch lines' included)."""
        return sum(not w.done() for w in (*self._waiters, *self._later))

    def try_take(self, later: bool = False) -> bool:
        """Take a slot if one is free and nobody waits for one before this request (a
        batch line: nobody at all); never waits."""
        ahead = (*self._waiters, *self._later) if later else self._waiters
        if self.free > 0 and not any(not w.done() for w in ahead):
            self.free -= 1
            return True
        return False

    async def take(self, later: bool = False) -> None:
        """Take a slot, waiting in line for one (a batch line: in the second line)."""
        if self.try_take(later):
            return
        waiter = asyncio.get_running_loop().create_future()
        line = self._later if later else self._waiters
        line.append(waiter)
        self._since[waiter] = time.monotonic()
        try:
            await waiter
        except asyncio.CancelledError:
            if not waiter.cancelled():
                self.give()  # handed one as it was cancelled: the next in line gets it
            elif waiter in line:  # (``give`` may have dropped it already)
                line.remove(waiter)
            raise
        finally:
            del self._since[waiter]

    def waiting_since(self) -> list[tuple[float, bool]]:
        """Each waiter still without a slot: since when it waits, and whether it is a
        batch line (``later``)."""
        return [(self._since[w], line is self._later)
                for line in (self._waiters, self._later) for w in line
                if not w.done() and w in self._since]

    def resize(self, size: int) -> None:
        """Hold ``size`` slots from now on (a model's replicas came or went): slots added
        go to waiters first; slots taken away are taken from the free ones, or from those
        given back later (``free`` below 0 meanwhile), never from a request that holds one."""
        grown, self.size = size - self.size, size
        if grown < 0:
            self.free += grown
        for _ in range(grown):
            self.give()

    def give(self) -> None:
        """Return a slot: to the first waiter, else to the first batch line, else to the
        free ones (first to make up for a ``resize`` down)."""
        if self.free < 0:
            self.free += 1
            return
        for line in (self._waiters, self._later):
            while line:
                waiter = line.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    return
        self.free += 1


class Serving(Protocol):
    """What the registry's readers (policy) see of the worker that serves a model's
    requests (the lifecycle's ``router.lifecycle.replica.Replica``, which owns it)."""

    @property
    def busy(self) -> bool:
        """Generations or calls in flight on it."""
        ...


@dataclass(eq=False)
class ModelEntry:
    """One declared model and what the router knows of its worker right now: a summary
    the lifecycle writes (``state``, ``pid``, …); the running workers themselves are the
    lifecycle's (``router.lifecycle.replica``)."""

    spec: ModelSpec
    state: str = "unloaded"
    replica: Serving | None = None
    """The replica that serves its requests, from ready until it is reaped or crashes
    (the lifecycle's ``Replica``, whose link requests go to: ``replica.link_of``)."""
    pid: int | None = None
    node: str | None = None
    """Where the worker runs: this host's name (``local``), or its Ray node's address."""
    leases: int = 0
    last_used: float = 0.0
    loaded_at: float | None = None
    load_seconds: float | None = None
    load_phases: dict[str, float] = field(default_factory=dict)
    load_started: float = 0.0
    """When (``time.monotonic``) the running load's worker began to start, the clock of
    ``load_seconds``; 0 while a load waits for room or a start lock."""
    max_model_len: int | None = None
    max_prompt_chars: int = 0
    """From the worker: a longer prompt cannot fit, so it is refused before sending."""
    error: str | None = None
    exit_code: int | None = None
    queued: int = 0
    """Requests waiting for this model to load, wake or find room."""
    failures: int = 0
    """Consecutive failed starts or crashes; drives the restart backoff."""
    failed_at: float = 0.0
    engine_in_flight: int | None = None
    """Requests vLLM itself still holds, as the worker last reported (``Pong``)."""
    restarts: int = 0
    """Starts after a crash or a failed start."""
    replica_failures: int = 0
    """Replicas that failed to start or crashed while another served (the model did not)."""
    replica_count: int = 0
    """Its workers now (its replicas, starting and draining ones included): each counts
    against ``max_loaded_models`` and the memory budgets (``policy.room.specs``)."""
    evictions: int = 0
    """Stops to make room for another model."""
    loads: int = 0
    """Starts that became ready."""
    placement: dict[str, str] = field(default_factory=dict)
    keep_alive: float | None = None
    """The latest admin request's ``keep_alive`` in seconds (negative: forever; 0: stop
    when idle); ``None`` (that request had none): the preset's ``ttl`` applies."""
    kept_until: float = 0.0
    """Until when (``time.monotonic``) the model stays loaded however long it idles: the
    latest end of a non-admin request's ``keep_alive``."""
    yield_to: str | None = None
    """The model this one makes room for after it waited ``swap_wait``: new requests wait
    (they will load this one again later) and it stops once its requests are done."""
    room_since: float | None = None
    """When this model's load began to wait for room; the line for room goes by priority,
    then by this."""
    demand: float = 0.0
    demand_at: float = 0.0
    batch_leases: int = 0
    """Of ``leases``, those of batch lines (which never count as a person's demand)."""
    interactive_at: float = 0.0
    """When (``time.monotonic``) a request that is no batch line last took a lease."""
    batch_load: bool = False
    """Its load was asked for by batch lines alone (``Supervisor.start_loading``)."""
    person_hook: Callable[[ModelEntry, bool], None] | None = None
    """Told (``True``) in the turn a request that is no batch line takes a lease, and
    (``False``) when the last such lease goes: the batch runner's, which cuts its lines
    here the moment a person's request is admitted and runs them again once it is done
    (``router.batches.runner``)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    slots: Slots | None = None
    """``max_concurrent`` requests served at once; ``None``: no cap."""
    removed: bool = False
    """A reload took it out of the preset: it drains and stops, and never loads again."""
    lora: LoraRef | None = None
    """An adapter model's adapter (``spec.base`` names the model that serves it): what its
    requests carry to the base's worker. Its entry holds no worker: its state, leases
    and slots are its base's, and only its name, demand and use are its own."""
    found: bool = False
    """An adapter found in its base's ``adapters_dir`` (not declared in the preset)."""
    registered: bool = False
    """An adapter an admin registered by path at run time (``POST /v1/models/adapters``),
    not declared in the preset."""
    rank: int | None = None
    """An adapter's LoRA rank (its ``adapter_config.json``; None: unreadable)."""
    adapters_loaded: list[AdapterState] = field(default_factory=list)
    """A base's adapters loaded in its engine, as its worker last said."""
    parked_for: str | None = None
    """The model this one was last parked to make room for: it waits behind that model
    in the line for room until that one's turn has begun (``policy.room.defers``)."""
    parked_at: float = 0.0
    """When (``time.monotonic``) it was last parked (``state`` ``parked``: its worker keeps
    its memory and gives up its cores; ``router.lifecycle.parking``)."""
    turn_at: float = 0.0
    """When (``time.monotonic``) it last began to run: loaded or woken. A model another
    waits for keeps the cores at least ``park_quantum`` from here."""
    parks: int = 0
    """Times it was parked (each frees its cores for another model)."""
    wakes: int = 0
    """Times it was woken from ``parked``."""
    parked_level: int = 0
    """How its worker is parked (while ``parking``/``parked``/``waking``): 0 its engine
    paused and its processes stopped (a CPU model), 1 or 2 vLLM's sleep mode (a GPU
    model: weights in pinned host memory, or dropped; ``policy.gpu_park``)."""
    weights_bytes: int = 0
    """Its weights' size on disk (read once, when a park first needs to know what its
    load will take): the floor of what its worker holds."""
    resident_bytes: int = 0
    """What its worker's processes held (resident sets) when last measured: as it
    parked, or as it became ready."""

    @property
    def names(self) -> list[str]:
        """The names a key's model globs (and a budget's) match: its id, then the aliases
        an operator declared (the preset's, or an admin's registration). An adapter found
        in an ``adapters_dir`` is matched by its id ``<base>/<folder>`` alone: its folder
        name is an alias a request may call it by, chosen by whoever named the folder,
        and must not let a key limited to ``llama-*`` reach ``qwen/llama-tuned`` (and so
        the qwen base)."""
        return [self.spec.id] if self.found else [self.spec.id, *self.spec.aliases]

    @property
    def known_as(self) -> list[str]:
        """Every name a request may call the model by: ``names``, and a found adapter's
        folder name."""
        return [self.spec.id, *self.spec.aliases]

    def __post_init__(self) -> None:
        if self.spec.max_concurrent:
            self.slots = Slots(self.spec.max_concurrent)

    def respec(self, spec: ModelSpec) -> None:
        """Take a reloaded preset's ``spec``. A lease keeps the ``Slots`` it took its slot
        from, so a new ``max_concurrent`` cannot be miscounted by requests in flight."""
        if spec.max_concurrent != self.spec.max_concurrent:
            self.slots = Slots(spec.max_concurrent) if spec.max_concurrent else None
        self.spec = spec
        self.failures = 0  # a new spec gets its first start without a backoff

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def busy(self) -> bool:
        """Work in flight on the replica that serves it."""
        return self.replica is not None and self.replica.busy

    def note_request(self, now: float) -> None:
        """Count a request in the model's decaying demand (``request_rate``)."""
        self.demand = self.demand * math.exp((self.demand_at - now) / DEMAND_SECONDS) + 1.0
        self.demand_at = now

    def request_rate(self, now: float) -> float:
        """Recent requests per second, an exponentially weighted average over about
        ``DEMAND_SECONDS``."""
        return self.demand * math.exp((self.demand_at - now) / DEMAND_SECONDS) / DEMAND_SECONDS


class ModelRegistry:
    """Every model by name: ``entries`` (models with workers: iterating the registry
    gives these) and ``adapters`` (LoRA adapter models, served by their base's worker)."""

    def __init__(self, preset: Preset) -> None:
        self._numbers = itertools.count(1)
        self._numbered: dict[tuple[str, str, tuple[int, ...]], int] = {}
        self.entries: dict[str, ModelEntry] = {}
        self.adapters: dict[str, ModelEntry] = {}
        self.reconfigure(preset)

    def _index(self, default_model: str | None) -> None:
        self._every = {**self.entries, **self.adapters}
        self._aliases = {alias: e.id for e in self._every.values() for alias in e.spec.aliases}
        self._folded: dict[str, str] = {}
        for entry in self._every.values():
            for name in entry.known_as:
                self._folded[name.lower()] = entry.id
        self.default_model = default_model

    def _adapter(self, spec: ModelSpec, old: ModelEntry | None, found: bool = False,
                 registered: bool = False) -> ModelEntry:
        """The entry of adapter model ``spec``: ``old`` kept where it is the same adapter,
        its number kept while its name, its folder and the folder's files are (the engine
        caches by number: a folder rewritten in place must be loaded anew)."""
        assert spec.adapter is not None
        key = (spec.id, spec.adapter, stamp(spec.adapter))
        number = self._numbered.get(key) or self._numbered.setdefault(key, next(self._numbers))
        lora = LoraRef(name=spec.id, number=number, path=spec.adapter, pinned=spec.pinned)
        if old is not None and old.lora == lora:
            old.spec = spec
            return old
        try:
            rank: int | None = read_adapter(spec.adapter).rank
        except AdapterError:
            rank = None  # its requests are refused with the reason
        return ModelEntry(spec=spec, lora=lora, found=found, registered=registered, rank=rank)

    def reconfigure(self, preset: Preset) -> tuple[list[ModelEntry], list[ModelEntry]]:
        """Serve ``preset``'s models from now on: entries of models it keeps take its specs
        (``ModelEntry.respec``), others are made or dropped, names resolve by its aliases
        and default; adapters registered at run time stay while their base serves them and
        their names are free, and those found in an ``adapters_dir`` while their base keeps
        that folder. Returns the (added, removed) entries with workers; the caller stops
        the removed ones' workers and restarts those whose spec needs it.

        Refuses nothing (a reload checks ``preset`` before it calls this, and a failure
        half way would leave a mix of two presets): an adapter folder that no longer reads
        as one makes an adapter whose requests its base's worker refuses with the
        reason, as at a start."""
        old, old_adapters = self.entries, self.adapters
        self.entries = {name: old.get(name) or ModelEntry(spec=spec)
                        for name, spec in preset.models.items() if spec.base is None}
        for name, spec in preset.models.items():
            if name in old and spec.base is None and old[name].spec != spec:
                old[name].respec(spec)
        self.adapters = {name: self._adapter(spec, old_adapters.get(name))
                         for name, spec in preset.models.items() if spec.base is not None}
        self._index(preset.server.default_model)
        # Registered ones before found ones: a folder's alias must not take their names.
        for name, entry in old_adapters.items():
            if entry.registered and self._keeps(entry):
                self.adapters[name] = entry
                self._index(preset.server.default_model)
        for name, entry in old_adapters.items():  # found ones stay while their folder does
            if entry.found and name not in self.adapters:
                again = self._find(name)
                if again is not None and again.lora == entry.lora:
                    entry.spec = again.spec
                    self.adapters[name] = entry
        for name, entry in old_adapters.items():
            if self.adapters.get(name) is not entry:
                entry.removed = True
        removed = [e for name, e in old.items() if name not in self.entries]
        for entry in removed:
            entry.removed = True
        self._index(preset.server.default_model)
        return [e for name, e in self.entries.items() if name not in old], removed

    def _keeps(self, entry: ModelEntry) -> bool:
        """Whether a reloaded preset keeps registered adapter ``entry`` (its spec then made
        anew from its base's): its base still serves adapters of its rank with a batch
        slot left for unpinned ones, and the preset took none of its names."""
        assert entry.lora is not None and entry.spec.base is not None
        base = self.entries.get(entry.spec.base)
        try:
            self.check_adapter(entry.id, entry.spec.base, entry.spec.aliases,
                               entry.spec.pinned, entry.rank, folders=False)
        except APIError:
            return False
        assert base is not None
        entry.spec = self._registered_spec(base, entry.id, entry.lora.path,
                                           entry.spec.aliases, entry.spec.pinned)
        return True

    def check_adapter(self, name: str, base_id: str, aliases: list[str], pinned: bool,
                      rank: int | None = None, folders: bool = True) -> ModelEntry:
        """The base ``base_id`` (an exact id) if it may serve a new adapter model ``name``
        of ``rank``: it serves adapters, its batch keeps a slot free of pinned adapters,
        and no model is known by ``name`` or an alias in any case (409), nor, with
        ``folders``, would be found by it in an ``adapters_dir``. Raises the ``APIError``
        that names the adapter and the reason."""
        where = f"adapter '{name}'"
        names = [name, *aliases]
        folded = [n.lower() for n in names]
        if len(set(folded)) < len(folded):
            raise BadRequest(f"{where}: its aliases repeat a name", param="aliases",
                             code="invalid_value")
        taken = [n for n in names if n.lower() in self._folded
                 or (folders and self._holding(n))]
        if taken:
            raise APIError(f"{where}: a model is already known as '{taken[0]}'", status=409,
                           type="invalid_request_error",
                           param="name" if taken[0] == name else "aliases",
                           code="model_exists")
        base = self.entries.get(base_id)
        if base is None or base.removed:
            raise BadRequest(f"{where}: no model '{base_id}' to serve it (give the exact "
                             f"id of a base model: {', '.join(sorted(self.entries))})",
                             param="base", code="adapter_invalid")
        if not serves_adapters(base.spec):
            raise BadRequest(f"{where}: model '{base_id}' serves no adapters (its preset "
                             "entry needs max_loras or adapters_dir)", param="base",
                             code="adapter_invalid")
        assert base.spec.max_cpu_loras is not None and base.spec.max_lora_rank is not None
        if rank is not None and rank > base.spec.max_lora_rank:
            raise BadRequest(f"{where}: rank {rank} is above its base's max_lora_rank "
                             f"({base.spec.max_lora_rank})", param="path",
                             code="adapter_invalid")
        held = sum(a.spec.pinned for a in self.adapters_of(base))
        if pinned and held + 1 >= base.spec.max_cpu_loras:  # as shared.config refuses
            raise BadRequest(f"{where}: {held + 1} pinned adapters need max_cpu_loras above "
                             f"that on their base '{base.id}' (it is "
                             f"{base.spec.max_cpu_loras}), so the engine has room for the "
                             "others", param="pinned", code="adapter_invalid")
        return base

    def register(self, name: str, base_id: str, path: str, aliases: list[str],
                 pinned: bool, rank: int) -> ModelEntry:
        """Make the LoRA folder ``path`` (resolved, read: ``rank``) the adapter model
        ``name`` that ``base_id`` serves, once ``check_adapter`` passes."""
        base = self.check_adapter(name, base_id, aliases, pinned, rank)
        # A fresh number: the engine caches by number, and the folder may have changed
        # since an adapter of this name and path was dropped.
        self._numbered.pop((name, path, stamp(path)), None)
        spec = self._registered_spec(base, name, path, aliases, pinned)
        entry = self.adapters[name] = self._adapter(spec, None, registered=True)
        self._index(self.default_model)
        return entry

    def unregister(self, name: str) -> ModelEntry:
        """Drop registered adapter ``name`` (an exact id): 404 for an unknown name, 400
        for a model the preset declares or an ``adapters_dir`` holds."""
        entry = self.adapters.get(name) or self.entries.get(name)
        if entry is None:
            raise ModelNotFound(f"no adapter named '{name}' (give its exact id)",
                                param="name")
        if not entry.registered:
            raise BadRequest(f"model '{name}' was not registered with POST "
                             "/v1/models/adapters (" + ("the preset declares it"
                             if not entry.found else "its base's adapters_dir holds it")
                             + "): only such adapters are removed so", param="name",
                             code="invalid_value")
        self.drop(entry)
        return entry

    def drop(self, entry: ModelEntry) -> None:
        """Forget adapter ``entry`` if the registry still holds it."""
        if self.adapters.get(entry.id) is entry:
            del self.adapters[entry.id]
            entry.removed = True
            self._index(self.default_model)

    @staticmethod
    def _registered_spec(base: ModelEntry, name: str, path: str, aliases: list[str],
                         pinned: bool) -> ModelSpec:
        return msgspec.structs.replace(
            base.spec, id=name, aliases=list(aliases), base=base.id, adapter=path,
            adapters_dir=None, load_on_startup=False, pinned=pinned,
            priority=base.spec.priority)

    def __iter__(self) -> Iterator[ModelEntry]:
        return iter(self.entries.values())

    def serving(self, entry: ModelEntry) -> ModelEntry:
        """The model whose worker serves ``entry``'s requests: an adapter's base, else
        itself."""
        return self.entries[entry.spec.base] if entry.spec.base is not None else entry

    def names_of(self, model_id: str) -> list[str]:
        """The names keys' and budgets' globs match for the model (or adapter) ``model_id``
        (``ModelEntry.names``); an id no longer configured: itself."""
        entry = self.entries.get(model_id) or self.adapters.get(model_id)
        return entry.names if entry is not None else [model_id]

    def adapters_of(self, base: ModelEntry) -> list[ModelEntry]:
        return [a for a in self.adapters.values() if a.spec.base == base.id]

    def named(self, name: str) -> ModelEntry:
        """The model whose id or alias is exactly ``name`` (load, unload, preload: a name
        that only resembles a model's, or the default, must never unload it); else
        ``ModelNotFound`` (404)."""
        found = (self._every.get(name) or self._every.get(self._aliases.get(name, ""))
                 or self._find(name))
        if found is None:
            raise ModelNotFound(f"The model '{name}' does not exist (give its exact id or an "
                                f"alias). Available: {', '.join(sorted(self._every))}",
                                param="model")
        return found

    def _found_spec(self, base: ModelEntry, name: str) -> ModelSpec | None:
        """The spec of adapter ``name`` (``<base>/<folder>``) found in ``base``'s
        ``adapters_dir``; None where the folder went since it was looked for."""
        folder = name.rpartition("/")[2]
        path = folder_in(str(base.spec.adapters_dir), folder)
        if path is None:
            return None
        taken = folder.lower() in self._folded
        return msgspec.structs.replace(
            base.spec, id=name, aliases=[] if taken else [folder], base=base.id,
            adapter=str(path), adapters_dir=None, load_on_startup=False, pinned=False,
            priority=base.spec.priority)

    def _find(self, name: str, shown: Callable[[list[str]], bool] | None = None
              ) -> ModelEntry | None:
        """An adapter folder ``name`` names in a base's ``adapters_dir`` (``<base>/<folder>``,
        or ``<folder>`` alone where one base has it), made a model now (vLLM's
        filesystem resolver); None if there is none."""
        bases = self._holding(name)
        if len(bases) != 1:
            return None
        spec = self._found_spec(bases[0], f"{bases[0].id}/{name.rpartition('/')[2]}")
        if spec is None or spec.id in self._every:
            return None
        if shown is not None and not shown([spec.id]):  # a found one's ``names``: its id
            return None
        entry = self.adapters[spec.id] = self._adapter(spec, None, found=True)
        self._index(self.default_model)
        return entry

    def _holding(self, name: str) -> list[ModelEntry]:
        """The bases whose ``adapters_dir`` has the folder ``name`` names (``<base>/<folder>``
        or ``<folder>``)."""
        base_id, _, folder = name.rpartition("/")
        return [e for e in self.entries.values() if e.spec.adapters_dir is not None
                and (e.id == base_id if base_id else True) and not e.removed
                and folder_in(e.spec.adapters_dir, folder) is not None]

    def resolve(self, name: str | None,
                shown: Callable[[list[str]], bool] | None = None) -> ModelEntry:
        """Find the model a request names (exactly, by case, substring or prefix, else the
        default); raise ``ModelNotFound`` (404) if none fits, listing the models. With
        ``shown`` (a key limited to some models), only the models whose names it accepts
        exist: for matching, the default and the list alike, so no answer differs by a
        model the key may not know."""
        if name:
            found = self._match(name, shown)
            if found is not None:
                return self._every[found]
            self._no_such_adapter(name, shown)
        if self.default_model:
            default = self._match(self.default_model, shown)
            if default is not None:
                return self._every[default]
        if not name:
            raise ModelNotFound("no model named and no default_model configured",
                                param="model")
        listed = sorted(e.id for e in self._every.values() if shown is None or shown(e.names))
        raise ModelNotFound(f"The model '{name}' does not exist. Available: "
                            f"{', '.join(listed)}", param="model")

    def _no_such_adapter(self, name: str, shown: Callable[[list[str]], bool] | None) -> None:
        """A 404 for ``<base>/<folder>`` where that base has an ``adapters_dir`` but no such
        folder: it names a missing adapter, never the ``default_model`` (a typo, or a
        folder taken away, must not be answered by another model). For a key limited to
        some models, only where it may know the base or such a name."""
        base_id, slash, folder = name.partition("/")
        base = self.entries.get(base_id)
        if not slash or base is None or base.spec.adapters_dir is None or base.removed:
            return
        if shown is not None and not (shown(base.names) or shown([name])):
            return
        raise ModelNotFound(f"The model '{name}' does not exist: model '{base_id}' has no "
                            f"adapter folder '{folder}'", param="model",
                            code="adapter_not_found")

    def _match(self, name: str, shown: Callable[[list[str]], bool] | None = None) -> str | None:
        def known(owner: str) -> bool:
            return shown is None or shown(self._every[owner].names)

        if name in self._every and known(name):
            return name
        if name in self._aliases and known(self._aliases[name]):
            return self._aliases[name]
        folded = name.lower()
        if folded in self._folded and known(self._folded[folded]):
            return self._folded[folded]
        found = self._find(name, shown)
        if found is not None:
            return found.id
        hits = {owner for key, owner in self._folded.items() if folded in key and known(owner)}
        if len(hits) == 1:
            return hits.pop()
        if len(hits) > 1 and not self.default_model:
            raise ModelNotFound(f"The model name '{name}' is ambiguous: it matches "
                                f"{', '.join(sorted(hits))}", param="model",
                                code="model_ambiguous")
        if not hits:  # a versioned name (claude-sonnet-4-5-2025…) reaches its family's alias
            # ... but ``<base>/<folder>`` names an adapter, never its base
            prefixes = [key for key, owner in self._folded.items()
                        if folded.startswith(key) and known(owner)
                        and not folded[len(key):].startswith("/")]
            if prefixes:
                return self._folded[max(prefixes, key=len)]
        return None



class Lease:
    """Holds a model in use from resolution to the response's last byte.

    A leased model is never reaped or evicted. ``release`` is idempotent, so a streaming
    response can release in its generator's ``finally`` whatever path it ends by.
    """

    __slots__ = ("_held", "adapter", "batch", "entry", "keep_for", "slot")

    def __init__(self, entry: ModelEntry, adapter: ModelEntry | None = None,
                 batch: bool = False) -> None:
        self.entry = entry
        """The model whose worker serves the request (an adapter's base)."""
        self.adapter = adapter
        """The adapter model the request named, if it named one."""
        self.batch = batch
        """A batch's line: no one's demand (the model's eviction cost stays as it was)."""
        now = time.monotonic()
        if adapter is not None:
            adapter.last_used = now
            if not batch:
                adapter.note_request(now)
        self._held = True
        self.keep_for = 0.0
        """Seconds the model stays loaded after this request, whatever its idle limit (a
        non-admin key's ``keep_alive``)."""
        self.slot: Slots | None = None
        """Where the ``max_concurrent`` slot it holds came from (``Supervisor.acquire``)."""
        entry.leases += 1
        entry.last_used = now
        if batch:
            entry.batch_leases += 1
        else:
            entry.interactive_at = now
            entry.note_request(now)
            if entry.person_hook is not None:
                entry.person_hook(entry, True)

    @property
    def name(self) -> str:
        """The model the request is served as (its log line, usage row and response)."""
        return self.adapter.id if self.adapter is not None else self.entry.id

    def release(self) -> None:
        if self._held:
            self._held = False
            self.entry.leases -= 1
            self.entry.batch_leases -= self.batch
            self.entry.last_used = time.monotonic()
            if self.keep_for:
                self.entry.kept_until = max(self.entry.kept_until,
                                            self.entry.last_used + self.keep_for)
            if self.slot is not None:
                self.slot.give()
            entry, hook = self.entry, self.entry.person_hook
            if hook is not None and not self.batch and entry.leases == entry.batch_leases:
                hook(entry, False)  # the last person's request here is done

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
