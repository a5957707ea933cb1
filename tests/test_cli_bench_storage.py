"""`hicache bench storage --mib 4 --json` prints one JSON object: a row per backend and
host layout, each with positive figures and a ratio that is the quotient of the two it
compares; and a backend that cannot run is an error row, not a crash."""

from __future__ import annotations

import itertools
import json
import time

import pytest

from hicache.runtime import MasterStartError
from hicache.runtime import _bench_storage
from hicache.runtime.cli import main

ROUNDING = 0.0005
"""The bench rounds gbps, raw_gbps and ratio to 3 decimals."""


def _run_json(capsys: pytest.CaptureFixture[str]) -> tuple[dict, float]:
    started = time.monotonic()
    assert main(["bench", "storage", "--mib", "4", "--json"]) == 0
    elapsed_s = time.monotonic() - started
    body = json.loads(capsys.readouterr().out)  # the whole of stdout is exactly one JSON object
    assert isinstance(body, dict)
    return body, elapsed_s


@pytest.mark.timeout(90)
def test_bench_storage_json_has_a_row_per_backend_and_layout_with_its_raw_read(capsys) -> None:
    body, elapsed_s = _run_json(capsys)

    assert body["machine"]["cpu_count"] >= 1 and body["machine"]["torch"]
    assert body["workload"]["pages"] == 2 and body["workload"]["page_bytes"] == 2 << 20
    rows = body["results"]
    assert {(r["backend"], r["layout"]) for r in rows} == set(
        itertools.product(("file", "mooncake"), ("layer_first", "page_first"))
    )
    for r in rows:
        assert set(r) == {"backend", "layout", "gbps", "raw_gbps", "ratio", "write_gbps", "error"}
        assert r["error"] == "", r
        g, raw = r["gbps"], r["raw_gbps"]
        assert g > 0 and raw > 0 and r["write_gbps"] > 0, r
        slack = ROUNDING + ROUNDING * (1 / raw + (g + ROUNDING) / (raw * (raw - ROUNDING)))
        assert r["ratio"] == pytest.approx(g / raw, abs=slack), r
    assert elapsed_s < 45, f"the small bench took {elapsed_s:.1f}s"


@pytest.mark.timeout(60)
def test_a_master_that_cannot_start_is_an_error_row_not_a_crash(capsys, monkeypatch) -> None:
    def no_master(self: object) -> None:
        raise MasterStartError("mooncake_master was not found (test)")

    monkeypatch.setattr(_bench_storage.MooncakeMaster, "start", no_master)
    body, _ = _run_json(capsys)

    rows = {(r["backend"], r["layout"]): r for r in body["results"]}
    assert all(rows[("file", layout)]["error"] == "" for layout in ("layer_first", "page_first"))
    for layout in ("layer_first", "page_first"):
        row = rows[("mooncake", layout)]
        assert "mooncake_master was not found" in row["error"]
        assert row["gbps"] is None and row["ratio"] is None
