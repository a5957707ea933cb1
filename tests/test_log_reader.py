"""Reading delivery logs that a crash cut short or that something damaged: a crashed run's log
replays up to its last contiguous delivery and says so on one line (exit 0); a changed, lost,
repeated or malformed line, a missing delivery in a closed log and every malformed header field
are one line naming the line (exit 2); the reader's memory does not grow with the log."""

from __future__ import annotations

import base64
import json
import re
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from hicache.actors import SeededFaults
from hicache.messages import ActorName, FreeHostSlots, Indices
from hicache.runtime import Config, HiCache, LogReader, _log, _log_reader, read_log, rewrite_log
from hicache.runtime.cli import main
from hicache.runtime.testing import DeterministicRuntime, replay_log
from hicache.runtime.testing._scheduler import ReferenceScheduler, SchedulerConfig
from hicache.runtime.testing.explore import synthetic_workload

CONFIG = Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=96, host_slots=192)


def _run(path: Path, runtime: Any = None, requests: int = 12, config: Config = CONFIG, seed: int = 1) -> Path:
    with HiCache(config.replace(log_path=str(path)), runtime=runtime) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(max_running=4, prefill_tokens_per_tick=16, chunk_tokens=8,
                                                       abort_rate=0.05, seed=seed, lookahead_slots=2,
                                                       device_budget_ratio=2.0))
        sched.submit(synthetic_workload(seed, requests, config.page_size))
        sched.run(on_tick=lambda s: hc.check_invariants())
        hc.quiesce()
    return path


@pytest.fixture(scope="module")
def threaded_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run on threads: its delivery lines come out of `seq` order."""
    return _run(tmp_path_factory.mktemp("logs") / "threads.log")


@pytest.fixture(scope="module")
def faults_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A deterministic run whose fault plan fails transfers and host reservations."""
    faults = SeededFaults(5, transfer_fail_rate=0.2, host_exhausted_rate=0.2)
    return _run(tmp_path_factory.mktemp("logs") / "faults.log", DeterministicRuntime(seed=5, faults=faults), seed=5)


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def _replay(path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["replay", str(path), *args])
    out, err = capsys.readouterr()
    return code, out.strip(), err.strip()


def _refused(path: Path, capsys: pytest.CaptureFixture[str], pattern: str) -> str:
    """Replay of `path` is one line on stderr matching `pattern`, exit 2, nothing on stdout."""
    code, out, err = _replay(path, capsys)
    assert (code, out) == (2, ""), (code, out, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(pattern, err), err
    return err


def _contiguous(records: list[dict[str, Any]]) -> int:
    """The last delivery of the unbroken run from 1 among `records`."""
    seqs = {r["seq"] for r in records if r.get("event") == "delivery"}
    last = 0
    while last + 1 in seqs:
        last += 1
    return last


# -- a crashed run's log ---------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.35, 0.6, 0.85, 0.999])
def test_a_log_cut_at_a_line_boundary_replays_to_its_last_contiguous_delivery_and_says_so(
    threaded_log: Path, tmp_path: Path, capsys, fraction: float
) -> None:
    lines = threaded_log.read_bytes().splitlines(keepends=True)
    kept = lines[: max(1, int(len(lines) * fraction))]
    cut = tmp_path / "cut.log"
    cut.write_bytes(b"".join(kept))
    last = _contiguous(_records(cut))

    code, out, err = _replay(cut, capsys)

    assert (code, err) == (0, ""), err
    assert len(out.splitlines()) == 1, out
    whole = replay_log(read_log(threaded_log), until=last)  # the same deliveries, from the closed log
    assert out.startswith(f"replayed {whole.deliveries} deliveries, no divergence, up to delivery {last}: "
                          "the log has no end line"), out
    assert whole.divergence is None


@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.9])
def test_a_log_cut_inside_a_line_ignores_that_line_and_names_it(threaded_log: Path, tmp_path: Path, capsys,
                                                                fraction: float) -> None:
    data = threaded_log.read_bytes()
    at = int(len(data) * fraction)
    while data[at - 1:at] == b"\n":
        at += 1  # inside a line
    cut = tmp_path / "cut.log"
    cut.write_bytes(data[:at])
    whole = data[:at].split(b"\n")[:-1]
    whole_lines = len(whole)
    last = _contiguous([json.loads(line) for line in whole])

    code, out, _ = _replay(cut, capsys, "--json")

    assert code == 0
    result = json.loads(out)
    assert result["divergence"] is None and result["last_seq"] == last
    assert f"its last line, {whole_lines + 1}, is cut short" in result["stopped"]


def test_a_log_still_being_written_is_read_as_it_was_when_the_reader_opened_it(threaded_log: Path,
                                                                             tmp_path: Path) -> None:
    """A reader followed the lines its run went on writing: replay of a running server's log
    chased its end as long as the run logged faster than replay read."""
    data = threaded_log.read_bytes()
    at = data.index(b"\n", len(data) // 2) + 1
    live = tmp_path / "live.log"
    live.write_bytes(data[:at])
    with LogReader(live) as reader:
        with live.open("ab") as run:  # the run goes on writing, to its end line
            run.write(data[at:])
        deliveries = list(reader)
        assert reader.end is not None and not reader.end.complete, reader.end
        assert reader.bytes_read == reader.size == at
    assert deliveries[-1].seq == _contiguous([json.loads(line) for line in data[:at].splitlines()])
    assert read_log(live).end.complete  # read again: all of it


def test_a_crashed_logs_deliveries_after_a_missing_one_are_left_out_and_counted(threaded_log: Path,
                                                                               tmp_path: Path, capsys) -> None:
    # a run that died while one handler ran: its delivery line never came, some lines after it did
    records = _records(threaded_log)
    lost = next(r for r in records if r.get("type") == "WriteDone")
    prefix = [r for r in records[: lost["n"] + 12] if r is not lost]
    crashed = _rewrite(threaded_log, tmp_path / "crashed.log", {r["n"] for r in prefix})
    last = _contiguous(prefix)
    left = sum(1 for r in prefix if r.get("event") == "delivery" and r["seq"] > last)
    assert last == lost["seq"] - 1 and left > 0

    code, out, _ = _replay(crashed, capsys)

    assert code == 0
    assert f"up to delivery {last}: the log has no end line" in out
    assert f"delivery {lost['seq']} is missing and the {left} after it are left out" in out


def _rewrite(src: Path, dst: Path, keep: set[int] | None = None, edit: Any = None) -> Path:
    """`src` with only the lines numbered in `keep` (all: None), each record through `edit`
    (None: as it is), numbered and sealed again."""
    numbers = iter(range(1, 1 << 62))

    def change(rec: dict[str, Any]) -> dict[str, Any] | None:
        if keep is not None and next(numbers) not in keep:
            return None
        return edit(rec) if edit is not None else rec

    rewrite_log(src, dst, change)
    return dst


def _without(path: Path, *numbers: int) -> set[int]:
    """Every line number of `path` but `numbers`."""
    return set(range(1, len(_records(path)) + 1)) - set(numbers)


def test_a_log_with_only_its_header_replays_nothing_and_says_why(threaded_log: Path, tmp_path: Path, capsys) -> None:
    only = tmp_path / "header.log"
    only.write_bytes(threaded_log.read_bytes().split(b"\n", 1)[0] + b"\n")
    code, out, _ = _replay(only, capsys)
    assert code == 0 and out.startswith("replayed 0 deliveries, no divergence, up to delivery 0: the log has no end")


def test_a_header_cut_short_is_refused(threaded_log: Path, tmp_path: Path, capsys) -> None:
    cut = tmp_path / "cut.log"
    cut.write_bytes(threaded_log.read_bytes()[:200])
    _refused(cut, capsys, r"line 1: the header line is cut short")


# -- damage ---------------------------------------------------------------------------------------


def _line_of(path: Path, event: str, nth: int = 3) -> int:
    """The number of the `nth` line of kind `event`."""
    return [i for i, r in enumerate(_records(path), start=1) if r.get("event") == event][nth]


@pytest.mark.parametrize("event", ["header", "delivery", "blob", "fault"])
def test_one_changed_byte_in_any_line_is_a_checksum_mismatch_naming_it(blob_faults_log: Path, tmp_path: Path,
                                                                        capsys, event: str) -> None:
    """The header's too: read as a header before its seal was checked, a changed byte there was
    named a log version, a missing header or a line that is not JSON."""
    lines = blob_faults_log.read_bytes().splitlines(keepends=True)
    n = 1 if event == "header" else _line_of(blob_faults_log, event)
    line = bytearray(lines[n - 1])
    at = line.index(b'"header"') + 2 if event == "header" else line.index(b'"event"') - 3  # in a value
    line[at] = ord("1") if line[at] != ord("1") else ord("2")
    lines[n - 1] = bytes(line)
    bad = tmp_path / "changed.log"
    bad.write_bytes(b"".join(lines))
    _refused(bad, capsys, rf"line {n}: checksum mismatch: the line was changed or damaged")


def test_a_blob_cut_short_by_8_bytes_is_damage_not_a_clean_replay(blob_faults_log: Path, tmp_path: Path,
                                                                   capsys) -> None:
    lines = blob_faults_log.read_bytes().splitlines(keepends=True)
    n = _line_of(blob_faults_log, "blob")
    rec = json.loads(lines[n - 1])
    data = base64.b64decode(rec["data"])
    short = base64.b64encode(data[:-8])
    lines[n - 1] = lines[n - 1].replace(rec["data"].encode(), short)
    bad = tmp_path / "short-blob.log"
    bad.write_bytes(b"".join(lines))
    _refused(bad, capsys, rf"line {n}: checksum mismatch")


@pytest.mark.parametrize("event", ["delivery", "blob", "fault"])
def test_a_deleted_line_of_any_kind_is_named_by_the_line_after_it(blob_faults_log: Path, tmp_path: Path, capsys,
                                                                  event: str) -> None:
    lines = blob_faults_log.read_bytes().splitlines(keepends=True)
    n = _line_of(blob_faults_log, event)
    bad = tmp_path / "deleted.log"
    bad.write_bytes(b"".join(lines[: n - 1] + lines[n:]))
    _refused(bad, capsys, rf"line {n}: the line is numbered {n + 1}: 1 line\(s\) before it are missing")


def test_a_repeated_line_and_swapped_lines_are_named(threaded_log: Path, tmp_path: Path, capsys) -> None:
    lines = threaded_log.read_bytes().splitlines(keepends=True)
    bad = tmp_path / "repeated.log"
    bad.write_bytes(b"".join(lines[:20] + lines[19:]))
    _refused(bad, capsys, r"line 21: the line is numbered 20: it is repeated or out of place")
    bad.write_bytes(b"".join(lines[:20] + [lines[21], lines[20]] + lines[22:]))
    _refused(bad, capsys, r"line 21: the line is numbered 22: 1 line\(s\) before it are missing")


def test_lines_after_the_end_line_are_damage(threaded_log: Path, tmp_path: Path, capsys) -> None:
    lines = threaded_log.read_bytes().splitlines(keepends=True)
    bad = tmp_path / "after-end.log"
    bad.write_bytes(b"".join(lines) + lines[-1])
    _refused(bad, capsys, rf"line {len(lines) + 1}: the line is numbered {len(lines)}")
    # a line after the end line, numbered and sealed as if it belonged there
    records = _records(threaded_log)
    extra = {k: v for k, v in records[-2].items() if k not in ("n", "crc")}
    rewrite_log(threaded_log, bad, lambda r: r)
    with bad.open("ab") as f:
        body = _log._dumps({"n": len(lines) + 1, **extra})[:-1]
        f.write(body + b',"crc":"%08x"}\n' % _log.crc32(body))
    _refused(bad, capsys, rf"line {len(lines) + 1}: a line after the end line \(line {len(lines)}\)")


def test_a_closed_log_whose_end_line_counts_more_deliveries_than_it_has_is_damage(threaded_log: Path,
                                                                                  tmp_path: Path, capsys) -> None:
    last = max((r["seq"], r["n"]) for r in _records(threaded_log) if r.get("event") == "delivery")
    bad = _rewrite(threaded_log, tmp_path / "short.log", _without(threaded_log, last[1]))
    last = last[0]
    _refused(bad, capsys, rf"the end line counts {last} deliveries, the log has {last - 1}")


@pytest.mark.parametrize("content", [b"\0" * (3 << 20), bytes(range(256)) * 64, b"{}\n", b"[1]\n", b"\n\n"])
def test_what_is_not_a_delivery_log_is_one_line(tmp_path: Path, capsys, content: bytes) -> None:
    bad = tmp_path / "not-a-log"
    bad.write_bytes(content)
    _refused(bad, capsys, r"line 1: ")


def test_dev_zero_is_refused_at_once_on_one_line(capsys) -> None:
    _refused(Path("/dev/zero"), capsys, r"/dev/zero: line 1: no line end in its first 1048576 bytes: not a delivery log")


def test_a_line_longer_than_the_bound_is_damage(threaded_log: Path, tmp_path: Path, capsys,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_log_reader, "LINE_BYTES_MAX", 100)
    _refused(threaded_log, capsys, r"line 2: longer than 100 bytes")


# -- header fields ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "pattern"), [
    ({"seed": "x"}, r"header field seed must be an integer, got 'x'"),
    ({"seed": 1.5}, r"header field seed must be an integer, got 1.5"),
    ({"seed": True}, r"header field seed must be an integer, got True"),
    ({"seed": None}, r"header field seed must be an integer, got None"),
    ({"config": [1]}, r"header field config must be a JSON object"),
    ({"config": {"layers": "x"}}, r"the logged config is not valid: layers='x' must be an integer"),
    ({"config": {"bogus": 1}}, r"the logged config is not valid: unknown config field\(s\) bogus"),
    ({"versions": 3}, r"header field versions must be a JSON object"),
    ({"runtime": 3}, r"header field runtime must be a string"),
    ({"actor_classes": []}, r"header field actor_classes must be a JSON object"),
    ({"stand_ins": "tree"}, r"header field stand_ins must be a list of distinct actor names"),
    ({"stand_ins": ["bogus"]}, r"header field stand_ins must be a list of distinct actor names"),
    ({"stand_ins": ["tree", "tree"]}, r"header field stand_ins must be a list of distinct actor names"),
    ({"stand_ins": ["tree", "device", "host", "write", "load"]},
     r"stand_ins names every actor replay rebuilds \(tree, device, host, write, load\): nothing of this run"),
    ({"stand_ins": ["facade", "tree", "device", "host", "write", "load", "prefetch"]}, r"stand_ins names every actor"),
    ({"blobs_held_bytes_max": -1}, r"header field blobs_held_bytes_max must be a byte count, got -1"),
    ({"blobs_held_bytes_max": "64"}, r"header field blobs_held_bytes_max must be a byte count, got '64'"),
    ({"version": "3"}, r"log version '3' is not supported"),
    ({"event": "delivery"}, r"expected the header line, found 'delivery'"),
])
def test_every_malformed_header_field_is_one_line_naming_it(threaded_log: Path, tmp_path: Path, capsys,
                                                            change: dict[str, Any], pattern: str) -> None:
    def edit(rec: dict[str, Any]) -> dict[str, Any]:
        if rec.get("event") != "header":
            return rec
        if isinstance(change.get("config"), dict):
            return {**rec, "config": {**rec["config"], **change["config"]}}
        return {**rec, **change}

    bad = _rewrite(threaded_log, tmp_path / "header.log", edit=edit)
    _refused(bad, capsys, r"header.log: line 1: " + pattern)


def test_a_stood_in_actor_is_not_rebuilt_and_cannot_be_replayed_alone(threaded_log: Path, tmp_path: Path,
                                                                      capsys) -> None:
    log = _rewrite(threaded_log, tmp_path / "stand-in.log",
                   edit=lambda r: {**r, "stand_ins": ["write"]} if r.get("event") == "header" else r)
    result = replay_log(log)
    assert set(result.actors) == {"tree", "device", "host", "load"}
    assert result.divergence is None
    code, _, err = _replay(log, capsys, "--actor", "write")
    assert code == 2 and "--actor write: that actor was a stand-in in the logged run" in err


# -- fault decisions -------------------------------------------------------------------------------


def test_each_delivery_is_handed_the_fault_decisions_its_run_took(faults_log: Path) -> None:
    log = read_log(faults_log)
    injected = [(d.receiver, f) for d in log.deliveries for f in d.faults if f[1] not in (None, False)]
    assert len(injected) > 3  # the plan failed some transfers and reservations
    assert all(receiver.value in ("write", "load", "host") for receiver, _ in injected)
    assert replay_log(log).divergence is None


def test_a_fault_decision_left_out_is_a_divergence_at_the_delivery_that_took_it(faults_log: Path, tmp_path: Path,
                                                                               capsys) -> None:
    records = _records(faults_log)
    at = next(i for i, r in enumerate(records) if r.get("event") == "fault" and r["value"] not in (None, False))
    fault = records[at]
    taker = next(r for r in records[at:] if r.get("event") == "delivery" and r["receiver"] == fault["actor"])
    bad = _rewrite(faults_log, tmp_path / "no-fault.log", _without(faults_log, fault["n"]))
    code, out, _ = _replay(bad, capsys, "--json")
    assert code == 1
    div = json.loads(out)["divergence"]
    assert (div["seq"], div["actor"]) == (taker["seq"], fault["actor"])
    assert div["expected"] != div["actual"] and fault["hook"] in div["actual"]


@pytest.mark.parametrize(("event", "field"), [("fault", "actor"), ("delivery", "receiver")])
def test_a_sealed_fault_or_delivery_line_naming_an_actor_by_a_list_is_one_line(
        faults_log: Path, tmp_path: Path, capsys, event: str, field: str) -> None:
    """Its checksum holds, so only the reader's checks stand between it and a traceback: a list
    is no actor name (nor a key of the faults the reader holds for each actor)."""
    records = _records(faults_log)
    first_fault = next(i for i, r in enumerate(records) if r.get("event") == "fault")
    target = next(r["n"] for r in records[first_fault:] if r.get("event") == event)
    line = iter(range(1, 1 << 62))
    bad = _rewrite(faults_log, tmp_path / "listed.log",
                   edit=lambda rec: {**rec, field: []} if next(line) == target else rec)
    _refused(bad, capsys, f"line {target}: (malformed fault line|corrupt delivery)")


# -- bounded memory --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blob_faults_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pages of 64 tokens (blob lines), faults injected, the writer holding 16 KiB of blobs."""
    mp = pytest.MonkeyPatch()
    mp.setattr(_log, "BLOBS_HELD_BYTES_MAX", 16 << 10)
    try:
        cfg = Config(layers=2, kv_heads=1, head_dim=8, page_size=64, device_slots=64 * 24, host_slots=64 * 48)
        faults = SeededFaults(3, transfer_fail_rate=0.1, host_exhausted_rate=0.1)
        path = tmp_path_factory.mktemp("logs") / "blobs.log"
        with HiCache(cfg.replace(log_path=str(path)), runtime=DeterministicRuntime(seed=3, faults=faults)) as hc:
            sched = ReferenceScheduler(hc, SchedulerConfig(max_running=4, prefill_tokens_per_tick=512,
                                                           chunk_tokens=256, seed=3))
            sched.submit(synthetic_workload(3, 10, 64))
            sched.run()
            hc.quiesce()
    finally:
        mp.undo()
    return path


def test_the_reader_holds_only_the_blobs_the_writer_held_and_the_log_replays(blob_faults_log: Path) -> None:
    records = _records(blob_faults_log)
    assert records[0]["blobs_held_bytes_max"] == 16 << 10
    blobs = sum(1 for r in records if r.get("event") == "blob")
    with LogReader(blob_faults_log) as reader:
        held_max = 0
        for d in reader:
            held_max = max(held_max, reader._blobs.held_bytes)
    assert blobs > 20
    largest = max(len(base64.b64decode(r["data"])) for r in records if r.get("event") == "blob")
    assert held_max <= (16 << 10) + 8 * largest  # the bound, plus the new blobs of one delivery
    assert replay_log(blob_faults_log).divergence is None  # every reference found a held blob


def _synthetic_log(path: Path, deliveries: int) -> Path:
    """A log of `deliveries` small deliveries, written straight through `DeliveryLog`."""
    log = _log.DeliveryLog(path, {"bench": "reader"})
    for seq in range(1, deliveries + 1):
        log.fault("host", "host_exhausted", False)
        log.delivery(seq, 0.0, ActorName.HOST, ActorName.TREE,
                     FreeHostSlots(pages=Indices.from_range(seq % 1000, 8)), False, None, None)
    log.close()
    return path


def _peak_reading(path: Path) -> int:
    tracemalloc.start()
    try:
        with LogReader(path) as reader:
            count = sum(1 for _ in reader)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count > 0
    return peak


def test_reading_a_log_four_times_longer_takes_no_more_memory(tmp_path: Path) -> None:
    short = _peak_reading(_synthetic_log(tmp_path / "short.log", 5_000))
    long = _peak_reading(_synthetic_log(tmp_path / "long.log", 20_000))
    assert long < 1.5 * short + (64 << 10), (short, long)


def test_a_gap_that_outlasts_the_reorder_bound_is_damage_in_a_closed_log_and_the_end_of_a_cut_one(
    threaded_log: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_log_reader, "REORDER_BYTES_MAX", 64 << 10)
    records = _records(threaded_log)
    lost = [r for r in records if r.get("event") == "delivery"][40]
    closed = _rewrite(threaded_log, tmp_path / "gap.log", _without(threaded_log, lost["n"]))
    _refused(closed, capsys, rf"delivery {lost['seq']} is missing from the log \(it is not within 65536 bytes")
    cut = _rewrite(threaded_log, tmp_path / "gap-cut.log", _without(threaded_log, lost["n"], len(records)))
    code, out, _ = _replay(cut, capsys)
    assert code == 0 and f"up to delivery {lost['seq'] - 1}: the log has no end line" in out


def test_a_log_from_before_the_byte_bound_on_storage_steps_replays_with_steps_of_pages(threaded_log: Path,
                                                                                      tmp_path: Path) -> None:
    """`storage_batch_mb` came later: a header without it is a run that read `storage_batch_pages`
    a step, so replay builds it so; a header that names it keeps its value."""
    def drop(rec: dict[str, Any]) -> dict[str, Any]:
        if rec.get("event") != "header":
            return rec
        return {**rec, "config": {k: v for k, v in rec["config"].items() if k != "storage_batch_mb"}}

    assert read_log(threaded_log).config.storage_batch_mb == Config().storage_batch_mb == 1
    old = _rewrite(threaded_log, tmp_path / "old.log", edit=drop)
    assert "storage_batch_mb" not in read_log(old).header["config"]
    assert read_log(old).config.storage_batch_mb == 0
