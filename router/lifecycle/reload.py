"""Hot reload: read the preset file again and apply what changed, without a restart.

Triggers: ``POST /v1/config/reload`` (answers what changed), SIGHUP, and with
``modelyard serve --watch-config`` a change of the content of the file or of a file it
names (a model's ``chat_template`` file, the ``api_key_file``; looked at every second).
Reloads run one at a time. A file that does not load (unreadable, invalid, an unset
``${env:…}``, a model past its memory budget) changes nothing: the error names file,
model and key, and the running configuration stays.

Models, compared by their whole ``ModelSpec``:

- added: listed and served from now on; loaded at once if ``load_on_startup`` or in
  ``preload``, else on first use.
- removed: no name resolves to them any more (new requests get a 404); requests in
  flight finish (up to ``drain_timeout``), then the worker stops.
- changed: new requests resolve by the new spec at once. A change of router-only keys
  (``ROUTER_ONLY_FIELDS``: aliases, ttl, pinned, priority, …) applies to the running
  worker; any other keeps the old worker until its requests in flight are done, then
  stops it (new requests wait meanwhile), and a model that was loaded loads again.
- unchanged: untouched (same worker, same pid).
- an adapter registered at run time (``POST /v1/models/adapters``): kept while its base
  serves adapters of its rank and the preset takes none of its names; else dropped.

Server keys: ``RUNTIME_KEYS`` are read where they are used, so they apply at once; API
keys (``api_keys``, ``admin_api_keys``, ``api_key_file``'s content) are swapped in place:
a dropped key opens nothing at once, a new one opens at once (keys turned on included).
Turning keys off never applies while the router runs (``Keys.required`` is latched): the
dropped keys stop working, keys stay required, and ``api_keys`` is also listed in
``restart_required``. Any other key that differs is reported in ``restart_required`` and
otherwise ignored until the next start.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from router.access.admission import Keys
from router.errors import BadRequest, ModelNotFound
from router.lifecycle.supervisor import Supervisor
from router.workers.placement import check_budgets
from shared.adapters import folder_in
from shared.config import ConfigError, ModelSpec, Preset, ServerConfig
from shared.preset_loader import load_preset

log = logging.getLogger("modelyard.router")

RUNTIME_KEYS = frozenset({"ttl", "default_model", "max_loaded_models", "memory_budget_gib",
                          "max_queue_depth", "drain_timeout", "load_timeout", "send_timeout",
                          "swap_wait", "preload", "keep_alive_max",
                          "max_parked_models", "park_memory_gib", "park_quantum",
                          "loading_progress", "adapter_roots", "routing"})
"""Server keys a reload applies: everything that reads them reads the live value (the
server's ``routing`` is copied into each model's at load, which a reload swaps in)."""
KEY_KEYS = frozenset({"api_keys", "admin_api_keys", "api_key_file"})
WATCH_SECONDS = 1.0


class PresetDiff(msgspec.Struct, kw_only=True):
    """What differs between the running preset and a new one (``diff_presets``)."""

    added: list[str]
    removed: list[str]
    changed: list[str]
    unchanged: list[str]
    changed_keys: dict[str, list[str]]
    """Per changed model, the keys that differ."""
    applied: list[str]
    """Server keys that differ and apply at once (``RUNTIME_KEYS``)."""
    restart_required: list[str]
    """Server keys that differ and take effect only at the next start."""


def changed_fields(old: msgspec.Struct, new: msgspec.Struct) -> list[str]:
    """The fields of two Structs of one type whose values differ, in declaration order."""
    return [f for f in old.__struct_fields__ if getattr(old, f) != getattr(new, f)]


def diff_presets(old: Preset, new: Preset) -> PresetDiff:
    """Compare two presets model by model (whole ``ModelSpec``s) and key by key.
    API keys are compared by ``Reloader`` (a key file's content counts, not its name)."""
    changed_keys = {name: changed_fields(old.models[name], spec)
                    for name, spec in new.models.items()
                    if name in old.models and old.models[name] != spec}
    server = [k for k in changed_fields(old.server, new.server) if k not in KEY_KEYS]
    return PresetDiff(
        added=[n for n in new.models if n not in old.models],
        removed=[n for n in old.models if n not in new.models],
        changed=list(changed_keys),
        unchanged=[n for n in new.models if n in old.models and n not in changed_keys],
        changed_keys=changed_keys,
        applied=[k for k in server if k in RUNTIME_KEYS],
        restart_required=[k for k in server if k not in RUNTIME_KEYS])


class Reloader:
    """Reloads the preset file ``path`` into a running router (see the module's doc).

    ``overrides`` are the server keys the command line set (``--port`` …): they win over
    the file at every reload, as they did at start.
    """

    def __init__(self, path: str, preset: Preset, supervisor: Supervisor, keys: Keys,
                 overrides: dict[str, Any] | None = None) -> None:
        self.path = path
        self.watched = watched_files(path, preset)
        self.models: dict[str, ModelSpec] = dict(preset.models)
        self.supervisor = supervisor
        self.keys = keys
        self.overrides = overrides or {}
        self._lock = asyncio.Lock()
        self._watcher: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._signal = False

    # -- one reload --------------------------------------------------------------------
    async def reload(self, trigger: str) -> dict[str, Any]:
        """Load the file and apply it; the answer of ``POST /v1/config/reload``. A file
        that does not load raises ``BadRequest`` (400) and changes nothing."""
        async with self._lock:
            try:
                preset, keys = await asyncio.to_thread(self._read)
                diff = self._apply(preset, keys)
                self.watched = watched_files(self.path, preset)
            except ConfigError as err:
                log.error("config reload (%s) refused; the running config stays: %s",
                          trigger, err)
                raise BadRequest(str(err), code="invalid_config") from None
        log.info("config reloaded from %s (%s): added %s, removed %s, changed %s, "
                 "%d unchanged; server keys applied %s, needing a restart %s", self.path,
                 trigger, diff.added, diff.removed, diff.changed_keys, len(diff.unchanged),
                 diff.applied, diff.restart_required)
        return {"source": self.path, **msgspec.to_builtins(diff)}

    def _read(self) -> tuple[Preset, Keys]:
        """The file's preset with the command line's overrides, and its keys (a thread:
        files are read)."""
        preset = load_preset(self.path)
        for key, value in self.overrides.items():
            setattr(preset.server, key, value)
        return preset, Keys.load(preset.server, preset.source)

    def _apply(self, new: Preset, keys: Keys) -> PresetDiff:
        """Check everything that can refuse ``new``, then switch to it, with no ``await``:
        a request resolves by the old preset or the new one, never a mix. All or nothing:
        every check (the file and the adapter folders it declares were read by
        ``load_preset``; memory budgets, ``preload``, an admin key left) runs before
        anything switches, and the switch (``_switch``) refuses nothing."""
        live = self.supervisor.server
        diff = diff_presets(Preset(server=live, models=self.models), new)
        after = msgspec.structs.replace(live, **{k: getattr(new.server, k)
                                                 for k in diff.applied})
        try:
            check_budgets(new.models.values(), after, self.supervisor.placer.gpus)
        except ConfigError as err:
            raise ConfigError(f"{new.source}: {err}") from None
        self._check_preload(new, after)
        new_keys = keys.preset_digests != self.keys.preset_digests
        if new_keys and not self.keys.keeps_an_admin(keys):
            raise ConfigError(f"{new.source}: [server]: keys 'api_keys', "
                              "'admin_api_keys': this would leave no admin key (the "
                              "named ones included); make an admin key first, or "
                              "restart with this file")
        self._switch(new, keys if new_keys else None, diff, after)
        return diff

    def _switch(self, new: Preset, keys: Keys | None, diff: PresetDiff,
                after: ServerConfig) -> None:
        """Serve ``new`` (checked by ``_apply``) from now on: its keys (``keys``; None:
        unchanged), runtime server keys and models. Refuses nothing: ``reconfigure``
        takes an adapter folder that no longer reads as one whose requests are refused,
        and a ``preload`` name whose folder went since the check loads nothing."""
        live = self.supervisor.server
        if keys is not None:
            self.keys.set_preset(keys)
            diff.applied.append("api_keys")
            if self.keys.required and not keys.preset_digests[0] | keys.preset_digests[1]:
                # Keys stay required: turning them off takes a restart (fail closed).
                diff.restart_required.append("api_keys")
                log.warning("config reload: the preset has no API keys now; the ones it "
                            "dropped open nothing, and keys stay required until a restart")
        for key in diff.applied:
            if key != "api_keys":
                setattr(live, key, getattr(after, key))
        registry = self.supervisor.registry
        registered = [e for e in registry.adapters.values() if e.registered]
        added, removed = registry.reconfigure(Preset(server=live, models=new.models))
        for entry in registered:
            if entry.removed:
                log.warning("config reload: registered adapter %s dropped (its base %s "
                            "serves it no more, or the preset took one of its names)",
                            entry.id, entry.spec.base)
        self.models = dict(new.models)
        preload = set()
        for name in live.preload:
            try:
                preload.add(registry.serving(registry.named(name)).id)
            except ModelNotFound:
                log.warning("config reload: preload %s: its adapter folder went since the "
                            "file was checked; nothing is loaded for it", name)
        for entry in removed:
            self.supervisor.retire(entry)
        for entry in added:
            if entry.spec.load_on_startup or entry.id in preload:
                self.supervisor.start_loading(entry)
        for name in diff.changed:
            if name not in registry.entries:
                continue  # an adapter model: its new folder has a new number already
            changed = registry.entries[name]
            self.supervisor.refresh(changed, load=changed.spec.load_on_startup
                                    or name in preload)

    @staticmethod
    def _check_preload(new: Preset, server: ServerConfig) -> None:
        """Each ``preload`` name names a model of ``new`` as it would at a start
        (``ModelRegistry.named``): an exact id or alias, or an adapter folder a base's
        ``adapters_dir`` holds (``<base>/<folder>``, or ``<folder>`` where one base has
        it)."""
        names = {n for spec in new.models.values() for n in (spec.id, *spec.aliases)}
        for name in server.preload:
            base_id, _, folder = name.rpartition("/")
            holding = [spec.id for spec in new.models.values()
                       if spec.adapters_dir is not None and base_id in ("", spec.id)
                       and folder_in(spec.adapters_dir, folder) is not None]
            if name not in names and len(holding) != 1:
                raise ConfigError(f"{new.source}: [server]: key 'preload': no model or "
                                  f"alias named '{name}' (its exact id or alias, as at a "
                                  "start), nor an adapter folder of that name")

    # -- triggers ----------------------------------------------------------------------
    def start(self, watch: bool) -> None:
        """Reload on SIGHUP (when this thread may set signal handlers) and, with
        ``watch``, when the file's content changes."""
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)
            self._signal = True
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread
            log.info("config reload on SIGHUP is off: signals belong to another thread")
        if watch:
            self._watcher = asyncio.create_task(self._watch(), name="config-watch")

    def close(self) -> None:
        if self._signal:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._signal = False
        if self._watcher is not None:
            self._watcher.cancel()
        for task in self._tasks:
            task.cancel()

    def _on_sighup(self) -> None:
        self._in_background(self._logged("SIGHUP"))

    def _in_background(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    async def _logged(self, trigger: str) -> None:
        """A reload nobody waits for: its outcome goes to the log only."""
        try:
            await self.reload(trigger)
        except BadRequest:
            pass  # a file that does not load: reload() logged why
        except Exception:  # a bug must not end the watch or leave a task unretrieved
            log.exception("config reload (%s) failed", trigger)

    async def _watch(self, interval: float = WATCH_SECONDS) -> None:
        """Reload when the content of the preset file, or of a file it names (``watched``:
        a model's ``chat_template`` file, the ``api_key_file``), changes: size and mtime
        are looked at every ``interval``, the content hashed only when they move (a
        ``touch`` alone does not reload)."""
        seen = await asyncio.to_thread(_look, self.watched, {})
        while True:
            await asyncio.sleep(interval)
            now = await asyncio.to_thread(_look, self.watched, seen)
            changed = []
            for path, look in now.items():
                last = seen.get(path, look)  # a file new to the list: its reload read it
                if look is None:
                    now[path] = last  # being replaced, or gone: keep what was seen
                elif last is None or look[2] != last[2]:
                    changed.append(path)
            seen = now
            if changed:
                await self._logged("file changed" if changed == [self.path] else
                                   f"changed: {', '.join(changed)}")


Fingerprint = tuple[int, int, bytes]


def watched_files(path: str, preset: Preset) -> list[str]:
    """The files a reload of ``path`` reads: the preset, its models' chat templates, the
    API key file."""
    key_file = preset.server.api_key_file
    return [path, *preset.read_files, *([key_file] if key_file else [])]


def _look(paths: list[str], seen: dict[str, Fingerprint | None]
          ) -> dict[str, Fingerprint | None]:
    """Each path's fingerprint, ``None`` for one that cannot be read (no file yet: any that
    appears is a change; being replaced, or gone: looked at again next time)."""
    out: dict[str, Fingerprint | None] = {}
    for path in paths:
        try:
            out[path] = fingerprint(path, seen.get(path))
        except OSError as err:
            log.debug("config watch: %s: %s", path, err)
            out[path] = None
    return out


def fingerprint(path: str, last: Fingerprint | None,
                digest: Callable[[bytes], Any] = hashlib.sha256) -> Fingerprint:
    """``(mtime_ns, size, sha256)`` of ``path``; the content is read only when mtime or
    size differ from ``last``."""
    st = os.stat(path)
    if last is not None and (st.st_mtime_ns, st.st_size) == last[:2]:
        return last
    return st.st_mtime_ns, st.st_size, digest(Path(path).read_bytes()).digest()
