"""The LoRA adapters loaded in one engine: each checked against the model and loaded once,
however many requests ask for it at once.

Imports no vLLM: the engine hands ``AdapterPool`` its ``load``/``unload``/``pin``/``listed``
calls (``worker.engine``), so the pool's bookkeeping is tested without an engine.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from shared.adapters import AdapterError, read_adapter
from shared.protocol import AdapterState, LoraRef

log = logging.getLogger("modelyard.worker")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ModelShape:
    """What an adapter's tensors must fit: the base's layer count and the sizes its
    projections take in and give out."""

    layers: int
    sizes: frozenset[int]


def check_adapter(path: str, max_rank: int, shape: ModelShape | None) -> None:
    """Raise ``AdapterError`` unless the adapter at ``path`` fits a model of ``shape``
    (None: no model to fit, the synthetic engine's) and an engine whose ``max_lora_rank``
    is ``max_rank``."""
    info = read_adapter(path)
    if info.rank > max_rank:
        raise AdapterError(f"rank {info.rank} is above the base's max_lora_rank ({max_rank}); "
                           "raise it in the preset")
    weights = Path(path) / "adapter_model.safetensors"
    if shape is None or not weights.is_file():
        return  # a .bin (pickle) file: vLLM reads and checks it itself
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as tensors:
            shapes = {name: tensors.get_slice(name).get_shape()
                      for name in tensors.keys()}  # noqa: SIM118  # not iterable
    except Exception as err:  # noqa: BLE001  # safetensors raises its own kinds for a bad file
        raise AdapterError(f"cannot read {weights.name}: {err}") from None
    lora = {name: dims for name, dims in shapes.items() if ".lora_A." in name or ".lora_B." in name}
    if not lora:
        raise AdapterError(f"{weights.name} holds no LoRA weights")
    for name, dims in sorted(lora.items()):
        layer = _LAYER.search(name)
        if layer and int(layer.group(1)) >= shape.layers:
            raise AdapterError(f"tensor {name} is for layer {layer.group(1)}, but the base "
                               f"has {shape.layers} layers: made for another model")
        if len(dims) != 2:
            raise AdapterError(f"tensor {name} has shape {dims}, not a matrix")
        size = dims[1] if ".lora_A." in name else dims[0]
        if size not in shape.sizes:
            raise AdapterError(f"tensor {name} has shape {dims}, which no projection of the "
                               "base takes: made for another model")


class AdapterPool:
    """Adapters in the engine, least recently used first; ``hold`` before a request and
    ``release`` after it.

    The pool, not the engine's own LRU, decides what leaves: vLLM loads an adapter it
    let go again from its folder inside an engine step, and an error there (the folder
    deleted or half rewritten since) kills the engine under every request of the base.
    So an adapter a request runs with never leaves while it runs: an unload waits for
    its requests to end, and room for a new adapter is made from idle ones only (with
    none idle, the load waits for a request to end). Loads, unloads and listings take
    turns (``_turn``), so the count the engine holds is always known.
    """

    def __init__(self, check: Callable[[LoraRef], Awaitable[None]],
                 load: Callable[[LoraRef], Awaitable[None]],
                 unload: Callable[[int], Awaitable[None]],
                 listed: Callable[[], Awaitable[set[int]]], *, capacity: int) -> None:
        self._check, self._load, self._unload, self._listed = check, load, unload, listed
        self.capacity = capacity
        """Adapters the engine keeps (``max_cpu_loras``): past it, vLLM lets its least
        recently used go."""
        self._loaded: collections.OrderedDict[int, AdapterState] = collections.OrderedDict()
        self._loading: dict[int, asyncio.Task[None]] = {}
        self._loads: dict[int, int] = {}
        self._users: collections.Counter[int] = collections.Counter()
        """Requests running with each adapter (``hold`` to ``release``)."""
        self._leaving: set[int] = set()
        """Unloaded while requests ran with them: still in the engine until they end."""
        self._turn = asyncio.Lock()
        self._freed = asyncio.Event()
        """Set when a request ends: a load waiting for room looks again."""
        self._later: set[asyncio.Task[None]] = set()
        self.refs: dict[int, LoraRef] = {}
        """Every adapter loaded since the engine started, by number (a wake reloads them)."""

    async def hold(self, ref: LoraRef) -> None:
        """``ensure`` ``ref``, and keep it in the engine until ``release``."""
        self._users[ref.number] += 1
        try:
            await self.ensure(ref)
        except BaseException:
            self.release(ref.number)
            raise

    @contextlib.asynccontextmanager
    async def held(self, ref: LoraRef) -> AsyncIterator[None]:
        """``hold`` ``ref`` for the block, then ``release`` it."""
        await self.hold(ref)
        try:
            yield
        finally:
            self.release(ref.number)

    def release(self, number: int) -> None:
        """A request that ran with adapter ``number`` ended (``hold``)."""
        self._users[number] -= 1
        if self._users[number] > 0:
            return
        del self._users[number]
        self._freed.set()
        if number in self._leaving:
            task = asyncio.get_running_loop().create_task(self._unload_idle(number))
            self._later.add(task)
            task.add_done_callback(self._later.discard)

    async def ensure(self, ref: LoraRef) -> None:
        """Load ``ref`` unless it is loaded; concurrent callers share one load, and all see
        its ``AdapterError``."""
        if ref.number in self._loaded:
            self._loaded.move_to_end(ref.number)
            return
        task = self._loading.get(ref.number)
        if task is None:
            task = asyncio.ensure_future(self._load_one(ref))
            self._loading[ref.number] = task
            task.add_done_callback(lambda _: self._loading.pop(ref.number, None))
        await asyncio.shield(task)  # a caller that leaves does not cancel the others' load

    async def _load_one(self, ref: LoraRef) -> None:
        started = time.perf_counter()
        await self._check(ref)
        async with self._turn:
            if ref.number not in self._leaving:  # (one leaving is in the engine still)
                await self._make_room()
            await self._load(ref)
            self._leaving.discard(ref.number)
            self.refs[ref.number] = ref
            self._loads[ref.number] = self._loads.get(ref.number, 0) + 1
            seconds = time.perf_counter() - started
            self._loaded[ref.number] = AdapterState(
                number=ref.number, name=ref.name, load_seconds=seconds, pinned=ref.pinned,
                loads=self._loads[ref.number])
            log.info("adapter %s (%d) loaded in %.2f s", ref.name, ref.number, seconds)
            await self._sync()

    async def _make_room(self) -> None:
        """Unload idle adapters, least recently used first, until the engine has room for
        one more; with none idle, wait for a request to end. Holds ``_turn``."""
        while True:
            for number in [n for n in self._leaving if not self._users[n]]:
                self._leaving.discard(number)
                await self._unload(number)
            if len(self._loaded) + len(self._leaving) < self.capacity:
                return
            idle = next((n for n, state in self._loaded.items()
                         if not state.pinned and not self._users[n]), None)
            if idle is None:
                self._freed.clear()
                await self._freed.wait()
                continue
            del self._loaded[idle]
            await self._unload(idle)

    async def _unload_idle(self, number: int) -> None:
        """Unload leaving adapter ``number`` now that its last request ended."""
        async with self._turn:
            if number not in self._leaving or self._users[number]:
                return  # loaded again, or held again, meanwhile
            self._leaving.discard(number)
            try:
                await self._unload(number)
            except Exception as err:  # noqa: BLE001  # the engine's refusal: the LRU keeps it
                log.warning("adapter %d: not unloaded: %s", number, err)

    async def _sync(self) -> None:
        """Forget what the engine let go. Holds ``_turn``."""
        present = await self._listed()
        for number in [n for n in self._loaded if n not in present]:
            del self._loaded[number]
        self._leaving &= present

    async def apply(self, load: list[LoraRef], unload: list[int]) -> list[AdapterState]:
        """Load, then unload, as an admin asked; the adapters loaded after. An adapter that
        requests still run with leaves the engine when the last ends."""
        for ref in load:
            await self.ensure(ref)
        if not unload and self._turn.locked():
            return self.loaded  # a listing while a load waits for room: as known now
        async with self._turn:
            for number in unload:
                if self._loaded.pop(number, None) is None:
                    continue
                if self._users[number]:
                    self._leaving.add(number)
                else:
                    await self._unload(number)
            await self._sync()
        return self.loaded

    async def reload_all(self) -> None:
        """Load every loaded adapter again (after a sleep, whose wake may not restore
        them: vLLM #53888)."""
        async with self._turn:
            for number in [n for n in self._leaving if not self._users[n]]:
                self._leaving.discard(number)  # its requests ended: it goes now
                await self._unload(number)
            for number in list(self._loaded):
                await self._unload(number)
                await self._load(self.refs[number])
            await self._sync()

    @property
    def loaded(self) -> list[AdapterState]:
        return list(self._loaded.values())


def adapter_error(ref: LoraRef, err: AdapterError) -> tuple[str, int, str]:
    """The message, status and code a request for a bad adapter gets."""
    missing = str(err).startswith("no adapter folder")
    return (refusal(ref, err), 404 if missing else 400,
            "adapter_not_found" if missing else "adapter_invalid")


def refusal(ref: LoraRef, err: Exception) -> str:
    """``err`` as the client of a request for ``ref`` reads it: naming the adapter, and
    its folder by its last component only (a key may use an adapter without knowing
    where its files lie: ``root`` is an admin's). The worker's log has the whole path."""
    text = str(err)
    for path in sorted({ref.path, os.path.realpath(ref.path)}, key=len, reverse=True):
        text = text.replace(path, f".../{os.path.basename(path)}")
    return f"adapter '{ref.name}': {text}"
