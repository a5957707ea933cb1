"""`HostCore`: the host KV buffer, its page allocator and the page state machine.

Host memory is handed out in pages, and every page has a `HostSlotState` (all its
slots share it). Moves are checked against `HOST_TRANSITIONS` on every call,
vectorised over the pages of the call (a lookup in an 8x8 table), so an illegal move
raises at once, naming the pages, their states and the state asked for. This check
is always on.

The states are one byte per page (a `PageTable`); the pages per state that statistics
report are counted as pages move (`PageTable.move`'s tally), not read off the table.
Each call keeps its page numbers in the form `_pages` chooses for their number
(`Pages`): a move of a few pages (most moves) is checked and made with Python ints,
from the message's bytes on, which costs a fraction of the vectorised check's array
calls; a larger move takes the vectorised
path, and one that fails either check is explained by the tensor path below (which
names what is wrong). Pages come in as tensors, `Indices` or lists; `allocate_pages`
answers with the `Indices` a reply carries, `allocate` with a tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hicache.messages import HOST_TRANSITIONS, HostSlotState, Indices
from hicache.messages.config import Config, DeviceKind

from ._errors import InvariantError, SlotStateError
from ._kv import KVBuffer, KVShape
from ._pages import PagePool, Pages, PageTable, Slots, as_pages, as_tensor, indices_of

_N = len(HostSlotState)


@dataclass(frozen=True, slots=True)
class _Rules:
    """The legal moves, twice: as a (from, to) table for the vectorised check, and per
    target state as the set of states a slot may come from, for the check of few slots."""

    table: torch.Tensor
    sources: tuple[frozenset[int], ...]

    @classmethod
    def of(cls, moves: Iterable[tuple[HostSlotState, HostSlotState]]) -> _Rules:
        table = torch.zeros((_N, _N), dtype=torch.bool)
        for a, b in moves:
            table[a, b] = True
        return cls(table, tuple(frozenset(int(a) for a in table[:, b].nonzero().flatten()) for b in range(_N)))


_LEGAL = _Rules.of(HOST_TRANSITIONS)

_FREEABLE = (HostSlotState.RESERVED, HostSlotState.SYNCED, HostSlotState.HOST_ONLY)

# transition() never moves a FREE slot: leaving FREE is allocation, which takes the page
# off the free list (allocate()).
_MOVABLE = _Rules.of((a, b) for a, b in HOST_TRANSITIONS if a is not HostSlotState.FREE)

_MOVE_TO = tuple(f"move to {s.name}" for s in HostSlotState)
"""What `transition` to each state is called in errors (made once, not per call)."""


class HostCore:
    def __init__(self, config: Config) -> None:
        self.page_size = config.page_size
        self.capacity_slots = config.host_buffer_slots
        pin = config.device is DeviceKind.CUDA and torch.cuda.is_available()
        self.kv = KVBuffer.allocate(KVShape.of(config), config.host_buffer_slots, config.host_layout, "cpu", pin=pin)
        self._pool = PagePool(config.host_pages, config.page_size)
        self._pages = config.host_pages
        self._states = PageTable(config.host_pages, "B", runs=HostSlotState)
        """A `HostSlotState` per page."""
        self._state = self._states.tensor
        self._counts = [0] * _N
        """Pages per state, kept as pages move (`PageTable.move`'s tally): `counts` (each
        statistics() call) reads them, not the table."""
        self._counts[HostSlotState.FREE] = config.host_pages

    @property
    def free_slots(self) -> int:
        return self._pool.free_slots

    def allocate(self, n: int) -> torch.Tensor | None:
        """`allocate_pages`, the pages as a tensor."""
        got = self.allocate_pages(n)
        return None if got is None else got.as_tensor()

    def allocate_pages(self, n: int) -> Indices | None:
        """Pages for `n` slots (whole pages) in state RESERVED, or None when too few are free."""
        if n < 0 or n % self.page_size:
            raise ValueError(f"host allocation of {n} slots is not whole pages of {self.page_size}")
        pages = self._pool.alloc(n // self.page_size)
        if pages is None:
            return None
        self._move(pages, HostSlotState.RESERVED, "allocate", fresh=True)
        return indices_of(pages)

    def transition(self, pages: Slots, to: HostSlotState) -> None:
        """Move every page of `pages` to `to`; all moves must be legal."""
        if to is HostSlotState.FREE:
            raise SlotStateError("freeing goes through free(), which returns the pages to the free list")
        self._move(as_pages(pages), to, _MOVE_TO[to], _MOVABLE)

    def free(self, pages: Slots) -> None:
        """Free pages that hold no in-flight copy."""
        pages = as_pages(pages)
        self._move(pages, HostSlotState.FREE, "free")
        self._pool.free(pages)

    def states(self, pages: torch.Tensor) -> torch.Tensor:
        """The state of each page of `pages`."""
        return self._state.index_select(0, as_tensor(pages))

    def counts(self) -> tuple[int, ...]:
        """Slots in each state (a page counts `page_size` slots)."""
        return tuple(n * self.page_size for n in self._counts)

    def _recount(self) -> tuple[int, ...]:
        """`counts`, from the table itself (for the checks)."""
        c = torch.bincount(self._state.to(torch.int64), minlength=_N)
        return tuple(int(x) * self.page_size for x in c)

    def check_invariants(self) -> None:
        counts = self._recount()
        if sum(counts) != self.capacity_slots:
            raise InvariantError(f"host: states cover {sum(counts)} of {self.capacity_slots} slots")
        free_pages = self._pool.free_page_set()
        if counts[HostSlotState.FREE] != len(free_pages) * self.page_size:
            raise InvariantError(
                f"host: {counts[HostSlotState.FREE]} slots are FREE but the free list holds "
                f"{len(free_pages)} pages of {self.page_size}"
            )
        if len(free_pages):
            if bool((self._state[free_pages] != HostSlotState.FREE).any()) or len(torch.unique(free_pages)) != len(free_pages):
                raise InvariantError("host: the free list holds a page that is not FREE, or a page twice")
        if counts != self.counts():
            raise InvariantError(f"host: the states' counts kept as pages move, {self.counts()}, differ from the "
                                 f"table's, {counts}")

    def _move(self, pages: Pages, to: HostSlotState, what: str, rules: _Rules = _LEGAL, *, fresh: bool = False) -> None:
        """Move `pages` to `to` if every move is legal, else change nothing and say why.
        `fresh`: pages the free list just handed out (distinct and in range by its invariant)."""
        if self._states.move(pages, rules.sources[to], to, fresh=fresh, tally=self._counts):
            return
        at = as_tensor(pages)
        if bool((at < 0).any()) or bool((at >= self._pages).any()):
            raise SlotStateError(f"host {what}: page number out of range 0..{self._pages - 1}")
        if len(torch.unique(at)) != len(at):
            raise SlotStateError(f"host {what}: a page appears twice in one call")
        have = self._state[at].to(torch.int64)
        legal = rules.table[have, int(to)]
        bad = (~legal).nonzero().flatten()
        shown = ", ".join(f"page {int(at[i])} is {HostSlotState(int(have[i])).name}" for i in bad[:8])
        more = f" (and {len(bad) - 8} more)" if len(bad) > 8 else ""
        hint = ""
        if to is HostSlotState.FREE and bool((have[bad] == HostSlotState.FREE).any()):
            hint = " (double free)"
        elif to is HostSlotState.FREE:
            hint = f" (only {', '.join(s.name for s in _FREEABLE)} pages may be freed)"
        elif bool((have[bad] == HostSlotState.FREE).any()):
            hint = " (FREE pages are allocated with allocate(), not moved)"
        raise SlotStateError(f"illegal host page transition to {to.name} on {what}: {shown}{more}{hint}")
