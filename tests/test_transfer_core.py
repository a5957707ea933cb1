"""`TransferQueue`: FIFO operations merged into, and split over, bounded copy batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache.actors import InvariantError, Piece, TransferOp, TransferQueue
from hicache.actors._transfer_core import batch_indices, op_problem
from hicache.messages import ActorName


def _op(op_id: int, slots: int, base: int = 0) -> TransferOp:
    src = torch.arange(base, base + slots)
    return TransferOp(op_id, ActorName.TREE, src, src + 1000)


def _shape(batch: list[Piece]) -> list[tuple[int, int, int, bool]]:
    return [(p.op.op_id, p.start, p.end, p.last) for p in batch]


def _values(slots: list[int] | torch.Tensor) -> list[int]:
    return slots if isinstance(slots, list) else slots.tolist()


def _drain(q: TransferQueue) -> list[list[Piece]]:
    batches = []
    while batch := q.next_batch():
        q.check_invariants()
        batches.append(batch)
    return batches


def test_an_idle_queue_gives_an_empty_batch() -> None:
    q = TransferQueue(8, 4)
    assert q.next_batch() == []
    assert len(q) == 0 and q.merged_ops == 0 and q.split_ops == 0


def test_small_operations_merge_into_one_batch() -> None:
    q = TransferQueue(10, 8)
    for i in range(3):
        assert q.push(_op(i, 3))
    batch = q.next_batch()
    assert _shape(batch) == [(0, 0, 3, True), (1, 0, 3, True), (2, 0, 3, True)]
    assert len(q) == 0
    assert q.merged_ops == 3 and q.split_ops == 0
    assert q.next_batch() == []


def test_a_large_operation_is_split_into_bounded_batches() -> None:
    q = TransferQueue(10, 8)
    q.push(_op(7, 25))
    batches = _drain(q)
    assert [_shape(b) for b in batches] == [[(7, 0, 10, False)], [(7, 10, 20, False)], [(7, 20, 25, True)]]
    assert q.split_ops == 1 and q.merged_ops == 0


def test_an_operation_of_exactly_the_bound_is_neither_split_nor_merged() -> None:
    q = TransferQueue(10, 8)
    q.push(_op(1, 10))
    q.push(_op(2, 10))
    assert [_shape(b) for b in _drain(q)] == [[(1, 0, 10, True)], [(2, 0, 10, True)]]
    assert q.split_ops == 0 and q.merged_ops == 0


def test_an_operation_that_does_not_fit_the_room_left_continues_in_the_next_batch() -> None:
    q = TransferQueue(15, 8)
    for i in range(3):
        q.push(_op(i, 10))
    batches = _drain(q)
    assert [_shape(b) for b in batches] == [
        [(0, 0, 10, True), (1, 0, 5, False)],
        [(1, 5, 10, True), (2, 0, 10, True)],
    ]
    assert q.split_ops == 1
    assert q.merged_ops == 3  # each operation shared a batch; op 1 twice but counts once


def test_operations_complete_in_fifo_order() -> None:
    q = TransferQueue(4, 16)
    sizes = [1, 6, 2, 2, 9, 1]
    for i, n in enumerate(sizes):
        q.push(_op(i, n))
    done = [p.op.op_id for b in _drain(q) for p in b if p.last]
    assert done == list(range(len(sizes)))


def test_push_refuses_beyond_the_ops_bound_until_room_frees() -> None:
    q = TransferQueue(4, 2)
    assert q.push(_op(1, 2)) and q.push(_op(2, 2))
    assert not q.push(_op(3, 2))
    assert len(q) == 2
    q.check_invariants()
    q.next_batch()  # both complete
    assert q.push(_op(3, 2))
    assert len(q) == 1


def test_an_empty_operation_completes_at_once() -> None:
    q = TransferQueue(4, 4)
    q.push(_op(1, 0))
    assert _shape(q.next_batch()) == [(1, 0, 0, True)]
    assert len(q) == 0


def test_drain_removes_every_waiting_operation_in_order() -> None:
    q = TransferQueue(4, 8)
    ops = [_op(i, 3) for i in range(3)]
    for op in ops:
        q.push(op)
    assert q.drain() == ops
    assert len(q) == 0 and q.next_batch() == []


def test_cancel_drops_the_rest_of_a_failed_split_operation() -> None:
    q = TransferQueue(4, 8)
    big, after = _op(1, 10), _op(2, 2)
    q.push(big)
    q.push(after)
    first = q.next_batch()
    assert _shape(first) == [(1, 0, 4, False)]
    big.failed = True
    with pytest.raises(InvariantError, match="queued op 1 is done or failed but still queued"):
        q.check_invariants()
    q.cancel(big)
    q.check_invariants()
    assert _shape(q.next_batch()) == [(2, 0, 2, True)]
    q.cancel(big)  # a second cancel is harmless
    assert len(q) == 0


def test_batch_indices_concatenate_the_pieces_in_order() -> None:
    q = TransferQueue(5, 8)
    q.push(_op(1, 3, base=10))
    q.push(_op(2, 4, base=50))
    src, dst = batch_indices(q.next_batch())
    assert _values(src) == [10, 11, 12, 50, 51]
    assert _values(dst) == [1010, 1011, 1012, 1050, 1051]


def test_op_problem_names_a_length_mismatch_and_out_of_range_slots() -> None:
    a = torch.arange(4)
    assert op_problem(a, 8, a, 8) is None
    assert op_problem(a, 8, a[:3], 8) == "source has 4 slots but destination has 3"
    assert op_problem(a + 5, 8, a, 8) == "source slot out of range 0..7"
    assert op_problem(a, 8, a - 1, 8) == "destination slot out of range 0..7"
    empty = torch.empty(0, dtype=torch.int64)
    assert op_problem(empty, 8, empty, 8) is None


@pytest.mark.parametrize(("slots_max", "ops_max"), [(0, 1), (1, 0), (-1, 4)])
def test_the_bounds_must_be_positive(slots_max: int, ops_max: int) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        TransferQueue(slots_max, ops_max)


@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    slots_max=st.integers(1, 32),
)
def test_batches_are_bounded_and_cover_each_operation_once_in_order(sizes: list[int], slots_max: int) -> None:
    q = TransferQueue(slots_max, len(sizes))
    for i, n in enumerate(sizes):
        assert q.push(_op(i, n))
    batches = _drain(q)
    covered: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(sizes))}
    order = []
    for batch in batches:
        assert sum(p.end - p.start for p in batch) <= slots_max
        for p in batch:
            covered[p.op.op_id].append((p.start, p.end))
            order.append(p.op.op_id)
    assert order == sorted(order)  # FIFO
    for i, n in enumerate(sizes):
        pieces = covered[i]
        assert pieces[0][0] == 0 and pieces[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
    assert len(batches) == -(-sum(sizes) // slots_max)  # every batch but the last is full
    assert q.split_ops == sum(1 for i in covered if len(covered[i]) > 1)
    shared = {p.op.op_id for b in batches if len(b) > 1 for p in b}
    assert q.merged_ops == len(shared)
