"""`LiveSlots`: which device slots a forward pass may write and read (`Config.check_kv_writes`,
`Config.check_kv_reads`).

Writes. A cached prefix's slots are shared: the radix tree owns them and every request
whose prompt matches reads them. An engine that writes K/V there (a whole prompt recomputed
and written, a slot row kept after a retract, a step written after its request finished)
corrupts what every later request on that prefix reads, and nothing else would notice.
With `check_kv_writes`, `DeviceKV` asks this object before a write: a slot is writable when
its page is one a live request holds for its own positions, past its cached prefix (the
pages `allocate` gave it, those held ahead included; not its cached prefix's, nor what it
handed to the tree by `cache_unfinished`).

Reads. An engine reads wrong K/V, as silently, from a slot list kept too long (after
`cache_unfinished` switched its request to the tree's copy and freed its own, after the
request ended, a free slot), or from a prefix loaded back from host memory before the
layer it reads landed. With `check_kv_reads`, a slot is readable when its page is one a
live request holds, its cached prefix included; and `gather(layer, ...)` refuses a page a
load-back fills until that layer of its batch landed. A read made for one request (the
`request_id` of `gather`, `check_read`, `page_table`) takes only that request's pages, and
a write made for one (`write`, `index`) only its own new pages: a row of slots kept too
long, whose pages another request holds now, would read or overwrite that one's K/V.
Which pages: an admission names the
pages it queued for load-back (`Admitted.loads`); the next `StartLoads` starts every queued
one as one batch, whose number the facade learns from its reply. How far: the
`LayerDoneRing` says, without blocking, whether a layer of a batch landed (batches run one
after another, so a batch that began means every earlier one ended).

The facade owns the records; this reads them (the same thread calls both) and keeps, on
the pool's device, a mask of writable pages, one of readable pages and the load batch of
each page still loading, each rebuilt when the facade says its records changed (a grant, a
release, a swap, pages held ahead given back; with reads also an admission, a start of
load-backs), at the next check that needs it: a pass over the live requests' pages. A
check is one gather on the device and one `.all()` (while pages are loading, a read's
check is one `unique` instead), which on CUDA waits for the device once; a checked `SlotIndex` keeps
the generation and the batches its pages were loading in, so that the layers of a forward
pass check only those batches against the ring. Pages that left a live request are
remembered with how (one entry a page, the last), so a refusal can say whose a slot was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
from hicache.messages import Indices

from ._engine_kv import KVArgumentError

_WRITE_TODO = {
    "prefix": "write only the positions past the cached prefix (from AdmitResult.cached_tokens on), "
              "into the slots allocate() gave",
    "gone": "write a step's K/V before its request ends, and only into slots allocate() gave a live request "
            "(read slots(rid) again after cache_unfinished() or a new admission)",
    "free": "write only into slots allocate() gave a live request",
}

_READ_TODO = ("read only slots a live request holds, as the facade gives them now (read slots(rid) again after "
              "cache_unfinished() or a new admission; keep no slots or SlotIndex past their request's end)")

_QUEUED = -1
"""The load batch of a page whose load-back is queued and not started yet (no `start_loads` since)."""

_NOT_HELD = -2
"""In `readable`'s one pass: a slot whose page no live request holds."""


class _Holder(Protocol):
    """What the checks read of a live request (the facade's record)."""

    prefix: int

    def held(self) -> bytes: ...


class LiveSlots:
    """The writable and readable pages of one running cache, from the facade's live records, and
    the pages its load-backs fill (see the module docstring); what its `DeviceKV` checks against."""

    def __init__(self, lives: Mapping[str, _Holder], pages: int, page_size: int, *, reads: bool) -> None:
        self._lives = lives
        self._pages, self._p = pages, page_size
        self._reads = reads
        self._masks: dict[bool, torch.Tensor] = {}
        """Per kind (True: writable), per page, on the device of the slots last checked; absent: rebuild."""
        self._gone: dict[int, str] = {}
        """Per page that left a live request, how: "request 'r1' finished"."""
        self._loads: dict[int, int] = {}
        """With reads: per page a load-back fills that may not have landed, its batch (or `_QUEUED`)."""
        self._batches: torch.Tensor | None = None
        """`_loads` per page (0: none), on the device of the slots last checked; None: rebuild."""
        self.ring: Any = None
        """The `LayerDoneRing` of the running system (the facade sets it at each start)."""
        self.generation = 0
        """Changes with the records: a `SlotIndex` checked at another generation is checked again."""

    # -- the facade's records --------------------------------------------------------------------

    def changed(self) -> None:
        """The live requests' pages (or, with reads, the pages loading) changed: rebuilt at the next check."""
        self.generation += 1
        self._masks.clear()
        self._batches = None

    def left(self, rid: str, pages: bytes, how: str) -> None:
        """Pages (int64 bytes) that request `rid` no longer holds, and how it let them go."""
        if pages:
            self._gone.update(dict.fromkeys(Indices(pages).tolist(), f"request {rid!r} {how}"))
        self.changed()

    def admitted(self, loads: Indices) -> None:
        """An admission: its requests' cached prefixes became readable, and the pages of `loads`
        wait for the next `start_loads`."""
        if self._reads:
            if loads:
                self._loads.update(dict.fromkeys(loads.tolist(), _QUEUED))
            self.changed()

    def granted(self, pages: Iterable[Indices]) -> None:
        """Pages an allocation gave live requests: no load-back fills them any more (one that
        failed gave its pages back, and they may be granted again)."""
        if self._loads:
            for part in pages:
                for page in part.tolist():
                    self._loads.pop(page, None)
        self.changed()

    def started(self, batch: int) -> None:
        """Every queued load-back started, as load batch `batch`."""
        queued = [page for page, b in self._loads.items() if b == _QUEUED]
        if queued:
            self._loads.update(dict.fromkeys(queued, batch))
            self.changed()

    # -- checks ----------------------------------------------------------------------------------

    def writable(self, slots: torch.Tensor) -> int:
        """Refuse `slots` (int64, on the pool's device) unless every one is writable; the
        generation they were checked at."""
        _, ok = self._held(slots, write=True)
        if not bool(ok.all()):
            self._refuse(slots, ok, write=True)
        return self.generation

    def readable(self, slots: torch.Tensor) -> tuple[int, tuple[int, ...]]:
        """Refuse `slots` (int64, on the pool's device) unless a live request holds every one's
        page; the generation they were checked at, and the load batches (`_QUEUED`: not started)
        of their pages still loading then, which `landed` checks per layer. One wait for the
        device on CUDA, as `writable`: with pages loading, one `unique` answers both."""
        pages, ok = self._held(slots, write=False)
        if not self._loads:
            if not bool(ok.all()):
                self._refuse(slots, ok, write=False)
            return self.generation, ()
        seen = torch.unique(torch.where(ok, self._batch_of(slots.device)[pages], _NOT_HELD)).tolist()
        if _NOT_HELD in seen:
            self._refuse(slots, ok, write=False)
        return self.generation, tuple(b for b in seen if b)

    def owned(self, rid: str, slots: torch.Tensor, *, write: bool) -> None:
        """Refuse `slots` (on the pool's device) unless request `rid` holds every one's page:
        for reading, its cached prefix's or one `allocate` gave it (what its attention may read);
        for writing (`write`), one `allocate` gave it (its own new positions)."""
        live = self._lives.get(rid)
        config = "check_kv_writes" if write else "check_kv_reads"
        if live is None:
            raise KVArgumentError(f"request {rid!r} is not live (never admitted, or it ended): a "
                                  f"{'write' if write else 'read'} for a request is of a live one's slots "
                                  f"(Config.{config})")
        held = Indices(live.held()).as_tensor()[live.prefix // self._p if write else 0 :].to(slots.device)
        pages = slots // self._p if self._p > 1 else slots
        ok = torch.isin(pages, held)
        if not bool(ok.all()):
            slot = int(slots[int(torch.argmin(ok.to(torch.uint8)))])
            raise KVArgumentError(self._not_its(rid, slot, write))

    def _not_its(self, rid: str, slot: int, write: bool) -> str:
        page = slot // self._p
        other = self._holder(page, besides=rid)
        what = f"is request {other!r}'s" if other is not None else self._unheld(page)[0]
        if write:
            return (f"slot {slot} {what}, not request {rid!r}'s; a request writes only into the slots allocate() "
                    f"gave it for its new positions: take them from allocate() or slots({rid!r}) "
                    "(Config.check_kv_writes)")
        return (f"slot {slot} {what}, not request {rid!r}'s; a request reads only the slots of its own positions "
                f"(its cached prefix's and those allocate() gave it): take them from slots({rid!r}) "
                "(Config.check_kv_reads)")

    def landed(self, slots: torch.Tensor, loads: tuple[int, ...], layer: int) -> None:
        """Refuse a read of layer `layer` of `slots` (checked by `readable`, which found `loads`)
        where a page's load-back has not landed that layer."""
        ring = self.ring
        for b in loads:
            if (b == _QUEUED or not ring.landed(b, layer)) and (why := self._unlanded(slots, layer)):
                raise KVArgumentError(why)

    def _held(self, slots: torch.Tensor, *, write: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages of `slots`, and per slot whether a live request holds its page (for its own
        positions if `write`)."""
        mask = self._masks.get(write)
        if mask is None or mask.device != slots.device:
            mask = self._masks[write] = self._build(write).to(slots.device)
        pages = slots // self._p if self._p > 1 else slots
        return pages, mask[pages]

    def _refuse(self, slots: torch.Tensor, ok: torch.Tensor, *, write: bool) -> None:
        """A refusal naming the first of `slots` that `ok` says no live request holds."""
        first = int(slots[int(torch.argmin(ok.to(torch.uint8)))])
        raise KVArgumentError(self._refusal(first, write))

    def _build(self, write: bool) -> torch.Tensor:
        mask = torch.zeros(self._pages, dtype=torch.bool)
        p = self._p
        held = [Indices(live.held()).as_tensor()[live.prefix // p if write else 0 :] for live in self._lives.values()]
        if held:
            mask[torch.cat(held)] = True
        return mask

    def _batch_of(self, device: torch.device) -> torch.Tensor:
        """`_loads` as a tensor a page, once the batches that landed every layer are dropped."""
        if self._batches is not None and self._batches.device == device:
            return self._batches
        ring = self.ring
        done = {b for b in set(self._loads.values())
                if b != _QUEUED and all(ring.landed(b, layer) for layer in range(ring.layers))}
        if done:
            self._loads = {page: b for page, b in self._loads.items() if b not in done}
        batch = torch.zeros(self._pages, dtype=torch.int64)
        if self._loads:
            batch[torch.tensor(list(self._loads))] = torch.tensor(list(self._loads.values()))
        self._batches = batch.to(device)
        return self._batches

    # -- refusals: one line each -------------------------------------------------------------------

    def _refusal(self, slot: int, write: bool) -> str:
        """What `slot` is, and what to do."""
        page = slot // self._p
        if write and (rid := self._holder(page, prefix=True)) is not None:
            what, kind = f"is in the cached prefix of request {rid!r} (shared: other requests read it)", "prefix"
        else:
            what, kind = self._unheld(page)
        if write:
            return f"slot {slot} {what}; {_WRITE_TODO[kind]} (Config.check_kv_writes)"
        return f"slot {slot} {what}; {_READ_TODO} (Config.check_kv_reads)"

    def _unheld(self, page: int) -> tuple[str, str]:
        """What a page no live request holds is, and its kind: "gone" (with how it left its
        request) or "free"."""
        how = self._gone.get(page)
        return (f"belongs to no live request ({how})", "gone") if how else ("is free (no request holds its page)", "free")

    def _holder(self, page: int, *, prefix: bool = False, besides: str | None = None) -> str | None:
        """The first live request (other than `besides`) that holds `page` (in its cached prefix, if `prefix`)."""
        for rid, live in self._lives.items():
            held = Indices(live.held()).tolist()
            if rid != besides and page in (held[: live.prefix // self._p] if prefix else held):
                return rid
        return None

    def _unlanded(self, slots: torch.Tensor, layer: int) -> str:
        """Why the first of `slots` whose load-back has not landed layer `layer` cannot be read
        ("" if all have landed by now)."""
        ring = self.ring
        for slot in slots.tolist():
            b = self._loads.get(slot // self._p)
            if b is None or (b != _QUEUED and ring.landed(b, layer)):
                continue
            if b == _QUEUED:
                rid = self._holder(slot // self._p, prefix=True)
                whose = f" of request {rid!r}" if rid is not None else ""
                return (f"slot {slot} is in the cached prefix{whose}, which a load-back from host memory fills, "
                        "but start_loads() was not called since its admission, so nothing copies it; call "
                        f"start_loads() and wait for the layer (waiter.wait_layer({layer})) before reading it "
                        "(Config.check_kv_reads)")
            if (failure := ring.failure(b)) is not None:
                return (f"slot {slot} is in a prefix whose load-back from host memory failed (load batch {b}: "
                        f"{failure}); its K/V is not valid: retract the requests that read it and admit them "
                        "again (Config.check_kv_reads)")
            return (f"slot {slot} is in a prefix that load batch {b} brings back from host memory, and its layer "
                    f"{layer} has not landed yet; call waiter.wait_layer({layer}) first, on the waiter "
                    "start_loads() returned (Config.check_kv_reads)")
        return ""
