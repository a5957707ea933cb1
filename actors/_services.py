"""What actors take from their runtime: time, ids, timers, faults, observation.

Actor and core code never import `time`, `random`, `uuid` or `threading`; they
ask `Services`. The threaded runtime fills it with real clocks and locks; the
deterministic runtime fills it with virtual time and a seeded scheduler, so the
same actor classes run under both.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hicache.messages import ActorName


class Clock(Protocol):
    def now_s(self) -> float:
        """Seconds since the runtime started (virtual in the deterministic runtime)."""
        ...


class MonotonicClock:
    """Wall-clock seconds since construction."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()

    def now_s(self) -> float:
        return time.monotonic() - self._t0


class IdSource:
    """Sequential ids per kind ("op", "batch", ...): deterministic, never uuid4."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: dict[str, itertools.count[int]] = {}

    def next(self, kind: str) -> int:
        counter = self._next.get(kind)
        if counter is None:
            with self._lock:
                counter = self._next.setdefault(kind, itertools.count(1))
        return next(counter)  # atomic: a count is advanced in C under the interpreter lock

    def restart(self) -> None:
        """Every kind counts from 1 again: a system started again is numbered as a fresh one,
        so that its delivery log replays (replay numbers from 1). Only while nothing of the
        system runs (no id of the last start can still be in a message)."""
        with self._lock:
            self._next.clear()


class FaultPlan(Protocol):
    def transfer_fault(self, stream: ActorName, op_ids: tuple[int, ...]) -> str | None:
        """A reason to fail this copy batch, or None to let it run."""
        ...

    def host_exhausted(self, tokens: int) -> bool:
        """True to answer a host reservation as if the pool were full."""
        ...

    def storage_fault(self, op_id: int, call: str) -> str | None:
        """A reason to fail this storage call (`exists`, `read`, `write`) of an operation, or None."""
        ...

    def storage_delay(self, op_id: int) -> float:
        """Seconds of injected latency before the next read step of a prefetch (0: none)."""
        ...


class NoFaults:
    """Production: nothing is injected. Subclass it for a plan that injects some faults:
    the hooks it does not override inject nothing."""

    def transfer_fault(self, stream: ActorName, op_ids: tuple[int, ...]) -> str | None:
        return None

    def host_exhausted(self, tokens: int) -> bool:
        return False

    def storage_fault(self, op_id: int, call: str) -> str | None:
        return None

    def storage_delay(self, op_id: int) -> float:
        return 0.0


class SeededFaults(NoFaults):
    """Random faults from a seed: failed copy batches and refused host reservations.

    Decisions are drawn in the order the actors ask for them, so under the
    deterministic runtime the same seed and schedule inject the same faults."""

    def __init__(
        self, seed: int, *, transfer_fail_rate: float = 0.05, host_exhausted_rate: float = 0.05,
        storage_fail_rate: float = 0.0, storage_delay_s: float = 0.0,
    ) -> None:
        for name, rate in (("transfer_fail_rate", transfer_fail_rate), ("host_exhausted_rate", host_exhausted_rate),
                           ("storage_fail_rate", storage_fail_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {rate}")
        self._rng = random.Random(f"faults:{seed}")
        self._lock = threading.Lock()
        self.transfer_fail_rate = transfer_fail_rate
        self.host_exhausted_rate = host_exhausted_rate
        self.storage_fail_rate = storage_fail_rate
        self.storage_delay_s = storage_delay_s
        """Each read step waits up to this long (uniformly drawn)."""
        self.injected = 0

    def transfer_fault(self, stream: ActorName, op_ids: tuple[int, ...]) -> str | None:
        with self._lock:
            if self._rng.random() < self.transfer_fail_rate:
                self.injected += 1
                return f"injected {stream.value} failure (seeded)"
        return None

    def host_exhausted(self, tokens: int) -> bool:
        with self._lock:
            hit = self._rng.random() < self.host_exhausted_rate
            self.injected += hit
            return hit

    def storage_fault(self, op_id: int, call: str) -> str | None:
        if not self.storage_fail_rate:
            return None
        with self._lock:
            if self._rng.random() < self.storage_fail_rate:
                self.injected += 1
                return f"injected storage {call} failure (seeded)"
        return None

    def storage_delay(self, op_id: int) -> float:
        if not self.storage_delay_s:
            return 0.0
        with self._lock:
            return self._rng.random() * self.storage_delay_s


@dataclass(frozen=True, slots=True)
class FailedTransfers(NoFaults):
    """A fault plan that fails every copy batch containing one of `op_ids`."""

    op_ids: frozenset[int]
    reason: str = "injected transfer failure"

    def transfer_fault(self, stream: ActorName, op_ids: tuple[int, ...]) -> str | None:
        return self.reason if self.op_ids.intersection(op_ids) else None


DeliveryObserver = Callable[[ActorName, Any], None]
"""Called once per delivered mail, by the receiving actor, before it is handled."""


class ActorFailedError(RuntimeError):
    """An actor stopped because a handler raised; the original error is the cause."""


@dataclass(slots=True)
class Failures:
    """Failures of actors (an exception in a handler of a told message)."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _items: list[tuple[ActorName, BaseException]] = field(default_factory=list)

    any: bool = False
    """Whether an actor failed (a flag the senders read before each message)."""

    def report(self, actor: ActorName, error: BaseException) -> None:
        with self._lock:
            self._items.append((actor, error))
            self.any = True

    def first(self) -> tuple[ActorName, BaseException] | None:
        items = self._items  # read without the lock: a list only grows, and reading it is atomic
        return items[0] if items else None

    def raise_first(self) -> None:
        """Raise `ActorFailedError` (caused by the original error) if an actor failed."""
        failed = self.first()
        if failed is not None:
            name, error = failed
            raise ActorFailedError(f"the {name.value} actor failed: {error}") from error


@dataclass(slots=True)
class Services:
    """Everything an actor may take from its runtime."""

    clock: Clock
    ids: IdSource
    seed: int
    faults: FaultPlan
    failures: Failures
    observe: DeliveryObserver | None
    """Told of every delivery before it is handled (None: nobody watches)."""
    new_layer_ring: Callable[[int, int], Any]
    """`(ring_size, layers) -> LayerDoneRing` (threaded or deterministic)."""
    call_later: Callable[[float, ActorName, Any, Any], None]
    """`(delay_s, receiver, ref, mail)`: deliver `mail` to `ref` after `delay_s` (virtual or real)."""
    log: Any = None
    """The `DeliveryLog` every delivery is written to, or None."""
    stopping: bool = False
    """The system is stopping: mail to an actor that already stopped is dropped, not an error."""
    undelivered: list[tuple[ActorName, Any]] = field(default_factory=list)
    """Mail sent and never delivered, as `(receiver, Mail)`: told to an actor that had stopped,
    left in a stopped actor's inbox, or held by a timer that never fired. The runtimes add to it
    where they drop mail, which is only while a system stops or after an actor failed; stopping
    the system writes it to the delivery log as the mail in flight, and empties it."""
