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

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hicache.actors import ROUTES, Insufficient
from hicache.messages import (
    ActorName,
    AdmitItem,
    Admitted,
    Evicted,
    FinishItem,
    Finished,
    Indices,
    LoadDone,
    LoadKV,
    Message,
    PagesStored,
    Prefetch,
    PrefetchEnd,
    PrefetchesSettled,
    PrefetchesStarted,
    PrefetchesStopped,
    PrefetchHit,
    PrefetchProgress,
    PrefetchStopped,
    ReadPrefetch,
    ReleaseReason,
    StopPrefetch,
    StorePages,
    Tokens,
    WriteDone,
    WriteKV,
)
from hicache.messages.config import Config, StorageKind

from .._inline_cores import InlineCores


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


class SimCores(InlineCores):
    """The three cores in this thread, every transfer answered at once (see the module doc);
    each message goes through its receiver's route table, as between the actors."""

    def __init__(self, config: Config, storage_pages: int | None = None) -> None:
        super().__init__(config)
        self.config = config
        self.store = PageStore(storage_pages) if config.storage is not StorageKind.NONE else None
        self._played: dict[type[Message], Callable[[Any], Message]] = {
            WriteKV: lambda m: WriteDone(op_id=m.op_id, slots=len(m.device) * config.page_size),
            LoadKV: lambda m: LoadDone(op_id=m.op_id, batch=0, slots=len(m.device) * config.page_size),
            Prefetch: self._prefetch,
            ReadPrefetch: self._read_pages,
            StopPrefetch: lambda m: PrefetchStopped(op_id=m.op_id, pages=self._read.pop(m.op_id, 0)),
            StorePages: self._store,
        }
        """What the actors with no core here answer (the streams and the prefetcher), at once."""
        self._read: dict[int, int] = {}
        """Pages each prefetch read (all it was asked to, at once)."""

    def serve(self, rid: str, prompt: Tokens) -> Served:
        """One request: its prefetch (with storage), admission of `prompt` minus its last
        token, slots for the rest (evicting if short), commit, finish."""
        item = AdmitItem(request_id=rid, namespace="", tokens=prompt[: len(prompt) - 1])
        if self.store is not None:  # its admission tells which host hits the prefetch read, as the facade's does
            item = AdmitItem(request_id=rid, namespace="", tokens=item.tokens, stored=self._prefetched(item))
        [adm] = self._ask(lambda op: self.tree.admit(op, (item,)), Admitted).admissions
        cached = adm.device_hit + adm.host_hit
        rest = len(prompt) - cached
        got = self._allocate(rid, rest)
        done = FinishItem(request_id=rid, handle=adm.handle, reason=ReleaseReason.FINISHED, tokens=prompt[cached:],
                          device=got, allocs=0, commits=rest)  # what follows the cached prefix, committed with the release
        self._ask(lambda op: self.tree.finish(op, (done,)), Finished)
        return Served(len(item.tokens), adm.device_hit, adm.host_hit, adm.storage_hit, rest)

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
        got = self._run_outbox(op)
        assert isinstance(got, reply), got
        return got

    def _play(self, to: ActorName, message: Message) -> Message:
        """The streams and the prefetcher: every transfer answered at once."""
        ROUTES[to].check(ActorName.TREE, message)
        return self._played[type(message)](message)

    def _prefetch(self, m: Prefetch) -> PrefetchHit:
        assert self.store is not None
        return PrefetchHit(op_id=m.op_id, pages=self.store.exists(m.keys))

    def _read_pages(self, m: ReadPrefetch) -> PrefetchProgress:
        self._read[m.op_id] = m.pages  # instant: every page asked for has arrived
        return PrefetchProgress(op_id=m.op_id, pages=m.pages, finished=True, error="")

    def _store(self, m: StorePages) -> PagesStored:
        assert self.store is not None
        new = self.store.store(m.keys)
        return PagesStored(op_id=m.op_id, pages=len(m.keys), written=new, error="")

    def check_invariants(self) -> None:
        self.tree.check_invariants()
        self.device.check_invariants()
        self.host.check_invariants()

