"""Shared fixtures: small configs, cores that check their invariants after every
call, a running `System` in which the test speaks as the tree, a delivery gate
that holds an actor at a chosen message, and the fingerprint oracle.

KV shapes stay tiny (2 layers, 1 head, head_dim 8) so the whole suite runs in
seconds on two cores.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from hicache.actors import FaultPlan, KVBuffer, KVShape, NoFaults
from hicache.messages import (
    ActorName,
    AdoptLoadedSlots,
    AllocateHost,
    AllocateLoadSlots,
    AllocateSlots,
    CommitSlots,
    Finished,
    FreeDeviceSlots,
    FreeHostSlots,
    GetStatistics,
    HostAllocated,
    HostInsufficient,
    HostSlotState,
    Indices,
    LoadDone,
    LoadFailed,
    LoadKV,
    LoadsStarted,
    Message,
    ReleaseReason,
    ReleaseRequests,
    SetHostState,
    SlotDemand,
    SlotRelease,
    SlotsAllocated,
    SlotsCommitted,
    SlotsInsufficient,
    StartLoads,
    WriteDone,
    WriteFailed,
    WriteKV,
)
from hicache.runtime import Config, HiCache, HostLayout, LoadFailedError, Request, System, ThreadedRuntime
from hicache.runtime.testing import DeterministicRuntime, Probe
from hicache.runtime.testing.oracle import FingerprintOracle

GATE_TIMEOUT_S = 10.0
"""A held actor is let go after this long even if the test forgets (or fails) to open the gate."""


# -- configs -------------------------------------------------------------------


# -- KV buffers for copy tests -------------------------------------------------------------


def filled_kv(shape: KVShape, layout: HostLayout, pages: int, seed: int) -> KVBuffer:
    """A CPU buffer of `pages` pages whose every element is distinct (exact in float32)."""
    buf = KVBuffer.allocate(shape, pages * shape.page_size, layout, "cpu")
    g = torch.Generator().manual_seed(seed)
    buf.tensor.copy_(torch.randperm(buf.tensor.numel(), generator=g).view(buf.tensor.shape).float())
    return buf


def kv_of_slot(buf: KVBuffer, slot: int) -> torch.Tensor:
    """The `[2, L, H, D]` KV of one slot, as a view."""
    if buf.page_first:
        p = buf.shape.page_size
        return buf.tensor[slot // p, :, :, slot % p]
    return buf.tensor[:, :, slot]


def reference_copy(src: KVBuffer, src_idx: list[int], dst: KVBuffer, dst_idx: list[int], layer: int | None) -> torch.Tensor:
    """What `dst.tensor` should hold after copying `src_idx[i]` to `dst_idx[i]` (all layers, or
    `layer`): a slot-by-slot copy into a clone."""
    want = KVBuffer(dst.shape, dst.tensor.clone(), dst.layout)
    for s, d in zip(src_idx, dst_idx, strict=True):
        if layer is None:
            kv_of_slot(want, d).copy_(kv_of_slot(src, s))
        else:
            kv_of_slot(want, d)[:, layer].copy_(kv_of_slot(src, s)[:, layer])
    return want.tensor


def pages_to_slots(pages: Indices | torch.Tensor | list[int], page_size: int) -> torch.Tensor:
    """The slots of page numbers, in order: what the oracle and the KV buffers take."""
    t = pages.as_tensor() if isinstance(pages, Indices) else torch.as_tensor(pages, dtype=torch.int64)
    return (t.unsqueeze(1) * page_size + torch.arange(page_size)).reshape(-1)


def small_config(*, page_size: int = 4, device_pages: int = 16, host_pages: int = 32, **changes: Any) -> Config:
    """A tiny, valid Config: 2 layers, 1 KV head, head_dim 8, capacities in pages. No pages
    ahead (`ahead_slots=0`): an allocation gets exactly the pages it needs, which the tests
    count; the tests of pages ahead ask for them."""
    values: dict[str, Any] = {
        "layers": 2,
        "kv_heads": 1,
        "head_dim": 8,
        "page_size": page_size,
        "device_slots": device_pages * page_size,
        "host_slots": host_pages * page_size,
        "ahead_slots": 0,
    }
    values.update(changes)
    return Config(**values)


@pytest.fixture
def make_config() -> Callable[..., Config]:
    """`make_config(page_size=4, device_pages=16, host_pages=32, **config_fields)`."""
    return small_config


@pytest.fixture
def oracle_for() -> Callable[[Config], FingerprintOracle]:
    """A fingerprint oracle for the KV shape of a config."""
    return lambda config: FingerprintOracle(KVShape.of(config))


# -- cores that check themselves -------------------------------------------------


class Checked:
    """Wraps a core: every method call is followed by `check_invariants()`, also
    when the call raised (a refused operation must leave the core consistent)."""

    def __init__(self, core: Any) -> None:
        object.__setattr__(self, "core", core)
        object.__setattr__(self, "checks", 0)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.core, name)
        if not callable(value) or name == "check_invariants":
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return value(*args, **kwargs)
            finally:
                self.core.check_invariants()
                object.__setattr__(self, "checks", self.checks + 1)

        return call


@pytest.fixture
def checked() -> Callable[[Any], Any]:
    """`checked(core)`: the core, checking its invariants after every call."""
    return Checked


# -- a gate on deliveries --------------------------------------------------------


@dataclass
class _Hold:
    receiver: ActorName
    matches: Callable[[Message], bool]
    reached: threading.Event = field(default_factory=threading.Event)
    opened: threading.Event = field(default_factory=threading.Event)


class Gate:
    """A delivery observer (`ThreadedRuntime(observe=gate)`) that holds an actor
    before it handles the first message matching a rule, until `open()`.

    This orders deliveries without sleeping: whatever the test sends while the
    actor is held is in its inbox before anything the held message makes it send.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: list[_Hold] = []

    def hold(self, receiver: ActorName, matches: Callable[[Message], bool]) -> _Hold:
        h = _Hold(receiver, matches)
        with self._lock:
            self._holds.append(h)
        return h

    def open(self) -> None:
        with self._lock:
            holds, self._holds = self._holds, []
        for h in holds:
            h.opened.set()

    def __call__(self, receiver: ActorName, mail: Any) -> None:
        with self._lock:
            hit = next(
                (h for h in self._holds if h.receiver is receiver and not h.reached.is_set() and h.matches(mail.message)),
                None,
            )
            if hit is not None:
                hit.reached.set()
        if hit is not None:
            hit.opened.wait(GATE_TIMEOUT_S)


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.open()


# -- a running system, the test speaking as the tree -------------------------------


class TreeSide:
    """The test in the tree's place: sends as `ActorName.TREE` (as the facade where the
    scheduler is the sender: allocate, commit, start loads), receives the tree's mail
    from its probe, and checks every actor's invariants after every step.

    As in the messages, device and host memory are named by page numbers; `slots()`
    gives the slots of pages (for the oracle, which reads and writes slots)."""

    def __init__(self, system: System) -> None:
        self.system = system
        self.probe = system.probes[ActorName.TREE]
        self._op = 0

    # -- raw ---------------------------------------------------------------------

    def next_op(self) -> int:
        self._op += 1
        return self._op

    def ask(self, to: ActorName, message: Message, *, sender: ActorName = ActorName.TREE) -> Any:
        try:
            return self.system.ask(to, message, sender=sender)
        finally:
            self.system.check_invariants()

    def tell(self, to: ActorName, message: Message) -> None:
        self.system.tell(to, message, sender=ActorName.TREE)

    def expect(self, *types: type[Message]) -> Any:
        message = self.probe.expect(*types)
        self.system.check_invariants()
        return message

    def statistics(self, name: ActorName) -> Any:
        return self.system.ask(name, GetStatistics())

    def slots(self, pages: Indices) -> torch.Tensor:
        """The slots of `pages`, in order."""
        return pages_to_slots(pages, self.system.config.page_size)

    # -- device ------------------------------------------------------------------

    def allocate(self, demands: dict[str, int]) -> dict[str, Indices] | SlotsInsufficient:
        op = self.next_op()
        reply = self.ask(
            ActorName.DEVICE,
            AllocateSlots(op_id=op, demands=tuple(SlotDemand(request_id=r, tokens=n) for r, n in demands.items()),
                          allocs=(), commits=(), evict=False),
            sender=ActorName.FACADE,
        )
        assert reply.op_id == op
        if isinstance(reply, SlotsInsufficient):
            return reply
        assert isinstance(reply, SlotsAllocated)
        return {g.request_id: g.pages for g in reply.grants}

    def commit(self, request_id: str, tokens: int) -> Any:
        op = self.next_op()
        reply = self.ask(
            ActorName.DEVICE, CommitSlots(op_id=op, demands=(SlotDemand(request_id=request_id, tokens=tokens),)),
            sender=ActorName.FACADE,
        )
        assert isinstance(reply, SlotsCommitted) and reply.op_id == op
        return reply.entries[0]

    def release(self, request_id: str, adopt: Indices, reason: ReleaseReason) -> Any:
        op = self.next_op()
        release = SlotRelease(request_id=request_id, adopt=adopt, reason=reason, allocs=0, commits=0)
        assert self.ask(ActorName.DEVICE, ReleaseRequests(op_id=op, releases=(release,))) is None
        reply = self.system.next_reply(5.0)  # the device answers the facade, whose finish a release is
        assert isinstance(reply, Finished) and reply.op_id == op
        return reply.entries[0]

    def allocate_load(self, tokens: int) -> Indices | None:
        reply = self.ask(ActorName.DEVICE, AllocateLoadSlots(op_id=self.next_op(), tokens=tokens))
        if isinstance(reply, SlotsInsufficient):
            return None
        return reply.grants[0].pages

    def adopt_loaded(self, pages: Indices) -> None:
        assert self.ask(ActorName.DEVICE, AdoptLoadedSlots(pages=pages)) is None

    def free_device(self, pages: Indices) -> None:
        assert self.ask(ActorName.DEVICE, FreeDeviceSlots(pages=pages)) is None

    # -- host --------------------------------------------------------------------

    def host_allocate(self, tokens: int) -> Indices | None:
        op = self.next_op()
        reply = self.ask(ActorName.HOST, AllocateHost(op_id=op, tokens=tokens))
        assert reply.op_id == op
        if isinstance(reply, HostInsufficient):
            return None
        assert isinstance(reply, HostAllocated)
        return reply.pages

    def host_move(self, pages: Indices, state: HostSlotState) -> None:
        assert self.ask(ActorName.HOST, SetHostState(pages=pages, state=state)) is None

    def host_free(self, pages: Indices) -> None:
        assert self.ask(ActorName.HOST, FreeHostSlots(pages=pages)) is None

    # -- transfers ---------------------------------------------------------------

    def write(self, device: Indices, host: Indices, op_id: int | None = None) -> WriteDone | WriteFailed:
        """One D2H write through the stream (pages); the host pages go RESERVED -> WRITING -> SYNCED
        (or back to RESERVED if it failed)."""
        op = self.next_op() if op_id is None else op_id
        self.host_move(host, HostSlotState.WRITING)
        self.tell(ActorName.WRITE, WriteKV(op_id=op, device=device, host=host))
        reply = self.expect(WriteDone, WriteFailed)
        assert reply.op_id == op
        self.host_move(host, HostSlotState.SYNCED if isinstance(reply, WriteDone) else HostSlotState.RESERVED)
        return reply

    def load(self, host: Indices, device: Indices, op_id: int | None = None) -> LoadDone | LoadFailed:
        """One H2D load batch (pages); the host pages go HOST_ONLY -> LOADING -> SYNCED (or back to
        HOST_ONLY if it failed); the forward pass's per-layer waits succeed or raise."""
        op = self.next_op() if op_id is None else op_id
        self.host_move(host, HostSlotState.LOADING)
        self.tell(ActorName.LOAD, LoadKV(op_id=op, host=host, device=device))
        started = self.ask(ActorName.LOAD, StartLoads(), sender=ActorName.FACADE)
        assert isinstance(started, LoadsStarted) and started.ops == (op,)
        assert self.expect(LoadsStarted) == started  # told to the tree too, before the load's outcome
        assert self.system.ring is not None
        waiter = self.system.ring.waiter(started.batch)
        reply = self.expect(LoadDone, LoadFailed)
        assert reply.op_id == op
        if isinstance(reply, LoadDone):
            waiter.wait_all(timeout_s=30)
            self.host_move(host, HostSlotState.SYNCED)
        else:
            with pytest.raises(LoadFailedError):
                waiter.wait_layer(0, timeout_s=30)
            self.host_move(host, HostSlotState.HOST_ONLY)
        return reply


RUNTIME_KINDS = ("threads", "deterministic")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Actor tests run on both runtimes; those that hold threads at a `gate` run on threads."""
    if "runtime_kind" in metafunc.fixturenames:
        kinds = ("threads",) if "gate" in metafunc.fixturenames else RUNTIME_KINDS
        metafunc.parametrize("runtime_kind", kinds)


def make_runtime(kind: str, *, seed: int = 0, faults: FaultPlan | None = None, observe: Any = None) -> Any:
    if kind == "threads":  # the streams on threads of their own, as on CUDA (the facade's tests run the default)
        return ThreadedRuntime(seed=seed, faults=faults, observe=observe, write_stream_thread=True)
    return DeterministicRuntime(seed=seed, faults=faults, observe=observe)


def opened_caches(kind: str, **defaults: Any) -> Iterator[Callable[..., HiCache]]:
    """For a fixture: `open_(faults=None, **config_fields)` starts a `HiCache` of `small_config`
    (`defaults`, then the fields) on a runtime of `kind`; at teardown each is checked, then closed."""
    opened: list[HiCache] = []

    def open_(*, faults: FaultPlan | None = None, **fields: Any) -> HiCache:
        hc = HiCache(small_config(**{**defaults, **fields}), runtime=make_runtime(kind, seed=3, faults=faults))
        opened.append(hc.start())
        return hc

    yield open_
    for hc in opened:
        hc.check_invariants()
        hc.close()


def stored_only(hc: HiCache, prompt: list[int], rid: str = "a") -> None:
    """Serve one request of `prompt` to its end, let its pages be written through to host
    memory and backed up to storage, then evict them from device and host memory: the
    prompt's prefix is cached in storage alone."""
    [adm] = hc.admit([Request(rid, prompt[:-1])])
    hc.allocate({rid: len(prompt)})
    hc.commit({rid: prompt})
    hc.finish([adm.handle])
    hc.quiesce()
    hc.evict_device(hc.config.device_slots)
    hc.evict_host(hc.config.host_slots)


class FailFirstLoads(NoFaults):
    """A fault plan: the first `n` load-back batches fail (their copies are never marked done);
    everything else runs. `left`: how many are still to fail."""

    def __init__(self, n: int = 1) -> None:
        self.left = n

    def transfer_fault(self, stream: ActorName, op_ids: tuple[int, ...]) -> str | None:
        if stream is ActorName.LOAD and self.left:
            self.left -= 1
            return "injected: a load-back fails"
        return None


@pytest.fixture
def start_system(runtime_kind: str) -> Iterator[Callable[..., TreeSide]]:
    """`start_system(config, faults=None, observe=None)`: a running System with the tree
    stood in by a probe, on threads or on the deterministic runtime (the test runs on
    both). At teardown every actor's invariants are checked, then it stops."""
    with contextlib.ExitStack() as stack:

        def start(config: Config, *, faults: FaultPlan | None = None, observe: Any = None) -> TreeSide:
            runtime = make_runtime(runtime_kind, faults=faults, observe=observe)
            system = stack.enter_context(System(config, runtime=runtime, stand_ins=(ActorName.TREE,), stand_in=Probe))
            stack.callback(system.check_invariants)
            if isinstance(observe, Gate):
                stack.callback(observe.open)  # runs first: never check or stop a held actor
            return TreeSide(system)

        yield start

