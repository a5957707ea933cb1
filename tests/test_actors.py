"""The device, host and stream actors on threads, with the test in the tree's place.

Every step goes through `TreeSide` (conftest), which sends as `ActorName.TREE`,
receives the tree's mail from its probe and asks every actor to check its
invariants after each step. KV bytes are proved with the fingerprint oracle.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hicache.actors import FailedTransfers, Mail
from hicache.messages import (
    ActorName,
    AllocateHost,
    AllocateSlots,
    CheckInvariants,
    CopyLayer,
    DeviceStatistics,
    DrainWrites,
    Evicted,
    EvictForAllocation,
    HostAllocated,
    HostSlotState,
    HostStatistics,
    Indices,
    InvariantsHeld,
    LoadDone,
    LoadFailed,
    LoadKV,
    LoadsStarted,
    ReleaseReason,
    SlotDemand,
    SlotsAllocated,
    SlotsInsufficient,
    StartLoads,
    StreamStatistics,
    WriteDone,
    WriteFailed,
    WriteKV,
)
from hicache.runtime import Config, HostLayout, LoadFailedError
from hicache.runtime.testing.oracle import FingerprintMismatchError

S = HostSlotState
TREE, DEVICE, HOST, WRITE, LOAD = ActorName.TREE, ActorName.DEVICE, ActorName.HOST, ActorName.WRITE, ActorName.LOAD
FACADE = ActorName.FACADE


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32_000) for _ in range(n)]


def _prefill(tree: Any, oracle: Any, requests: dict[str, list[int]]) -> dict[str, Indices]:
    """Allocate device pages for each request in one batch, write its KV (the forward
    pass), commit it, and finish it with every page adopted by the tree. Every request
    is whole pages of tokens; the answer is its pages."""
    grants = tree.allocate({rid: len(tokens) for rid, tokens in requests.items()})
    assert isinstance(grants, dict)
    for rid, tokens in requests.items():
        assert len(grants[rid]) * tree.system.config.page_size == len(tokens)
        oracle.write(tree.system.device_kv, tokens, tree.slots(grants[rid]))
        entry = tree.commit(rid, len(tokens))
        assert (entry.allocated, entry.committed) == (len(tokens), len(tokens))
        final = tree.release(rid, grants[rid], ReleaseReason.FINISHED)
        assert final.freed == final.allocated == len(tokens)
    return grants


# -- L1 -> L2 -> L1 -------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", [HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST], ids=["layer_first", "page_first"])
def test_kv_bytes_round_trip_device_to_host_to_device_with_merged_and_split_transfers(
    make_config: Callable[..., Config], oracle_for: Callable[[Config], Any], start_system: Callable[..., Any],
    gate: Any, page_size: int, layout: HostLayout,
) -> None:
    cfg = make_config(page_size=page_size, device_pages=16, host_pages=32, host_layout=layout, transfer_pages_max=2)
    oracle = oracle_for(cfg)
    tree = start_system(cfg, observe=gate)
    p = page_size
    # four one-page requests (merged two per batch) and one of five pages (split 2 + 2 + 1)
    requests = {f"small-{i}": _tokens(i, p) for i in range(4)}
    requests["big"] = _tokens(99, 5 * p)
    device = _prefill(tree, oracle, requests)
    assert tree.statistics(DEVICE).tree_slots == 9 * p

    # L1 -> L2: every write is queued before the stream drains (the gate holds it at the first)
    host = {rid: tree.host_allocate(len(t)) for rid, t in requests.items()}
    for rid in requests:
        tree.host_move(host[rid], S.WRITING)
    gate.hold(WRITE, lambda m: isinstance(m, WriteKV))
    op_of = {rid: tree.next_op() for rid in requests}
    for rid in requests:
        tree.system.tell(WRITE, WriteKV(op_id=op_of[rid], device=device[rid], host=host[rid]), sender=TREE)
    gate.open()  # held or not yet dequeued: either way the drain comes after every write
    done = [tree.expect(WriteDone) for _ in requests]
    assert [d.op_id for d in done] == list(op_of.values())  # FIFO
    assert [d.slots for d in done] == [len(t) for t in requests.values()]
    writes = tree.statistics(WRITE)
    assert isinstance(writes, StreamStatistics)
    assert writes.merged_ops == 4 and writes.split_ops == 1
    assert writes.ops_done == 5 and writes.ops_failed == 0 and writes.queued_ops == 0
    assert writes.batches == 5
    assert writes.slots_copied == 9 * p and writes.bytes_copied == 9 * p * cfg.bytes_per_slot
    for rid, tokens in requests.items():
        tree.host_move(host[rid], S.SYNCED)
        oracle.verify(tree.system.host_kv, tokens, tree.slots(host[rid]))

    # the device copies go (eviction); the host copies are all that is left
    for rid in requests:
        tree.free_device(device[rid])
        tree.host_move(host[rid], S.HOST_ONLY)
    tree.system.device_kv.tensor.zero_()
    with pytest.raises(FingerprintMismatchError):
        oracle.verify(tree.system.device_kv, requests["big"], tree.slots(device["big"]))

    # L2 -> L1: one merged load batch into fresh device pages
    loaded = {rid: tree.allocate_load(len(t)) for rid, t in requests.items()}
    for rid in requests:
        tree.host_move(host[rid], S.LOADING)
        tree.tell(LOAD, LoadKV(op_id=op_of[rid] + 100, host=host[rid], device=loaded[rid]))
    started = tree.ask(LOAD, StartLoads(), sender=FACADE)
    assert isinstance(started, LoadsStarted) and started.batch == 1
    assert started.ops == tuple(op + 100 for op in op_of.values())
    assert tree.expect(LoadsStarted) == started  # the tree hears of the start before any LoadDone
    tree.system.ring.waiter(started.batch).wait_all(timeout_s=30)
    load_done = [tree.expect(LoadDone) for _ in requests]
    assert {d.op_id for d in load_done} == set(started.ops) and {d.batch for d in load_done} == {1}
    for rid, tokens in requests.items():
        tree.adopt_loaded(loaded[rid])
        tree.host_move(host[rid], S.SYNCED)
        oracle.verify(tree.system.device_kv, tokens, tree.slots(loaded[rid]))
    loads = tree.statistics(LOAD)
    assert loads.ops_done == 5 and loads.merged_ops == 5 and loads.batches == 1
    assert loads.bytes_copied == 9 * p * cfg.bytes_per_slot

    # everything given back: every slot is free
    for rid in requests:
        tree.host_free(host[rid])
        tree.free_device(loaded[rid])
    dev, hst = tree.statistics(DEVICE), tree.statistics(HOST)
    assert isinstance(dev, DeviceStatistics) and isinstance(hst, HostStatistics)
    assert dev.free_slots == dev.capacity_slots == cfg.device_slots and dev.live_requests == 0
    assert hst.slots_in(S.FREE) == hst.capacity_slots == cfg.host_slots


def test_a_write_longer_than_the_batch_bound_is_split_and_arrives_whole(
    make_config: Callable[..., Config], oracle_for: Callable[[Config], Any], start_system: Callable[..., Any]
) -> None:
    cfg = make_config(page_size=4, device_pages=16, host_pages=32, transfer_pages_max=3,
                      host_layout=HostLayout.PAGE_FIRST)
    oracle = oracle_for(cfg)
    tree = start_system(cfg)
    tokens = _tokens(5, 32)
    device = _prefill(tree, oracle, {"r": tokens})
    host = tree.host_allocate(32)
    reply = tree.write(device["r"][:7], host[:7])  # 7 pages: batches of 3, 3 and 1 (partial)
    assert isinstance(reply, WriteDone) and reply.slots == 28
    oracle.verify(tree.system.host_kv, tokens[:28], tree.slots(host[:7]))
    assert not bool(tree.system.host_kv.read(tree.slots(host[7:])).any())
    stats = tree.statistics(WRITE)
    assert stats.split_ops == 1 and stats.batches == 3 and stats.merged_ops == 0


# -- the per-layer waiter -------------------------------------------------------------


def test_the_forward_pass_may_read_a_layer_as_soon_as_its_load_is_done(
    make_config: Callable[..., Config], oracle_for: Callable[[Config], Any], start_system: Callable[..., Any],
    gate: Any,
) -> None:
    cfg = make_config(page_size=4, layers=3, host_layout=HostLayout.PAGE_FIRST)
    oracle = oracle_for(cfg)
    tree = start_system(cfg, observe=gate)
    tokens = _tokens(1, 12)
    host = tree.host_allocate(12)
    tree.host_move(host, S.PREFETCHING)
    oracle.write(tree.system.host_kv, tokens, tree.slots(host))  # as a storage read would
    tree.host_move(host, S.HOST_ONLY)
    device = tree.allocate_load(12)
    tree.host_move(host, S.LOADING)

    held = gate.hold(LOAD, lambda m: isinstance(m, CopyLayer) and m.layer == 1)
    tree.system.tell(LOAD, LoadKV(op_id=1, host=host, device=device), sender=TREE)
    started = tree.system.ask(LOAD, StartLoads())
    assert tree.probe.expect(LoadsStarted) == started  # no invariant check: it would ask the held stream
    waiter = tree.system.ring.waiter(started.batch)
    waiter.wait_layer(0, timeout_s=30)
    assert held.reached.wait(30)  # the stream is about to copy layer 1, and waits
    kv = tree.system.device_kv.read(tree.slots(device))
    want = oracle.expected(tokens, 0, 12)
    assert torch.equal(kv[:, 0], want[:, 0])
    assert not bool(kv[:, 1:].any())  # layers 1 and 2 not copied yet
    with pytest.raises(TimeoutError, match="layer 1 of load batch 1 not done"):
        waiter.wait_layer(1, timeout_s=0.05)
    gate.open()
    waiter.wait_layer(2, timeout_s=30)
    waiter.wait_layer(1, timeout_s=30)
    assert tree.expect(LoadDone).op_id == 1
    oracle.verify(tree.system.device_kv, tokens, tree.slots(device))
    tree.adopt_loaded(device)
    tree.host_move(host, S.SYNCED)


def test_start_loads_with_nothing_queued_is_batch_zero_and_needs_no_wait(
    make_config: Callable[..., Config], start_system: Callable[..., Any]
) -> None:
    tree = start_system(make_config())
    started = tree.ask(LOAD, StartLoads(), sender=FACADE)
    assert started == LoadsStarted(batch=0, ops=())
    tree.system.ring.waiter(0).wait_all(timeout_s=0)


def test_load_batches_are_numbered_in_order_and_each_completes(
    make_config: Callable[..., Config], oracle_for: Callable[[Config], Any], start_system: Callable[..., Any]
) -> None:
    cfg = make_config(page_size=4)
    oracle = oracle_for(cfg)
    tree = start_system(cfg)
    batches = []
    for i in range(6):  # more batches than the ring holds (4), one at a time
        tokens = _tokens(i, 4)
        host = tree.host_allocate(4)
        tree.host_move(host, S.PREFETCHING)
        oracle.write(tree.system.host_kv, tokens, tree.slots(host))
        tree.host_move(host, S.HOST_ONLY)
        device = tree.allocate_load(4)
        reply = tree.load(host, device)
        assert isinstance(reply, LoadDone)
        batches.append(reply.batch)
        oracle.verify(tree.system.device_kv, tokens, tree.slots(device))
        tree.free_device(device)
        tree.host_free(host)
    assert batches == [1, 2, 3, 4, 5, 6]


# -- failures -------------------------------------------------------------------------


def test_a_failed_write_is_reported_failed_and_never_done(
    make_config: Callable[..., Config], oracle_for: Callable[[Config], Any], start_system: Callable[..., Any]
) -> None:
    cfg = make_config(page_size=4)
    oracle = oracle_for(cfg)
    tree = start_system(cfg, faults=FailedTransfers(frozenset({500}), reason="disk on fire"))
    tokens = _tokens(2, 8)
    device = _prefill(tree, oracle, {"r": tokens})["r"]
    host = tree.host_allocate(8)
    failed = tree.write(device, host, op_id=500)
    assert failed == WriteFailed(op_id=500, reason="disk on fire")
    assert tree.system.host_kv.tensor.count_nonzero() == 0
    assert tree.probe.pending() == 0
    stats = tree.statistics(WRITE)
    assert (stats.ops_failed, stats.ops_done, stats.slots_copied) == (1, 0, 0)
    # the stream goes on: the same pages with another op id are written
    assert isinstance(tree.write(device, host, op_id=501), WriteDone)
    oracle.verify(tree.system.host_kv, tokens, tree.slots(host))


def test_a_failed_split_write_leaves_nothing_queued(
    make_config: Callable[..., Config], oracle_for: Callable[[Config], Any], start_system: Callable[..., Any],
    gate: Any,
) -> None:
    cfg = make_config(page_size=4, transfer_pages_max=1)
    tree = start_system(cfg, faults=FailedTransfers(frozenset({9})), observe=gate)
    device = _prefill(tree, oracle_for(cfg), {"r": _tokens(3, 16)})["r"]  # 4 batches of one page
    host = tree.host_allocate(16)
    tree.host_move(host, S.WRITING)
    drains = iter(range(1, 1_000))
    gate.hold(WRITE, lambda m: isinstance(m, DrainWrites) and next(drains) == 2)
    tree.tell(WRITE, WriteKV(op_id=9, device=device, host=host))
    assert tree.probe.expect(WriteFailed).op_id == 9
    # Whatever the stream does after the failure, this check is in its inbox before it
    # could copy (or skip) another piece of the failed write.
    check = tree.system.directory.ref(WRITE).ask(Mail(TREE, CheckInvariants(), ask=True), block=False)
    gate.open()
    assert check.get(timeout=30) == InvariantsHeld(actor=WRITE)
    assert tree.statistics(WRITE).queued_ops == 0
    tree.host_move(host, S.RESERVED)
    assert tree.probe.pending() == 0


def test_every_write_merged_with_a_failed_one_is_failed_too(
    make_config: Callable[..., Config], oracle_for: Callable[[Config], Any], start_system: Callable[..., Any],
    gate: Any,
) -> None:
    cfg = make_config(page_size=4, transfer_pages_max=4)
    tree = start_system(cfg, faults=FailedTransfers(frozenset({2})), observe=gate)
    device = _prefill(tree, oracle_for(cfg), {f"r{i}": _tokens(i, 4) for i in range(5)})
    host = {rid: tree.host_allocate(4) for rid in device}
    gate.hold(WRITE, lambda m: isinstance(m, WriteKV))
    for op, rid in enumerate(device, start=1):  # ops 1-4 share a batch, op 5 has its own
        tree.system.tell(WRITE, WriteKV(op_id=op, device=device[rid], host=host[rid]), sender=TREE)
    gate.open()
    replies = {m.op_id: m for m in (tree.expect(WriteDone, WriteFailed) for _ in range(5))}
    assert {op for op, m in replies.items() if isinstance(m, WriteFailed)} == {1, 2, 3, 4}
    assert isinstance(replies[5], WriteDone)
    assert tree.probe.pending() == 0


def test_a_failed_load_is_reported_failed_and_waiting_on_it_raises(
    make_config: Callable[..., Config], oracle_for: Callable[[Config], Any], start_system: Callable[..., Any]
) -> None:
    cfg = make_config(page_size=4)
    oracle = oracle_for(cfg)
    tree = start_system(cfg, faults=FailedTransfers(frozenset({77}), reason="bit flip"))
    tokens = _tokens(4, 8)
    device = _prefill(tree, oracle, {"r": tokens})["r"]
    host = tree.host_allocate(8)
    assert isinstance(tree.write(device, host), WriteDone)
    tree.free_device(device)
    tree.host_move(host, S.HOST_ONLY)
    tree.system.device_kv.tensor.zero_()

    target = tree.allocate_load(8)
    tree.host_move(host, S.LOADING)
    tree.tell(LOAD, LoadKV(op_id=77, host=host, device=target))
    started = tree.ask(LOAD, StartLoads(), sender=FACADE)
    assert tree.expect(LoadsStarted) == started
    waiter = tree.system.ring.waiter(started.batch)
    failed = tree.expect(LoadDone, LoadFailed)
    assert failed == LoadFailed(op_id=77, reason="bit flip")
    for layer in range(cfg.layers):
        with pytest.raises(LoadFailedError, match=f"load batch {started.batch} failed: bit flip"):
            waiter.wait_layer(layer, timeout_s=30)
    with pytest.raises(LoadFailedError):
        waiter.wait_all(timeout_s=30)
    assert tree.system.device_kv.tensor.count_nonzero() == 0
    assert tree.probe.pending() == 0  # no LoadDone behind the LoadFailed
    stats = tree.statistics(LOAD)
    assert (stats.ops_failed, stats.ops_done, stats.batches) == (1, 0, 1)
    # the tree gives the load's device pages back and keeps the host copy
    tree.free_device(target)
    tree.host_move(host, S.HOST_ONLY)
    retry = tree.allocate_load(8)
    assert isinstance(tree.load(host, retry, op_id=78), LoadDone)
    oracle.verify(tree.system.device_kv, tokens, tree.slots(retry))


@pytest.mark.parametrize(
    ("host_pages", "reason"),
    [
        (lambda h: h[:1], "bad write: source has 2 pages but destination has 1"),
        (lambda h: Indices.of([10_000, 10_001]), "bad write: destination page out of range 0..31"),
    ],
    ids=["length-mismatch", "out-of-range"],
)
def test_a_write_with_unusable_indices_is_failed_at_once(
    make_config: Callable[..., Config], start_system: Callable[..., Any], host_pages: Any, reason: str
) -> None:
    tree = start_system(make_config(page_size=4))
    device = tree.allocate_load(8)
    host = tree.host_allocate(8)
    tree.tell(WRITE, WriteKV(op_id=3, device=device, host=host_pages(host)))
    failed = tree.expect(WriteFailed)
    assert failed == WriteFailed(op_id=3, reason=reason)
    assert tree.statistics(WRITE).ops_failed == 1
    tree.free_device(device)


def test_a_load_with_unusable_indices_is_failed_at_once(
    make_config: Callable[..., Config], start_system: Callable[..., Any]
) -> None:
    tree = start_system(make_config(page_size=4))
    tree.tell(LOAD, LoadKV(op_id=4, host=Indices.of([0, 1]), device=Indices.of([5_000, 5_001])))
    failed = tree.expect(LoadFailed)
    assert failed == LoadFailed(op_id=4, reason="bad load: destination page out of range 0..15")
    # The admission that sent it has answered a host hit: the batch the next start gives fails.
    started = tree.ask(LOAD, StartLoads(), sender=FACADE)
    assert started.batch > 0 and started.ops == ()
    with pytest.raises(LoadFailedError, match="load 4 was refused: bad load"):
        tree.system.ring.waiter(started.batch).wait_all(timeout_s=30)
    assert tree.ask(LOAD, StartLoads(), sender=FACADE).batch == 0  # once: the next start has nothing to fail


def _start_loads(tree: Any, *, awaited: bool = True) -> Any:
    """Tell the load stream to start its queued loads, as the facade does; its reply comes
    to the facade's inbox (`_replies`)."""
    tree.system.tell(LOAD, StartLoads(awaited=awaited), sender=FACADE)


def _replies(tree: Any, n: int) -> list[Any]:
    return [tree.system.next_reply(30.0) for _ in range(n)]


@pytest.mark.parametrize("queued_behind", [False, True])
def test_a_failed_load_back_no_forward_pass_waited_on_fails_the_next_awaited_batch(
    make_config: Callable[..., Config], start_system: Callable[..., Any], gate: Any, queued_behind: bool
) -> None:
    """`quiesce()` and `close()` start queued load-backs that no forward pass waits on
    (`StartLoads(awaited=False)`), but the admissions that queued them answered host hits,
    and the engine's forward pass waits on the batch its `start_loads` gives. If the earlier
    batch fails, that one must fail too, or the pass reads slots no load filled. The failure
    comes before the awaited batch starts, or while it is queued behind the failing one (the
    stream is held at the first start, so the second is in its inbox before the first's copies)."""
    tree = start_system(make_config(page_size=4), faults=FailedTransfers(frozenset({4})), observe=gate)
    gate.hold(LOAD, lambda m: isinstance(m, StartLoads))
    tree.tell(LOAD, LoadKV(op_id=4, host=Indices.of([0]), device=Indices.of([1])))
    _start_loads(tree, awaited=False)
    if not queued_behind:
        gate.open()
        assert tree.expect(LoadsStarted).ops == (4,)
        assert tree.expect(LoadFailed).op_id == 4
    tree.tell(LOAD, LoadKV(op_id=5, host=Indices.of([2]), device=Indices.of([3])))
    _start_loads(tree)
    gate.open()
    unawaited, started = _replies(tree, 2)
    assert started.batch > unawaited.batch and started.ops == (5,)
    with pytest.raises(LoadFailedError, match=f"batch {unawaited.batch}, which no forward pass waited on, failed"):
        tree.system.ring.waiter(started.batch).wait_all(timeout_s=30)
    mail = [tree.expect(LoadsStarted, LoadFailed) for _ in range(2 if not queued_behind else 4)]
    assert {m.op_id for m in mail if isinstance(m, LoadFailed)} == ({5} if not queued_behind else {4, 5})
    tree.tell(LOAD, LoadKV(op_id=6, host=Indices.of([4]), device=Indices.of([5])))
    _start_loads(tree)
    [again] = _replies(tree, 1)
    tree.system.ring.waiter(again.batch).wait_all(timeout_s=30)  # once: the next batch does not fail
    assert tree.expect(LoadsStarted).ops == (6,)
    assert tree.expect(LoadDone).op_id == 6


def test_a_batch_quiesce_started_that_start_loads_hands_out_reports_its_own_failure_once(
    make_config: Callable[..., Config], start_system: Callable[..., Any], gate: Any
) -> None:
    """A batch `quiesce()` started that `start_loads` then hands out (nothing new queued, the
    batch still in flight) is awaited: its failure reaches that waiter and fails no later batch."""
    tree = start_system(make_config(page_size=4), faults=FailedTransfers(frozenset({4})), observe=gate)
    gate.hold(LOAD, lambda m: isinstance(m, StartLoads))
    tree.tell(LOAD, LoadKV(op_id=4, host=Indices.of([0]), device=Indices.of([1])))
    _start_loads(tree, awaited=False)
    _start_loads(tree)
    gate.open()
    unawaited, handed = _replies(tree, 2)
    assert handed.batch == unawaited.batch and handed.ops == ()
    with pytest.raises(LoadFailedError, match="injected transfer failure"):
        tree.system.ring.waiter(handed.batch).wait_all(timeout_s=30)
    assert tree.expect(LoadsStarted).ops == (4,)
    assert tree.expect(LoadFailed).op_id == 4
    tree.tell(LOAD, LoadKV(op_id=5, host=Indices.of([2]), device=Indices.of([3])))
    _start_loads(tree)
    [started] = _replies(tree, 1)
    tree.system.ring.waiter(started.batch).wait_all(timeout_s=30)
    assert tree.expect(LoadsStarted).ops == (5,)
    assert tree.expect(LoadDone).op_id == 5


def test_writes_beyond_the_queue_bound_are_refused_as_failed(
    make_config: Callable[..., Config], oracle_for: Callable[[Config], Any], start_system: Callable[..., Any],
    gate: Any,
) -> None:
    cfg = make_config(page_size=4, transfer_queue_ops_max=2)
    tree = start_system(cfg, observe=gate)
    device = _prefill(tree, oracle_for(cfg), {f"r{i}": _tokens(i, 4) for i in range(3)})
    host = {rid: tree.host_allocate(4) for rid in device}
    gate.hold(WRITE, lambda m: isinstance(m, WriteKV))
    for op, rid in enumerate(device, start=1):
        tree.system.tell(WRITE, WriteKV(op_id=op, device=device[rid], host=host[rid]), sender=TREE)
    gate.open()
    replies = {m.op_id: m for m in (tree.expect(WriteDone, WriteFailed) for _ in range(3))}
    assert isinstance(replies[1], WriteDone) and isinstance(replies[2], WriteDone)
    assert replies[3] == WriteFailed(op_id=3, reason="write queue full (2 ops, transfer_queue_ops_max)")


# -- device and host through their actors ------------------------------------------------


def test_device_statistics_count_slots_by_owner(
    make_config: Callable[..., Config], start_system: Callable[..., Any]
) -> None:
    tree = start_system(make_config(page_size=4, device_pages=16))
    grants = tree.allocate({"a": 5, "b": 4})
    tree.allocate_load(4)
    tree.release("b", grants["b"], ReleaseReason.FINISHED)
    assert tree.statistics(DEVICE) == DeviceStatistics(
        capacity_slots=64, free_slots=48, request_slots=8, tree_slots=4, loading_slots=4, live_requests=1
    )


def test_an_allocation_that_does_not_fit_is_answered_insufficient(
    make_config: Callable[..., Config], start_system: Callable[..., Any]
) -> None:
    tree = start_system(make_config(page_size=4, device_pages=16))
    got = tree.allocate({"a": 30, "b": 40})
    assert (got.requested_slots, got.free_slots, got.shortfall_slots) == (72, 64, 8)
    assert tree.statistics(DEVICE).free_slots == 64
    assert tree.allocate_load(65) is None
    assert tree.host_allocate(4 * 33) is None


def _allocate_evicting(tree: Any, op: int, demands: dict[str, int]) -> None:
    """The facade's allocation: told (its answer comes to the facade's inbox), evicting if short."""
    message = AllocateSlots(op_id=op, demands=tuple(SlotDemand(request_id=r, tokens=n) for r, n in demands.items()),
                            allocs=(), commits=(), evict=True)
    tree.system.tell(DEVICE, message, sender=ActorName.FACADE)


def test_a_short_allocation_has_the_tree_evict_and_is_answered_once_it_has(
    make_config: Callable[..., Config], start_system: Callable[..., Any]
) -> None:
    tree = start_system(make_config(page_size=4, device_pages=4))
    held = tree.allocate({"a": 16})["a"]
    tree.release("a", held[:3], ReleaseReason.FINISHED)  # the tree keeps 3 pages, one is free
    _allocate_evicting(tree, 7, {"b": 8})  # two pages: one short
    ask = tree.expect(EvictForAllocation)
    assert (ask.op_id, ask.tokens) == (7, 4)
    assert tree.system.next_reply(0.0, block=False) is None  # nothing answered while the tree evicts
    tree.free_device(held[:1])
    tree.tell(DEVICE, Evicted(op_id=7, device_tokens=4, host_tokens=0))
    reply = tree.system.next_reply(5.0)
    assert isinstance(reply, SlotsAllocated) and reply.op_id == 7 and len(reply.grants[0].pages) == 2
    assert tree.statistics(DEVICE).request_slots == 8


def test_an_allocation_whose_request_was_released_while_the_tree_evicted_takes_nothing(
    make_config: Callable[..., Config], start_system: Callable[..., Any]
) -> None:
    """A facade that gave up on the call (its reply timeout) may finish the request meanwhile:
    the retry must not hand pages to a ledger that is closed."""
    tree = start_system(make_config(page_size=4, device_pages=4))
    held = tree.allocate({"a": 8})["a"]
    _allocate_evicting(tree, 9, {"a": 12})  # three more pages: one short
    assert tree.expect(EvictForAllocation).tokens == 4
    tree.release("a", Indices(), ReleaseReason.FINISHED)
    tree.tell(DEVICE, Evicted(op_id=9, device_tokens=0, host_tokens=0))
    reply = tree.system.next_reply(5.0)
    assert isinstance(reply, SlotsInsufficient) and reply.op_id == 9
    assert tree.statistics(DEVICE) == DeviceStatistics(
        capacity_slots=16, free_slots=16, request_slots=0, tree_slots=0, loading_slots=0, live_requests=0
    )
    assert len(held) == 2


def test_replies_to_tells_go_back_to_the_sender(
    make_config: Callable[..., Config], start_system: Callable[..., Any]
) -> None:
    tree = start_system(make_config(page_size=4))
    tree.tell(HOST, AllocateHost(op_id=42, tokens=8))
    reply = tree.expect(HostAllocated)
    assert reply.op_id == 42 and reply.pages.tolist() == [0, 1]  # 8 slots: two pages of 4
    hst = tree.statistics(HOST)
    assert hst.slots_in(S.RESERVED) == 8
    tree.host_free(reply.pages)
