"""Seeded random sequences of the facade's calls, as a scheduler makes them and as it gets
them wrong, on the threaded runtime with every tier.

A seed picks a page size, pool sizes, a write policy, a storage tier (none or files) and a
prefetch policy, whether the write stream runs on a thread of its own, whether copies,
host reservations and storage calls fail now and then, and whether requests come in two
namespaces whose KV differs for the same tokens. Then it makes 160 calls:
admissions of one to three requests in one call (new ids and retracted ones, some after a
storage prefetch, some given up by id while it runs), their slots allocated in one call
(per request or as one flat tensor), prefills committed in pieces, decode steps that
allocate and commit in one call, `cache_unfinished`, finish, abort and retract of one or
two requests a call, device and host eviction, restarts, and calls a scheduler must not
make (each a one-line `RequestError` that changes nothing). About half the seeds of one
instance overlap admissions as an overlap scheduler does: each admission comes while the
last one's load-backs are in flight, and may hit the pages they load. Token ids come in
every accepted form. The KV of every position is the fingerprint oracle's, written into the
slots the cache handed out; every cached prefix an admission reports is read back from
device memory and compared with it, whichever tier it came from, and so is a request's
committed prefix after `cache_unfinished`, in the slots the cache then reports. After each
call the invariants of every actor and of the facade are checked. Some seeds log their
deliveries, and the log (of the last start) must replay with no divergence; some export
Prometheus metrics, whose counters must never fall between the scrapes after each call; after
each `quiesce` the tokens `statistics()` counts as looked up and as hit in each tier are those
the admissions reported (a host hit once its load-back landed, since a failed one served none);
half check every K/V write against the slots live requests hold (`check_kv_writes`), which
must refuse none of this well-behaved caller's writes; half check every read
(`check_kv_reads`: live slots, load-backs landed), which must refuse none of its reads.

A second test runs two such instances (two servers) over one storage directory whose size
bound keeps each evicting the other's pages.

A failure names its seed and step: rerun that seed to reproduce it (the threads' timing
may move it).
"""

from __future__ import annotations

import math
import random
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hicache.actors import KVShape, LoadFailedError, SeededFaults
from hicache.messages import PrefetchEnd
from hicache.runtime import Config, HiCache, Insufficient, Request, RequestError, ThreadedRuntime, read_log
from hicache.runtime.oracle import FingerprintOracle
from hicache.runtime.testing import replay_log

pytestmark = pytest.mark.timeout(120)

STEPS = 160


@dataclass
class _Truth:
    looked_up: int = 0
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0


@dataclass
class _Admission:
    """The requests of one `admit` call, as admitted, and the waiter of their load-backs."""

    rids: list[str]
    prompts: list[list[int]]
    spaces: list[str]
    admitted: list[Any]
    waiter: Any = None


class _Run:
    """One seed's calls and the scheduler-side state they need."""

    def __init__(self, seed: int, tmp_path: Path, *, like: _Run | None = None, storage_max_bytes: int = 0) -> None:
        """`like`: another run whose page size, storage directory and conversations this one
        shares (a second server over the same storage). With `like` or a `storage_max_bytes`,
        a run has a host tier and file storage whatever its seed draws."""
        self.seed = seed
        rng = self.rng = random.Random(seed)
        p = self.page = rng.choice([1, 2, 4, 8]) if like is None else like.page
        device = p * rng.choice([24, 40, 64])
        config = Config(layers=2, kv_heads=1, head_dim=4, page_size=p, device_slots=device,
                        host_slots=device * rng.choice([2, 4]),
                        host_tier=rng.random() < 0.8 or like is not None or storage_max_bytes > 0,
                        write_policy=rng.choice(["write_through", "write_back", "write_through_selective"]))
        if config.host_tier and (rng.random() < 0.6 or like is not None or storage_max_bytes > 0):
            config = config.replace(storage="file", storage_dir=str(tmp_path / "l3"), prefetch_threshold_pages=1,
                                    prefetch_policy=rng.choice(["best_effort", "wait_complete", "timeout"]),
                                    storage_max_bytes=storage_max_bytes)
        self.logged = seed % 3 == 0
        if self.logged:
            config = config.replace(log_path=str(tmp_path / f"deliveries-{seed}.log"))
        if seed % 2:  # every write of a well-behaved caller is one the write check lets through
            config = config.replace(check_kv_writes=True)
        if seed % 4 in (1, 2):  # and every read (failed copies among them: seed % 4 == 1)
            config = config.replace(check_kv_reads=True)
        self.exported = seed % 6 == 2
        if self.exported:  # its Prometheus samples are scraped after every call (`scrape`)
            config = config.replace(metrics=True, metrics_name=f"random-{seed}-{tmp_path.name}")
        self.config = config
        self.counted: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        """The last scrape's cumulative samples (counters, histogram sums and counts) by name and labels."""
        faults = None
        if seed % 4 == 1:  # failed copies, refused host reservations, failed storage calls
            faults = SeededFaults(seed, transfer_fail_rate=0.15, host_exhausted_rate=0.1, storage_fail_rate=0.1)
        self.runtime = ThreadedRuntime(write_stream_thread=rng.random() < 0.5, faults=faults)
        # Half the seeds serve two namespaces (two adapters, say) whose KV differs for the same
        # tokens: a prefix cached under one must never be served to the other.
        self.spaces = random.Random(seed * 7 + 3)
        self.namespaces = ["", "adapter-1"] if self.spaces.random() < 0.5 else [""]
        self.set_shape(config)
        vocab = [rng.randrange(1, 50) for _ in range(6)] if like is None else like.vocab
        self.vocab = vocab
        self.stems = ([[rng.choice(vocab) for _ in range(rng.randrange(1, 3 * p + 4))] for _ in range(4)]
                      if like is None else like.stems)
        self.live: dict[str, dict[str, Any]] = {}
        self.retracted: list[str] = []
        self.turns: list[tuple[list[int], str]] = []
        """The committed tokens of finished requests, which a later admission may continue."""
        self.overlap = random.Random(seed * 11 + 5)
        """The overlapped run's own choices (so that the other seeds' calls stay as they were)."""
        self.overlapped = self.overlap.random() < 0.5 and like is None and not storage_max_bytes
        # (the two instances over one bounded directory call as before: their seeds are those
        # whose calls make the bound evict)
        self.pending: _Admission | None = None
        """An overlapped run's last admission, whose forward pass runs until the next one."""
        self.made = 0
        self.verified = 0
        self.truth = _Truth()
        """What this start's admissions looked up and were served, as the scheduler saw them."""

    def set_shape(self, config: Config) -> None:
        """The fingerprint oracle of each namespace, for `config`'s KV shape."""
        self.models = {ns: FingerprintOracle(KVShape.of(config), seed=i) for i, ns in enumerate(self.namespaces)}

    def tokens(self, ids: list[int]) -> Any:
        """`ids` in one of the forms the facade takes."""
        form = self.rng.randrange(5)
        if form == 1:
            return torch.tensor(ids, dtype=torch.int64)
        if form == 2:
            return numpy.array(ids, dtype=numpy.int64)
        if form == 3:
            return array("q", ids)
        return tuple(ids) if form == 4 else list(ids)

    def write(self, cache: HiCache, st: dict[str, Any], upto: int) -> None:
        """The oracle's KV of positions `st["committed"]`..`upto` into the request's slots."""
        start = st["committed"]
        if upto > start:
            kv = cache.kv
            new = self.models[st["ns"]].expected(st["tokens"][:upto], start, upto)
            for layer in range(kv.layers):
                kv.write(layer, st["slots"][start:upto], new[0, layer], new[1, layer])

    def commit(self, cache: HiCache, rid: str, upto: int) -> None:
        st = self.live[rid]
        self.write(cache, st, upto)
        cache.commit({rid: self.tokens(st["tokens"][st["committed"]:upto])})
        st["committed"] = upto

    def admit(self, cache: HiCache, step: int, k: int) -> None:
        """`k` requests admitted in one call (some after a prefetch from storage), their
        load-backs started, waited for and their cached prefixes read back, their slots
        allocated in one call (per request, or as one flat tensor) and the first piece of each
        prefill committed in one call.

        An overlapped run admits them while the last admission's forward pass runs, as an
        overlap scheduler does: that admission's load-backs are in flight, and the new
        requests may hit what they are loading. Their own loads start before or after that
        forward pass waits for its loads, and they wait for theirs at the next admission (or
        at a quiesce, a restart, the end)."""
        admission = self.admission(cache, step, k)
        if not self.overlapped:
            if admission is not None:
                admission.waiter = cache.start_loads()
                self.served(cache, step, admission)
            return
        earlier, self.pending = self.pending, None
        if admission is not None and earlier is not None and self.overlap.random() < 0.5:
            admission.waiter = cache.start_loads()  # started while the earlier forward pass runs
        if earlier is not None:
            self.served(cache, step, earlier)
        if admission is not None:
            if admission.waiter is None:
                admission.waiter = cache.start_loads()
            self.pending = admission

    def end_pending(self, cache: HiCache, step: int) -> None:
        """The forward pass of an overlapped run's last admission, before a call that needs
        every admission settled."""
        if self.pending is not None:
            earlier, self.pending = self.pending, None
            self.served(cache, step, earlier)

    def admission(self, cache: HiCache, step: int, k: int) -> _Admission | None:
        """`k` requests chosen (new, retracted ones, next turns; some prefetched) and admitted."""
        rng = self.rng
        rids: list[str] = []
        prompts: list[list[int]] = []
        spaces: list[str] = []
        for _ in range(k):
            if self.retracted and rng.random() < 0.4:
                rid = self.retracted.pop(rng.randrange(len(self.retracted)))  # a retracted id may come back
            else:
                self.made += 1
                rid = f"r{self.made}"
            # A new conversation from a shared stem, or the next turn of one that finished (its
            # prompt, the tokens it decoded, and new ones): the turn's hit reads decoded KV back.
            if self.turns and rng.random() < 0.5:  # a conversation goes on in its namespace
                start, ns = rng.choice(self.turns)
            else:
                start, ns = rng.choice(self.stems), self.spaces.choice(self.namespaces)
            ids = list(start) + [rng.choice(self.vocab) for _ in range(rng.randrange(1, 2 * self.page + 3))]
            if self.config.storage.value != "none" and rng.random() < 0.5:
                if cache.prefetch([Request(rid, ids[:-1], ns)]).get(rid) and rng.random() < 0.2:
                    cache.abort([rid])  # a queued request given up while its prefetch runs
                    continue
                for _ in range(5000):  # once per scheduler tick
                    if cache.ready([rid]):
                        break
                    time.sleep(0.001)
                else:
                    raise AssertionError(f"seed {self.seed} step {step}: the prefetch of {rid} was never ready")
            rids.append(rid)
            prompts.append(ids)
            spaces.append(ns)
        if not rids:
            return None
        admitted = cache.admit([Request(rid, self.tokens(ids[:-1]), ns) for rid, ids, ns in zip(rids, prompts, spaces)])
        self.truth.looked_up += sum(len(ids) - 1 for ids in prompts)
        self.truth.device_hit += sum(adm.device_hit for adm in admitted)
        return _Admission(rids, prompts, spaces, admitted)

    def served(self, cache: HiCache, step: int, admission: _Admission) -> None:
        """An admission's load-backs waited for (a failed one retracts it) and its cached
        prefixes read back; its slots allocated and the first piece of each prefill committed."""
        rng = self.rng
        rids, prompts, spaces, admitted = admission.rids, admission.prompts, admission.spaces, admission.admitted
        assert admission.waiter is not None
        try:
            admission.waiter.wait_all()
        except LoadFailedError:  # the tree dropped what did not load: retract, and admit again later
            cache.retract([adm.handle for adm in admitted])
            self.retracted += rids
            return
        self.truth.host_hit += sum(adm.host_hit for adm in admitted)  # served: their loads landed
        self.truth.storage_hit += sum(adm.storage_hit for adm in admitted)
        for adm, ids, ns in zip(admitted, prompts, spaces):
            cached = adm.cached_tokens
            if cached:  # whatever tier it came from, the prefix's KV in device memory is the oracle's
                kv, want = cache.kv, self.models[ns].expected(ids[:cached], 0, cached)
                for layer in range(kv.layers):
                    k_, v_ = kv.gather(layer, adm.device_indices)
                    assert torch.equal(k_, want[0, layer]) and torch.equal(v_, want[1, layer]), (
                        f"seed {self.seed} step {step}: the cached prefix of {adm.request_id} ({cached} tokens) "
                        "reads wrong KV")
                self.verified += 1
        flat = rng.random() < 0.5
        need = [len(ids) - adm.cached_tokens for adm, ids in zip(admitted, prompts)]
        got = cache.allocate({adm.request_id: n for adm, n in zip(admitted, need)}, flat=flat)
        if isinstance(got, Insufficient):
            cache.abort([adm.handle for adm in admitted])
            return
        at, commits = 0, {}
        for adm, ids, n, ns in zip(admitted, prompts, need, spaces):
            mine = got[at : at + n] if flat else got[adm.request_id]
            at += n
            st = self.live[adm.request_id] = {"tokens": ids, "slots": torch.cat([adm.device_indices, mine]),
                                              "committed": adm.cached_tokens, "handle": adm.handle, "ns": ns}
            upto = rng.randrange(adm.cached_tokens, len(ids) + 1)
            if upto > st["committed"]:
                self.write(cache, st, upto)
                commits[adm.request_id] = self.tokens(ids[st["committed"]:upto])
                st["committed"] = upto
        if commits:
            cache.commit(commits)

    def extend(self, cache: HiCache) -> None:
        """The rest of a prefill, or decode steps: each allocates its next slot and commits the last."""
        rng = self.rng
        rid = rng.choice(list(self.live))
        st = self.live[rid]
        if st["committed"] < len(st["tokens"]):
            self.commit(cache, rid, rng.randrange(st["committed"] + 1, len(st["tokens"]) + 1))
            return
        got = cache.allocate({rid: 1})
        for _ in range(rng.randrange(1, 2 * self.page + 2)):
            if not isinstance(got, dict):
                return
            st["tokens"].append(rng.choice(self.vocab))
            st["slots"] = torch.cat([st["slots"], got[rid]])
            self.write(cache, st, len(st["tokens"]))
            got = cache.allocate({rid: 1}, commit={rid: self.tokens(st["tokens"][-1:])})
            st["committed"] = len(st["tokens"])  # the commit holds even when the allocation does not fit
        if isinstance(got, dict):  # the slot allocated last takes one more token
            st["tokens"].append(rng.choice(self.vocab))
            st["slots"] = torch.cat([st["slots"], got[rid]])
            self.commit(cache, rid, len(st["tokens"]))

    def cache_unfinished(self, cache: HiCache, step: int) -> None:
        """Cache a request's committed prefix mid-prefill. Its prefix may now lie in the tree's
        slots (pages the tree held are used, the request's copies freed): the slots the cache
        reports (`slots`) hold the oracle's KV at every committed position, and are the ones
        used from here on."""
        rid = self.rng.choice(list(self.live))
        st = self.live[rid]
        [st["handle"]] = cache.cache_unfinished([st["handle"]])
        slots = cache.slots(rid)
        n = st["committed"]
        assert len(slots) == len(st["slots"]) and torch.equal(slots[n:], st["slots"][n:]), (
            f"seed {self.seed} step {step}: cache_unfinished moved slots past the committed prefix of {rid}")
        if n:
            kv, want = cache.kv, self.models[st["ns"]].expected(st["tokens"][:n], 0, n)
            for layer in range(kv.layers):
                k_, v_ = kv.gather(layer, slots[:n])
                assert torch.equal(k_, want[0, layer]) and torch.equal(v_, want[1, layer]), (
                    f"seed {self.seed} step {step}: after cache_unfinished, the slots of {rid} read wrong KV")
        st["slots"] = slots

    def end(self, cache: HiCache) -> None:
        """One or two requests finished, aborted or retracted in one call."""
        rng = self.rng
        rids = rng.sample(list(self.live), min(len(self.live), rng.choice([1, 1, 2])))
        ended = [self.live.pop(rid) for rid in rids]
        how = rng.random()
        if how < 0.7:
            cache.finish([st["handle"] for st in ended])
            self.turns += [(st["tokens"][: st["committed"]], st["ns"]) for st in ended]
        elif how < 0.85:
            cache.abort([st["handle"] for st in ended])
        else:
            cache.retract([st["handle"] for st in ended])
            self.retracted += rids

    def misuse(self, cache: HiCache, step: int) -> None:
        """A call a scheduler must not make: a one-line `RequestError`, nothing changed."""
        rng = self.rng
        rid = rng.choice(list(self.live)) if self.live else None
        calls = [lambda: cache.commit({"nobody": [1]}), lambda: cache.allocate({"": 3}),
                 lambda: cache.finish(["not a handle"])]
        if rid is not None:
            calls += [lambda: cache.commit({rid: [-1]}), lambda: cache.commit({rid: [1] * 10_000}),
                      lambda: cache.admit([Request(rid, [1, 2])]), lambda: cache.allocate({rid: -1})]
        call = rng.choice(calls)
        with pytest.raises(RequestError) as caught:
            call()
        assert "\n" not in str(caught.value), f"seed {self.seed} step {step}: a multi-line error"

    def play(self) -> None:
        with HiCache(self.config, runtime=self.runtime) as cache:
            for step in range(STEPS):
                self.step(cache, step)
            self.finish(cache)

    def finish(self, cache: HiCache) -> None:
        self.end_pending(cache, STEPS)
        for st in self.live.values():
            cache.finish([st["handle"]])
        self.live.clear()
        cache.quiesce()
        cache.check_invariants()
        self.check_hits(cache, STEPS)

    def check_hits(self, cache: HiCache, step: int) -> None:
        """After a `quiesce`: each tier's figures are what the admissions reported, a host hit
        counted once its load-back landed (a failed one is no tier's)."""
        s, t = cache.statistics(), self.truth
        served = (s.l2.hit_tokens if s.l2 else 0) + (s.l3.hit_tokens if s.l3 else 0)
        assert (s.looked_up_tokens, s.l1.hit_tokens, served, s.l3.hit_tokens if s.l3 else 0) == (
            t.looked_up, t.device_hit, t.host_hit, t.storage_hit), f"seed {self.seed} step {step}: {s.tiers}, {t}"
        for upper, lower in zip(s.tiers, s.tiers[1:]):
            assert lower.requested_tokens == upper.requested_tokens - upper.hit_tokens, f"seed {self.seed} step {step}"
        assert s.tree.live_handles == len(self.live), f"seed {self.seed} step {step}"
        ends = sum(s.tree.prefetch_ends.of(end) for end in PrefetchEnd)
        assert ends + s.tree.prefetches_in_flight == s.tree.prefetches_started, f"seed {self.seed} step {step}"

    def step(self, cache: HiCache, step: int) -> None:
        """One call (or a few that go together) chosen at random, then every invariant checked."""
        rng = self.rng
        op = rng.random()
        if op < 0.3 and len(self.live) < 4:
            self.admit(cache, step, rng.choice([1, 1, 2, 3]))
        elif op < 0.5 and self.live:
            self.extend(cache)
        elif op < 0.6 and self.live:
            self.cache_unfinished(cache, step)
        elif op < 0.82 and self.live:
            self.end(cache)
        elif op < 0.9:
            self.misuse(cache, step)
        elif op < 0.915:  # a restart: a fresh L1 and L2 over the same storage (a new log)
            self.end_pending(cache, step)
            for st in self.live.values():
                (cache.finish if rng.random() < 0.5 else cache.abort)([st["handle"]])
            self.live.clear()
            self.retracted.clear()
            cache.close(drain=rng.random() < 0.7)
            cache.start()
            self.counted.clear()  # a cache started again counts from zero
            self.truth = _Truth()
        else:
            self.end_pending(cache, step)
            cache.quiesce()
            self.check_hits(cache, step)
            if rng.random() < 0.3:
                cache.evict_device(rng.randrange(1, 4 * self.page))
            if self.config.host_tier and rng.random() < 0.5:
                cache.evict_host(rng.randrange(1, 16 * self.page))
        cache.check_invariants()
        if self.exported:
            self.scrape(step)

    def scrape(self, step: int) -> None:
        """This cache's samples in the default registry: finite, never negative, and the
        cumulative ones (counters, histograms' counts and sums) never fall between scrapes."""
        mine = self.config.metrics_name
        for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
            for sample in family.samples:
                if sample.labels.get("cache") != mine or sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sorted(sample.labels.items())))
                value = sample.value
                assert value >= 0 and (math.isfinite(value) or sample.labels.get("le") == "+Inf"), (
                    f"seed {self.seed} step {step}: {key} = {value}")
                if family.type in ("counter", "histogram"):
                    assert value >= self.counted.get(key, 0.0), (
                        f"seed {self.seed} step {step}: {key} fell from {self.counted[key]} to {value}")
                    self.counted[key] = value


@pytest.mark.parametrize("seed", range(12))
def test_random_facade_calls_keep_every_cached_prefix_right(seed: int, tmp_path: Path) -> None:
    run = _Run(seed, tmp_path)
    run.play()
    assert run.made > 5 and run.verified > 3, "the seed admitted and hit too few requests to mean anything"
    if run.logged:
        result = replay_log(read_log(Path(run.config.log_path)))
        assert result.divergence is None, f"seed {seed}: the log replays with a divergence: {result.divergence}"
        assert result.deliveries > 20


STORAGE_BOUND_BYTES = 12 << 10
"""The storage directory's bound in the shared test: a few dozen small pages, so that each
instance evicts pages the other wrote, matched or is reading."""


@pytest.mark.parametrize("seed", range(3))
def test_two_caches_over_one_bounded_storage_directory_read_only_right_kv(seed: int, tmp_path: Path) -> None:
    """Two instances (two servers) with the same conversations and page size over one storage
    directory, under a size bound that keeps each evicting the other's pages, called in turn.
    A page one of them finds in storage and loads back is the oracle's KV, or a miss."""
    a = _Run(seed, tmp_path, storage_max_bytes=STORAGE_BOUND_BYTES)
    b = _Run(seed + 100, tmp_path, like=a, storage_max_bytes=STORAGE_BOUND_BYTES)
    turns = random.Random(seed)
    with HiCache(a.config, runtime=a.runtime) as first, HiCache(b.config, runtime=b.runtime) as second:
        for step in range(STEPS):
            run, cache = (a, first) if turns.random() < 0.5 else (b, second)
            run.step(cache, step)
        a.finish(first)
        b.finish(second)
        stats = [first.statistics(), second.statistics()]
    assert a.verified + b.verified > 5
    assert sum(s.prefetch.evicted_pages for s in stats) > 0, "the bound never evicted: it tests nothing"
