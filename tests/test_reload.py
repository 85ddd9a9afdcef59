"""Hot reload of the preset (``router/lifecycle/reload.py``): the diff, its application to a running
router, and the three triggers (``POST /v1/config/reload``, SIGHUP, ``--watch-config``).

Unit tests need no worker. The integration test runs one router with real vLLM workers on
the embedded model and walks it through a sequence of reloads (four loads in all); the
file watch runs against a router of synthetic workers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest

from router.access.admission import Keys
from router.errors import BadRequest, ModelNotFound
from router.lifecycle.reload import Reloader, diff_presets, fingerprint
from router.lifecycle.supervisor import Supervisor
from router.registry import ModelRegistry
from router.workers.placement import Placer
from shared.config import restart_needed
from shared.preset_loader import build_preset, load_preset
from tests.conftest import ROOT, RouterProcess, running_router

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
    # rotated in place: the KeyGuard holds this object
    assert rl.keys.identify(b"new-key") is not None and rl.keys.identify(b"old-key") is None
    assert registry.resolve("shared-name") is second and registry.resolve("one") is first
    assert registry.resolve(None) is second and registry.resolve("four").id == "fourth"
    assert registry.entries["first"] is first  # the same entry: its worker is kept
    assert second.slots is not None and second.slots.free == 1
    with pytest.raises(ModelNotFound):
        registry.named("third")
    assert third.removed and list(registry.entries) == ["first", "second", "fourth"]
    with pytest.raises(ModelNotFound, match="removed from the configuration"):
        rl.supervisor.start_loading(third)  # a request queued before the reload


def test_the_watch_sees_the_files_a_preset_names(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``--watch-config`` reloads when a model's ``chat_template`` file or the
    ``api_key_file`` changes, not only the preset file; a touch alone is no change, and a
    template the last reload named is watched from then on. (Before: the preset file
    alone was watched, and an edited template waited for a SIGHUP.)"""
    (tmp_path / "a.jinja").write_text("{{ messages }} a")
    (tmp_path / "b.jinja").write_text("{{ messages }} b")
    keys = tmp_path / "keys.txt"
    keys.write_text("k1\n")
    path = tmp_path / "p.yaml"
    preset = ("server: {{port: 9999, api_key_file: {keys}}}\n"
              "models:\n  m: {{model: /m, chat_template: {template}}}\n")
    path.write_text(preset.format(keys=keys, template="a.jinja"))
    rl = reloader_for(path)
    assert rl.watched == [str(path), str(tmp_path / "a.jinja"), str(keys)]
    triggers: list[str] = []

    async def logged(trigger: str) -> None:
        triggers.append(trigger)
        await rl.reload(trigger)

    monkeypatch.setattr(rl, "_logged", logged)

    async def scenario() -> None:
        watch = asyncio.create_task(rl._watch(interval=0.02))

        async def after(change: Any) -> list[str]:
            await asyncio.sleep(0.1)
            before = len(triggers)
            change()
            for _ in range(50):
                await asyncio.sleep(0.02)
                if len(triggers) > before:
                    break
            await asyncio.sleep(0.1)
            return triggers[before:]

        assert await after(lambda: os.utime(tmp_path / "a.jinja")) == []  # a touch alone
        got = await after(lambda: (tmp_path / "a.jinja").write_text("{{ messages }} A!"))
        assert got == [f"changed: {tmp_path / 'a.jinja'}"]
        assert rl.models["m"].chat_template == "{{ messages }} A!"
        got = await after(lambda: keys.write_text("k2\n"))
        assert got == [f"changed: {keys}"] and rl.keys.identify(b"k2") is not None
        got = await after(lambda: path.write_text(preset.format(keys=keys, template="b.jinja")))
        assert got == ["file changed"] and rl.watched[1] == str(tmp_path / "b.jinja")
        got = await after(lambda: (tmp_path / "b.jinja").write_text("{{ messages }} B!"))
        assert got == [f"changed: {tmp_path / 'b.jinja'}"]
        assert rl.models["m"].chat_template == "{{ messages }} B!"
        assert await after(lambda: (tmp_path / "a.jinja").write_text("gone from the list")) == []
        watch.cancel()
        await asyncio.sleep(0.1)  # the removed model's stop, if any, runs

    asyncio.run(scenario())


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
        assert old_slots.free == 2 and second.slots.free == 5

    asyncio.run(scenario())


def test_from_a_reloads_answer_on_no_request_leases_a_changed_models_old_worker(
        tmp_path: Path) -> None:
    """Found by clean-clone CI on fa3909f: the restart was decided in a task, so a request
    that came right after the reload's answer could still lease the worker of the old
    spec (test_reload_adds_changes_removes... read 'ready' where 'stopping' was due)."""
    from tests.test_scheduling import supervisor

    sup, loads = supervisor(tmp_path, {"m": {"max_model_len": 512}}, stop_seconds=0.05)
    entry = sup.registry.entries["m"]

    async def scenario() -> None:
        held, _ = await sup.acquire("m")
        worker = sup.worker_of(entry)
        assert worker is not None
        worker.spec = entry.spec
        entry.respec(msgspec.structs.replace(entry.spec, max_model_len=768))
        sup.refresh(entry, load=False)
        # no await since the refresh: what a request right after the answer finds
        assert entry.state == "stopping"
        assert not isinstance(sup.acquire_now("m"), tuple)
        waiter = asyncio.create_task(sup.acquire("m"))  # waits for the stop, then loads
        await asyncio.sleep(0.01)
        held.release()
        lease, _ = await waiter
        assert loads == ["m", "m"] and entry.state == "ready"
        lease.release()
        await sup.stop_all()

    asyncio.run(asyncio.wait_for(scenario(), 30))


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


# -- all or nothing: adapter folders, keys, new models ---------------------------------

ADAPTED = """
server: {port: 8080, api_keys: [old-key, kept-key], admin_api_keys: [admin-key]}
models:
  qwen: {model: /m, adapters_dir: loras}
"""
ADAPTED_AFTER = """
server: {port: 8080, api_keys: [kept-key], admin_api_keys: [admin-key]%s}
models:
  qwen: {model: /m, adapters_dir: loras}
  fresh: {model: /m}
"""
LORA = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}


def lora_folder(folder: Path, **fault: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({**LORA, **fault}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def unchanged(rl: Reloader) -> None:
    """``rl``'s router serves as it did from ``ADAPTED``: its keys, its models."""
    assert rl.keys.identify(b"old-key") is not None  # the key the file dropped still works
    assert rl.keys.identify(b"kept-key") is not None
    registry = rl.supervisor.registry
    assert list(registry.entries) == ["qwen"] and "tuned" not in registry.adapters
    with pytest.raises(ModelNotFound):
        registry.resolve("fresh")  # the new model is not served
    assert list(rl.models) == ["qwen"]  # what the next reload compares with


def reloads_once(rl: Reloader, path: Path, added: list[str]) -> None:
    """A good file reloads now, reporting ``added`` once (never again at the next)."""
    answer = asyncio.run(rl.reload("test"))
    assert answer["added"] == added and answer["removed"] == [], answer
    assert rl.keys.identify(b"old-key") is None and rl.keys.identify(b"kept-key") is not None
    assert rl.supervisor.registry.resolve("fresh").id == "fresh"
    again = asyncio.run(rl.reload("test"))
    assert again["added"] == [] and again["unchanged"] == ["qwen", *added], again


@pytest.mark.parametrize("fault", ["malformed", "missing", "not json"])
def test_a_reload_refused_for_an_adapter_folder_changes_nothing(
        tmp_path: Path, fault: str) -> None:
    """The file drops a key, adds a model and declares an adapter whose folder is
    malformed or missing: a 400 naming file, model and key, the dropped key still works,
    the new model is not served; once the folder is fixed, a reload adds both, once."""
    path = tmp_path / "p.yaml"
    path.write_text(ADAPTED)
    (tmp_path / "loras").mkdir()
    rl = reloader_for(path)
    tuned = tmp_path / "tuned"
    if fault == "malformed":
        lora_folder(tuned, lora_alpha="sixteen")
    elif fault == "not json":
        lora_folder(tuned)
        (tuned / "adapter_config.json").write_text('{"r": 8,')
    path.write_text(ADAPTED_AFTER % "" + f"  tuned: {{base: qwen, adapter: {tuned}}}\n")
    with pytest.raises(BadRequest) as refused:
        asyncio.run(rl.reload("test"))
    error = refused.value
    assert (error.status, error.code) == (400, "invalid_config")
    assert error.message.startswith(f"{path}: model 'tuned': key 'adapter': "), error.message
    assert {"malformed": "$.lora_alpha", "missing": "no adapter folder",
            "not json": "is not JSON"}[fault] in error.message
    unchanged(rl)
    lora_folder(tuned)
    reloads_once(rl, path, ["fresh", "tuned"])


def test_a_found_adapters_folder_broken_before_a_reload_leaves_no_half_reload(
        tmp_path: Path) -> None:
    """An adapter found in ``qwen``'s ``adapters_dir`` is rewritten with a malformed
    config before a reload that drops a key and adds a model: the reload applies whole
    (the found folder is no part of the file: its requests are refused with the reason),
    never a 500 with the key already dropped and the model already served."""
    path = tmp_path / "p.yaml"
    path.write_text(ADAPTED)
    lora_folder(tmp_path / "loras" / "pirate")
    rl = reloader_for(path)
    registry = rl.supervisor.registry
    found = registry.resolve("qwen/pirate")
    assert found.found and found.rank == 8
    lora_folder(tmp_path / "loras" / "pirate", lora_alpha="sixteen", target_modules=5)
    path.write_text(ADAPTED_AFTER % "")
    reloads_once(rl, path, ["fresh"])
    again = registry.resolve("qwen/pirate")
    assert again.found and again.rank is None  # unreadable: its base's worker refuses it
    assert again.lora is not None and found.lora is not None
    assert again.lora.number != found.lora.number  # a folder rewritten: loaded anew


def test_a_preload_name_is_checked_before_anything_switches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``preload`` naming the new model in another case (a start refuses it: names are
    exact there) is a 400 that changes nothing, not a 404 after the switch."""
    path = tmp_path / "p.yaml"
    path.write_text(ADAPTED)
    (tmp_path / "loras").mkdir()
    rl = reloader_for(path)
    loads: list[str] = []
    monkeypatch.setattr(rl.supervisor, "start_loading", lambda entry: loads.append(entry.id))
    path.write_text(ADAPTED_AFTER % ", preload: [FRESH]")
    with pytest.raises(BadRequest) as refused:
        asyncio.run(rl.reload("test"))
    assert refused.value.code == "invalid_config"
    assert "[server]: key 'preload': no model or alias named 'FRESH'" in refused.value.message
    unchanged(rl)
    lora_folder(tmp_path / "loras" / "pirate")
    path.write_text(ADAPTED_AFTER % ", preload: [fresh, qwen/pirate]")
    reloads_once(rl, path, ["fresh"])
    assert loads == ["fresh"]  # (qwen, pirate's base, was there before: not added)


SYNTHETIC = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  api_keys: [old-key, kept-key]
  admin_api_keys: [admin-key]
models:
  qwen: {model: /synthetic, engine: synthetic, adapters_dir: {loras}}
"""


def test_over_http_a_refused_reload_is_a_400_and_the_old_key_still_works(
        tmp_path: Path) -> None:
    """Over HTTP, against a router of synthetic workers (no vLLM): a reload that drops a
    key, adds a model and declares a malformed adapter folder (a 500 before) is a 400
    changing nothing, while a found adapter's folder broken meanwhile refuses nothing;
    the reload once the declared folder is fixed adds the model once. (A 500 that left
    the key dropped and the model served: ``..._leaves_no_half_reload`` above.)"""
    loras = tmp_path / "loras"
    lora_folder(loras / "pirate")
    tuned = lora_folder(tmp_path / "tuned", lora_alpha="sixteen")
    with running_router(SYNTHETIC, tmp_path, "reload-all", {"loras": str(loras)}) as r:
        def ask(key: str, method: str, path: str, body: Any = None) -> httpx.Response:
            return r.client.request(method, r.url + path, json=body, timeout=60,
                                    headers={"Authorization": f"Bearer {key}"})

        def chat(key: str, model: str) -> httpx.Response:
            return ask(key, "POST", "/v1/chat/completions", {
                "model": model, "max_tokens": 2, "messages": [{"role": "user",
                                                               "content": "hi"}]})

        assert chat("admin-key", "qwen/pirate").status_code == 200  # found
        lora_folder(loras / "pirate", lora_alpha="sixteen")  # and now broken
        r.preset.write_text(r.preset.read_text().replace("[old-key, kept-key]", "[kept-key]")
                            + "  fresh: {model: /synthetic, engine: synthetic}\n"
                            f"  tuned: {{base: qwen, adapter: {tuned}}}\n")
        refused = ask("admin-key", "POST", "/v1/config/reload")
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "invalid_config", error
        assert "model 'tuned': key 'adapter'" in error["message"], error
        assert "$.lora_alpha" in error["message"], error
        assert chat("old-key", "qwen").status_code == 200  # the dropped key still works
        assert chat("kept-key", "fresh").status_code == 404  # the new model is not served
        lora_folder(tuned)
        answer = ask("admin-key", "POST", "/v1/config/reload")
        assert answer.status_code == 200, answer.text
        assert answer.json()["added"] == ["fresh", "tuned"], answer.json()
        assert chat("old-key", "qwen").status_code == 401
        assert chat("kept-key", "fresh").status_code == 200
        assert chat("kept-key", "tuned").json()["model"] == "tuned"
        broken = chat("kept-key", "qwen/pirate")  # found, now malformed: refused, named
        assert broken.status_code == 400 and "$.lora_alpha" in broken.text, broken.text
        again = ask("admin-key", "POST", "/v1/config/reload").json()
        assert again["added"] == [] and again["removed"] == [], again


# -- a real router, real workers -----------------------------------------------------

STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
START = """
server: {host: 127.0.0.1, port: {port}, load_timeout: 600, drain_timeout: 300,
         default_model: keep}
models:
  keep: {model: "builtin:smollm2", cpu_cores: "0", max_model_len: 512, load_on_startup: true}
  shifty: {model: "builtin:smollm2", cpu_cores: "1", max_model_len: 512, aliases: [shift],
           load_on_startup: true}
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with running_router(START, tmp_path_factory.mktemp("reload"), "reload") as r:
        r.wait_model("keep")
        r.wait_model("shifty")
        yield r


def rewrite(r: RouterProcess, text: str) -> None:
    r.preset.write_text(text.replace("{port}", str(r.port)))


def models(r: RouterProcess) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in r.client.get(f"{r.url}/v1/models").json()["data"]}


def reload(r: RouterProcess) -> httpx.Response:
    return r.client.post(f"{r.url}/v1/config/reload", timeout=30)


class Stream(threading.Thread):
    """A streamed chat read to its end in a thread; ``started`` is set at its first chunk."""

    def __init__(self, r: RouterProcess, model: str) -> None:
        super().__init__()
        self.r, self.model = r, model
        self.started = threading.Event()
        self.chunks: list[Any] = []
        self.error: BaseException | None = None
        self.start()
        assert self.started.wait(300), r.tail()

    def run(self) -> None:
        try:
            with openai.OpenAI(base_url=self.r.url + "/v1", api_key="unused", max_retries=0,
                               timeout=300) as client:
                for chunk in client.chat.completions.create(
                        model=self.model, messages=STORY, max_tokens=100, stream=True,  # type: ignore[arg-type]
                        extra_body={"ignore_eos": True}):
                    self.chunks.append(chunk)
                    self.started.set()
        except Exception as err:  # noqa: BLE001  # a thread's error: finished() asserts on it
            self.error = err
            self.started.set()

    def finished(self) -> int:
        """Tokens streamed; the stream must have ended normally, at its length."""
        self.join(300)
        assert self.error is None and not self.is_alive(), self.error
        assert self.chunks[-1].choices[0].finish_reason == "length"
        return sum(bool(c.choices and c.choices[0].delta.content) for c in self.chunks)


def wait_for(check: Any, what: str, r: RouterProcess, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}\n{r.tail()}"
        time.sleep(0.2)


@pytest.mark.integration
def test_reload_adds_changes_removes_and_streams_in_flight_finish(live: RouterProcess) -> None:
    before = models(live)
    keep_pid, shifty_pid = before["keep"]["pid"], before["shifty"]["pid"]

    # 1. shifty changes (a restart) while it streams; fresh is added; keep is untouched
    stream = Stream(live, "shift")
    rewrite(live, START.replace("max_model_len: 512, aliases: [shift]",
                                "max_model_len: 768, aliases: [shift]")
            + '  fresh: {model: "builtin:smollm2", cpu_cores: "1", max_model_len: 512,'
              ' aliases: [new-name]}\n')
    answer = reload(live)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "source": str(live.preset), "added": ["fresh"], "removed": [], "changed": ["shifty"],
        "unchanged": ["keep"], "changed_keys": {"shifty": ["max_model_len"]},
        "applied": [], "restart_required": []}
    now = models(live)
    assert now["shifty"]["state"] == "stopping" and now["shifty"]["pid"] == shifty_pid
    assert now["fresh"]["state"] == "unloaded" and now["keep"]["pid"] == keep_pid
    waiter = Stream(live, "shifty")  # waits for the new worker meanwhile
    assert stream.finished() > 50
    assert waiter.finished() > 50
    wait_for(lambda: models(live)["shifty"]["state"] == "ready", "shifty back", live)
    now = models(live)
    assert now["shifty"]["pid"] not in (shifty_pid, None) and now["shifty"]["max_model_len"] == 768
    wait_for(lambda: psutil_gone(shifty_pid), "the old worker is gone", live, 30)

    # 2. shifty is removed while it streams: it finishes, new requests get a 404
    stream = Stream(live, "shifty")
    new_pid = models(live)["shifty"]["pid"]
    rewrite(live, START.split("  shifty:")[0].replace("default_model: keep", "")
            + '  fresh: {model: "builtin:smollm2", cpu_cores: "1", max_model_len: 512,'
              ' aliases: [new-name]}\n')
    answer = reload(live)
    assert answer.status_code == 200, answer.text
    assert answer.json()["removed"] == ["shifty"] and answer.json()["changed"] == []
    assert answer.json()["unchanged"] == ["keep", "fresh"]
    assert answer.json()["applied"] == ["default_model"]  # none: an unknown name is a 404
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                       timeout=300) as client:
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="shifty", messages=STORY, max_tokens=2)  # type: ignore[arg-type]
        assert stream.finished() > 50
        assert "shifty" not in models(live)  # at once; its worker drains meanwhile
        wait_for(lambda: psutil_gone(new_pid), "the removed model's worker stops", live, 30)
        # the added model loads on first use, by its alias
        reply = client.chat.completions.create(model="new-name", messages=STORY,  # type: ignore[arg-type]
                                               max_tokens=2)
        assert reply.model == "fresh"
    assert models(live)["keep"]["pid"] == keep_pid

    # 3. a broken file: a 400 naming file, model and key; nothing changes
    state = {k: (m["state"], m.get("pid")) for k, m in models(live).items()}
    rewrite(live, START + '  bad: {model: "builtin:smollm2", env: {T: "${env:RELOAD_UNSET}"}}\n')
    answer = reload(live)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_config" and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{live.preset}: model 'bad': key 'env.T': ")
    assert {k: (m["state"], m.get("pid")) for k, m in models(live).items()} == state


@pytest.mark.integration
def test_sighup_reloads_and_router_only_keys_keep_the_worker(live: RouterProcess) -> None:
    assert live.proc is not None
    keep = models(live)["keep"]
    rewrite(live, START.split("  shifty:")[0].replace(
        "load_on_startup: true}", "load_on_startup: true, aliases: [keeper], ttl: 3600}")
        .replace("default_model: keep", "default_model: keeper"))
    live.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: models(live)["keep"].get("aliases") == ["keeper"], "SIGHUP reload", live,
             timeout=10)
    now = models(live)["keep"]
    assert now["pid"] == keep["pid"] and now["state"] == "ready" and now["ttl"] == 3600
    for name in ("keeper", "no-such-name"):  # an alias, and the default by its alias
        reply = live.client.post(f"{live.url}/v1/chat/completions", timeout=120, json={
            "model": name, "messages": STORY, "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["model"] == "keep", reply.text
    assert live.proc.poll() is None


def psutil_gone(pid: int) -> bool:
    import psutil

    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


# -- the file watch (synthetic workers: it is the trigger under test) ------------------

WATCHED = """
server: {host: 127.0.0.1, port: {port}, spare_workers: 0}
models:
  syn-a: {model: /synthetic, engine: synthetic}
"""


class WatchingRouter(RouterProcess):
    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.log = open(self.log_path, "wb")  # noqa: SIM115  # the router's stdout until stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router", "serve", "--config", str(self.preset),
             "--watch-config"], cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)


@pytest.mark.integration
def test_watch_config_reloads_on_a_change_of_content(tmp_path: Path) -> None:
    r = WatchingRouter(WATCHED, tmp_path, "watched")
    r.start()
    try:
        r.wait_healthy()
        time.sleep(1.5)  # the watcher's first look
        def reloads() -> int:
            return r.tail(1000).count("config reloaded from")

        os.utime(r.preset)  # a touch alone is not a change
        time.sleep(2)
        assert reloads() == 0
        rewrite(r, WATCHED + "  syn-b: {model: /synthetic, engine: synthetic}\n")
        wait_for(lambda: "syn-b" in models(r), "the watch saw the change", r, timeout=5)
        time.sleep(2.5)
        assert reloads() == 1
        rewrite(r, WATCHED + "  syn-b: {model: /synthetic, engine: synthetic, ttl: soon}\n")
        wait_for(lambda: "refused; the running config stays" in r.tail(), "refused", r, 5)
        assert "model 'syn-b': key 'ttl'" in r.tail() and "syn-b" in models(r)
        rewrite(r, WATCHED)
        wait_for(lambda: "syn-b" not in models(r), "the fixed file applied", r, timeout=5)
        assert r.client.post(f"{r.url}/v1/chat/completions", json={
            "model": "syn-a", "messages": STORY, "max_tokens": 3}).status_code == 200
    finally:
        r.stop()
