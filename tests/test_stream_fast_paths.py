"""The stream copies' fast paths do what their general paths do.

A `CopyPlan` copies by memmove (CPU, small blocks by memoryview slice assignment, large
ones by ctypes, which releases the GIL) or by torch views; it plans with Python ints on a
few slots and vectorised on many; the transfer queue keeps indices as Python ints, a tensor
or `Indices`. Each property runs the same copy every way and compares the bytes (with a
slot-by-slot reference), the bytes counted and the errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hicache.actors._kv as kv_module
import hicache.actors._pages as pages_module
from hicache.actors import KVBuffer, KVShape, TransferOp, TransferQueue, copy_kv
from hicache.actors._transfer_core import batch_indices, op_problem
from hicache.messages import ActorName, Indices
from hicache.runtime import HostLayout

from conftest import filled_kv, reference_copy

LF, PF = HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST
PAGES = 6

_ALL = 1 << 30
_WAYS: dict[str, list[tuple[Any, str, Any]]] = {
    # How copies run, by the module constants that decide it (besides the way as shipped).
    "memmove-held": [(kv_module, "_MEMMOVES_PER_PIECE_MAX", _ALL), (kv_module, "_TORCH_GRAIN_ELEMENTS", _ALL),
                     (kv_module, "_GIL_HELD_BYTES_MAX", _ALL)],
    "memmove-ctypes": [(kv_module, "_MEMMOVES_PER_PIECE_MAX", _ALL), (kv_module, "_TORCH_GRAIN_ELEMENTS", _ALL),
                       (kv_module, "_GIL_HELD_BYTES_MAX", 0)],
    "torch": [(kv_module._Rows, "of", classmethod(lambda cls, buf: None))],  # no buffer offers its rows
    "vectorised-plan": [(pages_module, "FEW_MAX", 0)],
    # Page-granular plans only: whole pages gathered and scattered by torch, or never.
    "page-gather": [(kv_module, "_GATHER_RUNS_MIN", 0), (kv_module, "_GATHER_BLOCK_BYTES_MAX", _ALL)],
    "no-page-gather": [(kv_module, "_GATHER_RUNS_MIN", _ALL)],
}


@contextmanager
def _way(name: str | None) -> Iterator[None]:
    """Copies inside take the named way (None: as shipped)."""
    with pytest.MonkeyPatch.context() as mp:
        for target, attr, value in _WAYS[name] if name else []:
            mp.setattr(target, attr, value)
        yield


def _filled(shape: KVShape, layout: HostLayout, seed: int) -> KVBuffer:
    return filled_kv(shape, layout, PAGES, seed)


_FORMS: dict[str, Callable[[list[int]], Any]] = {
    "list": list,
    "tensor": lambda v: torch.tensor(v, dtype=torch.int64),
    "indices": Indices.of,
}


def _outcome(run: Callable[[], Any]) -> Any:
    try:
        return run()
    except (ValueError, IndexError, RuntimeError) as err:
        return type(err).__name__, str(err)


def _copies(index_max: int, pairs_max: int) -> st.SearchStrategy[Any]:
    """Copies between two layouts: page size, layers, layer, (source, destination) index pairs, form."""
    return st.tuples(
        st.sampled_from([(LF, LF), (LF, PF), (PF, LF)]),
        st.sampled_from([1, 2, 4]),  # page size
        st.integers(1, 3),  # layers
        st.one_of(st.none(), st.integers(-3, 2)),  # layer (None: all; negative counts from the end)
        st.lists(st.tuples(st.integers(0, index_max), st.integers(0, index_max)), max_size=pairs_max),
        st.sampled_from(sorted(_FORMS)),
    )


_COPIES = _copies(PAGES * 4 - 1, 20)


@settings(max_examples=300, deadline=None)
@given(copy=_COPIES)
def test_every_way_of_copying_moves_the_same_bytes_as_a_slot_by_slot_copy(copy: Any) -> None:
    (src_layout, dst_layout), page_size, layers, layer, pairs, form = copy
    shape = KVShape(layers=layers, heads=2, head_dim=3, dtype=torch.float32, page_size=page_size)
    if layer is not None and not -layers <= layer < layers:
        layer = None
    slots = PAGES * page_size
    s_idx = [s % slots for s, _ in pairs]
    d_idx = list(dict.fromkeys(d % slots for _, d in pairs))
    s_idx = s_idx[: len(d_idx)]
    want = reference_copy(_filled(shape, src_layout, 1), s_idx, _filled(shape, dst_layout, 2), d_idx, layer)
    for way in [None, *_WAYS]:
        src, dst = _filled(shape, src_layout, 1), _filled(shape, dst_layout, 2)
        with _way(way):
            nbytes = copy_kv(src, _FORMS[form](s_idx), dst, _FORMS[form](d_idx), layer=layer)
        assert torch.equal(dst.tensor, want), way
        assert nbytes == len(s_idx) * shape.bytes_per_slot // (1 if layer is None else layers), way


@settings(max_examples=200, deadline=None)
@given(
    s_idx=st.lists(st.integers(-3, 30), max_size=12),
    d_idx=st.lists(st.integers(-3, 30), max_size=12),
    layouts=st.sampled_from([(LF, LF), (LF, PF), (PF, LF), (PF, PF)]),
    form=st.sampled_from(sorted(_FORMS)),
)
def test_every_way_refuses_bad_indices_alike(
    s_idx: list[int], d_idx: list[int], layouts: tuple[HostLayout, HostLayout], form: str
) -> None:
    shape = KVShape(layers=2, heads=1, head_dim=4, dtype=torch.float32, page_size=4)
    _same_outcome_every_way(shape, layouts, lambda src, dst: copy_kv(src, _FORMS[form](s_idx), dst, _FORMS[form](d_idx)))


def _same_outcome_every_way(
    shape: KVShape, layouts: tuple[HostLayout, HostLayout], copy: Callable[[KVBuffer, KVBuffer], Any]
) -> None:
    """`copy` between fresh buffers gives the same result (or error) every way, and a refused
    copy touches nothing."""
    outcomes = {}
    for way in [None, *_WAYS]:
        src, dst = _filled(shape, layouts[0], 1), _filled(shape, layouts[1], 2)
        before = dst.tensor.clone()
        with _way(way):
            got = _outcome(lambda: copy(src, dst))
        if isinstance(got, tuple):  # a refused copy touches nothing
            assert torch.equal(dst.tensor, before), way
        outcomes[way] = got
    assert len(set(map(repr, outcomes.values()))) == 1, outcomes


_PAGE_COPIES = _copies(PAGES * 2 - 1, 12)


@settings(max_examples=300, deadline=None)
@given(copy=_PAGE_COPIES)
def test_every_way_of_copying_pages_moves_the_same_bytes_as_a_slot_by_slot_copy(copy: Any) -> None:
    """What the streams run: `plan_pages` (which may gather whole pages) planned once, run for
    all layers or for one, layer after layer, as a load does."""
    (src_layout, dst_layout), page_size, layers, layer, pairs, form = copy
    shape = KVShape(layers=layers, heads=2, head_dim=3, dtype=torch.float32, page_size=page_size)
    if layer is not None and not -layers <= layer < layers:
        layer = None
    s_pages = [s % PAGES for s, _ in pairs]
    d_pages = list(dict.fromkeys(d % PAGES for _, d in pairs))
    s_pages = s_pages[: len(d_pages)]
    s_slots = [s * page_size + k for s in s_pages for k in range(page_size)]
    d_slots = [d * page_size + k for d in d_pages for k in range(page_size)]
    want = reference_copy(_filled(shape, src_layout, 1), s_slots, _filled(shape, dst_layout, 2), d_slots, layer)
    for way in [None, *_WAYS]:
        src, dst = _filled(shape, src_layout, 1), _filled(shape, dst_layout, 2)
        with _way(way):
            plan = kv_module._Route(src, dst).plan_pages(_FORMS[form](s_pages), _FORMS[form](d_pages))
            if way == "page-gather":
                assert (plan._gather is not None) == bool(s_pages), way
            nbytes = plan.run(layer=layer)
        assert torch.equal(dst.tensor, want), way
        assert nbytes == len(s_slots) * shape.bytes_per_slot // (1 if layer is None else layers), way
        if layer is not None:  # the same plan, run again for one layer, copies the same bytes
            assert plan.run(layer=layer) == nbytes and torch.equal(dst.tensor, want), way


@settings(max_examples=200, deadline=None)
@given(
    s_pages=st.lists(st.integers(-2, 8), max_size=10),
    d_pages=st.lists(st.integers(-2, 8), max_size=10),
    layouts=st.sampled_from([(LF, LF), (LF, PF), (PF, LF), (PF, PF)]),
    form=st.sampled_from(sorted(_FORMS)),
)
def test_every_way_refuses_bad_pages_alike(
    s_pages: list[int], d_pages: list[int], layouts: tuple[HostLayout, HostLayout], form: str
) -> None:
    shape = KVShape(layers=2, heads=1, head_dim=4, dtype=torch.float32, page_size=2)
    _same_outcome_every_way(shape, layouts, lambda src, dst: kv_module._Route(src, dst).plan_pages(
        _FORMS[form](s_pages), _FORMS[form](d_pages)).run())


def test_scattered_pages_of_a_tiny_kv_are_gathered_and_large_or_contiguous_ones_are_not() -> None:
    def gathers(heads: int, head_dim: int, pages: list[int], layers: int = 1) -> bool:
        shape = KVShape(layers=layers, heads=heads, head_dim=head_dim, dtype=torch.float16, page_size=16)
        src = KVBuffer.allocate(shape, 16 * 256, LF, "cpu")
        dst = KVBuffer.allocate(shape, 16 * 256, PF, "cpu")
        return kv_module._Route(src, dst).plan_pages(pages, list(range(len(pages))))._gather is not None

    scattered = list(range(0, 256, 2))
    assert gathers(1, 1, scattered)  # 32 bytes a block, 256 blocks: the peer harness's shape
    assert not gathers(8, 128, scattered)  # 32 KiB a block: memcpy per block beats the gather
    assert not gathers(1, 1, list(range(128)))  # one run: two blocks
    assert not gathers(1, 1, [0, 2, 4])  # three runs
    shape = KVShape(layers=1, heads=1, head_dim=1, dtype=torch.float16, page_size=16)
    wide = KVBuffer(shape, torch.zeros(2, 1, 16 * 256, 1, 2, dtype=torch.float16)[..., :1], LF)  # not contiguous
    plan = kv_module._Route(wide, KVBuffer.allocate(shape, 16 * 256, LF, "cpu")).plan_pages(scattered, scattered)
    assert plan._gather is None and plan.run() == len(scattered) * 16 * shape.bytes_per_slot


def test_a_slot_out_of_range_is_named_before_anything_is_copied() -> None:
    shape = KVShape(layers=2, heads=1, head_dim=4, dtype=torch.float32, page_size=4)
    for layouts in [(LF, LF), (LF, PF), (PF, LF)]:
        src, dst = _filled(shape, layouts[0], 1), _filled(shape, layouts[1], 2)
        with pytest.raises(IndexError, match=r"copy: destination slot out of range 0\.\.23"):
            copy_kv(src, torch.arange(4), dst, torch.tensor([20, 21, 22, 24]))
        with pytest.raises(IndexError, match=r"copy: source slot out of range 0\.\.23"):
            copy_kv(src, torch.tensor([-1, 0]), dst, torch.tensor([0, 1]), layer=1)


def test_tiny_copies_of_all_layers_take_memmove_and_large_ones_torch() -> None:
    def way(layers: int, heads: int, head_dim: int, slots: int) -> str:
        shape = KVShape(layers=layers, heads=heads, head_dim=head_dim, dtype=torch.float16, page_size=4)
        src = KVBuffer.allocate(shape, 64, LF, "cpu")
        dst = KVBuffer.allocate(shape, 64, PF, "cpu")
        plan = kv_module.CopyPlan(src, list(range(slots)), dst, list(range(slots)))
        route = plan._route
        return "memmove" if kv_module._memmove_pays(plan._pieces, route) and route.rows else "torch"

    assert way(layers=2, heads=1, head_dim=8, slots=8) == "memmove"  # the replay bench's shape
    assert way(layers=32, heads=1, head_dim=8, slots=8) == "torch"  # 64 blocks a page
    assert way(layers=2, heads=8, head_dim=128, slots=64) == "torch"  # pages beyond torch's grain


def test_buffers_that_are_not_contiguous_are_copied_by_torch() -> None:
    shape = KVShape(layers=2, heads=1, head_dim=4, dtype=torch.float32, page_size=4)
    wide = torch.arange(2 * 2 * 16 * 1 * 8, dtype=torch.float32).view(2, 2, 16, 1, 8)
    src = KVBuffer(shape, wide[..., :4], LF)  # rows of 4 of every 8 values
    dst = KVBuffer.allocate(shape, 16, LF, "cpu")
    assert src._rows is None and dst._rows is not None
    copy_kv(src, [3, 4, 9], dst, [0, 1, 2])
    assert torch.equal(dst.tensor[:, :, :3], wide[:, :, [3, 4, 9], :, :4])


# -- the transfer queue's index forms --------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6), slots_max=st.integers(1, 70),
       form=st.sampled_from(sorted(_FORMS)))
def test_batches_hold_the_same_slots_whatever_form_the_ops_keep(sizes: list[int], slots_max: int, form: str) -> None:
    def batches(make: Callable[[list[int]], Any]) -> list[tuple[list[int], list[int]]]:
        q = TransferQueue(slots_max, len(sizes))
        base = 0
        for i, n in enumerate(sizes):
            q.push(TransferOp(i, ActorName.TREE, make(list(range(base, base + n))),
                              make(list(range(1000 + base, 1000 + base + n)))))
            base += n + 3
        out = []
        while batch := q.next_batch():
            src, dst = batch_indices(batch)
            assert len(src) == len(dst) == sum(p.end - p.start for p in batch)
            out.append((pages_module.as_tensor(src).tolist(), pages_module.as_tensor(dst).tolist()))
        return out

    assert batches(_FORMS[form]) == batches(_FORMS["tensor"])


@settings(max_examples=200, deadline=None)
@given(src=st.lists(st.integers(-2, 9), max_size=70), dst=st.lists(st.integers(-2, 9), max_size=70),
       form=st.sampled_from(sorted(_FORMS)))
def test_op_problem_says_the_same_of_every_form(src: list[int], dst: list[int], form: str) -> None:
    want = op_problem(torch.tensor(src, dtype=torch.int64), 8, torch.tensor(dst, dtype=torch.int64), 8)
    assert op_problem(_FORMS[form](src), 8, _FORMS[form](dst), 8) == want
    with _way("vectorised-plan"):
        assert op_problem(_FORMS[form](src), 8, _FORMS[form](dst), 8) == want
