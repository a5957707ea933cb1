"""`PagePool` (the free-page stack behind both allocators), the page/slot conversions and
the two forms of `Pages`.

The pool answers a few pages as Python ints and many as a numpy array (`FEW_MAX`
counts pages); `as_list` reads either form. tests/test_pool_fast_paths.py
checks that both forms give the same results. The cores and messages name pages; slots
are the pages' `slots_of_pages` (what the KV buffers and the oracle take).
"""

from __future__ import annotations

import random

import numpy
import pytest
import torch

from hicache.actors import PagePool, pages_of, slots_of_pages
from hicache.actors._pages import FEW_MAX, SlotTable, as_list
from hicache.messages import Indices
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import pages_to_slots

# -- PagePool --------------------------------------------------------------------


def test_a_fresh_pool_hands_out_pages_in_order() -> None:
    pool = PagePool(8, 4)
    assert pool.free_pages == 8 and pool.free_slots == 32
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.alloc(2) == [3, 4]
    assert pool.free_pages == 3 and pool.free_slots == 12


def test_allocating_more_than_is_free_gives_none_and_takes_nothing() -> None:
    pool = PagePool(4, 2)
    pool.alloc(3)
    assert pool.alloc(2) is None
    assert pool.free_pages == 1
    assert pool.alloc(1) == [3]


def test_allocating_zero_pages_gives_nothing() -> None:
    pool = PagePool(4, 2)
    assert pool.alloc(0) == []
    assert pool.free_pages == 4


def test_a_few_pages_come_as_python_ints_and_many_as_an_array() -> None:
    pool = PagePool(3 * FEW_MAX, 1)
    few = pool.alloc(FEW_MAX)
    assert few == list(range(FEW_MAX))
    many = pool.alloc(FEW_MAX + 1)
    assert isinstance(many, numpy.ndarray) and many.dtype == numpy.int64
    assert many.tolist() == list(range(FEW_MAX, 2 * FEW_MAX + 1))
    assert isinstance(PagePool(FEW_MAX, 16).alloc(FEW_MAX // 2 + 1), list)  # pages count, not slots
    pool.free(many)
    pool.free(few)
    assert pool.free_pages == 3 * FEW_MAX
    assert pool.alloc(3) == [0, 1, 2]  # each form pushed back in the order it was handed out


def test_allocating_a_negative_number_of_pages_is_an_error() -> None:
    with pytest.raises(ValueError, match="cannot allocate -1 pages"):
        PagePool(4, 2).alloc(-1)


def test_freed_pages_are_handed_out_again_first_in_the_same_order() -> None:
    pool = PagePool(8, 1)
    pool.alloc(2)
    middle = pool.alloc(3)
    pool.free(middle)
    assert pool.alloc(3) == middle


@pytest.mark.parametrize("pages", [2, FEW_MAX + 1], ids=["ints", "array"])
def test_alloc_returns_pages_the_pool_does_not_keep(pages: int) -> None:
    pool = PagePool(pages + 2, 1)
    got = pool.alloc(pages)
    got[:] = [99] * pages if isinstance(got, list) else 99
    assert sorted(pool.free_page_set().tolist()) == [pages, pages + 1]
    pool.free(numpy.arange(pages))
    assert sorted(pool.free_page_set().tolist()) == list(range(pages + 2))


def test_freeing_more_pages_than_were_allocated_is_caught_as_a_double_free() -> None:
    pool = PagePool(4, 1)
    got = pool.alloc(1)
    pool.free(got)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(got)
    assert pool.free_pages == 4


def test_random_alloc_and_free_keep_every_page_exactly_once() -> None:
    rng = random.Random(7)
    pool = PagePool(32, 2)
    held: list[int] = []
    for _ in range(500):
        if held and rng.random() < 0.5:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            pool.free(held[:k] if rng.random() < 0.5 else numpy.array(held[:k]))
            held = held[k:]
        else:
            got = pool.alloc(rng.choice([rng.randint(0, 6), rng.randint(0, 20)]))
            if got is not None:
                held.extend(as_list(got))
        free = pool.free_page_set().tolist()
        assert sorted(free + held) == list(range(32))
        assert pool.free_pages == len(free)


@pytest.mark.parametrize(("pages", "page_size"), [(0, 4), (4, 0), (-1, 1)])
def test_a_pool_needs_pages_and_a_page_size(pages: int, page_size: int) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        PagePool(pages, page_size)


# -- pages_of --------------------------------------------------------------------


def test_pages_of_whole_pages_gives_their_numbers_in_order() -> None:
    slots = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])
    assert pages_of(slots, 4, "test").tolist() == [2, 0]
    assert pages_of(slots.tolist(), 4, "test") == [2, 0]  # Python ints in, Python ints out


def test_pages_of_with_page_size_one_is_the_identity() -> None:
    assert pages_of(torch.tensor([5, 1, 3]), 1, "test").tolist() == [5, 1, 3]


def test_pages_of_nothing_is_empty() -> None:
    got = pages_of(torch.empty(0, dtype=torch.int64), 4, "test")
    assert got.numel() == 0 and got.dtype == torch.int64


def test_slots_of_pages_lists_every_slot_of_each_page_in_page_order_and_inverts_pages_of() -> None:
    pages = torch.tensor([2, 0])
    slots = slots_of_pages(pages, 4)
    assert slots.tolist() == [8, 9, 10, 11, 0, 1, 2, 3] and slots.dtype == torch.int64
    assert pages_of(slots, 4, "test").tolist() == [2, 0]
    assert slots_of_pages(torch.arange(100), 16).tolist() == list(range(1600))  # the vectorised path
    assert slots_of_pages(torch.empty(0, dtype=torch.int64), 4).numel() == 0
    assert slots_of_pages([2, 0], 4) == [8, 9, 10, 11, 0, 1, 2, 3]
    assert slots_of_pages([], 4) == []


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
def test_the_tests_pages_to_slots_agrees_with_slots_of_pages(page_size: int) -> None:
    rng = random.Random(page_size)
    for n in (0, 1, 3, FEW_MAX // page_size + 1, 2 * FEW_MAX):
        pages = rng.sample(range(4 * FEW_MAX), n)
        want = as_list(slots_of_pages(torch.tensor(pages, dtype=torch.int64), page_size))
        assert pages_to_slots(pages, page_size).tolist() == want == as_list(slots_of_pages(pages, page_size))


def test_a_count_that_is_not_whole_pages_is_refused_naming_the_caller() -> None:
    with pytest.raises(ValueError, match="the caller's slots: 3 slots are not whole pages of 4"):
        pages_of(torch.tensor([0, 1, 2]), 4, "the caller's slots")


def test_slots_that_do_not_start_on_a_page_boundary_are_refused() -> None:
    with pytest.raises(ValueError, match=r"adopted: slots \[1, 2, 3, 4\] are not one whole page \(page_size=4\)"):
        pages_of(torch.tensor([1, 2, 3, 4]), 4, "adopted")


def test_slots_of_a_page_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match=r"slots \[4, 6, 5, 7\] are not one whole page"):
        pages_of(torch.tensor([0, 1, 2, 3, 4, 6, 5, 7]), 4, "test")


def test_slots_that_mix_two_pages_are_refused() -> None:
    with pytest.raises(ValueError, match="not one whole page"):
        pages_of(torch.tensor([0, 1, 6, 7]), 2 * 2, "test")


# -- SlotTable -------------------------------------------------------------------------


def _split_reference(page_size: int, parts: list[tuple[int, int, list[int], int]]) -> list[list[int]]:
    """Each part's slots the plain way: the spare run, then the pages' slots, cut to `n`."""
    out = []
    for base, spare, pages, n in parts:
        slots = list(range(base, base + spare))
        slots += [pg * page_size + i for pg in pages for i in range(page_size)][: n - spare]
        out.append(slots)
    return out


@settings(max_examples=150, deadline=None)
@given(st.data(), st.sampled_from([1, 4, 16]), st.integers(1, 40))
def test_slot_table_split_gives_each_part_its_spare_slots_then_its_pages_slots(data, page_size, requests) -> None:
    pages_total = 600
    table = SlotTable(pages_total, page_size)
    free = list(range(pages_total))
    random.Random(data.draw(st.integers(0, 2**16))).shuffle(free)
    parts = []
    for _ in range(requests):
        spare = data.draw(st.integers(0, page_size - 1))
        base = data.draw(st.integers(0, pages_total - 1)) * page_size + (page_size - spare)
        want = data.draw(st.integers(0, spare + 3 * page_size if data.draw(st.booleans()) else spare))
        spare = min(spare, want)
        k = -(-(want - spare) // page_size)
        pages, free = free[:k], free[k:]
        parts.append((base, spare, pages, want))
    got = table.split([(b, s, Indices.of(pg), n) for b, s, pg, n in parts])
    assert len(got) == len(parts)
    for tensor, expected in zip(got, _split_reference(page_size, parts), strict=True):
        assert tensor.dtype == torch.int64 and tensor.tolist() == expected


def test_slot_table_split_makes_many_slots_by_row_gathers_and_few_in_python() -> None:
    table = SlotTable(4096, 16)
    big = [(0, 0, Indices.of(list(range(100, 100 + 3000))), 3000 * 16 - 5)]  # past FEW_MAX: the array form
    few = [(35, 13, Indices.of([7]), 20), (64, 0, Indices.of([]), 0)]
    for parts in (big, few, big + few):
        got = table.split(parts)
        expected = _split_reference(16, [(b, s, pg.tolist(), n) for b, s, pg, n in parts])
        assert [t.tolist() for t in got] == expected


def test_every_empty_answer_of_the_slot_table_is_a_tensor_of_its_own() -> None:
    """An admission with nothing cached gets no slots: a tensor over one shared, empty,
    non-resizable storage, whose shape no other answer shares."""
    table = SlotTable(64, 16)
    first, second = table.slots(Indices.of([]), 0), table.slots(Indices.of([3]), 0)
    assert first is not second and first.dtype == second.dtype == torch.int64
    first.unsqueeze_(0)  # an in-place view op on one answer
    assert tuple(first.shape) == (1, 0) and tuple(second.shape) == (0,)
    assert tuple(table.slots(Indices.of([]), 0).shape) == (0,)
    with pytest.raises(RuntimeError, match="not resizable"):
        second.resize_(4)
    assert table.slots(Indices.of([3]), 5).tolist() == [48, 49, 50, 51, 52]
