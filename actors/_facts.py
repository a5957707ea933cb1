"""`Facts`: rank-local outcomes the tree applies only in an order every rank shares.

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
does (SGLang #20049). With several, the facade runs the agreement once per tick
(`HiCache.sync`): it asks for `known()` and `values()`, reduces both across
ranks, and hands the result back to `take()`.
"""

from __future__ import annotations

from collections import deque

from ._errors import InvariantError

KINDS: tuple[str, ...] = ("write", "load", "hit", "backup")
"""Kinds of outcomes, in the order they are agreed and applied."""


class Facts:
    def __init__(self) -> None:
        self._order: dict[str, deque[int]] = {k: deque() for k in KINDS}
        self._local: dict[tuple[str, int], int] = {}

    def expect(self, kind: str, op: int) -> None:
        """An operation was issued; its outcome will be recorded once."""
        self._order[kind].append(op)

    def record(self, kind: str, op: int, value: int) -> None:
        """The local outcome of an issued operation (0: failed; otherwise a count or 1)."""
        key = (kind, op)
        if key in self._local or op not in self._order[kind]:
            raise InvariantError(
                f"{kind} outcome of op {op} recorded twice or never issued (invariant: each issued "
                "operation has exactly one outcome)"
            )
        if value < 0:
            raise InvariantError(f"{kind} outcome of op {op} is {value}; outcomes are >= 0")
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

    def take(self, counts: tuple[int, ...], values: tuple[int, ...]) -> list[tuple[str, int, int]]:
        """Remove the first `counts[k]` operations of each kind; `(kind, op, agreed value)` in
        the order to apply them."""
        if len(counts) != len(KINDS) or sum(counts) != len(values):
            raise InvariantError(f"agreed outcomes {counts} / {len(values)} values do not fit the kinds {KINDS}")
        out = []
        at = 0
        for kind, n in zip(KINDS, counts, strict=True):
            order = self._order[kind]
            if n > len(order):
                raise InvariantError(f"{n} {kind} outcomes agreed but only {len(order)} issued (ranks diverged)")
            for _ in range(n):
                op = order.popleft()
                self._local.pop((kind, op), None)
                out.append((kind, op, values[at]))
                at += 1
        return out

    def take_local(self, kind: str) -> list[tuple[str, int, int]]:
        """With one rank, where the local outcomes are the agreed ones: remove the leading
        operations of `kind` that have an outcome; `(kind, op, value)` in issue order.

        This is `take(known(), values(known()))` when only `kind` changed since the last
        take, which holds with one rank: every outcome is taken as soon as it is recorded."""
        order, local = self._order[kind], self._local
        out = []
        while order and (kind, order[0]) in local:
            op = order.popleft()
            out.append((kind, op, local.pop((kind, op))))
        return out

    def pending(self) -> int:
        """Issued operations whose agreed outcome has not been applied."""
        return sum(len(q) for q in self._order.values())
