"""`System`: builds the cores and buffers from a `Config`, starts the actors, stops them.

The threaded runtime runs the bookkeeping actors on a serial executor and the copying
ones on threads of their own (pykka's ThreadingActor), which it waits for when the
system stops.
Time, ids, randomness, faults and delivery observation come from `Services`, so
the deterministic runtime can run the same actor classes without threads.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import pykka

from hicache.actors import (
    DeviceAllocatorActor,
    DeviceCore,
    HostCore,
    HostPoolActor,
    LoadStreamActor,
    StoragePrefetcherActor,
    TreeActor,
    WriteStreamActor,
    open_backend,
)
from hicache.messages import ActorName, CheckInvariants, GetStatistics, Message

from hicache.actors._actor import Directory, HiActor, Mail
from ._executor import SerialExecutor
from ._inbox import Inbox
from ._log import DeliveryLog, LogInUseError, _LoggedFaults, _versions
from hicache.actors._layers import LayerDoneRing
from hicache.actors._services import (
    ActorFailedError,
    DeliveryObserver,
    FaultPlan,
    Failures,
    IdSource,
    MonotonicClock,
    NoFaults,
    Services,
)
from hicache.messages.config import Config, ConfigError, StorageKind, check_resources
from hicache.actors._logging import logger

DEFAULT_ASK_TIMEOUT_S = 60.0
"""How long the caller waits for an actor's reply before raising TimeoutError."""

THREAD_JOIN_TIMEOUT_S = 10.0
"""How long stopping a system waits for each thread it started (an actor's, a timer's) to end
once told to: a storage call hung on a dead mount or server does not hold the caller longer."""

_THREAD_NUMBERS = itertools.count(1)

log = logger("hicache.system")


EXECUTOR_ACTORS = frozenset({ActorName.TREE, ActorName.DEVICE, ActorName.HOST})
"""The bookkeeping actors: they share a `SerialExecutor` and run on the threads that deliver
their mail (the scheduler's, or a stream's for an ack). The streams and the prefetcher copy
and do I/O: each has a thread of its own, except the write stream on a CPU device (see
`ThreadedRuntime`)."""


class ThreadedRuntime:
    """Production runtime: the bookkeeping actors on a serial executor, the copying ones on
    their own threads; a monotonic clock, sequential ids.

    `write_stream_thread`: whether the write stream (device -> host) gets a thread of its
    own. By default (None) it does on CUDA, where it waits on each copy's event, and does
    not on a CPU device: there a copy is synchronous Python and memcpy, so on a thread of
    its own it would only take turns with the scheduler for the interpreter lock (each
    turn a thread switch, and its bookkeeping no cheaper); on the executor a write-through
    is copied and acknowledged in the cascade of the call that started it. True gives it a
    thread on CPU too (tests of the threaded stream); False is refused on CUDA."""

    def __init__(
        self,
        *,
        seed: int = 0,
        faults: FaultPlan | None = None,
        observe: DeliveryObserver | None = None,
        write_stream_thread: bool | None = None,
    ) -> None:
        if write_stream_thread not in (None, True, False) or type(write_stream_thread) is int:
            raise TypeError(f"write_stream_thread must be None, True or False, got {write_stream_thread!r}")
        self.write_stream_thread = write_stream_thread
        self._threads: list[threading.Thread] = []
        """The threads of the actors started on threads of their own, joined by `shutdown`."""
        self._thread_actors: list[HiActor] = []
        """Those actors, whose inboxes `shutdown` empties of mail that came after they stopped."""
        self._thread_classes: dict[type, type] = {}
        self._timers: list[tuple[threading.Timer, _TimerMail]] = []
        self._timers_lock = threading.Lock()
        self.services = Services(
            clock=MonotonicClock(),
            ids=IdSource(),
            seed=seed,
            faults=faults or NoFaults(),
            failures=Failures(),
            observe=observe,
            new_layer_ring=LayerDoneRing,
            call_later=self._call_later,
        )
        self.executor = SerialExecutor(self.services.undelivered)

    def start(self, cls: type[HiActor], **kwargs: Any) -> pykka.ActorRef[Any]:
        if cls.name in EXECUTOR_ACTORS or (cls.name is ActorName.WRITE and not self._write_thread(kwargs)):
            return self.executor.actor_class(cls).start(**kwargs)
        return self._thread_class(cls).start(**kwargs)

    def _thread_class(self, cls: type[HiActor]) -> type[HiActor]:
        """`cls` on a thread this runtime keeps (made once per class), so that stopping the
        system waits for it to end. pykka's own actor starts its thread and forgets it, so a
        system could be stopped while the thread still ran its last lines; a process that
        exited then could abort in torch's native code (`terminate called without an active
        exception`) as the interpreter stopped the thread."""
        made = self._thread_classes.get(cls)
        if made is None:
            threads, actors, undelivered = self._threads, self._thread_actors, self.services.undelivered

            class OnThread(cls):  # type: ignore[valid-type, misc]
                def _start_actor_loop(self) -> None:
                    thread = threading.Thread(target=self._actor_loop, name=f"{cls.__name__}-{next(_THREAD_NUMBERS)}",
                                              daemon=self.use_daemon_thread)
                    threads.append(thread)
                    actors.append(self)
                    thread.start()

                def _actor_loop_teardown(self) -> None:
                    _keep_undelivered(self, undelivered)  # then pykka's answers the asks left
                    super()._actor_loop_teardown()

            OnThread.__name__ = OnThread.__qualname__ = cls.__name__
            made = self._thread_classes[cls] = OnThread
        return made

    def _write_thread(self, kwargs: Mapping[str, Any]) -> bool:
        cuda = kwargs["device_kv"].device.type != "cpu"
        if self.write_stream_thread is False and cuda:
            raise ValueError("write_stream_thread=False needs a CPU device: on CUDA the write stream waits "
                             "on its copies' events on a thread of its own (leave it None)")
        return cuda if self.write_stream_thread is None else self.write_stream_thread

    poll_s: float | None = 0.05
    """How long the caller waits on its inbox between checks for failed actors."""

    def new_mailbox(self, what: str) -> _QueueMailbox:
        return _QueueMailbox(what)

    def _call_later(self, delay_s: float, receiver: ActorName, ref: pykka.ActorRef[Any], mail: Any) -> None:
        held = _TimerMail(receiver, mail)
        undelivered = self.services.undelivered

        def fire() -> None:
            held.fired = True
            try:
                if ref.is_alive():
                    ref.tell(mail)
                    return
            except pykka.ActorDeadError:  # it stopped between the look and the tell
                pass
            undelivered.append((receiver, mail))

        timer = threading.Timer(delay_s, fire)
        timer.daemon = True
        with self._timers_lock:
            self._timers = [(t, h) for t, h in self._timers if t.is_alive()]
            self._timers.append((timer, held))
        timer.start()

    def shutdown(self) -> None:
        """Cancel pending timers, then wait for them and for the actors' threads to end (called
        once every actor was told to stop): when a system's stop returns, none of its threads
        runs (each waited for at most `THREAD_JOIN_TIMEOUT_S`; one still running is logged).
        The mail of the timers that never fired, and any that reached an actor's inbox after it
        stopped, is added to `Services.undelivered`."""
        with self._timers_lock:
            timers, self._timers = self._timers, []
        for t, _ in timers:
            t.cancel()
        threads = list(self._threads)
        self._threads.clear()  # in place: the classes `_thread_class` made append to this list
        me = threading.current_thread()
        for thread in (*(t for t, _ in timers), *threads):
            if thread is not me:
                thread.join(THREAD_JOIN_TIMEOUT_S)
                if thread.is_alive():
                    log.warning("thread still running after the system stopped", thread=thread.name,
                                waited_s=THREAD_JOIN_TIMEOUT_S)
        undelivered = self.services.undelivered
        undelivered.extend((h.receiver, h.mail) for t, h in timers if not h.fired)
        actors = list(self._thread_actors)
        self._thread_actors.clear()
        for actor in actors:
            if actor.actor_stopped.is_set():
                _keep_undelivered(actor, undelivered)  # told between its teardown and now (a tell races a stop)


class _TimerMail:
    """The mail a timer of `ThreadedRuntime` tells when it fires, and whether it fired."""

    __slots__ = ("fired", "mail", "receiver")

    def __init__(self, receiver: ActorName, mail: Any) -> None:
        self.receiver = receiver
        self.mail = mail
        self.fired = False


def _keep_undelivered(actor: HiActor, undelivered: list[tuple[ActorName, Any]]) -> None:
    """Add the mail in the inbox of a stopped actor (on a thread of its own) to `undelivered`
    and take the tells out; the asks (and pykka's own messages) stay, for pykka to answer."""
    inbox, kept = actor.actor_inbox, []
    while not inbox.empty():
        envelope = inbox.get()
        if type(envelope.message) is Mail:
            undelivered.append((actor.name, envelope.message))
        if envelope.reply_to is not None or type(envelope.message) is not Mail:
            kept.append(envelope)
    for envelope in kept:
        inbox.put(envelope)


class _QueueMailbox:
    """A thread-safe mailbox the caller reads (the facade's inbox, probes).

    Most mail for the caller is put by the caller's own thread (the bookkeeping actors run
    on it), so a get first looks without taking a lock; only a get that must wait takes the
    condition, and a put notifies only when someone waits."""

    def __init__(self, what: str) -> None:
        self._items: deque[Any] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0
        self._what = what

    def put(self, item: Any) -> None:
        self._items.append(item)
        if self._waiting:
            with self._cond:
                self._cond.notify_all()

    def get(self, timeout_s: float | None = None) -> Any:
        items = self._items
        if items:
            return items.popleft()
        with self._cond:
            self._waiting += 1
            try:
                if not self._cond.wait_for(lambda: bool(items), timeout_s):
                    raise TimeoutError(f"{self._what}: nothing arrived within {timeout_s}s")
            finally:
                self._waiting -= 1
        return items.popleft()

    def qsize(self) -> int:
        return len(self._items)


def actor_specs(
    cfg: Config, ring: LayerDoneRing, *, storage: bool = True
) -> tuple[list[tuple[type[HiActor], dict[str, Any]]], Any, Any]:
    """The six actor classes of a system with their constructor arguments (services and
    directory aside), built over fresh cores; and the device and host KV buffers.

    The one place that wires cores, buffers and actors: `System.start` and log replay use it.
    `storage=False` leaves the prefetcher out (replay: its results come from storage contents
    the log does not hold, so its messages are replayed as inputs) and opens no backend."""
    device, host = DeviceCore(cfg), HostCore(cfg)
    specs: list[tuple[type[HiActor], dict[str, Any]]] = [
        (DeviceAllocatorActor, {"config": cfg, "core": device}),
        (HostPoolActor, {"config": cfg, "core": host}),
        (WriteStreamActor, {"config": cfg, "device_kv": device.kv, "host_kv": host.kv}),
        (LoadStreamActor, {"config": cfg, "device_kv": device.kv, "host_kv": host.kv, "ring": ring}),
        (TreeActor, {"config": cfg}),
    ]
    if storage:
        backend = None
        if cfg.storage is not StorageKind.NONE:
            backend = open_backend(cfg)
            if not cfg.model_id:
                log.warning("storage keys name no model: another model's instances on this storage would read "
                            "its pages as theirs; set Config.model_id", storage=cfg.storage.value)
        specs.append((StoragePrefetcherActor, {"config": cfg, "host_kv": host.kv, "backend": backend}))
    return specs, device.kv, host.kv


class _CallerRef:
    """Stands where an actor ref would for the caller (the facade): a tell is a put into
    its inbox, observed like any delivery."""

    def __init__(self, probe: Any, services: Services) -> None:
        self._probe = probe
        self._services = services
        self._alive = True

    def tell(self, mail: Mail) -> None:
        services = self._services
        if services.observe is not None:
            services.observe(ActorName.FACADE, mail)
        if services.log is not None:
            services.log.delivery(services.log.next_seq(), services.clock.now_s(), ActorName.FACADE,
                                  mail.sender, mail.message, False, None, None)
        self._probe._inbox.put((mail.sender, mail.message))

    def is_alive(self) -> bool:
        return self._alive

    def stop(self, block: bool = True, timeout: float | None = None) -> bool:
        self._alive = False
        return True


class Runtime(Protocol):
    """What `System` needs from a runtime (threaded or deterministic)."""

    services: Services

    def start(self, cls: type[HiActor], **kwargs: Any) -> pykka.ActorRef[Any]: ...

    poll_s: float | None

    def new_mailbox(self, what: str) -> Any: ...

    def shutdown(self) -> None: ...


class System:
    """The running actors of one hicache instance (one per tensor-parallel rank).

    Use as a context manager, or call `start()` and `stop()`. `stand_ins` starts
    stand-ins (`stand_in`: an `Inbox`, or a test's `Probe`) in place of real actors (the
    tree, to drive the pools by hand). An inbox always stands under the `facade` name:
    replies to what the caller told the actors arrive there (`System.next_reply`).
    """

    def __init__(
        self,
        config: Config,
        *,
        runtime: Runtime | None = None,
        stand_ins: Iterable[ActorName] = (),
        stand_in: type[Inbox] = Inbox,
        actor_classes: Mapping[ActorName, type[HiActor]] | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        self.config = config
        self.runtime: Runtime = runtime or ThreadedRuntime()
        self.services = self.runtime.services
        self._stand_in_names = tuple(stand_ins)
        self._stand_in = stand_in
        self._log_path = log_path or config.log_path or None
        if actor_classes is not None and not isinstance(actor_classes, Mapping):
            raise TypeError(f"actor_classes maps an ActorName to an actor class, got {type(actor_classes).__name__}")
        self._overrides = dict(actor_classes or {})
        """Subclasses to run in place of an actor's class: exploration's mutants, never config."""
        for name, cls in self._overrides.items():
            if not isinstance(name, ActorName) or not isinstance(cls, type):
                raise TypeError(f"actor_classes maps an ActorName to an actor class, got {name!r}: {cls!r}")
        self.directory = Directory()
        self.probes: dict[ActorName, Any] = {}
        self._started = False
        self.device_kv: Any = None
        self.host_kv: Any = None
        self.ring: LayerDoneRing | None = None

    # -- lifecycle ------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._started

    def start(self) -> System:
        """Start the actors over fresh cores and buffers (again after `stop`: an empty cache).
        If an actor fails to start, the ones already running are stopped: no thread is left."""
        if self._started:
            raise RuntimeError("system already started")
        cfg, svc = self.config, self.services
        check_resources(cfg)  # before anything is allocated: one line naming what does not fit
        svc.ids.restart()  # numbered as a fresh system, as its log's replay numbers (none of the last runs)
        svc.undelivered.clear()  # the last run's mail in flight is not this run's
        self.directory = Directory()
        self.probes = {}
        try:
            self._start_actors(cfg, svc)
            if self._log_path:  # only once every actor runs: a failed start leaves an old log as it was
                self._open_log(self._log_path)
        except BaseException:
            self._stop_actors()
            raise
        self._started = True
        return self

    def _start_actors(self, cfg: Config, svc: Services) -> None:
        d = self.directory
        self.ring = svc.new_layer_ring(cfg.load_ring_size, cfg.layers)
        specs, self.device_kv, self.host_kv = actor_specs(cfg, self.ring)
        common = {"services": svc, "directory": d}
        for cls, kwargs in specs:
            if cls.name not in self._stand_in_names:
                self._register(cls, **kwargs, **common)
        for name in self._stand_in_names:
            probe = self._stand_in(name, self.runtime.new_mailbox(f"stand-in {name.value}"))
            d.register(name, self.runtime.start(probe.actor_class(), inbox=probe, **common))
            self.probes[name] = probe
        if ActorName.FACADE not in self._stand_in_names:
            # The caller is not an actor: mail for it goes straight into its inbox (no thread hop).
            inbox = Inbox(ActorName.FACADE, self.runtime.new_mailbox("the facade's inbox"))
            d.register(ActorName.FACADE, _CallerRef(inbox, svc))  # type: ignore[arg-type]
            self.probes[ActorName.FACADE] = inbox

    def _open_log(self, path: str | Path) -> None:
        svc = self.services
        header = {
            "versions": _versions(), "config": self.config.to_mapping(),
            "runtime": type(self.runtime).__name__, "seed": svc.seed,
            "stand_ins": sorted(n.value for n in self._stand_in_names),
            "actor_classes": {n.value: c.__qualname__ for n, c in sorted(self._overrides.items(), key=lambda i: i[0].value)},
        }
        try:
            svc.log = DeliveryLog(path, header)
        except LogInUseError as e:
            raise ConfigError(str(e)) from None
        except OSError as e:
            raise ConfigError(f"log_path={str(path)!r} cannot be written ({e.strerror or e}): give a file in a folder "
                              "this process may write") from None
        self._unlogged_faults = svc.faults
        svc.faults = _LoggedFaults(svc.faults, svc.log)

    def _register(self, cls: type[HiActor], **kwargs: Any) -> None:
        use = self._overrides.get(cls.name, cls)
        if not issubclass(use, cls):
            raise TypeError(f"{use.__name__} must subclass {cls.__name__} to run as the {cls.name.value} actor")
        self.directory.register(cls.name, self.runtime.start(use, **kwargs))

    def stop(self) -> tuple[ActorName, ...]:
        """Stop the actors, then close the log, recording in it the mail sent and never
        delivered (`Services.undelivered`: the mail in flight when the run stopped). An actor
        still in a handler after `DEFAULT_ASK_TIMEOUT_S` (a storage call that hangs, say) is
        left behind: its thread (a daemon) ends on its own, the others stop, the log is closed,
        and the system may start again. What this returns: the actors left behind, each also
        logged as an error."""
        if not self._started:
            return ()
        svc = self.services
        try:
            stuck = self._stop_actors()
        finally:
            in_flight = list(svc.undelivered)
            svc.undelivered.clear()
            if svc.log is not None:
                svc.log.close(in_flight)
                svc.log = None
                svc.faults = self._unlogged_faults
            self._started = False
        return stuck

    def _stop_actors(self) -> tuple[ActorName, ...]:
        self.services.stopping = True
        stuck: list[ActorName] = []
        try:
            for name in self.directory.names():
                ref = self.directory.ref(name)
                if ref.is_alive():
                    try:
                        ref.stop(block=True, timeout=DEFAULT_ASK_TIMEOUT_S)
                    except pykka.Timeout:
                        stuck.append(name)
                        log.error("actor did not stop: still in a handler, left behind (its thread ends on its "
                                  "own)", actor=name.value, waited_s=DEFAULT_ASK_TIMEOUT_S)
            self.runtime.shutdown()
        finally:
            self.services.stopping = False
            self.directory = Directory()
        return tuple(stuck)

    def __enter__(self) -> System:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- talking to actors from outside --------------------------------------

    def tell(self, to: ActorName, message: Message, *, sender: ActorName = ActorName.FACADE) -> None:
        if self.services.failures.any:
            self.raise_if_failed()
        ref = self.directory.refs.get(to) if self._started else None
        (ref or self._ref(to)).tell(Mail(sender, message))

    def ask(
        self,
        to: ActorName,
        message: Message,
        *,
        sender: ActorName = ActorName.FACADE,
        timeout_s: float = DEFAULT_ASK_TIMEOUT_S,
    ) -> Any:
        """Send `message` and wait for the reply. Errors the handler raised are raised here.
        On threads, a wait gives up with `pykka.ActorDeadError` once the actor has stopped
        without answering: an ask that races its stop (a `statistics()` from another thread
        racing `close()`) can land in an inbox pykka no longer reads."""
        self.raise_if_failed()
        ref = self._ref(to)
        future = ref.ask(Mail(sender, message, ask=True), block=False)
        poll, deadline = self.runtime.poll_s, time.monotonic() + timeout_s
        while True:
            try:
                return future.get(timeout=timeout_s if poll is None else min(poll, max(0.0, deadline - time.monotonic())))
            except pykka.Timeout:
                if poll is not None and not ref.is_alive():
                    try:  # answered just before it stopped
                        return future.get(timeout=0)
                    except pykka.Timeout:
                        raise pykka.ActorDeadError(f"the {to.value} actor stopped without answering "
                                                   f"{type(message).__name__}") from None
                if poll is None or time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"no reply from the {to.value} actor to {type(message).__name__} within {timeout_s}s"
                    ) from None

    def next_reply(self, timeout_s: float | None, *, block: bool = True) -> Message | None:
        """The next message told to the caller (the facade), waiting up to `timeout_s`
        (`block=False`: only one already there); None if none came. Raises if an actor failed."""
        if self.services.failures.any:
            self.raise_if_failed()
        inbox = self.probes[ActorName.FACADE]
        if not block and not inbox.pending():
            return None
        try:
            return inbox.receive(timeout_s=timeout_s)[1]
        except TimeoutError:
            self.raise_if_failed()
            return None

    def quiesce(self, timeout_s: float = DEFAULT_ASK_TIMEOUT_S) -> None:
        """Return once the tree has no write-through, load-back or backup to storage in flight (every
        ack handled; with several ranks: every ack arrived, to be applied by the next agreement)."""
        run_until_idle = getattr(self.runtime, "run_until_idle", None)
        deadline = time.monotonic() + timeout_s
        while True:
            if run_until_idle is not None:
                run_until_idle()  # deterministic: deliver everything, then look
            stats = self.ask(ActorName.TREE, GetStatistics())
            # With several ranks, local outcomes wait for agreement (HiCache.sync): only their arrival counts here.
            busy = stats.facts_unknown if self.config.tp_size > 1 else stats.facts_pending
            if not (busy or (self.config.tp_size == 1 and (stats.writes_in_flight or stats.loads_in_flight))):
                return
            if run_until_idle is not None:
                raise RuntimeError(
                    f"{stats.writes_in_flight} writes and {stats.loads_in_flight} loads in flight, but no actor "
                    "has mail: their acknowledgements will never be handled"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"still in flight after {timeout_s:g} s: {stats.writes_in_flight} write-throughs, "
                    f"{stats.loads_in_flight} load-backs, {stats.backups_in_flight} backups and "
                    f"{stats.prefetches_in_flight} prefetches; wait longer (timeout_s) or close(drain=False) to "
                    "drop them"
                )
            if run_until_idle is None:
                time.sleep(0.0005)

    def _ref(self, to: ActorName) -> pykka.ActorRef[Any]:
        if not self._started:
            raise RuntimeError(f"the system is not running (start it first): cannot reach the {to.value} actor")
        return self.directory.ref(to)

    def raise_if_failed(self) -> None:
        self.services.failures.raise_first()

    def check_invariants(self) -> None:
        """Ask every actor to check its invariants; raises the first violation."""
        for name in self._actor_names():
            self.ask(name, CheckInvariants())

    def statistics(self) -> dict[ActorName, Message]:
        return {name: self.ask(name, GetStatistics()) for name in self._actor_names()}

    def _actor_names(self) -> tuple[ActorName, ...]:
        return tuple(n for n in self.directory.names() if n not in self.probes)
