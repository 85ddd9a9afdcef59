"""``Routes``: which replica of a model of several serves a request, and what the router
remembers to decide it (``router.lifecycle.policy.route`` decides; this keeps its inputs).

Per model a ``PrefixIndex`` of the prompts sent to each replica, made at the model's first
routed request and dropped when its last replica goes (no engine holds those caches any
more); a replica reaped is ``forget``-ten. The count of requests routed orders ties
(``Replica.routed_seq``). The supervisor's ``route`` calls ``pick`` with no await between
the choice and the caller's submit, so the replica chosen is the one that gets it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from router.lifecycle.policy.route import ReplicaLoad, choose
from router.lifecycle.prefix_index import PrefixIndex, prompt_blocks, prompt_bytes, seed_of
from router.lifecycle.replica import Replica
from router.registry import ModelEntry
from shared.protocol import Generate


class Routes:
    """The routing state of this router's models of several replicas (module docstring)."""

    def __init__(self) -> None:
        self.indexes: dict[str, PrefixIndex] = {}
        """Each model's record of the prompts it sent to each replica, by model id."""
        self._routed = 0

    def pick(self, entry: ModelEntry, serving: Sequence[Replica],
             gens: Sequence[Generate] | None = None, session: bytes | None = None) -> Replica:
        """The replica of ``serving`` (two or more) for this request, recorded as used:
        a full one (at ``max_concurrent``, which is each replica's) is passed over while
        another has room; then ``policy.route.choose`` over their loads, with the prompt's
        blocks (strategy ``prefix``) and the session."""
        cap = entry.spec.max_concurrent
        if cap:
            serving = [r for r in serving if r.link.in_flight < cap] or serving
        routing = entry.spec.routing
        blocks = None
        if routing.strategy == "prefix" and gens:
            gen = gens[0]
            blocks = prompt_blocks(prompt_bytes(gen),
                                   seed_of(gen.lora, gen.tools, gen.template_kwargs))
        index = self.indexes.get(entry.id)
        if index is None:
            index = self.indexes[entry.id] = PrefixIndex()
        hint = index.hint(blocks, session) if blocks is not None else None
        loads = [ReplicaLoad(r.number, r.link.in_flight, 0, True, False, r.routed_seq)
                 for r in serving]
        chosen = choose(loads, routing, hint)
        assert chosen is not None  # some replica serves
        replica = next(r for r in serving if r.number == chosen.replica)
        self._routed += 1
        replica.routed_seq, replica.last_used = self._routed, time.monotonic()
        if blocks is not None:
            index.routed(replica.number, blocks, session)
        return replica

    def forget(self, model_id: str, number: int) -> None:
        """Replica ``number`` of the model is gone, and its engine's cache with it."""
        index = self.indexes.get(model_id)
        if index is not None:
            index.forget(number)

    def drop(self, model_id: str) -> None:
        """The model runs no replica: what its index knew of their caches is gone."""
        self.indexes.pop(model_id, None)
