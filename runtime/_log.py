"""The delivery log: one structlog JSON line per delivered message, replayable.

Line kinds (the `event` field):

- `header` (first line): log version, hicache and torch versions, the `Config`,
  the runtime and its seed, which actor names were stood in by probes.
- `delivery`: `seq` (global order of delivery), `t` (runtime time: virtual in the
  deterministic runtime), `receiver`, `sender`, `type`, `ask`, `body` (the
  message's msgpack bytes in base64, exactly re-decodable), `reply` (base64, for
  an ask), `error` (the exception a handler raised, if any).
- `blob`: the bytes (`data`, base64) of an `Indices` or `Tokens` of at least
  `BLOB_BYTES_MIN` bytes, numbered (`blob`) in order of appearance. A body or
  reply that carries such a value refers to it by number (codec extensions 5 and
  6) instead of carrying the bytes, and the blob line comes before the first line
  that refers to it. The token ids and slot indices of a batch travel in several
  messages (admission, allocation, finish, write-through, host states): written
  once, they are less than half the bytes of a large run's log.
- `fault`: a decision of the fault plan (`actor`, `hook`, `value`), in the order
  the actor asked, so that a replay injects the same faults.

Everything a run depends on from outside the actors is in the log: the calls of
the facade are deliveries from `facade`, their results are deliveries to it or
ask replies, stream completions and timer firings are deliveries, faults are
`fault` lines. JSON is rendered with orjson, base64 with pybase64, when they are
installed (the `fast` extra); the text is the same without them.
"""

from __future__ import annotations

import base64
import binascii
import importlib.metadata
import itertools
import json
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import structlog

from hicache.messages import ActorName, Message, encode

from ._services import FaultPlan

LOG_VERSION = 2
"""2: large `Indices` are `blob` lines referred to by number (1 carried them in every body)."""

BLOB_BYTES_MIN = 1024
"""An `Indices` or `Tokens` payload this large (128 values) or larger is written as a blob, once."""
BLOBS_HELD_BYTES_MAX = 64 << 20
"""Bytes of blobs the writer remembers for reference; past this the oldest are forgotten
(a repeat of one is written again, as a new blob). The reader keeps all."""
LOG_BUFFER_BYTES = 1 << 20
"""Lines wait in a buffer of this many bytes before they are written to the file. Closing the
log (stopping the System) writes them all; a process killed hard (SIGKILL, a crash in native
code) loses at most this much of the end of its log."""

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


_NULL = b"null"
_END = b',"event":"delivery"}\n'


class _LineWriter:
    """The log file, written through a buffer of `LOG_BUFFER_BYTES`: each line is put into
    it whole, under one lock, and the buffer goes to the file when full, on `flush` and on
    `close`. One `write` system call per line cost more than the rest of logging a small
    delivery, and each released the GIL to the other actors' threads in mid-delivery.

    structlog writes the header and fault lines through it (it is the logger structlog
    wraps); `DeliveryLog` writes the delivery and blob lines directly."""

    def __init__(self, path: Path) -> None:
        self._file: BinaryIO = path.open("wb", buffering=LOG_BUFFER_BYTES)
        self.lock = threading.Lock()

    def close(self) -> None:
        """Write what is buffered and close the file; a line written after this raises."""
        with self.lock:
            self._file.close()

    def flush(self) -> None:
        """Hand every line written so far to the operating system."""
        with self.lock:
            self._file.flush()

    def write_line(self, parts: Sequence[bytes]) -> None:
        """Write `parts` (the last ends with a newline) as one line (joined: one buffer call)."""
        with self.lock:
            self._file.write(b"".join(parts))

    def write_locked(self, parts: Sequence[bytes]) -> None:
        """Write `parts` as one line, each into the buffer as it is (a blob line's tens of
        kilobytes are not joined into one more copy); the caller holds `lock`."""
        for part in parts:
            self._file.write(part)

    def msg(self, message: bytes) -> None:
        self.write_line((message, b"\n"))

    info = msg


_BLOB_EDGE_BYTES = 32
_BlobKey = tuple[int, bytes, bytes]
"""A payload's length, first and last `_BLOB_EDGE_BYTES`: where `_Blobs` looks for it."""


class _Blobs:
    """The log's blob lines: `refer` gives the number of a large payload, writing its `blob`
    line first if it is new. The lookup, the numbering and the write happen under the line
    writer's lock, so the blob line is in the file before any line that refers to it.

    Payloads are found by a key of their length and first and last `_BLOB_EDGE_BYTES`,
    then compared whole: hashing every payload (most are fresh `bytes` objects, whose hash
    is not cached yet) cost more than the rest of logging it."""

    def __init__(self, out: _LineWriter) -> None:
        self._out = out
        self._held: dict[_BlobKey, list[tuple[bytes, int]]] = {}
        self._order: deque[tuple[_BlobKey, bytes]] = deque()
        """The held payloads, oldest first: the first forgotten past `BLOBS_HELD_BYTES_MAX`."""
        self._held_bytes = 0
        self._next = 0

    def refer(self, data: bytes) -> int | None:
        if len(data) < BLOB_BYTES_MIN:
            return None
        key = (len(data), data[:_BLOB_EDGE_BYTES], data[-_BLOB_EDGE_BYTES:])
        with self._out.lock:
            same = self._held.setdefault(key, [])
            for held, n in same:
                if held == data:
                    return n
            n = self._next
            self._next += 1
            self._out.write_locked((b'{"blob":%d,"data":"' % n, _b64(data), b'","event":"blob"}\n'))
            same.append((data, n))
            self._order.append((key, data))
            self._held_bytes += len(data)
            while self._held_bytes > BLOBS_HELD_BYTES_MAX:
                self._forget_oldest()
        return n

    def _forget_oldest(self) -> None:
        key, data = self._order.popleft()
        same = self._held[key]
        same[:] = [(held, n) for held, n in same if held is not data]
        if not same:
            del self._held[key]
        self._held_bytes -= len(data)


class DeliveryLog:
    """Writes the log of one system. Thread-safe: actors on threads log concurrently.

    A delivery or blob line is the JSON object structlog's `JSONRenderer` renders for
    the event `delivery` (`blob`) with the fields in the order the module docstring lists
    them (`event` last), byte for byte; it is put together here without structlog's event
    dict (integers are written as `%d`, which is what every JSON renderer writes for them),
    and base64 goes into it as bytes, so that the megabytes of a large message are neither
    decoded to a str nor scanned again by the JSON encoder. The header and fault lines go
    through structlog."""

    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self._out = _LineWriter(self.path)
        self._log = structlog.wrap_logger(
            self._out,
            processors=[structlog.processors.JSONRenderer(serializer=_dumps)],
            cache_logger_on_first_use=True,
        )
        self._seq = itertools.count(1)
        self._blobs = _Blobs(self._out)
        self._middles: dict[tuple[ActorName, ActorName, type, bool], bytes] = {}
        self._log.msg("header", version=LOG_VERSION, **header)

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
        body = _b64(encode(message, self._blobs))
        err = _dumps(f"{type(error).__name__}: {error}") if error is not None else _NULL
        head = (b'{"seq":', b"%d" % seq, b',"t":', _dumps(t), b",", middle, b',"body":"', body)
        if ask and reply is not None:
            parts = (*head, b'","reply":"', _b64(encode(reply, self._blobs)), b'","error":', err, _END)
        else:
            parts = (*head, b'","reply":null,"error":', err, _END)
        self._out.write_line(parts)

    def fault(self, actor: str, hook: str, value: Any) -> None:
        self._log.msg("fault", actor=actor, hook=hook, value=value)

    def flush(self) -> None:
        """Hand every line logged so far to the operating system (closing does it too)."""
        self._out.flush()

    def close(self) -> None:
        self._out.close()


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
