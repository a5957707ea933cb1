"""Replay a delivery log: rebuild the actors, feed each its logged inbox, find the first divergence.

Each actor is deterministic given the order of its inbox (it takes ids, time and
faults from its services, and the faults it saw are in the log). So replay needs
no threads and no scheduler: for every actor it builds a fresh instance from the
logged `Config`, hands it the mail logged for it, one delivery after another, and
records what it sends. Mail from one actor to another arrives in the order it was
sent, so an actor's sends to each receiver must equal, in order, the deliveries
the log has from it to that receiver; an ask's reply must equal the logged reply.
The first delivery (lowest `seq`) where that fails is the divergence.

This replays logs recorded on threads as well as in the deterministic runtime.
`read_log` resolves the log's blob references (large `Indices` written once, as
`blob` lines), so each delivery's `body` and `reply` are the whole msgpack, as
`encode` writes them. A replayed message matches a logged one when it equals it
(messages are frozen dataclasses: the same type and equal fields, `Indices` by
their bytes) or, failing that, when it encodes to the same bytes (a NaN field
is not equal to itself); only a message that fails both is a divergence.
"""

from __future__ import annotations

import binascii
from bisect import bisect_right
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.messages import ActorName, CodecError, Message, decode, encode

from ._actor import Directory, HiActor, Mail
from ._layers import LayerDoneRing
from ._log import LOG_VERSION, loads_line, unbase64
from ._services import Failures, IdSource, NoFaults, Services
from ._system import actor_specs
from .config import Config, ConfigError



class ReplayLogError(ValueError):
    """The log cannot be replayed: the message names the line and what is wrong."""


@dataclass(frozen=True, slots=True)
class Delivery:
    seq: int
    t: float
    receiver: ActorName
    sender: ActorName
    message: Message
    ask: bool
    reply: bytes | None
    """The reply's msgpack bytes (`encode(reply)`), for an ask that returned one."""
    error: str | None
    line: int
    body: bytes = b""
    """The message's msgpack bytes (`encode(message)`; empty for a delivery not read from a log)."""
    answer: Message | None = None
    """The reply, decoded (None where `reply` is)."""


@dataclass(slots=True)
class ParsedLog:
    header: dict[str, Any]
    config: Config
    deliveries: list[Delivery]
    faults: dict[str, list[tuple[str, Any]]]


@dataclass(slots=True)
class Divergence:
    seq: int
    actor: str
    expected: str
    actual: str
    context: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ReplayResult:
    deliveries: int
    divergence: Divergence | None
    actors: dict[str, HiActor]


# -- reading -----------------------------------------------------------------------------------


def read_log(path: str | Path) -> ParsedLog:
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as err:
        raise ReplayLogError(f"{p}: cannot read: {err.strerror}") from None
    lines = text.split(b"\n")
    if not text.strip():
        raise ReplayLogError(f"{p}: line 1: the log is empty")
    if not text.endswith(b"\n"):
        raise ReplayLogError(f"{p}: line {len(lines)}: the log is truncated (its last line is incomplete)")
    header = _json(p, 1, lines[0])
    if header.get("event") != "header":
        raise ReplayLogError(f"{p}: line 1: expected the header line, found {header.get('event')!r}")
    if header.get("version") != LOG_VERSION:
        raise ReplayLogError(
            f"{p}: line 1: log version {header.get('version')!r} is not supported (this hicache reads "
            f"version {LOG_VERSION}; replay it with the hicache that wrote it, "
            f"{header.get('versions', {}).get('hicache', 'unknown')})"
        )
    try:
        config = Config.from_mapping({**header["config"], "log_path": ""})
    except (KeyError, ConfigError, TypeError) as err:
        raise ReplayLogError(f"{p}: line 1: the logged config is not valid: {err}") from None
    deliveries: list[Delivery] = []
    faults: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    blobs = Blobs()
    for n, raw in enumerate(lines[1:-1], start=2):
        rec = _json(p, n, raw)
        event = rec.get("event")
        if event == "delivery":
            deliveries.append(_delivery(p, n, rec, blobs))
        elif event == "blob":
            blobs.add(p, n, rec)
        elif event == "fault":
            faults[str(rec.get("actor"))].append((str(rec.get("hook")), rec.get("value")))
        else:
            raise ReplayLogError(f"{p}: line {n}: unknown event {event!r}")
    deliveries.sort(key=lambda d: d.seq)
    for a, b in zip(deliveries, deliveries[1:]):
        if a.seq == b.seq:
            raise ReplayLogError(f"{p}: line {b.line}: sequence number {b.seq} appears twice (line {a.line})")
    return ParsedLog(header, config, deliveries, dict(faults))


def _json(p: Path, n: int, raw: bytes) -> dict[str, Any]:
    try:
        rec = loads_line(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ReplayLogError(f"{p}: line {n}: not a JSON object ({err})") from None
    if not isinstance(rec, dict):
        raise ReplayLogError(f"{p}: line {n}: not a JSON object")
    return rec


class Blobs(Mapping[int, bytes]):
    """The `blob` lines of a log read so far, by number. It counts the lookups the codec makes,
    so that a body that referred to a blob is known (and re-encoded whole for comparisons)."""

    def __init__(self) -> None:
        self._data: dict[int, bytes] = {}
        self.lookups = 0

    def add(self, p: Path, n: int, rec: dict[str, Any]) -> None:
        """Hold the blob of log line `n`, `rec`."""
        try:
            number, data = rec["blob"], unbase64(rec["data"])
        except KeyError as err:
            raise ReplayLogError(f"{p}: line {n}: blob without field {err}") from None
        except (binascii.Error, ValueError, TypeError) as err:
            raise ReplayLogError(f"{p}: line {n}: corrupt blob: {err}") from None
        if not isinstance(number, int) or number in self._data:
            raise ReplayLogError(f"{p}: line {n}: blob number {number!r} is not a new integer")
        self._data[number] = data

    def __getitem__(self, number: int) -> bytes:
        self.lookups += 1
        return self._data[number]

    def __iter__(self) -> Iterator[int]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def _delivery(p: Path, n: int, rec: dict[str, Any], blobs: Blobs) -> Delivery:
    try:
        before = blobs.lookups
        body = unbase64(rec["body"])
        message = decode(body, blobs)
        if blobs.lookups != before:
            body = encode(message)
        reply = answer = None
        if rec.get("reply"):
            before = blobs.lookups
            reply = unbase64(rec["reply"])
            answer = decode(reply, blobs)
            if blobs.lookups != before:
                reply = encode(answer)
        return Delivery(int(rec["seq"]), float(rec["t"]), _actor(rec["receiver"]), _actor(rec["sender"]),
                        message, bool(rec["ask"]), reply, rec.get("error"), n, body, answer)
    except KeyError as err:
        raise ReplayLogError(f"{p}: line {n}: delivery without field {err}") from None
    except (CodecError, binascii.Error, ValueError, TypeError) as err:
        raise ReplayLogError(f"{p}: line {n}: corrupt delivery: {err}") from None


_ACTORS = {a.value: a for a in ActorName}


def _actor(name: Any) -> ActorName:
    try:
        return _ACTORS[name]
    except (KeyError, TypeError):
        raise ValueError(f"{name!r} is not an actor name") from None


# -- replaying -----------------------------------------------------------------------------------


class _Sends:
    """What the replayed actors sent: per (sender, receiver), in order, each message with the
    `seq` of the delivery being handled when it was sent (`cause`; replay is sequential)."""

    def __init__(self) -> None:
        self.by_pair: dict[tuple[ActorName, ActorName], list[tuple[int, Message]]] = {}
        self.cause = 0


class _Capture:
    """Stands in for a receiver's ref: a replayed actor's tells to it are recorded in `_Sends`
    (or dropped, with none)."""

    __slots__ = ("_out", "_sends")

    def __init__(self, sends: _Sends | None, sender: ActorName, receiver: ActorName) -> None:
        self._sends = sends
        self._out = None if sends is None else sends.by_pair.setdefault((sender, receiver), [])

    def tell(self, mail: Mail) -> None:
        if self._out is not None:
            self._out.append((self._sends.cause, mail.message))  # type: ignore[union-attr]

    def is_alive(self) -> bool:
        return True


class _ReplayFaults(NoFaults):
    """Gives each actor the fault decisions the log recorded for it, in order."""

    def __init__(self, faults: dict[str, list[tuple[str, Any]]]) -> None:
        self._left = {actor: deque(items) for actor, items in faults.items()}

    def _next(self, actor: str, hook: str) -> Any:
        q = self._left.get(actor)
        if not q:
            return None
        logged_hook, value = q.popleft()
        if logged_hook != hook:
            raise ReplayLogError(f"the {actor} actor asked the fault plan {hook}, the log has {logged_hook}")
        return value

    def transfer_fault(self, stream: ActorName, op_ids: tuple[int, ...]) -> str | None:
        return self._next(stream.value, "transfer_fault")  # type: ignore[no-any-return]

    def host_exhausted(self, tokens: int) -> bool:
        return bool(self._next(ActorName.HOST.value, "host_exhausted"))

    def storage_fault(self, op_id: int, call: str) -> str | None:
        return self._next(ActorName.PREFETCH.value, "storage_fault")  # type: ignore[no-any-return]

    def storage_delay(self, op_id: int) -> float:
        return float(self._next(ActorName.PREFETCH.value, "storage_delay") or 0.0)


def _build_actors(log: ParsedLog, sends: _Sends | None, clock: _LoggedClock) -> dict[ActorName, HiActor]:
    """Fresh, unstarted actors of the logged system, their sends recorded in `sends` (None:
    dropped), their time read from `clock`."""
    cfg = log.config
    stood_in = set(log.header.get("stand_ins", []))
    faults = _ReplayFaults(log.faults)
    specs, _, _ = actor_specs(cfg, LayerDoneRing(cfg.load_ring_size, cfg.layers), storage=False)
    out: dict[ActorName, HiActor] = {}
    for cls, kwargs in specs:
        name = cls.name
        if name.value in stood_in:
            continue
        services = Services(clock=clock, ids=IdSource(), seed=int(log.header.get("seed", 0)), faults=faults,
                            failures=Failures(), observe=lambda r, m: None, new_layer_ring=LayerDoneRing,
                            call_later=lambda delay, receiver, ref, mail: ref.tell(mail))
        directory = Directory()
        for other in ActorName:
            directory.register(other, _Capture(sends, name, other))  # type: ignore[arg-type]
        out[name] = cls(**kwargs, services=services, directory=directory)
    return out


class _LoggedClock:
    """The time of the delivery being replayed (set before each one)."""

    t = 0.0

    def now_s(self) -> float:
        return self.t


def replay_log(
    log: ParsedLog,
    *,
    until: int | None = None,
    only: ActorName | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    sends, clock = _Sends(), _LoggedClock()
    actors = _build_actors(log, sends, clock)
    if only is not None:
        actors = {only: actors[only]} if only in actors else {}
    deliveries = log.deliveries if until is None else log.deliveries[: bisect_right(log.deliveries, until, key=_seq)]
    logged: dict[tuple[ActorName, ActorName], list[Delivery]] = defaultdict(list)
    first: Divergence | None = None
    count = 0
    receiver_of = actors.get
    for d in deliveries:
        logged[(d.sender, d.receiver)].append(d)
        actor = receiver_of(d.receiver)
        if actor is None:
            continue
        count += 1
        sends.cause, clock.t = d.seq, d.t
        problem = _deliver(actor, d)
        if problem is not None and first is None:
            first = problem
        if progress is not None and count % 1000 == 0:
            progress(count)
    for (sender, receiver), emitted in sends.by_pair.items():
        if sender not in actors:
            continue
        expected = logged.get((sender, receiver), [])
        for i, (cause, msg) in enumerate(emitted):
            want = expected[i] if i < len(expected) else None
            if want is None:
                if until is None:
                    div = Divergence(cause, sender.value, f"(no more deliveries from {sender.value} to {receiver.value})",
                                     f"delivery {cause} made {sender.value} send {msg!r}")
                    first = _earlier(first, div)
                break
            if not _same(msg, want.message, want.body):
                div = Divergence(want.seq, sender.value, f"{want.message!r}",
                                 f"{msg!r} (sent while handling delivery {cause})")
                first = _earlier(first, div)
                break
        else:
            if until is None and len(expected) > len(emitted):
                missing = expected[len(emitted)]
                div = Divergence(missing.seq, sender.value, f"{missing.message!r}",
                                 f"(the replayed {sender.value} never sent it)")
                first = _earlier(first, div)
    gap = _first_gap(log.deliveries, until)
    if gap is not None and (gap <= first.seq if first is not None else only is None):
        # A delivery is missing from the log: that, not its consequence, is the divergence (with
        # one actor replayed, only when that actor diverges after it: the rest were not checked).
        first = Divergence(gap, first.actor if first else "log",
                           f"(delivery {gap} is missing from the log)",
                           first.actual if first else "(no actor diverged because of it)")
    if first is not None:
        first.context = [_describe(d) for d in log.deliveries if first.seq - 5 <= d.seq < first.seq]
    return ReplayResult(count, first, {n.value: a for n, a in actors.items()})


def _deliver(actor: HiActor, d: Delivery) -> Divergence | None:
    try:
        reply = actor.on_receive(Mail(d.sender, d.message, ask=d.ask))
    except Exception as err:  # noqa: BLE001 - a handler error is compared with the logged one
        got = f"{type(err).__name__}: {err}"
        if d.error != got:
            return Divergence(d.seq, actor.name.value, d.error or "no error", got)
        return None
    if d.error is not None:
        return Divergence(d.seq, actor.name.value, d.error, "no error")
    if d.ask:
        want = d.answer if d.answer is not None or not d.reply else decode(d.reply)
        if (reply is None) != (want is None) or (reply is not None and not _same(reply, want, d.reply)):
            return Divergence(d.seq, actor.name.value, f"reply {want!r}", f"reply {reply!r}")
    return None


def _same(got: Message, want: Message, want_bytes: bytes | None) -> bool:
    """`got` matches the logged `want`: equal, or (failing that) the same msgpack bytes."""
    return got == want or encode(got) == (want_bytes or encode(want))


def _seq(d: Delivery) -> int:
    return d.seq


def _first_gap(ds: list[Delivery], until: int | None) -> int | None:
    """The first sequence number missing between 1 and the last logged one."""
    expect = 1
    for d in ds:
        if until is not None and d.seq > until:
            break
        if d.seq != expect:
            return expect
        expect += 1
    return None


def _earlier(a: Divergence | None, b: Divergence) -> Divergence:
    return b if a is None or b.seq < a.seq else a


def _describe(d: Delivery) -> str:
    return f"#{d.seq} {d.sender.value} -> {d.receiver.value}: {d.message!r}"[:300]
