"""Preset loading: YAML and INI agree, every shipped config loads, errors name the spot."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from shared.config import ConfigError
from shared.preset_loader import build_preset, load_preset, parse_ini, parse_yaml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.*")), ids=lambda p: p.name)
def test_every_shipped_preset_loads(path: Path) -> None:
    preset = load_preset(path)
    assert preset.models
    for spec in preset.models.values():
        assert spec.id and spec.model


def test_lab_yaml_and_ini_describe_the_same_lab() -> None:
    yaml, ini = load_preset(CONFIGS / "lab.yaml"), load_preset(CONFIGS / "lab.ini")
    assert msgspec.to_builtins(yaml.models) == msgspec.to_builtins(ini.models)
    assert msgspec.to_builtins(yaml.server) == msgspec.to_builtins(ini.server)
    qwen = yaml.models["qwen3-32b"]
    assert qwen.gpus == [1, 2] and qwen.tensor_parallel_size == 2 and qwen.ttl == 1800
    assert qwen.device == "cuda" and qwen.gpu_memory_utilization == 0.9  # from defaults
    assert yaml.models["mistral-7b"].gpu_memory_utilization == 0.45      # overrides them
    assert yaml.server.default_model == "llama-3.1-8b"


def test_default_preset_is_the_embedded_cpu_model() -> None:
    preset = load_preset(CONFIGS / "default.yaml")
    spec = preset.models["smollm2"]
    assert spec.model == "builtin:smollm2" and spec.device == "cpu" and spec.enforce_eager
    assert preset.server.host == "127.0.0.1" and preset.server.port == 8080
    assert spec.sampling_defaults.temperature == 0.2 and spec.sampling_defaults.top_p == 0.5


def test_sampling_defaults_in_yaml_and_ini() -> None:
    ini = build_preset(parse_ini("[m]\nmodel = /x\nsampling_defaults.temperature = 0.3\n"
                                 "sampling_defaults.top_k = 20\n"
                                 "sampling_defaults.max_tokens = 512\n", "t.ini"), "t.ini")
    spec = ini.models["m"].sampling_defaults
    assert (spec.temperature, spec.top_k, spec.top_p, spec.max_tokens) == (0.3, 20, None, 512)
    yaml = build_preset(parse_yaml("models:\n  m: {model: /x, sampling_defaults: "
                                   "{temperature: 0.3, top_k: 20, max_tokens: 512}}\n",
                                   "t.yaml"), "t.yaml")
    assert yaml.models["m"].sampling_defaults == ini.models["m"].sampling_defaults


def test_ini_env_engine_args_and_star_defaults() -> None:
    raw = parse_ini("[*]\nttl = 30\n[m]\nmodel = /x\nenv.hf_home = /h\n"
                    "engine_args.max_num_batched_tokens = 4096\naliases = a, b\n", "t.ini")
    spec = build_preset(raw, "t.ini").models["m"]
    assert spec.ttl == 30 and spec.env == {"HF_HOME": "/h"} and spec.aliases == ["a", "b"]
    assert spec.engine_args == {"max_num_batched_tokens": 4096}


@pytest.mark.parametrize("text,fragment", [
    ("models:\n  m: {model: /x, ttl: soon}\n", "t.yaml: model 'm': key 'ttl'"),
    ("models:\n  m: {model: /x, colour: red}\n", "t.yaml: model 'm': key 'colour': unknown key"),
    ("models:\n  m: {ttl: 5}\n", "t.yaml: model 'm'"),
    ("server: {port: eighty}\nmodels:\n  m: {model: /x}\n", "[server]: key 'port'"),
    ("models: {}\n", "at least one model"),
    ("server: {default_model: zz}\nmodels:\n  m: {model: /x}\n", "key 'default_model'"),
    ("models:\n  m: {model: /x, aliases: [n]}\n  n: {model: /y}\n", "already used"),
    ("models:\n  m: {model: /x, device: tpu}\n", "key 'device'"),
    ("models:\n  m: {model: /x, sampling_defaults: {top_p: 2}}\n",
     "model 'm': key 'sampling_defaults.top_p'"),
    ("models:\n  m: {model: /x, sampling_defaults: {max_tokens: 0}}\n",
     "model 'm': key 'sampling_defaults.max_tokens'"),
    ("models:\n  m: {model: /x, sampling_defaults: {temp: 1}}\n",
     "key 'sampling_defaults.temp': unknown key"),
    ("modls:\n  m: {model: /x}\n", "unknown top-level key 'modls'"),
])
def test_errors_name_file_model_and_key(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_preset(parse_yaml(text, "t.yaml"), "t.yaml")
    assert fragment in str(info.value)


def test_ini_errors_name_the_section(tmp_path: Path) -> None:
    path = tmp_path / "bad.ini"
    path.write_text("[m]\nmodel = /x\nkv_cache_gib = lots\n")
    with pytest.raises(ConfigError, match=r"bad.ini: model 'm': key 'kv_cache_gib'"):
        load_preset(path)


def test_unknown_extension_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown preset format"):
        load_preset(tmp_path / "x.toml")
    with pytest.raises(ConfigError, match="cannot read"):
        load_preset(tmp_path / "missing.yaml")


@pytest.mark.parametrize("cores", ["0-x", "3-1", "", ",", "-1"])
def test_bad_cpu_cores_are_refused_at_load(cores: str) -> None:
    """Issue 8, defect 4: "0-x" was accepted and failed only when the worker spawned."""
    with pytest.raises(ConfigError, match="model 'm': key 'cpu_cores'"):
        build_preset({"models": {"m": {"model": "/m", "cpu_cores": cores}}}, "p.yaml")


@pytest.mark.parametrize("key,value", [
    ("rate_limit_per_minute", -1), ("rate_limit_burst", -5), ("max_connections", 0),
    ("keep_alive_timeout", 0), ("read_timeout", -1),
    ("trusted_proxies", ["10.0.0.1/8"]), ("trusted_proxies", ["proxy.lan"]),
    ("trusted_proxies", ["10.0.0.0/33"]), ("trusted_proxies", "10.0.0.0/8"),
])
def test_bad_admission_limits_are_refused_at_load(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"p.yaml: \\[server\\]: key '{key}'"):
        build_preset({"server": {key: value}, "models": {"m": {"model": "/m"}}}, "p.yaml")


def test_admission_limits_from_ini() -> None:
    raw = parse_ini("[server]\nrate_limit_per_minute = 60\nread_timeout = 2.5\n"
                    "trusted_proxies = 127.0.0.1, 10.0.0.0/8, ::1\n[m]\nmodel = /m\n", "p.ini")
    server = build_preset(raw, "p.ini").server
    assert server.rate_limit_per_minute == 60 and server.read_timeout == 2.5
    assert server.trusted_proxies == ["127.0.0.1", "10.0.0.0/8", "::1"]
    assert server.max_connections == 1024 and server.rate_limit_burst == 0


ENV = {"HF_HOME": "/srv/hf", "MODEL_KEY": "sk-from-env", "ALIASES": "a, b", "PORT": "9001"}


def test_env_references_in_yaml_and_ini_agree(tmp_path: Path) -> None:
    """``${env:NAME}`` and ``${env:NAME:-default}`` in string values, read when the preset
    loads: a shared preset names its secrets instead of holding them."""
    (tmp_path / "p.yaml").write_text(
        'server: {port: "${env:PORT}", api_keys: ["${env:MODEL_KEY}"]}\n'
        "models:\n"
        '  m: {model: "${env:HF_HOME}/m", env: {HF_TOKEN: "${env:HF_TOKEN:-none}"},\n'
        '      aliases: ["${env:NICK:-m-${env:HF_HOME}}", "$${env:HF_HOME}"]}\n')
    (tmp_path / "p.ini").write_text(
        "[server]\nport = ${env:PORT}\napi_keys = ${env:MODEL_KEY}\n"
        "[m]\nmodel = ${env:HF_HOME}/m\nenv.hf_token = ${env:HF_TOKEN:-none}\n"
        "aliases = ${env:NICK:-m-${env:HF_HOME}}, $${env:HF_HOME}\n")
    yaml, ini = load_preset(tmp_path / "p.yaml", ENV), load_preset(tmp_path / "p.ini", ENV)
    for preset in (yaml, ini):
        spec = preset.models["m"]
        assert spec.model == "/srv/hf/m" and spec.env == {"HF_TOKEN": "none"}
        # a default is plain text (no nesting); $${ is a literal ${
        assert spec.aliases == ["m-${env:HF_HOME}", "${env:HF_HOME}"]
        assert preset.server.port == 9001 and preset.server.api_keys == ["sk-from-env"]
    raw = parse_ini("[m]\nmodel = /m\naliases = ${env:ALIASES}\n", "q.ini", ENV)
    assert build_preset(raw, "q.ini").models["m"].aliases == ["a", "b"]  # split after


@pytest.mark.parametrize("name,text,where", [
    ("p.yaml", 'models:\n  m: {model: /m, env: {HF_TOKEN: "${env:NO_SUCH_TOKEN}"}}\n',
     "p.yaml: model 'm': key 'env.HF_TOKEN'"),
    ("p.yaml", 'server: {api_keys: [a, "${env:NO_SUCH_TOKEN}"]}\nmodels:\n  m: {model: /m}\n',
     "p.yaml: [server]: key 'api_keys'"),
    ("p.yaml", 'defaults: {cache: "${env:NO_SUCH_TOKEN}"}\nmodels:\n  m: {model: /m}\n',
     "p.yaml: [defaults]: key 'cache'"),
    ("p.ini", "[m]\nmodel = /m\nenv.hf_token = ${env:NO_SUCH_TOKEN}\n",
     "p.ini: model 'm': key 'env.hf_token'"),
    ("p.ini", "[*]\nttl = ${env:NO_SUCH_TOKEN}\n[m]\nmodel = /m\n", "p.ini: [defaults]: key 'ttl'"),
])
def test_an_unset_env_reference_names_file_model_key_and_variable(
        tmp_path: Path, name: str, text: str, where: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as info:
        load_preset(tmp_path / name, ENV)
    message = str(info.value)
    assert message.startswith(str(tmp_path / name))
    assert where.split(": ", 1)[1] in message and "'NO_SUCH_TOKEN' is not set" in message
    assert "sk-from-env" not in message


def test_env_references_read_this_process_environment_by_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELYARD_TEST_MODEL", "/from/os/environ")
    (tmp_path / "p.yaml").write_text('models:\n  m: {model: "${env:MODELYARD_TEST_MODEL}"}\n')
    assert load_preset(tmp_path / "p.yaml").models["m"].model == "/from/os/environ"
