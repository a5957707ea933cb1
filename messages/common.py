"""Verbs every actor understands, and the names actors are addressed by."""

from __future__ import annotations

import enum

from ._registry import Message, message, wire_enum


@wire_enum(1)
class ActorName(enum.Enum):
    """Who sends and who receives: the six actors and the external caller."""

    TREE = "tree"
    DEVICE = "device"
    HOST = "host"
    WRITE = "write"
    LOAD = "load"
    PREFETCH = "prefetch"
    FACADE = "facade"
    """The scheduler's thread (or a test) calling in from outside the actors."""


@message(1)
class CheckInvariants(Message):
    """Ask an actor to check its core's invariants; it raises if one is broken."""


@message(2)
class InvariantsHeld(Message):
    """Reply to `CheckInvariants`: every invariant of the actor's core holds."""

    actor: ActorName
    """The actor that checked."""


@message(3)
class GetStatistics(Message):
    """Ask an actor for its statistics record."""


@message(4)
class Durations(Message):
    """A histogram of durations (seconds) since start, as statistics carry it."""

    bounds_s: tuple[float, ...]
    """Upper bounds of the buckets, increasing; the last bucket has none."""
    bucket_counts: tuple[int, ...]
    """Durations per bucket, one more than `bounds_s`: bucket `i` holds those above `bounds_s[i - 1]`
    and at most `bounds_s[i]`; the last holds those above every bound."""
    sum_s: float
    """The sum of every duration."""

    @property
    def count(self) -> int:
        """How many durations were observed."""
        return sum(self.bucket_counts)
