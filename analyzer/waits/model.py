"""The pieces of a wait-for graph (:mod:`analyzer.waits.graph`): channels, the
unfinished operations of ranks, the waits between ranks, and what each member of a channel
recorded. Both the graph and its roots (:mod:`analyzer.waits.roots`) are built of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

NEVER = math.inf


@dataclass(frozen=True, order=True)
class Channel:
    """One process group instance (``src`` = ``dst`` = -1) or one send/recv direction."""

    group: str
    gid: int
    src: int
    dst: int

    @property
    def p2p(self) -> bool:
        """Whether this is a send/recv direction rather than a group."""
        return self.src >= 0

    def describe(self) -> str:
        """The channel in words: ``tp 3->4`` or ``tp group 0``."""
        return (
            f"{self.group} {self.src}->{self.dst}" if self.p2p else f"{self.group} group {self.gid}"
        )


@dataclass(frozen=True)
class Op:
    """An unfinished operation of one rank."""

    channel: Channel
    seq: int
    op: str
    step: int
    issue_ns: int
    started: bool = False

    @property
    def key(self) -> tuple[Channel, int]:
        """(channel, seq): the same operation on every rank of the channel."""
        return (self.channel, self.seq)

    def describe(self) -> dict[str, Any]:
        """The operation for a finding's evidence: group, channel, op, seq and step."""
        return {
            "group": self.channel.group,
            "channel": self.channel.describe(),
            "op": self.op,
            "seq": self.seq,
            "step": self.step,
        }


@dataclass(frozen=True)
class Edge:
    """``waiter`` waits for ``target`` in ``op`` (``kind``: missing, busy or unrecorded)."""

    waiter: int
    target: int
    op: Op | None
    kind: str


@dataclass
class Member:
    """What one member of a channel recorded there: the last seq it entered, the last it
    finished, the first it recorded."""

    last_seq: float = -NEVER
    done_seq: float = -NEVER
    min_seq: float = NEVER
