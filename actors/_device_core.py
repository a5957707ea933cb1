"""`DeviceCore`: the device KV buffer, its page allocator and the request ledger.

Every device page has exactly one owner: free, a live request, the tree, or an
in-flight load. A request's ledger (SGLang #12224) records how many slots it was
handed (`allocated`) and how many hold real KV (`committed`); `allocated >=
committed` always, and `release` gives back every page of the request exactly
once, in one place: pages the tree adopts change owner, all others are freed.
Running out of pages is not an error but an `Insufficient` result.

The owners are one table of int32 per page (a `PageTable`): a `PageOwner`, or for a
request's page the number of its ledger. So checking that pages belong to a request
is one lookup per page, and a release is a few passes over the request's own pages,
never over the pool; the slots per owner that statistics report are counted as pages
change owner, not read off the table. A ledger's number is reused once the ledger is
released (no page carries it then), so the numbers stay below the live requests' count
plus four and the table's entries stay four bytes: half the memory an eviction's checks
go through.

Each call keeps its page numbers in the form `_pages` chooses for their number
(`Pages`): Python ints for a few (most calls: from the message's bytes to the reply's
without an array), a numpy array for many. Pages come in as `Indices`, tensors or
lists; the `*_pages` methods answer with the `Indices` a reply carries, the others
with tensors (read-only views of those `Indices`).
"""

from __future__ import annotations

import enum
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy
import torch

from hicache.messages import EMPTY, Indices, LedgerEntry, ReleaseReason
from hicache.messages.config import Config, DeviceKind, HostLayout

from ._errors import InvariantError, LedgerError, SlotStateError
from ._kv import KVBuffer, KVShape
from ._pages import (
    FEW_MAX,
    PagePool,
    Pages,
    PageTable,
    Slots,
    as_list,
    as_pages,
    as_tensor,
    indices_of,
    new_pages,
    pages_of_array,
    pages_of_bytes,
    slots_of_pages,
)

RELEASED_REMEMBERED_MAX = 1 << 16
"""Finished or aborted requests whose final ledger is kept (to catch use after release)."""

_COMMITTED_BITS = 64
"""A released request's final ledger is kept as one int, `allocated << 64 | committed`
(`_released`): an int is no object the garbage collector tracks, where a `LedgerEntry` each
would keep up to `RELEASED_REMEMBERED_MAX` of them for it to walk."""
_COMMITTED_MASK = (1 << _COMMITTED_BITS) - 1


class PageOwner(enum.IntEnum):
    FREE = 0
    REQUEST = 1
    TREE = 2
    LOADING = 3


_FIRST_LEDGER = 4
"""Owner codes from here on are ledgers: a request's pages carry its ledger's number, so
"is this page the request's?" is one lookup (vectorised: one gather), never a set operation."""

_INT32_PAGES_MAX = (1 << 31) - 1 - _FIRST_LEDGER
"""Pools of at most this many pages keep their owners as int32 (a free page's code is
`-(place + 1)`, a ledger's number is below the live requests' count plus `_FIRST_LEDGER`);
a larger one as int64."""


@dataclass(frozen=True, slots=True)
class Insufficient:
    """An allocation that does not fit in the free pages; nothing was allocated. The facade
    returns it only when the allocation does not fit even after eviction."""

    requested_slots: int
    free_slots: int

    @property
    def shortfall_slots(self) -> int:
        return self.requested_slots - self.free_slots

    def __getitem__(self, key: object) -> Any:
        """An allocation that did not fit has no slots: read as if it had, it says so."""
        raise TypeError(self._misread())

    def __getattr__(self, name: str) -> Any:
        """Read as a flat allocation (`split`, say), it says so too; other names are plain misses."""
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"{self._misread()} (Insufficient has no {name!r})")

    def _misread(self) -> str:
        return (f"allocate() did not fit: {self.requested_slots} slots asked, {self.free_slots} free after eviction; "
                "nothing was allocated. Check isinstance(result, Insufficient) before reading slots from it, then "
                "retract a request (or wait for writes in flight) and allocate again")


@dataclass(slots=True)
class _Ledger:
    request_id: str
    number: int
    """Its owner code in the page table (>= `_FIRST_LEDGER`; 0 until it holds slots). Reused
    by a later ledger once this one is released."""
    serial: int = 0
    """Its place among every ledger the core ever registered (never reused: what `mark` tells)."""
    pages: array = field(default_factory=lambda: array("q"))
    """Pages it still holds, in token order (whole pages handed over mid-life are gone)."""
    allocated: int = 0
    committed: int = 0
    given: int = 0
    """Slots of whole committed pages handed to the tree (or freed as duplicates) while live."""


class DeviceCore:
    def __init__(self, config: Config) -> None:
        self.page_size = config.page_size
        self.capacity_slots = config.device_slots
        device = "cuda" if config.device is DeviceKind.CUDA else "cpu"
        self.kv = KVBuffer.allocate(KVShape.of(config), config.device_slots, HostLayout.LAYER_FIRST, device)
        self._pool = PagePool(config.device_pages, config.page_size)
        self.ahead_pages = config.ahead_pages
        """Whole free pages a demand that needs new pages also gets when its allocation asks
        for pages ahead (`Config.ahead_slots`); a ledger never holds more past its slots."""
        self._owners = PageTable(config.device_pages, "i" if config.device_pages <= _INT32_PAGES_MAX else "q",
                                 runs=PageOwner)
        """Per page the number of the ledger that holds it, `PageOwner.TREE` or `LOADING`, or
        for a free page `-(i + 1)`, `i` its place in the free list's stack (so a move to the
        free list writes each page once: see `PageTable.move_free`)."""
        self._owners.put_free(numpy.arange(config.device_pages, dtype=numpy.int64), 0)
        self._owner = self._owners.tensor
        self._request_pages = 0
        """Pages the live ledgers hold (the sum of their `pages`' lengths): kept as they change,
        so `counts` (each statistics() call) reads numbers, not the table."""
        self._loading_pages = 0
        """Pages owned by loads in flight (`PageOwner.LOADING`), kept the same way."""
        self._needed_pages = 0
        """Of `_request_pages`, those the live ledgers' allocated slots need (`_pages_left`): the
        rest are held ahead (`ahead_slots`)."""
        self._ledgers: dict[str, _Ledger] = {}
        self._next_ledger = _FIRST_LEDGER
        """The number the next ledger gets when no released ledger's number is spare."""
        self._spare_numbers: list[int] = []
        """Numbers of released ledgers, which no page carries: the next ledgers' (last in, first out)."""
        self._serials = 0
        """Ledgers registered so far (each one's `serial`)."""
        self._released: OrderedDict[str, int] = OrderedDict()
        """Final ledgers of released requests (not retracted ones), by id, as `_COMMITTED_BITS` packs them."""
        self.waiting: dict[int, tuple[Any, tuple[tuple[int, bool], ...]]] = {}
        """Allocations waiting for the tree's eviction (the actor's routes keep them here): by
        op id, the `AllocateSlots` and each of its requests' `mark` when it was put aside."""
        self.outbox: list[tuple[Any, Any]] = []
        """(receiver, message) for the actor to send once its route returns."""

    # -- requests -------------------------------------------------------------

    def allocate(self, demands: Sequence[tuple[str, int]]) -> dict[str, torch.Tensor] | Insufficient:
        """`allocate_pages`, answered as the slots each request got (its next positions, on
        the pages it holds: the rest of its last partial page, pages held ahead, new pages), as
        a tensor: what an engine writes KV into."""
        p = self.page_size
        before = {rid: self._ledgers[rid].allocated if rid in self._ledgers else 0 for rid, _ in demands}
        got = self.allocate_pages(demands)
        if isinstance(got, Insufficient):
            return got
        out = {}
        for rid, n in demands:
            ledger, start = self._ledgers.get(rid), before[rid]
            if not n or ledger is None:
                out[rid] = torch.empty(0, dtype=torch.int64)
                continue
            first = start // p - ledger.given // p  # the ledger's page of position `start`
            pages = ledger.pages[first : first + -(-(start % p + n) // p)].tolist()
            out[rid] = torch.tensor(slots_of_pages(pages, p)[start % p : start % p + n], dtype=torch.int64)
        return out

    def allocate_pages(self, demands: Sequence[tuple[str, int]], *,
                       ahead: bool = False) -> dict[str, Indices] | Insufficient:
        """Room for the next `n` tokens of several requests, all or nothing, in demand order:
        each first fills the pages it holds (the rest of its last partial page, then pages it
        was given ahead), then gets whole new pages (the answer: per request, its new pages).

        `ahead`: a small demand (at most `ahead_pages` pages' slots: a decode step's) that needs
        new pages also gets `ahead_pages` more when the free list holds them for every such
        demand of the call after what all need (never by eviction): a decode's next steps then
        fit in pages the request holds, which the facade hands out without a message. A
        prefill's demand gets what it needs, no more."""
        p = self.page_size
        plan: list[tuple[_Ledger, int, int]] = []  # ledger, tokens, new pages
        seen: set[str] = set()
        need = needy = 0
        small = self.ahead_pages * p if ahead else 0
        for rid, n in demands:
            if n < 0:
                raise LedgerError(f"request {rid!r}: cannot allocate {n} slots")
            if rid in seen:
                raise LedgerError(f"request {rid!r} appears twice in one allocation")
            seen.add(rid)
            ledger = self._live_or_new(rid)
            k = new_pages(n, _room(ledger, p), p)
            plan.append((ledger, n, k))
            need += k
            needy += 0 < k and n <= small
        free = self._pool.free_pages
        if need > free:
            return Insufficient(requested_slots=need * p, free_slots=self._pool.free_slots)
        more = self.ahead_pages if needy and need + needy * self.ahead_pages <= free else 0
        total = need + needy * more
        # One take from the free list for all of them: the pages each would have got in turn,
        # in the same order (the stack's top first), with one conversion to bytes.
        data = self._pool.alloc_bytes(total) if total else b""
        assert data is not None
        new = pages_of_bytes(data)
        out, at = {}, 0
        for ledger, n, k in plan:
            if k and n <= small:
                k += more
            out[ledger.request_id] = self._grant(ledger, n, new[at : at + k], data[8 * at : 8 * (at + k)])
            at += k
        return out

    def _grant(self, ledger: _Ledger, n: int, new: Pages, data: bytes) -> Indices:
        """`n` more tokens for the ledger: what its last page has left, then the new pages
        `new` (their bytes: `data`)."""
        if ledger.request_id not in self._ledgers:
            if self._spare_numbers:
                ledger.number = self._spare_numbers.pop()
            else:
                ledger.number = self._next_ledger
                self._next_ledger += 1
            self._serials += 1
            ledger.serial = self._serials
            self._ledgers[ledger.request_id] = ledger
        left = _pages_left(ledger, self.page_size)
        ledger.allocated += n
        self._needed_pages += _pages_left(ledger, self.page_size) - left
        if not data:
            return EMPTY
        self._owners.put(new, ledger.number)
        ledger.pages.frombytes(data)
        self._request_pages += len(data) // 8
        return Indices(data)

    def extend_only(self, demands: Sequence[tuple[str, int]]) -> None:
        """Slots several requests took from the pages they hold (the free part of the last
        one, pages given ahead), which the facade handed out itself (an allocation that needs
        no new page): counted as allocated, all or nothing. Each must fit in what its pages
        have left; more is a bug in the caller."""
        p = self.page_size
        ledgers = self._distinct_live([rid for rid, _ in demands], "extend")
        for (rid, n), ledger in zip(demands, ledgers, strict=True):
            room = _room(ledger, p)
            if not 0 <= n <= room:
                raise LedgerError(
                    f"request {rid!r}: {n} slots taken from the pages it holds, which have {room} free "
                    "(invariant: only an allocation that fits in a request's pages is served without new pages)"
                )
        for (_, n), ledger in zip(demands, ledgers, strict=True):
            left = _pages_left(ledger, p)
            ledger.allocated += n
            self._needed_pages += _pages_left(ledger, p) - left

    def trim(self, rids: Sequence[str]) -> int:
        """Give back the pages several requests hold ahead of their allocated slots (past the
        page of their last one) to the free list: what an allocation that came up short asks
        for before it tries again. The pages freed."""
        p = self.page_size
        freed = 0
        for ledger in self._distinct_live(list(rids), "trim the pages held ahead by", new_ok=True):
            keep = _pages_left(ledger, p)
            if len(ledger.pages) > keep:
                extra = pages_of_array(ledger.pages[keep:])
                self._free(extra, frozenset((ledger.number,)), "trim pages held ahead")
                del ledger.pages[keep:]
                freed += len(extra)
        self._request_pages -= freed
        return freed

    def commit(self, rid: str, n: int) -> LedgerEntry:
        return self.commit_many([(rid, n)])[0]

    def commit_many(self, demands: Sequence[tuple[str, int]]) -> list[LedgerEntry]:
        """Commit for several requests, all or nothing: every demand is checked first."""
        return [self._view(ledger, freed=ledger.given) for ledger in self.commit_only(demands)]

    def commit_only(self, demands: Sequence[tuple[str, int]]) -> list[_Ledger]:
        """`commit_many` without its answer (the commits an allocation or a release carries)."""
        ledgers = self._distinct_live([rid for rid, _ in demands], "commit")
        for (rid, n), ledger in zip(demands, ledgers, strict=True):
            if n < 0:
                raise LedgerError(f"request {rid!r}: cannot commit {n} slots")
            if ledger.committed + n > ledger.allocated:
                raise LedgerError(
                    f"request {rid!r}: committing {n} more slots would make committed="
                    f"{ledger.committed + n} > allocated={ledger.allocated} (invariant: "
                    "allocated >= committed; allocate before writing KV)"
                )
        for (_, n), ledger in zip(demands, ledgers, strict=True):
            ledger.committed += n
        return ledgers

    def release(self, rid: str, adopt: Slots, reason: ReleaseReason) -> LedgerEntry:
        return self.release_many([(rid, adopt, reason)])[0]

    def release_many(self, releases: Sequence[tuple[str, Slots, ReleaseReason]],
                     commits: Sequence[tuple[str, int]] = (),
                     allocs: Sequence[tuple[str, int]] = ()) -> list[LedgerEntry]:
        """Give back every page of each request: its `adopt` pages to the tree, the
        rest to the free list. Exactly once per request; all or nothing. `allocs` (as
        `extend_only`), then `commits` (as `commit_many`) are applied first and hold even
        when the release is refused."""
        if allocs:
            self.extend_only(allocs)
        if commits:
            self.commit_only(commits)
        # A request admitted and ended before it allocated has an empty ledger.
        ledgers = self._distinct_live([rid for rid, _, _ in releases], "release", new_ok=True)
        adopted: list[tuple[Pages, Pages]] = []
        try:
            for ledger, (rid, adopt, _) in zip(ledgers, releases, strict=True):
                adopted.append(self._hand_over(ledger, adopt))
        except LedgerError:
            for ledger, (pages, _) in zip(ledgers, adopted):
                self._owners.put(pages, ledger.number)  # all or nothing
            raise
        views = []
        for ledger, (_, held), (rid, _, reason) in zip(ledgers, adopted, releases, strict=True):
            self._push(self._rest(ledger, held))
            if self._ledgers.pop(rid, None) is not None:  # registered: no page carries its number now
                self._spare_numbers.append(ledger.number)
                self._request_pages -= len(ledger.pages)
                self._needed_pages -= _pages_left(ledger, self.page_size)
            view = self._view(ledger, freed=ledger.allocated)
            if reason is not ReleaseReason.RETRACTED:
                self._released[rid] = ledger.allocated << _COMMITTED_BITS | ledger.committed
                while len(self._released) > RELEASED_REMEMBERED_MAX:
                    self._released.popitem(last=False)
            views.append(view)
        return views

    def swap(self, rid: str, adopt: Slots, free: Slots, *, commits: int = 0, allocs: int = 0) -> LedgerEntry:
        """Mid-life: whole committed pages of a live request go to the tree (`adopt`) or
        back to the free list (`free`, duplicates of the tree's); the request stays live.
        `allocs` more of its slots are allocated (as `extend_only`), then `commits` committed,
        first (they hold even when the swap is refused)."""
        if allocs:
            self.extend_only([(rid, allocs)])
        if commits:
            self.commit_only([(rid, commits)])
        ledger = self._live(rid, "swap pages of", new_ok=True)  # a full-prefix hit may not have allocated
        p = self.page_size
        adopt_pages = as_list(as_pages(adopt))
        free_pages = as_list(as_pages(free))
        both = adopt_pages + free_pages
        whole = ledger.committed // p - ledger.given // p if ledger.committed >= ledger.given else 0
        handed = set(both)
        if len(handed) != len(both) or not handed <= set(ledger.pages[:whole]):
            raise LedgerError(
                f"request {rid!r}: pages {both} are not distinct, whole, committed pages of the "
                "request (only committed pages can be handed over mid-life)"
            )
        self._owners.put(adopt_pages, PageOwner.TREE)
        self._push(free_pages)
        ledger.pages = array("q", [pg for pg in ledger.pages if pg not in handed])
        ledger.given += len(both) * p
        self._request_pages -= len(both)
        self._needed_pages -= len(both)
        return self._view(ledger, freed=ledger.given)

    def _hand_over(self, ledger: _Ledger, adopt: Slots) -> tuple[Pages, Pages]:
        """Give the `adopt` pages of the ledger to the tree; the pages, and those the ledger
        still holds. Refused (changing nothing) unless they are distinct pages it holds.

        Usually they are its first pages, in order (its own pages after its cached prefix,
        none a duplicate): then that is the check, one comparison of bytes, since a ledger's
        pages are its own (an invariant). Otherwise one lookup per page: each must carry the
        ledger's number, and be named once."""
        number, held, k = ledger.number, ledger.pages, len(adopt)
        if isinstance(adopt, Indices) and k <= len(held) and _starts(adopt, held):
            pages = as_pages(adopt)
            self._owners.put(pages, PageOwner.TREE)
            return pages, pages_of_array(held[k:])  # a copy of the rest: the ledger's array stays resizable
        pages = as_pages(adopt)
        # A ledger that never held a page has number 0, which no page carries: no page is its own.
        own = frozenset((number,)) if number >= _FIRST_LEDGER else frozenset()
        if self._owners.move(pages, own, PageOwner.TREE):
            return pages, self._held(ledger)
        listed = as_list(pages)
        table = self._owners.items
        foreign = [pg for pg in listed if not 0 <= pg < len(table) or table[pg] not in own]
        raise LedgerError(
            f"request {ledger.request_id!r}: adopted pages {(foreign or listed)[:16]} are not distinct pages of "
            "this request"
        )

    def _rest(self, ledger: _Ledger, held: Pages) -> Pages:
        """What a release frees: every page the ledger still holds once the tree took its share."""
        return held

    def _held(self, ledger: _Ledger) -> Pages:
        """The ledger's pages it still owns in the table, in token order."""
        pages = ledger.pages
        if len(pages) <= FEW_MAX:
            table, number = self._owners.items, ledger.number
            return [pg for pg in pages if table[pg] == number]
        mine = numpy.frombuffer(pages, dtype=numpy.int64)
        return mine[self._owners.view.take(mine) == ledger.number]  # a copy: no view of the ledger's array lives on

    def _distinct_live(self, rids: list[str], what: str, *, new_ok: bool = False) -> list[_Ledger]:
        if len(set(rids)) != len(rids):
            twice = sorted({r for r in rids if rids.count(r) > 1})
            raise LedgerError(f"cannot {what} request(s) {twice} twice in one call")
        return [self._live(rid, what, new_ok=new_ok) for rid in rids]

    @property
    def free_slots(self) -> int:
        return self._pool.free_slots

    def mark(self, rid: str) -> tuple[int, bool]:
        """What tells a request's ledger apart from any it had or will have: its serial (0: none
        now) and whether it was released. Equal marks at two times: nothing of it changed owner."""
        ledger = self._ledgers.get(rid)
        return (ledger.serial if ledger is not None else 0, rid in self._released)

    def ledger(self, rid: str) -> LedgerEntry:
        if rid in self._ledgers:
            return self._view(self._ledgers[rid], freed=self._ledgers[rid].given)
        if rid in self._released:
            return self._released_entry(rid)
        raise LedgerError(f"request {rid!r} has no ledger (never allocated, or retracted)")

    # -- tree and loads -------------------------------------------------------

    def allocate_load(self, n: int) -> torch.Tensor | Insufficient:
        """`allocate_load_pages`, the pages as a tensor."""
        got = self.allocate_load_pages(n)
        return got if isinstance(got, Insufficient) else got.as_tensor()

    def allocate_load_pages(self, n: int) -> Indices | Insufficient:
        """Whole pages for a load of `n` tokens from host; owner LOADING until adopted or freed."""
        k = -(-n // self.page_size)
        new = self._pool.alloc(k)
        if new is None:
            return Insufficient(requested_slots=k * self.page_size, free_slots=self._pool.free_slots)
        self._owners.put(new, PageOwner.LOADING)
        self._loading_pages += len(new)
        return indices_of(new)

    def adopt_loaded(self, pages: Slots) -> None:
        """A load into `pages` completed: the tree owns them."""
        pages = as_pages(pages)
        self._move(pages, _LOADING, PageOwner.TREE, "adopt loaded pages")
        self._loading_pages -= len(pages)

    def free_tree(self, pages: Slots) -> None:
        """Free pages the tree owns, or a load's pages whose load failed or was dropped."""
        pages = as_pages(pages)
        loading = self._loading_among(pages) if self._loading_pages else 0
        self._free(pages, _TREE_OR_LOADING, "free device pages")
        self._loading_pages -= loading

    def _loading_among(self, pages: Pages) -> int:
        """How many of `pages` (those in range) a load owns."""
        size = self._owners.size
        if isinstance(pages, list):
            items = self._owners.items
            return sum(1 for pg in pages if 0 <= pg < size and items[pg] == PageOwner.LOADING)
        at = pages[(pages >= 0) & (pages < size)]
        return int(numpy.count_nonzero(self._owners.view.take(at) == PageOwner.LOADING))

    # -- checks and numbers ---------------------------------------------------

    def counts(self) -> dict[PageOwner, int]:
        """Slots per owner, from the free list and the counts kept as pages change owner."""
        p = self.page_size
        free, request, loading = self._pool.free_pages * p, self._request_pages * p, self._loading_pages * p
        return {
            PageOwner.FREE: free,
            PageOwner.REQUEST: request,
            PageOwner.TREE: self._owners.size * p - free - request - loading,
            PageOwner.LOADING: loading,
        }

    def _recount(self) -> dict[PageOwner, int]:
        """`counts`, from the table itself (for the checks)."""
        o, p = self._owner, self.page_size
        return {
            PageOwner.FREE: int((o < 0).sum()) * p,
            PageOwner.REQUEST: int((o >= _FIRST_LEDGER).sum()) * p,
            PageOwner.TREE: int((o == PageOwner.TREE).sum()) * p,
            PageOwner.LOADING: int((o == PageOwner.LOADING).sum()) * p,
        }

    def ahead_slots(self) -> int:
        """Slots in the pages live requests hold past the pages of their allocated slots (as the
        ledgers count them: slots the facade served that they have not heard of are in it)."""
        return self.page_size * (self._request_pages - self._needed_pages)

    def live_requests(self) -> int:
        return len(self._ledgers)

    def check_invariants(self) -> None:
        counts = self._recount()
        if sum(counts.values()) != self.capacity_slots or bool((self._owner == PageOwner.REQUEST).any()):
            raise InvariantError(f"device: owners cover {sum(counts.values())} of {self.capacity_slots} slots")
        free = self._pool.free_page_set()
        if counts[PageOwner.FREE] != len(free) * self.page_size:
            raise InvariantError(
                f"device: {counts[PageOwner.FREE]} slots marked free but the free list holds {len(free)} pages"
            )
        low = self._pool.low
        if len(free) and (bool((self._owner[free] != torch.arange(-low - 1, -low - 1 - len(free), -1)).any())
                          or len(torch.unique(free)) != len(free)):
            raise InvariantError("device: the free list holds a page that is not free (or not marked with its "
                                 "place in the list), or a page twice")
        numbers = sorted([led.number for led in self._ledgers.values()] + self._spare_numbers)
        if numbers != list(range(_FIRST_LEDGER, self._next_ledger)):
            raise InvariantError(
                f"device: ledger numbers {numbers[:16]} of the live ledgers and the spare ones are not each number "
                f"handed out so far ({_FIRST_LEDGER}..{self._next_ledger - 1}) once (a number reused while a "
                "ledger holds it, or lost)"
            )
        held = 0
        for led in self._ledgers.values():
            mine = torch.frombuffer(led.pages, dtype=torch.int64) if led.pages else torch.empty(0, dtype=torch.int64)
            if bool((self._owner[mine] != led.number).any()):
                raise InvariantError(f"device: ledger of {led.request_id!r} lists a page the table gives another owner")
            held += len(mine)
            pages_left = _pages_left(led, self.page_size)
            if not (led.committed <= led.allocated and led.given % self.page_size == 0
                    and pages_left <= len(led.pages) <= pages_left + self.ahead_pages):
                raise InvariantError(
                    f"device: ledger of {led.request_id!r} has committed={led.committed}, "
                    f"allocated={led.allocated}, {len(led.pages)} pages (invariant: committed <= allocated, "
                    f"pages = ceil(allocated / page_size) - given pages, plus at most {self.ahead_pages} held "
                    f"ahead; given={led.given})"
                )
        if held * self.page_size != counts[PageOwner.REQUEST]:
            raise InvariantError(
                f"device: ledgers hold {held} pages but {counts[PageOwner.REQUEST] // self.page_size} "
                "pages are marked request-owned (a page in two ledgers, or one no ledger lists)"
            )
        for rid, final in self._released.items():
            if final & _COMMITTED_MASK > final >> _COMMITTED_BITS:
                raise InvariantError(f"device: released request {rid!r} has {self._released_entry(rid)} "
                                     "(invariant: committed <= allocated)")
        if counts != self.counts():
            raise InvariantError(f"device: the owners' counts kept as pages move, {self.counts()}, differ from the "
                                 f"table's, {counts}")
        needed = sum(_pages_left(led, self.page_size) for led in self._ledgers.values())
        if needed != self._needed_pages:
            raise InvariantError(f"device: the live ledgers' slots need {needed} pages, the count kept as they "
                                 f"change says {self._needed_pages}")

    # -- helpers --------------------------------------------------------------

    def _released_entry(self, rid: str) -> LedgerEntry:
        """The final ledger of a released request: every slot it was allocated freed."""
        final = self._released[rid]
        allocated = final >> _COMMITTED_BITS
        return LedgerEntry(request_id=rid, allocated=allocated, committed=final & _COMMITTED_MASK,
                           freed=allocated)

    def _live_or_new(self, rid: str) -> _Ledger:
        if rid in self._released:
            raise LedgerError(
                f"request {rid!r} was already released ({self._released_entry(rid)}); allocating for a "
                "finished or aborted request is a bug (SGLang #12224: never allocate after finish)"
            )
        return self._ledgers.get(rid) or _Ledger(rid, 0)

    def _live(self, rid: str, what: str, *, new_ok: bool = False) -> _Ledger:
        ledger = self._ledgers.get(rid)
        if ledger is not None:
            return ledger
        if rid in self._released:
            raise LedgerError(f"cannot {what} request {rid!r}: it was already released (released twice?)")
        if new_ok:
            return _Ledger(rid, 0)
        raise LedgerError(f"cannot {what} request {rid!r}: it has no slots (unknown request)")

    def _free(self, pages: Pages, owners: frozenset[PageOwner], what: str) -> None:
        """Push `pages` onto the free list if they are distinct pages, each with an owner of
        `owners`; else change nothing and raise, naming why."""
        low = self._pool.low - len(pages)  # below 0: more pages than are out, which the check names
        if low < 0 or not self._owners.move_free(pages, owners, low):
            self._refuse(pages, owners, what)
        self._pool.free(pages)

    def _push(self, pages: Pages) -> None:
        """Push pages whose owner was checked onto the free list, each marked with its place."""
        self._owners.put_free(pages, self._pool.free(pages))

    def _move(self, pages: Pages, owners: frozenset[PageOwner], to: PageOwner, what: str) -> None:
        """Give `pages` the owner `to` if they are distinct pages, each with an owner of `owners`;
        else change nothing and raise, naming why."""
        if not self._owners.move(pages, owners, to):
            self._refuse(pages, owners, what)

    def _refuse(self, pages: Pages, owners: frozenset[PageOwner], what: str) -> NoReturn:
        """Why `pages` may not move: out of range, named twice, or owned by another."""
        at = as_tensor(pages)
        size = self._owners.size
        if bool((at < 0).any()) or bool((at >= size).any()):
            raise SlotStateError(f"cannot {what}: page number out of range 0..{size - 1}")
        if len(torch.unique(at)) != len(at):
            raise SlotStateError(f"{what}: a page appears twice in {at.tolist()}")
        have = self._owner[at]
        ok = torch.zeros_like(have, dtype=torch.bool)
        for o in owners:
            ok |= have == o
        bad = (~ok).nonzero().flatten()[:8]
        detail = ", ".join(
            f"slots {int(at[i]) * self.page_size}..{int(at[i]) * self.page_size + self.page_size - 1} "
            f"owned by {_owner_name(int(have[i]))}"
            for i in bad
        )
        allowed = " or ".join(o.name.lower() for o in sorted(owners))
        hint = " (double free?)" if any(int(have[i]) < 0 for i in bad) else ""
        raise SlotStateError(f"cannot {what}: {detail}; expected {allowed}{hint}")

    @staticmethod
    def _view(ledger: _Ledger, freed: int) -> LedgerEntry:
        return LedgerEntry(request_id=ledger.request_id, allocated=ledger.allocated, committed=ledger.committed,
                           freed=freed)


def _pages_left(ledger: _Ledger, page_size: int) -> int:
    """The pages a ledger's allocated slots still need (those not handed over mid-life): what it
    holds without its pages ahead."""
    return -(-ledger.allocated // page_size) - ledger.given // page_size


def _room(ledger: _Ledger, page_size: int) -> int:
    """Slots the pages a ledger holds have past its allocated ones (its last page's rest, and
    the pages it was given ahead)."""
    return (ledger.given // page_size + len(ledger.pages)) * page_size - ledger.allocated


def _starts(pages: Indices, held: array) -> bool:
    """`held` starts with `pages` (one memcmp, no copy of either)."""
    data, start, stop = pages.span()
    return data.startswith(memoryview(held).cast("B")[: stop - start], start, stop)


_LOADING = frozenset((PageOwner.LOADING,))
_TREE_OR_LOADING = frozenset((PageOwner.TREE, PageOwner.LOADING))


def _owner_name(code: int) -> str:
    if code < 0:
        return "free"
    return PageOwner(min(code, PageOwner.REQUEST) if code >= _FIRST_LEDGER else code).name.lower()


