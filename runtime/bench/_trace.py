"""`hicache bench trace`: the embedded conversation trace through the facade and through the
bare cores, per phase of a request.

What a scheduler's thread pays per request: each request is admitted with its prompt
minus the last token, gets device slots for what the cache did not have (the tree evicts
when the pool is short), commits its prompt and finishes, as an engine's scheduler does.
Requests are served one at a time or in ticks of 8 or 64 (one `admit`, one `allocate`,
one `commit` and one `finish` for the whole tick; a tick holds as many requests as fit
half the pool). Two sides see the same requests in the same order:

- **facade**: `HiCache` (L1 only) on the production runtime; prompts are tensors, as an
  engine holds them (their conversion is part of the facade's cost);
- **cores**: `TreeCore` and `DeviceCore` in this thread with no actor and no facade
  (`DirectCores`), prompts already as `Tokens`.

It reports microseconds per request per phase (admit, allocate, commit, finish) and the
facade's total over the cores'. Requests longer than half the pool are skipped (both
sides skip the same).

Then decode ticks: a batch of 1, 8 or 64 running requests (the trace's first prompts, cut to
`DECODE_PROMPT_TOKENS`), each tick committing every request's last token and allocating its
next slot in one call, `allocate({rid: 1, ...}, commit={rid: [token], ...})`, as a
scheduler's decode loop does; against the device core's own commit and allocation of the
same ticks (`DeviceCore.commit_only`, `allocate_pages`). Every other tick asks for the
answer as one tensor (`flat=True`), so both forms are timed side by side in one run. It
reports microseconds per tick and per request of a tick, and the facade's longest tick (a
stall of the scheduler's thread: the garbage collector's full passes, say). Not actor code:
it reads `time.perf_counter`.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Group
from rich.markup import escape
from rich.table import Table

from hicache.actors import DeviceCore
from hicache.messages import FinishItem, ReleaseReason, Tokens
from hicache.messages.config import Config, DeviceKind

from ._cli import progress_bar, report
from ._overhead import DirectCores
from ._transfer import _machine
from .._facade import HiCache, Insufficient, Request
from ..trace import load_trace

PHASES = ("admit", "allocate", "commit", "finish")


@dataclass(frozen=True, slots=True)
class Plan:
    requests: int
    pages: tuple[int, ...]
    capacities: tuple[int, ...]
    ticks: tuple[int, ...]


FULL = Plan(requests=2000, pages=(1, 16, 64), capacities=(20_000, 100_000, 1_000_000), ticks=(1, 8, 64))
QUICK = Plan(requests=60, pages=(16,), capacities=(100_000,), ticks=(1, 8))
"""A smoke test: its figures mean nothing."""

DECODE_BATCHES = (1, 8, 64)
DECODE_TICKS = 500
"""Ticks timed per decode run (after `DECODE_WARMUP` untimed ones; `--quick`: a tenth)."""
DECODE_WARMUP = 20
DECODE_PROMPT_TOKENS = 512


@dataclass(slots=True)
class Side:
    """Seconds per phase over a run, and the tokens it found cached."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    hit_tokens: int = 0

    def us_per_request(self, n: int) -> dict[str, float]:
        return {k: round(1e6 * v / n, 2) for k, v in self.seconds.items()}

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def _config(page: int, capacity: int) -> Config:
    slots = capacity // page * page
    return Config(layers=1, kv_heads=1, head_dim=1, dtype="float16", page_size=page, device_slots=slots,
                  host_slots=slots + page, host_tier=False)


def _ticks(prompts: list[torch.Tensor], size: int, room: int) -> list[list[int]]:
    """Consecutive requests in ticks of at most `size`, each tick's prompts within `room` tokens."""
    out: list[list[int]] = []
    for i, t in enumerate(prompts):
        if out and len(out[-1]) < size and sum(len(prompts[j]) for j in out[-1]) + len(t) <= room:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _facade_tick(hc: HiCache, prompts: list[torch.Tensor], ids: list[int], side: Side) -> None:
    s, clock = side.seconds, time.perf_counter
    t0 = clock()
    admitted = hc.admit([Request(f"r{i}", prompts[i][:-1]) for i in ids])
    t1 = clock()
    cached = {a.request_id: a.cached_tokens for a in admitted}
    got = hc.allocate({f"r{i}": len(prompts[i]) - cached[f"r{i}"] for i in ids})
    if isinstance(got, Insufficient):
        raise RuntimeError(f"bench trace: a tick within half the pool did not fit: {got}")
    t2 = clock()
    hc.commit({f"r{i}": prompts[i][cached[f"r{i}"]:] for i in ids})
    t3 = clock()
    hc.finish([a.handle for a in admitted])
    t4 = clock()
    s["admit"] += t1 - t0
    s["allocate"] += t2 - t1
    s["commit"] += t3 - t2
    s["finish"] += t4 - t3
    side.hit_tokens += sum(cached.values())


def _cores_tick(cores: DirectCores, tokens: list[Tokens], ids: list[int], side: Side) -> None:
    s, clock = side.seconds, time.perf_counter
    t0 = clock()
    admissions = cores.admit_tokens([(f"r{i}", tokens[i][: len(tokens[i]) - 1]) for i in ids])
    t1 = clock()
    want = [(a.request_id, len(tokens[i]) - a.device_hit - a.host_hit) for i, a in zip(ids, admissions, strict=True)]
    got = cores.allocate_evicting(want)
    t2 = clock()
    t3 = clock()  # committed as the facade does: the release carries the commits
    items = tuple(
        FinishItem(request_id=a.request_id, handle=a.handle, reason=ReleaseReason.FINISHED,
                   tokens=tokens[i][a.device_hit + a.host_hit :], device=got[a.request_id], allocs=0, commits=n)
        for i, a, (_, n) in zip(ids, admissions, want, strict=True)
    )
    cores.finish(items)
    t4 = clock()
    s["admit"] += t1 - t0
    s["allocate"] += t2 - t1
    s["commit"] += t3 - t2
    s["finish"] += t4 - t3
    side.hit_tokens += sum(a.device_hit + a.host_hit for a in admissions)


def _run(prompts: list[torch.Tensor], tokens: list[Tokens], page: int, capacity: int, tick: int) -> dict[str, Any]:
    config = _config(page, capacity)
    keep = [i for i, t in enumerate(prompts) if 2 <= len(t) and len(t) <= config.device_slots // 2]
    ticks = _ticks([prompts[i] for i in keep], tick, config.device_slots // 2)
    ticks = [[keep[j] for j in t] for t in ticks]
    facade, cores = Side(), Side()
    gc.collect()
    with HiCache(config) as hc:
        for ids in ticks:
            _facade_tick(hc, prompts, ids, facade)
    gc.collect()
    direct = DirectCores(config)
    for ids in ticks:
        _cores_tick(direct, tokens, ids, cores)
    if facade.hit_tokens != cores.hit_tokens:
        raise RuntimeError(f"bench trace: the facade hit {facade.hit_tokens} tokens, the cores {cores.hit_tokens}")
    n = len(keep)
    return {
        "page": page, "capacity": config.device_slots, "tick": tick, "requests": n,
        "hit_rate": round(facade.hit_tokens / max(1, sum(len(prompts[i]) for i in keep)), 4),
        "facade_us": facade.us_per_request(n), "cores_us": cores.us_per_request(n),
        "facade_us_per_request": round(1e6 * facade.total / n, 1), "cores_us_per_request": round(1e6 * cores.total / n, 1),
        "facade_over_cores": round(facade.total / cores.total, 2),
    }


def _decode(prompts: list[torch.Tensor], page: int, batch: int, ticks: int) -> dict[str, Any]:
    """`ticks` decode ticks of `batch` running requests through the facade and through the device core."""
    starts = [prompts[i % len(prompts)][:DECODE_PROMPT_TOKENS] for i in range(batch)]
    rids = [f"d{i}" for i in range(batch)]
    config = _config(page, batch * (DECODE_PROMPT_TOKENS + DECODE_WARMUP + 2 * ticks + 2 * page))
    clock = time.perf_counter
    gc.collect()
    with HiCache(config) as hc:
        admitted = hc.admit([Request(rid, t) for rid, t in zip(rids, starts, strict=True)])
        cached = {a.request_id: a.cached_tokens for a in admitted}
        hc.allocate({rid: len(t) - cached[rid] for rid, t in zip(rids, starts, strict=True)})
        commit: dict[str, Any] = {rid: t[cached[rid]:] for rid, t in zip(rids, starts, strict=True)}
        facade = [0.0, 0.0]  # per request, flat: alternate ticks
        longest = 0.0
        for k in range(DECODE_WARMUP + 2 * ticks):
            t0 = clock()
            got = hc.allocate(dict.fromkeys(rids, 1), commit=commit, flat=bool(k % 2))
            if k >= DECODE_WARMUP:
                took = clock() - t0
                facade[k % 2] += took
                longest = max(longest, took)
            if isinstance(got, Insufficient):
                raise RuntimeError(f"bench trace: a decode tick did not fit: {got}")
            commit = {rid: [k % 30_000] for rid in rids}
        hc.finish([a.handle for a in admitted])
    gc.collect()
    core = DeviceCore(config)
    core.allocate_pages([(rid, len(t)) for rid, t in zip(rids, starts, strict=True)])
    commits = [(rid, len(t)) for rid, t in zip(rids, starts, strict=True)]
    cores = 0.0
    for k in range(DECODE_WARMUP + ticks):
        t0 = clock()
        core.commit_only(commits)
        core.allocate_pages([(rid, 1) for rid in rids])
        if k >= DECODE_WARMUP:
            cores += clock() - t0
        commits = [(rid, 1) for rid in rids]
    per_request, flat = facade
    return {
        "page": page, "batch": batch, "ticks": ticks,
        "facade_us_per_tick": round(1e6 * per_request / ticks, 1), "cores_us_per_tick": round(1e6 * cores / ticks, 1),
        "facade_us_per_request": round(1e6 * per_request / ticks / batch, 2),
        "facade_over_cores": round(per_request / cores, 2),
        "facade_flat_us_per_tick": round(1e6 * flat / ticks, 1),
        "facade_flat_over_cores": round(flat / cores, 2),
        "facade_longest_tick_us": round(1e6 * longest, 1),
    }


def _decode_table(rows: list[dict[str, Any]], machine: dict[str, object]) -> Table:
    table = Table(title=escape("decode ticks: allocate({rid: 1, ...}, commit={rid: [token], ...}) of a batch"),
                  caption=f"{machine}; µs per tick (facade: one call, a tensor per request or flat=True; "
                          "cores: the device core's commit and allocation)")
    for col in ("page", "batch", "ticks", "facade µs/tick", "facade µs/request", "flat µs/tick", "cores µs/tick",
                "facade ÷ cores", "flat ÷ cores", "facade's longest tick µs"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["page"]), str(r["batch"]), str(r["ticks"]), f"{r['facade_us_per_tick']:.0f}",
                      f"{r['facade_us_per_request']:.1f}", f"{r['facade_flat_us_per_tick']:.0f}",
                      f"{r['cores_us_per_tick']:.0f}", f"{r['facade_over_cores']:.2f}",
                      f"{r['facade_flat_over_cores']:.2f}", f"{r['facade_longest_tick_us']:.0f}")
    return table


def _table(rows: list[dict[str, Any]], machine: dict[str, object]) -> Table:
    table = Table(title="conversation trace, per request: facade (actors) vs cores (no actors), L1 only",
                  caption=f"{machine}; µs per request, phases admit/allocate/commit/finish")
    for col in ("page", "capacity", "tick", "reqs", "hit", "facade µs", "cores µs", "facade ÷ cores",
                "facade phases", "cores phases"):
        table.add_column(col, justify="right")
    for r in rows:
        fmt = lambda d: " / ".join(f"{d[k]:.0f}" for k in PHASES)  # noqa: E731
        table.add_row(str(r["page"]), f"{r['capacity']:,}", str(r["tick"]), str(r["requests"]), f"{r['hit_rate']:.4f}",
                      f"{r['facade_us_per_request']:.0f}", f"{r['cores_us_per_request']:.0f}",
                      f"{r['facade_over_cores']:.2f}", fmt(r["facade_us"]), fmt(r["cores_us"]))
    return table


def run_bench_trace(*, as_json: bool, quick: bool, requests: int | None = None) -> int:
    plan = QUICK if quick else FULL
    n = requests or plan.requests
    torch.set_num_threads(1)  # tiny tensor ops: no thread pool spin in the measured calls
    prompts = [r.tokens() for r in load_trace(n)]
    tokens = [Tokens.from_tensor(t) for t in prompts]
    runs = [(p, c, k) for p in plan.pages for c in plan.capacities for k in plan.ticks]
    rows = []
    with progress_bar(as_json) as bar:
        task = bar.add_task("bench trace", total=len(runs))
        for page, capacity, tick in runs:
            rows.append(_run(prompts, tokens, page, capacity, tick))
            bar.advance(task)
        decode_runs = [(p, b) for p in plan.pages for b in DECODE_BATCHES]
        ticks = DECODE_TICKS // 10 if quick else DECODE_TICKS
        task = bar.add_task("decode ticks", total=len(decode_runs))
        decode = []
        for page, batch in decode_runs:
            decode.append(_decode(prompts, page, batch, ticks))
            bar.advance(task)
    machine = _machine(DeviceKind.CPU)
    body = {"requests": n, "machine": machine, "results": rows, "decode": decode}
    return report(Group(_table(rows, machine), _decode_table(decode, machine)), body, as_json=as_json)
