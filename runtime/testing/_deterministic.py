"""The deterministic runtime: the production actor classes, no threads, a seeded scheduler.

It plugs into pykka's three hooks. For each actor class it makes a subclass that
only overrides them:

- `_create_actor_inbox` -> a `_Inbox` (a deque the scheduler reads);
- `_create_future`      -> a `DeterministicFuture` whose `get()` runs the scheduler
                           until the future resolves (only the caller outside the
                           actors may wait; inside a handler that is an error);
- `_start_actor_loop`   -> registers the actor with the scheduler instead of
                           starting a thread.

A step picks one actor with mail (the strategy decides which), takes its oldest
envelope and handles it exactly as pykka's loop does. Same seed, same strategy,
same inputs: same interleaving and same log. Virtual time moves only when nothing
is runnable (or, with `timers_race`, when the strategy picks a due timer over a
delivery). Faults are injected from the seeded plan.

Failures it reports: `DeadlockError` (someone waits, nothing is runnable, no timer
is pending: with who waits on what), `LivelockError` (a wait took more than
`max_steps` deliveries), `BlockingGetError` (strict mode: a `get()` inside a handler).
"""

from __future__ import annotations

import heapq
import itertools
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pykka
from pykka._envelope import Envelope

from hicache.actors._actor import HiActor, Mail
from hicache.actors._layers import LayerDoneRing
from hicache.actors._services import DeliveryObserver, FaultPlan, Failures, IdSource, NoFaults, Services
from hicache.messages import ActorName

from ._strategies import RandomStrategy, Strategy

T = TypeVar("T")

DEFAULT_MAX_STEPS = 1_000_000
"""Deliveries one wait may take before it is called a livelock."""


class DeadlockError(RuntimeError):
    """Someone waits, but no actor has mail and no timer is pending."""


class LivelockError(RuntimeError):
    """A wait took more than `max_steps` deliveries without resolving."""


class BlockingGetError(RuntimeError):
    """A handler called `get()` on a future: actor code must never block (strict mode)."""


class VirtualClock:
    """Seconds of virtual time; moves only when the scheduler fires a timer."""

    def __init__(self) -> None:
        self.t = 0.0

    def now_s(self) -> float:
        return self.t


@dataclass(order=True, slots=True)
class _Timer:
    due_s: float
    seq: int
    receiver: ActorName = field(compare=False)
    ref: pykka.ActorRef[Any] = field(compare=False)
    mail: Mail = field(compare=False)


@dataclass(frozen=True, slots=True)
class Step:
    """One entry of a schedule trace: which actor handled its next mail, or a timer fired."""

    index: int
    actor: str
    """Receiving actor name, or `timer:<name>` when a timer fired into that actor."""


class _Inbox:
    __slots__ = ("_q", "actor")

    def __init__(self) -> None:
        self._q: deque[Envelope[Any]] = deque()
        self.actor: pykka.Actor | None = None

    def put(self, envelope: Envelope[Any], /) -> None:
        self._q.append(envelope)

    def get(self) -> Envelope[Any]:
        return self._q.popleft()

    def empty(self) -> bool:
        return not self._q

    def __len__(self) -> int:
        return len(self._q)


class DeterministicFuture(pykka.Future[T]):
    """A future resolved by the scheduler; `get()` drives it until then."""

    def __init__(self, runtime: DeterministicRuntime | None = None) -> None:
        # pykka makes bare instances (`ActorRef.stop`) that only carry a get hook.
        super().__init__()
        self._runtime = runtime
        self._done = False
        self._value: Any = None
        self._exc_info: Any = None

    def get(self, *, timeout: float | None = None) -> T:
        if self._get_hook is not None:
            return super().get(timeout=timeout)  # pykka's hook futures (stop, map, join)
        if not self._done:
            assert self._runtime is not None, "a deterministic future without a runtime has no result"
            self._runtime.drive_until(lambda: self._done, "a reply", timeout_s=timeout)
        if self._exc_info is not None:
            exc = self._exc_info[1]
            raise exc.with_traceback(self._exc_info[2])
        return self._value  # type: ignore[no-any-return]

    def set(self, value: Any | None = None) -> None:
        self._value, self._done = value, True

    def set_exception(self, exc_info: Any = None) -> None:
        self._exc_info = exc_info if isinstance(exc_info, tuple) else sys.exc_info()
        self._done = True


class _Mailbox:
    """Deterministic stand-in for a thread-safe queue read by the caller (probes)."""

    def __init__(self, runtime: DeterministicRuntime, what: str) -> None:
        self._runtime = runtime
        self._q: deque[Any] = deque()
        self._what = what

    def put(self, item: Any) -> None:
        self._q.append(item)

    def get(self, timeout_s: float | None = None) -> Any:
        if not self._q:
            self._runtime.drive_until(lambda: bool(self._q), self._what, timeout_s=timeout_s)
        return self._q.popleft()

    def qsize(self) -> int:
        return len(self._q)


class _DeterministicLayerRing(LayerDoneRing):
    """The layer ring whose waits run the scheduler instead of blocking."""

    def __init__(self, runtime: DeterministicRuntime, ring_size: int, layers: int) -> None:
        super().__init__(ring_size, layers)
        self._runtime = runtime

    def wait_layer(self, batch: int, layer: int, timeout_s: float | None = None) -> None:
        self.check_layer(layer)
        if batch and not self._ready(batch, layer):
            self._runtime.drive_until(
                lambda: self._ready(batch, layer), f"layer {layer} of load batch {batch}", timeout_s=timeout_s
            )
        super().wait_layer(batch, layer, timeout_s=0)


class DeterministicRuntime:
    """Runs actors threadless under a seeded `Strategy`, with virtual time and faults."""

    def __init__(
        self,
        *,
        seed: int = 0,
        strategy: Strategy | None = None,
        faults: FaultPlan | None = None,
        observe: DeliveryObserver | None = None,
        strict: bool = True,
        timers_race: bool = False,
        max_steps: int = DEFAULT_MAX_STEPS,
    ) -> None:
        self.seed = seed
        self.strategy = strategy or RandomStrategy(seed)
        self.strict = strict
        self.timers_race = timers_race
        self.max_steps = max_steps
        self.clock = VirtualClock()
        self.schedule: list[Step] = []
        self._observers: list[DeliveryObserver] = [observe] if observe else []
        self._inboxes: dict[str, _Inbox] = {}
        self._timers: list[_Timer] = []
        self._timer_seq = itertools.count()
        self._in_handler: str | None = None
        self._classes: dict[type, type] = {}
        self._waiting_on: list[str] = []
        self.after_step: Callable[[pykka.Actor | None], None] | None = None
        """Called after every step with the actor that handled a mail (None for a timer);
        exploration checks that actor's invariants here."""
        self.services = Services(
            clock=self.clock,
            ids=IdSource(),
            seed=seed,
            faults=faults or NoFaults(),
            failures=Failures(),
            observe=self._observe,
            new_layer_ring=lambda size, layers: _DeterministicLayerRing(self, size, layers),
            call_later=self._call_later,
        )

    # -- the three pykka hooks --------------------------------------------------

    def actor_class(self, cls: type[HiActor]) -> type[HiActor]:
        """`cls` with pykka's hooks bound to this runtime (made once per class)."""
        made = self._classes.get(cls)
        if made is None:
            runtime = self

            class Deterministic(cls):  # type: ignore[valid-type, misc]
                @staticmethod
                def _create_actor_inbox() -> _Inbox:
                    return _Inbox()

                @staticmethod
                def _create_future() -> DeterministicFuture[Any]:
                    return DeterministicFuture(runtime)

                def _start_actor_loop(self) -> None:
                    runtime._register(self)

            Deterministic.__name__ = Deterministic.__qualname__ = cls.__name__
            made = self._classes[cls] = Deterministic
        return made

    def start(self, cls: type[HiActor], **kwargs: Any) -> pykka.ActorRef[Any]:
        return self.actor_class(cls).start(**kwargs)

    poll_s: float | None = None
    """Waits run the scheduler to completion (or to a deadlock report), never poll."""

    def new_mailbox(self, what: str) -> _Mailbox:
        return _Mailbox(self, what)

    def shutdown(self) -> None:
        """Drop what is left (every actor has stopped): the mail still in the stopped actors'
        inboxes, then that of the timers not fired yet, in the order they would have come,
        goes to `Services.undelivered`."""
        undelivered = self.services.undelivered
        for key in sorted(self._inboxes):
            inbox = self._inboxes[key]
            if not self._stopped(inbox):
                continue
            actor = inbox.actor
            assert isinstance(actor, HiActor), f"a {type(actor).__name__} in the {key} inbox"
            while inbox:
                message = inbox.get().message
                if type(message) is Mail:
                    undelivered.append((actor.name, message))
        while self._timers:
            timer = heapq.heappop(self._timers)
            undelivered.append((timer.receiver, timer.mail))

    def _register(self, actor: HiActor) -> None:
        key = actor.name.value
        inbox = actor.actor_inbox
        assert isinstance(inbox, _Inbox)
        inbox.actor = actor
        if key in self._inboxes and not self._stopped(self._inboxes[key]):
            raise RuntimeError(f"an actor named {key} already runs in this deterministic runtime")
        self._inboxes[key] = inbox
        actor._actor_loop_setup()  # on_start, in the caller, as its thread would

    # -- scheduling ----------------------------------------------------------------

    def runnable(self) -> list[str]:
        return sorted(k for k, box in self._inboxes.items() if len(box) and not self._stopped(box))

    def step(self) -> bool:
        """Deliver one mail (or fire one timer when racing); False when nothing is runnable."""
        choices = self.runnable()
        due = self._due_timer_target()
        if due is not None and self.timers_race:
            choices.append(f"timer:{due}")
        if not choices:
            return False
        pick = self.strategy.choose(len(self.schedule), choices)
        self.schedule.append(Step(len(self.schedule), pick))
        actor = None
        if pick.startswith("timer:"):
            self._fire_next_timer()
        else:
            inbox = self._inboxes[pick]
            actor = inbox.actor
            self._deliver(inbox)
        if self.after_step is not None and not (actor is not None and actor.actor_stopped.is_set()):
            self.after_step(actor)
        return True

    def drive_until(self, done: Callable[[], bool], what: str, *, timeout_s: float | None = None) -> None:
        """Run the scheduler until `done()`; raise on deadlock, livelock or virtual timeout."""
        if self._in_handler is not None and self.strict:
            raise BlockingGetError(
                f"the {self._in_handler} actor waited for {what} inside a handler; actor code must "
                "never block: send a message and handle the reply as another message"
            )
        deadline = None if timeout_s is None else self.clock.t + timeout_s
        self._waiting_on.append(what)
        try:
            steps = 0
            while not done():
                if not self.step():
                    self.services.failures.raise_first()  # a stopped actor explains the silence
                    if not self._advance_time(deadline):
                        if deadline is not None and self._timers and self._timers[0].due_s > deadline:
                            raise pykka.Timeout(f"{what} did not arrive within {timeout_s} virtual seconds")
                        raise DeadlockError(self._deadlock_report(what))
                    continue
                steps += 1
                if steps > self.max_steps:
                    raise LivelockError(
                        f"waited {steps} deliveries for {what} (max_steps={self.max_steps}); last "
                        f"steps: {', '.join(s.actor for s in self.schedule[-12:])}"
                    )
        finally:
            self._waiting_on.pop()

    def run_until_idle(self) -> int:
        """Deliver until no actor has mail (timers not yet due stay pending). Returns steps."""
        n = 0
        while self.step():
            n += 1
            if n > self.max_steps:
                raise LivelockError(f"still busy after {n} deliveries (max_steps={self.max_steps})")
        return n

    def advance(self, seconds: float) -> None:
        """Let `seconds` of virtual time pass, as a caller's own work would (a scheduler's forward
        pass): deliver everything, firing each timer that falls due on the way."""
        if seconds < 0:
            raise ValueError(f"cannot advance time by {seconds} s")
        deadline = self.clock.t + seconds
        while True:
            self.run_until_idle()
            if not self._advance_time(deadline):
                break
        self.clock.t = max(self.clock.t, deadline)

    # -- delivery ---------------------------------------------------------------------

    def _deliver(self, inbox: _Inbox) -> None:
        actor = inbox.actor
        assert actor is not None
        envelope = inbox.get()
        self._in_handler = actor.name.value if isinstance(actor, HiActor) else str(actor)
        try:
            # The body of pykka's Actor._actor_loop_running, for one envelope.
            try:
                response = actor._handle_receive(envelope.message)
                if envelope.reply_to is not None:
                    envelope.reply_to.set(response)
            except Exception:
                if envelope.reply_to is not None:
                    envelope.reply_to.set_exception()
                else:
                    actor._handle_failure(*sys.exc_info())
                    actor.on_failure(*sys.exc_info())
        finally:
            self._in_handler = None

    def _observe(self, receiver: ActorName, mail: Any) -> None:
        for observer in self._observers:
            observer(receiver, mail)

    def add_observer(self, observer: DeliveryObserver) -> None:
        self._observers.append(observer)

    @staticmethod
    def _stopped(inbox: _Inbox) -> bool:
        return inbox.actor is not None and inbox.actor.actor_stopped.is_set()

    # -- virtual time -------------------------------------------------------------

    def _call_later(self, delay_s: float, receiver: ActorName, ref: pykka.ActorRef[Any], mail: Mail) -> None:
        if delay_s < 0:
            raise ValueError(f"timer delay {delay_s} < 0")
        heapq.heappush(self._timers, _Timer(self.clock.t + delay_s, next(self._timer_seq), receiver, ref, mail))

    def _due_timer_target(self) -> str | None:
        return self._timers[0].receiver.value if self._timers else None

    def _fire_next_timer(self) -> None:
        timer = heapq.heappop(self._timers)
        self.clock.t = max(self.clock.t, timer.due_s)
        if timer.ref.is_alive():
            timer.ref.tell(timer.mail)
        else:
            self.services.undelivered.append((timer.receiver, timer.mail))

    def _advance_time(self, deadline: float | None) -> bool:
        if not self._timers:
            return False
        if deadline is not None and self._timers[0].due_s > deadline:
            return False
        self.schedule.append(Step(len(self.schedule), f"timer:{self._timers[0].receiver.value}"))
        self._fire_next_timer()
        return True

    # -- reports --------------------------------------------------------------------

    def _deadlock_report(self, what: str) -> str:
        lines = [f"deadlock: the caller waits for {what}, but no actor has mail and no timer is pending"]
        for key in sorted(self._inboxes):
            actor = self._inboxes[key].actor
            state = "stopped" if self._stopped(self._inboxes[key]) else "idle"
            awaiting = actor.awaiting() if isinstance(actor, HiActor) else ()
            detail = f"; waits for {', '.join(awaiting)}" if awaiting else ""
            lines.append(f"  {key}: {state}{detail}")
        if len(self._waiting_on) > 1:
            lines.append(f"  outer waits: {', '.join(self._waiting_on[:-1])}")
        tail = ", ".join(s.actor for s in self.schedule[-12:]) or "(none)"
        lines.append(f"  last steps: {tail}")
        return "\n".join(lines)


def replay_choices(schedule: Sequence[Step]) -> list[str]:
    """The choices of a recorded schedule, for `ReplayStrategy`."""
    return [s.actor for s in schedule]
