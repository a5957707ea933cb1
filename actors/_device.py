"""`DeviceAllocatorActor`: hands out and takes back device slots."""

from __future__ import annotations

from hicache.messages import (
    ActorName,
    AdoptLoadedSlots,
    AllocateLoadSlots,
    AllocateSlots,
    CommitSlots,
    DeviceStatistics,
    Evicted,
    EvictForAllocation,
    Finished,
    FreeDeviceSlots,
    Indices,
    Message,
    ReleaseRequests,
    RequestPagesSwapped,
    SlotGrant,
    SlotsAllocated,
    SlotsCommitted,
    SlotsInsufficient,
    SwapRequestPages,
)
from ._actor import Directory, HiActor
from ._services import Services
from hicache.messages.config import Config

from ._device_core import DeviceCore, Insufficient, PageOwner
from ._errors import LedgerError
from ._routes import Routes


class DeviceAllocatorActor(HiActor):
    name = ActorName.DEVICE

    def __init__(self, *, config: Config, core: DeviceCore, services: Services, directory: Directory) -> None:
        super().__init__(services=services, directory=directory)
        self.core = core

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        reply = DEVICE_ROUTES.deliver(self.core, sender, message)
        if self.core.outbox:
            self.send_outbox(self.core)
        return reply

    def awaiting(self) -> tuple[str, ...]:
        n = len(self.core.waiting)
        return (f"{n} evictions for allocations",) if n else ()

    def check_invariants(self) -> None:
        self.core.check_invariants()

    def statistics(self) -> DeviceStatistics:
        c = self.core.counts()
        return DeviceStatistics(
            capacity_slots=self.core.capacity_slots,
            free_slots=c[PageOwner.FREE],
            request_slots=c[PageOwner.REQUEST],
            tree_slots=c[PageOwner.TREE],
            loading_slots=c[PageOwner.LOADING],
            live_requests=self.core.live_requests(),
            ahead_slots=self.core.ahead_slots(),
        )


def _insufficient(op: int, got: Insufficient) -> SlotsInsufficient:
    return SlotsInsufficient(
        op_id=op,
        requested_slots=got.requested_slots,
        free_slots=got.free_slots,
        shortfall_slots=got.shortfall_slots,
    )


def _allocate(core: DeviceCore, m: AllocateSlots) -> SlotsAllocated | SlotsInsufficient | None:
    if m.allocs:
        core.extend_only([(d.request_id, d.tokens) for d in m.allocs])
    if m.commits:
        core.commit_only([(d.request_id, d.tokens) for d in m.commits])
    if m.trim:
        core.trim(m.trim)
    got = core.allocate_pages([(d.request_id, d.tokens) for d in m.demands], ahead=m.ahead)
    if isinstance(got, Insufficient) and m.evict:  # answered once the tree has evicted
        core.waiting[m.op_id] = (m, tuple(core.mark(d.request_id) for d in m.demands))
        core.outbox.append((TREE, EvictForAllocation(op_id=m.op_id, tokens=got.shortfall_slots)))
        return None
    return _allocated(m, got)


def _allocated(m: AllocateSlots, got: dict[str, Indices] | Insufficient) -> SlotsAllocated | SlotsInsufficient:
    if isinstance(got, Insufficient):
        return _insufficient(m.op_id, got)
    return SlotsAllocated(op_id=m.op_id, grants=tuple([SlotGrant(request_id=d.request_id, pages=got[d.request_id])
                                                       for d in m.demands]))


def _evicted(core: DeviceCore, e: Evicted) -> None:
    """The tree evicted for a waiting allocation: try it once more and answer the facade. If one
    of its requests was released or allocated for meanwhile (the facade gave up on the call
    and went on), nothing is allocated: the answer goes to a call nobody waits for."""
    if e.op_id not in core.waiting:
        raise LedgerError(f"Evicted for op {e.op_id}, but no allocation waits for an eviction under that op")
    m, marks = core.waiting.pop(e.op_id)
    if any(core.mark(d.request_id) != mark for d, mark in zip(m.demands, marks, strict=True)):
        got: dict[str, Indices] | Insufficient = Insufficient(requested_slots=0, free_slots=core.free_slots)
    else:
        got = core.allocate_pages([(d.request_id, d.tokens) for d in m.demands], ahead=m.ahead)
    core.outbox.append((FACADE, _allocated(m, got)))


def _commit(core: DeviceCore, m: CommitSlots) -> SlotsCommitted:
    return SlotsCommitted(op_id=m.op_id, entries=tuple(core.commit_many([(d.request_id, d.tokens) for d in m.demands])))


def _release(core: DeviceCore, m: ReleaseRequests) -> None:
    """The tree's release of finished requests: answered to the facade, whose finish it is."""
    views = core.release_many([(r.request_id, r.adopt, r.reason) for r in m.releases],
                              commits=[(r.request_id, r.commits) for r in m.releases if r.commits],
                              allocs=[(r.request_id, r.allocs) for r in m.releases if r.allocs])
    core.outbox.append((FACADE, Finished(op_id=m.op_id, entries=tuple(views))))


def _swap(core: DeviceCore, m: SwapRequestPages) -> RequestPagesSwapped:
    return RequestPagesSwapped(op_id=m.op_id, entry=core.swap(m.request_id, m.adopt, m.free, commits=m.commits,
                                                                allocs=m.allocs))


def _allocate_load(core: DeviceCore, m: AllocateLoadSlots) -> SlotsAllocated | SlotsInsufficient:
    pages = core.allocate_load_pages(m.tokens)
    if isinstance(pages, Insufficient):
        return _insufficient(m.op_id, pages)
    return SlotsAllocated(op_id=m.op_id, grants=(SlotGrant(request_id="", pages=pages),))


FACADE, TREE = ActorName.FACADE, ActorName.TREE

DEVICE_ROUTES: Routes[DeviceCore] = Routes(ActorName.DEVICE, {
    AllocateSlots: (FACADE, _allocate, "allocating request slots"),
    CommitSlots: (FACADE, _commit, "committing request slots"),
    ReleaseRequests: (TREE, _release, "releasing finished requests' slots"),
    SwapRequestPages: (TREE, _swap, "handing request pages to the tree"),
    AllocateLoadSlots: (TREE, _allocate_load, "reserving device slots for a load-back"),
    AdoptLoadedSlots: (TREE, lambda core, m: core.adopt_loaded(m.pages), "adopting loaded device slots"),
    FreeDeviceSlots: (TREE, lambda core, m: core.free_tree(m.pages), "freeing tree-owned device slots"),
    Evicted: (TREE, _evicted, "the tree's eviction for an allocation that waits for it"),
})
"""Each message the device allocator handles: who may send it, and the call on the core it
becomes, with the reply the sender gets. The scheduler owns its requests' slots; the tree
owns the slots it holds, loads into and frees."""
