"""`hicache bench replay`: how fast a delivery log is read and replayed.

The log is that of a realistic run, written once at the start: the reference
scheduler serving the synthetic workload of exploration (prompts of shared
blocks, chunked prefill, decode with lookahead slots, aborts) on tiny pools, so
that devices and hosts evict and load back, on the deterministic runtime (seed
0: the same log every run). Then, `reps` times:

- **read**: `read_log` (JSON lines, base64 and msgpack decoding, sort by `seq`);
- **replay**: `replay_log` of what was read: fresh actors, each fed its logged
  inbox, every send and ask reply compared with the log. It must find no
  divergence;
- **handlers**: the same deliveries handed to fresh actors' `on_receive` one
  after another, with nothing compared or recorded: the actors' own handling
  (their cores do real work: torch ops, the radix tree), which replay cannot
  avoid. Replay and this pass run back to back, alternating which goes first;
  the median of their differences is what the replay machinery adds
  (`machinery_share` of the replay time);
- **per actor**: each replayed actor handed its own logged inbox alone (each depends
  only on its inbox), one after another; the median microseconds a delivery of each
  (`handlers_us_per_delivery`): where the handling goes.

The median of each counts. `deliveries` is the number of deliveries replayed (to
the tree, the pools and the streams; the log's deliveries to the facade are
compared as sends, not replayed). This is not actor code: it reads
`time.perf_counter`.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from hicache.actors._actor import HiActor
from hicache.messages import ActorName
from hicache.messages.config import Config, DeviceKind

from ._cli import progress_bar, report
from ._transfer import _machine
from ..testing._deterministic import DeterministicRuntime
from .._facade import HiCache
from .._log_reader import Delivery, ParsedLog, read_log
from ..testing._replay import Rebuilt, replay_log
from ..testing._scheduler import ReferenceScheduler, SchedulerConfig
from ..testing.explore import synthetic_workload

TARGET_PER_S = 50_000.0


@dataclass(frozen=True, slots=True)
class Workload:
    requests: int
    """Requests of the synthetic workload the logged run serves."""
    reps: int
    """Timed reads, replays and handler passes of the log (each)."""


FULL = Workload(requests=250, reps=7)
QUICK = Workload(requests=12, reps=2)
"""A smoke test: a short log, two repetitions; its figures mean nothing."""

RUN_CONFIG = Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=96, host_slots=192)
"""Tiny pools (the replay tests' shape): the run evicts, writes back and loads back."""


def log_scheduler_run(path: Path, requests: int, seed: int = 0) -> int:
    """Serve `requests` synthetic requests with the reference scheduler, logging every delivery
    to `path`; the number of scheduler ticks."""
    cfg = RUN_CONFIG.replace(log_path=str(path))
    with HiCache(cfg, runtime=DeterministicRuntime(seed=seed)) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(
            max_running=4, prefill_tokens_per_tick=16, chunk_tokens=8, abort_rate=0.05, seed=seed,
            lookahead_slots=2, device_budget_ratio=2.0,
        ))
        sched.submit(synthetic_workload(seed, requests, cfg.page_size))
        sched.run()
        hc.quiesce()
        return sched.ticks


def handle_only(log: ParsedLog) -> int:
    """Hand every logged delivery to a fresh actor of its receiver, comparing nothing; how many."""
    rebuilt = Rebuilt(log.run, None)
    return _hand(rebuilt, rebuilt.actors, log.deliveries)


def handle_per_actor(log: ParsedLog) -> dict[str, tuple[int, float]]:
    """Each replayed actor handed its own logged inbox alone (each depends only on its inbox),
    one after another: its deliveries and the seconds it took."""
    rebuilt = Rebuilt(log.run, None)
    out = {}
    for name, actor in rebuilt.actors.items():
        mine = [d for d in log.deliveries if d.receiver is name]
        gc.collect()
        t0 = time.perf_counter()
        n = _hand(rebuilt, {name: actor}, mine)
        out[name.value] = (n, time.perf_counter() - t0)
    return out


def _hand(rebuilt: Rebuilt, actors: dict[ActorName, HiActor], deliveries: list[Delivery]) -> int:
    count = 0
    for d in deliveries:
        actor = actors.get(d.receiver)
        if actor is None:
            continue
        count += 1
        try:
            rebuilt.hand(actor, d)
        except Exception:  # noqa: BLE001, S110 - a logged handler error happens again; replay compares it
            pass
    return count


@dataclass(frozen=True, slots=True)
class Result:
    deliveries: int
    """Deliveries replayed (to the five replayed actors)."""
    deliveries_logged: int
    """Every delivery in the log (the facade's included)."""
    log_bytes: int
    ticks: int
    read_s: float
    replay_s: float
    handlers_s: float
    machinery_s: float
    """Median over the repetitions of replay time less handler-pass time (the pair run back to back)."""
    actor_us: dict[str, float]
    """Per replayed actor, microseconds a delivery when it is handed its inbox alone (median)."""

    @property
    def deliveries_per_s(self) -> float:
        return self.deliveries / self.replay_s

    @property
    def machinery_share(self) -> float:
        """The share of replay time that is not the actors' own handling (0 where noise hides it)."""
        return min(1.0, max(0.0, self.machinery_s / self.replay_s))

    def to_json(self) -> dict[str, object]:
        return {
            "deliveries": self.deliveries,
            "replay_s": round(self.replay_s, 4),
            "deliveries_per_s": round(self.deliveries_per_s, 1),
            "read_s": round(self.read_s, 4),
            "read_deliveries_per_s": round(self.deliveries_logged / self.read_s, 1),
            "handlers_s": round(self.handlers_s, 4),
            "machinery_s": round(self.machinery_s, 4),
            "machinery_share": round(self.machinery_share, 3),
            "handlers_us_per_delivery": {a: round(us, 2) for a, us in self.actor_us.items()},
            "deliveries_logged": self.deliveries_logged,
            "log_bytes": self.log_bytes,
            "ticks": self.ticks,
        }


def _measure(w: Workload, step: Callable[[], None]) -> Result:
    with tempfile.TemporaryDirectory(prefix="hicache-bench-replay-") as tmp:
        path = Path(tmp) / "run.log"
        ticks = log_scheduler_run(path, w.requests)
        step()
        log_bytes = path.stat().st_size
        read_s: list[float] = []
        replay_s: list[float] = []
        handlers_s: list[float] = []
        deliveries = replayed = handled = 0
        result = None
        for i in range(w.reps):
            gc.collect()
            t0 = time.perf_counter()
            log = read_log(path)
            read_s.append(time.perf_counter() - t0)
            # replay and the handler pass one after the other, alternating which goes first
            for side in ("replay", "handlers") if i % 2 == 0 else ("handlers", "replay"):
                gc.collect()
                t0 = time.perf_counter()
                if side == "replay":
                    result = replay_log(log)
                    replay_s.append(time.perf_counter() - t0)
                else:
                    handled = handle_only(log)
                    handlers_s.append(time.perf_counter() - t0)
            assert result is not None
            if result.divergence is not None:
                d = result.divergence
                raise RuntimeError(f"bench replay: the log of the run diverges at delivery {d.seq} ({d.actor}): "
                                   f"expected {d.expected}, got {d.actual}")
            if handled != result.deliveries:
                raise AssertionError(f"bench replay: replay counted {result.deliveries} deliveries, "
                                     f"the handler pass {handled}")
            deliveries, replayed = len(log.deliveries), result.deliveries
            step()
        per_actor: dict[str, list[float]] = {}
        counts: dict[str, int] = {}
        for _ in range(w.reps):
            for actor, (n, seconds) in handle_per_actor(log).items():
                per_actor.setdefault(actor, []).append(seconds)
                counts[actor] = n
            step()
    return Result(
        deliveries=replayed, deliveries_logged=deliveries, log_bytes=log_bytes, ticks=ticks,
        read_s=statistics.median(read_s), replay_s=statistics.median(replay_s),
        handlers_s=statistics.median(handlers_s),
        machinery_s=statistics.median(r - h for r, h in zip(replay_s, handlers_s, strict=True)),
        actor_us={a: statistics.median(ss) / max(1, counts[a]) * 1e6 for a, ss in per_actor.items()},
    )


def _table(r: Result, w: Workload, machine: dict[str, object]) -> Table:
    t = Table(
        title=f"replay: a log of {r.deliveries_logged:,} deliveries (reference scheduler, {w.requests} requests), "
        f"median of {w.reps}" + (" (--quick: a smoke test, not a figure)" if w is QUICK else ""),
        caption=(
            f"{machine['cpu_count']} x {machine['cpu_model']}, {machine['memory_gib']} GiB, "
            f"torch {machine['torch']}; target: >= {TARGET_PER_S:,.0f} deliveries replayed per second"
        ),
    )
    for col in ("figure", "value"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    mark = " (< target)" if w is FULL and r.deliveries_per_s < TARGET_PER_S else ""
    rows = (
        ("deliveries replayed", f"{r.deliveries:,}"),
        ("replay (s)", f"{r.replay_s:.3f}"),
        ("deliveries replayed per second", f"{r.deliveries_per_s:,.0f}{mark}"),
        ("read_log (s)", f"{r.read_s:.3f}"),
        ("deliveries read per second", f"{r.deliveries_logged / r.read_s:,.0f}"),
        ("the actors' own handling (s)", f"{r.handlers_s:.3f}"),
        ("replay less handling, paired (s)", f"{r.machinery_s:.3f}"),
        ("replay machinery share", f"{r.machinery_share:.0%}"),
        *((f"  {a}: us a delivery, its inbox alone", f"{us:.1f}") for a, us in r.actor_us.items()),
        ("log size (MB)", f"{r.log_bytes / 1e6:.1f}"),
    )
    for row in rows:
        t.add_row(*row)
    return t


def run_bench_replay(*, as_json: bool, quick: bool) -> int:
    w = QUICK if quick else FULL
    progress = progress_bar(as_json)
    with progress:
        task = progress.add_task("replay", total=1 + 2 * w.reps)
        result = _measure(w, lambda: progress.advance(task))
    machine = _machine(DeviceKind.CPU)
    table = _table(result, w, machine)
    body = {
        **result.to_json(),
        "machine": machine,
        "workload": {"requests": w.requests, "reps": w.reps, "runtime": "deterministic", "quick": quick},
    }
    return report(table, body, as_json=as_json)
