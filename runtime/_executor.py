"""`SerialExecutor`: the bookkeeping actors run one message at a time on the thread that
delivers their mail, with no thread of their own.

The tree, the device allocator and the host pool do pure bookkeeping: each handler is
a few microseconds of Python. Giving each its own thread would make every message a
thread hand-off (tens of microseconds with the GIL), several per scheduler call. Here
they share one executor instead: a tell appends the envelope to one FIFO and, unless
some thread is already draining it, the sender drains it at once. So a facade call
runs its whole cascade (tree -> device -> facade) on the scheduler's thread,
and an ack from a stream thread (`WriteDone`) is handled by that thread as soon as it
arrives when the scheduler is not calling: acks never wait for the next facade call.

On a CPU device the write stream runs here too (see `ThreadedRuntime`): a CPU copy is
synchronous, so it costs the same on any thread, and on a thread of its own it would only
take turns with the scheduler for the interpreter lock.

Actor semantics stay those of pykka: each actor handles one envelope at a time, in the
order its envelopes were put (the executor runs one handler at a time, full stop); a
handler never blocks; an actor that fails stops, and what was queued for it is
answered with `ActorDeadError` (an ask) or kept as undelivered (a tell: the delivery log
records it as in flight when the system stops). The actor classes are the production ones with
pykka's hooks bound to the executor (as the deterministic runtime binds them to its
scheduler).

A drainer holds the executor's lock while it runs handlers and re-checks the queue
after releasing it, so an envelope put by another thread while the lock was held is
never left behind: either the holder sees it, or the putter gets the lock. A put while
the lock is held (by a handler of this thread, or by another thread) leaves the
delivery to the holder.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from typing import Any

import pykka
from pykka._envelope import Envelope

from hicache.actors._actor import Mail


class _ExecutorInbox:
    """The inbox pykka gives an actor: puts go to the executor's one queue."""

    __slots__ = ("_executor", "actor")

    def __init__(self, executor: SerialExecutor) -> None:
        self._executor = executor
        self.actor: pykka.Actor | None = None

    def put(self, envelope: Envelope[Any], /) -> None:
        actor = self.actor
        assert actor is not None, "mail for an actor the executor has not started"
        self._executor.submit(actor, envelope.message, envelope.reply_to)

    def empty(self) -> bool:
        return True

    def get(self) -> Envelope[Any]:  # pragma: no cover - the executor delivers, pykka's loop never runs
        raise RuntimeError("an executor actor's inbox is read by the executor only")


class _ExecutorRef(pykka.ActorRef[Any]):
    """The ref of an actor on the executor: a tell goes straight to the executor's queue
    (pykka's own puts an envelope into the actor's inbox, which then does the same)."""

    def __init__(self, actor: pykka.Actor, executor: SerialExecutor) -> None:
        super().__init__(actor)
        self._inbox = actor.actor_inbox
        self._submit = executor.submit

    def tell(self, message: Any) -> None:
        if self.actor_stopped.is_set():
            raise pykka.ActorDeadError(f"{self} not found")
        self._submit(self._inbox.actor, message, None)


class SerialExecutor:
    """One FIFO of (actor, message, reply future); handlers run one at a time on a delivering thread."""

    def __init__(self, undelivered: list[tuple[Any, Any]] | None = None) -> None:
        self._queue: deque[tuple[pykka.Actor, Any, Any]] = deque()
        self.undelivered: list[tuple[Any, Any]] = [] if undelivered is None else undelivered
        """Where mail for an actor that stopped before handling it goes, as (receiver name, mail)
        (the runtime's `Services.undelivered`)."""
        self._lock = threading.Lock()
        """Held by the thread running handlers."""
        self._classes: dict[type, type] = {}

    # -- pykka's hooks ---------------------------------------------------------

    def actor_class(self, cls: type[pykka.Actor]) -> type[pykka.Actor]:
        """`cls` with pykka's inbox and loop hooks bound to this executor (made once per class)."""
        made = self._classes.get(cls)
        if made is None:
            executor = self

            class OnExecutor(cls):  # type: ignore[valid-type, misc]
                def __init__(self, *args: Any, **kwargs: Any) -> None:
                    super().__init__(*args, **kwargs)
                    urn = self.actor_ref.actor_urn
                    self._actor_ref = _ExecutorRef(self, executor)
                    self.actor_ref.actor_urn = urn

                @staticmethod
                def _create_actor_inbox() -> _ExecutorInbox:
                    return _ExecutorInbox(executor)

                def _start_actor_loop(self) -> None:
                    self.actor_inbox.actor = self
                    self._actor_loop_setup()  # on_start, in the starting thread

            OnExecutor.__name__ = OnExecutor.__qualname__ = cls.__name__
            made = self._classes[cls] = OnExecutor
        return made

    # -- delivery --------------------------------------------------------------

    def submit(self, actor: pykka.Actor, message: Any, reply_to: Any) -> None:
        """Queue a delivery (`reply_to`: the asker's future, or None); run the queue now unless
        a thread is already running it."""
        self._queue.append((actor, message, reply_to))
        # Held: by this thread, in a handler (its tells wait for its return), or by another,
        # which delivers this too (it looks at the queue again after it lets go).
        if not self._lock.locked():
            self.run()

    def run(self) -> None:
        """Deliver until the queue is empty, unless another thread holds the executor (it will)."""
        queue, lock, undelivered = self._queue, self._lock, self.undelivered
        while queue:
            if not lock.acquire(blocking=False):
                return
            try:
                while queue:
                    _deliver(*queue.popleft(), undelivered)
            finally:
                lock.release()

    @property
    def busy(self) -> bool:
        return bool(self._queue) or self._lock.locked()


def _deliver(actor: pykka.Actor, message: Any, reply_to: Any, undelivered: list[tuple[Any, Any]]) -> None:
    """The body of pykka's actor loop for one message; mail for an actor that stopped goes to
    `undelivered`."""
    if actor.actor_stopped.is_set():
        if type(message) is Mail:
            undelivered.append((actor.name, message))  # type: ignore[attr-defined]
        if reply_to is not None:
            if isinstance(message, pykka.messages._ActorStop):
                reply_to.set(None)
            else:
                dead = pykka.ActorDeadError(f"{actor} stopped before handling the message")
                reply_to.set_exception(exc_info=(pykka.ActorDeadError, dead, None))
        return
    try:
        # Mail goes straight to the actor's handler; pykka's own messages (a stop) take its path.
        response = actor.on_receive(message) if type(message) is Mail else actor._handle_receive(message)
        if reply_to is not None:
            reply_to.set(response)
    except Exception:
        if reply_to is not None:
            reply_to.set_exception()
        else:
            actor._handle_failure(*sys.exc_info())
            try:
                actor.on_failure(*sys.exc_info())
            except Exception:
                actor._handle_failure(*sys.exc_info())
