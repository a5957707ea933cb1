"""The radix tree's node model: a node's lifecycle states and legal moves, the node itself,
its chained page hashes, what an insert reports, and a node's own invariants.

- Keys and pages are immutable values: a node's tokens are the little-endian int64
  bytes of its token ids (`Node.key`, the bytes inside a `Tokens`), its device and
  host memory are the `Indices` of its pages (one page number per `page_size`
  tokens). A part of a key is cut by the rule `Indices` slices follow (`key_part`):
  a part that keeps most of a large buffer is a read-only view of it (an insert's new
  node over most of a prompt copies nothing), any other part a copy of exactly its
  bytes, so what a node keeps alive beyond its own bytes is at most as much again.
  The tree runs on bytes and Python ints (a child is found under the bytes of its
  first page, a match is a `startswith`); only the duplicate pages of a long insert
  are found by a tensor comparison.
- Each page has a hash chained from its parent page's hash, seeded by the namespace,
  computed only when something asks for it (storage keys, rank digests).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from hicache.messages import Indices
from hicache.messages._index import VIEW_FRACTION, _kind, viewed

from ._errors import InvariantError


class NodeState(enum.Enum):
    DEVICE = "device"
    """KV in device memory only."""
    WRITING = "writing"
    """In device memory; its host copy is being written (host pages may still be on their way)."""
    SYNCED = "synced"
    """In device and host memory."""
    HOST_ONLY = "host_only"
    """In host memory only."""
    LOADING = "loading"
    """In host memory; device pages are being filled from it."""

    # Members are singletons compared by identity: hash them the same way, in C (Enum's own
    # hash is a Python call on the name, paid at every `state in RESIDENT`).
    __hash__ = object.__hash__


_N = NodeState
NODE_TRANSITIONS: frozenset[tuple[NodeState, NodeState]] = frozenset(
    {
        (_N.DEVICE, _N.WRITING),  # write-through starts
        (_N.WRITING, _N.SYNCED),  # WriteDone
        (_N.WRITING, _N.DEVICE),  # write failed, or no host memory
        (_N.SYNCED, _N.HOST_ONLY),  # device copy evicted
        (_N.HOST_ONLY, _N.LOADING),  # load-back starts
        (_N.LOADING, _N.SYNCED),  # LoadDone
        (_N.LOADING, _N.HOST_ONLY),  # load failed
        (_N.HOST_ONLY, _N.SYNCED),  # an insert brought fresh device KV for it
    }
)
"""Every legal move of a node; creation (DEVICE, or HOST_ONLY from storage) and deletion are not moves."""

RESIDENT = frozenset({_N.DEVICE, _N.WRITING, _N.SYNCED, _N.LOADING})
"""States with device pages."""
BACKED = frozenset({_N.SYNCED, _N.HOST_ONLY, _N.LOADING})
"""States whose host copy is complete."""


class NodeStateError(RuntimeError):
    """An illegal node lifecycle move (a programmer error)."""


@dataclass(eq=False, slots=True)
class Node:
    id: int
    namespace: str
    parent: Node | None
    key: bytes | memoryview
    """Token ids as little-endian int64 bytes, a whole number of pages (empty for a root): its
    own bytes, or a read-only view of most of a larger `bytes` object (`key_part`)."""
    tokens: int
    """Tokens of the key (`len(key) // 8`)."""
    page_bytes: int
    """Bytes of one page of the key (8 x page size)."""
    state: NodeState
    device: Indices | None = None
    host: Indices | None = None
    children: dict[bytes, Node] = field(default_factory=dict)
    """Child by the bytes of its first page."""
    lock_ref: int = 0
    host_ref: int = 0
    """Pins of the host copy (prefetch anchors, backups to storage)."""
    hit_count: int = 0
    last_access: int = 0
    created: int = 0
    priority: int = 0
    op: int = 0
    """The write or load operation in flight on this node, 0 if none."""
    stored: bool = False
    """Every page is in storage (L3): backed up there, or prefetched from there."""
    resident_children: int = 0
    version: int = 0
    alive: bool = True
    chained: tuple[int, ...] | None = None
    """The page hashes once computed (`hashes`); None until something needs them."""

    @property
    def hashes(self) -> tuple[int, ...]:
        """One chained hash per page, computed on first use and kept: only storage (page
        keys) and rank agreement (digests) need them, so a tree without storage never hashes."""
        chained = self.chained
        if chained is None:
            assert self.parent is not None, "a root's hash is set when it is made"
            chained = self.chained = chain_hashes(self.parent.hashes[-1], self.key, self.page_bytes)
        return chained

    def token_ids(self) -> list[int]:
        """The key's token ids."""
        return list(struct.unpack(f"<{self.tokens}q", self.key))

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def path(self) -> Iterator[Node]:
        """This node and its ancestors up to (not including) the root."""
        node: Node | None = self
        while node is not None and node.parent is not None:
            yield node
            node = node.parent

    def __repr__(self) -> str:
        return f"Node(#{self.id} {self.state.value} tokens={self.tokens} lock={self.lock_ref})"


@dataclass(slots=True)
class HostInsert:
    """What `RadixTree.insert_host` did with pages that arrived from storage."""

    new: list[Node]
    """Host-only nodes created for them (their pages are the tree's now)."""
    unused: list[Indices]
    """Pages not taken: those the tree already held, and those past a node that is not backed up."""
    last: Node | None = None
    """The deepest node the walk reached (the last new one, or the last it went through)."""


@dataclass(slots=True)
class InsertOutcome:
    path: list[Node]
    """Every node the inserted prefix now runs through, root excluded."""
    present: int
    """Tokens already cached (device, host or loading) before the insert."""
    adopted: list[Indices]
    """Pages of the caller that the tree now owns (new nodes, revived host-only nodes)."""
    duplicates: list[Indices]
    """Pages of the caller whose KV the tree already holds in other pages."""
    revived: list[Node]
    """Host-only nodes that got the caller's device pages (now SYNCED)."""


def key_part(data: bytes | memoryview, lo: int, hi: int) -> bytes | memoryview:
    """`data[lo:hi]` as a node key, where `data` is a `bytes` object or a view of one (a key,
    or the bytes under a `Tokens`): a read-only view of the same bytes when the part is at
    least `VIEW_BYTES_MIN` bytes and `VIEW_FRACTION` of that object (`viewed`), else a copy of
    exactly the part. Views of one object are disjoint parts of it (a node's key, its split halves),
    each at least half of it, so at most two share it, and nothing is kept alive beyond twice
    the bytes of the live keys."""
    size = hi - lo
    if type(data) is bytes:
        if size == len(data):
            return data
        if viewed(size, len(data)):
            return memoryview(data)[lo:hi]
        return data[lo:hi]
    if viewed(size, len(data.obj)):
        return data[lo:hi]
    return data[lo:hi].tobytes()


def first_page(key: bytes | memoryview, page_bytes: int) -> bytes:
    """The bytes of a key's first page: what its parent files it under."""
    return key[:page_bytes] if type(key) is bytes else key[:page_bytes].tobytes()


HASH_BYTES: Final = 16
"""Bytes of a page hash (blake2b's digest): 128 bits, so that no two prefixes share a
storage key by chance. At 64 bits, a store holding 5 million pages answers one lookup in
about 4 x 10^12 with another prefix's page; a cluster looking up 10^5 pages a second
would be served wrong KV about once a year."""


def root_hash(model_id: str, namespace: str) -> int:
    """The hash a namespace's chain of page hashes starts from (`chain_hashes`): blake2b-128
    of the namespace's UTF-8 bytes, keyed, for a named model, with blake2b-256 of the model
    id (a keyed hash is another function: no namespace of one model gives another's seed)."""
    blake2b, data = hashlib.blake2b, namespace.encode()
    key = blake2b(model_id.encode(), digest_size=32).digest() if model_id else b""
    digest = blake2b(data, digest_size=HASH_BYTES, key=key)  # no key: the unkeyed hash
    return int.from_bytes(digest.digest(), "little")


def chain_hashes(prev: int, data: bytes | memoryview, page_bytes: int) -> tuple[int, ...]:
    """hash(page) = blake2b-128(previous page hash || page token bytes), one per page of
    `data`, as a little-endian unsigned number (`HASH_BYTES`); the chain goes on from each
    digest's bytes."""
    blake2b, last = hashlib.blake2b, prev.to_bytes(HASH_BYTES, "little")
    digests = []
    for at in range(0, len(data), page_bytes):
        last = blake2b(last + data[at : at + page_bytes], digest_size=HASH_BYTES).digest()
        digests.append(last)
    return tuple(int.from_bytes(d, "little") for d in digests)


class _Where:
    """`tree: <node>`, formatted only when an invariant message is built."""

    __slots__ = ("node",)

    def __init__(self, node: Node) -> None:
        self.node = node

    def __str__(self) -> str:
        return f"tree: {self.node}"

    def __format__(self, spec: str) -> str:
        return str(self)

def check_node(node: Node, page_size: int, unit: int) -> None:
    """A node's own invariants, and those it shares with its parent and children (`unit`:
    tokens one device or host index stands for)."""
    p, u, page_bytes = page_size, unit, 8 * page_size
    parent = node.parent
    assert parent is not None
    where = _Where(node)
    if parent.children.get(first_page(node.key, page_bytes)) is not node:
        raise InvariantError(f"{where} is not its parent's child under its first page")
    if node.tokens != len(node.key) // 8 or len(node.key) % 8:
        raise InvariantError(f"{where}: a key of {len(node.key)} bytes is not {node.tokens} int64 token ids")
    key = node.key
    if type(key) is not bytes and (type(key.obj) is not bytes or len(key) < VIEW_FRACTION * len(key.obj)):
        raise InvariantError(f"{where}: its key views {len(key)} of the {len(key.obj)} bytes it keeps alive "
                             "(a key that is a view must be at least half of a bytes object)")
    if node.tokens == 0 or node.tokens % p or node.page_bytes != page_bytes:
        raise InvariantError(f"{where}: {node.tokens} tokens are not whole pages of {p}")
    if node.chained is not None and (
        parent.chained is None or node.chained != chain_hashes(parent.chained[-1], node.key, page_bytes)
    ):
        raise InvariantError(f"{where}: page hashes do not chain from the parent's")
    resident = node.state in RESIDENT
    if resident != (node.device is not None) or (resident and len(node.device) * u != node.tokens):  # type: ignore[arg-type]
        raise InvariantError(f"{where}: device pages do not match state")
    if node.state in BACKED and (node.host is None or len(node.host) * u != node.tokens):
        raise InvariantError(f"{where}: backed-up state without a full host copy")
    if node.state is NodeState.DEVICE and node.host is not None:
        raise InvariantError(f"{where}: not backed up but holds host pages")
    if resident and node.state is not NodeState.LOADING and not parent.is_root and parent.state not in RESIDENT:
        # (a LOADING node may sit under a host-only one whose own load failed as it ran: it goes
        # back to host memory when its load ends, `Admissions.loaded`)
        raise InvariantError(f"{where}: device residency is not prefix-closed (parent {parent})")
    if node.state in BACKED and not parent.is_root and parent.state not in BACKED:
        raise InvariantError(f"{where}: backup is not prefix-closed (parent {parent})")
    if node.lock_ref < 0 or node.host_ref < 0:
        raise InvariantError(f"{where}: negative lock or host ref")
    if node.lock_ref < sum(c.lock_ref for c in node.children.values()):
        raise InvariantError(f"{where}: lock ref below its children's (locks count up the path)")
    if node.resident_children != sum(c.state in RESIDENT for c in node.children.values()):
        raise InvariantError(f"{where}: resident child count is stale")
    for what, pages in (("device", node.device), ("host", node.host)):
        if pages is not None and _kind(pages) is not Indices:  # a lazy concat is one too
            raise InvariantError(f"{where}: {what} pages are a {type(pages).__name__}, not Indices")


def device_evictable(node: Node) -> bool:
    """In device memory, unlocked, with no child in device memory: its device copy may go."""
    return (
        node.alive and node.parent is not None and node.state in (NodeState.DEVICE, NodeState.SYNCED)
        and node.lock_ref == 0 and node.resident_children == 0
    )


def host_evictable(node: Node) -> bool:
    """A host-only leaf nothing locks or pins: it may be deleted."""
    return (
        node.alive and node.parent is not None and node.state is NodeState.HOST_ONLY
        and node.lock_ref == 0 and node.host_ref == 0 and not node.children
    )


def differing_pages(mine: Indices, theirs: Indices) -> Indices:
    """The pages of `mine` that differ from `theirs` at the same position (equal lengths):
    compared as Python ints for a few, vectorised for more."""
    if len(mine) <= _SMALL:
        return Indices.of(s for s, t in zip(mine.tolist(), theirs.tolist(), strict=True) if s != t)
    a, b = mine.as_tensor(), theirs.as_tensor()
    return Indices.from_tensor(a[a != b])


_SMALL = 64
"""Up to this many pages, Python ints beat a tensor op's fixed cost."""
