"""The project's actor base on pykka: mail with a sender, one delivery point.

Every message travels in a `Mail` that names its sender, so a receiver can refuse
what it must not accept (a host free that does not come from the tree).
`HiActor.on_receive` is the single place every delivery goes through: it reports
the delivery to the runtime's observer, calls the subclass's `handle(sender,
message)` and, when the system has a delivery log, writes it there with its reply.

A handler returns its reply (or None). If the mail was an ask, pykka hands the
reply to the asker's future; if it was a tell from another actor, the reply is
sent back to the sender as a message of its own. Handlers never block on futures.
"""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Any, ClassVar

import pykka

from hicache.messages import (
    ActorName,
    CheckInvariants,
    GetStatistics,
    InvariantsHeld,
    Message,
)

from ._services import Services


class Mail:
    """A message in transit: who sent it, and whether the sender waits for a reply."""

    __slots__ = ("ask", "message", "sender")

    def __init__(self, sender: ActorName, message: Message, *, ask: bool = False) -> None:
        self.sender = sender
        self.message = message
        self.ask = ask

    def __repr__(self) -> str:
        kind = "ask" if self.ask else "tell"
        return f"Mail({kind} from {self.sender.value}: {self.message!r})"


class Directory:
    """Actor name -> pykka ref, for one system. Filled once at start."""

    def __init__(self) -> None:
        self.refs: dict[ActorName, pykka.ActorRef[Any]] = {}
        """Read-only to all but `register` (a send looks its receiver up here)."""

    def register(self, name: ActorName, ref: pykka.ActorRef[Any]) -> None:
        if name in self.refs:
            raise RuntimeError(f"an actor named {name.value} is already registered")
        self.refs[name] = ref

    def ref(self, name: ActorName) -> pykka.ActorRef[Any]:
        try:
            return self.refs[name]
        except KeyError:
            raise LookupError(
                f"no actor named {name.value!r} in this system; running: "
                f"{', '.join(sorted(n.value for n in self.refs))}"
            ) from None

    def names(self) -> tuple[ActorName, ...]:
        return tuple(self.refs)


class WrongSenderError(RuntimeError):
    """A message came from an actor that must never send it (a programmer error)."""


class HiActor(pykka.ThreadingActor, abc.ABC):
    """Base of the six actors: a thin shell that decodes mail and calls a plain core."""

    name: ClassVar[ActorName]
    use_daemon_thread = True
    """An actor with a thread of its own never keeps the process alive (a cache left unclosed)."""

    def __init__(self, *, services: Services, directory: Directory) -> None:
        super().__init__()
        # Deterministic identity instead of pykka's uuid4 URN (the ref copied it at creation).
        self.actor_urn = self.actor_ref.actor_urn = f"urn:hicache:{self.name.value}"
        self._services = services
        self._directory = directory
        self._delivery_s: float | None = None
        """The logged time of the delivery being handled (None: not logging, or between deliveries)."""

    def now_s(self) -> float:
        """The runtime's time, as a handler reads it: while its delivery is logged, the time the
        log gives it, so that a replay (which sets its clock to that time for the delivery)
        reads the same. A handler's decision that a moment later would go the other way (a
        prefetch's timeout) is then made the same way again."""
        t = self._delivery_s
        return self._services.clock.now_s() if t is None else t

    # -- the single delivery point -------------------------------------------

    def on_receive(self, mail: Any) -> Any:
        if type(mail) is not Mail:
            raise TypeError(
                f"{self.name.value} received {type(mail).__name__}; actors exchange Mail "
                "(send through System.tell/ask or HiActor.send)"
            )
        services = self._services
        if services.observe is not None:
            services.observe(self.name, mail)
        log = services.log
        if log is None:
            message = mail.message
            if type(message) is CheckInvariants or type(message) is GetStatistics:
                reply = self._dispatch(mail)
            else:
                reply = self.handle(mail.sender, message)
        else:
            seq, t = log.next_seq(), services.clock.now_s()
            self._delivery_s = t
            try:
                reply = self._dispatch(mail)
            except Exception as err:
                log.delivery(seq, t, self.name, mail.sender, mail.message, mail.ask, None, err)
                raise
            finally:
                self._delivery_s = None
            log.delivery(seq, t, self.name, mail.sender, mail.message, mail.ask, reply, None)
        if mail.ask:
            return reply
        if reply is not None:
            self.send(mail.sender, reply)
        return None

    def _dispatch(self, mail: Mail) -> Message | None:
        message = mail.message
        if isinstance(message, CheckInvariants):
            self.check_invariants()
            return InvariantsHeld(actor=self.name)
        if isinstance(message, GetStatistics):
            return self.statistics()
        return self.handle(mail.sender, message)

    def on_failure(
        self,
        exception_type: type[BaseException] | None,
        exception_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exception_value is not None:
            self._services.failures.report(self.name, exception_value)

    # -- what subclasses use and implement -----------------------------------

    def send(self, to: ActorName, message: Message) -> None:
        """Tell another actor (or this one) a message; never waits."""
        ref = self._directory.refs.get(to) or self._directory.ref(to)
        mail = Mail(self.name, message)
        try:
            ref.tell(mail)
        except pykka.ActorDeadError:
            if not self._services.stopping:  # at shutdown the receiver may have stopped first
                raise
            self._services.undelivered.append((to, mail))

    def send_outbox(self, core: Any) -> None:
        """Send, in order, what `core` put in its `outbox` (receiver, message) while it handled
        a message, and empty it (the tree's and the device's cores answer third parties so)."""
        out, core.outbox = core.outbox, []
        for to, message in out:
            self.send(to, message)

    def send_later(self, delay_s: float, to: ActorName, message: Message) -> None:
        """Tell `to` a message after `delay_s` seconds of runtime time (virtual when deterministic)."""
        self._services.call_later(delay_s, to, self._directory.ref(to), Mail(self.name, message))

    def awaiting(self) -> tuple[str, ...]:
        """What this actor waits for (replies, acks), for deadlock reports. Override to tell."""
        return ()

    @abc.abstractmethod
    def handle(self, sender: ActorName, message: Message) -> Message | None:
        """Handle one message; return the reply or None."""

    @abc.abstractmethod
    def check_invariants(self) -> None:
        """Raise if an invariant of the core is broken."""

    @abc.abstractmethod
    def statistics(self) -> Message:
        """A frozen statistics record."""

    def unknown(self, message: Message) -> None:
        """For the last `case _` of a handler's match: an unknown message is a bug."""
        raise TypeError(
            f"the {self.name.value} actor does not handle {type(message).__name__}; "
            "check docs/messages.md for its receiver"
        )
