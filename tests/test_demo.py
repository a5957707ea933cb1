"""`hicache demo` runs end to end on a small prefix of the trace."""

import json

from hicache.runtime.cli import main


def test_demo_round_trips_a_trace_prefix_and_conserves_slots(capsys) -> None:
    assert main(["demo", "--requests", "6", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["requests"] + figures["skipped_longer_than_device"] == 6
    assert figures["requests"] >= 5
    assert figures["verified_tokens"] == figures["input_tokens"] > 0
    assert figures["d2h_bytes"] == figures["h2d_bytes"] > 0
    assert figures["slots_conserved"] is True


def test_demo_rejects_a_non_positive_request_count() -> None:
    import pytest

    with pytest.raises(SystemExit, match="--requests must be > 0"):
        main(["demo", "--requests", "0"])
