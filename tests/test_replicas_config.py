"""Preset keys ``replicas`` and ``routing``: defaults, shorthand, YAML = INI, and every
refusal names the file, the model and the key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from router.lifecycle.reload import diff_presets
from shared.config import ConfigError, Preset, Replicas, Routing, restart_needed
from shared.preset_loader import build_preset, load_preset


def preset(model: dict[str, Any], server: dict[str, Any] | None = None) -> Preset:
    return build_preset({"server": server or {}, "models": {"m": {"model": "/m", **model}}},
                        "p.yaml")


def test_a_model_runs_one_replica_routed_by_prefix_unless_told() -> None:
    spec = preset({}).models["m"]
    assert spec.replicas == Replicas(min=1, max=1, idle=30.0, up_wait=1.0, up_after=2.0,
                                     cooldown=10.0)
    assert spec.routing == Routing(strategy="prefix", min_prefix_share=0.3, balance_abs=4,
                                   balance_rel=1.5)


def test_more_replicas_than_the_host_has_cores_are_refused() -> None:
    host = len(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match=rf"model 'm': key 'replicas.max': {host + 1} "
                                          rf"replicas need a core each, and this host gives "
                                          rf"the router {host}"):
        preset({"replicas": {"max": host + 1}})
    assert preset({"replicas": host}).models["m"].replicas.max == host


def test_one_replica_and_scale_to_zero_load() -> None:
    assert preset({"replicas": 1}).models["m"].replicas.max == 1
    zero = preset({"replicas": {"min": 0, "idle": 5}}).models["m"].replicas
    assert (zero.min, zero.max, zero.idle) == (0, 1, 5.0)


def test_a_pinned_adapter_of_a_base_that_scales_to_zero_loads(tmp_path: Path) -> None:
    """An adapter's ``pinned`` keeps it in its base's engine, not its base loaded: a base
    with ``replicas.min: 0`` may have one (the lifecycle simulation's replica worlds found
    this preset refused, naming the adapter's ``replicas.min``, which it has no key of)."""
    folder = tmp_path / "a8"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    (folder / "adapter_model.safetensors").write_bytes(b"")
    models = build_preset({"server": {}, "models": {
        "m": {"model": "/m", "cpu_cores": "0-1", "replicas": {"min": 0, "max": 2}},
        "a": {"base": "m", "adapter": str(folder), "pinned": True}}}, "p.yaml").models
    assert models["a"].pinned and models["m"].replicas.min == 0
    with pytest.raises(ConfigError, match="model 'm': key 'replicas.min': 0 stops"):
        preset({"replicas": {"min": 0}, "pinned": True})  # the base's own pin still is


def test_a_number_is_min_and_max() -> None:
    cores = {"cpu_cores": "0-3"}  # a core each (else the host's: two on CI)
    assert preset({"replicas": 3, **cores}).models["m"].replicas == Replicas(min=3, max=3)
    assert preset({"replicas": {"max": 4}, **cores}).models["m"].replicas == Replicas(min=1,
                                                                                     max=4)


@pytest.mark.parametrize(("model", "key", "says"), [
    ({"replicas": {"min": 3, "max": 2}}, "replicas.min", "3 is above replicas.max (2)"),
    ({"replicas": {"min": 2}}, "replicas.min", "2 is above replicas.max (1)"),
    ({"replicas": {"max": 33}}, "replicas.max", "<= 32"),
    ({"replicas": {"max": 0}}, "replicas.max", ">= 1"),
    ({"replicas": {"min": -1}}, "replicas.min", ">= 0"),
    ({"replicas": {"idle": 0}}, "replicas.idle", "> 0"),
    ({"replicas": {"up_wait": -1}}, "replicas.up_wait", ">= 0"),
    ({"replicas": {"cooldown": -1}}, "replicas.cooldown", ">= 0"),
    ({"replicas": {"maximum": 2}}, "replicas.maximum", "unknown key"),
    ({"replicas": 0}, "replicas", "at least 1"),
    ({"replicas": True}, "replicas", "expected a number"),
    ({"replicas": "two"}, "replicas", "expected a number"),
    ({"replicas": {"min": 0}, "pinned": True}, "replicas.min", "pinned"),
    ({"replicas": 3, "cpu_cores": "0-1"}, "replicas.max", "a core each"),
    ({"replicas": 2, "device": "cuda", "gpus": [0, 1, 2]}, "replicas.max", "own GPUs"),
    ({"replicas": 2, "device": "cuda"}, "replicas.max", "own GPUs"),
    ({"replicas": 2, "device": "cuda", "gpus": [0, 1], "tensor_parallel_size": 2},
     "replicas.max", "at least tensor_parallel_size (2)"),
    ({"routing": {"strategy": "random"}}, "routing.strategy", "Invalid enum value"),
    ({"routing": {"min_prefix_share": 1.5}}, "routing.min_prefix_share", "<= 1"),
    ({"routing": {"balance_rel": 0.9}}, "routing.balance_rel", ">= 1"),
    ({"routing": {"balance_abs": 0}}, "routing.balance_abs", ">= 1"),
    ({"routing": {"min_prefix_share": 0}}, "routing.min_prefix_share", "> 0"),
    ({"routing": "prefix"}, "routing", "Expected `object`"),
])
def test_a_bad_value_names_the_model_and_key(model: dict[str, Any], key: str,
                                             says: str) -> None:
    with pytest.raises(ConfigError) as err:
        preset(model)
    assert str(err.value).startswith(f"p.yaml: model 'm': key '{key}': "), err.value
    assert says in str(err.value)


def test_replicas_fit_their_cores_and_gpus() -> None:
    assert preset({"replicas": 2, "cpu_cores": "0-1"}).models["m"].replicas.max == 2
    spec = preset({"replicas": 2, "device": "cuda", "gpus": [0, 1, 2, 3]}).models["m"]
    assert spec.replicas.max == 2
    # Ray gives each replica's actor its own GPUs: the preset names none
    ray = preset({"replicas": 2, "device": "cuda", "backend": "ray"}).models["m"]
    assert ray.replicas.max == 2


def test_a_models_routing_goes_over_the_servers_key_by_key() -> None:
    server = {"routing": {"strategy": "least_loaded", "balance_abs": 9}}
    p = build_preset({"server": server, "models": {
        "own": {"model": "/m", "routing": {"strategy": "round_robin"}},
        "plain": {"model": "/m"}}})
    assert p.server.routing == Routing(strategy="least_loaded", balance_abs=9)
    assert p.models["own"].routing == Routing(strategy="round_robin", balance_abs=9)
    assert p.models["plain"].routing == p.server.routing


def test_a_bad_server_routing_names_the_server() -> None:
    with pytest.raises(ConfigError, match=r"\[server\]: key 'routing.balance_rel'"):
        preset({}, {"routing": {"balance_rel": 0}})


YAML = """
server:
  routing: {strategy: least_loaded}
defaults:
  replicas: {idle: 12}
models:
  a:
    model: /m
    replicas: {min: 0, up_wait: 0.5, up_after: 3, cooldown: 4}
    routing: {min_prefix_share: 0.5, balance_rel: 2}
  b:
    model: /m
"""

INI = """
[server]
routing.strategy = least_loaded

[*]
replicas.idle = 12

[a]
model = /m
replicas.min = 0
replicas.up_wait = 0.5
replicas.up_after = 3
replicas.cooldown = 4
routing.min_prefix_share = 0.5
routing.balance_rel = 2

[b]
model = /m
"""


def test_yaml_and_ini_write_the_same_replicas_and_routing(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(YAML)
    (tmp_path / "p.ini").write_text(INI)
    yaml, ini = load_preset(tmp_path / "p.yaml"), load_preset(tmp_path / "p.ini")
    assert msgspec.to_builtins(yaml.models) == msgspec.to_builtins(ini.models)
    assert msgspec.to_builtins(yaml.server) == msgspec.to_builtins(ini.server)
    a = yaml.models["a"]
    # a model's own table replaces the defaults' whole, as every key of ``defaults`` does
    assert a.replicas == Replicas(min=0, max=1, idle=30, up_wait=0.5, up_after=3, cooldown=4)
    assert a.routing == Routing(strategy="least_loaded", min_prefix_share=0.5, balance_rel=2)
    assert yaml.models["b"].replicas == Replicas(idle=12)


@pytest.mark.parametrize("text", ["replicas = 1\nreplicas.idle = 3\n",
                                  "replicas.idle = 3\nreplicas = 1\n"])
def test_ini_refuses_a_count_beside_its_keys(tmp_path: Path, text: str) -> None:
    (tmp_path / "p.ini").write_text(f"[m]\nmodel = /m\n{text}")
    with pytest.raises(ConfigError, match=r"model 'm': key 'replicas(\.idle)?': not beside"):
        load_preset(tmp_path / "p.ini")


def test_replicas_and_routing_change_without_restarting_a_worker() -> None:
    old = preset({}).models["m"]
    for key, value in [("replicas", Replicas(min=0, idle=5)),
                       ("routing", Routing(strategy="round_robin"))]:
        assert not restart_needed(old, msgspec.structs.replace(old, **{key: value})), key
    # A new max cuts the cores anew: the replicas started on the old shares restart.
    two = preset({"replicas": 2, "cpu_cores": "0-3"}).models["m"]
    assert restart_needed(two, msgspec.structs.replace(two, replicas=Replicas(min=2, max=4)))
    assert not restart_needed(two, msgspec.structs.replace(two, replicas=Replicas(min=1,
                                                                                  max=2)))


def test_a_reload_applies_the_servers_routing() -> None:
    old, new = preset({}), preset({}, {"routing": {"strategy": "round_robin"}})
    diff = diff_presets(old, new)
    assert diff.applied == ["routing"] and diff.restart_required == []
    assert diff.changed_keys == {"m": ["routing"]}
