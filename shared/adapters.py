"""LoRA adapters as folders: what a preset's ``adapter`` and a base's ``adapters_dir``
name, read without an engine (the router sizes a base's engine from the ranks and checks
names; the worker checks an adapter's tensors against its model before vLLM loads it).

An adapter folder is what peft's ``save_pretrained`` writes: ``adapter_config.json`` and
``adapter_model.safetensors`` (or ``.bin``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 accepts."""

DEFAULT_MAX_LORAS = 4
"""Adapters one engine step may mix (vLLM's ``max_loras``) unless the base says."""

DEFAULT_MAX_CPU_LORAS = 32
"""Adapters an engine keeps loaded, least recently used out (``max_cpu_loras``)."""

FOLDER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""A folder in an ``adapters_dir`` that a request may name: one path component, no
``..``, no separators, so no name reaches outside the folder."""


class AdapterError(ValueError):
    """An adapter folder that cannot be served; the message says why."""


@dataclass(frozen=True)
class AdapterInfo:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str | None


def read_adapter(path: str | Path) -> AdapterInfo:
    """``path``'s ``adapter_config.json``, checked to be a LoRA with weights beside it."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"no adapter folder at {folder}")
    try:
        config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    except OSError as err:
        raise AdapterError(f"cannot read {folder}/adapter_config.json: {err.strerror}") from None
    except ValueError as err:
        raise AdapterError(f"{folder}/adapter_config.json is not JSON: {err}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{folder}/adapter_config.json is not a JSON object")
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise AdapterError(f"{folder} is a {kind} adapter; only LoRA adapters are served")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{folder}/adapter_config.json has no rank 'r' (got {rank!r})")
    if not any((folder / name).is_file() for name in
               ("adapter_model.safetensors", "adapter_model.bin")):
        raise AdapterError(f"{folder} has no adapter_model.safetensors")
    targets = config.get("target_modules") or ()
    return AdapterInfo(rank=rank, alpha=float(config.get("lora_alpha") or rank),
                       target_modules=tuple([targets] if isinstance(targets, str)
                                            else sorted(str(t) for t in targets)),
                       base_model=config.get("base_model_name_or_path"))


def stamp(path: str | Path) -> tuple[int, ...]:
    """When and how big ``path``'s adapter files were last written: a folder rewritten in
    place (a new training run) gets another stamp; () where nothing reads."""
    found: list[int] = []
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        try:
            info = (Path(path) / name).stat()
        except OSError:
            continue
        found += [info.st_mtime_ns, info.st_size]
    return tuple(found)


def rank_cap(ranks: list[int]) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds every rank (at least 16,
    vLLM's default, so adding a small adapter later never restarts the base)."""
    needed = max([16, *ranks])
    for cap in LORA_RANKS:
        if cap >= needed:
            return cap
    raise AdapterError(f"rank {needed} is above vLLM's largest max_lora_rank "
                       f"({LORA_RANKS[-1]})")


def folder_in(adapters_dir: str | Path, name: str) -> Path | None:
    """The adapter folder ``name`` names inside ``adapters_dir``, or None: a name that is
    not one plain path component, or whose folder (links followed) lies outside the
    directory, names nothing."""
    if not FOLDER_NAME.match(name) or name in (".", ".."):
        return None
    root = Path(adapters_dir).resolve()
    found = (root / name).resolve()
    if found.parent != root or not (found / "adapter_config.json").is_file():
        return None
    return found


def folders(adapters_dir: str | Path) -> dict[str, Path]:
    """Every adapter folder in ``adapters_dir`` now, by name."""
    try:
        names = sorted(p.name for p in Path(adapters_dir).iterdir())
    except OSError:
        return {}
    return {name: path for name in names if (path := folder_in(adapters_dir, name))}


def within(path: str | Path, roots: list[str]) -> bool:
    """Whether ``path`` (links followed) lies inside one of ``roots``."""
    real = Path(path).resolve()
    return any(real.is_relative_to(Path(root).resolve()) for root in roots)
