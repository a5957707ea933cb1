"""`HiCache`: the synchronous, batch-first facade a scheduler embeds (one per rank).

Every call takes a batch and costs one round trip to the actors in the common
case, so a scheduler calls it once or twice per tick. The facade keeps the
scheduler-side view of each live request (its committed tokens and the device
slot of every position) and checks every call before it reaches an actor: an
unknown request, finishing twice, committing more than was allocated or a stale
handle is a clear error here, and the actors keep running.

Lifecycle of a request::

    [prefetch -> ready ...] -> admit -> [start_loads, wait per layer] -> allocate/commit ...
          -> (cache_unfinished ...) -> finish | abort | retract   (a retracted request may be admitted again)

With storage (L3), a queued request may first get a prefetch (`prefetch`); it is
admitted once `ready` reports it (its prefetch terminated by the policy, its
pages kept as host-only nodes that admission loads back). With several
tensor-parallel ranks, call `sync` once per tick on every rank: it agrees on the
rank-local outcomes (acks, storage hits) and applies them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.messages import (
    ActorName,
    AdmitItem,
    AdmitRequests,
    Admitted,
    ApplyFacts,
    DigestTree,
    FactsApplied,
    LocalFacts,
    PrefetchEnd,
    PrefetcherStatistics,
    PrefetchesSettled,
    PrefetchesStarted,
    PrefetchesStopped,
    PrefetchReadiness,
    PrefetchRequests,
    PrefetchStates,
    ReportFacts,
    SettlePrefetches,
    TerminatePrefetches,
    TreeDigest,
    AllocateSlots,
    CacheItem,
    Cached,
    CacheUnfinished,
    CommitSlots,
    DeviceStatistics,
    EvictDevice,
    Evicted,
    EvictHost,
    FinishItem,
    Finished,
    FinishRequests,
    GetStatistics,
    HostStatistics,
    Indices,
    LedgerEntry,
    Message,
    ReleaseReason,
    SlotDemand,
    SlotsInsufficient,
    StartLoads,
    StreamStatistics,
    Tokens,
    TreeStatistics,
)

from ._actor import HiActor
from ._group import Group, SingleGroup
from ._layers import LayerWaiter
from ._system import Runtime, System
from .config import Config

FINISHED_REMEMBERED_MAX = 1 << 16
"""Ended request ids remembered to tell "finished twice" from "never admitted"."""


class RequestError(ValueError):
    """A facade call named a request in a way its lifecycle does not allow."""


class ExpiredHandleError(RequestError):
    """A handle was used after `cache_unfinished` replaced it or its request ended."""


@dataclass(frozen=True, slots=True)
class CacheHandle:
    """Opaque: what a request holds while it lives. Pass it to finish, abort, retract, cache."""

    request_id: str
    _token: int


@dataclass(frozen=True, slots=True)
class Request:
    """A request to admit: its id, prompt tokens and namespace (model / LoRA / cache salt)."""

    request_id: str
    tokens: Sequence[int] | torch.Tensor
    namespace: str = ""


@dataclass(frozen=True, slots=True)
class AdmitResult:
    request_id: str
    handle: CacheHandle
    device_indices: torch.Tensor
    """Slots of the cached prefix (`cached_tokens` of them); loads into some may still run."""
    device_hit: int
    """Prefix tokens already in device memory."""
    host_hit: int
    """Prefix tokens loaded back from host now (wait per layer before reading them)."""
    host_miss: int
    """Tokens in host memory that were not loaded back (quota, minimum length)."""

    @property
    def cached_tokens(self) -> int:
        return self.device_hit + self.host_hit


@dataclass(frozen=True, slots=True)
class Insufficient:
    """An allocation that does not fit even after eviction; nothing was allocated."""

    requested_slots: int
    free_slots: int
    shortfall_slots: int


@dataclass(frozen=True, slots=True)
class HiCacheStatistics:
    tree: TreeStatistics
    device: DeviceStatistics
    host: HostStatistics
    write: StreamStatistics
    load: StreamStatistics
    prefetch: PrefetcherStatistics


@dataclass(slots=True)
class _Live:
    handle: CacheHandle
    namespace: str
    chunks: list[torch.Tensor]
    """Committed tokens in order (the cached prefix first), one tensor per commit; `tokens()` joins them."""
    slots: torch.Tensor
    """Device slot of every committed or allocated position."""
    committed: int

    def tokens(self) -> torch.Tensor:
        """Every committed token (int64), joined once and kept joined."""
        if len(self.chunks) != 1:
            self.chunks = [torch.cat(self.chunks) if self.chunks else torch.empty(0, dtype=torch.int64)]
        return self.chunks[0]


class HiCache:
    """Start from a `Config`; use as a context manager (or `start()` / `close()`)."""

    def __init__(
        self,
        config: Config | None = None,
        *,
        runtime: Runtime | None = None,
        actor_classes: Mapping[ActorName, type[HiActor]] | None = None,
        group: Group | None = None,
    ) -> None:
        self.config = config or Config()
        self.group: Group = group or SingleGroup()
        if (self.group.size, self.group.rank) != (self.config.tp_size, self.config.tp_rank):
            raise ValueError(
                f"the group is rank {self.group.rank} of {self.group.size} but the config says tp_rank="
                f"{self.config.tp_rank}, tp_size={self.config.tp_size}; make them equal"
            )
        self.system = System(self.config, runtime=runtime, actor_classes=actor_classes)
        self._live: dict[str, _Live] = {}
        self._prefetching: dict[str, int] = {}
        """Queued requests with a storage prefetch in flight, and the host tokens reserved for it."""
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._ops = self.system.services.ids

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> HiCache:
        self.system.start()
        return self

    def close(self) -> None:
        self.system.stop()

    def __enter__(self) -> HiCache:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def device_kv(self) -> Any:
        """The device KV buffer (`KVBuffer`; `.tensor` is `[2, layers, slots, heads, head_dim]`)."""
        return self.system.device_kv

    @property
    def host_kv(self) -> Any:
        return self.system.host_kv

    # -- admission and loads -------------------------------------------------------

    def admit(self, requests: Iterable[Request]) -> list[AdmitResult]:
        """Match each request's prompt, lock its cached prefix, start load-back of host hits."""
        reqs = list(requests)
        seen: set[str] = set()
        for r in reqs:
            if r.request_id in self._live or r.request_id in seen:
                raise RequestError(f"request {r.request_id!r} is already admitted; finish, abort or retract it first")
            if r.request_id in self._prefetching:
                raise RequestError(f"request {r.request_id!r} has a storage prefetch in flight; admit it once "
                                   "ready() reports it, or abort it by id")
            if r.request_id in self._ended:  # its ledger is closed for good (seed 001); only retract keeps an id
                raise RequestError(f"request {r.request_id!r} already {self._ended[r.request_id]}; "
                                   "a finished or aborted request id is never admitted again")
            seen.add(r.request_id)
        items = tuple(
            AdmitItem(request_id=r.request_id, namespace=r.namespace, tokens=Tokens.from_tensor(_tokens(r.tokens)))
            for r in reqs
        )
        reply = self._call(ActorName.TREE, AdmitRequests, Admitted, items=items)
        out = []
        for r, adm in zip(reqs, reply.admissions, strict=True):
            handle = CacheHandle(r.request_id, adm.handle)
            slots = adm.device.as_tensor().clone()
            cached = adm.device_hit + adm.host_hit
            prompt = _tokens(r.tokens)
            self._live[r.request_id] = _Live(handle, r.namespace, [prompt[:cached].clone()], slots, cached)
            out.append(AdmitResult(r.request_id, handle, slots, adm.device_hit, adm.host_hit, adm.host_miss))
        return out

    # -- storage prefetch (L3 -> host) ----------------------------------------------------

    def prefetch(self, requests: Iterable[Request]) -> dict[str, int]:
        """Start storage prefetches for queued requests whose part missing from L1/L2 reaches
        `prefetch_threshold_pages` (and the rate limit allows). Returns the host tokens reserved
        per request (0: no prefetch). Admit a prefetching request only after `ready` reports it."""
        reqs = list(requests)
        seen: set[str] = set()
        for r in reqs:
            if r.request_id in self._live or r.request_id in self._prefetching or r.request_id in seen:
                raise RequestError(f"request {r.request_id!r} is already admitted or prefetching")
            if r.request_id in self._ended:
                raise RequestError(f"request {r.request_id!r} already {self._ended[r.request_id]}")
            seen.add(r.request_id)
        items = tuple(
            AdmitItem(request_id=r.request_id, namespace=r.namespace, tokens=Tokens.from_tensor(_tokens(r.tokens)))
            for r in reqs
        )
        reply = self._call(ActorName.TREE, PrefetchRequests, PrefetchesStarted, items=items)
        out = {}
        for r, n in zip(reqs, reply.tokens, strict=True):
            out[r.request_id] = n
            if n:
                self._prefetching[r.request_id] = n
        return out

    def ready(self, request_ids: Iterable[str]) -> dict[str, int]:
        """Which of these queued requests may be admitted now: those without a prefetch, and
        those whose prefetch may terminate under `prefetch_policy` on every rank. Those
        prefetches are stopped and settled first: the agreed pages become host-only nodes.
        Returns, per ready request, the tokens it got from storage."""
        ids = list(dict.fromkeys(request_ids))
        local = self._call(ActorName.TREE, PrefetchStates, PrefetchReadiness, request_ids=tuple(ids)).ready
        agreed = self.group.all_min([int(x) for x in local])
        go = [rid for rid, ok in zip(ids, agreed, strict=True) if ok]
        got = self._terminate([rid for rid in go if rid in self._prefetching], PrefetchEnd.BEST_EFFORT)
        return {rid: got.get(rid, 0) for rid in go}

    @property
    def prefetching(self) -> tuple[str, ...]:
        """Queued requests with a storage prefetch in flight."""
        return tuple(self._prefetching)

    def _terminate(self, ids: list[str], reason: PrefetchEnd) -> dict[str, int]:
        """Stop, agree on the complete pages, settle: the one path that ends a prefetch."""
        stopped = self._call(ActorName.TREE, TerminatePrefetches, PrefetchesStopped,
                             request_ids=tuple(ids), reason=reason).pages
        pages = self.group.all_min(list(stopped))
        settled = self._call(ActorName.TREE, SettlePrefetches, PrefetchesSettled,
                             request_ids=tuple(ids), pages=tuple(pages)).tokens
        for rid in ids:
            del self._prefetching[rid]
        return dict(zip(ids, settled, strict=True))

    def sync(self) -> None:
        """Agree with the other ranks on rank-local outcomes and apply them (once per tick on
        every rank). With one rank the tree applies them as they arrive and this does nothing."""
        if self.group.size == 1:
            return
        facts = self._call(ActorName.TREE, ReportFacts, LocalFacts)
        counts = self.group.all_min(list(facts.known))
        mine: list[int] = []
        at = 0
        for known, n in zip(facts.known, counts, strict=True):
            mine.extend(facts.values[at : at + n])
            at += known
        values = self.group.all_min(mine)
        self._call(ActorName.TREE, ApplyFacts, FactsApplied, counts=tuple(counts), values=tuple(values))

    def tree_digest(self) -> tuple[str, int]:
        """A digest of the tree's logical state and the host tokens it holds or reserved:
        equal on every rank of a group after each `sync`."""
        reply = self._call(ActorName.TREE, DigestTree, TreeDigest)
        return reply.digest, reply.host_used

    def start_loads(self) -> LayerWaiter:
        """Start every queued load-back as one batch; the forward pass waits per layer on the result."""
        started = self.system.ask(ActorName.LOAD, StartLoads())
        assert self.system.ring is not None
        return self.system.ring.waiter(started.batch)

    # -- slots ------------------------------------------------------------------------

    def allocate(self, demands: Mapping[str, int]) -> dict[str, torch.Tensor] | Insufficient:
        """Device slots for the next tokens of many requests, all or nothing. If the pool is
        short, the tree evicts and the allocation is tried once more."""
        for rid, n in demands.items():
            self._req(rid)
            if not isinstance(n, int) or n < 0:
                raise RequestError(f"request {rid!r}: cannot allocate {n!r} slots")
        reply = self._allocate(demands)
        if isinstance(reply, SlotsInsufficient):
            self._call(ActorName.TREE, EvictDevice, Evicted, tokens=reply.shortfall_slots)
            reply = self._allocate(demands)
        if isinstance(reply, SlotsInsufficient):
            return Insufficient(reply.requested_slots, reply.free_slots, reply.shortfall_slots)
        out = {}
        for grant in reply.grants:
            live = self._live[grant.request_id]
            new = grant.indices.as_tensor()
            live.slots = torch.cat([live.slots, new])
            out[grant.request_id] = new.clone()
        return out

    def _allocate(self, demands: Mapping[str, int]) -> Any:
        op = self._ops.next("facade-op")
        items = tuple(SlotDemand(request_id=r, tokens=n) for r, n in demands.items())
        return self.system.ask(ActorName.DEVICE, AllocateSlots(op_id=op, demands=items))

    def commit(self, tokens: Mapping[str, Sequence[int] | torch.Tensor]) -> None:
        """Record that the KV of these new tokens (per request, in order) is written."""
        batch = []
        for rid, toks in tokens.items():
            live = self._req(rid)
            new = _tokens(toks).clone()
            if live.committed + len(new) > len(live.slots):
                raise RequestError(
                    f"request {rid!r}: committing {len(new)} tokens makes {live.committed + len(new)} committed "
                    f"but only {len(live.slots)} slots are allocated (allocate before writing KV)"
                )
            batch.append((rid, live, new))
        # Nothing to record for an empty commit (a request on a full cache hit may have no ledger yet).
        demands = tuple(SlotDemand(request_id=rid, tokens=len(new)) for rid, _, new in batch if len(new))
        if demands:
            self.system.ask(ActorName.DEVICE, CommitSlots(op_id=self._ops.next("facade-op"), demands=demands))
        for _, live, new in batch:
            live.chunks.append(new)
            live.committed += len(new)

    def allocated(self, request_id: str) -> int:
        """Positions of a live request that have a slot (committed or not)."""
        return len(self._req(request_id).slots)

    def slots(self, request_id: str) -> torch.Tensor:
        """Device slot of every committed or allocated position of a live request."""
        return self._req(request_id).slots.clone()

    def committed_tokens(self, request_id: str) -> list[int]:
        return self._req(request_id).tokens().tolist()

    # -- leaving ------------------------------------------------------------------------

    def finish(self, handles: Iterable[CacheHandle]) -> list[LedgerEntry]:
        return self._end(handles, ReleaseReason.FINISHED)

    def abort(self, requests: Iterable[CacheHandle | str]) -> list[LedgerEntry]:
        """End admitted requests (by handle) and queued ones with a prefetch in flight (by id).
        A prefetch is released through the same path as `ready` (stopped, agreed, settled),
        even mid-I/O. Returns the ledgers of the admitted ones."""
        return self._end(requests, ReleaseReason.ABORTED)

    def retract(self, requests: Iterable[CacheHandle | str]) -> list[LedgerEntry]:
        """Give a request's memory back (a queued one's prefetch too); it may come back under the same id."""
        return self._end(requests, ReleaseReason.RETRACTED)

    def _end(self, requests: Iterable[CacheHandle | str], reason: ReleaseReason) -> list[LedgerEntry]:
        items = list(requests)
        # Only abort and retract take ids (of prefetching requests); finish needs handles.
        queued = [r for r in items if isinstance(r, str)] if reason is not ReleaseReason.FINISHED else []
        for rid in queued:
            if rid not in self._prefetching:
                raise RequestError(f"request {rid!r} has no prefetch in flight; pass the CacheHandle of an "
                                   "admitted request instead of its id")
        if len(set(queued)) != len(queued):
            raise RequestError(f"a request appears twice in one call: {queued}")
        hs = self._check_handles([r for r in items if r not in queued])
        if queued:
            ended = PrefetchEnd.RETRACTED if reason is ReleaseReason.RETRACTED else PrefetchEnd.ABORTED
            self._terminate(queued, ended)
            if reason is not ReleaseReason.RETRACTED:
                for rid in queued:
                    self._ended[rid] = reason.value
        if not hs:
            return []
        items = tuple(
            FinishItem(request_id=h.request_id, handle=h._token, reason=reason,
                       tokens=Tokens.from_tensor(self._live[h.request_id].tokens()),
                       device=Indices.from_tensor(self._committed_slots(h.request_id)))
            for h in hs
        )
        reply = self._call(ActorName.TREE, FinishRequests, Finished, items=items)
        for h in hs:
            del self._live[h.request_id]
            if reason is not ReleaseReason.RETRACTED:
                self._ended[h.request_id] = reason.value
                while len(self._ended) > FINISHED_REMEMBERED_MAX:
                    self._ended.popitem(last=False)
        return list(reply.entries)

    def cache_unfinished(self, handles: Iterable[CacheHandle]) -> list[CacheHandle]:
        """After a prefill chunk: cache each request's committed prefix, switch it to the
        tree's slots and move its lock. Returns the new handles (the old ones expire)."""
        hs = self._check_handles(handles)
        items = tuple(
            CacheItem(request_id=h.request_id, handle=h._token, tokens=Tokens.from_tensor(self._live[h.request_id].tokens()),
                      device=Indices.from_tensor(self._committed_slots(h.request_id)))
            for h in hs
        )
        reply = self._call(ActorName.TREE, CacheUnfinished, Cached, items=items)
        if reply.refused:
            raise RequestError(
                f"request(s) {list(reply.refused)}: the cached prefix was lost to a failed load-back, so "
                "nothing was cached; abort or retract them (the whole batch was refused)"
            )
        out = []
        for h, prefix in zip(hs, reply.prefixes, strict=True):
            live = self._live[h.request_id]
            tree_slots = prefix.device.as_tensor()
            live.slots = torch.cat([tree_slots, live.slots[len(tree_slots):]])
            live.handle = CacheHandle(h.request_id, prefix.handle)
            out.append(live.handle)
        return out

    # -- eviction, numbers, checks ---------------------------------------------------------

    def quiesce(self, timeout_s: float = 60.0) -> None:
        """Wait until every write-through, load-back and backup to storage in flight has been
        acknowledged and applied. With several ranks, call it on every rank: it agrees too."""
        while True:
            self.system.quiesce(timeout_s)
            if self.group.size == 1:
                return
            self.sync()
            # Applying outcomes may issue more (a landed write starts its backup): agree until none
            # is pending. The count is agreed state, so every rank leaves after as many syncs.
            if not self.system.ask(ActorName.TREE, GetStatistics()).facts_pending:
                return

    def evict_device(self, tokens: int) -> int:
        """Free at least `tokens` device slots held by the cache if it can; returns how many."""
        return self._call(ActorName.TREE, EvictDevice, Evicted, tokens=tokens).device_tokens

    def evict_host(self, tokens: int) -> int:
        return self._call(ActorName.TREE, EvictHost, Evicted, tokens=tokens).host_tokens

    def statistics(self) -> HiCacheStatistics:
        s = self.system.statistics()
        return HiCacheStatistics(tree=s[ActorName.TREE], device=s[ActorName.DEVICE], host=s[ActorName.HOST],
                                 write=s[ActorName.WRITE], load=s[ActorName.LOAD], prefetch=s[ActorName.PREFETCH])

    def check_invariants(self) -> None:
        """Every actor checks its core; the facade checks its own view against the ledger."""
        self.system.check_invariants()
        for rid, live in self._live.items():
            if live.committed != len(live.tokens()) or live.committed > len(live.slots):
                raise AssertionError(f"facade: request {rid!r} has {live.committed} committed, "
                                     f"{len(live.tokens())} tokens, {len(live.slots)} slots")

    @property
    def live_requests(self) -> tuple[str, ...]:
        return tuple(self._live)

    # -- helpers -------------------------------------------------------------------------------

    def _call(self, to: ActorName, verb: type[Message], reply: type[Message], **fields: Any) -> Any:
        """Tell and wait for the reply. No reply waits for an agreement: with several ranks the
        tree answers an eviction (or an admission that evicted) without waiting for its
        write-backs, whose slots go when their agreed acks apply. A `sync` run while a reply is
        still on its way would read that reply as stray mail."""
        op = self._ops.next("facade-op")
        self.system.tell(to, verb(op_id=op, **fields))
        return self.system.await_reply(op, reply)

    def _req(self, rid: str) -> _Live:
        live = self._live.get(rid)
        if live is not None:
            return live
        if rid in self._ended:
            raise RequestError(f"request {rid!r} already {self._ended[rid]}; it has no slots any more")
        raise RequestError(f"request {rid!r} is unknown: admit it first")

    def _check_handles(self, handles: Iterable[CacheHandle]) -> list[CacheHandle]:
        hs = list(handles)
        seen: set[str] = set()
        for h in hs:
            if not isinstance(h, CacheHandle):
                raise RequestError(f"expected a CacheHandle from admit() or cache_unfinished(), got {h!r}")
            live = self._req(h.request_id)
            if live.handle != h:
                raise ExpiredHandleError(
                    f"handle of request {h.request_id!r} has expired: cache_unfinished() replaced it; "
                    "use the handle it returned"
                )
            if h.request_id in seen:
                raise RequestError(f"request {h.request_id!r} appears twice in one call")
            seen.add(h.request_id)
        return hs

    def _committed_slots(self, rid: str) -> torch.Tensor:
        live = self._live[rid]
        return live.slots[: live.committed]


def _tokens(tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    t = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(list(tokens), dtype=torch.int64)
    if t.dim() != 1:
        raise RequestError(f"tokens must be one sequence, got shape {tuple(t.shape)}")
    return t.to(torch.int64)
