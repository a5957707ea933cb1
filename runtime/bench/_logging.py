"""`hicache bench logging`: what the delivery log costs, per delivery and on a tick of `bench overhead`.

Two measurements, in one run:

- **per delivery**: `DeliveryLog.delivery` called on the deliveries of real runs
  (their messages, replies and runtime times, read back from the runs' own logs),
  `passes` times over the set per repetition, each pass writing a fresh log in a
  temporary directory (so that each pass writes the blobs of its large payloads,
  as the run did); the median of `reps` repetitions of the time spent in
  `delivery` (and the closing of the file), divided by the deliveries written.
  Two sets:
  - *scheduler*: every delivery of the reference scheduler serving the synthetic
    workload of exploration (small prompts, the message mix of a serving loop:
    admissions, allocations, commits, copies, evictions, load-backs, asks for
    statistics); `us_per_delivery` is this figure;
  - *overhead tick*: every delivery of one measured tick of the overhead run
    below (64 trace prompts of up to 4096 tokens: a few messages carry hundreds
    of thousands of token ids or slot indices, and writing them is what costs).
- **slowdown**: the actor side of `hicache bench overhead` (the same workload,
  config and tick: admit, allocate, commit, finish a batch of 64 requests, then
  wait for the write-throughs), on two systems started side by side: one without
  a log, one logging every delivery to a file in a temporary directory. Both get
  the same batches in the same order, interleaved batch by batch, alternating
  which goes first; the median per batch counts. `slowdown = on / off`. At the
  end the two trees' statistics must be equal (the same work was done).

JSON is rendered with orjson and base64 with pybase64 when they are installed (the
`fast` extra); `orjson` and `pybase64` say whether they were.
This is not actor code: it reads `time.perf_counter` and drives the systems from
outside.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from hicache.messages import ActorName, decode
from hicache.messages.config import DeviceKind

from . import _overhead as overhead
from ._cli import progress_bar, report
from ._replay import log_scheduler_run
from ._transfer import _machine
from .._facade import HiCache
from .._log import ORJSON, PYBASE64, DeliveryLog
from .._log_reader import Delivery, LogReader, ReplayLogError, read_log
from .._system import ThreadedRuntime

TARGET_US = 10.0
TARGET_SLOWDOWN = 1.25


@dataclass(frozen=True, slots=True)
class Workload:
    ticks: overhead.Workload
    """The overhead bench's workload (its round trips are not timed here)."""
    requests: int
    """Requests of the scheduler run whose deliveries are logged again and again."""
    passes: int
    """Passes over the scheduler run's deliveries per repetition."""
    tick_passes: int
    """Passes over the overhead tick's deliveries per repetition."""
    reps: int
    """Repetitions of each per-delivery measurement."""


FULL = Workload(ticks=overhead.FULL, requests=60, passes=10, tick_passes=2, reps=7)
QUICK = Workload(ticks=overhead.QUICK, requests=12, passes=2, tick_passes=1, reps=2)
"""A smoke test (the overhead bench's quick batches, few passes); its figures mean nothing."""


@dataclass(frozen=True, slots=True)
class PerDelivery:
    deliveries: int
    """Deliveries in the set (each repetition writes `passes` times as many)."""
    us: float
    """Median over the repetitions of microseconds per delivery written."""
    bytes: float
    """Mean bytes of log per delivery."""

    def to_json(self) -> dict[str, object]:
        return {"deliveries": self.deliveries, "us_per_delivery": round(self.us, 3),
                "bytes_per_delivery": round(self.bytes, 1)}


@dataclass(frozen=True, slots=True)
class Result:
    scheduler: PerDelivery
    tick: PerDelivery
    off_ms: float
    on_ms: float
    deliveries_logged: int
    """Deliveries the logged system logged over the whole overhead run (warm-up included)."""
    deliveries_per_tick: float
    """Median deliveries logged per measured tick."""
    log_mb_per_tick: float
    """Median log written per measured tick (MB)."""
    orjson: bool
    pybase64: bool

    @property
    def slowdown(self) -> float:
        return self.on_ms / self.off_ms

    def to_json(self) -> dict[str, object]:
        return {
            "us_per_delivery": round(self.scheduler.us, 3),
            "overhead_ms_off": round(self.off_ms, 3),
            "overhead_ms_on": round(self.on_ms, 3),
            "slowdown": round(self.slowdown, 3),
            "deliveries_logged": self.deliveries_logged,
            "orjson": self.orjson,
            "pybase64": self.pybase64,
            "bytes_per_delivery": round(self.scheduler.bytes, 1),
            "us_per_delivery_tick": round(self.tick.us, 3),
            "bytes_per_delivery_tick": round(self.tick.bytes, 1),
            "deliveries_per_tick": self.deliveries_per_tick,
            "log_mb_per_tick": round(self.log_mb_per_tick, 3),
            "sets": {"scheduler": self.scheduler.to_json(), "overhead_tick": self.tick.to_json()},
        }


# -- per delivery ----------------------------------------------------------------


Args = tuple[int, float, ActorName, ActorName, Any, bool, Any, BaseException | None]


def _args(ds: list[Delivery]) -> list[Args]:
    """`DeliveryLog.delivery`'s arguments for each logged delivery (the reply decoded again)."""
    return [
        (d.seq, d.t, d.receiver, d.sender, d.message, d.ask, decode(d.reply) if d.reply else None,
         RuntimeError(d.error) if d.error is not None else None)
        for d in ds
    ]


def _per_delivery(args: list[Args], passes: int, reps: int, tmp: Path, step: Callable[[], None]) -> PerDelivery:
    us: list[float] = []
    size = 0
    for r in range(reps):
        elapsed_s = 0.0
        size = 0
        for p in range(passes):
            # a fresh log per pass: a pass must not find the previous one's blobs already written
            path = tmp / f"per-delivery-{r}-{p}.log"
            log = DeliveryLog(path, {"bench": "logging"})
            header = path.stat().st_size
            delivery = log.delivery
            gc.collect()
            t0 = time.perf_counter()
            for a in args:
                delivery(*a)
            log.close()
            elapsed_s += time.perf_counter() - t0
            size += path.stat().st_size - header
            path.unlink()
        us.append(elapsed_s / (passes * len(args)) * 1e6)
        step()
    return PerDelivery(len(args), statistics.median(us), size / (passes * len(args)))


def _tick_deliveries(path: Path, start: int, end: int) -> list[Delivery]:
    """The deliveries logged between two offsets of a log (whole lines only), read with the
    blobs logged before them."""
    first, last = _lines_before(path, start) + 1, _lines_before(path, end)
    with LogReader(path) as log:
        out = [d for d in log if first <= d.line <= last]
    if not out:
        raise ReplayLogError(f"{path}: no delivery between offsets {start} and {end}")
    return out


def _lines_before(path: Path, offset: int) -> int:
    """How many lines of the file end before `offset`."""
    count = 0
    with path.open("rb") as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 20))
            if not chunk:
                break
            count += chunk.count(b"\n")
            offset -= len(chunk)
    return count


# -- logging on and off ----------------------------------------------------------


class _Counting(overhead.WriteAcks):
    """The overhead bench's write-ack observer, counting every delivery too."""

    def __init__(self) -> None:
        super().__init__()
        self.deliveries = 0

    def __call__(self, receiver: ActorName, mail: Any) -> None:
        self.deliveries += 1
        super().__call__(receiver, mail)


def _on_off(w: overhead.Workload, tmp: Path, step: Callable[[], None]) -> tuple[
        float, float, int, float, float, list[Delivery]]:
    """Median tick without and with the log (ms), deliveries logged, median deliveries and MB per
    measured tick, and the deliveries of the last measured tick."""
    batches = overhead._batches(w)
    config = overhead.bench_config([t for b in batches for _, t in b], w.batch)
    path = tmp / "overhead.log"
    off_s: list[float] = []
    on_s: list[float] = []
    per_tick: list[int] = []
    bytes_per_tick: list[int] = []
    off_acks, on_acks = overhead.WriteAcks(), _Counting()
    off = HiCache(config, runtime=ThreadedRuntime(observe=off_acks))
    on = HiCache(config.replace(log_path=str(path)), runtime=ThreadedRuntime(observe=on_acks))
    span = (0, 0)
    with off, on:
        log = on.system.services.log
        assert log is not None
        for i, batch in enumerate(batches):
            gc.collect()
            sides = ((off, off_acks), (on, on_acks)) if i % 2 == 0 else ((on, on_acks), (off, off_acks))
            times = {}
            for cache, acks in sides:
                if cache is on:
                    before_n, before_b = on_acks.deliveries, path.stat().st_size
                t0 = time.perf_counter()
                overhead._tick_actors(cache, acks, batch)
                if cache is on:  # within the tick: the tick's lines are written, none left buffered
                    log.flush()
                times[cache is on] = time.perf_counter() - t0
                if cache is on:
                    after_b = path.stat().st_size
                    span = (before_b, after_b)
                    n_tick, b_tick = on_acks.deliveries - before_n, after_b - before_b
            if i >= w.warmup:
                off_s.append(times[False])
                on_s.append(times[True])
                per_tick.append(n_tick)
                bytes_per_tick.append(b_tick)
            step()
        off_tree, on_tree = off.statistics().tree, on.statistics().tree
        on.check_invariants()
        off.check_invariants()
    overhead._expect_same_work(on_tree, off_tree)
    return (statistics.median(off_s) * 1e3, statistics.median(on_s) * 1e3, on_acks.deliveries,
            statistics.median(per_tick), statistics.median(bytes_per_tick) / 1e6,
            _tick_deliveries(path, *span))


def _measure(w: Workload, step: Callable[[], None]) -> Result:
    with tempfile.TemporaryDirectory(prefix="hicache-bench-logging-") as d:
        tmp = Path(d)
        off_ms, on_ms, logged, per_tick, mb_per_tick, tick_ds = _on_off(w.ticks, tmp, step)
        (tmp / "overhead.log").unlink()
        tick = _per_delivery(_args(tick_ds), w.tick_passes, w.reps, tmp, step)
        del tick_ds
        run_log = tmp / "scheduler.log"
        log_scheduler_run(run_log, w.requests)
        scheduler = _per_delivery(_args(read_log(run_log).deliveries), w.passes, w.reps, tmp, step)
    return Result(scheduler=scheduler, tick=tick, off_ms=off_ms, on_ms=on_ms, deliveries_logged=logged,
                  deliveries_per_tick=per_tick, log_mb_per_tick=mb_per_tick, orjson=ORJSON,
                  pybase64=PYBASE64)


def _table(r: Result, w: Workload, machine: dict[str, object]) -> Table:
    t = Table(
        title="logging: DeliveryLog.delivery per delivery (median of "
        f"{w.reps}), and a tick of bench overhead without and with the log (median of {w.ticks.reps})"
        + (" (--quick: a smoke test, not a figure)" if w is QUICK else ""),
        caption=(
            f"{machine['cpu_count']} x {machine['cpu_model']}, {machine['memory_gib']} GiB, "
            f"torch {machine['torch']}; JSON by {'orjson' if r.orjson else 'the json module'}, base64 by "
            f"{'pybase64' if r.pybase64 else 'binascii'}; targets: "
            f"<= {TARGET_US:g} us per delivery, slowdown <= {TARGET_SLOWDOWN}"
        ),
    )
    for col in ("figure", "value"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    full = w is FULL
    us_mark = " (> target)" if full and r.scheduler.us > TARGET_US else ""
    slow_mark = " (> target)" if full and r.slowdown > TARGET_SLOWDOWN else ""
    rows = (
        (f"us per delivery, scheduler run ({r.scheduler.deliveries:,} deliveries)", f"{r.scheduler.us:.2f}{us_mark}"),
        ("  log bytes per delivery", f"{r.scheduler.bytes:,.0f}"),
        (f"us per delivery, one overhead tick ({r.tick.deliveries:,} deliveries)", f"{r.tick.us:.1f}"),
        ("  log bytes per delivery", f"{r.tick.bytes:,.0f}"),
        ("overhead tick, no log (ms)", f"{r.off_ms:.2f}"),
        ("overhead tick, logged (ms)", f"{r.on_ms:.2f}"),
        ("slowdown", f"{r.slowdown:.2f}{slow_mark}"),
        ("deliveries logged per tick (median)", f"{r.deliveries_per_tick:,.0f}"),
        ("log MB per tick (median)", f"{r.log_mb_per_tick:.1f}"),
        ("deliveries logged over the run", f"{r.deliveries_logged:,}"),
    )
    for row in rows:
        t.add_row(*row)
    return t


def run_bench_logging(*, as_json: bool, quick: bool) -> int:
    w = QUICK if quick else FULL
    progress = progress_bar(as_json)
    with progress:
        task = progress.add_task("logging", total=w.ticks.warmup + w.ticks.reps + 2 * w.reps)
        result = _measure(w, lambda: progress.advance(task))
    machine = _machine(DeviceKind.CPU)
    table = _table(result, w, machine)
    body = {
        **result.to_json(),
        "machine": machine,
        "workload": {
            "batch": w.ticks.batch, "prompt_tokens_max": w.ticks.prompt_tokens_max, "warmup": w.ticks.warmup,
            "reps": w.ticks.reps, "scheduler_requests": w.requests, "passes": w.passes,
            "tick_passes": w.tick_passes, "per_delivery_reps": w.reps, "quick": quick,
        },
    }
    return report(table, body, as_json=as_json)
