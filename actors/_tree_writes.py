"""Write policy, write-back and eviction: the part of the tree core that moves device copies to host.

- write-through: a DEVICE node hit often enough under a backed-up parent ->
  WRITING, locked -> `AllocateHost` -> `SetHostState(WRITING)`, `WriteKV` ->
  on the agreed `WriteDone`: SYNCED, `SetHostState(SYNCED)`, unlocked.
- eviction: device leaves in policy order (backed-up ones become HOST_ONLY,
  others are deleted, or written first under write_back); host-only leaves.

Backup stays prefix-closed: a node is written only under a parent that is backed up
or being written (the write stream keeps order), and a failed write fails the writes
in flight below it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hicache.messages import (
    ActorName,
    AllocateHost,
    Evicted,
    FreeDeviceSlots,
    FreeHostSlots,
    HostSlotState,
    Indices,
    SetHostState,
    WriteKV,
)
from hicache.messages.config import WritePolicy

from ._errors import InvariantError
from ._facts import FactKind
from ._radix_node import BACKED, Node, NodeState
from ._tree_backup import BackupBook
from ._tree_shared import DEVICE, FACADE, HOST, WRITE, TreeShared, cat

_THRESHOLD = {WritePolicy.WRITE_THROUGH: 1, WritePolicy.WRITE_THROUGH_SELECTIVE: 2}
"""Hits a device node needs before it is written through, per write policy (absent: never)."""


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
class _Eviction:
    """A device eviction that goes on until `want` tokens are free or nothing evictable is
    left, waiting for writes and loads in flight when they hold the rest: its own write-backs
    (write_back), write-throughs whose nodes only the write keeps locked, and load-backs that
    nothing locks any more (their request ended while they ran: landed, they are evictable)."""

    want: int
    freed: int = 0
    waiting: set[int] = field(default_factory=set)
    """Writes and loads whose landing lets it go on."""
    reply_op: int = 0
    """The EvictDevice (of the facade) or EvictForAllocation (of the device) to answer with
    Evicted, if any."""
    reply_to: ActorName = FACADE
    """Who asked."""
    then: Callable[[], None] | None = None
    """What to do once it ends (an admission sends its AllocateLoadSlots again), if anything."""


def _unlocked(nodes: list[Node]) -> bool:
    """Whether a node of a load-back in flight is locked by nothing (its request ended)."""
    return any(nd.lock_ref == 0 for nd in nodes)


def _soon_free(w: _Write) -> bool:
    """Whether a write-through in flight holds a node nothing but its own lock keeps: once it
    lands, that node is evictable (synced, so it moves to host memory; or, if the write fails,
    as a doomed one will, back on device only and deletable). Its upper nodes may be locked by
    a request whose prefix they are (a node split by the request's match)."""
    return not w.evict_after and any(nd.lock_ref == 1 for nd in w.nodes)


class WriteBack:
    """Owns the writes in flight and the evictions waiting for them."""

    def __init__(self, shared: TreeShared, backups: BackupBook, loading: Callable[[], bool],
                 started_loads: Callable[[], dict[int, list[Node]]]) -> None:
        self.s = shared
        self._backups = backups
        self._loading = loading
        """Whether load-backs are in flight (their nodes are neither evictable nor free)."""
        self._started_loads = started_loads
        """The load-backs in flight whose batch has started, each op's nodes: they land without
        a further call (one the facade has not started waits for its next `start_loads`)."""
        self.writes: dict[int, _Write] = {}
        self._evictions: dict[int, _Eviction] = {}
        self._eviction_of: dict[int, list[int]] = {}

    # == eviction ==========================================================================

    def evict_device(self, op_id: int, tokens: int, reply_to: ActorName = FACADE) -> None:
        """Answer `reply_to` once `tokens` are free or nothing more can be: see `_Eviction`."""
        self.evict_until(_Eviction(tokens, reply_op=op_id, reply_to=reply_to))

    def evict_for(self, tokens: int, then: Callable[[], None]) -> None:
        """Free `tokens` of device memory as far as possible, then call `then`."""
        self.evict_until(_Eviction(tokens, then=then))

    def evict_until(self, ev: _Eviction) -> None:
        """Evict for `ev` now; wait for writes in flight if they hold what is still missing,
        else end it (answer the facade, or call its `then`)."""
        local = self.s.agreement.local
        freed, writes = self._evict_device(ev.want - ev.freed - self._pending_frees(ev))
        ev.freed += freed
        ev.waiting.update(writes)
        if local and ev.freed + self._pending_frees(ev) < ev.want:
            ev.waiting.update(self._writes_holding_evictable())
            ev.waiting.update(self._loads_holding_evictable())
        if not local or not ev.waiting:
            # With several ranks an ack applies only at an agreement (HiCache.sync), which the
            # caller cannot run while it waits for this reply: answer with what is free now; the
            # write-backs free their slots when their agreed acks are applied.
            self._end_eviction(ev)
            return
        key = self.s.next_id()
        self._evictions[key] = ev
        for w in ev.waiting:
            self._eviction_of.setdefault(w, []).append(key)

    def _pending_frees(self, ev: _Eviction) -> int:
        """Tokens the write-backs `ev` waits for free when they land."""
        return sum(self.writes[w].tokens for w in ev.waiting if w in self.writes and self.writes[w].evict_after)

    def _writes_holding_evictable(self) -> list[int]:
        """Write-throughs in flight that hold a node only their own lock keeps (`_soon_free`)."""
        return [op for op, w in self.writes.items() if _soon_free(w)]

    def _loads_holding_evictable(self) -> list[int]:
        """Started load-backs with a node nothing locks: the request that asked for them ended
        (finished, aborted, retracted) before they landed, so once they land (or fail, which
        frees their slots) that memory is the eviction's."""
        return [op for op, nodes in self._started_loads().items() if _unlocked(nodes)]

    def _end_eviction(self, ev: _Eviction) -> None:
        if ev.freed < ev.want and self.s.agreement.local:
            left = self.s.tree.evictable_tokens
            if left and not self._loading():
                raise InvariantError(
                    f"tree: an eviction of {ev.want} tokens ended with {ev.freed} freed while {left} are evictable "
                    "(eviction goes on until the demand is met or nothing evictable remains)"
                )
            soon = sorted(op for op, nodes in self._started_loads().items() if _unlocked(nodes))
            if soon:
                raise InvariantError(
                    f"tree: an eviction of {ev.want} tokens ended with {ev.freed} freed while started load-backs "
                    f"{soon}, which nothing locks, are in flight (eviction waits for them: landed, their nodes are "
                    "evictable)"
                )
            soon = sorted(op for op, w in self.writes.items() if _soon_free(w))
            if soon:
                raise InvariantError(
                    f"tree: an eviction of {ev.want} tokens ended with {ev.freed} freed while write-throughs {soon} "
                    "hold nodes only they lock (eviction waits for them: landed, those nodes are evictable)"
                )
        if ev.reply_op:
            self.s.emit(ev.reply_to, Evicted(op_id=ev.reply_op, device_tokens=ev.freed, host_tokens=0))
        if ev.then is not None:
            ev.then()

    def _evict_device(self, tokens: int) -> tuple[int, list[int]]:
        """Free device slots now (returns how many) and start write-backs whose slots go when
        their writes land (returns their op ids)."""
        cfg = self.s.config
        frees: list[Indices] = []
        freed = pending = 0
        writes: list[int] = []
        while freed + pending < tokens:  # a write-back counts: its slots go when its write lands
            node = self.s.tree.pop_device_victim()
            if node is None:
                break
            if (node.state is NodeState.DEVICE and cfg.write_policy is WritePolicy.WRITE_BACK
                    and cfg.host_tier and self._back_up_ancestors(node)
                    and self.start_backup(node, evict_after=True)):
                pending += node.tokens
                writes.append(node.op)
                continue
            frees.append(self._drop_device(node))
            freed += node.tokens
        self._emit_device_frees(frees)
        return freed, writes

    def op_landed(self, op: int, dropped: list[Node]) -> None:
        """A write or load an eviction may wait for landed or failed (`dropped`: the nodes
        whose device slots it freed, a write-back's or a failed load's): once an eviction
        waits for nothing more, it goes on."""
        for key in self._eviction_of.pop(op, ()):
            ev = self._evictions[key]
            ev.freed += sum(nd.tokens for nd in dropped)
            ev.waiting.discard(op)
            if not ev.waiting:
                del self._evictions[key]
                self.evict_until(ev)

    def _drop_device(self, node: Node) -> Indices:
        """Free a device-evictable node's device copy: to HOST_ONLY if backed up, else delete it."""
        device = node.device
        assert device is not None
        if node.state is NodeState.SYNCED:
            self.s.emit(HOST, SetHostState(pages=node.host, state=HostSlotState.HOST_ONLY))  # type: ignore[arg-type]
            self.s.tree.evict_to_host(node)
        else:
            self.s.tree.remove(node)
        self.s.n.evicted_device_tokens += node.tokens
        return device

    def evict_host(self, tokens: int) -> int:
        """Delete host-only leaves until `tokens` host slots are free or none is left; how many were."""
        s = self.s
        frees: list[Indices] = []
        freed = 0
        while freed < tokens:
            node = s.tree.pop_host_victim()
            if node is None:
                break
            assert node.host is not None
            frees.append(node.host)
            freed += node.tokens
            s.tree.remove(node)
        if frees:
            s.emit(HOST, FreeHostSlots(pages=cat(frees)))
            s.host_free += freed
            s.n.evicted_host_tokens += freed
        return freed

    def _emit_device_frees(self, frees: list[Indices]) -> None:
        if frees:
            self.s.emit(DEVICE, FreeDeviceSlots(pages=cat(frees)))

    # == writes =============================================================================

    def consider_backup(self, node: Node) -> None:
        """Write a device node through to host memory if the write policy wants it now."""
        cfg = self.s.config
        threshold = _THRESHOLD.get(cfg.write_policy)
        if threshold is None or not cfg.host_tier or not node.alive:
            return
        if (node.state is NodeState.DEVICE and node.op == 0 and node.hit_count >= threshold
                and self._parent_backed(node)):
            self.start_backup(node, evict_after=False)

    def start_backup(self, node: Node, *, evict_after: bool) -> bool:
        """Reserve host slots and start writing `node` (False: host memory cannot take it)."""
        s = self.s
        need = node.tokens
        if s.host_free < need:
            self.evict_host(need - s.host_free)
        if s.host_free < need:
            s.n.backups_failed += 1
            return False
        op = s.next_id()
        s.tree.set_state(node, NodeState.WRITING)
        s.tree.lock(node, +1)
        node.op = op
        self.writes[op] = _Write([node], evict_after, need)
        s.agreement.expect(FactKind.WRITE, op)
        s.host_free -= need
        s.emit(HOST, AllocateHost(op_id=op, tokens=need))
        return True

    def on_host_allocated(self, op: int, pages: Indices | None) -> None:
        w = self.writes[op]
        s = self.s
        if pages is None:  # the mirror says this cannot happen (an injected fault): the write fails
            s.agreement.record(FactKind.WRITE, op, 0)
            return
        at = 0
        for nd in w.nodes:
            k = nd.tokens // s.page_size
            s.tree.set_host(nd, pages[at : at + k])
            at += k
        w.host_assigned = True
        host = cat([nd.host for nd in w.nodes])
        device = cat([nd.device for nd in w.nodes])
        s.emit(HOST, SetHostState(pages=host, state=HostSlotState.WRITING))
        s.emit(WRITE, WriteKV(op_id=op, device=device, host=host))

    def landed(self, op: int, value: int) -> None:
        """The agreed outcome of write `op`: 1 landed, 0 failed."""
        self._write_done(op) if value else self._write_failed(op)

    def _write_done(self, op: int) -> None:
        if self.writes[op].doomed:
            self._write_failed(op)
            return
        s = self.s
        w = self.writes.pop(op)
        s.emit(HOST, SetHostState(pages=cat([nd.host for nd in w.nodes]), state=HostSlotState.SYNCED))
        for nd in w.nodes:
            nd.op = 0
            s.tree.set_state(nd, NodeState.SYNCED)
        s.tree.lock(w.nodes[-1], -1)  # one lock per write, on its deepest node (splits add uppers)
        s.n.backups_done += 1
        freed = [nd for nd in w.nodes if s.tree.device_evictable(nd)] if w.evict_after else []
        self._emit_device_frees([self._drop_device(nd) for nd in freed])
        self.op_landed(op, freed)
        for nd in w.nodes:
            self._backups.consider_store(nd)
        for nd in w.nodes:
            for child in sorted(nd.children.values(), key=lambda c: c.id):
                self.consider_backup(child)

    def _write_failed(self, op: int) -> None:
        s = self.s
        w = self.writes[op]
        self._doom_descendants(w)
        if w.host_assigned:  # its bytes are not valid (on this rank or another)
            host = cat([nd.host for nd in w.nodes])
            s.emit(HOST, SetHostState(pages=host, state=HostSlotState.RESERVED))
            s.emit(HOST, FreeHostSlots(pages=host))
            for nd in w.nodes:
                s.tree.set_host(nd, None)
        s.host_free += w.tokens
        self._abandon_write(op, w)

    def _abandon_write(self, op: int, w: _Write) -> None:
        s = self.s
        s.n.backups_failed += 1
        self.writes.pop(op, None)
        for nd in w.nodes:
            nd.op = 0
            s.tree.set_state(nd, NodeState.DEVICE)
        s.tree.lock(w.nodes[-1], -1)
        dropped = [nd for nd in w.nodes if s.tree.device_evictable(nd)] if w.evict_after else []
        self._emit_device_frees([self._drop_device(nd) for nd in dropped])
        self.op_landed(op, dropped)

    def _doom_descendants(self, failed: _Write) -> None:
        """Writes in flight below a failed one fail too when they land (see `_Write.doomed`)."""
        mine = {id(nd) for nd in failed.nodes}
        for w in self.writes.values():
            if w is not failed and not w.doomed and any(id(a) in mine for a in w.nodes[0].path()):
                w.doomed = True

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
            if up.op or not self.start_backup(up, evict_after=False):
                self._lost_tail(node, chain)
                return False
        return True

    def _lost_tail(self, node: Node, chain: list[Node]) -> None:
        """A write_back victim is about to be deleted: only for want of host memory."""
        s = self.s
        need = node.tokens + sum(up.tokens for up in chain if up.state is NodeState.DEVICE and not up.op)
        if s.host_free >= need and s.agreement.local:
            raise InvariantError(
                f"tree: write_back would delete {node} (and lose its tail) with {s.host_free} host tokens "
                f"free for the {need} its write-back and its ancestors' need"
            )

    # == the tree's other parts ===============================================================

    def follow_split(self, upper: Node, lower: Node) -> None:
        """A write's node list gets the new upper part of a split node, just before the lower one."""
        w = self.writes.get(lower.op) if lower.op else None
        if w is not None:
            w.nodes.insert(w.nodes.index(lower), upper)

    def busy(self) -> bool:
        return bool(self.writes or self._evictions)

    def unassigned_tokens(self) -> int:
        """Host tokens reserved for writes whose host slots have not been granted yet."""
        return sum(w.tokens for w in self.writes.values() if not w.host_assigned)

    def check_invariants(self) -> None:
        for op, w in self.writes.items():
            if not w.nodes or w.nodes[-1].lock_ref <= 0:
                raise InvariantError(f"tree: write {op} must hold a lock on its deepest node")
        in_flight = set(self.writes) | set(self._started_loads())
        for key, ev in self._evictions.items():
            if not ev.waiting or not ev.waiting <= in_flight:
                raise InvariantError(f"tree: eviction {key} waits for writes or loads {ev.waiting} that are not "
                                     "in flight")
        for w, keys in self._eviction_of.items():
            if any(key not in self._evictions for key in keys):
                raise InvariantError(f"tree: write or load {w} lets evictions {keys} go on, but some are not waiting")
