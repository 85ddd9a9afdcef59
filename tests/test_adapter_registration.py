"""LoRA adapters registered at run time (``POST /v1/models/adapters``, ``DELETE
/v1/models/adapters/{name}``) against one router with synthetic workers, which serve an
adapter by saying its name: only folders inside ``adapter_roots`` (links followed), checked
against the base before they are accepted, admin keys only; a reload keeps them while their
base serves them.

The adapter folders are minimal (an ``adapter_config.json`` and an empty weights file):
the synthetic engine checks no tensors.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import RouterProcess, running_router

pytestmark = pytest.mark.integration

USER, ADMIN = "k-user-5a6b", "k-admin-7c8d"
PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  api_keys: [k-user-5a6b]
  admin_api_keys: [k-admin-7c8d]
  adapter_roots: [{roots}]
models:
  base: {model: /synthetic, engine: synthetic, max_loras: 2, load_on_startup: true}
  cold: {model: /synthetic, engine: synthetic, max_loras: 1, max_cpu_loras: 2}
  plain: {model: /synthetic, engine: synthetic}
  declared: {base: base, adapter: {roots}/good}
"""


def make_adapter(folder: Path, rank: int = 8) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


class Router(RouterProcess):
    roots: Path
    elsewhere: Path

    def ask(self, method: str, path: str, key: str | None = ADMIN,
            **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return self.client.request(method, self.url + path, headers=headers, timeout=60, **kw)

    def register(self, name: str, base: str, path: Path | str, key: str | None = ADMIN,
                 **more: Any) -> httpx.Response:
        return self.ask("POST", "/v1/models/adapters", key,
                        json={"name": name, "base": base, "path": str(path), **more})

    def model(self, name: str) -> httpx.Response:
        return self.ask("GET", f"/v1/models/{name}")

    def said(self, model: str, served_as: str | None = None) -> str:
        """What ``model`` answers a chat with (a user key), answered as ``served_as``."""
        reply = self.ask("POST", "/v1/chat/completions", USER, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3})
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == (served_as or model)
        return str(reply.json()["choices"][0]["message"]["content"])


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    top = tmp_path_factory.mktemp("registration")
    roots, elsewhere = top / "roots", top / "elsewhere"
    for name in ("good", "second", "third", "pin-a", "pin-b", "temp", "kept", "gone", "taken"):
        make_adapter(roots / name)
    make_adapter(roots / "r32", rank=32)
    (roots / "bad").mkdir()
    (roots / "bad" / "adapter_config.json").write_text("{not json")
    (roots / "bad" / "adapter_model.safetensors").write_bytes(b"")
    for name, fault in (("sixteen", {"lora_alpha": "sixteen"}), ("five", {"target_modules": 5})):
        make_adapter(roots / name)
        config = json.loads((roots / name / "adapter_config.json").read_text())
        (roots / name / "adapter_config.json").write_text(json.dumps({**config, **fault}))
    make_adapter(elsewhere / "evil")
    (roots / "link").symlink_to(elsewhere / "evil")
    with running_router(PRESET, top, "registration", {"roots": str(roots)}, kind=Router) as r:
        assert isinstance(r, Router)
        r.roots, r.elsewhere = roots, elsewhere
        deadline = time.monotonic() + 60
        while r.model("base").json().get("state") != "ready":
            assert time.monotonic() < deadline, r.tail()
            time.sleep(0.2)
        yield r


def refused(reply: httpx.Response, status: int, code: str, *words: str) -> None:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code, error
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error


def test_a_registered_adapter_is_served_by_its_running_base(router: Router) -> None:
    reply = router.register("helper", "base", router.roots / "good", aliases=["Aide"])
    assert reply.status_code == 201, reply.text
    made = reply.json()
    assert made["id"] == "helper" and made["object"] == "model"
    assert made["parent"] == "base" and made["registered"] is True and made["rank"] == 8
    assert made["aliases"] == ["Aide"]
    assert made["root"] == str((router.roots / "good").resolve())
    assert made["state"] == "resident", made  # the running base loaded it at once
    assert router.said("helper").split() == ["helper"] * 3
    assert router.said("Aide", "helper").split() == ["helper"] * 3  # served as the adapter's id
    listed = [m["id"] for m in router.ask("GET", "/v1/models").json()["data"]]
    assert listed.index("helper") > listed.index("base")


def test_a_base_that_is_not_running_accepts_and_serves_it_on_first_use(router: Router) -> None:
    reply = router.register("second", "cold", router.roots / "second")
    assert reply.status_code == 201, reply.text
    assert reply.json()["state"] == "known"
    assert router.model("cold").json()["state"] == "unloaded"
    assert router.said("second").split() == ["second"] * 3
    assert router.model("second").json()["state"] == "resident"


def test_paths_outside_the_roots_are_refused(router: Router) -> None:
    outside = {
        "plain outside": router.elsewhere / "evil",
        "through ..": f"{router.roots}/../elsewhere/evil",
        "a link out": router.roots / "link",
        "the roots' parent": router.roots.parent,
    }
    for why, path in outside.items():
        reply = router.register("evil", "base", path)
        refused(reply, 400, "adapter_path_not_allowed", "adapter 'evil'",
                "outside the allowed roots (adapter_roots")
        assert reply.json()["error"]["param"] == "path", why
    refused(router.register("evil", "base", "roots/good"), 400, "adapter_invalid",
            "adapter 'evil'", "not absolute")
    refused(router.register("evil", "base", f"{router.roots}/good\x00"), 400,
            "adapter_invalid", "adapter 'evil'", "names no folder")
    assert router.model("evil").status_code == 404


def test_folders_that_are_no_adapter_are_refused_naming_it(router: Router) -> None:
    refused(router.register("nope", "base", router.roots / "missing"), 400,
            "adapter_invalid", "adapter 'nope'", "no adapter folder")
    refused(router.register("nope", "base", router.roots / "bad"), 400,
            "adapter_invalid", "adapter 'nope'", "adapter_config.json is not JSON")
    # a value of the wrong type: a 400 naming its field, never a 500
    refused(router.register("nope", "base", router.roots / "sixteen"), 400,
            "adapter_invalid", "adapter 'nope'", "adapter_config.json", "$.lora_alpha")
    refused(router.register("nope", "base", router.roots / "five"), 400,
            "adapter_invalid", "adapter 'nope'", "$.target_modules")
    refused(router.register("nope", "base", router.roots / "r32"), 400,
            "adapter_invalid", "adapter 'nope'", "rank 32", "max_lora_rank (16)")
    assert router.model("nope").status_code == 404


def test_names_must_be_new_in_any_case(router: Router) -> None:
    good = router.roots / "third"
    for name, aliases, param in (("base", [], "name"), ("PLAIN", [], "name"),
                                 ("Declared", [], "name"), ("third", ["Plain"], "aliases")):
        reply = router.register(name, "base", good, aliases=aliases)
        refused(reply, 409, "model_exists", f"adapter '{name}'")
        assert reply.json()["error"]["param"] == param
    refused(router.register("third", "base", good, aliases=["Third"]), 400,
            "invalid_value", "repeat")
    assert router.register("", "base", good).status_code == 400
    assert router.register("x" * 129, "base", good).status_code == 400
    reply = router.ask("POST", "/v1/models/adapters", json={
        "name": "third", "base": "base", "path": str(good), "weights": 1})
    assert reply.status_code == 400 and "weights" in reply.json()["error"]["message"]
    assert router.model("third").status_code == 404


def test_the_base_must_be_a_model_that_serves_adapters(router: Router) -> None:
    good = router.roots / "third"
    refused(router.register("third", "plain", good), 400, "adapter_invalid",
            "adapter 'third'", "model 'plain' serves no adapters")
    refused(router.register("third", "nosuch", good), 400, "adapter_invalid",
            "adapter 'third'", "no model 'nosuch'")
    refused(router.register("third", "declared", good), 400, "adapter_invalid",
            "no model 'declared'")  # an adapter is no base
    refused(router.register("third", "BASE", good), 400, "adapter_invalid",
            "no model 'BASE'")  # an exact id
    assert router.model("third").status_code == 404


def test_pinned_adapters_leave_room_in_the_engine(router: Router) -> None:
    """``cold`` has one batch slot and room for two adapters: one may be pinned."""
    assert router.register("pin-a", "cold", router.roots / "pin-a",
                           pinned=True).status_code == 201
    refused(router.register("pin-b", "cold", router.roots / "pin-b", pinned=True), 400,
            "adapter_invalid", "adapter 'pin-b'", "max_cpu_loras")
    assert router.register("pin-b", "cold", router.roots / "pin-b").status_code == 201


def test_only_an_admin_registers_or_removes(router: Router) -> None:
    for key, status in ((USER, 403), (None, 401)):
        assert router.register("temp", "base", router.roots / "temp",
                               key=key).status_code == status
        assert router.ask("DELETE", "/v1/models/adapters/helper", key).status_code == status
    assert router.model("temp").status_code == 404
    assert router.model("helper").status_code == 200


def test_delete_removes_a_registered_adapter_only(router: Router) -> None:
    assert router.register("temp", "base", router.roots / "temp").status_code == 201
    assert router.said("temp").split() == ["temp"] * 3
    reply = router.ask("DELETE", "/v1/models/adapters/temp")
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"id": "temp", "object": "model", "deleted": True}
    assert router.model("temp").status_code == 404
    chat = router.ask("POST", "/v1/chat/completions", USER, json={
        "model": "temp", "messages": [{"role": "user", "content": "hi"}]})
    refused(chat, 404, "model_not_found", "'temp'")
    refused(router.ask("DELETE", "/v1/models/adapters/temp"), 404, "model_not_found", "temp")
    for declared in ("declared", "base"):
        reply = router.ask("DELETE", "/v1/models/adapters/" + declared)
        assert reply.status_code == 400, reply.text
        assert "POST /v1/models/adapters" in reply.json()["error"]["message"]
    assert router.model("declared").status_code == 200
    again = router.register("temp", "base", router.roots / "temp")  # the name is free again
    assert again.status_code == 201, again.text
    assert router.said("temp").split() == ["temp"] * 3


def test_a_reload_keeps_registered_adapters_whose_base_serves_them(router: Router) -> None:
    """Last: it rewrites the preset. ``cold`` goes (its adapter with it), and a model
    takes the name of another adapter."""
    for name, base in (("kept", "base"), ("gone", "cold"), ("taken", "base")):
        assert router.register(name, base, router.roots / name).status_code == 201
    text = router.preset.read_text()
    text = text.replace("  cold: {model: /synthetic, engine: synthetic, max_loras: 1, "
                        "max_cpu_loras: 2}\n", "")
    router.preset.write_text(text + "  taken: {model: /synthetic, engine: synthetic}\n")
    reply = router.ask("POST", "/v1/config/reload")
    assert reply.status_code == 200, reply.text
    kept = router.model("kept").json()
    assert kept["parent"] == "base" and kept["registered"] is True
    assert router.said("kept").split() == ["kept"] * 3
    assert router.said("helper").split() == ["helper"] * 3
    assert router.model("gone").status_code == 404
    assert "parent" not in router.model("taken").json()  # the preset's model now
    assert "registered adapter gone dropped" in router.tail(200)


# -- the registry alone ----------------------------------------------------------------

def test_a_reload_keeps_a_registered_name_that_a_new_folder_would_alias(tmp_path: Path) -> None:
    """Registered adapters are kept before found ones are looked up again: a folder that
    appeared in an ``adapters_dir`` under a registered name takes no alias from it."""
    from router.registry import ModelRegistry
    from shared.preset_loader import build_preset

    folder = tmp_path / "adapters"
    folder.mkdir()
    make_adapter(tmp_path / "loras" / "pirate")
    raw = {"models": {"base": {"model": "/synthetic", "engine": "synthetic",
                               "adapters_dir": str(folder)}}}
    registry = ModelRegistry(build_preset(raw, str(tmp_path / "p.yaml")))
    entry = registry.register("pirate", "base", str(tmp_path / "loras" / "pirate"), [],
                              False, 8)
    assert registry.resolve("pirate") is entry and entry.registered
    make_adapter(folder / "pirate")
    found = registry.resolve("base/pirate")
    assert found.found and found.spec.aliases == []  # the name is the registered one's
    registry.reconfigure(build_preset(raw, str(tmp_path / "p.yaml")))
    assert registry.resolve("pirate") is entry and not entry.removed
    assert registry.resolve("base/pirate") is found and found.spec.aliases == []
    number = entry.lora.number if entry.lora else 0
    registry.unregister("pirate")
    assert entry.removed and "pirate" not in registry.adapters
    again = registry.register("renamed", "base", str(tmp_path / "loras" / "pirate"), [],
                              False, 8)
    assert again.lora is not None and again.lora.number != number
