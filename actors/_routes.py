"""`Routes`: an actor's route table, message type -> allowed senders -> handler.

Each actor declares its table once, beside its shell. The shell delivers every
message through it, and so does every driver that runs the cores without actors
(the test players, the overhead benchmark's direct cores, the simulator), so a
message is handled the same way wherever it goes.

The table is the one place a sender is checked: a message from an actor its route
does not name is a programmer error and raises `WrongSenderError` before the
handler runs, so no second party ever decides for the owner of a state. A message
type with no route raises TypeError. `CheckInvariants` and `GetStatistics` are in
no table: every actor answers them, from anyone (`HiActor`).

Delivery is one dict lookup by `type(message)` and a membership test in a tuple of
senders; nothing is allocated per message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from hicache.messages import ActorName, Message
from ._actor import WrongSenderError

T = TypeVar("T")

Handler = Callable[[T, Any], "Message | None"]
"""`(target, message) -> reply or None`: the target is what the actor's table acts on
(its core, or the shell itself when the handler needs the shell's queues and mail)."""


@dataclass(frozen=True, slots=True)
class Route(Generic[T]):
    """How one actor handles one message type."""

    senders: tuple[ActorName, ...]
    """The actors allowed to send it; from any other it is refused."""
    call: Handler[T]
    what: str
    """What the message does, in the words a refusal uses."""


class Routes(Mapping[type[Message], Route[T]]):
    """The route table of `actor`: a read-only mapping from message type to `Route`.

    `table` maps each message type to `(senders, handler)` or `(senders, handler, what)`:
    `senders` one `ActorName` or a tuple of them; `what` defaults to the type's name."""

    __slots__ = ("actor", "_table")

    def __init__(self, actor: ActorName, table: Mapping[type[Message], tuple[Any, ...]]) -> None:
        self.actor = actor
        routes = {cls: _route(actor, cls, entry) for cls, entry in table.items()}
        # Unpacked beside each route: a delivery reads a tuple, not two attributes.
        self._table: dict[type[Message], tuple[tuple[ActorName, ...], Handler[T], Route[T]]] = {
            cls: (r.senders, r.call, r) for cls, r in routes.items()
        }

    def deliver(self, target: T, sender: ActorName, message: Message) -> Message | None:
        """Check the sender of `message` and hand it to its handler on `target`; the reply.
        Raises as `check` does (written out here: this is every delivery's path)."""
        entry = self._table.get(type(message))
        if entry is None:
            raise self._unknown(message)
        senders, call, route = entry
        if sender not in senders:
            raise self._refused(route, sender)
        return call(target, message)

    def check(self, sender: ActorName, message: Message) -> Route[T]:
        """The route of `message` from `sender`, without handling it (for a driver that plays
        the actor itself): TypeError when the actor does not handle it, `WrongSenderError`
        when `sender` may not send it."""
        entry = self._table.get(type(message))
        if entry is None:
            raise self._unknown(message)
        route = entry[2]
        if sender not in route.senders:
            raise self._refused(route, sender)
        return route

    def __getitem__(self, cls: type[Message]) -> Route[T]:
        return self._table[cls][2]

    def __iter__(self) -> Iterator[type[Message]]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return f"Routes({self.actor.value}: {', '.join(cls.__name__ for cls in self._table)})"

    def _unknown(self, message: Message) -> TypeError:
        return TypeError(
            f"the {self.actor.value} actor does not handle {type(message).__name__}; "
            "check docs/messages.md for its receiver"
        )

    def _refused(self, route: Route[T], sender: ActorName) -> WrongSenderError:
        allowed = " or ".join(s.value for s in route.senders)
        return WrongSenderError(
            f"{route.what} is accepted only from the {allowed} actor, got it from {sender.value} "
            f"(invariant: only the {allowed} decides this; a second deciding party is how the threaded "
            "original double-freed and leaked)"
        )


def _route(actor: ActorName, cls: Any, entry: Any) -> Route[Any]:
    """One table entry as a `Route`; a malformed entry is a one-line TypeError naming it."""
    where = f"the {actor.value} actor's route for {getattr(cls, '__name__', cls)!r}"
    if not (isinstance(cls, type) and issubclass(cls, Message)):
        raise TypeError(f"{where}: the key must be a message class")
    if not isinstance(entry, tuple) or len(entry) not in (2, 3):
        raise TypeError(f"{where}: give (senders, handler) or (senders, handler, what), got {entry!r}")
    senders = entry[0] if isinstance(entry[0], tuple) else (entry[0],)
    if not senders or not all(isinstance(s, ActorName) for s in senders) or len(set(senders)) != len(senders):
        raise TypeError(f"{where}: senders must be one ActorName or a tuple of distinct ones, got {entry[0]!r}")
    if not callable(entry[1]):
        raise TypeError(f"{where}: the handler must be callable, got {entry[1]!r}")
    what = entry[2] if len(entry) == 3 else cls.__name__
    return Route(senders=senders, call=entry[1], what=what)
