"""What the scheduler's thread pays per request: no page hash without storage, a decode
tick in one message, and no `Insufficient` while eviction can still free what is asked.

The last is about timing: a write-through in flight keeps its node locked, so an
allocation that needs that node's slots must wait for the write to land (and then evict
the node to host memory), not give up.
"""

from __future__ import annotations

import gc
import sys
import threading
from array import array
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy
import pytest
import torch

import hicache.actors._radix as radix_module
import hicache.actors._radix_node as node_module
from hicache.actors import NoFaults
from hicache.messages import ActorName, SlotDemand, Tokens
from hicache.messages.transfer import CopyLayer
from hicache.runtime import (
    ActorFailedError,
    Config,
    HiCache,
    Insufficient,
    LoadFailedError,
    Request,
    RequestError,
    ThreadedRuntime,
    WritePolicy,
)
from hicache.runtime.testing import DeterministicRuntime, RandomStrategy, ReferenceScheduler, SchedulerConfig
from hicache.runtime.testing._mutants import mutant
from hicache.runtime.testing.explore import synthetic_workload

from conftest import make_runtime


def seq(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


class CountingHashes:
    """Counts every page hash the tree computes, and which pages."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pages: list[tuple[int, bytes]] = []
        real = radix_module.chain_hashes

        def counted(prev: int, data: bytes, page_bytes: int) -> tuple[int, ...]:
            out = real(prev, data, page_bytes)
            for i, at in enumerate(range(0, len(data), page_bytes)):
                self.pages.append((prev if i == 0 else out[i - 1], data[at : at + page_bytes]))
            return out

        monkeypatch.setattr(radix_module, "chain_hashes", counted)
        monkeypatch.setattr(node_module, "chain_hashes", counted)  # Node.hashes and the node checks


def _serve(hc: HiCache, rid: str, tokens: list[int]) -> None:
    [adm] = hc.admit([Request(rid, tokens[:-1])])
    if adm.host_hit:
        hc.start_loads().wait_all()
    got = hc.allocate({rid: len(tokens) - adm.cached_tokens}, commit=None)
    assert isinstance(got, dict), got
    hc.commit({rid: tokens[adm.cached_tokens :]})
    hc.finish([adm.handle])


def test_a_cache_without_storage_computes_no_page_hash(
    runtime_kind: str, make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    hashes = CountingHashes(monkeypatch)
    config = make_config(device_pages=12, host_pages=48)
    with HiCache(config, runtime=make_runtime(runtime_kind)) as hc:
        for i in range(12):  # shared prefixes, splits, eviction to host, load-back
            _serve(hc, f"r{i}", seq(8, 1) + seq(4 * (1 + i % 3), 100 * (i % 4) + 50) + [7])
        hc.quiesce()
        stats = hc.statistics().tree
        assert stats.evicted_device_tokens > 0 and stats.host_hit_tokens > 0
        assert hashes.pages == []
        hc.check_invariants()


def test_with_storage_each_page_is_hashed_once(
    make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    hashes = CountingHashes(monkeypatch)
    config = make_config(device_pages=12, host_pages=48, storage="file", storage_dir=str(tmp_path))
    with HiCache(config, runtime=DeterministicRuntime(seed=3)) as hc:
        for i in range(8):  # backups of nodes that later split
            _serve(hc, f"r{i}", seq(8, 1) + seq(4 * (1 + i % 3), 100 * (i % 4) + 50) + [7])
            hc.quiesce()
        assert hc.statistics().tree.stored_tokens > 0
        hashed = list(hashes.pages)
        hc.check_invariants()  # recomputes every chain to check it: not the product's work
    assert hashed, "backups need page keys"
    assert len(hashed) == len(set(hashed)), "a page was hashed twice"


def test_a_decode_step_is_one_message_when_it_needs_a_page_and_none_when_its_last_page_has_room(
        make_config: Callable[..., Config]) -> None:
    """A tick that needs a new page is one `AllocateSlots` (its commit rides along); a tick
    whose slot is in the free part of the request's last page changes no page's owner, so the
    facade answers it itself and the device hears of it with the next message about the request
    (`allocs`, applied before the commits)."""
    sent: list[Any] = []

    def observe(receiver: ActorName, mail: Any) -> None:
        if mail.sender is ActorName.FACADE:
            sent.append(mail.message)

    with HiCache(make_config(page_size=4), runtime=make_runtime("threads", observe=observe)) as hc:
        [a] = hc.admit([Request("a", seq(8, 1))])
        assert isinstance(hc.allocate({"a": 9}), dict)  # pages of slots 0-3, 4-7 and 8-11
        sent.clear()
        ticks = [hc.allocate({"a": 1}, commit={"a": seq(9, 1)})]  # the prefill's KV, the first decode slot
        for token in range(10, 14):  # each tick: commit the token just written, allocate the next slot
            ticks.append(hc.allocate({"a": 1}, commit={"a": [token]}))
        # slots 9, 10, 11: the third page's; 12: a new page (the one message); 13: that page's
        assert [type(m).__name__ for m in sent] == ["AllocateSlots"]
        assert (sent[0].allocs, sent[0].commits, sent[0].demands) == (
            (SlotDemand(request_id="a", tokens=3),), (SlotDemand(request_id="a", tokens=12),),
            (SlotDemand(request_id="a", tokens=1),))
        assert [t["a"].tolist() for t in ticks] == [[s] for s in hc.slots("a").tolist()[9:14]]
        assert len(hc.committed_tokens("a")) == 13 and hc.allocated("a") == 14
        hc.commit({"a": [14]})
        entry = hc.finish([a.handle])[0]
        assert (sent[-1].items[0].allocs, sent[-1].items[0].commits) == (1, 2)
        assert (entry.allocated, entry.committed, entry.freed) == (14, 14, 14)


@pytest.mark.parametrize("flat", [False, True])
def test_at_page_size_one_a_decode_step_takes_a_page_held_ahead_and_asks_the_device_once_per_four(
        make_config: Callable[..., Config], flat: bool) -> None:
    """With `ahead_slots=3` at page size 1 a decode step's grant brings three pages more than
    the demand (a prefill's none), and the next three steps take them here, with no message:
    one `AllocateSlots` per four steps (each carrying the slots served since, and the commits),
    every slot the request's own."""
    sent: list[Any] = []

    def observe(receiver: ActorName, mail: Any) -> None:
        if mail.sender is ActorName.FACADE and type(mail.message).__name__ not in ("CheckInvariants", "GetStatistics"):
            sent.append(mail.message)

    config = make_config(page_size=1, device_pages=64, host_pages=128, ahead_slots=3)
    with HiCache(config, runtime=make_runtime("threads", observe=observe)) as hc:
        [a, b] = hc.admit([Request("a", seq(8, 1)), Request("b", seq(5, 90))])
        first = hc.allocate({"a": 9, "b": 6})
        assert isinstance(first, dict) and hc.statistics().device.request_slots == 9 + 6
        assert hc.statistics().device.ahead_slots == 0  # a prefill's demand takes no page ahead
        sent.clear()
        toks = {"a": seq(9, 1), "b": seq(6, 90)}
        got: dict[str, list[int]] = {"a": first["a"].tolist(), "b": first["b"].tolist()}
        for step in range(12):
            tick = hc.allocate({"a": 1, "b": 1}, commit=toks, flat=flat)
            assert not isinstance(tick, Insufficient)
            pair = tick.tolist() if flat else tick["a"].tolist() + tick["b"].tolist()
            got["a"].append(pair[0])
            got["b"].append(pair[1])
            toks = {"a": [100 + step], "b": [200 + step]}
            hc.check_invariants()
        # What step 9 brought: the device hears that steps 10-12 took it with the next message.
        assert hc.statistics().device.ahead_slots == 2 * 3
        assert [type(m).__name__ for m in sent] == ["AllocateSlots"] * 3  # steps 1, 5, 9
        assert all(m.ahead for m in sent) and sent[0].allocs == ()
        assert all(m.allocs == (SlotDemand(request_id="a", tokens=3), SlotDemand(request_id="b", tokens=3))
                   for m in sent[1:])
        assert got["a"] == hc.slots("a").tolist() and got["b"] == hc.slots("b").tolist()
        assert not set(got["a"]) & set(got["b"]) and len(set(got["a"])) == 21
        hc.commit(toks)
        entries = hc.finish([a.handle, b.handle])
        assert [(e.allocated, e.committed, e.freed) for e in entries] == [(21, 21, 21), (18, 18, 18)]
        assert hc.statistics().device.request_slots == 0
        hc.check_invariants()


def test_an_allocation_short_of_pages_takes_back_the_pages_held_ahead_and_tries_once_more(
        make_config: Callable[..., Config]) -> None:
    """Pages held ahead are the first to go when memory is short: an allocation the free pages
    cannot serve is tried once more after every request's pages ahead go back (one more
    message), and the requests that held them go on, their next step asking the device."""
    sent: list[Any] = []

    def observe(receiver: ActorName, mail: Any) -> None:
        if mail.sender is ActorName.FACADE and type(mail.message).__name__ not in ("CheckInvariants", "GetStatistics"):
            sent.append(mail.message)

    config = make_config(page_size=1, device_pages=16, ahead_slots=3, host_tier=False)
    with HiCache(config, runtime=make_runtime("threads", observe=observe)) as hc:
        [a, b] = hc.admit([Request("a", seq(4, 1)), Request("b", seq(4, 50))])
        assert isinstance(hc.allocate({"a": 4, "b": 4}), dict)
        assert isinstance(hc.allocate({"a": 1, "b": 1}, commit={"a": seq(4, 1), "b": seq(4, 50)}), dict)
        assert hc.statistics().device.free_slots == 0  # each holds 3 pages ahead
        assert isinstance(hc.allocate({"a": 1}), dict)  # a page held ahead: 2 left for "a", 3 for "b"
        [c] = hc.admit([Request("c", seq(4, 100))])
        sent.clear()
        got = hc.allocate({"c": 3})  # no page free, 5 held ahead
        assert isinstance(got, dict) and len(got["c"]) == 3
        assert [(type(m).__name__, m.trim) for m in sent] == [("AllocateSlots", ()), ("AllocateSlots", ("a", "b"))]
        assert sent[1].allocs == (SlotDemand(request_id="a", tokens=1),)  # the slot "a" took from its pages ahead
        hc.check_invariants()
        sent.clear()
        step = hc.allocate({"a": 1, "b": 1}, commit={"a": [5, 6], "b": [54]})
        assert isinstance(step, dict) and [type(m).__name__ for m in sent] == ["AllocateSlots"]
        assert step["a"].tolist() == hc.slots("a").tolist()[-1:] and step["b"].tolist() == hc.slots("b").tolist()[-1:]
        assert not set(hc.slots("c").tolist()) & set(hc.slots("a").tolist() + hc.slots("b").tolist())
        # Short even with nothing held ahead: Insufficient, and nothing changed.
        before = (hc.allocated("a"), hc.allocated("c"), hc.statistics().device.free_slots)
        assert isinstance(hc.allocate({"c": 8}), Insufficient)
        assert (hc.allocated("a"), hc.allocated("c"), hc.statistics().device.free_slots) == before
        hc.check_invariants()
        hc.commit({"c": seq(3, 100)})
        hc.finish([a.handle, b.handle, c.handle])
        assert hc.statistics().device.request_slots == 0
        hc.check_invariants()


@pytest.mark.parametrize("then", ["allocate", "finish", "abort", "retract", "cache_unfinished"])
def test_slots_served_from_a_last_page_reach_the_device_with_the_next_message_about_the_request(
        make_config: Callable[..., Config], then: str) -> None:
    """Whatever the next message about a request is (an allocation that needs a page, its
    release, a `cache_unfinished`), it carries the slots the facade served locally, and the
    device's ledger agrees with the facade's; a request left out of a tick keeps its own."""
    sent: list[Any] = []

    def observe(receiver: ActorName, mail: Any) -> None:
        if mail.sender is ActorName.FACADE and type(mail.message).__name__ not in ("CheckInvariants", "GetStatistics"):
            sent.append(mail.message)

    with HiCache(make_config(page_size=4), runtime=make_runtime("threads", observe=observe)) as hc:
        adms = {a.request_id: a for a in hc.admit([Request("a", seq(5, 1)), Request("b", seq(6, 50))])}
        assert isinstance(hc.allocate({"a": 5, "b": 6}), dict)  # a: 3 slots left in its last page; b: 2
        hc.commit({"a": seq(5, 1), "b": seq(6, 50)})
        sent.clear()
        assert isinstance(hc.allocate({"a": 2, "b": 1}), dict)  # both local
        assert isinstance(hc.allocate({"a": 1}), dict)  # a's page is full now; b keeps its slot unsent
        hc.check_invariants()
        assert sent == []
        hc.commit({"a": seq(3, 9), "b": seq(1, 9)})
        if then == "allocate":  # b needs a page: one message, carrying b's slot (a is not in it)
            got = hc.allocate({"b": 2})
            assert isinstance(got, dict) and got["b"].tolist() == hc.slots("b").tolist()[7:9]
            [m] = sent
            assert (m.allocs, m.commits) == ((SlotDemand(request_id="b", tokens=1),),
                                             (SlotDemand(request_id="b", tokens=7),))
            hc.commit({"b": seq(2, 3)})
            entries = hc.finish([adms["a"].handle, adms["b"].handle])
            assert sent[-1].items[0].allocs == 3 and sent[-1].items[1].allocs == 0
            expected = {"a": (8, 8), "b": (9, 9)}
        elif then == "cache_unfinished":
            new = {h.request_id: h for h in hc.cache_unfinished([adms["a"].handle, adms["b"].handle])}
            assert [(it.allocs, it.commits) for it in sent[-1].items] == [(3, 8), (1, 7)]
            hc.check_invariants()
            got = hc.allocate({"a": 1, "b": 1})  # a: a new page, from the device; b: its last slot, here
            assert isinstance(got, dict) and list(got) == ["a", "b"]
            assert [got[r].tolist() for r in got] == [hc.slots(r).tolist()[-1:] for r in got]
            assert sent[-1].demands == (SlotDemand(request_id="a", tokens=1),)
            hc.commit({"a": [1], "b": [2]})
            entries = hc.finish([new["a"], new["b"]])
            assert [(it.allocs, it.commits) for it in sent[-1].items] == [(0, 1), (1, 1)]
            expected = {"a": (9, 9), "b": (8, 8)}
        else:
            entries = getattr(hc, then)([adms["a"].handle, adms["b"].handle])
            assert [(it.allocs, it.commits) for it in sent[-1].items] == [(3, 8), (1, 7)]
            expected = {"a": (8, 8), "b": (7, 7)}
        assert {e.request_id: (e.allocated, e.committed) for e in entries} == expected
        assert all(e.freed == e.allocated for e in entries)
        hc.check_invariants()


def test_a_tick_sends_only_the_requests_that_need_a_page_and_stays_all_or_nothing(
        make_config: Callable[..., Config]) -> None:
    """In a tick of requests of different lengths, those whose last page has room are served
    by the facade and only the others reach the device; when the device cannot serve those,
    the tick is refused whole: no request's allocation moves."""
    sent: list[Any] = []

    def observe(receiver: ActorName, mail: Any) -> None:
        if mail.sender is ActorName.FACADE and type(mail.message).__name__ not in ("CheckInvariants", "GetStatistics"):
            sent.append(mail.message)

    with HiCache(make_config(page_size=4, device_pages=8), runtime=make_runtime("threads", observe=observe)) as hc:
        lengths = {"a": 4, "b": 5, "c": 6, "d": 7}  # a's last page is full; b, c, d have 3, 2, 1 slots left
        adms = hc.admit([Request(rid, seq(n, 10 * i)) for i, (rid, n) in enumerate(lengths.items())])
        assert isinstance(hc.allocate(dict(lengths)), dict)  # 7 of the 8 pages
        sent.clear()
        got = hc.allocate(dict.fromkeys(lengths, 2), flat=True)  # a and d need a page: one is free
        assert isinstance(got, Insufficient)
        assert {rid: hc.allocated(rid) for rid in lengths} == lengths
        assert [m.demands for m in sent] == [(SlotDemand(request_id="a", tokens=2), SlotDemand(request_id="d", tokens=2))]
        sent.clear()
        got = hc.allocate({"a": 2, "b": 2, "c": 2}, flat=True)  # only a needs the free page
        assert [m.demands for m in sent] == [(SlotDemand(request_id="a", tokens=2),)]
        assert got.tolist() == [s for rid in "abc" for s in hc.slots(rid).tolist()[lengths[rid]:]]
        hc.check_invariants()
        hc.commit({rid: seq(hc.allocated(rid), 3) for rid in lengths})
        entries = hc.finish([a.handle for a in adms])
        assert [(e.allocated, e.committed, e.freed) for e in entries] == [(6, 6, 6), (7, 7, 7), (8, 8, 8), (7, 7, 7)]
        hc.check_invariants()


def test_a_decode_tick_of_many_requests_answers_each_its_own_next_slots(make_config: Callable[..., Config]) -> None:
    """The answers of a tick are views of one tensor: each must be exactly the request's
    next positions as `slots()` lists them, across page boundaries and mixed demands."""
    with HiCache(make_config(page_size=4, device_slots=4096, host_slots=4096 + 4)) as hc:
        lengths = {f"r{i}": 3 + i for i in range(12)}
        adms = hc.admit([Request(rid, seq(n, 100 * i)) for i, (rid, n) in enumerate(lengths.items())])
        assert isinstance(hc.allocate(dict(lengths)), dict)
        hc.commit({a.request_id: seq(lengths[a.request_id], 7) for a in adms})
        for tick in range(9):
            want = {rid: 1 + (tick + i) % 3 for i, rid in enumerate(lengths)}  # one to three slots each
            before = {rid: hc.allocated(rid) for rid in want}
            got = hc.allocate(want)
            assert isinstance(got, dict) and list(got) == list(want)
            for rid, n in want.items():
                assert got[rid].tolist() == hc.slots(rid)[before[rid] : before[rid] + n].tolist()
            hc.commit({rid: seq(n, 50) for rid, n in want.items()})
        taken = [s for rid in lengths for s in hc.slots(rid).tolist()]
        assert len(taken) == len(set(taken))  # no slot handed to two requests
        hc.finish([a.handle for a in adms])
        hc.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_tick_answered_flat_is_every_requests_next_slots_in_the_order_of_its_demands(
    make_config: Callable[..., Config], page_size: int
) -> None:
    """`allocate(..., flat=True)`: one tensor, request after request in the order the demands
    name them, equal to what the per-request answers and `slots()` say; for ticks of equal
    demands (a decode tick: the per-request answers are rows of one view), mixed ones, and
    ticks large enough to be gathered rather than listed."""
    with HiCache(make_config(page_size=page_size, device_slots=8192, host_slots=8192 + 4)) as hc:
        lengths = {f"r{i}": 3 + i for i in range(12)}
        adms = hc.admit([Request(rid, seq(n, 100 * i)) for i, (rid, n) in enumerate(lengths.items())])
        assert isinstance(hc.allocate(dict(lengths)), dict)
        hc.commit({a.request_id: seq(lengths[a.request_id], 7) for a in adms})
        order = list(lengths)
        for tick in range(12):
            order = order[5:] + order[:5]  # demands named in another order each tick
            n_each = [1, 2, 40][tick % 3]  # equal demands; 12 x 40 slots are gathered, not listed
            want = {rid: n_each if tick % 2 else n_each + i % 2 for i, rid in enumerate(order)}
            before = {rid: hc.allocated(rid) for rid in want}
            flat = tick % 4 < 2
            got = hc.allocate(want, commit={rid: [5] for rid in want} if tick else None, flat=flat)
            expected = [hc.slots(rid)[before[rid] : before[rid] + n].tolist() for rid, n in want.items()]
            if flat:
                assert isinstance(got, torch.Tensor) and got.dtype == torch.int64
                assert got.tolist() == [s for slots in expected for s in slots]
            else:
                assert isinstance(got, dict) and list(got) == list(want)
                assert [got[rid].tolist() for rid in want] == expected
            hc.commit({rid: seq(n - (1 if tick < 11 else 0), 50) for rid, n in want.items() if n > 1})
        taken = [s for rid in lengths for s in hc.slots(rid).tolist()]
        assert len(taken) == len(set(taken))  # no slot handed to two requests
        empty = hc.allocate({}, flat=True)
        assert isinstance(empty, torch.Tensor) and empty.dtype == torch.int64 and not len(empty)
        short = hc.allocate({"r0": 10**6}, flat=True)
        assert isinstance(short, Insufficient)
        with pytest.raises(RequestError, match="flat must be True or False"):
            hc.allocate({"r0": 1}, flat=1)  # type: ignore[call-overload]
        hc.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_long_decode_keeps_no_object_per_step_and_its_request_stays_whole(
    make_config: Callable[..., Config], page_size: int
) -> None:
    """Each decode step's token and (at page size 1, every step; else one step in a page) its
    new page join the request's record in place: 8 requests x 600 steps leave no object per
    step behind for the garbage collector's full passes to walk (before, a long decode of a
    large batch stalled the scheduler's thread for 150 ms at a time). What the request holds
    stays exact through it all: its tokens, its slots, a `cache_unfinished` midway and its
    finish, whose tokens the next request then hits."""
    with HiCache(make_config(page_size=page_size, device_slots=8192, host_slots=8192 + 4)) as hc:
        prompts = {f"r{i}": seq(9 + i, 1000 * i) for i in range(8)}
        hc.admit([Request(rid, t) for rid, t in prompts.items()])
        assert isinstance(hc.allocate({rid: len(t) for rid, t in prompts.items()}), dict)
        hc.commit(prompts)
        tokens = {rid: list(t) for rid, t in prompts.items()}
        slots = {rid: array("q", hc.slots(rid).tolist()) for rid in prompts}  # no int object a slot
        commit: dict[str, list[int]] | None = None

        def steps(k: int, first: int) -> None:
            nonlocal commit
            for step in range(first, first + k):
                got = hc.allocate(dict.fromkeys(prompts, 1), commit=commit, flat=True)
                assert isinstance(got, torch.Tensor)
                for rid, slot in zip(prompts, got.tolist(), strict=True):
                    slots[rid].append(slot)
                commit = {rid: [7 + (step + i) % 50] for i, rid in enumerate(prompts)}
                for rid, t in commit.items():
                    tokens[rid].append(t[0])

        steps(20, 0)  # the record's pieces are made; then they only grow
        gc.collect()
        before = sys.getallocatedblocks()
        steps(600, 20)
        gc.collect()
        grown = sys.getallocatedblocks() - before
        assert grown < 600, f"{grown} memory blocks more after 600 steps of 8 requests"
        hc.commit(commit or {})
        hc.check_invariants()
        for rid in prompts:
            assert hc.committed_tokens(rid) == tokens[rid]
            assert hc.slots(rid).tolist() == slots[rid].tolist()
        hc.cache_unfinished([hc.handle("r0")])  # midway: the tree takes what r0 committed
        commit = None
        steps(30, 620)
        hc.commit(commit or {})
        assert hc.committed_tokens("r3") == tokens["r3"] and hc.slots("r3").tolist() == slots["r3"].tolist()
        hc.finish([hc.handle(rid) for rid in prompts])
        hc.check_invariants()
        [again] = hc.admit([Request("again", tokens["r5"] + [1])])
        assert again.cached_tokens == len(tokens["r5"]) // page_size * page_size
        hc.finish([again.handle])
        hc.check_invariants()


def test_a_finish_and_a_cache_unfinished_send_only_what_follows_the_cached_prefix(
    make_config: Callable[..., Config],
) -> None:
    """The tree has the prefix a handle locks: the items carry the tokens and pages after it,
    and what gets cached is still the whole sequence."""
    items: list[Any] = []

    def observe(receiver: ActorName, mail: Any) -> None:
        if mail.sender is ActorName.FACADE and hasattr(mail.message, "items") and receiver is ActorName.TREE:
            items.extend(mail.message.items)

    config = make_config()
    p = config.page_size
    with HiCache(config, runtime=make_runtime("threads", observe=observe)) as hc:
        _serve(hc, "a", seq(2 * p, 1) + [99])  # two pages cached
        prompt = seq(2 * p, 1) + seq(3 * p, 500)
        [b] = hc.admit([Request("b", prompt)])
        assert b.cached_tokens == 2 * p
        got = hc.allocate({"b": 3 * p + 1})
        assert isinstance(got, dict)
        hc.commit({"b": prompt[2 * p : 3 * p]})  # one chunk of the prefill
        items.clear()
        [b2] = hc.cache_unfinished([b.handle])
        [cached] = [it for it in items if type(it).__name__ == "CacheItem"]
        assert cached.tokens.tolist() == prompt[2 * p : 3 * p] and len(cached.device) == 1
        hc.commit({"b": prompt[3 * p :] + [7]})
        items.clear()
        hc.finish([b2])
        [done] = [it for it in items if type(it).__name__ == "FinishItem"]
        assert done.tokens.tolist() == prompt[3 * p :] + [7]  # after the 3 pages cache_unfinished cached
        assert len(done.device) == 3  # 2 whole pages and the partly committed last one
        [c] = hc.admit([Request("c", prompt + [7] + seq(p, 900))])
        assert c.cached_tokens == 5 * p  # the whole of b's page-aligned sequence is in the tree
        hc.finish([c.handle])
        hc.check_invariants()


def test_an_allocation_that_needs_an_eviction_is_one_message_from_the_facade(
    make_config: Callable[..., Config], runtime_kind: str
) -> None:
    """The device has the tree evict and tries again itself: no Insufficient, no EvictDevice
    and no second AllocateSlots from the facade."""
    sent: list[tuple[str, str]] = []

    def observe(receiver: ActorName, mail: Any) -> None:
        sent.append((mail.sender.value, type(mail.message).__name__))

    config = make_config(device_pages=12, host_pages=48)
    with HiCache(config, runtime=make_runtime(runtime_kind, observe=observe)) as hc:
        for i in range(3):  # 3 x 3 pages cached: 3 pages free
            _serve(hc, f"r{i}", seq(12, 100 * i + 1) + [7])
        hc.quiesce()
        [b] = hc.admit([Request("b", seq(20, 1000))])
        sent.clear()
        got = hc.allocate({"b": 20})  # 5 pages: 2 short
        assert isinstance(got, dict) and len(got["b"]) == 20
        from_facade = [name for sender, name in sent if sender == "facade"]
        assert from_facade == ["AllocateSlots"]
        assert ("device", "EvictForAllocation") in sent and ("tree", "Evicted") in sent
        assert hc.statistics().tree.evicted_device_tokens >= 8
        hc.check_invariants()
        hc.finish([b.handle])
        hc.check_invariants()


def test_a_commit_sends_nothing_and_the_next_message_about_the_request_carries_it(
    make_config: Callable[..., Config]
) -> None:
    sent: list[tuple[str, Any]] = []

    def observe(receiver: ActorName, mail: Any) -> None:
        if mail.sender is ActorName.FACADE or receiver is ActorName.DEVICE:
            sent.append((type(mail.message).__name__, mail.message))

    page = make_config().page_size
    with HiCache(make_config(), runtime=make_runtime("threads", observe=observe)) as hc:
        [a] = hc.admit([Request("a", seq(3 * page, 1))])
        assert isinstance(hc.allocate({"a": 3 * page}), dict)
        sent.clear()
        hc.commit({"a": seq(2 * page, 1)})  # a prefill chunk
        assert sent == []
        [a_handle] = hc.cache_unfinished([a.handle])  # the swap carries the chunk's commits
        [swap] = [m for name, m in sent if name == "SwapRequestPages"]
        assert swap.commits == 2 * page
        hc.check_invariants()
        sent.clear()
        hc.commit({"a": seq(page, 2 * page + 1)})
        got = hc.allocate({"a": 1})  # the allocation carries the last chunk's commits
        assert isinstance(got, dict)
        [alloc] = [m for name, m in sent if name == "AllocateSlots"]
        assert [(d.request_id, d.tokens) for d in alloc.commits] == [("a", page)]
        hc.commit({"a": [7]})
        sent.clear()
        entry = hc.finish([a_handle])[0]
        [release] = [m for name, m in sent if name == "ReleaseRequests"]
        assert [(r.request_id, r.commits) for r in release.releases] == [("a", 1)]
        assert (entry.allocated, entry.committed, entry.freed) == (3 * page + 1,) * 3
        hc.check_invariants()


def test_a_reference_scheduler_decode_tick_is_one_message(make_config: Callable[..., Config]) -> None:
    per_tick: list[list[str]] = [[]]

    def observe(receiver: ActorName, mail: Any) -> None:
        if mail.sender is ActorName.FACADE:
            per_tick[-1].append(type(mail.message).__name__)

    config = make_config(device_pages=64, host_pages=128)
    with HiCache(config, runtime=make_runtime("threads", observe=observe)) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(max_running=4, seed=1))
        work = synthetic_workload(5, 3, config.page_size, outputs_max=1)
        sched.submit([w.__class__(w.request_id, w.prompt, 6) for w in work])  # 6 outputs each: decode ticks
        sched.run(on_tick=lambda _: per_tick.append([]))
        decode_only = [t for t in per_tick if t and "AdmitRequests" not in t and "FinishRequests" not in t]
        assert decode_only, per_tick
        assert all(t == ["AllocateSlots"] for t in decode_only), decode_only
        hc.check_invariants()


@pytest.mark.parametrize("policy", list(WritePolicy))
@pytest.mark.parametrize("seed", range(6))
def test_no_allocation_is_insufficient_while_eviction_can_free_it(
    make_config: Callable[..., Config], policy: WritePolicy, seed: int
) -> None:
    """One request at a time on a pool it nearly fills: what earlier requests left is
    unlocked, or locked only by a write to host in flight, so every allocation fits."""
    config = make_config(device_pages=16, host_pages=64, write_policy=policy)
    runtime = DeterministicRuntime(seed=seed, strategy=RandomStrategy(seed))
    with HiCache(config, runtime=runtime) as hc:
        for i in range(10):
            prompt = seq(4 * (2 + (i * 5 + seed) % 12), 1000 * i)
            [adm] = hc.admit([Request(f"r{i}", prompt)])
            got = hc.allocate({f"r{i}": len(prompt) - adm.cached_tokens})
            assert not isinstance(got, Insufficient), (i, got, hc.statistics().tree)
            hc.commit({f"r{i}": prompt[adm.cached_tokens :]})
            hc.finish([adm.handle])
            hc.check_invariants()


def test_an_eviction_that_gives_up_after_one_round_is_what_that_test_catches(
    make_config: Callable[..., Config],
) -> None:
    """The same requests with the eviction that does not wait for writes in flight (a mutant
    of the tree): some allocation comes back `Insufficient`, or the tree's invariant that an
    eviction goes on while anything is evictable fails."""
    short = 0
    for seed in range(6):
        config = make_config(device_pages=16, host_pages=64, write_policy=WritePolicy.WRITE_THROUGH)
        runtime = DeterministicRuntime(seed=seed, strategy=RandomStrategy(seed))
        with HiCache(config, runtime=runtime, actor_classes=mutant("eviction-ends-short").actor_classes) as hc:
            try:
                for i in range(10):
                    prompt = seq(4 * (2 + (i * 5 + seed) % 12), 1000 * i)
                    [adm] = hc.admit([Request(f"r{i}", prompt)])
                    if isinstance(hc.allocate({f"r{i}": len(prompt) - adm.cached_tokens}), Insufficient):
                        short += 1
                        break
                    hc.commit({f"r{i}": prompt[adm.cached_tokens :]})
                    hc.finish([adm.handle])
            except Exception:  # noqa: BLE001 - the tree's invariant caught the short eviction
                short += 1
    assert short > 0


def _load_then_leave(hc: HiCache, seed: int, *, start: bool) -> int:
    """A prompt cached in host memory only, admitted again (its load-back queued, and started if
    `start`), then retracted before the load lands: that load's 12 pages of the 16 will be
    evictable, and no others are. Returns the tokens of a new prompt that needs them."""
    first = seq(48, 10_000)
    _serve(hc, "a", first)
    hc.quiesce()  # written through
    hc.evict_device(hc.config.device_slots)
    [adm] = hc.admit([Request("again", first + [7])])
    assert adm.host_hit == 48, adm
    if start:
        hc.start_loads()  # not waited for: the load is in flight
    hc.retract([adm.handle])
    return 56 + 4 * (seed % 2)


class Last:
    """A schedule in which `actor` handles its mail only when no other actor has any: a load
    (or a write) it started is still in flight when the calls after it run."""

    def __init__(self, actor: ActorName) -> None:
        self.actor = actor.value
        self.name = f"{self.actor}-last"

    def choose(self, step: int, choices: Sequence[str]) -> str:
        others = [c for c in choices if c != self.actor]
        return others[0] if others else choices[0]


@pytest.mark.parametrize("seed", [None, *range(4)], ids=["loads-last", *(f"random-{s}" for s in range(4))])
def test_an_allocation_waits_for_the_started_load_of_a_request_that_ended(
        make_config: Callable[..., Config], seed: int | None) -> None:
    """Memory a retracted request's started load-back holds is evictable once it lands: an
    allocation that needs it waits for that load instead of answering `Insufficient` (which
    made the reference scheduler retract, or give up on a request that would fit)."""
    config = make_config(device_pages=16, host_pages=64)
    strategy = Last(ActorName.LOAD) if seed is None else RandomStrategy(seed)
    seed = seed or 0
    with HiCache(config, runtime=DeterministicRuntime(seed=seed, strategy=strategy)) as hc:
        n = _load_then_leave(hc, seed, start=True)
        [adm] = hc.admit([Request("b", seq(n, 50_000))])
        got = hc.allocate({"b": n})
        assert not isinstance(got, Insufficient), (got, hc.statistics().tree)
        hc.commit({"b": seq(n, 50_000)})
        hc.finish([adm.handle])
        hc.check_invariants()


def test_an_eviction_that_does_not_wait_for_loads_is_what_that_test_catches(
        make_config: Callable[..., Config]) -> None:
    """The same, loads last, with the eviction that waits for writes but not for loads (a
    mutant of the tree): the tree's check stops it when it ends short."""
    config = make_config(device_pages=16, host_pages=64)
    runtime = DeterministicRuntime(seed=0, strategy=Last(ActorName.LOAD))
    with HiCache(config, runtime=runtime, actor_classes=mutant("eviction-skips-loads").actor_classes) as hc:
        n = _load_then_leave(hc, 0, start=True)
        hc.admit([Request("b", seq(n, 50_000))])
        with pytest.raises(ActorFailedError, match=r"ended with 0 freed while started load-backs \[\d+\], which"):
            hc.allocate({"b": n})


def test_an_allocation_does_not_wait_for_a_load_nobody_started(make_config: Callable[..., Config]) -> None:
    """A queued load-back lands only after the next `start_loads`: an allocation that would need
    its memory answers `Insufficient` at once instead of waiting for it, and fits once it landed."""
    config = make_config(device_pages=16, host_pages=64)
    with HiCache(config, runtime=DeterministicRuntime(seed=0)) as hc:
        n = _load_then_leave(hc, 0, start=False)
        [adm] = hc.admit([Request("b", seq(n, 50_000))])
        assert isinstance(hc.allocate({"b": n}), Insufficient)
        hc.start_loads().wait_all()
        got = hc.allocate({"b": n})
        assert not isinstance(got, Insufficient), got
        hc.finish([adm.handle])
        hc.check_invariants()


def test_an_allocation_waits_for_a_write_whose_upper_node_a_request_holds(make_config: Callable[..., Config]) -> None:
    """A request matches the first 8 of 48 tokens whose write-through is in flight: the node
    splits and the request locks the upper part. Once the write lands the lower 40 tokens are
    evictable, so an allocation that needs them waits for it (it was refused: the tree waited
    only for writes whose every node the write alone locked)."""
    config = make_config(device_pages=16, host_pages=64)
    with HiCache(config, runtime=DeterministicRuntime(seed=0, strategy=Last(ActorName.WRITE))) as hc:
        a = seq(48, 1000)
        [adm] = hc.admit([Request("a", a[:-1])])
        hc.allocate({"a": 48})
        hc.commit({"a": a})
        hc.finish([adm.handle])
        assert hc.statistics().tree.writes_in_flight == 1
        b = a[:8] + seq(40, 5000)
        [adm] = hc.admit([Request("b", b[:-1])])
        assert adm.cached_tokens == 8 and hc.statistics().tree.evictable_tokens == 0
        got = hc.allocate({"b": len(b) - 8})
        assert not isinstance(got, Insufficient), got
        hc.commit({"b": b[8:]})
        hc.finish([adm.handle])
        hc.check_invariants()


def _prefix_in_host_memory_only(hc: HiCache, oracle: Any, n: int = 48) -> list[int]:
    """`n` tokens served with fingerprint KV, written through, evicted from the device, and the
    device zeroed: whatever a later request reads there comes from a load-back."""
    tokens = seq(n, 10_000)
    [adm] = hc.admit([Request("a", tokens[:-1])])
    oracle.write(hc.device_kv, tokens, hc.allocate({"a": n})["a"])
    hc.commit({"a": tokens})
    hc.finish([adm.handle])
    hc.quiesce()
    hc.evict_device(hc.config.device_slots)
    hc.device_kv.tensor.zero_()
    return tokens


def _two_prefixes_in_host_memory_only(hc: HiCache, oracle: Any) -> tuple[list[int], list[int]]:
    """Two prefixes of 16 tokens as `_prefix_in_host_memory_only` makes one, each written
    through on its own (the write queue may hold one operation: a second would be refused)."""
    first, second = seq(16, 10_000), seq(16, 20_000)
    for rid, tokens in (("a", first), ("b", second)):
        [adm] = hc.admit([Request(rid, tokens[:-1])])
        oracle.write(hc.device_kv, tokens, hc.allocate({rid: 16})[rid])
        hc.commit({rid: tokens})
        hc.finish([adm.handle])
        hc.quiesce()
    hc.evict_device(hc.config.device_slots)
    hc.device_kv.tensor.zero_()
    return first, second


def test_a_prefix_whose_load_was_never_started_is_a_host_hit_for_the_next_request(
        make_config: Callable[..., Config], oracle_for: Callable[[Config], Any]) -> None:
    """A request admitted with a load-back leaves before `start_loads` (an engine drops it before
    its forward pass). The next request on that prefix must be told it is a host hit, so that
    it starts the load and waits for it; counted as a device hit, it read zeros."""
    config = make_config(device_pages=16, host_pages=64)
    oracle = oracle_for(config)
    with HiCache(config) as hc:
        tokens = _prefix_in_host_memory_only(hc, oracle)
        [b] = hc.admit([Request("b", tokens + [7])])
        assert (b.device_hit, b.host_hit) == (0, 48)
        hc.abort([b.handle])
        [c] = hc.admit([Request("c", tokens + [8])])
        assert (c.device_hit, c.host_hit) == (0, 48)
        hc.start_loads().wait_all(timeout_s=30)
        oracle.verify(hc.device_kv, tokens, c.device_indices)
        hc.finish([c.handle])
        hc.check_invariants()


@pytest.mark.parametrize("kind", ["threads", "deterministic"])
@pytest.mark.parametrize("quiesce", [False, True], ids=["start-loads", "quiesce-first"])
def test_a_host_hit_whose_load_the_stream_refused_fails_the_batch_the_next_start_makes(
        make_config: Callable[..., Config], oracle_for: Callable[[Config], Any], kind: str, quiesce: bool) -> None:
    """A load the stream refuses (its queue full: a load of a request that left before
    `start_loads` holds the one place) comes after its admission answered a host hit. The
    waiter `start_loads` gives must fail, or the forward pass reads slots nothing loaded.
    With a `quiesce()` between the admission and `start_loads`, the quiesce starts the queued
    loads in a batch of its own, the one the facade gives the requests admitted since: that
    batch must fail too. It used to land (the refusal waited for the next batch a forward
    pass waits on), so the commit of the request whose load was refused was taken over slots
    nothing loaded."""
    config = make_config(device_pages=16, host_pages=64, transfer_queue_ops_max=1)
    oracle = oracle_for(config)
    with HiCache(config, runtime=make_runtime(kind, seed=3)) as hc:
        first, second = _two_prefixes_in_host_memory_only(hc, oracle)
        [x] = hc.admit([Request("x", first + [7])])
        hc.abort([x.handle])  # gone before its forward pass: its load stays queued
        [y] = hc.admit([Request("y", second + [7])])
        assert y.host_hit == 16 and hc.statistics().load.ops_failed == 1  # y's load refused
        if quiesce:
            hc.quiesce()
            assert isinstance(got := hc.allocate({"y": 1}), dict)
            oracle.write(hc.device_kv, second + [7], got["y"], start=16)
            with pytest.raises(RequestError, match="request 'y': the load-back of its 16 tokens from host memory "
                                                   "failed .*load .* was refused"):
                hc.commit({"y": second[16:] + [7]})
        with pytest.raises(LoadFailedError, match="load .* was refused"):
            hc.start_loads().wait_all(timeout_s=30)
        hc.retract([y.handle])
        hc.check_invariants()
        [y] = hc.admit([Request("y", second + [7])])  # admitted again: this time it loads
        assert y.host_hit == 16
        hc.start_loads().wait_all(timeout_s=30)
        oracle.verify(hc.device_kv, second, y.device_indices)
        hc.finish([y.handle])
        hc.check_invariants()


@pytest.mark.parametrize("kind", ["threads", "deterministic"])
def test_a_host_hit_whose_load_a_quiesce_started_and_which_failed_fails_the_forward_pass(
        make_config: Callable[..., Config], oracle_for: Callable[[Config], Any], kind: str) -> None:
    """`quiesce()` between an admission and `start_loads` starts the admitted load-back, and
    nobody waits on that batch. When it failed, `start_loads` used to give a waiter that waited
    for nothing, and the forward pass read zeros where the prefix's KV belonged."""
    config = make_config(device_pages=16, host_pages=64)
    oracle = oracle_for(config)
    faults = _FailLoads()
    with HiCache(config, runtime=make_runtime(kind, seed=3, faults=faults)) as hc:
        tokens = _prefix_in_host_memory_only(hc, oracle, 16)
        [y] = hc.admit([Request("y", tokens + [7])])
        assert y.host_hit == 16
        faults.on = True
        hc.quiesce()  # starts y's load-back, which fails
        faults.on = False
        with pytest.raises(LoadFailedError, match="which no forward pass waited on, failed: injected load failure"):
            hc.start_loads().wait_all(timeout_s=30)
        hc.retract([y.handle])
        hc.check_invariants()
        [y] = hc.admit([Request("y", tokens + [7])])  # host memory still holds the prefix: it loads now
        assert y.host_hit == 16
        hc.start_loads().wait_all(timeout_s=30)
        oracle.verify(hc.device_kv, tokens, y.device_indices)
        hc.finish([y.handle])
        hc.check_invariants()


class _FailFirstLoadBatch(NoFaults):
    """The first batch of the load stream fails; every other copy lands."""

    def __init__(self) -> None:
        self.batches = 0

    def transfer_fault(self, stream: ActorName, op_ids: tuple[int, ...]) -> str | None:
        if stream is ActorName.LOAD:
            self.batches += 1
            return "injected failure of the first load batch" if self.batches == 1 else None
        return None


@pytest.mark.parametrize("own_load", [True, False], ids=["own-load", "nothing-queued"])
def test_a_request_admitted_while_an_earlier_load_back_runs_fails_when_that_load_fails(
        make_config: Callable[..., Config], oracle_for: Callable[[Config], Any], gate: Any, own_load: bool) -> None:
    """An engine that schedules the next batch while a forward pass runs admits y while x's
    load-back is in flight: y's prefix is partly x's loading pages, a host hit. When x's batch
    fails, y's waiter must fail too, whether y queued a load of its own (the rest of its
    prefix: that batch lands, but under a prefix that is not in device memory, so the tree
    gives it back) or had nothing to queue (its `start_loads` has no batch in flight to hand
    out). y used to get a waiter that landed and have its commit taken, its prefix zeros; with
    a load of its own, the tree then held device pages under a host-only node."""
    config = make_config(device_pages=16, host_pages=64)
    oracle = oracle_for(config)
    with HiCache(config, runtime=make_runtime("threads", seed=3, faults=_FailFirstLoadBatch(), observe=gate)) as hc:
        tokens = _prefix_in_host_memory_only(hc, oracle)
        gate.hold(ActorName.LOAD, lambda m: isinstance(m, CopyLayer))  # x's batch waits for y's admission
        [x] = hc.admit([Request("x", tokens[:16] + [7])])
        assert x.host_hit == 16
        x_loads = hc.start_loads()
        y_tokens = tokens if own_load else tokens[:16]
        [y] = hc.admit([Request("y", y_tokens + [8])])
        assert (y.device_hit, y.host_hit) == (0, len(y_tokens))
        gate.open()
        with pytest.raises(LoadFailedError, match="injected failure of the first load batch"):
            x_loads.wait_all(timeout_s=30)
        y_loads = hc.start_loads()
        with pytest.raises(LoadFailedError, match="injected failure of the first load batch"):
            y_loads.wait_all(timeout_s=30)
        got = hc.allocate({"y": 1})
        assert isinstance(got, dict)
        with pytest.raises(RequestError, match="request 'y': the load-back of its .* tokens from host memory failed"):
            hc.commit({"y": [8]})
        hc.retract([x.handle, y.handle])
        hc.check_invariants()
        [y] = hc.admit([Request("y", y_tokens + [8])])  # host memory still holds the prefix: it loads now
        assert y.host_hit == len(y_tokens)
        hc.start_loads().wait_all(timeout_s=30)
        oracle.verify(hc.device_kv, y_tokens, y.device_indices)
        hc.finish([y.handle])
        hc.check_invariants()


class _FailLoads(NoFaults):
    """Copies of the load stream fail once `on`; writes never do."""

    def __init__(self) -> None:
        self.on = False

    def transfer_fault(self, stream: ActorName, op_ids: tuple[int, ...]) -> str | None:
        return "injected load failure" if self.on and stream is ActorName.LOAD else None


@pytest.mark.parametrize("kind", ["threads", "deterministic"])
def test_a_request_caching_a_prefix_whose_load_has_not_landed_keeps_its_own_kv(
        make_config: Callable[..., Config], oracle_for: Callable[[Config], Any], kind: str) -> None:
    """Request y computed a prefix P itself while P went to host memory, and another request's
    load-back of P is queued (that request left before `start_loads`). y's `cache_unfinished`
    used to take the loading pages as P's and free y's own: y then read pages nothing had
    loaded, and its further tokens hung under a node whose load could still fail."""
    config = make_config(device_pages=16, host_pages=64)
    oracle = oracle_for(config)
    faults = _FailLoads()
    with HiCache(config, runtime=make_runtime(kind, seed=5, faults=faults)) as hc:
        prefix, more = seq(16, 10_000), seq(16, 30_000)
        [adm] = hc.admit([Request("y", prefix + more + [8])])  # nothing cached yet: y computes P
        y = adm.handle
        y_slots = hc.allocate({"y": 32})["y"]
        hc.commit({"y": prefix + more})
        [a] = hc.admit([Request("a", prefix + [9])])
        oracle.write(hc.device_kv, prefix, hc.allocate({"a": 17})["a"][:16])
        hc.commit({"a": prefix + [9]})
        hc.finish([a.handle])
        hc.quiesce()
        hc.evict_device(hc.config.device_slots)  # P is in host memory only; y's pages are its own
        hc.device_kv.tensor.zero_()
        oracle.write(hc.device_kv, prefix + more, y_slots)
        [x] = hc.admit([Request("x", prefix + [7])])
        assert x.host_hit == 16
        hc.abort([x.handle])  # its load stays queued: P is loading
        [y] = hc.cache_unfinished([y])
        oracle.verify(hc.device_kv, prefix + more, hc.slots("y")[:32])
        hc.check_invariants()
        faults.on = True
        hc.quiesce()  # starts the queued load, which fails: P is in host memory only again
        hc.check_invariants()
        faults.on = False
        oracle.verify(hc.device_kv, prefix + more, hc.slots("y")[:32])
        [y] = hc.cache_unfinished([y])  # now P is cached from y's pages (revived), and the rest too
        oracle.verify(hc.device_kv, prefix + more, hc.slots("y")[:32])
        hc.finish([y])
        hc.check_invariants()
        [z] = hc.admit([Request("z", prefix + more + [1])])
        assert z.device_hit == 32
        oracle.verify(hc.device_kv, prefix + more, z.device_indices)
        hc.finish([z.handle])
        hc.check_invariants()


def test_start_loads_with_nothing_queued_answers_the_waiter_of_the_batch_in_flight(
        make_config: Callable[..., Config], oracle_for: Callable[[Config], Any]) -> None:
    """The same with the load started, still in flight (loads last), when the next request is
    admitted: its `start_loads` has nothing to queue, so it must wait on that batch."""
    config = make_config(device_pages=16, host_pages=64)
    oracle = oracle_for(config)
    with HiCache(config, runtime=DeterministicRuntime(seed=0, strategy=Last(ActorName.LOAD))) as hc:
        tokens = _prefix_in_host_memory_only(hc, oracle)
        [b] = hc.admit([Request("b", tokens + [7])])
        first = hc.start_loads()
        hc.abort([b.handle])
        [c] = hc.admit([Request("c", tokens + [8])])
        assert (c.device_hit, c.host_hit) == (0, 48)
        waiter = hc.start_loads()
        waiter.wait_all(timeout_s=30)
        oracle.verify(hc.device_kv, tokens, c.device_indices)  # zeros, had it not waited
        assert waiter.batch == first.batch > 0
        hc.finish([c.handle])
        hc.check_invariants()


@pytest.mark.parametrize("close", [False, True], ids=["quiesce", "close"])
def test_quiesce_and_close_start_the_loads_of_requests_that_left_before_start_loads(
        make_config: Callable[..., Config], oracle_for: Callable[[Config], Any], close: bool) -> None:
    """A load nobody started would never land: `quiesce` timed out on it and `close` waited for
    its whole drain timeout. Both start it first."""
    config = make_config(device_pages=16, host_pages=64)
    hc = HiCache(config).start()
    try:
        tokens = _prefix_in_host_memory_only(hc, oracle_for(config))
        [b] = hc.admit([Request("b", tokens + [7])])
        hc.abort([b.handle])
        assert hc.statistics().tree.loads_in_flight == 1
        if close:
            assert hc.close(timeout_s=5).drained
            return
        hc.quiesce(timeout_s=5)
        assert hc.statistics().tree.loads_in_flight == 0
        hc.check_invariants()
    finally:
        hc.close()


@pytest.mark.parametrize("write_stream_thread", [None, True])
def test_on_cpu_a_write_through_is_copied_within_the_call_that_starts_it_unless_the_stream_has_a_thread(
    make_config: Callable[..., Config], write_stream_thread: bool | None
) -> None:
    """On a CPU device the write stream runs on the executor by default: the finish that
    starts a write-through returns with the pages in host memory (no wait, no other thread).
    With a thread of its own (as on CUDA) its copies run there."""
    threads: set[int] = set()

    def observe(receiver: ActorName, mail: Any) -> None:
        if receiver is ActorName.WRITE:
            threads.add(threading.get_ident())

    config = make_config(device_pages=16, host_pages=64, write_policy=WritePolicy.WRITE_THROUGH)
    runtime = ThreadedRuntime(observe=observe, write_stream_thread=write_stream_thread)
    with HiCache(config, runtime=runtime) as hc:
        _serve(hc, "a", seq(12, 1) + [7])
        if write_stream_thread is None:
            assert threads == {threading.get_ident()}
            stats = hc.statistics()  # written and acknowledged before finish returned
            assert (stats.tree.writes_in_flight, stats.write.ops_done, stats.tree.host_tokens) == (0, 1, 12)
        else:
            hc.quiesce()
            assert threads and threading.get_ident() not in threads
            stats = hc.statistics()
            assert (stats.tree.writes_in_flight, stats.write.ops_done, stats.tree.host_tokens) == (0, 1, 12)
        hc.check_invariants()


def test_the_write_stream_cannot_be_put_on_the_executor_on_cuda() -> None:
    cuda = {"device_kv": SimpleNamespace(device=SimpleNamespace(type="cuda"))}
    with pytest.raises(ValueError, match="write_stream_thread=False needs a CPU device"):
        ThreadedRuntime(write_stream_thread=False)._write_thread(cuda)
    assert ThreadedRuntime()._write_thread(cuda) is True
    cpu = {"device_kv": SimpleNamespace(device=SimpleNamespace(type="cpu"))}
    assert ThreadedRuntime()._write_thread(cpu) is False
    assert ThreadedRuntime(write_stream_thread=True)._write_thread(cpu) is True
    for bad in ("no", 1, 0):
        with pytest.raises(TypeError, match="write_stream_thread must be None, True or False"):
            ThreadedRuntime(write_stream_thread=bad)  # type: ignore[arg-type]


def _ids(form: str, values: list[int]) -> Any:
    """`values` as a scheduler may keep them: an int64 tensor, numpy array or array("q")."""
    if form == "tensor":
        return torch.tensor(values, dtype=torch.int64)
    if form == "numpy":
        return numpy.array(values, dtype=numpy.int64)
    return array("q", values)


@pytest.mark.parametrize("form", ["tensor", "numpy", "array"])
def test_a_prefill_committed_from_the_prompts_ids_reaches_the_tree_as_the_admitted_bytes(
    make_config: Callable[..., Config], form: str
) -> None:
    """A commit of the prompt's own tokens (a slice of the ids it was admitted with) is
    compared with the admitted prompt, not copied: the tokens a cache_unfinished and a finish
    send the tree are read where the admitted prompt's bytes lie. What gets cached is what was
    committed, and the caller's ids may change afterwards without changing the cache."""
    items: list[Any] = []

    def observe(receiver: ActorName, mail: Any) -> None:
        if mail.sender is ActorName.FACADE and receiver is ActorName.TREE and hasattr(mail.message, "items"):
            items.extend(mail.message.items)

    config = make_config(page_size=16, device_pages=256, host_pages=512)
    p = config.page_size
    original = list(range(1, 1 + 120 * p + 1))  # 120 pages and a last token
    full = _ids(form, original)
    with HiCache(config, runtime=make_runtime("threads", observe=observe)) as hc:
        [a] = hc.admit([Request("a", full[:-1])])
        [admitted] = [it for it in items if type(it).__name__ == "AdmitItem"]
        prompt_bytes = admitted.tokens.span()[0]
        assert isinstance(hc.allocate({"a": len(full)}), dict)
        hc.commit({"a": full[: 40 * p]})  # a prefill chunk: the prompt's first 40 pages
        items.clear()
        [a2] = hc.cache_unfinished([a.handle])
        [cached] = [it for it in items if type(it).__name__ == "CacheItem"]
        assert cached.tokens.head_span(40 * p)[0] is prompt_bytes
        assert cached.tokens.tolist() == original[: 40 * p]
        hc.commit({"a": full[40 * p :]})  # the rest of the prompt and the last token
        full[:] = _ids(form, [7] * len(original))  # the caller reuses its ids: the cache keeps what was committed
        items.clear()
        hc.finish([a2])
        [done] = [it for it in items if type(it).__name__ == "FinishItem"]
        assert done.tokens.head_span(80 * p)[0] is prompt_bytes  # the tree reads the whole pages there
        assert done.tokens.tolist() == original[40 * p :] and done.tokens == Tokens.of(original[40 * p :])
        hc.check_invariants()
        # A prompt mostly cached (120 of 160 pages): the tree would copy its new node's key out
        # of the prompt's bytes, so the commit copies (as any), and the tree keeps that copy.
        longer = original[:-1] + list(range(5000, 5000 + 40 * p + 1))
        items.clear()
        [b] = hc.admit([Request("b", _ids(form, longer[:-1]))])
        assert b.cached_tokens == 120 * p
        [admitted_b] = [it for it in items if type(it).__name__ == "AdmitItem"]
        assert isinstance(hc.allocate({"b": 40 * p + 1}), dict)
        ids = _ids(form, longer)
        hc.commit({"b": ids[120 * p :]})
        items.clear()
        hc.finish([b.handle])
        [done] = [it for it in items if type(it).__name__ == "FinishItem"]
        assert done.tokens.head_span(40 * p)[0] is not admitted_b.tokens.span()[0]
        assert done.tokens.tolist() == longer[120 * p :]
        [c] = hc.admit([Request("c", longer + [5])])
        assert c.cached_tokens == 160 * p
        hc.finish([c.handle])
        hc.check_invariants()


def test_a_commit_that_differs_from_the_prompt_is_what_gets_cached_and_a_bad_one_commits_nothing(
    make_config: Callable[..., Config]
) -> None:
    config = make_config(page_size=16, device_pages=256, host_pages=512)
    p = config.page_size
    prompt = torch.arange(1, 1 + 40 * p, dtype=torch.int64)
    computed = prompt.clone()
    computed[25 * p] = 9999  # the engine's tokens part from the prompt's in page 25
    with HiCache(config, runtime=make_runtime("threads")) as hc:
        [a] = hc.admit([Request("a", prompt)])
        assert isinstance(hc.allocate({"a": 40 * p + 1}), dict)
        for bad in (torch.cat([prompt[: 10 * p], torch.tensor([-3])]),  # a negative id where the prompt has one
                    torch.cat([prompt, torch.tensor([-3])])):  # a negative id past the prompt
            with pytest.raises(RequestError, match="-3"):
                hc.commit({"a": bad})
            assert hc.committed_tokens("a") == []
        hc.commit({"a": prompt[: 10 * p]})
        hc.commit({"a": torch.cat([computed[10 * p :], torch.tensor([4])])})
        assert hc.committed_tokens("a") == computed.tolist() + [4]
        hc.check_invariants()
        hc.finish([a.handle])
        [b] = hc.admit([Request("b", computed.tolist() + [4, 5])])
        [c] = hc.admit([Request("c", prompt.tolist() + [5])])
        assert (b.cached_tokens, c.cached_tokens) == (40 * p, 25 * p)
        hc.finish([b.handle, c.handle])
        hc.check_invariants()


@pytest.mark.parametrize("kind", ["threads", "deterministic"])
def test_an_l1_only_cache_allocates_one_host_page_whatever_host_slots_says(
        make_config: Callable[..., Config], oracle_for: Callable[[Config], Any], kind: str) -> None:
    """`host_tier=False` still required `host_slots > device_slots` and allocated a host buffer
    of `host_slots` (2 GiB for a real model at the default): memory spent on nothing."""
    config = Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=64, host_slots=1 << 20, host_tier=False)
    assert Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=64, host_slots=8,
                  host_tier=False).host_pages == 1  # the rule between the two is the host tier's
    oracle = oracle_for(config)
    with HiCache(config, runtime=make_runtime(kind, seed=2)) as hc:
        assert hc.system.host_kv.tensor.numel() * hc.system.host_kv.tensor.element_size() == 4 * config.bytes_per_slot
        assert hc.statistics().host.capacity_slots == 4 and hc.statistics().l2 is None
        for round_ in range(3):  # 3 x 10 pages through 16: eviction deletes, nothing goes to the host
            for i in range(10):
                tokens = seq(8, 1000 * round_ + 100 * i)
                [adm] = hc.admit([Request(f"r{round_}-{i}", tokens[:-1])])
                slots = hc.allocate({f"r{round_}-{i}": 8 - adm.cached_tokens})[f"r{round_}-{i}"]
                oracle.write(hc.device_kv, tokens, slots, start=adm.cached_tokens)
                hc.commit({f"r{round_}-{i}": tokens[adm.cached_tokens:]})
                oracle.verify(hc.device_kv, tokens, hc.slots(f"r{round_}-{i}"))
                hc.finish([adm.handle])
                hc.check_invariants()
        s = hc.statistics()
        assert s.l1.evicted_tokens > 0 and s.host.free_slots == 4
