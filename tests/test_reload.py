"""Hot reload of the preset (``router/reload.py``): the diff, its application to a running
router, and the three triggers (``POST /v1/config/reload``, SIGHUP, ``--watch-config``).

Unit tests need no worker. The integration test runs one router with real vLLM workers on
the embedded model and walks it through a sequence of reloads (four loads in all); the
file watch runs against a router of synthetic workers.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from router.admission import Keys
from router.errors import BadRequest, ModelNotFound
from router.placement import Placer
from router.registry import ModelRegistry
from router.reload import Reloader, diff_presets, fingerprint
from router.supervisor import Supervisor
from shared.config import build_preset, load_preset, restart_needed

# -- the diff ------------------------------------------------------------------------


def preset(server: dict[str, Any] | None = None, **models: dict[str, Any]):  # type: ignore[no-untyped-def]
    return build_preset({"server": server or {},
                         "models": {n: {"model": "/m", **m} for n, m in models.items()}})


def test_diff_sorts_models_and_server_keys() -> None:
    old = preset({"port": 1, "ttl": 5, "host": "127.0.0.1"},
                 same={"aliases": ["s"]}, gone={}, moved={"max_model_len": 512},
                 renamed={"aliases": ["r"]})
    new = preset({"port": 2, "ttl": 9, "host": "127.0.0.1", "api_keys": ["k"]},
                 same={"aliases": ["s"]}, moved={"max_model_len": 1024},
                 renamed={"aliases": ["r2"], "ttl": 3}, fresh={})
    diff = diff_presets(old, new)
    assert (diff.added, diff.removed, diff.unchanged) == (["fresh"], ["gone"], ["same"])
    assert diff.changed == ["moved", "renamed"]
    assert diff.changed_keys == {"moved": ["max_model_len"], "renamed": ["aliases", "ttl"]}
    # ttl applies at once; a new port needs a restart; keys are compared by the Reloader
    assert diff.applied == ["ttl"] and diff.restart_required == ["port"]
    assert diff_presets(new, new) == diff_presets(new, preset(
        {"port": 2, "ttl": 9, "host": "127.0.0.1"}, same={"aliases": ["s"]},
        moved={"max_model_len": 1024}, renamed={"aliases": ["r2"], "ttl": 3}, fresh={}))


def test_only_router_side_keys_spare_a_running_worker() -> None:
    base = preset(m={"aliases": ["a"], "ttl": 10}).models["m"]
    for key, value in [("aliases", ["b"]), ("ttl", 60.0), ("pinned", True), ("priority", 3),
                       ("owned_by", "lab"), ("load_on_startup", True)]:
        assert not restart_needed(base, msgspec.structs.replace(base, **{key: value})), key
    for key, value in [("max_model_len", 4096), ("env", {"A": "1"}), ("cpu_cores", "1"),
                       ("chat_template", "{{ x }}"), ("max_concurrent", 2), ("task", "embed")]:
        assert restart_needed(base, msgspec.structs.replace(base, **{key: value})), key


def test_fingerprint_hashes_only_when_mtime_or_size_move(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("a: 1\n")
    hashed: list[bytes] = []

    def counting(data: bytes) -> Any:
        import hashlib
        hashed.append(data)
        return hashlib.sha256(data)

    first = fingerprint(str(path), None, counting)
    assert fingerprint(str(path), first, counting) is first and len(hashed) == 1
    os.utime(path, ns=(first[0] + 10**9, first[0] + 10**9))  # a touch: same content
    touched = fingerprint(str(path), first, counting)
    assert touched[2] == first[2] and touched[0] != first[0] and len(hashed) == 2
    path.write_text("a: 2\n")
    assert fingerprint(str(path), touched, counting)[2] != first[2]


# -- applying a reload, no workers ---------------------------------------------------

BEFORE = """
server: {port: 8080, ttl: 30, default_model: first, api_keys: [old-key]}
models:
  first: {model: /m, aliases: [one, shared-name]}
  second: {model: /m, aliases: [two], max_concurrent: 2}
  third: {model: /m}
"""
AFTER = """
server: {port: 9999, ttl: 5, default_model: second, api_keys: ["${env:RELOAD_TEST_KEY}"]}
models:
  first: {model: /m, aliases: [one]}
  second: {model: /m, aliases: [two, shared-name], max_concurrent: 1}
  fourth: {model: /m, aliases: [four]}
"""


def reloader_for(path: Path, overrides: dict[str, Any] | None = None) -> Reloader:
    start = load_preset(path)
    for key, value in (overrides or {}).items():
        setattr(start.server, key, value)
    sup = Supervisor(ModelRegistry(start), start.server, path.parent, Placer(cores={0}, gpus={}))
    return Reloader(str(path), start, sup, Keys.load(start.server, str(path)), overrides)


def test_a_reload_switches_names_default_keys_and_runtime_keys_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BEFORE)
    rl = reloader_for(path)
    registry, server = rl.supervisor.registry, rl.supervisor.server
    first, second, third = (registry.entries[n] for n in ("first", "second", "third"))
    monkeypatch.setenv("RELOAD_TEST_KEY", "new-key")
    path.write_text(AFTER)

    async def scenario() -> dict[str, Any]:
        answer = await rl.reload("test")
        await asyncio.sleep(0.05)  # the removed model's stop runs (it has no worker)
        return answer

    answer = asyncio.run(scenario())
    assert answer == {
        "source": str(path), "added": ["fourth"], "removed": ["third"],
        "changed": ["first", "second"], "unchanged": [],
        "changed_keys": {"first": ["aliases"], "second": ["aliases", "max_concurrent"]},
        "applied": ["default_model", "ttl", "api_keys"], "restart_required": ["port"]}
    assert server.ttl == 5 and server.port == 8080  # the port waits for a restart
    assert rl.keys.user == [b"new-key"]  # rotated in place: the KeyGuard holds this object
    assert registry.resolve("shared-name") is second and registry.resolve("one") is first
    assert registry.resolve(None) is second and registry.resolve("four").id == "fourth"
    assert registry.entries["first"] is first  # the same entry: its worker is kept
    assert second.slots is not None and second.slots._value == 1
    with pytest.raises(ModelNotFound):
        registry.resolve("third", use_default=False)
    assert third.removed and list(registry.entries) == ["first", "second", "fourth"]
    with pytest.raises(ModelNotFound, match="removed from the configuration"):
        rl.supervisor.start_loading(third)  # a request queued before the reload


def test_a_lease_taken_before_a_reload_gives_its_slot_back_to_its_own_semaphore(
        tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BEFORE)
    rl = reloader_for(path)
    second = rl.supervisor.registry.entries["second"]
    old_slots = second.slots
    assert old_slots is not None

    async def scenario() -> None:
        from router.registry import Lease

        lease = Lease(second)
        await rl.supervisor._take_slot(lease)
        path.write_text(BEFORE.replace("max_concurrent: 2", "max_concurrent: 5"))
        await rl.reload("test")
        assert second.slots is not old_slots and second.slots is not None
        lease.release()
        assert old_slots._value == 2 and second.slots._value == 5

    asyncio.run(scenario())


@pytest.mark.parametrize("text,message", [
    ("models:\n  first: {model: /m, max_model_len: lots}\n", "model 'first': key 'max_model_len'"),
    ('models:\n  first: {model: /m, env: {T: "${env:RELOAD_UNSET}"}}\n',
     "model 'first': key 'env.T': environment variable 'RELOAD_UNSET' is not set"),
    ("server: {preload: [nobody]}\nmodels:\n  first: {model: /m}\n",
     "[server]: key 'preload': no model or alias named 'nobody'"),
    ("server: {memory_budget_gib: {cpu: 1}}\nmodels:\n  first: {model: /m}\n",
     "model 'first': needs 2 GiB on cpu"),
    ("models: [\n", "line 2, column 1"),
])
def test_a_broken_file_is_a_400_naming_the_spot_and_changes_nothing(
        tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BEFORE)
    rl = reloader_for(path)
    path.write_text(text)
    with pytest.raises(BadRequest) as info:
        asyncio.run(rl.reload("test"))
    assert info.value.status == 400 and info.value.code == "invalid_config"
    assert info.value.message.startswith(f"{path}: ") and message in info.value.message
    registry = rl.supervisor.registry
    assert list(registry.entries) == ["first", "second", "third"]
    assert registry.resolve(None).id == "first" and rl.supervisor.server.ttl == 30
    assert rl.supervisor.server.memory_budget_gib == {}


def test_command_line_overrides_win_at_every_reload(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(BEFORE)
    rl = reloader_for(path, {"port": 7000})
    answer = asyncio.run(rl.reload("test"))
    assert answer["restart_required"] == [] and answer["unchanged"] == ["first", "second",
                                                                        "third"]
    assert rl.supervisor.server.port == 7000
