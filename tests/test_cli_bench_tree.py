"""`hicache bench overhead --quick --json` and `hicache bench tree --quick --json` each
print one JSON object with the agreed keys, positive figures and a ratio that is the
quotient of the two figures it compares."""

from __future__ import annotations

import json
import time

import pytest

from hicache.runtime.cli import main

ROUNDING = 0.0005
"""Both benches round their figures and ratios to 3 decimals."""


def _run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[dict, float]:
    started = time.monotonic()
    assert main(argv) == 0
    elapsed_s = time.monotonic() - started
    body = json.loads(capsys.readouterr().out)  # the whole of stdout is exactly one JSON object
    assert isinstance(body, dict)
    machine = body["machine"]
    assert machine["cpu_count"] >= 1 and machine["torch"]
    assert body["workload"]["quick"] is True
    return body, elapsed_s


def _assert_quotient(ratio: float, top: float, bottom: float) -> None:
    """`ratio` is `top / bottom`, up to the rounding of all three."""
    slack = ROUNDING + ROUNDING * (1 / bottom + (top + ROUNDING) / (bottom * (bottom - ROUNDING)))
    assert ratio == pytest.approx(top / bottom, abs=slack)


@pytest.mark.timeout(60)
def test_bench_overhead_quick_json_times_both_sides_of_one_batch(capsys) -> None:
    body, elapsed_s = _run_json(["bench", "overhead", "--quick", "--json"], capsys)

    assert {"batch", "actor_ms", "direct_ms", "ratio", "round_trip_p50_us"} <= set(body)
    assert body["batch"] == 64
    for key in ("actor_ms", "direct_ms", "ratio", "round_trip_p50_us"):
        assert isinstance(body[key], (int, float)) and body[key] > 0, (key, body[key])
    _assert_quotient(body["ratio"], body["actor_ms"], body["direct_ms"])
    assert body["round_trip_p99_us"] >= body["round_trip_p50_us"]
    # a bare ask costs far less than a whole batch through the actors
    assert body["round_trip_p50_us"] / 1e3 < body["actor_ms"]
    assert body["prompt_tokens"] > 0 and body["inserted_tokens"] > 0
    assert elapsed_s < 15, f"the quick bench took {elapsed_s:.1f}s; it is a smoke test"


@pytest.mark.timeout(60)
def test_bench_tree_quick_json_reports_eviction_cost_at_a_small_and_a_large_tree(capsys) -> None:
    body, elapsed_s = _run_json(["bench", "tree", "--quick", "--json"], capsys)

    assert {"evict_us_small", "evict_us_large", "evict_ratio"} <= set(body)
    for key in ("evict_us_small", "evict_us_large", "evict_ratio"):
        assert isinstance(body[key], (int, float)) and body[key] > 0, (key, body[key])
    _assert_quotient(body["evict_ratio"], body["evict_us_large"], body["evict_us_small"])

    sizes = body["sizes"]
    assert len(sizes) >= 2
    assert [s["pages"] for s in sizes] == sorted(s["pages"] for s in sizes)
    for s, wanted in zip(sizes, body["workload"]["sizes"], strict=True):
        assert s["pages"] >= wanted and s["nodes"] > 0
        assert s["match_pages_per_s"] > 0 and s["insert_pages_per_s"] > 0 and s["evict_us_per_page"] > 0
    assert sizes[0]["evict_us_per_page"] == pytest.approx(body["evict_us_small"], abs=ROUNDING)
    assert sizes[-1]["evict_us_per_page"] == pytest.approx(body["evict_us_large"], abs=ROUNDING)
    assert elapsed_s < 15, f"the quick bench took {elapsed_s:.1f}s; it is a smoke test"
