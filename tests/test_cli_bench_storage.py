"""`hicache bench storage --mib 4 --json` prints one JSON object: a row per backend, host
layout and page size, each with positive read and write figures and ratios that are the
quotients of the two they compare; and a backend that cannot run is an error row, not a crash."""

from __future__ import annotations

import itertools
import json
import os
import time

import pytest

from hicache.runtime.bench import _storage as _bench_storage
from hicache.runtime import cli
from hicache.runtime._usage import UsageError
from hicache.runtime.cli import main
from hicache.runtime.testing import MasterStartError

ROUNDING = 0.0005
"""The bench rounds gbps, raw_gbps and ratio to 3 decimals."""


def _run_json(capsys: pytest.CaptureFixture[str]) -> tuple[dict, float]:
    started = time.monotonic()
    assert main(["bench", "storage", "--mib", "4", "--json"]) == 0
    elapsed_s = time.monotonic() - started
    body = json.loads(capsys.readouterr().out)  # the whole of stdout is exactly one JSON object
    assert isinstance(body, dict)
    return body, elapsed_s


@pytest.mark.timeout(120)
def test_bench_storage_json_has_a_row_per_backend_layout_and_page_size_with_its_raw_io(capsys) -> None:
    body, elapsed_s = _run_json(capsys)

    assert body["machine"]["cpu_count"] >= 1 and body["machine"]["torch"]
    assert body["workload"]["pages"] == {"2MiB": 2, "64KiB": 64, "2KiB": 2048}
    assert body["workload"]["read_pages"] == {"2MiB": 16, "64KiB": 16, "2KiB": 512}  # a prefetch step's pages
    rows = body["results"]
    assert {(r["backend"], r["layout"], r["page"]) for r in rows} == set(
        itertools.product(("file", "mooncake"), ("layer_first", "page_first"), ("2MiB", "64KiB", "2KiB"))
    )
    for r in rows:
        assert set(r) == {"backend", "layout", "page", "read_gbps", "raw_read_gbps", "read_ratio", "write_gbps",
                          "raw_write_gbps", "write_ratio", "error"}
        assert r["error"] == "", r
        for side in ("read", "write"):
            g, raw = r[f"{side}_gbps"], r[f"raw_{side}_gbps"]
            assert g > 0 and raw > 0, r
            slack = ROUNDING + ROUNDING * (1 / raw + (g + ROUNDING) / (raw * (raw - ROUNDING)))
            assert r[f"{side}_ratio"] == pytest.approx(g / raw, abs=slack), r
    assert elapsed_s < 90, f"the small bench took {elapsed_s:.1f}s"


@pytest.mark.timeout(90)
def test_a_master_that_cannot_start_is_an_error_row_not_a_crash(capsys, monkeypatch) -> None:
    def no_master(self: object) -> None:
        raise MasterStartError("mooncake_master was not found (test)")

    monkeypatch.setattr(_bench_storage.MooncakeMaster, "start", no_master)
    body, _ = _run_json(capsys)

    rows = {(r["backend"], r["layout"], r["page"]): r for r in body["results"]}
    cells = list(itertools.product(("layer_first", "page_first"), ("2MiB", "64KiB", "2KiB")))
    assert all(rows[("file", *cell)]["error"] == "" for cell in cells)
    for cell in cells:
        row = rows[("mooncake", *cell)]
        assert "mooncake_master was not found" in row["error"]
        assert row["read_gbps"] is None and row["write_ratio"] is None


@pytest.mark.timeout(120)
def test_load_back_times_an_l3_hits_path_to_the_device_for_the_chosen_backend(capsys) -> None:
    assert main(["bench", "storage", "--mib", "4", "--backend", "file", "--load-back", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert {r["backend"] for r in body["results"]} == {"file"}
    paths = body["load_back"]
    assert [(r["backend"], r["layout"]) for r in paths] == [("file", "layer_first"), ("file", "page_first")]
    for r in paths:
        assert r["error"] == "" and r["device"] == body["machine"]["device"], r
        for part in ("read", "load", "path"):
            assert r[f"{part}_gbps"] > 0 and r[f"raw_{part}_gbps"] > 0, r
        # the path's time is its read's and its load's: its rate is below either's
        assert r["path_gbps"] <= min(r["read_gbps"], r["load_gbps"]) + ROUNDING, r
        slack = ROUNDING + ROUNDING * (1 / r["raw_path_gbps"] + 2 / r["raw_path_gbps"] ** 2)
        assert r["path_ratio"] == pytest.approx(r["path_gbps"] / r["raw_path_gbps"], abs=slack), r


@pytest.mark.timeout(60)
def test_load_back_on_a_backend_that_cannot_run_is_an_error_row(capsys, monkeypatch) -> None:
    def no_master(self: object) -> None:
        raise MasterStartError("mooncake_master was not found (test)")

    monkeypatch.setattr(_bench_storage.MooncakeMaster, "start", no_master)
    assert main(["bench", "storage", "--mib", "4", "--backend", "mooncake", "--load-back", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert {r["backend"] for r in body["results"]} == {"mooncake"}
    assert [r["layout"] for r in body["load_back"]] == ["layer_first", "page_first"]
    for r in body["load_back"]:
        assert "mooncake_master was not found" in r["error"] and r["path_ratio"] is None


@pytest.mark.timeout(120)
def test_read_threads_reach_the_backends_and_the_report(capsys, monkeypatch) -> None:
    opened: list[int] = []
    real = _bench_storage.open_backend

    def recording(config):  # type: ignore[no-untyped-def]
        opened.append(config.storage_read_threads)
        return real(config)

    monkeypatch.setattr(_bench_storage, "open_backend", recording)
    assert main(["bench", "storage", "--mib", "2", "--backend", "file", "--read-threads", "3", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["workload"]["read_threads"] == 3 and opened and set(opened) == {3}
    assert all(r["error"] == "" and r["read_gbps"] > 0 for r in body["results"])

    opened.clear()
    assert main(["bench", "storage", "--mib", "2", "--backend", "file", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["read_threads"] == 2 and set(opened) == {2}


@pytest.mark.timeout(30)
def test_read_threads_outside_one_to_64_are_refused_with_the_range(capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["bench", "storage", "--mib", "2", "--backend", "file", "--read-threads", "65", "--json"])
    assert refused.value.code == 2
    assert capsys.readouterr().err == ("hicache bench storage: argument --read-threads: 65 must be in 1..64 "
                                       "(see hicache bench storage --help)\n")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("kwargs", "says"), [
    ({"mib": 1}, "--mib 1: give at least 2 (one 2 MiB page)"),
    ({"mib": 2, "read_threads": 65}, "--read-threads must be in 1..64, got 65"),
    ({"mib": 2, "write_pages": 0}, "--write-pages 0: give at least 1"),
    ({"mib": 2, "backends": ("tape",)}, "unknown backend ['tape']"),
    ({"mib": 2, "where": "/nonexistent/l3"}, "--dir /nonexistent/l3: not a writable directory"),
])
def test_the_bench_refuses_what_cannot_run_as_a_usage_error_that_exits_2(capsys, kwargs, says) -> None:
    """Called from Python it raises `UsageError` (exit 2 through the command line), not
    `SystemExit` with a message (exit 1)."""
    with pytest.raises(UsageError) as refused:
        _bench_storage.run_bench_storage(as_json=True, **kwargs)
    assert str(refused.value).startswith(says)
    assert capsys.readouterr().out == ""  # refused before any backend was timed


def test_the_command_lines_bounds_and_help_are_the_benchs(capsys) -> None:
    """`--mib` and `--read-threads` are parsed without importing the bench (so `--help` stays
    instant); their bounds and their help must still be the bench's."""
    low, high = _bench_storage.MIB_MIN, _bench_storage.READ_THREADS_MAX
    parse = cli._parser().parse_args
    args = parse(["bench", "storage", "--mib", str(low), "--read-threads", str(high)])
    assert (args.mib, args.read_threads) == (low, high)
    for wrong in (["--mib", str(low - 1)], ["--read-threads", str(high + 1)], ["--read-threads", "0"]):
        with pytest.raises(SystemExit):
            parse(["bench", "storage", *wrong])
    with pytest.raises(SystemExit):
        parse(["bench", "storage", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert f"at least {low} (one 2 MiB page)" in shown and f"storage_read_threads, 1..{high}:" in shown


@pytest.mark.timeout(60)
def test_dir_puts_the_file_backends_pages_on_the_file_system_given_and_names_it(capsys, tmp_path,
                                                                               monkeypatch) -> None:
    """The pages and the raw side's file go to a fresh directory in `--dir` (the file system
    an L3 is to run on), which the report names with its type; nothing is left there."""
    made: list[str] = []
    real = _bench_storage.tempfile.TemporaryDirectory

    def recording(*args, **kwargs):
        made.append(kwargs.get("dir"))
        return real(*args, **kwargs)

    monkeypatch.setattr(_bench_storage.tempfile, "TemporaryDirectory", recording)
    assert main(["bench", "storage", "--mib", "2", "--backend", "file", "--dir", str(tmp_path), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert made == [str(tmp_path)]
    assert body["workload"]["file_dir"] == str(tmp_path)
    kind, _, point = body["workload"]["file_system"].partition(" at ")
    mounts = [line.split()[1:3] for line in open("/proc/self/mounts", encoding="utf-8")]
    assert [point, kind] in mounts and os.path.realpath(tmp_path).startswith(point)
    assert all(r["error"] == "" for r in body["results"])
    assert list(tmp_path.iterdir()) == []  # the bench's directory went with it
