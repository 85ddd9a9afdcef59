"""``Budgets``: a named key's token budgets (``KeySpec.budgets``), which no request can
overspend.

A budget caps a key's prompt+completion tokens per calendar day, ISO week or month
(UTC), over every model or those its ``model`` glob names: a model is covered when the
glob matches its id or any of its aliases (the registry's current entries); rows of a
model no longer served count by their id alone.

**Reserve, count, then settle.** Before a request waits for its model, ``reserve`` holds
what it may spend against what each budget covering its model has left, its prompt taken
at its least (one token per prompt, or its token ids, or a one-shot request's least
input): ``n`` times its ``max_tokens`` (at most the model's context where known) plus
that. The check and the hold are one step on the event loop, so concurrent requests see
each other's holds, and a key whose budget is spent never loads a model. Once the request
has its model's worker, ``recount`` replaces the hold with the same sum over its prompt as
the worker counts it (``Tokenize``: the chat template rendered with its tools, tool calls,
template kwargs and media, as the engine will run it; an embedding's or a score's input,
``count_only``), before it is submitted: a prompt is counted, never estimated, and no
request's prompt changes another's hold. A request that cannot fit is refused
(``BudgetExceeded``: a 429 naming the budget and what the request may spend), with two
exceptions:

* a request without ``max_tokens`` asks for what there is room for (as an engine's
  default is what the context leaves): its ``max_tokens`` becomes what the budget leaves
  it, when that is less than the context;
* where the protocol clamps an overflowing ``max_tokens`` (``clamp=True``: Anthropic's by
  default, ``shared.config.clamps_max_tokens``), it is clamped to what the budget leaves
  rather than refused, as it is to what the context leaves.

Either way a request left less than one token per choice is refused. ``Reservation.settle``
(once the request's ledger row is recorded, however it ended) drops the hold: its real
spend is then in that row. A refusal after the count, for a stream that began while its
model loaded (loading progress, keep-alives), is that stream's in-band error event.

**What a key has spent.** The current period's sum of the key's rows in the database
(every router's: routers sharing a database share budgets), read at most every
``SPENT_EVERY`` seconds per key, up to a *cut*: the earliest of the read's time and the
oldest row this router has not written yet (``Ledger.unwritten_since``). Every row this
router recorded at or after the cut is added from memory (``recorded``, the ledger's hook),
so a row is counted exactly once: in the database below the cut, in memory from it, even
while a flush runs.

**The database away.** A read that fails keeps the last good one, and this router's rows
since its cut are kept (never trimmed until a read succeeds): the spend is the last read
plus every row this router recorded since, so the database being away never admits a key
past its budget (what other routers spent meanwhile is unknown until it returns). A
failed read is retried after ``SPENT_EVERY`` seconds, not per request.

**The ledger's queue full** (``Ledger.full``: the database away for long): no budgeted
request is admitted (``LedgerFull``, a 503) until it drains. The queue drops no row (a
row dropped is spend the database never sees: the key could spend it again once the
database returns), so budgeted requests stop adding to it; unbudgeted requests go on,
their rows kept (``Ledger.overflow``).

**A new period** starts from the rows at or after its start (a read made in the last
period does not cover it: a new one is made, and with the database away this router's
rows since the start count). Holds of requests still running count in the new period:
their rows will land in it.
"""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from router.access.database import Conn
from router.access.key_store import Budget
from router.access.ledger import Ledger, period_bounds
from router.errors import APIError
from router.registry import ModelEntry, ModelRegistry
from shared.protocol import Generate

log = logging.getLogger("modelyard.router")

SPENT_EVERY = 2.0
"""Seconds a key's spend read from the database is trusted (plus this router's own rows
since): another router's requests count against a shared budget within this."""


class BudgetExceeded(APIError):
    """A 429: the request does not fit what a budget of its key has left."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, status=429, type="rate_limit_error",
                         code="budget_exceeded", retry_after=retry_after)


class LedgerFull(APIError):
    """A 503: the ledger's queue is full (the database away), so no budgeted request is
    admitted until it drains."""

    def __init__(self, rows: int) -> None:
        super().__init__(f"the usage ledger holds {rows} rows the database has not taken "
                         "yet: requests of keys with a budget wait until it has; retry "
                         "later", status=503, type="server_error", code="usage_ledger_full",
                         retry_after=10)


class Reservation:
    """What one request holds of its key's budgets until ``settle``; ``recount`` (by
    ``Budgets.recount``) replaces the hold of a prompt taken at its least by its count."""

    __slots__ = ("asked", "budgets", "clamp", "context", "counted", "gens", "model", "settled",
                 "state", "tokens")

    def __init__(self, state: _Key | None, model: str, tokens: int,
                 gens: Sequence[Generate] = (), budgets: Sequence[Budget] = (),
                 context: int | None = None, clamp: bool = False) -> None:
        self.state = state
        self.model = model
        self.tokens = tokens
        self.gens = gens
        self.asked = [(g.sampling.max_tokens, g.sampling.clamp_max_tokens) for g in gens]
        """What each generate asked, before ``fit`` lowered it (a recount fits again)."""
        self.budgets = budgets
        """The key's budgets that cover the model."""
        self.context = context
        self.clamp = clamp
        self.counted = state is None
        """Whether its prompts are counted (or nothing is held)."""
        self.settled = False

    def settle(self) -> None:
        """Drop the hold (the request's row, recorded just before, carries its real
        spend). Only the first call counts."""
        if self.settled:
            return
        self.settled = True
        if self.state is not None:
            self.state.held.remove(self)


NOTHING_HELD = Reservation(None, "", 0)
"""For a request no budget covers."""


@dataclass(slots=True)
class _Read:
    cut: float
    """Rows before this are in ``sums``; this router's from it on are in ``_Key.rows``."""
    sums: dict[float, dict[str, int]]
    """Per period start: tokens per model id in [start, cut)."""


@dataclass(slots=True)
class _Key:
    rows: deque[tuple[float, str, int]] = field(default_factory=deque)
    """This router's rows (time, model id, tokens) since the last good read's cut."""
    totals: dict[str, int] = field(default_factory=dict)
    """Their tokens per model id (a reservation sums these, not the rows)."""
    read: _Read | None = None
    tried: float = float("-inf")
    """When a read was last tried."""
    failed: bool = False
    """Whether that try failed."""
    held: list[Reservation] = field(default_factory=list)
    reading: asyncio.Lock = field(default_factory=asyncio.Lock)


class Budgets:
    """The budgets of every key that has reserved on this router; see the module
    docstring. ``clock`` (seconds since the epoch) is the ledger's row clock."""

    def __init__(self, ledger: Ledger, registry: ModelRegistry,
                 clock: Callable[[], float] = time.time) -> None:
        self.ledger = ledger
        self.registry = registry
        self.clock = clock
        self._keys: dict[str, _Key] = {}
        ledger.on_record = self.recorded

    def recorded(self, at: float, key: str, model: str, tokens: int) -> None:
        """The ledger's hook: a row of ``key`` was recorded at ``at``."""
        state = self._keys.get(key)  # none kept for a key that never reserved
        if state is not None and tokens:
            state.rows.append((at, model, tokens))
            state.totals[model] = state.totals.get(model, 0) + tokens

    async def reserve(self, key: str, budgets: Sequence[Budget], entry: ModelEntry,
                      gens: Sequence[Generate], clamp: bool = False, least: int = 0
                      ) -> Reservation:
        """Hold what ``gens`` (one request to ``entry``'s model; none for a one-shot
        request, whose input is ``least`` tokens at least) may spend of ``key``'s
        ``budgets``, each prompt at its least (``least_prompt``), lowering their
        ``max_tokens`` where the module docstring says; else ``BudgetExceeded``, or
        ``LedgerFull``. ``recount`` counts the prompts."""
        covering = [b for b in budgets if self.covers(b, entry.id)]
        if not covering:
            return NOTHING_HELD
        if self.ledger.full:
            raise LedgerFull(self.ledger.unwritten)
        state = self._keys.setdefault(key, _Key())
        now = self.clock()
        starts = {_bounds(b.period, now)[0] for b in budgets}
        await self._refresh(key, state, starts)
        # From here to the hold nothing awaits: concurrent requests see each other's.
        context = entry.max_model_len or entry.spec.max_model_len
        reservation = Reservation(state, entry.id, 0, gens, covering, context, clamp)
        reservation.tokens = self._fit(state, reservation, [least_prompt(g) for g in gens],
                                       least, counted=False)
        state.held.append(reservation)
        return reservation

    def recount(self, held: Reservation, prompts: Sequence[int], tokens: int = 0) -> None:
        """``held``'s hold, its prompts now counted by the worker (``prompts``: each
        generate's; ``tokens``: a one-shot request's input), as ``reserve`` would make it
        (from the generates' ``max_tokens`` as asked); else ``BudgetExceeded`` (the hold
        stays until the request's log line settles it). Nothing awaits."""
        if held.counted or held.settled or held.state is None:
            return
        for gen, (asked, clamped) in zip(held.gens, held.asked, strict=True):
            gen.sampling.max_tokens, gen.sampling.clamp_max_tokens = asked, clamped
        held.tokens = self._fit(held.state, held, prompts, tokens, counted=True, own=held.tokens)
        held.counted = True

    def _fit(self, state: _Key, held: Reservation, prompts: Sequence[int], tokens: int,
             counted: bool, own: int = 0) -> int:
        """What ``held``'s request needs of the room its budgets leave (besides ``own``,
        its own hold), fitted (``fit``); else ``BudgetExceeded`` for the tightest."""
        now = self.clock()
        tightest, room = min(((b, self.left(state, b, now) + own) for b in held.budgets),
                             key=lambda pair: pair[1])
        need = fit(held.gens, held.context, room - tokens, held.clamp, prompts)
        if need is None or room < 1:
            end = _bounds(tightest.period, now)[1]
            raise BudgetExceeded(_refusal(tightest, room, held.gens, prompts, tokens,
                                          held.context, end, counted),
                                 retry_after=max(1, int(end - now)))
        return need + tokens

    def covers(self, budget: Budget, model_id: str) -> bool:
        """Whether ``budget`` counts rows of the model ``model_id``: its glob matches the
        id or, for a model the registry serves, any alias."""
        if not budget.model:
            return True
        return any(fnmatch.fnmatchcase(name, budget.model)
                   for name in self.registry.names_of(model_id))

    def spent(self, key: str, budget: Budget) -> int:
        """``key``'s tokens on ``budget``'s models in its current period, as known now
        (the last read plus this router's rows since; no holds)."""
        state = self._keys.get(key)
        if state is None:
            return 0
        return self._spent(state, budget, _bounds(budget.period, self.clock())[0])

    def left(self, state: _Key, budget: Budget, now: float) -> int:
        start = _bounds(budget.period, now)[0]
        held = sum(r.tokens for r in state.held if self.covers(budget, r.model))
        return budget.tokens - self._spent(state, budget, start) - held

    def _spent(self, state: _Key, budget: Budget, start: float) -> int:
        read = state.read
        total = 0
        if read is not None and start in read.sums:
            total += sum(tokens for model, tokens in read.sums[start].items()
                         if self.covers(budget, model))
        # Rows before the read's cut are in its sums; a period the read has no sum for
        # began after it (this router's rows since are all here).
        if state.rows and state.rows[0][0] < start:  # kept since before the period began
            return total + sum(tokens for at, model, tokens in state.rows
                               if at >= start and self.covers(budget, model))
        return total + sum(tokens for model, tokens in state.totals.items()
                           if self.covers(budget, model))

    async def _refresh(self, key: str, state: _Key, starts: set[float]) -> None:
        """Read ``key``'s sums for the periods beginning at ``starts`` when the last read
        is older than ``SPENT_EVERY`` or lacks one of them, at most one try every
        ``SPENT_EVERY`` seconds; a failure keeps the last read."""
        async with state.reading:  # one read per key at a time; a waiter takes its result
            now = self.clock()
            current = state.read is not None and starts <= state.read.sums.keys()
            if now - state.tried < SPENT_EVERY and (current or state.failed):
                return
            state.tried, state.failed = now, True
            unwritten = self.ledger.unwritten_since()
            cut = now if unwritten is None else min(now, unwritten)
            wanted = sorted(starts)
            try:
                sums = await self.ledger.db.run(lambda conn: _sums(conn, key, wanted, cut))
            except Exception as err:  # noqa: BLE001  # either driver's: keep what is known
                log.warning("budgets: cannot read %s's spending (%s); counting the last read "
                            "and this router's rows since", key, err)
                return
            state.read, state.failed = _Read(cut, sums), False
            while state.rows and state.rows[0][0] < cut:
                _, model, tokens = state.rows.popleft()
                state.totals[model] -= tokens


def _bounds(period: str, now: float) -> tuple[float, float]:
    """``period_bounds``, computed once per UTC day (a period is whole days)."""
    return _day_bounds(period, int(now // 86_400))


@functools.lru_cache(maxsize=16)
def _day_bounds(period: str, day: int) -> tuple[float, float]:
    return period_bounds(period, day * 86_400.0)


def least_prompt(gen: Generate) -> int:
    """The fewest tokens ``gen``'s prompt can take before the worker counts it: its token
    ids, else one."""
    return len(gen.prompt_token_ids) if gen.prompt_token_ids is not None else 1


def fit(gens: Sequence[Generate], context: int | None, room: int, clamp: bool,
        prompts: Sequence[int]) -> int | None:
    """What ``gens`` may spend once fitted into ``room`` tokens, or ``None`` if they
    cannot fit. Each may spend its prompt (``prompts``, each at most the context) and
    ``n`` times its ``max_tokens`` (at most the context; none given: the context, or no
    bound where the context is unknown). When that is more than ``room``, or unbounded,
    the generates without ``max_tokens`` (and, with ``clamp``, every one) get an equal
    share per choice of what the others leave as their ``max_tokens`` (where it is less
    than they asked); at least one token each, else ``None``. The only side effect: those
    ``max_tokens``, set only when it returns a number."""
    if room < 1 and gens:  # every request spends a token
        return None
    prompts = [min(p, context) if context else p for p in prompts]
    wants = [_per_choice(g.sampling.max_tokens, context) for g in gens]
    if None not in wants:
        whole = sum(prompts) + sum(g.sampling.n * (w or 0) for g, w in zip(gens, wants,
                                                                         strict=True))
        if whole <= room:
            return whole
    lowered = [i for i, g in enumerate(gens) if clamp or g.sampling.max_tokens is None]
    fixed = sum(prompts) + sum(g.sampling.n * (wants[i] or 0) for i, g in enumerate(gens)
                               if i not in lowered)
    choices = sum(gens[i].sampling.n for i in lowered)
    share = (room - fixed) // choices if choices else 0
    if share < 1:
        return None
    need = fixed
    for i in lowered:
        want, sampling = wants[i], gens[i].sampling
        tokens = share if want is None else min(share, want)
        if tokens != want:
            sampling.max_tokens = tokens
            # The prompt may leave the context less than that: the worker lowers it
            # further, as the engine would have (this request asked for no number, or for
            # a protocol that clamps).
            sampling.clamp_max_tokens = True
        need += sampling.n * tokens
    return need


def _per_choice(max_tokens: int | None, context: int | None) -> int | None:
    if max_tokens is None:
        return context
    return min(max_tokens, context) if context else max_tokens


def _refusal(budget: Budget, room: int, gens: Sequence[Generate], prompts: Sequence[int],
             tokens: int, context: int | None, resets: float, counted: bool) -> str:
    on = f" on {budget.model}" if budget.model else ""
    head = f"this key's budget of {budget.tokens} tokens per {budget.period}{on}"
    when = datetime.fromtimestamp(resets, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if room <= 0:
        return f"{head} is spent; it resets at {when}"
    prompt = sum(prompts) + tokens
    if not gens:
        return (f"{head} has {room} tokens left, and this request's input is {prompt} "
                f"tokens; wait: it resets at {when}")
    most = prompt + sum(g.sampling.n * (g.sampling.max_tokens or context or 1) for g in gens)
    what = (f"up to {most} (its prompt of {prompt} tokens and n × max_tokens)" if counted
            else f"at least {most} (n × max_tokens, and its prompt)")
    return (f"{head} has {room} tokens left, and this request may spend {what}; lower "
            f"max_tokens or n, or wait: it resets at {when}")


def _sums(conn: Conn, key: str, starts: list[float], cut: float) -> dict[float, dict[str, int]]:
    """Per period start: ``key``'s prompt and completion tokens per model in [start, cut)."""
    out: dict[float, dict[str, int]] = {}
    for start in starts:
        rows = conn.execute("SELECT model, SUM(prompt_tokens + completion_tokens) FROM usage "
                            "WHERE key = ? AND time >= ? AND time < ? GROUP BY model",
                            (key, start, cut))
        out[start] = {model: int(n or 0) for model, n in rows}
    return out
