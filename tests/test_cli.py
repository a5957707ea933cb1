"""The command line's manners: every user mistake is one line on stderr with exit 2, help is
instant (nothing heavy imported) and shows defaults and choices."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hicache.runtime import cli
from hicache.runtime.cli import main
from hicache.runtime.demo._progress import LineProgress


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run `hicache argv`; it must exit 2 with exactly one line on stderr, returned."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, (argv, code, err)
    assert err.endswith("\n") and err.count("\n") == 1, (argv, err)
    return err


@pytest.mark.parametrize(("argv", "says"), [
    (["demo", "--prefill-tps", "0"], "hicache demo: argument --prefill-tps: 0 must be >= 1e-12"),
    (["demo", "--l2-gbps", "fast"], "hicache demo: argument --l2-gbps: 'fast' is not a number"),
    (["explore", "--depth", "0"], "hicache explore: argument --depth: 0 must be >= 1"),
    (["explore", "--seeds", "-3"], "hicache explore: argument --seeds: -3 must be >= 1"),
    (["explore", "--seeds", "9" * 50], f"hicache explore: argument --seeds: {'9' * 50} is more than any count takes "
                                       "(at most 4611686018427387903)"),
    (["explore", "--scenario", "nope"], "invalid choice: 'nope' (choose from 'standard', 'faults', 'misuse', 'pressure', 'orphans', 'overlap', 'storage')"),
    (["replay", "x.log", "--actor", "prefetch"], "hicache replay: argument --actor: invalid choice: 'prefetch'"),
    (["soak", "--every-s", "0"], "hicache soak: argument --every-s: 0 must be >= 1e-12"),
    (["bench", "storage", "--mib", "0"], "hicache bench storage: argument --mib: 0 must be >= 2"),
    (["simulate", "--l1", "100k"], "hicache simulate: the following arguments are required: --trace"),
    (["frobnicate"], "hicache: argument COMMAND: invalid choice: 'frobnicate'"),
    (["demo", "--l2-gbps", "1e-300"], "hicache demo: argument --l2-gbps: 1e-300 must be >= 1e-12"),
    (["simulate", "--trace", "t.jsonl", "--l1", "1k", "--prefill-tps", "inf"],
     "hicache simulate: argument --prefill-tps: 'inf' is not a finite number; give one >= 1e-12"),
    (["simulate", "--trace", "t.jsonl", "--l1", "1k", "--l2-gbps", "nan"], "argument --l2-gbps: 'nan' is not a finite"),
    (["demo", "--l3-gbps=1e999"], "hicache demo: argument --l3-gbps: '1e999' is not a finite number"),
    (["soak", "--minutes", "inf"], "hicache soak: argument --minutes: 'inf' is not a finite number"),
    (["soak", "--every-s=-inf"], "hicache soak: argument --every-s: '-inf' is not a finite number"),
    (["bench", "storage", "--mib", "1"], "hicache bench storage: argument --mib: 1 must be >= 2"),
    (["bench", "storage", "--read-threads", "100"],
     "hicache bench storage: argument --read-threads: 100 must be in 1..64"),
])
def test_an_argument_argparse_refuses_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                  says: str) -> None:
    assert says in _refused(capsys, argv)


def test_a_log_into_a_missing_folder_is_refused_before_serving(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    err = _refused(capsys, ["demo", "--requests", "1", "--log", str(tmp_path / "no" / "such" / "x.log")])
    assert "does not exist or is not writable" in err


def test_a_log_that_is_a_folder_is_refused_before_serving(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "is a folder; give the path of a file to write" in _refused(capsys, ["demo", "--requests", "1", "--log",
                                                                                   str(tmp_path)])


def test_a_delivery_log_given_to_explore_replay_is_refused_with_the_right_command(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text('{"seq": 1, "actor": "tree"}\n{"seq": 2, "actor": "tree"}\n')
    err = _refused(capsys, ["explore", "--replay", str(log)])
    assert "is not a schedule trace written by hicache explore" in err and "hicache replay LOG" in err


def test_a_missing_mooncake_master_is_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "hicache.runtime.cli", "demo", "--requests", "1", "--storage",
                           "mooncake", "--mooncake-master", "127.0.0.1:9"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("hicache demo: cannot reach the Mooncake master")


def test_help_imports_neither_torch_nor_the_actors() -> None:
    probe = ("import sys, time\nt0 = time.perf_counter()\nfrom hicache.runtime.cli import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('torch', 'hicache.actors', 'hicache.messages', 'rich') if m in sys.modules),"
             " file=sys.stderr)")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - t0
    assert done.returncode == 0 and done.stderr.strip() == "[]", done.stderr
    assert "simulate" in done.stdout and wall < 5.0  # the 0.3 s figure is in docs/benchmarks.md


def test_help_shows_defaults_and_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["explore", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "{standard,faults,misuse,pressure,orphans,overlap,storage}" in text and "(default: standard)" in text
    assert "(default: 100)" in text and "--json print one JSON object --out" in text  # no default shown for a flag
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 600)" in text and "(default: 8000.0)" in text and "{file,mooncake,none}" in text


def test_the_cli_lists_agree_with_what_they_name() -> None:
    from hicache.runtime import EvictionPolicy, PrefetchPolicy, WritePolicy
    from hicache.runtime.demo._demo import DEMO_REQUESTS, CostModel
    from hicache.runtime.testing.explore import SCENARIOS

    assert cli.SCENARIOS == tuple(SCENARIOS)
    assert cli.WRITE_POLICIES == tuple(p.value for p in WritePolicy)
    assert cli.EVICTION_POLICIES == tuple(p.value for p in EvictionPolicy)
    assert cli.PREFETCH_POLICIES == tuple(p.value for p in PrefetchPolicy)
    demo = {a.dest: a.default for a in cli._parser()._subparsers._group_actions[0].choices["demo"]._actions}
    cost = {f.name: f.default for f in dataclasses.fields(CostModel)}
    assert demo["requests"] == DEMO_REQUESTS
    assert (demo["prefill_tps"], demo["l2_gbps"], demo["l3_gbps"], demo["kv_bytes_per_token"]) == (
        cost["prefill_tokens_per_s"], cost["l2_gbps"], cost["l3_gbps"], cost["kv_bytes_per_token"])


def test_progress_off_a_terminal_is_a_line_per_tenth() -> None:
    out = io.StringIO()
    bar = LineProgress(out)
    task = bar.add_task("serving", total=200)
    for _ in range(200):
        bar.advance(task)
    lines = out.getvalue().splitlines()
    assert [line.split(":")[1].split("%")[0].strip() for line in lines] == [str(10 * i) for i in range(1, 11)]
    assert lines[-1].startswith("serving: 100% (200/200)")


def test_soak_names_its_model_so_its_instances_start_without_the_storage_warning(tmp_path: Path) -> None:
    from hicache.runtime import HiCache
    from hicache.runtime.cli._soak import _config
    from hicache.runtime.testing import capture_logs

    for seed in range(3):  # each instance the soak starts (every prefetch policy)
        with capture_logs() as logs, HiCache(_config(str(tmp_path), seed)):
            pass
        assert not [e for e in logs if e["event"].startswith("storage keys")], logs
