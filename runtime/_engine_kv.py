"""`DeviceKV`: the device KV pool as an engine's forward pass reads and writes it.

Layouts (the device's is fixed; the host's is `Config.host_layout`):

- device (L1): layer-first `[2, layers, slots, kv_heads, head_dim]` whatever `host_layout`
  says; index 0 is K, 1 is V. Slot `s` is offset `s % page_size` of page `s // page_size`,
  so one layer's K (or V) is `[slots, kv_heads, head_dim]` and, page by page,
  `[pages, page_size, kv_heads, head_dim]`: the paged cache that FlashInfer (NHD) and
  flash-attn (`k_cache` with a block table) take, without a copy.
- host (L2): `layer_first` as the device, or `page_first` `[pages, 2, layers, page_size,
  kv_heads, head_dim]` (one page contiguous across layers, as storage reads and writes it).
  An engine never touches the host buffer: load-back copies its pages into device slots,
  layer by layer, and the forward pass waits per layer (`LayerWaiter.wait_layer`).

A request's positions lie in the slots the facade gives (`AdmitResult.device_indices`,
`allocate()`, `slots(rid)`): position `i` in slot `slots[i]`, whole pages in position
order, so `page_table(slots)` is its row of a block table.

Every tensor stays on the pool's device: on CUDA, `write` and `gather` are device
kernels on the caller's current stream (which `wait_layer` has ordered after the
layer's load), and no KV passes through host memory. Slot numbers are checked (in
range; distinct for a write) before any kernel runs: a bad slot would corrupt another
request's KV, or, on CUDA, abort the device context. `index(slots)` checks them and
moves them to the device once, for all the layers of a forward pass.

With `Config.check_kv_writes`, an index for writing (`distinct=True`) is also checked
against the slots live requests hold for their own positions (`LiveSlots`, which the
facade keeps): a write into a cached prefix, a free slot or an ended request's is refused
before anything lands. An engine whose own kernels write the pool indexes its output
slots this way to have them checked. With `Config.check_kv_reads`, slots read (`gather`,
`page_table`, an index with `distinct=False`) must lie in pages a live request holds, and
`gather(layer, ...)` refuses pages whose load-back from host memory has not landed that
layer; nothing is read or returned then. A call given the `request_id` its slots are for
takes only that request's pages (its own new ones for a write): a row of slots kept after
its pages changed hands is refused even when another live request holds them now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ._facade_types import shown

if TYPE_CHECKING:
    from hicache.actors import KVBuffer

_INDEX_DTYPES = frozenset({torch.int32, torch.int64})


class KVArgumentError(ValueError):
    """A call on the device KV named a layer, slots or K/V tensors it cannot take."""


@dataclass(frozen=True, slots=True)
class SlotIndex:
    """Slots checked against one pool (in range, and `distinct` if so), on the pool's device."""

    tensor: torch.Tensor
    """int64, 1-D, on the pool's device."""
    distinct: bool
    pool: int
    """`id` of the pool tensor they were checked against."""
    checked: int = -1
    """With `Config.check_kv_writes` (for writing) or `check_kv_reads`: the `LiveSlots.generation`
    they were found writable (readable) at."""
    loads: tuple[int, ...] = ()
    """With `Config.check_kv_reads`: the load batches that were still filling some of their pages
    then (`gather` checks each layer against them)."""

    def __len__(self) -> int:
        return self.tensor.shape[0]


class _SlotCheck(Protocol):
    """What slots are checked against with `Config.check_kv_writes` or `check_kv_reads`: the
    facade's `LiveSlots`, from its records of the live requests and of the load-backs."""

    generation: int
    """Changes whenever the slots that may be written or read do."""

    def writable(self, slots: torch.Tensor) -> int:
        """Raise `KVArgumentError` unless every one of `slots` may be written; the generation."""
        ...

    def readable(self, slots: torch.Tensor) -> tuple[int, tuple[int, ...]]:
        """Raise `KVArgumentError` unless every one of `slots` may be read; the generation, and
        the load batches still filling some of their pages."""
        ...

    def landed(self, slots: torch.Tensor, loads: tuple[int, ...], layer: int) -> None:
        """Raise `KVArgumentError` unless layer `layer` of every one of `slots` has landed."""
        ...

    def owned(self, rid: str, slots: torch.Tensor, *, write: bool) -> None:
        """Raise `KVArgumentError` unless request `rid` is live and holds every one of `slots`
        (for its own new positions, if `write`)."""
        ...


class DeviceKV:
    """The device (L1) KV pool of a started `HiCache`, per layer (see the module docstring)."""

    def __init__(self, buffer: KVBuffer, writable: _SlotCheck | None = None,
                 readable: _SlotCheck | None = None) -> None:
        self._buffer = buffer
        self._writable = writable
        """With `Config.check_kv_writes`, what an index for writing is checked against; else None."""
        self._readable = readable
        """With `Config.check_kv_reads`, what slots read are checked against; else None."""
        self._t = buffer.tensor
        self._storage = self._t.untyped_storage().data_ptr()
        """Where the pool's memory starts: K or V that lie in it are views of the pool (`write`)."""
        s = buffer.shape
        self.layers, self.kv_heads, self.head_dim, self.page_size = s.layers, s.heads, s.head_dim, s.page_size
        self.slots = buffer.slots
        self.pages = buffer.slots // s.page_size

    @property
    def dtype(self) -> torch.dtype:
        return self._t.dtype

    @property
    def device(self) -> torch.device:
        return self._t.device

    @property
    def buffer(self) -> KVBuffer:
        return self._buffer

    # -- views -----------------------------------------------------------------------

    def k(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s K of every slot, `[slots, kv_heads, head_dim]` (a view)."""
        return self._t[0, self._layer(layer)]

    def v(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s V of every slot, `[slots, kv_heads, head_dim]` (a view)."""
        return self._t[1, self._layer(layer)]

    def k_pages(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s K page by page, `[pages, page_size, kv_heads, head_dim]` (a view)."""
        return self.k(layer).view(self.pages, self.page_size, self.kv_heads, self.head_dim)

    def v_pages(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s V page by page, `[pages, page_size, kv_heads, head_dim]` (a view)."""
        return self.v(layer).view(self.pages, self.page_size, self.kv_heads, self.head_dim)

    # -- a forward pass ------------------------------------------------------------------

    def index(self, slots: torch.Tensor | SlotIndex, *, distinct: bool = True,
              request_id: str | None = None) -> SlotIndex:
        """`slots` checked once (in range; with `distinct`, no slot twice) and put on the pool's
        device, for every layer's `write` or `gather` of a forward pass. With
        `Config.check_kv_writes`, `distinct` slots are also checked to be writable (index slots
        that are only read with `distinct=False`); with `Config.check_kv_reads`, slots indexed
        otherwise are checked to be readable. Given the `request_id` they are for, they are
        checked to be that request's too (its own new positions' pages for writing, any of
        its pages for reading)."""
        idx = self._index(slots, distinct)
        self._owned(request_id, idx, write=distinct)
        return idx

    def _index(self, slots: torch.Tensor | SlotIndex, distinct: bool) -> SlotIndex:
        if type(distinct) is not bool:
            raise KVArgumentError(f"distinct must be True or False, got {shown(distinct)}")
        if isinstance(slots, SlotIndex):
            if slots.pool != id(self._t):
                raise KVArgumentError("these slots were checked against another cache's pool: index them again")
            if distinct and not slots.distinct:
                raise KVArgumentError("slots indexed with distinct=False cannot be written: index them with distinct=True")
            if distinct and self._writable is not None:
                if slots.checked != self._writable.generation:
                    return SlotIndex(slots.tensor, True, slots.pool, self._writable.writable(slots.tensor))
            elif self._readable is not None and slots.checked != self._readable.generation:
                return SlotIndex(slots.tensor, slots.distinct, slots.pool, *self._readable.readable(slots.tensor))
            return slots
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in _INDEX_DTYPES:
            got = f"a {slots.dtype} tensor of shape {tuple(slots.shape)}" if isinstance(slots, torch.Tensor) \
                else type(slots).__name__
            raise KVArgumentError(f"slots must be a 1-D int64 (or int32) tensor, as the facade gives them; got {got}")
        if len(slots):
            lo, hi = (int(x) for x in torch.aminmax(slots))
            if lo < 0 or hi >= self.slots:
                raise KVArgumentError(f"slot {lo if lo < 0 else hi} is outside the pool's 0..{self.slots - 1}")
            if distinct and len(slots) > 1:
                ordered = slots.sort().values
                if bool((ordered[1:] == ordered[:-1]).any()):
                    raise KVArgumentError("a write names a slot twice: each new token needs a slot of its own")
        placed = slots.to(self.device, torch.int64, non_blocking=True)
        if placed is slots:  # int64 on the pool's device already: a copy, so that what was checked stays so
            placed = slots.clone()  # (an engine reuses its output-slot buffer for the next pass)
        if distinct and self._writable is not None:
            return SlotIndex(placed, True, id(self._t), self._writable.writable(placed))
        if self._readable is not None:
            return SlotIndex(placed, distinct, id(self._t), *self._readable.readable(placed))
        return SlotIndex(placed, distinct, id(self._t))

    def write(self, layer: int, slots: torch.Tensor | SlotIndex, k: torch.Tensor, v: torch.Tensor,
              request_id: str | None = None) -> None:
        """Write layer `layer`'s K and V of new tokens (`[n, kv_heads, head_dim]` each, on the
        pool's device, in its dtype) into their `n` slots (with `Config.check_kv_writes` and the
        `request_id` they are for, slots of pages that request does not hold for its own new
        positions are refused)."""
        layer = self._layer(layer)
        idx = self.index(slots, request_id=request_id)
        n = len(idx)
        for name, x in (("k", k), ("v", v)):
            self._check_kv(name, x, n)
        # K and V of a pass computed with autograd on: the pool keeps no graph (it would hold every
        # pass's tensors alive). Views of the pool itself (a copy between slots): copied first, so
        # that K's write cannot change V's source and torch's overlap check cannot refuse V after K landed.
        k, v = k.detach(), v.detach()
        if k.untyped_storage().data_ptr() == self._storage:
            k = k.clone()
        if v.untyped_storage().data_ptr() == self._storage:
            v = v.clone()
        self._t[0, layer].index_copy_(0, idx.tensor, k)
        self._t[1, layer].index_copy_(0, idx.tensor, v)

    def gather(self, layer: int, slots: torch.Tensor | SlotIndex,
               request_id: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V of `slots`, in their order: two `[n, kv_heads, head_dim]`
        tensors on the pool's device (a copy: attention without a paged kernel reads these).
        With `Config.check_kv_reads`, slots of a prefix loaded back from host memory are refused
        until this layer of their load landed (`LayerWaiter.wait_layer`), and given the
        `request_id` the slots are read for, slots of pages that request does not hold."""
        layer, idx = self._read(layer, slots, request_id)
        both = self._t[:, layer].index_select(1, idx.tensor)
        return both[0], both[1]

    def check_read(self, layer: int, slots: torch.Tensor | SlotIndex, request_id: str | None = None) -> None:
        """What `gather(layer, slots, request_id)` checks, without the copy: for an engine whose
        paged kernel reads layer `layer` of `k_pages` / `v_pages` in place through a block table.
        With `Config.check_kv_reads`, call it before the kernel of each layer (on a `SlotIndex`
        made once for the pass, `index(slots, distinct=False)`): it refuses slots no live request
        holds and pages whose load-back has not landed that layer (and, given a `request_id`,
        pages that request does not hold). Without it, only the arguments are checked."""
        self._read(layer, slots, request_id)

    def _read(self, layer: int, slots: torch.Tensor | SlotIndex,
              request_id: str | None = None) -> tuple[int, SlotIndex]:
        """The checked layer and index of a read (see `gather`)."""
        layer = self._layer(layer)
        idx = self.index(slots, distinct=False, request_id=request_id)
        if idx.loads:  # only with check_kv_reads
            self._readable.landed(idx.tensor, idx.loads, layer)  # type: ignore[union-attr]
        return layer, idx

    def _owned(self, request_id: str | None, idx: SlotIndex, *, write: bool) -> None:
        """With the check of writes (`write`) or of reads on, refuse slots for `request_id` (when
        given) of pages that request does not hold (for its own new positions, if `write`); a
        `request_id` that is no request id, always."""
        if request_id is None:
            return
        if type(request_id) is not str or not request_id:
            raise KVArgumentError(f"request_id must be a request's id (a non-empty str) or None, got "
                                  f"{shown(request_id)}")
        check = self._writable if write else self._readable
        if check is not None:
            check.owned(request_id, idx.tensor, write=write)

    def page_table(self, slots: torch.Tensor, request_id: str | None = None) -> torch.Tensor:
        """The page of each page of positions of a request whose positions lie in `slots`
        (as the facade gives them): its block-table row, int64 on CPU. With
        `Config.check_kv_reads` and the `request_id`, slots of pages it does not hold are refused."""
        idx = self.index(slots, distinct=False, request_id=request_id).tensor.cpu()
        p = self.page_size
        pages = idx[::p] // p
        expect = pages.repeat_interleave(p)[: len(idx)] * p + torch.arange(len(idx)) % p
        if not torch.equal(expect, idx):
            raise KVArgumentError("these slots are not whole pages in position order (slot i at offset i % "
                                  "page_size of its page): pass a request's slots as the facade gives them")
        return pages

    # -- checks ----------------------------------------------------------------------

    def _layer(self, layer: int) -> int:
        if type(layer) is not int or not 0 <= layer < self.layers:
            raise KVArgumentError(f"layer must be an int in 0..{self.layers - 1}, got {shown(layer)}")
        return layer

    def _check_kv(self, name: str, x: torch.Tensor, n: int) -> None:
        want = (n, self.kv_heads, self.head_dim)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise KVArgumentError(f"{name} must be [tokens, kv_heads, head_dim] = {list(want)}, got {got}")
        if x.dtype != self.dtype:
            raise KVArgumentError(f"{name} is {x.dtype} but the pool holds {self.dtype}: compute K/V in the "
                                  "cache's dtype (Config.dtype)")
        if x.device != self.device:
            raise KVArgumentError(f"{name} is on {x.device} but the pool is on {self.device}: compute K/V on the "
                                  "pool's device (the cache never stages KV through another memory)")
