"""What tests and exploration use: a probe that stands in for an actor and records its
mail, captured log events, the deterministic runtime and its strategies, exploration
and its mutants, the reference scheduler with the fingerprint oracle, log replay, and a
local Mooncake master.

Until an actor exists (or to watch what reaches one), start a `Probe` under its
name: `System(config, stand_ins=(ActorName.TREE,), stand_in=Probe)`. Tests then wait
for mail with `system.probes[ActorName.TREE].expect(WriteDone)`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any, TypeVar

from hicache.messages import Message

from .._inbox import DEFAULT_RECEIVE_TIMEOUT_S, Inbox
from ._deterministic import (
    BlockingGetError,
    DeadlockError,
    DeterministicFuture,
    DeterministicRuntime,
    LivelockError,
    Step,
    VirtualClock,
    replay_choices,
)
from ._mooncake_master import MasterStartError, MooncakeMaster
from ._mutants import MUTANTS, Mutant, mutant
from ._replay import Divergence, ReplayResult, replay_log
from ._scheduler import (
    FakeModel,
    ForwardStep,
    Outcome,
    ReferenceScheduler,
    SchedulerConfig,
    ServeRequest,
    ServedTotals,
    StepModel,
)
from ._strategies import PCTStrategy, RandomStrategy, ReplayStrategy, ScheduleDivergedError, Strategy
from .oracle import FingerprintMismatchError, FingerprintOracle

__all__ = [
    "MUTANTS",
    "BlockingGetError",
    "DeadlockError",
    "DeterministicFuture",
    "DeterministicRuntime",
    "Divergence",
    "FakeModel",
    "FingerprintMismatchError",
    "FingerprintOracle",
    "ForwardStep",
    "LivelockError",
    "MasterStartError",
    "MooncakeMaster",
    "Mutant",
    "Outcome",
    "PCTStrategy",
    "Probe",
    "RandomStrategy",
    "ReferenceScheduler",
    "ReplayResult",
    "ReplayStrategy",
    "ScheduleDivergedError",
    "SchedulerConfig",
    "ServeRequest",
    "ServedTotals",
    "Step",
    "StepModel",
    "Strategy",
    "VirtualClock",
    "capture_logs",
    "mutant",
    "replay_choices",
    "replay_log",
]

M = TypeVar("M", bound=Message)


class Probe(Inbox):
    """An inbox a test reads: waits for mail of given types, or for a count of messages."""

    def expect(self, *types: type[M], timeout_s: float = DEFAULT_RECEIVE_TIMEOUT_S) -> M:
        """The next message, which must be one of `types`."""
        _, message = self.receive(timeout_s)
        if not isinstance(message, types):
            wanted = " or ".join(t.__name__ for t in types)
            raise AssertionError(f"probe {self.name.value}: expected {wanted}, got {message!r}")
        return message  # type: ignore[return-value]

    def collect(self, count: int, timeout_s: float = DEFAULT_RECEIVE_TIMEOUT_S) -> list[Message]:
        """The next `count` messages, in arrival order."""
        return [self.receive(timeout_s)[1] for _ in range(count)]


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
