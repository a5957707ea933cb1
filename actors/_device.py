"""`DeviceAllocatorActor`: hands out and takes back device slots."""

from __future__ import annotations

from hicache.messages import (
    ActorName,
    AdoptLoadedSlots,
    AllocateLoadSlots,
    AllocateSlots,
    CommitSlots,
    DeviceStatistics,
    FreeDeviceSlots,
    Message,
    ReleaseRequests,
    RequestPagesSwapped,
    RequestsReleased,
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


class DeviceAllocatorActor(HiActor):
    name = ActorName.DEVICE

    def __init__(self, *, config: Config, core: DeviceCore, services: Services, directory: Directory) -> None:
        super().__init__(services=services, directory=directory)
        self.core = core

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        core = self.core
        match message:
            case AllocateSlots(op_id=op, demands=demands, commits=commits):
                if commits:
                    core.commit_many([(d.request_id, d.tokens) for d in commits])
                got = core.allocate_pages([(d.request_id, d.tokens) for d in demands])
                if isinstance(got, Insufficient):
                    return _insufficient(op, got)
                grants = tuple(SlotGrant(request_id=d.request_id, pages=got[d.request_id]) for d in demands)
                return SlotsAllocated(op_id=op, grants=grants)
            case CommitSlots(op_id=op, demands=demands):
                views = core.commit_many([(d.request_id, d.tokens) for d in demands])
                return SlotsCommitted(op_id=op, entries=tuple(views))
            case ReleaseRequests(op_id=op, releases=releases):
                views = core.release_many([(r.request_id, r.adopt, r.reason) for r in releases])
                return RequestsReleased(op_id=op, entries=tuple(views))
            case SwapRequestPages(op_id=op, request_id=rid, adopt=adopt, free=free):
                self.require_sender(sender, ActorName.TREE, "handing request pages to the tree")
                view = core.swap(rid, adopt, free)
                return RequestPagesSwapped(op_id=op, entry=view)
            case AllocateLoadSlots(op_id=op, tokens=n):
                pages = core.allocate_load_pages(n)
                if isinstance(pages, Insufficient):
                    return _insufficient(op, pages)
                grant = SlotGrant(request_id="", pages=pages)
                return SlotsAllocated(op_id=op, grants=(grant,))
            case AdoptLoadedSlots(pages=idx):
                self.require_sender(sender, ActorName.TREE, "adopting loaded device slots")
                core.adopt_loaded(idx)
                return None
            case FreeDeviceSlots(pages=idx):
                self.require_sender(sender, ActorName.TREE, "freeing tree-owned device slots")
                core.free_tree(idx)
                return None
            case _:
                self.unknown(message)
        return None

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
        )


def _insufficient(op: int, got: Insufficient) -> SlotsInsufficient:
    return SlotsInsufficient(
        op_id=op,
        requested_slots=got.requested_slots,
        free_slots=got.free_slots,
        shortfall_slots=got.shortfall_slots,
    )
