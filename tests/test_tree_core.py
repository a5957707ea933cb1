"""`TreeCore` driven directly, with the real device and host cores answering it.

A `Player` plays every actor the tree talks to: the device allocator and the host
pool answer at once (their real cores), the write and load streams hold each copy
until the test completes or fails it (copying the KV bytes with `copy_kv`), and
the facade's replies are collected. It also plays the scheduler: admit, allocate
and commit (writing fingerprint KV), finish. After every message and every verb,
all three cores check their invariants, and the tree's mirror of free host slots
must equal the host pool's. Messages name device and host memory by page numbers,
as the product does; the Player turns pages into slots only where KV is read or
written (the copies and the fingerprint oracle).

The seed 003 test (`test_write_ack_unlocks_node_during_pure_decode`) runs at the
end on the real actors through the `HiCache` facade, on both runtimes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import pytest
import torch

from hicache.actors import (
    DEVICE_ROUTES,
    HOST_ROUTES,
    ROUTES,
    TREE_ROUTES,
    DeviceCore,
    HandleError,
    HostCore,
    HostSide,
    Insufficient,
    KVShape,
    NodeState,
    PageOwner,
    TreeCore,
    copy_kv,
)
from hicache.messages import (
    ActorName,
    AdmitItem,
    AdmitRequests,
    Admitted,
    AdoptLoadedSlots,
    AllocateHost,
    AllocateLoadSlots,
    CacheItem,
    CacheUnfinished,
    Cached,
    EvictDevice,
    EvictHost,
    Evicted,
    FinishItem,
    Finished,
    FinishRequests,
    FreeDeviceSlots,
    FreeHostSlots,
    HostSlotState,
    Indices,
    LedgerEntry,
    LoadDone,
    LoadFailed,
    LoadKV,
    Message,
    ReleaseReason,
    ReleaseRequests,
    SetHostState,
    SwapRequestPages,
    Tokens,
    WriteDone,
    WriteFailed,
    WriteKV,
)
from hicache.actors import NoFaults, _tree_admission
from hicache.runtime import Config, HiCache, Request, WritePolicy
from hicache.runtime.testing.oracle import FingerprintOracle

from conftest import make_runtime, pages_to_slots

M = TypeVar("M", bound=Message)
S = NodeState
P = 4


def seq(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


@dataclass
class Req:
    """The scheduler's view of one request."""

    rid: str
    namespace: str
    tokens: list[int]
    """Committed tokens (the cached prefix first)."""
    pages: list[int]
    """Device page of every page of positions with a slot (the cached prefix's first; the last
    page may be partly allocated)."""
    allocated: int
    """Positions with a slot: the cached prefix, then what the request allocated."""
    handle: int
    device_hit: int = 0
    host_hit: int = 0
    host_miss: int = 0
    prefix: int = 0
    """Tokens of the cached prefix its handle locks (the tree has them; items send what follows)."""

    @property
    def slots(self) -> torch.Tensor:
        """Device slot of every position with one: what the engine writes KV into."""
        return pages_to_slots(self.pages, P)[: self.allocated]

    def device(self) -> Indices:
        """The pages of the committed tokens after the cached prefix (the last maybe partly
        committed), as a `FinishItem` or `CacheItem` names them."""
        return Indices.of(self.pages[self.prefix // P : -(-len(self.tokens) // P)])

    def after_prefix(self) -> Tokens:
        """The committed tokens after the cached prefix, as a `FinishItem` or `CacheItem` names them."""
        return Tokens.of(self.tokens[self.prefix :])


class _Refusals(NoFaults):
    """A player's faults: the host pool refuses every reservation while `refuse_host` is set."""

    def __init__(self, player: Player) -> None:
        self._player = player

    def host_exhausted(self, tokens: int) -> bool:
        return self._player.refuse_host


class Player:
    """Plays the device, host, write, load and facade actors around a `TreeCore`. Every
    message goes through the route table of its receiver, as between the actors."""

    PLAYS = (ActorName.DEVICE, ActorName.HOST, ActorName.WRITE, ActorName.LOAD)

    def __init__(self, config: Config, *, refuse_host: bool = False) -> None:
        ids = itertools.count(1)
        assert config.page_size == P
        self.config = config
        self.tree = TreeCore(config, lambda: next(ids))
        self.device = DeviceCore(config)
        self.host = HostCore(config)
        self.oracle = FingerprintOracle(KVShape.of(config))
        self.refuse_host = refuse_host
        """Answer every AllocateHost as if the pool were short (the mirror says it cannot be)."""
        self.host_side = HostSide(self.host, _Refusals(self))
        self.writes: dict[int, WriteKV] = {}
        self.loads: dict[int, LoadKV] = {}
        self.replies: list[Message] = []
        self.sent: list[tuple[ActorName, Message]] = []
        """Everything the tree emitted, in order."""
        self._ops = itertools.count(10_000)
        self.checks = 0

    # -- the other actors ---------------------------------------------------------------

    def check(self) -> None:
        self.tree.check_invariants()
        self.device.check_invariants()
        self.host.check_invariants()
        if not self.tree.outbox:  # every reservation and free delivered
            assert self.tree.host_free == self.host.free_slots, "the tree's mirror of free host slots drifted"
        self.checks += 1

    def pump(self) -> None:
        """Deliver what the tree emitted (and what that makes it emit) until it is quiet."""
        self.check()
        while self.tree.outbox:
            to, message = self.tree.outbox.pop(0)
            self.sent.append((to, message))
            self._deliver(to, message)
            self.check()

    def _deliver(self, to: ActorName, m: Message) -> None:
        """One message the tree emitted: the receiver's routes must take it from the tree. The
        device and host answer through their routes at once, the streams hold theirs, the
        facade's replies are collected."""
        if to is ActorName.FACADE:
            self.replies.append(m)
            return
        assert to in self.PLAYS, f"this player does not play the {to.value} actor ({m!r})"
        ROUTES[to].check(ActorName.TREE, m)
        if to is ActorName.DEVICE:
            self.to_tree(to, DEVICE_ROUTES.deliver(self.device, ActorName.TREE, m))
            out, self.device.outbox = self.device.outbox, []
            for receiver, message in out:  # a release's `Finished` goes to the facade
                assert receiver is ActorName.FACADE, (receiver, message)
                self.replies.append(message)
        elif to is ActorName.HOST:
            self.to_tree(to, HOST_ROUTES.deliver(self.host_side, ActorName.TREE, m))
        elif isinstance(m, WriteKV):
            self.writes[m.op_id] = m
        elif isinstance(m, LoadKV):
            self.loads[m.op_id] = m

    def to_tree(self, sender: ActorName, m: Message | None) -> None:
        """Deliver `m` (if any) from `sender` to the tree, through the tree's routes."""
        if m is not None:
            TREE_ROUTES.deliver(self.tree, sender, m)

    def complete_writes(self, *, fail: bool = False) -> None:
        for op in sorted(self.writes):
            self.complete_write(op, fail=fail)

    def complete_write(self, op: int, *, fail: bool = False) -> None:
        """Land (or fail) one write, as the stream reports it."""
        w = self.writes.pop(op)
        if fail:
            self.to_tree(ActorName.WRITE, WriteFailed(op_id=op, reason="failed by the test"))
        else:
            copy_kv(self.device.kv, pages_to_slots(w.device, P), self.host.kv, pages_to_slots(w.host, P))
            self.to_tree(ActorName.WRITE, WriteDone(op_id=op, slots=len(w.device) * P))
        self.pump()

    def complete_loads(self, *, fail: bool = False) -> None:
        for op, load in sorted(self.loads.items()):
            del self.loads[op]
            if fail:
                self.to_tree(ActorName.LOAD, LoadFailed(op_id=op, reason="failed by the test"))
            else:
                copy_kv(self.host.kv, pages_to_slots(load.host, P), self.device.kv, pages_to_slots(load.device, P))
                self.to_tree(ActorName.LOAD, LoadDone(op_id=op, batch=1, slots=len(load.device) * P))
            self.pump()

    def sent_since(self, mark: int, *types: type[M]) -> list[M]:
        return [m for _, m in self.sent[mark:] if isinstance(m, types)]

    # -- the scheduler ----------------------------------------------------------------------

    def _reply(self, op: int, kind: type[M]) -> M:
        [reply] = [r for r in self.replies if getattr(r, "op_id", None) == op]
        self.replies.remove(reply)
        assert isinstance(reply, kind), reply
        return reply

    def admit(self, *requests: tuple[str, Sequence[int]] | tuple[str, Sequence[int], str]) -> list[Req]:
        op = next(self._ops)
        items = [AdmitItem(request_id=r[0], namespace=r[2] if len(r) > 2 else "", tokens=Tokens.of(r[1]))
                 for r in requests]
        self.to_tree(ActorName.FACADE, AdmitRequests(op_id=op, items=tuple(items)))
        self.pump()
        out = []
        for r, a in zip(requests, self._reply(op, Admitted).admissions, strict=True):
            cached = a.device_hit + a.host_hit
            assert len(a.device) * P == cached  # the cached prefix is whole pages
            out.append(Req(a.request_id, items[len(out)].namespace, list(r[1])[:cached], a.device.tolist(),
                           cached, a.handle, a.device_hit, a.host_hit, a.host_miss, prefix=cached))
        return out

    def extend(self, req: Req, new: Sequence[int], *, extra: int = 0) -> None:
        """Allocate for `new` tokens (and `extra` more), write their KV, commit them."""
        spare = req.allocated - len(req.tokens)
        need = max(0, len(new) + extra - spare)
        if need:
            got = self.device.allocate_pages([(req.rid, need)])
            assert not isinstance(got, Insufficient), got
            req.pages = req.pages + got[req.rid].tolist()
            req.allocated += need
            assert len(req.pages) == -(-req.allocated // P), "new pages only once the last one is full"
        at = len(req.tokens)
        req.tokens = req.tokens + list(new)
        self.oracle.write(self.device.kv, req.tokens, req.slots[at : at + len(new)], start=at)
        if new:
            self.device.commit(req.rid, len(new))
        self.check()

    def run(self, rid: str, tokens: Sequence[int], namespace: str = "", *, extra: int = 0) -> Req:
        """Admit, then compute the rest of the prompt."""
        [req] = self.admit((rid, tokens, namespace))
        self.extend(req, list(tokens)[len(req.tokens):], extra=extra)
        return req

    def finish(self, *reqs: Req, reason: ReleaseReason = ReleaseReason.FINISHED) -> tuple[LedgerEntry, ...]:
        op = next(self._ops)
        self.to_tree(ActorName.FACADE, FinishRequests(op_id=op, items=tuple(self._finish_item(r, reason) for r in reqs)))
        self.pump()
        return self._reply(op, Finished).entries

    @staticmethod
    def _finish_item(r: Req, reason: ReleaseReason) -> FinishItem:
        return FinishItem(request_id=r.rid, handle=r.handle, tokens=r.after_prefix(), device=r.device(),
                          reason=reason, allocs=0, commits=0)

    def cache(self, *reqs: Req) -> tuple[str, ...]:
        """Cache the requests' committed prefixes; returns the ids the tree refused (then nothing changed)."""
        op = next(self._ops)
        items = [CacheItem(request_id=r.rid, handle=r.handle, tokens=r.after_prefix(), device=r.device(), allocs=0, commits=0)
                 for r in reqs]
        self.to_tree(ActorName.FACADE, CacheUnfinished(op_id=op, items=tuple(items)))
        self.pump()
        reply = self._reply(op, Cached)
        if reply.refused:
            return reply.refused
        for r, prefix in zip(reqs, reply.prefixes, strict=True):
            tree_pages = prefix.device.tolist()
            r.pages = tree_pages + r.pages[len(tree_pages):]
            r.handle = prefix.handle
            r.prefix = len(tree_pages) * P
        return ()

    def evict_device(self, tokens: int) -> int:
        op = self.start_evict_device(tokens)
        return self._reply(op, Evicted).device_tokens

    def start_evict_device(self, tokens: int) -> int:
        """Ask for an eviction; under write_back its `Evicted` comes once the write-backs land."""
        op = next(self._ops)
        self.to_tree(ActorName.FACADE, EvictDevice(op_id=op, tokens=tokens))
        self.pump()
        return op

    def evicted(self, op: int) -> int | None:
        """Device tokens of the eviction's `Evicted`, or None while it is not answered yet."""
        if not any(getattr(r, "op_id", None) == op for r in self.replies):
            return None
        return self._reply(op, Evicted).device_tokens

    def evict_host(self, tokens: int) -> int:
        op = next(self._ops)
        self.to_tree(ActorName.FACADE, EvictHost(op_id=op, tokens=tokens))
        self.pump()
        return self._reply(op, Evicted).host_tokens

    # -- looking -------------------------------------------------------------------------------

    def node(self, tokens: Sequence[int], namespace: str = "") -> Any:
        """The node that ends exactly at `tokens` (without touching access times)."""
        node = self.tree.tree.root(namespace)
        pos = 0
        while pos < len(tokens):
            node = node.children[Tokens.of(tokens[pos : pos + P]).to_bytes()]
            pos += node.tokens
        assert pos == len(tokens), f"no node ends at {len(tokens)} tokens"
        return node

    def verify_host(self, tokens: Sequence[int], start: int = 0) -> None:
        """The host copy of `tokens[start:]` (one node) holds their KV."""
        node = self.node(tokens)
        assert node.tokens == len(tokens) - start
        self.oracle.verify(self.host.kv, tokens, pages_to_slots(node.host, P), start=start)

    def assert_idle(self) -> None:
        """Nothing live: no lock, nothing protected, every device slot free or the tree's."""
        stats = self.tree.statistics()
        assert (stats.protected_tokens, stats.live_handles, stats.writes_in_flight, stats.loads_in_flight) == (0, 0, 0, 0)
        assert self.tree.idle()
        counts = self.device.counts()
        assert (counts[PageOwner.REQUEST], counts[PageOwner.LOADING], self.device.live_requests()) == (0, 0, 0)
        assert counts[PageOwner.FREE] + counts[PageOwner.TREE] == self.device.capacity_slots
        assert counts[PageOwner.TREE] == stats.device_tokens
        assert all(nd.lock_ref == 0 for nd in self.tree.tree.walk())


@pytest.fixture
def play(make_config: Callable[..., Config]) -> Callable[..., Player]:
    """`play(**config_fields)`: a Player over a tiny config (16 device pages, 32 host pages of 4)."""
    return lambda refuse_host=False, **fields: Player(make_config(**fields), refuse_host=refuse_host)


# == admission ====================================================================================


def test_an_admission_batch_follows_its_splits_without_a_walk_over_its_plans(
        play: Callable[..., Player], monkeypatch: Any) -> None:
    # Each request's match ends inside a cached node, which it splits; the node lists of the
    # batch's plans made so far must follow the split. Found by the node: a walk over every
    # plan at each split would make an admission of B requests cost B x B.
    p = play(device_pages=64, host_pages=128)
    b = 24
    for i in range(b):
        p.finish(p.run(f"w{i}", seq(2 * P, 1000 * i)))
    p.complete_writes()
    reads: list[int] = []
    base = _tree_admission._Plan

    class CountedPlan(base):  # type: ignore[misc, valid-type]
        """A plan that counts the reads of its device nodes."""

        @property  # type: ignore[misc]
        def device_nodes(self) -> list[Any]:
            reads.append(1)
            return base.device_nodes.__get__(self)  # type: ignore[attr-defined, no-any-return]

        @device_nodes.setter
        def device_nodes(self, nodes: list[Any]) -> None:
            base.device_nodes.__set__(self, nodes)  # type: ignore[attr-defined]

    monkeypatch.setattr(_tree_admission, "_Plan", CountedPlan)
    reqs = p.admit(*((f"r{i}", seq(P, 1000 * i) + seq(P, 1000 * i + 500)) for i in range(b)))
    assert [r.device_hit for r in reqs] == [P] * b  # each matched one page of its two: a split each
    assert p.tree.tree.nodes == 2 * b
    assert len(reads) <= 3 * b, len(reads)  # the reply's reads of each plan; no walk per split
    p.finish(*reqs)
    p.complete_writes()
    p.assert_idle()


# == write policies =============================================================================


def test_write_through_backs_up_a_node_on_its_first_insert(play: Callable[..., Player]) -> None:
    p = play(write_policy=WritePolicy.WRITE_THROUGH)
    a = p.run("a", seq(10, 1))
    mark = len(p.sent)
    p.finish(a)
    [alloc] = p.sent_since(mark, AllocateHost)
    assert alloc.tokens == 8  # the page-aligned prefix; the 2-token tail is freed
    node = p.node(seq(8, 1))
    assert node.state is S.WRITING and node.lock_ref == 1
    assert p.tree.statistics().protected_tokens == 8
    assert len(p.writes) == 1
    p.complete_writes()
    assert node.state is S.SYNCED and node.lock_ref == 0
    assert p.tree.statistics().backups_done == 1
    p.verify_host(seq(8, 1))
    p.assert_idle()


def test_write_through_selective_backs_up_only_on_the_second_hit(play: Callable[..., Player]) -> None:
    p = play(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE)
    p.finish(p.run("a", seq(8, 1)))
    assert p.sent_since(0, AllocateHost) == [] and p.writes == {}
    node = p.node(seq(8, 1))
    assert node.state is S.DEVICE and node.hit_count == 1

    mark = len(p.sent)
    b = p.run("b", seq(8, 1) + seq(4, 50))
    assert b.device_hit == 8
    p.finish(b)
    [alloc] = p.sent_since(mark, AllocateHost)
    assert alloc.tokens == 8  # the twice-hit prefix only; the new leaf has one hit
    assert node.state is S.WRITING and p.node(seq(8, 1) + seq(4, 50)).state is S.DEVICE
    p.complete_writes()
    p.verify_host(seq(8, 1))
    p.assert_idle()


def test_write_back_backs_up_only_at_eviction_before_the_device_slots_go(play: Callable[..., Player]) -> None:
    p = play(write_policy=WritePolicy.WRITE_BACK)
    p.finish(p.run("a", seq(8, 1)))
    p.finish(p.run("b", seq(8, 1)))  # a second hit changes nothing under write_back
    assert p.sent_since(0, AllocateHost) == []
    node = p.node(seq(8, 1))
    pages = node.device

    mark = len(p.sent)
    op = p.start_evict_device(8)
    assert p.evicted(op) is None  # not answered: nothing is free until the write lands
    assert [m.tokens for m in p.sent_since(mark, AllocateHost)] == [8]
    assert p.sent_since(mark, FreeDeviceSlots) == []
    assert node.state is S.WRITING and node.lock_ref == 1
    assert p.device.counts()[PageOwner.TREE] == 8

    mark = len(p.sent)
    p.complete_writes()
    assert p.evicted(op) == 8  # answered once the slots are free
    [freed] = p.sent_since(mark, FreeDeviceSlots)
    assert freed.pages.tolist() == pages.tolist()
    assert node.state is S.HOST_ONLY
    p.verify_host(seq(8, 1))
    assert p.tree.statistics().evicted_device_tokens == 8
    p.assert_idle()


def test_write_back_evicts_only_as_much_as_was_asked_for(play: Callable[..., Player]) -> None:
    p = play(write_policy=WritePolicy.WRITE_BACK)
    prompts = [seq(8, 1), seq(8, 100), seq(8, 200)]
    for i, prompt in enumerate(prompts):
        p.finish(p.run(f"r{i}", prompt))
    mark = len(p.sent)
    op = p.start_evict_device(8)
    assert p.evicted(op) is None
    assert [m.tokens for m in p.sent_since(mark, AllocateHost)] == [8]  # one write-back covers the 8 asked for
    p.complete_writes()
    assert p.evicted(op) == 8
    assert sum(len(m.pages) for m in p.sent_since(mark, FreeDeviceSlots)) * P == 8
    assert [p.node(t).state for t in prompts] == [S.HOST_ONLY, S.DEVICE, S.DEVICE]  # least recently used first
    p.assert_idle()


def test_an_admission_that_comes_while_another_waits_for_load_slots_is_planned_after_it(
        play: Callable[..., Player]) -> None:
    """The facade sends one admission at a time, but after an `admit` it gave up on (a timeout,
    Ctrl-C) its next one reaches the tree while the first still waits for its load-back's device
    slots. Both planned to load the same host-only prefix, and the second `start_load` of it
    killed the tree (an illegal LOADING -> LOADING). The second now waits its turn, and counts
    the prefix the first is loading as its host hit."""
    p = play(write_policy=WritePolicy.WRITE_THROUGH)
    prefix = seq(8, 1)
    p.finish(p.run("a", prefix + [99]))
    p.complete_writes()
    assert p.evict_device(8) == 8 and p.node(prefix).state is S.HOST_ONLY
    first, second = next(p._ops), next(p._ops)
    for op, rid in ((first, "x"), (second, "y")):  # both in the tree's inbox before the device answers
        p.to_tree(ActorName.FACADE, AdmitRequests(op_id=op, items=(
            AdmitItem(request_id=rid, namespace="", tokens=Tokens.of(prefix + [7])),)))
        p.check()
    p.pump()
    x, y = (p._reply(op, Admitted).admissions[0] for op in (first, second))
    assert (x.host_hit, y.host_hit) == (8, 8) and x.device == y.device
    p.complete_loads()
    for adm in (x, y):
        p.oracle.verify(p.device.kv, prefix, pages_to_slots(adm.device.tolist(), P))
    assert p.node(prefix).state is S.SYNCED
    for adm in (x, y):
        p.finish(Req(adm.request_id, "", prefix, adm.device.tolist(), 8, adm.handle, 0, 8, 0, prefix=8))
    p.assert_idle()


def test_without_a_host_tier_nothing_is_backed_up_and_eviction_deletes(play: Callable[..., Player]) -> None:
    p = play(write_policy=WritePolicy.WRITE_BACK, host_tier=False)
    p.finish(p.run("a", seq(8, 1)))
    assert p.evict_device(8) == 8
    assert p.sent_since(0, AllocateHost) == []
    assert p.tree.tree.nodes == 0
    p.assert_idle()


def test_a_childs_write_through_starts_while_its_parents_write_is_in_flight(play: Callable[..., Player]) -> None:
    p = play(write_policy=WritePolicy.WRITE_THROUGH)
    x, y, z = seq(8, 1), seq(8, 20), seq(8, 40)
    p.finish(p.run("a", x + y))  # one node x+y, being written
    b = p.run("b", x + z)  # splits it at x; the write covers both halves
    assert b.device_hit == 8
    assert p.node(x).state is S.WRITING and p.node(x + y).state is S.WRITING

    mark = len(p.sent)
    p.finish(b)
    child = p.node(x + z)
    assert child.state is S.WRITING, "the child waits for no ack: the stream keeps write order"
    assert [m.tokens for m in p.sent_since(mark, AllocateHost)] == [8]
    first, second = sorted(p.writes)
    p.complete_write(first)  # the parent lands first, as the stream reports in order
    assert p.node(x).state is S.SYNCED and p.node(x + y).state is S.SYNCED
    p.complete_write(second)
    assert child.state is S.SYNCED
    p.verify_host(x)
    p.verify_host(x + y, start=8)
    p.verify_host(x + z, start=8)
    assert p.tree.statistics().backups_done == 2
    p.assert_idle()


def test_a_failed_parent_write_fails_its_childs_write_when_it_lands(play: Callable[..., Player]) -> None:
    p = play(write_policy=WritePolicy.WRITE_THROUGH)
    x, z = seq(8, 1), seq(8, 40)
    p.finish(p.run("a", x))  # x being written
    p.finish(p.run("b", x + z))  # z written under it at once
    parent, child = p.node(x), p.node(x + z)
    assert parent.state is S.WRITING and child.state is S.WRITING
    first, second = sorted(p.writes)
    p.complete_write(first, fail=True)
    assert parent.state is S.DEVICE and child.state is S.WRITING  # its bytes are still being copied
    p.complete_write(second)  # copied fine, but its parent has no host copy: not backed up
    assert child.state is S.DEVICE and child.host is None
    stats = p.tree.statistics()
    assert (stats.backups_done, stats.backups_failed) == (0, 2)
    assert p.tree.host_free == p.config.host_slots
    p.assert_idle()


# == eviction =====================================================================================


def test_device_eviction_turns_backed_up_nodes_host_only_and_deletes_the_others(play: Callable[..., Player]) -> None:
    p = play(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE)
    backed, plain = seq(8, 1), seq(8, 100)
    p.finish(p.run("a", backed))
    p.finish(p.run("b", backed))  # second hit: backed up
    p.complete_writes()
    p.finish(p.run("c", plain))  # one hit: device only
    mark = len(p.sent)
    assert p.evict_device(16) == 16
    assert p.node(backed).state is S.HOST_ONLY
    assert Tokens.of(plain[:P]).to_bytes() not in p.tree.tree.root("").children
    assert sorted(len(m.pages) for m in p.sent_since(mark, FreeDeviceSlots)) == [16 // P]
    [moved] = [m for m in p.sent_since(mark, SetHostState) if m.state is HostSlotState.HOST_ONLY]
    assert moved.pages == p.node(backed).host
    stats = p.tree.statistics()
    assert (stats.device_tokens, stats.host_tokens, stats.evicted_device_tokens) == (0, 8, 16)
    assert p.device.counts()[PageOwner.FREE] == p.device.capacity_slots
    p.assert_idle()


def test_device_eviction_never_takes_a_node_a_request_holds(play: Callable[..., Player]) -> None:
    p = play()
    p.finish(p.run("a", seq(8, 1)))
    p.complete_writes()
    [held] = p.admit(("b", seq(8, 1) + [99]))
    assert held.device_hit == 8
    assert p.evict_device(100) == 0
    assert p.node(seq(8, 1)).state is S.SYNCED
    p.finish(held)
    assert p.evict_device(100) == 8
    p.assert_idle()


def test_host_eviction_frees_host_only_leaves_through_the_host_pool(play: Callable[..., Player]) -> None:
    p = play()
    p.finish(p.run("a", seq(8, 1)))
    p.complete_writes()
    assert p.evict_host(8) == 0  # still on the device: not a host victim
    p.evict_device(8)
    host = p.node(seq(8, 1)).host
    mark = len(p.sent)
    assert p.evict_host(8) == 8
    [freed] = p.sent_since(mark, FreeHostSlots)
    assert freed.pages.tolist() == host.tolist()
    assert p.tree.tree.nodes == 0
    assert p.host.free_slots == p.host.capacity_slots == p.tree.host_free
    p.assert_idle()


def test_a_backup_evicts_host_only_leaves_first_when_the_mirror_says_the_host_is_short(
    play: Callable[..., Player],
) -> None:
    p = play(device_pages=4, host_pages=5)  # 16 device slots, 20 host slots
    x, y, z = seq(8, 1), seq(8, 100), seq(8, 200)
    _host_only(p, x, y)
    assert p.tree.host_free == p.host.free_slots == 4
    x_host = p.node(x).host.tolist()
    mark = len(p.sent)
    p.finish(p.run("z", z))
    sent = [m for _, m in p.sent[mark:] if isinstance(m, FreeHostSlots | AllocateHost)]
    assert [type(m).__name__ for m in sent] == ["FreeHostSlots", "AllocateHost"]  # evict, then reserve
    assert sent[0].pages.tolist() == x_host
    assert Tokens.of(x[:P]).to_bytes() not in p.tree.tree.root("").children  # the least recently used host-only leaf
    assert p.node(y).state is S.HOST_ONLY
    p.complete_writes()
    stats = p.tree.statistics()
    assert (stats.backups_done, stats.backups_failed, stats.evicted_host_tokens) == (3, 0, 8)
    p.verify_host(z)
    p.assert_idle()


def test_a_backup_is_skipped_when_no_host_memory_can_be_freed(play: Callable[..., Player]) -> None:
    p = play(device_pages=4, host_pages=5)
    x, y, z = seq(8, 1), seq(8, 100), seq(8, 200)
    _host_only(p, x, y)
    r1, r2 = p.admit(("r1", x), ("r2", y))
    p.complete_loads(fail=True)  # both stay host-only, locked by their requests: not host victims
    mark = len(p.sent)
    p.finish(p.run("z", z))
    assert p.sent_since(mark, AllocateHost, FreeHostSlots) == []
    node = p.node(z)
    assert node.state is S.DEVICE and node.lock_ref == 0
    assert p.tree.statistics().backups_failed == 1
    p.finish(r1, r2, reason=ReleaseReason.ABORTED)
    p.assert_idle()


def test_namespaces_never_share_a_cached_prefix(play: Callable[..., Player]) -> None:
    p = play()
    p.finish(p.run("a", seq(8, 1), namespace="model-a"))
    b = p.run("b", seq(8, 1), namespace="model-b")
    assert (b.device_hit, b.host_hit) == (0, 0)
    c = p.run("c", seq(8, 1), namespace="model-a")
    assert c.device_hit == 8
    p.finish(b, c)
    p.complete_writes()
    assert p.tree.tree.nodes == 2
    assert p.node(seq(8, 1), "model-a").hashes != p.node(seq(8, 1), "model-b").hashes
    p.assert_idle()


# == load-back ====================================================================================


def _host_only(p: Player, *prompts: list[int]) -> None:
    """Each prompt cached, backed up and evicted from the device (host-only)."""
    for i, prompt in enumerate(prompts):
        p.finish(p.run(f"warm-{i}", prompt))
        p.complete_writes()
    p.evict_device(p.config.device_slots)
    for prompt in prompts:
        assert p.node(prompt).state is S.HOST_ONLY


def test_a_host_hit_is_loaded_back_and_reads_the_computed_kv(play: Callable[..., Player]) -> None:
    p = play()
    _host_only(p, seq(8, 1))
    [a] = p.admit(("a", seq(8, 1) + [7, 7]))
    assert (a.device_hit, a.host_hit, a.host_miss) == (0, 8, 0)
    node = p.node(seq(8, 1))
    assert node.state is S.LOADING and node.lock_ref == 1
    assert len(p.loads) == 1
    mark = len(p.sent)
    p.complete_loads()
    assert node.state is S.SYNCED
    assert p.sent_since(mark, AdoptLoadedSlots)[0].pages.tolist() == a.pages
    p.oracle.verify(p.device.kv, a.tokens, a.slots)
    p.extend(a, [7, 7])
    p.finish(a)
    assert p.tree.statistics().host_hit_tokens == 8
    p.assert_idle()


def test_a_host_hit_shorter_than_load_back_min_tokens_is_reported_as_a_host_miss(play: Callable[..., Player]) -> None:
    p = play(load_back_min_tokens=12)
    _host_only(p, seq(8, 1))
    [a] = p.admit(("a", seq(8, 1) + seq(8, 50)))
    assert (a.device_hit, a.host_hit, a.host_miss) == (0, 0, 8)
    assert p.sent_since(0, AllocateLoadSlots) == [] and p.loads == {}
    assert p.node(seq(8, 1)).lock_ref == 0
    p.extend(a, seq(8, 1) + seq(8, 50))  # recomputed from scratch
    p.finish(a)
    p.complete_writes()
    p.assert_idle()


def test_load_back_stays_within_the_quota_of_one_admission_batch(play: Callable[..., Player]) -> None:
    p = play(load_back_quota_tokens=8)
    x, y, w = seq(8, 1), seq(8, 20), seq(8, 100)
    p.finish(p.run("warm-x", x))
    p.finish(p.run("warm-xy", x + y))  # a second node under x
    p.finish(p.run("warm-w", w))
    p.complete_writes()
    p.complete_writes()
    p.evict_device(p.config.device_slots)
    a, b = p.admit(("a", x + y), ("b", w))
    assert (a.host_hit, a.host_miss) == (8, 8)  # x fits the quota, y does not
    assert (b.host_hit, b.host_miss) == (0, 8)  # the quota is spent
    assert [m.tokens for m in p.sent_since(0, AllocateLoadSlots)] == [8]
    p.complete_loads()
    p.oracle.verify(p.device.kv, a.tokens, a.slots)
    p.finish(a, reason=ReleaseReason.ABORTED)
    p.finish(b, reason=ReleaseReason.ABORTED)
    p.assert_idle()


def test_two_requests_of_one_batch_share_a_load_even_when_the_second_splits_the_node(
    play: Callable[..., Player],
) -> None:
    p = play()
    x, y, z = seq(8, 1), seq(8, 20), seq(8, 40)
    _host_only(p, x + y)  # one host-only node of 16 tokens
    a, b = p.admit(("a", x + y + [9]), ("b", x + z))
    assert (a.device_hit + a.host_hit, b.device_hit + b.host_hit) == (16, 8)
    assert (a.host_hit, b.host_hit) == (16, 8)  # both wait for the load of this batch
    assert b.pages == a.pages[: 8 // P]
    assert [m.tokens for m in p.sent_since(0, AllocateLoadSlots)] == [16]
    p.complete_loads()
    p.oracle.verify(p.device.kv, a.tokens, a.slots)
    p.oracle.verify(p.device.kv, b.tokens, b.slots)
    p.finish(a, b, reason=ReleaseReason.ABORTED)
    p.assert_idle()


def test_a_short_device_evicts_and_retries_the_load_once(play: Callable[..., Player]) -> None:
    p = play(device_pages=8)  # 32 slots
    x, e = seq(8, 1), seq(8, 100)
    _host_only(p, x)
    p.finish(p.run("e", e))  # an evictable node that the retry can take
    p.complete_writes()
    [r] = p.admit(("r", []))
    p.extend(r, [], extra=24)  # a live request holds the rest of the device
    assert p.device.counts()[PageOwner.FREE] == 0

    mark = len(p.sent)
    [a] = p.admit(("a", x))
    assert [m.tokens for m in p.sent_since(mark, AllocateLoadSlots)] == [8, 8]
    assert (a.host_hit, a.host_miss) == (8, 0)
    assert p.node(e).state is S.HOST_ONLY  # evicted for the retry
    p.complete_loads()
    p.oracle.verify(p.device.kv, a.tokens, a.slots)
    p.finish(a, r)
    p.assert_idle()


def test_a_short_device_gives_up_the_loads_after_one_retry(play: Callable[..., Player]) -> None:
    p = play(device_pages=8)
    x = seq(8, 1)
    _host_only(p, x)
    [r] = p.admit(("r", []))
    p.extend(r, [], extra=32)  # nothing evictable, nothing free

    mark = len(p.sent)
    [a] = p.admit(("a", x + [5]))
    assert [m.tokens for m in p.sent_since(mark, AllocateLoadSlots)] == [8, 8]
    assert (a.device_hit, a.host_hit, a.host_miss) == (0, 0, 8)
    assert (a.pages, a.allocated) == ([], 0) and p.loads == {}
    node = p.node(x)
    assert node.state is S.HOST_ONLY and node.lock_ref == 0
    p.finish(r)
    p.extend(a, x + [5])
    p.finish(a)
    p.assert_idle()


def test_a_given_up_load_also_trims_a_request_that_shared_it(play: Callable[..., Player]) -> None:
    p = play(device_pages=8)
    x = seq(8, 1)
    _host_only(p, x)
    [r] = p.admit(("r", []))
    p.extend(r, [], extra=32)
    a, b = p.admit(("a", x), ("b", x + [3]))
    for req in (a, b):
        assert (req.device_hit, req.host_hit, req.host_miss, len(req.pages)) == (0, 0, 8, 0)
    assert p.node(x).lock_ref == 0
    p.finish(a, b, r, reason=ReleaseReason.ABORTED)
    p.assert_idle()


# == failures ======================================================================================


def test_a_failed_write_is_never_marked_done_and_the_tree_frees_its_host_pages(play: Callable[..., Player]) -> None:
    p = play()
    p.finish(p.run("a", seq(8, 1)))
    node = p.node(seq(8, 1))
    host = p.writes[next(iter(p.writes))].host
    mark = len(p.sent)
    p.complete_writes(fail=True)
    [freed] = p.sent_since(mark, FreeHostSlots)
    assert freed.pages == host
    assert [m.state for m in p.sent_since(mark, SetHostState)] == [HostSlotState.RESERVED]
    assert node.state is S.DEVICE and node.host is None and node.lock_ref == 0
    stats = p.tree.statistics()
    assert (stats.backups_done, stats.backups_failed, stats.host_tokens) == (0, 1, 0)
    assert p.host.free_slots == p.host.capacity_slots
    assert p.evict_device(8) == 8  # not backed up: deleted, not made host-only
    assert p.tree.tree.nodes == 0
    p.assert_idle()


def test_a_refused_host_reservation_puts_the_node_back_and_unlocks_it(play: Callable[..., Player]) -> None:
    p = play(refuse_host=True)
    p.finish(p.run("a", seq(8, 1)))
    node = p.node(seq(8, 1))
    assert node.state is S.DEVICE and node.lock_ref == 0 and p.writes == {}
    assert p.tree.host_free == p.host.capacity_slots
    assert p.tree.statistics().backups_failed == 1
    p.assert_idle()


def test_a_failed_load_is_never_marked_done_and_the_request_can_leave(play: Callable[..., Player]) -> None:
    p = play()
    x = seq(8, 1)
    _host_only(p, x)
    [a] = p.admit(("a", x))
    node = p.node(x)
    mark = len(p.sent)
    p.complete_loads(fail=True)
    [freed] = p.sent_since(mark, FreeDeviceSlots)
    assert freed.pages.tolist() == a.pages
    assert p.sent_since(mark, AdoptLoadedSlots) == []
    assert [m.state for m in p.sent_since(mark, SetHostState)] == [HostSlotState.HOST_ONLY]
    assert node.state is S.HOST_ONLY and node.host is not None
    assert p.device.counts()[PageOwner.LOADING] == 0  # no slot left loading
    p.finish(a, reason=ReleaseReason.ABORTED)
    assert node.lock_ref == 0
    [again] = p.admit(("again", x))  # the host copy is intact: a second load works
    p.complete_loads()
    p.oracle.verify(p.device.kv, again.tokens, again.slots)
    p.finish(again)
    p.assert_idle()


def test_a_load_that_lands_under_a_prefix_whose_earlier_load_failed_is_given_back(play: Callable[..., Player]) -> None:
    """b is admitted while a's load of the prefix's first half runs (an engine scheduling the
    next batch during a forward pass): b's host hit waits on that load and on its own of the
    second half. a's load fails, b's lands: the second half would sit in device memory under a
    host-only node, so it goes back to host memory too (its device pages freed, none adopted),
    and b's host hit is no hit."""
    p = play()
    x = seq(16, 1)
    _host_only(p, x)
    [a] = p.admit(("a", x[:8] + [7]))
    [b] = p.admit(("b", x + [7]))
    assert (a.host_hit, b.host_hit) == (8, 16)
    [first, second] = sorted(p.loads)
    top, bottom = p.node(x[:8]), p.node(x)
    assert top.state is bottom.state is S.LOADING and (top.op, bottom.op) == (first, second)
    before = p.tree.statistics().host_hit_tokens
    mark = len(p.sent)
    del p.loads[first]
    p.to_tree(ActorName.LOAD, LoadFailed(op_id=first, reason="failed by the test"))
    p.pump()
    load = p.loads.pop(second)
    copy_kv(p.host.kv, pages_to_slots(load.host, P), p.device.kv, pages_to_slots(load.device, P))
    p.to_tree(ActorName.LOAD, LoadDone(op_id=second, batch=2, slots=len(load.device) * P))
    p.pump()
    assert top.state is bottom.state is S.HOST_ONLY and bottom.device is None
    assert p.sent_since(mark, AdoptLoadedSlots) == []
    assert sorted(pg for m in p.sent_since(mark, FreeDeviceSlots) for pg in m.pages.tolist()) == sorted(b.pages)
    assert p.tree.statistics().host_hit_tokens == before
    assert p.device.counts()[PageOwner.LOADING] == 0
    p.finish(a, reason=ReleaseReason.ABORTED)
    p.finish(b, reason=ReleaseReason.ABORTED)
    [again] = p.admit(("again", x + [7]))  # the host copy is intact: it loads now
    assert again.host_hit == 16
    p.complete_loads()
    p.oracle.verify(p.device.kv, again.tokens, again.slots)
    p.finish(again)
    p.assert_idle()


def test_a_failed_load_takes_the_nodes_loaded_under_it_since_back_to_host_memory(play: Callable[..., Player]) -> None:
    """Loads of one prefix from three admissions made while the earlier loads ran: a loads the
    top, b the middle; a's load fails, so c loads the top again (the middle, still loading
    under a host-only node, and the bottom are c's host miss: it computes them). The middle
    lands while c's load of the top runs, then that load fails: the middle goes back to host
    memory with it, and none of the three host hits counts as served."""
    p = play()
    x = seq(24, 1)
    _host_only(p, x)
    before = p.tree.statistics().host_hit_tokens
    [a] = p.admit(("a", x[:8] + [7]))
    [b] = p.admit(("b", x[:16] + [7]))
    [op_a, op_b] = sorted(p.loads)
    top, mid = p.node(x[:8]), p.node(x[:16])

    def end(op: int, *, fail: bool) -> None:
        load = p.loads.pop(op)
        if fail:
            p.to_tree(ActorName.LOAD, LoadFailed(op_id=op, reason="failed by the test"))
        else:
            copy_kv(p.host.kv, pages_to_slots(load.host, P), p.device.kv, pages_to_slots(load.device, P))
            p.to_tree(ActorName.LOAD, LoadDone(op_id=op, batch=op, slots=len(load.device) * P))
        p.pump()

    end(op_a, fail=True)
    assert top.state is S.HOST_ONLY and mid.state is S.LOADING  # its load runs on, under a host-only node
    [c] = p.admit(("c", x + [7]))
    assert (c.device_hit, c.host_hit, c.host_miss) == (0, 8, 16)
    [op_c] = sorted(set(p.loads) - {op_b})
    bottom = p.node(x)
    assert (top.state, mid.state, bottom.state) == (S.LOADING, S.LOADING, S.HOST_ONLY)
    end(op_b, fail=False)
    assert mid.state is S.SYNCED  # under a top that is loading again
    mark = len(p.sent)
    end(op_c, fail=True)
    assert (top.state, mid.state, bottom.state) == (S.HOST_ONLY, S.HOST_ONLY, S.HOST_ONLY)
    freed = sorted(pg for m in p.sent_since(mark, FreeDeviceSlots) for pg in m.pages.tolist())
    assert freed == sorted(c.pages + b.pages[2:])  # c's top, and the middle, which b's load filled
    assert p.tree.statistics().host_hit_tokens == before
    for r in (a, b, c):
        p.finish(r, reason=ReleaseReason.ABORTED)
    [again] = p.admit(("again", x + [7]))
    p.complete_loads()
    p.oracle.verify(p.device.kv, again.tokens, again.slots)
    p.finish(again)
    p.assert_idle()


def test_a_request_whose_load_failed_caches_nothing_of_its_own_when_it_finishes(play: Callable[..., Player]) -> None:
    p = play()
    x = seq(8, 1)
    _host_only(p, x)
    [a] = p.admit(("a", x + seq(8, 30)))
    p.complete_loads(fail=True)
    p.extend(a, seq(8, 30))  # a scheduler that went on regardless: its KV read a failed load
    mark = len(p.sent)
    [entry] = p.finish(a)
    assert entry.freed == entry.allocated == 8
    [release] = p.sent_since(mark, ReleaseRequests)
    assert len(release.releases[0].adopt) == 0  # none of it is cached
    assert p.tree.tree.nodes == 1 and p.node(x).state is S.HOST_ONLY
    assert p.sent_since(mark, AllocateHost) == []
    p.assert_idle()


def test_caching_a_chunk_over_a_failed_load_is_refused_and_changes_nothing(play: Callable[..., Player]) -> None:
    p = play()
    x = seq(8, 1)
    _host_only(p, x)
    [a] = p.admit(("a", x + seq(8, 30)))
    p.complete_loads(fail=True)
    p.extend(a, seq(8, 30))
    assert p.cache(a) == ("a",)
    p.check()
    assert p.tree.tree.nodes == 1 and p.tree.statistics().live_handles == 1
    p.finish(a, reason=ReleaseReason.ABORTED)
    p.assert_idle()


# == handles =======================================================================================


def test_an_unknown_handle_is_a_handle_error_and_changes_nothing(play: Callable[..., Player]) -> None:
    p = play()
    a = p.run("a", seq(8, 1))
    ghost = replace(a, handle=999)
    with pytest.raises(HandleError, match="lock handle 999 of request 'a' is unknown or already released"):
        p.finish(ghost)
    p.check()
    p.finish(a)
    with pytest.raises(HandleError, match=f"lock handle {a.handle} of request 'a' is unknown or already released"):
        p.finish(a)
    p.check()
    p.complete_writes()
    p.assert_idle()


def test_another_requests_handle_is_a_handle_error_and_the_whole_batch_is_refused(
    play: Callable[..., Player],
) -> None:
    p = play()
    a = p.run("a", seq(8, 1))
    b = p.run("b", seq(8, 1))
    stolen = replace(b, handle=a.handle)
    with pytest.raises(HandleError, match=f"lock handle {a.handle} belongs to request 'a', not 'b'"):
        p.finish(a, stolen)
    p.check()
    assert p.tree.statistics().live_handles == 2 and p.tree.tree.nodes == 0  # a was not finished either
    with pytest.raises(HandleError, match="belongs to request 'a', not 'b'"):
        p.cache(stolen)
    p.finish(a, b)
    p.complete_writes()
    p.assert_idle()


def test_a_finish_names_only_what_follows_the_cached_prefix_and_the_prefix_counts_as_matched(
    play: Callable[..., Player],
) -> None:
    p = play()
    p.finish(p.run("a", seq(8, 1)))
    b = p.run("b", seq(16, 1))
    assert b.prefix == 8 and b.after_prefix().tolist() == seq(8, 9) and len(b.device()) == 2
    p.finish(b)
    path = p.tree.tree.match("", Tokens.of(seq(16, 1)))
    assert [nd.tokens for nd in path] == [8, 8]
    assert [nd.hit_count for nd in path] == [2, 1]  # a's insert, then b's finish through it
    p.complete_writes()
    p.assert_idle()


def test_an_item_whose_pages_do_not_cover_its_tokens_is_refused_and_changes_nothing(
    play: Callable[..., Player],
) -> None:
    p = play()
    a = p.run("a", seq(10, 1))  # 10 committed tokens: 3 pages, the last partly committed
    slots = FinishItem(request_id="a", handle=a.handle, tokens=Tokens.of(a.tokens),
                       device=Indices.from_tensor(a.slots), reason=ReleaseReason.FINISHED, allocs=0, commits=0)  # one per token
    with pytest.raises(ValueError, match="request 'a': 10 tokens after its cached prefix need 3 pages of 4, got 10"):
        p.tree.finish(next(p._ops), [slots])
    p.check()
    with pytest.raises(ValueError, match="request 'a': 10 tokens after its cached prefix need 3 pages of 4, got 2"):
        p.cache(replace(a, pages=a.pages[:2]))
    p.check()
    assert p.tree.statistics().live_handles == 1 and p.tree.tree.nodes == 0 and p.tree.outbox == []
    p.finish(a)
    p.complete_writes()
    p.assert_idle()


# == finish, chunked prefill, ledgers ==========================================================


def test_finish_adopts_new_pages_and_frees_duplicates_tail_and_over_allocation(play: Callable[..., Player]) -> None:
    p = play(write_policy=WritePolicy.WRITE_BACK)
    a, c = p.admit(("a", seq(8, 1)), ("c", seq(8, 1) + seq(6, 30)))  # both compute the same prefix
    p.extend(a, seq(8, 1))
    p.extend(c, seq(8, 1) + seq(6, 30), extra=7)  # 6 new tokens, then 7 slots never used (6 pages in all)
    p.finish(a)
    mark = len(p.sent)
    [entry] = p.finish(c)
    assert (entry.allocated, entry.committed, entry.freed) == (21, 14, 21)
    [release] = p.sent_since(mark, ReleaseRequests)
    assert release.releases[0].adopt.tolist() == c.pages[2:3]  # only its one new whole page
    node = p.node(seq(8, 1) + seq(4, 30))
    assert node.device.tolist() == c.pages[2:3]
    assert p.node(seq(8, 1)).device.tolist() == a.pages  # a's copy stays, c's duplicate is freed
    assert p.device.counts()[PageOwner.TREE] == 12
    assert p.device.ledger("c").freed == p.device.ledger("c").allocated
    p.assert_idle()


def test_cache_unfinished_swaps_to_the_trees_pages_and_frees_duplicates(play: Callable[..., Player]) -> None:
    p = play(write_policy=WritePolicy.WRITE_BACK)
    prompt = seq(14, 1)
    a, b = p.admit(("a", prompt), ("b", prompt))
    p.extend(a, prompt[:6])
    p.extend(b, prompt[:6])
    old_a, old_b = a.handle, b.handle
    a_page, b_page = a.pages[0], b.pages[0]
    mark = len(p.sent)
    p.cache(a)
    p.cache(b)
    assert a.handle != old_a and b.handle != old_b
    swaps = p.sent_since(mark, SwapRequestPages)
    assert [(s.adopt.tolist(), s.free.tolist()) for s in swaps] == [([a_page], []), ([], [b_page])]
    assert b.pages[0] == a.pages[0] == a_page  # both read the tree's page now
    assert p.device.ledger("b").freed == 4
    with pytest.raises(HandleError, match=f"lock handle {old_a} of request 'a' is unknown"):
        p.finish(replace(a, handle=old_a))
    p.extend(a, prompt[6:])
    p.extend(b, prompt[6:])
    p.oracle.verify(p.device.kv, prompt, a.slots)
    p.oracle.verify(p.device.kv, prompt, b.slots)
    entries = p.finish(a, b)
    assert all(e.freed == e.allocated == 14 for e in entries)
    p.assert_idle()


# == seed 003 on the core ===========================================================================


def test_a_write_ack_returns_protected_tokens_to_the_other_requests_share(play: Callable[..., Player]) -> None:
    p = play(device_pages=32, host_pages=64)
    shared = seq(8, 1)
    p.finish(p.run("warm", shared))
    p.complete_writes()
    a = p.run("a", shared + seq(8, 20))
    b = p.run("b", shared + seq(8, 40))
    p.finish(a)  # a's own pages start a write-through
    assert p.tree.statistics().protected_tokens == 8 + 8
    for step in range(50):  # b decodes; the tree hears nothing but the write's ack
        p.extend(b, [1000 + step])
        if step == 3:
            p.complete_writes()
        assert p.tree.statistics().protected_tokens == (8 if step >= 3 else 16)
    p.finish(b)
    p.complete_writes()
    p.assert_idle()


# == seed 003 on the real actors ====================================================================


class _WriteAcks:
    """A delivery observer counting the write acks delivered to the tree (before it handles each)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, receiver: ActorName, mail: Any) -> None:
        if receiver is ActorName.TREE and type(mail.message).__name__ == "WriteDone":
            self.count += 1


def _settle(hc: HiCache, timeout_s: float = 10.0) -> Any:
    """Statistics once no write or load is in flight (threads: the copies take real time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = hc.statistics()
        if stats.tree.writes_in_flight == 0 and stats.tree.loads_in_flight == 0:
            return stats
        assert time.monotonic() < deadline, f"transfers still in flight after {timeout_s}s: {stats.tree}"


def _compute(hc: HiCache, oracle: FingerprintOracle, rid: str, tokens: list[int]) -> None:
    """Allocate, write the KV of and commit the positions of `tokens` after the request's cached prefix."""
    done = len(hc.committed_tokens(rid))
    new = tokens[done:]
    got = hc.allocate({rid: len(new)})
    assert isinstance(got, dict), got
    oracle.write(hc.device_kv, tokens, got[rid], start=done)
    hc.commit({rid: new})


DECODE_STEPS = 300


def test_write_ack_unlocks_node_during_pure_decode(
    runtime_kind: str, make_config: Callable[..., Config], oracle_for: Callable[[Config], FingerprintOracle]
) -> None:
    """Seed 003: request a finishes and its pages start a write-through (locked); request b
    keeps decoding with no new request. The ack unlocks a's pages as soon as the tree gets
    it, and over a long decode-only run the protected tokens stay at b's own share."""
    cfg = make_config(device_pages=128, host_pages=256, write_policy=WritePolicy.WRITE_THROUGH)
    oracle = oracle_for(cfg)
    acks = _WriteAcks()
    with HiCache(cfg, runtime=make_runtime(runtime_kind, seed=3, observe=acks)) as hc:
        shared = seq(8, 1)
        [warm] = hc.admit([Request("warm", shared)])
        _compute(hc, oracle, "warm", shared)
        hc.finish([warm.handle])
        assert _settle(hc).tree.protected_tokens == 0

        a_prompt, b_prompt = shared + seq(8, 20), shared + seq(8, 40)
        a, b = hc.admit([Request("a", a_prompt), Request("b", b_prompt)])
        assert a.device_hit == b.device_hit == 8
        _compute(hc, oracle, "a", a_prompt)
        _compute(hc, oracle, "b", b_prompt)
        share = 8  # b's lock: the shared prefix it was admitted with
        assert hc.statistics().tree.protected_tokens == share

        acks_before = acks.count
        hc.finish([a.handle])  # a's own 8 tokens: inserted, locked for their write-through
        written = 8
        history = []
        for step in range(DECODE_STEPS):
            token = 5000 + step
            got = hc.allocate({"b": 1})
            assert isinstance(got, dict)
            oracle.write(hc.device_kv, hc.committed_tokens("b") + [token], got["b"], start=len(b_prompt) + step)
            hc.commit({"b": [token]})
            acked_before = acks.count > acks_before  # the tree got the ack before the question below
            tree = hc.statistics().tree
            acked_after = acks.count > acks_before
            history.append(tree.protected_tokens)
            got_stats = (tree.protected_tokens, tree.writes_in_flight)
            if acked_before:
                assert got_stats == (share, 0), (
                    f"decode step {step}: the write ack was delivered, yet {tree.protected_tokens} tokens "
                    f"are protected (b's share is {share})"
                )
            elif not acked_after:
                assert got_stats == (share + written, 1)  # nothing but the ack may unlock a's pages
            else:
                assert got_stats in ((share, 0), (share + written, 1))  # the ack raced the question
        assert acks.count == acks_before + 1, "the write ack never reached the tree during the decode-only run"
        assert history[-DECODE_STEPS // 2 :] == [share] * (DECODE_STEPS // 2)
        assert max(history) <= share + written

        oracle.verify(hc.device_kv, hc.committed_tokens("b"), hc.slots("b"))
        hc.finish([b.handle])
        stats = _settle(hc)
        assert (stats.tree.protected_tokens, stats.tree.live_handles) == (0, 0)
        assert (stats.device.request_slots, stats.device.loading_slots) == (0, 0)
        assert stats.device.free_slots + stats.device.tree_slots == stats.device.capacity_slots
        hc.check_invariants()
