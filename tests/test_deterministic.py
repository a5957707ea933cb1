"""The deterministic runtime: same seed same log, strategies, virtual time, failures it finds."""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import os
import subprocess
import sys
import textwrap
from typing import Any

import pykka
import pytest

from hicache.actors import HiActor
from hicache.actors._actor import Directory, Mail
from hicache.messages import (
    ActorName,
    CopyLayer,
    DrainWrites,
    GetStatistics,
    Indices,
    Message,
    StartLoads,
    StreamStatistics,
)
from hicache.runtime import Config, System
from hicache.runtime.testing import Probe
from hicache.runtime.testing._deterministic import (
    BlockingGetError,
    DeadlockError,
    DeterministicRuntime,
    LivelockError,
)
from hicache.runtime.testing._strategies import PCTStrategy, RandomStrategy, ReplayStrategy, ScheduleDivergedError

# -- a workload over the real actors ---------------------------------------------------

WORKLOAD = textwrap.dedent(
    """
    import hashlib
    from hicache.messages import *
    from hicache.runtime import Config, System
    from hicache.runtime.testing import Probe
    from hicache.runtime.testing._deterministic import DeterministicRuntime
    from hicache.runtime.testing._strategies import PCTStrategy, RandomStrategy

    def run(seed, strategy="random"):
        log = []
        strat = RandomStrategy(seed) if strategy == "random" else PCTStrategy(seed, depth=3, steps=200)
        rt = DeterministicRuntime(seed=seed, strategy=strat,
                                  observe=lambda r, m: log.append(f"{r.value}<-{m.sender.value}:{m.message!r}"))
        cfg = Config(layers=2, kv_heads=1, head_dim=8, page_size=2, device_slots=32, host_slots=64,
                     transfer_pages_max=1)
        T = ActorName.TREE
        with System(cfg, runtime=rt, stand_ins=(T,), stand_in=Probe) as s:
            got = s.ask(ActorName.DEVICE, AllocateSlots(op_id=1, demands=(SlotDemand(request_id="a", tokens=12),), allocs=(), commits=(), evict=False))
            dev = got.grants[0].pages  # six pages of two slots
            host = s.ask(ActorName.HOST, AllocateHost(op_id=2, tokens=12), sender=T).pages
            s.tell(ActorName.HOST, SetHostState(pages=host, state=HostSlotState.WRITING), sender=T)
            for i in range(6):
                s.tell(ActorName.WRITE, WriteKV(op_id=10 + i, device=dev[i: i + 1], host=host[i: i + 1]), sender=T)
                s.tell(ActorName.DEVICE, CommitSlots(op_id=20 + i, demands=(SlotDemand(request_id="a", tokens=2),)))
            s.probes[T].collect(6)
            assert all(s.next_reply(5.0) is not None for _ in range(6))  # the six SlotsCommitted
            s.check_invariants()
        return hashlib.sha256("\\n".join(log).encode()).hexdigest(), len(log)
    """
)


def _workload() -> Any:
    scope: dict[str, Any] = {}
    exec(WORKLOAD, scope)
    return scope["run"]


def test_same_seed_gives_the_same_log_and_different_seeds_differ() -> None:
    run = _workload()
    digests = {seed: run(seed) for seed in range(6)}
    assert run(3) == digests[3]
    assert len({d for d, _ in digests.values()}) > 1, "every seed produced the same interleaving"


def test_same_seed_gives_the_same_log_in_processes_with_different_hash_seeds() -> None:
    script = WORKLOAD + "\nprint(run(7, 'pct')[0])\n"
    outs = []
    for hash_seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], env=env,
                              capture_output=True, text=True, timeout=120, check=True)
        outs.append(done.stdout.strip())
    assert outs[0] == outs[1]
    assert len(outs[0]) == 64


# -- tiny actor pairs ---------------------------------------------------------------------


class _Ping(HiActor):
    """On StartLoads from the facade: asks PREFETCH for DrainWrites, replies when it gets CopyLayer."""

    name = ActorName.TREE

    def __init__(self, *, broken: bool, **kw: Any) -> None:
        super().__init__(**kw)
        self.broken = broken
        self.waiting = False
        self.got: list[str] = []

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        match message:
            case StartLoads():
                self.waiting = True
                self.send(ActorName.PREFETCH, DrainWrites())
            case CopyLayer(batch=b):
                self.waiting = False
                self.got.append(f"copy{b}")
            case _:
                self.unknown(message)
        return None

    def awaiting(self) -> tuple[str, ...]:
        return ("CopyLayer from prefetch",) if self.waiting else ()

    def check_invariants(self) -> None:
        return None

    def statistics(self) -> Message:
        return _stats(len(self.got))


class _Pong(HiActor):
    """Answers DrainWrites with CopyLayer, unless broken (then it waits for a message nobody sends)."""

    name = ActorName.PREFETCH

    def __init__(self, *, broken: bool, spin: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.broken = broken
        self.spin = spin

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        match message:
            case DrainWrites() if self.spin:
                self.send(self.name, DrainWrites())  # livelock: forever busy, never answers
            case DrainWrites() if not self.broken:
                self.send(ActorName.TREE, CopyLayer(batch=1, layer=0))
            case DrainWrites():
                pass  # deadlock: waits for a StartLoads that nobody will send
            case _:
                self.unknown(message)
        return None

    def awaiting(self) -> tuple[str, ...]:
        return ("StartLoads from tree",) if self.broken else ()

    def check_invariants(self) -> None:
        return None

    def statistics(self) -> Message:
        return _stats(0)


def _stats(n: int) -> StreamStatistics:
    return StreamStatistics(ops_done=n, ops_failed=0, slots_copied=0, bytes_copied=0, batches=0,
                            merged_ops=0, split_ops=0, queued_ops=0)


def _pair(rt: DeterministicRuntime, *, broken: bool, spin: bool = False) -> tuple[Directory, Any]:
    d = Directory()
    svc = rt.services
    d.register(ActorName.TREE, rt.start(_Ping, broken=broken, services=svc, directory=d))
    d.register(ActorName.PREFETCH, rt.start(_Pong, broken=broken, spin=spin, services=svc, directory=d))
    return d, d.ref(ActorName.TREE)


def _stop(d: Directory) -> None:
    for n in d.names():
        if d.ref(n).is_alive():
            d.ref(n).stop()


def test_a_working_pair_completes_without_threads() -> None:
    rt = DeterministicRuntime(seed=1)
    d, ping = _pair(rt, broken=False)
    ping.tell(Mail(ActorName.FACADE, StartLoads()))
    assert rt.run_until_idle() == 3  # StartLoads, DrainWrites, CopyLayer
    assert ping.ask(Mail(ActorName.FACADE, GetStatistics(), ask=True)).ops_done == 1
    assert str(ping) == "_Ping (urn:hicache:tree)"
    _stop(d)


def test_deadlock_is_detected_with_who_waits_on_what() -> None:
    rt = DeterministicRuntime(seed=1)
    d, ping = _pair(rt, broken=True)
    ping.tell(Mail(ActorName.FACADE, StartLoads()))
    rt.run_until_idle()
    future = pykka.ActorRef.ask(ping, Mail(ActorName.FACADE, StartLoads(), ask=True), block=False)
    rt.run_until_idle()
    waiting = rt.new_mailbox("CopyLayer at the tree")
    with pytest.raises(DeadlockError) as err:
        waiting.get()
    text = str(err.value)
    assert "waits for CopyLayer at the tree" in text
    assert "tree: idle; waits for CopyLayer from prefetch" in text
    assert "prefetch: idle; waits for StartLoads from tree" in text
    assert future.get() is None
    _stop(d)


def test_livelock_is_detected_by_the_step_limit() -> None:
    rt = DeterministicRuntime(seed=1, max_steps=500)
    d, ping = _pair(rt, broken=False, spin=True)
    ping.tell(Mail(ActorName.FACADE, StartLoads()))
    box = rt.new_mailbox("an answer that never comes")
    with pytest.raises(LivelockError, match=r"waited 501 deliveries for an answer that never comes \(max_steps=500\)"):
        box.get()
    _stop(d)


class _Blocker(HiActor):
    name = ActorName.TREE

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        # A bug: a handler waits on another actor's reply.
        self._directory.ref(ActorName.PREFETCH).ask(Mail(self.name, message, ask=True))
        return None

    def check_invariants(self) -> None:
        return None

    def statistics(self) -> Message:
        return _stats(0)


def test_strict_mode_refuses_a_blocking_get_inside_a_handler() -> None:
    rt = DeterministicRuntime(seed=1, strict=True)
    d = Directory()
    svc = rt.services
    d.register(ActorName.TREE, rt.start(_Blocker, services=svc, directory=d))
    d.register(ActorName.PREFETCH, rt.start(_Pong, broken=False, services=svc, directory=d))
    with pytest.raises(BlockingGetError, match="the tree actor waited for a reply inside a handler"):
        d.ref(ActorName.TREE).ask(Mail(ActorName.FACADE, DrainWrites(), ask=True))
    _stop(d)


# -- virtual time -----------------------------------------------------------------------


class _Alarm(HiActor):
    name = ActorName.TREE

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.fired_at: list[float] = []

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        match message:
            case StartLoads():
                self.send_later(2.5, self.name, CopyLayer(batch=1, layer=0))
            case CopyLayer():
                self.fired_at.append(self._services.clock.now_s())
            case _:
                self.unknown(message)
        return None

    def check_invariants(self) -> None:
        return None

    def statistics(self) -> Message:
        return _stats(len(self.fired_at))


def test_timers_fire_in_virtual_time_only_when_nothing_else_can_run() -> None:
    rt = DeterministicRuntime(seed=1)
    d = Directory()
    d.register(ActorName.TREE, rt.start(_Alarm, services=rt.services, directory=d))
    ref = d.ref(ActorName.TREE)
    ref.tell(Mail(ActorName.FACADE, StartLoads()))
    rt.run_until_idle()
    assert rt.clock.now_s() == 0.0
    assert ref.ask(Mail(ActorName.FACADE, GetStatistics(), ask=True)).ops_done == 0
    box = rt.new_mailbox("the alarm")
    with pytest.raises(DeadlockError):
        box.get()  # the timer fires while waiting, then nothing else can happen
    assert rt.clock.now_s() == 2.5
    assert ref.ask(Mail(ActorName.FACADE, GetStatistics(), ask=True)).ops_done == 1
    _stop(d)


def test_racing_timers_can_fire_before_pending_deliveries() -> None:
    early = 0
    for seed in range(20):
        rt = DeterministicRuntime(seed=seed, timers_race=True)
        d = Directory()
        d.register(ActorName.TREE, rt.start(_Alarm, services=rt.services, directory=d))
        ref = d.ref(ActorName.TREE)
        ref.tell(Mail(ActorName.FACADE, StartLoads()))
        for _ in range(3):
            ref.tell(Mail(ActorName.FACADE, CopyLayer(batch=9, layer=0)))
        rt.step()  # StartLoads: arms the timer
        rt.step()  # either the timer or the next mail
        early += rt.schedule[-1].actor == "timer:tree"
        _stop(d)
    assert 0 < early < 20


# -- strategies ---------------------------------------------------------------------------


def test_pct_lowers_the_running_actor_at_its_change_points() -> None:
    pct = PCTStrategy(5, depth=3, steps=10)
    picks = [pct.choose(i, ["a", "b", "c"]) for i in range(12)]
    assert len(set(picks)) >= 2, "two change points must switch the running actor at least once"
    again = PCTStrategy(5, depth=3, steps=10)
    assert [again.choose(i, ["a", "b", "c"]) for i in range(12)] == picks


def test_pct_with_depth_one_never_switches() -> None:
    pct = PCTStrategy(9, depth=1, steps=10)
    assert len({pct.choose(i, ["a", "b", "c"]) for i in range(12)}) == 1


def test_replay_repeats_a_recorded_schedule_and_reports_divergence() -> None:
    rec = RandomStrategy(3)
    recorded = [rec.choose(i, ["a", "b"]) for i in range(8)]
    replay = ReplayStrategy(recorded)
    assert [replay.choose(i, ["a", "b"]) for i in range(8)] == recorded
    with pytest.raises(ScheduleDivergedError, match="step 0: the recorded schedule picks"):
        ReplayStrategy(["zzz"]).choose(0, ["a", "b"])


def test_replaying_a_recorded_schedule_reproduces_the_log() -> None:
    log_a: list[str] = []
    log_b: list[str] = []

    def go(strategy: Any, log: list[str]) -> DeterministicRuntime:
        rt = DeterministicRuntime(seed=11, strategy=strategy, observe=lambda r, m: log.append(f"{r}{m!r}"))
        cfg = Config(layers=2, kv_heads=1, head_dim=8, page_size=2, device_slots=32, host_slots=64)
        with System(cfg, runtime=rt, stand_ins=(ActorName.TREE,), stand_in=Probe) as s:
            from hicache.messages import AllocateSlots, SlotDemand, WriteKV

            got = s.ask(ActorName.DEVICE, AllocateSlots(op_id=1, demands=(SlotDemand(request_id="r", tokens=8),), allocs=(), commits=(), evict=False))
            for i in range(4):  # one page of two slots each
                s.tell(ActorName.WRITE, WriteKV(op_id=i, device=got.grants[0].pages[i:i + 1],
                                                host=Indices.of([i])), sender=ActorName.TREE)
            s.probes[ActorName.TREE].collect(4)
        return rt

    first = go(PCTStrategy(11, depth=2, steps=50), log_a)
    go(ReplayStrategy([s.actor for s in first.schedule]), log_b)
    assert log_a == log_b and log_a


# -- the pykka contract ------------------------------------------------------------------


def test_pykka_still_has_the_three_hooks_the_deterministic_runtime_overrides() -> None:
    assert importlib.metadata.version("pykka").split(".")[0] == "4"
    actor_src = inspect.getsource(pykka.Actor.__init__)
    assert "self._create_actor_inbox()" in actor_src
    assert "obj._start_actor_loop()" in inspect.getsource(pykka.Actor.start.__func__)
    assert "_create_future()" in inspect.getsource(pykka.ActorRef.ask)
    for hook in ("_create_actor_inbox", "_create_future", "_start_actor_loop"):
        assert hook in pykka.ThreadingActor.__dict__, f"pykka.ThreadingActor no longer defines {hook}"
    # ThreadedRuntime._thread_class starts an actor's thread as pykka does, keeping it to wait for at stop.
    start = inspect.getsource(pykka.ThreadingActor._start_actor_loop)
    assert "target=self._actor_loop" in start and "self.use_daemon_thread" in start and "start()" in start
    # ...and takes the mail left in its inbox when it stops (kept as in flight) before pykka's teardown drops it.
    assert "self._actor_loop_teardown()" in inspect.getsource(pykka.Actor._actor_loop)
    assert "self.actor_inbox.get()" in inspect.getsource(pykka.Actor._actor_loop_teardown)
    loop = inspect.getsource(pykka.Actor._actor_loop_running)
    # The deterministic runtime copies this loop body for one envelope; if pykka changes it, re-check.
    digest = hashlib.sha256(loop.encode()).hexdigest()[:16]
    assert digest == LOOP_DIGEST, f"pykka's actor loop changed (digest {digest}); re-check DeterministicRuntime._deliver"


LOOP_DIGEST = "4109f316d2be434e"
