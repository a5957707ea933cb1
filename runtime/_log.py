"""The delivery log: one structlog JSON line per delivered message, replayable.

Line kinds (the `event` field):

- `header` (first line): log version, hicache and torch versions, the `Config`,
  the runtime and its seed, which actor names were stood in by probes, and
  `blobs_held_bytes_max` (below).
- `delivery`: `seq` (global order of delivery), `t` (runtime time: virtual in the
  deterministic runtime), `receiver`, `sender`, `type`, `ask`, `body` (the
  message's msgpack bytes in base64, exactly re-decodable), `reply` (base64, for
  an ask), `error` (the exception a handler raised, if any). A message or reply
  the codec cannot encode (an integer past msgpack's range, an unregistered
  type) is logged all the same, with `unencodable` naming which and why and that
  part `null`: logging never fails a delivery.
- `blob`: the bytes (`data`, base64) of an `Indices` or `Tokens` of at least
  `BLOB_BYTES_MIN` bytes, numbered (`blob`) in order of appearance. A body or
  reply that carries such a value refers to it by number (codec extensions 5 and
  6) instead of carrying the bytes, and the blob line comes right before the
  delivery line that first refers to it. The token ids and slot indices of a
  batch travel in several messages (admission, allocation, finish,
  write-through, host states): written once, they are less than half the bytes
  of a large run's log. The writer holds `blobs_held_bytes_max` bytes of blobs
  for reference and forgets the oldest only between delivery lines, so a reader
  that does the same holds exactly the blobs the next line may refer to.
- `fault`: a decision of the fault plan (`actor`, `hook`, `value`), written while
  the actor that asked handles a delivery, so it belongs to that actor's next
  delivery line: replay hands each delivery the decisions of its run.
- `in_flight` (written by `close`, right before the end line, with no other line
  between them but blobs): one per message its run sent and never delivered (told
  to an actor that had stopped, left in a stopped actor's inbox, held by a timer
  that never fired): `receiver`, `sender`, `type`, `ask` and `body` as a delivery
  line has them (`unencodable` and a `null` body where the codec refused it).
  Replay expects these sends of the rebuilt actors, and no others, past the last
  delivery.
- `end` (last line, written by `close`): `deliveries`, how many sequence numbers
  were given out. A log without it was not closed: its run crashed, or is running.

Every line starts with its number `n` (the header is 1) and ends with `crc`, the
CRC-32 of the line's text before `,"crc":`, as 8 lowercase hex digits: a reader
tells a changed, lost or reordered line from a log that is merely cut short.

Everything a run depends on from outside the actors is in the log: the calls of
the facade are deliveries from `facade`, their results are deliveries to it or
ask replies, stream completions and timer firings are deliveries, faults are
`fault` lines. JSON is rendered with orjson, base64 with pybase64 and the CRC-32
by zlib-ng, when they are installed (the `fast` extra); the text is the same
without them.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import fcntl
import importlib.metadata
import itertools
import json
import os
import stat
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import structlog

from hicache.actors._logging import logger
from hicache.actors._services import FaultPlan
from hicache.messages import ActorName, CodecError, Message, encode

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # the `fast` extra is not installed: the same checksum, slower
    from zlib import crc32

LOG_VERSION = 11
"""10: an admission's reply names the device pages its load-backs fill (`Admitted.loads`). 9: a
closed log ends with the mail its run sent and never delivered (`in_flight` lines), and
replay expects exactly those sends past the last delivery. 8: storage keys are blake2b-128
chains seeded by the model (`Config.model_id`, in the header's config) and a tensor-parallel
group's keys name its size (`StorePages` and `Prefetch` of a version 7 log carry other keys). 7:
`StartLoads` says whether a forward pass waits on the batch (`awaited`); an admission carries
its settled prefetch's tokens (`AdmitItem.stored`) and the tree answers the storage part of its
host hit (`Admission.storage_hit`, `TreeStatistics.host_hit_storage_tokens`). 6: the device
answers a finish to the facade itself (`Finished`; no `RequestsReleased` to the tree). 5:
allocations may grant pages ahead of a request's slots and give them back (`ahead`, `trim`). 4:
the device's messages carry the slots the facade served from a request's last page (`allocs`).
3: numbered, checksummed lines, an `end` line, blobs forgotten only between deliveries,
unencodable deliveries logged as such. 2 had none of these; 1 carried large payloads in every
body. A reader reads its own version only."""

BLOB_BYTES_MIN = 1024
"""An `Indices` or `Tokens` payload this large (128 values) or larger is written as a blob, once."""
BLOBS_HELD_BYTES_MAX = 64 << 20
"""Bytes of blobs the writer remembers for reference (and a reader holds); past this the oldest
are forgotten after the delivery line being written (a repeat of one is written again, as a new
blob). The header states the bound the log was written with."""
LOG_BUFFER_BYTES = 1 << 20
"""Lines wait in a buffer of this many bytes before they are written to the file. Closing the
log (stopping the System) writes them all, and so does a process that exits without closing it;
a process killed hard (SIGKILL, a crash in native code) loses at most this much of the end of
its log."""

SEAL_BYTES = len(b',"crc":"12345678"}')
"""A line's checksum at its end: `,"crc":"`, 8 lowercase hex digits, `"}` (the line end aside)."""

log = logger("hicache.log")

try:  # optional, faster
    import orjson

    ORJSON = True

    def _dumps(obj: Any, **_: Any) -> bytes:
        return orjson.dumps(obj)

    loads_line: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover - orjson is optional
    ORJSON = False

    def _dumps(obj: Any, **_: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    loads_line = json.loads
"""Parse one log line (bytes); a ValueError (`json.JSONDecodeError`) when it is not JSON."""


def _orjson_would_carry(value: Any) -> None:
    """Raise TypeError where orjson would refuse what the standard library's json writes: an
    integer outside 64 bits. A fault value is small; so the log reads the same with or without
    the fast extra."""
    if isinstance(value, int) and not -(2**63) <= value < 2**64:
        raise TypeError(f"integer exceeds 64-bit range: {value}")
    if isinstance(value, (list, tuple)):
        for v in value:
            _orjson_would_carry(v)
    elif isinstance(value, dict):
        for v in value.values():
            _orjson_would_carry(v)


def _b64_stdlib(data: bytes) -> bytes:
    """Standard base64 of `data`, as ASCII bytes (what `base64.b64encode` gives)."""
    return binascii.b2a_base64(data, newline=False)


try:  # optional, faster: SIMD base64, the same text as the standard library's
    import pybase64

    PYBASE64 = True
    _b64: Callable[[bytes], bytes] = pybase64.b64encode
    _unb64: Callable[..., bytes] = pybase64.b64decode
except ImportError:  # pragma: no cover - pybase64 is optional
    PYBASE64 = False
    _b64 = _b64_stdlib
    _unb64 = base64.b64decode


def unbase64(text: str | bytes) -> bytes:
    """The bytes of standard base64 `text`; `binascii.Error` (a ValueError) for anything else."""
    return _unb64(text, validate=True)


def error_text(err: BaseException) -> str:
    """`"Type: message"` of an exception, as a log line and a replay write it; never raises
    (an exception whose `str` raises is named by that), and encodable (a lone surrogate is
    written as its escape)."""
    try:
        text = str(err)
    except Exception as failed:  # noqa: BLE001 - its own __str__ failed: say so instead of its text
        text = f"<str() raised {type(failed).__name__}>"
    return f"{type(err).__name__}: {text}".encode("utf-8", "backslashreplace").decode("utf-8")


_NULL = b"null"
_END = b',"event":"delivery"'
_IN_FLIGHT = b',"event":"in_flight"'


class LogInUseError(OSError):
    """Another writer (another instance of this process, or another process) holds the log file."""


def _open_exclusive(path: Path) -> BinaryIO:
    """`path` emptied and opened for writing, with an exclusive `flock` held until it is
    closed: two instances given one `log_path` (tensor-parallel ranks sharing a config file,
    say) would interleave their lines into a log no replay reads. The lock is taken before
    the file is emptied, so a refused writer leaves the other's log whole."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LogInUseError(f"log_path={str(path)!r} is being written by another running instance (of this "
                                "process or another): give each instance, and each tensor-parallel rank, a log "
                                "file of its own") from None
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.ftruncate(fd, 0)
        return os.fdopen(fd, "wb", buffering=LOG_BUFFER_BYTES)
    except BaseException:
        os.close(fd)
        raise


class _LineWriter:
    """The log file, written through a buffer of `LOG_BUFFER_BYTES`: each line is numbered,
    sealed with its checksum and put into the buffer whole, under one lock; the buffer goes
    to the file when full, on `flush` and on `close`. One `write` system call per line cost
    more than the rest of logging a small delivery, and each released the GIL to the other
    actors' threads in mid-delivery.

    structlog writes the header, fault and end lines through it (it is the logger structlog
    wraps); `DeliveryLog` writes the delivery and blob lines directly.

    A process that exits without closing it hands the buffer to the file on its way out (no
    end line is written: the run was not closed).

    An OS error (a full disk) stops the log where it happened: it is logged once, with the
    path and the bytes the file kept, kept in `error`, and later lines are dropped, so the
    file reads as a log cut short. The actor whose delivery was being written goes on."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO = _open_exclusive(path)
        self.lock = threading.Lock()
        self.lines = 0
        """Lines written (or being written): the number of the last one."""
        self.closed = False
        self.error: OSError | None = None
        self._writing = True
        """Neither closed nor stopped by an error: lines are written."""
        self._pid = os.getpid()
        atexit.register(self._flush_at_exit)

    def close(self, last: bytes | None = None, before: Callable[[], None] | None = None) -> None:
        """Write the lines `before()` writes (with `seal_locked`), then `last` (a rendered line, the
        end line), what is buffered, and close the file, all under the lock: no other line comes
        between them. A line written after this is dropped."""
        with self.lock:
            if self.closed:
                return
            if before is not None:
                before()
            if last is not None:
                self.seal_locked([b"", last[1:-1]])
            if self._writing:
                self._flush_locked()  # while the file is open: a failure says how much it kept
            failed = self._shut_locked()
            if failed is not None:
                self._failed(failed)

    def flush(self) -> None:
        """Hand every line written so far to the operating system."""
        with self.lock:
            if not self.closed and self.error is None:
                self._flush_locked()

    def flush_or_refuse(self) -> None:
        """`flush` the first line: an OS error (no room on the file system) closes the file
        and is raised, for the caller to refuse the log at its start, instead of ending it."""
        with self.lock:
            try:
                self._file.flush()
            except OSError:
                self._shut_locked()
                raise

    def _flush_locked(self) -> None:
        try:
            self._file.flush()
        except OSError as err:
            self._failed(err)

    def _shut_locked(self) -> OSError | None:
        """Close the file (what is still buffered is tried once more); the error, if any."""
        self.closed = True
        self._writing = False
        atexit.unregister(self._flush_at_exit)
        try:
            self._file.close()
        except OSError as err:
            return err
        return None

    def _flush_at_exit(self) -> None:
        """A process that exits without closing its log (an exception past the application's
        `close`) keeps what it logged: the buffer goes to the file, with no end line, as the
        log of a crashed run reads. A forked child that exits leaves its copy of the buffer."""
        if os.getpid() == self._pid:
            self.flush()

    def seal_locked(self, parts: list[bytes]) -> None:
        """Write one line: `{"n":N,` (into `parts[0]`), then the rest of `parts` (a JSON object's
        members, `"key":value,...`), then its checksum. The caller holds `lock`."""
        if not self._writing:
            return
        self.lines += 1
        parts[0] = b'{"n":%d,' % self.lines
        line = b"".join(parts)
        try:
            self._file.write(b'%b,"crc":"%08x"}\n' % (line, crc32(line)))
        except OSError as err:
            self._failed(err)

    def seal_parts_locked(self, parts: Sequence[bytes]) -> None:
        """`seal_locked` of the fields in pieces, each written as it is (a blob line's tens of
        kilobytes are not joined into one more copy)."""
        if not self._writing:
            return
        self.lines += 1
        head = b'{"n":%d,' % self.lines
        crc = crc32(head)
        try:
            write = self._file.write
            write(head)
            for part in parts:
                crc = crc32(part, crc)
                write(part)
            write(b',"crc":"%08x"}\n' % crc)
        except OSError as err:
            self._failed(err)

    def _failed(self, err: OSError) -> None:
        self._writing = False
        if self.error is None:
            self.error = err
            try:  # what reached the file: the lines still in the buffer when the write failed are lost too
                kept: int | None = os.fstat(self._file.fileno()).st_size
            except (OSError, ValueError):
                kept = None
            log.warning("delivery log write failed; the log ends here: the cache goes on, the rest of its run is "
                        "not logged, and replay reads the file up to where it stops. Free space where it is, or "
                        "give log_path on another file system, and start again to log a whole run",
                        path=str(self.path), file_bytes=kept, error=f"{type(err).__name__}: {err}")

    def msg(self, message: bytes) -> None:
        with self.lock:
            self.seal_locked([b"", message[1:-1]])

    info = msg


_BLOB_EDGE_BYTES = 32
_BlobKey = tuple[int, bytes, bytes]
"""A payload's length, first and last `_BLOB_EDGE_BYTES`: where `_Blobs` looks for it."""


class _Blobs:
    """The log's blob lines: `refer` gives the number of a large payload, writing its `blob`
    line first if it is new; `trim` forgets the oldest past the bound, between delivery
    lines. Both run under the line writer's lock, with the delivery line they serve, so the
    blob line is in the file right before it and a reader can hold the same blobs.

    Payloads are found by a key of their length and first and last `_BLOB_EDGE_BYTES`,
    then compared whole: hashing every payload (most are fresh `bytes` objects, whose hash
    is not cached yet) cost more than the rest of logging it."""

    def __init__(self, out: _LineWriter, held_bytes_max: int) -> None:
        self._out = out
        self._held: dict[_BlobKey, list[tuple[bytes, int]]] = {}
        self._order: deque[tuple[_BlobKey, bytes]] = deque()
        """The held payloads, oldest first: the first forgotten past `held_bytes_max`."""
        self.held_bytes = 0
        self.held_bytes_max = held_bytes_max
        self._next = 0

    def refer(self, data: bytes) -> int | None:
        if len(data) < BLOB_BYTES_MIN:
            return None
        key = (len(data), data[:_BLOB_EDGE_BYTES], data[-_BLOB_EDGE_BYTES:])
        same = self._held.setdefault(key, [])
        for held, n in same:
            if held == data:
                return n
        n = self._next
        self._next += 1
        self._out.seal_parts_locked((b'"blob":%d,"data":"' % n, _b64(data), b'","event":"blob"'))
        same.append((data, n))
        self._order.append((key, data))
        self.held_bytes += len(data)
        return n

    def trim(self) -> None:
        while self.held_bytes > self.held_bytes_max:
            key, data = self._order.popleft()
            same = self._held[key]
            same[:] = [(held, n) for held, n in same if held is not data]
            if not same:
                del self._held[key]
            self.held_bytes -= len(data)


class DeliveryLog:
    """Writes the log of one system. Thread-safe: actors on threads log concurrently.

    A delivery or blob line is the JSON object structlog's `JSONRenderer` renders for
    the event `delivery` (`blob`) with the fields in the order the module docstring lists
    them (`event` last), byte for byte, numbered and sealed like every line; it is put
    together here without structlog's event dict (integers are written as `%d`, which is
    what every JSON renderer writes for them), and base64 goes into it as bytes, so that the
    megabytes of a large message are neither decoded to a str nor scanned again by the JSON
    encoder. The header, fault and end lines go through structlog.

    `delivery` never raises for what it is given: a message or reply the codec refuses is
    logged as unencodable, an exception whose text cannot be taken is named by type. After
    `close`, deliveries are not written (the end line has closed the log)."""

    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self._out = _LineWriter(self.path)
        self._log = structlog.wrap_logger(
            self._out,
            processors=[structlog.processors.JSONRenderer(serializer=_dumps)],
            cache_logger_on_first_use=True,
        )
        self._seq = itertools.count(1)
        self._seq_top = 0
        """The highest sequence number logged (a caller may number deliveries itself)."""
        self._blobs = _Blobs(self._out, BLOBS_HELD_BYTES_MAX)
        self._middles: dict[tuple[ActorName, ActorName, type, bool], bytes] = {}
        self._log.msg("header", version=LOG_VERSION, **header, blobs_held_bytes_max=BLOBS_HELD_BYTES_MAX)
        # In the file at once: a log with no room is refused at the start of its run, and a run
        # killed before its first buffer is written leaves a log that says so.
        self._out.flush_or_refuse()

    @property
    def error(self) -> OSError | None:
        """The OS error that stopped the log early, or None."""
        return self._out.error

    def next_seq(self) -> int:
        """The sequence number of a delivery that starts now (global delivery order)."""
        return next(self._seq)

    def delivery(
        self, seq: int, t: float, receiver: ActorName, sender: ActorName, message: Message, ask: bool,
        reply: Message | None, error: BaseException | None,
    ) -> None:
        kind = (receiver, sender, type(message), ask)
        middle = self._middles.get(kind)
        if middle is None:  # `"receiver":...,"sender":...,"type":...,"ask":...`, rendered once per kind
            middle = self._middles[kind] = _dumps({
                "receiver": receiver.value, "sender": sender.value, "type": type(message).__name__, "ask": ask,
            })[1:-1]
        err = _dumps(error_text(error)) if error is not None else _NULL
        out = self._out
        with out.lock:
            if seq > self._seq_top:
                self._seq_top = seq
            try:
                body = _b64(encode(message, self._blobs))
                answer = _b64(encode(reply, self._blobs)) if ask and reply is not None else None
            except CodecError as failed:
                parts = self._unencodable(seq, t, middle, err, message, failed)
            else:
                if answer is None:
                    parts = [b"", b'"seq":', b"%d" % seq, b',"t":', _dumps(t), b",", middle, b',"body":"', body,
                             b'","reply":null,"error":', err, _END]
                else:
                    parts = [b"", b'"seq":', b"%d" % seq, b',"t":', _dumps(t), b",", middle, b',"body":"', body,
                             b'","reply":"', answer, b'","error":', err, _END]
            out.seal_locked(parts)
            blobs = self._blobs
            if blobs.held_bytes > blobs.held_bytes_max:
                blobs.trim()

    def _unencodable(self, seq: int, t: float, middle: bytes, err: bytes, message: Message,
                     failed: CodecError) -> list[bytes]:
        """The parts of a delivery line whose message (or reply) the codec refused: that part
        `null` and `unencodable` saying which and why."""
        try:
            body = b'"%b"' % _b64(encode(message, self._blobs))
            why = _dumps(f"reply: {error_text(failed)}")
        except CodecError as body_failed:
            body, why = _NULL, _dumps(f"body: {error_text(body_failed)}")
        return [b"", b'"seq":', b"%d" % seq, b',"t":', _dumps(t), b",", middle, b',"body":', body,
                b',"reply":null,"error":', err, b',"unencodable":', why, _END]

    def fault(self, actor: str, hook: str, value: Any) -> None:
        try:
            _dumps(value)
            if not ORJSON:
                _orjson_would_carry(value)
        except (TypeError, ValueError):  # a value JSON cannot carry: recorded as its text, never a failed delivery
            value = repr(value).encode("utf-8", "backslashreplace").decode("utf-8")
        self._log.msg("fault", actor=actor, hook=hook, value=value)

    def flush(self) -> None:
        """Hand every line logged so far to the operating system (closing does it too)."""
        self._out.flush()

    def close(self, in_flight: Sequence[tuple[ActorName, Any]] = ()) -> None:
        """Write an `in_flight` line for each `(receiver, Mail)` of `in_flight` (the mail its
        run sent and never delivered), then the end line (how many sequence numbers were given
        out, or the highest logged if more), and close the file."""
        issued = max(next(self._seq) - 1, self._seq_top)

        def undelivered() -> None:
            for receiver, mail in in_flight:
                self._in_flight_locked(receiver, mail)

        self._out.close(_dumps({"deliveries": issued, "event": "end"}), undelivered)

    def _in_flight_locked(self, receiver: ActorName, mail: Any) -> None:
        """One `in_flight` line: the delivery line's fields that a message has before it is
        delivered (its blobs written first, and forgotten past the bound after it, as after a
        delivery line). The caller holds the writer's lock."""
        message = mail.message
        head = _dumps({"receiver": receiver.value, "sender": mail.sender.value, "type": type(message).__name__,
                       "ask": mail.ask})[1:-1]
        try:
            parts = [b"", head, b',"body":"', _b64(encode(message, self._blobs)), b'"', _IN_FLIGHT]
        except CodecError as failed:
            parts = [b"", head, b',"body":null,"unencodable":', _dumps(f"body: {error_text(failed)}"), _IN_FLIGHT]
        self._out.seal_locked(parts)
        blobs = self._blobs
        if blobs.held_bytes > blobs.held_bytes_max:
            blobs.trim()


def rewrite_log(src: str | Path, dst: str | Path, edit: Callable[[dict[str, Any]], dict[str, Any] | None]) -> int:
    """Write the log `src` to `dst` with each line's record (a dict without `n` and `crc`)
    passed through `edit`, which returns it (changed or not) or None to leave it out; the
    lines are numbered and sealed again. What a build with a bug would have logged, made
    from a good log: replay then shows where today's code differs from it. A last line cut
    short is left out. The number of lines written."""
    out = _LineWriter(Path(dst))
    with Path(src).open("rb") as f, out.lock:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            rec = loads_line(raw)
            rec.pop("n", None)
            rec.pop("crc", None)
            kept = edit(rec)
            if kept is not None:
                out.seal_locked([b"", _dumps(kept)[1:-1]])
    out.close()
    if out.error is not None:
        raise out.error
    return out.lines


class _LoggedFaults:
    """A fault plan that records each decision of the plan it wraps."""

    def __init__(self, inner: FaultPlan, log: DeliveryLog) -> None:
        self._inner = inner
        self._log = log

    def transfer_fault(self, stream: ActorName, op_ids: tuple[int, ...]) -> str | None:
        value = self._inner.transfer_fault(stream, op_ids)
        self._log.fault(stream.value, "transfer_fault", value)
        return value

    def host_exhausted(self, tokens: int) -> bool:
        value = self._inner.host_exhausted(tokens)
        self._log.fault(ActorName.HOST.value, "host_exhausted", value)
        return value

    def storage_fault(self, op_id: int, call: str) -> str | None:
        value = self._inner.storage_fault(op_id, call)
        self._log.fault(ActorName.PREFETCH.value, "storage_fault", value)
        return value

    def storage_delay(self, op_id: int) -> float:
        value = self._inner.storage_delay(op_id)
        self._log.fault(ActorName.PREFETCH.value, "storage_delay", value)
        return value


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("hicache", "torch", "pykka", "msgpack"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "unknown"
    return out
