"""Routing among a model's replicas (issue 35): the prefix index
(``router.lifecycle.prefix_index``) and the route policy (``router.lifecycle.policy.route``),
alone: no supervisor, no worker, no event loop."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from router.lifecycle.policy.route import (
    Choice,
    ReplicaLoad,
    RouteHint,
    choose,
    overloaded,
)
from router.lifecycle.prefix_index import (
    BLOCK,
    PrefixIndex,
    PromptBlocks,
    prompt_blocks,
    prompt_bytes,
    seed_of,
    session_key,
)
from shared.config import Routing
from shared.protocol import ChatMessage, ContentPart, Generate, LoraRef, SamplingSpec, Tool

ROOT = Path(__file__).resolve().parents[1]
PREFIX = Routing()
SYSTEM = "You are a careful assistant who answers in full sentences. " * 20  # ~1 200 chars


def loads(*in_flight: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(number=n, in_flight=f) for n, f in enumerate(in_flight)]


def chat(*turns: str, system: str = SYSTEM, **kw: object) -> Generate:
    messages = [ChatMessage(role="system", content=system)]
    for i, text in enumerate(turns):
        messages.append(ChatMessage(role="user" if i % 2 == 0 else "assistant", content=text))
    return Generate(id="r", sampling=SamplingSpec(), messages=messages, **kw)  # type: ignore[arg-type]


def blocks_of(request: Generate) -> PromptBlocks:
    return prompt_blocks(prompt_bytes(request),
                         seed_of(request.lora, request.tools, request.template_kwargs))


# -- the overload rule ------------------------------------------------------------------


@pytest.mark.parametrize(("load", "least", "over"), [
    (4, 0, True),     # 4 over an idle replica: both rules hold (1.5 x 0 = 0)
    (3, 0, False),    # under balance_abs
    (5, 1, True),     # 4 more and 5x
    (40, 36, False),  # 4 more but 1.1x: busy alike
    (60, 40, True),   # 20 more and 1.5x
    (59, 40, False),  # 19 more but under 1.5x
    (0, 0, False),
])
def test_overloaded_needs_both_the_absolute_and_the_relative_gap(
        load: int, least: int, over: bool) -> None:
    assert overloaded(load, least, PREFIX) is over


def test_routing_knobs_are_checked() -> None:
    for bad in ({"strategy": "random"}, {"min_prefix_share": 0.0}, {"min_prefix_share": 1.5},
                {"balance_abs": 0}, {"balance_rel": 0.5}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, Routing)


# -- choose -----------------------------------------------------------------------------


def test_no_serving_replica_is_no_choice_and_one_is_the_only_choice() -> None:
    assert choose([], PREFIX) is None
    assert choose([ReplicaLoad(0, ready=False), ReplicaLoad(1, draining=True)], PREFIX) is None
    got = choose([ReplicaLoad(0, ready=False), ReplicaLoad(1, in_flight=50)], PREFIX)
    assert got == Choice(1, "only")


def test_without_a_hint_the_least_loaded_wins_ties_to_the_least_recently_routed() -> None:
    assert choose(loads(3, 1, 2), PREFIX) == Choice(1, "least_loaded")
    tied = [ReplicaLoad(0, routed_seq=9), ReplicaLoad(1, routed_seq=4), ReplicaLoad(2, routed_seq=7)]
    assert choose(tied, PREFIX) == Choice(1, "least_loaded")
    never = [ReplicaLoad(2), ReplicaLoad(0), ReplicaLoad(1)]  # none routed yet: lowest number
    assert choose(never, PREFIX) == Choice(0, "least_loaded")


def test_queued_requests_count_as_load() -> None:
    replicas = [ReplicaLoad(0, in_flight=1, queued=5), ReplicaLoad(1, in_flight=3)]
    assert choose(replicas, PREFIX) == Choice(1, "least_loaded")


def test_draining_and_unready_replicas_are_never_chosen_even_with_the_best_prefix() -> None:
    hint = RouteHint(session=0, matched={0: 1000, 1: 1000}, size=1000)
    replicas = [ReplicaLoad(0, draining=True), ReplicaLoad(1, ready=False),
                ReplicaLoad(2, in_flight=3), ReplicaLoad(3, in_flight=1)]
    assert choose(replicas, PREFIX, hint) == Choice(3, "least_loaded")


def test_the_sessions_replica_wins_over_a_longer_prefix_and_a_lighter_load() -> None:
    hint = RouteHint(session=1, matched={0: 900, 1: 300}, size=1000)
    got = choose(loads(0, 3), PREFIX, hint)
    assert got == Choice(1, "session", 0.3)


def test_an_overloaded_sessions_replica_escapes_to_the_least_loaded() -> None:
    hint = RouteHint(session=1, size=1000)
    got = choose(loads(0, 4, 2), PREFIX, hint)
    assert got == Choice(0, "least_loaded", escaped=True)
    # one request fewer and it is not overloaded: the session holds
    assert choose(loads(0, 3, 2), PREFIX, hint) == Choice(1, "session")
    # its prefix is no way back in while it is overloaded
    hint = RouteHint(session=1, matched={1: 900}, size=1000)
    assert choose(loads(0, 4), PREFIX, hint) == Choice(0, "least_loaded", escaped=True)


def test_a_sessions_replica_that_is_gone_is_no_escape() -> None:
    hint = RouteHint(session=7, size=1000)
    assert choose(loads(1, 0), PREFIX, hint) == Choice(1, "least_loaded")


def test_the_longest_prefix_over_the_minimum_share_wins() -> None:
    hint = RouteHint(matched={0: 400, 1: 800, 2: 600}, size=1000)
    assert choose(loads(2, 3, 0), PREFIX, hint) == Choice(1, "prefix", 0.8)


def test_a_prefix_under_the_minimum_share_is_no_draw() -> None:
    hint = RouteHint(matched={1: 299}, size=1000)
    assert choose(loads(0, 1), PREFIX, hint) == Choice(0, "least_loaded")
    hint = RouteHint(matched={1: 300}, size=1000)
    assert choose(loads(0, 1), PREFIX, hint) == Choice(1, "prefix", 0.3)
    assert choose(loads(0, 1), Routing(min_prefix_share=0.5), hint) == Choice(0, "least_loaded")


def test_an_overloaded_longest_match_gives_way_to_the_next_longest() -> None:
    hint = RouteHint(matched={0: 900, 1: 500}, size=1000)
    got = choose(loads(8, 2, 0), PREFIX, hint)
    assert got == Choice(1, "prefix", 0.5, escaped=True)
    # every match overloaded: the least loaded
    hint = RouteHint(matched={0: 900}, size=1000)
    assert choose(loads(8, 2, 0), PREFIX, hint) == Choice(2, "least_loaded", escaped=True)


def test_equal_matches_go_to_the_least_loaded_of_them() -> None:
    hint = RouteHint(matched={0: 600, 1: 600}, size=1000)
    assert choose(loads(2, 1, 0), PREFIX, hint) == Choice(1, "prefix", 0.6)


def test_least_loaded_and_round_robin_ignore_the_hint() -> None:
    hint = RouteHint(session=0, matched={0: 1000}, size=1000)
    assert choose(loads(1, 0), Routing(strategy="least_loaded"), hint) == Choice(1, "least_loaded")
    rr = Routing(strategy="round_robin")
    replicas = [ReplicaLoad(0, in_flight=0, routed_seq=5), ReplicaLoad(1, in_flight=9, routed_seq=3)]
    assert choose(replicas, rr, hint) == Choice(1, "round_robin")


def test_round_robin_turns_through_the_replicas() -> None:
    rr, seq, seen = Routing(strategy="round_robin"), {0: 0, 1: 0, 2: 0}, []
    for turn in range(1, 7):
        got = choose([ReplicaLoad(n, routed_seq=s) for n, s in seq.items()], rr)
        assert got is not None
        seq[got.replica] = turn
        seen.append(got.replica)
    assert seen == [0, 1, 2, 0, 1, 2]


# -- the prefix index -------------------------------------------------------------------


def test_a_conversations_next_turn_matches_every_block_of_the_last() -> None:
    index = PrefixIndex()
    first = blocks_of(chat("What is a radix tree?" * 10))
    index.insert(1, first)
    second = blocks_of(chat("What is a radix tree?" * 10, "A tree of prefixes." * 10, "And?"))
    full = first.size // BLOCK
    assert full >= 4 and second.hashes[:full] == first.hashes[:full]
    # every full block of the first turn; a short last block differs from the longer text
    assert index.match(second) == {1: full}
    assert index.hint(second).matched == {1: full * BLOCK}


def test_match_reports_each_replica_its_own_depth() -> None:
    index = PrefixIndex()
    shared = blocks_of(chat("hello"))
    deep = blocks_of(chat("hello", "hi there " * 100, "more " * 100))
    index.insert(0, shared)
    index.insert(1, deep)
    got = index.match(deep)
    assert got[1] == len(deep.hashes)
    assert got[0] == shared.size // BLOCK  # the full blocks the two share
    assert index.match(blocks_of(chat("hello", system="another system " * 50))) == {}


def test_an_identical_prompt_matches_whole_including_its_short_last_block() -> None:
    index = PrefixIndex()
    b = blocks_of(chat("x" * 10))
    assert b.size % BLOCK  # a short last block
    index.insert(0, b)
    assert index.hint(b).matched == {0: b.size}
    assert index.hint(b).share(0) == 1.0


def test_seeds_tell_adapters_tools_and_template_variables_apart() -> None:
    lora = LoraRef(name="sql", number=1, path="/adapters/sql")
    tool = Tool(name="search", parameters={"type": "object", "properties": {}})
    variants = [
        chat("hi"),
        chat("hi", lora=lora),
        chat("hi", lora=LoraRef(name="sql", number=1, path="/adapters/sql-v2")),
        chat("hi", lora=LoraRef(name="law", number=1, path="/adapters/sql")),
        chat("hi", tools=[tool]),
        chat("hi", template_kwargs={"enable_thinking": False}),
        chat("hi", template_kwargs={"enable_thinking": True}),
    ]
    firsts = [blocks_of(v).hashes[0] for v in variants]
    assert len(set(firsts)) == len(firsts)
    index = PrefixIndex()
    index.insert(0, blocks_of(variants[1]))
    assert index.match(blocks_of(variants[0])) == {}
    # the router's number for an adapter is its own: another router's number matches too
    renumbered = chat("hi", lora=LoraRef(name="sql", number=7, path="/adapters/sql"))
    assert index.match(blocks_of(renumbered)) == {0: len(blocks_of(renumbered).hashes)}
    # dict order is no difference
    a = seed_of(template_kwargs={"a": 1, "b": 2})
    assert a == seed_of(template_kwargs={"b": 2, "a": 1}) != seed_of()


def test_prompt_bytes_grow_by_appending_and_media_counts_by_digest() -> None:
    one = prompt_bytes(chat("first"))
    two = prompt_bytes(chat("first", "second"))
    assert two.startswith(one)
    image = "data:image/png;base64," + "A" * 1_000_000
    media = Generate(id="m", sampling=SamplingSpec(), messages=[ChatMessage(
        role="user", content="look", parts=[ContentPart(type="text", text="look"),
                                            ContentPart(type="image_url", url=image)])])
    other = Generate(id="m", sampling=SamplingSpec(), messages=[ChatMessage(
        role="user", content="look", parts=[ContentPart(type="text", text="look"),
                                            ContentPart(type="image_url", url=image + "B")])])
    assert len(prompt_bytes(media)) < 500
    assert prompt_bytes(media) != prompt_bytes(other)
    text = Generate(id="p", sampling=SamplingSpec(), prompt="Once upon a time")
    assert prompt_bytes(text) == b"Once upon a time"
    ids = [prompt_bytes(Generate(id="t", sampling=SamplingSpec(), prompt_token_ids=t))
           for t in ([1, 2], [1, 23], [1, 2, 3])]
    assert ids[2].startswith(ids[0]) and not ids[1].startswith(ids[0])  # "2" begins "23"


def test_forget_drops_a_replicas_blocks_and_sessions_and_keeps_the_others() -> None:
    index = PrefixIndex()
    a, b = blocks_of(chat("a" * 600)), blocks_of(chat("b" * 600))
    index.routed(0, a, b"s0")
    index.routed(1, a, b"s1")
    index.routed(1, b, b"s2")
    only_b = set(b.hashes) - set(a.hashes)
    assert index.match(b) == {0: len(b.hashes) - len(only_b), 1: len(b.hashes)}
    index.forget(1)
    assert index.match(a) == {0: len(a.hashes)}
    assert index.match(b) == {0: len(b.hashes) - len(only_b)}  # the system prompt's blocks
    assert index.session(b"s0") == 0
    assert index.session(b"s1") is None and index.session(b"s2") is None
    index.forget(0)
    assert index.match(a) == {} and index.session(b"s0") is None
    index.forget(5)  # never seen: nothing to forget


def test_a_replica_restarted_under_its_number_starts_empty() -> None:
    index = PrefixIndex()
    a, b = blocks_of(chat("a" * 600)), blocks_of(chat("b" * 600))
    index.routed(1, a, b"s")
    index.forget(1)
    index.routed(1, b)
    assert index.match(a) == {1: len(a.hashes) - len(set(a.hashes) - set(b.hashes))}
    assert index.match(b) == {1: len(b.hashes)}
    assert index.session(b"s") is None


def test_forgotten_replicas_bits_are_swept_before_their_slots_are_reused() -> None:
    """A crash only marks its slot dead; once no slot is left a sweep clears them all,
    blocks and sessions, and no restarted replica inherits another's blocks."""
    index = PrefixIndex()
    index.routed(0, PromptBlocks((1, 2), 2 * BLOCK), b"keep")
    for crash in range(3 * PrefixIndex.SLOTS):
        number = 1000 + crash  # replica numbers are any int
        index.routed(number, PromptBlocks((1, 2, 3 + crash), 3 * BLOCK), bytes([crash % 256]) * 2)
        assert index.match(PromptBlocks((1, 2, 3 + crash), 3 * BLOCK)) == {0: 2, number: 3}
        index.forget(number)
        assert index.match(PromptBlocks((1, 2, 3 + crash), 3 * BLOCK)) == {0: 2}
    assert len(index) < 2 + PrefixIndex.SLOTS  # swept: the dead-only blocks are gone
    assert index.sessions < 1 + PrefixIndex.SLOTS
    assert index.session(b"keep") == 0


def test_more_live_replicas_than_slots_are_refused() -> None:
    index = PrefixIndex()
    for number in range(PrefixIndex.SLOTS):
        index.insert(number, PromptBlocks((number,), BLOCK))
    with pytest.raises(ValueError):
        index.insert(PrefixIndex.SLOTS, PromptBlocks((1,), BLOCK))


def test_the_index_stays_within_its_bounds_under_100_000_inserts() -> None:
    index = PrefixIndex(blocks=1000, sessions=100)
    for i in range(100_000):
        b = PromptBlocks((i, i + 1_000_000), 2 * BLOCK)
        index.routed(i % 8, b, i.to_bytes(4, "little"))
        assert len(index) <= 1000
    assert len(index) == 1000 and index.sessions == 100
    # the most recent are kept, the oldest gone
    assert index.match(PromptBlocks((99_999, 1_099_999), 2 * BLOCK)) == {99_999 % 8: 2}
    assert index.match(PromptBlocks((0, 1_000_000), 2 * BLOCK)) == {}
    assert index.session((99_999).to_bytes(4, "little")) == 99_999 % 8
    assert index.session((0).to_bytes(4, "little")) is None


def test_aging_drops_a_prefixs_tail_before_its_head() -> None:
    index = PrefixIndex(blocks=4)
    index.insert(0, PromptBlocks((1, 2, 3), 3 * BLOCK))
    index.insert(1, PromptBlocks((10, 11), 2 * BLOCK))  # one too many: block 3 goes first
    assert index.match(PromptBlocks((1, 2, 3), 3 * BLOCK)) == {0: 2}


def test_sessions_are_scoped_by_owner_and_the_strongest_hint_wins() -> None:
    assert session_key("alice") is None
    assert session_key("alice", user="u") != session_key("bob", user="u")
    assert session_key("alice", header="s", user="u") == session_key("alice", header="s")
    assert session_key("alice", previous_response_id="resp_1", user="u") == session_key(
        "alice", previous_response_id="resp_1")
    # a header's value and a user's of the same words are different sessions
    assert session_key("alice", header="x") != session_key("alice", user="x")
    assert len(session_key("alice", user="u" * 100_000) or b"") == 16


HASHES = """
from router.lifecycle.prefix_index import prompt_blocks, prompt_bytes, seed_of
from shared.protocol import ChatMessage, Generate, LoraRef, SamplingSpec
g = Generate(id="x", sampling=SamplingSpec(), messages=[
    ChatMessage(role="system", content="s" * 700), ChatMessage(role="user", content="q" * 300)],
    lora=LoraRef(name="a", number=3, path="/a"), template_kwargs={"b": 1, "a": 2})
print(prompt_blocks(prompt_bytes(g), seed_of(g.lora, g.tools, g.template_kwargs)).hashes)
"""


def test_hashes_are_equal_in_two_processes() -> None:
    """Not ``hash()``, which Python salts per process: a simulation's seed replays, and
    routers behind one load balancer could share what they saw."""
    outs = []
    for salt in ("1", "2"):
        done = subprocess.run([sys.executable, "-c", HASHES], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, check=True,
                              env={**os.environ, "PYTHONHASHSEED": salt})
        outs.append(done.stdout.strip())
    assert outs[0] == outs[1]
    assert outs[0].startswith("(") and outs[0].count(",") >= 4


# -- index and policy together ----------------------------------------------------------


def test_conversations_keep_their_turns_on_one_replica_and_spread_over_both() -> None:
    """Two conversations with one system prompt over two idle replicas: each goes where its
    earlier turns went, the second to the other replica (the shared system prompt alone is
    under the minimum share of a long first turn)."""
    index, seq = PrefixIndex(), {0: 0, 1: 0}
    where: dict[str, set[int]] = {}
    step = 0
    for turn in range(4):
        for name in ("ann", "bob"):
            history = [f"{name} turn {t} " + name * 1500 for t in range(turn * 2 + 1)]
            blocks = blocks_of(chat(*history))
            got = choose([ReplicaLoad(n, routed_seq=s) for n, s in seq.items()], PREFIX,
                         index.hint(blocks))
            assert got is not None
            step += 1
            seq[got.replica] = step
            index.routed(got.replica, blocks)
            where.setdefault(name, set()).add(got.replica)
            if turn:
                assert got.why == "prefix" and got.share >= PREFIX.min_prefix_share
    assert where["ann"] != where["bob"] and all(len(r) == 1 for r in where.values())
