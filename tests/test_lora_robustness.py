"""A broken or removed LoRA adapter hurts nobody else on its base: the synthetic engine
does what vLLM does (a step loads an adapter the engine let go again from its folder,
and a folder that no longer reads there kills the engine under every request), so an
adapter must never leave the engine while a request still runs with it."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

from shared.preset_loader import build_preset
from shared.protocol import Delta, Generate, LoraRef, SamplingSpec
from worker.synthetic import SyntheticEngine


def folder(path: Path) -> str:
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return str(path)


def engine(max_cpu_loras: int) -> SyntheticEngine:
    preset = build_preset({"models": {"base": {
        "model": "/synthetic", "engine": "synthetic", "max_loras": max_cpu_loras,
        "max_cpu_loras": max_cpu_loras, "engine_args": {"tokens_per_second": 200}}}})
    return SyntheticEngine(preset.models["base"])


def request(name: str, lora: LoraRef | None, tokens: int) -> Generate:
    return Generate(id=name, prompt="hi", sampling=SamplingSpec(max_tokens=tokens), lora=lora)


async def words(stream: AsyncIterator[list[Delta]]) -> list[str]:
    return [d.text.strip() for batch in [b async for b in stream] for d in batch]


def test_an_adapter_unloaded_while_its_request_runs_stays_until_it_ends(
        tmp_path: Path) -> None:
    """An admin unloads an adapter (or DELETEs a registered one) and removes its folder
    while a long answer runs with it: the answer ends well, the base lives, and the
    adapter leaves the engine once the answer is done."""
    pirate = LoraRef(name="pirate", number=1, path=folder(tmp_path / "pirate"))

    async def main() -> None:
        e = engine(max_cpu_loras=4)
        assert e.adapters is not None
        stream = e.generate(request("a", pirate, 20))
        first = await anext(stream)
        assert first[0].text.strip() == "pirate"
        await e.adapters_apply([], [pirate.number])
        shutil.rmtree(pirate.path)
        assert await words(stream) == ["pirate"] * 19
        assert await words(e.generate(request("b", None, 3))) == ["tok"] * 3
        assert e.dead is None
        await asyncio.sleep(0)  # the deferred unload
        assert pirate.number not in e.adapters_loaded
        assert [s.number for s in await e.adapters_apply([], [])] == []

    asyncio.run(main())


def test_a_full_engine_never_lets_go_of_an_adapter_in_use(tmp_path: Path) -> None:
    """More adapters asked for than the engine keeps, while requests run with all it
    holds, whose folders are gone: the new adapter waits for one of them to end, so the
    running requests end well and nobody else's request fails."""
    refs = [LoraRef(name=n, number=i + 1, path=folder(tmp_path / n))
            for i, n in enumerate(("old", "mid", "new"))]
    old, mid, new = refs

    async def main() -> None:
        e = engine(max_cpu_loras=2)
        long = e.generate(request("long", old, 30))
        short = e.generate(request("short", mid, 10))
        assert (await anext(long))[0].text.strip() == "old"
        assert (await anext(short))[0].text.strip() == "mid"
        shutil.rmtree(old.path)
        shutil.rmtree(mid.path)
        newer = asyncio.ensure_future(words(e.generate(request("n", new, 2))))
        ends = await asyncio.gather(words(long), words(short))
        assert ends == [["old"] * 29, ["mid"] * 9]
        assert await newer == ["new"] * 2
        assert e.dead is None
        assert await words(e.generate(request("b", None, 2))) == ["tok"] * 2

    asyncio.run(main())


def test_an_idle_adapter_makes_room_first(tmp_path: Path) -> None:
    """With the engine full, the least recently used adapter no request runs with leaves
    for a new one, however old the busy ones are."""
    refs = [LoraRef(name=n, number=i + 1, path=folder(tmp_path / n))
            for i, n in enumerate(("busy", "idle", "new"))]
    busy, idle, new = refs

    async def main() -> None:
        e = engine(max_cpu_loras=2)
        assert e.adapters is not None
        running = e.generate(request("r", busy, 30))
        await anext(running)
        await words(e.generate(request("i", idle, 1)))
        assert await words(e.generate(request("n", new, 1))) == ["new"]
        assert set(e.adapters_loaded) == {busy.number, new.number}
        await running.aclose()

    asyncio.run(main())


# -- what a refusal tells ---------------------------------------------------------------
def test_a_refused_adapter_never_tells_a_client_where_its_folder_lies(tmp_path: Path) -> None:
    """A key that may use an adapter reads why it cannot, not the folder's path (only an
    admin sees ``root``): neither from the worker's own checks nor from vLLM's refusal,
    which its engine core process sends as a bare ``Exception`` (once a 500)."""
    from worker.engine import RequestError, VllmEngine
    from worker.synthetic import SyntheticError

    gone = LoraRef(name="gone", number=1, path=str(tmp_path / "srv" / "secret" / "gone"))

    async def synthetic() -> None:
        e = engine(max_cpu_loras=2)
        try:
            await words(e.generate(request("a", gone, 2)))
        except SyntheticError as err:
            assert (err.status, err.code) == (404, "adapter_not_found")
            assert "gone" in err.message and "secret" not in err.message
        else:
            raise AssertionError("a missing folder was served")

    asyncio.run(synthetic())

    class Engine:  # vLLM's AsyncLLM as its engine core refuses an adapter
        async def add_lora(self, request: object) -> bool:
            raise Exception(  # noqa: TRY002  # what vLLM's core client raises
                f"Call to add_lora method failed: While loading {gone.path}, "
                "expected target modules in {'q_proj'} but received {'x'}")

    async def vllm() -> None:
        e = VllmEngine.__new__(VllmEngine)
        e._llm = Engine()
        try:
            await e._load_adapter(gone)
        except RequestError as err:
            assert (err.status, err.code) == (400, "adapter_invalid")
            assert "expected target modules" in err.message
            assert "secret" not in err.message
        else:
            raise AssertionError("a refused adapter loaded")

    asyncio.run(vllm())


# -- a folder rewritten in place --------------------------------------------------------
def test_an_adapter_folder_rewritten_in_place_is_loaded_anew_after_a_reload(
        tmp_path: Path) -> None:
    """A new training run saved over an adapter's folder: the engine caches adapters by
    number, so the reload that follows gives it a new number (the old weights are never
    served again), where an untouched folder keeps its number (no reload from disk)."""
    from router.registry import ModelRegistry

    legal = folder(tmp_path / "legal")
    (tmp_path / "dir").mkdir()
    folder(tmp_path / "dir" / "pirate")
    doc = {"models": {"base": {"model": "m", "adapters_dir": str(tmp_path / "dir")},
                      "legal": {"base": "base", "adapter": legal}}}
    registry = ModelRegistry(build_preset(doc))

    def number(name: str) -> int:
        lora = registry.resolve(name).lora
        assert lora is not None
        return lora.number

    before = {"legal": number("legal"), "base/pirate": number("base/pirate")}
    registry.reconfigure(build_preset(doc))
    assert {n: number(n) for n in before} == before  # untouched: kept
    for path in (Path(legal), tmp_path / "dir" / "pirate"):
        (path / "adapter_model.safetensors").write_bytes(b"new weights")
    registry.reconfigure(build_preset(doc))
    after = {n: number(n) for n in before}
    assert all(after[n] != before[n] for n in before), (before, after)


def test_a_missing_adapter_is_a_404_never_the_default_model(tmp_path: Path) -> None:
    """``<base>/<folder>`` with no such folder (a typo, a folder taken away) is a 404,
    not an answer from ``default_model`` under the adapter's name; other unknown names
    still reach the default, and a key that may not know the base is told nothing new."""
    from router.errors import ModelNotFound
    from router.registry import ModelRegistry

    (tmp_path / "dir").mkdir()
    folder(tmp_path / "dir" / "pirate")
    registry = ModelRegistry(build_preset({
        "server": {"default_model": "base"},
        "models": {"base": {"model": "m", "adapters_dir": str(tmp_path / "dir")},
                   "other": {"model": "m"}}}))
    assert registry.resolve("base/pirate").id == "base/pirate"
    for name in ("base/parrot", "base/../dir/pirate", "base/pirate/x"):
        try:
            registry.resolve(name)
        except ModelNotFound as err:
            assert err.code == "adapter_not_found", err.message
        else:
            raise AssertionError(f"{name} was served by the default model")
    assert registry.resolve("gpt-4o").id == "base"  # any other name: the default

    def only_other(names: list[str]) -> bool:
        return "other" in names

    for name in ("base/parrot", "gpt-4o"):  # alike: as any name the key cannot know
        try:
            registry.resolve(name, only_other)
        except ModelNotFound as err:
            assert err.code == "model_not_found", err.message
        else:
            raise AssertionError(f"{name} resolved for a key limited to 'other'")


def test_an_adapter_asked_for_again_while_it_was_leaving_stays(tmp_path: Path) -> None:
    """Unloaded while a request ran with it, then asked for again before that request
    ended: it stays in the engine (the deferred unload is off), loaded once."""
    pirate = LoraRef(name="pirate", number=1, path=folder(tmp_path / "pirate"))

    async def main() -> None:
        e = engine(max_cpu_loras=2)
        first = e.generate(request("a", pirate, 10))
        await anext(first)
        await e.adapters_apply([], [pirate.number])
        again = e.generate(request("b", pirate, 10))
        await anext(again)
        await words(first)
        await asyncio.sleep(0)
        assert pirate.number in e.adapters_loaded
        assert await words(again) == ["pirate"] * 9
        assert [s.number for s in await e.adapters_apply([], [])] == [pirate.number]

    asyncio.run(main())
