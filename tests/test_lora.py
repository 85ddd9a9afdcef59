"""LoRA adapters as models, on real vLLM: one engine serves its base and every adapter,
mixed in one batch, with no swap between them.

The adapters are made here with peft from random weights (``bench/lora_adapters.py``),
ranks 8 and 16, for the embedded model in float32. One router serves the module; its
base's worker starts once, then once more when a synthetic model takes its place.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from bench.lora_adapters import make_adapters, peft_greedy
from tests.conftest import RouterProcess, running_router

pytestmark = pytest.mark.integration

PROMPT = "Once upon a time, there was a"

LORA_PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  max_loaded_models: 1
  max_parked_models: 0  # the base stops for ``other``: its restarts are tested here
  load_timeout: 600
  spare_workers: 0
models:
  smollm2:
    model: "builtin:smollm2"
    dtype: float32
    max_model_len: 1024
    adapters_dir: {adapters_dir}
    max_loras: 3
    max_cpu_loras: 4
  a8: {base: smollm2, adapter: {a8}}
  b16: {base: smollm2, adapter: {b16}, aliases: [bee]}
  c8: {base: smollm2, adapter: {c8}, pinned: true}
  other: {model: "builtin:smollm2", engine: synthetic}
"""


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """a8 (rank 8), b16 (rank 16), c8 (rank 8) to declare; d8, e8 to drop into the
    adapters_dir at run time; r32 (rank 32, above the base's 16)."""
    folder = tmp_path_factory.mktemp("adapters")
    return make_adapters(folder, {"a8": (8, 4), "b16": (16, 2), "c8": (8, 5), "d8": (8, 1),
                                  "e8": (8, 6), "r32": (32, 7)})


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory, made: dict[str, Path]):  # type: ignore[no-untyped-def]
    adapters_dir = tmp_path_factory.mktemp("adapters_dir")
    subst = {"adapters_dir": str(adapters_dir), **{k: str(v) for k, v in made.items()}}
    with running_router(LORA_PRESET, tmp_path_factory.mktemp("lora"), "lora", subst) as r:
        r.adapters_dir = adapters_dir  # type: ignore[attr-defined]
        yield r


def complete(r: RouterProcess, model: str, prompt: str | list[int] = PROMPT,
             max_tokens: int = 8, **kw: Any) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
    return r.client.post(f"{r.url}/v1/completions", json=body, timeout=600)


def text(r: RouterProcess, model: str, **kw: Any) -> str:
    resp = complete(r, model, **kw)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == model
    return str(resp.json()["choices"][0]["text"])


def listed(r: RouterProcess) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in r.client.get(f"{r.url}/v1/models").json()["data"]}


def base_of(r: RouterProcess) -> dict[str, Any]:
    return dict(r.client.get(f"{r.url}/v1/models/smollm2").json())


def test_adapters_change_greedy_output_as_peft_does(lora: RouterProcess,
                                                    made: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    from bench.lora_adapters import base_path

    tokenizer = AutoTokenizer.from_pretrained(base_path())
    ids = tokenizer.encode(PROMPT)
    got = {name: text(lora, name, prompt=ids) for name in ("smollm2", "a8", "b16")}
    assert len(set(got.values())) == 3, got  # each adapter changes the base's words
    assert text(lora, "a8", prompt=ids) == got["a8"]  # and the same every time
    for name, adapter in (("smollm2", None), ("a8", made["a8"]), ("b16", made["b16"])):
        assert tokenizer.decode(peft_greedy(adapter, ids, 8)) == got[name], name


def test_one_batch_mixes_the_base_and_three_adapters(lora: RouterProcess) -> None:
    """vLLM 0.32's CPU ops gave a base request in a batch with adapters the last adapter's
    weights (worker/lora_ops.py): each answer must be what it is alone."""
    names = ["smollm2", "a8", "b16", "c8"]
    alone = {name: text(lora, name, max_tokens=16) for name in names}
    assert len(set(alone.values())) == 4, alone

    async def together() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=lora.url + "/v1", api_key="-",
                                      max_retries=0) as client:
            async def one(name: str) -> tuple[str, str]:
                out = await client.completions.create(model=name, prompt=PROMPT,
                                                      max_tokens=16, temperature=0)
                return name, out.choices[0].text
            return await asyncio.gather(*(one(n) for n in names * 3))

    for name, answer in asyncio.run(together()):
        assert answer == alone[name], name


def test_alternating_adapters_never_reload_the_base(lora: RouterProcess) -> None:
    before = base_of(lora)
    for name in ["a8", "bee", "a8", "b16", "a8", "b16"]:
        assert complete(lora, name, max_tokens=2).status_code == 200
    after = base_of(lora)
    assert (after["loads"], after["pid"]) == (before["loads"], before["pid"])


def test_models_lists_each_adapter_under_its_base(lora: RouterProcess,
                                                  made: dict[str, Path]) -> None:
    complete(lora, "b16", max_tokens=1)
    models = listed(lora)
    ids = list(models)
    assert ids.index("smollm2") < ids.index("a8")  # each base followed by its adapters
    a8, b16, c8 = models["a8"], models["b16"], models["c8"]
    assert (a8["parent"], a8["rank"], b16["rank"], b16["aliases"]) == ("smollm2", 8, 16, ["bee"])
    assert c8["pinned"] is True and c8["state"] == "resident"
    assert b16["state"] == "resident" and b16["load_seconds"] > 0
    assert a8["root"] == str(made["a8"])  # a server without keys: its one user is an admin
    assert "smollm2/d8" not in models  # a folder nobody asked for is not listed


def test_an_adapter_dropped_into_adapters_dir_is_found(lora: RouterProcess,
                                                       made: dict[str, Path]) -> None:
    folder: Path = lora.adapters_dir  # type: ignore[attr-defined]
    assert complete(lora, "smollm2/d8").status_code == 404
    shutil.copytree(made["d8"], folder / "d8")
    found = text(lora, "smollm2/d8")
    assert found not in (text(lora, "smollm2"), text(lora, "a8"))
    assert complete(lora, "d8").json()["model"] == "smollm2/d8"  # its folder name alone
    entry = listed(lora)["smollm2/d8"]
    assert (entry["parent"], entry["found"], entry["aliases"]) == ("smollm2", True, ["d8"])


def test_fifty_first_requests_load_a_new_adapter_once(lora: RouterProcess,
                                                      made: dict[str, Path]) -> None:
    shutil.copytree(made["e8"], lora.adapters_dir / "e8")  # type: ignore[attr-defined]

    async def fifty() -> list[int]:
        async with httpx.AsyncClient(timeout=600) as client:
            body = {"model": "smollm2/e8", "prompt": PROMPT, "max_tokens": 2}
            replies = await asyncio.gather(*(
                client.post(f"{lora.url}/v1/completions", json=body) for _ in range(50)))
            return [r.status_code for r in replies]

    assert asyncio.run(fifty()) == [200] * 50
    assert listed(lora)["smollm2/e8"]["adapter_loads"] == 1


def _bad_adapters(folder: Path, made: dict[str, Path]) -> None:
    """Folders that cannot be served, each for its own reason."""
    shutil.copytree(made["r32"], folder / "rank32")
    (folder / "broken").mkdir()
    (folder / "broken" / "adapter_config.json").write_text("{not json")
    shutil.copytree(made["a8"], folder / "garbage")
    (folder / "garbage" / "adapter_model.safetensors").write_bytes(b"\x00\x01not safetensors")
    import torch
    from safetensors.torch import save_file

    shutil.copytree(made["a8"], folder / "foreign")  # tensors of a model 1024 wide
    save_file({f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight":
               torch.zeros((8, 1024) if ab == "A" else (1024, 8)) for i in range(2)
               for ab in "AB"}, str(folder / "foreign" / "adapter_model.safetensors"))


def test_bad_adapters_are_4xx_naming_the_adapter_and_the_base_serves_on(
        lora: RouterProcess, made: dict[str, Path]) -> None:
    folder: Path = lora.adapters_dir  # type: ignore[attr-defined]
    _bad_adapters(folder, made)
    expect = {"smollm2/rank32": (400, "rank 32 is above"),
              "smollm2/broken": (400, "is not JSON"),
              "smollm2/garbage": (400, "cannot read adapter_model.safetensors"),
              "smollm2/foreign": (400, "made for another model")}
    for name, (status, words) in expect.items():
        resp = complete(lora, name)
        assert resp.status_code == status, (name, resp.text)
        error = resp.json()["error"]
        assert f"adapter '{name}'" in error["message"] and words in error["message"], error
        assert error["param"] == "model"
    for name in ("smollm2/nothere", "smollm2/../a8", "../a8", "smollm2/..", "smollm2/a8/.."):
        resp = complete(lora, name)
        assert resp.status_code == 404, (name, resp.text)
    client = anthropic.Anthropic(base_url=lora.url, api_key="-", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="smollm2/foreign", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["type"] == "error"  # type: ignore[index]
    assert "made for another model" in err.value.body["error"]["message"]  # type: ignore[index]
    embeddings = lora.client.post(f"{lora.url}/v1/embeddings",
                                  json={"model": "a8", "input": "hi"})
    assert embeddings.status_code == 400, embeddings.text  # never the base's embeddings
    assert embeddings.json()["error"]["code"] == "wrong_model_task"
    assert text(lora, "smollm2") and text(lora, "a8")  # everyone else is served as before


def test_least_recently_used_adapters_leave_and_pinned_stay(lora: RouterProcess,
                                                            made: dict[str, Path]) -> None:
    folder: Path = lora.adapters_dir  # type: ignore[attr-defined]
    for name in ("f1", "f2", "f3"):
        shutil.copytree(made["a8"], folder / name)
    for name in ("a8", "b16", "smollm2/f1", "smollm2/f2", "smollm2/f3"):
        assert complete(lora, name, max_tokens=1).status_code == 200
    states = {k: v["state"] for k, v in listed(lora).items() if v.get("parent")}
    # max_cpu_loras 4: c8 (pinned, least recently used) and the three last
    assert states["c8"] in ("resident", "cpu")
    assert (states["a8"], states["b16"]) == ("known", "known")
    assert {states[f"smollm2/f{i}"] for i in (1, 2, 3)} <= {"resident", "cpu"}


ONE_SLOT_PRESET = """
server: {host: 127.0.0.1, port: {port}, load_timeout: 600, spare_workers: 0}
models:
  smollm2:
    model: "builtin:smollm2"
    dtype: float32
    max_model_len: 1024
    max_loras: 1
    max_cpu_loras: 2
  p8: {base: smollm2, adapter: {c8}, pinned: true}
  a8: {base: smollm2, adapter: {a8}}
  b16: {base: smollm2, adapter: {b16}}
"""


def test_one_batch_slot_lru_and_a_pinned_adapter(tmp_path_factory: pytest.TempPathFactory,
                                                 made: dict[str, Path]) -> None:
    """``max_loras: 1`` with a pinned adapter: vLLM's own pin would hold the only batch
    slot for good, and its engine died on the next other adapter. The pin is the pool's:
    the pinned adapter never leaves the engine, the others leave least recently used
    first (``max_cpu_loras: 2``: the pinned one and one more), and requests of three
    adapters and the base at once take turns in the slot, each answered as alone."""
    subst = {k: str(v) for k, v in made.items()}
    with running_router(ONE_SLOT_PRESET, tmp_path_factory.mktemp("one-slot"), "one-slot",
                        subst) as r:
        names = ["smollm2", "p8", "a8", "b16"]
        alone = {name: text(r, name) for name in names}
        assert len(set(alone.values())) == 4, alone
        states = {k: v["state"] for k, v in listed(r).items() if v.get("parent")}
        assert states == {"p8": "cpu", "a8": "known", "b16": "resident"}, states

        async def together() -> list[tuple[str, str]]:
            async with openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="-",
                                          max_retries=0) as client:
                async def one(name: str) -> tuple[str, str]:
                    out = await client.completions.create(model=name, prompt=PROMPT,
                                                          max_tokens=8, temperature=0)
                    return name, out.choices[0].text
                return await asyncio.gather(*(one(n) for n in names * 3))

        pid = base_of(r)["pid"]
        for name, answer in asyncio.run(together()):
            assert answer == alone[name], name
        models = listed(r)
        assert models["p8"]["state"] in ("resident", "cpu") and models["p8"]["adapter_loads"] == 1
        assert base_of(r)["pid"] == pid and base_of(r)["state"] == "ready"


def test_admin_unloads_and_loads_an_adapter_inside_the_running_base(
        lora: RouterProcess) -> None:
    pid = base_of(lora)["pid"]
    out = lora.client.post(f"{lora.url}/v1/models/load", json={"model": "b16"}, timeout=600)
    assert out.status_code == 200 and out.json()["state"] in ("resident", "cpu"), out.text
    out = lora.client.post(f"{lora.url}/v1/models/unload", json={"model": "b16"}, timeout=60)
    assert out.status_code == 200 and out.json()["state"] == "known", out.text
    assert base_of(lora)["state"] == "ready" and base_of(lora)["pid"] == pid


def test_a_restarted_base_gets_its_adapters_back_before_it_serves(lora: RouterProcess) -> None:
    assert complete(lora, "a8", max_tokens=1).status_code == 200
    assert complete(lora, "other", max_tokens=1).status_code == 200  # evicts the base
    assert base_of(lora)["state"] == "unloaded"
    assert listed(lora)["a8"]["state"] == "known"
    out = lora.client.post(f"{lora.url}/v1/models/load", json={"model": "smollm2"}, timeout=600)
    assert out.status_code == 200, out.text
    states = {k: v["state"] for k, v in listed(lora).items() if v.get("parent")}
    # c8 pinned, restored first: loaded, behind the more recent ones in the LRU order
    assert states["c8"] in ("resident", "cpu") and states["a8"] in ("resident", "cpu"), states
    assert complete(lora, "other", max_tokens=1).status_code == 200  # the base out again
    assert text(lora, "a8")  # an adapter's request loads its base
    assert base_of(lora)["state"] == "ready"


def test_reload_adds_and_removes_adapters_without_restarting_the_base(
        lora: RouterProcess, made: dict[str, Path]) -> None:
    pid = base_of(lora)["pid"]
    preset = lora.preset.read_text()
    changed = preset.replace(f"  c8: {{base: smollm2, adapter: {made['c8']}, pinned: true}}\n",
                             f"  g8: {{base: smollm2, adapter: {made['d8']}}}\n")
    assert changed != preset
    lora.preset.write_text(changed)
    try:
        out = lora.client.post(f"{lora.url}/v1/config/reload", timeout=60)
        assert out.status_code == 200, out.text
        assert complete(lora, "c8").status_code == 404
        assert text(lora, "g8") == text(lora, "smollm2/d8")  # the same folder's weights
        assert base_of(lora)["pid"] == pid
    finally:
        lora.preset.write_text(preset)
        lora.client.post(f"{lora.url}/v1/config/reload", timeout=60)
    assert json.dumps(listed(lora)["c8"]["parent"]) == '"smollm2"'
