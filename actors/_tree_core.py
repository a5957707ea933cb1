"""`TreeCore`: every decision of the cache, as a plain state machine that emits messages.

The tree actor is a thin shell: it calls one method of this core per message and
sends what the core put in `outbox` (pairs of receiver and message). The core
owns the radix tree, the lock handles given to requests, the in-flight
operation tables (write-throughs, load-backs, releases) and a mirror of the host
pool's free slots: the tree is the only party that reserves or frees host slots,
so it knows exactly how many are free and evicts before it reserves.

Flows (each a few messages; the facade gets one reply when all steps are done):

- admit: match, lock, plan load-back of host-only nodes within a quota ->
  `AllocateLoadSlots` -> nodes LOADING, `SetHostState(LOADING)`, `LoadKV` ->
  `Admitted`. If the device is short, evict and retry once, then give up the loads.
- write-through: a DEVICE node hit often enough under a backed-up parent ->
  WRITING, locked -> `AllocateHost` -> `SetHostState(WRITING)`, `WriteKV` ->
  on `WriteDone`, whenever it arrives: SYNCED, `SetHostState(SYNCED)`, unlocked.
- finish / abort / retract: insert the committed page-aligned prefix; the pages
  the tree takes are adopted, everything else of the request (duplicates, the
  unaligned tail, over-allocation) is freed by one `ReleaseRequests`.
- eviction: device leaves in policy order (backed-up ones become HOST_ONLY,
  others are deleted, or written first under write_back); host-only leaves.
- prefetch (storage -> host): reserve host slots (evict, else shrink to fit),
  pin the anchor -> `AllocateHost` -> `Prefetch` -> agreed hit: free the
  surplus, `ReadPrefetch` -> terminated by the facade (`StopPrefetch`) ->
  agreed pages settled in one place: host-only nodes, everything else freed.
- backup (host -> storage): after a write-through lands, `StorePages`, the node
  host-pinned until `PagesStored` applies.

Rank-local outcomes (write and load acks, storage hits, backups) are recorded in
`Facts` and applied in issue order once agreed: at once with one rank.

The file is long because these flows share the op tables and the host mirror;
each method is one event.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from collections import OrderedDict
from dataclasses import dataclass, field

from hicache.messages import (
    ActorName,
    AdmitItem,
    Admission,
    Admitted,
    AllocateHost,
    AllocateLoadSlots,
    AdoptLoadedSlots,
    CacheItem,
    Cached,
    CachedPrefix,
    Evicted,
    FinishItem,
    Finished,
    FreeDeviceSlots,
    FreeHostSlots,
    HostSlotState,
    Indices,
    LedgerEntry,
    LoadKV,
    LocalFacts,
    Message,
    Prefetch,
    PrefetchEnd,
    PrefetchEndCounts,
    PrefetchesSettled,
    PrefetchesStarted,
    PrefetchesStopped,
    ReadPrefetch,
    ReleaseRequests,
    SetHostState,
    SlotRelease,
    StopPrefetch,
    StorePages,
    SwapRequestPages,
    TreeDigest,
    Tokens,
    TreeStatistics,
    WriteKV,
)
from hicache.messages.config import Config, PrefetchPolicy, StorageKind, WritePolicy

from ._errors import InvariantError
from ._facts import Facts
from ._radix import BACKED, RESIDENT, Node, NodeState, RadixTree
from ._stored_page import page_keys

DEVICE, HOST, WRITE, LOAD, FACADE = ActorName.DEVICE, ActorName.HOST, ActorName.WRITE, ActorName.LOAD, ActorName.FACADE
PREFETCH = ActorName.PREFETCH

_THRESHOLD = {WritePolicy.WRITE_THROUGH: 1, WritePolicy.WRITE_THROUGH_SELECTIVE: 2}

SETTLED_HELD_MAX = 4096
"""Ready requests whose settled prefetch pages are held in host memory for them at once; past
it, the oldest hold is dropped (a scheduler that never admits a ready request must not pin
host memory for ever)."""


class HandleError(RuntimeError):
    """A lock handle that does not exist (any more) or belongs to another request."""


@dataclass(slots=True)
class _Handle:
    request_id: str
    namespace: str
    node: Node | None
    """The locked node (None: nothing matched, nothing locked)."""
    prefix_tokens: int
    """Positions below this hold the tree's slots, not the request's own."""


@dataclass(slots=True)
class _Write:
    nodes: list[Node]
    evict_after: bool
    tokens: int
    host_assigned: bool = False
    doomed: bool = False
    """An ancestor's write failed while this one was in flight: it fails when it lands, so
    that no backed-up node hangs under one that is not (the stream keeps write order, so the
    ancestor's outcome always comes first)."""


@dataclass(slots=True)
class _Load:
    nodes: list[Node]


@dataclass(slots=True)
class _Plan:
    item: AdmitItem
    handle: int
    device_nodes: list[Node]
    load_nodes: list[Node]
    host_miss: int


@dataclass(slots=True)
class _Admission:
    facade_op: int
    plans: list[_Plan]
    retried: bool = False


@dataclass(slots=True)
class _Swaps:
    facade_op: int
    prefixes: list[CachedPrefix]
    waiting: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Eviction:
    """A device eviction that goes on until `want` tokens are free or nothing evictable is
    left, waiting for writes in flight when they hold the rest: its own write-backs
    (write_back), and write-throughs whose nodes only the write keeps locked."""

    want: int
    freed: int = 0
    waiting: set[int] = field(default_factory=set)
    """Writes whose landing lets it go on."""
    reply_op: int = 0
    """The facade's EvictDevice to answer with Evicted, if any."""
    retry_load: int = 0
    """The admission whose AllocateLoadSlots to send again, if any."""


@dataclass(slots=True)
class _Prefetch:
    """A storage prefetch from its reservation until the tree settles it."""

    op: int
    request_id: str
    anchor: Node
    """A backed-up node (or a root), host-pinned until settled: `tokens` follow its end."""
    tokens: Tokens
    """From the anchor's end: the `held` tokens the cache had, then the prefetched pages."""
    held: int
    """Tokens after the anchor that were in device or host memory: not read from storage (the
    pages attach after them once they are backed up)."""
    hashes: tuple[int, ...]
    """The page hashes of `tokens` (the nodes they become keep them)."""
    keys: tuple[str, ...]
    """Storage keys of the prefetched pages only."""
    reserved: int
    """Host tokens reserved for it (counted in the host mirror)."""
    started: float
    timeout: float
    host: Indices | None = None
    """The reserved pages once the host pool granted them."""
    host_reply: bool = False
    """The host pool answered the reservation (with pages or refused)."""
    hit: int = -1
    """Agreed leading pages storage holds (-1: not agreed yet)."""
    read: int = 0
    """Pages the prefetcher was told to read (they are PREFETCHING)."""
    local_finished: bool = False
    stopping: bool = False
    stopped: int = -1
    """Pages complete on this rank when the prefetcher stopped (-1: not stopped yet)."""
    reason: PrefetchEnd = PrefetchEnd.BEST_EFFORT


@dataclass(slots=True)
class _Termination:
    facade_op: int
    ops: list[int]
    """The prefetch of each request, 0 for a request without one."""
    waiting: set[int]


@dataclass(slots=True)
class _Counters:
    looked_up_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    evicted_device_tokens: int = 0
    evicted_host_tokens: int = 0
    backups_done: int = 0
    backups_failed: int = 0
    prefetches_started: int = 0
    prefetch_skipped: int = 0
    prefetch_ends: dict[PrefetchEnd, int] = field(default_factory=lambda: dict.fromkeys(PrefetchEnd, 0))
    storage_hit_tokens: int = 0
    stored_tokens: int = 0


class TreeCore:
    def __init__(self, config: Config, next_id: Callable[[], int], now: Callable[[], float] = lambda: 0.0) -> None:
        self.config = config
        self.page_size = config.page_size
        self.tree = RadixTree(config.page_size, config.eviction_policy, index_tokens=config.page_size)
        self.tree.on_split = self._follow_split
        self._next_id = next_id
        self.outbox: list[tuple[ActorName, Message]] = []
        self.host_free = config.host_slots
        self._handles: dict[int, _Handle] = {}
        self._next_handle = 1
        self._writes: dict[int, _Write] = {}
        self._loads: dict[int, _Load] = {}
        self._admissions: dict[int, _Admission] = {}
        self._finishes: dict[int, int] = {}
        self._swaps: dict[int, _Swaps] = {}
        self._swap_of: dict[int, int] = {}
        self._evictions: dict[int, _Eviction] = {}
        self._eviction_of: dict[int, list[int]] = {}
        self._building: list[_Plan] = []
        """Plans of the admission being built: a later item's match may split their nodes."""
        self.n = _Counters()
        self._now = now
        self.facts = Facts()
        self._agree_locally = config.tp_size == 1
        self._storage = config.storage is not StorageKind.NONE
        self._prefetches: dict[int, _Prefetch] = {}
        self._prefetch_of: dict[str, int] = {}
        self._prefetch_tokens = 0
        self._terminations: dict[int, _Termination] = {}
        self._termination_of: dict[int, int] = {}
        self._stores: dict[int, Node] = {}
        self._settled: OrderedDict[str, Node] = OrderedDict()
        """Per ready request, the deepest node its settled prefetch reached, host-pinned until
        the request is admitted or leaves (`SETTLED_HELD_MAX` at most)."""
        self._last_reservation = (0, 0)
        """The last prefetch reservation: (reserved, what the shrink-to-fit rule prescribes)."""

    # == facade verbs ====================================================================

    def admit(self, op_id: int, items: Sequence[AdmitItem]) -> None:
        quota = self.config.load_back_quota_tokens
        plans: list[_Plan] = []
        self._building = plans
        try:
            self._plan_admission(items, plans, quota)
        finally:
            self._building = []
        total = sum(nd.tokens for p in plans for nd in p.load_nodes)
        if total == 0:
            self._reply_admitted(op_id, plans)
            return
        load_op = self._next_id()
        self._admissions[load_op] = _Admission(op_id, plans)
        self._emit(DEVICE, AllocateLoadSlots(op_id=load_op, tokens=total))

    def _plan_admission(self, items: Sequence[AdmitItem], plans: list[_Plan], quota: int) -> None:
        for item in items:
            self._release_settled(item.request_id)  # its lock holds what it uses from now on
            path = self.tree.match(item.namespace, item.tokens)
            planned = {nd.id for p in plans for nd in p.load_nodes}  # after this match's splits
            dev = [nd for nd in path if nd.state in RESIDENT or nd.id in planned]
            rest = path[len(dev):]
            host_tokens = sum(nd.tokens for nd in rest)
            load: list[Node] = []
            if host_tokens >= self.config.load_back_min_tokens:
                for nd in rest:
                    if nd.tokens > quota:
                        break
                    load.append(nd)
                    quota -= nd.tokens
                    planned.add(nd.id)
            top = (dev + load)[-1] if dev or load else None
            if top is not None:
                self.tree.lock(top, +1)
            loaded = sum(nd.tokens for nd in load)
            handle = self._new_handle(item.request_id, item.namespace, top, sum(nd.tokens for nd in dev) + loaded)
            plans.append(_Plan(item, handle, dev, load, host_tokens - loaded))

    def finish(self, op_id: int, items: Sequence[FinishItem]) -> None:
        releases = []
        for it, h in zip(items, self._take_handles(items), strict=True):
            adopted: list[Indices] = []
            path: list[Node] = []
            if not self._prefix_lost(h):  # else its KV was computed over a failed load: cache none of it
                path = self._insert(h, it.tokens, it.device, adopted, [])
            self._unlock_finished(h)
            for nd in path:
                self._consider_backup(nd)
            releases.append(SlotRelease(request_id=it.request_id, adopt=_cat(adopted), reason=it.reason))
        device_op = self._next_id()
        self._finishes[device_op] = op_id
        self._emit(DEVICE, ReleaseRequests(op_id=device_op, releases=tuple(releases)))

    def cache_unfinished(self, op_id: int, items: Sequence[CacheItem]) -> None:
        lost = tuple(it.request_id for it in items
                     if (h := self._handles.get(it.handle)) is not None and self._prefix_lost(h))
        if lost:  # their new nodes would hang under host-only ones: refuse the batch, change nothing
            self._emit(FACADE, Cached(op_id=op_id, prefixes=(), refused=lost))
            return
        swaps = _Swaps(op_id, [])
        for it, h in zip(items, self._take_handles(items, caching=True), strict=True):
            adopted: list[Indices] = []
            duplicates: list[Indices] = []
            path = self._insert(h, it.tokens, it.device, adopted, duplicates)
            top = path[-1] if path else h.node
            if top is not None:
                self.tree.lock(top, +1)
            if h.node is not None:
                self.tree.lock(h.node, -1)
            prefix = sum(nd.tokens for nd in path)
            handle = self._new_handle(it.request_id, h.namespace, top, prefix)
            device = _cat([nd.device for nd in path if nd.device is not None])
            swaps.prefixes.append(CachedPrefix(request_id=it.request_id, handle=handle, device=device))
            for nd in path:
                self._consider_backup(nd)
            swap_op = self._next_id()
            swaps.waiting.add(swap_op)
            self._swap_of[swap_op] = op_id
            self._emit(DEVICE, SwapRequestPages(op_id=swap_op, request_id=it.request_id,
                                                adopt=_cat(adopted), free=_cat(duplicates)))
        if swaps.waiting:
            self._swaps[op_id] = swaps
        else:
            self._emit(FACADE, Cached(op_id=op_id, prefixes=tuple(swaps.prefixes), refused=()))

    def evict_device(self, op_id: int, tokens: int) -> None:
        """Reply once `tokens` are free or nothing more can be: see `_Eviction`."""
        self._evict_until(_Eviction(tokens, reply_op=op_id))

    def _evict_until(self, ev: _Eviction) -> None:
        """Evict for `ev` now; wait for writes in flight if they hold what is still missing,
        else end it (answer the facade, or retry the admission's load slots)."""
        freed, writes = self._evict_device(ev.want - ev.freed - self._pending_frees(ev))
        ev.freed += freed
        ev.waiting.update(writes)
        if self._agree_locally and ev.freed + self._pending_frees(ev) < ev.want:
            ev.waiting.update(self._writes_holding_evictable())
        if not self._agree_locally or not ev.waiting:
            # With several ranks an ack applies only at an agreement (HiCache.sync), which the
            # caller cannot run while it waits for this reply: answer with what is free now; the
            # write-backs free their slots when their agreed acks are applied.
            self._end_eviction(ev)
            return
        key = self._next_id()
        self._evictions[key] = ev
        for w in ev.waiting:
            self._eviction_of.setdefault(w, []).append(key)

    def _pending_frees(self, ev: _Eviction) -> int:
        """Tokens the write-backs `ev` waits for free when they land."""
        return sum(self._writes[w].tokens for w in ev.waiting if w in self._writes and self._writes[w].evict_after)

    def _writes_holding_evictable(self) -> list[int]:
        """Write-throughs in flight whose nodes nothing but the write keeps locked: once they
        land, those nodes are evictable (synced, so they move to host memory)."""
        return [op for op, w in self._writes.items()
                if not w.evict_after and not w.doomed and all(nd.lock_ref == 1 for nd in w.nodes)]

    def _end_eviction(self, ev: _Eviction) -> None:
        left = self.tree.evictable_tokens
        if ev.freed < ev.want and left and self._agree_locally and not self._loads:
            raise InvariantError(
                f"tree: an eviction of {ev.want} tokens ended with {ev.freed} freed while {left} are evictable "
                "(eviction goes on until the demand is met or nothing evictable remains)"
            )
        if ev.reply_op:
            self._emit(FACADE, Evicted(op_id=ev.reply_op, device_tokens=ev.freed, host_tokens=0))
        if ev.retry_load:
            self._retry_load_slots(ev.retry_load)

    def _retry_load_slots(self, load_op: int) -> None:
        adm = self._admissions[load_op]
        total = sum(nd.tokens for p in adm.plans for nd in p.load_nodes)
        self._emit(DEVICE, AllocateLoadSlots(op_id=load_op, tokens=total))

    def evict_host(self, op_id: int, tokens: int) -> None:
        freed = self._evict_host(tokens)
        self._emit(FACADE, Evicted(op_id=op_id, device_tokens=0, host_tokens=freed))

    # == replies from the other actors ====================================================

    def on_load_slots(self, load_op: int, pages: Indices | None, shortfall: int) -> None:
        adm = self._admissions.pop(load_op)
        if pages is None:
            if not adm.retried:
                adm.retried = True
                self._admissions[load_op] = adm
                self._evict_until(_Eviction(shortfall, retry_load=load_op))
                return
            self._give_up_loads(adm)
            self._reply_admitted(adm.facade_op, adm.plans)
            return
        nodes = [nd for p in adm.plans for nd in p.load_nodes]
        at = 0
        for nd in nodes:
            k = nd.tokens // self.page_size
            self.tree.start_load(nd, pages[at : at + k])
            nd.op = load_op
            at += k
        host = _cat([nd.host for nd in nodes if nd.host is not None])
        device = _cat([nd.device for nd in nodes if nd.device is not None])
        self._loads[load_op] = _Load(nodes)
        self.facts.expect("load", load_op)
        self._emit(HOST, SetHostState(pages=host, state=HostSlotState.LOADING))
        self._emit(LOAD, LoadKV(op_id=load_op, host=host, device=device))
        self._reply_admitted(adm.facade_op, adm.plans)

    # == rank-local outcomes: recorded here, applied once agreed (see `Facts`) ==================

    def on_write_done(self, op: int) -> None:
        self._fact("write", op, 1)

    def on_write_failed(self, op: int) -> None:
        self._fact("write", op, 0)

    def on_load_done(self, op: int) -> None:
        self._fact("load", op, 1)

    def on_load_failed(self, op: int) -> None:
        self._fact("load", op, 0)

    def on_prefetch_hit(self, op: int, pages: int) -> None:
        self._fact("hit", op, pages)

    def on_pages_stored(self, op: int, pages: int, written: int) -> None:
        self.n.stored_tokens += written * self.page_size
        self._fact("backup", op, pages)

    def report_facts(self, op_id: int) -> None:
        known = self.facts.known()
        self._emit(FACADE, LocalFacts(op_id=op_id, known=known, values=self.facts.values(known)))

    def apply_facts(self, counts: tuple[int, ...], values: tuple[int, ...]) -> None:
        for kind, op, value in self.facts.take(counts, values):
            self._apply(kind, op, value)

    def _fact(self, kind: str, op: int, value: int) -> None:
        self.facts.record(kind, op, value)
        if self._agree_locally:  # one rank: its outcomes are the agreed ones, applied at once
            for kind_, op_, value_ in self.facts.take_local(kind):
                self._apply(kind_, op_, value_)

    def _apply(self, kind: str, op: int, value: int) -> None:
        if kind == "write":
            self._write_done(op) if value else self._write_failed(op)
        elif kind == "load":
            self._load_done(op) if value else self._load_failed(op)
        elif kind == "hit":
            self._prefetch_hit(op, value)
        else:
            self._stored(op, value)

    def _load_done(self, op: int) -> None:
        load = self._loads.pop(op)
        for nd in load.nodes:
            nd.op = 0
            self.tree.set_state(nd, NodeState.SYNCED)
        self._emit(HOST, SetHostState(pages=_cat([nd.host for nd in load.nodes if nd.host is not None]),
                                      state=HostSlotState.SYNCED))
        self._emit(DEVICE, AdoptLoadedSlots(pages=_cat([nd.device for nd in load.nodes if nd.device is not None])))

    def _load_failed(self, op: int) -> None:
        load = self._loads.pop(op)
        device = _cat([nd.device for nd in load.nodes if nd.device is not None])
        for nd in load.nodes:
            nd.op = 0
            self.tree.fail_load(nd)
        self._emit(HOST, SetHostState(pages=_cat([nd.host for nd in load.nodes if nd.host is not None]),
                                      state=HostSlotState.HOST_ONLY))
        self._emit(DEVICE, FreeDeviceSlots(pages=device))

    def on_host_allocated(self, op: int, pages: Indices | None) -> None:
        if op in self._prefetches:
            self._prefetch_host(self._prefetches[op], pages)
            return
        w = self._writes[op]
        if pages is None:  # the mirror says this cannot happen (an injected fault): the write fails
            self._fact("write", op, 0)
            return
        at = 0
        for nd in w.nodes:
            k = nd.tokens // self.page_size
            self.tree.set_host(nd, pages[at : at + k])
            at += k
        w.host_assigned = True
        host = _cat([nd.host for nd in w.nodes if nd.host is not None])
        device = _cat([nd.device for nd in w.nodes if nd.device is not None])
        self._emit(HOST, SetHostState(pages=host, state=HostSlotState.WRITING))
        self._emit(WRITE, WriteKV(op_id=op, device=device, host=host))

    def _write_done(self, op: int) -> None:
        if self._writes[op].doomed:
            self._write_failed(op)
            return
        w = self._writes.pop(op)
        self._emit(HOST, SetHostState(pages=_cat([nd.host for nd in w.nodes if nd.host is not None]),
                                      state=HostSlotState.SYNCED))
        for nd in w.nodes:
            nd.op = 0
            self.tree.set_state(nd, NodeState.SYNCED)
        self.tree.lock(w.nodes[-1], -1)  # one lock per write, on its deepest node (splits add uppers)
        self.n.backups_done += 1
        freed = [nd for nd in w.nodes if self.tree.device_evictable(nd)] if w.evict_after else []
        self._emit_device_frees([self._drop_device(nd) for nd in freed])
        self._write_landed(op, freed)
        for nd in w.nodes:
            self._consider_store(nd)
        for nd in w.nodes:
            for child in sorted(nd.children.values(), key=lambda c: c.id):
                self._consider_backup(child)

    def _write_failed(self, op: int) -> None:
        w = self._writes[op]
        self._doom_descendants(w)
        if w.host_assigned:  # its bytes are not valid (on this rank or another)
            host = _cat([nd.host for nd in w.nodes if nd.host is not None])
            self._emit(HOST, SetHostState(pages=host, state=HostSlotState.RESERVED))
            self._emit(HOST, FreeHostSlots(pages=host))
            for nd in w.nodes:
                self.tree.set_host(nd, None)
        self.host_free += w.tokens
        self._abandon_write(op, w)

    def on_released(self, device_op: int, entries: tuple[LedgerEntry, ...]) -> None:
        self._emit(FACADE, Finished(op_id=self._finishes.pop(device_op), entries=entries))

    def on_swapped(self, swap_op: int) -> None:
        facade_op = self._swap_of.pop(swap_op)
        swaps = self._swaps[facade_op]
        swaps.waiting.discard(swap_op)
        if not swaps.waiting:
            del self._swaps[facade_op]
            self._emit(FACADE, Cached(op_id=facade_op, prefixes=tuple(swaps.prefixes), refused=()))

    # == storage: prefetch (L3 -> host) and backup (host -> L3) ================================

    def prefetch(self, op_id: int, items: Sequence[AdmitItem]) -> None:
        """Start a prefetch for each request whose part missing from L1/L2 is long enough."""
        for it in items:
            if it.request_id in self._prefetch_of:
                raise HandleError(f"request {it.request_id!r} already has a prefetch in flight")
        started = tuple(self._start_prefetch(it) for it in items)
        self._emit(FACADE, PrefetchesStarted(op_id=op_id, tokens=started))

    def _start_prefetch(self, item: AdmitItem) -> int:
        if not self._storage:
            return 0
        p, cfg = self.page_size, self.config
        tokens = item.tokens
        n = len(tokens) - len(tokens) % p
        path = self.tree.match(item.namespace, tokens)
        matched = sum(nd.tokens for nd in path)
        threshold = cfg.prefetch_threshold_pages * p
        if n - matched < threshold:
            return 0
        anchor, start = self._anchor(item.namespace, path)
        # Only what L1 and L2 miss is read; the rate limit, like the host space below, shrinks it
        # to what it leaves while that is worth it.
        want = self._reserve(n - matched, self._rate_room())
        if not want:
            self.n.prefetch_skipped += 1
            return 0
        self.tree.pin_host(anchor, +1)  # before evicting host memory: the anchor must stay
        if self.host_free < want:
            self._evict_host(want - self.host_free)
        free = self.host_free
        got = self._reserve(want, free)
        fit = free - free % p  # the rule, restated for check_invariants: all, else shrink if worth it
        self._last_reservation = (got, want if want <= free else fit if fit >= threshold else 0)
        want = got
        if not want:
            self.tree.pin_host(anchor, -1)
            self.n.prefetch_skipped += 1
            return 0
        self._back_up_held(path, anchor)
        op, held = self._next_id(), matched - start
        toks = tokens[start : matched + want]
        hashes = self.tree.chain(anchor, toks)
        keys = tuple(page_keys(hashes[held // p :], cfg.tp_rank))
        pf = _Prefetch(op, item.request_id, anchor, toks, held, hashes, keys,
                       want, self._now(), self._timeout(want))
        self._prefetches[op] = pf
        self._prefetch_of[item.request_id] = op
        self.host_free -= want
        self._prefetch_tokens += want
        self.n.prefetches_started += 1
        self.facts.expect("hit", op)
        self._emit(HOST, AllocateHost(op_id=op, tokens=want))
        return want

    def _back_up_held(self, path: list[Node], anchor: Node) -> None:
        """Start the backups of the matched nodes after the anchor that are in device memory
        only: the prefetched pages attach after them once they are backed up (a host-only node
        never hangs under one that is not)."""
        if not self.config.host_tier:
            return
        after = anchor.is_root
        for nd in path:
            if after and nd.state is NodeState.DEVICE and not nd.op and not self._start_backup(nd, evict_after=False):
                return
            after = after or nd is anchor

    def _hold_settled(self, request_id: str, node: Node) -> None:
        """Keep what a settled prefetch brought (and the path to it) in host memory until its
        request is admitted or leaves: host eviction must not undo the read before it is used."""
        self._release_settled(request_id)
        self.tree.pin_host(node, +1)
        self._settled[request_id] = node
        while len(self._settled) > SETTLED_HELD_MAX:  # a request never admitted must not pin forever
            self.tree.pin_host(self._settled.popitem(last=False)[1], -1)

    def _release_settled(self, request_id: str) -> None:
        node = self._settled.pop(request_id, None)
        if node is not None:
            self.tree.pin_host(node, -1)

    def _anchor(self, namespace: str, path: list[Node]) -> tuple[Node, int]:
        """The deepest backed-up node of the match (eviction can never delete it), or the root;
        and the tokens up to its end, where the prefetched pages start."""
        anchor, start, pos = self.tree.root(namespace), 0, 0
        for nd in path:
            pos += nd.tokens
            if nd.state in BACKED:
                anchor, start = nd, pos
        return anchor, start

    def _rate_room(self) -> int:
        """Tokens more that may be prefetching under `prefetch_rate_fraction` of the host slots."""
        cfg = self.config
        return int(cfg.prefetch_rate_fraction * cfg.host_slots) - self._prefetch_tokens

    def _reserve(self, want: int, room: int) -> int:
        """Tokens to reserve for a prefetch of `want` within `room` (free host space, or what the
        rate limit leaves; 0: none): all of it if it fits, else the page-aligned room if that
        still meets the threshold (SGLang's prefetch shrink-to-fit: shrink rather than give up)."""
        if want <= room:
            return want
        fit = room - room % self.page_size
        return fit if fit >= self.config.prefetch_threshold_pages * self.page_size else 0

    def _timeout(self, tokens: int) -> float:
        cfg = self.config
        return min(cfg.prefetch_timeout_base_s + cfg.prefetch_timeout_per_1k_s * tokens / 1000, cfg.prefetch_timeout_max_s)

    def _prefetch_host(self, pf: _Prefetch, pages: Indices | None) -> None:
        pf.host_reply = True
        if pages is None:  # refused (an injected fault): it never reaches storage
            self._fact("hit", pf.op, 0)
            if pf.stopping:
                self.on_prefetch_stopped(pf.op, 0)
            return
        pf.host = pages
        self._emit(PREFETCH, Prefetch(op_id=pf.op, keys=pf.keys, host=pages))
        if pf.stopping:
            self._emit(PREFETCH, StopPrefetch(op_id=pf.op))

    def _prefetch_hit(self, op: int, pages: int) -> None:
        """The agreed hit: free the surplus pages now, read the rest (unless stopping already)."""
        pf = self._prefetches.get(op)
        if pf is None:  # settled already: everything it held was freed then
            return
        pf.hit = min(pages, len(pf.keys))
        keep = pf.hit * self.page_size
        surplus = pf.reserved - keep
        if surplus:
            if pf.host is not None:
                self._emit(HOST, FreeHostSlots(pages=pf.host[pf.hit :]))
                pf.host = pf.host[: pf.hit]
            pf.reserved = keep
            self.host_free += surplus
            self._prefetch_tokens -= surplus
        if pf.hit and not pf.stopping and pf.host is not None:
            pf.read = pf.hit
            self._emit(HOST, SetHostState(pages=pf.host, state=HostSlotState.PREFETCHING))
            self._emit(PREFETCH, ReadPrefetch(op_id=op, pages=pf.hit))

    def on_prefetch_progress(self, op: int, pages: int, finished: bool) -> None:
        pf = self._prefetches.get(op)
        if pf is not None:
            pf.local_finished = finished

    def prefetch_states(self, request_ids: Sequence[str]) -> tuple[bool, ...]:
        """Per request: may its prefetch terminate now by this rank's view (no prefetch: yes)?"""
        out = []
        for rid in request_ids:
            op = self._prefetch_of.get(rid)
            out.append(True if op is None else self._may_terminate(self._prefetches[op]))
        return tuple(out)

    def _may_terminate(self, pf: _Prefetch) -> bool:
        policy = self.config.prefetch_policy
        complete = pf.hit == 0 or (pf.hit > 0 and pf.read > 0 and pf.local_finished)
        if policy is PrefetchPolicy.BEST_EFFORT or complete:
            return True
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            return False
        return self._now() - pf.started >= pf.timeout

    def terminate_prefetches(self, op_id: int, request_ids: Sequence[str], reason: PrefetchEnd) -> None:
        """Stop the prefetches; reply with each one's local final count once all stopped."""
        t = _Termination(op_id, [], set())
        for rid in request_ids:
            op = self._prefetch_of.get(rid, 0)
            t.ops.append(op)
            if not op:
                self._release_settled(rid)  # a ready request that leaves before admission
                continue
            pf = self._prefetches[op]
            if pf.stopping:
                raise HandleError(f"the prefetch of request {rid!r} is already being terminated")
            pf.stopping, pf.reason = True, reason
            t.waiting.add(op)
            self._termination_of[op] = op_id
        self._terminations[op_id] = t
        for op in sorted(t.waiting):
            pf = self._prefetches[op]
            if pf.host_reply and pf.host is None:  # never reached the prefetcher
                pf.stopped = 0
                t.waiting.discard(op)
                del self._termination_of[op]
            elif pf.host_reply:
                self._emit(PREFETCH, StopPrefetch(op_id=op))
            # else: the Stop follows the Prefetch once the host pool answers
        if not t.waiting:
            self._stopped_all(t)

    def on_prefetch_stopped(self, op: int, pages: int) -> None:
        pf = self._prefetches[op]
        pf.stopped = min(pages, pf.read)
        t = self._terminations[self._termination_of.pop(op)]
        t.waiting.discard(op)
        if not t.waiting:
            self._stopped_all(t)

    def _stopped_all(self, t: _Termination) -> None:
        del self._terminations[t.facade_op]
        pages = tuple(self._prefetches[op].stopped if op else 0 for op in t.ops)
        self._emit(FACADE, PrefetchesStopped(op_id=t.facade_op, pages=pages))

    def settle_prefetches(self, op_id: int, request_ids: Sequence[str], pages: Sequence[int]) -> None:
        """The one place a prefetch's pages are kept or freed, after the ranks agreed on `pages`."""
        out = []
        for rid, agreed in zip(request_ids, pages, strict=True):
            op = self._prefetch_of.get(rid)
            if op is None:
                out.append(0)
                continue
            pf = self._prefetches[op]
            if pf.stopped < 0:
                raise InvariantError(f"prefetch {op} of {rid!r} settled before its prefetcher stopped (SGLang #9302: a prefetch's pages are settled once, after the prefetcher stopped)")
            del self._prefetch_of[rid], self._prefetches[op]
            out.append(self._settle(pf, min(agreed, pf.read)))
        self._emit(FACADE, PrefetchesSettled(op_id=op_id, tokens=tuple(out)))

    def _settle(self, pf: _Prefetch, pages: int) -> int:
        p = self.page_size
        keep = pages * p
        unused: list[Indices] = []
        kept = 0
        if pf.host is not None:
            if keep:
                held = pf.held
                res = self.tree.insert_host(pf.anchor, pf.tokens[: held + keep], pf.host[:pages],
                                            pf.hashes[: (held + keep) // p], held=held)
                for nd in res.new:
                    kept += nd.tokens
                new = _cat([nd.host for nd in res.new])
                if len(new):
                    self._emit(HOST, SetHostState(pages=new, state=HostSlotState.HOST_ONLY))
                unused.extend(res.unused)
                if res.last is not None and kept and pf.reason not in (PrefetchEnd.ABORTED, PrefetchEnd.RETRACTED):
                    self._hold_settled(pf.request_id, res.last)  # for the admission that follows
            read = pf.host[pages : pf.read]  # read (or being read) and not kept
            if len(read):
                unused.append(read)
            prefetching = _cat(unused)
            if len(prefetching):
                self._emit(HOST, SetHostState(pages=prefetching, state=HostSlotState.RESERVED))
            free = _cat([prefetching, pf.host[pf.read :]])
            if len(free):
                self._emit(HOST, FreeHostSlots(pages=free))
        self.host_free += pf.reserved - kept
        self._prefetch_tokens -= pf.reserved
        self.tree.pin_host(pf.anchor, -1)
        if pf.reason in (PrefetchEnd.ABORTED, PrefetchEnd.RETRACTED):
            end = pf.reason
        elif pf.hit == 0:
            end = PrefetchEnd.MISS
        elif pf.hit > 0 and pages == pf.hit:
            end = PrefetchEnd.COMPLETE
        elif self.config.prefetch_policy is PrefetchPolicy.TIMEOUT:
            end = PrefetchEnd.TIMEOUT
        elif self.config.prefetch_policy is PrefetchPolicy.WAIT_COMPLETE:
            end = PrefetchEnd.FAILED
        else:
            end = PrefetchEnd.BEST_EFFORT
        self.n.prefetch_ends[end] += 1
        self.n.storage_hit_tokens += keep
        return keep

    def _consider_store(self, node: Node) -> None:
        """Back a node's freshly synced host copy up to storage, pinned until it lands."""
        if not self._storage or node.stored or not node.alive or node.host is None:
            return
        op = self._next_id()
        self.tree.pin_host(node, +1)
        self._stores[op] = node
        self.facts.expect("backup", op)
        self._emit(PREFETCH, StorePages(op_id=op, keys=tuple(page_keys(node.hashes, self.config.tp_rank)),
                                        host=node.host))

    def _stored(self, op: int, pages: int) -> None:
        node = self._stores.pop(op)
        self.tree.pin_host(node, -1)
        if pages >= len(node.hashes):
            node.stored = True

    # == policies ===========================================================================

    def _consider_backup(self, node: Node) -> None:
        threshold = _THRESHOLD.get(self.config.write_policy)
        if threshold is None or not self.config.host_tier or not node.alive:
            return
        if (node.state is NodeState.DEVICE and node.op == 0 and node.hit_count >= threshold
                and self._parent_backed(node)):
            self._start_backup(node, evict_after=False)

    def _start_backup(self, node: Node, *, evict_after: bool) -> bool:
        need = node.tokens
        if self.host_free < need:
            self._evict_host(need - self.host_free)
        if self.host_free < need:
            self.n.backups_failed += 1
            return False
        op = self._next_id()
        self.tree.set_state(node, NodeState.WRITING)
        self.tree.lock(node, +1)
        node.op = op
        self._writes[op] = _Write([node], evict_after, need)
        self.facts.expect("write", op)
        self.host_free -= need
        self._emit(HOST, AllocateHost(op_id=op, tokens=need))
        return True

    def _abandon_write(self, op: int, w: _Write) -> None:
        self.n.backups_failed += 1
        self._writes.pop(op, None)
        for nd in w.nodes:
            nd.op = 0
            self.tree.set_state(nd, NodeState.DEVICE)
        self.tree.lock(w.nodes[-1], -1)
        dropped = [nd for nd in w.nodes if self.tree.device_evictable(nd)] if w.evict_after else []
        self._emit_device_frees([self._drop_device(nd) for nd in dropped])
        self._write_landed(op, dropped)

    def _doom_descendants(self, failed: _Write) -> None:
        """Writes in flight below a failed one fail too when they land (see `_Write.doomed`)."""
        mine = {id(nd) for nd in failed.nodes}
        for w in self._writes.values():
            if w is not failed and not w.doomed and any(id(a) in mine for a in w.nodes[0].path()):
                w.doomed = True

    def _evict_device(self, tokens: int) -> tuple[int, list[int]]:
        """Free device slots now (returns how many) and start write-backs whose slots go when
        their writes land (returns their op ids)."""
        frees: list[Indices] = []
        freed = pending = 0
        writes: list[int] = []
        while freed + pending < tokens:  # a write-back counts: its slots go when its write lands
            node = self.tree.pop_device_victim()
            if node is None:
                break
            if (node.state is NodeState.DEVICE and self.config.write_policy is WritePolicy.WRITE_BACK
                    and self.config.host_tier and self._back_up_ancestors(node)
                    and self._start_backup(node, evict_after=True)):
                pending += node.tokens
                writes.append(node.op)
                continue
            frees.append(self._drop_device(node))
            freed += node.tokens
        self._emit_device_frees(frees)
        return freed, writes

    def _write_landed(self, op: int, dropped: list[Node]) -> None:
        """A write an eviction waits for landed or failed (a write-back's `dropped` slots are
        free now): once it waits for nothing more, the eviction goes on."""
        for key in self._eviction_of.pop(op, ()):
            ev = self._evictions[key]
            ev.freed += sum(nd.tokens for nd in dropped)
            ev.waiting.discard(op)
            if not ev.waiting:
                del self._evictions[key]
                self._evict_until(ev)

    def _drop_device(self, node: Node) -> Indices:
        """Free a device-evictable node's device copy: to HOST_ONLY if backed up, else delete it."""
        device = node.device
        assert device is not None
        if node.state is NodeState.SYNCED:
            self._emit(HOST, SetHostState(pages=node.host, state=HostSlotState.HOST_ONLY))  # type: ignore[arg-type]
            self.tree.evict_to_host(node)
        else:
            self.tree.remove(node)
        self.n.evicted_device_tokens += node.tokens
        return device

    def _evict_host(self, tokens: int) -> int:
        frees: list[Indices] = []
        freed = 0
        while freed < tokens:
            node = self.tree.pop_host_victim()
            if node is None:
                break
            assert node.host is not None
            frees.append(node.host)
            freed += node.tokens
            self.tree.remove(node)
        if frees:
            self._emit(HOST, FreeHostSlots(pages=_cat(frees)))
            self.host_free += freed
            self.n.evicted_host_tokens += freed
        return freed

    def _give_up_loads(self, adm: _Admission) -> None:
        for p in adm.plans:
            # Nodes another plan of the batch was to load sit in device_nodes, still host-only.
            keep = [nd for nd in p.device_nodes if nd.state in RESIDENT]
            dropped = p.device_nodes[len(keep):] + p.load_nodes
            if not dropped:
                continue
            top = keep[-1] if keep else None
            if top is not None:
                self.tree.lock(top, +1)
            self.tree.lock(dropped[-1], -1)
            h = self._handles[p.handle]
            h.node = top
            h.prefix_tokens = sum(nd.tokens for nd in keep)
            p.host_miss += sum(nd.tokens for nd in dropped)
            p.device_nodes, p.load_nodes = keep, []

    # == helpers ==============================================================================

    def _insert(
        self, h: _Handle, tokens: Tokens, device: Indices,
        adopted: list[Indices], duplicates: list[Indices],
    ) -> list[Node]:
        self._check_item(h.request_id, h, tokens, device)
        p = self.page_size
        n = len(tokens) - len(tokens) % p
        out = self.tree.insert(h.namespace, tokens[:n], device[: n // p], own_from=h.prefix_tokens)
        if out.revived:
            revived = _cat([nd.host for nd in out.revived])
            self._emit(HOST, SetHostState(pages=revived, state=HostSlotState.SYNCED))
        adopted.extend(out.adopted)
        duplicates.extend(out.duplicates)
        return out.path

    def _reply_admitted(self, op_id: int, plans: list[_Plan]) -> None:
        admissions = []
        loading = {nd.id for p in plans for nd in p.load_nodes}  # loaded by this batch, for any of its plans
        for p in plans:
            nodes = p.device_nodes + p.load_nodes
            dev_hit = sum(nd.tokens for nd in nodes if nd.id not in loading)
            host_hit = sum(nd.tokens for nd in nodes if nd.id in loading)
            self.n.looked_up_tokens += len(p.item.tokens)
            self.n.device_hit_tokens += dev_hit
            self.n.host_hit_tokens += host_hit
            admissions.append(Admission(
                request_id=p.item.request_id, handle=p.handle,
                device=_cat([nd.device for nd in nodes if nd.device is not None]),
                device_hit=dev_hit, host_hit=host_hit, host_miss=p.host_miss,
            ))
        self._emit(FACADE, Admitted(op_id=op_id, admissions=tuple(admissions)))

    def _new_handle(self, request_id: str, namespace: str, node: Node | None, prefix: int) -> int:
        handle = self._next_handle
        self._next_handle += 1
        self._handles[handle] = _Handle(request_id, namespace, node, prefix)
        return handle

    def _take_handles(
        self, items: Sequence[FinishItem] | Sequence[CacheItem], *, caching: bool = False
    ) -> list[_Handle]:
        """Every item's handle, all checked before any is taken: one bad item refuses the
        whole batch and changes nothing."""
        seen: set[int] = set()
        for it in items:
            h = self._handles.get(it.handle)
            if h is None:
                raise HandleError(f"lock handle {it.handle} of request {it.request_id!r} is unknown or already released")
            if h.request_id != it.request_id:
                raise HandleError(f"lock handle {it.handle} belongs to request {h.request_id!r}, not {it.request_id!r}")
            if it.handle in seen:
                raise HandleError(f"lock handle {it.handle} of request {it.request_id!r} appears twice in one batch")
            self._check_item(it.request_id, h, it.tokens, it.device)
            seen.add(it.handle)
        return [self._handles.pop(it.handle) for it in items]

    def _check_item(self, rid: str, h: _Handle, tokens: Tokens, device: Indices) -> None:
        """A request's committed tokens come with the pages that hold them, and cover at
        least the prefix it was admitted with."""
        p = self.page_size
        if -(-len(tokens) // p) != len(device):
            raise ValueError(f"request {rid!r}: {len(tokens)} tokens need {-(-len(tokens) // p)} pages of {p}, "
                             f"got {len(device)}")
        n = len(tokens) - len(tokens) % p
        if n < h.prefix_tokens:
            raise ValueError(f"request {rid!r}: {n} committed page-aligned tokens, fewer than the "
                             f"{h.prefix_tokens} it was admitted with")

    def _unlock_finished(self, h: _Handle) -> None:
        """The one lock release of a request that leaves, whatever the reason."""
        if h.node is not None:
            self.tree.lock(h.node, -1)

    @staticmethod
    def _prefix_lost(h: _Handle) -> bool:
        """The request's cached prefix has no device copy any more (its load-back failed)."""
        return h.node is not None and any(nd.state not in RESIDENT for nd in h.node.path())

    def _parent_backed(self, node: Node) -> bool:
        """The parent is backed up, or its write is in flight: the write stream keeps order,
        so a child's write lands after its parent's (and fails if the parent's failed)."""
        parent = node.parent
        return parent is None or parent.is_root or parent.state in BACKED or parent.state is NodeState.WRITING

    def _back_up_ancestors(self, node: Node) -> bool:
        """Under write_back, before a victim is written back: start the writes of its ancestors
        that are on device only (they stay on device, synced once written), top down, so that
        backup stays prefix-closed and a tail under a hot prefix that is never evicted is not
        lost. False if host memory cannot take one of them (the victim is then deleted)."""
        chain = []
        for up in node.parent.path() if node.parent is not None else ():
            if up.state in BACKED or up.state is NodeState.WRITING:
                break
            chain.append(up)
        for up in reversed(chain):
            if up.op or not self._start_backup(up, evict_after=False):
                self._lost_tail(node, chain)
                return False
        return True

    def _lost_tail(self, node: Node, chain: list[Node]) -> None:
        """A write_back victim is about to be deleted: only for want of host memory."""
        need = node.tokens + sum(up.tokens for up in chain if up.state is NodeState.DEVICE and not up.op)
        if self.host_free >= need and self._agree_locally:
            raise InvariantError(
                f"tree: write_back would delete {node} (and lose its tail) with {self.host_free} host tokens "
                f"free for the {need} its write-back and its ancestors' need"
            )

    def _emit_device_frees(self, frees: list[Indices]) -> None:
        if frees:
            self._emit(DEVICE, FreeDeviceSlots(pages=_cat(frees)))

    def _emit(self, to: ActorName, message: Message) -> None:
        self.outbox.append((to, message))

    def _follow_split(self, upper: Node, lower: Node) -> None:
        """An op's or a plan's node list gets the new upper part, just before the lower one.

        Plans follow whether or not an op runs yet: a node planned for load-back has none
        until its device slots arrive."""
        plans = [p for adm in self._admissions.values() for p in adm.plans] + self._building
        for p in plans:
            for nodes in (p.device_nodes, p.load_nodes):
                if lower in nodes:
                    nodes.insert(nodes.index(lower), upper)
        if not lower.op:
            return
        op = self._writes.get(lower.op) or self._loads.get(lower.op)
        if op is not None:
            op.nodes.insert(op.nodes.index(lower), upper)

    # == numbers and checks =====================================================================

    def statistics(self) -> TreeStatistics:
        t = self.tree
        return TreeStatistics(
            nodes=t.nodes, device_tokens=t.device_tokens, host_tokens=t.host_tokens,
            protected_tokens=t.protected_tokens, evictable_tokens=t.evictable_tokens,
            live_handles=len(self._handles), writes_in_flight=len(self._writes), loads_in_flight=len(self._loads),
            looked_up_tokens=self.n.looked_up_tokens,
            device_hit_tokens=self.n.device_hit_tokens, host_hit_tokens=self.n.host_hit_tokens,
            evicted_device_tokens=self.n.evicted_device_tokens, evicted_host_tokens=self.n.evicted_host_tokens,
            backups_done=self.n.backups_done, backups_failed=self.n.backups_failed,
            prefetches_started=self.n.prefetches_started, prefetches_in_flight=len(self._prefetches),
            prefetch_skipped=self.n.prefetch_skipped,
            prefetch_ends=PrefetchEndCounts(**{e.value: n for e, n in self.n.prefetch_ends.items()}),
            storage_hit_tokens=self.n.storage_hit_tokens, stored_tokens=self.n.stored_tokens,
            backups_in_flight=len(self._stores),
            facts_pending=self.facts.pending(), facts_unknown=self.facts.pending() - sum(self.facts.known()),
        )

    def idle(self) -> bool:
        """No handle held and nothing in flight."""
        return not (self._handles or self._writes or self._loads or self._admissions
                    or self._finishes or self._swaps or self._evictions or self._prefetches
                    or self._stores or self._terminations or self._settled or self.facts.pending())

    def digest(self, op_id: int) -> None:
        """A digest of the logical state: nodes (pages, state, locks, pins, storage), in-flight
        prefetches and the host mirror; slot numbers are left out. Ranks of a group agree on it."""
        h = hashlib.blake2b(digest_size=16)
        for node in self.tree.walk():
            h.update(struct.pack("<Qqiiii?", node.hashes[-1], node.tokens, list(NodeState).index(node.state),
                                 node.lock_ref, node.host_ref, node.op, node.stored))
        for op in sorted(self._prefetches):
            pf = self._prefetches[op]
            h.update(struct.pack("<qqqq", op, pf.reserved, pf.hit, pf.read))
        h.update(struct.pack("<qq", self.host_free, self.facts.pending()))
        self._emit(FACADE, TreeDigest(op_id=op_id, digest=h.hexdigest(), host_used=self.config.host_slots - self.host_free))

    def check_invariants(self) -> None:
        self.tree.check_invariants()
        unassigned = sum(w.tokens for w in self._writes.values() if not w.host_assigned)
        prefetching = sum(pf.reserved for pf in self._prefetches.values())
        if self.host_free != self.config.host_slots - self.tree.host_tokens - unassigned - prefetching:
            raise InvariantError(
                f"tree: host mirror says {self.host_free} free, but capacity {self.config.host_slots} - "
                f"{self.tree.host_tokens} held by nodes - {unassigned} being reserved - {prefetching} "
                "reserved by prefetches differs"
            )
        if prefetching != self._prefetch_tokens:
            raise InvariantError(f"tree: prefetches reserve {prefetching} tokens but the rate limit counts {self._prefetch_tokens}")
        if self._rate_room() < 0:
            raise InvariantError(
                f"tree: {self._prefetch_tokens} tokens are prefetching, past the rate limit of "
                f"{self.config.prefetch_rate_fraction} x {self.config.host_slots} host slots"
            )
        for op, pf in self._prefetches.items():
            a = pf.anchor
            if not a.alive or not (a.is_root or (a.state in BACKED and a.host_ref > 0)):
                raise InvariantError(
                    f"tree: prefetch {op} of {pf.request_id!r} is anchored on {a}, which must be alive, backed "
                    "up and host-pinned (or a root) so that eviction cannot delete it"
                )
            if self._prefetch_of.get(pf.request_id) != op:
                raise InvariantError(f"tree: prefetch {op} is not the one of request {pf.request_id!r}")
            if pf.host is not None and len(pf.host) * self.page_size != pf.reserved:
                raise InvariantError(f"tree: prefetch {op} holds {len(pf.host)} host pages but reserved {pf.reserved} "
                                     "tokens")
        got, rule = self._last_reservation
        if got != rule:
            raise InvariantError(
                f"tree: a prefetch reserved {got} host tokens where the free space prescribes {rule} "
                "(seed 002: shrink to the page-aligned free space when that still meets the threshold)"
            )
        for op, node in self._stores.items():
            if not node.alive or node.host is None or node.host_ref <= 0:
                raise InvariantError(f"tree: backup {op} to storage of {node} needs it alive, on host and pinned")
        for node in self.tree.walk():
            if node.state is NodeState.WRITING and node.op not in self._writes:
                raise InvariantError(f"tree: {node} is WRITING without a write in flight")
            parent = node.parent
            if (node.state is NodeState.WRITING and parent is not None and not parent.is_root
                    and parent.state not in BACKED and parent.state is not NodeState.WRITING
                    and not self._writes[node.op].doomed):
                raise InvariantError(f"tree: {node} is written under {parent}, which is not backed up and "
                                     "whose write did not fail (backup must stay prefix-closed)")
            if node.state is NodeState.LOADING and node.op not in self._loads:
                raise InvariantError(f"tree: {node} is LOADING without a load in flight")
        for key, ev in self._evictions.items():
            if not ev.waiting or not ev.waiting <= set(self._writes):
                raise InvariantError(f"tree: eviction {key} waits for writes {ev.waiting} that are not in flight")
        for handle, h in self._handles.items():
            if h.node is not None and (not h.node.alive or h.node.lock_ref <= 0):
                raise InvariantError(f"tree: handle {handle} of {h.request_id!r} holds {h.node}, not alive and locked")
        for rid, node in self._settled.items():
            if not node.alive or node.host_ref <= 0:
                raise InvariantError(f"tree: what the prefetch of {rid!r} settled into ({node}) must be alive and pinned")
        if not self._prefetches and not self._stores and not self._settled:
            pinned = [nd for nd in self.tree.walk() if nd.host_ref]
            if pinned:
                raise InvariantError(f"tree: no prefetch and no backup to storage in flight, yet {pinned[:3]} are "
                                     "host-pinned (a leaked pin)")
        locks = sum(1 for h in self._handles.values() if h.node is not None) + len(self._writes)
        if locks == 0 and not self._admissions:
            held = [nd for nd in self.tree.walk() if nd.lock_ref]
            if held or self.tree.protected_tokens:
                raise InvariantError(
                    f"tree: no request and no write holds a lock, yet {held[:3]} are locked and "
                    f"{self.tree.protected_tokens} tokens protected (a leaked lock ref)"
                )


def _cat(parts: Sequence[Indices | None]) -> Indices:
    """The slots of all parts, one after another (a None part has none)."""
    return Indices.concat(p for p in parts if p is not None)
