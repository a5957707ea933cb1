"""Programmer errors sent to the actors: each raises a clear error at the asker,
names what was violated, changes nothing, and the actor keeps running."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from hicache.actors import LedgerError, SlotStateError, WrongSenderError
from hicache.actors._services import Failures
from hicache.messages import (
    ActorName,
    AdoptLoadedSlots,
    AllocateHost,
    AllocateSlots,
    CheckInvariants,
    CommitSlots,
    DeviceStatistics,
    FreeDeviceSlots,
    FreeHostSlots,
    GetStatistics,
    HostSlotState,
    Indices,
    InvariantsHeld,
    LoadKV,
    Message,
    ReleaseReason,
    SetHostState,
    SlotDemand,
    StartLoads,
    WriteKV,
)
from hicache.runtime import ActorFailedError, Config, System, ThreadedRuntime
from hicache.runtime.testing import Probe

S = HostSlotState
TREE, DEVICE, HOST, WRITE, LOAD = ActorName.TREE, ActorName.DEVICE, ActorName.HOST, ActorName.WRITE, ActorName.LOAD


@pytest.fixture
def tree(make_config: Callable[..., Config], start_system: Callable[..., Any]) -> Any:
    return start_system(make_config(page_size=4, device_pages=16, host_pages=32))


def _still_running(tree: Any, name: ActorName) -> None:
    """The actor that refused answers the next ask, and every invariant holds."""
    assert tree.system.ask(name, CheckInvariants()) == InvariantsHeld(actor=name)
    tree.system.check_invariants()


# -- double frees ------------------------------------------------------------------


def test_freeing_tree_device_pages_twice_is_refused_as_a_double_free(tree: Any) -> None:
    pages = tree.allocate({"r": 8})["r"]
    assert pages.tolist() == [0, 1]
    tree.release("r", pages, ReleaseReason.FINISHED)
    tree.free_device(pages)
    with pytest.raises(SlotStateError, match=r"cannot free device pages: slots 0..3 owned by free.*\(double free\?\)"):
        tree.ask(DEVICE, FreeDeviceSlots(pages=pages))
    _still_running(tree, DEVICE)
    assert tree.statistics(DEVICE).free_slots == 64


def test_freeing_host_pages_twice_is_refused_as_a_double_free(tree: Any) -> None:
    pages = tree.host_allocate(4)
    tree.host_free(pages)
    with pytest.raises(SlotStateError, match=r"illegal host page transition to FREE on free: page 0 is FREE.*\(double free\)"):
        tree.ask(HOST, FreeHostSlots(pages=pages))
    _still_running(tree, HOST)
    assert tree.host_allocate(4) == pages


def test_freeing_host_pages_while_a_write_is_in_flight_is_refused(tree: Any) -> None:
    pages = tree.host_allocate(4)
    tree.host_move(pages, S.WRITING)
    with pytest.raises(SlotStateError, match="page 0 is WRITING.*only RESERVED, SYNCED, HOST_ONLY pages may be freed"):
        tree.ask(HOST, FreeHostSlots(pages=pages))
    _still_running(tree, HOST)
    assert tree.statistics(HOST).slots_in(S.WRITING) == 4


# -- wrong senders -----------------------------------------------------------------


def test_a_host_free_not_from_the_tree_is_refused(tree: Any) -> None:
    pages = tree.host_allocate(4)
    with pytest.raises(
        WrongSenderError, match="freeing host slots is accepted only from the tree actor, got it from write"
    ):
        tree.system.ask(HOST, FreeHostSlots(pages=pages), sender=WRITE)
    _still_running(tree, HOST)
    assert tree.statistics(HOST).slots_in(S.RESERVED) == 4
    tree.host_free(pages)  # the tree may


@pytest.mark.parametrize("sender", [ActorName.FACADE, ActorName.LOAD, ActorName.PREFETCH])
@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda idx: FreeDeviceSlots(pages=idx), "freeing tree-owned device slots"),
        (lambda idx: AdoptLoadedSlots(pages=idx), "adopting loaded device slots"),
    ],
    ids=["free", "adopt"],
)
def test_tree_only_device_verbs_from_anyone_else_are_refused(
    tree: Any, sender: ActorName, make: Callable[[Indices], Message], what: str
) -> None:
    pages = tree.allocate_load(4)
    with pytest.raises(WrongSenderError, match=f"{what} is accepted only from the tree actor, got it from {sender.value}"):
        tree.system.ask(DEVICE, make(pages), sender=sender)
    _still_running(tree, DEVICE)
    assert tree.statistics(DEVICE).loading_slots == 4


# -- the request ledger ------------------------------------------------------------


def test_allocating_for_a_finished_request_names_the_request(tree: Any) -> None:
    pages = tree.allocate({"req-7": 4})["req-7"]
    tree.release("req-7", Indices(), ReleaseReason.FINISHED)
    message = AllocateSlots(op_id=1, demands=(SlotDemand(request_id="req-7", tokens=4),), allocs=(), commits=(), evict=False)
    with pytest.raises(LedgerError, match="request 'req-7' was already released.*never allocate after finish"):
        tree.ask(DEVICE, message, sender=ActorName.FACADE)
    _still_running(tree, DEVICE)
    assert tree.statistics(DEVICE).free_slots == 64
    assert tree.allocate({"req-8": 4})["req-8"] == pages


def test_committing_more_than_was_allocated_is_refused(tree: Any) -> None:
    tree.allocate({"r": 6})
    tree.commit("r", 2)
    message = CommitSlots(op_id=1, demands=(SlotDemand(request_id="r", tokens=5),))
    with pytest.raises(LedgerError, match=r"request 'r': committing 5 more slots would make committed=7 > allocated=6"):
        tree.ask(DEVICE, message, sender=ActorName.FACADE)
    _still_running(tree, DEVICE)
    assert tree.commit("r", 4).committed == 6


def test_releasing_a_request_twice_is_refused(tree: Any) -> None:
    tree.allocate({"r": 4})
    tree.release("r", Indices(), ReleaseReason.ABORTED)
    with pytest.raises(LedgerError, match="cannot release request 'r': it was already released"):
        tree.release("r", Indices(), ReleaseReason.ABORTED)
    _still_running(tree, DEVICE)


# -- the host state machine ------------------------------------------------------------


def test_an_illegal_host_page_transition_names_pages_and_states(tree: Any) -> None:
    pages = tree.host_allocate(8)
    with pytest.raises(
        SlotStateError,
        match=r"illegal host page transition to SYNCED on move to SYNCED: page 0 is RESERVED, page 1 is RESERVED$",
    ):
        tree.ask(HOST, SetHostState(pages=pages, state=S.SYNCED))
    _still_running(tree, HOST)
    assert tree.statistics(HOST).slots_in(S.RESERVED) == 8


def test_reserving_free_host_pages_by_a_state_change_is_refused(tree: Any) -> None:
    with pytest.raises(SlotStateError, match=r"to RESERVED.*page 0 is FREE"):
        tree.ask(HOST, SetHostState(pages=Indices.of([0]), state=S.RESERVED))
    _still_running(tree, HOST)
    assert tree.host_allocate(4 * 32) is not None  # every page is still free


@pytest.mark.parametrize(
    ("pages", "error"),
    [
        (lambda got: Indices.of([got[0], got[0]]), "host move to WRITING: a page appears twice in one call"),
        (lambda got: Indices.of([got[0], 32]), r"host move to WRITING: page number out of range 0..31"),
    ],
    ids=["twice", "out-of-range"],
)
def test_a_host_move_naming_a_page_twice_or_past_the_pool_is_refused(
    tree: Any, pages: Callable[[list[int]], Indices], error: str
) -> None:
    got = tree.host_allocate(8)
    with pytest.raises(SlotStateError, match=error):
        tree.ask(HOST, SetHostState(pages=pages(got.tolist()), state=S.WRITING))
    _still_running(tree, HOST)
    assert tree.statistics(HOST).slots_in(S.RESERVED) == 8  # nothing moved
    tree.host_move(got, S.WRITING)


@pytest.mark.parametrize(
    ("pages", "error"),
    [
        (lambda got: Indices.of([got[0], got[0]]), r"free device pages: a page appears twice in \[0, 0\]"),
        (lambda got: Indices.of([got[0], 16]), r"cannot free device pages: page number out of range 0..15"),
    ],
    ids=["twice", "out-of-range"],
)
def test_a_device_free_naming_a_page_twice_or_past_the_pool_is_refused(
    tree: Any, pages: Callable[[list[int]], Indices], error: str
) -> None:
    got = tree.allocate_load(8)
    with pytest.raises(SlotStateError, match=error):
        tree.ask(DEVICE, FreeDeviceSlots(pages=pages(got.tolist())))
    _still_running(tree, DEVICE)
    assert tree.statistics(DEVICE).loading_slots == 8  # nothing freed
    tree.free_device(got)


def test_a_host_allocation_that_is_not_whole_pages_is_refused(tree: Any) -> None:
    with pytest.raises(ValueError, match="host allocation of 6 slots is not whole pages of 4"):
        tree.ask(HOST, AllocateHost(op_id=1, tokens=6))
    _still_running(tree, HOST)


# -- messages an actor does not handle ------------------------------------------------------


@pytest.mark.parametrize(
    ("to", "message"),
    [
        (DEVICE, WriteKV(op_id=1, device=Indices(), host=Indices())),
        (HOST, StartLoads()),
        (WRITE, LoadKV(op_id=1, host=Indices(), device=Indices())),
        (LOAD, AllocateHost(op_id=1, tokens=4)),
        (DEVICE, InvariantsHeld(actor=DEVICE)),
    ],
    ids=lambda v: v.value if isinstance(v, ActorName) else type(v).__name__,
)
def test_a_registered_message_an_actor_does_not_handle_is_a_type_error_naming_it(
    tree: Any, to: ActorName, message: Message
) -> None:
    name = type(message).__name__
    with pytest.raises(TypeError, match=f"the {to.value} actor does not handle {name}; check docs/messages.md"):
        tree.system.ask(to, message, sender=TREE)
    _still_running(tree, to)


def test_an_actor_refuses_anything_that_is_not_mail(tree: Any) -> None:
    with pytest.raises(TypeError, match="device received str; actors exchange Mail"):
        tree.system.directory.ref(DEVICE).ask("allocate please")
    _still_running(tree, DEVICE)
    assert isinstance(tree.system.ask(DEVICE, GetStatistics()), DeviceStatistics)


# -- a bad tell is not swallowed -----------------------------------------------------------------


class _SignallingFailures(Failures):
    """Failures that also signal when one is reported (so the test waits on an event)."""

    def __init__(self) -> None:
        super().__init__()
        self.reported = threading.Event()

    def report(self, actor: ActorName, error: BaseException) -> None:
        super().report(actor, error)
        self.reported.set()


def test_a_told_programmer_error_stops_the_actor_and_the_next_call_says_so(make_config: Callable[..., Config]) -> None:
    runtime = ThreadedRuntime()
    failures = runtime.services.failures = _SignallingFailures()
    with System(make_config(), runtime=runtime, stand_ins=(TREE,), stand_in=Probe) as system:
        system.tell(HOST, FreeHostSlots(pages=Indices.of([0])), sender=TREE)  # never allocated
        assert failures.reported.wait(30)
        with pytest.raises(ActorFailedError, match=r"the host actor failed: illegal host page transition") as err:
            system.ask(DEVICE, GetStatistics())
        assert isinstance(err.value.__cause__, SlotStateError)
        assert not system.directory.ref(HOST).is_alive()
