"""Which replica of a model has seen which prompt prefixes: an approximate, bounded record
the router keeps of what it sent where, so that a request goes where its prefix is likely
still in the engine's KV cache (``router.lifecycle.policy.route`` decides with it).

The router never renders a chat template, so a prompt is named by its canonical bytes
(``prompt_bytes``: each message encoded alone and in order, so that a conversation's next
turn begins with the same bytes as the last one), cut into ``BLOCK``-byte blocks whose
hashes are chained: a block's hash names the whole prefix up to its end, and a lookup is
one dict read per block, no tree. The chain starts from a seed (``seed_of``) of what
changes what the engine caches for the same text: the LoRA adapter, the tools, the
template's variables. Hashes are blake2b, never ``hash()``: equal in every process, so a
simulation replays and routers behind one load balancer could share them.

Approximate on purpose: the engine evicts on its own, the index ages by LRU alone, and a
crashed or stopped replica is forgotten whole (``forget``).
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from cachetools import LRUCache

from router.lifecycle.policy.route import RouteHint
from shared.protocol import Generate, LoraRef, Tool

BLOCK = 256
"""Bytes of canonical prompt text per block: a 4 000-character prompt is 16 lookups, and a
shared system prompt of a few hundred characters still fills a block or two."""
DIGEST = 8
"""Bytes of each block hash: 64 bits, no collision to expect among a million blocks."""
DEFAULT_BLOCKS = 200_000
"""Blocks one model's index holds: about 50 MB of prompt text at ``BLOCK``, 45 000
prompts of 4 000 characters, in about 21 MB of the router's memory (105 bytes a block,
``bench/route_cost.py``); the least recently sent go first."""
DEFAULT_SESSIONS = 20_000
"""Session keys one model's index holds; the least recently used go first."""
_ENCODE = msgspec.json.Encoder(order="deterministic")
"""Sorted dict keys: equal tools and template variables give equal bytes in any process."""


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt's chained block hashes, the shortest prefix first."""

    hashes: tuple[int, ...]
    size: int
    """Bytes of canonical text the blocks cover (the last block may be short)."""

    def covered(self, blocks: int) -> int:
        """Bytes of the prompt its first ``blocks`` blocks cover."""
        return min(blocks * BLOCK, self.size)


def seed_of(lora: LoraRef | None = None, tools: Sequence[Tool] | None = None,
            template_kwargs: Mapping[str, Any] | None = None) -> bytes:
    """What, besides the text, changes the engine's cache for it: equal text under another
    adapter (vLLM keys its prefix cache by the adapter too), other tools or other template
    variables (both change the rendered prompt) must not match. The adapter is its name
    and folder, not the router's number for it, which another router numbers otherwise."""
    if lora is None and not tools and not template_kwargs:
        return b""
    adapter = (lora.name, lora.path) if lora is not None else None
    return _ENCODE.encode([adapter, list(tools or ()), dict(template_kwargs or {})])


def prompt_bytes(request: Generate) -> bytes:
    """``request``'s prompt as canonical bytes, prefix-preserving: a message is its own
    JSON, so appending turns appends bytes. Media parts count by a digest of their data,
    not the data itself, which would fill the index with an image's blocks."""
    if request.messages is not None:
        out = bytearray()
        for message in request.messages:
            if message.parts is not None and any(p.data or p.url for p in message.parts):
                parts = [(p.type, p.text, _digest(p.data or p.url or "")) for p in message.parts]
                out += _ENCODE.encode([message.role, message.content, message.name,
                                       message.tool_call_id, message.tool_calls, parts])
            else:
                out += _ENCODE.encode(message)
        return bytes(out)
    if request.prompt is not None:
        return request.prompt.encode()
    if request.prompt_token_ids is not None:
        # Fixed width, so one id is never a prefix of another ("1" of "12").
        return array.array("q", request.prompt_token_ids).tobytes()
    return b""


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def prompt_blocks(data: bytes, seed: bytes = b"") -> PromptBlocks:
    """``data``'s chained block hashes: block ``i``'s is blake2b of block ``i - 1``'s digest
    and its own bytes, the first's of the seed's digest: equal only where everything before
    it is equal too."""
    blake = hashlib.blake2b
    previous = blake(seed, digest_size=DIGEST).digest()
    hashes = []
    view = memoryview(data)
    for start in range(0, len(data), BLOCK):
        previous = blake(previous + view[start:start + BLOCK], digest_size=DIGEST).digest()
        hashes.append(int.from_bytes(previous, "little"))
    return PromptBlocks(tuple(hashes), len(data))


def session_key(owner: str, header: str | None = None, previous_response_id: str | None = None,
                user: str | None = None) -> bytes | None:
    """The session a request belongs to, the strongest hint first: ``x-session-id``, then
    Responses' ``previous_response_id`` (a response's follow-up names it: after answering,
    the caller sticks ``session_key(owner, previous_response_id=<its own id>)`` to the replica
    that answered), then the client's user (OpenAI ``user``, Anthropic ``metadata.user_id``).
    Scoped by the key's owner, so one tenant's names never steer another's; a digest, so a
    client's long string costs the index no more than a short one."""
    for kind, value in (("h", header), ("r", previous_response_id), ("u", user)):
        if value:
            return hashlib.blake2b(f"{kind}\0{owner}\0{value}".encode(), digest_size=16).digest()
    return None


class PrefixIndex:
    """One model's record of the block hashes sent to each replica and of the replica each
    session last went to. Both bounded, least recently used out first.

    A replica is one bit of a block's mask: its *slot*, given at its first insert and
    taken back by ``forget``. A forgotten slot's bits stay in the masks, ignored (``_live``),
    until so many slots are dead that a new one would pass ``SLOTS``: then one pass clears
    them all (``sweep``). So a crash costs the event loop nothing per block, and a restarted
    replica of the same number starts empty in a fresh slot.

    The blocks live in an ``OrderedDict`` rather than a ``cachetools.LRUCache``: that keeps a
    dict and an ``OrderedDict`` beside it (twice the memory per block) behind Python-level
    methods on every lookup, and a sweep rewrites values in place, which an ``OrderedDict``
    does without reordering. The session map is a plain ``LRUCache``: one read and one
    write a request.
    """

    SLOTS = 60
    """Bits a mask may use: below 2**60 a Python int is two machine digits at most."""

    def __init__(self, blocks: int = DEFAULT_BLOCKS, sessions: int = DEFAULT_SESSIONS) -> None:
        if blocks < 1 or sessions < 1:
            raise ValueError("a prefix index holds at least one block and one session")
        self._capacity = blocks
        self._owners: OrderedDict[int, int] = OrderedDict()
        """Block hash -> bitmask of the slots it was sent to."""
        self._sessions: LRUCache[bytes, int] = LRUCache(maxsize=sessions)
        """Session key -> the slot it last went to."""
        self._slot: dict[int, int] = {}
        """Replica number -> its slot's bit."""
        self._replica: dict[int, int] = {}
        """A live slot's bit -> its replica's number."""
        self._live = 0
        self._dead = 0
        """Slots forgotten whose bits may still be in masks and sessions."""

    def __len__(self) -> int:
        return len(self._owners)

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    def _bit(self, replica: int) -> int:
        bit = self._slot.get(replica)
        if bit is not None:
            return bit
        taken = self._live | self._dead
        free = ~taken & (taken + 1)  # the lowest clear bit
        if free >> self.SLOTS:
            self.sweep()
            free = ~self._live & (self._live + 1)
            if free >> self.SLOTS:
                raise ValueError(f"a prefix index tells at most {self.SLOTS} replicas apart")
        self._slot[replica], self._replica[free] = free, replica
        self._live |= free
        return free

    def insert(self, replica: int, blocks: PromptBlocks) -> None:
        """``blocks`` were sent to ``replica``. The deepest block is touched first and the
        first last, so aging drops a prefix's tail before its head (a tree's leaves before
        its root) and a lookup's walk from the head finds what is left."""
        bit = self._bit(replica)
        owners = self._owners
        for h in reversed(blocks.hashes):
            mask = owners.get(h)
            if mask is None:
                owners[h] = bit
            else:
                owners[h] = mask | bit
                owners.move_to_end(h)
        while len(owners) > self._capacity:
            owners.popitem(last=False)

    def match(self, blocks: PromptBlocks) -> dict[int, int]:
        """Per replica that was sent a prompt beginning as this one does: how many of its
        blocks, from the first, it was sent. Reads only: a match that routes elsewhere does
        not keep its blocks young."""
        get, live = self._owners.get, self._live
        found: dict[int, int] = {}
        alive = live
        for depth, h in enumerate(blocks.hashes):
            mask = get(h, 0) & alive
            if depth and (gone := alive & ~mask):  # at the first block: never matched
                self._record(found, gone, depth)
            if not mask:
                return found
            alive = mask
        self._record(found, alive, len(blocks.hashes))
        return found

    def _record(self, found: dict[int, int], mask: int, depth: int) -> None:
        """Each replica whose slot is in ``mask`` matched ``depth`` blocks."""
        while mask:
            low = mask & -mask
            found[self._replica[low]] = depth
            mask ^= low

    def forget(self, replica: int) -> None:
        """``replica`` crashed or stopped: its engine's cache is gone, and so is what this
        index knew of it (its blocks and sessions, ignored from now on)."""
        bit = self._slot.pop(replica, None)
        if bit is not None:
            del self._replica[bit]
            self._live &= ~bit
            self._dead |= bit

    def sweep(self) -> None:
        """One pass clearing the forgotten slots' bits from every block and session (done
        when slots run out; a caller with an idle moment may do it sooner)."""
        keep, owners = ~self._dead, self._owners
        for h in [h for h, mask in owners.items() if mask & self._dead]:
            if mask := owners[h] & keep:
                owners[h] = mask  # an existing key keeps its place in the order
            else:
                del owners[h]
        for key in [k for k, bit in self._sessions.items() if bit & self._dead]:
            del self._sessions[key]
        self._dead = 0

    def session(self, key: bytes) -> int | None:
        """The replica ``key``'s session last went to, if still remembered."""
        bit = self._sessions.get(key)
        return self._replica.get(bit) if bit is not None else None

    def stick(self, key: bytes, replica: int) -> None:
        self._sessions[key] = self._bit(replica)

    def hint(self, blocks: PromptBlocks, session: bytes | None = None) -> RouteHint:
        """What ``route.choose`` reads: per replica the bytes of this prompt it was sent as a
        prefix, and the session's replica."""
        matched = {r: blocks.covered(n) for r, n in self.match(blocks).items()}
        return RouteHint(session=self.session(session) if session is not None else None,
                         matched=matched, size=blocks.size)

    def routed(self, replica: int, blocks: PromptBlocks, session: bytes | None = None) -> None:
        """The request went to ``replica``: its blocks and its session are now there."""
        self.insert(replica, blocks)
        if session is not None:
            self.stick(session, replica)
