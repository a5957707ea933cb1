"""The prefetch book: storage prefetches (L3 -> host) from their reservation to their settlement.

Reserve host slots (evict, else shrink to fit), pin the anchor -> `AllocateHost` ->
`Prefetch` -> agreed hit: free the surplus, `ReadPrefetch` -> terminated by the facade
(`StopPrefetch`) -> agreed pages settled in one place: host-only nodes, everything else
freed. What a settled prefetch brought stays host-pinned until its request is admitted
or leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hicache.messages import (
    AdmitItem,
    AllocateHost,
    FreeHostSlots,
    HostSlotState,
    Indices,
    Prefetch,
    PrefetchEnd,
    PrefetchesSettled,
    PrefetchesStarted,
    PrefetchesStopped,
    ReadPrefetch,
    SetHostState,
    StopPrefetch,
    Tokens,
)
from hicache.messages.config import PrefetchPolicy

from ._errors import InvariantError
from ._facts import FactKind
from ._radix_node import BACKED, Node, NodeState
from ._tree_holds import SettledHolds
from ._tree_shared import FACADE, HOST, PREFETCH, HandleError, TreeShared, cat
from ._tree_writes import WriteBack

_LEFT = (PrefetchEnd.ABORTED, PrefetchEnd.RETRACTED)
"""Ends after which the request is gone: nothing is held for it."""


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


class PrefetchBook:
    """Owns the prefetches in flight and their terminations; what settled ones hold is in `holds`."""

    def __init__(self, shared: TreeShared, writes: WriteBack) -> None:
        self.s = shared
        self._writes = writes
        self.prefetches: dict[int, _Prefetch] = {}
        self._prefetch_of: dict[str, int] = {}
        self._prefetch_tokens = 0
        """Host tokens reserved by prefetches: what the rate limit counts."""
        self._terminations: dict[int, _Termination] = {}
        self._termination_of: dict[int, int] = {}
        self.holds = SettledHolds(shared.tree)
        """What settled prefetches brought, held for their requests."""

    # == start ================================================================================

    def prefetch(self, op_id: int, items: Sequence[AdmitItem]) -> None:
        """Start a prefetch for each request whose part missing from L1/L2 is long enough."""
        for it in items:
            if it.request_id in self._prefetch_of:
                raise HandleError(f"request {it.request_id!r} already has a prefetch in flight")
        started = tuple(self._start_prefetch(it) for it in items)
        self.s.emit(FACADE, PrefetchesStarted(op_id=op_id, tokens=started))

    def _start_prefetch(self, item: AdmitItem) -> int:
        s = self.s
        if not s.storage:
            return 0
        p, cfg = s.page_size, s.config
        tokens = item.tokens
        n = len(tokens) - len(tokens) % p
        path = s.tree.match(item.namespace, tokens)
        matched = sum(nd.tokens for nd in path)
        if n - matched < cfg.prefetch_threshold_pages * p:
            return 0
        anchor, start = self._anchor(item.namespace, path)
        # Only what L1 and L2 miss is read; the rate limit, like the host space below, shrinks it
        # to what it leaves while that is worth it.
        want = self._reserve(n - matched, self._rate_room())
        if not want:
            s.n.prefetch_skipped += 1
            return 0
        s.tree.pin_host(anchor, +1)  # before evicting host memory: the anchor must stay
        if s.host_free < want:
            self._writes.evict_host(want - s.host_free)
        free = s.host_free
        got = self._reserve(want, free)
        self._check_reservation(want, free, got)
        want = got
        if not want:
            s.tree.pin_host(anchor, -1)
            s.n.prefetch_skipped += 1
            return 0
        self._back_up_held(path, anchor)
        op, held = s.next_id(), matched - start
        toks = tokens[start : matched + want]
        hashes = s.tree.chain(anchor, toks)
        keys = s.storage_keys(hashes[held // p :])
        pf = _Prefetch(op, item.request_id, anchor, toks, held, hashes, keys, want, s.now(), self._timeout(want))
        self.prefetches[op] = pf
        self._prefetch_of[item.request_id] = op
        s.host_free -= want
        self._prefetch_tokens += want
        s.n.prefetches_started += 1
        s.agreement.expect(FactKind.HIT, op)
        s.emit(HOST, AllocateHost(op_id=op, tokens=want))
        return want

    def _back_up_held(self, path: list[Node], anchor: Node) -> None:
        """Start the backups of the matched nodes after the anchor that are in device memory
        only: the prefetched pages attach after them once they are backed up (a host-only node
        never hangs under one that is not)."""
        if not self.s.config.host_tier:
            return
        after = anchor.is_root
        for nd in path:
            if (after and nd.state is NodeState.DEVICE and not nd.op
                    and not self._writes.start_backup(nd, evict_after=False)):
                return
            after = after or nd is anchor

    def _anchor(self, namespace: str, path: list[Node]) -> tuple[Node, int]:
        """The deepest backed-up node of the match (eviction can never delete it), or the root;
        and the tokens up to its end, where the prefetched pages start."""
        anchor, start, pos = self.s.tree.root(namespace), 0, 0
        for nd in path:
            pos += nd.tokens
            if nd.state in BACKED:
                anchor, start = nd, pos
        return anchor, start

    def _rate_room(self) -> int:
        """Tokens more that may be prefetching under `prefetch_rate_fraction` of the host slots."""
        cfg = self.s.config
        return int(cfg.prefetch_rate_fraction * cfg.host_slots) - self._prefetch_tokens

    def _reserve(self, want: int, room: int) -> int:
        """Tokens to reserve for a prefetch of `want` within `room` (free host space, or what the
        rate limit leaves; 0: none): all of it if it fits, else the page-aligned room if that
        still meets the threshold (SGLang #16370: shrink to the free space rather than give up)."""
        if want <= room:
            return want
        fit = room - room % self.s.page_size
        return fit if fit >= self.s.config.prefetch_threshold_pages * self.s.page_size else 0

    def _check_reservation(self, want: int, free: int, got: int) -> None:
        """The reservation against free host space, checked as a property of its result: all
        of `want` when it fits, else as many whole pages as are free, and none only when that
        is below the threshold."""
        p = self.s.page_size
        whole = free - free % p
        ok = got == want if want <= free else (got == whole if whole >= self.s.config.prefetch_threshold_pages * p
                                               else got == 0)
        if not ok:
            raise InvariantError(
                f"tree: a prefetch of {want} tokens reserved {got} host tokens with {free} free (SGLang #16370: "
                "shrink to the page-aligned free space when that still meets the threshold)"
            )

    def _timeout(self, tokens: int) -> float:
        cfg = self.s.config
        return min(cfg.prefetch_timeout_base_s + cfg.prefetch_timeout_per_1k_s * tokens / 1000, cfg.prefetch_timeout_max_s)

    # == replies ==============================================================================

    def on_host_allocated(self, op: int, pages: Indices | None) -> bool:
        """The host pool's answer, if `op` is a prefetch's reservation (False: it is not)."""
        pf = self.prefetches.get(op)
        if pf is None:
            return False
        pf.host_reply = True
        if pages is None:  # refused (an injected fault): it never reaches storage
            self.s.agreement.record(FactKind.HIT, pf.op, 0)
            if pf.stopping:
                self.on_prefetch_stopped(pf.op, 0)
            return True
        pf.host = pages
        self.s.emit(PREFETCH, Prefetch(op_id=pf.op, keys=pf.keys, host=pages))
        if pf.stopping:
            self.s.emit(PREFETCH, StopPrefetch(op_id=pf.op))
        return True

    def hit(self, op: int, pages: int) -> None:
        """The agreed hit: free the surplus pages now, read the rest (unless stopping already)."""
        pf = self.prefetches.get(op)
        if pf is None:  # settled already: everything it held was freed then
            return
        s = self.s
        pf.hit = min(pages, len(pf.keys))
        keep = pf.hit * s.page_size
        surplus = pf.reserved - keep
        if surplus:
            if pf.host is not None:
                s.emit(HOST, FreeHostSlots(pages=pf.host[pf.hit :]))
                pf.host = pf.host[: pf.hit]
            pf.reserved = keep
            s.host_free += surplus
            self._prefetch_tokens -= surplus
        if pf.hit and not pf.stopping and pf.host is not None:
            pf.read = pf.hit
            s.emit(HOST, SetHostState(pages=pf.host, state=HostSlotState.PREFETCHING))
            s.emit(PREFETCH, ReadPrefetch(op_id=op, pages=pf.hit))

    def on_prefetch_progress(self, op: int, finished: bool) -> None:
        pf = self.prefetches.get(op)
        if pf is not None:
            pf.local_finished = finished

    # == termination ==========================================================================

    def prefetch_states(self, request_ids: Sequence[str]) -> tuple[bool, ...]:
        """Per request: may its prefetch terminate now by this rank's view (no prefetch: yes)?"""
        out = []
        for rid in request_ids:
            op = self._prefetch_of.get(rid)
            out.append(True if op is None else self._may_terminate(self.prefetches[op]))
        return tuple(out)

    def _may_terminate(self, pf: _Prefetch) -> bool:
        policy = self.s.config.prefetch_policy
        complete = pf.hit == 0 or (pf.hit > 0 and pf.read > 0 and pf.local_finished)
        if policy is PrefetchPolicy.BEST_EFFORT or complete:
            return True
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            return False
        return self.s.now() - pf.started >= pf.timeout

    def terminate_prefetches(self, op_id: int, request_ids: Sequence[str], reason: PrefetchEnd) -> None:
        """Stop the prefetches; reply with each one's local final count once all stopped."""
        t = _Termination(op_id, [], set())
        for rid in request_ids:
            op = self._prefetch_of.get(rid, 0)
            t.ops.append(op)
            if not op:
                self.holds.release(rid)  # a ready request that leaves before admission
                continue
            pf = self.prefetches[op]
            if pf.stopping:
                raise HandleError(f"the prefetch of request {rid!r} is already being terminated")
            pf.stopping, pf.reason = True, reason
            t.waiting.add(op)
            self._termination_of[op] = op_id
        self._terminations[op_id] = t
        for op in sorted(t.waiting):
            pf = self.prefetches[op]
            if pf.host_reply and pf.host is None:  # never reached the prefetcher
                pf.stopped = 0
                t.waiting.discard(op)
                del self._termination_of[op]
            elif pf.host_reply:
                self.s.emit(PREFETCH, StopPrefetch(op_id=op))
            # else: the Stop follows the Prefetch once the host pool answers
        if not t.waiting:
            self._stopped_all(t)

    def on_prefetch_stopped(self, op: int, pages: int) -> None:
        pf = self.prefetches[op]
        pf.stopped = min(pages, pf.read)
        t = self._terminations[self._termination_of.pop(op)]
        t.waiting.discard(op)
        if not t.waiting:
            self._stopped_all(t)

    def _stopped_all(self, t: _Termination) -> None:
        del self._terminations[t.facade_op]
        pages = tuple(self.prefetches[op].stopped if op else 0 for op in t.ops)
        self.s.emit(FACADE, PrefetchesStopped(op_id=t.facade_op, pages=pages))

    # == settlement ===========================================================================

    def settle_prefetches(self, op_id: int, request_ids: Sequence[str], pages: Sequence[int]) -> None:
        """The one place a prefetch's pages are kept or freed, after the ranks agreed on `pages`."""
        out = []
        for rid, agreed in zip(request_ids, pages, strict=True):
            op = self._prefetch_of.get(rid)
            if op is None:
                out.append(0)
                continue
            pf = self.prefetches[op]
            if pf.stopped < 0:
                raise InvariantError(f"prefetch {op} of {rid!r} settled before its prefetcher stopped (SGLang #9302: a prefetch's pages are settled once, after the prefetcher stopped)")
            del self._prefetch_of[rid], self.prefetches[op]
            out.append(self._settle(pf, min(agreed, pf.read)))
        self.s.emit(FACADE, PrefetchesSettled(op_id=op_id, tokens=tuple(out)))

    def _settle(self, pf: _Prefetch, pages: int) -> int:
        s = self.s
        keep = pages * s.page_size
        kept = self._keep(pf, pages) if pf.host is not None else 0
        s.host_free += pf.reserved - kept
        self._prefetch_tokens -= pf.reserved
        s.tree.pin_host(pf.anchor, -1)
        s.n.prefetch_ends[self._end(pf, pages)] += 1
        s.n.storage_hit_tokens += keep
        return keep

    def _keep(self, pf: _Prefetch, pages: int) -> int:
        """Insert the first `pages` read pages as host-only nodes and free every other host page
        of the prefetch; the tokens the new nodes took."""
        s, p = self.s, self.s.page_size
        assert pf.host is not None
        keep = pages * p
        unused: list[Indices] = []
        kept = 0
        if keep:
            held = pf.held
            res = s.tree.insert_host(pf.anchor, pf.tokens[: held + keep], pf.host[:pages],
                                     pf.hashes[: (held + keep) // p], held=held)
            for nd in res.new:
                kept += nd.tokens
            new = cat([nd.host for nd in res.new])
            if len(new):
                s.emit(HOST, SetHostState(pages=new, state=HostSlotState.HOST_ONLY))
            unused.extend(res.unused)
            if res.last is not None and kept and pf.reason not in _LEFT:
                self.holds.hold(pf.request_id, res.last)  # for the admission that follows
        read = pf.host[pages : pf.read]  # read (or being read) and not kept
        if len(read):
            unused.append(read)
        prefetching = cat(unused)
        if len(prefetching):
            s.emit(HOST, SetHostState(pages=prefetching, state=HostSlotState.RESERVED))
        free = cat([prefetching, pf.host[pf.read :]])
        if len(free):
            s.emit(HOST, FreeHostSlots(pages=free))
        return kept

    def _end(self, pf: _Prefetch, pages: int) -> PrefetchEnd:
        """How the prefetch ended, for the statistics."""
        policy = self.s.config.prefetch_policy
        if pf.reason in _LEFT:
            return pf.reason
        if pf.hit == 0:
            return PrefetchEnd.MISS
        if pf.hit > 0 and pages == pf.hit:
            return PrefetchEnd.COMPLETE
        if policy is PrefetchPolicy.TIMEOUT:
            return PrefetchEnd.TIMEOUT
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            return PrefetchEnd.FAILED
        return PrefetchEnd.BEST_EFFORT

    # == numbers and checks =====================================================================

    def reserved_tokens(self) -> int:
        return sum(pf.reserved for pf in self.prefetches.values())

    def busy(self) -> bool:
        """A prefetch, a termination or a settled hold is in flight."""
        return bool(self.prefetches or self._terminations or self.holds)

    def check_invariants(self) -> None:
        cfg, p = self.s.config, self.s.page_size
        if self.reserved_tokens() != self._prefetch_tokens:
            raise InvariantError(f"tree: prefetches reserve {self.reserved_tokens()} tokens but the rate limit "
                                 f"counts {self._prefetch_tokens}")
        if self._rate_room() < 0:
            raise InvariantError(
                f"tree: {self._prefetch_tokens} tokens are prefetching, past the rate limit of "
                f"{cfg.prefetch_rate_fraction} x {cfg.host_slots} host slots"
            )
        for op, pf in self.prefetches.items():
            a = pf.anchor
            if not a.alive or not (a.is_root or (a.state in BACKED and a.host_ref > 0)):
                raise InvariantError(
                    f"tree: prefetch {op} of {pf.request_id!r} is anchored on {a}, which must be alive, backed "
                    "up and host-pinned (or a root) so that eviction cannot delete it"
                )
            if self._prefetch_of.get(pf.request_id) != op:
                raise InvariantError(f"tree: prefetch {op} is not the one of request {pf.request_id!r}")
            if pf.host is not None and len(pf.host) * p != pf.reserved:
                raise InvariantError(f"tree: prefetch {op} holds {len(pf.host)} host pages but reserved {pf.reserved} "
                                     "tokens")
        self.holds.check_invariants()
