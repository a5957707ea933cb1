"""`TreeCore`: every decision of the cache, as a plain state machine that emits messages.

The tree actor is a thin shell: it calls one method of this core per message and
sends what the core put in `outbox` (pairs of receiver and message). The core
owns the radix tree and a mirror of the host pool's free slots: the tree is the
only party that reserves or frees host slots, so it knows exactly how many are
free and evicts before it reserves.

The core composes five parts, each owning its tables and checking its own
invariants; the core routes each event to the part it concerns and checks what
spans parts (the host mirror, node states against in-flight operations, leaked
locks and pins):

- `Admissions` (`_tree_admission`): admit and load back, finish / abort / retract,
  cache unfinished; the lock handles.
- `WriteBack` (`_tree_writes`): write policy, write-through and write-back, device
  and host eviction.
- `PrefetchBook` (`_tree_prefetch`): storage -> host prefetches, from the
  reservation to the settlement.
- `BackupBook` (`_tree_backup`): host -> storage backups.
- `Agreement` (`_facts`): rank-local outcomes (write and load acks, storage hits,
  backups), applied in issue order once agreed: at once with one rank.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

from hicache.messages import (
    ActorName,
    AdmitItem,
    CacheItem,
    Evicted,
    FinishItem,
    Indices,
    LocalFacts,
    Message,
    PrefetchEnd,
    PrefetchEndCounts,
    TreeDigest,
    TreeStatistics,
)
from hicache.messages.config import Config

from ._errors import InvariantError
from ._facts import FactKind
from ._radix import RadixTree
from ._radix_node import BACKED, HASH_BYTES, Node, NodeState
from ._tree_admission import Admissions
from ._tree_backup import BackupBook
from ._tree_prefetch import PrefetchBook
from ._tree_shared import FACADE, TreeShared
from ._tree_writes import WriteBack


class TreeCore:
    def __init__(self, config: Config, next_id: Callable[[], int], now: Callable[[], float] = lambda: 0.0) -> None:
        self.config = config
        s = self.shared = TreeShared(config, next_id, now)
        self.tree: RadixTree = s.tree
        self.tree.on_split = self._follow_split
        self.backups = BackupBook(s)
        self.writes = WriteBack(s, self.backups, loading=lambda: bool(self.admission.loads),
                                started_loads=lambda: {op: ld.nodes for op, ld in self.admission.loads.items()
                                                       if ld.started})
        self.prefetches = PrefetchBook(s, self.writes)
        self.admission = Admissions(s, self.writes, self.prefetches.holds)
        self.agreement = s.agreement
        self.agreement.on(FactKind.WRITE, lambda op, value: self.writes.landed(op, value))
        self.agreement.on(FactKind.LOAD, lambda op, value: self.admission.loaded(op, value))
        self.agreement.on(FactKind.HIT, lambda op, value: self.prefetches.hit(op, value))
        self.agreement.on(FactKind.BACKUP, lambda op, value: self.backups.stored(op, value))

    @property
    def outbox(self) -> list[tuple[ActorName, Message]]:
        """What the core decided to send, in order: (receiver, message) pairs the shell sends."""
        return self.shared.outbox

    @outbox.setter
    def outbox(self, value: list[tuple[ActorName, Message]]) -> None:
        self.shared.outbox = value

    @property
    def host_free(self) -> int:
        """The host pool's free slots, as the tree's mirror counts them."""
        return self.shared.host_free

    # == facade verbs ====================================================================

    def admit(self, op_id: int, items: Sequence[AdmitItem]) -> None:
        self.admission.admit(op_id, items)

    def finish(self, op_id: int, items: Sequence[FinishItem]) -> None:
        self.admission.finish(op_id, items)

    def cache_unfinished(self, op_id: int, items: Sequence[CacheItem]) -> None:
        self.admission.cache_unfinished(op_id, items)

    def evict_device(self, op_id: int, tokens: int, reply_to: ActorName = ActorName.FACADE) -> None:
        self.writes.evict_device(op_id, tokens, reply_to)

    def evict_host(self, op_id: int, tokens: int) -> None:
        freed = self.writes.evict_host(tokens)
        self.shared.emit(FACADE, Evicted(op_id=op_id, device_tokens=0, host_tokens=freed))

    def prefetch(self, op_id: int, items: Sequence[AdmitItem]) -> None:
        self.prefetches.prefetch(op_id, items)

    def prefetch_states(self, request_ids: Sequence[str]) -> tuple[bool, ...]:
        return self.prefetches.prefetch_states(request_ids)

    def terminate_prefetches(self, op_id: int, request_ids: Sequence[str], reason: PrefetchEnd) -> None:
        self.prefetches.terminate_prefetches(op_id, request_ids, reason)

    def settle_prefetches(self, op_id: int, request_ids: Sequence[str], pages: Sequence[int]) -> None:
        self.prefetches.settle_prefetches(op_id, request_ids, pages)

    def report_facts(self, op_id: int) -> None:
        known, values = self.agreement.report()
        self.shared.emit(FACADE, LocalFacts(op_id=op_id, known=known, values=values))

    def apply_facts(self, counts: tuple[int, ...], values: tuple[int, ...]) -> None:
        self.agreement.apply(counts, values)

    # == replies from the other actors ====================================================

    def on_load_slots(self, load_op: int, pages: Indices | None, shortfall: int) -> None:
        self.admission.on_load_slots(load_op, pages, shortfall)

    def on_swapped(self, swap_op: int) -> None:
        self.admission.on_swapped(swap_op)

    def on_host_allocated(self, op: int, pages: Indices | None) -> None:
        if not self.prefetches.on_host_allocated(op, pages):
            self.writes.on_host_allocated(op, pages)

    def on_prefetch_progress(self, op: int, pages: int, finished: bool) -> None:
        self.prefetches.on_prefetch_progress(op, finished)

    def on_prefetch_stopped(self, op: int, pages: int) -> None:
        self.prefetches.on_prefetch_stopped(op, pages)

    # rank-local outcomes: recorded here, applied once agreed (see `Agreement`)

    def on_write_done(self, op: int) -> None:
        self.agreement.record(FactKind.WRITE, op, 1)

    def on_write_failed(self, op: int) -> None:
        self.agreement.record(FactKind.WRITE, op, 0)

    def on_loads_started(self, ops: tuple[int, ...]) -> None:
        self.admission.loads_started(ops)

    def on_load_done(self, op: int) -> None:
        self.agreement.record(FactKind.LOAD, op, 1)

    def on_load_failed(self, op: int) -> None:
        self.agreement.record(FactKind.LOAD, op, 0)

    def on_prefetch_hit(self, op: int, pages: int) -> None:
        self.agreement.record(FactKind.HIT, op, pages)

    def on_pages_stored(self, op: int, pages: int, written: int) -> None:
        self.backups.on_stored(op, pages, written)

    def _follow_split(self, upper: Node, lower: Node) -> None:
        """A split node's new upper part joins every node list that holds the lower one."""
        self.admission.follow_split(upper, lower)
        self.writes.follow_split(upper, lower)

    # == numbers and checks =====================================================================

    def statistics(self) -> TreeStatistics:
        t, n = self.tree, self.shared.n
        return TreeStatistics(
            nodes=t.nodes, device_tokens=t.device_tokens, host_tokens=t.host_tokens,
            protected_tokens=t.protected_tokens, evictable_tokens=t.evictable_tokens,
            live_handles=len(self.admission.handles), writes_in_flight=len(self.writes.writes),
            loads_in_flight=len(self.admission.loads),
            looked_up_tokens=n.looked_up_tokens,
            device_hit_tokens=n.device_hit_tokens, host_hit_tokens=n.host_hit_tokens,
            evicted_device_tokens=n.evicted_device_tokens, evicted_host_tokens=n.evicted_host_tokens,
            backups_done=n.backups_done, backups_failed=n.backups_failed,
            prefetches_started=n.prefetches_started, prefetches_in_flight=len(self.prefetches.prefetches),
            prefetch_skipped=n.prefetch_skipped,
            prefetch_ends=PrefetchEndCounts(**{e.value: k for e, k in n.prefetch_ends.items()}),
            storage_hit_tokens=n.storage_hit_tokens, stored_tokens=n.stored_tokens,
            backups_in_flight=len(self.backups.stores),
            facts_pending=self.agreement.pending(), facts_unknown=self.agreement.unknown(),
            host_hit_storage_tokens=n.host_hit_storage_tokens,
        )

    def idle(self) -> bool:
        """No handle held and nothing in flight."""
        return not (self.admission.busy() or self.writes.busy() or self.prefetches.busy()
                    or self.backups.stores or self.agreement.pending())

    def digest(self, op_id: int) -> None:
        """A digest of the logical state: nodes (pages, state, locks, pins, storage), in-flight
        prefetches and the host mirror; slot numbers are left out. Ranks of a group agree on it."""
        h = hashlib.blake2b(digest_size=16)
        for node in self.tree.walk():
            h.update(node.hashes[-1].to_bytes(HASH_BYTES, "little"))
            h.update(struct.pack("<qiiii?", node.tokens, list(NodeState).index(node.state),
                                 node.lock_ref, node.host_ref, node.op, node.stored))
        prefetches = self.prefetches.prefetches
        for op in sorted(prefetches):
            pf = prefetches[op]
            h.update(struct.pack("<qqqq", op, pf.reserved, pf.hit, pf.read))
        h.update(struct.pack("<qq", self.host_free, self.agreement.pending()))
        self.shared.emit(FACADE, TreeDigest(op_id=op_id, digest=h.hexdigest(),
                                            host_used=self.config.host_buffer_slots - self.host_free))

    def check_invariants(self) -> None:
        self.tree.check_invariants()
        self._check_host_mirror()
        for part in (self.prefetches, self.backups, self.writes, self.admission, self.agreement):
            part.check_invariants()
        self._check_nodes()
        self._check_leaks()

    def _check_host_mirror(self) -> None:
        unassigned = self.writes.unassigned_tokens()
        prefetching = self.prefetches.reserved_tokens()
        cap = self.config.host_buffer_slots
        if self.host_free != cap - self.tree.host_tokens - unassigned - prefetching:
            raise InvariantError(
                f"tree: host mirror says {self.host_free} free, but capacity {cap} - {self.tree.host_tokens} "
                f"held by nodes - {unassigned} being reserved - {prefetching} reserved by prefetches differs"
            )

    def _check_nodes(self) -> None:
        """Every node WRITING or LOADING has its operation in flight; writes stay prefix-closed."""
        writes, loads = self.writes.writes, self.admission.loads
        for node in self.tree.walk():
            if node.state is NodeState.WRITING and node.op not in writes:
                raise InvariantError(f"tree: {node} is WRITING without a write in flight")
            parent = node.parent
            if (node.state is NodeState.WRITING and parent is not None and not parent.is_root
                    and parent.state not in BACKED and parent.state is not NodeState.WRITING
                    and not writes[node.op].doomed):
                raise InvariantError(f"tree: {node} is written under {parent}, which is not backed up and "
                                     "whose write did not fail (backup must stay prefix-closed)")
            if node.state is NodeState.LOADING and node.op not in loads:
                raise InvariantError(f"tree: {node} is LOADING without a load in flight")

    def _check_leaks(self) -> None:
        """With nothing that pins or locks in flight, no node is pinned or locked."""
        if not self.prefetches.busy() and not self.backups.stores:
            pinned = [nd for nd in self.tree.walk() if nd.host_ref]
            if pinned:
                raise InvariantError(f"tree: no prefetch and no backup to storage in flight, yet {pinned[:3]} are "
                                     "host-pinned (a leaked pin)")
        if not self.admission.holds_locks() and not self.writes.writes:
            held = [nd for nd in self.tree.walk() if nd.lock_ref]
            if held or self.tree.protected_tokens:
                raise InvariantError(
                    f"tree: no request and no write holds a lock, yet {held[:3]} are locked and "
                    f"{self.tree.protected_tokens} tokens protected (a leaked lock ref)"
                )
