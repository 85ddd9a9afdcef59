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
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from router.access import ledger as ledger_module
from router.access.budgets import (
    TEMPLATE_TOKENS,
    BudgetExceeded,
    Budgets,
    fit,
    prompt_estimate,
)
from router.access.database import Database
from router.access.key_store import Budget
from router.access.ledger import INSERT, SCHEMA, Ledger
from router.registry import ModelRegistry
from shared.config import build_preset
from shared.protocol import ChatMessage, Generate, SamplingSpec
from tests.conftest import RouterProcess, running_router

# -- the arithmetic -------------------------------------------------------------------------

HI = len(b"hi") + 2 * TEMPLATE_TOKENS  # a one-message chat "hi": its prompt estimate


def chat(max_tokens: int | None = None, n: int = 1, text: str = "hi") -> Generate:
    return Generate(id="g", sampling=SamplingSpec(max_tokens=max_tokens, n=n),
                    messages=[ChatMessage(role="user", content=text)])


def test_a_request_is_held_at_its_prompt_and_n_times_max_tokens() -> None:
    assert prompt_estimate(chat()) == HI
    assert fit([chat(10)], None, 100, clamp=False) == HI + 10
    assert fit([chat(100, n=128)], None, 40, clamp=False) is None  # 12 800 of 40
    assert fit([chat(100, n=128)], 4096, 1_000_000, clamp=False) == HI + 12_800
    assert fit([chat(5000)], 4096, 10_000, clamp=False) == HI + 4096  # at most the context
    assert fit([chat(10)], None, HI + 9, clamp=False) is None
    assert fit([chat(10)], None, 0, clamp=False) is None


def test_without_max_tokens_a_request_gets_what_the_budget_leaves() -> None:
    gen = chat()
    assert fit([gen], 4096, 10_000, clamp=False) == HI + 4096  # the context fits: as asked
    assert gen.sampling.max_tokens is None
    assert fit([gen], 4096, 100, clamp=False) == 100
    assert gen.sampling.max_tokens == 100 - HI and gen.sampling.clamp_max_tokens
    unknown = chat(n=2)  # no context known: bounded by the budget however much it leaves
    assert fit([unknown], None, 10_000, clamp=False) == HI + 2 * ((10_000 - HI) // 2)
    assert unknown.sampling.max_tokens == (10_000 - HI) // 2


def test_a_protocol_that_clamps_is_clamped_to_the_budget_not_refused() -> None:
    gen = chat(100)
    assert fit([gen], None, 40, clamp=True) == 40
    assert gen.sampling.max_tokens == 40 - HI
    assert fit([chat(100)], None, HI, clamp=True) is None  # not one token left


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

    async def reserve(self, key: str, budget: Budget, max_tokens: int, model: str = "m"
                      ) -> Any:
        return await self.budgets.reserve(key, [budget], self.registry.entries[model],
                                          [chat(max_tokens)])


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


def test_a_templates_overhead_is_learnt_and_held_from_then_on(setup: Setup) -> None:
    """A template that inserts a system prompt makes "hi" take ~35 tokens, not its
    estimate of 18: the first request's settle teaches the model that, and later holds
    of the model include it (another model's do not)."""
    budget = Budget(tokens=10_000, period="day")

    async def go() -> None:
        first = await setup.reserve("k", budget, 10)
        assert first.tokens == HI + 10
        first.settle(prompt_tokens=HI + 30)  # the template added 30 more
        again = await setup.reserve("k", budget, 10)
        assert again.tokens == HI + 30 + 10
        again.settle(prompt_tokens=HI + 12)  # less than learnt: the most seen stays
        assert (await setup.reserve("k", budget, 10)).tokens == HI + 30 + 10
        assert (await setup.reserve("k", budget, 10, model="other")).tokens == HI + 10
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
  admin_api_keys: [k-admin-budgets]
models:
  m: {model: /synthetic, engine: synthetic, aliases: [smol]}
  slow: {model: /synthetic, engine: synthetic, engine_args: {tokens_per_second: 20}}
  tight: {model: /synthetic, engine: synthetic, max_model_len: 64}
  cold: {model: /synthetic, engine: synthetic, engine_args: {start_seconds: 2}}
"""
HI_CHAT = [{"role": "user", "content": "hi"}]  # 5 prompt tokens (synthetic)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with running_router(PRESET, tmp_path_factory.mktemp("budgets"), "budgets") as r:
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
    assert body["usage"]["output_tokens"] == 40 - HI
    assert clamped.headers["x-modelyard-max-tokens-clamped"] == str(40 - HI)
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
