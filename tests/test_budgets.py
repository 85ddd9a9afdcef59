"""Budgets that cannot be overspent (issue 26, findings 5-7).

The unit tests drive ``router.access.budgets`` with a clock of their own, a real ``Ledger`` over
SQLite and a database they take away; the router tests reproduce the findings against a
router with synthetic workers (each token is one word; a chat prompt of one message is its
words + 4 tokens). On 96966e8: carol's ``smol*`` budget was never enforced; one request of
``n: 128`` spent 12 800 tokens of 40; concurrent requests all passed; with the database
away a budget admitted the key past it; a row written during a read counted twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from router.access import ledger as ledger_module
from router.access.budgets import BudgetExceeded, Budgets, LedgerFull, fit, least_prompt
from router.access.database import Database
from router.access.key_store import Budget
from router.access.ledger import INSERT, SCHEMA, Ledger
from router.registry import ModelRegistry
from shared.preset_loader import build_preset
from shared.protocol import (
    ChatMessage,
    ContentPart,
    Generate,
    SamplingSpec,
    Tokenize,
    Tool,
    ToolCall,
)
from tests.conftest import RouterProcess, running_router
from worker.synthetic import SyntheticEngine

# -- the arithmetic -------------------------------------------------------------------------

HI = 18  # a one-message chat "hi": its prompt, as a worker counted it


def chat(max_tokens: int | None = None, n: int = 1, text: str = "hi") -> Generate:
    return Generate(id="g", sampling=SamplingSpec(max_tokens=max_tokens, n=n),
                    messages=[ChatMessage(role="user", content=text)])


def test_a_request_is_held_at_its_prompt_and_n_times_max_tokens() -> None:
    assert least_prompt(chat()) == 1  # not counted yet: at least a token
    ids = Generate(id="g", sampling=SamplingSpec(), prompt_token_ids=[1, 2, 3])
    assert least_prompt(ids) == 3  # token ids are their own count
    assert fit([chat(10)], None, 100, False, [HI]) == HI + 10
    assert fit([chat(100, n=128)], None, 40, False, [HI]) is None  # 12 800 of 40
    assert fit([chat(100, n=128)], 4096, 1_000_000, False, [HI]) == HI + 12_800
    assert fit([chat(5000)], 4096, 10_000, False, [HI]) == HI + 4096  # at most the context
    assert fit([chat(10)], 4096, 10_000, False, [9000]) == 4096 + 10  # a prompt too
    assert fit([chat(10)], None, HI + 9, False, [HI]) is None
    assert fit([chat(10)], None, 0, False, [HI]) is None


def test_without_max_tokens_a_request_gets_what_the_budget_leaves() -> None:
    gen = chat()
    assert fit([gen], 4096, 10_000, False, [HI]) == HI + 4096  # the context fits: as asked
    assert gen.sampling.max_tokens is None
    assert fit([gen], 4096, 100, False, [HI]) == 100
    assert gen.sampling.max_tokens == 100 - HI and gen.sampling.clamp_max_tokens
    unknown = chat(n=2)  # no context known: bounded by the budget however much it leaves
    assert fit([unknown], None, 10_000, False, [HI]) == HI + 2 * ((10_000 - HI) // 2)
    assert unknown.sampling.max_tokens == (10_000 - HI) // 2


def test_a_protocol_that_clamps_is_clamped_to_the_budget_not_refused() -> None:
    gen = chat(100)
    assert fit([gen], None, 40, True, [HI]) == 40
    assert gen.sampling.max_tokens == 40 - HI
    assert fit([chat(100)], None, HI, True, [HI]) is None  # not one token left


def test_the_synthetic_engines_count_is_the_prompt_it_then_reports() -> None:
    """The count a budget holds (``Tokenize``, ``count_only``) is the prompt the synthetic
    engine reports once it runs, tools, tool calls, media and template kwargs included."""
    spec = build_preset({"models": {"m": {"model": "/synthetic", "engine": "synthetic",
                                          "max_model_len": 10_000}}}).models["m"]
    engine = SyntheticEngine(spec)
    messages = [
        ChatMessage(role="user", content="look at this", parts=[
            ContentPart(type="text", text="look at this"),
            ContentPart(type="image_url", url="data:image/png;base64,AAAA")]),
        ChatMessage(role="assistant", tool_calls=[
            ToolCall(id="c1", name="lookup", arguments='{"q": "a b c"}')]),
        ChatMessage(role="tool", tool_call_id="c1", content="found it")]
    tools = [Tool(name="lookup", description="finds a thing in a very long list",
                  parameters={"type": "object"})]
    kwargs = {"enable_thinking": True, "reasoning_effort": "high"}
    gen = Generate(id="g", sampling=SamplingSpec(max_tokens=2), messages=messages,
                   tools=tools, template_kwargs=kwargs)
    count = Tokenize(id="t", messages=messages, tools=tools, template_kwargs=kwargs,
                     count_only=True)

    async def go() -> tuple[int, int]:
        ids, strs, counted = await engine.tokenize(count)
        assert ids == [] and strs is None
        reported = [d.prompt_tokens async for batch in engine.generate(gen) for d in batch]
        return counted, max(reported)

    counted, reported = asyncio.run(go())
    bare = sum(len((m.content or "").split()) + 4 for m in messages)
    assert counted == reported > bare  # the tools, the call, the image and kwargs count


# -- the reservations, the clock and the database -------------------------------------------

class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Setup:
    """A real ``Ledger`` over SQLite with ``Budgets`` on one clock; ``down`` takes the
    database away."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, now: float) -> None:
        self.clock = Clock(now)
        monkeypatch.setattr(ledger_module, "time", SimpleNamespace(time=self.clock))
        self.db = Database(f"sqlite:///{tmp_path / 'b.db'}", SCHEMA)
        self.ledger = Ledger(self.db)
        self.down = False
        real_run = self.db.run

        async def run(work: Any) -> Any:
            if self.down:
                raise OSError("the database is away")
            return await real_run(work)

        monkeypatch.setattr(self.db, "run", run)
        preset = build_preset({"models": {
            "m": {"model": "/synthetic", "engine": "synthetic", "aliases": ["smol"]},
            "other": {"model": "/synthetic", "engine": "synthetic"}}})
        self.registry = ModelRegistry(preset)
        self.budgets = Budgets(self.ledger, self.registry, self.clock)

    def spend(self, key: str, model: str, tokens: int) -> None:
        self.ledger.record(key, model, "chat", 200, tokens, 0, 0, 0.1)

    async def reserve(self, key: str, budget: Budget, max_tokens: int, model: str = "m",
                      prompt: int = HI) -> Any:
        """As the relay: held before the model, then counted (``prompt``) once its worker
        is known; a refusal's hold goes with its log line."""
        held = await self.budgets.reserve(key, [budget], self.registry.entries[model],
                                          [chat(max_tokens)])
        try:
            self.budgets.recount(held, [prompt])
        except BudgetExceeded:
            held.settle()
            raise
        return held


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    s = Setup(tmp_path, monkeypatch, now=1_750_000_000.0)  # 2025-06-15 15:06:40 UTC
    yield s
    s.db.close()


def test_concurrent_requests_see_each_others_holds(setup: Setup) -> None:
    budget = Budget(tokens=100, period="day")

    async def go() -> None:
        holds = await asyncio.gather(*(setup.reserve("k", budget, 10) for _ in range(3)),
                                     return_exceptions=True)
        held = [h for h in holds if not isinstance(h, BaseException)]
        assert len(held) == 3  # 3 × 28 = 84 of 100
        with pytest.raises(BudgetExceeded, match="100 tokens per day has 16 tokens left"):
            await setup.reserve("k", budget, 10)
        setup.spend("k", "m", 15)  # the first ends: its row, then its settle
        held[0].settle()
        held[0].settle()  # a second settle changes nothing
        assert setup.budgets.spent("k", budget) == 15
        await setup.reserve("k", budget, 10)  # 15 + 56 held + 28 = 99
        with pytest.raises(BudgetExceeded, match="has 1 tokens left"):
            await setup.reserve("k", budget, 10)

    asyncio.run(go())


def test_a_prompt_is_held_as_counted_and_no_key_learns_from_another(setup: Setup) -> None:
    """Issue 38, finding 4: on 1a1e9ee a chat's prompt was estimated (UTF-8 bytes plus 8
    tokens a message; tools, tool calls, images and template kwargs not at all) and the
    excess its settle saw was learnt per model: one key's chat with 20 tools, estimated
    at 18 tokens and settled at 30 000, made every later hold of the model 30 000 more,
    and another key with 20 000 left was refused a 28-token "hi". Now a request holds its
    prompt at its least until its worker counts it, then as counted; no hold depends on
    another request."""
    budget = Budget(tokens=20_000, period="day")
    big = Budget(tokens=1_000_000, period="day")

    async def go() -> None:
        entry = setup.registry.entries["m"]
        tools = await setup.budgets.reserve("a", [big], entry, [chat(10)])
        assert tools.tokens == 1 + 10  # its prompt not counted yet: at least a token
        setup.budgets.recount(tools, [30_000])
        assert tools.tokens == 30_000 + 10  # the count, tools and all
        setup.spend("a", "m", 30_010)
        tools.settle()
        hi = await setup.reserve("b", budget, 10)  # another key: its own count alone
        assert hi.tokens == HI + 10
        hi.settle()
        with pytest.raises(BudgetExceeded, match="20000 tokens per day has 20000 tokens "
                           r"left, and this request may spend up to 30010 \(its prompt "
                           "of 30000 tokens"):
            await setup.reserve("b", budget, 10, prompt=30_000)  # the real cost, stated
        assert setup.budgets.spent("b", budget) == 0
        assert (await setup.reserve("b", budget, 10)).tokens == HI + 10  # nothing kept

    asyncio.run(go())


def test_a_one_shot_request_holds_its_counted_input(setup: Setup) -> None:
    """Issue 38, finding 3: on 1a1e9ee an embedding (score, rerank) reserved against no
    generate, ``fit([])`` was 0: six concurrent 3 000-word embeddings on a 100-token
    budget all ran (18 006 tokens). Now one holds a token until its input is counted,
    then its count, and one that does not fit is refused."""
    budget = Budget(tokens=100, period="day")

    async def go() -> None:
        entry = setup.registry.entries["m"]
        holds = [await setup.budgets.reserve("k", [budget], entry, [], least=1)
                 for _ in range(6)]
        assert [h.tokens for h in holds] == [1] * 6
        for held in holds:
            with pytest.raises(BudgetExceeded, match="has (9[5-9]|100) tokens left, and this "
                               "request's input is 3001 tokens"):  # the others hold 1 or none
                setup.budgets.recount(held, [], 3001)
            held.settle()
        small = await setup.budgets.reserve("k", [budget], entry, [], least=1)
        setup.budgets.recount(small, [], 60)
        assert small.tokens == 60
        other = await setup.budgets.reserve("k", [budget], entry, [], least=1)
        with pytest.raises(BudgetExceeded, match="has 40 tokens left"):
            setup.budgets.recount(other, [], 41)

    asyncio.run(go())


def test_a_full_ledger_queue_admits_no_budgeted_request_and_drops_no_row(
        setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 38: on 1a1e9ee a queue past ``QUEUE_MAX`` rows (the database away) dropped its
    oldest: their spend never reached the database, so once it returned the key spent it
    again. Now no row is dropped; once the bound waits, a budgeted request is a 503 until
    the queue drains, and an unbudgeted one goes on, its row kept."""
    monkeypatch.setattr(ledger_module, "QUEUE_MAX", 5)
    budget = Budget(tokens=1_000, period="day")

    async def go() -> None:
        (await setup.reserve("k", budget, 1)).settle()
        setup.down = True  # nothing is written: the rows wait
        for _ in range(4):
            setup.spend("k", "m", 10)
        (await setup.reserve("k", budget, 1)).settle()  # 4 rows wait: admitted
        setup.spend("k", "m", 10)
        assert setup.ledger.full
        with pytest.raises(LedgerFull) as refused:
            await setup.reserve("k", budget, 1)
        assert refused.value.status == 503 and refused.value.code == "usage_ledger_full"
        unbudgeted = await setup.budgets.reserve("k", [], setup.registry.entries["m"],
                                                 [chat(1)])
        assert unbudgeted.tokens == 0  # no budget covers it: it runs
        for _ in range(3):  # its rows past the bound are kept, counted
            setup.ledger.record("free", "m", "chat", 200, 7, 0, 0, 0.1)
        assert len(setup.ledger._queue) == 8 and setup.ledger.overflow == 3
        assert setup.budgets.spent("k", budget) == 50
        setup.down = False
        await setup.ledger.flush()  # the database is back: every row written, once
        assert setup.ledger.written == 8 and not setup.ledger.full
        setup.clock.now += 3
        (await setup.reserve("k", budget, 1)).settle()
        assert setup.budgets.spent("k", budget) == 50
        assert await setup.db.run(lambda conn: conn.execute(
            "SELECT COUNT(*) FROM usage")) == [(8,)]

    asyncio.run(go())


def test_an_alias_glob_counts_the_models_rows(setup: Setup) -> None:
    """On 96966e8 the rows (by id, ``m``) never matched ``smol*``: spent stayed 0."""
    budget = Budget(tokens=100, period="day", model="smol*")

    async def go() -> None:
        (await setup.reserve("carol", budget, 10)).settle()
        setup.spend("carol", "m", 60)
        setup.spend("carol", "other", 500)  # not covered
        assert setup.budgets.spent("carol", budget) == 60
        await setup.ledger.flush()
        setup.clock.now += 3  # a fresh read from the database
        await setup.reserve("carol", budget, 10)
        assert setup.budgets.spent("carol", budget) == 60
        with pytest.raises(BudgetExceeded):  # 60 + 28 held + 28
            await setup.reserve("carol", budget, 10, model="m")
        await setup.reserve("carol", budget, 10, model="other")  # no budget covers it

    asyncio.run(go())


def test_with_the_database_away_every_row_since_the_last_read_counts(setup: Setup) -> None:
    """The rule: the last read plus every row this router recorded since, however long
    the database stays away (on 96966e8 rows older than 4 s were dropped: a 100-token
    budget admitted the key at 360)."""
    budget = Budget(tokens=100, period="day")

    async def go() -> None:
        setup.spend("k", "m", 20)
        await setup.ledger.flush()
        setup.clock.now += 1
        (await setup.reserve("k", budget, 1)).settle()  # read: 20
        setup.down = True
        for _ in range(6):  # a minute of requests, the database away
            setup.clock.now += 10
            hold = await setup.reserve("k", budget, 1)
            setup.spend("k", "m", 12)
            hold.settle()
        assert setup.budgets.spent("k", budget) == 20 + 72
        with pytest.raises(BudgetExceeded):  # 92 + 19
            await setup.reserve("k", budget, 1)
        setup.down = False  # back: the rows are written, and read once
        await setup.ledger.flush()
        setup.clock.now += 10
        with pytest.raises(BudgetExceeded, match="has 8 tokens left"):
            await setup.reserve("k", budget, 1)
        assert setup.budgets.spent("k", budget) == 92

    asyncio.run(go())


def test_a_row_written_while_the_spend_is_read_counts_once(setup: Setup) -> None:
    """A row committed between the reader's look at the queue and its read (a flush in
    flight) is in the database and in memory: it counts once (twice on 96966e8: a false
    429 at 60 of 100)."""
    budget = Budget(tokens=100, period="day")

    async def go() -> None:
        (await setup.reserve("k", budget, 1)).settle()
        setup.spend("k", "m", 60)
        rows = list(setup.ledger._queue)
        # The flush commits its rows, but has not taken them off the queue yet.
        await setup.db.run(lambda conn: conn.many(INSERT, rows))
        setup.clock.now += 3
        hold = await setup.reserve("k", budget, 1)  # 60 + 19 held: room
        assert setup.budgets.spent("k", budget) == 60
        setup.ledger._queue.clear()  # the flush ends
        hold.settle()
        setup.clock.now += 3
        await setup.reserve("k", budget, 1)
        assert setup.budgets.spent("k", budget) == 60

    asyncio.run(go())


def test_a_new_period_starts_from_nothing_but_what_is_still_held(setup: Setup) -> None:
    budget = Budget(tokens=100, period="day")
    setup.clock.now = 1_750_031_990.0  # 23:59:50 UTC

    async def go() -> None:
        setup.spend("k", "m", 70)
        await setup.ledger.flush()
        setup.clock.now += 1
        running = await setup.reserve("k", budget, 2)  # 70 + 20: it runs past midnight
        setup.spend("k", "m", 5)  # yesterday's, kept in memory (not read yet)
        assert setup.budgets.spent("k", budget) == 75
        with pytest.raises(BudgetExceeded):
            await setup.reserve("k", budget, 2)
        setup.clock.now += 19  # 00:00:10: a new day, the database away
        setup.down = True
        assert setup.budgets.spent("k", budget) == 0
        late = await setup.reserve("k", budget, 50)  # 20 still held + 68
        with pytest.raises(BudgetExceeded, match="has 12 tokens left"):
            await setup.reserve("k", budget, 2)
        setup.spend("k", "m", 7)  # the one that ran past midnight ends: its row is today's
        running.settle()
        late.settle()
        assert setup.budgets.spent("k", budget) == 7

    asyncio.run(go())


# -- a router with synthetic workers --------------------------------------------------------

ADMIN = "k-admin-budgets"
PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  cache_dir: {cache}
  admin_api_keys: [k-admin-budgets]
models:
  m: {model: /synthetic, engine: synthetic, aliases: [smol]}
  slow: {model: /synthetic, engine: synthetic, engine_args: {tokens_per_second: 20}}
  tight: {model: /synthetic, engine: synthetic, max_model_len: 64}
  cold: {model: /synthetic, engine: synthetic, engine_args: {start_seconds: 2}}
  wide: {model: /synthetic, engine: synthetic, max_model_len: 100000}
  vectors: {model: /synthetic, engine: synthetic, task: embed}
  ranker: {model: /synthetic, engine: synthetic, task: score}
"""
HI_CHAT = [{"role": "user", "content": "hi"}]
HI_PROMPT = 5  # its prompt tokens (synthetic), as the worker counts them


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    cache = tmp_path_factory.mktemp("budgets-cache")  # batch files: not the user's own
    with running_router(PRESET, tmp_path_factory.mktemp("budgets"), "budgets",
                        {"cache": str(cache)}) as r:
        yield r


def call(r: RouterProcess, key: str, method: str, path: str, body: object = None
         ) -> httpx.Response:
    return r.client.request(method, r.url + path, json=body, timeout=60,
                            headers={"Authorization": f"Bearer {key}"})


def key_with(r: RouterProcess, name: str, budget: dict[str, Any]) -> str:
    made = call(r, ADMIN, "POST", "/v1/keys", {"name": name, "budgets": [budget]})
    assert made.status_code == 201, made.text
    secret: str = made.json()["key"]
    return secret


def spent(r: RouterProcess, key: str) -> int:
    rows = call(r, key, "GET", "/v1/usage").json()["data"]
    return sum(row["prompt_tokens"] + row["completion_tokens"] for row in rows)


@pytest.mark.integration
def test_an_alias_glob_budget_is_enforced(router: RouterProcess) -> None:
    """On 96966e8 carol's ``smol*`` budget never counted a row: 10 requests, 150 tokens."""
    carol = key_with(router, "carol", {"tokens": 40, "period": "day", "model": "smol*"})
    answers = [call(router, carol, "POST", "/v1/chat/completions",
                    {"model": "smol", "messages": HI_CHAT, "max_tokens": 10})
               for _ in range(10)]
    codes = [a.status_code for a in answers]
    assert set(codes) == {200, 429}, codes
    refused = answers[codes.index(429)].json()["error"]
    assert refused["code"] == "budget_exceeded" and "40 tokens per day on smol*" in \
        refused["message"]
    assert spent(router, carol) <= 40


@pytest.mark.integration
def test_one_request_cannot_spend_past_the_budget(router: RouterProcess) -> None:
    """On 96966e8 one request of ``n: 128, max_tokens: 100`` spent 12 800 of 40 tokens,
    and Anthropic's ``max_tokens: 100`` spent 105."""
    dan = key_with(router, "dan", {"tokens": 40, "period": "day"})
    big = call(router, dan, "POST", "/v1/chat/completions",
               {"model": "m", "messages": HI_CHAT, "max_tokens": 100, "n": 128})
    assert big.status_code == 429, big.text[:300]
    error = big.json()["error"]
    assert error["code"] == "budget_exceeded" and error["type"] == "rate_limit_error"
    assert "40 tokens per day has 40 tokens left" in error["message"]
    assert spent(router, dan) == 0
    # Anthropic clamps an overflowing max_tokens: to what the budget leaves, too.
    clamped = call(router, dan, "POST", "/v1/messages",
                   {"model": "m", "max_tokens": 100, "messages": HI_CHAT})
    assert clamped.status_code == 200, clamped.text
    body = clamped.json()
    assert body["stop_reason"] == "max_tokens"
    assert body["usage"]["output_tokens"] == 40 - HI_PROMPT  # the counted prompt: all of it
    assert clamped.headers["x-modelyard-max-tokens-clamped"] == str(40 - HI_PROMPT)
    assert spent(router, dan) <= 40
    refused = call(router, dan, "POST", "/v1/messages",
                   {"model": "m", "max_tokens": 100, "messages": HI_CHAT})
    assert refused.status_code == 429
    assert refused.json()["type"] == "error"  # Anthropic's error shape
    assert refused.json()["error"]["type"] == "rate_limit_error"


@pytest.mark.integration
def test_concurrent_requests_never_spend_past_the_budget(router: RouterProcess) -> None:
    """On 96966e8 10 concurrent requests all passed the admission: 150 of 100 tokens."""
    erin = key_with(router, "erin", {"tokens": 100, "period": "day"})
    chat_body = {"model": "slow", "messages": HI_CHAT, "max_tokens": 10}
    call(router, ADMIN, "POST", "/v1/chat/completions", chat_body)  # loaded
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        codes = list(pool.map(
            lambda _: call(router, erin, "POST", "/v1/chat/completions", chat_body
                           ).status_code, range(10)))
    assert codes.count(200) >= 1 and set(codes) == {200, 429}, codes
    assert spent(router, erin) <= 100


@pytest.mark.integration
def test_a_hold_is_given_back_however_the_request_ends(router: RouterProcess) -> None:
    """A stream its client leaves and a request the worker refuses give their hold back:
    the same request fits again (a hold kept would leave no room for it)."""
    fay = key_with(router, "fay", {"tokens": 200, "period": "day"})
    body = {"model": "slow", "messages": HI_CHAT, "max_tokens": 100, "stream": True}
    long = {"model": "tight", "max_tokens": 60, "messages": [
        {"role": "user", "content": "one two three four five six seven eight nine ten"}]}
    for _ in range(3):  # 14 + 60 > 64: refused by the worker, holding 124 of what is left
        refused = call(router, fay, "POST", "/v1/chat/completions", long)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "context_length_exceeded"
    for _ in range(3):  # each holds 118 of 200: the next fits once the last gave it back
        deadline = time.monotonic() + 15
        while True:
            with router.client.stream("POST", router.url + "/v1/chat/completions", json=body,
                                      headers={"Authorization": f"Bearer {fay}"}) as stream:
                if stream.status_code == 200:
                    next(stream.iter_lines())  # gone after its first event
                    break
                assert stream.status_code == 429 and time.monotonic() < deadline, \
                    "the hold of a stream its client left is still kept"
            time.sleep(0.2)
    assert spent(router, fay) <= 200


@pytest.mark.integration
def test_a_cold_stream_its_client_leaves_gives_its_hold_back(router: RouterProcess) -> None:
    """A stream that began with loading progress while its model loads, left by its
    client: its hold goes back and the same request fits again. On 8448a60 the relay's
    cleanup awaited inside the cancel scope Starlette ends such a stream with: the await
    was cancelled too, the request never logged and its hold kept until a restart."""
    gus = key_with(router, "gus", {"tokens": 200, "period": "day"})
    body = {"model": "cold", "messages": HI_CHAT, "max_tokens": 100, "stream": True}
    headers = {"Authorization": f"Bearer {gus}", "X-Modelyard-Loading-Progress": "comments"}
    for _ in range(3):  # each holds 118 of 200: the next fits once the last gave it back
        unloaded = call(router, ADMIN, "POST", "/v1/models/unload", {"model": "cold"})
        assert unloaded.status_code == 200, unloaded.text
        deadline = time.monotonic() + 15
        while True:
            with router.client.stream("POST", router.url + "/v1/chat/completions", json=body,
                                      headers=headers) as stream:
                if stream.status_code == 200:
                    first = next(stream.iter_lines())
                    assert first.startswith(": modelyard "), first  # gone while it loads
                    break
                assert stream.status_code == 429 and time.monotonic() < deadline, \
                    "the hold of a cold stream its client left is still kept"
            time.sleep(0.2)
    assert spent(router, gus) <= 200


WORDS_3000 = " ".join(f"w{i}" for i in range(3000))
ONE_SHOTS = {  # a request of each spending one-shot endpoint: 3 001+ tokens, then 4 or 6
    "/v1/embeddings": lambda text: {"model": "vectors", "input": text},
    "/v1/score": lambda text: {"model": "ranker", "text_1": "q", "text_2": [text]},
    "/v1/rerank": lambda text: {"model": "ranker", "query": "q", "documents": [text]},
}


@pytest.mark.integration
@pytest.mark.parametrize("path", list(ONE_SHOTS))
def test_over_budget_embeddings_scores_and_reranks_are_refused(router: RouterProcess,
                                                                path: str) -> None:
    """Issue 38, finding 3: on 1a1e9ee six concurrent 3 000-word embeddings on a 100-token
    daily budget all got 200 (18 006 tokens spent): nothing was held for them. Now each
    holds its input as its worker counts it before it runs: six 429s, and a small one
    within the budget still passes."""
    body = ONE_SHOTS[path]
    name = "ivy" + path.replace("/", "-")
    ivy = key_with(router, name, {"tokens": 100, "period": "day"})
    warm = call(router, ADMIN, "POST", path, body("a b c"))  # loaded: the race is the budget's
    assert warm.status_code == 200, warm.text
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: call(router, ivy, "POST", path, body(WORDS_3000)),
                                range(6)))
    assert [a.status_code for a in answers] == [429] * 6, [a.text[:200] for a in answers]
    error = answers[0].json()["error"]
    assert error["code"] == "budget_exceeded" and "this request's input is" in error["message"]
    assert spent(router, ivy) == 0
    small = call(router, ivy, "POST", path, body("a b c"))
    assert small.status_code == 200, small.text
    assert 0 < spent(router, ivy) <= 100


def tools_chat(model: str, words: int) -> dict[str, Any]:
    """A "hi" with 20 tools whose descriptions hold ``words`` words between them."""
    each = " ".join(["describe"] * (words // 20))
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": each,
        "parameters": {"type": "object", "properties": {}}}} for i in range(20)]
    return {"model": model, "messages": HI_CHAT, "tools": tools, "max_tokens": 10}


@pytest.mark.integration
def test_one_keys_tools_do_not_raise_another_keys_holds(router: RouterProcess) -> None:
    """Issue 38, finding 4: on 1a1e9ee a chat with 20 tools (estimated at 18 tokens: tools
    were not counted) settled at 30 000, which was learnt as the model's template overhead
    and held on every later request of every key: another key with 20 000 tokens left was
    refused a "hi", its refusal misstating the cost. Now each prompt is counted by its
    worker: the "hi" passes, and a key whose budget the tools chat does not fit is
    refused with its real prompt."""
    jay = key_with(router, "jay", {"tokens": 1_000_000, "period": "day"})
    big = call(router, jay, "POST", "/v1/chat/completions", tools_chat("wide", 30_000))
    assert big.status_code == 200, big.text[:300]
    prompt = big.json()["usage"]["prompt_tokens"]
    assert prompt > 30_000
    kay = key_with(router, "kay", {"tokens": 20_000, "period": "day"})
    hi = call(router, kay, "POST", "/v1/chat/completions",
              {"model": "wide", "messages": HI_CHAT, "max_tokens": 10})
    assert hi.status_code == 200, hi.text[:300]
    assert hi.json()["usage"]["prompt_tokens"] == HI_PROMPT
    refused = call(router, kay, "POST", "/v1/chat/completions", tools_chat("wide", 30_000))
    assert refused.status_code == 429, refused.text[:300]
    message = refused.json()["error"]["message"]
    assert f"may spend up to {prompt + 10} (its prompt of {prompt} tokens" in message
    assert spent(router, kay) == HI_PROMPT + 10


@pytest.mark.integration
def test_over_budget_batch_lines_of_embeddings_are_refused(router: RouterProcess) -> None:
    """Issue 38, finding 3: batch lines on embeddings overspent as requests did. A line
    takes the request's path: each over-budget line is a 429, a small one runs."""
    lee = key_with(router, "lee", {"tokens": 100, "period": "day"})
    lines = [{"custom_id": f"big-{i}", "method": "POST", "url": "/v1/embeddings",
              "body": ONE_SHOTS["/v1/embeddings"](WORDS_3000)} for i in range(4)]
    lines.append({"custom_id": "small", "method": "POST", "url": "/v1/embeddings",
                  "body": ONE_SHOTS["/v1/embeddings"]("a b c")})
    headers = {"Authorization": f"Bearer {lee}"}
    made = router.client.post(router.url + "/v1/files", headers=headers, data={"purpose": "batch"},
                              files={"file": ("in.jsonl", "".join(
                                  json.dumps(item) + "\n" for item in lines).encode())})
    assert made.status_code == 200, made.text
    batch = call(router, lee, "POST", "/v1/batches", {
        "input_file_id": made.json()["id"], "endpoint": "/v1/embeddings",
        "completion_window": "24h"})
    assert batch.status_code == 200, batch.text
    deadline = time.monotonic() + 60
    while (done := call(router, lee, "GET", f"/v1/batches/{batch.json()['id']}").json()
           )["status"] not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, done
        time.sleep(0.2)
    answers = {}
    for file_id in (done.get("output_file_id"), done.get("error_file_id")):
        if file_id:
            text = call(router, lee, "GET", f"/v1/files/{file_id}/content").text
            for row in map(json.loads, text.splitlines()):
                answers[row["custom_id"]] = row["response"]["status_code"]
    assert answers == {**{f"big-{i}": 429 for i in range(4)}, "small": 200}, answers
    assert 0 < spent(router, lee) <= 100
