"""`hicache demo` runs end to end on a small prefix of the trace."""

import json
import os
import subprocess
import sys

import pytest

from hicache.runtime.cli import main


def test_demo_serves_a_trace_prefix_through_l1_and_l2_and_reports_every_figure(capsys) -> None:
    assert main(["demo", "--requests", "12", "--json"]) == 0
    f = json.loads(capsys.readouterr().out)
    for key in ("requests", "input_tokens", "hit_tokens_l1", "hit_tokens_l2", "hit_tokens_l3", "recomputed_tokens", "hit_rate",
                "hit_rate_l1_l2", "storage_read_bytes", "storage_written_bytes",
                "hit_rate_l1_only", "hit_rate_infinite", "ttft_p50_s", "ttft_p99_s"):
        assert key in f, key
    assert f["requests"] + f["skipped_longer_than_half_device"] == 12
    assert f["input_tokens"] > 0 and f["verified_tokens"] > 0
    # every request of the trace starts with the same 512-token block: later ones hit it
    assert f["hit_tokens_l1"] >= 512 * (f["requests"] - 8)
    hits = f["hit_tokens_l1"] + f["hit_tokens_l2"] + f["hit_tokens_l3"]
    assert f["hit_rate"] == pytest.approx(hits / f["input_tokens"], abs=1e-4)
    assert f["storage"] == "file" and f["storage_written_bytes"] > 0  # write-throughs backed up to L3
    assert max(f["hit_rate_l1_only"], f["hit_rate_l1_l2"], f["hit_rate"]) <= f["hit_rate_infinite"]
    assert 0 < f["ttft_p50_s"] <= f["ttft_p99_s"]
    assert f["d2h_bytes"] > 0


def test_demo_hits_storage_once_the_host_tier_has_evicted_what_later_requests_reuse(capsys) -> None:
    """Past the first hundred requests the trace reuses prefixes that L2 (sixteen times L1) no longer
    holds: with the file L3 they come back from storage, and the hit rate beats L1 + L2."""
    assert main(["demo", "--requests", "150", "--json"]) == 0
    f = json.loads(capsys.readouterr().out)
    assert f["hit_tokens_l3"] > 0 and f["storage_read_bytes"] > 0
    assert f["hit_rate"] > f["hit_rate_l1_l2"]
    assert f["verified_tokens"] > 0


def test_demo_without_storage_serves_l1_and_l2_only(capsys) -> None:
    assert main(["demo", "--requests", "6", "--json", "--storage", "none"]) == 0
    f = json.loads(capsys.readouterr().out)
    assert f["storage"] == "none" and f["hit_tokens_l3"] == 0 and f["storage_written_bytes"] == 0
    assert f["hit_rate"] == f["hit_rate_l1_l2"]


def test_demo_rejects_a_request_count_outside_the_trace_in_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["demo", "--requests", "0"])
    assert refused.value.code == 2
    assert capsys.readouterr().err == "hicache demo: argument --requests: 0 must be >= 1 (see hicache demo --help)\n"
    assert main(["demo", "--requests", "999999"]) == 2
    assert capsys.readouterr().err == ("hicache demo: --requests 999999: the embedded trace has 12,031 requests; "
                                       "give 1..12031\n")


def test_demo_shows_progress_lines_off_a_terminal(capsys) -> None:
    assert main(["demo", "--requests", "10", "--json", "--storage", "none"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert any(line.startswith("serving 10 trace requests, L1 + L2: 100% (10/10)") for line in lines), lines
    assert any(line.startswith("serving 10 trace requests, L1 only: 100% (10/10)") for line in lines), lines


def test_demo_states_its_cost_model_in_the_json(capsys) -> None:
    assert main(["demo", "--requests", "3", "--json", "--prefill-tps", "1000", "--l2-gbps", "5"]) == 0
    f = json.loads(capsys.readouterr().out)
    assert f["cost_model"]["prefill_tokens_per_s"] == 1000.0 and f["cost_model"]["l2_gbps"] == 5.0


def test_the_demo_and_simulate_load_without_the_model_extra() -> None:
    """`make demo` installs the project without extras: nothing the demo imports may need transformers."""
    code = ("import sys, hicache.runtime.demo._demo, hicache.runtime.demo._simulate, hicache.runtime.demo; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'mooncake')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_a_model_that_is_neither_tiny_nor_a_model_directory_is_one_line_with_exit_2(capsys, tmp_path) -> None:
    nowhere = tmp_path / "nowhere"
    assert main(["demo", "--model", str(nowhere)]) == 2
    assert capsys.readouterr().err == (f"hicache demo: --model takes 'tiny' or a local transformers model directory "
                                       f"(with a config.json); '{nowhere}' is neither\n")


@pytest.mark.skipif(not (os.path.exists("/dev/full") and os.access("/dev/full", os.W_OK)),
                    reason="needs Linux's /dev/full (it opens for writing and refuses every byte)")
def test_a_log_file_that_refuses_bytes_is_refused_before_serving(capsys) -> None:
    assert main(["demo", "--requests", "1", "--log", "/dev/full"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ("hicache demo: --log /dev/full: cannot be written (No space left "
                                                   "on device); give a file in a folder this process may write\n")


def test_a_log_another_instance_is_writing_is_refused_and_left_whole(capsys, tmp_path) -> None:
    """The check that the log takes bytes must not empty a log another running instance
    holds (the delivery log's lock says so)."""
    import fcntl

    log = tmp_path / "shared.log"
    log.write_bytes(b"another instance's lines\n")
    with log.open("ab") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert main(["demo", "--requests", "1", "--log", str(log)]) == 2
    assert capsys.readouterr().err == (f"hicache demo: --log {log}: another running instance is writing it; give "
                                       "each run a log file of its own\n")
    assert log.read_bytes() == b"another instance's lines\n"
