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
`fault` lines. JSON is rendered with orjson when it is installed.
"""

from __future__ import annotations

import base64
import importlib.metadata
import itertools
import json
from pathlib import Path
from typing import Any, BinaryIO

import structlog

from hicache.messages import ActorName, Message, encode

from ._services import FaultPlan

LOG_VERSION = 1

try:  # optional, faster
    import orjson

    def _dumps(obj: Any, **_: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover - orjson is optional

    def _dumps(obj: Any, **_: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class DeliveryLog:
    """Writes the log of one system. Thread-safe: actors on threads log concurrently."""

    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self._file: BinaryIO = self.path.open("wb")
        self._log = structlog.wrap_logger(
            structlog.BytesLogger(self._file),
            processors=[structlog.processors.JSONRenderer(serializer=_dumps)],
            cache_logger_on_first_use=True,
        )
        self._seq = itertools.count(1)
        self._log.msg("header", version=LOG_VERSION, **header)

    def next_seq(self) -> int:
        """The sequence number of a delivery that starts now (global delivery order)."""
        return next(self._seq)

    def delivery(
        self, seq: int, t: float, receiver: ActorName, sender: ActorName, message: Message, ask: bool,
        reply: Message | None, error: BaseException | None,
    ) -> None:
        self._log.msg(
            "delivery", seq=seq, t=t, receiver=receiver.value, sender=sender.value,
            type=type(message).__name__, ask=ask, body=_b64(encode(message)),
            reply=_b64(encode(reply)) if ask and reply is not None else None,
            error=f"{type(error).__name__}: {error}" if error is not None else None,
        )

    def fault(self, actor: str, hook: str, value: Any) -> None:
        self._log.msg("fault", actor=actor, hook=hook, value=value)

    def close(self) -> None:
        self._file.flush()
        self._file.close()


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


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("hicache", "torch", "pykka", "msgpack"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "unknown"
    return out
