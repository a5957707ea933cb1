"""`hicache bench tree`: match, insert and evict throughput of `RadixTree` as it grows.

One tree (page size 4, LRU) grows from empty to about 10k, 100k and 1M cached
pages. Its sequences look like a serving trace: most reuse a page-aligned prefix
of a recent sequence (a conversation going on, a shared system prompt) and add a
fresh suffix of 1 to 31 pages; one in ten starts afresh. Every node is
DEVICE-resident and unlocked, so every leaf is evictable.

At each size, several repetitions of, side by side:

- **match**: `match` of the 200 most recent sequences (whole ones, which end at
  a node boundary unless eviction cut them); pages matched per second.
- **evict**: `pop_device_victim` + `remove` (the tree core's path for a device
  leaf with no host copy) until 1000 pages are gone; microseconds per page. An
  evicted leaf's parent may become a leaf and follow it, as in the tree core.
- **insert**: fresh sequences until the tree is back at its size (the pages the
  evict step took); new pages per second.

Each timed step starts after a `gc.collect()`, so a full collection of the
whole heap does not land in one repetition and not another; the median of the
repetitions counts. `evict_ratio = evict_us_large / evict_us_small`.

This is not actor code: it reads `time.perf_counter` and a seeded `random`.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from rich.table import Table

from hicache.actors import RadixTree
from hicache.messages import Indices, Tokens
from hicache.messages.config import DeviceKind, EvictionPolicy

from ._cli import progress_bar, report
from ._transfer import _machine
from ..trace import VOCAB_SIZE

TARGET_RATIO = 2.0
PAGE_SIZE = 4
NAMESPACE = ""
SUFFIX_PAGES_MAX = 31
"""A new sequence adds 1..31 fresh pages (16 on average)."""
SEQUENCE_PAGES_MAX = 512
"""Sequences are cut at this many pages (a bound on the tree's depth in tokens)."""
REUSE_PROBABILITY = 0.9
"""How often a new sequence continues a recent one instead of starting afresh."""
RECENT_MAX = 256
"""Recent sequences kept to continue and to match."""
SEED = 20241


@dataclass(frozen=True, slots=True)
class Workload:
    sizes: tuple[int, ...]
    """Cached pages at which the tree is measured; the first is "small", the last "large"."""
    reps: int
    matches: int
    """Sequences matched per repetition."""
    evict_pages: int
    """Pages evicted per repetition."""


FULL = Workload(sizes=(10_000, 100_000, 1_000_000), reps=7, matches=200, evict_pages=1000)
QUICK = Workload(sizes=(1_000, 10_000), reps=3, matches=50, evict_pages=200)
"""A smoke test: two small trees; its figures mean nothing."""


@dataclass(frozen=True, slots=True)
class Size:
    """The figures at one tree size (medians of the repetitions)."""

    pages: int
    nodes: int
    grow_s: float
    """Time spent inserting to grow the tree from the previous size to this one."""
    match_pages_per_s: float
    insert_pages_per_s: float
    evict_us_per_page: float

    def to_json(self) -> dict[str, object]:
        return {
            "pages": self.pages,
            "nodes": self.nodes,
            "grow_s": round(self.grow_s, 3),
            "match_pages_per_s": round(self.match_pages_per_s),
            "insert_pages_per_s": round(self.insert_pages_per_s),
            "evict_us_per_page": round(self.evict_us_per_page, 3),
        }


class Grower:
    """A `RadixTree` and the seeded stream of sequences inserted into it."""

    def __init__(self) -> None:
        self.tree = RadixTree(PAGE_SIZE, EvictionPolicy.LRU)
        self.recent: deque[Tokens] = deque(maxlen=RECENT_MAX)
        self._rng = random.Random(SEED)
        self._gen = torch.Generator().manual_seed(SEED)
        self._next_slot = 0

    @property
    def pages(self) -> int:
        return self.tree.device_tokens // PAGE_SIZE

    def next_sequence(self) -> Tokens:
        rng = self._rng
        if self.recent and rng.random() < REUSE_PROBABILITY:
            parent = self.recent[rng.randrange(len(self.recent))]
            prefix = parent[: rng.randrange(len(parent) // PAGE_SIZE + 1) * PAGE_SIZE]
        else:
            prefix = Tokens()
        suffix = torch.randint(0, VOCAB_SIZE, (rng.randint(1, SUFFIX_PAGES_MAX) * PAGE_SIZE,), generator=self._gen)
        # Joined now (`Tokens.concat` would join on the first read, inside a timed call).
        data = b"".join([prefix.buffer(), Tokens.from_tensor(suffix).buffer()])
        return Tokens(data)[: SEQUENCE_PAGES_MAX * PAGE_SIZE]

    def grow_to(self, pages: int) -> float:
        """Insert new sequences until the tree holds `pages`; the seconds it took."""
        t0 = time.perf_counter()
        while self.pages < pages:
            tokens = self.next_sequence()
            device = Indices.from_range(self._next_slot, len(tokens))
            self._next_slot += len(tokens)
            self.tree.insert(NAMESPACE, tokens, device)
            self.recent.append(tokens)
        return time.perf_counter() - t0


# -- the three measurements at one size ------------------------------------------


def _time_match(g: Grower, count: int) -> float:
    """Pages matched per second over the most recent `count` sequences."""
    seqs = list(g.recent)[-count:]
    tree = g.tree
    gc.collect()
    t0 = time.perf_counter()
    matched = 0
    for tokens in seqs:
        matched += sum(nd.tokens for nd in tree.match(NAMESPACE, tokens))
    elapsed = time.perf_counter() - t0
    return matched / PAGE_SIZE / elapsed


def _time_evict(g: Grower, pages: int) -> float:
    """Microseconds per page to evict at least `pages` pages, leaf by leaf."""
    tree = g.tree
    gc.collect()
    freed = 0
    t0 = time.perf_counter()
    while freed < pages:
        node = tree.pop_device_victim()
        if node is None:
            raise RuntimeError(f"bench tree: nothing left to evict after {freed} pages")
        freed += node.tokens
        tree.remove(node)
    elapsed = time.perf_counter() - t0
    return elapsed / (freed // PAGE_SIZE) * 1e6


def _time_refill(g: Grower, pages: int) -> float:
    """New pages per second while growing back to `pages`."""
    before = g.pages
    gc.collect()
    elapsed = g.grow_to(pages)
    return (g.pages - before) / elapsed


def _measure(w: Workload, step: Callable[[str], None]) -> tuple[list[Size], Grower]:
    g = Grower()
    out = []
    for size in w.sizes:
        step(f"grow to {size:,} pages")
        grow_s = g.grow_to(size)
        match, evict, insert = [], [], []
        for _ in range(w.reps):
            match.append(_time_match(g, w.matches))
            evict.append(_time_evict(g, w.evict_pages))
            insert.append(_time_refill(g, size))
        out.append(Size(
            pages=g.pages, nodes=g.tree.nodes, grow_s=grow_s,
            match_pages_per_s=statistics.median(match),
            insert_pages_per_s=statistics.median(insert),
            evict_us_per_page=statistics.median(evict),
        ))
        step(f"measured {size:,} pages")
    return out, g


def _table(sizes: list[Size], w: Workload, ratio: float, machine: dict[str, object]) -> Table:
    t = Table(
        title=f"radix tree, page size {PAGE_SIZE}, LRU: median of {w.reps} at each size"
        + (" (--quick: a smoke test, not a figure)" if w is QUICK else ""),
        caption=(
            f"{machine['cpu_count']} x {machine['cpu_model']}, {machine['memory_gib']} GiB, torch {machine['torch']}; "
            f"evict ratio (largest / smallest) {ratio:.2f}, target <= {TARGET_RATIO}"
        ),
    )
    for col in ("pages", "nodes", "grow s", "match pages/s", "insert pages/s", "evict us/page"):
        t.add_column(col, justify="right")
    for s in sizes:
        t.add_row(f"{s.pages:,}", f"{s.nodes:,}", f"{s.grow_s:.1f}", f"{s.match_pages_per_s:,.0f}",
                  f"{s.insert_pages_per_s:,.0f}", f"{s.evict_us_per_page:.3f}")
    return t


def run_bench_tree(*, as_json: bool, quick: bool) -> int:
    w = QUICK if quick else FULL
    progress = progress_bar(as_json)
    with progress:
        task = progress.add_task("tree", total=2 * len(w.sizes))

        def step(what: str) -> None:
            progress.update(task, description=what)
            if what.startswith("measured"):
                progress.advance(task, 2)

        sizes, g = _measure(w, step)
    if quick:
        g.tree.check_invariants()  # cheap on a small tree: counters, links, hash chains
    small, large = sizes[0], sizes[-1]
    ratio = large.evict_us_per_page / small.evict_us_per_page
    machine = _machine(DeviceKind.CPU)
    table = _table(sizes, w, ratio, machine)
    body = {
        "evict_us_small": round(small.evict_us_per_page, 3),
        "evict_us_large": round(large.evict_us_per_page, 3),
        "evict_ratio": round(ratio, 3),
        "page_size": PAGE_SIZE,
        "sizes": [s.to_json() for s in sizes],
        "machine": machine,
        "workload": {
            "sizes": list(w.sizes), "reps": w.reps, "matches": w.matches, "evict_pages": w.evict_pages,
            "quick": quick,
        },
    }
    return report(table, body, as_json=as_json)
