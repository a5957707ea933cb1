"""Schedule exploration: run scenarios under many seeded interleavings and report failures.

Each schedule runs a scenario on the deterministic runtime with a strategy (PCT or
random) and a seed, with every actor's `check_invariants()` after every delivery,
the fingerprint oracle on every cached read, and quiescence checks at the end (no
lock held, nothing in flight, slots conserved; the statistics' hits are those the
scheduler was served). A failure is written down as a
schedule trace (the strategy's choices, with scenario, seed and mutant) and a
delivery log, and `hicache explore --replay TRACE` runs exactly that schedule
again.

Python API::

    report = explore("standard", strategy="pct", seeds=range(100))
    result = run_schedule("standard", seed=7, strategy="pct")
    result = replay(Path("trace.json"))

A `Scenario` of one's own (an engine's scheduler over `HiCache`) goes wherever a scenario's
name does: `explore(Scenario("mine", "...", run), seeds=range(50))`, and
`replay(trace, scenario=...)` runs its trace again.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy
import torch

from hicache.actors._actor import HiActor, Mail
from hicache.actors._services import SeededFaults
from hicache.messages import ActorName, HostSlotState, encode
from hicache.messages.config import Config, EvictionPolicy, PrefetchPolicy, WritePolicy

from ._deterministic import DeterministicRuntime
from .._facade import CacheHandle, HiCache, Request, RequestError
from .._facade_types import shown
from ._mutants import MUTANTS, Mutant, mutant
from ._scheduler import ReferenceScheduler, SchedulerConfig, ServeRequest, ServedTotals
from ._strategies import PCTStrategy, RandomStrategy, ReplayStrategy, Strategy

DEFAULT_PCT_STEPS = 3000
"""PCT's estimate of a schedule's length (change points are drawn within it)."""

TRACE_VERSION = 1


class QuiescenceError(AssertionError):
    """At the end of a scenario something is still held, in flight or unaccounted for."""


@dataclass(frozen=True, slots=True)
class Scenario:
    """A workload run once per schedule: `run(runtime, seed, mutant)` starts a `HiCache` on
    `runtime` (with `actor_classes=mutant.actor_classes` when `mutant` is not None), drives it,
    and raises on anything wrong. Exploration calls it once per seed; the seed also seeds what
    the workload draws, so that a seed and its choices repeat the run."""

    name: str
    description: str
    run: Callable[[DeterministicRuntime, int, Mutant | None], None]


@dataclass(slots=True)
class ScheduleResult:
    scenario: str
    seed: int
    strategy: str
    depth: int
    mutant: str | None
    choices: list[str]
    deliveries: int
    digest: str
    error: str | None = None
    error_type: str | None = None
    log: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass(slots=True)
class ExploreReport:
    scenario: str
    strategy: str
    seeds: int
    failures: list[ScheduleResult]
    elapsed_s: float
    deliveries: int
    deterministic: bool

    @property
    def schedules_per_s(self) -> float:
        return self.seeds / self.elapsed_s if self.elapsed_s else 0.0


# -- scenarios -------------------------------------------------------------------------------


def synthetic_workload(
    seed: int, n: int, page: int, *, blocks: int = 5, blocks_per_prompt: int = 3, tail_pages: int = 2,
    outputs_max: int = 5,
) -> list[ServeRequest]:
    """`n` requests whose prompts are 1..`blocks_per_prompt` blocks (of two pages) drawn from
    `blocks` shared ones, then up to `tail_pages` pages of their own: prefixes repeat."""
    rng = random.Random(f"workload:{seed}")
    shared = [[rng.randrange(32_000) for _ in range(2 * page)] for _ in range(blocks)]
    out = []
    for i in range(n):
        prompt: list[int] = []
        for _ in range(rng.randint(1, blocks_per_prompt)):
            prompt += rng.choice(shared)
        prompt += [rng.randrange(32_000) for _ in range(rng.randint(1, tail_pages * page))]
        out.append(ServeRequest(f"q{i}", torch.tensor(prompt), rng.randint(1, outputs_max)))
    return out


CHECKED = {"check_kv_writes": True, "check_kv_reads": True}
"""Every scenario's fake model has its K/V writes and reads checked (`Config.check_kv_writes`,
`check_kv_reads`): a slot it is given that is shared, stale or free, or a layer it reads before
the layer's load-back landed, fails the schedule."""


def _standard(rt: DeterministicRuntime, seed: int, mut: Mutant | None) -> None:
    _serve_workload(rt, seed, mut)


def _faults(rt: DeterministicRuntime, seed: int, mut: Mutant | None) -> None:
    rt.services.faults = SeededFaults(seed, transfer_fail_rate=0.08, host_exhausted_rate=0.1)
    _serve_workload(rt, seed, mut)


def _serve_workload(rt: DeterministicRuntime, seed: int, mut: Mutant | None) -> None:
    policy = (WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_THROUGH_SELECTIVE, WritePolicy.WRITE_BACK)[seed % 3]
    cfg = Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=4 * 24, host_slots=4 * 48,
                 write_policy=policy, load_back_min_tokens=4, transfer_pages_max=2, **CHECKED)
    with HiCache(cfg, runtime=rt, actor_classes=mut.actor_classes if mut else None) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(
            max_running=4, prefill_tokens_per_tick=16, chunk_tokens=8, abort_rate=0.04, seed=seed,
            lookahead_slots=2, device_budget_ratio=2.0,
        ))
        sched.submit(synthetic_workload(seed, 12, cfg.page_size))
        sched.run(on_tick=lambda s: hc.check_invariants())
        _check_end(hc, sched)


def _pressure(rt: DeterministicRuntime, seed: int, mut: Mutant | None) -> None:
    """16 requests on a device of 25 pages under priority eviction, admitted at twice what the
    device holds: the newest request is retracted while its load-back is still in flight, and
    the allocation after must wait for that load. Even seeds: write_back, pages of 2 tokens; odd
    seeds: write_through, pages of 1 (a request's match splits a node under write, so the
    write's upper part stays locked by the request when it lands)."""
    policy, page = ((WritePolicy.WRITE_BACK, 2), (WritePolicy.WRITE_THROUGH, 1))[seed % 2]
    cfg = Config(layers=2, kv_heads=1, head_dim=8, page_size=page, device_slots=page * 25, host_slots=page * 46,
                 write_policy=policy, eviction_policy=EvictionPolicy.PRIORITY, ahead_slots=2,
                 load_back_min_tokens=1, **CHECKED)
    with HiCache(cfg, runtime=rt, actor_classes=mut.actor_classes if mut else None) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(
            max_running=7, prefill_tokens_per_tick=47, chunk_tokens=26, seed=seed, device_budget_ratio=2.0,
            prefetch_window=1,
        ))
        sched.submit(synthetic_workload(seed, 16, cfg.page_size, blocks=4, blocks_per_prompt=3, tail_pages=3,
                                        outputs_max=6))
        sched.run(on_tick=lambda s: hc.check_invariants())
        _check_end(hc, sched)


def _orphans(rt: DeterministicRuntime, seed: int, mut: Mutant | None) -> None:
    """22 requests of short prompts on prefixes of two blocks, served twice, prefilled two tokens a
    chunk, with requests often dropped right after admission: their load-backs stay queued (the
    load queue holds one operation), the next load is refused, and running requests cache prefixes
    that those queued loads bring in; the scheduler sometimes quiesces between admitting and
    starting load-backs (the quiesce starts them, and no forward pass waits on that batch).
    Write_through or write_back by the seed."""
    policy = (WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_BACK)[seed % 2]
    cfg = Config(layers=2, kv_heads=1, head_dim=8, page_size=2, device_slots=2 * 12, host_slots=2 * 31,
                 write_policy=policy, load_back_min_tokens=1, transfer_queue_ops_max=1, **CHECKED)
    with HiCache(cfg, runtime=rt, actor_classes=mut.actor_classes if mut else None) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(
            max_running=5, prefill_tokens_per_tick=8, chunk_tokens=2, abort_rate=0.08, seed=seed,
            lookahead_slots=1, device_budget_ratio=2.0, prefetch_window=1, quiesce_rate=0.3,
        ))
        work = synthetic_workload(seed, 22, cfg.page_size, blocks=2, blocks_per_prompt=4, tail_pages=1, outputs_max=3)
        sched.submit(work)
        sched.run(on_tick=lambda s: hc.check_invariants())
        sched.submit([ServeRequest(f"again-{r.request_id}", r.prompt, r.output_tokens) for r in work])
        sched.run(on_tick=lambda s: hc.check_invariants())
        _check_end(hc, sched)


def _overlap(rt: DeterministicRuntime, seed: int, mut: Mutant | None) -> None:
    """The orphans' workload (short prompts on shared prefixes, host-only between turns) under an
    overlap scheduler: half the ticks admit the next tick's requests while the forward pass
    runs, so their prefixes are often pages this tick's load-backs are still bringing in, and
    12% of copy batches fail. Write_through or write_back by the seed."""
    rt.services.faults = SeededFaults(seed, transfer_fail_rate=0.12, host_exhausted_rate=0.0)
    policy = (WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_BACK)[seed % 2]
    cfg = Config(layers=2, kv_heads=1, head_dim=8, page_size=2, device_slots=2 * 16, host_slots=2 * 40,
                 write_policy=policy, load_back_min_tokens=1, **CHECKED)
    with HiCache(cfg, runtime=rt, actor_classes=mut.actor_classes if mut else None) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(
            max_running=5, prefill_tokens_per_tick=8, chunk_tokens=4, abort_rate=0.04, seed=seed,
            device_budget_ratio=2.0, overlap_rate=0.5,
        ))
        work = synthetic_workload(seed, 16, cfg.page_size, blocks=2, blocks_per_prompt=4, tail_pages=1, outputs_max=3)
        sched.submit(work)
        sched.run(on_tick=lambda s: hc.check_invariants())
        hc.quiesce()
        hc.evict_device(cfg.device_slots)  # the second turn finds the prefixes in host memory only
        hc.check_invariants()
        sched.submit([ServeRequest(f"again-{r.request_id}", r.prompt, r.output_tokens) for r in work])
        sched.run(on_tick=lambda s: hc.check_invariants())
        _check_end(hc, sched)


EXPLORE_MODEL_ID = "hicache-explore"
"""The model the storage scenario's KV is of (the reference scheduler's fingerprints): what its keys name."""


def _storage(rt: DeterministicRuntime, seed: int, mut: Mutant | None) -> None:
    """The workload on a host tier too small for it, with a file L3 in a fresh directory, twice:
    the first pass backs its pages up to storage, then L1 and L2 are emptied and the second pass
    prefetches them under the policy of the seed (reads delayed in virtual time, some failing),
    aborting some prefetching requests. On odd seeds an admission loads back at most one
    block: under host pages that a request of the second pass wrote, the pages a prefetch
    brought stay in host memory (its L3 hit is then less than what it read)."""
    rt.services.faults = SeededFaults(seed, transfer_fail_rate=0.0, host_exhausted_rate=0.0,
                                      storage_fail_rate=0.05, storage_delay_s=0.02)
    policy = list(PrefetchPolicy)[seed % 3]
    writes = (WritePolicy.WRITE_BACK, WritePolicy.WRITE_THROUGH_SELECTIVE, WritePolicy.WRITE_THROUGH)[seed // 3 % 3]
    quota = {"load_back_quota_tokens": 8} if seed % 2 else {}
    with tempfile.TemporaryDirectory(prefix="hicache-explore-l3-") as tmp:
        cfg = Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=4 * 16, host_slots=4 * 24,
                     load_back_min_tokens=4, transfer_pages_max=2, storage="file", storage_dir=tmp, write_policy=writes,
                     model_id=EXPLORE_MODEL_ID,
                     storage_batch_pages=2, storage_batch_mb=0, prefetch_threshold_pages=1, prefetch_policy=policy,
                     prefetch_timeout_base_s=0.01, prefetch_timeout_per_1k_s=0.5, prefetch_timeout_max_s=0.05,
                     **quota, **CHECKED)
        with HiCache(cfg, runtime=rt, actor_classes=mut.actor_classes if mut else None) as hc:
            sched = ReferenceScheduler(hc, SchedulerConfig(
                max_running=3, prefill_tokens_per_tick=16, chunk_tokens=8, abort_rate=0.03, seed=seed,
                device_budget_ratio=2.0, prefetch_window=4, tick_s=0.005,
            ))
            work = synthetic_workload(seed, 10, cfg.page_size, blocks=4, blocks_per_prompt=3)
            sched.submit(work)
            sched.run(on_tick=lambda s: hc.check_invariants())
            hc.quiesce()
            hc.evict_device(cfg.device_slots)  # the second pass finds the prefixes in storage only
            hc.evict_host(cfg.host_slots)
            hc.check_invariants()
            sched.submit([ServeRequest(f"again-{r.request_id}", r.prompt, r.output_tokens) for r in work])
            sched.run(on_tick=lambda s: hc.check_invariants())
            _check_end(hc, sched)


def _misuse(rt: DeterministicRuntime, seed: int, mut: Mutant | None) -> None:
    """The standard workload with a bad call after most ticks: each must be one `RequestError`
    that changes nothing (every actor's statistics are the same after it), and the
    workload goes on to a quiet end."""
    rng = random.Random(f"misuse:{seed}")
    policy = (WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_THROUGH_SELECTIVE, WritePolicy.WRITE_BACK)[seed % 3]
    cfg = Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=4 * 24, host_slots=4 * 48,
                 write_policy=policy, load_back_min_tokens=4, transfer_pages_max=2, **CHECKED)
    with HiCache(cfg, runtime=rt, actor_classes=mut.actor_classes if mut else None) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(
            max_running=4, prefill_tokens_per_tick=16, chunk_tokens=8, abort_rate=0.04, seed=seed,
            lookahead_slots=2, device_budget_ratio=2.0,
        ))

        def tick(s: ReferenceScheduler) -> None:
            hc.check_invariants()
            if rng.random() < 0.7:
                misuse(hc, s, rng)
                hc.check_invariants()

        sched.submit(synthetic_workload(seed, 12, cfg.page_size))
        sched.run(on_tick=tick)
        _check_end(hc, sched)


def _bad_calls(hc: HiCache, sched: ReferenceScheduler) -> list[Callable[[], Any]]:
    """Calls a scheduler must never make; each one is refused."""
    live = sorted(hc.live_requests)
    rid = live[0] if live else "q0"
    handle = hc.handle(rid) if live else CacheHandle("q0", 1)
    return [
        lambda: hc.admit([Request(rid, [1, 2, 3], namespace=None)]),  # type: ignore[arg-type]
        lambda: hc.admit([Request("x", [1.5, 2.5])]),  # type: ignore[list-item]
        lambda: hc.admit([Request("x", [1, True])]),
        lambda: hc.admit([Request("x", [2**63])]),
        lambda: hc.admit([Request("x", torch.tensor([[1, 2]]))]),
        lambda: hc.prefetch([Request("x", ["a"])]),  # type: ignore[list-item]
        lambda: hc.evict_device("x"),  # type: ignore[arg-type]
        lambda: hc.evict_host(None),  # type: ignore[arg-type]
        lambda: hc.evict_host(-3),
        lambda: hc.allocate({rid: True}),
        lambda: hc.allocate({rid: 10**30}),
        lambda: hc.allocate({"never-admitted": 4}),
        lambda: hc.commit({rid: [0.5]}),  # type: ignore[list-item]
        lambda: hc.commit({rid: list(range(10**4))}),  # more than it allocated
        lambda: hc.finish([CacheHandle(rid, 10**6)]),  # forged
        lambda: hc.finish([handle, handle]),
        lambda: hc.finish(["not-a-handle"]),  # type: ignore[list-item]
        lambda: hc.abort(["not-prefetching"]),
        lambda: hc.cache_unfinished([CacheHandle("never-admitted", 1)]),
        lambda: hc.ready(None),  # type: ignore[arg-type]
        lambda: hc.evict_device(numpy.array([1.0])),  # type: ignore[arg-type]
        lambda: hc.allocate({rid: torch.tensor([[1, 2]])}),  # type: ignore[dict-item]
        lambda: hc.allocate({rid: 1}, commit=torch.tensor([[1, 2]])),  # type: ignore[arg-type]
        lambda: hc.quiesce("soon"),  # type: ignore[arg-type]
        lambda: hc.close(timeout_s=[1.0]),  # type: ignore[arg-type]
        lambda: hc.admit([Request(rid, [1, 2, 3])]) if live else hc.allocate({"x": -1}),  # admitted twice
    ]


def misuse(hc: HiCache, sched: ReferenceScheduler, rng: random.Random) -> None:
    """One bad call drawn at random: a `RequestError`, and every actor's statistics unchanged."""
    calls = _bad_calls(hc, sched)
    call = calls[rng.randrange(len(calls))]
    settle = getattr(hc.system.runtime, "run_until_idle", None)
    if settle is not None:
        settle()  # what is in flight lands first: only the bad call could change anything below
    before = hc.statistics()
    try:
        call()
    except RequestError:
        pass
    else:
        raise AssertionError("a bad call was accepted")
    after = hc.statistics()
    if (after.tree, after.device, after.host) != (before.tree, before.device, before.host):
        raise AssertionError(f"a refused call changed the cache: {before} -> {after}")


SCENARIOS: dict[str, Scenario] = {
    "standard": Scenario(
        "standard",
        "12 requests with shared prefixes through the reference scheduler on tiny pools: admissions, "
        "chunked prefill, decode with lookahead slots, finish, retraction, abort, device and host "
        "eviction, load-back; the write policy rotates with the seed",
        _standard,
    ),
    "faults": Scenario(
        "faults",
        "the standard workload with seeded faults: 8% of copy batches fail (write-throughs are "
        "abandoned, failed load-backs make the scheduler retract) and 10% of host reservations are "
        "refused as if the pool were full",
        _faults,
    ),
    "misuse": Scenario(
        "misuse",
        "the standard workload with a bad call after most ticks (malformed tokens, ids, namespaces, "
        "counts (arrays and tensors too) and timeouts, forged and repeated handles, unknown requests, commits "
        "past the allocation): each is one RequestError that changes nothing, and the workload ends quiet",
        _misuse,
    ),
    "pressure": Scenario(
        "pressure",
        "16 requests on a device of 25 pages, admitted at twice what it holds, under priority eviction "
        "and pages held ahead, write_back (pages of 2 tokens) or write_through (pages of 1) by the seed: "
        "retractions of requests whose load-backs are in flight, writes whose upper nodes a request "
        "locks, and allocations that must wait for those loads and writes to land",
        _pressure,
    ),
    "orphans": Scenario(
        "orphans",
        "22 requests on 12 device pages, served twice in chunks of two tokens, many dropped right after "
        "admission: load-backs nobody started hold the load queue (one operation), the next one is refused, "
        "and running requests cache prefixes those loads bring in",
        _orphans,
    ),
    "overlap": Scenario(
        "overlap",
        "16 requests on 16 device pages, served twice (host-only in between) by a scheduler that admits "
        "the next tick's requests during half the forward passes, with 12% of copy batches failing: "
        "prefixes that a load-back still in flight brings in, waited on by the next tick",
        _overlap,
    ),
    "storage": Scenario(
        "storage",
        "10 requests with shared prefixes on small pools with a file L3, served twice with L1 and L2 "
        "emptied in between: backups to storage after write-through, then prefetches under the seed's "
        "policies (write and prefetch policies rotate; timeouts in virtual time) with delayed and failing reads, "
        "aborts mid-prefetch, load-back of prefetched pages checked by the oracle",
        _storage,
    ),
}


def check_quiescent(hc: HiCache) -> None:
    """Nothing live, nothing in flight, no lock held, every slot accounted for."""
    s = hc.statistics()
    cfg = hc.config
    problems = []
    if s.tree.live_handles or s.tree.protected_tokens:
        problems.append(f"{s.tree.live_handles} handles live, {s.tree.protected_tokens} tokens protected")
    if s.tree.writes_in_flight or s.tree.loads_in_flight:
        problems.append(f"{s.tree.writes_in_flight} writes and {s.tree.loads_in_flight} loads in flight")
    if s.tree.prefetches_in_flight or s.prefetch.in_flight or s.tree.facts_pending:
        problems.append(f"{s.tree.prefetches_in_flight} prefetches in the tree, {s.prefetch.in_flight} in the "
                        f"prefetcher, {s.tree.facts_pending} outcomes not applied")
    if s.device.request_slots or s.device.loading_slots or s.device.live_requests:
        problems.append(f"device: {s.device.request_slots} slots still request-owned, "
                        f"{s.device.loading_slots} loading, {s.device.live_requests} ledgers live")
    if s.device.tree_slots != s.tree.device_tokens or s.device.free_slots + s.device.tree_slots != cfg.device_slots:
        problems.append(f"device: {s.device.tree_slots} tree-owned slots but the tree holds {s.tree.device_tokens}")
    held = cfg.host_slots - s.host.slots_in(HostSlotState.FREE)
    if held != s.tree.host_tokens:
        problems.append(f"host: {held} slots held but the tree holds {s.tree.host_tokens}")
    if problems:
        raise QuiescenceError("not quiescent at the end: " + "; ".join(problems))


def _check_end(hc: HiCache, sched: ReferenceScheduler) -> None:
    """A scenario's end: the cache quiesced, then its invariants, quiescence and statistics checked."""
    hc.quiesce()
    hc.check_invariants()
    check_quiescent(hc)
    check_served(hc, sched.served)


def check_served(hc: HiCache, want: ServedTotals) -> None:
    """Once the cache is quiet, each tier's figures are what the scheduler's admissions looked up
    and were served (`ReferenceScheduler.served`): a host hit counts once the load-back it waited
    for landed (one that failed is no tier's hit); those of requests dropped before their loads
    started may count or not."""
    s = hc.statistics()
    l3 = s.l3.hit_tokens if s.l3 else 0
    host = l3 + (s.l2.hit_tokens if s.l2 else 0)
    if ((s.looked_up_tokens, s.l1.hit_tokens) != (want.looked_up, want.device_hit)
            or not want.host_hit <= host <= want.host_hit + want.unseen_host_hit
            or not want.storage_hit <= l3 <= want.storage_hit + want.unseen_storage_hit):
        raise QuiescenceError(
            f"statistics differ from what the admissions were served: looked up {s.looked_up_tokens}, "
            f"L1 hit {s.l1.hit_tokens}, L2+L3 hit {host}, L3 hit {l3}; the scheduler saw {want.looked_up} looked "
            f"up, {want.device_hit} device hit, {want.host_hit} host hit landed (+{want.unseen_host_hit} unseen), "
            f"{want.storage_hit} storage hit (+{want.unseen_storage_hit} unseen)")


# -- one schedule ------------------------------------------------------------------------------


def make_strategy(name: str, seed: int, depth: int, steps: int = DEFAULT_PCT_STEPS) -> Strategy:
    if name == "pct":
        return PCTStrategy(seed, depth=depth, steps=steps)
    if name == "random":
        return RandomStrategy(seed)
    raise ValueError(f"unknown strategy {name!r}; use pct or random")


def run_schedule(
    scenario: str | Scenario,
    seed: int,
    strategy: str = "pct",
    depth: int = 3,
    mutant_name: str | None = None,
    choices: list[str] | None = None,
    keep_log: bool = False,
) -> ScheduleResult:
    """Run one schedule of a scenario (a name in `SCENARIOS`, or a `Scenario` of one's own); the
    result says whether it failed, and how to replay it."""
    scen = _scenario(scenario)
    mut = mutant(mutant_name) if mutant_name else None
    strat: Strategy = ReplayStrategy(choices) if choices is not None else make_strategy(strategy, seed, depth)
    digest = hashlib.sha256()
    log: list[dict[str, Any]] = []
    count = 0

    def observe(receiver: ActorName, mail: Mail) -> None:
        nonlocal count
        count += 1
        body = encode(mail.message)
        digest.update(receiver.value.encode() + b"|" + mail.sender.value.encode() + b"|" + body)
        if keep_log:
            log.append({"seq": count, "t": rt.clock.now_s(), "receiver": receiver.value,
                        "sender": mail.sender.value, "type": type(mail.message).__name__,
                        "body": base64.b64encode(body).decode()})

    rt = DeterministicRuntime(seed=seed, strategy=strat, observe=observe)
    rt.after_step = _check_actor
    result = ScheduleResult(scen.name, seed, strategy if choices is None else "replay", depth, mutant_name,
                            [], 0, "")
    try:
        scen.run(rt, seed, mut)
    except Exception as err:  # noqa: BLE001 - every failure of a schedule is its result
        result.error = f"{type(err).__name__}: {err}"
        cause = err.__cause__
        if cause is not None and str(cause) not in str(err):
            result.error += f" (caused by {type(cause).__name__}: {cause})"
        result.error_type = type(err).__name__
    result.choices = [s.actor for s in rt.schedule]
    result.deliveries = count
    result.digest = digest.hexdigest()
    result.log = log
    return result


def _check_actor(actor: Any) -> None:
    if isinstance(actor, HiActor):
        actor.check_invariants()


def _scenario(name: str | Scenario) -> Scenario:
    if isinstance(name, Scenario):
        return name
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)} (or pass a Scenario of "
                         "your own)") from None


# -- many schedules ------------------------------------------------------------------------------


def explore(
    scenario: str | Scenario = "standard",
    strategy: str = "pct",
    seeds: Iterable[int] = range(100),
    depth: int = 3,
    mutant_name: str | None = None,
    stop_at_first: bool = False,
    on_schedule: Callable[[ScheduleResult], None] | None = None,
) -> ExploreReport:
    """Run `scenario` (a name in `SCENARIOS`, or a `Scenario` of one's own) once per seed under
    `strategy`; the first seed runs twice, and `deterministic` says whether both runs agreed."""
    scenario = _scenario(scenario)
    seed_list = list(seeds)
    failures: list[ScheduleResult] = []
    deliveries = 0
    deterministic = True
    t0 = time.perf_counter()
    for i, seed in enumerate(seed_list):
        res = run_schedule(scenario, seed, strategy, depth, mutant_name)
        deliveries += res.deliveries
        if i == 0:  # the nondeterminism self-check: the same schedule twice, the same log
            again = run_schedule(scenario, seed, strategy, depth, mutant_name)
            deterministic = again.digest == res.digest and again.choices == res.choices
        if on_schedule is not None:
            on_schedule(res)
        if res.failed:
            failures.append(res)
            if stop_at_first:
                seed_list = seed_list[: i + 1]
                break
    return ExploreReport(scenario.name, strategy, len(seed_list), failures, time.perf_counter() - t0, deliveries,
                         deterministic)


def write_failure(res: ScheduleResult, out_dir: Path, scenario: Scenario | None = None) -> tuple[Path, Path]:
    """The schedule trace and the delivery log of a failed schedule; returns their paths. A
    schedule of a `Scenario` of one's own, run without `keep_log`, needs that `scenario` to be
    run again for its log."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{res.scenario}-{res.strategy}-seed{res.seed}" + (f"-{res.mutant}" if res.mutant else "")
    trace = out_dir / f"{stem}.trace.json"
    logf = out_dir / f"{stem}.log.jsonl"
    trace.write_text(json.dumps({
        "version": TRACE_VERSION, "scenario": res.scenario, "seed": res.seed, "strategy": res.strategy,
        "depth": res.depth, "mutant": res.mutant, "error": res.error, "choices": res.choices,
    }))
    full = res if res.log else run_schedule(_named(res.scenario, scenario), res.seed, choices=res.choices,
                                            mutant_name=res.mutant, keep_log=True)
    logf.write_text("".join(json.dumps(line) + "\n" for line in full.log))
    return trace, logf


def replay(trace_path: Path, keep_log: bool = False, scenario: Scenario | None = None) -> ScheduleResult:
    """Run the schedule recorded in a trace file again, choice for choice; a trace of a
    `Scenario` of one's own needs that `scenario` (of the name the trace records). A file that
    is not a schedule trace (another JSON value, a field of the wrong type) is a ValueError
    naming the file and the field."""
    data = _read_trace(Path(trace_path))
    return run_schedule(_named(data["scenario"], scenario, trace_path), data["seed"], data.get("strategy", "pct"),
                        data.get("depth", 3), data.get("mutant"), choices=data["choices"], keep_log=keep_log)


class _ScenarioUnknown(ValueError):
    """A recorded schedule of a scenario that is not hicache's, replayed without it."""


def _named(name: str, scenario: Scenario | None, trace: Path | None = None) -> str | Scenario:
    """The scenario a recorded schedule names: `scenario` if given (it must bear that name), else
    the one in `SCENARIOS`."""
    if scenario is None:
        if name not in SCENARIOS:
            where = f"{trace}: " if trace is not None else ""
            raise _ScenarioUnknown(f"{where}scenario {name!r} is not one of hicache's ({', '.join(SCENARIOS)}): "
                                   "`replay(trace, scenario=...)` (hicache.runtime.explore), given the Scenario it "
                                   "was recorded with, runs it")
        return name
    if scenario.name != name:
        where = f"{trace}" if trace is not None else "the schedule"
        raise ValueError(f"{where} was recorded with scenario {name!r}, not {scenario.name!r}")
    return scenario


TRACE_BYTES_MAX = 64 << 20
"""Largest schedule trace `replay` reads: millions of choices; a device or a stray binary is
refused at this size rather than read whole into memory."""


@dataclass(frozen=True, slots=True)
class _TraceField:
    required: bool
    ok: Callable[[Any], bool]
    want: str
    """What the value must be, as the refusal says it."""


_TRACE_FIELDS = {
    "scenario": _TraceField(True, lambda v: isinstance(v, str), "a scenario name"),
    "seed": _TraceField(True, lambda v: type(v) is int and v >= 0, "an integer >= 0"),
    "depth": _TraceField(False, lambda v: type(v) is int and v >= 1, "an integer >= 1"),
    "mutant": _TraceField(False, lambda v: v is None or isinstance(v, str), "a mutant name or null"),
    "choices": _TraceField(True, lambda v: isinstance(v, list) and all(isinstance(c, str) for c in v),
                           "a list of actor names"),
}
"""The fields `replay` runs on (`strategy` and `error` are only recorded)."""


def _read_trace(path: Path) -> dict[str, Any]:
    """The trace's JSON object, its version and the fields `replay` runs on checked, so that a
    trace edited by hand or cut short is refused by name, not somewhere inside the scenario."""
    try:
        with path.open("rb") as f:
            raw = f.read(TRACE_BYTES_MAX + 1)
        if len(raw) > TRACE_BYTES_MAX:
            raise ValueError(f"larger than {TRACE_BYTES_MAX >> 20} MiB")
        data = json.loads(raw)
    except RecursionError:
        raise ValueError(f"cannot read schedule trace {path}: JSON nested too deeply") from None
    except (OSError, ValueError) as err:  # ValueError: not UTF-8, not JSON, too large
        raise ValueError(f"cannot read schedule trace {path}: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level is {_json_kind(data)}, not the object a schedule trace is")
    version = data.get("version")
    if type(version) is not int or version != TRACE_VERSION:
        raise ValueError(f"{path}: trace version {shown(version)}, this hicache reads {TRACE_VERSION}")
    for key, field_ in _TRACE_FIELDS.items():
        if key not in data:
            if field_.required:
                raise ValueError(f"{path}: no field {key} (it must be {field_.want})")
        elif not field_.ok(data[key]):
            raise ValueError(f"{path}: field {key} must be {field_.want}, got {shown(data[key])}")
    return data


def _json_kind(value: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


@dataclass(frozen=True, slots=True)
class MutantResult:
    mutant: str
    bug: str
    caught: bool
    schedules_to_first_failure: int | None
    error: str | None


def hunt_mutants(scenario: str = "standard", schedules: int = 50, depth: int = 3,
                 on_result: Callable[[MutantResult], None] | None = None) -> list[MutantResult]:
    """For each mutant, PCT schedules until the first failure (at most `schedules`)."""
    out = []
    for m in MUTANTS:
        found: MutantResult | None = None
        for n, seed in enumerate(range(schedules), start=1):
            res = run_schedule(m.scenario if m.scenario != "standard" else scenario, seed, "pct", depth, m.name)
            if res.failed:
                found = MutantResult(m.name, m.bug, True, n, res.error)
                break
        result = found or MutantResult(m.name, m.bug, False, None, None)
        out.append(result)
        if on_result is not None:
            on_result(result)
    return out
