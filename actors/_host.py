"""`HostPoolActor`: owns host slot state; accepts a free only from the tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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
from hicache.messages.config import Config

from ._actor import Directory, HiActor
from ._services import FaultPlan, NoFaults, Services

from ._host_core import HostCore
from ._routes import Routes


class _Host(Protocol):
    """What the host pool's routes act on: the actor itself, or a `HostSide` where a driver
    runs the core without it."""

    @property
    def core(self) -> HostCore: ...

    @property
    def faults(self) -> FaultPlan: ...


@dataclass(frozen=True, slots=True)
class HostSide:
    """A host core for the host pool's routes without the actor, with the faults to inject
    (a reservation refused as if the pool were short)."""

    core: HostCore
    faults: FaultPlan = NoFaults()


class HostPoolActor(HiActor):
    name = ActorName.HOST

    def __init__(self, *, config: Config, core: HostCore, services: Services, directory: Directory) -> None:
        super().__init__(services=services, directory=directory)
        self.core = core

    @property
    def faults(self) -> FaultPlan:
        """The runtime's faults, read at each reservation (an open delivery log wraps them)."""
        return self._services.faults

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        return HOST_ROUTES.deliver(self, sender, message)

    def check_invariants(self) -> None:
        self.core.check_invariants()

    def statistics(self) -> HostStatistics:
        return HostStatistics.of(self.core.capacity_slots, self.core.counts())


def _allocate(side: _Host, m: AllocateHost) -> HostAllocated | HostInsufficient:
    pages = None if side.faults.host_exhausted(m.tokens) else side.core.allocate_pages(m.tokens)
    if pages is None:
        return HostInsufficient(op_id=m.op_id, requested_slots=m.tokens, free_slots=side.core.free_slots)
    return HostAllocated(op_id=m.op_id, pages=pages)


TREE = ActorName.TREE

HOST_ROUTES: Routes[_Host] = Routes(ActorName.HOST, {
    SetHostState: (TREE, lambda side, m: side.core.transition(m.pages, m.state), "moving host slot states"),
    AllocateHost: (TREE, _allocate, "reserving host slots"),
    FreeHostSlots: (TREE, lambda side, m: side.core.free(m.pages), "freeing host slots"),
})
"""Each message the host pool handles, all from the tree (the only actor that decides what
host memory holds), and the call on the core it becomes, with the reply."""
