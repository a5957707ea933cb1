"""Mutants: known cache-manager bugs put back on purpose, to show exploration catches each.

Each mutant is a small subclass of one actor (or of its core) that re-introduces
one bug the field has shipped (SGLang's HiCache first among them). They are reachable only through the exploration harness
(`hicache explore --mutants`), which passes them to `System(actor_classes=...)`:
no `Config` field selects them, so production cannot run one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from hicache.actors import (
    BACKED,
    DeviceAllocatorActor,
    DeviceCore,
    LoadStreamActor,
    Node,
    NodeState,
    RadixTree,
    StoragePrefetcherActor,
    TreeActor,
    TreeCore,
    WriteStreamActor,
)
from hicache.actors._actor import HiActor
from hicache.actors._pages import Pages, as_list
from hicache.actors._tree_admission import Admissions, _Plan, _Served
from hicache.actors._tree_prefetch import PrefetchBook, _Prefetch
from hicache.actors._tree_writes import WriteBack
from hicache.messages import (
    ActorName,
    Admitted,
    AdmitRequests,
    AllocateSlots,
    FreeHostSlots,
    HostSlotState,
    Indices,
    LoadKV,
    Message,
    Prefetch,
    PrefetchEnd,
    ReleaseReason,
    SetHostState,
    StartLoads,
    WriteDone,
)


@dataclass(frozen=True, slots=True)
class Mutant:
    name: str
    bug: str
    """The bug it brings back, named by the upstream change that fixed it where there is one."""
    breaks: str
    """What goes wrong when it runs, in one line."""
    actor_classes: Mapping[ActorName, type[HiActor]]
    scenario: str = "standard"
    """The exploration scenario that exercises the code it breaks."""


# -- 1. SGLang #20049: write-through acks handled only on the prefill path -----------------


class _AcksOnAdmission(TreeActor):
    """Like the scheduler that ran `writing_check` only in the prefill path: a WriteDone
    waits until the next admission, so a pure decode loop never unlocks its nodes."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._parked: list[Message] = []

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        if isinstance(message, WriteDone):
            self._parked.append(message)
            return None
        if isinstance(message, AdmitRequests):
            parked, self._parked = self._parked, []
            for ack in parked:
                super().handle(ActorName.WRITE, ack)
        return super().handle(sender, message)


# -- 2. SGLang #12224: slots freed by an inferred length, not the ledger ----------------------


class _InferredLengthCore(DeviceCore):
    """Frees the pages that cover the committed length, as `len(input) + len(output) - 1`
    did: over-allocated pages (speculative lookahead) leak."""

    def _rest(self, ledger: Any, held: Pages) -> Pages:
        rest = super()._rest(ledger, held)
        p = self.page_size
        inferred = -(-max(ledger.committed - ledger.given, 0) // p)
        mine = set(ledger.pages[:inferred])
        return [pg for pg in as_list(rest) if pg in mine]


class _InferredLengthDevice(DeviceAllocatorActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.__class__ = _InferredLengthCore


# -- 3. SGLang HiCacheController: a device copy dropped before its host copy is synced -------


class _EagerRadix(RadixTree):
    @staticmethod
    def device_evictable(node: Node) -> bool:
        if node.alive and node.parent is not None and node.state is NodeState.WRITING and node.resident_children == 0:
            return True
        return RadixTree.device_evictable(node)


class _EvictWhileWritingWrites(WriteBack):
    def _drop_device(self, node: Node) -> Indices:
        if node.state is not NodeState.WRITING:
            return super()._drop_device(node)
        device = node.device
        assert device is not None
        if node.host is not None:
            self.s.emit(ActorName.HOST, SetHostState(pages=node.host, state=HostSlotState.HOST_ONLY))
        t = self.s.tree
        t._account(node, -1)
        node.state, node.device = NodeState.HOST_ONLY, None  # the bug: no synced check
        t._account(node, +1)
        return device


class _EvictWhileWriting(TreeActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.writes.__class__ = _EvictWhileWritingWrites
        self.core.tree.__class__ = _EagerRadix


# -- 4. a lock ref decremented twice on retract ---------------------------------------------


class _DoubleUnlockCore(TreeCore):
    def finish(self, op_id: int, items: Any) -> None:
        handles = self.admission.handles
        locked = [handles[it.handle].node for it in items
                  if it.reason is ReleaseReason.RETRACTED and it.handle in handles]
        super().finish(op_id, items)
        for node in locked:
            if node is not None and node.alive:
                self.tree.lock(node, -1)


class _DoubleUnlockOnRetract(TreeActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.__class__ = _DoubleUnlockCore


# -- 5. a short transfer marked done --------------------------------------------------------


class _ShortWrites(WriteStreamActor):
    """Copies all but the last page of a batch and still reports every write done."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._route = _ShortRoute(self._route)


class _ShortRoute:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def plan_pages(self, src: Any, dst: Any) -> Any:
        keep = max(0, len(src) - 1)
        return self._inner.plan_pages(src[:keep], dst[:keep])


# -- 6. a node backed up under a parent that is not -----------------------------------------


class _UnclosedBackupWrites(WriteBack):
    def _parent_backed(self, node: Node) -> bool:
        return True

    def _back_up_ancestors(self, node: Node) -> bool:
        return True


class _UnclosedBackup(TreeActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.writes.__class__ = _UnclosedBackupWrites


# -- an eviction that ends after one round, short of its demand ---------------------------------


class _OneRoundWrites(WriteBack):
    """Ends an eviction once its own write-backs land, without evicting what they made
    evictable (their parents), and never waits for write-throughs: the allocation that asked
    gets `Insufficient` (a load-back gives up) with evictable tokens left."""

    def _writes_holding_evictable(self) -> list[int]:
        return []

    def op_landed(self, op: int, dropped: list[Node]) -> None:
        for key in self._eviction_of.pop(op, ()):
            ev = self._evictions[key]
            ev.freed += sum(nd.tokens for nd in dropped)
            ev.waiting.discard(op)
            if not ev.waiting:
                del self._evictions[key]
                self._end_eviction(ev)


class _OneRoundEviction(TreeActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.writes.__class__ = _OneRoundWrites


# -- an eviction does not wait for the load-backs of requests that ended ---------------------


class _SkipLoadsWrites(WriteBack):
    """Waits for writes in flight but not for load-backs whose request ended while they ran:
    the allocation that asked gets `Insufficient` though the load lands a moment later and
    leaves its nodes evictable (the scheduler gives up on a request that would fit)."""

    def _loads_holding_evictable(self) -> list[int]:
        return []


class _SkipLoads(TreeActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.writes.__class__ = _SkipLoadsWrites


# -- an eviction waits for a write only when the write is all that locks every node of it ------


class _EveryNodeWrites(WriteBack):
    """Waits for a write-through only when every node of it is locked by the write alone: a
    write whose upper node a request's match split off and locks is not waited for, though
    its lower node is evictable the moment it lands."""

    def _writes_holding_evictable(self) -> list[int]:
        return [op for op, w in self.writes.items()
                if not w.evict_after and not w.doomed and all(nd.lock_ref == 1 for nd in w.nodes)]


class _EveryNodeWait(TreeActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.writes.__class__ = _EveryNodeWrites


# -- an eviction does not wait for a write that will fail -------------------------------------


class _SkipDoomedWrites(WriteBack):
    """Does not wait for a write-through doomed by its ancestor's failed write: it fails when
    it lands, and leaves its nodes on device only, unlocked and deletable."""

    def _writes_holding_evictable(self) -> list[int]:
        return [op for op in super()._writes_holding_evictable() if not self.writes[op].doomed]


class _SkipDoomed(TreeActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.writes.__class__ = _SkipDoomedWrites


# -- a prefix an earlier load has not landed counted as a device hit ---------------------------


class _BatchLoadsOnly(Admissions):
    """Counts as host hits only the nodes this admission's own batch loads: a prefix whose
    load an earlier request queued, and left before `start_loads`, is a device hit, so the
    engine starts no load and reads device pages nothing was copied to."""

    @staticmethod
    def _loading(plans: list[_Plan]) -> set[int]:
        return {nd.id for p in plans for nd in p.load_nodes}


class _LoadingAsDevice(TreeActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.admission.__class__ = _BatchLoadsOnly


# -- an admission that waits only on its own load ---------------------------------------------


class _OwnLoadsOnly(Admissions):
    """Tells the facade as an admission's waits only the load it queued itself: a prefix whose
    upper pages an earlier batch is still loading when the admission comes (an overlap
    scheduler's) is waited on through the admission's own batch alone, which lands when that
    earlier one fails."""

    def _reply_admitted(self, op_id: int, plans: list[_Plan], *, waited: bool = False) -> None:
        super()._reply_admitted(op_id, plans, waited=waited)
        to, reply = self.s.outbox[-1]
        assert isinstance(reply, Admitted), reply
        own = [tuple(sorted({nd.op for nd in p.load_nodes})) for p in plans]
        self.s.outbox[-1] = (to, replace(reply, admissions=tuple(
            replace(a, waits=tuple(op for op in a.waits if op in mine)) for a, mine in zip(reply.admissions, own))))


class _WaitsOwnLoadsOnly(TreeActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.admission.__class__ = _OwnLoadsOnly


# -- a host hit counted when the admission is answered, not when its load-back lands ------------


class _HitsOnAnswer(Admissions):
    """Counts an admission's host hits (and their storage part) as served when it answers the
    admission: a load-back that then fails still counts as an L2 (or L3) hit, and the request
    admitted again to recompute the prefix counts a second one."""

    def _await_served(self, served: _Served) -> None:
        self.s.n.host_hit_tokens += served.host
        self.s.n.host_hit_storage_tokens += served.storage


class _HitsCountedOnAnswer(TreeActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.admission.__class__ = _HitsOnAnswer


class _StoragePartOfAnyHost(Admissions):
    """Counts an admission's host hit as its prefetch's up to the tokens the prefetch read, as
    if the prefetched pages began the host part of its path: host pages above them that a
    load-back quota loads alone count as L3 hits."""

    @staticmethod
    def _storage_part(host_hit: int, stored: int, host_miss: int) -> int:
        return min(host_hit, stored)


class _StorageHitOfHostPages(TreeActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.admission.__class__ = _StoragePartOfAnyHost


# -- write_back deletes a victim whose parent is not backed up ---------------------------------


class _DropTailWrites(WriteBack):
    """Writes a victim back only if its parent already is; otherwise deletes it: a tail under
    a hot prefix that is never evicted (so never backed up) is lost on every eviction."""

    def _back_up_ancestors(self, node: Node) -> bool:
        parent = node.parent
        if parent is None or parent.is_root or parent.state in BACKED:
            return True
        self._lost_tail(node, [])
        return False


class _DropTail(TreeActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.writes.__class__ = _DropTailWrites


# -- 7. SGLang #9302: the prefetcher frees host slots itself -----------------------------------


class _PrefetcherFrees(StoragePrefetcherActor):
    """Frees the slots past the storage hit itself, as SGLang's prefetch thread
    did, racing the tree's own accounting of them."""

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        reply = super().handle(sender, message)
        if isinstance(message, Prefetch) and reply is not None:
            surplus = message.host[reply.pages :]  # type: ignore[attr-defined]
            if len(surplus):
                self.send(ActorName.HOST, FreeHostSlots(pages=surplus))
        return reply


# -- 8. SGLang prefetch shrink-to-fit: a prefetch that gives up instead of shrinking -----------


class _GiveUpBook(PrefetchBook):
    def _reserve(self, want: int, free: int) -> int:
        return want if want <= free else 0


class _PrefetchGivesUp(TreeActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.prefetches.__class__ = _GiveUpBook


# -- 9. a prefetch anchored on a node eviction can delete ----------------------------------------


class _DeviceAnchorBook(PrefetchBook):
    """Anchors on the deepest matched node whatever its state (a device-only node can be evicted)."""

    def _anchor(self, namespace: str, path: list[Node]) -> tuple[Node, int]:
        if not path:
            return super()._anchor(namespace, path)
        return path[-1], sum(nd.tokens for nd in path)


class _EvictableAnchor(TreeActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.prefetches.__class__ = _DeviceAnchorBook


# -- 10. a storage page reported complete before its bytes are written ----------------------------


class _EarlyComplete(StoragePrefetcherActor):
    """Reads all but the last page of each step and still counts the whole step complete."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._backend = _ShortReads(self._backend)


class _ShortReads:
    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.name = getattr(inner, "name", "none")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def read(self, keys: Any, host: Any, slots: Any) -> Any:
        page = len(slots) // max(1, len(keys))
        io = self._inner.read(keys[:-1], host, slots[: len(slots) - page])
        return type(io)(pages=io.pages + 1 if io.pages == len(keys) - 1 else io.pages, written=io.written,
                        bytes=io.bytes, error=io.error)


# -- 11. an aborted request whose prefetch is never released -------------------------------------


class _LeakAbortedBook(PrefetchBook):
    def _settle(self, pf: _Prefetch, pages: int) -> int:
        if pf.reason is PrefetchEnd.ABORTED:
            return 0  # forgets the prefetch: its slots and the anchor's pin are never given back
        return super()._settle(pf, pages)


class _LeakAbortedPrefetch(TreeActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.prefetches.__class__ = _LeakAbortedBook


# -- 12. the slots the facade served from a request's last page never reach the device's ledger --


class _DropServedCore(DeviceCore):
    """Takes the slots the facade served from the free part of a request's last page (`allocs`)
    and forgets them: the ledger falls behind what the scheduler handed out, as a ledger kept
    beside a scheduler's own count does when one side's path skips the other."""

    def extend_only(self, demands: Any) -> None:
        return None


class _DropServedDevice(DeviceAllocatorActor):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.__class__ = _DropServedCore


# -- 13. the pages held ahead given back before the slots served from them are counted ---------


class _TrimFirstDevice(DeviceAllocatorActor):
    """Gives back a request's pages held ahead before it applies the slots the facade served
    from them (`allocs`): the ledger, behind the scheduler, frees pages an engine is writing."""

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        if isinstance(message, AllocateSlots) and message.trim:
            self.core.trim(message.trim)
            message = AllocateSlots(op_id=message.op_id, demands=message.demands, allocs=message.allocs,
                                    commits=message.commits, evict=message.evict, ahead=message.ahead)
        return super().handle(sender, message)


# -- a load the stream refused, unseen by the forward pass ---------------------------------------


class _RefusalUnseen(LoadStreamActor):
    """Refuses a load (its queue full) as before, but the batch the next start gives does not
    fail: the forward pass waits on it and reads the refused load's pages, which nothing filled."""

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        reply = super().handle(sender, message)
        if isinstance(message, LoadKV):
            self._refused = ""
        return reply


class _UnawaitedFailureLost(LoadStreamActor):
    """Treats every batch as one a forward pass waits on: the failure of a batch that `quiesce()`
    started after an admission answered a host hit reaches no waiter, and the forward pass
    waits on a later batch that succeeds."""

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        if isinstance(message, StartLoads):
            message = StartLoads()
        return super().handle(sender, message)


# -- an insert through a node whose load has not landed ----------------------------------------


class _ThroughLoads(RadixTree):
    UNLANDED = frozenset()


class _InsertThroughLoads(TreeActor):
    """A request caching a prefix that another request's load-back is bringing in takes the
    loading pages for its own KV (and frees its own), and hangs its further tokens under them."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.core.tree.__class__ = _ThroughLoads


MUTANTS: tuple[Mutant, ...] = (
    Mutant("write-acks-on-admission", "SGLang #20049: write-through acks handled only on the prefill path",
           "a pure decode loop never unlocks the nodes it wrote; protected tokens pile up until memory runs out",
           {ActorName.TREE: _AcksOnAdmission}),
    Mutant("free-by-inferred-length", "SGLang #12224: a request's slots freed by `len(input) + len(output) - 1`, "
           "not by its ledger", "pages allocated past the committed length (speculative lookahead) leak on finish",
           {ActorName.DEVICE: _InferredLengthDevice}),
    Mutant("evict-before-synced", "SGLang HiCacheController: a device copy dropped before its host copy is synced",
           "a node turns host-only while its host copy is still being written; a load-back reads a partial copy",
           {ActorName.TREE: _EvictWhileWriting}),
    Mutant("double-unlock-on-retract", "a lock ref decremented twice when a request is retracted",
           "a lock ref goes below zero; a node a live request reads becomes evictable",
           {ActorName.TREE: _DoubleUnlockOnRetract}),
    Mutant("short-write-marked-done", "a short device-to-host copy reported done",
           "the host copy lacks its last page; a later load-back feeds the model zeros",
           {ActorName.WRITE: _ShortWrites}),
    Mutant("backup-under-unbacked-parent", "a node backed up under a parent that is not backed up",
           "backup stops being prefix-closed; evicting the parent strands a host copy no lookup can reach",
           {ActorName.TREE: _UnclosedBackup}),
    Mutant("eviction-ends-short", "an eviction that ends after one round, without waiting for the writes it started",
           "an allocation or load-back gives up while evictable tokens remain", {ActorName.TREE: _OneRoundEviction}),
    Mutant("eviction-skips-loads", "an eviction that does not wait for the load-backs of requests that ended "
           "while they ran", "an allocation is refused though a load lands a moment later and leaves its nodes "
           "evictable", {ActorName.TREE: _SkipLoads}, "pressure"),
    Mutant("write-wait-needs-every-node", "an eviction waits for a write-through only when the write alone "
           "locks every node of it", "an allocation is refused though a write lands a moment later and leaves "
           "its lower node evictable (its upper node is a running request's prefix)",
           {ActorName.TREE: _EveryNodeWait}, "pressure"),
    Mutant("eviction-skips-doomed-writes", "an eviction does not wait for a write-through that fails when it "
           "lands (its ancestor's write failed)", "an allocation is refused though the write's nodes are unlocked "
           "and deletable a moment later", {ActorName.TREE: _SkipDoomed}, "faults"),
    Mutant("loading-prefix-as-device-hit", "an admission counts only its own batch's load-backs as host hits",
           "a prefix whose load was queued by a request that left before `start_loads` is a device hit: no load "
           "starts, and the model reads pages nothing was copied to", {ActorName.TREE: _LoadingAsDevice}),
    Mutant("refused-load-unseen", "a load-back the stream refuses (its queue full) after its admission answered a "
           "host hit, with no failure for the forward pass", "the forward pass reads pages no load filled",
           {ActorName.LOAD: _RefusalUnseen}, "orphans"),
    Mutant("unawaited-load-failure-lost", "the failure of a load-back batch that `quiesce()` started, which no "
           "forward pass waits on, fails no later batch", "the forward pass waits on a later batch that succeeds "
           "and reads pages no load filled", {ActorName.LOAD: _UnawaitedFailureLost}, "orphans"),
    Mutant("insert-through-loads", "a request's insert takes the pages of a node whose load-back has not landed for "
           "its own KV", "a running request reads pages nothing loaded; a failed load leaves device nodes under a "
           "host-only one", {ActorName.TREE: _InsertThroughLoads}, "orphans"),
    Mutant("waits-own-load-only", "an admission names only its own load-back as what its host hit waits for, "
           "not the earlier batch still loading the upper part of its prefix",
           "under an overlap scheduler the forward pass reads a prefix whose earlier load failed, through a waiter "
           "that landed", {ActorName.TREE: _WaitsOwnLoadsOnly}, "overlap"),
    Mutant("host-hit-counted-at-admission", "an admission's host hit (L2's, and its storage part L3's) counted "
           "when the tree answers the admission, not when its load-back lands",
           "a load-back that fails still counts as a hit, and the request admitted again counts a second one: "
           "L2's hit tokens exceed what was loaded", {ActorName.TREE: _HitsCountedOnAnswer}, "orphans"),
    Mutant("storage-hit-of-host-pages", "an admission's L3 hit is its host hit up to the tokens its prefetch "
           "read, wherever in the host part of its path those lie",
           "when the load-back quota loads only the host pages above the prefetched ones, L3 is credited with "
           "L2's tokens", {ActorName.TREE: _StorageHitOfHostPages}, "storage"),
    Mutant("write-back-drops-tail", "write_back deletes a victim whose parent is not backed up instead of writing "
           "the ancestors back with it", "a tail under a hot prefix is lost on every eviction instead of kept in host memory",
           {ActorName.TREE: _DropTail}),
    Mutant("served-slots-dropped", "SGLang #12224's class: the allocator's ledger misses slots the scheduler handed "
           "out (here: those the facade served from a request's last page)",
           "the ledger counts fewer slots than the request uses: its commits exceed its allocation, its release "
           "frees less than it held", {ActorName.DEVICE: _DropServedDevice}),
    Mutant("trim-before-served-slots", "a request's pages held ahead given back before the slots the scheduler "
           "took from them are counted", "a page an engine is writing goes back to the free list and to another "
           "request", {ActorName.DEVICE: _TrimFirstDevice}),
    Mutant("prefetcher-frees-slots", "SGLang #9302: the prefetcher frees the host slots past the storage hit itself",
           "two parties free the same host slots; the pool's accounting (and the ranks') diverges",
           {ActorName.PREFETCH: _PrefetcherFrees}, "storage"),
    Mutant("prefetch-gives-up", "SGLang prefetch shrink-to-fit: a prefetch gives up when the free host space cannot "
           "hold it whole", "storage hits are dropped while there is host space for a prefix above the threshold",
           {ActorName.TREE: _PrefetchGivesUp}, "storage"),
    Mutant("anchor-evictable", "a prefetch anchored on a device-only node that eviction can delete",
           "eviction deletes the node the prefetched pages are to hang under",
           {ActorName.TREE: _EvictableAnchor}, "storage"),
    Mutant("page-complete-before-bytes", "a storage page reported complete before its bytes are in host memory",
           "the model reads a page whose bytes never arrived", {ActorName.PREFETCH: _EarlyComplete}, "storage"),
    Mutant("aborted-prefetch-leaks", "an aborted request's prefetch is never released",
           "the prefetch's host slots and its anchor's pin are never given back",
           {ActorName.TREE: _LeakAbortedPrefetch}, "storage"),
)
"""Every mutant, in a stable order."""


def mutant(name: str) -> Mutant:
    for m in MUTANTS:
        if m.name == name:
            return m
    raise KeyError(f"no mutant named {name!r}; known: {', '.join(m.name for m in MUTANTS)}")
