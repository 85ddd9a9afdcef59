"""LoRA adapters without an engine: the corrected CPU ops, the preset's adapter entries,
name resolution of adapters, and the worker's pool of loaded adapters."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from router.errors import ModelNotFound
from router.registry import ModelRegistry
from shared.adapters import AdapterError, folder_in, rank_cap, read_adapter
from shared.config import ConfigError
from shared.preset_loader import build_preset, parse_ini
from shared.protocol import LoraRef
from worker import lora_ops
from worker.adapters import AdapterPool, ModelShape, check_adapter


def adapter(folder: Path, rank: int = 8, shape: tuple[int, int] = (576, 576)) -> Path:
    """A LoRA folder peft would write (one layer's q_proj, zeros) for a model
    ``shape[0]`` wide."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file({name.format("A"): torch.zeros(rank, shape[0]),
               name.format("B"): torch.zeros(shape[1], rank)},
              str(folder / "adapter_model.safetensors"))
    return folder


# -- the ops ---------------------------------------------------------------------------
def test_a_token_of_no_adapter_gets_nothing_from_the_last_adapter_slot() -> None:
    """vLLM 0.32's own op adds the last slot's product to a base-model token (index -1);
    the corrected one adds nothing, and both agree on the adapters' tokens."""
    from vllm.lora.ops.torch_ops import lora_ops as vllm_ops

    torch.manual_seed(0)
    slots, rank, width = 3, 4, 6
    shrink_w = torch.randn(slots, 1, rank, width)
    expand_w = torch.randn(slots, 1, width, rank)
    x = torch.randn(4, width)
    indices = torch.tensor([0, -1, 2, -1])

    def run(ops: object) -> torch.Tensor:
        buffer = torch.zeros(4, rank)
        out = torch.ones(4, width)
        ops.bgmv_shrink(x, shrink_w, buffer, indices, 1.0)  # type: ignore[attr-defined]
        ops.bgmv_expand(buffer, expand_w, out, indices, True)  # type: ignore[attr-defined]
        return out

    ours, theirs = run(lora_ops), run(vllm_ops)
    assert torch.equal(ours[1], torch.ones(width)) and torch.equal(ours[3], torch.ones(width))
    assert not torch.allclose(theirs[1], torch.ones(width))  # the bug, as shipped
    assert torch.allclose(ours[[0, 2]], theirs[[0, 2]])
    sliced = torch.ones(4, 2 * width)
    lora_ops.bgmv_expand_slice(x[:, :rank], expand_w, sliced, indices, width, width, True)
    assert torch.equal(sliced[1], torch.ones(2 * width)) and torch.equal(sliced[:, :width],
                                                                         torch.ones(4, width))


def test_a_batch_without_adapters_is_left_as_it_is() -> None:
    out = torch.full((2, 3), 7.0)
    lora_ops.bgmv_expand(torch.randn(2, 2), torch.randn(1, 1, 3, 2), out,
                         torch.tensor([-1, -1]), True)
    assert torch.equal(out, torch.full((2, 3), 7.0))


# -- presets ---------------------------------------------------------------------------
def preset(models: dict[str, dict[str, object]]) -> dict[str, object]:
    return {"models": {"base": {"model": "builtin:smollm2"}, **models}}


def test_an_adapter_entry_is_its_base_with_its_own_name(tmp_path: Path) -> None:
    a = adapter(tmp_path / "a", rank=8)
    b = adapter(tmp_path / "b", rank=32)
    p = build_preset(preset({"pirate": {"base": "base", "adapter": str(a), "aliases": ["arr"]},
                             "wide": {"base": "base", "adapter": str(b), "pinned": True}}))
    base, pirate = p.models["base"], p.models["pirate"]
    assert (base.max_loras, base.max_cpu_loras, base.max_lora_rank) == (4, 32, 32)
    assert (pirate.base, pirate.adapter, pirate.aliases) == ("base", str(a), ["arr"])
    assert pirate.model == base.model and pirate.max_model_len == base.max_model_len
    assert p.models["wide"].pinned and not base.pinned


def test_an_adapter_entry_refuses_keys_that_are_its_bases(tmp_path: Path) -> None:
    a = str(adapter(tmp_path / "a"))
    cases = {
        "key 'dtype': an adapter model takes only": {"base": "base", "adapter": a,
                                                     "dtype": "float32"},
        "key 'base': no model named 'nobody'": {"base": "nobody", "adapter": a},
        "key 'adapter': an adapter model needs its folder": {"base": "base"},
        "key 'adapter': no adapter folder": {"base": "base", "adapter": str(tmp_path / "x")},
    }
    for words, body in cases.items():
        with pytest.raises(ConfigError, match=words):
            build_preset(preset({"bad": body}))
    with pytest.raises(ConfigError, match="base cannot be another adapter"):
        build_preset(preset({"one": {"base": "base", "adapter": a},
                             "two": {"base": "one", "adapter": a}}))


def test_ranks_and_pins_must_fit_the_base(tmp_path: Path) -> None:
    wide = str(adapter(tmp_path / "wide", rank=32))
    with pytest.raises(ConfigError, match="rank 32 is above its base's max_lora_rank"):
        build_preset({"models": {"base": {"model": "m", "max_lora_rank": 16},
                                 "w": {"base": "base", "adapter": wide}}})
    a = str(adapter(tmp_path / "a"))
    one_slot = {"base": {"model": "m", "max_loras": 1, "max_cpu_loras": 1},
                "p": {"base": "base", "adapter": a, "pinned": True}}
    with pytest.raises(ConfigError, match="pinned adapters need max_cpu_loras above"):
        build_preset({"models": one_slot})
    one_slot["base"]["max_cpu_loras"] = 2  # one batch slot, a pinned adapter: room to spare
    assert build_preset({"models": one_slot}).models["p"].pinned
    assert rank_cap([8]) == 16 and rank_cap([33]) == 64


def test_adapters_read_from_ini_too(tmp_path: Path) -> None:
    a = adapter(tmp_path / "a")
    (tmp_path / "dir").mkdir()
    text = (f"[base]\nmodel = builtin:smollm2\nadapters_dir = dir\nmax_loras = 2\n\n"
            f"[pirate]\nbase = base\nadapter = {a}\naliases = arr, matey\n")
    p = build_preset(parse_ini(text, str(tmp_path / "p.ini")), str(tmp_path / "p.ini"))
    assert p.models["base"].adapters_dir == str(tmp_path / "dir")
    assert p.models["base"].max_loras == 2 and p.models["pirate"].aliases == ["arr", "matey"]


def test_a_base_without_adapters_starts_no_lora_engine() -> None:
    from worker.engine_args import engine_args_for

    p = build_preset({"models": {"plain": {"model": "m"}, "ready": {"model": "m",
                                                                    "max_loras": 2}}})
    assert "enable_lora" not in engine_args_for(p.models["plain"], "/m", set())
    args = engine_args_for(p.models["ready"], "/m", set())
    assert (args["enable_lora"], args["max_loras"], args["max_cpu_loras"],
            args["max_lora_rank"]) == (True, 2, 32, 16)


def test_a_pooling_base_with_adapters_starts_a_pooling_lora_engine(tmp_path: Path) -> None:
    """Adapters of an embedding or scoring model are served by its pooling engine."""
    from worker.engine_args import engine_args_for

    folder = adapter(tmp_path / "a")
    p = build_preset({"models": {
        "vectors": {"model": "m", "task": "embed"},
        "ranker": {"model": "m", "task": "score", "max_loras": 1},
        "tuned": {"base": "vectors", "adapter": str(folder)}}})
    for name, convert in (("vectors", "embed"), ("ranker", "classify")):
        args = engine_args_for(p.models[name], "/m", set())
        assert (args["runner"], args["convert"], args["enable_lora"]) == ("pooling", convert,
                                                                          True), name


# -- names -----------------------------------------------------------------------------
def test_adapter_folders_are_found_by_plain_names_only(tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    adapter(root / "pirate")
    adapter(tmp_path / "outside")
    (root / "link").symlink_to(tmp_path / "outside")
    registry = ModelRegistry(build_preset({"models": {
        "smollm2": {"model": "m", "adapters_dir": str(root)},
        "other": {"model": "m"}}}))
    assert registry.adapters == {}  # nothing is found before a request names it
    found = registry.resolve("smollm2/pirate")
    assert (found.id, found.spec.base, found.found) == ("smollm2/pirate", "smollm2", True)
    assert registry.resolve("pirate") is found  # its folder name alone: an alias
    assert registry.resolve("PIRATE") is found
    assert found.lora is not None and found.lora.path == str(root / "pirate")
    for name in ("smollm2/../outside", "smollm2/link", "smollm2/nothere",
                 "smollm2/pirate/x", "other/pirate"):
        with pytest.raises(Exception, match="does not exist"):
            registry.resolve(name)
    assert folder_in(root, "..") is None and folder_in(root, "link") is None


def test_a_found_adapter_is_allowed_to_a_key_by_its_id_never_its_folder_name(
        tmp_path: Path) -> None:
    """A key limited to ``llama-*`` never reaches ``qwen/llama-tuned`` (so the qwen base)
    through the folder's name, found before or not; ``qwen*`` does. Declared names (a
    preset's adapter model and its aliases, a registered one's) are matched as given."""
    from router.access.key_store import KeySpec

    root = tmp_path / "adapters"
    adapter(root / "llama-tuned")
    declared = adapter(tmp_path / "declared")
    registry = ModelRegistry(build_preset({"models": {
        "qwen": {"model": "m", "adapters_dir": str(root)},
        "llama-3": {"model": "m"},
        "llama-chat": {"base": "qwen", "adapter": str(declared), "aliases": ["llama-c"]}}}))
    llama, qwen = KeySpec(models=["llama-*"]).allows, KeySpec(models=["qwen*"]).allows
    for found_first in (False, True):
        if found_first:  # an admin's request found it: its folder name is an alias now
            found = registry.resolve("qwen/llama-tuned")
            assert found.spec.aliases == ["llama-tuned"] and found.names == [found.id]
        for name in ("llama-tuned", "qwen/llama-tuned", "LLAMA-TUNED", "llama-tune"):
            with pytest.raises(ModelNotFound) as refused:
                registry.resolve(name, llama)
            assert refused.value.code == "model_not_found", refused.value.message
            assert refused.value.message.endswith("Available: llama-3, llama-chat")
        assert registry.resolve("llama-3", llama).id == "llama-3"
        assert registry.resolve("llama-c", llama).id == "llama-chat"  # the preset's alias
        assert registry.resolve("llama-tuned", qwen).id == "qwen/llama-tuned"
        assert registry.resolve("qwen/llama-tuned", qwen).id == "qwen/llama-tuned"
    assert not llama(registry.names_of("qwen/llama-tuned"))
    registry.register("llama-reg", "qwen", str(declared), ["llama-r"], False, 8)
    assert registry.resolve("llama-reg", llama).spec.base == "qwen"  # the admin named it


def test_adapter_numbers_stay_with_their_name_and_folder(tmp_path: Path) -> None:
    a, b = adapter(tmp_path / "a"), adapter(tmp_path / "b")
    first = build_preset(preset({"x": {"base": "base", "adapter": str(a)}}))
    registry = ModelRegistry(first)
    number = registry.adapters["x"].lora.number  # type: ignore[union-attr]
    registry.reconfigure(build_preset(preset({"x": {"base": "base", "adapter": str(a),
                                                    "aliases": ["y"]}})))
    assert registry.adapters["x"].lora.number == number  # type: ignore[union-attr]
    old = registry.adapters["x"]
    registry.reconfigure(build_preset(preset({"x": {"base": "base", "adapter": str(b)}})))
    assert registry.adapters["x"].lora.number != number  # type: ignore[union-attr]
    assert old.removed and not registry.adapters["x"].removed
    assert registry.serving(registry.adapters["x"]) is registry.entries["base"]


# -- adapter_config.json, read typed --------------------------------------------------
def broken(folder: Path, config: bytes | str | None, weights: bool = True) -> Path:
    """An adapter folder whose ``adapter_config.json`` holds ``config`` (None: none)."""
    folder.mkdir(parents=True)
    if config is not None:
        data = config.encode() if isinstance(config, str) else config
        (folder / "adapter_config.json").write_bytes(data)
    if weights:
        (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def test_a_malformed_adapter_config_is_an_adapter_error_naming_the_field(
        tmp_path: Path) -> None:
    """Whatever an ``adapter_config.json`` holds, reading it raises ``AdapterError`` (the
    router's 400) and nothing else, naming the field of a value of the wrong type."""
    good = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    cases: dict[str, tuple[bytes | str | None, bool, str]] = {
        "alpha": (json.dumps({**good, "lora_alpha": "sixteen"}), True, "$.lora_alpha"),
        "targets": (json.dumps({**good, "target_modules": 5}), True, "$.target_modules"),
        "target": (json.dumps({**good, "target_modules": [5]}), True, "$.target_modules[0]"),
        "rank": (json.dumps({**good, "r": "8"}), True, "$.r"),
        "zero": (json.dumps({**good, "r": 0}), True, "$.r"),
        "norank": (json.dumps({"peft_type": "LORA"}), True, "`r`"),
        "kind": (json.dumps({**good, "peft_type": 3}), True, "$.peft_type"),
        "dora": (json.dumps({**good, "use_dora": "yes"}), True, "$.use_dora"),
        "array": ("[1, 2]", True, "Expected `object`"),
        "text": ("{not json", True, "is not JSON"),
        "empty": ("", True, "is empty"),
        "blank": ("  \n", True, "is empty"),
        "huge": (json.dumps({**good, "pad": "x" * (2 << 20)}), True, "larger than 1024 KiB"),
        "deep": ('{"r": 8, "pad": ' + "[" * 200_000 + "]" * 200_000 + "}", True,
                 "nested too deep"),
        "ia3": (json.dumps({**good, "peft_type": "IA3"}), True, "only LoRA adapters"),
        "noweights": (json.dumps(good), False, "has no adapter_model.safetensors"),
        "noconfig": (None, True, "cannot read"),
    }
    for name, (config, weights, words) in cases.items():
        with pytest.raises(AdapterError) as caught:
            read_adapter(broken(tmp_path / name, config, weights))
        assert words in str(caught.value), (name, str(caught.value))
    fifo = broken(tmp_path / "fifo", None)
    os.mkfifo(fifo / "adapter_config.json")  # never hangs the read
    with pytest.raises(AdapterError, match="is not a file"):
        read_adapter(fifo)
    folder = broken(tmp_path / "dir", None)
    (folder / "adapter_config.json").mkdir()
    with pytest.raises(AdapterError, match="is not a file"):
        read_adapter(folder)
    info = read_adapter(broken(tmp_path / "peft", json.dumps({
        **good, "target_modules": "q_proj|v_proj", "lora_alpha": 4.5, "task_type": None,
        "init_lora_weights": "gaussian", "rank_pattern": {}, "modules_to_save": None})))
    assert (info.rank, info.alpha, info.target_modules) == (8, 4.5, ("q_proj|v_proj",))


def test_a_loop_of_links_in_an_adapters_dir_names_no_folder(tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    root.mkdir()
    (root / "loop").symlink_to(root / "loop")
    assert folder_in(root, "loop") is None
    registry = ModelRegistry(build_preset({"models": {"qwen": {"model": "m",
                                                               "adapters_dir": str(root)}}}))
    with pytest.raises(ModelNotFound):
        registry.resolve("qwen/loop")


# -- the worker's pool -----------------------------------------------------------------
def test_fifty_requests_for_a_new_adapter_load_it_once() -> None:
    loads: list[int] = []

    async def check(ref: LoraRef) -> None:
        await asyncio.sleep(0.01)

    async def load(ref: LoraRef) -> None:
        loads.append(ref.number)
        await asyncio.sleep(0.05)

    async def unload(number: int) -> None:
        return None

    async def listed() -> set[int]:
        return set(loads)

    async def main() -> None:
        pool = AdapterPool(check, load, unload, listed, capacity=32)
        ref = LoraRef(name="a", number=7, path="/a")
        await asyncio.gather(*(pool.ensure(ref) for _ in range(50)))
        assert loads == [7] and [s.loads for s in pool.loaded] == [1]

    asyncio.run(main())


def test_a_check_refuses_what_does_not_fit_the_base(tmp_path: Path) -> None:
    shape = ModelShape(layers=30, sizes=frozenset({576, 192, 1536}))
    check_adapter(str(adapter(tmp_path / "ok")), 16, shape)
    with pytest.raises(ValueError, match="made for another model"):
        check_adapter(str(adapter(tmp_path / "wide", shape=(1024, 1024))), 16, shape)
    with pytest.raises(ValueError, match="rank 32 is above"):
        check_adapter(str(adapter(tmp_path / "r32", rank=32)), 16, shape)


@pytest.mark.parametrize("indices", [
    torch.tensor([0, 2, -1, 2, 3, 0]),  # a few adapters: one batched product over slots
    torch.tensor([2, 2, 2]),  # one adapter for the whole batch
    torch.tensor([0] * 150 + [3] * 2 + [-1] * 3),  # past SMALL, uneven: one per adapter
], ids=["grouped", "single", "per-adapter"])
def test_a_merged_layer_in_two_products_adds_what_each_slice_would(
        indices: torch.Tensor) -> None:
    """``add_lora_linear`` fuses the slices (q, k, v) of a merged layer: the same sums as
    shrinking and expanding each slice apart, rows of no adapter untouched, adapters of a
    rank below the engine's (zero rows, trimmed) included, whichever way it groups the
    rows."""
    torch.manual_seed(1)
    slots, rank, width, sizes = 4, 8, 32, (32, 8, 8)
    a = tuple(torch.randn(slots, 1, rank, width) for _ in sizes)
    b = tuple(torch.randn(slots, 1, size, rank) for size in sizes)
    for stack in a:
        stack[0, 0, 3:] = 0  # slot 0 holds a rank-3 adapter, slot 2 a rank-5 one
        stack[2, 0, 5:] = 0
    for stack in b:
        stack[0, 0, :, 3:] = 0
        stack[2, 0, :, 5:] = 0
    x = torch.randn(len(indices), width)
    y = torch.randn(len(indices), sum(sizes))
    expected = y.clone()
    offset = 0
    for i, size in enumerate(sizes):
        for row, slot in enumerate(indices.tolist()):
            if slot >= 0:
                shrunk = x[row] @ a[i][slot, 0].T * 0.5
                expected[row, offset: offset + size] += b[i][slot, 0] @ shrunk
        offset += size

    class Wrapper:
        token_lora_indices = indices

    lora_ops.forget_plans()
    lora_ops.forget_weights()
    lora_ops.add_lora_linear(Wrapper(), y, x, a, b, 0.5, sizes)
    assert torch.allclose(y, expected, atol=1e-4)


def test_a_layer_no_adapter_of_the_batch_trains_is_skipped_until_a_slot_changes() -> None:
    """An adapter of q and v leaves zeros in the other layers' slots: nothing to add
    there; once ``activate_adapter`` puts weights in the slot (``forget_weights``), the
    layer adds them."""
    a = (torch.zeros(2, 1, 4, 8),)
    b = (torch.zeros(2, 1, 8, 4),)
    y = torch.ones(3, 8)

    class Wrapper:
        token_lora_indices = torch.tensor([1, 1, -1])

    lora_ops.forget_plans()
    lora_ops.forget_weights()
    lora_ops.add_lora_linear(Wrapper(), y, torch.randn(3, 8), a, b, 1.0, (8,))
    assert torch.equal(y, torch.ones(3, 8))
    a[0][1].fill_(1.0)
    b[0][1].fill_(1.0)
    lora_ops.forget_weights()  # vLLM's activate_adapter, wrapped by fix_cpu_lora_ops
    lora_ops.add_lora_linear(Wrapper(), y, torch.ones(3, 8), a, b, 1.0, (8,))
    assert torch.equal(y[:2], torch.full((2, 8), 33.0)) and torch.equal(y[2], torch.ones(8))
