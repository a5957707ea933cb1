"""The delivery log: one structlog JSON line per delivered message, replayable.

Line kinds (the `event` field):

- `header` (first line): log version, hicache and torch versions, the `Config`,
  the runtime and its seed, which actor names were stood in by probes.
- `delivery`: `seq` (global order of delivery), `t` (runtime time: virtual in the
  deterministic runtime), `receiver`, `sender`, `type`, `ask`, `body` (the
  message's msgpack bytes in base64, exactly re-decodable), `reply` (base64, for
  an ask), `error` (the exception a handler raised, if any).
- `fault`: a decision of the fault plan (`actor`, `hook`, `value`), in the order
  the actor asked, so that a replay injects the same faults.

Everything a run depends on from outside the actors is in the log: the calls of
the facade are deliveries from `facade`, their results are deliveries to it or
ask replies, stream completions and timer firings are deliveries, faults are
`fault` lines. JSON is rendered with orjson, base64 with pybase64, when they are
installed (the `fast` extra); the text is the same without them.
"""

from __future__ import annotations

import binascii
import importlib.metadata
import itertools
import json
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import structlog

from hicache.messages import ActorName, Message, encode

from ._services import FaultPlan

LOG_VERSION = 1

try:  # optional, faster
    import orjson

    ORJSON = True

    def _dumps(obj: Any, **_: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover - orjson is optional
    ORJSON = False

    def _dumps(obj: Any, **_: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()


def _b64_stdlib(data: bytes) -> bytes:
    """Standard base64 of `data`, as ASCII bytes (what `base64.b64encode` gives)."""
    return binascii.b2a_base64(data, newline=False)


try:  # optional, faster: SIMD base64, the same text as the standard library's
    import pybase64

    PYBASE64 = True
    _b64: Callable[[bytes], bytes] = pybase64.b64encode
except ImportError:  # pragma: no cover - pybase64 is optional
    PYBASE64 = False
    _b64 = _b64_stdlib


_NULL = b"null"
_END = b',"event":"delivery"}\n'


_WRITEV = hasattr(os, "writev")
_JOIN_MAX = 1 << 16
"""Lines longer than this are handed to the kernel in pieces (`writev`), not joined first."""


def _write_all(fd: int, parts: Sequence[bytes], big: bool) -> None:
    """Write `parts` to `fd`, one after the other: joined by one copy and written, or, when
    `big`, handed to the kernel as they are (`writev`: the megabytes are not copied twice)."""
    if big and _WRITEV:
        done = os.writev(fd, parts)
        if done == sum(map(len, parts)):
            return
        rest = memoryview(b"".join(parts))[done:]  # a short write (a signal, a full disk): the rest
    else:
        data = b"".join(parts)
        done = os.write(fd, data)
        if done == len(data):
            return
        rest = memoryview(data)[done:]
    while rest:
        rest = rest[os.write(fd, rest):]


class _LineWriter:
    """The log file, unbuffered: each line is written whole, by one call under one lock, so
    that it is out of this process when the call returns (a crash loses no logged line).

    structlog writes the header and fault lines through it (it is the logger structlog
    wraps); `DeliveryLog.delivery` writes its lines directly."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._fd = file.fileno()
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the file; a line written after this raises (it never lands in a reused descriptor)."""
        with self._lock:
            self._fd = -1
            self._file.close()

    def write_line(self, parts: Sequence[bytes], big: bool = False) -> None:
        """Write `parts` (the last ends with a newline) as one line; `big`: more than `_JOIN_MAX` bytes."""
        with self._lock:
            _write_all(self._fd, parts, big)

    def msg(self, message: bytes) -> None:
        self.write_line((message, b"\n"), len(message) > _JOIN_MAX)

    info = msg


class DeliveryLog:
    """Writes the log of one system. Thread-safe: actors on threads log concurrently.

    A delivery line is the JSON object structlog's `JSONRenderer` renders for the event
    `delivery` with the fields in the order the module docstring lists them (`event`
    last), byte for byte; it is put together here without structlog's event dict, and
    the base64 of the body and reply goes into it as bytes, so that the megabytes of a
    large message are neither decoded to a str nor scanned again by the JSON encoder.
    The header and fault lines go through structlog."""

    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self._file: BinaryIO = self.path.open("wb", buffering=0)
        self._out = _LineWriter(self._file)
        self._log = structlog.wrap_logger(
            self._out,
            processors=[structlog.processors.JSONRenderer(serializer=_dumps)],
            cache_logger_on_first_use=True,
        )
        self._seq = itertools.count(1)
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
        body = _b64(encode(message))
        err = _dumps(f"{type(error).__name__}: {error}") if error is not None else _NULL
        head = (b'{"seq":', _dumps(seq), b',"t":', _dumps(t), b",", middle, b',"body":"', body)
        if ask and reply is not None:
            answer = _b64(encode(reply))
            parts = (*head, b'","reply":"', answer, b'","error":', err, _END)
            big = len(body) + len(answer) > _JOIN_MAX
        else:
            parts = (*head, b'","reply":null,"error":', err, _END)
            big = len(body) > _JOIN_MAX
        self._out.write_line(parts, big)

    def fault(self, actor: str, hook: str, value: Any) -> None:
        self._log.msg("fault", actor=actor, hook=hook, value=value)

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
