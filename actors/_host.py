"""`HostPoolActor`: owns host slot state; accepts a free only from the tree."""

from __future__ import annotations

from hicache.messages import (
    ActorName,
    AllocateHost,
    FreeHostSlots,
    HostAllocated,
    HostInsufficient,
    HostStatistics,
    Message,
    SetHostState,
)
from ._actor import Directory, HiActor
from ._services import Services
from hicache.messages.config import Config

from ._host_core import HostCore


class HostPoolActor(HiActor):
    name = ActorName.HOST

    def __init__(self, *, config: Config, core: HostCore, services: Services, directory: Directory) -> None:
        super().__init__(services=services, directory=directory)
        self.core = core

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        match message:
            case SetHostState(pages=idx, state=state):  # the most frequent first
                self.require_sender(sender, ActorName.TREE, "moving host slot states")
                self.core.transition(idx, state)
                return None
            case AllocateHost(op_id=op, tokens=n):
                self.require_sender(sender, ActorName.TREE, "reserving host slots")
                pages = None if self._services.faults.host_exhausted(n) else self.core.allocate_pages(n)
                if pages is None:
                    return HostInsufficient(op_id=op, requested_slots=n, free_slots=self.core.free_slots)
                return HostAllocated(op_id=op, pages=pages)
            case FreeHostSlots(pages=idx):
                self.require_sender(sender, ActorName.TREE, "freeing host slots")
                self.core.free(idx)
                return None
            case _:
                self.unknown(message)
        return None

    def check_invariants(self) -> None:
        self.core.check_invariants()

    def statistics(self) -> HostStatistics:
        return HostStatistics.of(self.core.capacity_slots, self.core.counts())
