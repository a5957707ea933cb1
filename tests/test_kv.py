"""KV buffers, `runs()` and the page-granular `copy_kv`, checked against a slow
per-slot reference copy, between layer_first and page_first buffers."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable

import pytest
import torch

from hicache.actors import KVBuffer, KVShape, copy_kv, runs
from hicache.actors._kv import _Route
from hicache.runtime import Config, HostLayout

from conftest import filled_kv, kv_of_slot, reference_copy

LF, PF = HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST
PAGES = 8


def _shape(page_size: int, layers: int = 2) -> KVShape:
    return KVShape(layers=layers, heads=1, head_dim=8, dtype=torch.float32, page_size=page_size)


def _filled(shape: KVShape, layout: HostLayout, seed: int) -> KVBuffer:
    return filled_kv(shape, layout, PAGES, seed)


def _scattered(rng: random.Random, page_size: int, drop: float) -> list[int]:
    """Distinct slots: whole pages in random order, with a share of single slots
    dropped so that partial pages and runs of every length appear."""
    pages = list(range(PAGES))
    rng.shuffle(pages)
    slots = [pg * page_size + i for pg in pages for i in range(page_size)]
    return [s for s in slots if rng.random() >= drop]


# -- runs -------------------------------------------------------------------------


def test_runs_of_nothing_is_empty() -> None:
    e = torch.empty(0, dtype=torch.int64)
    assert runs(e, e) == []


def test_runs_of_one_slot_is_one_run() -> None:
    assert runs(torch.tensor([5]), torch.tensor([9])) == [(5, 9, 1)]


def test_runs_break_where_either_side_stops_stepping_by_one() -> None:
    a = torch.tensor([0, 1, 2, 3, 10, 11, 12, 13])
    b = torch.tensor([4, 5, 9, 10, 11, 12, 13, 0])
    assert runs(a, b) == [(0, 4, 2), (2, 9, 2), (10, 11, 3), (13, 0, 1)]


def test_runs_merge_a_contiguous_copy_into_one_run() -> None:
    assert runs(torch.arange(100, 164), torch.arange(7, 71)) == [(100, 7, 64)]


def test_runs_of_unequal_lengths_name_source_and_destination() -> None:
    with pytest.raises(ValueError, match="source has 3 slots but destination has 5"):
        runs(torch.arange(3), torch.arange(5))


def test_runs_treat_a_descending_sequence_as_single_slots() -> None:
    assert runs(torch.tensor([3, 2, 1]), torch.tensor([0, 1, 2])) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]


# -- buffers ----------------------------------------------------------------------


def test_kv_shape_of_a_config_carries_its_dimensions(make_config: Callable[..., Config]) -> None:
    cfg = make_config(page_size=16, dtype="bfloat16")
    shape = KVShape.of(cfg)
    assert (shape.layers, shape.heads, shape.head_dim, shape.dtype, shape.page_size) == (
        cfg.layers, cfg.kv_heads, cfg.head_dim, torch.bfloat16, 16
    )
    assert shape.bytes_per_slot == cfg.bytes_per_slot == 2 * 2 * 1 * 8 * 2


def test_a_buffer_of_slots_that_are_not_whole_pages_is_refused() -> None:
    shape = _shape(4)
    with pytest.raises(ValueError, match="6 slots are not whole pages of 4"):
        KVBuffer(shape, torch.zeros(2, 2, 6, 1, 8), LF)


def test_staging_rounds_up_to_whole_pages_and_holds_at_least_one() -> None:
    shape = _shape(16)
    assert KVBuffer.staging(shape, 17).slots == 32
    assert KVBuffer.staging(shape, 0).slots == 16
    assert KVBuffer.staging(shape, 5).layout is LF


@pytest.mark.parametrize("layout", [LF, PF], ids=["layer_first", "page_first"])
def test_write_then_read_gives_back_the_same_kv_in_index_order(layout: HostLayout) -> None:
    shape = _shape(4)
    buf = KVBuffer.allocate(shape, 32, layout, "cpu")
    idx = torch.tensor([13, 2, 3, 4, 31, 0])
    data = torch.arange(2 * 2 * 6 * 8, dtype=torch.float32).view(2, 2, 6, 1, 8)
    buf.write(idx, data)
    assert torch.equal(buf.read(idx), data)
    assert torch.equal(kv_of_slot(buf, 13), data[:, :, 0])
    assert torch.equal(kv_of_slot(buf, 0), data[:, :, 5])
    assert float(buf.tensor.abs().sum()) == float(data.abs().sum())  # nothing else was touched


@pytest.mark.parametrize("layout", [LF, PF], ids=["layer_first", "page_first"])
def test_read_of_one_layer_is_that_layer_of_a_full_read(layout: HostLayout) -> None:
    buf = KVBuffer.allocate(_shape(4), 32, layout, "cpu")
    buf.tensor.copy_(torch.randn(buf.tensor.shape))
    idx = torch.tensor([7, 8, 30, 1])
    assert torch.equal(buf.read(idx, layer=1), buf.read(idx)[:, 1:2])


@pytest.mark.parametrize("layout", [LF, PF], ids=["layer_first", "page_first"])
@pytest.mark.parametrize("slot", [32, -1])
def test_read_or_write_of_a_slot_outside_the_buffer_is_refused(layout: HostLayout, slot: int) -> None:
    buf = KVBuffer.allocate(_shape(4), 32, layout, "cpu")
    idx = torch.tensor([0, slot])
    with pytest.raises(IndexError, match="out of range"):
        buf.read(idx)
    with pytest.raises(IndexError, match="out of range"):
        buf.write(idx, torch.ones(2, 2, 2, 1, 8))
    assert not buf.tensor.any()  # a refused write wrote nothing


# -- copy_kv against the reference ------------------------------------------------------


DIRECTIONS = [(LF, PF), (PF, LF), (LF, LF)]
DIRECTION_IDS = ["layer_first-to-page_first", "page_first-to-layer_first", "layer_first-to-layer_first"]


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize(("src_layout", "dst_layout"), DIRECTIONS, ids=DIRECTION_IDS)
@pytest.mark.parametrize("layer", [None, 0, 1], ids=["all-layers", "layer-0", "layer-1"])
def test_copy_kv_of_scattered_and_partial_pages_matches_a_slot_by_slot_copy(
    page_size: int, src_layout: HostLayout, dst_layout: HostLayout, layer: int | None
) -> None:
    shape = _shape(page_size)
    for seed in range(3):
        rng = random.Random(f"{page_size}:{seed}")
        src = _filled(shape, src_layout, seed)
        dst = _filled(shape, dst_layout, seed + 100)
        s_idx = _scattered(rng, page_size, drop=(0.0, 0.1, 0.4)[seed])
        d_idx = _scattered(rng, page_size, drop=(0.0, 0.3, 0.05)[seed])
        n = min(len(s_idx), len(d_idx))
        s_idx, d_idx = s_idx[:n], d_idx[:n]
        want = reference_copy(src, s_idx, dst, d_idx, layer)
        nbytes = copy_kv(src, torch.tensor(s_idx), dst, torch.tensor(d_idx), layer=layer)
        assert torch.equal(dst.tensor, want)
        per_slot = shape.bytes_per_slot if layer is None else shape.bytes_per_slot // shape.layers
        assert nbytes == n * per_slot


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize(("src_layout", "dst_layout"), DIRECTIONS, ids=DIRECTION_IDS)
def test_copy_kv_of_a_long_unaligned_run_across_pages_matches_a_slot_by_slot_copy(
    page_size: int, src_layout: HostLayout, dst_layout: HostLayout
) -> None:
    shape = _shape(page_size)
    src = _filled(shape, src_layout, 1)
    dst = _filled(shape, dst_layout, 2)
    n = 5 * page_size - 1
    s_idx = list(range(page_size // 2, page_size // 2 + n))  # starts mid-page (p > 1)
    d_idx = list(range(page_size, page_size + n))  # page aligned
    want = reference_copy(src, s_idx, dst, d_idx, None)
    copy_kv(src, torch.tensor(s_idx), dst, torch.tensor(d_idx))
    assert torch.equal(dst.tensor, want)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_copying_layer_by_layer_equals_copying_all_layers(page_size: int) -> None:
    shape = _shape(page_size, layers=3)
    rng = random.Random(page_size)
    src = _filled(shape, PF, 5)
    by_layer = KVBuffer.allocate(shape, PAGES * page_size, LF, "cpu")
    at_once = KVBuffer.allocate(shape, PAGES * page_size, LF, "cpu")
    s_idx = torch.tensor(_scattered(rng, page_size, 0.2))
    d_idx = torch.tensor(list(reversed(range(len(s_idx)))))
    for layer in range(3):
        copy_kv(src, s_idx, by_layer, d_idx, layer=layer)
    copy_kv(src, s_idx, at_once, d_idx)
    assert torch.equal(by_layer.tensor, at_once.tensor)
    assert torch.equal(at_once.read(d_idx), src.read(s_idx))


def test_a_copy_of_nothing_copies_no_bytes() -> None:
    shape = _shape(4)
    src, dst = _filled(shape, LF, 1), _filled(shape, PF, 2)
    before = dst.tensor.clone()
    e = torch.empty(0, dtype=torch.int64)
    assert copy_kv(src, e, dst, e) == 0
    assert torch.equal(dst.tensor, before)


def test_a_copy_between_two_page_first_buffers_is_refused() -> None:
    shape = _shape(4)
    with pytest.raises(ValueError, match="two page_first buffers are not supported"):
        copy_kv(_filled(shape, PF, 1), torch.arange(4), _filled(shape, PF, 2), torch.arange(4))


def test_a_copy_with_unequal_index_lengths_is_refused() -> None:
    shape = _shape(4)
    with pytest.raises(ValueError, match="source has 4 slots but destination has 3"):
        copy_kv(_filled(shape, LF, 1), torch.arange(4), _filled(shape, LF, 2), torch.arange(3))


# -- the one-kernel page copy of a CUDA route -------------------------------------------------


def test_cuda_pages_is_none_where_no_kernel_reaches_the_buffer() -> None:
    """On a CPU machine, or for pageable memory, there is no device view: copies keep runs."""
    buf = KVBuffer.allocate(_shape(4), PAGES * 4, LF, "cpu")
    assert buf.cuda_pages is None
    if not torch.cuda.is_available():
        assert _Route(buf, KVBuffer.allocate(_shape(4), PAGES * 4, PF, "cpu")).mapped is None


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("src_layout", "dst_layout"), DIRECTIONS, ids=DIRECTION_IDS)
@pytest.mark.parametrize("layer", [None, 0, 1], ids=["all-layers", "layer-0", "layer-1"])
def test_a_page_copy_by_one_gather_and_scatter_matches_a_slot_by_slot_copy(
    page_size: int, src_layout: HostLayout, dst_layout: HostLayout, layer: int | None
) -> None:
    """The gather-and-scatter of a mapped route, its views standing on CPU tensors here (on
    CUDA they are the device buffer and the pinned host buffer mapped; test_cuda.py): every
    page's every layer lands where a slot-by-slot copy puts it, and nothing else changes."""
    shape = _shape(page_size)
    for seed in range(3):
        rng = random.Random(f"mapped:{page_size}:{seed}")
        src = _filled(shape, src_layout, seed)
        dst = _filled(shape, dst_layout, seed + 100)
        n = rng.randrange(1, PAGES + 1)
        s_pages, d_pages = rng.sample(range(PAGES), n), rng.sample(range(PAGES), n)
        slots = lambda pages: [pg * page_size + i for pg in pages for i in range(page_size)]  # noqa: E731
        want = reference_copy(src, slots(s_pages), dst, slots(d_pages), layer)
        route = _Route(src, dst)
        route.mapped = (src.page_major(src.tensor), dst.page_major(dst.tensor))
        plan = route.plan_pages(torch.tensor(s_pages), torch.tensor(d_pages))
        assert plan.run(layer=layer) == n * page_size * (
            shape.bytes_per_slot if layer is None else shape.bytes_per_slot // shape.layers)
        assert torch.equal(dst.tensor, want)
        with pytest.raises(IndexError, match="source page out of range"):
            route.plan_pages(torch.tensor([PAGES]), torch.tensor([0]))


def test_a_stream_between_the_gpu_and_a_host_buffer_no_kernel_reaches_says_so(monkeypatch: pytest.MonkeyPatch,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    """Copies to pageable host memory go run by run at a share of the bus: a stream on such a
    route warns once when it starts (the route stands in here; test_cuda.py has the real one)."""
    from hicache.actors import _streams
    from hicache.messages import ActorName

    class Unmapped:
        mapped = None

        def __init__(self, src: object, dst: object) -> None:
            pass

    class Buffer:  # what the check reads of a KVBuffer
        def __init__(self, device: str) -> None:
            self.device, self.tensor = torch.device(device), torch.zeros(1)

    monkeypatch.setattr(_streams, "_Route", Unmapped)
    with caplog.at_level(logging.WARNING, logger="hicache.streams"):
        _streams._route(Buffer("cpu"), Buffer("cuda"), ActorName.LOAD)  # type: ignore[arg-type]
        _streams._route(Buffer("cpu"), Buffer("cpu"), ActorName.WRITE)  # type: ignore[arg-type]
    [record] = caplog.records
    said = json.loads(record.getMessage())
    assert said["stream"] == "load" and said["host_pinned"] is False and said["level"] == "warning"
    assert "not reachable by GPU kernels" in said["event"]
