"""Tensor parallel: ranks with different physical luck keep identical trees.

Two ranks run as two processes on one machine, joined by a gloo group over
127.0.0.1. Each has its own hicache with its own injected storage latency, storage
failures, transfer failures and host exhaustion, and both serve the same workload
under the reference scheduler (tests/_tp_worker.py). Every rank-local outcome goes
through the ranks' agreement, so after every tick the tree digests, host use, free
device slots and queues are equal. Nothing may hang: every rank has a deadline, and
the parent kills both and fails with their output if they exceed it.

The tests of what the ranks must do alike (their configs, their agreeing calls, a
restart, a timeout) run the ranks as threads of this process instead, over a group
whose collectives meet at a barrier.
"""

from __future__ import annotations

import json
import random
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.actors import InvariantError
from hicache.actors._facts import KINDS, FactKind, Facts
from hicache.messages import PrefetchEnd
from hicache.runtime import Config, ConfigError, HiCache, PrefetchPolicy, Request, WritePolicy
from hicache.runtime._group import RankDivergenceError, SingleGroup
from hicache.runtime.testing import DeterministicRuntime

WORKER = Path(__file__).with_name("_tp_worker.py")
RANKS = 2
PARENT_DEADLINE_S = 90.0
"""Both ranks must have exited by then (each stops itself earlier; this is the backstop)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(mode: str, tmp_path: Path) -> list[dict[str, Any]]:
    """Start every rank, wait for all within the deadline (killing them past it), and
    return their results; fail with every rank's output if one failed or hung."""
    init = f"tcp://127.0.0.1:{_free_port()}"
    storage = tmp_path / "storage"
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs = []
    for rank in range(RANKS):
        log = (tmp_path / f"rank{rank}.log").open("w")
        cmd = [sys.executable, str(WORKER), mode, str(rank), str(RANKS), init, str(storage),
               str(tmp_path / f"rank{rank}.json")]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    deadline = time.monotonic() + PARENT_DEADLINE_S
    hung = []
    for rank, (p, _) in enumerate(procs):
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(rank)
    for p, log in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()
    output = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{(tmp_path / f'rank{r}.log').read_text()[-6000:]}"
                       for r, (p, _) in enumerate(procs))
    results = []
    for rank in range(RANKS):
        path = tmp_path / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"rank": rank, "error": "no result"})
    if hung:
        pytest.fail(f"rank(s) {hung} still running after {PARENT_DEADLINE_S}s (killed)\n{results}\n{output}")
    for r in results:
        if "diverged" in r:
            pytest.fail(f"rank {r['rank']}: ranks diverged at {r['diverged']}:\n" + "\n".join(r["views"]))
        if "error" in r:
            pytest.fail(f"rank {r['rank']} failed:\n{r['error']}\n{output}")
    if any(p.returncode for p, _ in procs):
        pytest.fail(f"a rank exited with an error\n{output}")
    return results


@pytest.mark.timeout(PARENT_DEADLINE_S + 30)
@pytest.mark.parametrize(("write", "prefetch"), [(WritePolicy.WRITE_THROUGH, PrefetchPolicy.WAIT_COMPLETE),
                                                 (WritePolicy.WRITE_BACK, PrefetchPolicy.TIMEOUT)])
def test_ranks_with_different_faults_keep_identical_trees_after_every_tick(
    tmp_path: Path, write: WritePolicy, prefetch: PrefetchPolicy
) -> None:
    r0, r1 = _run_ranks(f"serve:{write.name}:{prefetch.name}", tmp_path)
    for r in (r0, r1):
        assert r["ended"] and r["finished"] + r["aborted"] == r["requests"] == 48, r
        assert r["finished"] > 0, r
        assert r["digest_checks"] == sum(r["ticks"]) + 3, r
        # the workload exercised what it is meant to
        assert r["prefetches_started"] > 0, r
        assert r["storage_hit_tokens"] > 0 and r["pages_read"] > 0, r
        assert r["pages_written"] > 0, r
        assert r["faults_injected"] > 0, r
        # at the end: nothing held, nothing in flight, every outcome agreed and applied
        assert r["live_handles"] == 0 and r["facts_pending"] == 0 and r["prefetches_in_flight"] == 0, r
        assert r["writes_in_flight"] == 0 and r["loads_in_flight"] == 0, r
    # what the ranks agreed on is the same; what they saw locally may differ
    for key in ("ticks", "prefetches_started", "prefetch_ends", "storage_hit_tokens", "scheduler_storage_hit",
                "backups_failed", "load_failures", "host_hit_tokens", "device_hit_tokens", "finished", "aborted"):
        assert r0[key] == r1[key], (key, r0[key], r1[key])
    assert r0["prefetch_ends"][PrefetchEnd.COMPLETE.value] > 0, r0
    # each rank stored its share of the heads under keys naming the rank and the group's size
    # (rank 1 of 2 holds other heads than rank 1 of 4), and found it again under them (hits above)
    stored = {m.group(1) for f in (tmp_path / "storage").rglob("*") if f.is_file()
              for m in re.finditer(rb"[0-9a-f]{16}(-r[0-9]+(?:of[0-9]+)?)\0", f.read_bytes())}
    assert stored == {b"-r0of2", b"-r1of2"}, stored


@pytest.mark.timeout(PARENT_DEADLINE_S + 30)
def test_a_rank_passing_a_different_number_of_values_raises_on_every_rank(tmp_path: Path) -> None:
    results = _run_ranks("diverge", tmp_path)
    for r in results:
        assert r["raised"] is not None and "diverged" in r["raised"], r
        assert r["after"] == [10], r  # no rank hung, and the group is still in step


@pytest.mark.timeout(PARENT_DEADLINE_S + 30)
def test_a_lost_rank_is_one_rank_lost_error_at_once_and_then_every_time(tmp_path: Path) -> None:
    r0, r1 = _run_ranks("lose", tmp_path)
    assert r1["raised"] == [], r1
    assert len(r0["raised"]) == 2, r0
    for message, took_s in r0["raised"]:
        assert "rank 0 of 2" in message and "close() this cache" in message, message
        assert took_s < 5.0, r0  # a closed peer is noticed at once, not after the collective timeout
    assert r0["raised"][0][0] == r0["raised"][1][0], r0


# -- Facts: the per-kind ledger of rank-local outcomes -----------------------------------


def test_facts_are_known_in_issue_order_and_taken_with_agreed_values() -> None:
    f = Facts()
    for op in (1, 2, 3):
        f.expect(FactKind.WRITE, op)
    f.expect(FactKind.HIT, 9)
    assert f.known() == (0,) * len(KINDS) and f.pending() == 4
    f.record(FactKind.WRITE, 2, 1)  # out of order: not known until op 1 is
    f.record(FactKind.HIT, 9, 5)
    known = f.known()
    assert known == tuple(1 if k is FactKind.HIT else 0 for k in KINDS)
    f.record(FactKind.WRITE, 1, 0)
    known = f.known()
    assert known[KINDS.index(FactKind.WRITE)] == 2 and known[KINDS.index(FactKind.HIT)] == 1
    assert f.values(known) == (0, 1, 5)  # kinds in KINDS order, ops in issue order
    agreed = list(SingleGroup().all_min(f.values(known)))
    agreed[-1] = 3  # another rank saw fewer hits: the agreed value is what is applied
    taken = f.take(known, tuple(agreed))
    assert taken == [(FactKind.WRITE, 1, 0), (FactKind.WRITE, 2, 1), (FactKind.HIT, 9, 3)]
    assert f.pending() == 1 and f.known() == (0,) * len(KINDS)
    f.record(FactKind.WRITE, 3, 1)
    assert f.take(f.known(), (1,)) == [(FactKind.WRITE, 3, 1)] and f.pending() == 0


def test_a_record_finds_its_operation_without_searching_the_issue_order() -> None:
    # Outcomes recorded behind one still in flight (with several ranks, every outcome of a tick
    # until its agreement) wait in the issue order: a record that searched it for its operation
    # would make n outcomes cost n x n.
    class Unsearchable(deque):  # type: ignore[type-arg]
        def __contains__(self, op: object) -> bool:
            raise AssertionError("a record searched the issue order for its operation")

    f = Facts()
    for kind in KINDS:
        f._order[kind] = Unsearchable()
    for op in range(100):
        f.expect(FactKind.WRITE, op)
    for op in range(1, 100):  # op 0 is still in flight
        f.record(FactKind.WRITE, op, 1)
    assert f.known()[KINDS.index(FactKind.WRITE)] == 0
    f.record(FactKind.WRITE, 0, 1)
    assert f.known()[KINDS.index(FactKind.WRITE)] == 100
    with pytest.raises(InvariantError, match="recorded twice or never issued"):
        f.record(FactKind.WRITE, 100, 1)
    assert len(f.take_local(FactKind.WRITE)) == 100 and f.pending() == 0
    f.check_invariants()


def test_facts_take_fewer_than_known_when_another_rank_knows_less() -> None:
    f = Facts()
    f.expect(FactKind.LOAD, 4)
    f.expect(FactKind.LOAD, 5)
    f.record(FactKind.LOAD, 4, 1)
    f.record(FactKind.LOAD, 5, 1)
    counts = tuple(1 if k is FactKind.LOAD else 0 for k in KINDS)  # the agreed (MIN) count
    assert f.take(counts, (0,)) == [(FactKind.LOAD, 4, 0)]
    assert f.known() == counts and f.values(counts) == (1,)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 3)), min_size=1, max_size=30), st.randoms())
def test_facts_taken_locally_per_kind_equal_a_full_take_after_every_record(
    issued: list[tuple[FactKind, int]], rnd: random.Random
) -> None:
    """With one rank the tree takes the recorded kind only; a full take after every record
    (what several ranks in agreement do) must give the same outcomes in the same order."""
    local, full = Facts(), Facts()
    for op, (kind, _) in enumerate(issued, start=1):
        local.expect(kind, op)
        full.expect(kind, op)
    order = list(enumerate(issued, start=1))
    rnd.shuffle(order)  # outcomes arrive in any order
    for op, (kind, value) in order:
        local.record(kind, op, value)
        full.record(kind, op, value)
        known = full.known()
        assert local.take_local(kind) == full.take(known, full.values(known))
    assert local.pending() == full.pending() == 0


def test_facts_refuse_a_double_record_an_unissued_op_and_a_negative_value() -> None:
    f = Facts()
    f.expect(FactKind.BACKUP, 1)
    f.record(FactKind.BACKUP, 1, 2)
    with pytest.raises(InvariantError, match="twice"):
        f.record(FactKind.BACKUP, 1, 2)
    with pytest.raises(InvariantError, match="never issued"):
        f.record(FactKind.BACKUP, 2, 1)
    f.expect(FactKind.BACKUP, 3)
    with pytest.raises(InvariantError, match=">= 0"):
        f.record(FactKind.BACKUP, 3, -1)


def test_facts_refuse_an_agreement_that_does_not_fit() -> None:
    f = Facts()
    f.expect(FactKind.WRITE, 1)
    f.record(FactKind.WRITE, 1, 1)
    with pytest.raises(InvariantError, match="do not fit"):
        f.take(f.known(), ())  # fewer values than counts
    too_many = tuple(2 if k is FactKind.WRITE else 0 for k in KINDS)
    with pytest.raises(InvariantError, match="diverged"):
        f.take(too_many, (1, 1))


# -- Configs: the ranks of a group decide alike ------------------------------------------


class _ThreadRanks:
    """The ranks of a group as threads of this process: `all_min` meets at a barrier."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=10)
        self._values: list[list[int]] = [[] for _ in range(size)]

    def member(self, rank: int) -> Any:
        ranks = self

        class Member:
            def all_min(self, values: Any) -> list[int]:
                ranks._values[rank] = [int(v) for v in values]
                ranks._barrier.wait()
                met = ranks._values[:]
                ranks._barrier.wait()
                if len({len(v) for v in met}) > 1:  # as TorchGroup does, by its fixed-size first collective
                    raise RankDivergenceError(f"rank {rank}: a collective met ranks passing {[len(v) for v in met]}")
                return [min(vs) for vs in zip(*met)]

        m = Member()
        m.rank, m.size = rank, self.size  # type: ignore[attr-defined]
        return m

    def run(self, fn: Any) -> list[Any]:
        """`fn(group, rank)` on every rank at once; each rank's result or exception."""
        out: list[Any] = [None] * self.size

        def rank_main(rank: int) -> None:
            try:
                out[rank] = fn(self.member(rank), rank)
            except Exception as err:  # the test compares every rank's outcome
                out[rank] = err

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return out


def _tp_config(rank: int, size: int, **fields: Any) -> Config:
    base: dict[str, Any] = {"layers": 1, "kv_heads": 1, "head_dim": 4, "page_size": 4, "device_slots": 64,
                            "host_slots": 128}
    return Config(**{**base, **fields}, tp_rank=rank, tp_size=size)


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_whose_configs_differ_in_what_decides_refuse_to_start_in_one_line(size: int) -> None:
    def start(group: Any, rank: int) -> str:
        # rank-local fields may differ; the model, the page size and the write policy may not
        local = {"kv_heads": 1 + rank, "transfer_pages_max": 8 + rank, "load_ring_size": 2 + rank}
        odd = {"page_size": 8, "model_id": "other", "write_policy": "write_back"} if rank == size - 1 else {}
        with HiCache(_tp_config(rank, size, **local, **odd), runtime=DeterministicRuntime(seed=rank), group=group):
            return "started"

    for rank, out in enumerate(_ThreadRanks(size).run(start)):
        assert isinstance(out, ConfigError), (rank, out)
        assert str(out).startswith(f"rank {rank} of {size}: the ranks' configs differ in model_id, page_size, "
                                   "write_policy (this rank: "), out
        assert "\n" not in str(out), out
    assert "page_size=8, write_policy='write_back')" in str(out), out
    # the same fields on every rank: they start, and agree
    same = _ThreadRanks(size).run(lambda group, rank: _digest(group, rank, size))
    assert all(isinstance(d, str) for d in same) and len(set(same)) == 1, same


def _digest(group: Any, rank: int, size: int) -> str:
    local = {"kv_heads": 1 + rank, "transfer_pages_max": 8 + rank}
    with HiCache(_tp_config(rank, size, **local), runtime=DeterministicRuntime(seed=rank), group=group) as hc:
        hc.sync()
        return hc.tree_digest()[0]


def _served(group: Any, rank: int) -> HiCache:
    """A started rank that cached one prompt, agreed."""
    hc = HiCache(_tp_config(rank, 2), runtime=DeterministicRuntime(seed=rank), group=group).start()
    prompt = list(range(1, 41))
    [res] = hc.admit([Request("a", prompt)])
    hc.allocate({"a": len(prompt)})
    hc.commit({"a": prompt})
    hc.finish([res.handle])
    hc.sync()
    return hc


def test_a_rank_that_restarts_alone_is_refused_instead_of_missing_what_the_others_hit() -> None:
    def run(group: Any, rank: int) -> Any:
        hc = _served(group, rank)
        try:
            if rank == 1:  # an engine restarts this rank's cache; the others go on
                hc.close()
                hc.start()
            hc.sync()
            [res] = hc.admit([Request("b", list(range(1, 41)))])
            return res.cached_tokens
        finally:
            hc.close()

    _every_rank_diverged(run)


def _every_rank_diverged(run: Any) -> list[str]:
    """`run(group, rank)` on two ranks, each of which must raise `RankDivergenceError`; their messages."""
    outs = _ThreadRanks(2).run(run)
    for rank, out in enumerate(outs):
        assert isinstance(out, RankDivergenceError), (rank, out)
        assert "\n" not in str(out), out
    return [str(out) for out in outs]


def test_ranks_that_make_different_agreeing_calls_raise_on_every_rank() -> None:
    def run(group: Any, rank: int) -> Any:
        hc = _served(group, rank)
        try:
            if rank == 0:  # as many values as sync agrees on: only the tags tell the calls apart
                return hc.ready([f"q{i}" for i in range(len(KINDS))])
            hc.sync()
            return "synced"
        finally:
            hc.close()

    for out in _every_rank_diverged(run):
        assert "the ranks made different calls" in out, out


def test_one_ranks_quiesce_timeout_is_every_ranks_and_the_group_stays_in_step() -> None:
    def run(group: Any, rank: int) -> Any:
        hc = _served(group, rank)
        out: list[Any] = []
        if rank == 1:  # this rank's work outlasts the timeout (a slow storage write, say)
            local = hc.system.quiesce

            def slow(timeout_s: float) -> None:
                hc.system.quiesce = local  # type: ignore[method-assign]
                raise TimeoutError(f"still in flight after {timeout_s:g} s: 1 backups")

            hc.system.quiesce = slow  # type: ignore[method-assign]
        try:
            try:
                hc.quiesce(timeout_s=1.0)
                out.append("quiesced")
            except TimeoutError as err:
                out.append(str(err))
            hc.sync()
            out.append(hc.ready(["q"]))
            return out
        finally:
            hc.close()

    r0, r1 = _ThreadRanks(2).run(run)
    assert r1 == ["still in flight after 1 s: 1 backups", {"q": 0}], r1
    assert r0 == ["rank 0 of 2: another rank still had work in flight after 1 s; wait longer (timeout_s) or "
                  "close(drain=False) to drop it", {"q": 0}], r0


# Calls that change one rank's cache with no collective, made differently on one rank: the next
# agreement (here `sync`; `ready` and `quiesce` alike) raises on every rank.
_DIVERGING = {
    "other tokens committed": lambda hc, rank: _admitted(hc, "b", list(range(50, 60)), [7 + rank]),
    "a request admitted on one rank only": lambda hc, rank: _admitted(hc, "b", list(range(50, 60)), [7])
    if rank == 0 else None,
    "another count allocated": lambda hc, rank: hc.allocate({_admitted(hc, "b", list(range(50, 60)), None): 3 + rank}),
    "a finish on one rank only": lambda hc, rank: hc.finish([hc.handle(_admitted(hc, "b", list(range(50, 60)), [7]))])
    if rank == 0 else _admitted(hc, "b", list(range(50, 60)), [7]),
    "an eviction on one rank only": lambda hc, rank: hc.evict_device(8) if rank == 1 else None,
    "the same calls answered differently": lambda hc, rank: _parted_silently(hc, rank),
}


def _parted_silently(hc: HiCache, rank: int) -> None:
    """The digest takes the answers the agreed state decides too: a cache that parted from the
    others with no call that differs (a fault of its own, played here by an eviction kept out
    of the digest) answers the same admission with other hits."""
    hc.quiesce()  # its write to host memory landed: the prompt is evictable
    if rank == 1:
        hc._noting = False
        assert hc.evict_device(64) == 40  # the cached prompt leaves this rank's device memory only
        hc._noting = True
    hc.admit([Request("b", list(range(1, 41)))])  # the same call on both ranks


def _admitted(hc: HiCache, rid: str, prompt: list[int], extra: list[int] | None) -> str:
    """Admit `rid`, allocate and commit its prompt (then `extra` tokens, if any)."""
    [res] = hc.admit([Request(rid, prompt)])
    hc.allocate({rid: len(prompt) - res.cached_tokens + len(extra or [])})
    hc.commit({rid: prompt[res.cached_tokens:] + (extra or [])})
    return rid


@pytest.mark.parametrize("how", _DIVERGING)
def test_ranks_whose_local_calls_differ_raise_on_every_rank_at_the_next_agreement(how: str) -> None:
    def run(group: Any, rank: int) -> Any:
        hc = _served(group, rank)
        try:
            _DIVERGING[how](hc, rank)
            hc.sync()
            return "synced"
        finally:
            hc.close()

    for rank, out in enumerate(_every_rank_diverged(run)):
        assert out.startswith(f"rank {rank} of 2: at its agreement on fact counts, the calls it made since it "
                              "started differ from another rank's"), out


def test_ranks_making_the_same_calls_in_either_form_agree_and_a_restart_of_all_starts_afresh() -> None:
    def run(group: Any, rank: int) -> Any:
        hc = _served(group, rank)
        try:
            [res] = hc.admit([Request("b", list(range(1, 51)))])
            if rank == 0:  # one round trip on this rank, a commit then an allocation on the other: the same calls
                hc.allocate({"b": 10}, commit={"b": []})
            else:
                hc.commit({"b": []})
                hc.allocate({"b": 10})
            hc.commit({"b": list(range(41, 51))})
            hc.quiesce()
            out = [hc.ready(["b"]), hc.tree_digest()]
            hc.finish([res.handle])
            hc.sync()
            hc.close()
            hc.start()  # every rank together: the digests start again
            _admitted(hc, "c", list(range(1, 9)), None)
            hc.sync()
            return out
        finally:
            hc.close()

    r0, r1 = _ThreadRanks(2).run(run)
    assert r0 == r1 and r0[0] == {"b": 0}, (r0, r1)



@pytest.mark.parametrize(("agreeing", "about"), [("ready", "ready"), ("quiesce", "fact counts")])
def test_ready_and_quiesce_compare_the_ranks_calls_too(agreeing: str, about: str) -> None:
    def run(group: Any, rank: int) -> Any:
        hc = _served(group, rank)
        try:
            _DIVERGING["other tokens committed"](hc, rank)
            return hc.ready(["q"]) if agreeing == "ready" else hc.quiesce()
        finally:
            hc.close()

    for rank, out in enumerate(_every_rank_diverged(run)):
        assert out.startswith(f"rank {rank} of 2: at its agreement on {about}, the calls it made since it started "
                              "differ from another rank's"), out
