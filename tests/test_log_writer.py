"""Logging never fails a delivery: a message or reply the codec refuses, an exception whose text
cannot be taken, a fault value JSON cannot carry and a full disk are each recorded, and the actor
that handled the delivery goes on. Replay reports an unencodable delivery on one line, not as a
divergence."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from hicache.messages import ActorName, EvictHost, Evicted, FreeHostSlots, Indices, WriteDone
from hicache.runtime import Config, ConfigError, HiCache, LogReader, Request, ThreadedRuntime, _log, read_log
from hicache.runtime.cli import main
from hicache.runtime.testing import DeterministicRuntime, capture_logs

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


def test_a_log_path_with_no_room_fails_start_on_one_line_and_leaves_nothing_running() -> None:
    """It started, served the whole run unlogged and warned only when the buffer first filled."""
    threads, fds = set(threading.enumerate()), set(os.listdir("/proc/self/fd"))
    hc = HiCache(CONFIG.replace(log_path="/dev/full"))
    with capture_logs() as logs, pytest.raises(ConfigError, match=r"^log_path='/dev/full' cannot be written \(No "
                                               r"space left on device\): give a file in a folder this process "
                                               r"may write$"):
        hc.start()
    assert not hc.system.started and logs == []
    assert set(threading.enumerate()) <= threads and set(os.listdir("/proc/self/fd")) <= fds


class _SmallDisk(io.RawIOBase):
    """A file on a file system with `room` bytes left: a write past it is cut short, the next
    fails with ENOSPC, as the kernel does."""

    def __init__(self, raw: Any, room: int) -> None:
        self._raw, self._room = raw, room

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self._room == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self._raw.write(bytes(data[:self._room]))
        self._room -= n
        return n

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()
        super().close()


def test_a_log_whose_disk_fills_says_so_once_on_logging_never_on_stdout_and_replays_up_to_the_cut(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The warning went to stdout through structlog's global setup, past the application's
    `logging`, and named a line the file never held; replay blamed a crash."""
    opened = _log._open_exclusive
    monkeypatch.setattr(_log, "LOG_BUFFER_BYTES", 4096)
    monkeypatch.setattr(_log, "_open_exclusive",
                        lambda path: io.BufferedWriter(_SmallDisk(opened(path).detach(), 20_000), 4096))
    path = tmp_path / "full.log"
    with capture_logs() as logs:
        with HiCache(CONFIG.replace(log_path=str(path))) as hc:
            for i in range(6):
                _serve(hc, f"r{i}", list(range(8 * i, 8 * i + 16)))
            hc.check_invariants()
        monkeypatch.setattr(_log, "_open_exclusive", opened)
        with HiCache(CONFIG.replace(log_path=str(tmp_path / "next.log"))) as hc:  # another path: logs whole
            _serve(hc, "r", list(range(8)))
    [warned] = logs
    assert warned["event"].startswith("delivery log write failed; the log ends here") and "log_path" in warned["event"]
    assert warned["log_level"] == "warning" and warned["file_bytes"] == path.stat().st_size == 20_000
    assert "ENOSPC" not in warned["error"] and "No space left" in warned["error"]
    assert capsys.readouterr().out == ""
    assert read_log(tmp_path / "next.log").end.complete
    assert main(["replay", str(path)]) == 0
    assert "no end line" in (out := capsys.readouterr().out) and "a full disk" in out, out


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


_EXITS_WITHOUT_CLOSE = """
import os, sys
from hicache.runtime import Config, HiCache, Request
hc = HiCache(Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=96, host_slots=192,
                    log_path=sys.argv[1])).start()
for i in range(3):
    [a] = hc.admit([Request(f"r{i}", list(range(8 * i, 8 * i + 8)))])
    hc.finish([a.handle])
child = os.fork()
if child == 0:
    sys.exit(0)  # a helper the application forked, exiting normally with a copy of the buffer
os.waitpid(child, 0)
raise RuntimeError("the application failed before it closed the cache")
"""


def test_a_process_that_exits_without_closing_its_log_keeps_what_it_logged(tmp_path: Path) -> None:
    """An exception past the application's `close` left an empty file: the buffer was never
    written. A forked child's exit must not write its copy of the buffer into the parent's log."""
    path = tmp_path / "crashed.log"
    done = subprocess.run([sys.executable, "-c", _EXITS_WITHOUT_CLOSE, str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "the application failed" in done.stderr, done.stderr
    log = read_log(path)  # a repeated line (the child's copy) would be damage
    assert not log.end.complete and "no end line" in log.end.note
    assert sum(d.type_name == "FinishRequests" for d in log.deliveries) == 3
