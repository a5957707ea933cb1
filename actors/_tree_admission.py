"""Admission, locks and release: the part of the tree core that serves requests.

- admit: match, lock, plan load-back of host-only nodes within a quota ->
  `AllocateLoadSlots` -> nodes LOADING, `SetHostState(LOADING)`, `LoadKV` ->
  `Admitted`. If the device is short, evict and retry once, then give up the loads.
- finish / abort / retract: insert the committed page-aligned prefix; the pages
  the tree takes are adopted, everything else of the request (duplicates, the
  unaligned tail, over-allocation) is freed by one `ReleaseRequests`.
- cache unfinished: insert what a running request committed so far and move its
  lock down to it (`SwapRequestPages`).

Each admitted request holds one lock handle, on the deepest node it uses.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from hicache.messages import (
    EMPTY,
    AdmitItem,
    Admission,
    Admitted,
    AdoptLoadedSlots,
    AllocateLoadSlots,
    CacheItem,
    Cached,
    CachedPrefix,
    FinishItem,
    FreeDeviceSlots,
    HostSlotState,
    Indices,
    LoadKV,
    ReleaseRequests,
    SetHostState,
    SlotRelease,
    SwapRequestPages,
    Tokens,
)

from ._errors import InvariantError
from ._facts import FactKind
from ._radix_node import RESIDENT, Node, NodeState
from ._tree_holds import SettledHolds
from ._tree_shared import DEVICE, FACADE, HOST, LOAD, HandleError, TreeShared, cat
from ._tree_writes import WriteBack


@dataclass(slots=True)
class _Handle:
    request_id: str
    namespace: str
    node: Node | None
    """The locked node (None: nothing matched, nothing locked)."""
    prefix_tokens: int
    """Positions below this hold the tree's slots, not the request's own."""


def _resident_run(nodes: list[Node]) -> int:
    """How many of `nodes` (a path's, from the top) are in device memory before the first that is not."""
    k = 0
    while k < len(nodes) and nodes[k].state in RESIDENT:
        k += 1
    return k


@dataclass(slots=True)
class _Served:
    """An admission's host hit, counted as served (`host_hit_tokens`) once every load-back it
    waits for has landed; never if one of them fails."""

    ops: set[int]
    """The load-backs still in flight that bring in the nodes of its prefix."""
    host: int
    storage: int
    """Of `host`, the tokens the request's own storage prefetch read (`host_hit_storage_tokens`)."""
    ok: bool = True
    """No load-back it waits for failed so far."""


@dataclass(slots=True)
class _Load:
    nodes: list[Node]
    started: bool = False
    """The load stream started its batch (`LoadsStarted`): it lands without a further call."""
    served: list[_Served] = field(default_factory=list)
    """The host hits of the admissions that wait for it (among others, maybe)."""


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


class Admissions:
    """Owns the lock handles, the admissions waiting for load slots, the load-backs in flight,
    and the releases and swaps waiting for the device pool."""

    def __init__(self, shared: TreeShared, writes: WriteBack, holds: SettledHolds) -> None:
        self.s = shared
        self._writes = writes
        self._holds = holds
        self.handles: dict[int, _Handle] = {}
        self._next_handle = 1
        self._admissions: dict[int, _Admission] = {}
        self._deferred: deque[tuple[int, Sequence[AdmitItem]]] = deque()
        """Admissions that came while another waited for its load-back's device slots: planned in
        turn once it is answered. The facade sends one at a time, but after an `admit` it gave up
        on (a timeout, Ctrl-C) its next one may come first; planned at once, both would load the
        same host-only node."""
        self.loads: dict[int, _Load] = {}
        self._swaps: dict[int, _Swaps] = {}
        self._swap_of: dict[int, int] = {}
        self._building: list[_Plan] = []
        """Plans of the admission being built: a later item's match may split their nodes."""
        self._lists_of: dict[int, list[list[Node]]] = {}
        """Per node id, the node lists (`device_nodes`, `load_nodes`) of the plans being built or
        waiting for load slots that hold the node (one admission is planned at a time): a split
        finds the lists that must follow it here, not by a walk over every plan."""
        self._loads_planned: set[int] = set()
        """The ids of the nodes those plans load back."""

    # == admission and load-back ===============================================================

    def admit(self, op_id: int, items: Sequence[AdmitItem]) -> None:
        if self._admissions:
            self._deferred.append((op_id, items))
            return
        self._admit(op_id, items)

    def _admit_deferred(self) -> None:
        """Plan the admissions that waited for one to be answered, in order, while none waits."""
        while self._deferred and not self._admissions:
            self._admit(*self._deferred.popleft())

    def _admit(self, op_id: int, items: Sequence[AdmitItem]) -> None:
        plans: list[_Plan] = []
        self._building = plans
        try:
            self._plan_admission(items, plans, self.s.config.load_back_quota_tokens)
        except BaseException:
            self._forget_plans()
            raise
        finally:
            self._building = []
        total = sum(nd.tokens for p in plans for nd in p.load_nodes)
        if total == 0:
            self._forget_plans()
            self._reply_admitted(op_id, plans)
            return
        load_op = self.s.next_id()
        self._admissions[load_op] = _Admission(op_id, plans)
        self.s.emit(DEVICE, AllocateLoadSlots(op_id=load_op, tokens=total))

    def _plan_admission(self, items: Sequence[AdmitItem], plans: list[_Plan], quota: int) -> None:
        tree = self.s.tree
        for item in items:
            self._holds.release(item.request_id)  # its lock holds what it uses from now on
            path = tree.match(item.namespace, item.tokens)
            planned = self._loads_planned  # the earlier plans' loads, after this match's splits
            k = 0  # the resident prefix (and what earlier plans load): the device's part of the path
            while k < len(path) and (path[k].state in RESIDENT or path[k].id in planned):
                k += 1
            dev, rest = path[:k], path[k:]
            host_tokens = sum(nd.tokens for nd in rest)
            load: list[Node] = []
            if host_tokens >= self.s.config.load_back_min_tokens:
                for nd in rest:  # (a node still loading under a host-only one, whose load failed, ends it)
                    if nd.tokens > quota or nd.state is not NodeState.HOST_ONLY:
                        break
                    load.append(nd)
                    quota -= nd.tokens
                    planned.add(nd.id)
            top = (dev + load)[-1] if dev or load else None
            if top is not None:
                tree.lock(top, +1)
            loaded = sum(nd.tokens for nd in load)
            handle = self._new_handle(item.request_id, item.namespace, top, sum(nd.tokens for nd in dev) + loaded)
            plans.append(_Plan(item, handle, dev, load, host_tokens - loaded))
            for nodes in (dev, load):
                for nd in nodes:
                    self._lists_of.setdefault(nd.id, []).append(nodes)

    def _forget_plans(self) -> None:
        """The admission's plans are answered (or were never made): no split concerns them any more."""
        self._lists_of.clear()
        self._loads_planned.clear()

    def on_load_slots(self, load_op: int, pages: Indices | None, shortfall: int) -> None:
        s = self.s
        adm = self._admissions.pop(load_op)
        if pages is None:
            if not adm.retried:
                adm.retried = True
                self._admissions[load_op] = adm
                self._writes.evict_for(shortfall, lambda: self._retry_load_slots(load_op))
                return
            self._forget_plans()
            self._give_up_loads(adm)
            self._reply_admitted(adm.facade_op, adm.plans, waited=True)
            self._admit_deferred()
            return
        nodes = [nd for p in adm.plans for nd in p.load_nodes]
        at = 0
        for nd in nodes:
            k = nd.tokens // s.page_size
            s.tree.start_load(nd, pages[at : at + k])
            nd.op = load_op
            at += k
        host = cat([nd.host for nd in nodes])
        device = cat([nd.device for nd in nodes])
        self.loads[load_op] = _Load(nodes)
        s.agreement.expect(FactKind.LOAD, load_op)
        s.emit(HOST, SetHostState(pages=host, state=HostSlotState.LOADING))
        s.emit(LOAD, LoadKV(op_id=load_op, host=host, device=device))
        self._forget_plans()
        self._reply_admitted(adm.facade_op, adm.plans, waited=True)
        self._admit_deferred()

    def _retry_load_slots(self, load_op: int) -> None:
        adm = self._admissions[load_op]
        total = sum(nd.tokens for p in adm.plans for nd in p.load_nodes)
        self.s.emit(DEVICE, AllocateLoadSlots(op_id=load_op, tokens=total))

    def _give_up_loads(self, adm: _Admission) -> None:
        for p in adm.plans:
            # Nodes another plan of the batch was to load sit in device_nodes, still host-only (and
            # a node an earlier load was bringing in may have left device memory meanwhile).
            self._end_plan_at(p, _resident_run(p.device_nodes))

    def _cut_at_lost(self, plans: list[_Plan]) -> None:
        """End each plan's prefix before a node that left device memory since it was planned: a
        node an earlier load-back was bringing in, whose load failed while this admission waited
        for its load slots (an engine that admits during a forward pass). The rest of the match
        is the request's host miss; its lock moves up to what is left; the loads this admission
        queued for nodes below run on, and land or go back on their own (`loaded`)."""
        for p in plans:
            self._end_plan_at(p, _resident_run(p.device_nodes + p.load_nodes))

    def _end_plan_at(self, p: _Plan, cut: int) -> None:
        """Keep the first `cut` nodes of a plan's prefix (its device nodes, then those it loads):
        the rest is its host miss, and its lock moves up to the last node kept."""
        nodes = p.device_nodes + p.load_nodes
        keep, dropped = nodes[:cut], nodes[cut:]
        if not dropped:
            return
        tree = self.s.tree
        top = keep[-1] if keep else None
        if top is not None:
            tree.lock(top, +1)
        tree.lock(dropped[-1], -1)
        h = self.handles[p.handle]
        h.node = top
        h.prefix_tokens = sum(nd.tokens for nd in keep)
        p.host_miss += sum(nd.tokens for nd in dropped)
        k = min(cut, len(p.device_nodes))
        p.device_nodes, p.load_nodes = keep[:k], keep[k:]

    @staticmethod
    def _loading(plans: list[_Plan]) -> set[int]:
        """The nodes the plans' requests must wait for (their host hits): loaded by this batch (for
        any of its plans), or by an earlier load that has not landed (its requester may have left
        before `start_loads`, which has not started it yet)."""
        return {nd.id for p in plans for nd in p.device_nodes + p.load_nodes if nd.state is NodeState.LOADING}

    def _reply_admitted(self, op_id: int, plans: list[_Plan], *, waited: bool = False) -> None:
        """Answer the admission. `waited`: it waited for its load slots, time in which a node of
        its prefix that an earlier load was bringing in may have left device memory (`_cut_at_lost`)."""
        n = self.s.n
        admissions = []
        filled = [nd.device for p in plans for nd in p.load_nodes]  # what `LoadKV` asked to fill
        if waited:
            self._cut_at_lost(plans)
        loading = self._loading(plans)
        for p in plans:
            nodes = p.device_nodes + p.load_nodes
            dev_hit = sum(nd.tokens for nd in nodes if nd.id not in loading)
            host_hit = sum(nd.tokens for nd in nodes if nd.id in loading)
            n.looked_up_tokens += len(p.item.tokens)
            n.device_hit_tokens += dev_hit
            storage_hit = self._storage_part(host_hit, p.item.stored, p.host_miss)
            waits: tuple[int, ...] = ()
            if host_hit:  # served once the loads of its loading nodes land (`loaded`)
                waits = tuple(sorted({nd.op for nd in nodes if nd.id in loading}))
                self._await_served(_Served(set(waits), host_hit, storage_hit))
            admissions.append(Admission(
                request_id=p.item.request_id, handle=p.handle, device=cat([nd.device for nd in nodes]),
                device_hit=dev_hit, host_hit=host_hit, host_miss=p.host_miss, storage_hit=storage_hit,
                waits=waits,
            ))
        loads = cat(filled) if filled else EMPTY
        self.s.emit(FACADE, Admitted(op_id=op_id, admissions=tuple(admissions), loads=loads))

    def _await_served(self, served: _Served) -> None:
        """Count `served` when the last of its load-backs lands (`loaded`)."""
        for op in served.ops:
            self.loads[op].served.append(served)

    @staticmethod
    def _storage_part(host_hit: int, stored: int, host_miss: int) -> int:
        """Of an admission's `host_hit`, the tokens its own prefetch read from storage (its L3
        hit). The prefetched pages (`stored` tokens) end the host part of its path
        (`host_hit + host_miss` tokens, pages in host memory before them), whose leading
        `host_hit` tokens load back: those of them that are the prefetch's."""
        return min(host_hit, max(0, stored - host_miss))

    def loads_started(self, ops: tuple[int, ...]) -> None:
        """The load stream started these load-backs' batch (a load that failed before its start
        is gone already)."""
        for op in ops:
            load = self.loads.get(op)
            if load is not None:
                load.started = True

    def loaded(self, op: int, value: int) -> None:
        """The agreed outcome of load-back `op`: 1 landed (SYNCED), 0 failed (back to HOST_ONLY).

        Device memory holds whole prefixes only. An engine that admits while a load-back runs
        may load a node under one whose earlier load then fails: a node whose parent is not in
        device memory when its own load lands goes back to HOST_ONLY, and a node whose load
        fails (or goes back) takes the loaded nodes under it back to host memory with it. A
        load with a node given back counts as failed for the host hits that wait on it."""
        s = self.s
        load = self.loads.pop(op)
        landed: list[Node] = []
        back: list[Node] = []  # failed or given back: their device pages are freed
        freed: list[Indices] = []
        for nd in load.nodes:  # parents before children (each plan's nodes run down its path)
            nd.op = 0
            parent = nd.parent
            if value and (parent is None or parent.is_root or parent.state in RESIDENT):
                s.tree.set_state(nd, NodeState.SYNCED)
                landed.append(nd)
            else:
                freed.append(nd.device)  # type: ignore[arg-type]
                s.tree.fail_load(nd)
                back.append(nd)
        for nd in list(back):  # loaded nodes under a node given back: back too
            self._give_back_under(nd, back, freed)
        if landed:
            s.emit(HOST, SetHostState(pages=cat([nd.host for nd in landed]), state=HostSlotState.SYNCED))
            s.emit(DEVICE, AdoptLoadedSlots(pages=cat([nd.device for nd in landed])))
        if back:
            s.emit(HOST, SetHostState(pages=cat([nd.host for nd in back]), state=HostSlotState.HOST_ONLY))
            s.emit(DEVICE, FreeDeviceSlots(pages=cat(freed)))
        ok = not back
        for served in load.served:
            served.ops.discard(op)
            served.ok = served.ok and ok
            if not served.ops and served.ok:
                s.n.host_hit_tokens += served.host
                s.n.host_hit_storage_tokens += served.storage
        self._writes.op_landed(op, back)  # an eviction waiting for it goes on

    def _give_back_under(self, node: Node, back: list[Node], freed: list[Indices]) -> None:
        """Take the SYNCED nodes under `node` (now host-only) back to host memory: loaded while
        an ancestor's load still ran, which then failed. A LOADING one goes back when its load
        ends (its parent is not in device memory then); nothing else resident can be there (an
        insert stops at a node whose load has not landed)."""
        stack = list(node.children.values())
        while stack:
            nd = stack.pop()
            if nd.state is not NodeState.SYNCED:
                continue
            freed.append(nd.device)  # type: ignore[arg-type]
            self.s.tree.evict_to_host(nd)
            back.append(nd)
            stack.extend(nd.children.values())

    # == release ===============================================================================

    def finish(self, op_id: int, items: Sequence[FinishItem]) -> None:
        releases = []
        for it, h in zip(items, self._take_handles(items), strict=True):
            adopted: list[Indices] = []
            path: list[Node] = []
            if not self._prefix_lost(h):  # else its KV was computed over a failed load: cache none of it
                path = self._insert(h, it.tokens, it.device, adopted, [])
            self._unlock_finished(h)
            for nd in path:
                self._writes.consider_backup(nd)
            releases.append(SlotRelease(request_id=it.request_id, adopt=cat(adopted), reason=it.reason,
                                        allocs=it.allocs, commits=it.commits))
        # The device answers the facade (`Finished` of this op) once it has released them.
        self.s.emit(DEVICE, ReleaseRequests(op_id=op_id, releases=tuple(releases)))

    def cache_unfinished(self, op_id: int, items: Sequence[CacheItem]) -> None:
        lost = tuple(it.request_id for it in items
                     if (h := self.handles.get(it.handle)) is not None and self._prefix_lost(h))
        if lost:  # their new nodes would hang under host-only ones: refuse the batch, change nothing
            self.s.emit(FACADE, Cached(op_id=op_id, prefixes=(), refused=lost))
            return
        swaps = _Swaps(op_id, [])
        for it, h in zip(items, self._take_handles(items), strict=True):
            adopted: list[Indices] = []
            duplicates: list[Indices] = []
            path = self._insert(h, it.tokens, it.device, adopted, duplicates)
            top = path[-1] if path else h.node
            if top is not None:
                self.s.tree.lock(top, +1)
            if h.node is not None:
                self.s.tree.lock(h.node, -1)
            handle = self._new_handle(it.request_id, h.namespace, top, sum(nd.tokens for nd in path))
            swaps.prefixes.append(CachedPrefix(request_id=it.request_id, handle=handle,
                                               device=cat([nd.device for nd in path])))
            for nd in path:
                self._writes.consider_backup(nd)
            swap_op = self.s.next_id()
            swaps.waiting.add(swap_op)
            self._swap_of[swap_op] = op_id
            self.s.emit(DEVICE, SwapRequestPages(op_id=swap_op, request_id=it.request_id,
                                                 adopt=cat(adopted), free=cat(duplicates), allocs=it.allocs,
                                                 commits=it.commits))
        if swaps.waiting:
            self._swaps[op_id] = swaps
        else:
            self.s.emit(FACADE, Cached(op_id=op_id, prefixes=tuple(swaps.prefixes), refused=()))

    def on_swapped(self, swap_op: int) -> None:
        facade_op = self._swap_of.pop(swap_op)
        swaps = self._swaps[facade_op]
        swaps.waiting.discard(swap_op)
        if not swaps.waiting:
            del self._swaps[facade_op]
            self.s.emit(FACADE, Cached(op_id=facade_op, prefixes=tuple(swaps.prefixes), refused=()))

    def _insert(
        self, h: _Handle, tokens: Tokens, device: Indices,
        adopted: list[Indices], duplicates: list[Indices],
    ) -> list[Node]:
        """Insert a request's committed page-aligned prefix: `tokens` and `device` are what it
        committed after the cached prefix its handle locks (checked by `_take_handles`), so only
        they are walked and compared; the prefix's nodes count as matched."""
        p = self.s.page_size
        n = len(tokens) - len(tokens) % p
        out = self.s.tree.insert(h.namespace, tokens, device[: n // p], length=n, after=h.node)
        if out.revived:
            self.s.emit(HOST, SetHostState(pages=cat([nd.host for nd in out.revived]), state=HostSlotState.SYNCED))
        adopted.extend(out.adopted)
        duplicates.extend(out.duplicates)
        return out.path

    # == handles ===============================================================================

    def _new_handle(self, request_id: str, namespace: str, node: Node | None, prefix: int) -> int:
        handle = self._next_handle
        self._next_handle += 1
        self.handles[handle] = _Handle(request_id, namespace, node, prefix)
        return handle

    def _take_handles(self, items: Sequence[FinishItem] | Sequence[CacheItem]) -> list[_Handle]:
        """Every item's handle, all checked before any is taken: one bad item refuses the
        whole batch and changes nothing."""
        seen: set[int] = set()
        for it in items:
            h = self.handles.get(it.handle)
            if h is None:
                raise HandleError(f"lock handle {it.handle} of request {it.request_id!r} is unknown or already released")
            if h.request_id != it.request_id:
                raise HandleError(f"lock handle {it.handle} belongs to request {h.request_id!r}, not {it.request_id!r}")
            if it.handle in seen:
                raise HandleError(f"lock handle {it.handle} of request {it.request_id!r} appears twice in one batch")
            self._check_item(it.request_id, it.tokens, it.device)
            seen.add(it.handle)
        return [self.handles.pop(it.handle) for it in items]

    def _check_item(self, rid: str, tokens: Tokens, device: Indices) -> None:
        """The tokens a request committed after its cached prefix come with the pages that hold them."""
        p = self.s.page_size
        if -(-len(tokens) // p) != len(device):
            raise ValueError(f"request {rid!r}: {len(tokens)} tokens after its cached prefix need "
                             f"{-(-len(tokens) // p)} pages of {p}, got {len(device)}")

    def _unlock_finished(self, h: _Handle) -> None:
        """The one lock release of a request that leaves, whatever the reason."""
        if h.node is not None:
            self.s.tree.lock(h.node, -1)

    @staticmethod
    def _prefix_lost(h: _Handle) -> bool:
        """The request's cached prefix has no device copy any more (its load-back failed)."""
        return h.node is not None and any(nd.state not in RESIDENT for nd in h.node.path())

    # == the tree's other parts ================================================================

    def follow_split(self, upper: Node, lower: Node) -> None:
        """A plan's or a load's node list gets the new upper part of a split node, just before
        the lower one. Plans follow whether or not their load runs yet: a node planned for
        load-back has no op until its device slots arrive."""
        lists = self._lists_of.get(lower.id)
        if lists:
            for nodes in lists:
                nodes.insert(nodes.index(lower), upper)
            self._lists_of[upper.id] = list(lists)
            if lower.id in self._loads_planned:
                self._loads_planned.add(upper.id)
        load = self.loads.get(lower.op) if lower.op else None
        if load is not None:
            load.nodes.insert(load.nodes.index(lower), upper)

    def holds_locks(self) -> bool:
        """A handle holds a node, or an admission waiting for load slots holds its plans' nodes."""
        return bool(self._admissions) or any(h.node is not None for h in self.handles.values())

    def busy(self) -> bool:
        return bool(self.handles or self.loads or self._admissions or self._deferred or self._swaps)

    def check_invariants(self) -> None:
        for handle, h in self.handles.items():
            if h.node is not None and (not h.node.alive or h.node.lock_ref <= 0):
                raise InvariantError(f"tree: handle {handle} of {h.request_id!r} holds {h.node}, not alive and locked")
        if self._building:
            raise InvariantError("tree: an admission's plans are still being built between two messages")
        if self._deferred and not self._admissions:
            raise InvariantError(f"tree: {len(self._deferred)} admissions wait for their turn, but none is "
                                 "in flight to be answered first")
        for op, load in self.loads.items():
            for nd in load.nodes:
                if nd.state is not NodeState.LOADING or nd.op != op:
                    raise InvariantError(f"tree: load {op} holds {nd}, which is not LOADING under that load")
        for swap_op, facade_op in self._swap_of.items():
            if swap_op not in self._swaps.get(facade_op, _Swaps(0, [])).waiting:
                raise InvariantError(f"tree: swap {swap_op} is not one its CacheUnfinished {facade_op} waits for")
        self._check_plan_lists()

    def _check_plan_lists(self) -> None:
        """Every node of a waiting admission's plans is indexed with each list that holds it (a
        split must find them all), and nothing else is: the index ends with the admission."""
        plans = [p for adm in self._admissions.values() for p in adm.plans]
        entries = 0
        for p in plans:
            for nodes in (p.device_nodes, p.load_nodes):
                for nd in nodes:
                    if not any(held is nodes for held in self._lists_of.get(nd.id, ())):
                        raise InvariantError(f"tree: {nd} of the plan of {p.item.request_id!r} is not indexed with "
                                             "its plan's node list (a split of it would not follow)")
                entries += len(nodes)
            if any(nd.id not in self._loads_planned for nd in p.load_nodes):
                raise InvariantError(f"tree: a node the plan of {p.item.request_id!r} loads back is not counted "
                                     "as planned for load-back")
        indexed = sum(map(len, self._lists_of.values()))
        if indexed != entries or (not plans and self._loads_planned):
            raise InvariantError(f"tree: the plan index holds {indexed} entries for {entries} nodes of the plans "
                                 "waiting for load slots (an admission's index outlived it)")
