"""LoRA adapters as folders: what a preset's ``adapter`` and a base's ``adapters_dir``
name, read without an engine (the router sizes a base's engine from the ranks and checks
names; the worker checks an adapter's tensors against its model before vLLM loads it).

An adapter folder is what peft's ``save_pretrained`` writes: ``adapter_config.json`` and
``adapter_model.safetensors`` (or ``.bin``).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

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


MAX_CONFIG_BYTES = 1 << 20
"""The largest ``adapter_config.json`` read (peft writes about 1 KiB): a larger one is
refused unread, so a folder cannot make the router hold or parse megabytes."""

WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")

Count = Annotated[int, msgspec.Meta(ge=1)]


class LoraConfig(msgspec.Struct, kw_only=True):
    """The fields of peft's ``LoraConfig`` (its ``adapter_config.json``) the router and
    the workers read, typed: a value of another type is refused naming its field
    (``$.lora_alpha``). Fields not listed are peft's own and are ignored."""

    peft_type: str = "LORA"
    r: Count
    lora_alpha: int | float | None = None
    """``None``: the rank (peft's scale 1)."""
    target_modules: str | list[str] | None = None
    """A regular expression (``str``) or module names; ``None``: peft's per-model default."""
    base_model_name_or_path: str | None = None
    modules_to_save: list[str] | None = None
    bias: str = "none"
    use_dora: bool = False
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    layers_to_transform: int | list[int] | None = None
    rank_pattern: dict[str, int] | None = None
    alpha_pattern: dict[str, int | float] | None = None


@dataclass(frozen=True)
class AdapterInfo:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str | None


def read_adapter(path: str | Path) -> AdapterInfo:
    """``path``'s ``adapter_config.json``, checked to be a LoRA with weights beside it.
    Raises ``AdapterError`` (naming the file, and the field for a value of a wrong type)
    and nothing else, whatever the folder holds."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"no adapter folder at {folder}")
    name = folder / "adapter_config.json"
    try:
        config = msgspec.json.decode(_read_config(name), type=LoraConfig)
    except msgspec.DecodeError as err:
        raise AdapterError(f"{name} is not JSON: {err}") from None
    except msgspec.ValidationError as err:
        raise AdapterError(f"{name}: {err}") from None
    except RecursionError:  # msgspec skips an unknown field by recursion
        raise AdapterError(f"{name} is not JSON peft writes: nested too deep") from None
    if config.peft_type.upper() != "LORA":
        raise AdapterError(f"{folder} is a {config.peft_type} adapter; only LoRA adapters "
                           "are served")
    if not any((folder / weights).is_file() for weights in WEIGHTS):
        raise AdapterError(f"{folder} has no adapter_model.safetensors")
    targets = config.target_modules or ()
    return AdapterInfo(rank=config.r, alpha=float(config.lora_alpha or config.r),
                       target_modules=(targets,) if isinstance(targets, str)
                       else tuple(sorted(targets)),
                       base_model=config.base_model_name_or_path)


def _read_config(path: Path) -> bytes:
    """The bytes of the regular file ``path``, at most ``MAX_CONFIG_BYTES``; else
    ``AdapterError``. Opened without blocking: a FIFO in its place never hangs the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise AdapterError(f"cannot read {path}: {err.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise AdapterError(f"{path} is not a file")
        data = b""
        while len(data) <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as err:
        raise AdapterError(f"cannot read {path}: {err.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{path} is larger than {MAX_CONFIG_BYTES >> 10} KiB: no "
                           "adapter_config.json peft writes is")
    if not data.strip():
        raise AdapterError(f"{path} is empty")
    return data


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
    try:
        root = Path(adapters_dir).resolve()
        found = (root / name).resolve()
        if found.parent != root or not (found / "adapter_config.json").is_file():
            return None
    except (OSError, RuntimeError):  # a loop of links (RuntimeError before Python 3.13)
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
