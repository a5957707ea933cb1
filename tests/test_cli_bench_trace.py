"""`hicache bench trace --quick --json`: the trace's requests through the facade and the bare
cores, and decode ticks of 1, 8 and 64 running requests, in one JSON object."""

from __future__ import annotations

import json

from hicache.runtime.bench._trace import DECODE_BATCHES, PHASES, run_bench_trace


def test_bench_trace_quick_json_has_every_phase_and_every_decode_batch(capsys) -> None:
    assert run_bench_trace(as_json=True, quick=True, requests=24) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["requests"] == 24 and body["machine"]["device"] == "cpu"
    assert [r["tick"] for r in body["results"]] == [1, 8]
    for row in body["results"]:
        assert 0 < row["requests"] <= 24 and 0 <= row["hit_rate"] < 1
        assert set(row["facade_us"]) == set(row["cores_us"]) == set(PHASES)
        assert row["facade_us_per_request"] > 0 and row["cores_us_per_request"] > 0
        ratio = row["facade_us_per_request"] / row["cores_us_per_request"]
        assert abs(row["facade_over_cores"] - ratio) <= 0.01 * ratio + 0.01
    assert [(r["page"], r["batch"]) for r in body["decode"]] == [(16, b) for b in DECODE_BATCHES]
    for row in body["decode"]:
        assert row["ticks"] > 0 and row["facade_us_per_tick"] > 0 and row["cores_us_per_tick"] > 0
        assert abs(row["facade_us_per_request"] * row["batch"] - row["facade_us_per_tick"]) <= 0.01 * row["facade_us_per_tick"] + 0.1
        assert row["facade_flat_us_per_tick"] > 0
        flat_ratio = row["facade_flat_us_per_tick"] / row["cores_us_per_tick"]
        assert abs(row["facade_flat_over_cores"] - flat_ratio) <= 0.01 * flat_ratio + 0.01
        # The longest of the facade's ticks: at least their mean, at most their sum.
        mean = (row["facade_us_per_tick"] + row["facade_flat_us_per_tick"]) / 2
        assert mean - 0.1 <= row["facade_longest_tick_us"] <= 2 * mean * row["ticks"] + 0.1
