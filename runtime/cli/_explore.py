"""`hicache explore` and `hicache bench explore`: the command-line face of `hicache.runtime.testing.explore`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hicache.actors._actor import Directory, HiActor, Mail
from hicache.messages import ActorName, DrainWrites, Message

from ..testing._deterministic import DeterministicRuntime
from ..demo._progress import progress
from .._usage import UsageError
from ..testing.explore import (
    SCENARIOS,
    MutantResult,
    ScheduleResult,
    explore,
    hunt_mutants,
    replay,
    run_schedule,
    write_failure,
    _ScenarioUnknown,
)

DEFAULT_OUT = Path("explore-failures")


def run_explore(
    *, scenario: str, strategy: str, seeds: int, depth: int, as_json: bool, out: Path,
    replay_path: Path | None, mutants: bool, first_seed: int = 0,
) -> int:
    err = Console(stderr=True)
    if replay_path is not None:
        return _replay(replay_path, as_json, err)
    if mutants:
        return _mutants(scenario, as_json)
    if scenario not in SCENARIOS:
        raise UsageError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    if seeds <= 0 or depth <= 0:
        raise UsageError(f"--seeds ({seeds}) and --depth ({depth}) must be > 0")
    with progress() as bar:
        task = bar.add_task(f"{scenario}: {strategy} schedules", total=seeds)
        report = explore(scenario, strategy, range(first_seed, first_seed + seeds), depth,
                         on_schedule=lambda r: bar.advance(task))
    reports = [_failure_report(f, out) for f in report.failures]
    if as_json:
        print(json.dumps({
            "scenario": scenario, "strategy": strategy, "seeds": report.seeds, "depth": depth,
            "failures": reports, "schedules_per_s": round(report.schedules_per_s, 2),
            "deliveries_per_s": round(report.deliveries / report.elapsed_s, 1) if report.elapsed_s else 0.0,
            "deterministic": report.deterministic,
        }))
    else:
        for r in reports:
            _print_failure(r, err)
        verdict = "no failure" if not reports else f"{len(reports)} failing schedule(s)"
        Console().print(
            f"{scenario}: {report.seeds} {strategy} schedules (depth {depth}), {verdict}; "
            f"{report.schedules_per_s:.1f} schedules/s; deterministic: {report.deterministic}"
        )
    return 1 if reports or not report.deterministic else 0


def _failure_report(res: ScheduleResult, out: Path) -> dict[str, Any]:
    trace, log = write_failure(res, out)
    return {
        "scenario": res.scenario, "seed": res.seed, "strategy": res.strategy, "depth": res.depth,
        "mutant": res.mutant, "error": res.error, "trace": str(trace), "log": str(log),
        "replay": f"hicache explore --replay {trace}",
    }


def _print_failure(r: dict[str, Any], console: Console) -> None:
    console.print(f"[bold red]FAILED[/] {r['scenario']} seed {r['seed']} ({r['strategy']}, depth {r['depth']})"
                  + (f" mutant {r['mutant']}" if r["mutant"] else ""))
    console.print(f"  {r['error']}", markup=False)
    console.print(f"  schedule: {r['trace']}", markup=False)
    console.print(f"  log:      {r['log']}", markup=False)
    console.print(f"  replay:   {r['replay']}", markup=False)


def _replay(path: Path, as_json: bool, err: Console) -> int:
    try:
        res = replay(path)
    except _ScenarioUnknown as e:
        raise UsageError(f"--replay {_first_line(e)}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--replay {path} is not a schedule trace written by hicache explore ({_first_line(e)}); "
                         "a delivery log (hicache demo --log, Config.log_path) is replayed with `hicache replay LOG`"
                         ) from None
    if as_json:
        print(json.dumps({"trace": str(path), "failed": res.failed, "error": res.error,
                          "deliveries": res.deliveries, "digest": res.digest}))
    else:
        if res.failed:  # a divergence fails the replay too (docs/testing.md), but it reproduces nothing
            verdict = "diverged" if res.error_type == "ScheduleDivergedError" else "reproduced"
            err.print(f"[bold red]{verdict}[/]: {res.error}")
        Console().print(f"replayed {res.deliveries} deliveries of {res.scenario} seed {res.seed}: "
                        + ("failed" if res.failed else "no failure"))
    return 1 if res.failed else 0


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _mutants(scenario: str, as_json: bool) -> int:
    if scenario not in SCENARIOS:
        raise UsageError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    with progress() as bar:
        task = bar.add_task("hunting mutants with PCT", total=None)

        def done(m: MutantResult) -> None:
            bar.advance(task)

        results = hunt_mutants(scenario, on_result=done)
    if as_json:
        print(json.dumps([{"mutant": m.mutant, "bug": m.bug, "caught": m.caught,
                           "schedules_to_first_failure": m.schedules_to_first_failure, "error": m.error}
                          for m in results]))
    else:
        t = Table(title=f"mutants vs PCT exploration ({scenario}, at most 50 schedules each)")
        t.add_column("mutant")
        t.add_column("bug")
        t.add_column("caught")
        t.add_column("schedules", justify="right")
        for m in results:
            t.add_row(m.mutant, m.bug, "yes" if m.caught else "NO", str(m.schedules_to_first_failure or "-"))
        Console().print(t)
    return 0 if all(m.caught for m in results) else 1


class _Bouncer(HiActor):
    """Sends every `DrainWrites` on to its partner until a budget runs out (the bare runtime's speed)."""

    name = ActorName.TREE
    partner = ActorName.PREFETCH

    def __init__(self, *, budget: list[int], **kw: Any) -> None:
        super().__init__(**kw)
        self._budget = budget

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        if self._budget[0] > 0:
            self._budget[0] -= 1
            self.send(self.partner, DrainWrites())
        return None

    def check_invariants(self) -> None:
        return None

    def statistics(self) -> Message:
        raise TypeError("no statistics")


class _Bouncer2(_Bouncer):
    name = ActorName.PREFETCH
    partner = ActorName.TREE


def _bare_messages_per_s(messages: int) -> float:
    rt = DeterministicRuntime(seed=0)
    d = Directory()
    budget = [messages]
    for cls in (_Bouncer, _Bouncer2):
        d.register(cls.name, rt.start(cls, budget=budget, services=rt.services, directory=d))
    t0 = time.perf_counter()
    d.ref(ActorName.TREE).tell(Mail(ActorName.FACADE, DrainWrites()))
    delivered = rt.run_until_idle()
    elapsed = time.perf_counter() - t0
    for name in d.names():
        d.ref(name).stop()
    return delivered / elapsed


def run_bench_explore(*, as_json: bool, quick: bool) -> int:
    """Schedules and delivered messages per second for the standard scenario, and the bare
    runtime's messages per second (two actors bouncing one message) for comparison."""
    seeds = 3 if quick else 30
    run_schedule("standard", 0, "pct")  # warm-up
    deliveries = 0
    t0 = time.perf_counter()
    with progress() as bar:
        task = bar.add_task("standard scenario, PCT schedules", total=seeds)
        for seed in range(seeds):
            deliveries += run_schedule("standard", seed, "pct").deliveries
            bar.advance(task)
    elapsed = time.perf_counter() - t0
    bare = _bare_messages_per_s(20_000 if quick else 200_000)
    figures = {"scenario": "standard", "schedules": seeds, "schedules_per_s": round(seeds / elapsed, 2),
               "deliveries_per_s": round(deliveries / elapsed, 1), "deliveries_per_schedule": deliveries // seeds,
               "bare_messages_per_s": round(bare, 1), "machine": {"cpus": os.cpu_count()}}
    if as_json:
        print(json.dumps(figures))
    else:
        Console().print(
            f"standard scenario: {figures['schedules_per_s']} schedules/s, {figures['deliveries_per_s']:,} "
            f"deliveries/s ({figures['deliveries_per_schedule']} deliveries per schedule, invariants checked "
            "after every delivery, oracle on every cached read); the bare runtime bounces "
            f"{figures['bare_messages_per_s']:,} messages/s"
        )
    return 0
