"""`DeviceCore`: the device KV buffer, its page allocator and the request ledger.

Every device page has exactly one owner: free, a live request, the tree, or an
in-flight load. A request's ledger (seed 001) records how many slots it was
handed (`allocated`) and how many hold real KV (`committed`); `allocated >=
committed` always, and `release` gives back every page of the request exactly
once, in one place: pages the tree adopts change owner, all others are freed.
Running out of pages is not an error but an `Insufficient` result.

The owners are one `bytearray`, seen also as a uint8 tensor over the same memory.
Each call keeps its page and slot numbers in the form `_pages` chooses for their
number (`Ints`): Python ints for a few slots (most calls: from the message's bytes to
the reply's without a tensor), a tensor for many. Slots come in as tensors or
`Indices`; the `*_indices` methods answer with the `Indices` a reply carries, the
others with tensors (read-only views of those `Indices`).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hicache.messages import Indices, LedgerEntry, ReleaseReason
from hicache.runtime.config import Config, DeviceKind, HostLayout

from ._errors import InvariantError, LedgerError, SlotStateError
from ._kv import KVBuffer, KVShape
from ._pages import (
    SMALL_SLOTS_MAX,
    Ints,
    PagePool,
    as_list,
    as_tensor,
    holds,
    indices_of,
    ints,
    pages_of,
    put,
    slots_of_pages,
)

RELEASED_REMEMBERED_MAX = 1 << 16
"""Finished or aborted requests whose final ledger is kept (to catch use after release)."""


class PageOwner(enum.IntEnum):
    FREE = 0
    REQUEST = 1
    TREE = 2
    LOADING = 3


@dataclass(frozen=True, slots=True)
class Insufficient:
    """Not enough free pages; nothing was allocated."""

    requested_slots: int
    free_slots: int

    @property
    def shortfall_slots(self) -> int:
        return self.requested_slots - self.free_slots


LedgerView = LedgerEntry
"""A request's ledger as numbers (`request_id`, `allocated`, `committed`, `freed`): the
record a reply carries, so that the actor passes the core's answer on as it is."""


@dataclass(slots=True)
class _Ledger:
    request_id: str
    pages: list[int] = field(default_factory=list)
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
        self._owner_bytes = bytearray(config.device_pages)
        self._owner = torch.frombuffer(self._owner_bytes, dtype=torch.uint8)
        """The same memory as `_owner_bytes` (both are written, neither is copied)."""
        self._ledgers: dict[str, _Ledger] = {}
        self._released: OrderedDict[str, LedgerView] = OrderedDict()

    # -- requests -------------------------------------------------------------

    def allocate(self, demands: Sequence[tuple[str, int]]) -> dict[str, torch.Tensor] | Insufficient:
        """`allocate_indices`, each request's slots as a tensor."""
        got = self.allocate_indices(demands)
        return got if isinstance(got, Insufficient) else {rid: idx.as_tensor() for rid, idx in got.items()}

    def allocate_indices(self, demands: Sequence[tuple[str, int]]) -> dict[str, Indices] | Insufficient:
        """Slots for several requests, all or nothing, in demand order. Each request first
        gets the rest of its last partial page, then whole pages."""
        p = self.page_size
        plan: list[tuple[_Ledger, int, int]] = []  # ledger, tokens, new pages
        seen: set[str] = set()
        for rid, n in demands:
            if n < 0:
                raise LedgerError(f"request {rid!r}: cannot allocate {n} slots")
            if rid in seen:
                raise LedgerError(f"request {rid!r} appears twice in one allocation")
            seen.add(rid)
            ledger = self._live_or_new(rid)
            spare = (-ledger.allocated) % p
            plan.append((ledger, n, -(-max(0, n - spare) // p)))
        need = sum(k for _, _, k in plan)
        if need > self._pool.free_pages:
            return Insufficient(requested_slots=need * p, free_slots=self._pool.free_slots)
        out: dict[str, Indices] = {}
        for ledger, n, k in plan:
            self._ledgers.setdefault(ledger.request_id, ledger)
            start = ledger.allocated
            if k:
                new = self._pool.alloc(k)
                assert new is not None
                self._set_owner(new, PageOwner.REQUEST)
                ledger.pages.extend(as_list(new))
            ledger.allocated += n
            out[ledger.request_id] = indices_of(self._slots_of(ledger, start, ledger.allocated))
        return out

    def commit(self, rid: str, n: int) -> LedgerView:
        return self.commit_many([(rid, n)])[0]

    def commit_many(self, demands: Sequence[tuple[str, int]]) -> list[LedgerView]:
        """Commit for several requests, all or nothing: every demand is checked first."""
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
        return [self._view(ledger, freed=ledger.given) for ledger in ledgers]

    def release(self, rid: str, adopt: torch.Tensor | Indices, reason: ReleaseReason) -> LedgerView:
        return self.release_many([(rid, adopt, reason)])[0]

    def release_many(
        self, releases: Sequence[tuple[str, torch.Tensor | Indices, ReleaseReason]]
    ) -> list[LedgerView]:
        """Give back every page of each request: its `adopt` pages to the tree, the
        rest to the free list. Exactly once per request; all or nothing."""
        # A request admitted and ended before it allocated has an empty ledger.
        ledgers = self._distinct_live([rid for rid, _, _ in releases], "release", new_ok=True)
        plans = [
            self._split_release(ledger, adopt)
            for ledger, (_, adopt, _) in zip(ledgers, releases, strict=True)
        ]
        views = []
        for ledger, (adopt_pages, rest), (rid, _, reason) in zip(ledgers, plans, releases, strict=True):
            self._set_owner(adopt_pages, PageOwner.TREE)
            self._set_owner(rest, PageOwner.FREE)
            self._pool.free(rest)
            self._ledgers.pop(rid, None)
            view = self._view(ledger, freed=ledger.allocated)
            if reason is not ReleaseReason.RETRACTED:
                self._released[rid] = view
                while len(self._released) > RELEASED_REMEMBERED_MAX:
                    self._released.popitem(last=False)
            views.append(view)
        return views

    def swap(self, rid: str, adopt: torch.Tensor | Indices, free: torch.Tensor | Indices) -> LedgerView:
        """Mid-life: whole committed pages of a live request go to the tree (`adopt`) or
        back to the free list (`free`, duplicates of the tree's); the request stays live."""
        ledger = self._live(rid, "swap pages of", new_ok=True)  # a full-prefix hit may not have allocated
        p = self.page_size
        adopt_pages = pages_of(ints(adopt), p, f"slots adopted from request {rid!r}")
        free_pages = pages_of(ints(free), p, f"duplicate slots freed from request {rid!r}")
        both = as_list(adopt_pages) + as_list(free_pages)
        full = ledger.pages[: ledger.committed // p - ledger.given // p] if ledger.committed >= ledger.given else []
        handed = set(both)
        if len(handed) != len(both) or not handed <= set(full):
            raise LedgerError(
                f"request {rid!r}: pages {both} are not distinct, whole, committed pages of the "
                "request (only committed pages can be handed over mid-life)"
            )
        self._set_owner(adopt_pages, PageOwner.TREE)
        self._set_owner(free_pages, PageOwner.FREE)
        self._pool.free(free_pages)
        ledger.pages = [pg for pg in ledger.pages if pg not in handed]
        ledger.given += len(both) * p
        return self._view(ledger, freed=ledger.given)

    def _split_release(self, ledger: _Ledger, adopt: torch.Tensor | Indices) -> tuple[Ints, Ints]:
        """The request's pages to the tree (`adopt`'s) and to the free list (the rest, in ledger order)."""
        rid = ledger.request_id
        adopt_pages = pages_of(ints(adopt), self.page_size, f"slots adopted from request {rid!r}")
        if isinstance(adopt_pages, list) and len(ledger.pages) * self.page_size <= SMALL_SLOTS_MAX:
            taken = set(adopt_pages)
            if len(taken) == len(adopt_pages) and taken.issubset(ledger.pages):
                return adopt_pages, [pg for pg in ledger.pages if pg not in taken]
        mine = torch.tensor(ledger.pages, dtype=torch.int64)
        adopt_pages = as_tensor(adopt_pages)
        if len(adopt_pages):
            foreign = ~torch.isin(adopt_pages, mine)
            if bool(foreign.any()) or len(torch.unique(adopt_pages)) != len(adopt_pages):
                raise LedgerError(
                    f"request {rid!r}: adopted pages {adopt_pages[foreign].tolist() or adopt_pages.tolist()}"
                    " are not distinct pages of this request"
                )
        return adopt_pages, mine[~torch.isin(mine, adopt_pages)]

    def _distinct_live(self, rids: list[str], what: str, *, new_ok: bool = False) -> list[_Ledger]:
        if len(set(rids)) != len(rids):
            twice = sorted({r for r in rids if rids.count(r) > 1})
            raise LedgerError(f"cannot {what} request(s) {twice} twice in one call")
        return [self._live(rid, what, new_ok=new_ok) for rid in rids]

    def ledger(self, rid: str) -> LedgerView:
        if rid in self._ledgers:
            return self._view(self._ledgers[rid], freed=self._ledgers[rid].given)
        if rid in self._released:
            return self._released[rid]
        raise LedgerError(f"request {rid!r} has no ledger (never allocated, or retracted)")

    # -- tree and loads -------------------------------------------------------

    def allocate_load(self, n: int) -> torch.Tensor | Insufficient:
        """`allocate_load_indices`, the slots as a tensor."""
        got = self.allocate_load_indices(n)
        return got if isinstance(got, Insufficient) else got.as_tensor()

    def allocate_load_indices(self, n: int) -> Indices | Insufficient:
        """Whole pages for a load from host; owner LOADING until adopted or freed."""
        k = -(-n // self.page_size)
        new = self._pool.alloc(k)
        if new is None:
            return Insufficient(requested_slots=k * self.page_size, free_slots=self._pool.free_slots)
        self._set_owner(new, PageOwner.LOADING)
        return indices_of(slots_of_pages(new, self.page_size))

    def adopt_loaded(self, indices: torch.Tensor | Indices) -> None:
        pages = pages_of(ints(indices), self.page_size, "adopted loaded slots")
        self._expect(pages, (PageOwner.LOADING,), "adopt loaded slots")
        self._set_owner(pages, PageOwner.TREE)

    def free_tree(self, indices: torch.Tensor | Indices) -> None:
        """Free pages the tree owns, or a load's pages whose load failed or was dropped."""
        pages = pages_of(ints(indices), self.page_size, "freed device slots")
        self._expect(pages, (PageOwner.TREE, PageOwner.LOADING), "free device slots")
        self._set_owner(pages, PageOwner.FREE)
        self._pool.free(pages)

    # -- checks and numbers ---------------------------------------------------

    def counts(self) -> dict[PageOwner, int]:
        c = torch.bincount(self._owner.to(torch.int64), minlength=len(PageOwner))
        return {o: int(c[o]) * self.page_size for o in PageOwner}

    def live_requests(self) -> int:
        return len(self._ledgers)

    def check_invariants(self) -> None:
        counts = self.counts()
        if sum(counts.values()) != self.capacity_slots:
            raise InvariantError(f"device: owners cover {sum(counts.values())} of {self.capacity_slots} slots")
        free = self._pool.free_page_set()
        if counts[PageOwner.FREE] != len(free) * self.page_size:
            raise InvariantError(
                f"device: {counts[PageOwner.FREE]} slots marked free but the free list holds {len(free)} pages"
            )
        if len(free) and (bool((self._owner[free] != PageOwner.FREE).any()) or len(torch.unique(free)) != len(free)):
            raise InvariantError("device: the free list holds a page that is not free, or a page twice")
        owned = [pg for led in self._ledgers.values() for pg in led.pages]
        if len(owned) != len(set(owned)):
            raise InvariantError("device: a page is in two request ledgers")
        if len(owned) * self.page_size != counts[PageOwner.REQUEST]:
            raise InvariantError(
                f"device: ledgers hold {len(owned)} pages but {counts[PageOwner.REQUEST] // self.page_size} "
                "pages are marked request-owned"
            )
        for led in self._ledgers.values():
            pages_left = -(-led.allocated // self.page_size) - led.given // self.page_size
            if not (led.committed <= led.allocated and led.given % self.page_size == 0 and pages_left == len(led.pages)):
                raise InvariantError(
                    f"device: ledger of {led.request_id!r} has committed={led.committed}, "
                    f"allocated={led.allocated}, {len(led.pages)} pages (invariant: "
                    f"committed <= allocated, pages = ceil(allocated / page_size) - given pages; given={led.given})"
                )
        for view in self._released.values():
            if view.freed != view.allocated:
                raise InvariantError(f"device: request {view.request_id!r} freed {view.freed} of {view.allocated}")

    # -- helpers --------------------------------------------------------------

    def _live_or_new(self, rid: str) -> _Ledger:
        if rid in self._released:
            raise LedgerError(
                f"request {rid!r} was already released ({self._released[rid]}); allocating for a "
                "finished or aborted request is a bug (seed 001: never allocate after finish)"
            )
        return self._ledgers.get(rid) or _Ledger(rid)

    def _live(self, rid: str, what: str, *, new_ok: bool = False) -> _Ledger:
        ledger = self._ledgers.get(rid)
        if ledger is not None:
            return ledger
        if rid in self._released:
            raise LedgerError(f"cannot {what} request {rid!r}: it was already released (released twice?)")
        if new_ok:
            return _Ledger(rid)
        raise LedgerError(f"cannot {what} request {rid!r}: it has no slots (unknown request)")

    def _slots_of(self, ledger: _Ledger, start: int, end: int) -> Ints:
        """Slots of token positions `start..end` (pages given away mid-life come first)."""
        p = self.page_size
        first = (start - ledger.given) // p
        offset = start - ledger.given - first * p
        pages = ledger.pages[first:]
        if len(pages) * p > SMALL_SLOTS_MAX:
            pages = as_tensor(pages)
        return slots_of_pages(pages, p)[offset : offset + end - start]

    def _set_owner(self, pages: Ints, owner: PageOwner) -> None:
        put(self._owner_bytes, self._owner, pages, owner)

    def _expect(self, pages: Ints, owners: tuple[PageOwner, ...], what: str) -> None:
        if isinstance(pages, list):
            if holds(self._owner_bytes, pages, frozenset(owners)):
                return
            pages = as_tensor(pages)  # refused: the check below names why
        if not len(pages):
            return
        if bool(((pages < 0) | (pages >= len(self._owner))).any()):
            raise SlotStateError(f"cannot {what}: slot index out of range 0..{self.capacity_slots - 1}")
        if len(torch.unique(pages)) != len(pages):
            raise SlotStateError(f"{what}: a page appears twice in {pages.tolist()}")
        have = self._owner[pages]
        ok = torch.zeros_like(have, dtype=torch.bool)
        for o in owners:
            ok |= have == o
        if not bool(ok.all()):
            bad = (~ok).nonzero().flatten()[:8]
            detail = ", ".join(
                f"slots {int(pages[i]) * self.page_size}..{int(pages[i]) * self.page_size + self.page_size - 1} "
                f"owned by {PageOwner(int(have[i])).name.lower()}"
                for i in bad
            )
            allowed = " or ".join(o.name.lower() for o in owners)
            hint = " (double free?)" if any(int(have[i]) == PageOwner.FREE for i in bad) else ""
            raise SlotStateError(f"cannot {what}: {detail}; expected {allowed}{hint}")

    @staticmethod
    def _view(ledger: _Ledger, freed: int) -> LedgerView:
        return LedgerView(request_id=ledger.request_id, allocated=ledger.allocated, committed=ledger.committed,
                          freed=freed)

