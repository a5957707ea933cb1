"""How the facade waits for the actors: one journal of calls in flight, and interrupts
that land only where a call can give up cleanly.

Every verb the facade tells an actor carries an op id, and its reply comes back to the
facade's inbox with that id. A wait can be cut short (the reply timeout on a slow tick,
or Ctrl-C): the call then raises, but its op stays in the journal as abandoned. When
its reply arrives later, it is recognised by its op id and its effects are undone or
adopted by the handler the call left (an admission's locks are released, an
allocation's slots join the request), at the next call, before anything else.

A KeyboardInterrupt must not land inside an actor handler the scheduler's thread is
running (the bookkeeping actors run on it, see `SerialExecutor`): a core left halfway
through a change is corrupt. So while a facade call runs on the main thread, SIGINT
only records itself; the call delivers it where it may give up (while it waits for a
reply) or, having finished, on its way out. Then the handler that was installed runs,
as if the signal had just arrived: the default one raises KeyboardInterrupt.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Pending:
    """A call whose reply has not been applied yet."""

    replies: tuple[type, ...]
    """The reply types it may get."""
    late: Callable[[Any], None]
    """Applied to its reply if the call gave up before the reply came."""
    abandoned: bool = False


class Interrupts:
    """SIGINT deferred while the facade changes state (main thread only; nests)."""

    def __init__(self, on_enter: Callable[[], None]) -> None:
        self._on_enter = on_enter
        """Run first in every outermost call (the facade applies late replies there)."""
        self._depth = 0
        self._prev: Any = None
        self._hit = False
        self._on_interrupt: list[Callable[[], None]] = []

    def __enter__(self) -> Interrupts:
        self._depth += 1
        if self._depth == 1:
            self._hit = False
            self._prev = None
            if threading.current_thread() is threading.main_thread():
                prev = signal.getsignal(signal.SIGINT)
                if callable(prev):  # SIG_DFL / SIG_IGN: no Python code would run anyway
                    self._prev = prev
                    signal.signal(signal.SIGINT, self._record)
            try:
                self._on_enter()
            except BaseException:
                self.__exit__(*sys.exc_info())
                raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._depth -= 1
        if self._depth:
            return
        undo, self._on_interrupt = self._on_interrupt, []
        if self._prev is None:
            return
        signal.signal(signal.SIGINT, self._prev)
        self._prev = None
        if self._hit and exc_type is None:
            self._hit = False
            try:
                signal.raise_signal(signal.SIGINT)  # the restored handler runs now
            except BaseException:
                for fn in undo:  # the caller never sees this call's result: take its effects back
                    fn()
                raise

    def on_interrupt(self, fn: Callable[[], None]) -> None:
        """Run `fn` if this call completes but an interrupt then stops it from returning."""
        self._on_interrupt.append(fn)

    def deliver(self) -> None:
        """At a point where the call may give up: run a deferred SIGINT's handler now."""
        if not self._hit or self._prev is None:
            return
        self._hit = False
        signal.signal(signal.SIGINT, self._prev)
        try:
            signal.raise_signal(signal.SIGINT)
        finally:
            signal.signal(signal.SIGINT, self._record)

    def _record(self, signum: int, frame: Any) -> None:
        self._hit = True
