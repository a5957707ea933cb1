"""Storage (L3): prefetch into host memory and backup from it, on the real actors and the file backend.

Most tests play two servers sharing one storage directory: instance A serves
prompts, and its write-throughs are backed up to storage; instance B prefetches
the same prompts from there (`prefetch` -> `ready` -> `admit` -> load-back) and the
fingerprint oracle checks every byte the forward pass would read. A targeted fault
plan (`StoragePlan`) delays or fails chosen storage calls: delays are runtime
timers, real on threads and virtual on the deterministic runtime, where
`advance` moves the clock.

Every facade call of instance B is followed by `check_invariants()` and the host
conservation check (`assert_conserved`): the host pool's free slots equal the
tree's mirror, and the slots in held states equal what the tree's nodes hold, so
free + tree-held + prefetch-reserved + write-in-flight == capacity. Each test ends
with `assert_drained`: no prefetch in flight, nothing reserved, and then eviction
empties both tiers, which it can only do if no lock and no host pin was left.

The last section drives `TreeCore` directly (a `Player` that also plays the
prefetcher) for orderings the actors make hard to pin down: a stop that overtakes
the host reservation, a backup that lands partly, the anchor's pin.
"""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pykka
import pytest

from hicache.actors import (HOST_ROUTES, FileBackend, InvariantError, KVShape, NoFaults, NodeState, RadixTree,
                            page_keys, root_hash)
from hicache.messages import (
    ActorName,
    AdmitItem,
    AllocateHost,
    FreeHostSlots,
    HostSlotState,
    Indices,
    PagesStored,
    Prefetch,
    PrefetchEnd,
    PrefetchesSettled,
    PrefetchesStarted,
    PrefetchesStopped,
    PrefetchHit,
    PrefetchProgress,
    PrefetchRequests,
    PrefetchStopped,
    ReadPrefetch,
    ReleaseReason,
    SetHostState,
    SettlePrefetches,
    StopPrefetch,
    StorePages,
    TerminatePrefetches,
    Tokens,
)
from hicache.runtime import AdmitResult, Config, EvictionPolicy, HiCache, Request, RequestError
from hicache.runtime.testing import DeadlockError, DeterministicRuntime, capture_logs
from hicache.runtime.testing._scheduler import ReferenceScheduler, SchedulerConfig
from hicache.runtime.testing.explore import synthetic_workload
from hicache.runtime.testing.oracle import FingerprintOracle

from conftest import make_runtime, pages_to_slots, small_config
from test_tree_core import Player

pytestmark = pytest.mark.timeout(60)

P = 4
"""Tokens per page in every test."""
BIG_S = 1000.0
PREFETCH = ActorName.PREFETCH
"""A storage delay no test waits for: the read step behind it never lands."""
S = HostSlotState


def seq(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


PROMPT = seq(40, 100)
"""Ten pages."""


def config(storage_dir: Path, **changes: Any) -> Config:
    """A tiny config with file storage in `storage_dir`; reads go two pages per step (no byte bound)."""
    values: dict[str, Any] = {"storage": "file", "storage_dir": str(storage_dir), "storage_batch_pages": 2,
                              "storage_batch_mb": 0, "prefetch_threshold_pages": 2}
    values.update(changes)
    return small_config(**values)


class StoragePlan(NoFaults):
    """Targeted storage faults, counted per prefetch: read step i of each prefetch waits
    `delays[i]` seconds (`then` after those), read step `fail_read` fails; `exists` and
    `write` calls fail when asked to. Attributes may be changed while the system runs."""

    def __init__(self, *, delays: Sequence[float] = (), then: float = 0.0, fail_read: int | None = None,
                 fail_exists: bool = False, fail_write: bool = False) -> None:
        self.delays = tuple(delays)
        self.then = then
        self.fail_read = fail_read
        self.fail_exists = fail_exists
        self.fail_write = fail_write
        self._lock = threading.Lock()
        self._delays: defaultdict[int, int] = defaultdict(int)
        self._reads: defaultdict[int, int] = defaultdict(int)

    def storage_delay(self, op_id: int) -> float:
        with self._lock:
            i = self._delays[op_id]
            self._delays[op_id] += 1
        return self.delays[i] if i < len(self.delays) else self.then

    def storage_fault(self, op_id: int, call: str) -> str | None:
        if call == "exists" and self.fail_exists:
            return "injected: exists fails"
        if call == "write" and self.fail_write:
            return "injected: write fails"
        if call == "read":
            with self._lock:
                i = self._reads[op_id]
                self._reads[op_id] += 1
            if i == self.fail_read:
                return f"injected: read step {i} fails"
        return None


# -- time, waiting and checks on either runtime -------------------------------------------


def _deterministic(hc: HiCache) -> DeterministicRuntime | None:
    rt = hc.system.runtime
    return rt if isinstance(rt, DeterministicRuntime) else None


def advance(hc: HiCache, seconds: float) -> None:
    """Let `seconds` pass: virtual time on the deterministic runtime (every mail delivered and
    every timer due by then fired, in order), a real sleep on threads."""
    rt = _deterministic(hc)
    if rt is None:
        time.sleep(seconds)
        return
    target = rt.clock.now_s() + seconds
    with contextlib.suppress(pykka.Timeout, DeadlockError):  # no timer is due before the target
        rt.drive_until(lambda: rt.clock.now_s() >= target, "virtual time", timeout_s=seconds)
    rt.clock.t = max(rt.clock.t, target)


def statistics_when(hc: HiCache, ok: Callable[[Any], bool], what: str, timeout_s: float = 10.0) -> Any:
    """Statistics once `ok(statistics)` holds (the deterministic runtime delivers all mail first;
    it never fires a timer here)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rt = _deterministic(hc)
        if rt is not None:
            rt.run_until_idle()
        s = hc.statistics()
        if ok(s):
            return s
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s: {s}"
        time.sleep(0.002)


def quiet(s: Any) -> bool:
    """No write, load, backup, hit or prefetch in flight."""
    t = s.tree
    return not (t.writes_in_flight or t.loads_in_flight or t.facts_pending or t.prefetches_in_flight
                or s.prefetch.in_flight)


def assert_conserved(hc: HiCache, timeout_s: float = 10.0) -> None:
    """Host slots are conserved: the pool's FREE slots are the tree mirror's free slots, and the
    slots in WRITING / SYNCED / HOST_ONLY / LOADING are exactly those the tree's nodes hold, so
    the RESERVED and PREFETCHING ones are the prefetch reservations and writes being set up.
    Messages may be on their way between the tree and the pool: this must hold once they land."""
    hc.check_invariants()
    deadline = time.monotonic() + timeout_s
    while True:
        rt = _deterministic(hc)
        if rt is not None:
            rt.run_until_idle()
        s = hc.statistics()
        _, used = hc.tree_digest()
        by, cap = [s.host.slots_in(x) for x in S], s.host.capacity_slots
        held = by[S.WRITING] + by[S.SYNCED] + by[S.HOST_ONLY] + by[S.LOADING]
        if by[S.FREE] == cap - used and held == s.tree.host_tokens:
            assert sum(by) == cap
            return
        assert time.monotonic() < deadline, (
            f"host slots not conserved: pool {dict(zip((x.name for x in S), by))}, tree mirror uses {used}, "
            f"tree nodes hold {s.tree.host_tokens}"
        )
        time.sleep(0.002)


def assert_drained(hc: HiCache) -> None:
    """Nothing live, nothing in flight, nothing reserved; then no lock or host pin is left
    anywhere: evicting the device and then the host empties the tree and both pools."""
    assert hc.live_requests == () and hc.prefetching == ()
    s = statistics_when(hc, quiet, "in flight at the end")
    assert (s.tree.live_handles, s.tree.protected_tokens) == (0, 0)
    by = [s.host.slots_in(x) for x in S]
    assert (by[S.RESERVED], by[S.PREFETCHING], by[S.WRITING], by[S.LOADING]) == (0, 0, 0, 0)
    assert s.host.capacity_slots - by[S.FREE] == s.tree.host_tokens
    assert_conserved(hc)
    cfg = hc.config
    hc.evict_device(cfg.device_slots)
    hc.evict_host(cfg.host_slots)
    s = statistics_when(hc, quiet, "in flight after eviction")
    assert (s.tree.nodes, s.tree.device_tokens, s.tree.host_tokens) == (0, 0, 0), "a lock or a host pin was left"
    assert s.host.slots_in(S.FREE) == cfg.host_slots
    assert s.device.free_slots == cfg.device_slots
    hc.check_invariants()


def assert_reads_back_whole(server: Server, rid: str) -> None:
    """A prefetch of `PROMPT` reads all 40 tokens back from storage, they are admitted as a host
    hit, and the request leaves nothing behind."""
    assert server.hc.prefetch([Request(rid, PROMPT)]) == {rid: 40}
    assert server.ready([rid], 0.01) == {rid: 40}
    res = server.admit(rid, PROMPT)
    assert res.host_hit == 40
    server.hc.abort([res.handle])
    assert_drained(server.raw)


def ends(s: Any) -> dict[str, int]:
    """Settled prefetches by `PrefetchEnd` (only the reasons that occurred)."""
    return {e.value: s.tree.prefetch_ends.of(e) for e in PrefetchEnd if s.tree.prefetch_ends.of(e)}


_UNCHECKED = frozenset({"check_invariants", "statistics", "tree_digest", "committed_tokens", "slots", "allocated",
                        "close", "start", "quiesce", "sync"})


class CheckedCache:
    """A HiCache whose every mutating call is followed by `assert_conserved` (which runs
    `check_invariants()` first), also when the call raised."""

    def __init__(self, hc: HiCache) -> None:
        self.hc = hc
        self.checks = 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.hc, name)
        if name.startswith("_") or name in _UNCHECKED or not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return value(*args, **kwargs)
            finally:
                assert_conserved(self.hc)
                self.checks += 1

        return call


class Server:
    """One server instance: a checked HiCache and the fingerprint oracle."""

    def __init__(self, hc: HiCache) -> None:
        self.raw = hc
        self.hc: Any = CheckedCache(hc)
        self.oracle = FingerprintOracle(KVShape.of(hc.config))

    def admit(self, rid: str, tokens: list[int], namespace: str = "") -> AdmitResult:
        """Admit; wait for its load-backs; the cached prefix must read as computed."""
        [res] = self.hc.admit([Request(rid, tokens, namespace)])
        if res.host_hit:
            self.hc.start_loads().wait_all(timeout_s=30)
        self.oracle.verify(self.raw.device_kv, tokens[: res.cached_tokens], res.device_indices)
        return res

    def compute(self, rid: str, tokens: list[int]) -> None:
        """Allocate, write fingerprint KV for and commit the positions not computed yet."""
        done = len(self.hc.committed_tokens(rid))
        need = len(tokens) - len(self.hc.slots(rid))
        if need > 0:
            got = self.hc.allocate({rid: need})
            assert isinstance(got, dict), got
        self.oracle.write(self.raw.device_kv, tokens, self.hc.slots(rid)[done : len(tokens)], start=done)
        self.hc.commit({rid: tokens[done:]})

    def serve(self, rid: str, tokens: list[int], namespace: str = "") -> AdmitResult:
        """Admit, compute the rest, finish."""
        res = self.admit(rid, tokens, namespace)
        self.compute(rid, tokens)
        self.hc.finish([res.handle])
        return res

    def ready(self, rids: Sequence[str], step_s: float, tries: int = 400) -> dict[str, int]:
        """Ask `ready` until every request is ready, letting `step_s` pass between asks."""
        got: dict[str, int] = {}
        for _ in range(tries):
            got.update(self.hc.ready([r for r in rids if r not in got]))
            if len(got) == len(rids):
                return got
            advance(self.raw, step_s)
        raise AssertionError(f"not ready after {tries} steps of {step_s}s: {sorted(set(rids) - set(got))}")

    def stats(self) -> Any:
        return self.raw.statistics()


@contextlib.contextmanager
def _servers(kind: str, storage_dir: Path) -> Iterator[Callable[..., Server]]:
    opened: list[HiCache] = []

    def start(faults: Any = None, seed: int = 7, **fields: Any) -> Server:
        hc = HiCache(config(storage_dir, **fields), runtime=make_runtime(kind, seed=seed, faults=faults))
        opened.append(hc.start())
        return Server(hc)

    try:
        yield start
    finally:
        for hc in opened:
            hc.close()


@pytest.fixture
def servers(runtime_kind: str, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """`servers(faults=None, seed=7, **config_fields)`: a started server on this test's runtime,
    storing pages in this test's directory (shared by all its servers); closed at the end."""
    with _servers(runtime_kind, tmp_path / "l3") as start:
        yield start


@pytest.fixture
def det_servers(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """`servers`, always on the deterministic runtime (virtual time, seeded interleavings)."""
    with _servers("deterministic", tmp_path / "l3") as start:
        yield start


def populate(start: Callable[..., Server], prompts: Sequence[list[int]], namespace: str = "", **fields: Any) -> Any:
    """Instance A serves each prompt, waits until its pages are backed up to storage, stops.
    Returns its final statistics."""
    a = start(seed=11, **fields)
    for i, prompt in enumerate(prompts):
        a.serve(f"a{i}", prompt, namespace)
    s = statistics_when(a.raw, quiet, "instance A's backups")
    assert s.tree.backups_failed == 0
    a.raw.close()
    return s


def page_keys_of(tokens: list[int], namespace: str = "", model_id: str = "") -> list[str]:
    """The storage keys of the pages of `tokens` (a hash chain seeded by the model and the namespace, rank 0)."""
    tree = RadixTree(P, EvictionPolicy.LRU, model_id=model_id)
    hashes = tree.chain(tree.root(namespace), Tokens.of(tokens[: len(tokens) - len(tokens) % P]))
    return page_keys(hashes, rank=0)


def stored_pages(storage_dir: Path, tokens: list[int], namespace: str = "", model_id: str = "") -> list[bool]:
    """Which pages of `tokens` the file backend over `storage_dir` holds (a fresh instance's scan)."""
    backend = FileBackend(config(storage_dir))
    try:
        return [backend.exists([k]) == 1 for k in page_keys_of(tokens, namespace, model_id)]
    finally:
        backend.close()


def corrupt_page(storage_dir: Path, key: str) -> Path:
    """Flip a payload byte of `key`'s stored page in place; returns its segment file."""
    backend = FileBackend(config(storage_dir))
    path, offset = backend.locate(key)
    with open(path, "r+b") as f:
        f.seek(offset + backend.fmt.header_bytes + 72)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    backend.close()
    return path


# == the prefetch lifecycle under each termination policy ======================================


@pytest.mark.parametrize("arrived", [0, 2])
def test_best_effort_runs_at_once_with_the_pages_that_arrived(
    servers: Callable[..., Server], arrived: int
) -> None:
    populate(servers, [PROMPT])
    b = servers(StoragePlan(delays=(0.0,) * (arrived // 2), then=BIG_S), prefetch_policy="best_effort")
    assert b.hc.prefetch([Request("q", PROMPT)]) == {"q": 40}
    assert b.hc.prefetching == ("q",)
    statistics_when(b.raw, lambda s: s.prefetch.pages_read == arrived and s.tree.facts_pending == 0, "first read")
    assert b.hc.ready(["q"]) == {"q": arrived * P}
    s = b.stats()
    assert ends(s) == {"best_effort": 1}
    assert (s.tree.host_tokens, s.tree.storage_hit_tokens, s.tree.prefetches_in_flight) == (arrived * P,) * 2 + (0,)
    assert b.hc.prefetching == ()

    res = b.admit("q", PROMPT)
    assert (res.device_hit, res.host_hit) == (0, arrived * P)
    b.compute("q", PROMPT)
    b.hc.finish([res.handle])
    assert_drained(b.raw)


def test_wait_complete_is_ready_only_once_every_page_arrived_and_keeps_them_all(
    servers: Callable[..., Server], runtime_kind: str
) -> None:
    populate(servers, [PROMPT])
    step_s = 1.0 if runtime_kind == "deterministic" else 0.1  # five read steps of two pages
    b = servers(StoragePlan(then=step_s), prefetch_policy="wait_complete")
    assert b.hc.prefetch([Request("q", PROMPT)]) == {"q": 40}
    assert b.hc.ready(["q"]) == {}
    if runtime_kind == "deterministic":  # exact in virtual time: two steps landed, three to go
        advance(b.raw, 2.5)
        assert b.stats().prefetch.pages_read == 4
        assert b.hc.ready(["q"]) == {}
        assert b.stats().tree.prefetches_in_flight == 1
    assert b.ready(["q"], step_s / 4) == {"q": 40}
    s = b.stats()
    assert ends(s) == {"complete": 1}
    assert (s.prefetch.pages_read, s.tree.host_tokens, s.tree.storage_hit_tokens) == (10, 40, 40)

    res = b.admit("q", PROMPT)
    assert (res.device_hit, res.host_hit) == (0, 40)
    b.compute("q", PROMPT + [1, 2])
    b.hc.finish([res.handle])
    assert_drained(b.raw)


@pytest.mark.parametrize(("batch_mb", "steps"), [(0, 5), (1, 1)], ids=["pages-only", "byte-bound"])
def test_small_pages_are_read_in_steps_of_as_many_as_fit_the_byte_bound(
    det_servers: Callable[..., Server], batch_mb: int, steps: int
) -> None:
    """Ten 256-byte pages: two a step by `storage_batch_pages` alone, all ten in one step
    once `storage_batch_mb` lets a step take what fits in 1 MiB (`Config.storage_step_pages`)."""
    populate(det_servers, [PROMPT])
    plan = StoragePlan()
    b = det_servers(plan, prefetch_policy="wait_complete", storage_batch_mb=batch_mb)
    assert b.raw.system.config.storage_step_pages == (2 if batch_mb == 0 else 4096)
    assert b.hc.prefetch([Request("q", PROMPT)]) == {"q": 40}
    assert b.ready(["q"], 0.25) == {"q": 40}
    assert list(plan._reads.values()) == [steps]
    res = b.admit("q", PROMPT)
    assert (res.device_hit, res.host_hit) == (0, 40)
    b.compute("q", PROMPT + [1, 2])
    b.hc.finish([res.handle])
    assert_drained(b.raw)


@pytest.mark.parametrize(
    ("base_s", "per_1k_s", "max_s", "expires_s"),
    [(1.0, 25.0, 10.0, 2.0), (1.0, 1000.0, 3.0, 3.0), (1.5, 0.0, 10.0, 1.5)],
    ids=["base+per_1k", "capped", "flat"],
)
def test_timeout_holds_a_request_until_its_timeout_in_virtual_time_then_keeps_what_arrived(
    det_servers: Callable[..., Server], base_s: float, per_1k_s: float, max_s: float, expires_s: float
) -> None:
    populate(det_servers, [PROMPT])
    b = det_servers(StoragePlan(delays=(0.0,), then=BIG_S), prefetch_policy="timeout", prefetch_timeout_base_s=base_s,
                prefetch_timeout_per_1k_s=per_1k_s, prefetch_timeout_max_s=max_s)
    clock = b.raw.system.runtime.clock
    assert b.hc.prefetch([Request("q", PROMPT)]) == {"q": 40}  # timeout: min(base + per_1k * 0.04, max)
    assert b.hc.ready(["q"]) == {}
    advance(b.raw, expires_s - 0.05)
    assert b.stats().prefetch.pages_read == 2
    assert b.hc.ready(["q"]) == {}
    advance(b.raw, 0.1)
    assert clock.now_s() == pytest.approx(expires_s + 0.05)
    assert b.hc.ready(["q"]) == {"q": 8}
    s = b.stats()
    assert ends(s) == {"timeout": 1}
    assert s.tree.host_tokens == 8

    res = b.admit("q", PROMPT)
    assert (res.device_hit, res.host_hit) == (0, 8)
    b.compute("q", PROMPT)
    b.hc.finish([res.handle])
    assert_drained(b.raw)


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
@pytest.mark.parametrize("why", ["nothing stored", "exists fails"])
def test_a_prefetch_of_pages_storage_does_not_give_ends_as_a_miss(
    servers: Callable[..., Server], policy: str, why: str
) -> None:
    if why == "exists fails":
        populate(servers, [PROMPT])
    b = servers(StoragePlan(fail_exists=why == "exists fails"), prefetch_policy=policy)
    assert b.hc.prefetch([Request("q", PROMPT)]) == {"q": 40}  # reserved before storage is asked
    assert b.ready(["q"], 0.01) == {"q": 0}
    s = b.stats()
    assert ends(s) == {"miss": 1}
    assert (s.tree.host_tokens, s.tree.storage_hit_tokens, s.prefetch.pages_read) == (0, 0, 0)
    assert s.prefetch.errors == (1 if why == "exists fails" else 0)

    res = b.admit("q", PROMPT)
    assert (res.device_hit, res.host_hit) == (0, 0)
    b.compute("q", PROMPT)
    b.hc.finish([res.handle])
    assert_drained(b.raw)


@pytest.mark.parametrize(("policy", "end"), [("wait_complete", "failed"), ("timeout", "timeout"),
                                             ("best_effort", "best_effort")])
def test_a_failed_read_keeps_the_pages_before_it(servers: Callable[..., Server], policy: str, end: str) -> None:
    """Under `timeout` a prefetch that ended short counts as TIMEOUT even when a read failed
    first: the reason must be equal on every rank, and only the policy, the agreed hit and the
    agreed pages are shared (whether a read failed is rank-local)."""
    populate(servers, [PROMPT])
    b = servers(StoragePlan(fail_read=2), prefetch_policy=policy,
                prefetch_timeout_base_s=BIG_S, prefetch_timeout_max_s=BIG_S)  # the timeout never expires
    assert b.hc.prefetch([Request("q", PROMPT)]) == {"q": 40}
    statistics_when(b.raw, lambda s: s.prefetch.errors == 1, "the failed read")
    assert b.ready(["q"], 0.01) == {"q": 16}  # steps 0 and 1 landed, step 2 failed
    s = b.stats()
    assert ends(s) == {end: 1}
    assert (s.prefetch.pages_read, s.tree.host_tokens, s.tree.storage_hit_tokens) == (4, 16, 16)

    res = b.admit("q", PROMPT)
    assert (res.device_hit, res.host_hit) == (0, 16)
    b.compute("q", PROMPT)
    b.hc.finish([res.handle])
    assert_drained(b.raw)


def test_the_rate_limit_shrinks_a_prefetch_to_what_it_leaves_or_skips_one_it_leaves_too_little(
    servers: Callable[..., Server],
) -> None:
    other, third = seq(40, 700), seq(40, 1400)
    populate(servers, [PROMPT, other, third])
    b = servers(StoragePlan(then=BIG_S), prefetch_policy="best_effort")  # 64 of 128 host slots may be prefetching
    started = b.hc.prefetch([Request("q", PROMPT), Request("r", other), Request("s", third)])
    assert started == {"q": 40, "r": 24, "s": 0}  # seed 002 for the rate limit too: r shrinks, s cannot
    assert b.stats().tree.prefetch_skipped == 1
    assert b.hc.ready(["q", "r", "s"]) == {"q": 0, "r": 0, "s": 0}
    assert b.hc.prefetch([Request("s2", third)]) == {"s2": 40}
    b.hc.abort(["s2"])
    s = b.stats()
    assert ends(s) == {"best_effort": 2, "aborted": 1}
    assert (s.tree.prefetches_started, s.tree.prefetch_skipped) == (3, 1)
    assert_drained(b.raw)


def test_pages_computed_while_their_prefetch_was_reading_are_kept_once(
    servers: Callable[..., Server], runtime_kind: str
) -> None:
    populate(servers, [PROMPT])
    step_s = 1.0 if runtime_kind == "deterministic" else 0.05
    b = servers(StoragePlan(then=step_s), prefetch_policy="wait_complete")
    assert b.hc.prefetch([Request("q", PROMPT)]) == {"q": 40}
    b.serve("r", PROMPT)  # another request computes the same prompt meanwhile
    assert b.ready(["q"], step_s / 4) == {"q": 40}
    s = statistics_when(b.raw, quiet, "the write-through")
    assert ends(s) == {"complete": 1}
    assert s.tree.host_tokens == 40  # r's copy; the prefetched duplicates were freed
    res = b.admit("q", PROMPT)
    assert (res.device_hit, res.host_hit) == (40, 0)
    b.hc.finish([res.handle])
    assert_drained(b.raw)


# == seed 002: shrink to the free host space ======================================================


def test_a_prefetch_shrinks_to_the_free_host_space_when_that_still_meets_the_threshold(
    servers: Callable[..., Server],
) -> None:
    populate(servers, [PROMPT])
    b = servers(host_pages=20, prefetch_rate_fraction=1.0, prefetch_policy="wait_complete")  # 80 host slots, 64 device
    b.serve("head", PROMPT[:8])  # the prompt's first two pages: SYNCED, the prefetch's anchor
    b.serve("fill", seq(56, 5000))  # SYNCED too: host eviction cannot take device-resident nodes
    s = statistics_when(b.raw, quiet, "write-throughs")
    assert s.host.slots_in(S.FREE) == 16
    assert s.tree.host_tokens == 64

    assert b.hc.prefetch([Request("q", PROMPT)]) == {"q": 16}  # wanted 32 after the anchor: got the free 16
    s = b.stats()
    assert (s.tree.prefetch_skipped, s.tree.evicted_host_tokens) == (0, 0)
    assert b.ready(["q"], 0.01) == {"q": 16}
    assert ends(b.stats()) == {"complete": 1}  # storage held all four pages it asked for

    res = b.admit("q", PROMPT)  # the anchor's 8 on the device, 16 loaded from the prefetched pages
    assert (res.device_hit, res.host_hit) == (8, 16)
    b.compute("q", PROMPT)
    b.hc.finish([res.handle])
    assert_drained(b.raw)


def test_no_prefetch_starts_when_the_free_host_space_is_below_the_threshold(servers: Callable[..., Server]) -> None:
    populate(servers, [PROMPT])
    b = servers(host_pages=17, prefetch_rate_fraction=1.0, prefetch_policy="wait_complete")  # 68 host slots
    b.serve("head", PROMPT[:8])
    b.serve("fill", seq(56, 5000))
    s = statistics_when(b.raw, quiet, "write-throughs")
    assert s.host.slots_in(S.FREE) == 4  # one page: below the two-page threshold

    assert b.hc.prefetch([Request("q", PROMPT)]) == {"q": 0}
    s = b.stats()
    assert (s.tree.prefetch_skipped, s.tree.prefetches_started, s.tree.prefetches_in_flight) == (1, 0, 0)
    assert s.prefetch.prefetches == 0
    assert b.hc.prefetching == ()
    assert b.hc.ready(["q"]) == {"q": 0}
    res = b.admit("q", PROMPT)
    assert (res.device_hit, res.host_hit) == (8, 0)
    b.compute("q", PROMPT)
    b.hc.finish([res.handle])
    assert_drained(b.raw)  # the anchor it pinned and unpinned can be evicted


def test_a_prefetch_evicts_host_only_leaves_before_it_would_shrink(servers: Callable[..., Server]) -> None:
    populate(servers, [PROMPT])
    b = servers(host_pages=20, prefetch_rate_fraction=1.0, prefetch_policy="wait_complete")  # 80 host slots
    b.serve("fill", seq(64, 5000))
    statistics_when(b.raw, quiet, "write-throughs")
    assert b.hc.evict_device(64) == 64  # now host-only: host eviction may take it
    assert b.hc.prefetch([Request("q", PROMPT)]) == {"q": 40}
    assert b.stats().tree.evicted_host_tokens >= 24
    assert b.ready(["q"], 0.01) == {"q": 40}
    res = b.admit("q", PROMPT)
    assert res.host_hit == 40
    b.hc.abort([res.handle])
    assert_drained(b.raw)


# == abort and retract while pages are being read =================================================


@pytest.mark.parametrize("leave", ["abort", "retract"])
def test_abort_or_retract_mid_prefetch_releases_it_through_the_one_settle_path(
    servers: Callable[..., Server], leave: str
) -> None:
    populate(servers, [PROMPT])
    plan = StoragePlan(delays=(0.0,), then=BIG_S)  # two pages land, then storage stalls
    b = servers(plan, prefetch_policy="wait_complete")
    assert b.hc.prefetch([Request("q", PROMPT)]) == {"q": 40}
    statistics_when(b.raw, lambda s: s.prefetch.pages_read == 2, "the first read step")
    assert b.hc.ready(["q"]) == {}  # still reading
    with pytest.raises(RequestError, match="request 'nope' has no prefetch in flight or settled for it"):
        getattr(b.hc, leave)(["nope"])
    with pytest.raises(RequestError, match="expected a CacheHandle"):
        b.hc.finish(["q"])
    assert b.hc.prefetching == ("q",)  # the refused calls changed nothing

    assert getattr(b.hc, leave)(["q"]) == []  # no ledger: it was never admitted
    s = b.stats()
    assert ends(s) == {"aborted" if leave == "abort" else "retracted": 1}
    assert (s.tree.prefetches_in_flight, s.prefetch.in_flight) == (0, 0)
    assert (s.tree.host_tokens, s.tree.storage_hit_tokens) == (8, 8)  # what arrived is kept, once
    assert b.hc.prefetching == ()

    if leave == "abort":
        with pytest.raises(RequestError, match="request 'q' already aborted"):
            b.hc.prefetch([Request("q", PROMPT)])
        with pytest.raises(RequestError, match="request 'q' already aborted"):
            b.hc.admit([Request("q", PROMPT)])
    else:  # it comes back: the kept pages are in host memory, the rest is prefetched again
        plan.then = 0.0
        assert b.hc.prefetch([Request("q", PROMPT)]) == {"q": 32}
        assert b.ready(["q"], 0.01) == {"q": 32}
        res = b.admit("q", PROMPT)
        assert (res.device_hit, res.host_hit) == (0, 40)
        b.compute("q", PROMPT)
        b.hc.finish([res.handle])
        assert ends(b.stats()) == {"retracted": 1, "complete": 1}
    assert_drained(b.raw)


def test_one_abort_ends_an_admitted_request_by_handle_and_a_prefetching_one_by_id(
    servers: Callable[..., Server],
) -> None:
    populate(servers, [PROMPT])
    b = servers(StoragePlan(then=BIG_S), prefetch_policy="wait_complete")
    [a] = b.hc.admit([Request("a", seq(12, 3000))])
    b.compute("a", seq(12, 3000))
    assert b.hc.prefetch([Request("q", PROMPT)]) == {"q": 40}
    [entry] = b.hc.abort([a.handle, "q"])
    assert (entry.request_id, entry.freed, entry.allocated) == ("a", 12, 12)
    assert b.hc.live_requests == () and b.hc.prefetching == ()
    assert ends(b.stats()) == {"aborted": 1}
    assert_drained(b.raw)


def test_an_abort_right_after_the_prefetch_starts_releases_everything_whatever_the_interleaving(
    det_servers: Callable[..., Server],
) -> None:
    """The seed picks the interleaving and how many deliveries happen between the two calls:
    the stop overtakes the host reservation, the hit, or lands between read steps."""
    populate(det_servers, [PROMPT])
    kept = set()
    for seed in range(24):
        b = det_servers(seed=seed, prefetch_policy="wait_complete", storage_batch_pages=1)
        hc = b.raw  # unchecked: a check between the calls would deliver everything in between
        rt = _deterministic(hc)
        assert rt is not None
        hc.prefetch([Request("q", PROMPT)])
        for _ in range(2 * seed):
            rt.step()
        (hc.retract if seed % 2 else hc.abort)(["q"])
        s = hc.statistics()
        kept.add(s.tree.host_tokens)
        assert ends(s) == {"retracted" if seed % 2 else "aborted": 1}
        assert s.tree.storage_hit_tokens == s.tree.host_tokens
        assert_drained(hc)
        hc.close()
    assert 0 in kept and 40 in kept and len(kept) >= 4, f"the seeds stopped the prefetch at too few points: {kept}"


# == L3 data: one instance writes, another reads ====================================================


@pytest.mark.parametrize(("a_layout", "b_layout"), [("layer_first", "layer_first"), ("page_first", "page_first"),
                                                    ("layer_first", "page_first"), ("page_first", "layer_first")])
def test_pages_one_instance_backed_up_are_prefetched_by_another_and_read_back_exactly(
    servers: Callable[..., Server], a_layout: str, b_layout: str
) -> None:
    other = PROMPT[:16] + seq(12, 900)  # shares four pages with PROMPT
    a = populate(servers, [PROMPT, other], host_layout=a_layout)
    assert (a.tree.stored_tokens, a.prefetch.pages_written) == (52, 13)

    b = servers(host_layout=b_layout, prefetch_policy="wait_complete", prefetch_rate_fraction=1.0)
    assert b.hc.prefetch([Request("q", PROMPT), Request("r", other)]) == {"q": 40, "r": 28}
    assert b.ready(["q", "r"], 0.01) == {"q": 40, "r": 28}
    s = b.stats()
    assert ends(s) == {"complete": 2}
    assert s.tree.host_tokens == 52  # the four shared pages are kept once, their second copy freed
    assert s.prefetch.pages_read == 17

    q = b.admit("q", PROMPT)
    r = b.admit("r", other)
    assert (q.device_hit, q.host_hit, r.cached_tokens) == (0, 40, 28)
    b.compute("q", PROMPT + [5])
    b.compute("r", other)
    b.hc.finish([q.handle, r.handle])
    assert_drained(b.raw)


def test_the_reference_scheduler_serves_a_second_instance_from_the_first_ones_storage(
    servers: Callable[..., Server],
) -> None:
    fields = {"device_pages": 32, "host_pages": 128, "load_back_min_tokens": 4, "prefetch_policy": "wait_complete",
              "prefetch_threshold_pages": 1, "prefetch_rate_fraction": 1.0}
    sched_cfg = SchedulerConfig(max_running=4, prefill_tokens_per_tick=32, chunk_tokens=16, seed=3)

    def serve(server: Server) -> ReferenceScheduler:
        sched = ReferenceScheduler(server.raw, sched_cfg)
        sched.submit(synthetic_workload(3, 10, P, blocks=4, blocks_per_prompt=3, tail_pages=2, outputs_max=3))
        sched.run(on_tick=lambda _: assert_conserved(server.raw))
        return sched

    a = servers(seed=11, **fields)
    serve(a)
    stored = statistics_when(a.raw, quiet, "instance A's backups").tree.stored_tokens
    assert stored > 0
    a.raw.close()

    b = servers(**fields)
    sb = serve(b)  # its fake model checks every prefix the cache supplied, layer by layer
    outcomes = list(sb.outcomes.values())
    assert all(o.finished for o in outcomes)
    storage = sum(o.prefetched_tokens for o in outcomes)
    assert storage > 0 and sum(o.storage_hit > 0 for o in outcomes) >= 3
    s = statistics_when(b.raw, quiet, "instance B's backups")
    assert s.tree.storage_hit_tokens == storage
    assert sb.model.verified_tokens >= storage
    assert not sb._prefetch_tried and not sb._read  # the scheduler keeps nothing of a request it admitted
    assert s.tree.stored_tokens < stored  # B stores only the pages A had not
    assert_drained(b.raw)


def test_a_corrupt_page_in_shared_storage_is_a_miss_and_the_pages_before_it_are_used(
    servers: Callable[..., Server], tmp_path: Path
) -> None:
    populate(servers, [PROMPT])
    assert all(stored_pages(tmp_path / "l3", PROMPT))
    corrupt_page(tmp_path / "l3", page_keys_of(PROMPT)[5])  # the checksum no longer matches

    b = servers(prefetch_policy="wait_complete")
    assert b.hc.prefetch([Request("q", PROMPT)]) == {"q": 40}  # its size is right: exists() counts it
    assert b.ready(["q"], 0.01) == {"q": 20}
    s = b.stats()
    assert ends(s) == {"failed": 1}
    assert (s.prefetch.pages_read, s.prefetch.errors) == (5, 1)
    assert stored_pages(tmp_path / "l3", PROMPT)[5:] == [False] + [True] * 4  # dropped: the backup rewrites it

    res = b.admit("q", PROMPT)
    assert (res.device_hit, res.host_hit) == (0, 20)
    b.compute("q", PROMPT)
    b.hc.finish([res.handle])
    s = statistics_when(b.raw, quiet, "the backup")
    assert (s.tree.stored_tokens, s.prefetch.pages_written) == (4, 1)  # page 5 only; 6..9 were there
    assert all(stored_pages(tmp_path / "l3", PROMPT))
    assert_drained(b.raw)

    c = servers(prefetch_policy="wait_complete")  # the repaired page reads back exactly
    assert_reads_back_whole(c, "q")


def test_a_corrupt_page_storage_cannot_remove_is_a_miss_and_the_prefetcher_serves_on(
    servers: Callable[..., Server], tmp_path: Path
) -> None:
    populate(servers, [PROMPT])
    segment = corrupt_page(tmp_path / "l3", page_keys_of(PROMPT)[5])
    files = [segment]
    subprocess.run(["chattr", "+i", *map(str, files)], check=True)  # read-only, even for root
    try:
        b = servers(prefetch_policy="wait_complete")
        assert b.hc.prefetch([Request("q", PROMPT)]) == {"q": 40}
        assert b.ready(["q"], 0.01) == {"q": 20}
        s = b.stats()
        assert (s.prefetch.pages_read, s.prefetch.errors, s.prefetch.io_errors) == (5, 1, 1)
        res = b.admit("q", PROMPT)  # the cache serves on: the pages before the corrupt one are used
        assert res.host_hit == 20
        b.compute("q", PROMPT)
        b.hc.finish([res.handle])
        assert_drained(b.raw)
    finally:
        subprocess.run(["chattr", "-i", *map(str, files)], check=True)


def test_two_namespaces_with_the_same_tokens_never_hit_each_others_pages(
    servers: Callable[..., Server], tmp_path: Path
) -> None:
    populate(servers, [PROMPT], namespace="tenant-a")
    assert not set(page_keys_of(PROMPT, "tenant-a")) & set(page_keys_of(PROMPT, "tenant-b"))
    assert all(stored_pages(tmp_path / "l3", PROMPT, "tenant-a"))
    assert not any(stored_pages(tmp_path / "l3", PROMPT, "tenant-b"))

    b = servers(prefetch_policy="wait_complete", prefetch_rate_fraction=1.0, device_pages=32, host_pages=64)
    assert b.hc.prefetch([Request("x", PROMPT, "tenant-b"), Request("y", PROMPT, "tenant-a")]) == {"x": 40, "y": 40}
    assert b.ready(["x", "y"], 0.01) == {"x": 0, "y": 40}
    assert ends(b.stats()) == {"miss": 1, "complete": 1}
    x = b.admit("x", PROMPT, "tenant-b")
    y = b.admit("y", PROMPT, "tenant-a")
    assert (x.cached_tokens, y.host_hit) == (0, 40)
    b.compute("x", PROMPT)
    b.compute("y", PROMPT)
    b.hc.finish([x.handle, y.handle])
    statistics_when(b.raw, quiet, "the backup")
    assert all(stored_pages(tmp_path / "l3", PROMPT, "tenant-b"))  # tenant-b's own pages, under its own keys
    assert_drained(b.raw)


def test_models_sharing_a_storage_never_read_each_others_pages(
    servers: Callable[..., Server], tmp_path: Path
) -> None:
    """Two models of one KV shape (a base model and its fine-tune, say) computing the same
    prompt get different KV: each must miss the other's pages, and hit its own."""
    populate(servers, [PROMPT], model_id="org/base")
    assert all(stored_pages(tmp_path / "l3", PROMPT, model_id="org/base"))
    assert not any(stored_pages(tmp_path / "l3", PROMPT, model_id="org/base-instruct"))
    assert not any(stored_pages(tmp_path / "l3", PROMPT))  # nor a cache that names no model

    tuned = servers(prefetch_policy="wait_complete", model_id="org/base-instruct")
    assert tuned.hc.prefetch([Request("x", PROMPT)]) == {"x": 40}  # not in L1 or L2: looked for in storage
    assert tuned.ready(["x"], 0.01) == {"x": 0}
    assert ends(tuned.stats()) == {"miss": 1}
    x = tuned.admit("x", PROMPT)
    assert x.cached_tokens == 0
    tuned.compute("x", PROMPT)
    tuned.hc.finish([x.handle])
    assert statistics_when(tuned.raw, quiet, "the backup").tree.storage_hit_tokens == 0
    assert all(stored_pages(tmp_path / "l3", PROMPT, model_id="org/base-instruct"))  # under its own keys
    assert_drained(tuned.raw)

    base = servers(prefetch_policy="wait_complete", model_id="org/base")
    assert_reads_back_whole(base, "y")


def test_a_cache_that_starts_with_storage_and_names_no_model_says_so(tmp_path: Path) -> None:
    for model_id, warned in [("", True), ("org/base", False)]:
        with capture_logs() as logs, HiCache(config(tmp_path / "l3", model_id=model_id)):
            pass
        said = [e for e in logs if e["event"].startswith("storage keys name no model")]
        assert [(e["log_level"], e["storage"]) for e in said] == ([("warning", "file")] if warned else []), logs
    with capture_logs() as logs, HiCache(small_config()):  # no storage: nothing to name
        pass
    assert not [e for e in logs if e["event"].startswith("storage keys")], logs


def test_a_model_id_and_a_namespace_seed_the_page_hashes_without_ambiguity() -> None:
    assert root_hash("", "tenant") == int.from_bytes(hashlib.blake2b(b"tenant", digest_size=16).digest(), "little")
    pairs = [("", ""), ("a", "bc"), ("ab", "c"), ("abc", ""), ("", "abc"), ("1:a", ""), ("a", ""), ("", "1:a"),
             ("", "a")]
    assert len({root_hash(m, ns) for m, ns in pairs}) == len(pairs)
    # the chain of blake2b-128 digests from blake2b-128(b""): 32 hex digits a key
    assert page_keys_of(PROMPT)[:2] == ["b83fccd17fbf8f918839ac38688f9dba-r0", "23cc4de76855d34d3fb5d1578bced1b0-r0"]


# == backup to storage ==============================================================================


def test_a_backup_lands_in_storage_and_an_existing_page_is_not_rewritten(
    servers: Callable[..., Server], tmp_path: Path
) -> None:
    a = populate(servers, [PROMPT])
    assert (a.tree.stored_tokens, a.prefetch.pages_written, a.tree.backups_done) == (40, 10, 1)
    assert a.prefetch.bytes_written == 10 * P * KVShape.of(config(tmp_path)).bytes_per_slot
    assert a.prefetch.stored_bytes >= a.prefetch.bytes_written and a.prefetch.evicted_pages == 0
    before = {p: p.stat().st_size for p in (tmp_path / "l3").iterdir()}

    b = servers()
    res = b.serve("q", PROMPT)  # computes the same pages itself; its write-through then backs them up
    assert res.cached_tokens == 0
    s = statistics_when(b.raw, quiet, "the backup")
    assert (s.tree.backups_done, s.tree.stored_tokens, s.prefetch.pages_written, s.prefetch.errors) == (1, 0, 0, 0)
    assert {p: p.stat().st_size for p in (tmp_path / "l3").iterdir()} == before  # nothing written
    assert_drained(b.raw)  # PagesStored unpinned the node: host eviction may take it


def test_a_failed_backup_unpins_its_node_and_stores_nothing(servers: Callable[..., Server], tmp_path: Path) -> None:
    b = servers(StoragePlan(fail_write=True))
    b.serve("q", PROMPT)
    s = statistics_when(b.raw, quiet, "the backup")
    assert (s.tree.backups_done, s.tree.stored_tokens, s.prefetch.errors) == (1, 0, 1)
    assert not any(stored_pages(tmp_path / "l3", PROMPT))
    assert_drained(b.raw)


# == TreeCore directly: orderings the actors make hard to pin down ====================================


class StoragePlayer(Player):
    """A `Player` that also plays the storage prefetcher: keys in `stored` exist; reads and
    backups wait until the test lands them; host reservations may be held."""

    def __init__(self, cfg: Config, **kwargs: Any) -> None:
        super().__init__(cfg, **kwargs)
        self.stored: set[str] = set()
        self.keys: dict[int, tuple[str, ...]] = {}
        self.host_pages: dict[int, Indices] = {}
        """Each prefetch's host pages, one per key, as its `Prefetch` named them."""
        self.asked: dict[int, int] = {}
        self.done: dict[int, int] = {}
        self.backups: dict[int, StorePages] = {}
        self.hold_host = False
        self.held: list[AllocateHost] = []

    def check(self) -> None:
        held = sum(m.tokens for m in self.held)  # reserved in the mirror, not yet in the pool
        self.tree.check_invariants()
        self.device.check_invariants()
        self.host.check_invariants()
        if not self.tree.outbox:
            assert self.tree.host_free + held == self.host.free_slots, "the tree's mirror of free host slots drifted"

    PLAYS = (*Player.PLAYS, ActorName.PREFETCH)

    def _deliver(self, to: Any, m: Any) -> None:
        if isinstance(m, AllocateHost) and self.hold_host:
            HOST_ROUTES.check(ActorName.TREE, m)
            self.held.append(m)
            return
        super()._deliver(to, m)
        match m:
            case Prefetch(op_id=op, keys=keys, host=host):
                self.keys[op] = keys
                self.host_pages[op] = host
                hit = next((i for i, k in enumerate(keys) if k not in self.stored), len(keys))
                self.to_tree(PREFETCH, PrefetchHit(op_id=op, pages=hit))
            case ReadPrefetch(op_id=op, pages=n):
                self.asked[op] = n
                self.done[op] = 0
            case StopPrefetch(op_id=op):
                self.asked.pop(op, None)
                self.to_tree(PREFETCH, PrefetchStopped(op_id=op, pages=self.done.pop(op, 0)))
            case StorePages(op_id=op):
                self.backups[op] = m

    # -- the test's hands --------------------------------------------------------------

    def release_host(self) -> None:
        held, self.held = self.held, []
        for m in held:
            self.to_tree(ActorName.HOST, HOST_ROUTES.deliver(self.host_side, ActorName.TREE, m))
        self.pump()

    def read(self, op: int, pages: int, tokens: list[int], start: int) -> None:
        """Land `pages` more pages of prefetch `op` (fingerprint KV of `tokens` from `start`)."""
        a = self.done[op]
        b = a + pages
        assert b <= self.asked[op]
        self.oracle.write(self.host.kv, tokens, pages_to_slots(self.host_pages[op][a:b], P), start=start + a * P)
        self.done[op] = b
        self.to_tree(PREFETCH, PrefetchProgress(op_id=op, pages=b, finished=b == self.asked[op], error=""))
        self.pump()

    def land_backups(self, pages: int | None = None) -> None:
        for op, m in sorted(self.backups.items()):
            n = len(m.keys) if pages is None else pages
            self.stored.update(m.keys[:n])
            self.to_tree(PREFETCH, PagesStored(op_id=op, pages=n, written=n, error=""))
        self.backups.clear()
        self.pump()

    def prefetch(self, rid: str, tokens: list[int]) -> int:
        op = next(self._ops)
        items = (AdmitItem(request_id=rid, namespace="", tokens=Tokens.of(tokens)),)
        self.to_tree(ActorName.FACADE, PrefetchRequests(op_id=op, items=items))
        self.pump()
        return self._reply(op, PrefetchesStarted).tokens[0]

    def terminate(self, rids: Sequence[str], reason: PrefetchEnd = PrefetchEnd.BEST_EFFORT) -> int:
        op = next(self._ops)
        self.to_tree(ActorName.FACADE, TerminatePrefetches(op_id=op, request_ids=tuple(rids), reason=reason))
        self.pump()
        return op

    def stopped(self, op: int) -> tuple[int, ...] | None:
        if not any(getattr(r, "op_id", None) == op for r in self.replies):
            return None
        return self._reply(op, PrefetchesStopped).pages

    def settle(self, rids: Sequence[str], pages: Sequence[int]) -> tuple[int, ...]:
        op = next(self._ops)
        self.to_tree(ActorName.FACADE, SettlePrefetches(op_id=op, request_ids=tuple(rids), pages=tuple(pages)))
        self.pump()
        return self._reply(op, PrefetchesSettled).tokens

    def keys_of(self, tokens: list[int]) -> list[str]:
        t = self.tree.tree
        return page_keys(t.chain(t.root(""), Tokens.of(tokens)), rank=0)


@pytest.fixture
def storage_player(tmp_path: Path) -> Callable[..., StoragePlayer]:
    return lambda **fields: StoragePlayer(config(tmp_path / "l3", **fields))


def test_a_prefetch_pins_its_anchor_until_settled_and_its_pages_load_back_exactly(
    storage_player: Callable[..., StoragePlayer],
) -> None:
    p = storage_player()
    p.stored.update(p.keys_of(PROMPT))
    p.finish(p.run("a", PROMPT[:8]))
    p.complete_writes()
    p.land_backups()
    assert p.evict_device(8) == 8
    anchor = p.node(PROMPT[:8])
    assert (anchor.state, anchor.host_ref) == (NodeState.HOST_ONLY, 0)

    assert p.prefetch("q", PROMPT) == 32  # the pages after the anchor
    [op] = p.keys
    assert list(p.keys[op]) == p.keys_of(PROMPT)[2:]  # the hash chain continues from the anchor
    assert anchor.host_ref == 1
    assert p.evict_host(1000) == 0  # the pinned anchor stays
    p.read(op, 4, PROMPT, 8)
    p.read(op, 4, PROMPT, 8)
    assert p.tree.prefetch_states(["q"]) == (True,)
    assert p.stopped(p.terminate(["q"])) == (8,)
    assert p.settle(["q"], [8]) == (32,)
    node = p.node(PROMPT)
    assert (node.state, node.parent, node.tokens, node.stored) == (NodeState.HOST_ONLY, anchor, 32, True)
    assert (anchor.host_ref, node.host_ref) == (1, 1)  # the settled pages are held for q's admission
    assert p.evict_host(1000) == 0

    [q] = p.admit(("q", PROMPT))
    assert (anchor.host_ref, node.host_ref) == (0, 0)  # from here on q's lock holds what it uses
    assert (q.device_hit, q.host_hit) == (0, 40)
    p.complete_loads()
    p.oracle.verify(p.device.kv, PROMPT, q.slots)
    p.finish(q)
    p.assert_idle()


def test_a_prefetch_reads_only_pages_missing_from_l1_and_l2_and_attaches_them_once_the_rest_is_backed_up(
    storage_player: Callable[..., StoragePlayer],
) -> None:
    p = storage_player(write_policy="write_through_selective")  # a node is backed up on its second hit
    p.stored.update(p.keys_of(PROMPT))
    for rid in ("a", "a2"):
        p.finish(p.run(rid, PROMPT[:8]))
    p.complete_writes()
    p.land_backups()
    p.finish(p.run("b", PROMPT[:16]))  # one hit: pages 2-3 are in device memory only
    anchor, held = p.node(PROMPT[:8]), p.node(PROMPT[:16])
    assert (anchor.state, held.state) == (NodeState.SYNCED, NodeState.DEVICE)

    mark = len(p.sent)
    assert p.prefetch("q", PROMPT) == 24  # the six pages L1 and L2 miss, not the two in device memory
    [op] = p.keys
    assert list(p.keys[op]) == p.keys_of(PROMPT)[4:]
    assert held.state is NodeState.WRITING  # backed up now, so that the read pages can hang under it
    assert [m.tokens for m in p.sent_since(mark, AllocateHost)] == [8, 24]
    p.complete_writes()
    p.read(op, 6, PROMPT, 16)
    assert p.stopped(p.terminate(["q"])) == (6,)
    assert p.settle(["q"], [6]) == (24,)
    node = p.node(PROMPT)
    assert (node.state, node.parent, node.tokens) == (NodeState.HOST_ONLY, held, 24)
    [q] = p.admit(("q", PROMPT))
    assert (q.device_hit, q.host_hit) == (16, 24)
    p.complete_loads()
    p.oracle.verify(p.device.kv, PROMPT, q.slots)
    p.finish(q)
    p.land_backups()
    p.assert_idle()


def test_a_stop_that_overtakes_the_host_reservation_reaches_storage_once_and_frees_everything(
    storage_player: Callable[..., StoragePlayer],
) -> None:
    p = storage_player()
    p.stored.update(p.keys_of(PROMPT))
    p.hold_host = True
    assert p.prefetch("q", PROMPT) == 40
    mark = len(p.sent)
    op = p.terminate(["q"], PrefetchEnd.ABORTED)
    assert p.stopped(op) is None  # it waits for the host pool's answer
    assert p.sent_since(mark, Prefetch, StopPrefetch) == []
    p.release_host()
    sent = p.sent_since(mark, Prefetch, StopPrefetch, ReadPrefetch)
    assert [type(m) for m in sent] == [Prefetch, StopPrefetch]  # never told to read
    assert p.stopped(op) == (0,)
    assert p.settle(["q"], [0]) == (0,)
    assert p.tree.statistics().prefetch_ends.aborted == 1
    assert p.host.free_slots == p.config.host_slots == p.tree.host_free
    assert p.tree.idle()


def test_a_refused_host_reservation_ends_the_prefetch_with_nothing_to_free(
    storage_player: Callable[..., StoragePlayer],
) -> None:
    p = storage_player()
    p.refuse_host = True
    assert p.prefetch("q", PROMPT) == 40
    assert p.tree.prefetch_states(["q"]) == (True,)  # a refused reservation is a miss
    assert p.stopped(p.terminate(["q"])) == (0,)
    assert p.settle(["q"], [0]) == (0,)
    s = p.tree.statistics()
    assert s.prefetch_ends.miss == 1
    assert p.host.free_slots == p.config.host_slots == p.tree.host_free
    assert p.tree.idle()


def test_settling_a_prefetch_before_its_prefetcher_stopped_is_refused(
    storage_player: Callable[..., StoragePlayer],
) -> None:
    p = storage_player()
    p.stored.update(p.keys_of(PROMPT))
    assert p.prefetch("q", PROMPT) == 40
    with pytest.raises(InvariantError, match="settled before its prefetcher stopped"):
        p.tree.settle_prefetches(999, ["q"], [0])
    p.check()
    assert p.stopped(p.terminate(["q"])) == (0,)
    assert p.settle(["q"], [0]) == (0,)
    assert p.tree.idle() and p.host.free_slots == p.config.host_slots


def test_overlapping_prefetches_keep_each_page_once_and_free_the_duplicates(
    storage_player: Callable[..., StoragePlayer],
) -> None:
    p = storage_player(prefetch_rate_fraction=1.0)
    other = PROMPT[:16] + seq(12, 900)
    p.stored.update(p.keys_of(PROMPT) + p.keys_of(other))
    assert (p.prefetch("q", PROMPT), p.prefetch("r", other)) == (40, 28)
    op_q, op_r = sorted(p.keys)
    p.read(op_q, 10, PROMPT, 0)
    p.read(op_r, 7, other, 0)
    assert p.stopped(p.terminate(["q", "r"])) == (10, 7)
    assert p.settle(["q", "r"], [10, 7]) == (40, 28)
    assert p.tree.tree.host_tokens == 52
    assert p.host.free_slots == p.config.host_slots - 52
    [r] = p.admit(("r", other))
    assert r.host_hit == 28
    p.complete_loads()
    p.oracle.verify(p.device.kv, other, r.slots)
    p.finish(r)
    assert not p.tree.idle()  # q's settled pages are held for its admission...
    assert p.stopped(p.terminate(["q"])) == (0,)  # ...until it leaves without one
    assert p.settle(["q"], [0]) == (0,)
    p.assert_idle()


def test_a_short_hit_frees_the_surplus_pages_and_settling_fewer_keeps_exactly_the_agreed_pages(
    storage_player: Callable[..., StoragePlayer],
) -> None:
    p = storage_player()
    p.stored.update(p.keys_of(PROMPT)[:6])  # storage holds six of the ten pages
    mark = len(p.sent)
    assert p.prefetch("q", PROMPT) == 40
    [op] = p.keys
    host = p.host_pages[op]
    assert len(host) == 10  # one host page per key
    [surplus] = p.sent_since(mark, FreeHostSlots)
    assert surplus.pages == host[6:]
    [reading] = p.sent_since(mark, SetHostState)
    assert (reading.pages, reading.state) == (host[:6], S.PREFETCHING)
    assert p.asked[op] == 6
    p.read(op, 6, PROMPT, 0)
    assert p.stopped(p.terminate(["q"])) == (6,)

    mark = len(p.sent)
    assert p.settle(["q"], [4]) == (16,)  # the ranks agreed on four pages
    node = p.node(PROMPT[:16])
    assert (node.state, node.host) == (NodeState.HOST_ONLY, host[:4])
    moves = [(m.pages, m.state) for m in p.sent_since(mark, SetHostState)]
    assert moves == [(host[:4], S.HOST_ONLY), (host[4:6], S.RESERVED)]
    [freed] = p.sent_since(mark, FreeHostSlots)
    assert freed.pages == host[4:6]
    assert p.host.states(host.as_tensor()).tolist() == [S.HOST_ONLY] * 4 + [S.FREE] * 6
    assert p.host.free_slots == p.config.host_slots - 16 == p.tree.host_free

    [q] = p.admit(("q", PROMPT))
    assert (q.device_hit, q.host_hit) == (0, 16)
    p.complete_loads()
    p.oracle.verify(p.device.kv, PROMPT[:16], q.slots)
    p.finish(q, reason=ReleaseReason.ABORTED)
    p.assert_idle()


def test_a_backup_pins_its_node_until_it_lands_and_a_partial_one_is_not_marked_stored(
    storage_player: Callable[..., StoragePlayer],
) -> None:
    p = storage_player()
    p.finish(p.run("a", PROMPT))
    p.complete_writes()
    [store] = p.backups.values()
    assert list(store.keys) == p.keys_of(PROMPT)
    node = p.node(PROMPT)
    assert (node.state, node.host_ref) == (NodeState.SYNCED, 1)
    assert p.evict_device(40) == 40
    assert p.evict_host(40) == 0  # pinned by the backup in flight
    p.land_backups(pages=6)
    assert (node.host_ref, node.stored) == (0, False)
    assert p.tree.statistics().stored_tokens == 24
    assert p.evict_host(40) == 40
    p.assert_idle()

    p.finish(p.run("b", PROMPT))  # computed again: backed up again, all of it this time
    p.complete_writes()
    p.land_backups()
    node = p.node(PROMPT)
    assert (node.host_ref, node.stored) == (0, True)
    p.assert_idle()
