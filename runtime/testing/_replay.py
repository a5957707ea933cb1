"""Replay a delivery log: rebuild the actors, feed each its logged inbox, find the first divergence.

Each actor is deterministic given the order of its inbox (it takes ids, time and
faults from its services, and the faults it saw are in the log). So replay needs
no threads and no scheduler: for every actor it builds a fresh instance from the
logged `Config`, hands it the mail logged for it, one delivery after another in
`seq` order, with the fault decisions its run took for that delivery, and
records what it sends.

A message an actor sends is delivered after the delivery during which it was
sent began (sequence numbers are taken when handling starts). So by the time
replay reaches a logged delivery from a replayed actor, the replayed actor has
sent it: it must be the oldest message that actor has sent to that receiver and
the log has not delivered yet. Replay checks each logged delivery from a
replayed actor so, as it comes, and each ask's reply and each handler's error;
the first one that fails is the divergence. A message the replayed actor sent
and the log never delivers is checked at the end of a closed log, against the
mail the log records as in flight when its run stopped (`in_flight` lines): each
such send must be one of them (for its sender and receiver), and each of them
must have been sent; anything else is a divergence.

The log is read as a stream (`LogReader`), so memory does not grow with its
length; `read_log` holds a whole log for repeated replays. A replayed message
matches a logged one when it equals it (messages are frozen dataclasses: the
same type and equal fields, `Indices` by their bytes) or, failing that, when it
encodes to the same bytes (a NaN field is not equal to itself); only a message
that fails both is a divergence.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.actors._actor import Directory, HiActor, Mail
from hicache.actors._layers import LayerDoneRing
from hicache.actors._services import Failures, IdSource, NoFaults, Services
from hicache.messages import ActorName, CodecError, Message, decode, encode

from .._log import error_text
from .._log_reader import Delivery, InFlight, LogReader, ParsedLog, ReplayLogError, RunHeader
from .._system import actor_specs


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
    last_seq: int = 0
    """The last delivery replay reached (handed to its actor or checked as a send)."""
    stopped: str | None = None
    """Why replay stopped before the run's last delivery, on one line: the log has no end line
    (its run crashed), or a delivery its run could not encode. None when it replayed the whole
    log (or up to `until`)."""


# -- the rebuilt actors ------------------------------------------------------------------------


class _Sends:
    """What the replayed actors sent and the log has not delivered yet: per (sender, receiver),
    in order, each message with the `seq` of the delivery being handled when it was sent
    (`cause`) and the deliveries just before that one (`before`, for a report)."""

    def __init__(self) -> None:
        self.by_pair: dict[tuple[ActorName, ActorName], deque[tuple[int, Message, tuple[Delivery, ...]]]] = {}
        self.cause = 0
        self.before: deque[Delivery] = deque(maxlen=5)
        self.recording = True
        """False once a divergence is found: later sends are dropped (memory stays bounded)."""
        self.context: tuple[Delivery, ...] | None = None
        """`before` as it is while the delivery `cause` is handled (taken at its first send)."""


class _Capture:
    """Stands in for a receiver's ref: a replayed actor's tells to it are recorded in `_Sends`
    (or dropped, with none)."""

    __slots__ = ("_out", "_sends")

    def __init__(self, sends: _Sends | None, sender: ActorName, receiver: ActorName) -> None:
        self._sends = sends
        self._out = None if sends is None else sends.by_pair.setdefault((sender, receiver), deque())

    def tell(self, mail: Mail) -> None:
        sends = self._sends
        if sends is not None and sends.recording:
            if sends.context is None:
                sends.context = tuple(sends.before)
            self._out.append((sends.cause, mail.message, sends.context))  # type: ignore[union-attr]

    def is_alive(self) -> bool:
        return True


class _ReplayFaults(NoFaults):
    """Answers the actor being handed a delivery with the decisions its run took for that
    delivery, in order, and notes where the replayed actor asks otherwise."""

    def __init__(self) -> None:
        self._logged: tuple[tuple[str, Any], ...] = ()
        self._asked: list[str] | None = None
        self._lined_up = True
        """Every hook asked so far was the one the run asked at that point."""

    def start(self, decisions: tuple[tuple[str, Any], ...]) -> None:
        self._logged = decisions
        self._asked = None
        self._lined_up = True

    def problem(self) -> tuple[str, str] | None:
        """(what the run asked, what the replayed actor asked) during this delivery, if they differ."""
        if self._asked is None and not self._logged:  # most deliveries
            return None
        asked = self._asked or []
        run = [hook for hook, _ in self._logged]
        if run == asked:
            return None
        return (f"fault plan asked: {', '.join(run) or 'nothing'}",
                f"fault plan asked: {', '.join(asked) or 'nothing'}")

    def _next(self, hook: str) -> Any:
        if self._asked is None:
            self._asked = []
        at = len(self._asked)
        self._asked.append(hook)
        if self._lined_up and at < len(self._logged) and self._logged[at][0] == hook:
            return self._logged[at][1]
        self._lined_up = False  # the rest no longer lines up: `problem` reports the difference
        return None

    def transfer_fault(self, stream: ActorName, op_ids: tuple[int, ...]) -> str | None:
        value = self._next("transfer_fault")
        return value if isinstance(value, str) else None

    def host_exhausted(self, tokens: int) -> bool:
        return bool(self._next("host_exhausted"))

    def storage_fault(self, op_id: int, call: str) -> str | None:
        value = self._next("storage_fault")
        return value if isinstance(value, str) else None

    def storage_delay(self, op_id: int) -> float:
        value = self._next("storage_delay")
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


class _LoggedClock:
    """The time of the delivery being replayed (set before each one)."""

    t = 0.0

    def now_s(self) -> float:
        return self.t


class Rebuilt:
    """Fresh, unstarted actors of a logged run, their sends recorded in `sends` (None: dropped),
    with one clock and one fault plan that `hand` sets for each delivery."""

    def __init__(self, run: RunHeader, sends: _Sends | None) -> None:
        cfg = run.config
        self.clock = _LoggedClock()
        self.faults = _ReplayFaults()
        try:
            specs, _, _ = actor_specs(cfg, LayerDoneRing(cfg.load_ring_size, cfg.layers), storage=False)
        except (MemoryError, RuntimeError, TypeError, ValueError, OverflowError) as err:  # torch's, for the buffers
            first = str(err).splitlines()[0] if str(err) else ""
            raise ReplayLogError(f"{run.where}: the logged config cannot be rebuilt here: {type(err).__name__}: "
                                 f"{first}") from None
        self.actors: dict[ActorName, HiActor] = {}
        for cls, kwargs in specs:
            name = cls.name
            if name not in run.replayed:
                continue
            services = Services(clock=self.clock, ids=IdSource(), seed=run.seed, faults=self.faults,
                                failures=Failures(), observe=None, new_layer_ring=LayerDoneRing,
                                call_later=lambda delay, receiver, ref, mail: ref.tell(mail))
            directory = Directory()
            for other in ActorName:
                directory.register(other, _Capture(sends, name, other))  # type: ignore[arg-type]
            self.actors[name] = cls(**kwargs, services=services, directory=directory)

    def hand(self, actor: HiActor, d: Delivery) -> Message | None:
        """Hand `actor` the logged delivery `d` at its logged time, with its logged faults."""
        self.clock.t = d.t
        self.faults.start(d.faults)
        return actor.on_receive(Mail(d.sender, d.message, ask=d.ask))  # type: ignore[no-any-return]


# -- replaying -----------------------------------------------------------------------------------


def replay_log(
    log: ParsedLog | LogReader | str | Path,
    *,
    until: int | None = None,
    only: ActorName | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay `log` (a path or a `LogReader`: streamed; a `ParsedLog`: from memory) up to
    delivery `until` (all: None), rebuilding every actor the run had or `only` that one;
    `progress(n)` every 1000 deliveries replayed. `ReplayLogError` if the log is damaged."""
    if isinstance(log, str | Path):
        with LogReader(log) as reader:
            return replay_log(reader, until=until, only=only, progress=progress)
    return _Replay(log.run, only).run(log, until, progress)


class _Replay:
    def __init__(self, run: RunHeader, only: ActorName | None) -> None:
        self.sends = _Sends()
        rebuilt = Rebuilt(run, self.sends)
        self.rebuilt = rebuilt
        self.actors = rebuilt.actors if only is None else {n: a for n, a in rebuilt.actors.items() if n is only}
        self.first: Divergence | None = None
        self.count = 0
        self.last_seq = 0

    def run(self, log: ParsedLog | LogReader, until: int | None,
            progress: Callable[[int], None] | None) -> ReplayResult:
        stopped: str | None = None
        for d in log.deliveries if isinstance(log, ParsedLog) else log:
            if until is not None and d.seq > until:  # `until` < 1
                break
            if d.message is None:  # its run could not encode it: nothing to hand on
                stopped = (f"delivery {d.seq} ({d.sender.value} -> {d.receiver.value}, {d.type_name}) could not be "
                           f"logged ({d.unencodable}): replay stops before it")
                break
            self._step(d)
            if progress is not None and self.count % 1000 == 0 and self.count:
                progress(self.count)
            if until is not None and d.seq >= until:  # read no further: the log past it is not checked
                break
        else:
            assert log.end is not None
            if not log.end.complete:
                stopped = log.end.note
            elif until is None:
                self._unmatched(log.in_flight)
        return ReplayResult(self.count, self.first, {n.value: a for n, a in self.actors.items()}, self.last_seq,
                            stopped)

    def _step(self, d: Delivery) -> None:
        """Check logged delivery `d` as a send of its sender (if replayed), hand it to its receiver
        (if replayed). After the first divergence, deliveries are still handed on (a dump shows
        the run's inputs applied to this code) and only pair up with earlier sends."""
        self.last_seq = d.seq
        sends = self.sends
        if d.sender in self.actors:
            sent = sends.by_pair[(d.sender, d.receiver)]
            if self.first is not None:
                if sent:
                    sent.popleft()
            elif not sent:
                self._diverged(Divergence(d.seq, d.sender.value, f"{d.message!r}",
                                          f"(the replayed {d.sender.value} never sent it)"))
            else:
                cause, msg, _ = sent.popleft()
                if not _same(msg, d.message, d.body):
                    self._diverged(Divergence(d.seq, d.sender.value, f"{d.message!r}",
                                              f"{msg!r} (sent while handling delivery {cause})"))
        actor = self.actors.get(d.receiver)
        if actor is not None:
            self.count += 1
            sends.cause, sends.context = d.seq, None
            problem = _deliver(self.rebuilt, actor, d)
            if problem is not None and self.first is None:
                self._diverged(problem)
        sends.before.append(d)

    def _diverged(self, div: Divergence) -> None:
        div.context = [_describe(x) for x in self.sends.before if x.seq < div.seq]
        self.first = div
        self.sends.recording = False  # what is sent from now on cannot make an earlier divergence

    def _unmatched(self, in_flight: list[InFlight]) -> None:
        """At the end of a closed log: each message a replayed actor sent that the log never
        delivered must be one the log records as in flight when its run stopped (of the same
        sender and receiver, in any order: the runtimes drop undelivered mail in several
        places), and each in-flight message of a replayed sender must have been sent. The
        first send that is not (sent before the first divergence found, it is an earlier one),
        else the first in-flight message left over, is a divergence."""
        left: dict[tuple[ActorName, ActorName], dict[bytes, list[InFlight]]] = {}
        for m in in_flight:
            if m.sender in self.actors:
                left.setdefault((m.sender, m.receiver), {}).setdefault(m.body, []).append(m)
        extra: list[tuple[int, ActorName, ActorName, Message, tuple[Delivery, ...]]] = []
        for (sender, receiver), sent in self.sends.by_pair.items():
            if sender in self.actors:
                recorded = left.get((sender, receiver), {})
                extra.extend((cause, sender, receiver, msg, before) for cause, msg, before in sent
                             if _take(recorded, msg) is None)
        if extra:
            cause, sender, receiver, msg, before = min(extra, key=lambda e: e[0])
            if self.first is None or cause < self.first.seq:
                other = sorted((m for ms in left.get((sender, receiver), {}).values() for m in ms),
                               key=lambda m: m.line)
                if other:  # the log has another message in flight from it to that receiver
                    expected, actual = _in_flight_shown(other[0]), f"{msg!r} (sent while handling delivery {cause})"
                else:
                    expected = (f"(no more deliveries from {sender.value} to {receiver.value}, and no such message "
                                "in flight when the run stopped)")
                    actual = f"delivery {cause} made {sender.value} send {msg!r}"
                self.first = Divergence(cause, sender.value, expected, actual,
                                        [_describe(x) for x in before if x.seq < cause])
        if self.first is not None:
            return
        never = [m for recorded in left.values() for ms in recorded.values() for m in ms]
        if never:
            m = min(never, key=lambda m: m.line)
            self.first = Divergence(self.last_seq, m.sender.value, _in_flight_shown(m),
                                    f"(the replayed {m.sender.value} never sent it)",
                                    [_describe(x) for x in self.sends.before])


def _deliver(rebuilt: Rebuilt, actor: HiActor, d: Delivery) -> Divergence | None:
    try:
        reply = rebuilt.hand(actor, d)
    except Exception as err:  # noqa: BLE001 - a handler error is compared with the logged one
        faults = rebuilt.faults.problem()
        if faults is not None:
            return Divergence(d.seq, actor.name.value, *faults)
        got = error_text(err)
        if d.error != got:
            return Divergence(d.seq, actor.name.value, d.error or "no error", got)
        return None
    faults = rebuilt.faults.problem()
    if faults is not None:
        return Divergence(d.seq, actor.name.value, *faults)
    if d.error is not None:
        return Divergence(d.seq, actor.name.value, d.error, "no error")
    if d.ask:
        return _check_reply(actor, d, reply)
    return None


def _check_reply(actor: HiActor, d: Delivery, reply: Message | None) -> Divergence | None:
    if d.unencodable is not None:  # the run's reply could not be encoded: the replayed one must fail alike
        try:
            got = f"reply {encode(reply)!r}" if reply is not None else "reply None"  # type: ignore[arg-type]
        except CodecError as err:
            got = f"reply: {error_text(err)}"
        if got != d.unencodable:
            return Divergence(d.seq, actor.name.value, f"{d.unencodable} (the run's reply)", got)
        return None
    want = d.answer if d.answer is not None or not d.reply else decode(d.reply)
    if (reply is None) != (want is None) or (reply is not None and not _same(reply, want, d.reply)):
        return Divergence(d.seq, actor.name.value, f"reply {want!r}", f"reply {reply!r}")
    return None


def _same(got: Message, want: Message | None, want_bytes: bytes | None) -> bool:
    """`got` matches the logged `want`: equal, or (failing that) the same msgpack bytes."""
    if got == want:
        return True
    try:
        return encode(got) == (want_bytes or encode(want))  # type: ignore[arg-type]
    except CodecError:  # a replayed message the codec refuses matches no logged one
        return False


def _take(recorded: dict[bytes, list[InFlight]], got: Message) -> InFlight | None:
    """Remove from `recorded` (in-flight messages by their msgpack bytes) and return the first
    one the replayed send `got` is (`_same_in_flight`); None if none is. A send is looked up by
    its bytes, and compared with every one only when that finds none."""
    try:
        same = recorded.get(encode(got))
    except CodecError:
        same = None
    if same:
        return same.pop(0)
    for ms in recorded.values():
        for i, m in enumerate(ms):
            if _same_in_flight(got, m):
                return ms.pop(i)
    return None


def _same_in_flight(got: Message, want: InFlight) -> bool:
    """A replayed send `got` is the in-flight message `want`: as `_same`, or, where its run could
    not encode it, a message of its type that fails to encode with the same error."""
    if want.message is not None:
        return _same(got, want.message, want.body)
    if type(got).__name__ != want.type_name:
        return False
    try:
        encode(got)
    except CodecError as err:
        return f"body: {error_text(err)}" == want.unencodable
    return False


def _in_flight_shown(m: InFlight) -> str:
    shown = repr(m.message) if m.message is not None else f"{m.type_name} (not logged: {m.unencodable})"
    return f"{shown} (in flight from {m.sender.value} to {m.receiver.value} when the run stopped: line {m.line})"


def _describe(d: Delivery) -> str:
    shown = repr(d.message) if d.message is not None else f"(not logged: {d.unencodable})"
    return f"#{d.seq} {d.sender.value} -> {d.receiver.value}: {shown}"[:300]
