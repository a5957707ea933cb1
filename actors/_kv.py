"""KV buffers in their layouts, and the page-granular copy between them.

Copies run per contiguous run of slots, never per token with fancy indexing: a
per-token gather moves an order of magnitude fewer bytes a second than a slice copy
of a run (the figures are in docs/benchmarks.md, "Copy costs"). The one exception is a
page-granular copy on CPU whose blocks are many and tiny (a page of a small KV, scattered):
there each block's Python call, not the bytes, sets the speed, and a gather of whole
pages and a scatter cost less. On CUDA a page-granular copy is a gather and a scatter
kernel of whole pages too: pinned host memory is mapped into the device's address space,
so one kernel moves every scattered page over the bus, where a copy call a block would
pay its launch a block (and, between strided views, staging copies through pageable
memory: 1-8 GB/s of a 54 GB/s link on an H200, docs/benchmarks.md).

Layouts (`H` heads, `D` head_dim, `P` page size, `L` layers):
- layer_first: `[2, L, slots, H, D]` (the device buffer, and one host layout);
- page_first:  `[pages, 2, L, P, H, D]`: one page is contiguous across all layers,
  so the storage tier reads and writes a page as one block.

A copy is planned once (`CopyPlan`, on a `_Route` between two buffers) and run for all
layers or one. On a few slots the plan is worked out with Python ints, and on CPU a
step of few, small blocks is copied block by block without torch, since there each
torch call costs microseconds of overhead, more than the bytes; large copies keep
torch's copies and their threads. The plan, its two ways of copying and the
arithmetic that keeps the block copies inside their buffers live together: each block
copy is safe only because the plan checked its bounds against both buffers.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy
import torch

from hicache.messages.config import Config, HostLayout

from ._pages import Ints, Slots, as_tensor, ints


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
        self._tensor = tensor
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
    def tensor(self) -> torch.Tensor:
        """The KV tensor; fixed for the buffer's life (copy plans keep addresses into it)."""
        return self._tensor

    @functools.cached_property
    def _rows(self) -> _Rows | None:
        """Where its rows lie for a memmove copy (None when only torch can copy them)."""
        return _Rows.of(self)

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

    def page_rows(self, layer: int | None) -> list[torch.Tensor]:
        """One `[pages, P * H * D]` view per K and V of each layer (or of the given one): row
        `i` is page `i`'s block there (contiguous rows in layer_first, strided in page_first)."""
        t, s = self.tensor, self.shape
        row, pages = s.page_size * s.heads * s.head_dim, self.slots // s.page_size
        layers = range(s.layers) if layer is None else (layer,)
        if self.page_first:
            v = t.view(pages, 2, s.layers, row)
            return [v[:, kv, i] for i in layers for kv in (0, 1)]
        v = t.view(2, s.layers, pages, row)
        return [v[kv, i] for i in layers for kv in (0, 1)]

    @functools.cached_property
    def cuda_pages(self) -> torch.Tensor | None:
        """The buffer as `[pages, 2, L, P * H * D]` for CUDA kernels: the tensor itself on a
        CUDA device; on pinned host memory, the same bytes through the device's address
        space (unified addressing maps pinned memory, so a kernel reads and writes it over
        the bus with no staging copy); None where no kernel can reach it (pageable memory, a
        device without unified addressing)."""
        t = self.tensor
        if not t.is_contiguous():
            return None
        if t.device.type == "cuda":
            mapped = t
        elif t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned():
            mapped = _mapped(t)
            if mapped is None:
                return None
        else:
            return None
        return self.page_major(mapped)

    def page_major(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, this buffer's tensor or its bytes seen elsewhere, as `[pages, 2, L, P * H * D]`:
        row `[i, kv, l]` is page `i`'s K or V block of layer `l`."""
        s = self.shape
        pages, row = self.slots // s.page_size, s.page_size * s.heads * s.head_dim
        if self.page_first:
            return t.view(pages, 2, s.layers, row)
        return t.view(2, s.layers, pages, row).permute(2, 0, 1, 3)

    def read(self, indices: torch.Tensor, *, layer: int | None = None) -> torch.Tensor:
        """A copy of the KV in `indices` as `[2, L, n, H, D]` on CPU, in index order
        (with `layer`: that layer only, as `[2, 1, n, H, D]`)."""
        if not self.page_first and self.device.type == "cpu":  # slots are dim 2: one gather
            t = self.tensor if layer is None else self.tensor[:, layer : layer + 1]
            return t.index_select(2, self._checked(indices))
        out = KVBuffer.staging(self.shape, len(indices))
        copy_kv(self, indices, out, torch.arange(len(indices)), layer=layer)
        if layer is None:
            return out.tensor[:, :, : len(indices)]
        return out.tensor[:, layer : layer + 1, : len(indices)]

    def write(self, indices: torch.Tensor, data: torch.Tensor) -> None:
        """Write `data` (`[2, L, n, H, D]`) into `indices`."""
        if not self.page_first and self.device.type == "cpu" and data.device.type == "cpu":
            self.tensor.index_copy_(2, self._checked(indices), data.to(self.shape.dtype))  # one scatter
            return
        n = len(indices)
        src = KVBuffer.staging(self.shape, n, device=self.device)
        src.tensor[:, :, :n].copy_(data)
        copy_kv(src, torch.arange(n), self, indices)

    def _checked(self, indices: torch.Tensor) -> torch.Tensor:
        """`indices` as an int64 CPU tensor, IndexError unless each is a slot of this buffer."""
        idx = torch.as_tensor(indices, dtype=torch.int64, device="cpu")
        if len(idx) and not _in_range(idx, self.slots):
            raise IndexError(f"slot out of range 0..{self.slots - 1}")
        return idx


def involves_cuda(src: KVBuffer, dst: KVBuffer) -> bool:
    """Whether a copy between `src` and `dst` has a CUDA buffer on either side."""
    return src.device.type == "cuda" or dst.device.type == "cuda"


def _mapped_pair(src: KVBuffer, dst: KVBuffer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`src` and `dst` as `KVBuffer.cuda_pages` on one device, when CUDA is on either side."""
    if not involves_cuda(src, dst):
        return None
    a, b = src.cuda_pages, dst.cuda_pages
    if a is None or b is None or a.device != b.device:
        return None
    return a, b


class _CudaArray:
    """Pinned host bytes described to torch as device memory (`__cuda_array_interface__`):
    with unified addressing a pinned page's host address is also its device address. It
    keeps the host tensor alive for as long as the device view lives."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.__cuda_array_interface__ = {
            "shape": (t.numel() * t.element_size(),), "typestr": "|u1", "data": (t.data_ptr(), False),
            "version": 3, "strides": None,
        }


def _mapped(t: torch.Tensor) -> torch.Tensor | None:
    """Pinned, contiguous `t` as a CUDA tensor of the same shape and bytes, or None where the
    device cannot address it (torch then says the pointer is not device memory)."""
    try:
        raw = torch.as_tensor(_CudaArray(t), device="cuda")
    except (RuntimeError, TypeError, ValueError):
        return None
    if raw.data_ptr() != t.data_ptr():
        return None
    return raw.view(t.dtype).view(t.shape)


def _in_range(idx: Ints, cap: int) -> bool:
    """Whether every index is in `0 .. cap - 1` (`idx` not empty)."""
    if isinstance(idx, list):
        return min(idx) >= 0 and max(idx) < cap
    if idx.device.type == "cpu":  # numpy's reductions cost less a call than torch's
        x = idx.numpy()
        return int(x.min()) >= 0 and int(x.max()) < cap
    return int(idx.min()) >= 0 and int(idx.max()) < cap


def runs(a: Slots, b: Slots) -> list[tuple[int, int, int]]:
    """Maximal runs `(a_start, b_start, length)` where both index arrays step by one."""
    n = len(a)
    if n != len(b):
        raise ValueError(f"source has {n} slots but destination has {len(b)}")
    if n == 0:
        return []
    src, dst = ints(a), ints(b)
    return _runs_at(src, dst, _run_starts(src, dst))


def _run_starts(a: Ints, b: Ints) -> list[int] | numpy.ndarray:
    """Where each maximal run of `a` and `b` (one length, not empty) starts: 0 first."""
    if isinstance(a, list) and isinstance(b, list):  # with Python ints: see `_pages.FEW_MAX`
        return [0, *(i for i in range(1, len(a)) if a[i] != a[i - 1] + 1 or b[i] != b[i - 1] + 1)]
    x, y = as_tensor(a).numpy(), as_tensor(b).numpy()
    step = x[1:] - x[:-1]
    step ^= 1
    step |= (y[1:] - y[:-1]) ^ 1  # zero exactly where both step by one
    return numpy.flatnonzero(numpy.concatenate(([1], step)))


def _runs_at(a: Ints, b: Ints, starts: list[int] | numpy.ndarray) -> list[tuple[int, int, int]]:
    """The runs that start at `starts` (of `_run_starts(a, b)`)."""
    n = len(a)
    if isinstance(starts, list):
        ends = [*starts[1:], n]
        return [(a[i], b[i], e - i) for i, e in zip(starts, ends, strict=True)]
    x, y = as_tensor(a).numpy(), as_tensor(b).numpy()
    at = starts.tolist()
    return list(zip(x[starts].tolist(), y[starts].tolist(), [e - i for i, e in zip(at, [*at[1:], n])], strict=True))


def _pieces(rs: list[tuple[int, int, int]], pf_is_src: bool | None, p: int) -> list[tuple[int, int, int, int]]:
    """Split runs into `(src, dst, pages, span)` pieces that respect page_first pages:
    within one page of the page_first side, or whole aligned pages of it."""
    if pf_is_src is None:
        return [(s, d, 1, n) for s, d, n in rs]
    out = []
    for s, d, n in rs:
        pos = 0
        while pos < n:
            offset = ((s if pf_is_src else d) + pos) % p
            rest = n - pos
            if offset == 0 and rest >= p:
                k = rest // p
                out.append((s + pos, d + pos, k, p))
                pos += k * p
            else:
                span = min(rest, p - offset)
                out.append((s + pos, d + pos, 1, span))
                pos += span
    return out


class _Route:
    """A copy from one buffer to another: what depends only on the two buffers (their
    layouts and shape, whether memmove can copy between them), worked out once. A
    stream actor keeps the route of its two buffers and plans each batch on it
    (`plan`); `CopyPlan(...)` and `copy_kv` make one per copy."""

    __slots__ = ("block", "dst", "gather", "layers", "mapped", "page_size", "per_slot", "pf_is_src", "rows",
                 "slot_elements", "src")

    def __init__(self, src: KVBuffer, dst: KVBuffer) -> None:
        self.src, self.dst = src, dst
        shape = src.shape
        # Which side is page_first (None: neither; both is refused when planning).
        self.pf_is_src = True if src.page_first else (False if dst.page_first else None)
        self.page_size, self.layers, self.per_slot = shape.page_size, shape.layers, shape.bytes_per_slot
        self.slot_elements = 2 * shape.layers * shape.heads * shape.head_dim
        # The rows of both buffers when blocks can be copied between them, else None.
        same = shape == dst.shape and src.tensor.dtype == dst.tensor.dtype
        sr, dr = (src._rows, dst._rows) if same else (None, None)
        self.rows = None if sr is None or dr is None else (sr, dr)
        # Whole pages can be gathered and scattered by torch between contiguous CPU buffers of one
        # shape (`KVBuffer.page_rows` views them).
        self.gather = same and all(b.device.type == "cpu" and b.tensor.is_contiguous() for b in (src, dst))
        self.block = shape.page_size * shape.heads * shape.head_dim * shape.dtype.itemsize
        """Bytes of one page's K (or V) in one layer: the smallest block of a page-granular copy."""
        self.mapped = _mapped_pair(src, dst) if same else None
        """Both buffers as `KVBuffer.cuda_pages` when a copy between them involves CUDA and a
        CUDA kernel reaches both (a device buffer, pinned host memory): then a page-granular
        copy is one gather and one scatter kernel (all layers or one), however scattered its
        pages. Each piece's own `copy_` would cost microseconds of launch apiece and, between
        strided views of pinned and device memory, go through pageable staging copies."""

    def plan(self, src_idx: Slots, dst_idx: Slots) -> CopyPlan:
        """The plan of copying slot `src_idx[i]` to `dst_idx[i]`, on this route."""
        plan = CopyPlan.__new__(CopyPlan)
        plan._plan(self, src_idx, dst_idx)
        return plan

    def plan_pages(self, src_pages: Slots, dst_pages: Slots) -> CopyPlan:
        """The plan of copying page `src_pages[i]` to page `dst_pages[i]` (every slot of
        each), on this route: its runs are found over pages, `page_size` times fewer numbers."""
        p = self.page_size
        a, b = ints(src_pages), ints(dst_pages)
        n = len(a)
        if n != len(b) or n == 0:
            rs = runs(a, b)  # none, or the lengths' mismatch named
            gather = False
        else:
            for what, idx, buf in (("source", a, self.src), ("destination", b, self.dst)):
                if not _in_range(idx, buf.slots // p):
                    raise IndexError(f"copy: {what} page out of range 0..{buf.slots // p - 1}")
            if self.mapped is not None:
                rs, gather = [], True
            else:
                starts = _run_starts(a, b)  # the runs' number says which way pays before they are listed
                k = len(starts)
                gather = self.gather and k >= _GATHER_RUNS_MIN and self.block * n <= _GATHER_BLOCK_BYTES_MAX * k
                rs = [] if gather else _runs_at(a, b, starts)
        plan = CopyPlan.__new__(CopyPlan)
        plan._set(self, [(s * p, d * p, n * p) for s, d, n in rs], n * p)
        if gather:
            plan._gather = (as_tensor(a), as_tensor(b))
        return plan


_GATHER_RUNS_MIN = 16
"""A page-granular copy on CPU gathers and scatters whole pages with torch (two calls per K
and V of a layer, about 15 µs together, plus some 0.1 µs a page) when its pages make at
least this many runs of at most `_GATHER_BLOCK_BYTES_MAX` bytes a block on average: copied
block by block, each run costs a Python call (about half a microsecond) per K and V of a layer."""

_GATHER_BLOCK_BYTES_MAX = 1024
"""Past about 2 to 4 KiB a block, copying block by block beats the gather and scatter (which
move the bytes twice, and torch's index kernels move large rows slower than memcpy: 3-4x
slower at a model's 32 KiB blocks); 1 KiB keeps a margin. docs/benchmarks.md, the host tier."""


class CopyPlan:
    """The page-granular pieces of one copy between two buffers, worked out once.

    The indices are read as Python ints when few (as tensors when many, see
    `_pages.FEW_MAX`), checked against both buffers, and cut into runs and pieces;
    `run` copies all layers or one, and the load stream plans a batch once and runs
    it layer by layer. Hold a plan only while its copy is in flight: it keeps both
    buffers alive.

    A page-granular plan on a route that involves CUDA, when a kernel reaches both buffers
    (`_Route.mapped`: the device buffer and pinned host memory), copies by one gather and one
    scatter kernel of whole pages, all layers or one; it lists no runs.

    A page-granular plan (`_Route.plan_pages`) on CPU whose blocks would be many and
    tiny (see `_GATHER_RUNS_MIN`) copies instead by a torch gather of whole pages and a
    scatter per K and V of each layer (`KVBuffer.page_rows`), all layers or one; it lists
    no runs.

    Otherwise two ways to copy, each worked out at its first use and kept:
    - memmove (`_Blocks`): on CPU, between contiguous buffers of one KV shape, one
      copy per contiguous block (K or V of one layer of a run of slots within one
      page), at offsets worked out with Python ints from the buffers' strides; a Python
      call a block (see `_GIL_HELD_BYTES_MAX`).
    - torch: one `copy_` per piece on views `[2, L, pages, span, H, D]` of both
      buffers (`select`ed to one layer for a layer), all pieces in one fused call;
      a fixed cost a piece for its two views and its copy, whatever its size, and
      torch's intra-op threads share a large piece.

    One layer takes memmove whenever it can: a torch copy of one layer of a piece
    moves only 2 blocks but still pays a TensorIterator and an OpenMP fork/join; a
    layer-by-layer load of scattered pages is thousands of those, and on few cores
    that fixed cost, not memory bandwidth, sets the speed.

    All layers take memmove when it can and costs less (`_memmove_pays`): few blocks
    a piece, pieces too small for torch's threads. Otherwise (large pieces, many
    layers, CUDA, another dtype) torch copies. Both give the same bytes (tested).
    """

    __slots__ = ("_blocks", "_gather", "_pieces", "_planned", "_route", "_views", "slots")

    def __init__(self, src: KVBuffer, src_idx: Slots, dst: KVBuffer, dst_idx: Slots) -> None:
        self._plan(_Route(src, dst), src_idx, dst_idx)

    def _plan(self, route: _Route, src_idx: Slots, dst_idx: Slots) -> None:
        if route.src.page_first and route.dst.page_first:
            raise ValueError("copies between two page_first buffers are not supported")
        a, b = ints(src_idx), ints(dst_idx)
        rs = runs(a, b)
        if rs:
            for what, idx, buf in (("source", a, route.src), ("destination", b, route.dst)):
                if not _in_range(idx, buf.slots):
                    raise IndexError(f"copy: {what} slot out of range 0..{buf.slots - 1}")
        self._set(route, rs, len(a))

    def _set(self, route: _Route, rs: list[tuple[int, int, int]], slots: int) -> None:
        if route.src.page_first and route.dst.page_first:
            raise ValueError("copies between two page_first buffers are not supported")
        self._route = route
        self._pieces = _pieces(rs, route.pf_is_src, route.page_size)
        self.slots = slots
        self._views: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._blocks: _Blocks | None = None
        self._planned = False
        self._gather: tuple[torch.Tensor, torch.Tensor] | None = None
        """Source and destination pages, when the copy gathers and scatters whole pages."""

    def run(self, *, layer: int | None = None, non_blocking: bool = False) -> int:
        """Copy every piece, all layers or one; returns the number of bytes copied."""
        route = self._route
        layers = route.layers
        if self._gather is not None:
            if layer is not None and not -layers <= layer < layers:
                raise IndexError(f"layer {layer} out of range 0..{layers - 1}")
            if route.mapped is not None:
                self._run_mapped(route.mapped, layer)
            else:
                src_pages, dst_pages = self._gather
                for sv, dv in zip(route.src.page_rows(layer), route.dst.page_rows(layer), strict=True):
                    dv.index_copy_(0, dst_pages, sv.index_select(0, src_pages))
            return self.slots * (route.per_slot if layer is None else route.per_slot // layers)
        if layer is None:
            blocks = self._memmove_blocks() if _memmove_pays(self._pieces, route) else None
            if blocks is not None:
                blocks.run(range(layers))
            elif self._pieces:
                srcs, dsts = self._piece_views()
                _copy_pairs(dsts, srcs, non_blocking)
            return self.slots * route.per_slot
        if not -layers <= layer < layers:
            raise IndexError(f"layer {layer} out of range 0..{layers - 1}")
        blocks = self._memmove_blocks()
        if blocks is not None:
            blocks.run((layer % layers,))
        elif self._pieces:
            srcs, dsts = self._piece_views()
            _copy_pairs([v.select(1, layer) for v in dsts], [v.select(1, layer) for v in srcs], non_blocking)
        return self.slots * (route.per_slot // layers)

    def _run_mapped(self, mapped: tuple[torch.Tensor, torch.Tensor], layer: int | None) -> None:
        """One gather of the source pages and one scatter into the destination's, as CUDA
        kernels on the current stream (queued, not waited for). The page numbers move to the
        device at the first run, on that stream, and stay for the plan's other layers: through
        pinned memory, so that the host does not wait for what the stream has queued (a copy
        from pageable memory would wait for it, and the stream waits for the compute stream)."""
        sv, dv = mapped
        src_pages, dst_pages = self._gather  # type: ignore[misc]
        if src_pages.device != sv.device:
            staged = torch.empty((2, len(src_pages)), dtype=torch.int64, pin_memory=True)
            staged[0], staged[1] = src_pages, dst_pages
            # torch's pinned-memory cache keeps the block until the copy queued from it has run
            src_pages, dst_pages = staged.to(sv.device, non_blocking=True).unbind(0)
            self._gather = (src_pages, dst_pages)
        if layer is not None:
            sv, dv = sv[:, :, layer], dv[:, :, layer]
        dv.index_copy_(0, dst_pages, sv.index_select(0, src_pages))

    def _memmove_blocks(self) -> _Blocks | None:
        if not self._planned:
            self._planned = True
            rows = self._route.rows
            self._blocks = None if rows is None or not self._pieces else _Blocks(*rows, self._pieces)
        return self._blocks

    def _piece_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self._views is None:
            src, dst = self._route.src, self._route.dst
            self._views = (
                [src.view(s, pages, span, None) for s, _, pages, span in self._pieces],
                [dst.view(d, pages, span, None) for _, d, pages, span in self._pieces],
            )
        return self._views


_MEMMOVES_PER_PIECE_MAX = 8
"""All layers of a piece take memmove while that is at most this many blocks: a torch copy
of a piece (two views and its share of the fused call) costs about as much as 8 to 20
copies of small blocks (a Python call apiece); docs/benchmarks.md, "Copy costs"."""

_TORCH_GRAIN_ELEMENTS = 32768
"""torch copies a tensor of fewer elements on one thread (`at::internal::GRAIN_SIZE`); from
there on its intra-op threads share the copy, which one memmove at a time cannot match."""


def _memmove_pays(pieces: list[tuple[int, int, int, int]], route: _Route) -> bool:
    """Whether memmove costs less than torch to copy all layers of these pieces (when it
    can copy them at all): few blocks a piece, and pieces below torch's grain on average."""
    pages = slots = 0
    for _, _, k, span in pieces:
        pages += k
        slots += k * span
    blocks = 2 * route.layers * pages
    elements = route.slot_elements * slots
    return blocks <= _MEMMOVES_PER_PIECE_MAX * len(pieces) and elements <= _TORCH_GRAIN_ELEMENTS * len(pieces)


@dataclass(frozen=True, slots=True, eq=False)
class _Rows:
    """Where the rows of a contiguous CPU buffer lie in its storage's bytes: the K (0) or
    V (1) of one layer of one slot is `row` bytes at offset
    `base + kv * kv_step + layer * layer_step + at(slot)`, where
    `at(slot) = slot * row + (slot // page_size) * page_gap`: the slots of a page are
    adjacent, and pages `page_gap` bytes apart beyond that (0 in layer_first)."""

    storage: torch.UntypedStorage
    """Kept so that `bytes` never outlives the memory it shows."""
    bytes: memoryview
    """The storage's bytes, writable, bounds-checked on every slice."""
    address: int
    """Where `bytes[0]` is in memory."""
    base: int
    kv_step: int
    layer_step: int
    page_gap: int
    page_size: int
    row: int

    @classmethod
    def of(cls, buf: KVBuffer) -> _Rows | None:
        """The rows of `buf`, or None when memmove cannot copy them (not a contiguous CPU
        tensor). Checks that the rows of all its slots lie inside its storage."""
        t = buf.tensor
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        item = t.element_size()
        s = buf.shape
        row = s.heads * s.head_dim * item  # contiguous: also the step from slot to slot in a page
        if buf.page_first:  # [pages, 2, L, P, H, D]
            page, kv, layer = t.stride()[:3]
            gap = page * item - s.page_size * row
        else:  # [2, L, slots, H, D]
            kv, layer = t.stride()[:2]
            gap = 0
        storage = t.untyped_storage()
        address, limit = storage.data_ptr(), storage.nbytes()
        view = memoryview((ctypes.c_char * limit).from_address(address)).cast("B")
        rows = cls(storage, view, address, t.data_ptr() - address, kv * item, layer * item, gap, s.page_size, row)
        end = rows.base + rows.kv_step + (s.layers - 1) * rows.layer_step + rows.at(buf.slots - 1) + row
        if rows.base < 0 or end > limit:
            raise AssertionError(f"copy plan: the rows of a buffer lie outside its storage ({limit} bytes)")
        return rows

    def at(self, slot: int) -> int:
        """Where the rows of `slot` start, from `base` (of layer 0, K); grows with `slot`."""
        return slot * self.row + (slot // self.page_size) * self.page_gap


_GIL_HELD_BYTES_MAX = 16 << 10
"""Blocks of a copy up to this size are copied by memoryview slice assignment, which keeps
the GIL but costs a few times less a call than a ctypes memmove (docs/benchmarks.md, "Copy
costs"); a copy with larger blocks takes memmove, which releases the GIL for each block, so
that other actors' threads run while it copies."""


class _Blocks:
    """The contiguous blocks of a CPU copy: per K or V, per layer, per page of a piece
    (a page_first side breaks there), `nbytes` from offset `src + s` to `dst + d`.

    Every block lies inside its buffer: its slots are in range (the plan checked them),
    lie in one page or in layer_first, and the rows of every slot of a buffer lie inside
    its storage (`_Rows.of` checked that); slices of `_Rows.bytes` check it once more."""

    __slots__ = ("_at", "_dst", "_gil_free", "_src")

    def __init__(self, src: _Rows, dst: _Rows, pieces: list[tuple[int, int, int, int]]) -> None:
        self._src, self._dst = src, dst
        # `_Rows.at` of each block's first slot, inlined: a call per block would cost more.
        row, p, s_gap, d_gap = src.row, src.page_size, src.page_gap, dst.page_gap
        self._at = [((d + k) * row + (d + k) // p * d_gap, (s + k) * row + (s + k) // p * s_gap, span * row)
                    for s, d, pages, span in pieces for k in range(0, pages * span, span)]
        self._gil_free = max(span for _, _, _, span in pieces) * row > _GIL_HELD_BYTES_MAX

    def run(self, layers: Iterable[int]) -> None:
        """Copy these layers (each in 0 .. layers - 1)."""
        src, dst, at = self._src, self._dst, self._at
        move, s_bytes, d_bytes = _MEMMOVE, src.bytes, dst.bytes
        for layer in layers:
            for kv in (0, 1):
                s0 = src.base + kv * src.kv_step + layer * src.layer_step
                d0 = dst.base + kv * dst.kv_step + layer * dst.layer_step
                if self._gil_free:
                    s0 += src.address
                    d0 += dst.address
                    for d, s, n in at:
                        move(d0 + d, s0 + s, n)
                else:
                    for d, s, n in at:
                        d_bytes[d0 + d : d0 + d + n] = s_bytes[s0 + s : s0 + s + n]


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
    src_idx: Slots,
    dst: KVBuffer,
    dst_idx: Slots,
    *,
    layer: int | None = None,
    non_blocking: bool = False,
) -> int:
    """Copy slot `src_idx[i]` of `src` to slot `dst_idx[i]` of `dst`, all layers or one.

    Returns the number of bytes copied.
    """
    return CopyPlan(src, src_idx, dst, dst_idx).run(layer=layer, non_blocking=non_blocking)
