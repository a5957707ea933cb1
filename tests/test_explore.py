"""Schedule exploration: the unmutated system passes, every mutant is caught, failures replay."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from hicache.messages import decode
from hicache.runtime.cli import main
from hicache.runtime.testing import MUTANTS, capture_logs, mutant
from hicache.runtime.testing.explore import explore, hunt_mutants, replay, run_schedule, write_failure


def test_the_unmutated_standard_scenario_passes_two_hundred_seeds_under_pct_and_random() -> None:
    pct = explore("standard", "pct", range(120), depth=3)
    rnd = explore("standard", "random", range(1000, 1080))
    assert pct.failures == [] and rnd.failures == [], [f.error for f in pct.failures + rnd.failures]
    assert pct.deterministic and rnd.deterministic
    assert pct.seeds + rnd.seeds == 200 and pct.deliveries > 120 * 100


def test_every_mutant_is_caught_within_fifty_pct_schedules() -> None:
    results = hunt_mutants("standard", schedules=50)
    assert [r.mutant for r in results] == [m.name for m in MUTANTS]
    missed = [r.mutant for r in results if not r.caught]
    assert not missed, f"exploration missed {missed}"
    assert all(r.schedules_to_first_failure is not None and r.schedules_to_first_failure <= 50 for r in results)


@pytest.mark.parametrize(("name", "symptom"), [
    ("write-acks-on-admission", "writes and 0 loads in flight, but no actor has mail"),
    ("free-by-inferred-length", "ledgers hold .* pages but .* pages are marked request-owned"),
    ("evict-before-synced",
     "illegal host slot transition to HOST_ONLY .* is WRITING|host_only .*backed-up state without a full host copy"),
    ("double-unlock-on-retract", "would become -1 .*a lock released twice|write .* must hold a lock on its deepest node"),
    ("short-write-marked-done", "FingerprintMismatchError"),
    ("backup-under-unbacked-parent", "is written under .* which is not backed up"),
    ("eviction-ends-short", "ended with .* freed while .* are evictable"),
    ("eviction-skips-loads", r"ended with .* freed while started load-backs \[.*\], which nothing locks"),
    ("write-wait-needs-every-node", r"ended with .* freed while write-throughs \[.*\] hold nodes only they lock"),
    ("eviction-skips-doomed-writes", r"ended with .* freed while write-throughs \[.*\] hold nodes only they lock"),
    ("loading-prefix-as-device-hit",  # the read check sees the fake model read a prefix nothing loads
     r"which a load-back from host memory fills, but start_loads\(\) was not called"),
    ("refused-load-unseen", "FingerprintMismatchError"),
    ("unawaited-load-failure-lost", "is in a prefix whose load-back from host memory failed"),
    ("insert-through-loads",
     r"which a load-back from host memory fills, but start_loads\(\) was not called|device residency is not prefix-closed"),
    ("waits-own-load-only", "is in a prefix whose load-back from host memory failed"),
    ("host-hit-counted-at-admission", r"statistics differ from what the admissions were served: .* L2\+L3 hit"),
    ("storage-hit-of-host-pages",
     r"statistics differ from what the admissions were served: .* L3 hit (\d+);.* (?!\1)\d+ storage hit"),
    ("write-back-drops-tail", r"write_back would delete .* \(and lose its tail\)"),
    ("trim-before-served-slots", "slots taken from the pages it holds, which have .* free"),
    ("prefetcher-frees-slots", "freeing host slots is accepted only from the tree actor, got it from prefetch"),
    ("prefetch-gives-up", "SGLang #16370: shrink to the page-aligned free space"),
    ("anchor-evictable", "anchored on .* which must be alive, backed up and host-pinned"),
    ("page-complete-before-bytes", "FingerprintMismatchError"),
    ("aborted-prefetch-leaks", r"host mirror says .* reserved by prefetches differs|are host-pinned \(a leaked pin\)"),
])
def test_each_mutant_fails_with_the_symptom_of_its_bug(name: str, symptom: str) -> None:
    import re

    scenario = mutant(name).scenario
    found = next(r for r in (run_schedule(scenario, s, "pct", 3, name) for s in range(50)) if r.failed)
    assert re.search(symptom, found.error or ""), found.error


def test_the_misuse_scenario_refuses_every_bad_call_and_ends_quiet() -> None:
    """Bad calls between the ticks of a workload: each is a RequestError that changes nothing."""
    report = explore("misuse", strategy="pct", seeds=range(24))
    assert report.failures == [], report.failures[0].error
    assert report.deliveries > 24 * 100


def test_the_unmutated_storage_scenario_passes_thirty_seeds_on_every_policy() -> None:
    """Seeds rotate the prefetch policy (seed % 3) and the write policy (seed // 3 % 3)."""
    report = explore("storage", strategy="pct", seeds=range(30))
    assert report.failures == [], report.failures[0].error


def test_the_storage_scenario_names_its_model_so_no_schedule_warns_that_its_keys_name_none() -> None:
    with capture_logs() as logs:
        report = explore("storage", strategy="pct", seeds=range(2))
    assert report.failures == [], report.failures[0].error
    assert not [e for e in logs if e["event"].startswith("storage keys")], logs


def test_the_unmutated_pressure_scenario_passes_forty_seeds() -> None:
    """Retractions of requests whose load-backs are in flight, on a device admitted at twice its size."""
    report = explore("pressure", strategy="pct", seeds=range(40))
    assert report.failures == [], report.failures[0].error
    assert report.deliveries > 40 * 100


def test_the_unmutated_overlap_scenario_passes_forty_seeds_under_pct_and_random() -> None:
    """An overlap scheduler (admissions during half the forward passes) with failing copy batches."""
    for strategy in ("pct", "random"):
        report = explore("overlap", strategy=strategy, seeds=range(20))
        assert report.failures == [], report.failures[0].error
        assert report.deliveries > 20 * 100


def test_the_unmutated_orphans_scenario_passes_twenty_seeds() -> None:
    # (its mutants are caught within fifty schedules: test_every_mutant_is_caught_within_fifty_pct_schedules)
    report = explore("orphans", strategy="pct", seeds=range(20))
    assert report.failures == [], report.failures[0].error
    assert report.deliveries > 20 * 100


def test_a_load_refused_before_a_quiesce_fails_the_quiesces_batch_and_the_statistics_agree() -> None:
    """`orphans`, pct depth 5, seed 70161: a load is refused (the queue full) for an admission
    dropped before its forward pass; the next tick quiesces between admitting and
    `start_loads`. The refusal used to wait for a batch a forward pass waits on, so the
    quiesce's batch landed (the admission's commit would have been taken) while the waiter
    `start_loads` gave failed: the scheduler retracted a request whose load-back the cache
    counted as served, and the end's statistics check failed. The refusal now fails the
    batch the next start makes, the quiesce's."""
    result = run_schedule("orphans", 70161, "pct", 5)
    assert not result.failed, result.error


def test_an_allocation_short_while_the_ticks_load_back_fails_is_tried_again_not_called_impossible() -> None:
    """`orphans`, pct depth 5, seed 70367: the one running request's load-back (admitted this tick)
    is refused and its batch fails while the tick's allocation runs, so the allocation comes up
    short by pages that are free a moment later. The reference scheduler, with no request to
    retract, used to call that a device pool too small for one step; it tries once more, and
    the forward pass finds the failure and retracts the request."""
    result = run_schedule("orphans", 70367, "pct", 5)
    assert not result.failed, result.error


def test_a_failure_found_by_pct_replays_exactly_from_its_trace(tmp_path: Path) -> None:
    failing = next(r for r in (run_schedule("standard", s, "pct", 3, "backup-under-unbacked-parent")
                               for s in range(50)) if r.failed)
    trace, log = write_failure(failing, tmp_path)
    again = replay(trace, keep_log=True)
    assert again.failed and again.error == failing.error
    assert again.choices == failing.choices and again.digest == failing.digest
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == failing.deliveries
    first = lines[0]
    assert {"seq", "t", "receiver", "sender", "type", "body"} <= set(first)
    assert type(decode(base64.b64decode(first["body"]))).__name__ == first["type"]


def test_the_cli_reports_a_failure_with_the_command_that_replays_it(tmp_path: Path, capsys) -> None:
    failing = next(r for r in (run_schedule("standard", s, "pct", 3, "double-unlock-on-retract")
                               for s in range(50)) if r.failed)
    trace, _ = write_failure(failing, tmp_path)
    assert main(["explore", "--replay", str(trace), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["failed"] and out["error"] == failing.error
    assert re.search("would become -1|must hold a lock on its deepest node", out["error"]), out["error"]


def test_explore_json_names_scenario_strategy_seeds_failures_and_speed(tmp_path: Path, capsys) -> None:
    assert main(["explore", "--seeds", "3", "--json", "--out", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["scenario"], out["strategy"], out["seeds"], out["failures"]) == ("standard", "pct", 3, [])
    assert out["schedules_per_s"] > 0 and out["deterministic"] is True


def test_explore_mutants_json_lists_every_mutant_caught(capsys) -> None:
    assert main(["explore", "--mutants", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["mutant"] for m in out] == [m.name for m in MUTANTS]
    assert all(m["caught"] and m["schedules_to_first_failure"] <= 50 for m in out)


def test_bad_explore_input_is_a_clear_error(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["explore", "--scenario", "nope"])
    assert refused.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err
    bad = tmp_path / "bad.trace.json"
    bad.write_text("{not json")
    assert main(["explore", "--replay", str(bad)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "cannot read schedule trace" in line


def test_bench_explore_reports_schedules_and_deliveries_per_second(capsys) -> None:
    assert main(["bench", "explore", "--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schedules_per_s"] > 0 and out["deliveries_per_s"] > out["schedules_per_s"]


def test_the_faults_scenario_injects_seeded_faults_and_the_system_survives_them() -> None:
    import dataclasses

    from hicache.runtime import explore as ex

    injected: list[int] = []
    scenario = ex.SCENARIOS["faults"]

    def counting(rt, seed, mut):  # type: ignore[no-untyped-def]
        try:
            scenario.run(rt, seed, mut)
        finally:
            injected.append(rt.services.faults.injected)

    ex.SCENARIOS["counted-faults"] = dataclasses.replace(scenario, name="counted-faults", run=counting)
    try:
        report = explore("counted-faults", "pct", range(40))
    finally:
        del ex.SCENARIOS["counted-faults"]
    assert report.failures == [], [f.error for f in report.failures]
    assert sum(injected) > 40, f"too few faults injected: {injected}"


def test_seeded_faults_repeat_for_the_same_seed_and_differ_across_seeds() -> None:
    from hicache.messages import ActorName
    from hicache.actors import SeededFaults

    def draws(seed: int) -> list[object]:
        f = SeededFaults(seed, transfer_fail_rate=0.3, host_exhausted_rate=0.3)
        return [f.transfer_fault(ActorName.WRITE, (i,)) for i in range(30)] + [f.host_exhausted(4) for _ in range(30)]

    assert draws(1) == draws(1) and draws(1) != draws(2)
    with pytest.raises(ValueError, match="transfer_fail_rate must be in"):
        SeededFaults(0, transfer_fail_rate=2.0)


_TRACE = {"version": 1, "scenario": "standard", "seed": 0, "strategy": "pct", "depth": 3, "mutant": None,
          "error": "", "choices": []}


@pytest.mark.parametrize(("text", "says"), [
    ("[1, 2]", "the top level is an array, not the object a schedule trace is"),
    ('"x"', "the top level is a string"),
    ("null", "the top level is null"),
    ("5", "the top level is a number"),
    (json.dumps(_TRACE).replace('"seed": 0', '"seed": Infinity'), "field seed must be an integer >= 0, got inf"),
    (json.dumps({**_TRACE, "seed": 1.5}), "field seed must be an integer >= 0, got 1.5"),
    (json.dumps({**_TRACE, "choices": ["tree", 1]}), "field choices must be a list of actor names"),
    (json.dumps({**_TRACE, "choices": {"tree": 1}}), "field choices must be a list of actor names"),
    (json.dumps({k: v for k, v in _TRACE.items() if k != "scenario"}), "no field scenario"),
    ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
])
def test_a_replay_file_that_is_not_a_schedule_trace_is_one_line_with_exit_2(tmp_path: Path, capsys, text: str,
                                                                            says: str) -> None:
    path = tmp_path / "bad.trace.json"
    path.write_text(text)
    assert main(["explore", "--replay", str(path)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"hicache explore: --replay {path} is not a schedule trace") and says in line, line
    with pytest.raises(ValueError, match=re.escape(says)):
        replay(path)


def test_a_replay_file_over_the_size_bound_is_refused_unread(tmp_path: Path, monkeypatch) -> None:
    from hicache.runtime.testing import explore as ex

    monkeypatch.setattr(ex, "TRACE_BYTES_MAX", 1 << 20)
    path = tmp_path / "big.trace.json"
    path.write_text(json.dumps({**_TRACE, "choices": ["tree"] * 200_000}))
    with pytest.raises(ValueError, match=r"cannot read schedule trace .*: larger than 1 MiB"):
        replay(path)


def test_a_trace_that_diverges_from_this_build_fails_as_documented_and_says_diverged(tmp_path: Path, capsys) -> None:
    """docs/testing.md: when the code or inputs no longer allow a recorded choice, the replay
    fails (exit 1) with `ScheduleDivergedError`; it is not reported as a reproduced failure."""
    path = tmp_path / "other-build.trace.json"
    path.write_text(json.dumps({**_TRACE, "choices": ["no-such-actor"]}))
    assert main(["explore", "--replay", str(path)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("diverged: ScheduleDivergedError: step 0: the recorded schedule picks 'no-such-actor'"), err


def _serve_turns(rt, seed, mut, *, wait_first: bool) -> None:
    """A scheduler of one's own: one prompt served three times, L1 emptied between turns, so each
    later turn loads its prefix back from host memory while the forward pass runs."""
    import random

    import torch

    from hicache.actors import KVShape
    from hicache.runtime import Config, HiCache, Request
    from hicache.runtime.oracle import FingerprintOracle

    cfg = Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=32, host_slots=64)
    oracle = FingerprintOracle(KVShape.of(cfg))
    rng = random.Random(f"turns:{seed}")
    prompt = [rng.randrange(1000) for _ in range(13)]
    with HiCache(cfg, runtime=rt, actor_classes=mut.actor_classes if mut else None) as hc:
        for turn in range(3):
            rid = f"r{turn}"
            [got] = hc.admit([Request(rid, prompt[:-1])])
            assert turn == 0 or got.host_hit == 12, got
            cached = got.cached_tokens
            slots = torch.cat([got.device_indices, hc.allocate({rid: len(prompt) - cached})[rid]])
            waiter = hc.start_loads()
            new = oracle.expected(prompt, cached, len(prompt))
            for layer in range(cfg.layers):
                if wait_first:
                    waiter.wait_layer(layer)
                oracle.verify(hc.device_kv, prompt, slots[:cached], layer=layer)
                waiter.wait_layer(layer)
                hc.kv.write(layer, slots[cached:], new[0, layer], new[1, layer])
            hc.commit({rid: prompt[cached:]})
            hc.finish([got.handle])
            hc.quiesce()
            hc.evict_device(cfg.device_slots)
            [other] = hc.admit([Request(f"other{turn}", [])])      # another request's KV overwrites the slots
            slots = hc.allocate({other.request_id: cfg.device_slots})[other.request_id]
            for layer in range(cfg.layers):
                hc.kv.write(layer, slots, *oracle.expected([turn + 1] * len(slots), 0, len(slots))[:, layer])
            hc.abort([other.handle])
        hc.quiesce()


def test_a_scenario_of_ones_own_is_explored_written_and_replayed(tmp_path: Path, capsys) -> None:
    from functools import partial

    from hicache.runtime.explore import Scenario

    right = Scenario("turns", "served right", partial(_serve_turns, wait_first=True))
    report = explore(right, "pct", range(12))
    assert report.failures == [] and report.deterministic and report.scenario == "turns"
    wrong = Scenario("turns", "reads a layer before its load-back lands", partial(_serve_turns, wait_first=False))
    report = explore(wrong, "pct", range(12))
    assert report.failures, "reading before the wait went unnoticed"
    failing = report.failures[0]
    assert failing.scenario == "turns" and "FingerprintMismatchError" in failing.error
    trace, log = write_failure(failing, tmp_path, scenario=wrong)
    assert len(log.read_text().splitlines()) == failing.deliveries
    again = replay(trace, scenario=wrong)
    assert again.error == failing.error and again.digest == failing.digest
    with pytest.raises(ValueError, match="scenario 'turns' is not one of hicache's .*given the Scenario it was"):
        replay(trace)
    with pytest.raises(ValueError, match="recorded with scenario 'turns', not 'other'"):
        replay(trace, scenario=Scenario("other", "", wrong.run))
    assert main(["explore", "--replay", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "scenario 'turns' is not one of hicache's" in err and "replay(trace, scenario=...)" in err
