"""`DeviceCore`: device memory handed out in pages and the per-request ledger.

`allocate` answers the slots each request got (what an engine writes KV into);
every other call names page numbers (`allocate_pages`, `release`, `swap`, loads,
`free_tree`). Every core here is wrapped by the `checked` fixture: its invariants
are checked after every call, including calls that raised.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch

import hicache.actors._device_core as device_core_module
from hicache.actors import DeviceCore, Insufficient, InvariantError, LedgerError, PageOwner, SlotStateError
from hicache.messages import Indices, LedgerEntry, ReleaseReason
from hicache.runtime import Config, HostLayout

FREE, REQUEST, TREE, LOADING = PageOwner.FREE, PageOwner.REQUEST, PageOwner.TREE, PageOwner.LOADING


@pytest.fixture
def core(make_config: Callable[..., Config], checked: Callable[[Any], Any]) -> Any:
    """16 pages of 4 slots."""
    return checked(DeviceCore(make_config(page_size=4, device_pages=16)))


def _slots(pages: list[int], p: int = 4) -> list[int]:
    return [pg * p + i for pg in pages for i in range(p)]


def _owners(core: Any) -> dict[PageOwner, int]:
    return core.counts()


# -- the buffer ---------------------------------------------------------------------


def test_the_device_buffer_is_layer_first_with_the_config_shape(make_config: Callable[..., Config]) -> None:
    cfg = make_config(page_size=4, device_pages=16, dtype="bfloat16", host_layout=HostLayout.PAGE_FIRST)
    core = DeviceCore(cfg)
    assert core.kv.layout is HostLayout.LAYER_FIRST
    assert tuple(core.kv.tensor.shape) == (2, cfg.layers, 64, cfg.kv_heads, cfg.head_dim)
    assert core.kv.tensor.dtype == torch.bfloat16
    assert core.capacity_slots == 64
    assert _owners(core) == {FREE: 64, REQUEST: 0, TREE: 0, LOADING: 0}


# -- allocate ----------------------------------------------------------------------


def test_allocate_gives_whole_pages_to_a_new_request(core: Any) -> None:
    got = core.allocate([("a", 6)])
    assert got["a"].tolist() == _slots([0, 1])[:6]
    assert core.ledger("a").allocated == 6
    assert _owners(core)[REQUEST] == 8


def test_allocate_fills_the_last_partial_page_before_taking_new_pages(core: Any) -> None:
    core.allocate([("a", 6)])  # pages 0, 1; slots 6 and 7 spare
    core.allocate([("b", 2)])  # page 2
    assert core.allocate([("a", 1)])["a"].tolist() == [6]
    assert _owners(core)[REQUEST] == 12
    got = core.allocate([("a", 3)])["a"].tolist()
    assert got == [7, 12, 13]  # the last spare slot of page 1, then page 3
    assert core.ledger("a").allocated == 10
    assert core.allocate([("b", 2)])["b"].tolist() == [10, 11]
    assert _owners(core)[REQUEST] == 16


def test_allocating_within_the_partial_page_needs_no_free_page(core: Any) -> None:
    core.allocate([("a", 2)])
    core.allocate([("filler", 60)])
    assert _owners(core)[FREE] == 0
    assert core.allocate([("a", 2)])["a"].tolist() == [2, 3]
    assert isinstance(core.allocate([("a", 1)]), Insufficient)


def test_allocating_zero_slots_gives_nothing_and_takes_no_page(core: Any) -> None:
    got = core.allocate([("a", 0)])
    assert got["a"].numel() == 0
    assert _owners(core)[FREE] == 64
    assert core.ledger("a").allocated == 0


def test_one_allocation_serves_several_requests_in_demand_order(core: Any) -> None:
    got = core.allocate([("a", 5), ("b", 4), ("c", 1)])
    assert got["a"].tolist() == _slots([0, 1])[:5]
    assert got["b"].tolist() == _slots([2])
    assert got["c"].tolist() == _slots([3])[:1]
    assert core.live_requests() == 3


def test_a_batch_that_does_not_fit_allocates_nothing_and_reports_the_shortfall(core: Any) -> None:
    core.allocate([("a", 3)])  # page 0, one spare slot
    before = _owners(core)
    got = core.allocate([("a", 1 + 4 * 9), ("b", 4 * 7)])  # needs 9 + 7 = 16 pages, 15 free
    assert isinstance(got, Insufficient)
    assert got.requested_slots == 16 * 4
    assert got.free_slots == 15 * 4
    assert got.shortfall_slots == 4
    assert _owners(core) == before
    assert core.ledger("a").allocated == 3
    with pytest.raises(LedgerError, match="'b' has no ledger"):
        core.ledger("b")


def test_a_batch_that_just_fits_takes_every_free_page(core: Any) -> None:
    got = core.allocate([("a", 33), ("b", 28)])  # 9 + 7 pages
    assert not isinstance(got, Insufficient)
    assert _owners(core) == {FREE: 0, REQUEST: 64, TREE: 0, LOADING: 0}
    assert sorted(got["a"].tolist() + got["b"].tolist())[:3] == [0, 1, 2]


def test_a_request_may_appear_only_once_in_an_allocation(core: Any) -> None:
    with pytest.raises(LedgerError, match="'a' appears twice in one allocation"):
        core.allocate([("a", 1), ("a", 2)])
    assert core.live_requests() == 0


def test_a_negative_demand_is_a_ledger_error(core: Any) -> None:
    with pytest.raises(LedgerError, match="'a': cannot allocate -1 slots"):
        core.allocate([("a", -1)])


def test_allocate_pages_answers_the_new_pages_a_grant_carries(core: Any) -> None:
    got = core.allocate_pages([("a", 6), ("b", 1)])
    assert got == {"a": Indices.of([0, 1]), "b": Indices.of([2])}
    assert list(got) == ["a", "b"]  # demand order
    assert core.allocate_pages([("a", 1)]) == {"a": Indices()}  # slot 6: the rest of page 1, no new page
    assert core.allocate_pages([("a", 2)]) == {"a": Indices.of([3])}  # slot 7, then page 3's first
    assert core.ledger("a").allocated == 9
    assert _owners(core)[REQUEST] == 16
    assert core.allocate([("a", 3)])["a"].tolist() == [13, 14, 15]  # allocate: the same grants, as slots


def test_pages_may_come_in_as_indices(core: Any) -> None:
    got = core.allocate_pages([("a", 8)])["a"]
    assert got == Indices.of([0, 1])
    core.commit("a", 8)
    view = core.swap("a", got[:1], Indices())
    assert view == LedgerEntry(request_id="a", allocated=8, committed=8, freed=4)  # the reply's record itself
    core.release("a", got[1:], ReleaseReason.FINISHED)
    core.free_tree(Indices.concat([got[1:], got[:1]]))
    load = core.allocate_load_pages(4)
    assert load == Indices.of([1])
    core.adopt_loaded(load)
    assert _owners(core) == {FREE: 60, REQUEST: 0, TREE: 4, LOADING: 0}


# -- commit -------------------------------------------------------------------------


def test_commit_counts_filled_slots_up_to_the_allocation(core: Any) -> None:
    core.allocate([("a", 10)])
    view = core.commit("a", 4)
    assert (view.allocated, view.committed, view.freed) == (10, 4, 0)
    assert core.commit("a", 6).committed == 10
    assert core.ledger("a").committed == 10


def test_committing_beyond_the_allocation_is_refused_and_changes_nothing(core: Any) -> None:
    core.allocate([("a", 10)])
    core.commit("a", 7)
    with pytest.raises(LedgerError, match=r"'a'.*committed=11 > allocated=10.*allocated >= committed"):
        core.commit("a", 4)
    assert core.ledger("a").committed == 7


def test_committing_for_an_unknown_request_is_a_ledger_error(core: Any) -> None:
    with pytest.raises(LedgerError, match="cannot commit request 'ghost': it has no slots"):
        core.commit("ghost", 1)


def test_a_negative_commit_is_a_ledger_error(core: Any) -> None:
    core.allocate([("a", 2)])
    with pytest.raises(LedgerError, match="cannot commit -1 slots"):
        core.commit("a", -1)


def test_slots_taken_from_the_last_page_count_as_allocated_and_hand_out_no_page(core: Any) -> None:
    """What the facade served from the free part of a last page (`extend_only`): allocated
    grows, no page changes owner, and the next allocation starts after those slots."""
    core.allocate([("a", 5), ("b", 4)])  # a: pages of slots 0-3 and 4-7 (5 used); b: 8-11, full
    owners = _owners(core)
    core.extend_only([("a", 2), ("b", 0)])
    assert core.ledger("a").allocated == 7 and core.ledger("b").allocated == 4
    assert _owners(core) == owners
    core.commit("a", 7)  # commits may now cover the slots taken
    assert core.allocate([("a", 2)])["a"].tolist() == [7, 12]  # the last free slot of its page, then a new page


@pytest.mark.parametrize(("taken", "spare"), [(4, 3), (1, 0)])
def test_taking_more_than_the_last_page_has_left_is_refused_and_changes_nothing(
        core: Any, taken: int, spare: int) -> None:
    core.allocate([("a", 5), ("b", 4)])
    rid = "a" if spare else "b"
    with pytest.raises(LedgerError, match=rf"request '{rid}': {taken} slots taken from the pages it holds, which have "
                                          rf"{spare} free \(invariant: only an allocation that fits in a request's pages"):
        core.extend_only([("a", 1), (rid, taken)] if rid == "b" else [(rid, taken)])
    assert (core.ledger("a").allocated, core.ledger("b").allocated) == (5, 4)  # all or nothing


def test_slots_taken_for_an_unknown_or_repeated_request_are_ledger_errors(core: Any) -> None:
    core.allocate([("a", 1)])
    with pytest.raises(LedgerError, match="cannot extend request 'ghost': it has no slots"):
        core.extend_only([("ghost", 1)])
    with pytest.raises(LedgerError, match=r"cannot extend request\(s\) \['a'\] twice in one call"):
        core.extend_only([("a", 1), ("a", 1)])
    assert core.ledger("a").allocated == 1


def test_a_release_and_a_swap_apply_the_slots_taken_before_their_commits(core: Any) -> None:
    core.allocate([("a", 5), ("b", 6)])
    entry = core.swap("b", [], [], commits=7, allocs=1)  # 7 committed needs the slot taken first
    assert (entry.allocated, entry.committed) == (7, 7)
    [done] = core.release_many([("a", [], ReleaseReason.FINISHED)], commits=[("a", 8)], allocs=[("a", 3)])
    assert (done.allocated, done.committed, done.freed) == (8, 8, 8)


# -- release ------------------------------------------------------------------------


def test_release_frees_every_page_exactly_once(core: Any) -> None:
    core.allocate([("a", 9), ("b", 4)])
    view = core.release("a", torch.empty(0, dtype=torch.int64), ReleaseReason.FINISHED)
    assert (view.allocated, view.freed) == (9, 9)
    assert _owners(core) == {FREE: 60, REQUEST: 4, TREE: 0, LOADING: 0}
    with pytest.raises(LedgerError, match="cannot release request 'a': it was already released"):
        core.release("a", torch.empty(0, dtype=torch.int64), ReleaseReason.FINISHED)
    assert _owners(core)[FREE] == 60
    # the freed pages come back, each once
    again = core.allocate([("c", 60)])["c"]
    assert len(set(again.tolist())) == 60
    assert _owners(core)[FREE] == 0


def test_release_moves_adopted_whole_pages_to_the_tree_and_frees_the_rest(core: Any) -> None:
    got = core.allocate_pages([("a", 11)])["a"]  # pages 0, 1, 2 (2 partly used)
    assert got == Indices.of([0, 1, 2])
    core.commit("a", 11)
    view = core.release("a", got[:2], ReleaseReason.FINISHED)
    assert (view.allocated, view.committed, view.freed) == (11, 11, 11)
    assert _owners(core) == {FREE: 56, REQUEST: 0, TREE: 8, LOADING: 0}
    assert core.live_requests() == 0
    # page 2 is free again; pages 0, 1 are the tree's
    assert core.allocate([("b", 4)])["b"].tolist() == _slots([2])


def test_release_may_adopt_pages_in_any_order(core: Any) -> None:
    got = core.allocate_pages([("a", 12)])["a"].as_tensor()
    assert got.tolist() == [0, 1, 2]
    core.release("a", torch.stack([got[2], got[0]]), ReleaseReason.FINISHED)
    assert _owners(core)[TREE] == 8
    assert _owners(core)[FREE] == 56
    core.free_tree(torch.tensor([2, 0]))
    assert _owners(core)[FREE] == 64


@pytest.mark.parametrize(
    ("adopt", "foreign"),
    [(list(range(8)), [2, 3, 4, 5, 6, 7]), ([0, 16], [16]), ([-1], [-1])],
    ids=["slots-for-pages", "past-the-table", "negative"],
)
def test_adopting_numbers_that_are_not_pages_of_the_request_is_refused(
    core: Any, adopt: list[int], foreign: list[int]
) -> None:
    core.allocate([("a", 8)])  # pages 0, 1
    with pytest.raises(LedgerError, match=rf"request 'a': adopted pages \[{', '.join(map(str, foreign))}\] are not"):
        core.release("a", torch.tensor(adopt), ReleaseReason.FINISHED)
    assert core.live_requests() == 1
    assert _owners(core) == {FREE: 56, REQUEST: 8, TREE: 0, LOADING: 0}


def test_adopting_pages_of_another_request_is_refused(core: Any) -> None:
    core.allocate([("a", 4), ("b", 4)])
    with pytest.raises(LedgerError, match=r"request 'a': adopted pages \[1\] are not distinct pages of this request"):
        core.release("a", torch.tensor([1]), ReleaseReason.FINISHED)
    assert _owners(core) == {FREE: 56, REQUEST: 8, TREE: 0, LOADING: 0}


def test_adopting_the_same_page_twice_is_refused(core: Any) -> None:
    core.allocate([("a", 8)])
    with pytest.raises(LedgerError, match="not distinct pages"):
        core.release("a", torch.tensor([0, 0]), ReleaseReason.FINISHED)
    assert core.live_requests() == 1
    assert _owners(core) == {FREE: 56, REQUEST: 8, TREE: 0, LOADING: 0}


def test_the_final_ledger_of_a_finished_request_stays_readable(core: Any) -> None:
    core.allocate([("a", 5)])
    core.commit("a", 3)
    core.release("a", torch.empty(0, dtype=torch.int64), ReleaseReason.ABORTED)
    view = core.ledger("a")
    assert (view.allocated, view.committed, view.freed) == (5, 3, 5)


@pytest.mark.parametrize("reason", [ReleaseReason.FINISHED, ReleaseReason.ABORTED])
def test_a_finished_or_aborted_request_may_never_allocate_again(core: Any, reason: ReleaseReason) -> None:
    core.allocate([("a", 4)])
    core.release("a", torch.empty(0, dtype=torch.int64), reason)
    with pytest.raises(LedgerError, match="request 'a' was already released.*never allocate after finish"):
        core.allocate([("a", 1)])
    with pytest.raises(LedgerError, match="already released"):
        core.allocate([("b", 1), ("a", 1)])
    assert core.live_requests() == 0
    assert _owners(core)[FREE] == 64


def test_a_retracted_request_may_allocate_again_with_a_fresh_ledger(core: Any) -> None:
    core.allocate([("a", 6)])
    core.commit("a", 6)
    view = core.release("a", torch.empty(0, dtype=torch.int64), ReleaseReason.RETRACTED)
    assert view.freed == 6
    with pytest.raises(LedgerError, match="'a' has no ledger"):
        core.ledger("a")
    got = core.allocate([("a", 3)])
    assert got["a"].tolist() == [0, 1, 2]
    assert (core.ledger("a").allocated, core.ledger("a").committed) == (3, 0)


def test_released_requests_are_remembered_up_to_a_bound(
    core: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(device_core_module, "RELEASED_REMEMBERED_MAX", 3)
    for rid in "abcd":
        core.allocate([(rid, 1)])
        core.release(rid, torch.empty(0, dtype=torch.int64), ReleaseReason.FINISHED)
    with pytest.raises(LedgerError, match="'a' has no ledger"):
        core.ledger("a")
    assert [core.ledger(r).freed for r in "bcd"] == [1, 1, 1]


# -- load slots and the tree's pages ------------------------------------------------


def test_load_pages_are_owned_by_the_load(core: Any) -> None:
    got = core.allocate_load(5)
    assert got.tolist() == [0, 1]
    assert _owners(core) == {FREE: 56, REQUEST: 0, TREE: 0, LOADING: 8}


def test_a_completed_load_hands_its_pages_to_the_tree(core: Any) -> None:
    got = core.allocate_load(8)
    core.adopt_loaded(got)
    assert _owners(core) == {FREE: 56, REQUEST: 0, TREE: 8, LOADING: 0}
    with pytest.raises(SlotStateError, match="cannot adopt loaded pages: slots 0..3 owned by tree.*; expected loading"):
        core.adopt_loaded(got)


class _Unwalkable(dict):  # type: ignore[type-arg]
    def values(self) -> Any:
        raise AssertionError("a walk over every ledger")


def test_counts_follow_every_change_of_owner_without_a_pass_over_the_table(
        make_config: Callable[..., Config]) -> None:
    # statistics() reads the counts and the slots held ahead (each metrics scrape): taken from
    # the table and the ledgers, they would cost a pass over every page of the pool per owner
    # and one over every live request, on the device actor's thread, ahead of the next
    # allocation.
    core = DeviceCore(make_config(page_size=4, device_pages=16, ahead_slots=8))  # two pages ahead
    table, ledgers = core._owner, core._ledgers

    def counted_without_the_table() -> dict[PageOwner, int]:
        core._owner, core._ledgers = None, _Unwalkable(ledgers)  # any read of the table fails
        try:
            return {**core.counts(), "ahead": core.ahead_slots()}
        finally:
            core._owner, core._ledgers = table, ledgers

    def from_the_table() -> dict[PageOwner, int]:
        ahead = sum(len(led.pages) - device_core_module._pages_left(led, 4) for led in ledgers.values())
        return {FREE: int((table < 0).sum()) * 4, REQUEST: int((table >= 4).sum()) * 4,
                TREE: int((table == TREE).sum()) * 4, LOADING: int((table == LOADING).sum()) * 4, "ahead": 4 * ahead}

    got = core.allocate_pages([("a", 9), ("b", 2)], ahead=True)
    load = core.allocate_load_pages(8)
    assert core.ahead_slots() > 0
    steps: list[Callable[[], Any]] = [
        lambda: core.extend_only([("a", 3), ("b", 2)]),
        lambda: core.commit_many([("a", 9), ("b", 4)]),
        lambda: core.adopt_loaded(load[:1]),
        lambda: core.swap("a", got["a"][:1], got["a"][1:2]),  # a whole page each to the tree, to the free list
        lambda: core.free_tree(Indices.concat([load[1:], load[:1], got["a"][:1]])),  # a load's page, the tree's
        lambda: core.trim(["b"]),
        lambda: core.release("a", got["a"][2:3], ReleaseReason.FINISHED),
        lambda: core.release("b", Indices(), ReleaseReason.ABORTED),
    ]
    assert counted_without_the_table() == from_the_table()
    for step in steps:
        step()
        assert counted_without_the_table() == from_the_table()
        core.check_invariants()
    assert counted_without_the_table() == {FREE: 60, REQUEST: 0, TREE: 4, LOADING: 0, "ahead": 0}


def test_a_failed_load_frees_its_pages(core: Any) -> None:
    got = core.allocate_load(4)
    core.free_tree(got)
    assert _owners(core)[FREE] == 64


def test_load_slots_that_do_not_fit_are_insufficient(core: Any) -> None:
    core.allocate([("a", 60)])
    got = core.allocate_load(5)
    assert isinstance(got, Insufficient)
    assert (got.requested_slots, got.free_slots, got.shortfall_slots) == (8, 4, 4)
    assert _owners(core)[LOADING] == 0


def test_free_tree_frees_only_tree_or_loading_pages(core: Any) -> None:
    got = core.allocate_pages([("a", 8)])["a"]
    with pytest.raises(SlotStateError, match="cannot free device pages: slots 0..3 owned by request"):
        core.free_tree(got[:1])
    assert _owners(core)[REQUEST] == 8


def test_free_tree_twice_is_a_double_free(core: Any) -> None:
    got = core.allocate_pages([("a", 8)])["a"]
    core.release("a", got, ReleaseReason.FINISHED)
    core.free_tree(got)
    with pytest.raises(SlotStateError, match=r"slots 0..3 owned by free.*\(double free\?\)"):
        core.free_tree(got)
    assert _owners(core)[FREE] == 64


def test_free_tree_of_a_page_twice_in_one_call_is_refused(core: Any) -> None:
    got = core.allocate_pages([("a", 4)])["a"].as_tensor()
    core.release("a", got, ReleaseReason.FINISHED)
    with pytest.raises(SlotStateError, match=r"free device pages: a page appears twice in \[0, 0\]"):
        core.free_tree(torch.cat([got, got]))
    assert _owners(core)[TREE] == 4


def test_a_vectorised_free_tree_of_a_page_twice_is_refused_and_frees_nothing(
    make_config: Callable[..., Config], checked: Callable[[Any], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    big = checked(DeviceCore(make_config(page_size=4, device_pages=1024, host_pages=1100)))
    got = big.allocate_pages([("a", 4 * 600)])["a"].as_tensor()  # more pages than FEW_MAX
    big.release("a", got, ReleaseReason.FINISHED)
    twice = torch.cat([got[:300], got[299:]])
    assert len(twice) > device_core_module.FEW_MAX
    with pytest.raises(SlotStateError, match=r"free device pages: a page appears twice in \[0, 1, 2, "):
        big.free_tree(twice)
    assert _owners(big)[TREE] == 4 * 600
    big.free_tree(got)
    assert _owners(big)[FREE] == 4 * 1024


def test_a_free_pages_code_is_its_place_in_the_free_list(
    make_config: Callable[..., Config], checked: Callable[[Any], Any]
) -> None:
    """The owner table marks a free page with its place in the free list, written by the same
    scatter that finds a page named twice; the invariant check reads every code."""
    big = checked(DeviceCore(make_config(page_size=4, device_pages=1024, host_pages=1100)))
    got = big.allocate_pages([("a", 4 * 600)])["a"]  # more pages than FEW_MAX: the vectorised move
    big.release("a", got, ReleaseReason.FINISHED)
    big.free_tree(got[:500])
    big.free_tree(got[500:])
    stack, low = big._pool._stack, big._pool.low
    assert low == 0 and big._owner[torch.from_numpy(stack)].tolist() == list(range(-1, -1025, -1))
    assert big.allocate_pages([("b", 4 * 3)])["b"].tolist() == got[500:503].tolist()  # the last pushed, in order
    big._owner[int(stack[big._pool.low])] = -1  # the first free page marked with another place
    with pytest.raises(InvariantError, match="not marked with its place in the list"):
        big.check_invariants()


@pytest.mark.parametrize("pages", [[-1], [16], [0, 1, 16]])
def test_free_tree_of_pages_outside_the_buffer_is_refused(core: Any, pages: list[int]) -> None:
    got = core.allocate_pages([("a", 64)])["a"]
    core.release("a", got, ReleaseReason.FINISHED)
    with pytest.raises(SlotStateError, match=r"cannot free device pages: page number out of range 0..15"):
        core.free_tree(torch.tensor(pages))
    assert _owners(core)[TREE] == 64


def test_free_tree_of_a_page_it_does_not_hold_frees_nothing(core: Any) -> None:
    core.allocate_load(4)  # page 0; page 1 is free
    with pytest.raises(SlotStateError, match=r"slots 4..7 owned by free; expected tree or loading \(double free\?\)"):
        core.free_tree(torch.tensor([0, 1]))
    assert _owners(core) == {FREE: 60, REQUEST: 0, TREE: 0, LOADING: 4}


# -- a whole life -------------------------------------------------------------------


def test_allocated_stays_at_least_committed_through_a_request_life(core: Any) -> None:
    for step in range(1, 8):
        core.allocate([("a", step)])
        core.commit("a", step - 1)
        view = core.ledger("a")
        assert view.allocated >= view.committed
    got = core.allocate([("a", 0)])["a"]
    assert got.numel() == 0
    view = core.release("a", torch.tensor([0, 1, 2]), ReleaseReason.FINISHED)
    assert view.freed == view.allocated == 28
    assert _owners(core) == {FREE: 52, REQUEST: 0, TREE: 12, LOADING: 0}
    core.free_tree(torch.tensor([0, 1, 2]))
    assert _owners(core) == {FREE: 64, REQUEST: 0, TREE: 0, LOADING: 0}
    assert core.checks > 10


def test_allocate_after_a_mid_life_swap_answers_the_rest_of_the_last_page(core: Any) -> None:
    core.allocate([("a", 6)])  # pages 0, 1
    core.commit("a", 4)
    core.swap("a", torch.tensor([0]), torch.empty(0, dtype=torch.int64))  # page 0 to the tree
    assert core.allocate([("a", 3)])["a"].tolist() == [6, 7, 8]  # the rest of page 1, then page 2
    assert core.ledger("a") == LedgerEntry(request_id="a", allocated=9, committed=4, freed=4)
    assert _owners(core) == {FREE: 52, REQUEST: 8, TREE: 4, LOADING: 0}


def test_a_request_that_never_allocated_cannot_hand_free_pages_to_the_tree(make_config) -> None:
    """Its ledger's number is 0, the code of a free page: the owner check alone would pass a free
    page, which the tree would then own while it is on the free list (a later free of it frees twice)."""
    core = DeviceCore(make_config(page_size=4, device_pages=16))
    loaded = core.allocate_load(1)
    core.free_tree(loaded)  # page 0 is free again
    with pytest.raises(LedgerError, match=r"request 'r0': adopted pages \[0\] are not distinct pages of this request"):
        core.release("r0", torch.tensor([0]), ReleaseReason.FINISHED)
    core.check_invariants()
    assert core.release("r0", torch.tensor([], dtype=torch.int64), ReleaseReason.FINISHED).freed == 0
    core.check_invariants()


# -- ledger numbers -----------------------------------------------------------------


def test_a_released_ledgers_number_goes_to_the_next_request_and_its_pages_stay_apart(core: Any) -> None:
    """The owner table is int32 and a ledger's number is reused once it is released: the pages
    the tree adopted from the old request and the new request's own never pass for each other."""
    assert core._owners.view.dtype.name == "int32"
    core.allocate([("a", 8)])  # pages 0, 1
    core.commit("a", 8)
    number = core._ledgers["a"].number
    core.release("a", torch.tensor([0]), ReleaseReason.FINISHED)  # page 0 to the tree, page 1 freed
    core.allocate([("b", 4)])
    assert core._ledgers["b"].number == number
    # The tree's page 0 once carried the same number: it is not b's.
    with pytest.raises(LedgerError, match=r"request 'b': adopted pages \[0\] are not distinct pages of this request"):
        core.release("b", torch.tensor([0]), ReleaseReason.FINISHED)
    with pytest.raises(LedgerError, match="already released"):
        core.release("a", torch.tensor([], dtype=torch.int64), ReleaseReason.FINISHED)
    assert _owners(core) == {FREE: 56, REQUEST: 4, TREE: 4, LOADING: 0}
    core.allocate([("c", 4)])  # nothing spare: a new number
    assert core._ledgers["c"].number == number + 1
    core.free_tree(torch.tensor([0]))
    assert _owners(core) == {FREE: 56, REQUEST: 8, TREE: 0, LOADING: 0}


def test_a_retracted_request_that_allocates_again_gets_a_new_mark_though_its_number_comes_back(core: Any) -> None:
    """`mark` tells ledgers apart (an allocation put aside for an eviction is given up when its
    request's ledger changed meanwhile): by a serial, since the number may be the same."""
    core.allocate([("a", 4)])
    before = core.mark("a")
    core.release("a", torch.tensor([], dtype=torch.int64), ReleaseReason.RETRACTED)
    core.allocate([("a", 4)])
    assert core._ledgers["a"].number == 4 and core.mark("a") != before


def test_a_ledger_number_held_twice_or_lost_breaks_an_invariant(core: Any) -> None:
    core.allocate([("a", 4)])
    core.allocate([("b", 4)])
    core.release("a", torch.tensor([], dtype=torch.int64), ReleaseReason.FINISHED)
    core._spare_numbers.append(core._ledgers["b"].number)  # b's number also handed out as spare
    with pytest.raises(InvariantError, match="ledger numbers .* not each number handed out so far"):
        core.check_invariants()
    core._spare_numbers.clear()  # a's number lost
    with pytest.raises(InvariantError, match="ledger numbers .* not each number handed out so far"):
        core.check_invariants()
    core._spare_numbers.append(4)
    core.check_invariants()


def test_released_ledgers_are_kept_as_nothing_the_garbage_collector_walks(core: Any) -> None:
    """Up to `RELEASED_REMEMBERED_MAX` final ledgers are kept to catch use after release: as
    ints, not an object each, which a long run would keep for every full collection to walk."""
    for i in range(20):
        core.allocate([(f"r{i}", 5 + i)])
        core.commit(f"r{i}", 3 + i)
        core.release(f"r{i}", torch.tensor([], dtype=torch.int64), ReleaseReason.FINISHED)
    assert not any(gc.is_tracked(final) for final in core._released.values())
    assert core.ledger("r7") == LedgerEntry(request_id="r7", allocated=12, committed=10, freed=12)
    with pytest.raises(LedgerError, match=r"request 'r7' was already released \(LedgerEntry\(.*allocated=12, "
                                          r"committed=10, freed=12\)\)"):
        core.allocate([("r7", 1)])
    core._released["r7"] = 12 << 64 | 13  # committed past allocated
    with pytest.raises(InvariantError, match=r"released request 'r7' .* committed <= allocated"):
        core.check_invariants()
    core._released["r7"] = 12 << 64 | 10


def test_a_pool_too_large_for_int32_owner_codes_keeps_them_as_int64(monkeypatch: pytest.MonkeyPatch,
                                                                    make_config: Callable[..., Config]) -> None:
    monkeypatch.setattr(device_core_module, "_INT32_PAGES_MAX", 15)
    core = DeviceCore(make_config(page_size=4, device_pages=16))
    assert core._owners.view.dtype.name == "int64"
    core.allocate([("a", 8)])
    core.release("a", torch.tensor([1]), ReleaseReason.FINISHED)
    core.free_tree(torch.tensor([1]))
    core.check_invariants()
    assert _owners(core) == {FREE: 64, REQUEST: 0, TREE: 0, LOADING: 0}


# -- pages ahead ------------------------------------------------------------------


@pytest.fixture
def ahead(make_config: Callable[..., Config], checked: Callable[[Any], Any]) -> Any:
    """16 pages of 1 slot, up to 3 of them ahead of a request's slots."""
    return checked(DeviceCore(make_config(page_size=1, device_pages=16, ahead_slots=3)))


def test_a_demand_that_needs_a_page_also_gets_the_pages_ahead_it_asks_for(ahead: Any) -> None:
    got = ahead.allocate_pages([("a", 2), ("b", 1)], ahead=True)
    assert (got["a"].tolist(), got["b"].tolist()) == ([0, 1, 2, 3, 4], [5, 6, 7, 8])
    assert ahead.ledger("a").allocated == 2 and ahead.ledger("b").allocated == 1
    assert _owners(ahead)[REQUEST] == 9
    # The next slots come from the pages held: no new page, with or without `ahead`.
    assert ahead.allocate_pages([("a", 3)], ahead=True)["a"].tolist() == []
    assert ahead.allocate([("b", 2)])["b"].tolist() == [6, 7]
    ahead.extend_only([("b", 1)])  # served by the facade from its last page held
    assert (ahead.ledger("a").allocated, ahead.ledger("b").allocated) == (5, 4)
    # A demand past what it holds: the new pages it needs, then 3 ahead again.
    assert ahead.allocate_pages([("a", 2)], ahead=True)["a"].tolist() == [9, 10, 11, 12, 13]
    assert _owners(ahead)[REQUEST] == 14


def test_a_prefills_demand_gets_only_what_it_needs(ahead: Any) -> None:
    got = ahead.allocate_pages([("a", 4), ("b", 3)], ahead=True)  # more than 3 pages' slots: a prefill's
    assert (got["a"].tolist(), got["b"].tolist()) == ([0, 1, 2, 3], [4, 5, 6, 7, 8, 9])
    assert ahead.allocate_pages([("a", 1)], ahead=True)["a"].tolist() == [10, 11, 12, 13]  # its first step's


def test_pages_ahead_are_never_taken_by_eviction_nor_without_room_for_every_demand(ahead: Any) -> None:
    ahead.allocate_pages([("a", 10)])
    # 6 free: "b" and "c" need 1 each; 3 more for each would take 8.
    got = ahead.allocate_pages([("b", 1), ("c", 1)], ahead=True)
    assert (len(got["b"]), len(got["c"])) == (1, 1)
    got = ahead.allocate_pages([("d", 1)], ahead=True)
    assert len(got["d"]) == 4 and ahead.free_slots == 0
    assert isinstance(ahead.allocate_pages([("e", 1)], ahead=True), Insufficient)  # what "d" holds stays its


def test_taking_more_than_the_pages_held_have_left_is_a_ledger_error(ahead: Any) -> None:
    ahead.allocate_pages([("a", 1)], ahead=True)  # 1 slot, 3 held ahead
    with pytest.raises(LedgerError, match=r"request 'a': 4 slots taken from the pages it holds, which have 3 free"):
        ahead.extend_only([("a", 4)])
    assert ahead.ledger("a").allocated == 1


def test_trim_gives_back_only_the_pages_past_a_requests_slots(ahead: Any) -> None:
    ahead.allocate_pages([("a", 1), ("b", 1)], ahead=True)  # a: 0 + 1-3 ahead; b: 4 + 5-7 ahead
    ahead.extend_only([("a", 2)])  # a's slots: pages 0-2
    assert ahead.ahead_slots() == 1 + 3
    assert ahead.trim(["a", "b"]) == 1 + 3
    assert ahead.ahead_slots() == 0
    assert _owners(ahead) == {FREE: 12, REQUEST: 4, TREE: 0, LOADING: 0}
    assert ahead.trim(["a"]) == 0  # nothing ahead any more
    ahead.commit("a", 3)
    view = ahead.release("a", torch.tensor([0, 1, 2]), ReleaseReason.FINISHED)
    assert (view.allocated, view.freed) == (3, 3) and _owners(ahead)[TREE] == 3


def test_a_release_frees_the_pages_held_ahead_with_the_rest(ahead: Any) -> None:
    ahead.allocate_pages([("a", 5)], ahead=True)  # pages 0-4, 5-7 ahead
    ahead.commit("a", 5)
    view = ahead.release("a", torch.tensor([0, 1, 2, 3]), ReleaseReason.FINISHED)
    assert (view.allocated, view.committed, view.freed) == (5, 5, 5)
    assert _owners(ahead) == {FREE: 12, REQUEST: 0, TREE: 4, LOADING: 0}


def test_a_ledger_holding_more_pages_ahead_than_the_config_allows_breaks_the_invariant(
        make_config: Callable[..., Config]) -> None:
    core = DeviceCore(make_config(page_size=1, device_pages=16, ahead_slots=2))
    core.allocate_pages([("a", 1)], ahead=True)
    core.check_invariants()
    core.ahead_pages = 3  # a bug that grants one page too many
    core.allocate_pages([("b", 1)], ahead=True)
    with pytest.raises(InvariantError, match=r"ledger of 'b' .*plus at most 2 held ahead"):
        core.ahead_pages = 2
        core.check_invariants()
