"""`TreeActor`: the only actor that decides: locks, eviction, write-through, load-back.

A thin shell: each message becomes one call on `TreeCore`, and what the core put
in its outbox is sent. `WriteDone` and `LoadDone` are handled whenever they
arrive (with one rank they apply at once; with several, at the next agreement,
which the scheduler runs every tick), so a write-through never keeps a node
locked past its ack, whatever the scheduler is doing (the pure-decode leak of
SGLang #20049 cannot happen here). It also decides prefetch and backup to storage;
the prefetcher only reports.
"""

from __future__ import annotations

from hicache.messages import (
    ActorName,
    AdmitRequests,
    ApplyFacts,
    DigestTree,
    FactsApplied,
    PagesStored,
    PrefetchHit,
    PrefetchProgress,
    PrefetchReadiness,
    PrefetchRequests,
    PrefetchStates,
    PrefetchStopped,
    ReportFacts,
    SettlePrefetches,
    TerminatePrefetches,
    CacheUnfinished,
    EvictDevice,
    EvictForAllocation,
    EvictHost,
    FinishRequests,
    HostAllocated,
    HostInsufficient,
    LoadDone,
    LoadFailed,
    LoadsStarted,
    Message,
    RequestPagesSwapped,
    SlotsAllocated,
    SlotsInsufficient,
    TreeStatistics,
    WriteDone,
    WriteFailed,
)
from ._actor import Directory, HiActor
from ._services import Services
from hicache.messages.config import Config

from ._routes import Routes
from ._tree_core import TreeCore


FACADE, PREFETCH, DEVICE, HOST = ActorName.FACADE, ActorName.PREFETCH, ActorName.DEVICE, ActorName.HOST
WRITE, LOAD = ActorName.WRITE, ActorName.LOAD


def _readiness(core: TreeCore, m: PrefetchStates) -> None:
    core.outbox.append((FACADE, PrefetchReadiness(op_id=m.op_id, ready=core.prefetch_states(m.request_ids))))


def _apply_facts(core: TreeCore, m: ApplyFacts) -> None:
    core.apply_facts(m.counts, m.values)
    core.outbox.append((FACADE, FactsApplied(op_id=m.op_id)))


TREE_ROUTES: Routes[TreeCore] = Routes(ActorName.TREE, {
    # the facade's verbs
    AdmitRequests: (FACADE, lambda core, m: core.admit(m.op_id, m.items)),
    FinishRequests: (FACADE, lambda core, m: core.finish(m.op_id, m.items)),
    CacheUnfinished: (FACADE, lambda core, m: core.cache_unfinished(m.op_id, m.items)),
    EvictDevice: (FACADE, lambda core, m: core.evict_device(m.op_id, m.tokens)),
    EvictHost: (FACADE, lambda core, m: core.evict_host(m.op_id, m.tokens)),
    PrefetchRequests: (FACADE, lambda core, m: core.prefetch(m.op_id, m.items)),
    PrefetchStates: (FACADE, _readiness),
    TerminatePrefetches: (FACADE, lambda core, m: core.terminate_prefetches(m.op_id, m.request_ids, m.reason)),
    SettlePrefetches: (FACADE, lambda core, m: core.settle_prefetches(m.op_id, m.request_ids, m.pages)),
    ReportFacts: (FACADE, lambda core, m: core.report_facts(m.op_id)),
    ApplyFacts: (FACADE, _apply_facts),
    DigestTree: (FACADE, lambda core, m: core.digest(m.op_id)),
    # the device allocator's
    EvictForAllocation: (DEVICE, lambda core, m: core.evict_device(m.op_id, m.tokens, reply_to=DEVICE)),
    # replies and acks
    SlotsAllocated: (DEVICE, lambda core, m: core.on_load_slots(m.op_id, m.grants[0].pages, 0)),
    SlotsInsufficient: (DEVICE, lambda core, m: core.on_load_slots(m.op_id, None, m.shortfall_slots)),
    RequestPagesSwapped: (DEVICE, lambda core, m: core.on_swapped(m.op_id)),
    HostAllocated: (HOST, lambda core, m: core.on_host_allocated(m.op_id, m.pages)),
    HostInsufficient: (HOST, lambda core, m: core.on_host_allocated(m.op_id, None)),
    WriteDone: (WRITE, lambda core, m: core.on_write_done(m.op_id)),
    WriteFailed: (WRITE, lambda core, m: core.on_write_failed(m.op_id)),
    LoadsStarted: (LOAD, lambda core, m: core.on_loads_started(m.ops)),
    LoadDone: (LOAD, lambda core, m: core.on_load_done(m.op_id)),
    LoadFailed: (LOAD, lambda core, m: core.on_load_failed(m.op_id)),
    PrefetchHit: (PREFETCH, lambda core, m: core.on_prefetch_hit(m.op_id, m.pages)),
    PrefetchProgress: (PREFETCH, lambda core, m: core.on_prefetch_progress(m.op_id, m.pages, m.finished)),
    PrefetchStopped: (PREFETCH, lambda core, m: core.on_prefetch_stopped(m.op_id, m.pages)),
    PagesStored: (PREFETCH, lambda core, m: core.on_pages_stored(m.op_id, m.pages, m.written)),
})
"""Each message the tree handles: the one actor that may send it, and the call on the core it
becomes (what the core answers goes out through its outbox)."""


class TreeActor(HiActor):
    name = ActorName.TREE

    def __init__(self, *, config: Config, services: Services, directory: Directory) -> None:
        super().__init__(services=services, directory=directory)
        # Its own id sequence: the ids it draws depend on its inbox only (replay needs that).
        self.core = TreeCore(config, lambda: services.ids.next("tree-op"), self.now_s)

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        TREE_ROUTES.deliver(self.core, sender, message)
        self.send_outbox(self.core)
        return None

    def awaiting(self) -> tuple[str, ...]:
        s = self.core.statistics()
        parts = []
        if s.writes_in_flight:
            parts.append(f"{s.writes_in_flight} write acks")
        if s.loads_in_flight:
            parts.append(f"{s.loads_in_flight} load acks")
        if s.prefetches_in_flight:
            parts.append(f"{s.prefetches_in_flight} prefetches")
        return tuple(parts)

    def check_invariants(self) -> None:
        self.core.check_invariants()

    def statistics(self) -> TreeStatistics:
        return self.core.statistics()
