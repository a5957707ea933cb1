"""Settled holds: what a settled prefetch brought stays in host memory until its request uses it.

Between a prefetch's settlement and its request's admission, host eviction must not
undo the read: the deepest node the prefetch reached (and so the path to it) is
host-pinned, per request, until the request is admitted (its lock holds what it uses
from then on) or leaves.
"""

from __future__ import annotations

from collections import OrderedDict

from ._errors import InvariantError
from ._radix import RadixTree
from ._radix_node import Node

SETTLED_HELD_MAX = 4096
"""Ready requests whose settled prefetch pages are held in host memory for them at once; past
it, the oldest hold is dropped (a scheduler that never admits a ready request must not pin
host memory for ever)."""


class SettledHolds:
    def __init__(self, tree: RadixTree) -> None:
        self._tree = tree
        self._held: OrderedDict[str, Node] = OrderedDict()
        """Per ready request, the deepest node its settled prefetch reached, host-pinned."""

    def hold(self, request_id: str, node: Node) -> None:
        self.release(request_id)
        self._tree.pin_host(node, +1)
        self._held[request_id] = node
        while len(self._held) > SETTLED_HELD_MAX:  # a request never admitted must not pin forever
            self._tree.pin_host(self._held.popitem(last=False)[1], -1)

    def release(self, request_id: str) -> None:
        """The request is admitted or leaves: unpin what its settled prefetch brought."""
        node = self._held.pop(request_id, None)
        if node is not None:
            self._tree.pin_host(node, -1)

    def __bool__(self) -> bool:
        return bool(self._held)

    def check_invariants(self) -> None:
        for rid, node in self._held.items():
            if not node.alive or node.host_ref <= 0:
                raise InvariantError(f"tree: what the prefetch of {rid!r} settled into ({node}) must be alive and pinned")
