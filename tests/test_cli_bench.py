"""`hicache bench transfer --quick --json` prints one JSON object of the agreed shape."""

from __future__ import annotations

import itertools
import json
import time

import pytest

from hicache.runtime.cli import main

ROUNDING = 0.0005
"""The bench rounds gbps, raw_gbps and ratio to 3 decimals."""


@pytest.mark.timeout(60)
def test_bench_transfer_quick_json_covers_both_directions_layouts_and_page_sizes(capsys) -> None:
    started = time.monotonic()
    assert main(["bench", "transfer", "--quick", "--json"]) == 0
    elapsed_s = time.monotonic() - started
    out = capsys.readouterr().out

    body = json.loads(out)  # the whole of stdout is exactly one JSON object
    assert isinstance(body, dict)
    machine = body["machine"]
    assert machine["cpu_count"] >= 1 and machine["torch"] and machine["device"] in ("cpu", "cuda")

    results = body["results"]
    assert len(results) == 12
    cases = {(r["direction"], r["layout"], r["page_size"]) for r in results}
    assert cases == set(itertools.product(("d2h", "h2d"), ("layer_first", "page_first"), (16, 64, 256)))
    for r in results:
        assert set(r) == {"direction", "layout", "page_size", "gbps", "raw_gbps", "ratio"}
        g, raw = r["gbps"], r["raw_gbps"]
        assert g > 0 and raw > 0, r
        # each figure is off by at most ROUNDING, so g / raw is known only that well
        slack = ROUNDING + ROUNDING * (1 / raw + (g + ROUNDING) / (raw * (raw - ROUNDING)))
        assert r["ratio"] == pytest.approx(g / raw, abs=slack), r
    assert elapsed_s < 20, f"the quick bench took {elapsed_s:.1f}s; it is a smoke test"
