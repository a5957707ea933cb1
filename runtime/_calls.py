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
through a change is corrupt. So while a cache runs, the process's SIGINT handler is a
gate: outside facade calls it passes the signal on to the handler it replaced at once;
while a facade call runs on the main thread it only records it, and the call delivers it
where it may give up (while it waits for a reply) or, having finished, on its way out.
Then the replaced handler runs as if the signal had just arrived: the default one raises
KeyboardInterrupt. A handler the application installs after starting the cache replaces
the gate, and with it this protection.
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


class _SigintGate:
    """The process's SIGINT handler while any cache runs: it forwards the signal to the handler
    it replaced, at once outside facade calls and, inside one, where the call may give up.
    Installed by the first `HiCache.start()` on the main thread, removed by the last `close()`
    (if nothing replaced it meanwhile). A call costs a counter, not a handler swap."""

    def __init__(self) -> None:
        self.users = 0
        self.prev: Any = None
        self.depth = 0
        """Facade calls in progress on the main thread."""
        self.hit = False

    def acquire(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if self.users == 0:
            prev = signal.getsignal(signal.SIGINT)
            if not callable(prev):  # SIG_DFL / SIG_IGN: no Python code runs on SIGINT anyway
                return
            self.prev = prev
            signal.signal(signal.SIGINT, self._handle)
        self.users += 1

    def release(self) -> None:
        if threading.current_thread() is not threading.main_thread() or not self.users:
            return
        self.users -= 1
        if self.users == 0:
            if signal.getsignal(signal.SIGINT) == self._handle:
                signal.signal(signal.SIGINT, self.prev)
            self.prev = None

    def deliver(self) -> None:
        """Run a deferred SIGINT's handler now (it may raise, KeyboardInterrupt by default)."""
        if self.hit:
            self.hit = False
            self.prev(signal.SIGINT, None)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.depth:
            self.hit = True
        else:
            self.prev(signum, frame)


_GATE = _SigintGate()
_MAIN = threading.main_thread().ident


class Interrupts:
    """A facade's calls: SIGINT deferred while one runs on the main thread; they nest."""

    def __init__(self, on_enter: Callable[[], None]) -> None:
        self._on_enter = on_enter
        """Run first in every outermost call (the facade applies late replies there)."""
        self._depth = 0
        self._main = False
        self._on_main = False
        """Calls come from the main thread (one thread makes them: the one that started the cache)."""
        self._on_interrupt: list[Callable[[], None]] = []
        self._undoing = False
        """Taking back a call an interrupt stopped: no further interrupt lands meanwhile."""

    def start(self) -> None:
        self._on_main = threading.get_ident() == _MAIN
        _GATE.acquire()

    def stop(self) -> None:
        _GATE.release()

    def __enter__(self) -> Interrupts:
        self._depth += 1
        if self._depth == 1:
            self._main = self._on_main and _GATE.users > 0
            if self._main:
                _GATE.depth += 1
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
        if not self._main:
            return
        try:
            if _GATE.hit and _GATE.depth == 1:
                try:
                    _GATE.deliver()
                except BaseException:
                    if exc_type is None:  # the caller never sees this call's result: take its effects back
                        self._take_back(undo)
                    raise
        finally:
            _GATE.depth -= 1

    def _take_back(self, undo: list[Callable[[], None]]) -> None:
        """Run the take-backs of a call an interrupt stopped, with the gate still closed: a
        second Ctrl-C meanwhile is folded into the one being raised (it landed inside an
        actor's handler on this thread, and lost the message that released the locks)."""
        self._undoing = True
        try:
            for fn in undo:
                fn()
        finally:
            self._undoing = False
            _GATE.hit = False

    def on_interrupt(self, fn: Callable[[], None]) -> None:
        """Run `fn` if this call completes but an interrupt then stops it from returning."""
        self._on_interrupt.append(fn)

    def deliver(self) -> None:
        """At a point where the call may give up: run a deferred SIGINT's handler now."""
        if self._main and not self._undoing:
            _GATE.deliver()
