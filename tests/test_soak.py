"""The cache's memory grows with what it caches and what is live, never with the requests,
calls and prefetches it served.

One seeded workload drives the facade through every request path (prefetch from a file
L3 bounded to 1 MiB, `ready`, admit, `start_loads`, prefill, `cache_unfinished`, decode steps, finish,
abort, retract, the abort of a queued prefetch) with the delivery log on and
`statistics()` / `room()` called now and then, with the device and host full and evicting.
After K ticks and again after 4K, with the cache quiet, every dict, list, deque, set and
bytearray reachable from the facade and the actors is measured (by the path of attributes
that reaches it): none may have grown with the ticks in between. The structures bounded by
a count of remembered requests or held log bytes get small bounds here, so that they are
full by the first measure.

`hicache soak`, which judges the process's resident memory over a long run, must itself
keep what it stores bounded.
"""

from __future__ import annotations

import gc
import importlib
import random
import types
from collections import deque
from pathlib import Path

import pytest

from hicache.actors import _device_core
from hicache.actors._actor import HiActor
from hicache.runtime import Config, HiCache, Insufficient, Request
from hicache.runtime import _facade, _log

soak = importlib.import_module("hicache.runtime.cli._soak")  # the package's `_soak` is the command

TICKS = 60
"""Ticks before the first measure; the second comes after 4x as many."""
BATCH = 6
REMEMBERED = 64
"""`FINISHED_REMEMBERED_MAX` and `RELEASED_REMEMBERED_MAX` here: full after a few ticks."""


def _tokens(rng: random.Random, i: int) -> list[int]:
    """A shared system prompt, maybe a conversation's earlier turn, then tokens of its own
    (sometimes enough for the delivery log to write them as a blob)."""
    system, turn = 1000 + rng.randrange(12) * 100, 50_000 + rng.randrange(60) * 64
    own = rng.randrange(3, 30) if rng.random() < 0.85 else rng.randrange(130, 160)
    return ([system + k for k in range(rng.choice([8, 16, 24]))] + [turn + k for k in range(rng.choice([0, 8, 16]))]
            + [200_000 + i * 200 + k for k in range(own)])


class _Workload:
    def __init__(self, hc: HiCache, seed: int) -> None:
        self.hc, self.rng = hc, random.Random(seed)
        self.i = 0
        self.queued: dict[str, list[int]] = {}

    def tick(self) -> None:
        hc, rng = self.hc, self.rng
        for _ in range(BATCH):
            self.i += 1
            self.queued[f"r{self.i}"] = _tokens(rng, self.i)
        new = list(self.queued)[-BATCH:]
        hc.prefetch([Request(rid, self.queued[rid][:-1]) for rid in new])
        if hc.prefetching and rng.random() < 0.2:
            del self.queued[(gone := hc.prefetching[0])]
            hc.abort([gone])
        ready = hc.ready(list(self.queued))
        if len(self.queued) > 4 * BATCH:
            while len(ready) < len(self.queued):
                ready = hc.ready(list(self.queued))
        reqs = [(rid, self.queued.pop(rid)) for rid in ready]
        if not reqs:
            return
        live = {a.request_id: (toks, a) for (_, toks), a in
                zip(reqs, hc.admit([Request(rid, toks[:-1]) for rid, toks in reqs]), strict=True)}
        hc.start_loads()
        if isinstance(hc.allocate({rid: len(t) - a.cached_tokens for rid, (t, a) in live.items()}), Insufficient):
            hc.retract([a.handle for _, a in live.values()])
            return
        for rid, (_, a) in list(live.items()):
            fate = rng.random()
            if fate < 0.1:
                (hc.abort if fate < 0.05 else hc.retract)([a.handle])
                del live[rid]
        if not live:
            return
        hc.commit({rid: t[a.cached_tokens:] for rid, (t, a) in live.items()})
        handles = {rid: a.handle for rid, (_, a) in live.items()}
        chunked = [h for h in handles.values() if rng.random() < 0.3]
        if chunked:
            handles.update((h.request_id, h) for h in hc.cache_unfinished(chunked))
        for step in range(rng.randrange(1, 6)):
            got = hc.allocate(dict.fromkeys(live, 1), commit=dict.fromkeys(live, [7]) if step else None)
            if isinstance(got, Insufficient):
                hc.retract(list(handles.values()))
                return
        hc.commit(dict.fromkeys(live, [7]))
        hc.finish(list(handles.values()))


_LEAVES = (str, bytes, int, float, bool, type(None), memoryview, type, types.ModuleType)


def _sizes(hc: HiCache) -> dict[str, int]:
    """The length of every container reachable from the facade and the actors, by the path
    of attributes and keys that reaches it first (items of a sequence: the largest of its
    first few)."""
    actors = sorted((o for o in gc.get_objects() if issubclass(type(o), HiActor)), key=lambda a: a.name.value)
    out: dict[str, int] = {}
    seen: set[int] = set()
    todo = [("hc", hc, 0)] + [(type(a).__name__, a, 0) for a in reversed(actors)]  # the actors first
    while todo:
        path, obj, depth = todo.pop()
        if (isinstance(obj, _LEAVES) or callable(obj) and not hasattr(obj, "__dict__") or id(obj) in seen
                or depth and isinstance(obj, HiActor)):  # each actor is walked from its own name
            continue
        seen.add(id(obj))
        if isinstance(obj, (dict, list, deque, set, frozenset, bytearray)):
            out[path] = max(out.get(path, 0), len(obj))
        if depth == 8 or type(obj).__module__.startswith(("torch", "threading", "pykka", "structlog")):
            continue
        if isinstance(obj, dict):
            children = [(f"{path}[]", v) for v in obj.values()]
        elif isinstance(obj, (list, tuple, deque)):
            children = [(f"{path}[]", v) for v in list(obj)[:3]]
        else:
            names = list(getattr(obj, "__dict__", {}))
            names += [s for c in type(obj).__mro__ for s in c.__dict__.get("__slots__", ()) if isinstance(s, str)]
            children = [(f"{path}.{n}", getattr(obj, n, None)) for n in names]
        todo.extend((p, v, depth + 1) for p, v in reversed(children))
    return out


def _grown(before: dict[str, int], after: dict[str, int]) -> dict[str, tuple[int, int]]:
    """What grew the way a leak does: to more than twice its size (and 64 more) over 3x the ticks."""
    return {p: (before.get(p, 0), n) for p, n in after.items() if n > 2 * before.get(p, 0) + 64}


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_memory_does_not_grow_with_requests_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   write_policy: str) -> None:
    monkeypatch.setattr(_facade, "FINISHED_REMEMBERED_MAX", REMEMBERED)
    monkeypatch.setattr(_device_core, "RELEASED_REMEMBERED_MAX", REMEMBERED)
    monkeypatch.setattr(_log, "BLOBS_HELD_BYTES_MAX", 1 << 16)
    config = Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=1024, host_slots=2048,
                    write_policy=write_policy, storage="file", storage_dir=str(tmp_path / "l3"),
                    storage_max_bytes=1 << 20, model_id="soak", prefetch_threshold_pages=1,
                    log_path=str(tmp_path / "log.jsonl"))
    with HiCache(config) as hc:
        work = _Workload(hc, seed=7)
        sizes = []
        for ticks in (TICKS, 3 * TICKS):
            for t in range(ticks):
                work.tick()
                if t % 10 == 0:
                    hc.statistics()
                    hc.room()
            hc.quiesce()
            hc.check_invariants()
            sizes.append(_sizes(hc))
        served = work.i
        stats = hc.statistics()
    assert served == 4 * TICKS * BATCH
    assert stats.l3.hit_tokens > 0 and stats.l2.hit_tokens > 0  # every tier served hits
    assert len(sizes[1]) > 100  # the walk reached into the actors' cores
    assert _grown(sizes[0], sizes[1]) == {}


def test_the_soak_command_keeps_its_storage_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hicache soak` serves round after round into one storage directory, and each fresh instance
    indexes every page there: that storage must stop growing once full, or the resident memory
    the soak judges grows with the requests it served."""
    monkeypatch.setattr(soak, "L3_BYTES_MAX", 1 << 20, raising=False)  # full within the first round here
    stored = []
    with HiCache(soak._config(str(tmp_path), seed=0)) as hc:
        first = 0
        for rounds in (1, 3):
            for _ in range(rounds):
                soak._round(hc, 0, first)
                first += soak.ROUND_REQUESTS
            stored.append(sum(f.stat().st_blocks * 512 for f in tmp_path.iterdir()))
    assert stored[1] <= stored[0] + (1 << 20) // 8  # one segment of slack: its last holes may be punched later
