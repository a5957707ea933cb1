"""The route tables: every message an actor takes has a route naming who may send it, every
message type is routed to one actor or answers the facade, and each real actor refuses a
message from any actor its route does not name (or one it has no route for), changing nothing."""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Iterator
from typing import Any

import pytest

from hicache.actors import ROUTES, Route, Routes, WrongSenderError
from hicache.messages import (
    MESSAGE_TYPES,
    ActorName,
    CheckInvariants,
    Finished,
    GetStatistics,
    Indices,
    Message,
    ReleaseRequests,
    StartLoads,
    Tokens,
    WriteDone,
)
from hicache.runtime import System
from hicache.runtime.testing import DeterministicRuntime

from conftest import small_config

ACTORS = tuple(n for n in ActorName if n is not ActorName.FACADE)

ANSWERED_BY_EVERY_ACTOR = {CheckInvariants, GetStatistics}
"""In no table: `HiActor` answers them from anyone."""

NOT_DELIVERED_TO_ACTORS = {
    # what the actors answer the facade (its inbox, or the reply to its ask); `Evicted` answers
    # the device too (an allocation's eviction) and `LoadsStarted` is told to the tree too, so
    # they are routed
    "Admitted", "Cached", "Finished", "FactsApplied", "LocalFacts", "PrefetchReadiness",
    "PrefetchesSettled", "PrefetchesStarted", "PrefetchesStopped", "TreeDigest", "SlotsCommitted",
    "InvariantsHeld",
    # statistics records, the answer to GetStatistics
    "DeviceStatistics", "HostStatistics", "PrefetcherStatistics", "StreamStatistics", "TreeStatistics",
    # records inside other messages
    "Admission", "AdmitItem", "CacheItem", "CachedPrefix", "Durations", "FinishItem", "LedgerEntry",
    "PrefetchEndCounts", "SlotDemand", "SlotGrant", "SlotRelease",
}
"""Registered message types no actor receives, by name: a new message must be routed or listed."""


def sample(cls: type[Message]) -> Message:
    """An instance of `cls` with every field empty or zero: enough for a refusal, which
    comes before any handler reads a field."""
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _empty(hints[f.name]) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]


def _empty(t: Any) -> Any:
    if typing.get_origin(t) is tuple:
        return ()
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return next(iter(t))
    if isinstance(t, type) and issubclass(t, Message):
        return sample(t)
    return {int: 0, float: 0.0, bool: False, str: "", Indices: Indices(), Tokens: Tokens.of([])}[t]


@pytest.fixture(scope="module")
def system() -> Iterator[System]:
    with System(small_config(), runtime=DeterministicRuntime(seed=0)) as s:
        yield s


# -- the tables --------------------------------------------------------------------------


def test_every_actor_has_a_table_whose_routes_name_their_senders() -> None:
    assert set(ROUTES) == set(ACTORS)
    for name, routes in ROUTES.items():
        assert routes.actor is name and len(routes) > 0
        for cls, route in routes.items():
            assert issubclass(cls, Message) and cls not in ANSWERED_BY_EVERY_ACTOR, (name, cls)
            assert route.senders and all(isinstance(s, ActorName) for s in route.senders), (name, cls)
            assert route.what and callable(route.call), (name, cls)


def test_every_message_is_routed_to_one_actor_or_answers_the_facade() -> None:
    receivers: dict[str, list[str]] = {}
    for name, routes in ROUTES.items():
        for cls in routes:
            receivers.setdefault(cls.__name__, []).append(name.value)
    twice = {m: r for m, r in receivers.items() if len(r) > 1}
    assert not twice, f"message types routed to more than one actor: {twice}"
    assert not set(receivers) & NOT_DELIVERED_TO_ACTORS, "a routed message is listed as not delivered"
    everything = {cls.__name__ for cls in MESSAGE_TYPES.values()}
    declared = set(receivers) | NOT_DELIVERED_TO_ACTORS | {cls.__name__ for cls in ANSWERED_BY_EVERY_ACTOR}
    assert everything - declared == set(), "registered messages no table routes (add a route, or list them above)"
    assert declared - everything == set(), "names listed here that are not registered messages"


def test_the_scheduler_sends_its_slot_verbs_and_the_tree_sends_everything_else_to_the_pools() -> None:
    by_sender = {
        (name.value, cls.__name__): tuple(s.value for s in route.senders)
        for name, routes in ROUTES.items() if name in (ActorName.DEVICE, ActorName.HOST)
        for cls, route in routes.items()
    }
    assert {k for k, v in by_sender.items() if v == ("facade",)} == {("device", "AllocateSlots"), ("device", "CommitSlots")}
    assert all(v in (("facade",), ("tree",)) for v in by_sender.values()), by_sender


# -- the actors use them -------------------------------------------------------------------


@pytest.mark.parametrize("actor", ACTORS, ids=lambda a: a.value)
def test_each_actor_refuses_every_message_from_a_sender_its_route_does_not_name(system: System, actor: ActorName) -> None:
    before = system.statistics()
    refused = 0
    for cls, route in ROUTES[actor].items():
        allowed = " or ".join(s.value for s in route.senders)
        for sender in ActorName:
            if sender in route.senders:
                continue
            with pytest.raises(WrongSenderError, match=f"^{route.what} is accepted only from the {allowed} actor, "
                                                       f"got it from {sender.value} "):
                system.ask(actor, sample(cls), sender=sender)
            refused += 1
    assert refused >= len(ROUTES[actor]) * (len(ActorName) - 2)
    system.check_invariants()  # every actor still runs
    assert system.statistics() == before, "a refused message changed something"


@pytest.mark.parametrize("actor", ACTORS, ids=lambda a: a.value)
def test_each_actor_refuses_a_message_it_has_no_route_for(system: System, actor: ActorName) -> None:
    before = system.statistics()
    others = [cls for cls in MESSAGE_TYPES.values() if cls not in ROUTES[actor] and cls not in ANSWERED_BY_EVERY_ACTOR]
    for cls in others:
        with pytest.raises(TypeError, match=f"^the {actor.value} actor does not handle {cls.__name__}; "):
            system.ask(actor, sample(cls))
    system.check_invariants()
    assert system.statistics() == before


def test_the_device_takes_a_release_only_from_the_tree(system: System) -> None:
    with pytest.raises(WrongSenderError, match="releasing finished requests' slots is accepted only from the tree "
                                               "actor, got it from facade"):
        system.ask(ActorName.DEVICE, ReleaseRequests(op_id=1, releases=()))
    assert system.ask(ActorName.DEVICE, ReleaseRequests(op_id=2, releases=()), sender=ActorName.TREE) is None
    answer = system.next_reply(5.0)  # to the facade, whose finish the tree's release is
    assert isinstance(answer, Finished) and answer.op_id == 2 and answer.entries == ()


def test_the_load_stream_starts_loads_only_for_the_scheduler(system: System) -> None:
    with pytest.raises(WrongSenderError, match="starting the queued loads is accepted only from the facade actor"):
        system.ask(ActorName.LOAD, StartLoads(), sender=ActorName.TREE)
    assert system.ask(ActorName.LOAD, StartLoads()).batch == 0


# -- the helper ------------------------------------------------------------------------------


def _note(target: list[Message], m: Message) -> str:
    target.append(m)
    return "handled"


def test_a_table_delivers_to_its_handler_and_checks_first() -> None:
    routes: Routes[list[Message]] = Routes(ActorName.TREE, {WriteDone: ((ActorName.WRITE, ActorName.LOAD), _note)})
    seen: list[Message] = []
    done = WriteDone(op_id=1, slots=4)
    assert routes.deliver(seen, ActorName.LOAD, done) == "handled" and seen == [done]
    assert routes.check(ActorName.WRITE, done) is routes[WriteDone]
    assert routes[WriteDone] == Route(senders=(ActorName.WRITE, ActorName.LOAD), call=_note, what="WriteDone")
    with pytest.raises(WrongSenderError, match="^WriteDone is accepted only from the write or load actor, got it from host "):
        routes.deliver(seen, ActorName.HOST, done)
    with pytest.raises(TypeError, match="^the tree actor does not handle StartLoads; "):
        routes.deliver(seen, ActorName.WRITE, StartLoads())
    assert seen == [done] and list(routes) == [WriteDone] and len(routes) == 1


@pytest.mark.parametrize(
    ("table", "error"),
    [
        ({int: (ActorName.TREE, _note)}, "the tree actor's route for 'int': the key must be a message class"),
        ({WriteDone: (ActorName.TREE,)}, "give \\(senders, handler\\) or \\(senders, handler, what\\)"),
        ({WriteDone: ((), _note)}, "senders must be one ActorName or a tuple of distinct ones, got \\(\\)"),
        ({WriteDone: ("tree", _note)}, "senders must be one ActorName or a tuple of distinct ones, got 'tree'"),
        ({WriteDone: ((ActorName.TREE, ActorName.TREE), _note)}, "a tuple of distinct ones"),
        ({WriteDone: (ActorName.TREE, "on_write_done")}, "the handler must be callable, got 'on_write_done'"),
    ],
    ids=["not-a-message", "no-handler", "no-sender", "sender-not-a-name", "sender-twice", "handler-not-callable"],
)
def test_a_malformed_route_is_a_one_line_error_naming_it(table: dict[Any, Any], error: str) -> None:
    with pytest.raises(TypeError, match=error) as raised:
        Routes(ActorName.TREE, table)
    assert "\n" not in str(raised.value)
