"""Logging never fails a delivery: a message or reply the codec refuses, an exception whose text
cannot be taken, a fault value JSON cannot carry and a full disk are each recorded, and the actor
that handled the delivery goes on. Replay reports an unencodable delivery on one line, not as a
divergence."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hicache.messages import ActorName, EvictHost, Evicted, FreeHostSlots, Indices, WriteDone
from hicache.runtime import Config, HiCache, LogReader, Request, ThreadedRuntime, _log, read_log
from hicache.runtime.cli import main
from hicache.runtime.testing import DeterministicRuntime

CONFIG = Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=96, host_slots=192)


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def _await(hc: HiCache, op_id: int, kind: type) -> Any:
    """The reply `kind` to `op_id` told to the facade, skipping others."""
    while True:
        msg = hc.system.next_reply(10.0)
        assert msg is not None, f"no {kind.__name__} for op {op_id}"
        if isinstance(msg, kind) and msg.op_id == op_id:
            return msg


def _serve(hc: HiCache, rid: str, tokens: list[int]) -> None:
    [admitted] = hc.admit([Request(rid, tokens)])
    hc.start_loads()
    cached = admitted.cached_tokens
    hc.allocate({rid: len(tokens) - cached})
    hc.commit({rid: tokens[cached:]})
    hc.finish([admitted.handle])


@pytest.mark.parametrize("runtime", [ThreadedRuntime, lambda: DeterministicRuntime(seed=2)],
                         ids=["threads", "deterministic"])
def test_a_message_the_codec_cannot_encode_is_logged_as_such_and_its_actor_goes_on(
    tmp_path: Path, capsys, runtime: Any
) -> None:
    path = tmp_path / "run.log"
    with HiCache(CONFIG.replace(log_path=str(path)), runtime=runtime()) as hc:
        _serve(hc, "before", list(range(8)))
        hc.system.tell(ActorName.TREE, EvictHost(op_id=10**6, tokens=10**30))  # past msgpack's integers
        evicted = _await(hc, 10**6, Evicted)
        _serve(hc, "after", list(range(8)) + [9, 9, 9, 9])  # the tree still serves
        hc.check_invariants()
        hc.quiesce()

    assert evicted.op_id == 10**6
    [line] = [r for r in _records(path) if r.get("unencodable")]
    assert (line["receiver"], line["sender"], line["type"], line["body"]) == ("tree", "facade", "EvictHost", None)
    assert line["unencodable"].startswith("body: CodecError: integer 1000000000000000000000000000000 is outside")
    assert _records(path)[-1]["event"] == "end"

    assert main(["replay", str(path)]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1
    assert f"up to delivery {line['seq'] - 1}: delivery {line['seq']} (facade -> tree, EvictHost) could not be " \
           "logged (body: CodecError: integer" in out and out.endswith("replay stops before it")


def test_a_reply_the_codec_cannot_encode_keeps_the_body_and_says_why(tmp_path: Path) -> None:
    path = tmp_path / "reply.log"
    log = _log.DeliveryLog(path, {"bench": "writer"})
    log.delivery(1, 0.5, ActorName.TREE, ActorName.WRITE, WriteDone(op_id=3, slots=4), True,
                 WriteDone(op_id=2**64, slots=4), None)
    log.close()
    [d] = _deliveries_of(path)
    assert d.message == WriteDone(op_id=3, slots=4) and d.reply is None
    assert d.unencodable is not None and d.unencodable.startswith("reply: CodecError: integer 18446744073709551616")


def _deliveries_of(path: Path) -> list[Any]:
    with LogReader(path) as reader:
        return list(reader)


def test_an_exception_whose_text_cannot_be_taken_is_logged_by_its_type(tmp_path: Path) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    path = tmp_path / "error.log"
    log = _log.DeliveryLog(path, {"bench": "writer"})
    log.delivery(1, 0.0, ActorName.TREE, ActorName.WRITE, WriteDone(op_id=1, slots=4), False, None, Unprintable())
    log.delivery(2, 0.0, ActorName.TREE, ActorName.WRITE, WriteDone(op_id=2, slots=4), False, None,
                 ValueError("lone \ud800 surrogate"))
    log.close()
    first, second = _deliveries_of(path)
    assert first.error == "Unprintable: <str() raised RuntimeError>"
    assert second.error == "ValueError: lone \\ud800 surrogate"


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "stdlib-json"])
def test_a_fault_value_json_cannot_carry_is_logged_as_its_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               fast: bool) -> None:
    """The same text with or without the fast extra: the standard library's json writes a
    128-bit integer that orjson refuses, so without orjson the log still records its text."""
    if not fast:
        monkeypatch.setattr(_log, "ORJSON", False)
        monkeypatch.setattr(_log, "_dumps", lambda obj, **_: json.dumps(obj, separators=(",", ":")).encode())
    elif not _log.ORJSON:
        pytest.fail("orjson is missing: the test extras install it (make install)")
    path = tmp_path / "fault.log"
    log = _log.DeliveryLog(path, {"bench": "writer"})
    log.fault("host", "host_exhausted", {1, 2})
    log.fault("host", "host_exhausted", 10**30)
    log.delivery(1, 0.0, ActorName.HOST, ActorName.TREE, FreeHostSlots(pages=Indices.of([1])), False, None, None)
    log.close()
    [d] = _deliveries_of(path)
    assert d.faults == (("host_exhausted", "{1, 2}"), ("host_exhausted", str(10**30)))


def test_a_full_disk_ends_the_log_where_it_filled_and_every_actor_goes_on(tmp_path: Path, capsys,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_log, "LOG_BUFFER_BYTES", 4096)  # the first writes reach the device at once
    with HiCache(CONFIG.replace(log_path="/dev/full")) as hc:
        for i in range(3):
            _serve(hc, f"r{i}", list(range(8 * i, 8 * i + 8)))
        hc.check_invariants()
        log = hc.system.services.log
        assert log is not None and isinstance(log.error, OSError)
    assert "delivery log write failed; the log ends here" in capsys.readouterr().out


def test_a_delivery_after_close_is_not_written(tmp_path: Path) -> None:
    path = tmp_path / "closed.log"
    log = _log.DeliveryLog(path, {"bench": "writer"})
    log.delivery(1, 0.0, ActorName.TREE, ActorName.WRITE, WriteDone(op_id=1, slots=4), False, None, None)
    log.close()
    log.delivery(2, 0.0, ActorName.TREE, ActorName.WRITE, WriteDone(op_id=2, slots=4), False, None, None)
    records = _records(path)
    assert [r["event"] for r in records] == ["header", "delivery", "end"] and records[-1]["deliveries"] == 1


def test_a_run_logged_with_unencodable_deliveries_still_reads_whole(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    with HiCache(CONFIG.replace(log_path=str(path)), runtime=DeterministicRuntime(seed=1)) as hc:
        hc.system.tell(ActorName.TREE, EvictHost(op_id=10**6, tokens=2**64))
        _await(hc, 10**6, Evicted)
        _serve(hc, "r", list(range(8)))
    log = read_log(path)
    assert log.end.complete and [d.seq for d in log.deliveries] == list(range(1, len(log.deliveries) + 1))
    assert sum(d.message is None for d in log.deliveries) == 1


def test_a_second_running_instance_on_one_log_path_is_refused_and_leaves_the_log_whole(tmp_path: Path) -> None:
    """Tensor-parallel ranks sharing one config file once started on one `log_path`: each
    emptied the file and wrote its lines between the other's, into a log no replay reads."""
    path = tmp_path / "shared.log"
    config = CONFIG.replace(log_path=str(path))
    with HiCache(config) as first:
        [a] = first.admit([Request("a", list(range(8)))])
        first.finish([a.handle])
        second = HiCache(config)
        with pytest.raises(Exception, match=r"^log_path=.* is being written by "
                           r"another running instance .*: give each instance, and each tensor-parallel rank, a log "
                           r"file of its own$") as refused:
            second.start()
        assert type(refused.value).__name__ == "ConfigError" and not second.system.started
    assert main(["replay", str(path)]) == 0  # the first instance's log, whole
    with HiCache(config):  # free again once the first closed
        pass

