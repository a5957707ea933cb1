"""`HiCache`, the scheduler's facade, on the real actors and on both runtimes.

Every test plays a scheduler: admit, allocate, write fingerprint KV for the
computed positions, commit, then finish / abort / retract / cache a chunk. The
fingerprint oracle proves that what a later request reads for its cached prefix
is what was computed for it, on every tier path (device hit, host load-back).

Seed 001 (one place frees, exactly once; no allocation after finish) and the
misuse errors are here too: each misuse is a clear `RequestError` and the facade
keeps working afterwards. Each test ends with nothing live and checks that the
cache is quiet: nothing protected, nothing in flight, every device slot free or
the tree's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy
import pykka
import pytest
import torch

from hicache.actors import KVShape
from hicache.messages import LedgerEntry
from hicache.runtime import (
    CacheHandle,
    Config,
    ExpiredHandleError,
    HiCache,
    Insufficient,
    LoadFailedError,
    Request,
    RequestError,
    Room,
    WritePolicy,
)
from hicache.runtime.testing.oracle import FingerprintOracle

from conftest import FailFirstLoads, make_runtime


def seq(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


class Scheduler:
    """A HiCache and the fingerprint oracle, with the few steps a scheduler repeats."""

    def __init__(self, hc: HiCache) -> None:
        self.hc = hc
        self.oracle = FingerprintOracle(KVShape.of(hc.config))

    def compute(self, rid: str, tokens: list[int], *, extra: int = 0) -> None:
        """Allocate for the positions of `tokens` after what `rid` committed (spare slots
        first, then `extra` more it will not use yet), write their KV and commit them."""
        done = len(self.hc.committed_tokens(rid))
        new = tokens[done:]
        spare = len(self.hc.slots(rid)) - done
        need = len(new) + extra - spare
        if need > 0:
            got = self.hc.allocate({rid: need})
            assert isinstance(got, dict), got
            assert len(got[rid]) == need
        self.oracle.write(self.hc.device_kv, tokens, self.hc.slots(rid)[done : done + len(new)], start=done)
        self.hc.commit({rid: new})

    def run(self, rid: str, tokens: list[int], **kwargs: Any) -> Any:
        """Admit, then compute the rest of the prompt."""
        [res] = self.hc.admit([Request(rid, tokens)])
        self.verify(rid, tokens[: res.cached_tokens], res.device_indices)
        self.compute(rid, tokens, **kwargs)
        return res

    def verify(self, rid: str, tokens: list[int], slots: torch.Tensor) -> None:
        self.oracle.verify(self.hc.device_kv, tokens, slots)

    def settle(self, timeout_s: float = 10.0) -> Any:
        """Statistics once no write or load is in flight."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.hc.statistics()
            if stats.tree.writes_in_flight == 0 and stats.tree.loads_in_flight == 0:
                return stats
            assert time.monotonic() < deadline, f"transfers still in flight after {timeout_s}s: {stats.tree}"

    def assert_quiet(self) -> None:
        """Nothing live: nothing protected or in flight, every device slot free or the tree's."""
        assert self.hc.live_requests == ()
        stats = self.settle()
        tree, device = stats.tree, stats.device
        assert (tree.protected_tokens, tree.live_handles, tree.writes_in_flight, tree.loads_in_flight) == (0, 0, 0, 0)
        assert (device.request_slots, device.loading_slots, device.live_requests) == (0, 0, 0)
        assert device.free_slots + device.tree_slots == device.capacity_slots
        assert device.tree_slots == tree.device_tokens
        self.hc.check_invariants()


@pytest.fixture
def open_cache(runtime_kind: str, make_config: Callable[..., Config]) -> Iterator[Callable[..., Scheduler]]:
    """`open_cache(faults=None, **config_fields)`: a started HiCache on this test's runtime, closed at the end."""
    opened: list[HiCache] = []

    def open_(faults: Any = None, **fields: Any) -> Scheduler:
        hc = HiCache(make_config(**fields), runtime=make_runtime(runtime_kind, seed=7, faults=faults))
        opened.append(hc.start())
        return Scheduler(hc)

    yield open_
    for hc in opened:
        hc.close()


def _freed_once(entries: list[LedgerEntry]) -> None:
    for e in entries:
        assert e.freed == e.allocated >= e.committed, e


# == round trips ===================================================================================


def test_a_finished_prefix_is_a_device_hit_for_the_next_request(open_cache: Callable[..., Scheduler]) -> None:
    s = open_cache()
    hc = s.hc
    a = s.run("a", seq(10, 1))
    assert (a.device_hit, a.host_hit, a.host_miss, len(a.device_indices)) == (0, 0, 0, 0)
    entries = hc.finish([a.handle])
    assert [(e.request_id, e.allocated, e.committed, e.freed) for e in entries] == [("a", 10, 10, 10)]

    b = s.run("b", seq(10, 1) + seq(5, 90))
    assert (b.device_hit, b.host_hit, b.cached_tokens) == (8, 0, 8)  # the whole pages of a's 10
    s.verify("b", seq(8, 1), b.device_indices)
    s.verify("b", hc.committed_tokens("b"), hc.slots("b"))
    _freed_once(hc.finish([b.handle]))
    assert hc.statistics().tree.device_hit_tokens == 8
    s.assert_quiet()


@pytest.mark.parametrize("form", ["int64", "int32", "uint8", "strided", "numpy int64", "numpy uint16"])
def test_token_ids_in_any_integer_tensor_or_numpy_array_are_the_same_tokens_as_a_list(
    open_cache: Callable[..., Scheduler], form: str
) -> None:
    s = open_cache()
    hc = s.hc
    tokens = seq(10, 3)
    hc.finish([s.run("a", tokens).handle])
    given = {"int64": torch.tensor(tokens), "int32": torch.tensor(tokens, dtype=torch.int32),
             "uint8": torch.tensor(tokens, dtype=torch.uint8),
             "strided": torch.tensor(tokens).repeat_interleave(2)[::2],
             "numpy int64": numpy.array(tokens), "numpy uint16": numpy.array(tokens, dtype=numpy.uint16)}[form]
    assert form.startswith("numpy") or given.is_contiguous() == (form != "strided")
    [b] = hc.admit([Request("b", given)])
    assert b.cached_tokens == 8  # its whole pages
    assert hc.committed_tokens("b") == tokens[:8]
    got = hc.allocate({"b": 2})
    assert isinstance(got, dict)
    hc.commit({"b": given[8:]})
    assert hc.committed_tokens("b") == tokens
    _freed_once(hc.finish([b.handle]))
    s.assert_quiet()


def test_a_prefix_evicted_from_the_device_is_a_host_hit_loaded_back_layer_by_layer(
    open_cache: Callable[..., Scheduler],
) -> None:
    s = open_cache()
    hc = s.hc
    prompt = seq(12, 1)
    hc.finish([s.run("a", prompt).handle])
    s.settle()  # the write-through landed: the prefix is backed up
    assert hc.evict_device(12) == 12
    stats = hc.statistics()
    assert (stats.tree.device_tokens, stats.tree.host_tokens, stats.device.tree_slots) == (0, 12, 0)
    hc.device_kv.tensor.zero_()  # nothing on the device may still hold the bytes

    [b] = hc.admit([Request("b", prompt + [1, 2])])
    assert (b.device_hit, b.host_hit, b.host_miss) == (0, 12, 0)
    waiter = hc.start_loads()
    waiter.wait_all(timeout_s=30)
    s.verify("b", prompt, b.device_indices)
    s.compute("b", prompt + [1, 2])
    _freed_once(hc.finish([b.handle]))
    stats = s.settle()
    assert stats.tree.host_hit_tokens == 12 and stats.load.ops_done == 1
    s.assert_quiet()


def test_a_failed_load_back_raises_in_the_forward_pass_and_the_request_can_be_aborted(
    open_cache: Callable[..., Scheduler],
) -> None:
    faults = FailFirstLoads()
    s = open_cache(faults=faults)
    hc = s.hc
    prompt = seq(8, 1)
    hc.finish([s.run("a", prompt).handle])
    s.settle()
    hc.evict_device(8)
    [b] = hc.admit([Request("b", prompt + [5])])
    assert b.host_hit == 8
    waiter = hc.start_loads()
    with pytest.raises(LoadFailedError, match="injected: a load-back fails"):
        waiter.wait_layer(0, timeout_s=30)
    assert faults.left == 0
    hc.abort([b.handle])
    stats = s.settle()
    assert (stats.tree.host_tokens, stats.tree.device_tokens, stats.load.ops_failed) == (8, 0, 1)

    [c] = hc.admit([Request("c", prompt)])  # the host copy is intact: the next load works
    assert c.host_hit == 8
    hc.start_loads().wait_all(timeout_s=30)
    s.verify("c", prompt, c.device_indices)
    hc.abort([c.handle])
    s.assert_quiet()


def test_caching_a_chunk_over_a_failed_load_back_is_a_clear_error_and_the_actors_keep_running(
    open_cache: Callable[..., Scheduler],
) -> None:
    s = open_cache(faults=FailFirstLoads())
    hc = s.hc
    prompt = seq(8, 1)
    hc.finish([s.run("a", prompt).handle])
    s.settle()
    hc.evict_device(8)
    [b] = hc.admit([Request("b", prompt + seq(8, 40))])
    with pytest.raises(LoadFailedError):
        hc.start_loads().wait_layer(0, timeout_s=30)
    slots = hc.allocate({"b": 6})
    assert not isinstance(slots, Insufficient)
    assert isinstance(hc.allocate({"b": 1}), dict)  # from its last page: the device has not heard of it
    with pytest.raises(RequestError, match=r"^request 'b': the load-back of its 8 tokens from host memory failed"):
        hc.commit({"b": seq(7, 40)})  # KV computed over a prefix that never loaded
    with pytest.raises(RequestError, match=r"\['b'\]: the cached prefix was lost to a failed load-back.*abort or retract"):
        hc.cache_unfinished([b.handle])
    hc.check_invariants()
    [entry] = hc.retract([b.handle])  # the same handle still works: nothing changed, the slot still to send
    assert (entry.allocated, entry.committed, entry.freed) == (7, 0, 7)
    s.settle()
    s.assert_quiet()


def test_an_allocation_that_does_not_fit_evicts_the_cache_and_retries(open_cache: Callable[..., Scheduler]) -> None:
    s = open_cache(device_pages=8)  # 32 slots
    hc = s.hc
    hc.finish([s.run("a", seq(16, 1)).handle])
    s.settle()
    [b] = hc.admit([Request("b", seq(8, 100))])
    got = hc.allocate({"b": 28})  # 16 free: the tree's 16 must go
    assert isinstance(got, dict) and len(got["b"]) == 28
    assert hc.statistics().tree.evicted_device_tokens >= 12
    too_many = hc.allocate({"b": 64})
    assert isinstance(too_many, Insufficient) and too_many.shortfall_slots > 0
    assert len(hc.slots("b")) == 28  # nothing was allocated
    hc.abort([b.handle])
    s.assert_quiet()


def test_under_write_back_an_allocation_waits_for_the_write_backs_its_eviction_started(
    open_cache: Callable[..., Scheduler],
) -> None:
    s = open_cache(device_pages=8, write_policy=WritePolicy.WRITE_BACK)  # 32 slots
    hc = s.hc
    hc.finish([s.run("a", seq(16, 1)).handle])
    s.settle()
    assert hc.statistics().tree.host_tokens == 0  # write_back: nothing backed up yet
    [b] = hc.admit([Request("b", seq(8, 100))])
    got = hc.allocate({"b": 28})  # the tree's 16 must be written back, then freed
    assert isinstance(got, dict) and len(got["b"]) == 28
    stats = hc.statistics().tree
    assert stats.evicted_device_tokens >= 12 and stats.host_tokens >= 12
    hc.abort([b.handle])
    s.assert_quiet()


@pytest.mark.parametrize("tiers", [{}, {"write_policy": WritePolicy.WRITE_BACK}, {"host_tier": False}],
                         ids=["host", "write-back", "no-host"])
def test_room_is_what_statistics_reports_and_what_one_allocation_gets(
    open_cache: Callable[..., Scheduler], tiers: dict[str, Any],
) -> None:
    s = open_cache(device_pages=16, ahead_slots=8, **tiers)  # 64 slots; a decode page brings 2 more
    hc, p = s.hc, 4

    def same() -> Room:
        """`room()` once nothing is in flight, checked against `statistics()` in that state."""
        hc.quiesce()
        room, stats = hc.room(), hc.statistics()
        assert (room.free_slots, room.evictable_slots, room.ahead_slots) == (
            stats.device.free_slots, stats.tree.evictable_tokens, stats.device.ahead_slots)
        assert room.available_slots == room.free_slots + room.evictable_slots + room.ahead_slots
        return room

    assert same() == Room(64, 0, 0)
    hc.finish([s.run("a0", seq(8, 1)).handle])
    assert same() == Room(56, 8, 0)
    a = s.run("a", seq(20, 1))  # 8 hit (now locked), 12 computed
    assert same() == Room(44, 0, 0)
    assert len(hc.allocate({"a": 1})["a"]) == 1  # a decode step's new page, and two held ahead
    assert same() == Room(32, 0, 8)
    for step in range(4):  # the last page's rest, then the first page held ahead: no message
        got = hc.allocate({"a": 1}, commit={"a": [50 + step]})
        assert len(got["a"]) == 1
    room, stats = hc.room(), hc.statistics()
    assert room == Room(32, 0, 4)  # the device has not heard of the step onto a page held ahead
    assert stats.device.ahead_slots == room.ahead_slots + p
    hc.commit({"a": [54]})
    hc.finish([a.handle])  # 24 committed tokens cached, the partial page and the page ahead freed
    assert same() == Room(40, 24, 0)

    b = s.run("b", seq(8, 1) + seq(4, 900))  # locks the first 8 tokens; a demand this small gets pages ahead
    assert same() == Room(28, 16, 8)
    assert hc.evict_device(4) == 16  # the unlocked node, whole
    assert same() == Room(44, 0, 8)
    hc.finish([s.run("e", seq(8, 700)).handle])
    room = same()
    assert room == Room(36, 8, 8)

    [c] = hc.admit([Request("c", seq(4, 600))])
    short = hc.allocate({"c": room.available_slots + p})
    assert isinstance(short, Insufficient)
    assert hc.room().available_slots == room.available_slots  # it evicted and took back the pages ahead
    got = hc.allocate({"c": room.available_slots})
    assert isinstance(got, dict) and len(got["c"]) == room.available_slots
    assert same() == Room(0, 0, 0)
    hc.abort([b.handle, c.handle])
    s.assert_quiet()


# == chunked prefill =================================================================================


def test_cache_unfinished_switches_to_the_trees_slots_frees_duplicates_and_expires_the_old_handle(
    open_cache: Callable[..., Scheduler],
) -> None:
    s = open_cache()
    hc = s.hc
    prompt = seq(14, 1)
    a, b = hc.admit([Request("a", prompt), Request("b", prompt)])  # both compute the first chunk
    s.compute("a", prompt[:6])
    s.compute("b", prompt[:6])
    requests_before = hc.statistics().device.request_slots

    [a2] = hc.cache_unfinished([a.handle])
    [b2] = hc.cache_unfinished([b.handle])
    assert a2 != a.handle and b2 != b.handle
    assert hc.slots("b")[:4].tolist() == hc.slots("a")[:4].tolist()  # b reads the tree's page now
    stats = hc.statistics()
    assert stats.device.request_slots == requests_before - 8  # a's page adopted, b's duplicate freed
    assert stats.device.tree_slots == 4
    for old in (a.handle, b.handle):
        with pytest.raises(ExpiredHandleError, match=f"of request '{old.request_id}' is not its current one"):
            hc.finish([old])
    with pytest.raises(ExpiredHandleError, match="is not its current one"):
        hc.cache_unfinished([a.handle])

    s.compute("a", prompt)
    s.compute("b", prompt)
    s.verify("a", prompt, hc.slots("a"))
    s.verify("b", prompt, hc.slots("b"))
    entries = hc.finish([a2, b2])
    _freed_once(entries)
    assert [e.allocated for e in entries] == [14, 14]
    s.assert_quiet()


# == retract and abort ==============================================================================


def test_a_retracted_request_gives_everything_back_and_may_be_admitted_again(
    open_cache: Callable[..., Scheduler],
) -> None:
    s = open_cache()
    hc = s.hc
    prompt = seq(10, 1)
    a = s.run("a", prompt, extra=3)
    [entry] = hc.retract([a.handle])
    assert (entry.allocated, entry.committed, entry.freed) == (13, 10, 13)
    assert hc.statistics().device.request_slots == 0
    assert "a" not in hc.live_requests

    [again] = hc.admit([Request("a", prompt)])
    assert again.device_hit == 8  # its own committed prefix was cached
    s.verify("a", prompt[:8], again.device_indices)
    s.compute("a", prompt)
    _freed_once(hc.finish([again.handle]))
    s.assert_quiet()


def test_an_aborted_request_gives_everything_back_and_its_id_is_spent(open_cache: Callable[..., Scheduler]) -> None:
    s = open_cache()
    hc = s.hc
    a = s.run("a", seq(9, 1), extra=2)
    [entry] = hc.abort([a.handle])
    assert (entry.allocated, entry.committed, entry.freed) == (11, 9, 11)
    with pytest.raises(RequestError, match="request 'a' already aborted; it has no slots any more"):
        hc.allocate({"a": 1})
    with pytest.raises(RequestError, match="request 'a' already aborted"):
        hc.abort([a.handle])
    s.assert_quiet()


def test_a_request_may_leave_before_it_allocated_anything(open_cache: Callable[..., Scheduler]) -> None:
    s = open_cache()
    hc = s.hc
    hc.finish([s.run("a", seq(8, 1)).handle])
    hit, miss = hc.admit([Request("hit", seq(8, 1)), Request("miss", seq(8, 50))])
    assert (hit.device_hit, miss.device_hit) == (8, 0)
    entries = hc.abort([hit.handle, miss.handle])
    assert [(e.allocated, e.freed) for e in entries] == [(0, 0), (0, 0)]
    [back] = hc.admit([Request("back", seq(8, 1))])
    hc.retract([back.handle])
    s.assert_quiet()


# == seed 001: one place frees, exactly once ============================================================


def test_over_allocation_is_freed_exactly_once_at_finish(open_cache: Callable[..., Scheduler]) -> None:
    s = open_cache()
    hc = s.hc
    a = s.run("a", seq(6, 1), extra=9)  # 15 allocated, 6 committed
    for step in range(3):  # decode into the spare slots: no new allocation needed
        s.compute("a", hc.committed_tokens("a") + [100 + step])
    assert len(hc.slots("a")) == 15 and len(hc.committed_tokens("a")) == 9
    s.verify("a", hc.committed_tokens("a"), hc.slots("a")[:9])
    assert hc.statistics().device.request_slots == 16  # 4 pages
    [entry] = hc.finish([a.handle])
    assert (entry.allocated, entry.committed, entry.freed) == (15, 9, 15)
    stats = hc.statistics()
    assert stats.device.request_slots == 0
    assert stats.device.tree_slots == 8  # the two whole committed pages
    s.assert_quiet()


@pytest.mark.parametrize("leave", ["finish", "abort", "retract"])
def test_every_way_of_leaving_frees_allocated_slots_exactly_once(
    open_cache: Callable[..., Scheduler], leave: str
) -> None:
    s = open_cache()
    hc = s.hc
    prompt = seq(13, 1)
    hc.finish([s.run("warm", prompt[:8]).handle])
    a = s.run("a", prompt, extra=5)  # 8 cached, 5 computed, 5 spare
    [handle] = hc.cache_unfinished([a.handle])
    s.compute("a", prompt + seq(4, 70), extra=3)  # 4 of the 5 spare slots, then 2 more
    s.verify("a", hc.committed_tokens("a"), hc.slots("a")[:17])
    [entry] = getattr(hc, leave)([handle])
    assert (entry.allocated, entry.committed) == (12, 9)
    assert entry.freed == entry.allocated
    s.assert_quiet()


def test_allocating_for_a_finished_request_is_an_error_naming_it(open_cache: Callable[..., Scheduler]) -> None:
    s = open_cache()
    hc = s.hc
    a = s.run("a", seq(8, 1))
    hc.finish([a.handle])
    free = hc.statistics().device.free_slots
    with pytest.raises(RequestError, match="request 'a' already finished; it has no slots any more"):
        hc.allocate({"a": 4})
    with pytest.raises(RequestError, match="request 'a' already finished"):
        hc.commit({"a": [1]})
    assert hc.statistics().device.free_slots == free  # nothing was allocated
    hc.finish([s.run("b", seq(8, 1)).handle])  # still working
    s.assert_quiet()


# == misuse: clear errors, and the actors keep running ===================================================


def test_finishing_twice_is_an_error_and_the_cache_keeps_working(open_cache: Callable[..., Scheduler]) -> None:
    s = open_cache()
    hc = s.hc
    a = s.run("a", seq(8, 1))
    hc.finish([a.handle])
    with pytest.raises(RequestError, match="request 'a' already finished"):
        hc.finish([a.handle])
    b = s.run("b", seq(8, 1))
    assert b.device_hit == 8
    with pytest.raises(RequestError, match="request 'b' appears twice in one call"):
        hc.finish([b.handle, b.handle])
    _freed_once(hc.finish([b.handle]))
    s.assert_quiet()


def test_an_unknown_request_is_an_error_and_the_cache_keeps_working(open_cache: Callable[..., Scheduler]) -> None:
    s = open_cache()
    hc = s.hc
    with pytest.raises(RequestError, match="request 'ghost' is not admitted"):
        hc.allocate({"ghost": 4})
    with pytest.raises(RequestError, match="request 'ghost' is not admitted"):
        hc.commit({"ghost": [1, 2]})
    with pytest.raises(RequestError, match="request 'ghost' is not admitted"):
        hc.finish([CacheHandle("ghost", 1)])
    with pytest.raises(RequestError, match="expected a CacheHandle from admit"):
        hc.finish(["ghost"])  # type: ignore[list-item]
    hc.finish([s.run("a", seq(8, 1)).handle])
    s.assert_quiet()


def test_committing_more_than_was_allocated_is_an_error_and_nothing_is_committed(
    open_cache: Callable[..., Scheduler],
) -> None:
    s = open_cache()
    hc = s.hc
    [a] = hc.admit([Request("a", seq(8, 1))])
    hc.allocate({"a": 4})
    with pytest.raises(RequestError, match=r"request 'a': committing 5 tokens makes 5 committed but only 4 slots"):
        hc.commit({"a": seq(5, 1)})
    assert hc.committed_tokens("a") == []
    with pytest.raises(RequestError, match=r"demands\['a'\] must be in 0\.\.\d+, got -1"):
        hc.allocate({"a": -1})
    s.compute("a", seq(8, 1))
    _freed_once(hc.finish([a.handle]))
    s.assert_quiet()


def test_admitting_a_finished_request_again_is_an_error_and_the_cache_keeps_working(
    open_cache: Callable[..., Scheduler],
) -> None:
    s = open_cache()
    hc = s.hc
    hc.finish([s.run("a", seq(8, 1)).handle])
    with pytest.raises(RequestError, match="request 'a' already finished; a finished or aborted request id is never"):
        hc.admit([Request("a", seq(8, 1))])
    [b] = hc.admit([Request("b", seq(8, 1))])
    hc.abort([b.handle])
    with pytest.raises(RequestError, match="request 'b' already aborted"):
        hc.admit([Request("c", seq(4, 1)), Request("b", seq(8, 1))])
    assert hc.live_requests == ()
    hc.finish([s.run("c", seq(8, 1)).handle])
    s.assert_quiet()


def test_admitting_a_live_request_again_is_an_error(open_cache: Callable[..., Scheduler]) -> None:
    s = open_cache()
    hc = s.hc
    [a] = hc.admit([Request("a", seq(8, 1))])
    with pytest.raises(RequestError, match="request 'a' is already admitted"):
        hc.admit([Request("a", seq(8, 1))])
    with pytest.raises(RequestError, match="request 'b' is already admitted"):
        hc.admit([Request("b", seq(4, 1)), Request("b", seq(4, 1))])
    assert hc.live_requests == ("a",)
    hc.abort([a.handle])
    s.assert_quiet()


def test_a_handle_of_another_request_is_refused(open_cache: Callable[..., Scheduler]) -> None:
    s = open_cache()
    hc = s.hc
    a, b = hc.admit([Request("a", seq(8, 1)), Request("b", seq(8, 1))])
    forged = CacheHandle("b", a.handle._token)
    with pytest.raises(ExpiredHandleError, match="of request 'b' is not its current one"):
        hc.finish([forged])
    hc.abort([a.handle, b.handle])
    s.assert_quiet()


def test_no_thread_of_a_closed_cache_is_still_running(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The actors with threads of their own (the load stream, the prefetcher with its backend's
    helpers) have ended when `close` returns: a process that exits then stops no thread halfway
    through native code (which can abort it: `terminate called without an active exception`).
    Each actor thread's last lines are slowed here, so a close that did not wait would return first."""
    teardown = pykka.Actor._actor_loop_teardown

    def slow_teardown(self: Any) -> None:
        time.sleep(0.2)
        teardown(self)

    monkeypatch.setattr(pykka.Actor, "_actor_loop_teardown", slow_teardown)
    before = set(threading.enumerate())
    config = Config(layers=1, kv_heads=1, head_dim=8, page_size=4, device_slots=64, host_slots=256,
                    storage="file", storage_dir=str(tmp_path), prefetch_threshold_pages=1)
    hc = HiCache(config)
    for turn in range(2):  # a cache started again after a close: its new threads are waited for too
        hc.start()
        started = set(threading.enumerate()) - before
        assert {t.name.rsplit("-", 1)[0] for t in started} >= {"LoadStreamActor", "StoragePrefetcherActor"}
        [adm] = hc.admit([Request(f"a{turn}", list(range(1, 10)))])
        hc.allocate({f"a{turn}": 10 - adm.cached_tokens})
        hc.commit({f"a{turn}": list(range(1 + adm.cached_tokens, 11))})
        hc.finish([adm.handle])
        hc.quiesce()
        hc.close()
        assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == [], f"after close {turn + 1}"
