"""`TreeActor`: the only actor that decides: locks, eviction, write-through, load-back.

A thin shell: each message becomes one call on `TreeCore`, and what the core put
in its outbox is sent. `WriteDone` and `LoadDone` are handled whenever they
arrive (with one rank they apply at once; with several, at the next agreement,
which the scheduler runs every tick), so a write-through never keeps a node
locked past its ack, whatever the scheduler is doing (the pure-decode leak of
seed 003 cannot happen here). It also decides prefetch and backup to storage;
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
    EvictHost,
    FinishRequests,
    HostAllocated,
    HostInsufficient,
    LoadDone,
    LoadFailed,
    Message,
    RequestPagesSwapped,
    RequestsReleased,
    SlotsAllocated,
    SlotsInsufficient,
    TreeStatistics,
    WriteDone,
    WriteFailed,
)
from hicache.runtime._actor import Directory, HiActor
from hicache.runtime._services import Services
from hicache.runtime.config import Config

from ._tree_core import TreeCore


_SENDER: dict[type[Message], ActorName] = {
    **dict.fromkeys((AdmitRequests, FinishRequests, CacheUnfinished, EvictDevice, EvictHost, PrefetchRequests,
                     PrefetchStates, TerminatePrefetches, SettlePrefetches, ReportFacts, ApplyFacts, DigestTree),
                    ActorName.FACADE),
    **dict.fromkeys((PrefetchHit, PrefetchProgress, PrefetchStopped, PagesStored), ActorName.PREFETCH),
    **dict.fromkeys((SlotsAllocated, SlotsInsufficient, RequestsReleased, RequestPagesSwapped), ActorName.DEVICE),
    **dict.fromkeys((HostAllocated, HostInsufficient), ActorName.HOST),
    **dict.fromkeys((WriteDone, WriteFailed), ActorName.WRITE),
    **dict.fromkeys((LoadDone, LoadFailed), ActorName.LOAD),
}
"""Who may send each message the tree handles: a reply from anyone else is a bug."""


class TreeActor(HiActor):
    name = ActorName.TREE

    def __init__(self, *, config: Config, services: Services, directory: Directory) -> None:
        super().__init__(services=services, directory=directory)
        # Its own id sequence: the ids it draws depend on its inbox only (replay needs that).
        self.core = TreeCore(config, lambda: services.ids.next("tree-op"), services.clock.now_s)

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        expected = _SENDER.get(type(message))
        if expected is not None:
            self.require_sender(sender, expected, type(message).__name__)
        core = self.core
        match message:
            case AdmitRequests(op_id=op, items=items):
                core.admit(op, items)
            case FinishRequests(op_id=op, items=items):
                core.finish(op, items)
            case CacheUnfinished(op_id=op, items=items):
                core.cache_unfinished(op, items)
            case EvictDevice(op_id=op, tokens=n):
                core.evict_device(op, n)
            case EvictHost(op_id=op, tokens=n):
                core.evict_host(op, n)
            case SlotsAllocated(op_id=op, grants=grants):
                core.on_load_slots(op, grants[0].indices.as_tensor(), 0)
            case SlotsInsufficient(op_id=op, shortfall_slots=short):
                core.on_load_slots(op, None, short)
            case HostAllocated(op_id=op, indices=idx):
                core.on_host_allocated(op, idx.as_tensor())
            case HostInsufficient(op_id=op):
                core.on_host_allocated(op, None)
            case WriteDone(op_id=op):
                core.on_write_done(op)
            case WriteFailed(op_id=op):
                core.on_write_failed(op)
            case LoadDone(op_id=op):
                core.on_load_done(op)
            case LoadFailed(op_id=op):
                core.on_load_failed(op)
            case RequestsReleased(op_id=op, entries=entries):
                core.on_released(op, entries)
            case RequestPagesSwapped(op_id=op):
                core.on_swapped(op)
            case PrefetchRequests(op_id=op, items=items):
                core.prefetch(op, items)
            case PrefetchStates(op_id=op, request_ids=ids):
                core.outbox.append((ActorName.FACADE, PrefetchReadiness(op_id=op, ready=core.prefetch_states(ids))))
            case TerminatePrefetches(op_id=op, request_ids=ids, reason=reason):
                core.terminate_prefetches(op, ids, reason)
            case SettlePrefetches(op_id=op, request_ids=ids, pages=pages):
                core.settle_prefetches(op, ids, pages)
            case PrefetchHit(op_id=op, pages=pages):
                core.on_prefetch_hit(op, pages)
            case PrefetchProgress(op_id=op, pages=pages, finished=finished):
                core.on_prefetch_progress(op, pages, finished)
            case PrefetchStopped(op_id=op, pages=pages):
                core.on_prefetch_stopped(op, pages)
            case PagesStored(op_id=op, pages=pages, written=written):
                core.on_pages_stored(op, pages, written)
            case ReportFacts(op_id=op):
                core.report_facts(op)
            case ApplyFacts(op_id=op, counts=counts, values=values):
                core.apply_facts(counts, values)
                core.outbox.append((ActorName.FACADE, FactsApplied(op_id=op)))
            case DigestTree(op_id=op):
                core.digest(op)
            case _:
                self.unknown(message)
        self._flush()
        return None

    def _flush(self) -> None:
        out, self.core.outbox = self.core.outbox, []
        for to, msg in out:
            self.send(to, msg)

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
