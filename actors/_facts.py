"""Agreement across ranks: rank-local outcomes the tree applies only in an order every rank shares.

Whether a write or a load finished, how many pages storage holds, whether a
backup landed: these depend on one rank's physical state and timing. In a
tensor-parallel group each rank runs its own actors, and if one rank's tree
applied an ack another rank has not seen yet, their trees would differ from
then on. So the tree never applies such an outcome when it arrives. It records
the operation when it issues it (`expect`), records the local outcome when it
arrives (`record`), and applies outcomes per kind in issue order, as far as
every rank knows them, with the value the ranks agreed on: the minimum (a
failure is 0, so one rank's failure fails the operation everywhere; a hit
length or a page count takes the smallest).

With one rank the agreement is the local value and the tree applies outcomes
as soon as they arrive, which keeps write acks prompt whatever the scheduler
does (SGLang #20049: write-through acks handled only on prefill left a decode
loop's nodes locked). With several, the facade runs the agreement once per
tick (`HiCache.sync`): it asks for `known()` and `values()`, reduces both
across ranks, and hands the result back to `take()`.

`Facts` is the ledger; `Agreement` is the tree core's part that owns it and
hands each agreed outcome to the applier the core registered for its kind.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable

from ._errors import InvariantError


class FactKind(enum.Enum):
    """A kind of rank-local outcome; the declaration order is the order kinds are agreed and applied."""

    WRITE = "write"
    """A write-through or write-back landed (1) or failed (0)."""
    LOAD = "load"
    """A load-back landed (1) or failed (0)."""
    HIT = "hit"
    """Leading pages storage holds for a prefetch."""
    BACKUP = "backup"
    """Pages a backup to storage stored."""


KINDS: tuple[FactKind, ...] = tuple(FactKind)
"""Kinds of outcomes, in the order they are agreed and applied."""


class Facts:
    def __init__(self) -> None:
        self._order: dict[FactKind, deque[int]] = {k: deque() for k in KINDS}
        self._issued: set[tuple[FactKind, int]] = set()
        """The operations in `_order`: what `record` asks, without a walk over a queue."""
        self._local: dict[tuple[FactKind, int], int] = {}

    def expect(self, kind: FactKind, op: int) -> None:
        """An operation was issued; its outcome will be recorded once."""
        self._order[kind].append(op)
        self._issued.add((kind, op))

    def record(self, kind: FactKind, op: int, value: int) -> None:
        """The local outcome of an issued operation (0: failed; otherwise a count or 1)."""
        key = (kind, op)
        if key in self._local or key not in self._issued:
            raise InvariantError(
                f"{kind.value} outcome of op {op} recorded twice or never issued (invariant: each issued "
                "operation has exactly one outcome)"
            )
        if value < 0:
            raise InvariantError(f"{kind.value} outcome of op {op} is {value}; outcomes are >= 0")
        self._local[key] = value

    def known(self) -> tuple[int, ...]:
        """Per kind, how many leading operations have a local outcome."""
        out = []
        for kind in KINDS:
            n = 0
            for op in self._order[kind]:
                if (kind, op) not in self._local:
                    break
                n += 1
            out.append(n)
        return tuple(out)

    def values(self, counts: tuple[int, ...]) -> tuple[int, ...]:
        """The local outcomes of the first `counts[k]` operations of each kind, concatenated."""
        out: list[int] = []
        for kind, n in zip(KINDS, counts, strict=True):
            order = self._order[kind]
            out.extend(self._local[(kind, order[i])] for i in range(n))
        return tuple(out)

    def take(self, counts: tuple[int, ...], values: tuple[int, ...]) -> list[tuple[FactKind, int, int]]:
        """Remove the first `counts[k]` operations of each kind; `(kind, op, agreed value)` in
        the order to apply them."""
        if len(counts) != len(KINDS) or sum(counts) != len(values):
            raise InvariantError(f"agreed outcomes {counts} / {len(values)} values do not fit the kinds "
                                 f"{tuple(k.value for k in KINDS)}")
        out = []
        at = 0
        for kind, n in zip(KINDS, counts, strict=True):
            order = self._order[kind]
            if n > len(order):
                raise InvariantError(f"{n} {kind.value} outcomes agreed but only {len(order)} issued (ranks diverged)")
            for _ in range(n):
                op = order.popleft()
                self._issued.discard((kind, op))
                self._local.pop((kind, op), None)
                out.append((kind, op, values[at]))
                at += 1
        return out

    def take_local(self, kind: FactKind) -> list[tuple[FactKind, int, int]]:
        """With one rank, where the local outcomes are the agreed ones: remove the leading
        operations of `kind` that have an outcome; `(kind, op, value)` in issue order.

        This is `take(known(), values(known()))` when only `kind` changed since the last
        take, which holds with one rank: every outcome is taken as soon as it is recorded."""
        order, local = self._order[kind], self._local
        out = []
        while order and (kind, order[0]) in local:
            op = order.popleft()
            self._issued.discard((kind, op))
            out.append((kind, op, local.pop((kind, op))))
        return out

    def pending(self) -> int:
        """Issued operations whose agreed outcome has not been applied."""
        return sum(len(q) for q in self._order.values())

    def check_invariants(self) -> None:
        for kind, order in self._order.items():
            if len(set(order)) != len(order):
                raise InvariantError(f"{kind.value} op issued twice in {list(order)} (op ids are unique)")
        issued = {(kind, op) for kind, order in self._order.items() for op in order}
        for kind, op in self._local:
            if (kind, op) not in issued:
                raise InvariantError(f"{kind.value} outcome of op {op} kept after it was taken, or never issued")
        if issued != self._issued:
            raise InvariantError(f"{len(self._issued)} operations counted as issued but {len(issued)} in the issue "
                                 "order (invariant: an operation is in both from its issue until it is taken)")


class Agreement:
    """The tree core's part that owns `Facts`: records outcomes and applies agreed ones.

    The core registers one applier per kind (`on`); with one rank (`local`) an outcome is
    applied as soon as it is recorded, with several only once `apply` brings the agreement."""

    def __init__(self, local: bool) -> None:
        self.local = local
        self.facts = Facts()
        self._appliers: dict[FactKind, Callable[[int, int], None]] = {}

    def on(self, kind: FactKind, applier: Callable[[int, int], None]) -> None:
        """Apply each agreed outcome of `kind` with `applier(op, value)`."""
        self._appliers[kind] = applier

    def expect(self, kind: FactKind, op: int) -> None:
        self.facts.expect(kind, op)

    def record(self, kind: FactKind, op: int, value: int) -> None:
        self.facts.record(kind, op, value)
        if self.local:  # one rank: its outcomes are the agreed ones, applied at once
            for kind_, op_, value_ in self.facts.take_local(kind):
                self._appliers[kind_](op_, value_)

    def report(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """What this rank knows, for the agreement: per kind the count, then the values."""
        known = self.facts.known()
        return known, self.facts.values(known)

    def apply(self, counts: tuple[int, ...], values: tuple[int, ...]) -> None:
        for kind, op, value in self.facts.take(counts, values):
            self._appliers[kind](op, value)

    def pending(self) -> int:
        return self.facts.pending()

    def unknown(self) -> int:
        """Issued operations with no local outcome yet (leading ones only are counted as known)."""
        return self.facts.pending() - sum(self.facts.known())

    def check_invariants(self) -> None:
        missing = [k.value for k in KINDS if k not in self._appliers]
        if missing:
            raise InvariantError(f"tree: no applier registered for outcomes of kind {missing}")
        self.facts.check_invariants()
