"""The file backend's page index: least recently used first, by writes, scans and reads,
against a plain list that keeps the same order; invariants checked after every step."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.actors import InvariantError
from hicache.actors._page_index import _ORDER_MIN, PageIndex

RECORD = 100


def _segment(index: PageIndex, n: int) -> object:
    return index.new_segment(f"seg-1-0-{n:06d}.hkv", Path("unused"), ours=True, record=RECORD)


# A step: ("write", pages), ("scan", pages), ("read", which of the held keys), ("evict", how many).
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(1, 5)),
        st.tuples(st.just("scan"), st.integers(1, 3)),
        st.tuples(st.just("read"), st.lists(st.integers(0, 1000), min_size=1, max_size=4)),
        st.tuples(st.just("evict"), st.integers(1, 4)),
        st.tuples(st.just("new segment"), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(STEPS, st.sampled_from([_ORDER_MIN, 2]))
def test_the_oldest_page_is_the_least_recently_written_scanned_or_read(steps, order_min) -> None:
    index = PageIndex(order_min)  # 2: the queue of ranges compacted again and again
    segs = [_segment(index, 0)]
    model: list[str] = []  # least recently used first
    made = 0
    for op, arg in steps:
        seg = segs[-1]
        if op in ("write", "scan"):
            keys = [f"k{made + i}" for i in range(arg)]
            made += arg
            if op == "write":
                index.append(seg, keys)
            else:
                for key in keys:
                    assert index.take(key, seg, len(seg.keys))
                    seg.keys.append(key)
                    seg.live += 1
                index.end_scan()
            seg.scanned = len(seg.keys) * RECORD
            model += keys
        elif op == "read" and model:
            keys = list(dict.fromkeys(model[i % len(model)] for i in arg))
            for run in index.runs(keys, 1 << 20):  # as the backend reads: a run of records a call
                index.touch(*run)
            model = [k for k in model if k not in keys] + keys
        elif op == "evict":
            for _ in range(min(arg, len(model))):
                key = index.oldest()
                assert key == model[0]
                index.remove(key)
                model.pop(0)
        elif op == "new segment":
            segs.append(_segment(index, len(segs)))
        index.check_invariants()
        assert len(index) == len(model)


def test_a_dropped_segment_takes_its_pages_out_of_the_order() -> None:
    index = PageIndex()
    a, b = _segment(index, 0), _segment(index, 1)
    index.append(a, ["a0", "a1"])
    index.append(b, ["b0"])
    a.scanned, b.scanned = 2 * RECORD, RECORD
    index.touch(*index.locate("a1"), 1)
    index.drop_segment(a)
    index.check_invariants()
    assert index.oldest() == "b0" and len(index) == 1


def test_a_page_in_no_recency_order_is_an_invariant_error() -> None:
    index = PageIndex()
    seg = _segment(index, 0)
    assert index.take("k", seg, 0)
    seg.keys.append("k")
    seg.live, seg.scanned = 1, RECORD
    index._order.clear()  # what a bug that lost it would leave
    with pytest.raises(InvariantError, match="no recency order"):
        index.check_invariants()


def test_a_claim_with_a_held_or_repeated_key_refuses_them_all_and_changes_nothing() -> None:
    index = PageIndex()
    seg = _segment(index, 0)
    assert index.claim(seg, ["a", "b"])
    seg.scanned = 2 * RECORD
    for keys in (["c", "a", "d"], ["c", "d", "c"]):
        assert not index.claim(seg, keys)
        assert len(index) == 2 and seg.keys == ["a", "b"] and "c" not in index and "d" not in index
        assert index.locate("a") == (seg, 0)
        index.check_invariants()
    with pytest.raises(InvariantError, match="indexed already or repeated"):
        index.append(seg, ["e", "e"])
    assert index.claim(seg, ["c", "d"]) and index.locate("d") == (seg, 3)


def test_unclaim_takes_back_the_last_claim_whose_write_failed() -> None:
    index = PageIndex()
    seg = _segment(index, 0)
    assert index.claim(seg, ["a"])
    seg.scanned = RECORD
    assert index.claim(seg, ["b", "c"])
    index.unclaim(seg, 2)
    index.check_invariants()
    assert len(index) == 1 and seg.keys == ["a"] and seg.live == 1 and index.oldest() == "a"
    with pytest.raises(InvariantError, match="last claim did not add"):
        index.unclaim(seg, 3)


def test_pages_read_over_and_over_keep_the_recency_queue_bounded() -> None:
    index = PageIndex()
    seg = _segment(index, 0)
    index.append(seg, [f"k{i}" for i in range(8)])
    seg.scanned = 8 * RECORD
    for _ in range(10 * _ORDER_MIN):  # k0..k3 read again and again, one run a read
        index.touch(seg, 0, 4)
    index.check_invariants()
    assert len(index._order) <= _ORDER_MIN + 1
    for expected in ["k4", "k5", "k6", "k7", "k0", "k1", "k2", "k3"]:
        assert index.oldest() == expected
        index.remove(expected)
        index.check_invariants()
    with pytest.raises(InvariantError, match="empty index"):
        index.oldest()


def test_runs_follow_adjacent_records_and_stop_at_the_first_key_not_held() -> None:
    index = PageIndex()
    a, b = _segment(index, 0), _segment(index, 1)
    index.append(a, ["a0", "a1", "a2"])
    index.append(b, ["b0", "b1"])
    assert index.runs(["a0", "a1", "a2"], 8) == [(a, 0, 3)]
    assert index.runs(["a0", "a1", "a2"], 2) == [(a, 0, 2), (a, 2, 1)]
    assert index.runs(["a1", "a2", "b0", "b1"], 8) == [(a, 1, 2), (b, 0, 2)]
    assert index.runs(["a2", "a1"], 8) == [(a, 2, 1), (a, 1, 1)]
    assert index.runs(["a0", "a1", "x", "a2"], 8) == [(a, 0, 2)]
    assert index.runs(["x", "a0"], 8) == []


def test_a_record_stamped_for_no_queued_range_is_an_invariant_error() -> None:
    index = PageIndex()
    seg = _segment(index, 0)
    index.append(seg, ["a", "b"])
    seg.scanned = 2 * RECORD
    seg.ticks[1] = 99  # a stamp no range holds: the page could never be evicted
    with pytest.raises(InvariantError, match="'b' is in no recency order"):
        index.check_invariants()
