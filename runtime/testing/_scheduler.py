"""The reference scheduler: a continuous-batching loop that embeds `HiCache` like an engine.

Each `tick()`:

0. agrees with the other tensor-parallel ranks on rank-local outcomes (`sync`),
   starts storage prefetches for newly queued requests, and asks which queued
   requests with a prefetch may run (`ready`: their pages are then host-only
   nodes that admission loads back); a request whose prefetch is not ready
   holds the queue;
1. admits waiting requests in order while the running set and the tick's token
   budget allow (one `admit` call for the batch), and starts their load-backs;
2. plans the tick: a prefill chunk for each request still in prefill, one token
   for each request in decode, and allocates slots for all of it in one call;
   when the pool is short even after eviction, it retracts the most recently
   admitted decoding request (it goes back to the head of the queue) and tries
   again;
3. runs the model over every step (`StepModel.forward`): by default the fake model,
   which waits for each layer's load and checks, layer by layer, the KV of every
   prefix the cache supplied (fingerprint oracle), then writes fingerprint KV for
   the tokens it computes; or a real one (`ModelRunner`), whose greedy tokens are the
   outputs;
4. commits what was computed: a request that goes on decoding commits with the next
   tick's allocation (so a decode tick is one call), the others at once; caches
   requests that finished a prefill chunk but not the prompt (`cache_unfinished`),
   finishes requests that produced all their output, and aborts some when an abort
   rate is set.

Token semantics follow an engine: a request is admitted with its sequence minus
the last token (so at least one token is always computed), prefill computes the
KV of prompt positions and yields the first output token, and each decode step
computes the KV of the last token and yields the next one; the last output
token's KV is never computed.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hicache.actors import KVShape
from hicache.actors._layers import LayerWaiter, LoadFailedError

from .._facade import CacheHandle, HiCache, Insufficient, Request
from .oracle import FingerprintOracle
from ..trace import VOCAB_SIZE

@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_running: int = 32
    """Most requests admitted at once."""
    prefill_tokens_per_tick: int = 8192
    """Token budget of prefill chunks in one tick."""
    chunk_tokens: int = 4096
    """Most prompt tokens one request computes in one tick (chunked prefill)."""
    abort_rate: float = 0.0
    """Chance per tick that a running request is aborted (tests); a request just admitted may
    be aborted before its load-backs start, as an engine drops one that went away."""
    seed: int = 0
    """Seeds abort choices."""
    verify: bool = True
    """Check every cache-supplied prefix with the fingerprint oracle."""
    lookahead_slots: int = 0
    """Slots allocated beyond what a step computes, as speculative decoding does: the
    ledger then holds more than is committed, and finishing must free the surplus."""
    device_budget_ratio: float = 0.9
    """Admit while the running requests' full lengths fit in this share of the device slots
    (cached prefixes counted as if private: conservative, so decode rarely runs out)."""
    prefetch_window: int = 64
    """Queued requests, from the head, that may have a storage prefetch started."""
    tick_s: float = 0.0
    """Virtual seconds one tick's forward pass takes on the deterministic runtime (its timers,
    such as delayed storage reads and prefetch timeouts, move with it); real time flows on threads."""
    quiesce_rate: float = 0.0
    """Chance per tick with load-backs to start that the scheduler waits for the cache to
    settle (`quiesce()`) between admitting and starting them, as an engine draining before a
    checkpoint does (tests): the quiesce starts those loads, and the forward pass then waits
    on what `start_loads` gives. Drawn from a generator of its own (the abort draws stay)."""
    overlap_rate: float = 0.0
    """Chance per tick that the scheduler admits the next tick's requests while this tick's
    forward pass runs, after this tick's load-backs started and before it waits on them, as
    an overlap scheduler does (tests): their prefixes may be pages those loads are still
    bringing in, and their own load-backs start with the next tick's. Drawn from a generator
    of its own."""

    def __post_init__(self) -> None:
        for name in ("max_running", "prefill_tokens_per_tick", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.lookahead_slots < 0:
            raise ValueError(f"SchedulerConfig.lookahead_slots must be >= 0, got {self.lookahead_slots}")
        if not 0.0 < self.device_budget_ratio:
            raise ValueError(f"SchedulerConfig.device_budget_ratio must be > 0, got {self.device_budget_ratio}")
        if self.tick_s < 0:
            raise ValueError(f"SchedulerConfig.tick_s must be >= 0, got {self.tick_s}")
        for name in ("abort_rate", "quiesce_rate", "overlap_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SchedulerConfig.{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class ServeRequest:
    request_id: str
    prompt: torch.Tensor
    output_tokens: int
    namespace: str = ""


@dataclass(slots=True)
class Outcome:
    """What happened to one request (hits from its first admission)."""

    request_id: str
    input_tokens: int
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0
    """Of `host_hit`, the tokens its own prefetch read from storage (`AdmitResult.storage_hit`)."""
    prefetched_tokens: int = 0
    """Tokens its prefetch read from storage, as `ready` reported them (those its admission
    left in host memory, `host_miss`, are no part of `storage_hit`)."""
    computed_prompt_tokens: int = 0
    retractions: int = 0
    aborted: bool = False
    finished: bool = False
    first_tick: int = -1
    output_tokens: list[int] = field(default_factory=list)
    """The tokens it produced, in order (kept across a retraction)."""


@dataclass(slots=True)
class ServedTotals:
    """What every admission of a run looked up and was served, as the scheduler saw it: the
    figures the cache's statistics must report once it is quiet (`statistics()`'s tiers)."""

    looked_up: int = 0
    """Tokens every admission looked up (L1's requested tokens)."""
    device_hit: int = 0
    """Their device hits (L1's hit tokens)."""
    host_hit: int = 0
    """Host hits of the admissions whose load-backs the forward pass waited for and that landed
    (L2's hit tokens plus L3's): a load-back that failed served none."""
    storage_hit: int = 0
    """Of `host_hit`, those the requests' own prefetches read (L3's hit tokens), as the
    scheduler reckons them: of an admission's host hit (`host_hit + host_miss` tokens of its
    path were in host memory, the pages its prefetch brought last), the part that is the
    tokens `ready` reported its prefetch read, `min(host_hit, max(0, read - host_miss))`."""
    unseen_host_hit: int = 0
    """Host hits whose load-backs no forward pass saw land or fail, so they may count or not: those
    of admissions dropped before their load-backs started (a later batch starts them), and those
    of a tick with requests admitted during the last forward pass (`overlap_rate`) whose waiter
    failed (it may have failed for an earlier batch that only those wait on)."""
    unseen_storage_hit: int = 0
    """Of `unseen_host_hit`, those the requests' own prefetches read."""


@dataclass(slots=True)
class _Running:
    spec: ServeRequest
    handle: CacheHandle
    seq: array
    """Its prompt and outputs so far, as int64s (an `array("q")`: a slice is a copy in one
    call, and the facade takes its bytes without looking at every id's type)."""
    computed: int
    """Positions whose KV is written and committed."""
    verify_from: int
    verify_to: int
    """Cache-supplied positions not yet checked by the model."""
    hash_base: int | None
    """Fake model's prefix hash of position `computed - 1` (None: not worked out yet)."""
    outputs: int
    admitted_at: int
    since_cache: int = 0


@dataclass(slots=True)
class ForwardStep:
    """One request's share of a tick's forward pass: compute positions `start .. start + count - 1`
    of `tokens`; every position up to there has its slot in `slots` (the ones before `start`
    hold cached or earlier-computed KV)."""

    run: _Running
    start: int
    count: int
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    """The slot of each position `0 .. start + count - 1`."""

    @property
    def request_id(self) -> str:
        return self.run.spec.request_id

    @property
    def tokens(self) -> array:
        """The request's sequence so far (longer than `start + count` during a chunked prefill)."""
        return self.run.seq


class StepModel(Protocol):
    """What the scheduler runs each tick (`FakeModel`, or `ModelRunner` for a transformers model)."""

    def forward(self, steps: list[ForwardStep], waiter: LayerWaiter | None) -> dict[str, int]:
        """Compute every step, waiting per layer on `waiter`'s loads; return the next token of each
        request whose step reached the end of its sequence."""
        ...


class FakeModel:
    """Writes fingerprint KV for computed tokens; checks cached KV after each layer's load.
    Its output tokens are a hash of the request id and the output's index. It writes the pool
    as an engine's own kernels would, not through `DeviceKV.write`: with
    `Config.check_kv_writes` it indexes the slots it writes for writing first, which checks them.
    With `Config.check_kv_reads` it reads the cached KV it checks through `DeviceKV.gather`, after
    each layer's wait, which checks the slots and that the layer's load-back landed.

    With `kv=False` it writes and checks no KV (still waiting for each layer's load): for a
    run whose figures are only hits and bytes moved, where the fingerprints would cost most
    of the time and check nothing another run does not."""

    def __init__(self, hc: HiCache, verify: bool = True, *, kv: bool = True) -> None:
        self.hc = hc
        self.kv = kv
        self.verify = verify and kv
        self.oracle = FingerprintOracle(KVShape.of(hc.config))
        self.verified_tokens = 0
        self.written_tokens = 0

    def forward(self, steps: list[ForwardStep], waiter: LayerWaiter | None) -> dict[str, int]:
        checks = []
        kv = self.hc.kv if self.hc.config.check_kv_reads else None
        for st in steps:
            run = st.run
            if self.verify and run.verify_to > run.verify_from:
                lo, hi = run.verify_from, run.verify_to
                index = kv.index(st.slots[lo:hi], distinct=False) if kv is not None else None
                checks.append((run, st.slots[lo:hi], self.oracle.expected(run.seq[:hi], lo, hi), index))
        for layer in range(self.hc.config.layers):
            if waiter is not None:
                waiter.wait_layer(layer)
            for run, slots, want, index in checks:
                if kv is None:
                    got = self.hc.device_kv.read(slots, layer=layer)
                else:  # `[2, 1, n, H, D]` on CPU, as `read` gives it; read for its own request only
                    got = torch.stack(kv.gather(layer, index, request_id=run.spec.request_id)).unsqueeze(1).cpu()
                self.oracle.compare(got, want[:, layer : layer + 1], slots, run.verify_from, first_layer=layer)
        for run, *_ in checks:
            self.verified_tokens += run.verify_to - run.verify_from
            run.verify_from = run.verify_to
        nxt = {}
        for st in steps:
            run = st.run
            end = st.start + st.count
            if self.kv:
                if self.hc.config.check_kv_writes:
                    self.hc.kv.index(st.slots[st.start :], request_id=run.spec.request_id)
                run.hash_base = self.oracle.write(self.hc.device_kv, run.seq[:end], st.slots[st.start :],
                                                  start=st.start, base=run.hash_base)
                self.written_tokens += st.count
            if end == len(run.seq):
                nxt[st.request_id] = _output_token(st.request_id, run.outputs)
        return nxt


def _token_array(prompt: torch.Tensor) -> array:
    """A prompt's token ids as an `array("q")` (one copy of its bytes)."""
    out = array("q")
    out.frombytes(memoryview(prompt.detach().to("cpu", torch.int64).contiguous().numpy()).cast("B"))
    return out


class ReferenceScheduler:
    """Serves submitted requests over `hc`, running `model` (the fake model by default)."""

    def __init__(self, hc: HiCache, config: SchedulerConfig | None = None, model: StepModel | None = None) -> None:
        self.hc = hc
        self.config = config or SchedulerConfig()
        self.model: StepModel = model if model is not None else FakeModel(hc, self.config.verify)
        self._rng = random.Random(f"scheduler:{self.config.seed}")
        self._quiesce_rng = random.Random(f"scheduler-quiesce:{self.config.seed}")
        self._overlap_rng = random.Random(f"scheduler-overlap:{self.config.seed}")
        self.waiting: deque[ServeRequest | _Running] = deque()
        self.running: dict[str, _Running] = {}
        self.outcomes: dict[str, Outcome] = {}
        self.ticks = 0
        self.load_failures = 0
        self.served = ServedTotals()
        """What the admissions looked up and were served, summed over the run (`Outcome` holds a
        request's first admission only)."""
        self._awaited = (0, 0)
        """Host and storage hits of this tick's admissions, served once their load-backs land."""
        self._early = (0, 0)
        """Host and storage hits of the requests admitted during the last tick's forward pass
        (`overlap_rate`): their load-backs start, and are waited for, with this tick's."""
        self._awaited_early = (0, 0)
        """Of `_awaited`, those of the requests admitted early. If the tick's waiter fails with some,
        the failure may be an earlier batch's that only they wait on, while this tick's batch (and
        their loads in it) landed: nobody saw which, so the tick's host hits may count or not."""
        self._prefetch_tried: set[str] = set()
        """Queued requests whose prefetch was asked for (each once), until they are admitted or aborted."""
        self._read: dict[str, int] = {}
        """Tokens the settled prefetch of a queued request read (`ready`), until its next admission."""
        self._uncommitted: dict[str, array] = {}
        """Tokens computed last tick by requests still decoding: committed by this tick's allocation."""

    # -- driving ---------------------------------------------------------------------

    def submit(self, requests: Iterable[ServeRequest]) -> None:
        batch = list(requests)
        seen: set[str] = set()
        for r in batch:  # all checked first: a refused batch queues none of its requests
            if r.request_id in self.outcomes or r.request_id in seen:
                raise ValueError(f"request {r.request_id!r} was submitted twice")
            seen.add(r.request_id)
            if len(r.prompt) < 1 or r.output_tokens < 1:
                raise ValueError(f"request {r.request_id!r} needs a prompt and at least one output token")
            self._check_fits(r)
        for r in batch:
            self.outcomes[r.request_id] = Outcome(r.request_id, len(r.prompt))
            self.waiting.append(r)

    def _check_fits(self, r: ServeRequest) -> None:
        """Refuse a request whose KV could never be on the device at once: admitted alone, it
        would be retracted and admitted again forever."""
        cfg = self.hc.config
        slots = len(r.prompt) + r.output_tokens - 1 + self.config.lookahead_slots  # its last step's
        if -(-slots // cfg.page_size) > cfg.device_pages:
            raise ValueError(
                f"request {r.request_id!r} needs {slots:,} device slots at its last step ({len(r.prompt):,} prompt "
                f"tokens, {r.output_tokens:,} output) but device_slots is {cfg.device_slots:,}: "
                "raise device_slots or shorten the request"
            )

    def run(self, on_tick: Callable[[ReferenceScheduler], None] | None = None, max_ticks: int = 10_000_000) -> None:
        """Tick until every submitted request finished or was aborted."""
        while self.waiting or self.running:
            if self.ticks >= max_ticks:
                raise RuntimeError(f"still {len(self.waiting)} waiting, {len(self.running)} running after {max_ticks} ticks")
            self.tick()
            if on_tick is not None:
                on_tick(self)

    def tick(self) -> None:
        self.ticks += 1
        self.hc.sync()
        self._prefetch()
        self._awaited = self._awaited_early = self._early
        self._early = (0, 0)
        waiter = self._admit()
        steps = self._plan()
        if self.config.overlap_rate and self._overlap_rng.random() < self.config.overlap_rate:
            self._admit(early=True)  # the next tick's requests, while this tick's forward pass runs
        loaded = True
        nxt: dict[str, int] = {}
        try:
            if steps:
                nxt = self.model.forward(steps, waiter)
            elif waiter is not None:  # nothing computes this tick, but the loads' outcome must be known
                waiter.wait_all()
        except LoadFailedError:
            loaded = False
        if waiter is not None:  # a load may fail on one rank only: then every rank retracts
            loaded = bool(self.hc.group.all_min([int(loaded)])[0])
        if not loaded:
            if self._awaited_early[0]:  # the waiter may have failed for an earlier batch only they wait on
                self.served.unseen_host_hit += self._awaited[0]
                self.served.unseen_storage_hit += self._awaited[1]
            self._retract_after_failed_load(steps)
            return
        self.served.host_hit += self._awaited[0]
        self.served.storage_hit += self._awaited[1]
        if steps:
            self._commit(steps)
        self._advance(steps, nxt)
        advance = getattr(self.hc.system.runtime, "advance", None)
        if advance is not None and self.config.tick_s:
            advance(self.config.tick_s)

    def _commit(self, steps: list[ForwardStep]) -> None:
        """Commit what this tick computed. A request that goes on decoding commits with the
        next tick's allocation (one round trip per decode tick); one that finishes or caches
        a chunk now, since those calls read its committed tokens."""
        now = {}
        for st in steps:
            run = st.run
            run.computed += st.count
            tokens = run.seq[st.start : st.start + st.count]
            decoding_on = run.computed >= len(run.seq) and run.outputs + 1 < run.spec.output_tokens
            if decoding_on:
                self._uncommitted[run.spec.request_id] = tokens
            else:
                now[run.spec.request_id] = tokens
        if now:
            self.hc.commit(now)

    # -- storage prefetch --------------------------------------------------------------------

    def _prefetch(self) -> None:
        """Start prefetches for queued requests not tried yet; settle the ready ones."""
        window = [w for w, _ in zip(self.waiting, range(self.config.prefetch_window))]
        new = [w for w in window if isinstance(w, ServeRequest) and w.request_id not in self._prefetch_tried]
        if new:
            self._prefetch_tried.update(r.request_id for r in new)
            self.hc.prefetch([Request(r.request_id, r.prompt[:-1], r.namespace) for r in new])
        # Only the requests admission would take next are asked: the rest keep prefetching.
        prefetching = set(self.hc.prefetching)
        room = max(0, self.config.max_running - len(self.running))
        got = self.hc.ready([rid for rid in (_spec(w).request_id for w in window[:room]) if rid in prefetching])
        for rid, tokens in got.items():
            self.outcomes[rid].prefetched_tokens += tokens
            self._read[rid] = tokens
        if self.config.abort_rate:
            doomed = [rid for rid in self.hc.prefetching if self._rng.random() < self.config.abort_rate]
            if doomed:
                self.hc.abort(doomed)
                self.waiting = deque(w for w in self.waiting if not (isinstance(w, ServeRequest) and w.request_id in doomed))
                for rid in doomed:
                    self.outcomes[rid].aborted = True
                    self._prefetch_tried.discard(rid)

    # -- admission -------------------------------------------------------------------------

    def _admit(self, *, early: bool = False) -> LayerWaiter | None:
        """Admit what fits from the queue, then start the load-backs of the host hits (this
        tick's and those admitted early): the waiter the forward pass waits on. `early`: the
        next tick's admissions, made during this tick's forward pass; their loads start with
        the next tick's."""
        room = self.config.max_running - len(self.running)
        budget = self.config.prefill_tokens_per_tick
        memory = int(self.hc.config.device_slots * self.config.device_budget_ratio)
        memory -= sum(len(r.seq) + r.spec.output_tokens - r.outputs for r in self.running.values())
        batch: list[ServeRequest | _Running] = []
        prefetching = set(self.hc.prefetching)
        while self.waiting and room > 0:
            nxt = self.waiting[0]
            spec = _spec(nxt)
            if spec.request_id in prefetching:
                break  # its prefetch may not terminate yet: it holds the queue
            need = len(nxt.prompt) if isinstance(nxt, ServeRequest) else len(nxt.seq)
            whole = need + spec.output_tokens - (0 if isinstance(nxt, ServeRequest) else nxt.outputs)
            if (batch and need > budget) or (self.running or batch) and whole > memory:
                break
            batch.append(self.waiting.popleft())
            budget -= need
            memory -= whole
            room -= 1
        if not batch:
            return None if early else self._start_awaited_loads()
        seqs = [_token_array(item.prompt) if isinstance(item, ServeRequest) else item.seq for item in batch]
        results = self.hc.admit([Request(_spec(item).request_id, seq[:-1], _spec(item).namespace)
                                 for item, seq in zip(batch, seqs, strict=True)])
        served = self.served
        served.looked_up += sum(len(seq) - 1 for seq in seqs)
        served.device_hit += sum(res.device_hit for res in results)
        storage = {res.request_id: min(res.host_hit, max(0, self._read.pop(res.request_id, 0) - res.host_miss))
                   for res in results}
        for item, seq, res in zip(batch, seqs, results, strict=True):
            spec = _spec(item)
            outputs = 0 if isinstance(item, ServeRequest) else item.outputs
            cached = res.cached_tokens
            run = _Running(spec, res.handle, seq, cached, 0, cached, None, outputs, self.ticks + early)
            self.running[spec.request_id] = run
            self._prefetch_tried.discard(spec.request_id)
            out = self.outcomes[spec.request_id]
            if out.first_tick < 0:
                out.first_tick = self.ticks
                out.device_hit, out.host_hit, out.storage_hit = res.device_hit, res.host_hit, res.storage_hit
        if self.config.abort_rate and not early:  # gone before its forward pass: its load-backs were never started
            gone = [(item, res) for item, res in zip(batch, results, strict=True)
                    if self._rng.random() < self.config.abort_rate]
            if gone:
                self.hc.abort([res.handle for _, res in gone])
                served.unseen_host_hit += sum(res.host_hit for _, res in gone)
                served.unseen_storage_hit += sum(storage[res.request_id] for _, res in gone)
                for item, _ in gone:
                    rid = _spec(item).request_id
                    del self.running[rid]
                    self._uncommitted.pop(rid, None)
                    self.outcomes[rid].aborted = True
                gone_ids = {res.request_id for _, res in gone}
                results = [res for res in results if res.request_id not in gone_ids]
        hits = (sum(r.host_hit for r in results), sum(storage[r.request_id] for r in results))
        if early:
            self._early = (self._early[0] + hits[0], self._early[1] + hits[1])
            return None
        self._awaited = (self._awaited[0] + hits[0], self._awaited[1] + hits[1])
        return self._start_awaited_loads()

    def _start_awaited_loads(self) -> LayerWaiter | None:
        """`start_loads` when this tick's admissions (and those admitted early) have host hits."""
        if not self._awaited[0]:
            return None
        if self.config.quiesce_rate and self._quiesce_rng.random() < self.config.quiesce_rate:
            self.hc.quiesce()  # starts their load-backs, on which no forward pass waits
        return self.hc.start_loads()

    # -- one tick of work --------------------------------------------------------------------

    def _plan(self) -> list[ForwardStep]:
        """A step per running request: the rest of its sequence up to a chunk (prefill, or a
        re-prefill after retraction) or its last token (decode); then slots for all of it."""
        budget = self.config.prefill_tokens_per_tick
        steps = []
        for run in self.running.values():
            left = len(run.seq) - run.computed
            n = left if left == 1 else min(left, self.config.chunk_tokens, budget)
            if n <= 0:
                continue
            if left > 1:
                budget -= n
            steps.append(ForwardStep(run, run.computed, n))
        retried = False
        while steps:
            ahead = self.config.lookahead_slots
            want = {}
            for st in steps:
                rid = st.run.spec.request_id
                want[rid] = max(0, st.start + st.count + ahead - self.hc.allocated(rid))
            commit, self._uncommitted = self._uncommitted, {}
            got = self.hc.allocate(want, commit=commit)
            if not isinstance(got, Insufficient):
                for st in steps:
                    st.slots = self.hc.slots(st.request_id)[: st.start + st.count]
                return steps
            victim = self._retraction_victim()
            if victim is None or len(self.running) == 1:  # alone, it would be admitted again as it is
                stats = self.hc.statistics()
                tree = stats.tree
                if tree.writes_in_flight or tree.loads_in_flight:
                    # With several ranks an eviction cannot wait for write-backs or the loads of
                    # requests that ended (their acks apply only at the next agreement): nothing
                    # computes this tick; the next one's `sync` applies them, frees or unlocks
                    # what they hold and plans again.
                    return []
                if not retried and stats.device.free_slots + tree.evictable_tokens >= got.requested_slots:
                    # The load-back this tick's admission started failed while the allocation ran
                    # (its pages, locked then, are free now): the same allocation fits; the
                    # forward pass then finds the failure and retracts the request.
                    retried = True
                    continue
                raise RuntimeError(
                    f"the device pool cannot hold one step of request {steps[0].run.spec.request_id!r} "
                    f"({got.shortfall_slots} slots short after eviction); use a larger device_slots"
                )
            steps = [st for st in steps if st.run is not victim]
            self._retract(victim)
        return steps

    def _advance(self, steps: list[ForwardStep], nxt: dict[str, int]) -> None:
        to_finish: list[_Running] = []
        to_cache: list[_Running] = []
        for st in steps:
            run = st.run
            prompt_len = len(run.spec.prompt)
            self.outcomes[run.spec.request_id].computed_prompt_tokens += (
                min(st.start + st.count, prompt_len) - min(st.start, prompt_len)
            )
            if run.computed < len(run.seq):
                to_cache.append(run)  # a chunk done, more of the sequence to compute
                continue
            run.seq.append(nxt[run.spec.request_id])
            self.outcomes[run.spec.request_id].output_tokens.append(run.seq[-1])
            run.outputs += 1
            if run.outputs >= run.spec.output_tokens:
                to_finish.append(run)
        if to_cache:
            new = self.hc.cache_unfinished([r.handle for r in to_cache])
            for run, handle in zip(to_cache, new, strict=True):
                run.handle = handle
                run.verify_to = max(run.verify_to, run.computed - run.computed % self.hc.config.page_size)
        if to_finish:
            self.hc.finish([r.handle for r in to_finish])
            for run in to_finish:
                del self.running[run.spec.request_id]
                self.outcomes[run.spec.request_id].finished = True
        if self.config.abort_rate:  # (not those admitted during this forward pass for the next tick)
            doomed = [r for r in self.running.values()
                      if r.admitted_at <= self.ticks and self._rng.random() < self.config.abort_rate]
            if doomed:
                self.hc.abort([r.handle for r in doomed])
                for run in doomed:
                    self._uncommitted.pop(run.spec.request_id, None)
                    del self.running[run.spec.request_id]
                    self.outcomes[run.spec.request_id].aborted = True

    # -- retraction ---------------------------------------------------------------------------------

    def _retraction_victim(self) -> _Running | None:
        if not self.running:
            return None
        decoding = [r for r in self.running.values() if r.outputs > 0]
        pool = decoding or list(self.running.values())
        return max(pool, key=lambda r: (r.admitted_at, r.spec.request_id))

    def _retract(self, run: _Running) -> None:
        self._uncommitted.pop(run.spec.request_id, None)  # its KV past the committed part is given up
        self.hc.retract([run.handle])
        del self.running[run.spec.request_id]
        self.outcomes[run.spec.request_id].retractions += 1
        self.waiting.appendleft(run)

    def _retract_after_failed_load(self, steps: list[ForwardStep]) -> None:
        """A load-back failed, so this tick's forward pass did not run: every request of
        it is retracted (its allocations go back) and recomputes from what is cached. So is
        every request admitted this tick without a step (the prefill budget ran out): its
        cached prefix may be in the failed batch, and the tree drops it when the failure applies."""
        self.load_failures += 1
        doomed = [st.run for st in steps]
        stepped = {id(r) for r in doomed}
        doomed += [r for r in self.running.values() if r.admitted_at == self.ticks and id(r) not in stepped]
        for run in sorted(doomed, key=lambda r: r.admitted_at, reverse=True):
            self._retract(run)


def _spec(item: ServeRequest | _Running) -> ServeRequest:
    return item if isinstance(item, ServeRequest) else item.spec


def _output_token(request_id: str, index: int) -> int:
    """The `index`-th output token of a request: deterministic, so a retried request repeats it."""
    digest = hashlib.blake2b(request_id.encode() + index.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB_SIZE
