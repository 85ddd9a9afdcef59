"""Name resolution order and leases, without any process."""

from __future__ import annotations

import pytest

from router.errors import ModelNotFound
from router.registry import Lease, ModelRegistry
from shared.preset_loader import build_preset


def registry(default: str | None = None) -> ModelRegistry:
    server = {"default_model": default} if default else {}
    return ModelRegistry(build_preset({"server": server, "models": {
        "llama-3.1-8b": {"model": "/a", "aliases": ["llama", "Chat"]},
        "llama-3.1-70b": {"model": "/b", "aliases": ["big"]},
        "qwen3-32b": {"model": "/c", "aliases": ["qwen"]},
        "qwen3-32b-awq": {"model": "/d"},
    }}))


@pytest.mark.parametrize("name,expected", [
    ("llama-3.1-8b", "llama-3.1-8b"),   # exact id
    ("qwen3-32b", "qwen3-32b"),         # exact id, although also a substring of another
    ("qwen", "qwen3-32b"),              # exact alias
    ("LLAMA-3.1-70B", "llama-3.1-70b"), # case-insensitive id
    ("chat", "llama-3.1-8b"),           # case-insensitive alias
    ("70b", "llama-3.1-70b"),           # unique substring
    ("-awq", "qwen3-32b-awq"),
    ("Qwen-Max-2025", "qwen3-32b"),     # begins with an alias: a versioned family name
    ("qwen3-32b-awq-v2", "qwen3-32b-awq"),  # the longest id or alias it begins with
])
def test_resolution_order(name: str, expected: str) -> None:
    assert registry().resolve(name).id == expected


def test_default_model_catches_unknown_and_ambiguous_names() -> None:
    r = registry(default="big")
    assert r.resolve("gpt-4o").id == "llama-3.1-70b"
    assert r.resolve("llama-3.1").id == "llama-3.1-70b"   # ambiguous substring → default
    assert r.resolve(None).id == "llama-3.1-70b"


def test_without_default_unknown_and_ambiguous_are_404() -> None:
    r = registry()
    with pytest.raises(ModelNotFound) as info:
        r.resolve("gpt-4o")
    assert info.value.status == 404 and info.value.code == "model_not_found"
    with pytest.raises(ModelNotFound) as info:
        r.resolve("llama-3.1")
    assert info.value.code == "model_ambiguous" and "llama-3.1-70b" in info.value.message
    with pytest.raises(ModelNotFound):
        r.resolve("")


def test_lease_counts_and_release_is_idempotent() -> None:
    entry = registry().resolve("qwen")
    with Lease(entry) as lease:
        assert entry.leases == 1
        Lease(entry).release()
        assert entry.leases == 1
    assert entry.leases == 0
    lease.release()
    assert entry.leases == 0 and entry.last_used > 0


def test_load_and_unload_take_an_exact_id_or_alias_only() -> None:
    """A typo in ``POST /v1/models/unload`` unloaded the default model; ``{"model": "lla"}``
    unloaded ``llama-...`` by substring."""
    reg = registry(default="qwen3-32b")
    assert reg.resolve("no-such-model").id == "qwen3-32b"  # requests do fall back
    with pytest.raises(ModelNotFound):
        reg.named("no-such-model")
    assert reg.named("big").id == "llama-3.1-70b"  # an alias
    assert reg.named("llama-3.1-70b").id == "llama-3.1-70b"
    for loose in ("LLAMA-3.1-70B", "llama-3.1", "lla"):  # case, substring: requests only
        with pytest.raises(ModelNotFound):
            reg.named(loose)


def test_a_batch_line_takes_a_slot_only_when_no_one_else_waits() -> None:
    """``Slots``: a freed slot goes to the first client's request waiting, and to a
    batch's line only when none waits; a batch line never takes a free slot past a
    waiter, and a client's request passes waiting batch lines."""
    import asyncio

    from router.registry import Slots

    async def main() -> list[str]:
        slots = Slots(1)
        assert slots.try_take()
        got: list[str] = []

        async def take(name: str, later: bool) -> None:
            await slots.take(later)
            got.append(name)

        batch = asyncio.create_task(take("batch", True))
        await asyncio.sleep(0)
        person = asyncio.create_task(take("person", False))
        await asyncio.sleep(0)
        assert not slots.try_take(later=True) and not slots.try_take()
        slots.give()
        await asyncio.sleep(0)
        assert got == ["person"]
        slots.give()
        await asyncio.wait_for(batch, 1)
        await person
        slots.give()
        assert slots.try_take(later=True)  # free, no one waiting
        return got

    assert asyncio.run(main()) == ["person", "batch"]


def test_a_batch_line_handed_a_slot_as_it_is_cancelled_passes_it_on() -> None:
    """``Slots``: a waiter cancelled in the turn it is handed a slot passes it on, in the
    batch line as in the first: to a client's request that began to wait meanwhile (the
    first line before the batch line), else to the next batch line, else back to the free
    ones. (Issue 38, finding 7, was the same window one level up, in the relay's wait
    around ``take``: ``tests/test_lifecycle_races.py``; this passed before its fix too.)"""
    import asyncio

    from router.registry import Slots

    async def main() -> None:
        slots = Slots(1)
        assert slots.try_take()
        first = asyncio.create_task(slots.take(later=True))
        second = asyncio.create_task(slots.take(later=True))
        await asyncio.sleep(0)
        person = asyncio.create_task(slots.take())  # runs (and waits) before ``first``
        slots.give()  # handed to ``first``, which is cancelled before it runs
        first.cancel()
        await asyncio.wait({first})
        assert first.cancelled()
        async with asyncio.timeout(1):
            await person  # ``first``'s slot went on to the client's request
        assert not second.done() and slots.free == 0 and slots.waiting == 1
        slots.give()  # the client's request ends: to ``second``, cancelled as it is handed
        second.cancel()
        await asyncio.wait({second})
        assert second.cancelled()
        assert slots.free == 1 and slots.waiting == 0  # back to the free ones
        assert slots.try_take(later=True)

    asyncio.run(main())
