"""Who idles, and what then (``due``; ``IdleReaper`` acts on it).

A model is idle once it is ready, unleased and its link has nothing in flight. Its limit
is the latest admin request's ``keep_alive`` (Ollama's: seconds, ``-1`` for ever, ``0``
after this request; none: the preset's ``ttl``); a pinned model has none. Other keys'
requests only keep it loaded until their ``kept_until``. Past it the model stops, or on a
GPU with ``idle_action: sleep`` its engine sleeps (level 1).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from router.lifecycle.policy import park
from router.registry import ModelEntry
from shared.config import ServerConfig


@dataclass(frozen=True, slots=True)
class IdleDecision:
    """``entry`` has been idle ``idle_seconds``, past its limit: ``action`` it."""

    entry: ModelEntry
    action: Literal["stop", "sleep"]
    idle_seconds: float


def ttl(entry: ModelEntry, server: ServerConfig) -> float:
    """The preset's idle ttl for ``entry``: its own, else the server's (0: none)."""
    return entry.spec.ttl if entry.spec.ttl is not None else server.ttl


def idle_limit(entry: ModelEntry, server: ServerConfig) -> float | None:
    """Seconds idle before the model is stopped (or put to sleep); ``None``: never.
    A request's ``keep_alive`` overrides the preset's ``ttl``; a pinned model stays."""
    if entry.spec.pinned:
        return None
    if entry.keep_alive is not None:
        return None if entry.keep_alive < 0 else entry.keep_alive
    limit = ttl(entry, server)
    return limit if limit > 0 else None


def expired(entry: ModelEntry, now: float, server: ServerConfig) -> bool:
    """``entry`` is ready or parked, idle and has been so past its ``idle_limit`` and past
    what any request asked to keep it (``kept_until``). A parked model's memory is held
    by its ttl as a running one's: it stops then (it never sleeps)."""
    limit = idle_limit(entry, server)
    return (entry.state in ("ready", "parked") and limit is not None and entry.leases == 0
            and entry.replica is not None and not entry.busy
            and now - entry.last_used >= limit and now >= entry.kept_until)


def due(models: Iterable[ModelEntry], now: float, server: ServerConfig) -> list[IdleDecision]:
    """The models idle past their limit, each with what to do: sleep on a GPU with
    ``idle_action: sleep``, else stop; and parked models past the parking limits (a
    reload lowered ``max_parked_models`` or ``park_memory_gib``): the least recently
    used stop until the rest fit (only those with nothing in flight). A GPU model whose
    engine started without sleep mode (``shared.config.sleep_mode``) stops: a sleep would
    fail at each idle time, then stop it anyway."""
    models = list(models)
    out = [IdleDecision(e, "sleep" if e.spec.idle_action == "sleep" and park.sleeps(e.spec)
                        and e.state == "ready" else "stop", now - e.last_used)
           for e in models if expired(e, now, server)]
    going = {d.entry.id for d in out}
    kept = sorted((e for e in models if e.state == "parked" and e.id not in going),
                  key=lambda e: e.last_used, reverse=True)  # most recently used first
    ceiling = (server.park_memory_gib * park.GIB if server.park_memory_gib is not None
               else None)
    held = 0
    for i, e in enumerate(kept):
        held += park.host_held(e)
        over = i >= server.max_parked_models or (ceiling is not None and held > ceiling)
        if over and park.stoppable(e) and not e.spec.pinned:
            out.append(IdleDecision(e, "stop", now - e.last_used))
            held -= park.host_held(e)
    return out
