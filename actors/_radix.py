"""`RadixTree`: the radix tree over token pages, its node lifecycle, locks and eviction order.

Plain and synchronous; `TreeCore` drives it. What it guarantees:

- Keys are whole token pages under a namespace; each namespace has its own root,
  so two namespaces never share a node. Matching is longest page-aligned prefix,
  splitting a node at a page boundary when a match ends inside it.
- A node's lifecycle is a `NodeState`, moved only through `set_state`, which
  checks `NODE_TRANSITIONS`. No boolean flags.
- `insert` stops at a node whose load-back has not landed (`UNLANDED`): its pages
  hold no KV yet, and a node under it would stay resident if the load failed.
- `lock` counts a lock up the whole path; `protected_tokens` (device tokens under
  a lock) and `evictable_tokens` (device tokens under none) are kept exact on every
  change, and `check_invariants` recomputes them.
- Eviction order is kept incrementally: a heap of (policy key, version) entries
  with lazy deletion; a node is re-offered whenever it may have become evictable
  or its key changed, and stale entries are skipped (amortised O(log n) per
  evicted node, never a heap rebuilt from all leaves per call).

The node model (states, legal moves, the node, its keys, pages and chained hashes, its
own invariants) is in `_radix_node`.
"""

from __future__ import annotations

import heapq
import itertools
import struct
from collections.abc import Callable, Iterator


from hicache.messages import Indices
from hicache.messages.config import EvictionPolicy

from ._errors import InvariantError
from ._radix_node import (BACKED, NODE_TRANSITIONS, RESIDENT, HostInsert, InsertOutcome, Node, NodeState,
                          NodeStateError, chain_hashes, check_node, device_evictable, differing_pages, first_page,
                          host_evictable, key_part, root_hash)


class RadixTree:
    UNLANDED: frozenset[NodeState] = frozenset({NodeState.LOADING})
    """States of a node whose pages hold no KV yet (a load-back not landed): `insert` stops at one."""

    def __init__(self, page_size: int, policy: EvictionPolicy, *, index_tokens: int = 1, model_id: str = "") -> None:
        if index_tokens not in (1, page_size):
            raise ValueError(f"index_tokens must be 1 (slots) or page_size={page_size} (pages), got {index_tokens}")
        self.page_size = page_size
        self.index_tokens = index_tokens
        """Tokens one device or host index stands for: 1 when nodes hold slots, `page_size`
        when they hold pages (the cache's own tree)."""
        self._page_bytes = 8 * page_size
        self.policy = policy
        self.model_id = model_id
        """The model the KV is of (`Config.model_id`): part of every page hash, so of every storage key."""
        self._roots: dict[str, Node] = {}
        self._ids = itertools.count(1)
        self._tick = 0
        self._seq = itertools.count()
        self._device_heap: list[tuple[tuple[int, ...], int, int, Node]] = []
        self._host_heap: list[tuple[tuple[int, ...], int, int, Node]] = []
        self.nodes = 0
        self.device_tokens = 0
        self.host_tokens = 0
        self.protected_tokens = 0
        self.evictable_tokens = 0
        self.on_split: Callable[[Node, Node], None] | None = None
        """Called with (upper, lower) after a node is split (in-flight op tables follow it)."""

    # -- structure ---------------------------------------------------------------

    def root(self, namespace: str) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            root = Node(id=0, namespace=namespace, parent=None, key=b"", tokens=0, page_bytes=self._page_bytes,
                        state=NodeState.DEVICE, chained=(root_hash(self.model_id, namespace),))
            self._roots[namespace] = root
        return root

    def roots(self) -> list[Node]:
        return [self._roots[ns] for ns in sorted(self._roots)]

    def match(self, namespace: str, tokens: Indices) -> list[Node]:
        """The nodes of the longest cached page-aligned prefix, splitting the last if needed."""
        self._tick += 1
        path: list[Node] = []
        node = self.root(namespace)
        data, at, end = tokens.span()  # a slice of a larger value is read where it lies
        step = self._page_bytes
        end -= (end - at) % step
        while at < end:
            child = node.children.get(data[at : at + step])
            if child is None:
                break
            same = self._common(child.key, data, at, end)
            partial = same < child.tokens
            if partial:
                child = self.split(child, same)
            child.last_access = self._tick
            self.offer(child)  # its eviction key changed (LRU, LFU and PRIORITY use the access time)
            path.append(child)
            at += 8 * child.tokens
            node = child
            if partial:
                break
        return path

    def insert(
        self, namespace: str, tokens: Indices, device: Indices, *, own_from: int = 0, priority: int = 0,
        length: int | None = None, after: Node | None = None,
    ) -> InsertOutcome:
        """Insert `tokens` (whole pages) whose KV sits in the `device` pages (one per page of tokens);
        with `length`, only the first `length` tokens (whole pages; `tokens` is not copied).

        Pages of positions below `own_from` came from the tree itself (the caller's
        cached prefix): they are never adopted or reported as duplicates.

        With `after` (a live node of `namespace`), `tokens` continue the cached prefix that
        ends at `after`: the nodes from the root to it count as matched, as a walk over the
        whole sequence would count them (hit count, access time, priority, `path`, `present`),
        without their tokens being given or compared; `own_from` must then be 0.

        The walk stops at a node whose load-back has not landed (LOADING) past `own_from`: the
        caller's pages from there on are neither adopted nor duplicates (they stay the caller's),
        and `path` ends above it."""
        p = self.page_size
        n = len(tokens) if length is None else length
        u = self.index_tokens
        if n % p or len(device) * u != n or not 0 <= n <= len(tokens):
            raise ValueError(f"insert needs whole pages and an index per {u} tokens, got {n} tokens, "
                             f"{len(device)} indices")
        self._tick += 1
        out = InsertOutcome(path=[], present=0, adopted=[], duplicates=[], revived=[])
        if after is None:
            node = self.root(namespace)
        else:
            node = self._continue(namespace, after, own_from, priority, out)
        data, lo, end = tokens.head_span(n)  # read where they lie: a slice of a larger value's, a lazy join's part
        step = self._page_bytes
        pos = 0
        while pos < n:
            at = lo + 8 * pos
            child = node.children.get(data[at : at + step])
            if child is None:
                if pos < own_from:
                    for nd in out.path:  # their access times changed: keep the eviction index exact
                        self.offer(nd)
                    raise InvariantError(
                        f"insert: the caller's cached prefix ({own_from} tokens) is no longer in the tree at "
                        f"{pos}; its nodes were locked and cannot have been evicted"
                    )
                new = self._new_node(node, key_part(data, at, end), NodeState.DEVICE, priority)
                new.device = device[pos // u : n // u]
                self._attach(new)  # offers it for eviction
                out.adopted.append(new.device)
                for nd in out.path:  # the nodes above it, with their new access time
                    self.offer(nd)
                out.path.append(new)
                return out
            if child.state in self.UNLANDED and pos >= own_from:
                # Its load-back has not landed (it may never start, or fail): its pages hold no KV
                # yet, and a node under it would outlive a failed load. The caller keeps its pages.
                break
            same = self._common(child.key, data, at, end)
            if pos < own_from < pos + same:
                same = own_from - pos  # keep the tree's part and the caller's part in separate nodes
            if same < child.tokens:
                child = self.split(child, same)
            if pos + child.tokens <= own_from:
                out.present += child.tokens  # the tree's own pages
            else:
                self._absorb(child, device[pos // u : (pos + child.tokens) // u], out)
            child.hit_count += 1
            child.last_access = self._tick
            child.priority = max(child.priority, priority)
            out.path.append(child)
            pos += child.tokens
            node = child
        for nd in out.path:
            self.offer(nd)
        return out

    def _continue(self, namespace: str, after: Node, own_from: int, priority: int, out: InsertOutcome) -> Node:
        """`insert(after=...)`: the nodes from the root to `after`, used as matched; `after`."""
        if own_from:
            raise ValueError(f"insert after a node takes no own_from (got {own_from}): every page given is the caller's")
        if not after.alive or after.namespace != namespace or after.is_root:
            raise InvariantError(f"insert after {after}: it must be a live node of namespace {namespace!r}")
        path = list(after.path())
        path.reverse()
        for nd in path:
            nd.hit_count += 1
            nd.last_access = self._tick
            nd.priority = max(nd.priority, priority)
            out.present += nd.tokens
        out.path = path
        return after

    def _absorb(self, node: Node, mine: Indices, out: InsertOutcome) -> None:
        """The caller's pages for an existing node: the node's own, duplicates, or a revival."""
        out.present += node.tokens
        if node.device is not None:
            if mine != node.device:  # the caller computed KV the tree holds: its differing pages are spare
                out.duplicates.append(differing_pages(mine, node.device))
        elif node.state is NodeState.HOST_ONLY:
            self._account(node, -1)
            node.device = mine
            self._move(node, NodeState.SYNCED)
            self._account(node, +1)
            out.adopted.append(node.device)
            out.revived.append(node)
        else:  # pragma: no cover - every non-resident node is HOST_ONLY
            raise InvariantError(f"{node}: no device pages but not host-only")

    def split(self, node: Node, at: int) -> Node:
        """Cut `node` after `at` tokens (a page boundary); returns the new upper part."""
        if at <= 0 or at >= node.tokens or at % self.page_size:
            raise ValueError(f"cannot split {node} at {at}")
        parent = node.parent
        assert parent is not None
        pages, cut = at // self.page_size, at // self.index_tokens
        self._account(node, -1)
        upper = Node(
            id=next(self._ids), namespace=node.namespace, parent=parent, key=key_part(node.key, 0, 8 * at), tokens=at,
            page_bytes=node.page_bytes, state=node.state, chained=None if node.chained is None else node.chained[:pages],
            device=None if node.device is None else node.device[:cut],
            host=None if node.host is None else node.host[:cut],
            lock_ref=node.lock_ref, host_ref=node.host_ref, hit_count=node.hit_count,
            last_access=node.last_access, created=node.created, priority=node.priority, op=node.op,
            stored=node.stored,
        )
        node.key = key_part(node.key, 8 * at, len(node.key))
        node.tokens -= at
        if node.chained is not None:
            node.chained = node.chained[pages:]
        node.device = None if node.device is None else node.device[cut:]
        node.host = None if node.host is None else node.host[cut:]
        step = self._page_bytes
        parent.children[first_page(upper.key, step)] = upper
        upper.children[first_page(node.key, step)] = node
        node.parent = upper
        self.nodes += 1
        self._account(upper, +1)
        self._account(node, +1)
        if self.on_split is not None:
            self.on_split(upper, node)
        return upper

    def remove(self, node: Node) -> None:
        """Delete a leaf."""
        if node.children or node.parent is None:
            raise InvariantError(f"only a leaf can be removed, not {node} with {len(node.children)} children")
        self._account(node, -1)
        parent = node.parent
        del parent.children[first_page(node.key, self._page_bytes)]
        node.alive = False
        self.nodes -= 1
        self.offer(parent)

    # -- lifecycle and locks ----------------------------------------------------------

    def set_state(self, node: Node, to: NodeState) -> None:
        self._require_move(node, to)  # before any counter changes: a refused move changes nothing
        self._account(node, -1)
        self._move(node, to)
        self._account(node, +1)
        self.offer(node)
        if node.parent is not None:
            self.offer(node.parent)

    def start_load(self, node: Node, device: Indices) -> None:
        """HOST_ONLY -> LOADING with the device pages the load fills."""
        self._change(node, NodeState.LOADING, device=device)

    def fail_load(self, node: Node) -> None:
        """LOADING -> HOST_ONLY: the load failed, its device pages are given back."""
        self._change(node, NodeState.HOST_ONLY, device=None)

    def evict_to_host(self, node: Node) -> None:
        """SYNCED -> HOST_ONLY: the device copy is dropped; the host copy is synced."""
        self._change(node, NodeState.HOST_ONLY, device=None)

    def set_host(self, node: Node, host: Indices | None) -> None:
        """Give a WRITING node its host pages, or take them back (a failed write)."""
        self._account(node, -1)
        node.host = host
        self._account(node, +1)

    def _change(self, node: Node, to: NodeState, *, device: Indices | None) -> None:
        self._require_move(node, to)
        self._account(node, -1)
        self._move(node, to)
        node.device = device
        self._account(node, +1)
        self.offer(node)
        if node.parent is not None:
            self.offer(node.parent)

    def _move(self, node: Node, to: NodeState) -> None:
        self._require_move(node, to)
        node.state = to

    @staticmethod
    def _require_move(node: Node, to: NodeState) -> None:
        if (node.state, to) not in NODE_TRANSITIONS:
            raise NodeStateError(
                f"illegal node transition {node.state.value} -> {to.value} on {node} "
                f"(legal from {node.state.value}: "
                f"{', '.join(sorted(b.value for a, b in NODE_TRANSITIONS if a is node.state)) or 'none'})"
            )

    def lock(self, node: Node, delta: int) -> None:
        """Add `delta` (+1 or -1) to the lock ref of `node` and every ancestor."""
        if delta not in (1, -1):
            raise ValueError(f"lock delta must be +1 or -1, got {delta}")
        for nd in node.path():
            was, now = nd.lock_ref, nd.lock_ref + delta
            if now < 0:
                raise InvariantError(
                    f"lock ref of {nd} would become {now} (invariant: lock ref >= 0; a lock released twice?)"
                )
            if nd.state in RESIDENT and (was > 0) != (now > 0):  # its device tokens change sides
                moved = nd.tokens if now > 0 else -nd.tokens
                self.protected_tokens += moved
                self.evictable_tokens -= moved
            nd.lock_ref = now
            if now == 0:
                self.offer(nd)

    def pin_host(self, node: Node, delta: int) -> None:
        """Add `delta` to the host pin of `node` and every ancestor."""
        for nd in node.path():
            if nd.host_ref + delta < 0:
                raise InvariantError(f"host ref of {nd} would become {nd.host_ref + delta}")
            nd.host_ref += delta
            if nd.host_ref == 0:
                self.offer(nd)

    # -- eviction order ----------------------------------------------------------------

    device_evictable = staticmethod(device_evictable)
    host_evictable = staticmethod(host_evictable)

    def offer(self, node: Node) -> None:
        """Index the node for eviction if it is evictable now (with its current key)."""
        if self.device_evictable(node):  # the two are exclusive: resident vs host-only
            heap = self._device_heap
        elif self.host_evictable(node):
            heap = self._host_heap
        else:
            return
        node.version += 1
        heapq.heappush(heap, (self._key(node), next(self._seq), node.version, node))
        if len(heap) > 2 * self.nodes + 1024:
            self._compact()

    def pop_device_victim(self) -> Node | None:
        return self._pop(self._device_heap, self.device_evictable)

    def pop_host_victim(self) -> Node | None:
        return self._pop(self._host_heap, self.host_evictable)

    def _pop(self, heap: list[tuple[tuple[int, ...], int, int, Node]], ok: Callable[[Node], bool]) -> Node | None:
        while heap:
            _, _, version, node = heapq.heappop(heap)
            if version == node.version and ok(node):
                node.version += 1
                return node
        return None

    def _key(self, node: Node) -> tuple[int, ...]:
        match self.policy:
            case EvictionPolicy.LRU:
                return (node.last_access, node.created)
            case EvictionPolicy.LFU:
                return (node.hit_count, node.last_access, node.created)
            case EvictionPolicy.FIFO:
                return (node.created,)
            case EvictionPolicy.PRIORITY:
                return (node.priority, node.last_access, node.created)
        raise AssertionError(f"unknown eviction policy {self.policy}")

    def _compact(self) -> None:
        """Drop the stale entries of both heaps (when one outgrows twice the nodes)."""
        for name in ("_device_heap", "_host_heap"):
            live = [e for e in getattr(self, name) if e[2] == e[3].version and e[3].alive]
            heapq.heapify(live)
            setattr(self, name, live)

    # -- helpers -------------------------------------------------------------------------

    def _new_node(self, parent: Node, key: bytes | memoryview, state: NodeState, priority: int) -> Node:
        node = Node(id=next(self._ids), namespace=parent.namespace, parent=parent, key=key, tokens=len(key) // 8,
                    page_bytes=self._page_bytes, state=state, hit_count=1,
                    last_access=self._tick, created=next(self._seq), priority=priority)
        return node

    def insert_host(
        self, anchor: Node, tokens: Indices, host: Indices, hashes: tuple[int, ...] | None = None, *, held: int = 0
    ) -> HostInsert:
        """Attach pages that arrived from storage below `anchor` (whose end `tokens` follow) as
        host-only nodes. The first `held` tokens were in device or host memory when the pages
        were asked for (nothing was read for them; `host` holds the pages of `tokens[held:]`):
        they must still be in the tree, backed up, for the pages after them to attach. Pages
        already in the tree are not taken; the walk stops at a node that is not backed up, since
        a host-only child under it would break backup prefix-closure, and the pages past it are
        not taken either. `hashes`, when the caller has them (the prefetch's page keys), are
        those of `tokens`' pages: kept, not recomputed."""
        p, u = self.page_size, self.index_tokens
        n = len(tokens)
        if n % p or held % p or len(host) * u != n - held:
            raise ValueError(f"insert_host needs whole pages and an index per {u} tokens past the {held} held, "
                             f"got {n} tokens, {len(host)} indices")
        if not anchor.alive or not (anchor.is_root or anchor.state in BACKED):
            raise InvariantError(f"prefetch anchor {anchor} must be alive and backed up (or a root)")
        self._tick += 1
        out = HostInsert(new=[], unused=[])
        (data, lo, hi), step = tokens.span(), self._page_bytes
        node, pos = anchor, 0
        while pos < n:
            at = lo + 8 * pos
            child = node.children.get(data[at : at + step])
            if child is None:
                if pos < held:  # a held page is gone: what follows has nowhere to hang
                    break
                new = self._new_node(node, key_part(data, at, hi), NodeState.HOST_ONLY, 0)
                new.host = host[(pos - held) // u :]
                new.stored = True
                if hashes is not None:
                    new.chained = hashes[pos // p :]
                self._attach(new)
                out.new.append(new)
                out.last = new
                return out
            if child.state not in BACKED:
                break
            same = self._common(child.key, data, at, hi)
            if pos < held < pos + same:
                same = held - pos  # the held part and the read part in separate nodes
            if same < child.tokens:
                child = self.split(child, same)
            child.last_access = self._tick
            self.offer(child)
            if pos >= held:
                out.unused.append(host[(pos - held) // u : (pos - held + child.tokens) // u])
            pos += child.tokens
            node = out.last = child
        if pos < n:
            out.unused.append(host[max(0, pos - held) // u :])
        return out

    def chain(self, node: Node, tokens: Indices) -> tuple[int, ...]:
        """Page hashes of `tokens` (whole pages) continuing the chain after `node`."""
        return chain_hashes(node.hashes[-1], tokens.to_bytes(), self._page_bytes)

    def _attach(self, node: Node) -> None:
        assert node.parent is not None
        node.parent.children[first_page(node.key, self._page_bytes)] = node
        self.nodes += 1
        self._account(node, +1)
        self.offer(node)

    def _account(self, node: Node, sign: int) -> None:
        if node.parent is None:
            return
        n = sign * node.tokens
        if node.state in RESIDENT:
            self.device_tokens += n
            if node.lock_ref > 0:
                self.protected_tokens += n
            else:
                self.evictable_tokens += n
            node.parent.resident_children += sign
        if node.host is not None:
            self.host_tokens += n

    def _common(self, key: bytes | memoryview, data: bytes, at: int, end: int) -> int:
        """Tokens of `key` (whole pages) equal to `data[at:end]`'s start, floored to a page.

        Usually the whole key matches (one `startswith`, no copy); otherwise a binary
        search over whole pages, each probe one comparison in C."""
        if data.startswith(key, at, end):
            return len(key) // 8
        step = self._page_bytes
        lo, hi = 0, min(len(key), end - at) // step  # the first `lo` pages match; none past `hi`
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if data.startswith(key[: mid * step], at):
                lo = mid
            else:
                hi = mid - 1
        return lo * self.page_size

    def walk(self) -> Iterator[Node]:
        """Every node, roots excluded, parents before children."""
        stack = [r for r in self.roots()]
        while stack:
            node = stack.pop()
            for _, child in sorted(((_page_ids(k), c) for k, c in node.children.items()), reverse=True):
                yield child
                stack.append(child)

    # -- invariants ------------------------------------------------------------------------

    def check_invariants(self) -> None:
        p, u = self.page_size, self.index_tokens
        device = host = protected = evictable = count = 0
        for node in self.walk():
            count += 1
            check_node(node, p, u)
            resident = node.state in RESIDENT
            if resident:
                device += node.tokens
                if node.lock_ref > 0:
                    protected += node.tokens
                else:
                    evictable += node.tokens
            if node.host is not None:
                host += node.tokens
        got = (count, device, host, protected, evictable)
        want = (self.nodes, self.device_tokens, self.host_tokens, self.protected_tokens, self.evictable_tokens)
        if got != want:
            raise InvariantError(
                f"tree counters (nodes, device, host, protected, evictable) are {want} but the tree holds {got}"
            )


def _page_ids(page: bytes) -> tuple[int, ...]:
    """A page key's token ids: children are walked in token order."""
    return struct.unpack(f"<{len(page) // 8}q", page)
