"""KV buffers in their layouts, and the page-granular copy between them.

Copies run per contiguous run of slots, never per token with fancy indexing: on
this machine class a per-token gather moves about 1.8 GB/s, a per-page slice copy
about 18 GB/s, a raw contiguous copy about 35 GB/s.

Layouts (`H` heads, `D` head_dim, `P` page size, `L` layers):
- layer_first: `[2, L, slots, H, D]` (the device buffer, and one host layout);
- page_first:  `[pages, 2, L, P, H, D]`: one page is contiguous across all layers,
  so the storage tier reads and writes a page as one block.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hicache.runtime.config import Config, HostLayout

from ._pages import SMALL_SLOTS_MAX


@dataclass(frozen=True, slots=True)
class KVShape:
    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int

    @classmethod
    def of(cls, config: Config) -> KVShape:
        return cls(config.layers, config.kv_heads, config.head_dim, config.torch_dtype, config.page_size)

    @property
    def bytes_per_slot(self) -> int:
        return 2 * self.layers * self.heads * self.head_dim * self.dtype.itemsize


class KVBuffer:
    """A KV tensor with its layout. Pools own these; streams copy between them."""

    def __init__(self, shape: KVShape, tensor: torch.Tensor, layout: HostLayout) -> None:
        self.shape = shape
        self.layout = layout
        self.tensor = tensor
        p = shape.page_size
        if layout is HostLayout.PAGE_FIRST:
            self.slots = tensor.shape[0] * p
        else:
            self.slots = tensor.shape[2]
        if self.slots % p:
            raise ValueError(f"{self.slots} slots are not whole pages of {p}")

    @classmethod
    def allocate(
        cls, shape: KVShape, slots: int, layout: HostLayout, device: torch.device | str, pin: bool = False
    ) -> KVBuffer:
        s = shape
        if layout is HostLayout.PAGE_FIRST:
            dims = (slots // s.page_size, 2, s.layers, s.page_size, s.heads, s.head_dim)
        else:
            dims = (2, s.layers, slots, s.heads, s.head_dim)
        t = torch.zeros(dims, dtype=s.dtype, device=device, pin_memory=pin)
        return cls(s, t, layout)

    @classmethod
    def staging(cls, shape: KVShape, slots: int, device: torch.device | str = "cpu") -> KVBuffer:
        """A layer-first scratch buffer of at least `slots` (whole pages, at least one)."""
        p = shape.page_size
        return cls.allocate(shape, max(p, -(-slots // p) * p), HostLayout.LAYER_FIRST, device)

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def page_first(self) -> bool:
        return self.layout is HostLayout.PAGE_FIRST

    def view(self, start: int, pages: int, span: int, layer: int | None) -> torch.Tensor:
        """The slots `start .. start + pages * span` as `[2, (L,) pages, span, H, D]`.

        For page_first a piece is either within one page (`pages == 1`) or whole
        aligned pages (`span == P`); the caller splits runs that way.
        """
        t = self.tensor
        s = self.shape
        n = pages * span
        if not self.page_first:
            if layer is None:
                return t[:, :, start : start + n].view(2, s.layers, pages, span, s.heads, s.head_dim)
            return t[:, layer, start : start + n].view(2, pages, span, s.heads, s.head_dim)
        p = s.page_size
        page, offset = divmod(start, p)
        if span == p and offset == 0:
            if layer is None:
                return t[page : page + pages].permute(1, 2, 0, 3, 4, 5)
            return t[page : page + pages, :, layer].permute(1, 0, 2, 3, 4)
        assert pages == 1 and offset + span <= p, "page_first piece crosses a page"
        if layer is None:
            return t[page, :, :, offset : offset + span].unsqueeze(2)
        return t[page, :, layer, offset : offset + span].unsqueeze(1)

    def read(self, indices: torch.Tensor, *, layer: int | None = None) -> torch.Tensor:
        """A copy of the KV in `indices` as `[2, L, n, H, D]` on CPU, in index order
        (with `layer`: that layer only, as `[2, 1, n, H, D]`)."""
        out = KVBuffer.staging(self.shape, len(indices))
        copy_kv(self, indices, out, torch.arange(len(indices)), layer=layer)
        if layer is None:
            return out.tensor[:, :, : len(indices)]
        return out.tensor[:, layer : layer + 1, : len(indices)]

    def write(self, indices: torch.Tensor, data: torch.Tensor) -> None:
        """Write `data` (`[2, L, n, H, D]`) into `indices`."""
        n = len(indices)
        src = KVBuffer.staging(self.shape, n, device=self.device)
        src.tensor[:, :, :n].copy_(data)
        copy_kv(src, torch.arange(n), self, indices)


def runs(a: torch.Tensor, b: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs `(a_start, b_start, length)` where both index arrays step by one."""
    n = len(a)
    if n != len(b):
        raise ValueError(f"source has {n} slots but destination has {len(b)}")
    if n == 0:
        return []
    if n <= SMALL_SLOTS_MAX:  # with Python ints: see SMALL_SLOTS_MAX
        src, dst = a.tolist(), b.tolist()
        out, start = [], 0
        for i in range(1, n):
            if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
                out.append((src[start], dst[start], i - start))
                start = i
        out.append((src[start], dst[start], n - start))
        return out
    brk = ((a[1:] - a[:-1]) != 1) | ((b[1:] - b[:-1]) != 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), brk.nonzero().flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([n])])
    return list(zip(a[starts].tolist(), b[starts].tolist(), (ends - starts).tolist(), strict=True))


def _pieces_for(
    run: tuple[int, int, int], pf_is_src: bool | None, p: int
) -> Iterator[tuple[int, int, int, int]]:
    """Split a run into `(src, dst, pages, span)` pieces that respect page_first pages:
    within one page of the page_first side, or whole aligned pages of it."""
    s, d, n = run
    if pf_is_src is None:
        yield s, d, 1, n
        return
    pos = 0
    while pos < n:
        key = (s if pf_is_src else d) + pos
        offset = key % p
        rest = n - pos
        if offset == 0 and rest >= p:
            k = rest // p
            yield s + pos, d + pos, k, p
            pos += k * p
        else:
            span = min(rest, p - offset)
            yield s + pos, d + pos, 1, span
            pos += span


class CopyPlan:
    """The page-granular pieces of one copy between two buffers, worked out once.

    A plan holds, per piece, a source and a destination view over all layers
    (`[2, L, pages, span, H, D]`); `run` copies all layers or one. The load stream
    plans a batch once and runs it layer by layer, so the runs are not recomputed
    per layer. Hold a plan only while its copy is in flight: it keeps both buffers alive.

    How a step copies:
    - all layers: one torch `copy_` per piece (2 x L blocks each), all pieces in one
      fused call; the per-call cost is amortised and torch's intra-op threads help.
    - one layer, CPU to CPU (the device stand-in): a `memmove` per contiguous block
      (K or V of a run of tokens), addresses taken from the views' own strides and
      checked against both storages when first needed. A torch copy of one layer of
      a piece moves only 2 blocks but still pays a TensorIterator and an OpenMP
      fork/join; a layer-by-layer load of scattered pages is thousands of those, and
      on a 2-core machine that fixed cost, not memory bandwidth, set the speed
      (about 2 GB/s against 9-12 GB/s by memmove at 64-token pages).
    - one layer otherwise (CUDA, rows that are not contiguous): as for all layers,
      on `select`ed views.
    """

    __slots__ = ("_blocks", "_dst_views", "_layers", "_per_slot", "_planned", "_src_views", "_tensors", "slots")

    def __init__(self, src: KVBuffer, src_idx: torch.Tensor, dst: KVBuffer, dst_idx: torch.Tensor) -> None:
        if src.page_first and dst.page_first:
            raise ValueError("copies between two page_first buffers are not supported")
        pf_is_src = True if src.page_first else (False if dst.page_first else None)
        p = src.shape.page_size
        pieces = [piece for run in runs(src_idx, dst_idx) for piece in _pieces_for(run, pf_is_src, p)]
        self._src_views = [src.view(s, pages, span, None) for s, _, pages, span in pieces]
        self._dst_views = [dst.view(d, pages, span, None) for _, d, pages, span in pieces]
        self.slots = len(src_idx)
        self._per_slot = src.shape.bytes_per_slot
        self._layers = src.shape.layers
        self._tensors = (src.tensor, dst.tensor)
        self._blocks: _LayerBlocks | None = None
        self._planned = False

    def run(self, *, layer: int | None = None, non_blocking: bool = False) -> int:
        """Copy every piece, all layers or one; returns the number of bytes copied."""
        if layer is None:
            if self._dst_views:
                _copy_pairs(self._dst_views, self._src_views, non_blocking)
            return self.slots * self._per_slot
        if not -self._layers <= layer < self._layers:
            raise IndexError(f"layer {layer} out of range 0..{self._layers - 1}")
        if not self._planned:
            self._planned = True
            self._blocks = _LayerBlocks.plan(*self._tensors, self._src_views, self._dst_views)
        if self._blocks is not None:
            self._blocks.run(layer)
        elif self._dst_views:
            srcs = [v.select(1, layer) for v in self._src_views]
            dsts = [v.select(1, layer) for v in self._dst_views]
            _copy_pairs(dsts, srcs, non_blocking)
        return self.slots * (self._per_slot // self._layers)


class _LayerBlocks:
    """Byte addresses and sizes of the contiguous blocks of each layer of a CPU plan."""

    __slots__ = ("_dst", "_nbytes", "_src")

    def __init__(self, dst: list[list[int]], src: list[list[int]], nbytes: list[int]) -> None:
        self._dst, self._src, self._nbytes = dst, src, nbytes

    @classmethod
    def plan(
        cls, src: torch.Tensor, dst: torch.Tensor, src_views: list[torch.Tensor], dst_views: list[torch.Tensor]
    ) -> _LayerBlocks | None:
        """The blocks of a copy, or None when a torch copy must do it."""
        if not src_views or src.device.type != "cpu" or dst.device.type != "cpu" or src.dtype != dst.dtype:
            return None
        layers = src_views[0].shape[1]
        # Per block of one (K, layer 0): its element offset and its K->V and layer strides.
        rows: list[tuple[int, int, int, int, int, int, int]] = []
        for sv, dv in zip(src_views, dst_views, strict=True):
            block = _common_block(sv, dv)
            if block is None:
                return None
            elems, lead = block
            for at in itertools.product(*(range(sv.shape[i]) for i in range(2, lead))):
                s_at = sv.storage_offset() + sum(j * sv.stride(2 + k) for k, j in enumerate(at))
                d_at = dv.storage_offset() + sum(j * dv.stride(2 + k) for k, j in enumerate(at))
                rows.append((s_at, sv.stride(0), sv.stride(1), d_at, dv.stride(0), dv.stride(1), elems))
        item = src.dtype.itemsize
        r = torch.tensor(rows, dtype=torch.int64)
        kv = torch.arange(2, dtype=torch.int64).view(1, 2, 1)
        layer = torch.arange(layers, dtype=torch.int64).view(layers, 1, 1)
        s_off = ((r[:, 0] + kv * r[:, 1] + layer * r[:, 2]) * item).reshape(layers, -1)
        d_off = ((r[:, 3] + kv * r[:, 4] + layer * r[:, 5]) * item).reshape(layers, -1)
        nbytes = (r[:, 6] * item).repeat(2)
        for what, off, t in (("source", s_off, src), ("destination", d_off, dst)):
            limit = t.untyped_storage().nbytes()
            if int(off.min()) < 0 or int((off + nbytes).max()) > limit:
                raise AssertionError(f"copy plan: a {what} block lies outside its buffer ({limit} bytes)")
        d_addr = d_off + dst.untyped_storage().data_ptr()
        s_addr = s_off + src.untyped_storage().data_ptr()
        return cls(d_addr.tolist(), s_addr.tolist(), nbytes.tolist())

    def run(self, layer: int) -> None:
        move = _MEMMOVE
        for d, s, n in zip(self._dst[layer], self._src[layer], self._nbytes, strict=True):
            move(d, s, n)


def _common_block(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int] | None:
    """`(elements, leading dims)`: the trailing dims (after K/V and layer) that are one
    contiguous block in both views; None when not even the last dim is contiguous."""
    elems, lead = 1, a.dim()
    for i in range(a.dim() - 1, 1, -1):
        if a.shape[i] != 1 and (a.stride(i) != elems or b.stride(i) != elems):
            break
        elems *= a.shape[i]
        lead = i
    return None if lead == a.dim() else (elems, lead)


_MEMMOVE = ctypes.memmove
"""libc memmove; ctypes releases the GIL for the call, like a torch copy."""


def _copy_pairs_loop(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> None:
    for d, s in zip(dsts, srcs, strict=True):
        d.copy_(s, non_blocking=non_blocking)


def _copy_pairs_fused(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> None:
    torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


# `_foreach_copy_` runs the list of `copy_` calls in one dispatch (and one GIL release).
_copy_pairs = _copy_pairs_fused if hasattr(torch, "_foreach_copy_") else _copy_pairs_loop


def copy_kv(
    src: KVBuffer,
    src_idx: torch.Tensor,
    dst: KVBuffer,
    dst_idx: torch.Tensor,
    *,
    layer: int | None = None,
    non_blocking: bool = False,
) -> int:
    """Copy slot `src_idx[i]` of `src` to slot `dst_idx[i]` of `dst`, all layers or one.

    Returns the number of bytes copied.
    """
    return CopyPlan(src, src_idx, dst, dst_idx).run(layer=layer, non_blocking=non_blocking)
