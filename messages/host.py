"""Verbs of the host pool: page allocation and the per-page state machine.

Host memory is handed out in pages of `page_size` slots, as device memory is; messages name
page numbers, and every slot of a page shares its state."""

from __future__ import annotations

import enum

from ._index import Indices
from ._registry import Message, message, wire_enum


@wire_enum(200)
class HostSlotState(enum.IntEnum):
    """Lifecycle of one host page (all its slots). Legal moves are listed in `HOST_TRANSITIONS`."""

    FREE = 0
    """Not allocated."""
    RESERVED = 1
    """Allocated, holds no valid KV yet (a write or prefetch will fill it)."""
    WRITING = 2
    """A device -> host copy is in flight into it."""
    SYNCED = 3
    """Holds the same KV as a device slot."""
    HOST_ONLY = 4
    """Holds KV whose device copy was dropped; the only copy in memory."""
    LOADING = 5
    """A host -> device copy is reading it."""
    PREFETCHING = 6
    """A storage -> host read is in flight into it."""


_S = HostSlotState

HOST_TRANSITIONS: frozenset[tuple[HostSlotState, HostSlotState]] = frozenset(
    {
        (_S.FREE, _S.RESERVED),  # allocate
        (_S.RESERVED, _S.WRITING),  # a write-through starts
        (_S.RESERVED, _S.PREFETCHING),  # a storage read starts
        (_S.RESERVED, _S.FREE),  # reservation returned unused
        (_S.WRITING, _S.SYNCED),  # write done
        (_S.WRITING, _S.RESERVED),  # write failed: bytes are not valid
        (_S.SYNCED, _S.HOST_ONLY),  # device copy dropped
        (_S.SYNCED, _S.FREE),  # host copy dropped while the device copy stays
        (_S.HOST_ONLY, _S.LOADING),  # load-back starts
        (_S.HOST_ONLY, _S.FREE),  # host eviction
        (_S.HOST_ONLY, _S.SYNCED),  # the device copy was computed again (an insert revived the node)
        (_S.LOADING, _S.SYNCED),  # load done: device and host agree
        (_S.LOADING, _S.HOST_ONLY),  # load failed: the device copy is not valid
        (_S.PREFETCHING, _S.HOST_ONLY),  # page read from storage
        (_S.PREFETCHING, _S.RESERVED),  # storage read failed or stopped
    }
)
"""Every legal (from, to) move of a host page; anything else is a programmer error."""


@message(201)
class AllocateHost(Message):
    """Reserve host pages for a write-through, a load or a prefetch."""

    op_id: int
    """Correlation id echoed in the reply."""
    tokens: int
    """Number of slots; must be a multiple of the page size."""


@message(202)
class HostAllocated(Message):
    """Reply to `AllocateHost`: the reserved pages, in state RESERVED."""

    op_id: int
    """The `op_id` of the allocation."""
    pages: Indices
    """The reserved pages (`tokens / page_size` of them)."""


@message(203)
class HostInsufficient(Message):
    """Reply to `AllocateHost` when free pages do not cover it; nothing was reserved."""

    op_id: int
    """The `op_id` of the allocation."""
    requested_slots: int
    """Slots asked for."""
    free_slots: int
    """Slots free at the time."""


@message(204)
class SetHostState(Message):
    """Move pages to a new state; every page's move must be legal."""

    pages: Indices
    """Pages to move."""
    state: HostSlotState
    """The state they move to (not FREE: use `FreeHostSlots`)."""


@message(205)
class FreeHostSlots(Message):
    """Free host pages. Accepted only from the tree."""

    pages: Indices
    """Pages in state RESERVED, SYNCED or HOST_ONLY."""


@message(206)
class HostStatistics(Message):
    """Counts of the host pool by slot state."""

    capacity_slots: int
    """All slots of the host buffer."""
    free_slots: int
    """Slots in state `FREE`."""
    reserved_slots: int
    """Slots in state `RESERVED`."""
    writing_slots: int
    """Slots in state `WRITING`."""
    synced_slots: int
    """Slots in state `SYNCED`."""
    host_only_slots: int
    """Slots in state `HOST_ONLY`."""
    loading_slots: int
    """Slots in state `LOADING`."""
    prefetching_slots: int
    """Slots in state `PREFETCHING`."""

    @classmethod
    def of(cls, capacity_slots: int, counts: tuple[int, ...]) -> HostStatistics:
        """From the slot count of each state, indexed by its value."""
        return cls(capacity_slots=capacity_slots,
                   **{f"{s.name.lower()}_slots": counts[s] for s in HostSlotState})

    def slots_in(self, state: HostSlotState) -> int:
        """Slots in `state`."""
        return int(getattr(self, f"{state.name.lower()}_slots"))
