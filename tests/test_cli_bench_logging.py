"""`hicache bench logging --quick --json` and `hicache bench replay --quick --json` each print
one JSON object with the agreed keys, positive figures and ratios that are the quotients of
the figures they compare; and the delivery and blob lines the bench times are the lines
structlog's JSON renderer makes of the same events (numbered and sealed with their CRC-32),
byte for byte, with and without the optional accelerators (orjson, pybase64)."""

from __future__ import annotations

import base64
import importlib.util
import json
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import structlog

from hicache.messages import (
    ActorName,
    FreeHostSlots,
    HostAllocated,
    HostSlotState,
    Indices,
    SetHostState,
    WriteDone,
    encode,
)
from hicache.runtime import _log, _log_reader
from hicache.runtime._log_reader import read_log
from hicache.runtime.bench._logging import _args, _tick_deliveries
from hicache.runtime.bench._replay import log_scheduler_run
from hicache.runtime.cli import main
from hicache.runtime.testing._replay import replay_log

ROUNDING = 0.0005
"""The benches round figures and ratios to 3 decimals (times in seconds to 4)."""


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
def test_bench_logging_quick_json_reports_cost_per_delivery_and_slowdown(capsys) -> None:
    body, elapsed_s = _run_json(["bench", "logging", "--quick", "--json"], capsys)

    assert {"us_per_delivery", "overhead_ms_off", "overhead_ms_on", "slowdown", "deliveries_logged",
            "orjson"} <= set(body)
    for key in ("us_per_delivery", "overhead_ms_off", "overhead_ms_on", "slowdown", "us_per_delivery_tick",
                "bytes_per_delivery", "bytes_per_delivery_tick", "log_mb_per_tick"):
        assert isinstance(body[key], (int, float)) and body[key] > 0, (key, body[key])
    _assert_quotient(body["slowdown"], body["overhead_ms_on"], body["overhead_ms_off"])
    assert body["orjson"] is (importlib.util.find_spec("orjson") is not None)
    assert body["orjson"] is _log.ORJSON and body["pybase64"] is _log.PYBASE64
    # every delivery of the logged run was logged: warm-up and measured ticks, tens each
    ticks = body["workload"]["warmup"] + body["workload"]["reps"]
    assert body["deliveries_logged"] >= ticks * body["deliveries_per_tick"] / 2 > 0
    # a tick of 64 trace prompts carries far larger messages than the scheduler's
    assert body["bytes_per_delivery_tick"] > body["bytes_per_delivery"]
    assert elapsed_s < 15, f"the quick bench took {elapsed_s:.1f}s; it is a smoke test"


@pytest.mark.timeout(60)
def test_bench_replay_quick_json_reports_deliveries_per_second(capsys) -> None:
    body, elapsed_s = _run_json(["bench", "replay", "--quick", "--json"], capsys)

    assert {"deliveries", "replay_s", "deliveries_per_s", "read_s"} <= set(body)
    for key in ("deliveries", "replay_s", "deliveries_per_s", "read_s", "handlers_s"):
        assert isinstance(body[key], (int, float)) and body[key] > 0, (key, body[key])
    assert isinstance(body["deliveries"], int)
    assert body["deliveries"] <= body["deliveries_logged"]  # deliveries to the facade are not replayed
    # replay_s is rounded to 4 decimals, deliveries_per_s to 1: the unrounded time lies within
    # half a unit of the fourth decimal, so the rate lies between the quotients at its two ends
    half = 0.00005
    low = body["deliveries"] / (body["replay_s"] + half) - 0.05
    high = body["deliveries"] / (body["replay_s"] - half) + 0.05
    assert low <= body["deliveries_per_s"] <= high, (low, body["deliveries_per_s"], high)
    assert 0 <= body["machinery_share"] <= 1
    per_actor = body["handlers_us_per_delivery"]  # each replayed actor, its inbox alone
    assert set(per_actor) == {"tree", "device", "host", "write", "load"}
    assert all(us > 0 for us in per_actor.values()), per_actor
    assert elapsed_s < 15, f"the quick bench took {elapsed_s:.1f}s; it is a smoke test"


# -- the delivery and blob lines are structlog's, byte for byte ---------------------------------


class _Numbering:
    """The log's blob numbering, redone: payloads of at least `BLOB_BYTES_MIN` bytes get the
    next number when new; the new ones wait in `fresh` for their lines."""

    def __init__(self) -> None:
        self.numbers: dict[bytes, int] = {}
        self.fresh: list[tuple[int, bytes]] = []

    def refer(self, data: bytes) -> int | None:
        if len(data) < _log.BLOB_BYTES_MIN:
            return None
        if data not in self.numbers:
            self.numbers[data] = len(self.numbers)
            self.fresh.append((self.numbers[data], data))
        return self.numbers[data]


def _structlog_lines(args: tuple, dumps, numbering: _Numbering) -> list[bytes]:
    """The lines of one delivery as structlog events (numbering aside): its new blobs, then
    the delivery."""
    seq, t, receiver, sender, message, ask, reply, error = args
    event = {
        "seq": seq, "t": t, "receiver": receiver.value, "sender": sender.value, "type": type(message).__name__,
        "ask": ask, "body": _b64_str(encode(message, numbering)),
        "reply": _b64_str(encode(reply, numbering)) if ask and reply is not None else None,
        "error": f"{type(error).__name__}: {error}" if error is not None else None,
        "event": "delivery",
    }
    blobs = [{"blob": n, "data": _b64_str(data), "event": "blob"} for n, data in numbering.fresh]
    numbering.fresh.clear()
    return [*blobs, event]


def _sealed(event: dict, n: int, dumps) -> bytes:
    """structlog's rendering of `event` as log line `n`: numbered first, its CRC-32 last."""
    line = structlog.processors.JSONRenderer(serializer=dumps)(None, "info", {"n": n, **event})[:-1]
    return line + b',"crc":"%08x"}' % zlib.crc32(line)


def _b64_str(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode("ascii")


@pytest.fixture(scope="module")
def logged_deliveries(tmp_path_factory: pytest.TempPathFactory) -> list[tuple]:
    path = tmp_path_factory.mktemp("bench-logging") / "run.log"
    log_scheduler_run(path, 12)
    out = _args(read_log(path).deliveries)
    big = Indices.from_range(0, 20_000)  # 160 KB of indices: a blob, referred to twice
    n = len(out)
    out += [
        (n + 1, 1e-7, ActorName.HOST, ActorName.TREE, SetHostState(pages=big, state=HostSlotState.SYNCED),
         False, None, None),
        (n + 2, 12345.678901234, ActorName.TREE, ActorName.WRITE, WriteDone(op_id=1, slots=2), True,
         SetHostState(pages=big, state=HostSlotState.FREE), None),
        (n + 3, 0.0, ActorName.TREE, ActorName.WRITE, WriteDone(op_id=1, slots=2), True, None,
         ValueError('bad "quote" \\ é ✓ \n line')),
        (n + 4, 2.5, ActorName.TREE, ActorName.FACADE, WriteDone(op_id=3, slots=4), False, WriteDone(op_id=5, slots=6),
         KeyError("k")),
        (n + 5, 3.0, ActorName.TREE, ActorName.HOST, HostAllocated(op_id=7, pages=Indices.from_range(5, 300)),
         True, HostAllocated(op_id=8, pages=Indices.from_range(5, 300)), None),
    ]
    return out


def _stdlib_json(obj, **_):
    return json.dumps(obj, separators=(",", ":")).encode()


@pytest.mark.parametrize("accelerated", [True, False], ids=["as-installed", "stdlib-only"])
def test_delivery_and_blob_lines_are_the_structlog_rendering_byte_for_byte(
    logged_deliveries: list[tuple], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accelerated: bool,
) -> None:
    if not accelerated:  # the paths taken where orjson and pybase64 are missing
        monkeypatch.setattr(_log, "_dumps", _stdlib_json)
        monkeypatch.setattr(_log, "_b64", _log._b64_stdlib)
    path = tmp_path / "lines.log"
    log = _log.DeliveryLog(path, {"bench": "logging"})
    for args in logged_deliveries:
        log.delivery(*args)
        log.delivery(*args)  # the second time from the cache of rendered fragments, its blobs known
    log.fault("write", "transfer_fault", None)
    log.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and json.loads(lines[0])["event"] == "header"
    got = lines[1:-3]
    numbering = _Numbering()
    events = [e for a in logged_deliveries for _ in range(2) for e in _structlog_lines(a, _log._dumps, numbering)]
    want = [_sealed(e, n, _log._dumps) for n, e in enumerate(events, start=2)]
    assert sum(b'"event":"blob"' in w for w in want) == 2  # the 160 KB indices and the 300 slots, once each
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g == w
    fault, end = (json.loads(x) for x in lines[-3:-1])
    assert {k: v for k, v in fault.items() if k not in ("n", "crc")} == {
        "actor": "write", "hook": "transfer_fault", "value": None, "event": "fault"}
    assert end["event"] == "end" and end["n"] == len(lines) - 1


def test_a_log_written_without_the_accelerators_replays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_log, "_dumps", _stdlib_json)
    monkeypatch.setattr(_log, "_b64", _log._b64_stdlib)
    path = tmp_path / "stdlib.log"
    log_scheduler_run(path, 6)
    result = replay_log(read_log(path))
    assert result.divergence is None and result.deliveries > 50


def test_a_log_reads_the_same_without_the_accelerators(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.log"
    log_scheduler_run(path, 6)
    fast = read_log(path)
    monkeypatch.setattr(_log_reader, "loads_line", json.loads)
    monkeypatch.setattr(_log, "_unb64", base64.b64decode)
    slow = read_log(path)

    def fields(log: Any) -> list[tuple[Any, ...]]:
        return [(d.seq, d.t, d.receiver, d.sender, d.message, d.body, d.reply, d.error, d.faults)
                for d in log.deliveries]

    assert fields(slow) == fields(fast) and len(fast.deliveries) > 50
    assert any(d.faults for d in fast.deliveries)


def test_past_its_bound_the_writer_forgets_the_oldest_blobs_and_writes_a_repeat_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_log, "BLOBS_HELD_BYTES_MAX", 3 * 2048)
    path = tmp_path / "bounded.log"
    log = _log.DeliveryLog(path, {"bench": "logging"})
    payloads = [Indices.from_range(1000 * i, 256) for i in range(5)]  # 2 KiB each: three are held
    for seq, idx in enumerate([*payloads, payloads[4], payloads[0]], start=1):
        log.delivery(seq, 0.0, ActorName.HOST, ActorName.TREE, FreeHostSlots(pages=idx), False, None, None)
    log.close()
    blobs = [x for x in map(json.loads, path.read_text().splitlines()) if x["event"] == "blob"]
    # the fifth is still held when it repeats; the first was forgotten, so it is written again
    assert [x["blob"] for x in blobs] == [0, 1, 2, 3, 4, 5]
    assert blobs[5]["data"] == blobs[0]["data"]
    got = [d.message.pages for d in _tick_deliveries(path, 0, path.stat().st_size)]
    assert got == [*payloads, payloads[4], payloads[0]]


def test_the_tick_of_the_logging_bench_reads_blobs_logged_before_it(tmp_path: Path) -> None:
    path = tmp_path / "span.log"
    log = _log.DeliveryLog(path, {"bench": "logging"})
    idx = Indices.from_range(0, 512)
    log.delivery(1, 0.0, ActorName.HOST, ActorName.TREE, FreeHostSlots(pages=idx), False, None, None)
    log.flush()
    start = path.stat().st_size
    log.delivery(2, 0.0, ActorName.HOST, ActorName.TREE, FreeHostSlots(pages=idx), False, None, None)
    log.close()
    (d,) = _tick_deliveries(path, start, path.stat().st_size)
    assert d.seq == 2 and d.message == FreeHostSlots(pages=idx)
