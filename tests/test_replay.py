"""Structured delivery logs, and replay that finds the first divergence."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from hicache.messages import CommitSlots, SlotDemand, decode, encode
from hicache.runtime import DeterministicRuntime, HiCache
from hicache.runtime import read_log, replay_log
from hicache.runtime.cli import main
from hicache.runtime.config import Config
from hicache.runtime.explore import synthetic_workload
from hicache.runtime._scheduler import ReferenceScheduler, SchedulerConfig


def _logged_run(path: Path, runtime: Any = None, seed: int = 1) -> HiCache:
    cfg = Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=96, host_slots=192, log_path=str(path))
    with HiCache(cfg, runtime=runtime) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(max_running=4, prefill_tokens_per_tick=16, chunk_tokens=8,
                                                       abort_rate=0.05, seed=seed, lookahead_slots=2,
                                                       device_budget_ratio=2.0))
        sched.submit(synthetic_workload(seed, 12, 4))
        sched.run(on_tick=lambda s: hc.check_invariants())
        hc.quiesce()
    return hc


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, lines: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.fixture(scope="module")
def threaded_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("logs") / "threads.log"
    _logged_run(path)
    return path


def test_every_delivery_is_one_json_line_with_a_re_decodable_body(threaded_log: Path) -> None:
    lines = _lines(threaded_log)
    header, rest = lines[0], lines[1:]
    assert header["event"] == "header" and header["version"] == 1
    assert header["config"]["page_size"] == 4 and "torch" in header["versions"]
    deliveries = [x for x in rest if x["event"] == "delivery"]
    assert len(deliveries) > 100
    assert sorted(x["seq"] for x in deliveries) == list(range(1, len(deliveries) + 1))
    for x in deliveries:
        msg = decode(base64.b64decode(x["body"]))
        assert type(msg).__name__ == x["type"]
        assert {"t", "receiver", "sender", "ask"} <= set(x)
    asks = [x for x in deliveries if x["ask"] and x["reply"]]
    assert asks and all(decode(base64.b64decode(x["reply"])) is not None for x in asks)
    assert {x["receiver"] for x in deliveries} >= {"tree", "device", "host", "write", "load", "facade"}


def test_a_threaded_run_with_real_concurrency_replays_with_no_divergence(threaded_log: Path, capsys) -> None:
    assert main(["replay", str(threaded_log)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("replayed ") and out.strip().endswith("deliveries, no divergence")


def test_a_deterministic_run_replays_with_no_divergence(tmp_path: Path) -> None:
    path = tmp_path / "det.log"
    _logged_run(path, DeterministicRuntime(seed=4), seed=4)
    result = replay_log(read_log(path))
    assert result.divergence is None and result.deliveries > 100


def test_changing_one_logged_body_is_a_divergence_at_that_delivery(threaded_log: Path, tmp_path: Path,
                                                                  capsys) -> None:
    lines = _lines(threaded_log)
    # a CommitSlots the facade asked, with one more token: the device's reply differs
    target = next(x for x in lines if x.get("type") == "CommitSlots" and x["ask"])
    msg = decode(base64.b64decode(target["body"]))
    assert isinstance(msg, CommitSlots)
    changed = CommitSlots(op_id=msg.op_id, demands=tuple(
        SlotDemand(request_id=d.request_id, tokens=d.tokens + 1) for d in msg.demands))
    target["body"] = base64.b64encode(encode(changed)).decode()
    bad = tmp_path / "changed.log"
    _write(bad, lines)
    assert main(["replay", str(bad), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["divergence"]["seq"] == target["seq"]
    assert out["divergence"]["actor"] == "device"


def test_dropping_one_delivery_is_a_divergence_at_that_sequence_number(threaded_log: Path, tmp_path: Path,
                                                                      capsys) -> None:
    lines = _lines(threaded_log)
    drop = next(x for x in lines if x.get("type") == "WriteDone")
    kept = [x for x in lines if x is not drop]
    bad = tmp_path / "dropped.log"
    _write(bad, kept)
    assert main(["replay", str(bad), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    div = out["divergence"]
    assert div["seq"] == drop["seq"] and div["actor"] in ("write", "tree")
    assert f"delivery {drop['seq']} is missing" in div["expected"]


def test_until_and_dump_show_the_tree_at_a_chosen_point(threaded_log: Path, capsys) -> None:
    lines = [x for x in _lines(threaded_log) if x.get("event") == "delivery"]
    first_finish = min(x["seq"] for x in lines if x["type"] == "FinishRequests" and x["receiver"] == "tree")
    assert main(["replay", str(threaded_log), "--until", str(first_finish - 1), "--dump", "tree"]) == 0
    before = capsys.readouterr().out
    assert main(["replay", str(threaded_log), "--until", str(first_finish), "--dump", "tree"]) == 0
    after = capsys.readouterr().out
    assert "namespace ''" in after and before != after
    assert "lock=" in after and "nodes " in after
    assert main(["replay", str(threaded_log), "--dump", "host", "--actor", "host"]) == 0
    assert "host slots: free" in capsys.readouterr().out


@pytest.mark.parametrize(("damage", "message"), [
    (lambda text: "", r"line 1: the log is empty"),
    (lambda text: text[: len(text) // 2], r"line \d+: the log is truncated"),
    (lambda text: text.replace('"event":"delivery"', '"event":"delivery" garbage', 1), r"line \d+: not a JSON object"),
    (lambda text: text.replace('"version":1', '"version":99', 1), r"line 1: log version 99 is not supported"),
])
def test_a_bad_log_is_one_clear_line_with_exit_code_2(threaded_log: Path, tmp_path: Path, capsys, damage: Any,
                                                     message: str) -> None:
    import re

    bad = tmp_path / "bad.log"
    bad.write_text(damage(threaded_log.read_text()))
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err), err


def test_a_missing_delivery_is_reported_even_when_nothing_diverges_after_it(threaded_log: Path, tmp_path: Path,
                                                                           capsys) -> None:
    lines = _lines(threaded_log)
    last = max(x["seq"] for x in lines if x.get("event") == "delivery")
    # the facade's inbox is not replayed: dropping a delivery to it changes no replayed actor
    drop = next(x for x in lines if x.get("receiver") == "facade" and x["seq"] < last)
    bad = tmp_path / "gap.log"
    _write(bad, [x for x in lines if x is not drop])
    assert main(["replay", str(bad), "--json"]) == 1
    div = json.loads(capsys.readouterr().out)["divergence"]
    assert div["seq"] == drop["seq"] and f"delivery {drop['seq']} is missing" in div["expected"]


def test_replay_refuses_an_actor_it_cannot_replay(threaded_log: Path, capsys) -> None:
    assert main(["replay", str(threaded_log), "--actor", "facade"]) == 2
    assert "cannot be replayed; use one of tree, device, host, write, load" in capsys.readouterr().err
