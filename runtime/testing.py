"""Public testing helpers: a probe that stands in for an actor and records its mail.

Until an actor exists (or to watch what reaches one), start a `Probe` under its
name: `System(config, stand_ins=(ActorName.TREE,))`. Tests then wait for mail
with `system.probes[ActorName.TREE].expect(WriteDone)`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any, TypeVar

from hicache.messages import ActorName, Message

from hicache.actors._actor import HiActor

M = TypeVar("M", bound=Message)

DEFAULT_EXPECT_TIMEOUT_S = 30.0


class Probe:
    """Records every message delivered to the actor name it stands in for."""

    def __init__(self, name: ActorName, mailbox: Any) -> None:
        self.name = name
        self._inbox = mailbox  # from the runtime: a queue, or a deque that drives the scheduler

    def actor_class(self) -> type[HiActor]:
        name = self.name

        class ProbeActor(HiActor):
            def __init__(self, *, probe: Probe, **kwargs: Any) -> None:
                self.name = name  # type: ignore[misc]
                super().__init__(**kwargs)
                self._probe = probe

            def handle(self, sender: ActorName, message: Message) -> None:
                self._probe._inbox.put((sender, message))

            def check_invariants(self) -> None:
                return None

            def statistics(self) -> Message:
                raise TypeError(f"probe {name.value} stands in for an actor and keeps no statistics")

        ProbeActor.name = name
        ProbeActor.__name__ = f"Probe[{name.value}]"
        return ProbeActor

    def receive(self, timeout_s: float = DEFAULT_EXPECT_TIMEOUT_S) -> tuple[ActorName, Message]:
        """The next (sender, message) delivered, waiting up to `timeout_s`."""
        return self._inbox.get(timeout_s)  # type: ignore[no-any-return]

    def expect(self, *types: type[M], timeout_s: float = DEFAULT_EXPECT_TIMEOUT_S) -> M:
        """The next message, which must be one of `types`."""
        _, message = self.receive(timeout_s)
        if not isinstance(message, types):
            wanted = " or ".join(t.__name__ for t in types)
            raise AssertionError(f"probe {self.name.value}: expected {wanted}, got {message!r}")
        return message  # type: ignore[return-value]

    def collect(self, count: int, timeout_s: float = DEFAULT_EXPECT_TIMEOUT_S) -> list[Message]:
        """The next `count` messages, in arrival order."""
        return [self.receive(timeout_s)[1] for _ in range(count)]

    def pending(self) -> int:
        return self._inbox.qsize()


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.events: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        event = json.loads(record.getMessage())
        event["log_level"] = event.pop("level", record.levelname.lower())
        self.events.append(event)


@contextlib.contextmanager
def capture_logs() -> Iterator[list[dict[str, Any]]]:
    """The operational log events of hicache (storage faults, ...) emitted inside the block,
    as dicts with `event`, `log_level` and their fields, in order."""
    handler = _Captured()
    root = logging.getLogger("hicache")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler.events
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
