"""Reading a preset (``shared.config``'s schema) from YAML or INI.

YAML::

    server:   {port: 8080, default_model: smollm2}
    defaults: {device: cpu}          # applied to every model ("*" is accepted too)
    models:
      smollm2: {model: "builtin:smollm2", aliases: [smol]}

INI (like llama-server's presets): a ``[server]`` section, a ``[*]`` section of model
defaults, and one section per model; lists are comma-separated.

String values may name environment variables, so a preset can be shared without its
secrets: ``${env:HF_TOKEN}``, or ``${env:HF_HOME:-/srv/hf}`` with a default; ``$${``
stands for a literal ``${``. A variable that is not set and has no default is an error.

Every problem is reported once, at load, as a ``ConfigError`` naming the file, the model
and the key.
"""

from __future__ import annotations

import configparser
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from shared.adapters import (
    DEFAULT_MAX_CPU_LORAS,
    DEFAULT_MAX_LORAS,
    AdapterError,
    AdapterInfo,
    rank_cap,
    read_adapter,
)
from shared.config import (
    ADAPTER_KEYS,
    ConfigError,
    ModelSpec,
    Preset,
    ServerConfig,
    auto_tool_calls,
    parse_cores,
)

_LIST_KEYS = ("aliases", "gpus", "trusted_proxies", "preload", "api_keys",  # comma-separated
              "admin_api_keys", "adapter_roots")                         # in INI
_INI_TABLES = ("sampling_defaults", "replicas", "routing")  # INI: "replicas.max = 2"
_ENV_RE = re.compile(r"\$(\$)?\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_AT_RE = re.compile(r"\s*- at `\$((?:\.\w+|\[\d+\])*)`")


def _explain(err: msgspec.ValidationError) -> tuple[str, str | None]:
    """Split msgspec's message into (reason, key)."""
    text = str(err)
    m = _AT_RE.search(text)
    reason = _AT_RE.sub("", text)
    unknown = re.search(r"unknown field `([^`]+)`", text)
    key = m.group(1).lstrip(".") if m else None
    if unknown:  # at a nested table's key: its path first
        return "unknown key", f"{key}.{unknown.group(1)}" if key else unknown.group(1)
    return reason, key or None


def _convert(data: Any, kind: type, where: str) -> Any:
    try:
        return msgspec.convert(data, kind, strict=False)
    except msgspec.ValidationError as err:
        reason, key = _explain(err)
        raise ConfigError(f"{where}: key '{key}': {reason}" if key else f"{where}: {reason}") from None


def build_preset(raw: dict[str, Any], source: str = "<preset>") -> Preset:
    """Validate a preset given as plain data (already parsed from YAML or INI)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    unknown = set(raw) - {"server", "defaults", "*", "models"}
    if unknown:
        raise ConfigError(f"{source}: unknown top-level key '{min(unknown)}' "
                          "(expected server, defaults, models)")
    server = _convert(_off_word(raw.get("server") or {}, f"{source}: [server]"), ServerConfig,
                      f"{source}: [server]")
    server.adapter_roots = [str(_preset_path(root, source).resolve())
                            for root in server.adapter_roots]
    defaults = raw.get("defaults") or raw.get("*") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{source}: 'defaults' must be a mapping")
    models_raw = raw.get("models") or {}
    if not isinstance(models_raw, dict) or not models_raw:
        raise ConfigError(f"{source}: 'models' must name at least one model")
    models: dict[str, ModelSpec] = {}
    adapters: dict[str, dict[str, Any]] = {}
    read_files: list[str] = []
    for name, body in models_raw.items():
        name = str(name)
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: model '{name}': must be a mapping of keys")
        if "base" in body:  # an adapter model: made from its base's spec below
            adapters[name] = body
            continue
        where = f"{source}: model '{name}'"
        merged = _off_word({**defaults, **body, "id": name}, where)
        merged = _replicas_and_routing(merged, server, where)
        models[name] = _convert(merged, ModelSpec, where)
        if models[name].backend is None:
            models[name].backend = server.backend
        _check_placement(models[name], merged, where)
        template = _read_template(models[name], source)
        if template is not None and template not in read_files:
            read_files.append(template)
    _add_adapters(models, adapters, source)
    _check_names(models, server, source)
    return Preset(server=server, models=models, source=source, read_files=read_files)


def _replicas_and_routing(body: dict[str, Any], server: ServerConfig,
                          where: str) -> dict[str, Any]:
    """``body`` with ``replicas: N`` written out as ``{min: N, max: N}`` and its
    ``routing`` keys laid over the server's (a model that names only ``strategy`` keeps
    the server's thresholds)."""
    out = dict(body)
    count = out.get("replicas")
    if isinstance(count, bool):  # YAML's yes/no: a number was meant, or a typo
        raise ConfigError(f"{where}: key 'replicas': expected a number or "
                          "{min, max, idle, up_wait, up_after, cooldown, placement}")
    if isinstance(count, str):  # INI's values are text; YAML's "2" is taken as well
        try:
            count = int(count.strip())
        except ValueError:
            raise ConfigError(f"{where}: key 'replicas': expected a number or "
                              f"{{min, max, ...}}, got \"{count}\"") from None
    if isinstance(count, int):
        if count < 1:  # "replicas: 0" would be a model that can never serve
            raise ConfigError(f"{where}: key 'replicas': expected at least 1 (scale to "
                              "zero with replicas.min: 0)")
        out["replicas"] = {"min": count, "max": count}
    routing = out.get("routing")
    if routing is None or isinstance(routing, dict):
        out["routing"] = {**msgspec.to_builtins(server.routing), **(routing or {})}
    return out


def _check_placement(spec: ModelSpec, body: dict[str, Any], where: str) -> None:
    """``replicas.placement`` only where it places something: a ``backend: ray`` model's
    replicas over the cluster's nodes. A local model's replicas all run on this host, so
    the key there (written in the model or its defaults) would promise what nothing does."""
    given = body.get("replicas")
    if isinstance(given, dict) and "placement" in given and spec.backend != "ray":
        raise ConfigError(f"{where}: key 'replicas.placement': places replicas over a Ray "
                          "cluster's nodes, and this model's backend is "
                          f"'{spec.backend or 'local'}' (its replicas share this host's "
                          "cores); leave the key out or use backend: ray")


def _check_replicas(spec: ModelSpec, source: str) -> None:
    """``replicas`` that can be served: ``min <= max``, a core and a GPU per replica
    where the model names them (else a core each among this host's: a local CPU model's
    replicas share the router's cores), no scale to zero for a pinned model."""
    where = f"{source}: model '{spec.id}'"
    wanted = spec.replicas
    if wanted.min > wanted.max:
        raise ConfigError(f"{where}: key 'replicas.min': {wanted.min} is above "
                          f"replicas.max ({wanted.max})")
    if wanted.min == 0 and spec.pinned and spec.base is None:  # an adapter's: in its engine
        raise ConfigError(f"{where}: key 'replicas.min': 0 stops the model when idle, "
                          "which a pinned model never is; set min to 1 or drop 'pinned'")
    if spec.cpu_cores is not None and spec.device == "cpu":
        cores = len(parse_cores(spec.cpu_cores))  # checked by _check_names before
        if cores < wanted.max:
            raise ConfigError(f"{where}: key 'replicas.max': {wanted.max} replicas need a "
                              f"core each, and cpu_cores \"{spec.cpu_cores}\" has {cores} "
                              "(replicas never share cores)")
    if spec.device == "cuda" and wanted.max > 1 and spec.backend != "ray":  # Ray: its own
        gpus = len(spec.gpus or [0])
        if (gpus < wanted.max or gpus % wanted.max
                or gpus // wanted.max < spec.tensor_parallel_size):
            raise ConfigError(f"{where}: key 'replicas.max': {wanted.max} replicas need "
                              "their own GPUs, the same number each and at least "
                              f"tensor_parallel_size ({spec.tensor_parallel_size}), and "
                              f"gpus lists {gpus}")
    if (spec.cpu_cores is None and spec.device == "cpu" and spec.backend in (None, "local")
            and wanted.max > (host := len(os.sched_getaffinity(0)))):
        raise ConfigError(f"{where}: key 'replicas.max': {wanted.max} replicas need a core "
                          f"each, and this host gives the router {host} (replicas never "
                          "share cores)")


def _preset_path(value: str, source: str) -> Path:
    """A path a preset names: relative ones from the preset's folder."""
    base = Path(source).parent if source and not source.startswith("<") else Path.cwd()
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def _add_adapters(models: dict[str, ModelSpec], adapters: dict[str, dict[str, Any]],
                  source: str) -> None:
    """Each adapter model's spec (its base's, with its own ``ADAPTER_KEYS``) into
    ``models``, and every base that serves adapters sized for them (``max_loras``,
    ``max_cpu_loras``, ``max_lora_rank``)."""
    ranks: dict[str, list[int]] = {}
    own: dict[str, tuple[ModelSpec, AdapterInfo]] = {}
    for name, body in adapters.items():
        where = f"{source}: model '{name}'"
        extra = sorted(set(body) - ADAPTER_KEYS)
        if extra:
            raise ConfigError(f"{where}: key '{extra[0]}': an adapter model takes only "
                              f"{', '.join(sorted(ADAPTER_KEYS))}; the rest is its base's")
        spec = _convert({**body, "id": name, "model": ""}, ModelSpec, where)
        base = models.get(str(spec.base))
        if base is None:
            raise ConfigError(f"{where}: key 'base': no model named '{spec.base}'"
                              + (" (an adapter's base cannot be another adapter)"
                                 if spec.base in adapters else ""))
        if spec.adapter is None:
            raise ConfigError(f"{where}: key 'adapter': an adapter model needs its folder")
        path = _preset_path(spec.adapter, source)
        try:
            info = read_adapter(path)
        except AdapterError as err:
            raise ConfigError(f"{where}: key 'adapter': {err}") from None
        spec.adapter = str(path.resolve())
        ranks.setdefault(base.id, []).append(info.rank)
        own[name] = spec, info
    for base in models.values():
        if base.adapters_dir is not None:
            folder = _preset_path(base.adapters_dir, source)
            if not folder.is_dir():
                raise ConfigError(f"{source}: model '{base.id}': key 'adapters_dir': no "
                                  f"folder at {folder}")
            base.adapters_dir = str(folder.resolve())
        if base.id not in ranks and base.max_loras is None and base.adapters_dir is None:
            continue
        where = f"{source}: model '{base.id}'"
        try:
            cap = rank_cap(ranks.get(base.id, []))
        except AdapterError as err:
            raise ConfigError(f"{where}: key 'max_lora_rank': {err}") from None
        base.max_lora_rank = base.max_lora_rank or cap  # type: ignore[assignment]
        base.max_loras = base.max_loras or DEFAULT_MAX_LORAS
        base.max_cpu_loras = base.max_cpu_loras or max(DEFAULT_MAX_CPU_LORAS, base.max_loras)
        if base.max_cpu_loras < base.max_loras:
            raise ConfigError(f"{where}: key 'max_cpu_loras': must be at least max_loras "
                              f"({base.max_loras})")
    pinned: dict[str, int] = {}
    for name, (spec, info) in own.items():
        base = models[str(spec.base)]
        assert base.max_lora_rank is not None and base.max_cpu_loras is not None  # sized
        pinned[base.id] = pinned.get(base.id, 0) + spec.pinned
        if pinned[base.id] >= base.max_cpu_loras:
            raise ConfigError(f"{source}: model '{name}': key 'pinned': {pinned[base.id]} "
                              f"pinned adapters need max_cpu_loras above that on their base "
                              f"'{base.id}' (it is {base.max_cpu_loras}), so the engine has "
                              "room for the others")
        if info.rank > base.max_lora_rank:
            raise ConfigError(f"{source}: model '{name}': key 'adapter': rank {info.rank} is "
                              f"above its base's max_lora_rank ({base.max_lora_rank})")
        models[name] = msgspec.structs.replace(
            base, id=name, aliases=spec.aliases, pinned=spec.pinned, priority=spec.priority,
            owned_by=spec.owned_by if "owned_by" in adapters[name] else base.owned_by,
            base=base.id, adapter=spec.adapter, adapters_dir=None, load_on_startup=False)


def _off_word(body: Any, where: str) -> Any:
    """``body`` with ``loading_progress: off`` as written: YAML 1.1 reads an unquoted
    ``off`` as false (and ``on`` as true, which names no choice)."""
    if not isinstance(body, dict) or not isinstance(body.get("loading_progress"), bool):
        return body
    if body["loading_progress"]:
        raise ConfigError(f"{where}: key 'loading_progress': expected off, comments or "
                          "reasoning")
    return {**body, "loading_progress": "off"}


BUILTIN_TEMPLATE = "builtin:"
TEMPLATES = Path(__file__).parent / "templates"
"""Chat templates shipped with modelyard (``chat_template: builtin:NAME``)."""


def _read_template(spec: ModelSpec, source: str) -> str | None:
    """A ``chat_template`` that is not Jinja text names a file: read it now; its path."""
    value = spec.chat_template
    if value is None or "{{" in value or "{%" in value:
        return None
    if value.startswith(BUILTIN_TEMPLATE):  # shipped with modelyard: a preset copied
        path = TEMPLATES / f"{value.removeprefix(BUILTIN_TEMPLATE)}.jinja"  # anywhere finds it
    else:
        path = _preset_path(value, source)
    try:
        spec.chat_template = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{source}: model '{spec.id}': key 'chat_template': cannot read "
                          f"{path}: {err.strerror}") from None
    return str(path)


def _check_names(models: dict[str, ModelSpec], server: ServerConfig, source: str) -> None:
    owner: dict[str, str] = {}
    for spec in models.values():
        for name in (spec.id, *spec.aliases):
            key = name.lower()
            if key in owner and owner[key] != spec.id:
                raise ConfigError(f"{source}: model '{spec.id}': key 'aliases': name '{name}' "
                                  f"is already used by model '{owner[key]}'")
            owner[key] = spec.id
        if spec.device == "cpu" and spec.kv_cache_gib <= 0:
            raise ConfigError(f"{source}: model '{spec.id}': key 'kv_cache_gib': must be > 0")
        if spec.tensor_parallel_size < 1:
            raise ConfigError(f"{source}: model '{spec.id}': key 'tensor_parallel_size': must be >= 1")
        if spec.tool_strict_level is not None and auto_tool_calls(spec) == "unconstrained":
            raise ConfigError(f"{source}: model '{spec.id}': key 'tool_strict_level': "
                              + (f"tool parser '{spec.tool_parser}' has no structural tag in "
                                 "vLLM, so its calls cannot be constrained"
                                 if spec.reasoning_parser is None else
                                 "not with a 'reasoning_parser' (the tag would hold the "
                                 "thinking too)") + "; leave the key out")
        if spec.tool_strict_level is not None and spec.tool_parser is None:
            raise ConfigError(f"{source}: model '{spec.id}': key 'tool_strict_level': needs "
                              "'tool_parser'")
        if spec.cpu_cores is not None:
            try:
                cores = parse_cores(spec.cpu_cores)
            except ValueError:
                cores = set()
            if not cores or min(cores) < 0:
                raise ConfigError(f"{source}: model '{spec.id}': key 'cpu_cores': expected core "
                                  f"numbers and ranges such as \"0-3,6\", got "
                                  f"\"{spec.cpu_cores}\"")
        _check_replicas(spec, source)
    if server.default_model and server.default_model.lower() not in owner:
        raise ConfigError(f"{source}: [server]: key 'default_model': no model or alias "
                          f"named '{server.default_model}'")
    for proxy in server.trusted_proxies:
        try:  # strict: "10.0.0.1/8" (host bits set) is refused, not read as something else
            ipaddress.ip_network(proxy, strict=True)
        except ValueError as err:
            raise ConfigError(f"{source}: [server]: key 'trusted_proxies': expected IP "
                              f"addresses or CIDRs, got \"{proxy}\" ({err})") from None


def expand_env(value: str, where: str, environ: Mapping[str, str]) -> str:
    """``value`` with its ``${env:NAME}`` and ``${env:NAME:-default}`` references replaced
    (``$${env:…}`` is kept as the literal ``${env:…}``); ``where`` names file, model and
    key in the error for a variable that is not set and has no default."""
    if "${" not in value:
        return value

    def one(m: re.Match[str]) -> str:
        escaped, name, default = m.groups()
        if escaped:
            return m.group(0)[1:]
        found = environ.get(name)
        if found is not None:
            return found
        if default is not None:
            return default
        raise ConfigError(f"{where}: environment variable '{name}' is not set (write "
                          f"${{env:{name}:-default}} to give a default)")

    return _ENV_RE.sub(one, value)


def _expand_tree(data: Any, where: str, environ: Mapping[str, str]) -> Any:
    """Every string in ``data`` (a model's or section's keys and values) expanded; the
    key path goes in ``where`` (``key 'env.HF_TOKEN'``)."""
    def walk(value: Any, path: str) -> Any:
        if isinstance(value, str):
            return expand_env(value, f"{where}: key '{path}'", environ)
        if isinstance(value, dict):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, path) for v in value]
        return value

    return walk(data, "")


def _section_where(source: str, section: str) -> str:
    if section == "server":
        return f"{source}: [server]"
    if section in ("defaults", "*"):
        return f"{source}: [defaults]"
    return f"{source}: model '{section}'"


def _ini_section(section: configparser.SectionProxy, where: str,
                 environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, raw in section.items():
        # expanded before a list is split, so one variable may hold "a, b"
        value = expand_env(raw, f"{where}: key '{key}'", environ)
        if key in _LIST_KEYS:
            out[key] = [v.strip() for v in value.split(",") if v.strip()]
        elif key.startswith("env."):
            out.setdefault("env", {})[key[4:].upper()] = value
        elif key.startswith("engine_args."):
            out.setdefault("engine_args", {})[key[12:]] = _ini_scalar(value)
        elif key.partition(".")[0] in _INI_TABLES and "." in key:
            table, _, inner = key.partition(".")
            given = out.setdefault(table, {})
            if not isinstance(given, dict):  # "replicas = 2" and "replicas.max = 3"
                raise ConfigError(f"{where}: key '{key}': not beside '{table} = {given}'")
            given[inner] = value
        elif key in _INI_TABLES and key in out:
            raise ConfigError(f"{where}: key '{key}': not beside '{key}.' keys")
        else:
            out[key] = value
    return out


def _ini_scalar(value: str) -> Any:
    """Engine args have no schema here, so guess the scalar type of an INI value."""
    try:
        return msgspec.json.decode(value)
    except msgspec.DecodeError:
        return value


def parse_ini(text: str, source: str,
              environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    parser = configparser.ConfigParser(interpolation=None, default_section="\0none")
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    try:
        parser.read_string(text, source=source)
    except configparser.Error as err:
        raise ConfigError(f"{source}: {err}") from None
    env = os.environ if environ is None else environ
    raw: dict[str, Any] = {"models": {}}
    for name in parser.sections():
        body = _ini_section(parser[name], _section_where(source, name), env)
        if name == "server":
            raw["server"] = body
        elif name == "*":
            raw["defaults"] = body
        else:
            raw["models"][name] = body
    return raw


def parse_yaml(text: str, source: str,
               environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    try:
        data = msgspec.yaml.decode(text)
    except msgspec.DecodeError as err:
        raise ConfigError(f"{source}: {err}") from None
    if data is None:
        raise ConfigError(f"{source}: empty file")
    if not isinstance(data, dict):
        return data  # type: ignore[no-any-return]  # build_preset says what is wrong
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for section, body in data.items():
        if section == "models" and isinstance(body, dict):
            out[section] = {name: _expand_tree(model, f"{source}: model '{name}'", env)
                            for name, model in body.items()}
        else:
            out[section] = _expand_tree(body, _section_where(source, str(section)), env)
    return out


def load_preset(path: str | os.PathLike[str],
                environ: Mapping[str, str] | None = None) -> Preset:
    """Load a ``.yaml``/``.yml`` or ``.ini`` preset file; ``${env:…}`` references are read
    from ``environ`` (default: this process's environment)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".ini", ".cfg", ".conf"):
        parse = parse_ini
    elif suffix in (".yaml", ".yml", ".json"):
        parse = parse_yaml
    else:
        raise ConfigError(f"{p}: unknown preset format (use .yaml or .ini)")
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{p}: cannot read: {err.strerror}") from None
    return build_preset(parse(text, str(p), environ), str(p))
