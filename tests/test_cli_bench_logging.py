"""`hicache bench logging --quick --json` and `hicache bench replay --quick --json` each print
one JSON object with the agreed keys, positive figures and ratios that are the quotients of
the figures they compare; and the delivery lines the bench times are the lines structlog's
JSON renderer makes of the same event, byte for byte, with and without the optional
accelerators (orjson, pybase64, writev)."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import structlog

from hicache.messages import ActorName, Indices, SetHostState, HostSlotState, WriteDone, encode
from hicache.runtime import _log
from hicache.runtime._bench_logging import _args
from hicache.runtime._bench_replay import log_scheduler_run
from hicache.runtime._replay import read_log, replay_log
from hicache.runtime.cli import main

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
    # replay_s is rounded to 4 decimals, deliveries_per_s to 1
    rel = 0.00005 / body["replay_s"]
    assert body["deliveries_per_s"] == pytest.approx(body["deliveries"] / body["replay_s"], rel=rel, abs=0.05)
    assert 0 <= body["machinery_share"] <= 1
    assert elapsed_s < 15, f"the quick bench took {elapsed_s:.1f}s; it is a smoke test"


# -- the delivery line is structlog's, byte for byte -------------------------------------------


def _structlog_line(args: tuple, dumps) -> bytes:
    """The line the log wrote before delivery lines were put together by hand: a structlog event."""
    seq, t, receiver, sender, message, ask, reply, error = args
    event = {
        "seq": seq, "t": t, "receiver": receiver.value, "sender": sender.value, "type": type(message).__name__,
        "ask": ask, "body": _b64_str(encode(message)),
        "reply": _b64_str(encode(reply)) if ask and reply is not None else None,
        "error": f"{type(error).__name__}: {error}" if error is not None else None,
        "event": "delivery",
    }
    return structlog.processors.JSONRenderer(serializer=dumps)(None, "info", event) + b"\n"


def _b64_str(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode("ascii")


@pytest.fixture(scope="module")
def logged_deliveries(tmp_path_factory: pytest.TempPathFactory) -> list[tuple]:
    path = tmp_path_factory.mktemp("bench-logging") / "run.log"
    log_scheduler_run(path, 12)
    out = _args(read_log(path).deliveries)
    big = Indices.from_range(0, 20_000)  # 160 KB of indices: past _JOIN_MAX, written with writev
    n = len(out)
    out += [
        (n + 1, 1e-7, ActorName.HOST, ActorName.TREE, SetHostState(indices=big, state=HostSlotState.SYNCED),
         False, None, None),
        (n + 2, 12345.678901234, ActorName.TREE, ActorName.WRITE, WriteDone(op_id=1, slots=2), True,
         SetHostState(indices=big, state=HostSlotState.FREE), None),
        (n + 3, 0.0, ActorName.TREE, ActorName.WRITE, WriteDone(op_id=1, slots=2), True, None,
         ValueError('bad "quote" \\ é ✓ \n line')),
        (n + 4, 2.5, ActorName.TREE, ActorName.FACADE, WriteDone(op_id=3, slots=4), False, WriteDone(op_id=5, slots=6),
         KeyError("k")),
    ]
    return out


def _stdlib_json(obj, **_):
    return json.dumps(obj, separators=(",", ":")).encode()


@pytest.mark.parametrize("accelerated", [True, False], ids=["as-installed", "stdlib-only"])
def test_delivery_lines_are_the_structlog_rendering_byte_for_byte(
    logged_deliveries: list[tuple], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accelerated: bool,
) -> None:
    if not accelerated:  # the paths taken where orjson, pybase64 and writev are missing
        monkeypatch.setattr(_log, "_dumps", _stdlib_json)
        monkeypatch.setattr(_log, "_b64", _log._b64_stdlib)
        monkeypatch.setattr(_log, "_WRITEV", False)
    path = tmp_path / "lines.log"
    log = _log.DeliveryLog(path, {"bench": "logging"})
    for args in logged_deliveries:
        log.delivery(*args)
        log.delivery(*args)  # the second time from the cache of rendered fragments
    log.fault("write", "transfer_fault", None)
    log.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and json.loads(lines[0])["event"] == "header"
    got = lines[1:-2]
    want = [_structlog_line(a, _log._dumps)[:-1] for a in logged_deliveries for _ in range(2)]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g == w
    assert json.loads(lines[-2]) == {"actor": "write", "hook": "transfer_fault", "value": None, "event": "fault"}


def test_a_log_written_without_the_accelerators_replays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_log, "_dumps", _stdlib_json)
    monkeypatch.setattr(_log, "_b64", _log._b64_stdlib)
    monkeypatch.setattr(_log, "_WRITEV", False)
    path = tmp_path / "stdlib.log"
    log_scheduler_run(path, 6)
    result = replay_log(read_log(path))
    assert result.divergence is None and result.deliveries > 50
