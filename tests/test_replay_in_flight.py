"""The mail a run sent and never delivered: recorded at the end of its log, expected by replay."""

from __future__ import annotations

import base64
import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hicache.actors import HostPoolActor, SeededFaults, WriteStreamActor
from hicache.actors._actor import Mail
from hicache.messages import ActorName, AllocateHost, HostSlotState, Indices, Message, SetHostState, WriteKV, decode, encode
from hicache.messages.config import Config
from hicache.runtime import HiCache, Request, ThreadedRuntime, read_log, rewrite_log
from hicache.runtime.cli import main
from hicache.runtime.testing import DeterministicRuntime, replay_log
from hicache.runtime.testing._mutants import Mutant
from hicache.runtime.testing._scheduler import ReferenceScheduler, SchedulerConfig
from hicache.runtime.testing.explore import Scenario, run_schedule, synthetic_workload

from conftest import stored_only

CONFIG = Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=96, host_slots=192)
REPLAYED = {"tree", "device", "host", "write", "load"}


class EngineFailed(RuntimeError):
    """What the engine of the scenario below raises in the middle of its run."""


def _failing_engine(path: Path, ticks: int) -> Scenario:
    """The reference scheduler's workload, logged to `path`, until the engine raises after `ticks`
    ticks: the cache closes without draining, with its write-throughs and acks in flight."""

    def run(rt: DeterministicRuntime, seed: int, mut: Mutant | None) -> None:
        with HiCache(CONFIG.replace(log_path=str(path)), runtime=rt) as hc:
            sched = ReferenceScheduler(hc, SchedulerConfig(max_running=4, prefill_tokens_per_tick=16, chunk_tokens=8,
                                                           seed=seed, lookahead_slots=2, device_budget_ratio=2.0))
            sched.submit(synthetic_workload(seed, 12, CONFIG.page_size))

            def tick(s: ReferenceScheduler) -> None:
                if s.ticks == ticks:
                    raise EngineFailed(f"the engine failed at tick {ticks}")

            sched.run(on_tick=tick)

    return Scenario("failing-engine", "the standard workload until the engine raises", run)


def _in_flight_lines(path: Path) -> list[dict[str, Any]]:
    return [rec for rec in map(json.loads, path.read_bytes().splitlines()) if rec.get("event") == "in_flight"]


@pytest.fixture(scope="module")
def failed_logs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The logs of explored schedules (PCT) that failed on the engine's exception, each with mail
    of the replayed actors in flight."""
    out = []
    for seed in (0, 1, 4, 5):  # in flight: the tree's notes to the stopped host; and the write stream's to itself
        path = tmp_path_factory.mktemp("failed") / f"seed{seed}.log"
        result = run_schedule(_failing_engine(path, ticks=3), seed, strategy="pct")
        assert result.failed and result.error_type == "EngineFailed", result.error
        out.append(path)
    return out


def test_an_explored_schedule_that_failed_replays_with_no_divergence_and_no_until(failed_logs: list[Path],
                                                                                   capsys) -> None:
    pending = [[rec for rec in _in_flight_lines(path) if rec["sender"] in REPLAYED] for path in failed_logs]
    assert all(pending), [len(p) for p in pending]  # each run stopped with replayed actors' mail in flight
    for path in failed_logs:
        log = read_log(path)
        assert log.end.complete and log.in_flight
        result = replay_log(log)
        assert result.divergence is None, result.divergence
        assert result.stopped is None and result.last_seq == log.end.last_seq
        assert main(["replay", str(path)]) == 0
        assert capsys.readouterr().out.strip().endswith("no divergence")


def _edited(src: Path, dst: Path, change: Any) -> tuple[Message, Message]:
    """`src` with the message of its first in-flight line from a replayed actor changed by
    `change`, numbered and sealed again; (before, after)."""
    blobs: dict[int, bytes] = {}
    seen: list[tuple[Message, Message]] = []

    def edit(rec: dict[str, Any]) -> dict[str, Any]:
        if rec.get("event") == "blob":
            blobs[rec["blob"]] = base64.b64decode(rec["data"])
        if rec.get("event") == "in_flight" and rec["sender"] in REPLAYED and not seen:
            before = decode(base64.b64decode(rec["body"]), blobs)
            after = change(before)
            rec["body"] = base64.b64encode(encode(after)).decode()
            rec["type"] = type(after).__name__
            seen.append((before, after))
        return rec

    rewrite_log(src, dst, edit)
    assert seen, f"{src} has no in-flight line of a replayed actor"
    return seen[0]


def _other(message: Message) -> Message:
    """`message` with one field changed."""
    if isinstance(message, SetHostState):
        other = HostSlotState.FREE if message.state is not HostSlotState.FREE else HostSlotState.SYNCED
        return dataclasses.replace(message, state=other)
    field = next(f.name for f in dataclasses.fields(message) if isinstance(getattr(message, f.name), int)
                 and not isinstance(getattr(message, f.name), bool))
    return dataclasses.replace(message, **{field: getattr(message, field) + 1000})


def test_an_in_flight_message_edited_to_another_is_a_divergence_naming_both(failed_logs: list[Path], tmp_path: Path,
                                                                           capsys) -> None:
    bad = tmp_path / "edited.log"
    before, after = _edited(failed_logs[0], bad, _other)
    div = replay_log(bad).divergence
    assert div is not None
    assert div.expected.startswith(f"{after!r} (in flight from ") and "when the run stopped: line " in div.expected
    assert div.actual.startswith(f"{before!r} (sent while handling delivery ")
    assert main(["replay", str(bad)]) == 1
    assert f"expected: {after!r}" in capsys.readouterr().out


def test_a_send_that_matches_nothing_delivered_or_in_flight_is_a_divergence(failed_logs: list[Path],
                                                                           tmp_path: Path) -> None:
    bad = tmp_path / "dropped.log"
    first = next(rec for rec in _in_flight_lines(failed_logs[0]) if rec["sender"] in REPLAYED)
    rewrite_log(failed_logs[0], bad, lambda rec: None if rec == {k: v for k, v in first.items()
                                                                  if k not in ("n", "crc")} else rec)
    assert len(_in_flight_lines(bad)) == len(_in_flight_lines(failed_logs[0])) - 1
    div = replay_log(bad).divergence
    assert div is not None and div.actor == first["sender"]
    assert div.expected == (f"(no more deliveries from {first['sender']} to {first['receiver']}, and no such message "
                            "in flight when the run stopped)")
    assert div.actual.startswith(f"delivery {div.seq} made {first['sender']} send {first['type']}(")


def test_an_in_flight_message_the_replayed_actor_never_sent_is_a_divergence(tmp_path: Path) -> None:
    path = tmp_path / "never.log"
    never = SetHostState(pages=Indices.of([7]), state=HostSlotState.SYNCED)
    with HiCache(CONFIG.replace(log_path=str(path)), runtime=DeterministicRuntime(seed=2)) as hc:
        [got] = hc.admit([Request("r", list(range(12)))])
        hc.abort([got.handle])
        hc.quiesce()
        # as a run whose tree had sent it, and stopped before the host handled it, would log
        hc.system.services.undelivered.append((ActorName.HOST, Mail(ActorName.TREE, never)))
    [recorded] = read_log(path).in_flight
    assert (recorded.sender, recorded.receiver, recorded.message) == (ActorName.TREE, ActorName.HOST, never)
    result = replay_log(path)
    div = result.divergence
    assert div is not None and (div.seq, div.actor) == (result.last_seq, "tree")
    assert div.expected == f"{never!r} (in flight from tree to host when the run stopped: line {recorded.line})"
    assert div.actual == "(the replayed tree never sent it)"
    assert replay_log(path, until=result.last_seq).divergence is None  # --until checks only what was delivered


class _GatedWrite(WriteStreamActor):
    """The write stream, holding each write until the host pool has stopped (a copy still running
    when the cache is closed)."""

    gate = threading.Event()

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        if isinstance(message, WriteKV):
            assert self.gate.wait(30), "the host pool never stopped"
        return super().handle(sender, message)


class _OpeningHost(HostPoolActor):
    def on_stop(self) -> None:
        _GatedWrite.gate.set()


def test_a_threaded_close_with_mail_queued_records_it_and_replays_with_no_divergence(tmp_path: Path) -> None:
    path = tmp_path / "threads.log"
    _GatedWrite.gate.clear()
    hc = HiCache(CONFIG.replace(log_path=str(path)), runtime=ThreadedRuntime(write_stream_thread=True),
                 actor_classes={ActorName.WRITE: _GatedWrite, ActorName.HOST: _OpeningHost}).start()
    [got] = hc.admit([Request("r", list(range(12)))])
    hc.allocate({"r": 13})
    hc.commit({"r": list(range(13))})
    hc.finish([got.handle])  # its write-through waits in the write stream's handler
    closed = hc.close(drain=False)
    assert not closed.drained and closed.writes_dropped == 1
    log = read_log(path)
    assert log.end.complete and log.header["runtime"] == "ThreadedRuntime"
    # the write stream's note to itself (left in its inbox) or the tree's to the stopped host
    assert {(m.sender.value, m.receiver.value) for m in log.in_flight} & {("write", "write"), ("tree", "host")}
    result = replay_log(log)
    assert result.divergence is None, result.divergence


def test_a_delivery_line_after_the_in_flight_lines_is_damage_named_by_line(failed_logs: list[Path], tmp_path: Path,
                                                                          capsys) -> None:
    lines = [json.loads(line) for line in failed_logs[0].read_bytes().splitlines()]
    last = max(rec["n"] for rec in lines if rec.get("event") == "delivery")
    first = min(rec["n"] for rec in lines if rec.get("event") == "in_flight")
    assert first == last + 1
    by_n = {rec["n"]: {k: v for k, v in rec.items() if k not in ("n", "crc")} for rec in lines}
    n = iter(range(1, len(lines) + 1))
    swapped = {last: by_n[first], first: by_n[last]}
    bad = tmp_path / "swapped.log"
    rewrite_log(failed_logs[0], bad, lambda rec: swapped.get(next(n), rec))
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"line {first}: a delivery line after the in-flight lines (from line {last}), which only "
                        "blob lines and the end line follow"), err


@pytest.mark.parametrize(("edit", "message"), [
    (lambda rec: {k: v for k, v in rec.items() if k != "sender"}, "in-flight line without field 'sender'"),
    (lambda rec: {**rec, "body": "AAAA"}, "corrupt in-flight line: malformed payload"),
    (lambda rec: {**rec, "type": "WriteDone"}, "corrupt in-flight line: the body is a "),
])
def test_a_malformed_in_flight_line_is_damage_named_by_line(failed_logs: list[Path], tmp_path: Path, capsys,
                                                             edit: Any, message: str) -> None:
    bad = tmp_path / "malformed.log"
    first = next(rec["n"] for rec in map(json.loads, failed_logs[0].read_bytes().splitlines())
                 if rec.get("event") == "in_flight")
    rewrite_log(failed_logs[0], bad, lambda rec: edit(rec) if rec.get("event") == "in_flight" else rec)
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"line {first}: {message}" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_timer_that_had_not_fired_when_the_cache_closed_is_recorded_in_flight(tmp_path: Path,
                                                                               deterministic: bool) -> None:
    """The storage prefetcher paces its reads with timers (`storage_delay`): closed mid-prefetch,
    its next step is mail in flight on either runtime."""
    path = tmp_path / "timer.log"
    faults = SeededFaults(0, transfer_fail_rate=0.0, host_exhausted_rate=0.0, storage_delay_s=30.0)
    runtime = DeterministicRuntime(seed=0, faults=faults) if deterministic else ThreadedRuntime(faults=faults)
    cfg = CONFIG.replace(log_path=str(path), storage="file", storage_dir=str(tmp_path / "l3"),
                         model_id="test", prefetch_threshold_pages=1, storage_batch_pages=1, storage_batch_mb=0)
    prompt = list(range(1, 34))
    hc = HiCache(cfg, runtime=runtime).start()
    stored_only(hc, prompt)
    assert hc.prefetch([Request("b", prompt[:-1])]) == {"b": 32}
    if not deterministic:  # on threads: until the prefetcher has set its timer (the tree answered its hit)
        waited = 0
        while not runtime._timers and waited < 10_000:
            time.sleep(0.001)
            waited += 1
    hc.close(drain=False)
    log = read_log(path)
    timers = [m for m in log.in_flight if m.sender is ActorName.PREFETCH]
    assert [(m.receiver, m.type_name) for m in timers] == [(ActorName.PREFETCH, "ContinuePrefetch")]
    assert replay_log(log).divergence is None


def test_an_in_flight_message_the_codec_refuses_is_logged_as_such_and_named(tmp_path: Path) -> None:
    path = tmp_path / "unencodable.log"
    refused = AllocateHost(op_id=10**30, tokens=4)
    with HiCache(CONFIG.replace(log_path=str(path)), runtime=DeterministicRuntime(seed=2)) as hc:
        hc.system.services.undelivered.append((ActorName.HOST, Mail(ActorName.TREE, refused)))
    [recorded] = read_log(path).in_flight
    assert recorded.message is None and recorded.type_name == "AllocateHost"
    assert recorded.unencodable is not None and recorded.unencodable.startswith("body: CodecError: ")
    div = replay_log(path).divergence
    assert div is not None and div.actual == "(the replayed tree never sent it)"
    assert div.expected.startswith(f"AllocateHost (not logged: {recorded.unencodable}) (in flight from tree to host")
