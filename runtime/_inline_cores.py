"""`InlineCores`: `TreeCore`, `DeviceCore` and `HostCore` driven in the caller's thread,
no actors, each message through its receiver's route table as between the actors.

A verb of the tree (`tree.admit(op, ...)`, say) fills its outbox; `_run_outbox(op)` delivers
that outbox in order, and what the deliveries lead to, until it is empty, and answers
the tree's reply to `op`. The device and the host answer at once through their routes,
as their shells do (the device's own outbox, a release's `Finished`, goes on to its
receiver); their answers go back to the tree through the tree's routes. What goes to an
actor with no core here (the streams, the prefetcher) is the subclass's to play
(`_play`): the bench's direct side copies writes, the simulator answers every transfer
at once.

This is not actor code: it serves the benches and the simulator, which time or count
what the cores decide.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from hicache.actors import DEVICE_ROUTES, HOST_ROUTES, TREE_ROUTES, DeviceCore, HostCore, HostSide, TreeCore
from hicache.messages import ActorName, Message
from hicache.messages.config import Config


class InlineCores:
    """The three cores in this thread; subclasses play the actors that have no core here."""

    def __init__(self, config: Config) -> None:
        ids = itertools.count(1)
        self._next_id: Callable[[], int] = lambda: next(ids)
        self.tree = TreeCore(config, self._next_id)
        self.device = DeviceCore(config)
        self.host = HostCore(config)
        self._host = HostSide(self.host)
        self._replies: dict[int, Message] = {}

    def _run_outbox(self, op: int) -> Message:
        """Deliver the tree's outbox (and what it leads to) until nothing is left; the reply to `op`."""
        tree = self.tree
        while tree.outbox:
            out, tree.outbox = tree.outbox, []
            for to, message in out:
                self._one(to, message)
        return self._replies.pop(op)

    def _one(self, to: ActorName, message: Message) -> None:
        """One message of the tree's outbox, through its receiver's routes; an answer goes back
        to the tree through the tree's."""
        if to is ActorName.FACADE:
            self._replies[message.op_id] = message  # type: ignore[attr-defined]
            return
        if to is ActorName.DEVICE:
            reply = DEVICE_ROUTES.deliver(self.device, ActorName.TREE, message)
            out, self.device.outbox = self.device.outbox, []
            for receiver, answer in out:  # a release's `Finished`, to the facade
                self._one(receiver, answer)
        elif to is ActorName.HOST:
            reply = HOST_ROUTES.deliver(self._host, ActorName.TREE, message)
        else:
            reply = self._play(to, message)
        if reply is not None:
            TREE_ROUTES.deliver(self.tree, to, reply)

    def _play(self, to: ActorName, message: Message) -> Message | None:
        """A message to an actor with no core here: check it against `to`'s routes, act it
        out, and answer what that actor would answer the tree at once (None: nothing now)."""
        raise AssertionError(f"{type(self).__name__} plays no {to.value} actor, yet the tree sent it {message!r}")
