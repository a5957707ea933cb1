"""`HostCore`: host memory handed out in pages and the per-page state machine.

The whole 7x7 table of (from, to) moves is tested: every pair in
`HOST_TRANSITIONS` works, every other pair raises `SlotStateError` naming the
page, its state and the state asked for, and leaves every page as it was.
Calls name page numbers; `counts()` and `free_slots` still count slots.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hicache.actors import HostCore, SlotStateError
from hicache.messages import HOST_TRANSITIONS, HostSlotState, Indices
from hicache.runtime import Config, HostLayout

S = HostSlotState
PAGE = 4

# A legal path from a freshly allocated (RESERVED) page to each state.
_PATH_FROM_RESERVED: dict[HostSlotState, tuple[HostSlotState, ...]] = {
    S.RESERVED: (),
    S.WRITING: (S.WRITING,),
    S.SYNCED: (S.WRITING, S.SYNCED),
    S.HOST_ONLY: (S.WRITING, S.SYNCED, S.HOST_ONLY),
    S.LOADING: (S.WRITING, S.SYNCED, S.HOST_ONLY, S.LOADING),
    S.PREFETCHING: (S.PREFETCHING,),
}


@pytest.fixture
def core(make_config: Callable[..., Config], checked: Callable[[Any], Any]) -> Any:
    """8 pages of 4 slots (device 4 pages)."""
    return checked(HostCore(make_config(page_size=PAGE, device_pages=4, host_pages=8)))


def _page_in(core: Any, state: HostSlotState) -> torch.Tensor:
    """One page (its number, as a tensor) brought to `state` along legal moves (FREE: a page
    allocated and freed)."""
    if state is S.FREE:
        page = core.allocate(PAGE)
        core.free(page)  # a freed page is the one the next allocation takes
        return page
    page = core.allocate(PAGE)
    assert len(page) == 1
    for step in _PATH_FROM_RESERVED[state]:
        core.transition(page, step)
    assert core.states(page).tolist() == [int(state)]
    return page


def _move(core: Any, pages: torch.Tensor, frm: HostSlotState, to: HostSlotState) -> None:
    """Ask for the move the way the pool's users do: allocate, free, or transition."""
    if to is S.FREE:
        core.free(pages)
    elif frm is S.FREE and to is S.RESERVED:
        got = core.allocate(PAGE * len(pages))
        assert got.tolist() == pages.tolist()
    else:
        core.transition(pages, to)


ALL_PAIRS = list(itertools.product(S, S))
LEGAL = sorted(HOST_TRANSITIONS)
ILLEGAL = [pair for pair in ALL_PAIRS if pair not in HOST_TRANSITIONS]


def test_the_table_has_seven_states_and_fifteen_legal_moves() -> None:
    assert len(S) == 7 and len(ALL_PAIRS) == 49
    assert len(LEGAL) == 15 and len(ILLEGAL) == 34
    assert all(a is not b for a, b in HOST_TRANSITIONS)


@pytest.mark.parametrize(("frm", "to"), LEGAL, ids=lambda s: s.name)
def test_every_legal_transition_works(core: Any, frm: HostSlotState, to: HostSlotState) -> None:
    page = _page_in(core, frm)
    _move(core, page, frm, to)
    assert core.states(page).tolist() == [int(to)]
    expected_free = 32 if to is S.FREE else 28
    assert core.counts()[S.FREE] == expected_free
    assert core.free_slots == expected_free


@pytest.mark.parametrize(("frm", "to"), ILLEGAL, ids=lambda s: s.name)
def test_every_illegal_transition_raises_naming_pages_and_states(
    core: Any, frm: HostSlotState, to: HostSlotState
) -> None:
    other = _page_in(core, S.SYNCED)  # a bystander that must not change
    page = _page_in(core, frm)
    before = core.counts()
    with pytest.raises(SlotStateError) as err:
        _move(core, page, frm, to)
    message = str(err.value)
    if to is S.FREE and frm is S.FREE:
        assert "double free" in message
    assert f"illegal host page transition to {to.name}" in message
    assert f"page {int(page[0])} is {frm.name}" in message
    assert core.states(page).tolist() == [int(frm)]
    assert core.states(other).tolist() == [int(S.SYNCED)]
    assert core.counts() == before


def test_transition_to_free_is_refused_in_favour_of_free(core: Any) -> None:
    page = _page_in(core, S.SYNCED)
    with pytest.raises(SlotStateError, match="freeing goes through free"):
        core.transition(page, S.FREE)
    assert core.states(page).tolist() == [int(S.SYNCED)]


def test_free_pages_cannot_be_reserved_by_a_transition(core: Any) -> None:
    page = _page_in(core, S.FREE)
    with pytest.raises(SlotStateError, match=r"to RESERVED.*page \d+ is FREE.*allocate\(\)"):
        core.transition(page, S.RESERVED)
    assert core.free_slots == 32


def test_a_move_with_one_illegal_page_moves_no_page(core: Any) -> None:
    reserved = _page_in(core, S.RESERVED)
    writing = _page_in(core, S.WRITING)
    with pytest.raises(SlotStateError, match=rf"page {int(writing[0])} is WRITING"):
        core.transition(torch.cat([reserved, writing]), S.WRITING)
    assert core.states(reserved).tolist() == [int(S.RESERVED)]
    assert core.states(writing).tolist() == [int(S.WRITING)]


def test_a_long_list_of_bad_pages_is_abbreviated(
    make_config: Callable[..., Config], checked: Callable[[Any], Any]
) -> None:
    core = checked(HostCore(make_config(page_size=PAGE, device_pages=4, host_pages=12)))
    pages = torch.cat([_page_in(core, S.RESERVED) for _ in range(12)])
    with pytest.raises(SlotStateError, match=r"page 7 is RESERVED \(and 4 more\)$"):
        core.transition(pages, S.SYNCED)
    assert core.states(pages).tolist() == [int(S.RESERVED)] * 12


def test_a_page_twice_in_one_move_is_refused(core: Any) -> None:
    page = _page_in(core, S.RESERVED)
    with pytest.raises(SlotStateError, match="a page appears twice in one call"):
        core.transition(torch.cat([page, page]), S.WRITING)
    assert core.states(page).tolist() == [int(S.RESERVED)]


@pytest.mark.parametrize("page", [-1, 8])
def test_a_page_outside_the_buffer_is_refused(core: Any, page: int) -> None:
    with pytest.raises(SlotStateError, match=r"page number out of range 0..7"):
        core.transition(torch.tensor([page]), S.WRITING)


def test_a_transition_may_cover_some_pages_of_an_allocation(core: Any) -> None:
    pages = core.allocate(2 * PAGE)
    core.transition(pages[:1], S.WRITING)
    assert core.states(pages).tolist() == [int(S.WRITING), int(S.RESERVED)]


# -- allocation -----------------------------------------------------------------------


def test_allocation_gives_whole_pages_in_state_reserved(core: Any) -> None:
    got = core.allocate(3 * PAGE)
    assert got.tolist() == [0, 1, 2]
    assert core.states(got).tolist() == [int(S.RESERVED)] * 3
    assert core.counts()[S.RESERVED] == 12 and core.free_slots == 20


@pytest.mark.parametrize("n", [1, 5, -4])
def test_allocation_that_is_not_whole_pages_is_refused(core: Any, n: int) -> None:
    with pytest.raises(ValueError, match=f"host allocation of {n} slots is not whole pages of 4"):
        core.allocate(n)
    assert core.free_slots == 32


def test_allocation_larger_than_the_free_pages_gives_none_and_reserves_nothing(core: Any) -> None:
    core.allocate(7 * PAGE)
    assert core.allocate(2 * PAGE) is None
    assert core.counts()[S.RESERVED] == 28
    assert core.allocate(PAGE) is not None


def test_allocate_pages_answers_the_indices_a_reply_carries_and_moves_take_indices(core: Any) -> None:
    got = core.allocate_pages(2 * PAGE)
    assert got == Indices.of(range(2))
    core.transition(got[:1], S.WRITING)
    assert core.states(torch.arange(2)).tolist() == [int(S.WRITING), int(S.RESERVED)]
    with pytest.raises(SlotStateError, match="illegal host page transition to FREE on free: page 0 is WRITING"):
        core.free(got)
    core.free(got[1:])
    assert core.free_slots == 28


def test_allocating_zero_slots_reserves_nothing(core: Any) -> None:
    got = core.allocate(0)
    assert got is not None and got.numel() == 0
    assert core.free_slots == 32


# -- free -----------------------------------------------------------------------------


def test_free_returns_pages_for_reuse(core: Any) -> None:
    a = core.allocate(2 * PAGE)
    core.free(a)
    assert core.free_slots == 32
    assert core.allocate(2 * PAGE).tolist() == a.tolist()


def test_a_double_free_is_refused(core: Any) -> None:
    page = core.allocate(PAGE)
    core.free(page)
    with pytest.raises(SlotStateError, match=r"illegal host page transition to FREE on free: page 0 is FREE.*\(double free\)"):
        core.free(page)
    assert core.free_slots == 32


@pytest.mark.parametrize("state", [S.WRITING, S.LOADING, S.PREFETCHING])
def test_free_while_a_copy_is_in_flight_is_refused(core: Any, state: HostSlotState) -> None:
    page = _page_in(core, state)
    with pytest.raises(
        SlotStateError, match=f"page {int(page[0])} is {state.name}.*only RESERVED, SYNCED, HOST_ONLY pages may be freed"
    ):
        core.free(page)
    assert core.states(page).tolist() == [int(state)]
    assert core.free_slots == 28


def test_free_of_a_page_twice_in_one_call_is_refused_and_frees_nothing(core: Any) -> None:
    page = core.allocate(PAGE)
    with pytest.raises(SlotStateError, match="host free: a page appears twice in one call"):
        core.free(torch.cat([page, page]))
    assert core.states(page).tolist() == [int(S.RESERVED)]
    assert core.free_slots == 28
    core.free(page)
    assert core.allocate(8 * PAGE).tolist() == list(range(8))  # the free list holds each page once


def test_a_vectorised_free_of_a_page_twice_is_refused_and_frees_nothing(
    make_config: Callable[..., Config], checked: Callable[[Any], Any]
) -> None:
    big = checked(HostCore(make_config(page_size=PAGE, device_pages=4, host_pages=1024)))
    pages = big.allocate(600 * PAGE)  # more pages than FEW_MAX: the vectorised check
    with pytest.raises(SlotStateError, match="host free: a page appears twice in one call"):
        big.free(torch.cat([pages[:300], pages[299:]]))
    assert big.states(pages).unique().tolist() == [int(S.RESERVED)]
    big.free(pages)
    assert big.free_slots == 1024 * PAGE


def test_free_of_pages_with_one_in_flight_frees_nothing(core: Any) -> None:
    pages = core.allocate(2 * PAGE)
    core.transition(pages[1:], S.WRITING)
    with pytest.raises(SlotStateError, match=f"page {int(pages[1])} is WRITING"):
        core.free(pages)
    assert core.states(pages).tolist() == [int(S.RESERVED), int(S.WRITING)]
    assert core.free_slots == 24


# -- buffers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        (HostLayout.LAYER_FIRST, lambda c: (2, c.layers, c.host_slots, c.kv_heads, c.head_dim)),
        (HostLayout.PAGE_FIRST, lambda c: (c.host_pages, 2, c.layers, c.page_size, c.kv_heads, c.head_dim)),
    ],
    ids=["layer_first", "page_first"],
)
def test_both_layouts_allocate_the_right_buffer_shape(
    make_config: Callable[..., Config], layout: HostLayout, shape: Callable[[Config], tuple[int, ...]]
) -> None:
    cfg = make_config(page_size=8, device_pages=4, host_pages=6, layers=3, kv_heads=2, head_dim=4,
                      dtype="float32", host_layout=layout)
    core = HostCore(cfg)
    assert core.kv.layout is layout
    assert tuple(core.kv.tensor.shape) == shape(cfg)
    assert core.kv.tensor.dtype == torch.float32 and core.kv.tensor.device.type == "cpu"
    assert core.kv.slots == cfg.host_slots == core.capacity_slots
    assert core.counts() == (48, 0, 0, 0, 0, 0, 0)


def test_counts_follow_every_move_without_a_pass_over_the_table(make_config: Callable[..., Config]) -> None:
    # statistics() reads the counts (each metrics scrape): taken from the table, they would
    # cost a pass over every page of the pool on the host actor's thread, ahead of the writes
    # and load-backs it serves. Moves of a few pages (Python ints) and of many (arrays), of
    # one state and of several, keep them.
    S = HostSlotState
    core = HostCore(make_config(page_size=4, device_pages=16, host_pages=1024))
    table = core._state

    def counted_without_the_table() -> tuple[int, ...]:
        core._state = None  # any read of the table fails
        try:
            return core.counts()
        finally:
            core._state = table

    def from_the_table() -> tuple[int, ...]:
        return tuple(int(n) * 4 for n in torch.bincount(table.to(torch.int64), minlength=len(S)))

    many = core.allocate_pages(900 * 4)
    few = core.allocate_pages(4 * 4)
    assert many is not None and few is not None
    a, b, c = many[:400], many[400:700], many[700:]
    steps = [
        lambda: core.transition(a, S.WRITING),
        lambda: core.transition(Indices.concat([b, c]), S.PREFETCHING),
        lambda: core.transition(few[:2], S.WRITING),
        lambda: core.transition(a, S.SYNCED),
        lambda: core.transition(Indices.concat([b, few[:2]]), S.RESERVED),  # from two states
        lambda: core.transition(c[50:], S.HOST_ONLY),
        lambda: core.transition(Indices.concat([a[:100], c[:50]]), S.HOST_ONLY),  # SYNCED and PREFETCHING
        lambda: core.free(Indices.concat([a[:300], b, c[:60], few])),  # three states
        lambda: core.free(Indices.concat([a[300:], c[60:]])),
    ]
    assert counted_without_the_table() == from_the_table()
    for step in steps:
        step()
        assert counted_without_the_table() == from_the_table()
        core.check_invariants()
    assert counted_without_the_table() == (4096, 0, 0, 0, 0, 0, 0)
