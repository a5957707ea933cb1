"""Structured delivery logs, and replay that finds the first divergence."""

from __future__ import annotations

import base64
import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from hicache.actors import TreeActor
from hicache.messages import ActorName, AllocateSlots, Message, SlotDemand, decode, encode
from hicache.messages.config import Config
from hicache.runtime import _log
from hicache.runtime import LOG_VERSION, HiCache, Request, ThreadedRuntime, read_log, rewrite_log
from hicache.runtime.cli import main
from hicache.runtime.testing import DeterministicRuntime, replay_log
from hicache.runtime.testing._scheduler import ReferenceScheduler, SchedulerConfig
from hicache.runtime.testing.explore import synthetic_workload

from conftest import stored_only


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


def _blobs(lines: list[dict[str, Any]]) -> dict[int, bytes]:
    """The blobs the log's bodies may refer to, by number."""
    return {x["blob"]: base64.b64decode(x["data"]) for x in lines if x.get("event") == "blob"}


def _rewrite(src: Path, dst: Path, edit: Any) -> Path:
    """`src` with each record through `edit` (None drops it), numbered and sealed again."""
    rewrite_log(src, dst, edit)
    return dst


@pytest.fixture(scope="module")
def threaded_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("logs") / "threads.log"
    _logged_run(path)
    return path


def test_every_delivery_is_one_json_line_with_a_re_decodable_body(threaded_log: Path) -> None:
    lines = _lines(threaded_log)
    header, rest = lines[0], lines[1:]
    blobs = _blobs(lines)
    assert header["event"] == "header" and header["version"] == LOG_VERSION == 11
    assert [x["n"] for x in lines] == list(range(1, len(lines) + 1)) and lines[-1]["event"] == "end"
    assert header["config"]["page_size"] == 4 and "torch" in header["versions"]
    deliveries = [x for x in rest if x["event"] == "delivery"]
    assert len(deliveries) > 100
    assert sorted(x["seq"] for x in deliveries) == list(range(1, len(deliveries) + 1))
    for x in deliveries:
        msg = decode(base64.b64decode(x["body"]), blobs)
        assert type(msg).__name__ == x["type"]
        assert {"t", "receiver", "sender", "ask"} <= set(x)
    asks = [x for x in deliveries if x["ask"] and x["reply"]]
    assert asks and all(decode(base64.b64decode(x["reply"]), blobs) is not None for x in asks)
    assert {x["receiver"] for x in deliveries} >= {"tree", "device", "host", "write", "load", "facade"}


def test_a_threaded_run_with_real_concurrency_replays_with_no_divergence(threaded_log: Path, capsys) -> None:
    assert main(["replay", str(threaded_log)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("replayed ") and out.strip().endswith("deliveries, no divergence")
    assert len(out.splitlines()) == 1


def test_a_deterministic_run_replays_with_no_divergence(tmp_path: Path) -> None:
    path = tmp_path / "det.log"
    _logged_run(path, DeterministicRuntime(seed=4), seed=4)
    result = replay_log(read_log(path))
    assert result.divergence is None and result.deliveries > 100


def test_changing_one_logged_body_is_a_divergence_at_that_delivery(threaded_log: Path, tmp_path: Path,
                                                                  capsys) -> None:
    lines = _lines(threaded_log)
    blobs = _blobs(lines)
    header = lines[0]
    # an allocation the facade asked for, one page more: the device's reply differs
    target = next(x for x in lines if x.get("type") == "AllocateSlots" and x["sender"] == "facade"
                  and decode(base64.b64decode(x["body"]), blobs).demands)
    msg = decode(base64.b64decode(target["body"]), blobs)
    assert isinstance(msg, AllocateSlots)
    changed = AllocateSlots(op_id=msg.op_id, allocs=msg.allocs, commits=msg.commits, evict=msg.evict, demands=tuple(  # a page more
        SlotDemand(request_id=d.request_id, tokens=d.tokens + header["config"]["page_size"]) for d in msg.demands))

    def edit(rec: dict[str, Any]) -> dict[str, Any]:
        if rec.get("seq") == target["seq"]:
            rec["body"] = base64.b64encode(encode(changed)).decode()
        return rec

    bad = _rewrite(threaded_log, tmp_path / "changed.log", edit)
    assert main(["replay", str(bad), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    # the device handles it and tells the facade another grant: the facade's delivery differs
    reply = next(x for x in lines if x.get("event") == "delivery" and x["seq"] > target["seq"]
                 and x["receiver"] == "facade")
    assert (out["divergence"]["seq"], reply["type"]) == (reply["seq"], "SlotsAllocated")
    assert out["divergence"]["actor"] == "device"


def test_a_closed_log_that_lacks_a_delivery_is_damage_named_by_line_and_until_replays_up_to_it(
    threaded_log: Path, tmp_path: Path, capsys
) -> None:
    drop = next(x for x in _lines(threaded_log) if x.get("type") == "WriteDone")
    bad = _rewrite(threaded_log, tmp_path / "dropped.log", lambda rec: None if rec.get("seq") == drop["seq"] else rec)
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert re.search(rf"line \d+: delivery \d+ is here but delivery {drop['seq']} is missing from the log", err), err
    assert main(["replay", str(bad), "--until", str(drop["seq"] - 1)]) == 0
    assert capsys.readouterr().out.strip().endswith("no divergence")


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


def _header_of_version(text: str, version: int, *, sealed: bool = True) -> str:
    """The log with its header saying `version`: sealed again (a later format's), or without a
    seal (a version 2 log's: written before lines were numbered and sealed)."""
    head, rest = text.split("\n", 1)
    body = head[: head.rindex(',"crc":')].replace(f'"version":{LOG_VERSION}', f'"version":{version}', 1)
    return (body + (',"crc":"%08x"}' % _log.crc32(body.encode()) if sealed else "}")) + "\n" + rest


@pytest.mark.parametrize(("damage", "message"), [
    (lambda text: "", r"line 1: the log is empty"),
    (lambda text: text.replace('"event":"delivery"', '"event":"delivery" garbage', 1), r"line \d+: checksum mismatch"),
    (lambda text: _header_of_version(text, 99), r"line 1: log version 99 is not supported"),
    (lambda text: _header_of_version(text, 2, sealed=False),
     r"line 1: log version 2 is not supported \(this hicache reads version 11; replay it with the hicache that wrote it"),
    (lambda text: text.replace(f'"version":{LOG_VERSION}', '"version":99', 1),  # one byte changed, not resealed
     r"line 1: checksum mismatch: the line was changed or damaged"),
])
def test_a_bad_log_is_one_clear_line_with_exit_code_2(threaded_log: Path, tmp_path: Path, capsys, damage: Any,
                                                     message: str) -> None:
    bad = tmp_path / "bad.log"
    bad.write_text(damage(threaded_log.read_text()))
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err), err


def test_replay_refuses_an_actor_it_cannot_replay(threaded_log: Path, capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["replay", str(threaded_log), "--actor", "facade"])
    assert refused.value.code == 2
    assert "invalid choice: 'facade' (choose from 'tree', 'device', 'host', 'write', 'load')" in capsys.readouterr().err


# -- large payloads: blob lines ------------------------------------------------------------


@pytest.fixture(scope="module")
def blob_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of prompts of hundreds of tokens at page size 1: token ids and page numbers of 1 KiB and more."""
    path = tmp_path_factory.mktemp("logs") / "blobs.log"
    cfg = Config(layers=2, kv_heads=1, head_dim=8, page_size=1, device_slots=64 * 24, host_slots=64 * 48,
                 log_path=str(path))
    with HiCache(cfg, runtime=DeterministicRuntime(seed=3)) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(max_running=4, prefill_tokens_per_tick=512,
                                                       chunk_tokens=256, seed=3))
        sched.submit(synthetic_workload(3, 10, 64))
        sched.run()
        hc.quiesce()
    return path


def test_a_large_payload_is_one_blob_line_that_later_lines_refer_to(blob_log: Path) -> None:
    from hicache.runtime._log import BLOB_BYTES_MIN

    lines = _lines(blob_log)
    blobs = _blobs(lines)
    assert blobs and sorted(blobs) == list(range(len(blobs)))  # numbered in order of appearance
    assert all(len(data) >= BLOB_BYTES_MIN for data in blobs.values())
    assert len(set(blobs.values())) == len(blobs)  # no payload is written twice
    seen: set[int] = set()
    for x in lines:
        if x.get("event") == "blob":
            seen.add(x["blob"])
        elif x.get("event") == "delivery":  # what a body refers to came before it
            decode(base64.b64decode(x["body"]), {n: blobs[n] for n in seen})


def test_a_log_with_blobs_replays_with_no_divergence(blob_log: Path) -> None:
    log = read_log(blob_log)
    result = replay_log(log)
    assert result.divergence is None and result.deliveries > 50
    assert all(d.body == encode(d.message) for d in log.deliveries)  # bodies are whole again


def test_changing_a_blob_is_a_divergence_at_the_first_delivery_that_refers_to_it(blob_log: Path, tmp_path: Path,
                                                                                capsys) -> None:
    lines = _lines(blob_log)
    blobs = _blobs(lines)
    deliveries = sorted((x for x in lines if x.get("event") == "delivery"), key=lambda x: x["seq"])
    # pages the device handed out, logged as a blob: the replayed device hands out the real ones
    first = next(x for x in deliveries if x["type"] == "SlotsAllocated" and x["sender"] == "device"
                 and _referred(x, blobs))
    number = min(_referred(first, blobs))
    assert all(number not in _referred(x, blobs) for x in deliveries if x["seq"] < first["seq"])
    data = bytearray(blobs[number])
    data[0] ^= 1  # another slot

    def edit(rec: dict[str, Any]) -> dict[str, Any]:
        if rec.get("event") == "blob" and rec["blob"] == number:
            rec["data"] = base64.b64encode(bytes(data)).decode()
        return rec

    bad = _rewrite(blob_log, tmp_path / "blob-changed.log", edit)
    assert main(["replay", str(bad), "--json"]) == 1
    div = json.loads(capsys.readouterr().out)["divergence"]
    assert div["seq"] == first["seq"] and div["actor"] == "device"


def _referred(line: dict[str, Any], blobs: dict[int, bytes]) -> set[int]:
    """The blob numbers a delivery line refers to."""
    counted: set[int] = set()

    class Tracking(dict):  # type: ignore[type-arg]
        def get(self, key: Any, default: Any = None) -> Any:
            counted.add(key)
            return super().get(key, default)

    for field in ("body", "reply"):
        if line.get(field):
            decode(base64.b64decode(line[field]), Tracking(blobs))
    return counted


def test_a_body_that_refers_to_a_blob_the_log_lacks_is_a_corrupt_delivery(blob_log: Path, tmp_path: Path,
                                                                         capsys) -> None:
    lines = _lines(blob_log)
    last = max(x["blob"] for x in lines if x.get("event") == "blob")
    bad = _rewrite(blob_log, tmp_path / "blob-missing.log",
                   lambda rec: None if rec.get("event") == "blob" and rec["blob"] == last else rec)
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"line \d+: corrupt delivery: the payload refers to blob {last}, which is not among",
                     err), err


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_log_of_a_cache_started_again_after_a_close_replays(tmp_path: Path, deterministic: bool) -> None:
    """A start after a close is a fresh system: its log (written anew) replays from nothing,
    so every id the actors make counts from 1 again."""
    path = tmp_path / "again.log"
    cfg = Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=96, host_slots=192, log_path=str(path))
    hc = HiCache(cfg, runtime=DeterministicRuntime(seed=6) if deterministic else None)
    for turn in range(2):
        hc.start()
        sched = ReferenceScheduler(hc, SchedulerConfig(max_running=4, prefill_tokens_per_tick=16, chunk_tokens=8,
                                                       seed=turn, lookahead_slots=2, device_budget_ratio=2.0))
        sched.submit(synthetic_workload(turn, 8, 4))
        sched.run(on_tick=lambda s: hc.check_invariants())
        hc.quiesce()
        hc.close()
        result = replay_log(read_log(path))
        assert result.divergence is None, f"start {turn + 1}: {result.divergence}"
        assert result.deliveries > 50


class _SteppingClock:
    """A clock that moves on at every read (1 ms), as a real one does between two reads."""

    def __init__(self) -> None:
        self.t = 0.0
        self._lock = threading.Lock()

    def now_s(self) -> float:
        with self._lock:
            self.t += 0.001
            return self.t


class _TimedTree(TreeActor):
    """The tree, noting the time its core reads at the start of each handler."""

    reads: list[tuple[str, float]] = []

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        type(self).reads.append((type(message).__name__, self.core.shared.now()))
        return super().handle(sender, message)


def test_a_logged_handler_reads_the_time_its_delivery_was_logged_with(tmp_path: Path) -> None:
    """The tree decides on time (a prefetch's timeout: now - started >= timeout). A replay sets
    its clock to each delivery's logged time, so the run must read that time too: a read a
    moment later could decide the other way (a replay divergence under the `timeout` policy
    with a short timeout, about 1 run in 20 before)."""
    path = tmp_path / "timed.log"
    runtime = ThreadedRuntime()
    runtime.services.clock = _SteppingClock()
    _TimedTree.reads = []
    cfg = Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=96, host_slots=192, log_path=str(path),
                 storage="file", storage_dir=str(tmp_path / "l3"), prefetch_policy="timeout",
                 prefetch_threshold_pages=1, prefetch_timeout_base_s=0.002, prefetch_timeout_per_1k_s=0.0)
    prompt = list(range(1, 34))
    with HiCache(cfg, runtime=runtime, actor_classes={ActorName.TREE: _TimedTree}) as hc:
        stored_only(hc, prompt)
        assert hc.prefetch([Request("b", prompt[:-1])]) == {"b": 32}
        while not hc.ready(["b"]):
            pass
        [adm] = hc.admit([Request("b", prompt[:-1])])
        hc.start_loads().wait_all()
        hc.abort([adm.handle])
        hc.quiesce()
    logged = [(d.type_name, d.t) for d in read_log(path).deliveries
              if d.receiver is ActorName.TREE and d.type_name not in ("CheckInvariants", "GetStatistics")]
    assert len(logged) > 10 and _TimedTree.reads == logged
    result = replay_log(read_log(path))
    assert result.divergence is None, result.divergence
