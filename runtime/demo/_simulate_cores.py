"""The hit-rate-only engine of `hicache simulate`: the real cores, no actors and no KV bytes.

`TreeCore`, `DeviceCore` and `HostCore` take every decision as in production (matching,
locks, eviction by the configured policy, write-through by the configured write policy,
load-back, prefetch with its threshold, rate limit and shrink-to-fit, backup to storage);
what would move KV is answered at once and moves nothing: a write-through lands, a
load-back completes, and storage is a set of page keys with a capacity in pages (least
recently used pages evicted past it). Requests are served one at a time, as an engine
with no concurrency would: prefetch (with storage) until ready, admit the prompt minus
its last token, allocate (evicting when short), commit and finish. Because reads are
instant, the prefetch policies (which differ in how long a request waits) give the same
hits here.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hicache.actors import DeviceCore, HostCore, Insufficient, TreeCore
from hicache.messages import (
    ActorName,
    AdmitItem,
    Admitted,
    AdoptLoadedSlots,
    AllocateHost,
    AllocateLoadSlots,
    Evicted,
    FinishItem,
    Finished,
    FreeDeviceSlots,
    FreeHostSlots,
    Indices,
    LedgerEntry,
    LoadKV,
    Message,
    Prefetch,
    PrefetchEnd,
    PrefetchesSettled,
    PrefetchesStarted,
    PrefetchesStopped,
    ReadPrefetch,
    ReleaseReason,
    ReleaseRequests,
    SetHostState,
    StopPrefetch,
    StorePages,
    SwapRequestPages,
    Tokens,
    WriteKV,
)
from hicache.messages.config import Config, StorageKind


@dataclass(frozen=True, slots=True)
class Served:
    """What one request found: tokens hit per tier, and the prompt tokens computed."""

    looked_up: int
    device_hit: int
    host_hit: int
    """Loaded back from host memory, `storage_hit` included."""
    storage_hit: int
    computed: int


class PageStore:
    """Storage as page keys, at most `capacity_pages` of them (None: unbounded), LRU."""

    def __init__(self, capacity_pages: int | None) -> None:
        self.capacity_pages = capacity_pages
        self._keys: OrderedDict[str, None] = OrderedDict()
        self.evicted_pages = 0

    def exists(self, keys: tuple[str, ...]) -> int:
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            self._keys.move_to_end(k)
            n += 1
        return n

    def store(self, keys: tuple[str, ...]) -> int:
        """Store the keys; how many were new."""
        new = 0
        for k in keys:
            if k in self._keys:
                self._keys.move_to_end(k)
            else:
                self._keys[k] = None
                new += 1
        while self.capacity_pages is not None and len(self._keys) > self.capacity_pages:
            self._keys.popitem(last=False)
            self.evicted_pages += 1
        return new

    @property
    def pages(self) -> int:
        return len(self._keys)


class SimCores:
    """The three cores in this thread, every transfer answered at once (see the module doc)."""

    def __init__(self, config: Config, storage_pages: int | None = None) -> None:
        ids = itertools.count(1)
        self._next_id: Callable[[], int] = lambda: next(ids)
        self.config = config
        self.tree = TreeCore(config, self._next_id)
        self.device = DeviceCore(config)
        self.host = HostCore(config)
        self.store = PageStore(storage_pages) if config.storage is not StorageKind.NONE else None
        self._replies: dict[int, Message] = {}
        self._routes: dict[type, Callable[[Any], None]] = {
            AllocateHost: lambda m: self.tree.on_host_allocated(m.op_id, self.host.allocate_pages(m.tokens)),
            SetHostState: lambda m: self.host.transition(m.pages, m.state),
            FreeHostSlots: lambda m: self.host.free(m.pages),
            WriteKV: lambda m: self.tree.on_write_done(m.op_id),
            LoadKV: lambda m: self.tree.on_load_done(m.op_id),
            ReleaseRequests: self._release,
            SwapRequestPages: self._swap,
            AllocateLoadSlots: self._load_slots,
            AdoptLoadedSlots: lambda m: self.device.adopt_loaded(m.pages),
            FreeDeviceSlots: lambda m: self.device.free_tree(m.pages),
            Prefetch: self._prefetch,
            ReadPrefetch: self._read_pages,
            StopPrefetch: self._stop,
            StorePages: self._store,
        }
        self._read: dict[int, int] = {}
        """Pages each prefetch read (all it was asked to, at once)."""

    def serve(self, rid: str, prompt: Tokens) -> Served:
        """One request: its prefetch (with storage), admission of `prompt` minus its last
        token, slots for the rest (evicting if short), commit, finish."""
        item = AdmitItem(request_id=rid, namespace="", tokens=prompt[: len(prompt) - 1])
        stored = self._prefetched(item) if self.store is not None else 0
        [adm] = self._ask(lambda op: self.tree.admit(op, (item,)), Admitted).admissions
        cached = adm.device_hit + adm.host_hit
        rest = len(prompt) - cached
        got = self._allocate(rid, rest)
        self.device.commit_many([(rid, rest)])
        done = FinishItem(request_id=rid, handle=adm.handle, reason=ReleaseReason.FINISHED, tokens=prompt,
                          device=Indices.concat((adm.device, got)))
        self._ask(lambda op: self.tree.finish(op, (done,)), Finished)
        return Served(len(item.tokens), adm.device_hit, adm.host_hit, min(stored, adm.host_hit), rest)

    def _prefetched(self, item: AdmitItem) -> int:
        """Tokens a prefetch brought for `item` from storage (0: none started, or a miss)."""
        started = self._ask(lambda op: self.tree.prefetch(op, (item,)), PrefetchesStarted).tokens[0]
        if not started:
            return 0
        rid = (item.request_id,)
        pages = self._ask(lambda op: self.tree.terminate_prefetches(op, rid, PrefetchEnd.BEST_EFFORT),
                          PrefetchesStopped).pages
        return self._ask(lambda op: self.tree.settle_prefetches(op, rid, pages), PrefetchesSettled).tokens[0]

    def _allocate(self, rid: str, n: int) -> Indices:
        got = self.device.allocate_pages([(rid, n)])
        if isinstance(got, Insufficient):
            self._ask(lambda op: self.tree.evict_device(op, got.shortfall_slots), Evicted)
            got = self.device.allocate_pages([(rid, n)])
        if isinstance(got, Insufficient):
            raise RuntimeError(f"simulate: request {rid!r} needs {n} device slots; even after eviction {got}")
        return got[rid]

    def _ask(self, call: Callable[[int], None], reply: type) -> Any:
        """Run a tree verb and everything it leads to; its reply."""
        op = self._next_id()
        call(op)
        tree = self.tree
        while tree.outbox:
            out, tree.outbox = tree.outbox, []
            for to, message in out:
                if to is ActorName.FACADE:
                    self._replies[message.op_id] = message  # type: ignore[attr-defined]
                else:
                    self._routes[type(message)](message)
        got = self._replies.pop(op)
        assert isinstance(got, reply), got
        return got

    def _release(self, m: ReleaseRequests) -> None:
        views = self.device.release_many([(r.request_id, r.adopt, r.reason) for r in m.releases])
        self.tree.on_released(m.op_id, tuple(
            LedgerEntry(request_id=v.request_id, allocated=v.allocated, committed=v.committed, freed=v.freed)
            for v in views))

    def _swap(self, m: SwapRequestPages) -> None:
        self.device.swap(m.request_id, m.adopt, m.free)
        self.tree.on_swapped(m.op_id)

    def _load_slots(self, m: AllocateLoadSlots) -> None:
        pages = self.device.allocate_load_pages(m.tokens)
        if isinstance(pages, Insufficient):
            self.tree.on_load_slots(m.op_id, None, pages.shortfall_slots)
        else:
            self.tree.on_load_slots(m.op_id, pages, 0)

    def _prefetch(self, m: Prefetch) -> None:
        assert self.store is not None
        self.tree.on_prefetch_hit(m.op_id, self.store.exists(m.keys))

    def _read_pages(self, m: ReadPrefetch) -> None:
        self._read[m.op_id] = m.pages  # instant: every page asked for has arrived
        self.tree.on_prefetch_progress(m.op_id, m.pages, True)

    def _stop(self, m: StopPrefetch) -> None:
        self.tree.on_prefetch_stopped(m.op_id, self._read.pop(m.op_id, 0))

    def _store(self, m: StorePages) -> None:
        assert self.store is not None
        new = self.store.store(m.keys)
        self.tree.on_pages_stored(m.op_id, len(m.keys), new)

    def check_invariants(self) -> None:
        self.tree.check_invariants()
        self.device.check_invariants()
        self.host.check_invariants()

