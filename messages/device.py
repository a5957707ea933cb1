"""Verbs of the device allocator: per-request slot ledger and tree-owned slots.

Device memory is handed out in pages of `page_size` slots; the pages a message names are
page numbers (page `k` holds slots `k * page_size .. (k + 1) * page_size - 1`). Only the
facade turns them into slot numbers, for the engine.

Ownership of a device page moves between four owners: free, a request (through
its ledger), the tree, and an in-flight load.
"""

from __future__ import annotations

import enum

from ._index import Indices
from ._registry import Message, message, wire_enum


@wire_enum(100)
class ReleaseReason(enum.Enum):
    """Why a request gives its slots back."""

    FINISHED = "finished"
    """Done; its id may never allocate again."""
    ABORTED = "aborted"
    """Cancelled; its id may never allocate again."""
    RETRACTED = "retracted"
    """Pushed back to the waiting queue under memory pressure; it may allocate again."""


@message(100)
class SlotDemand(Message):
    """How many slots one request wants (allocate) or has filled (commit)."""

    request_id: str
    """The scheduler's request id."""
    tokens: int
    """Number of token slots, >= 0."""


@message(101)
class AllocateSlots(Message):
    """Commit what requests wrote, then allocate slots for several requests at once; the
    allocation is all or nothing (the commits hold either way)."""

    op_id: int
    """Correlation id echoed in the reply."""
    demands: tuple[SlotDemand, ...]
    """One demand per request; a request appears at most once."""
    allocs: tuple[SlotDemand, ...]
    """Per request, slots it took from the pages it holds (the free part of its last page, pages
    held ahead) that the device was not told of yet (the facade serves an allocation that fits
    there itself), applied first."""
    commits: tuple[SlotDemand, ...]
    """Per request, how many more of its slots hold real KV (as `CommitSlots`), applied next:
    a decode tick commits the tokens it wrote and allocates the next ones in one message."""
    evict: bool
    """If the free pages are short: ask the tree to evict the shortfall (`EvictForAllocation`)
    and try once more when it answers, before replying (the facade's allocations: one round
    trip where it would take three)."""
    ahead: bool = False
    """A small demand (at most `Config.ahead_pages` pages' slots: a decode step's) that needs
    new pages also gets `Config.ahead_pages` whole pages more while the free list holds them
    (never by eviction): the facade's, so that the next decode steps are served from pages
    the request holds, without a message."""
    trim: tuple[str, ...] = ()
    """Requests whose pages held ahead of their allocated slots go back to the free list
    first, after the `allocs` (the facade's retry of an allocation that came up short)."""


@message(102)
class SlotGrant(Message):
    """The pages granted to one request (its next slots are the rest of its last partial
    page, then any pages it held ahead, then these pages, in token order; with
    `AllocateSlots.ahead`, the last `Config.ahead_pages` of them may be held ahead)."""

    request_id: str
    """The request the pages now belong to."""
    pages: Indices
    """New pages, in token order; none when the pages it holds cover the demand."""


@message(103)
class SlotsAllocated(Message):
    """Reply to `AllocateSlots` or `AllocateLoadSlots` when every demand was met."""

    op_id: int
    """The `op_id` of the allocation."""
    grants: tuple[SlotGrant, ...]
    """One grant per demand, in demand order."""


@message(104)
class SlotsInsufficient(Message):
    """Reply when free pages do not cover an allocation; nothing was allocated."""

    op_id: int
    """The `op_id` of the allocation."""
    requested_slots: int
    """Slots that would have had to come from free pages."""
    free_slots: int
    """Slots free at the time."""
    shortfall_slots: int
    """How many more free slots the allocation needed."""


@message(105)
class CommitSlots(Message):
    """Record that requests have written KV into more of their allocated slots."""

    op_id: int
    """Correlation id echoed in the reply."""
    demands: tuple[SlotDemand, ...]
    """Per request, how many more slots now hold real KV."""


@message(106)
class LedgerEntry(Message):
    """A request's ledger as numbers."""

    request_id: str
    """The request."""
    allocated: int
    """Slots handed to the request so far."""
    committed: int
    """Slots that hold real KV; never more than `allocated`."""
    freed: int
    """Slots given back (freed or adopted by the tree) at release."""


@message(107)
class SlotsCommitted(Message):
    """Reply to `CommitSlots`: the ledgers after the commit."""

    op_id: int
    """The `op_id` of the commit."""
    entries: tuple[LedgerEntry, ...]
    """One entry per demand."""


@message(108)
class SlotRelease(Message):
    """Release one request: its `adopt` pages go to the tree, all others are freed."""

    request_id: str
    """The request being finished, retracted or aborted."""
    adopt: Indices
    """Pages of the request that the tree keeps (its cached prefix); may be empty."""
    reason: ReleaseReason
    """Finished and aborted ids are remembered as released; retracted ones may come back."""
    allocs: int
    """Slots it took from the pages it holds that the device was not told of yet (as
    `AllocateSlots.allocs`), applied first."""
    commits: int
    """More of its slots that hold real KV (as `CommitSlots`), applied before the release."""


@message(109)
class ReleaseRequests(Message):
    """Release several requests in one place; each exactly once. The device answers the
    facade (not the tree) with `Finished`: the final ledgers."""

    op_id: int
    """The `op_id` of the facade's `FinishRequests`, echoed in `Finished`."""
    releases: tuple[SlotRelease, ...]
    """One release per request."""


@message(111)
class AllocateLoadSlots(Message):
    """Allocate device pages that a load from host will fill (owner: loading)."""

    op_id: int
    """Correlation id echoed in the reply (`SlotsAllocated` with one grant, or `SlotsInsufficient`)."""
    tokens: int
    """Number of slots; rounded up to whole pages."""


@message(112)
class AdoptLoadedSlots(Message):
    """A load into these pages completed: they now belong to the tree."""

    pages: Indices
    """Pages previously allocated with `AllocateLoadSlots`."""


@message(113)
class FreeDeviceSlots(Message):
    """Free tree-owned or loading pages (eviction, a failed load). Tree only."""

    pages: Indices
    """Pages to free."""


@message(114)
class DeviceStatistics(Message):
    """Counts of the device pool by owner."""

    capacity_slots: int
    """All slots of the device buffer."""
    free_slots: int
    """Slots in free pages."""
    request_slots: int
    """Slots in pages owned by live requests."""
    tree_slots: int
    """Slots in pages owned by the tree."""
    loading_slots: int
    """Slots in pages a load is filling."""
    live_requests: int
    """Requests with a ledger that were not released yet."""
    ahead_slots: int = 0
    """Slots of `request_slots` in pages live requests hold past the pages of the slots the
    device has counted as theirs (`Config.ahead_slots`; slots the facade served from them are
    counted with the next message about the request): given back first when memory is short."""


@message(115)
class SwapRequestPages(Message):
    """Mid-life (chunked prefill): some pages of a live request go to the tree, some are freed."""

    op_id: int
    """Correlation id echoed in `RequestPagesSwapped`."""
    request_id: str
    """The request; it stays live."""
    adopt: Indices
    """Whole committed pages (page numbers) the tree now owns."""
    free: Indices
    """Whole committed pages (page numbers) that duplicate the tree's and are freed."""
    allocs: int
    """Slots it took from the pages it holds that the device was not told of yet (as
    `AllocateSlots.allocs`), applied first."""
    commits: int
    """More of its slots that hold real KV (as `CommitSlots`), applied before the swap."""


@message(116)
class RequestPagesSwapped(Message):
    """Reply to `SwapRequestPages`: the ledger after it."""

    op_id: int
    """The `op_id` of the swap."""
    entry: LedgerEntry
    """The request's ledger."""
