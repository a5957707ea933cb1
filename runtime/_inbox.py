"""`Inbox`: mail for a name that no real actor serves, read by the caller.

The facade's replies arrive in one (`System.next_reply`). A stand-in (`System(stand_ins=...)`)
is an inbox too: an actor registered under the name that only puts its mail there.
"""

from __future__ import annotations

from typing import Any

from hicache.actors import HiActor
from hicache.messages import ActorName, Message

DEFAULT_RECEIVE_TIMEOUT_S = 30.0


class Inbox:
    """The (sender, message) pairs delivered to one actor name, in arrival order."""

    def __init__(self, name: ActorName, mailbox: Any) -> None:
        self.name = name
        self._inbox = mailbox  # from the runtime: a queue, or a deque that drives the scheduler

    def actor_class(self) -> type[HiActor]:
        """An actor class that stands in for `name`: it only puts its mail into this inbox."""
        name = self.name

        class StandIn(HiActor):
            def __init__(self, *, inbox: Inbox, **kwargs: Any) -> None:
                self.name = name  # type: ignore[misc]
                super().__init__(**kwargs)
                self._inbox = inbox

            def handle(self, sender: ActorName, message: Message) -> None:
                self._inbox._inbox.put((sender, message))

            def check_invariants(self) -> None:
                return None

            def statistics(self) -> Message:
                raise TypeError(f"stand-in {name.value} stands in for an actor and keeps no statistics")

        StandIn.name = name
        StandIn.__name__ = f"{type(self).__name__}[{name.value}]"
        return StandIn

    def receive(self, timeout_s: float = DEFAULT_RECEIVE_TIMEOUT_S) -> tuple[ActorName, Message]:
        """The next (sender, message) delivered, waiting up to `timeout_s`."""
        return self._inbox.get(timeout_s)  # type: ignore[no-any-return]

    def pending(self) -> int:
        return self._inbox.qsize()
