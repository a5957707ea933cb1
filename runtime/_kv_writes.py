"""`WritableSlots`: which device slots a forward pass may write (`Config.check_kv_writes`).

A cached prefix's slots are shared: the radix tree owns them and every request whose
prompt matches reads them. An engine that writes K/V there (a whole prompt recomputed and
written, a slot row kept after a retract, a step written after its request finished)
corrupts what every later request on that prefix reads, and nothing else would notice.
With the option on, `DeviceKV` asks this object before a write: a slot is writable when
its page is one a live request holds for its own positions, past its cached prefix (the
pages `allocate` gave it, those held ahead included; not its cached prefix's, nor what it
handed to the tree by `cache_unfinished`).

The facade owns the records; this reads them (the same thread calls both) and keeps a
mask of writable pages on the pool's device, rebuilt when the facade says its records
changed (a grant, a release, a swap, pages held ahead given back), at the next check: a
pass over the live requests' pages. A check is one gather on the device and one `.all()`,
which on CUDA waits for the device once. Pages that left a live request are remembered
with how (one entry a page, the last), so a refusal can say whose a slot was.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from hicache.messages import Indices

from ._engine_kv import KVArgumentError

_TODO = {
    "prefix": "write only the positions past the cached prefix (from AdmitResult.cached_tokens on), "
              "into the slots allocate() gave",
    "gone": "write a step's K/V before its request ends, and only into slots allocate() gave a live request "
            "(read slots(rid) again after cache_unfinished() or a new admission)",
    "free": "write only into slots allocate() gave a live request",
}


class _Holder(Protocol):
    """What the check reads of a live request (the facade's record)."""

    prefix: int

    def held(self) -> bytes: ...


class WritableSlots:
    """The writable pages of one running cache, from the facade's live records (see the module
    docstring); what its `DeviceKV` checks writes against."""

    def __init__(self, lives: Mapping[str, _Holder], pages: int, page_size: int) -> None:
        self._lives = lives
        self._pages, self._p = pages, page_size
        self._mask: torch.Tensor | None = None
        """Per page, writable or not, on the device of the slots last checked; None: rebuild."""
        self._gone: dict[int, str] = {}
        """Per page that left a live request, how: "request 'r1' finished"."""
        self.generation = 0
        """Changes with the records: a `SlotIndex` checked at another generation is checked again."""

    def changed(self) -> None:
        """The live requests' pages changed: the mask is rebuilt at the next check."""
        self.generation += 1
        self._mask = None

    def left(self, rid: str, pages: bytes, how: str) -> None:
        """Pages (int64 bytes) that request `rid` no longer holds, and how it let them go."""
        if pages:
            self._gone.update(dict.fromkeys(Indices(pages).tolist(), f"request {rid!r} {how}"))
        self.changed()

    def check(self, slots: torch.Tensor) -> int:
        """Refuse `slots` (int64, on the pool's device) unless every one is writable; the
        generation they were checked at."""
        mask = self._mask
        if mask is None or mask.device != slots.device:
            mask = self._mask = self._build().to(slots.device)
        ok = mask[slots // self._p] if self._p > 1 else mask[slots]
        if not bool(ok.all()):
            first = int(slots[int(torch.argmin(ok.to(torch.uint8)))])
            raise KVArgumentError(self._refusal(first))
        return self.generation

    def _build(self) -> torch.Tensor:
        mask = torch.zeros(self._pages, dtype=torch.bool)
        own = [Indices(live.held()).as_tensor()[live.prefix // self._p :] for live in self._lives.values()]
        if own:
            mask[torch.cat(own)] = True
        return mask

    def _refusal(self, slot: int) -> str:
        """What `slot` is, and what to do: one line."""
        page = slot // self._p
        for rid, live in self._lives.items():
            if page in Indices(live.held()).tolist()[: live.prefix // self._p]:
                what, kind = f"is in the cached prefix of request {rid!r} (shared: other requests read it)", "prefix"
                break
        else:
            how = self._gone.get(page)
            what, kind = (f"belongs to no live request ({how})", "gone") if how else \
                ("is free (no request holds its page)", "free")
        return f"slot {slot} {what}; {_TODO[kind]} (Config.check_kv_writes)"

