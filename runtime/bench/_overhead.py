"""`hicache bench overhead`: a batch through the actors vs the same work on the cores.

One tick of a scheduler, for a batch of 64 requests of the embedded Mooncake
conversation trace (prompts cut to at most 4096 tokens, so requests that continue
a conversation share their first blocks): admit the batch, allocate and commit the
tokens the cache did not have, finish the batch.

- **actors**: the `HiCache` facade on the threaded runtime. The tick ends when
  `finish` has returned and the write-throughs it started are acknowledged: the
  bench asks the tree how many writes are in flight, sleeps until that many
  `WriteDone` were delivered (a delivery observer counts them; no polling), asks
  again (a finished write may start its children's), and at the end sends the
  host pool an empty state change, which queues behind every state the tree
  sent it. So the actors do the same work as the direct side within the timed
  tick, and none of it spills into the next measurement.
- **direct**: `TreeCore`, `DeviceCore` and `HostCore` in this thread, with no
  actor. `DirectCores` delivers the tree's outbox synchronously and in order,
  each message to the core method its actor shell calls, and feeds the results
  back to the tree; a write-through's copy goes through a `TransferQueue` like
  the write stream's, so it is split into the same copy batches.

Both sides see the same batches in the same order (their trees grow alike; the
bench checks at the end that their tree statistics are equal), interleaved batch
by batch, alternating which side goes first; the median per batch counts.
`round_trip_p50_us` is the median of a bare `System.ask` (GetStatistics to the
write stream actor, whose statistics are a few counters) on the idle system,
timed in slices after each measured batch.

The KV shape is tiny (32 bytes a token): the bytes are not what is measured.
This is not actor code: it reads `time.perf_counter` and drives the system from
outside, as a scheduler would.
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from rich.table import Table

from hicache.actors import TREE_ROUTES, WRITE_ROUTES, Insufficient, TransferOp, TransferQueue, copy_kv
from hicache.actors._pages import slots_of_pages
from hicache.actors._transfer_core import batch_indices
from hicache.messages import (
    ActorName,
    AdmitItem,
    Admission,
    Admitted,
    FinishItem,
    Finished,
    GetStatistics,
    HostSlotState,
    Indices,
    LedgerEntry,
    Message,
    ReleaseReason,
    SetHostState,
    Tokens,
    TreeStatistics,
    WriteDone,
    WriteKV,
)
from hicache.messages.config import Config, DeviceKind

from ._cli import progress_bar, report
from ._transfer import _machine
from .._facade import HiCache, Request
from .._inline_cores import InlineCores
from .._system import ThreadedRuntime
from ..trace import load_trace

TARGET_RATIO = 1.5
DRAIN_ASKS_MAX = 10_000
"""Most statistics asks while waiting for the write-throughs of one batch."""
DRAIN_WAIT_S = 0.01
"""Longest wait for the expected write acks before the tree is asked again (a failed write never acks)."""


@dataclass(frozen=True, slots=True)
class Workload:
    batch: int
    """Requests admitted, committed and finished together."""
    prompt_tokens_max: int
    """Trace prompts are cut to this many tokens."""
    warmup: int
    """Batches run on both sides before the measured ones."""
    reps: int
    """Measured batches per side."""
    round_trips: int
    """Bare asks timed for `round_trip_p50_us`."""

    @property
    def requests(self) -> int:
        return self.batch * (self.warmup + self.reps)


FULL = Workload(batch=64, prompt_tokens_max=4096, warmup=2, reps=15, round_trips=2000)
QUICK = Workload(batch=64, prompt_tokens_max=1024, warmup=1, reps=2, round_trips=200)
"""A smoke test: short prompts, two measured batches; its figures mean nothing."""


def bench_config(prompts: list[torch.Tensor], batch: int) -> Config:
    """A tiny KV shape; device room for every prompt of the run (nothing is evicted)."""
    page = 16
    slots = sum(len(t) for t in prompts) + 2 * batch * page
    device = -(-slots // page) * page
    return Config(layers=1, kv_heads=1, head_dim=8, dtype="float16", page_size=page,
                  device_slots=device, host_slots=2 * device)


# -- the direct side -----------------------------------------------------------


class DirectCores(InlineCores):
    """`TreeCore`, `DeviceCore` and `HostCore` driven in this thread, no actors.

    Each call does what the facade's call does; the tree's outbox is delivered at
    once, in order, through the receiving actor's route table (the device's and the
    host's call their cores, as their shells do), and the replies go back through
    the tree's (`InlineCores`). Writes are copied at once, in the write stream's batches.
    """

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        # The write stream's op merger/splitter: the same copy batches as the actor's.
        self.writes = TransferQueue(config.transfer_batch_pages * config.page_size, config.transfer_queue_ops_max)

    def admit(self, batch: list[tuple[str, torch.Tensor]]) -> tuple[Admission, ...]:
        op = self._next_id()
        items = tuple(AdmitItem(request_id=rid, namespace="", tokens=Tokens.from_tensor(t)) for rid, t in batch)
        self.tree.admit(op, items)
        reply = self._run_outbox(op)
        assert isinstance(reply, Admitted)
        return reply.admissions

    def admit_tokens(self, batch: list[tuple[str, Tokens]]) -> tuple[Admission, ...]:
        """`admit` of prompts already as `Tokens`."""
        op = self._next_id()
        self.tree.admit(op, tuple(AdmitItem(request_id=rid, namespace="", tokens=t) for rid, t in batch))
        reply = self._run_outbox(op)
        assert isinstance(reply, Admitted)
        return reply.admissions

    def allocate_evicting(self, demands: list[tuple[str, int]]) -> dict[str, Indices]:
        """Slots as the facade gets them: if the pool is short, the tree evicts, then once more."""
        got = self.device.allocate_pages(demands)
        if isinstance(got, Insufficient):
            op = self._next_id()
            self.tree.evict_device(op, got.shortfall_slots)
            self._run_outbox(op)
            got = self.device.allocate_pages(demands)
        if isinstance(got, Insufficient):
            raise RuntimeError(f"bench: no room even after eviction: {got}")
        return got

    def allocate(self, demands: list[tuple[str, int]]) -> dict[str, Indices]:
        got = self.device.allocate_pages(demands)
        if isinstance(got, Insufficient):
            raise RuntimeError(f"bench overhead: the device pool is sized for the run, yet {got}")
        return got

    def finish(self, items: tuple[FinishItem, ...]) -> tuple[LedgerEntry, ...]:
        op = self._next_id()
        self.tree.finish(op, items)
        reply = self._run_outbox(op)
        assert isinstance(reply, Finished)
        return reply.entries

    def _copy_writes(self) -> None:
        """Copy what the write queue holds, batch by batch, as the write stream does."""
        while batch := self.writes.next_batch():
            src, dst = batch_indices(batch)
            copy_kv(self.device.kv, src, self.host.kv, dst)
            for piece in batch:
                if piece.last:
                    done = WriteDone(op_id=piece.op.op_id, slots=piece.op.slots)  # this queue counts slots
                    TREE_ROUTES.deliver(self.tree, ActorName.WRITE, done)

    def _play(self, to: ActorName, message: Message) -> None:
        """The write stream, the one actor with no core here that this workload sends to."""
        if to is not ActorName.WRITE:
            raise AssertionError(f"bench overhead: the direct side plays no {to.value} actor (nothing loads back or "
                                 f"goes to storage in this workload), yet the tree sent it {message!r}")
        WRITE_ROUTES.check(ActorName.TREE, message)
        self._write(message)  # type: ignore[arg-type]

    def _write(self, m: WriteKV) -> None:
        p = self.device.page_size
        src, dst = slots_of_pages(m.device.as_tensor(), p), slots_of_pages(m.host.as_tensor(), p)
        if not self.writes.push(TransferOp(m.op_id, ActorName.TREE, src, dst)):
            raise RuntimeError("bench overhead: the write queue is full")
        self._copy_writes()


# -- one tick on each side -----------------------------------------------------


class WriteAcks:
    """A delivery observer that counts `WriteDone` mail reaching the tree.

    With it the bench waits for the write-throughs in flight without polling: the
    tree's statistics say how many writes are in flight and how many it has
    handled; the bench sleeps until that many acks were delivered, then asks again
    (a write-through that completes may start its children's)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0

    def __call__(self, receiver: ActorName, mail: Any) -> None:
        if receiver is ActorName.TREE and isinstance(mail.message, WriteDone):
            with self._cond:
                self._count += 1
                self._cond.notify_all()

    def wait_for(self, count: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._count >= count, timeout_s)


def _tick_actors(cache: HiCache, acks: WriteAcks, batch: list[tuple[str, torch.Tensor]]) -> int:
    """Admit, allocate, commit, finish, then wait for the write-throughs; the drain asks made."""
    admitted = cache.admit(Request(rid, t) for rid, t in batch)
    cached = {a.request_id: a.cached_tokens for a in admitted}
    got = cache.allocate({rid: len(t) - cached[rid] for rid, t in batch})
    if not isinstance(got, dict):
        raise RuntimeError(f"bench overhead: the device pool is sized for the run, yet {got}")
    cache.commit({rid: t[cached[rid]:] for rid, t in batch})
    cache.finish(a.handle for a in admitted)
    return _drain(cache, acks)


def _drain(cache: HiCache, acks: WriteAcks) -> int:
    system = cache.system
    for asks in range(1, DRAIN_ASKS_MAX + 1):
        s = system.ask(ActorName.TREE, GetStatistics())
        if not (s.writes_in_flight or s.loads_in_flight):
            break
        acks.wait_for(s.backups_done + s.writes_in_flight, DRAIN_WAIT_S)
    else:
        raise RuntimeError(f"bench overhead: write-throughs still in flight after {DRAIN_ASKS_MAX} asks")
    # The tree sent every SetHostState before it answered; an empty one queues behind them.
    system.ask(ActorName.HOST, SetHostState(pages=Indices(), state=HostSlotState.SYNCED), sender=ActorName.TREE)
    return asks + 1


def _tick_direct(cores: DirectCores, batch: list[tuple[str, torch.Tensor]]) -> None:
    admitted = cores.admit(batch)
    cached = {a.request_id: a.device_hit + a.host_hit for a in admitted}
    got = cores.allocate([(rid, len(t) - cached[rid]) for rid, t in batch])
    # committed as the facade does: the release carries the commits (the device hears of them there)
    items = tuple(
        FinishItem(request_id=rid, handle=a.handle, reason=ReleaseReason.FINISHED,
                   tokens=Tokens.from_tensor(t[cached[rid]:]), device=got[rid], allocs=0, commits=len(t) - cached[rid])
        for (rid, t), a in zip(batch, admitted, strict=True)
    )
    cores.finish(items)


# -- the run -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Result:
    batch: int
    actor_ms: float
    direct_ms: float
    round_trip_p50_us: float
    round_trip_p99_us: float
    drain_asks: float
    """Median asks per batch spent waiting for write-throughs (counted in `actor_ms`)."""
    prompt_tokens: float
    """Median prompt tokens per batch."""
    hit_tokens: int
    inserted_tokens: int

    @property
    def ratio(self) -> float:
        return self.actor_ms / self.direct_ms

    def to_json(self) -> dict[str, object]:
        return {
            "batch": self.batch,
            "actor_ms": round(self.actor_ms, 3),
            "direct_ms": round(self.direct_ms, 3),
            "ratio": round(self.ratio, 3),
            "round_trip_p50_us": round(self.round_trip_p50_us, 1),
            "round_trip_p99_us": round(self.round_trip_p99_us, 1),
            "drain_asks": self.drain_asks,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "inserted_tokens": self.inserted_tokens,
        }


def _batches(w: Workload) -> list[list[tuple[str, torch.Tensor]]]:
    prompts = [r.tokens()[: w.prompt_tokens_max] for r in load_trace(w.requests)]
    return [
        [(f"b{b}r{i}", prompts[b * w.batch + i]) for i in range(w.batch)]
        for b in range(w.warmup + w.reps)
    ]


def _round_trips(cache: HiCache, n: int) -> list[float]:
    system = cache.system
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        system.ask(ActorName.WRITE, GetStatistics())
        out.append(time.perf_counter() - t0)
    return out


def _measure(w: Workload, step: Callable[[], None]) -> Result:
    batches = _batches(w)
    config = bench_config([t for b in batches for _, t in b], w.batch)
    cores = DirectCores(config)
    actor_s: list[float] = []
    direct_s: list[float] = []
    drains: list[int] = []
    rtt: list[float] = []
    acks = WriteAcks()
    with HiCache(config, runtime=ThreadedRuntime(observe=acks)) as cache:
        for i, batch in enumerate(batches):
            gc.collect()
            sides = ("actors", "direct") if i % 2 == 0 else ("direct", "actors")
            times = {}
            for side in sides:
                t0 = time.perf_counter()
                if side == "actors":
                    asks = _tick_actors(cache, acks, batch)
                else:
                    _tick_direct(cores, batch)
                times[side] = time.perf_counter() - t0
            if i >= w.warmup:
                actor_s.append(times["actors"])
                direct_s.append(times["direct"])
                drains.append(asks)
                # spread over the run, so a burst of load on the machine weighs on a few of them
                rtt += _round_trips(cache, w.round_trips // w.reps)
            step()
        rtt.sort()
        actor_tree = cache.statistics().tree
        cache.check_invariants()
    direct_tree = cores.tree.statistics()
    cores.tree.check_invariants()
    cores.device.check_invariants()
    cores.host.check_invariants()
    _expect_same_work(actor_tree, direct_tree)
    return Result(
        batch=w.batch,
        actor_ms=statistics.median(actor_s) * 1e3,
        direct_ms=statistics.median(direct_s) * 1e3,
        round_trip_p50_us=rtt[len(rtt) // 2] * 1e6,
        round_trip_p99_us=rtt[min(len(rtt) - 1, int(len(rtt) * 0.99))] * 1e6,
        drain_asks=statistics.median(drains),
        prompt_tokens=statistics.median(sum(len(t) for _, t in b) for b in batches[w.warmup:]),
        hit_tokens=direct_tree.device_hit_tokens,
        inserted_tokens=direct_tree.device_tokens,
    )


def _expect_same_work(actors: TreeStatistics, direct: TreeStatistics) -> None:
    if actors != direct:
        raise RuntimeError(
            f"bench overhead: the two sides did different work; tree statistics through the actors {actors}, "
            f"directly {direct}"
        )


def _table(r: Result, w: Workload, machine: dict[str, object]) -> Table:
    t = Table(
        title=f"overhead: a tick of {r.batch} requests (admit, allocate, commit, finish), median of {w.reps}"
        + (" (--quick: a smoke test, not a figure)" if w is QUICK else ""),
        caption=(
            f"{machine['cpu_count']} x {machine['cpu_model']}, {machine['memory_gib']} GiB, "
            f"torch {machine['torch']}; target: ratio <= {TARGET_RATIO}"
        ),
    )
    for col in ("figure", "value"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    mark = " (> target)" if w is FULL and r.ratio > TARGET_RATIO else ""
    rows = (
        ("through the actors (ms)", f"{r.actor_ms:.2f}"),
        ("directly on the cores (ms)", f"{r.direct_ms:.2f}"),
        ("ratio", f"{r.ratio:.2f}{mark}"),
        ("bare ask round trip p50 (us)", f"{r.round_trip_p50_us:.0f}"),
        ("bare ask round trip p99 (us)", f"{r.round_trip_p99_us:.0f}"),
        ("drain asks per tick (median)", f"{r.drain_asks:g}"),
        ("prompt tokens per tick (median)", f"{r.prompt_tokens:,.0f}"),
        ("tokens hit / inserted over the run", f"{r.hit_tokens:,} / {r.inserted_tokens:,}"),
    )
    for row in rows:
        t.add_row(*row)
    return t


def run_bench_overhead(*, as_json: bool, quick: bool) -> int:
    w = QUICK if quick else FULL
    progress = progress_bar(as_json)
    with progress:
        task = progress.add_task("overhead", total=w.warmup + w.reps)
        result = _measure(w, lambda: progress.advance(task))
    machine = _machine(DeviceKind.CPU)
    table = _table(result, w, machine)
    body = {
        **result.to_json(),
        "machine": machine,
        "workload": {
            "batch": w.batch, "prompt_tokens_max": w.prompt_tokens_max, "warmup": w.warmup,
            "reps": w.reps, "round_trips": w.round_trips, "quick": quick,
        },
    }
    return report(table, body, as_json=as_json)
