"""The messages between the router and its zygote (``worker/zygote.py``), one per
``SOCK_SEQPACKET`` datagram, msgspec JSON; a ``Fork`` carries the new worker's stdin (the
read end of its boot pipe) as ``SCM_RIGHTS``."""

from __future__ import annotations

import msgspec


class Fork(msgspec.Struct, tag=True):
    """Fork a spare whose stdin is the descriptor sent with this message."""


class Reap(msgspec.Struct, tag=True):
    """Wait for ``pid``, which has exited (its pidfd said so): its exit code."""

    pid: int


class Forked(msgspec.Struct, tag=True):
    pid: int


class Reaped(msgspec.Struct, tag=True):
    pid: int
    code: int | None
    """``None``: not a child of the zygote, or not exited."""


class Refused(msgspec.Struct, tag=True):
    reason: str


Request = Fork | Reap
Reply = Forked | Reaped | Refused
MAX_MESSAGE = 4096
