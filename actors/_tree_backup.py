"""The backup book: host copies backed up to storage (L2 -> L3), each node host-pinned until its
backup's agreed outcome applies."""

from __future__ import annotations

from hicache.messages import StorePages

from ._errors import InvariantError
from ._facts import FactKind
from ._radix_node import Node
from ._tree_shared import PREFETCH, TreeShared


class BackupBook:
    def __init__(self, shared: TreeShared) -> None:
        self.s = shared
        self.stores: dict[int, Node] = {}
        """Backups in flight: the node each one stores."""

    def consider_store(self, node: Node) -> None:
        """Back a node's freshly synced host copy up to storage, pinned until it lands."""
        s = self.s
        if not s.storage or node.stored or not node.alive or node.host is None:
            return
        op = s.next_id()
        s.tree.pin_host(node, +1)
        self.stores[op] = node
        s.agreement.expect(FactKind.BACKUP, op)
        s.emit(PREFETCH, StorePages(op_id=op, keys=s.storage_keys(node.hashes), host=node.host))

    def on_stored(self, op: int, pages: int, written: int) -> None:
        """The local outcome: `pages` leading pages are in storage, `written` of them by this backup."""
        self.s.n.stored_tokens += written * self.s.page_size
        self.s.agreement.record(FactKind.BACKUP, op, pages)

    def stored(self, op: int, pages: int) -> None:
        """The agreed outcome: the node is stored if every page is."""
        node = self.stores.pop(op)
        self.s.tree.pin_host(node, -1)
        if pages >= len(node.hashes):
            node.stored = True

    def check_invariants(self) -> None:
        for op, node in self.stores.items():
            if not node.alive or node.host is None or node.host_ref <= 0:
                raise InvariantError(f"tree: backup {op} to storage of {node} needs it alive, on host and pinned")
