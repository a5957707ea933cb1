"""`HiCache`: the synchronous, batch-first facade a scheduler embeds (one per rank).

Every call takes a batch and costs one round trip to the actors in the common case,
so a scheduler calls it once or twice per tick; a decode tick is one call,
`allocate(next_slots, commit=tokens_written)`. The facade keeps the scheduler-side
view of each live request (its committed tokens and the device slot of every
position) and checks every argument and every lifecycle step before anything reaches
an actor: a malformed argument, an unknown request, finishing twice, committing more
than was allocated or a stale handle is a one-line `RequestError`, and the actors
never see it.

Lifecycle of a request::

    [prefetch -> ready ...] -> admit -> [start_loads, wait per layer] -> allocate(commit=...) ...
          -> (cache_unfinished ...) -> finish | abort | retract   (a retracted request may be admitted again)

With storage (L3), a queued request may first get a prefetch (`prefetch`); it is
admitted once `ready` reports it (its prefetch terminated by the policy, its pages
kept as host-only nodes that admission loads back). With several tensor-parallel
ranks, call `sync` once per tick on every rank: it agrees on the rank-local outcomes
(acks, storage hits) and applies them.

One thread calls the facade: the one that started it (a call from another thread is a
`CacheStateError` at once), except `statistics`, which any thread may call. A call cut
short (its reply timeout, Ctrl-C) raises, and its late reply is undone or adopted by
the next call (see `_calls`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import pykka
import torch
import xxhash
from hicache.actors._logging import logger
from hicache.actors._errors import InvariantError
from hicache.actors._pages import SlotTable, new_pages
from hicache.messages._index import viewed
from hicache.messages import (
    ActorName,
    AdmitItem,
    AdmitRequests,
    Admitted,
    AllocateSlots,
    ApplyFacts,
    Cached,
    CacheItem,
    CacheUnfinished,
    DigestTree,
    EMPTY,
    EvictDevice,
    Evicted,
    EvictHost,
    FactsApplied,
    Finished,
    FinishItem,
    FinishRequests,
    GetStatistics,
    Indices,
    LedgerEntry,
    LoadsStarted,
    LocalFacts,
    Message,
    PrefetchEnd,
    PrefetchesSettled,
    PrefetchesStarted,
    PrefetchesStopped,
    PrefetchReadiness,
    PrefetchRequests,
    PrefetchStates,
    ReleaseReason,
    ReportFacts,
    SettlePrefetches,
    SlotDemand,
    SlotsAllocated,
    SlotsInsufficient,
    StartLoads,
    TerminatePrefetches,
    Tokens,
    TreeDigest,
)

from . import _facade_types as check
from hicache.actors._actor import HiActor
from ._calls import Interrupts, Pending
from ._engine_kv import DeviceKV
from ._kv_checks import LiveSlots
from ._facade_types import (
    AdmitResult,
    CacheHandle,
    CacheStateError,
    Closed,
    ExpiredHandleError,
    HiCacheStatistics,
    Insufficient,
    Request,
    RequestError,
    Room,
    TokenIds,
)
from ._group import Agreement, Group, SingleGroup, agree, agree_config
from hicache.actors._layers import LayerWaiter
from ._metrics import track, untrack
from ._statistics import cache_statistics
from ._timings import FacadeTimings
from ._system import DEFAULT_ASK_TIMEOUT_S, Runtime, System
from hicache.messages.config import Config

FINISHED_REMEMBERED_MAX = 1 << 16
"""Ended request ids remembered to tell "finished twice" from "never admitted"."""

CLOSE_DRAIN_TIMEOUT_S = 30.0
"""How long `close()` waits for writes and backups in flight by default."""

log = logger("hicache.facade")

_NO_TIMINGS = FacadeTimings()
"""Empty histograms, for the statistics of an instance without metrics."""

__all__ = [
    "AdmitResult", "CacheHandle", "CacheStateError", "Closed", "ExpiredHandleError", "HiCache",
    "HiCacheStatistics", "Insufficient", "Request", "RequestError", "Room",
]


@dataclass(slots=True)
class _Live:
    handle: CacheHandle
    namespace: str
    tokens: list[bytes | memoryview | bytearray]
    """Committed token ids (int64 bytes) in order, the cached prefix first: a view of the admitted
    prompt's bytes, which grows over the commits that continue the prompt (`along`); joined on
    demand. Small commits (decode steps) are appended to one bytearray at the end
    (`HiCache._record`), not kept an object each."""
    committed: int
    pages: list[Indices]
    """The device pages of its positions, in token order (the cached prefix's first); joined on
    demand, after `page_tail`."""
    allocated: int
    """Positions with a slot: the last page may be partly allocated."""
    last_page: int
    """The last of `pages` (-1: none yet), whose free slots the next allocation fills first."""
    ahead: bytes = b""
    """Pages the device gave it past the last of `pages` (int64 bytes, in order; see
    `Config.ahead_slots`): the next allocations take them here, after the last page's free
    slots, before any asks the device for more."""
    caching: bool = False
    """A `cache_unfinished` of it is in flight: its handle is being replaced."""
    unsent: int = 0
    """Committed slots the device has not been told of: `commit` is local, and the next message
    about the request (an allocation, a swap, its release) carries them."""
    allocs: int = 0
    """Slots it took from the free part of its last page that the device has not been told of:
    an allocation that fits there is local (it changes no page's owner), and the next message
    about the request carries them, before its commits."""
    prefix: int = 0
    """Tokens of the cached prefix its handle locks (whole pages): the tree has them, so a
    finish or a `cache_unfinished` sends only what comes after."""
    prompt: Tokens = Tokens()
    """The prompt it was admitted with (checked, immutable)."""
    along: int = -1
    """While every committed token is the prompt's, how many are (`tokens` is then one view
    of the prompt's bytes): a commit that continues the prompt is compared with it, not copied
    (`check.prompt_continued`). -1 once one differs or was copied, and from the start at page
    size 1: there every token ends a whole page, so the tree reads a finished request's last
    token too and its tokens are joined into one copy anyway; a commit copies, as the join
    would later, without the comparison."""
    page_tail: bytearray | None = None
    """The bytes of pages granted a few at a time (decode steps) after `pages`, one bytearray
    rather than an `Indices` each: a long decode of a large batch would otherwise keep an
    object per request per step, which the garbage collector's full passes walk again and
    again. Moved into `pages` as one `Indices` when they are read (`_seal`). A request's
    first two pieces (its cached prefix's pages, its first grant) are kept as they came."""

    def held(self) -> bytes:
        """Every page it holds (int64 bytes): its positions' in order, its cached prefix's
        first, then those held ahead; its pieces are read, not joined in place."""
        return b"".join([*(piece.to_bytes() for piece in self.pages), self.page_tail or b"", self.ahead])

    def follows_prompt(self) -> bool:
        """Whether the next commit is compared with the prompt rather than copied: every token
        committed so far is the prompt's, and the tree would keep what follows the cached prefix
        as a view of the prompt's bytes (`viewed`, the rule of its node keys). Else the tree
        copies its key from them anyway, and a copy at commit, which the tree then keeps as it
        is, costs no more than the comparison."""
        return self.along == self.committed and viewed(8 * (len(self.prompt) - self.prefix), 8 * len(self.prompt))

    def token_data(self) -> bytes:
        """Every committed token's bytes, joined (for checks: `tokens` stays as it is; one
        `bytes` piece is returned as it is)."""
        return b"".join(self.tokens)

    def tokens_after_prefix(self) -> Tokens:
        """The committed tokens after the cached prefix: a slice of the prompt and the bytes
        committed past it, joined only when read (the tree reads the whole pages, which the
        prompt holds); else a commit's bytes as they are when they are all of it, or one join."""
        first = self.tokens[0]
        if type(first) is memoryview and len(first) > 8 * self.prefix:  # commits continued the prompt
            tail = b"".join(self.tokens[1:])  # one bytes piece as it is
            return Tokens.view_then(self.prompt.to_bytes(), 8 * self.prefix, len(first), tail)
        i, skip = _past(self.tokens, 8 * self.prefix)
        rest = self.tokens[i:]
        if len(rest) == 1 and not skip and type(rest[0]) is bytes:
            return Tokens(rest[0])
        if skip:  # a view of a prompt's or a prefill's bytes; a copy of the tail's (which grows)
            first = rest[0]
            rest = [first[skip:] if type(first) is bytearray else memoryview(first)[skip:], *rest[1:]]
        return Tokens(b"".join(rest))

    def pages_after_prefix(self, page_size: int) -> Indices:
        """The pages of the committed tokens after the cached prefix (the last maybe partly committed)."""
        first = self.prefix // page_size
        if self.page_tail:
            self._seal()
        i, at = _past(self.pages, first)
        rest = self.pages[i:]
        if not rest:
            return EMPTY
        stop = -(-self.committed // page_size) - (first - at)
        return (rest[0] if len(rest) == 1 else Indices.concat(rest))[at:stop]

    def page_indices(self) -> Indices:
        if self.page_tail:
            self._seal()
        if len(self.pages) != 1:
            self.pages = [Indices.concat(self.pages)]
        return self.pages[0]

    def add_pages(self, new: Indices) -> None:
        if new:
            self._add(new.to_bytes(), new)

    def _add(self, data: bytes, new: Indices | None) -> None:
        """Pages (`data`: their bytes; `new`: them as an `Indices` if there is one) after the others."""
        if len(self.pages) < 2 or len(data) > 8 * _SMALL_PIECE:  # a prefix's, a prefill's: as they came
            if self.page_tail:
                self._seal()
            self.pages.append(new if new is not None else Indices(data))
        elif self.page_tail is None:
            self.page_tail = bytearray(data)
        else:
            self.page_tail += data
        self.last_page = int.from_bytes(data[-8:], "little", signed=True)

    def room(self, page_size: int) -> int:
        """Slots its pages have past the allocated ones: the last page's rest, the pages held ahead."""
        return (-self.allocated) % page_size + len(self.ahead) // 8 * page_size

    def extend(self, n: int, page_size: int, granted: Indices = EMPTY) -> tuple[int, int, Indices, int]:
        """Record `n` more allocated slots: the rest of the last page, then the pages held ahead,
        then `granted` (the device's new pages; those left over are held ahead). Their slots as
        `SlotTable.split` takes them: `(base, spare, pages, n)`."""
        p = page_size
        start = self.allocated
        spare = min(n, (-start) % p)
        base = self.last_page * p + start % p
        k = -(-(n - spare) // p)  # pages past the last one
        self.allocated = start + n
        if not self.ahead:  # the common case: a grant's pages as they came
            pages, rest = (granted, EMPTY) if k == len(granted) else (granted[:k], granted[k:])
            if pages:
                self.add_pages(pages)
            self.ahead = rest.to_bytes() if rest else b""
            return base, spare, pages, n
        held = self.ahead + granted.to_bytes() if granted else self.ahead
        data, self.ahead = held[: 8 * k], held[8 * k :]
        if not data:
            return base, spare, EMPTY, n
        self._add(data, None)
        return base, spare, Indices(data), n

    def _seal(self) -> None:
        self.pages.append(Indices(bytes(self.page_tail)))
        self.page_tail = None


_SMALL_PIECE = 64
"""A commit of this many tokens or fewer, or a grant of this many pages, joins the request's
tail; a larger one (a prefill's) is kept as it came, without a copy."""


def _past(parts: Sequence[Any], skip: int) -> tuple[int, int]:
    """(i, k): the first `skip` items of `parts` (sized pieces, one after another) end `k`
    items into `parts[i]` (i == len(parts) when they cover them all)."""
    i = 0
    while i < len(parts) and skip >= len(parts[i]):
        skip -= len(parts[i])
        i += 1
    return i, skip


_UNSTARTED = -1
"""The load batch of a host hit whose load-back was not started yet (`HiCache._host_hits`)."""

_LEFT = {ReleaseReason.FINISHED: "finished", ReleaseReason.ABORTED: "was aborted",
         ReleaseReason.RETRACTED: "was retracted"}
"""How a request let its pages go, as a refused write or read of one of them says (`check_kv_writes`,
`check_kv_reads`)."""


def _dropped(mine: Indices, kept: Indices) -> bytes:
    """The pages of `mine` not in `kept` (int64 bytes)."""
    gone = set(mine.tolist()) - set(kept.tolist())
    return Indices.of(sorted(gone)).to_bytes() if gone else b""


def _ignore(reply: Any) -> None:
    return None


class HiCache:
    """Start from a `Config`; use as a context manager (or `start()` / `close()`)."""

    def __init__(
        self,
        config: Config | None = None,
        *,
        runtime: Runtime | None = None,
        actor_classes: Mapping[ActorName, type[HiActor]] | None = None,
        group: Group | None = None,
        reply_timeout_s: float = DEFAULT_ASK_TIMEOUT_S,
    ) -> None:
        if config is not None and not isinstance(config, Config):
            raise RequestError(f"config must be a Config (None: the defaults), got {check.shown(config)}; build one "
                               "with Config(...) or Config.from_mapping(...)")
        if group is not None and not (type(getattr(group, "rank", None)) is int
                                      and type(getattr(group, "size", None)) is int
                                      and callable(getattr(group, "all_min", None))):
            raise RequestError(f"group must be a Group (rank, size, all_min: SingleGroup, TorchGroup), got "
                               f"{check.shown(group)}")
        if runtime is not None and not all(callable(getattr(runtime, m, None))
                                           for m in ("start", "new_mailbox", "shutdown")):
            raise RequestError(f"runtime must be a ThreadedRuntime or a DeterministicRuntime, got "
                               f"{check.shown(runtime)}")
        reply_timeout_s = check.seconds("reply_timeout_s", reply_timeout_s)
        self.config = config or Config()
        self.group: Group = group or SingleGroup()
        self._noting = self.group.size > 1
        """Calls go into a digest that the ranks' agreements compare (`_note`)."""
        if (self.group.size, self.group.rank) != (self.config.tp_size, self.config.tp_rank):
            raise ValueError(
                f"the group is rank {self.group.rank} of {self.group.size} but the config says tp_rank="
                f"{self.config.tp_rank}, tp_size={self.config.tp_size}; make them equal"
            )
        self.reply_timeout_s = reply_timeout_s
        self.system = System(self.config, runtime=runtime, actor_classes=actor_classes)
        self._ops = self.system.services.ids
        self._slot_table: SlotTable | None = None
        """Built at the first start: 8 bytes per device slot."""
        self._interrupts = Interrupts(on_enter=self._collect)
        self._closing = False
        """From `close()` on until the next `start()`: a `statistics()` whose actors stopped under it says so."""
        self._starts = 0
        """`start()`s so far: a `statistics()` whose actors stopped under it while a `close()` and
        a `start()` ran says so too."""
        self._caller = 0
        self._kv: DeviceKV | None = None
        self._timings: FacadeTimings | None = None
        if self.config.metrics:  # decided once: without metrics, the calls are the class's own
            self._timings = FacadeTimings()
            self._timings.instrument(self)
        self._reset()

    def _reset(self) -> None:
        self._calls = 0
        """With several ranks: a digest of the calls taken since the start, with their arguments
        and the answers the agreed state decides (`_note`)."""
        self._live: dict[str, _Live] = {}
        self._prefetching: dict[str, int] = {}
        """Queued requests with a storage prefetch in flight, and the host tokens reserved for it."""
        self._stored: dict[str, int] = {}
        """Tokens a settled prefetch brought from storage, until the request is admitted."""
        self._host_hits: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        """Live requests admitted with a host hit whose load-back has not landed: its batch
        (`_UNSTARTED` until `start_loads` or `quiesce` starts it), the hit, and the batches started
        before the admission that its prefix waits on too (pages an earlier load was bringing in).
        A commit of theirs is refused while the load is not started or once one of them failed:
        their prefix is not in their device slots, so KV computed over it is wrong (`_check_loaded`)."""
        self._op_batches: dict[int, int] = {}
        """The batch each load-back in flight was started in (`LoadsStarted.ops`), kept until it lands
        (one that failed, as long as the layer ring remembers its failure)."""
        self._await_after: set[int] = set()
        """Earlier batches the requests given a batch since the last `start_loads` wait on: the
        waiter the next one gives raises if any of them failed."""
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._pending: dict[int, Pending] = {}
        """Calls whose reply has not been applied (abandoned ones until their late reply comes)."""
        self._early: dict[int, Message] = {}
        """Replies to calls still waiting, taken by a wait nested inside theirs: a late reply's
        handler that asks (an admission taken back) waits within another call's wait, and
        that call's reply may come first. Each wait takes its own from here."""
        self._checks: LiveSlots | None = None
        """With `check_kv_writes` or `check_kv_reads`, the slots a forward pass may write and read
        (`DeviceKV` checks them); told of every change to the pages live requests hold, and of
        the load-backs admissions queue and `start_loads` starts."""
        if self.config.check_kv_writes or self.config.check_kv_reads:
            self._checks = LiveSlots(self._live, self.config.device_pages, self.config.page_size,
                                     reads=self.config.check_kv_reads)
        self._kv = None

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> HiCache:
        """Start the actors (again after `close`: a fresh, empty L1 and L2; L3 persists)."""
        if self.system.started:
            raise CacheStateError("the cache is already started")
        if self.config.metrics:  # first: a clash with another exporting instance leaves nothing started
            track(self)
        self._reset()
        if self._slot_table is None:
            self._slot_table = SlotTable(self.config.device_pages, self.config.page_size)
        try:
            agree_config(self.group, self.config)  # before anything is allocated
            self.system.start()
        except BaseException:
            untrack(self)
            raise
        self._starts += 1
        self._closing = False
        if self._checks is not None:
            self._checks.ring = self.system.ring
        self._caller = threading.get_ident()
        self._interrupts.start()
        return self

    def close(self, *, drain: bool = True, timeout_s: float = CLOSE_DRAIN_TIMEOUT_S) -> Closed:
        """Stop the actors. First, unless `drain=False`, wait up to `timeout_s` for writes to
        host memory and backups to storage in flight; what did not land is reported (and logged)."""
        drain, timeout_s = check.switch("drain", drain), check.seconds("timeout_s", timeout_s)
        if not self.system.started:
            return Closed(drained=True, writes_dropped=0, backups_dropped=0)
        self._check_caller()
        self._closing = True
        drained = True
        if drain:
            try:
                with self._interrupts:
                    self._start_queued_loads(awaited=False)
                    self.system.quiesce(timeout_s)
            except (TimeoutError, RuntimeError):
                drained = False
        try:
            stats = self.system.ask(ActorName.TREE, GetStatistics(), timeout_s=5.0)
            writes, backups = stats.writes_in_flight, stats.backups_in_flight
        except Exception:  # noqa: BLE001 - a failed actor: report what cannot be known as dropped
            writes = backups = -1
            drained = False
        untrack(self)  # before the actors stop: a scrape from now on leaves this cache out
        try:
            stuck = self.system.stop()
        finally:
            self._interrupts.stop()
        if writes or backups:
            drained = False
            log.warning("closed with work in flight" if writes >= 0 else "closed after an actor failed: what was in "
                        "flight is unknown", writes_dropped=writes, backups_dropped=backups)
        return Closed(drained=drained and not (writes or backups or stuck), writes_dropped=writes,
                      backups_dropped=backups, actors_left=tuple(name.value for name in stuck))

    def __enter__(self) -> HiCache:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close(drain=exc[0] is None)

    @property
    def kv(self) -> DeviceKV:
        """The device KV pool per layer, as the forward pass reads and writes it: K/V views in the
        shapes attention kernels take, `write` of new tokens, `gather` of a request (see `DeviceKV`)."""
        system = self._started()
        if self._kv is None or self._kv.buffer is not system.device_kv:
            checks, config = self._checks, self.config
            self._kv = DeviceKV(system.device_kv, checks if config.check_kv_writes else None,
                                checks if config.check_kv_reads else None)
        return self._kv

    @property
    def device_kv(self) -> Any:
        """The device KV buffer as the pools hold it (`KVBuffer`); an engine uses `kv`."""
        return self._started().device_kv

    @property
    def host_kv(self) -> Any:
        return self._started().host_kv

    # -- admission and loads -------------------------------------------------------

    def admit(self, requests: Iterable[Request]) -> list[AdmitResult]:
        """Match each request's prompt, lock its cached prefix, start load-back of host hits."""
        with self._call() as call:
            items = self._admit_items(requests)
            if not items:
                return []
            message = AdmitRequests(op_id=self._op(), items=tuple(items))
            reply = self._ask(ActorName.TREE, message, Admitted, late=lambda r: self._undo_admit(items, r))
            out = [self._admitted(item, adm) for item, adm in zip(items, reply.admissions, strict=True)]
            if self._noting:
                self._note_items(b"admit", items)
                self._note(b"admitted", *(x for r in out for x in (r.device_hit, r.host_hit, r.host_miss,
                                                                     r.storage_hit)))
            if self._checks is not None:
                self._checks.admitted(reply.loads)
            call.on_interrupt(lambda: self._undo_admit(items, reply))
            return out

    def _admitted(self, item: AdmitItem, adm: Any) -> AdmitResult:
        rid = item.request_id
        cached = adm.device_hit + adm.host_hit
        self._stored.pop(rid, None)
        handle = CacheHandle(rid, adm.handle)
        live = _Live(handle, item.namespace, [memoryview(item.tokens.to_bytes())[: 8 * cached]], cached, [], cached, -1,
                     prefix=cached, prompt=item.tokens, along=cached if self.config.page_size > 1 else -1)
        live.add_pages(adm.device)
        self._live[rid] = live
        if adm.host_hit:
            started = self._op_batches
            self._host_hits[rid] = (_UNSTARTED, adm.host_hit, tuple({started[op] for op in adm.waits if op in started}))
        return AdmitResult(rid, handle, self._slots(adm.device, cached), adm.device_hit, adm.host_hit,
                           adm.host_miss, adm.storage_hit)

    def _slots(self, pages: Indices, n: int) -> torch.Tensor:
        """The engine's view: the first `n` slots of `pages`, as a tensor the caller owns."""
        assert self._slot_table is not None  # built by start()
        return self._slot_table.slots(pages, n)

    def _undo_admit(self, items: Sequence[AdmitItem], reply: Admitted) -> None:
        """An admission whose caller never saw it: release its locks (retracted: the ids stay usable)."""
        if self._checks is not None:  # its load-backs are queued all the same
            self._checks.admitted(reply.loads)
        for adm in reply.admissions:
            self._live.pop(adm.request_id, None)
            self._host_hits.pop(adm.request_id, None)
            if self._checks is not None:
                self._checks.left(adm.request_id, adm.device.to_bytes(), "had its admission taken back")
        ends = tuple(
            FinishItem(request_id=it.request_id, handle=adm.handle, reason=ReleaseReason.RETRACTED,
                       tokens=Tokens(), device=EMPTY, allocs=0, commits=0)
            for it, adm in zip(items, reply.admissions, strict=True)
        )
        self._ask(ActorName.TREE, FinishRequests(op_id=self._op(), items=ends), Finished)

    def _admit_items(self, requests: Iterable[Request]) -> list[AdmitItem]:
        items = []
        seen: set[str] = set()
        for r in self._sequence(requests, "requests"):
            if not isinstance(r, Request):
                raise RequestError(f"expected a Request, got {check.shown(r)}")
            rid = check.request_id(r.request_id)
            if rid in self._live or rid in seen:
                raise RequestError(f"request {rid!r} is already admitted; finish, abort or retract it first")
            if rid in self._prefetching:
                raise RequestError(f"request {rid!r} has a storage prefetch in flight; admit it once "
                                   "ready() reports it, or abort it by id")
            if rid in self._ended:  # its ledger is closed for good; only retract keeps an id
                raise RequestError(f"request {rid!r} already {self._ended[rid]}; "
                                   "a finished or aborted request id is never admitted again")
            seen.add(rid)
            data = check.token_bytes(r.tokens, "tokens of request", rid)
            items.append(AdmitItem(request_id=rid, namespace=check.namespace(r.namespace), tokens=Tokens(data),
                                   stored=self._stored.get(rid, 0)))
        return items

    # -- storage prefetch (L3 -> host) ----------------------------------------------------

    def prefetch(self, requests: Iterable[Request]) -> dict[str, int]:
        """Start storage prefetches for queued requests whose part missing from L1/L2 reaches
        `prefetch_threshold_pages` (and the rate limit allows). Returns the host tokens reserved
        per request (0: no prefetch). Admit a prefetching request only after `ready` reports it."""
        with self._call() as call:
            items = self._admit_items(requests)
            if not items:
                return {}
            message = PrefetchRequests(op_id=self._op(), items=tuple(items))
            reply = self._ask(ActorName.TREE, message, PrefetchesStarted, late=lambda r: self._undo_prefetch(items, r))
            started = self._prefetched(items, reply)
            if self._noting:
                self._note_items(b"prefetch", items)
                self._note(b"reserved", *reply.tokens)
            call.on_interrupt(lambda: self._terminate(started, PrefetchEnd.RETRACTED) if started else None)
            return {it.request_id: n for it, n in zip(items, reply.tokens, strict=True)}

    def _prefetched(self, items: Sequence[AdmitItem], reply: PrefetchesStarted) -> list[str]:
        started = [it.request_id for it, n in zip(items, reply.tokens, strict=True) if n]
        for it, n in zip(items, reply.tokens, strict=True):
            if n:
                self._prefetching[it.request_id] = n
        return started

    def _undo_prefetch(self, items: Sequence[AdmitItem], reply: PrefetchesStarted) -> None:
        """Prefetches whose caller never saw them: ended as retracted (the ids stay usable)."""
        started = self._prefetched(items, reply)
        if started:
            self._terminate(started, PrefetchEnd.RETRACTED)

    def ready(self, request_ids: Iterable[str]) -> dict[str, int]:
        """Which of these queued requests may be admitted now: those without a prefetch, and
        those whose prefetch may terminate under `prefetch_policy` on every rank. Those
        prefetches are stopped and settled first: the agreed pages become host-only nodes.
        Returns, per ready request, the tokens it got from storage."""
        with self._call():
            ids = list(dict.fromkeys(check.request_id(r) for r in self._sequence(request_ids, "request_ids")))
            if not ids:
                return {}
            local = self._ask(ActorName.TREE, PrefetchStates(op_id=self._op(), request_ids=tuple(ids)),
                              PrefetchReadiness).ready
            if self._noting:
                self._note(b"ready", *ids)
            agreed = agree(self.group, Agreement.READY, [int(x) for x in local], calls=self._calls)
            go = [rid for rid, ok in zip(ids, agreed, strict=True) if ok]
            got = self._terminate([rid for rid in go if rid in self._prefetching], PrefetchEnd.BEST_EFFORT)
            return {rid: got.get(rid, 0) for rid in go}

    @property
    def prefetching(self) -> tuple[str, ...]:
        """Queued requests with a storage prefetch in flight."""
        return tuple(self._prefetching)

    def _terminate(self, ids: list[str], reason: PrefetchEnd) -> dict[str, int]:
        """Stop, agree on the complete pages, settle: the one path that ends a prefetch."""
        stop = TerminatePrefetches(op_id=self._op(), request_ids=tuple(ids), reason=reason)
        stopped = self._ask(ActorName.TREE, stop, PrefetchesStopped,
                            late=lambda r: self._settle(ids, list(r.pages), reason)).pages
        return self._settle(ids, agree(self.group, Agreement.STOPPED, list(stopped)), reason)

    def _settle(self, ids: list[str], pages: list[int], reason: PrefetchEnd) -> dict[str, int]:
        message = SettlePrefetches(op_id=self._op(), request_ids=tuple(ids), pages=tuple(pages))
        settled = self._ask(ActorName.TREE, message, PrefetchesSettled,
                            late=lambda r: self._settled(ids, r.tokens, reason)).tokens
        return self._settled(ids, settled, reason)

    def _settled(self, ids: list[str], tokens: Sequence[int], reason: PrefetchEnd) -> dict[str, int]:
        for rid, n in zip(ids, tokens, strict=True):
            self._prefetching.pop(rid, None)
            self._stored.pop(rid, None)
            if reason is PrefetchEnd.ABORTED:
                self._end(rid, ReleaseReason.ABORTED)
            elif reason is PrefetchEnd.BEST_EFFORT and n:
                self._stored[rid] = n
        return dict(zip(ids, tokens, strict=True))

    # -- several ranks --------------------------------------------------------------------

    def _note(self, kind: bytes, *parts: bytes | bytearray | memoryview | str | int) -> None:
        """Take a call (its kind, then its arguments) or its answer into the digest of this
        rank's calls, which the agreements of `sync`, `ready` and `quiesce` compare across the
        ranks (several ranks only: `_group`). Each part is hashed whole, seeded with the digest
        so far. The answers noted are those the agreed state decides, so ranks that made the
        same calls give the same: the hits of an admission, a prefetch's reservation, whether an
        allocation fell short, a finished request's ledger, the tokens an eviction freed (not
        slot numbers)."""
        digest = self._calls
        for part in (kind, *parts):
            if type(part) is str:
                part = part.encode()
            elif type(part) is int:
                part = part.to_bytes(8, "little", signed=True)
            digest = xxhash.xxh3_64_intdigest(part, seed=digest)
        self._calls = digest

    def _note_items(self, kind: bytes, items: Sequence[AdmitItem]) -> None:
        for it in items:
            self._note(kind, it.request_id, it.namespace, it.tokens.to_bytes())

    def _note_commits(self, kind: bytes, commits: list[tuple[_Live, bytes, int, int]]) -> None:
        """`_note` each commit's request and token ids, before they are recorded: `m` ids that
        continue the prompt (compared, not copied) and `data` the others are one stream."""
        for live, data, n, m in commits:
            self._note(kind, live.handle.request_id, n)
            ids = xxhash.xxh3_64(seed=self._calls)
            if m:
                ids.update(memoryview(live.prompt.to_bytes())[8 * live.along : 8 * (live.along + m)])
            ids.update(data)
            self._calls = ids.intdigest()

    def sync(self) -> None:
        """Agree with the other ranks on rank-local outcomes and apply them (once per tick on
        every rank). With one rank the tree applies them as they arrive and this does nothing."""
        if self.group.size == 1:
            return
        with self._call():
            self._sync()

    def _sync(self) -> None:
        facts = self._ask(ActorName.TREE, ReportFacts(op_id=self._op()), LocalFacts)
        counts = agree(self.group, Agreement.FACT_COUNTS, list(facts.known), calls=self._calls)
        mine: list[int] = []
        at = 0
        for known, n in zip(facts.known, counts, strict=True):
            mine.extend(facts.values[at : at + n])
            at += known
        values = agree(self.group, Agreement.FACT_VALUES, mine)
        self._ask(ActorName.TREE, ApplyFacts(op_id=self._op(), counts=tuple(counts), values=tuple(values)),
                  FactsApplied)

    def tree_digest(self) -> tuple[str, int]:
        """A digest of the tree's logical state and the host tokens it holds or reserved:
        equal on every rank of a group after each `sync`."""
        with self._call():
            reply = self._ask(ActorName.TREE, DigestTree(op_id=self._op()), TreeDigest)
            return reply.digest, reply.host_used

    def start_loads(self) -> LayerWaiter:
        """Start every queued load-back as one batch; the forward pass waits per layer on the result.
        With nothing queued, the waiter is that of the last batch still in flight, if any: an
        admission counts a prefix that an earlier load has not landed yet as a host hit. The
        waiter raises too if one of the earlier batches the requests admitted since wait on
        failed (admitted while it was in flight: an engine that schedules the next batch
        during a forward pass)."""
        with self._call():
            if self._noting:
                self._note(b"start_loads")
            started = self._start_queued_loads(awaited=True)
            assert self.system.ring is not None
            # Every earlier batch is started before it (or, with nothing queued, it is the last
            # one in flight, or none is): once its layer is done they have all ended.
            after, self._await_after = tuple(sorted(self._await_after - {started.batch})), set()
            return self.system.ring.waiter(started.batch, after)

    # -- slots ------------------------------------------------------------------------

    @overload
    def allocate(self, demands: Mapping[str, int], *, commit: Mapping[str, TokenIds] | None = None,
                 flat: Literal[False] = False) -> dict[str, torch.Tensor] | Insufficient: ...

    @overload
    def allocate(self, demands: Mapping[str, int], *, commit: Mapping[str, TokenIds] | None = None,
                 flat: Literal[True]) -> torch.Tensor | Insufficient: ...

    def allocate(
        self, demands: Mapping[str, int], *, commit: Mapping[str, TokenIds] | None = None,
        flat: bool = False,
    ) -> dict[str, torch.Tensor] | torch.Tensor | Insufficient:
        """Device slots for the next tokens of many requests, all or nothing. If the pool is
        short, the tree evicts (waiting for writes in flight, and started load-backs of
        requests that ended, that hold memory soon evictable) and the allocation is tried
        once more.

        `commit` first records tokens whose KV was written (as `commit` does): a decode tick is
        `allocate({rid: 1, ...}, commit={rid: [last_token], ...})`, one round trip. The commit
        holds even when the allocation does not fit.

        The slots come as a tensor per request, or with `flat=True` as one tensor: every
        request's slots one after another, in the order of `demands` (a batch's output
        locations, with no tensor made per request)."""
        with self._call():
            check.switch("flat", flat)
            want = check.demands(demands, "demands", check.COUNT_MAX)
            live = self._live
            for rid in want:
                if rid not in live:
                    self._req(rid)  # names why it is not live
            commits = self._commits({} if commit is None else commit)
            if self._noting:
                self._note_commits(b"commit", commits)
                self._note(b"allocate", int(flat), *(x for rid_n in want.items() for x in rid_n))
            self._record(commits)
            if not want:
                return torch.empty(0, dtype=torch.int64) if flat else {}
            p = self.config.page_size
            # Slots in the pages a request holds (its last page's free part, pages held ahead)
            # are its own already: only the demands that need a page go to the device (all or
            # nothing: the others are taken after). Not while a call given up on is still in
            # flight: its reply, applied when it comes, may change what a request holds, so
            # everything goes to the device.
            remote = want if self._pending else {
                rid: n for rid, n in want.items()
                if n > (-(r := live[rid]).allocated) % p and (not r.ahead or n > r.room(p))}
            if not remote:
                return self._slots_of(want, self._taken(want), flat)
            reply = self._allocate(remote)
            if isinstance(reply, SlotsInsufficient) and not self._pending and any(r.ahead for r in live.values()):
                # Once more, after every request's pages held ahead go back: the demands that
                # would have taken such pages here go to the device too.
                remote = want
                reply = self._allocate(remote, trim=True)
            if isinstance(reply, SlotsInsufficient):
                if self._noting:
                    self._note(b"insufficient")
                return Insufficient(requested_slots=reply.requested_slots, free_slots=reply.free_slots)
            parts = self._granted(reply, remote, to_caller=True)
            if len(remote) < len(want):  # in the demands' order, the served ones among the granted
                here = {rid: n for rid, n in want.items() if rid not in remote}
                by_rid = dict(zip(remote, parts))
                by_rid.update(zip(here, self._taken(here)))
                parts = [by_rid[rid] for rid in want]
            return self._slots_of(want, parts, flat)

    def _taken(self, want: Mapping[str, int]) -> list[tuple[int, int, Indices, int]]:
        """An allocation that fits in the pages each request holds, served here: no page changes
        owner, so the device hears of it with the next message about the request
        (`_Live.allocs`). Per request, its slots as `_granted` describes them."""
        p, live = self.config.page_size, self._live
        out = []
        for rid, n in want.items():
            r = live[rid]
            if n <= (-r.allocated) % p:  # the last page's rest (a decode step, mostly)
                out.append((r.last_page * p + r.allocated % p, n, EMPTY, n))
                r.allocated += n
            elif n == 1:  # a step onto the first page held ahead: that page's first slot
                data, r.ahead = r.ahead[:8], r.ahead[8:]
                if r.page_tail is not None:  # `_add`'s own case for a decode step's page, inline: a
                    r.page_tail += data      # call a request a tick cost 7% of a tick of 64 at page size 1
                    r.last_page = int.from_bytes(data, "little", signed=True)
                else:
                    r._add(data, None)
                out.append((r.last_page * p, 1, EMPTY, 1))
                r.allocated += 1
            else:
                out.append(r.extend(n, p))
            r.allocs += n
        return out

    def _allocate(self, want: Mapping[str, int], *, trim: bool = False) -> Any:
        """Ask the device for `want` (if the pool is short, the device has the tree evict and
        tries once more before it answers); the message carries the commits of those requests
        that the device has not heard of yet (certain once sent: the facade checked them).
        `trim`: every live request's pages held ahead go back to the free list first."""
        allocs, commits, trimmed = [], [], []
        lives = [(rid, self._live[rid]) for rid in want]
        if trim:
            trimmed = [rid for rid, live in self._live.items() if live.ahead]
            lives += [(rid, self._live[rid]) for rid in trimmed if rid not in want]
        for rid, live in lives:
            if live.allocs:
                allocs.append(SlotDemand(request_id=rid, tokens=live.allocs))
                live.allocs = 0
            if live.unsent:
                commits.append(SlotDemand(request_id=rid, tokens=live.unsent))
                live.unsent = 0
        for rid in trimmed:
            if self._checks is not None:
                self._checks.left(rid, self._live[rid].ahead,
                                  "gave it back: a page held ahead, when memory ran short")
            self._live[rid].ahead = b""
        message = AllocateSlots(
            op_id=self._op(),
            demands=tuple(SlotDemand(request_id=r, tokens=n) for r, n in want.items()),
            allocs=tuple(allocs),
            commits=tuple(commits),
            evict=True,
            ahead=True,
            trim=tuple(trimmed),
        )
        return self._ask(ActorName.DEVICE, message, (SlotsAllocated, SlotsInsufficient),
                         late=lambda r: self._granted(r, want))

    def _granted(self, reply: Any, demands: Mapping[str, int], *,
                 to_caller: bool = False) -> list[tuple[int, int, Indices, int]]:
        """Record the pages each request got for its `demands`; for the caller, each request's
        slots as `_slots_of` takes them, in the grants' order (the demands')."""
        if not isinstance(reply, SlotsAllocated):
            return []
        if self._checks is not None:
            self._checks.granted(grant.pages for grant in reply.grants)
        p, lives, ahead = self.config.page_size, self._live, self.config.ahead_pages
        got = []
        for grant in reply.grants:
            rid = grant.request_id
            live = lives.get(rid)
            if live is None:  # a late grant for a request that ended meanwhile: its release freed it
                continue
            n, pages, start = demands[rid], grant.pages, live.allocated
            spare = (-start) % p
            if not live.ahead and len(pages) == new_pages(n, spare, p):  # no page ahead, before or after
                if to_caller:
                    got.append((live.last_page * p + start % p, min(n, spare), pages, n))
                live.add_pages(pages)
                live.allocated = start + n
                continue
            room = live.room(p)
            k = new_pages(n, room, p)
            if len(pages) != k and not (k and n <= ahead * p and len(pages) == k + ahead):
                raise InvariantError(
                    f"facade: request {rid!r} was granted {len(pages)} pages for {n} slots with {room} "
                    f"free in the pages it holds (invariant: the device's ledger counts the slots the facade "
                    f"handed out; it grants {k}, or {k + ahead} with pages ahead for a demand of at most "
                    f"{ahead * p})"
                )
            part = live.extend(n, p, pages)
            if to_caller:
                got.append(part)
        return got

    def _slots_of(self, rids: Iterable[str], parts: list[tuple[int, int, Indices, int]],
                  flat: bool) -> dict[str, torch.Tensor] | torch.Tensor:
        """The slots of an allocation, per request (`parts`: each request's `(base, spare, pages,
        n)`, as `SlotTable.split` takes them) or `flat`: one tensor in the demands' order."""
        assert self._slot_table is not None  # built by start()
        if flat:
            return self._slot_table.join(parts)
        if not parts:
            return {}
        return dict(zip(rids, self._slot_table.split(parts)))

    def commit(self, tokens: Mapping[str, TokenIds]) -> None:
        """Record that the KV of these new tokens (per request, in order) is written. No
        message: the device learns of it with the next allocation, swap or release of the request."""
        with self._call():
            commits = self._commits(tokens)
            if self._noting:
                self._note_commits(b"commit", commits)
            self._record(commits)

    @staticmethod
    def _record(commits: list[tuple[_Live, bytes, int, int]]) -> None:
        for live, data, n, m in commits:
            if m:  # the prompt's next tokens: its view grows
                live.along += m
                live.tokens[0] = memoryview(live.prompt.to_bytes())[: 8 * live.along]
                live.committed += m
                live.unsent += m
                n -= m
                if not n:
                    continue
            live.along = -1
            if n > _SMALL_PIECE:  # a prefill's: kept as it came
                live.tokens.append(data)
            elif type(tail := live.tokens[-1]) is bytearray:  # a decode step's: onto the tail
                tail += data
            else:
                live.tokens.append(bytearray(data))
            live.committed += n
            live.unsent += n

    def _commits(self, tokens: Mapping[str, TokenIds]) -> list[tuple[_Live, bytes, int, int]]:
        """Each commit checked (all before any is recorded): the request, the bytes of its tokens
        past those that continue the prompt, its count of tokens, and the count of those."""
        if type(tokens) is not dict and not isinstance(tokens, Mapping):
            raise RequestError(f"commit must map request ids to tokens, got {type(tokens).__name__}")
        out = []
        lives, host_hits = self._live, self._host_hits
        for rid, toks in tokens.items():
            live = lives.get(rid) if type(rid) is str else None  # a live request's id is a valid one
            if live is None:
                live = self._req(check.request_id(rid, "a request id in commit"))
            if host_hits and rid in host_hits:
                self._check_loaded(rid)
            m, data = 0, b""
            if live.follows_prompt():
                m, data = check.prompt_continued(live.prompt.to_bytes(), live.along, toks) or (0, b"")
            if not m:
                data = check.token_bytes(toks, "tokens committed for request", rid)
            n = m + len(data) // 8
            if live.committed + n > live.allocated:
                raise RequestError(
                    f"request {rid!r}: committing {n} tokens makes {live.committed + n} committed "
                    f"but only {live.allocated} slots are allocated (allocate before writing KV)"
                )
            if n:
                out.append((live, data, n, m))
        return out

    def _check_loaded(self, rid: str) -> None:
        """Refuse a commit of `rid` if the load-back of its host hit was not started or failed;
        forget it once it landed."""
        batch, hit, earlier = self._host_hits[rid]
        if batch == _UNSTARTED:
            raise RequestError(
                f"request {rid!r} was admitted with {hit} tokens to load back from host memory "
                "(host_hit), but start_loads() was not called since: those tokens are not in its device "
                "slots, so KV computed over them is wrong. Call start_loads() after admit() and "
                "wait_layer(layer) before a layer reads the prefix; retract this request and admit it again"
            )
        ring = self.system.ring
        assert ring is not None
        for b in (batch, *earlier):
            if (failure := ring.failure(b)) is not None:
                raise RequestError(
                    f"request {rid!r}: the load-back of its {hit} tokens from host memory failed (load batch {b}: "
                    f"{failure}), so KV computed over them is wrong; retract this request and admit it again")
        last = ring.layers - 1
        if ring.landed(batch, last) and all(ring.landed(b, last) for b in earlier):
            del self._host_hits[rid]

    def allocated(self, request_id: str) -> int:
        """Positions of a live request that have a slot (committed or not)."""
        with self._call():
            return self._req(request_id).allocated

    def slots(self, request_id: str) -> torch.Tensor:
        """Device slot of every committed or allocated position of a live request."""
        with self._call():
            live = self._req(request_id)
            return self._slots(live.page_indices(), live.allocated)

    def committed_tokens(self, request_id: str) -> list[int]:
        with self._call():
            return Tokens(self._req(request_id).token_data()).tolist()

    def handle(self, request_id: str) -> CacheHandle:
        """The current handle of a live request (after a `cache_unfinished` cut short, say)."""
        with self._call():
            return self._req(request_id).handle

    # -- leaving ------------------------------------------------------------------------

    def finish(self, handles: Iterable[CacheHandle]) -> list[LedgerEntry]:
        return self._leave(handles, ReleaseReason.FINISHED)

    def abort(self, requests: Iterable[CacheHandle | str]) -> list[LedgerEntry]:
        """End admitted requests (by handle) and queued ones with a prefetch in flight (by id).
        A prefetch is released through the same path as `ready` (stopped, agreed, settled),
        even mid-I/O. Returns the ledgers of the admitted ones."""
        return self._leave(requests, ReleaseReason.ABORTED)

    def retract(self, requests: Iterable[CacheHandle | str]) -> list[LedgerEntry]:
        """Give a request's memory back (a queued one's prefetch too); it may come back under the same id."""
        return self._leave(requests, ReleaseReason.RETRACTED)

    def _leave(self, requests: Iterable[CacheHandle | str], reason: ReleaseReason) -> list[LedgerEntry]:
        with self._call():
            items = list(self._sequence(requests, "requests"))
            # Only abort and retract take ids (of prefetching requests); finish needs handles.
            queued = [r for r in items if isinstance(r, str)] if reason is not ReleaseReason.FINISHED else []
            for rid in queued:
                if rid not in self._prefetching and rid not in self._stored:
                    if rid in self._ended and rid not in self._live:
                        raise RequestError(f"request {rid!r} already {self._ended[rid]}: nothing is left to end")
                    if rid in self._live:
                        raise RequestError(f"request {rid!r} is admitted: pass its CacheHandle (from admit() or "
                                           f"cache_unfinished(), or handle({rid!r})), not its id")
                    raise RequestError(f"request {rid!r} has no prefetch in flight or settled for it; pass the "
                                       "CacheHandle of an admitted request instead of its id")
            if len(set(queued)) != len(queued):
                raise RequestError(f"a request appears twice in one call: {queued}")
            hs = self._check_handles([r for r in items if not isinstance(r, str) or reason is ReleaseReason.FINISHED])
            if self._noting:
                self._note(b"leave", reason.value, *queued, *(x for h in hs for x in (h.request_id, h._token)))
            if queued:
                self._terminate(queued, PrefetchEnd.RETRACTED if reason is ReleaseReason.RETRACTED
                                else PrefetchEnd.ABORTED)
            if not hs:
                return []
            ends = tuple(self._finish_item(h, reason) for h in hs)
            for h in hs:  # certain once sent: the tree takes each handle exactly once
                if self._checks is not None:
                    self._checks.left(h.request_id, self._live[h.request_id].held(), _LEFT[reason])
                del self._live[h.request_id]
                self._host_hits.pop(h.request_id, None)
                if reason is not ReleaseReason.RETRACTED:
                    self._end(h.request_id, reason)
            entries = list(self._ask(ActorName.TREE, FinishRequests(op_id=self._op(), items=ends), Finished).entries)
            if self._noting:
                self._note(b"left", *(x for e in entries for x in (e.allocated, e.committed, e.freed)))
            return entries

    def _finish_item(self, h: CacheHandle, reason: ReleaseReason) -> FinishItem:
        live = self._live[h.request_id]
        return FinishItem(request_id=h.request_id, handle=h._token, reason=reason, tokens=live.tokens_after_prefix(),
                          device=live.pages_after_prefix(self.config.page_size), allocs=live.allocs,
                          commits=live.unsent)

    def _end(self, rid: str, reason: ReleaseReason) -> None:
        self._ended[rid] = reason.value
        while len(self._ended) > FINISHED_REMEMBERED_MAX:
            self._ended.popitem(last=False)

    def cache_unfinished(self, handles: Iterable[CacheHandle]) -> list[CacheHandle]:
        """After a prefill chunk: cache each request's committed prefix, switch it to the
        tree's slots and move its lock. Returns the new handles (the old ones expire)."""
        with self._call():
            hs = self._check_handles(handles)
            if self._noting:
                self._note(b"cache_unfinished", *(x for h in hs for x in (h.request_id, h._token)))
            lives = [self._live[h.request_id] for h in hs]
            items = tuple(
                CacheItem(request_id=h.request_id, handle=h._token, tokens=live.tokens_after_prefix(),
                          device=live.pages_after_prefix(self.config.page_size), allocs=live.allocs,
                          commits=live.unsent)
                for h, live in zip(hs, lives, strict=True)
            )
            for live in lives:
                live.caching = True
            reply = self._ask(ActorName.TREE, CacheUnfinished(op_id=self._op(), items=items), Cached,
                              late=lambda r: self._cached(hs, r, items))
            if reply.refused:
                self._cached(hs, reply, items)
                raise RequestError(
                    f"request(s) {list(reply.refused)}: the cached prefix was lost to a failed load-back, so "
                    "nothing was cached; abort or retract them (the whole batch was refused)"
                )
            return self._cached(hs, reply, items)  # if cut short, the new handles are there through handle()

    def _cached(self, hs: list[CacheHandle], reply: Cached, items: Sequence[CacheItem]) -> list[CacheHandle]:
        out = []
        for h in hs:
            if (live := self._live.get(h.request_id)) is not None:
                live.caching = False
        if reply.refused:  # no swap: the device has not heard of the slots and commits the items carried
            return out
        for h, prefix, item in zip(hs, reply.prefixes, items, strict=True):
            live = self._live[h.request_id]
            live.allocs -= item.allocs  # the swap applied them (more may have come since)
            live.unsent -= item.commits
            rest = live.page_indices()[len(prefix.device):]
            if self._checks is not None:  # pages swapped for the tree's copy of the same tokens were freed
                self._checks.left(h.request_id, _dropped(live.page_indices()[: len(prefix.device)], prefix.device),
                                  "gave it up in cache_unfinished(), for the tree's copy of the same tokens")
            live.pages = [Indices.concat((prefix.device, rest))]
            live.prefix = len(prefix.device) * self.config.page_size
            live.handle = CacheHandle(h.request_id, prefix.handle)
            out.append(live.handle)
        if self._checks is not None:
            self._checks.changed()
        return out

    # -- eviction, numbers, checks ---------------------------------------------------------

    def quiesce(self, timeout_s: float = 60.0) -> None:
        """Wait until every write-through, load-back and backup to storage in flight has been
        acknowledged and applied. With several ranks, call it on every rank: it agrees too.
        After `timeout_s` a `TimeoutError` names what is still in flight; the cache goes on.
        With several ranks, one rank's timeout is every rank's: all leave the same agreement.
        A lost rank raises `RankLostError` instead, within the group's timeout."""
        with self._call():
            timeout_s = check.seconds("timeout_s", timeout_s)
            self._start_queued_loads(awaited=False)  # waited for below
            while True:
                if self.group.size == 1:
                    self.system.quiesce(timeout_s)
                    return
                late: TimeoutError | None = None
                try:
                    self.system.quiesce(timeout_s)
                except TimeoutError as err:  # the others are on their way to this agreement: leave with them
                    late = err
                self._sync()
                if not agree(self.group, Agreement.QUIESCED, [int(late is None)], calls=self._calls)[0]:
                    raise late or TimeoutError(
                        f"rank {self.group.rank} of {self.group.size}: another rank still had work in flight after "
                        f"{timeout_s:g} s; wait longer (timeout_s) or close(drain=False) to drop it")
                # Applying outcomes may issue more (a landed write starts its backup): agree until none
                # is pending. The count is agreed state, so every rank leaves after as many syncs.
                if not self.system.ask(ActorName.TREE, GetStatistics()).facts_pending:
                    return

    def _start_queued_loads(self, *, awaited: bool) -> LoadsStarted:
        """Start the load-backs admitted since the last start, as one batch: `start_loads`
        (`awaited`: the forward pass waits on it), and `quiesce` and `close`, since a load lands
        only once started and its requests may have left before they ran. Nobody waits on such
        a batch: a later `start_loads` answers the waiter of a batch still in flight, and if it
        failed, that of a batch that fails too."""
        started = self.system.ask(ActorName.LOAD, StartLoads(awaited=awaited), timeout_s=self.reply_timeout_s)
        ring, ops = self.system.ring, self._op_batches
        assert ring is not None
        if ops:  # a landed load's pages are in device memory: nothing waits on it any more
            last = ring.layers - 1
            for op in [op for op, batch in ops.items() if ring.landed(batch, last)]:
                del ops[op]
        for op in started.ops:
            ops[op] = started.batch
        hits, after = self._host_hits, self._await_after
        for rid, (batch, hit, earlier) in hits.items():  # the requests admitted since: their loads are this batch
            if batch == _UNSTARTED:
                hits[rid] = (started.batch, hit, earlier)
                after.update(earlier)  # (a batch none waits on fails the next awaited one itself: the stream's rule)
        if self._checks is not None:
            self._checks.started(started.batch)
        return started

    def evict_device(self, tokens: int) -> int:
        """Free at least `tokens` device slots held by the cache if it can; returns how many."""
        with self._call():
            n = check.count("tokens", tokens, check.COUNT_MAX)
            if self._noting:
                self._note(b"evict_device", n)
            message = EvictDevice(op_id=self._op(), tokens=min(n, self.config.device_slots))
            freed = self._ask(ActorName.TREE, message, Evicted).device_tokens
            if self._noting:
                self._note(b"evicted", freed)
            return freed

    def evict_host(self, tokens: int) -> int:
        with self._call():
            n = check.count("tokens", tokens, check.COUNT_MAX)
            if self._noting:
                self._note(b"evict_host", n)
            message = EvictHost(op_id=self._op(), tokens=min(n, self.config.host_slots))
            freed = self._ask(ActorName.TREE, message, Evicted).host_tokens
            if self._noting:
                self._note(b"evicted", freed)
            return freed

    def room(self) -> Room:
        """The device slots an allocation could get now, for admission control: free, evictable
        (cached tokens no request holds) and held ahead by live requests (`Room`). Two asks, the
        tree's record then the device's: about a quarter of what `statistics()` costs.

        `available_slots` is what one `allocate` gets in new pages without `Insufficient`, exactly
        once nothing is in flight (after `quiesce()`). Otherwise it may be less for a moment:
        `allocate` waits for write-backs its eviction started and for started load-backs of ended
        requests, but an unlocked node whose load-back is not started yet (its request ended
        before `start_loads`) is counted as evictable and is not freed until it lands. What becomes
        evictable once writes to host in flight land is not counted.

        The figures are this rank's. Every rank makes the same calls and applies rank-local
        outcomes only at `sync`, so they agree across ranks; call `room()` after the tick's
        `sync`, so that they include what it applied. With several ranks an eviction does not
        wait for write-backs (their acks apply at the next `sync`): under `write_back`, evictable
        tokens not backed up yet are freed a tick later."""
        with self._call():
            system, timeout_s = self.system, self.reply_timeout_s
            # The tree first: a write-back that lands in between moves its tokens from locked
            # in the tree to free on the device, counted once rather than not at all.
            tree = system.ask(ActorName.TREE, GetStatistics(), timeout_s=timeout_s)
            device = system.ask(ActorName.DEVICE, GetStatistics(), timeout_s=timeout_s)
            # Pages held ahead as the facade counts them: the device's `ahead_slots` also counts
            # those it has not heard a decode step took yet.
            ahead = sum([len(r.ahead) for r in self._live.values()]) // 8 * self.config.page_size
            return Room(free_slots=device.free_slots, evictable_slots=tree.evictable_tokens, ahead_slots=ahead)

    def statistics(self) -> HiCacheStatistics:
        """Per tier (tokens looked up, hit and evicted; capacity used), and each actor's record
        (any thread may call this; one racing a `close()` raises `CacheStateError`)."""
        t = self._timings or _NO_TIMINGS
        system = self._started()
        starts = self._starts
        try:  # the actors' records, which a close racing this call may take away one by one
            return cache_statistics(self.config, system.statistics(), t.load_back_wait,
                                    t.calls if self._timings else {})
        except (pykka.ActorDeadError, RuntimeError, LookupError, TimeoutError):
            if self._closing or not system.started or self._starts != starts:  # the actors stopped under it
                raise CacheStateError("the cache was closed while statistics() ran") from None
            raise

    def check_invariants(self) -> None:
        """Every actor checks its core; the facade checks its own view against the tree's."""
        with self._call():
            self.system.check_invariants()
            for rid, live in self._live.items():
                if live.committed != len(live.token_data()) // 8 or live.committed > live.allocated \
                        or -(-live.allocated // self.config.page_size) != len(live.page_indices()) \
                        or live.prefix % self.config.page_size or live.prefix > live.committed \
                        or len(live.ahead) > 8 * self.config.ahead_pages:
                    raise AssertionError(f"facade: request {rid!r} has {live.committed} committed, "
                                         f"{len(live.token_data()) // 8} tokens, {live.allocated} allocated, "
                                         f"{len(live.page_indices())} pages, {len(live.ahead) // 8} held ahead "
                                         f"(at most {self.config.ahead_pages}), a cached prefix of {live.prefix}")
            held = self.system.ask(ActorName.TREE, GetStatistics()).live_handles
            if held != len(self._live) and not self._pending:
                raise AssertionError(
                    f"facade: the tree holds {held} request handles but {len(self._live)} requests are live "
                    "(a handle no live request owns is a leaked lock)"
                )

    @property
    def live_requests(self) -> tuple[str, ...]:
        return tuple(self._live)

    # -- helpers -------------------------------------------------------------------------------

    def _call(self) -> Interrupts:
        """A facade call: its caller's thread is checked; entering it applies late replies first."""
        if threading.get_ident() != self._caller or not self.system.started:
            self._check_caller()
            self._started()
        return self._interrupts

    def _check_caller(self) -> None:
        me = threading.get_ident()
        if me != self._caller and self._caller:
            raise CacheStateError(
                f"HiCache is called by one thread, the one that started it (thread {self._caller}); "
                f"this call came from thread {me} (only statistics() may be called from any thread)"
            )

    def _started(self) -> System:
        if not self.system.started:
            raise CacheStateError("the cache is not running: call start() (or use `with HiCache(config)`) first")
        return self.system

    def _op(self) -> int:
        return self._ops.next("facade-op")

    def _ask(self, to: ActorName, message: Message, replies: type | tuple[type, ...],
             late: Callable[[Any], None] = _ignore) -> Any:
        """Tell `to` a verb and wait for its reply (by op id). If the wait is cut short, the op
        stays in the journal and `late` is applied to its reply when it comes."""
        op = message.op_id  # type: ignore[attr-defined]
        entry = Pending(replies if isinstance(replies, tuple) else (replies,), late)
        self._pending[op] = entry
        self.system.tell(to, message)
        try:
            return self._wait(op, entry)
        except BaseException:
            entry.abandoned = True
            raise

    def _wait(self, op: int, entry: Pending) -> Any:
        waited, poll = 0.0, self.system.runtime.poll_s
        while True:
            reply = self._early.pop(op, None) if self._early else None
            if reply is None:
                reply = self.system.next_reply(poll)
            if reply is None:
                self._interrupts.deliver()
                waited += poll or 0.0
                if waited >= self.reply_timeout_s:
                    raise TimeoutError(f"no reply to op {op} within {self.reply_timeout_s}s; its effects are "
                                       "undone or adopted when it comes, at the next call")
                continue
            if getattr(reply, "op_id", None) == op:
                del self._pending[op]
                if not isinstance(reply, entry.replies):
                    raise RuntimeError(f"op {op} got {reply!r}, not a {' or '.join(t.__name__ for t in entry.replies)}")
                return reply
            other = self._pending.get(getattr(reply, "op_id", None))  # type: ignore[arg-type]
            if other is not None and not other.abandoned:  # an outer call's, this wait nested in its wait
                self._early[reply.op_id] = reply  # type: ignore[attr-defined]
                continue
            self._late(reply)

    def _collect(self) -> None:
        """Apply every late reply that has arrived (none can but to a call given up; one that
        answers no call is caught by the next wait, which sees every reply)."""
        if not self._pending:
            return
        for op in [op for op in self._early if self._pending[op].abandoned]:  # taken early, then given up
            self._late(self._early.pop(op))
        while (reply := self.system.next_reply(0.0, block=False)) is not None:
            self._late(reply)

    def _late(self, reply: Message) -> None:
        op = getattr(reply, "op_id", None)
        entry = self._pending.get(op) if op is not None else None
        if entry is None or not entry.abandoned:
            raise RuntimeError(f"the facade got {reply!r}, which answers no call it made (a bug)")
        del self._pending[op]
        entry.late(reply)

    @staticmethod
    def _sequence(values: Any, what: str) -> Iterable[Any]:
        if type(values) is list:  # the usual argument: no ABC check
            return values
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise RequestError(f"{what} must be a list, got {type(values).__name__}")
        return values

    def _req(self, rid: str) -> _Live:
        live = self._live.get(rid) if type(rid) is str else None
        if live is not None:
            return live
        check.request_id(rid)
        if rid in self._ended:
            raise RequestError(f"request {rid!r} already {self._ended[rid]}; it has no slots any more")
        raise RequestError(f"request {rid!r} is not admitted (never, or it was retracted): admit it first")

    def _check_handles(self, handles: Iterable[CacheHandle]) -> list[CacheHandle]:
        hs = list(self._sequence(handles, "handles"))
        seen: set[str] = set()
        for h in hs:
            if not isinstance(h, CacheHandle):
                raise RequestError(f"expected a CacheHandle from admit() or cache_unfinished(), got {check.shown(h)}")
            live = self._req(h.request_id)
            if live.caching:
                raise RequestError(f"request {h.request_id!r}: its cache_unfinished() is still in flight; get its "
                                   "new handle with handle() once it returned")
            if live.handle != h:
                raise ExpiredHandleError(
                    f"handle {h._token} of request {h.request_id!r} is not its current one (replaced by "
                    "cache_unfinished(), or forged): use the one cache_unfinished() returned, or handle(request_id)"
                )
            if h.request_id in seen:
                raise RequestError(f"request {h.request_id!r} appears twice in one call")
            seen.add(h.request_id)
        return hs
