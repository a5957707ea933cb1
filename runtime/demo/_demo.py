"""`hicache demo`: serve a prefix of the Mooncake conversation trace through L1, L2 and L3.

The reference scheduler serves the first requests of the embedded trace with the
HiCache facade (device L1 + host L2 + storage L3: write-through, backup to
storage, prefetch, load-back), the fake model checking every cached prefix it
reads with the fingerprint oracle. Storage is the file backend in a temporary
directory by default (`--storage mooncake` uses a Mooncake master the user
started); a queued request waits for its prefetch up to the `timeout` policy's
bound, so the L3 hits do not depend on how the threads happen to race. In the
same run it serves them again with L1 + L2 (no storage) and
with L1 alone (same device capacity), and computes what an infinite cache would
hit (every page ever committed stays cached), the upper bound. Those two comparison runs
count hits only: their fake model writes and checks no KV (the L1 + L2 + L3 run checks
every cached token it reads, and the tests check every tier path).

TTFT is modelled, not measured: a request's first token costs its recomputed
prompt tokens at `prefill_tokens_per_s`, its L2 hits moved at `l2_gbps`, and its
L3 hits read at `l3_gbps` and then moved like L2 hits, with `kv_bytes_per_token`
of the modelled model (queueing is not modelled). The figures printed say which
cost model produced them.
"""

from __future__ import annotations

import fcntl
import json
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from hicache.messages.config import Config, PrefetchPolicy

from .._facade import HiCache
from ._progress import progress
from ..testing._scheduler import FakeModel, ReferenceScheduler, SchedulerConfig, ServeRequest
from .._usage import UsageError, check_writable_file
from ..trace import TRACE_RECORDS, TraceRequest, load_trace

DEMO_REQUESTS = 600
DEMO_OUTPUT_TOKENS_MAX = 16
DEMO_CHECK_TICKS = 1000
"""Every actor's `check_invariants()` runs every this many scheduler ticks and after each run
(a check is O(pool): the host pool alone has a million slots)."""
DEMO_PREFETCH_POLICY = PrefetchPolicy.TIMEOUT
"""A queued request waits for its prefetch, up to the timeout (base + per 1k tokens): with
`best_effort` the L3 hits would depend on how fast the prefetcher's thread reads against the
scheduler's, and move from run to run (13-18% here)."""


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_tokens_per_s: float = 8000.0
    """Prompt tokens a GPU prefills per second (an 8B-class model on one H100, roughly)."""
    l2_gbps: float = 20.0
    """Host -> device copy bandwidth (pinned PCIe 4/5, roughly)."""
    l3_gbps: float = 5.0
    """Storage -> host read bandwidth (a local NVMe or an RDMA store, roughly)."""
    kv_bytes_per_token: int = 131072
    """KV bytes per token of the modelled model (32 layers x 8 KV heads x 128 x K,V x fp16)."""

    def ttft_s(self, recomputed: int, host_hit: int, storage_hit: int = 0) -> float:
        """`host_hit` includes the `storage_hit` tokens: they reach the device through host memory."""
        moved = self.kv_bytes_per_token / 1e9
        return (recomputed / self.prefill_tokens_per_s + host_hit * moved / self.l2_gbps
                + storage_hit * moved / self.l3_gbps)


DEMO_MODEL_ID = "hicache-demo-fingerprints"
"""The model the demo's KV is of (its bytes are fingerprints of the tokens): what its storage keys name."""
DEMO_DEVICE_SLOTS = 65536
DEMO_HOST_SLOTS = 16 * DEMO_DEVICE_SLOTS
"""L1 holds the prefixes a conversation's next turn reuses; L2 some of those an earlier
conversation left, further back; L3 (storage, unbounded) the rest: with the default 600
requests each tier serves part of the hits."""


def demo_config(host_tier: bool = True, **storage: object) -> Config:
    """A small KV shape (the bytes are fingerprints, not a model's) and tiers sized so
    the trace's working set fits in neither L1 nor L2. Every K/V write and read of the fake
    model is checked (`check_kv_writes`, `check_kv_reads`): about a sixth more time for the
    run that writes and reads KV, none for those that only count hits."""
    return Config(layers=2, kv_heads=1, head_dim=16, dtype="float16", model_id=DEMO_MODEL_ID, page_size=16,
                  device_slots=DEMO_DEVICE_SLOTS, host_slots=DEMO_HOST_SLOTS, host_tier=host_tier,
                  check_kv_writes=True, check_kv_reads=True, **storage)  # type: ignore[arg-type]


def check_demo_arguments(requests: int, log_path: Path | None) -> None:
    """Refuse what cannot run, before anything is served."""
    if not 1 <= requests <= TRACE_RECORDS:
        raise UsageError(f"--requests {requests}: the embedded trace has {TRACE_RECORDS:,} requests; "
                         f"give 1..{TRACE_RECORDS}")
    if log_path is not None:
        check_writable_file("--log", log_path)
        _check_log_takes_bytes(log_path)


def _check_log_takes_bytes(path: Path) -> None:
    """Append a byte to the log file and take it back, under the lock the delivery log takes.
    Some files open for writing and then refuse every byte (`/proc/version`, `/dev/full`); the
    delivery log only warns when a write fails, since a run must go on without its log, so
    without this the demo would end with status 0 and no log. A log another running instance
    writes is left as it is (the lock), and so is an old one (the byte is taken back: a run
    that fails to start leaves it whole)."""
    try:
        with path.open("ab") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            size = f.seek(0, 2)
            f.write(b"\n")
            f.flush()
            if path.is_file():
                f.truncate(size)
    except BlockingIOError:
        raise UsageError(f"--log {path}: another running instance is writing it; give each run a log file of "
                         "its own") from None
    except OSError as e:
        raise UsageError(f"--log {path}: cannot be written ({e.strerror or e}); give a file in a folder this "
                         "process may write") from None


def run_demo(
    requests: int | None = None,
    as_json: bool = False,
    cost: CostModel | None = None,
    log_path: Path | None = None,
    storage: str = "file",
    mooncake_master: str | None = None,
    mooncake_metadata: str | None = None,
) -> int:
    n = DEMO_REQUESTS if requests is None else requests
    check_demo_arguments(n, log_path)
    cost = cost or CostModel()
    trace = [r for r in load_trace(n)]
    with tempfile.TemporaryDirectory(prefix="hicache-demo-l3-") as tmp:
        fields: dict[str, object] = {"storage": storage, "prefetch_policy": DEMO_PREFETCH_POLICY}
        if storage == "file":
            fields["storage_dir"] = tmp
        if mooncake_master:
            fields["mooncake_master"] = mooncake_master
        if mooncake_metadata:
            fields["mooncake_metadata"] = mooncake_metadata
        cfg = demo_config(**fields)
        served = [r for r in trace if r.input_length <= cfg.device_slots // 2]
        reqs = serve_requests(served)
        with progress() as bar, _one_torch_thread():
            label = "L1 + L2 + L3" if storage != "none" else "L1 + L2"
            hier = _serve(reqs, cfg.replace(log_path=str(log_path)) if log_path else cfg, bar, label)
            l2 = _serve(reqs, demo_config(), bar, "L1 + L2", kv=False) if storage != "none" else hier
            l1 = _serve(reqs, demo_config(host_tier=False), bar, "L1 only", kv=False)
    infinite = _infinite_hits(reqs, cfg.page_size)
    figures = _figures(served, len(trace) - len(served), hier, l2, l1, infinite, cost, cfg)
    figures["evicted_tokens_l1"], figures["evicted_tokens_l2"] = hier.evicted_l1, hier.evicted_l2
    if as_json:
        print(json.dumps(figures))
    else:
        _table(figures)
    return 0 if figures["verified_tokens"] > 0 or not served else 1


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Torch's CPU ops on the calling thread alone while the demo serves. Its fake model's
    gathers, stacks and copies are a few MiB each; split over torch's intra-op threads, each
    waits for the slowest. On a two-core machine whose other core was busy with another
    process, the three runs took 108 s on two threads and 14 s on one; on an idle one, 17-19 s
    either way, with a third less CPU time on one (docs/benchmarks.md)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class _Run:
    hits_l1: int
    hits_l2: int
    hits_l3: int
    recomputed: int
    ttfts: list[tuple[int, int, int]]
    d2h_bytes: int
    h2d_bytes: int
    storage_read_bytes: int
    storage_written_bytes: int
    verified: int
    retractions: int
    ticks: int
    evicted_l1: int = 0
    evicted_l2: int = 0


def serve_requests(trace: Iterable[TraceRequest]) -> list[ServeRequest]:
    """The trace's requests as the reference scheduler takes them (outputs capped)."""
    return [ServeRequest(f"r{r.index}", r.tokens(), max(1, min(r.output_length, DEMO_OUTPUT_TOKENS_MAX)))
            for r in trace]


def _serve(reqs: list[ServeRequest], cfg: Config, bar: Any, label: str, kv: bool = True) -> _Run:
    """Serve `reqs` on `cfg`; with `kv=False` the fake model writes and checks no KV (the
    comparison runs: only their hits count)."""
    task = bar.add_task(f"serving {len(reqs)} trace requests, {label}", total=len(reqs))
    with HiCache(cfg) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(max_running=8, prefill_tokens_per_tick=8192, chunk_tokens=4096,
                                                   prefetch_window=16), model=FakeModel(hc, kv=kv))
        sched.submit(reqs)

        def progress(s: ReferenceScheduler) -> None:
            done = sum(o.finished or o.aborted for o in s.outcomes.values())
            bar.update(task, completed=done)
            if s.ticks % DEMO_CHECK_TICKS == 0:
                hc.check_invariants()

        sched.run(on_tick=progress)
        hc.check_invariants()
        stats = hc.statistics()
    outs = list(sched.outcomes.values())
    l3 = [o.storage_hit for o in outs]  # what its prefetch brought and its admission loaded back
    return _Run(
        hits_l1=sum(o.device_hit for o in outs), hits_l2=sum(o.host_hit for o in outs) - sum(l3), hits_l3=sum(l3),
        recomputed=sum(o.computed_prompt_tokens for o in outs),
        ttfts=[(o.input_tokens - o.device_hit - o.host_hit, o.host_hit, s) for o, s in zip(outs, l3)],
        d2h_bytes=stats.write.bytes_copied, h2d_bytes=stats.load.bytes_copied,
        storage_read_bytes=stats.prefetch.bytes_read, storage_written_bytes=stats.prefetch.bytes_written,
        verified=sched.model.verified_tokens, retractions=sum(o.retractions for o in outs), ticks=sched.ticks,
        evicted_l1=stats.l1.evicted_tokens, evicted_l2=stats.l2.evicted_tokens if stats.l2 else 0,
    )


def _infinite_hits(trace: list[ServeRequest], page: int) -> int:
    """Tokens an infinite page cache would hit, serving the requests in order. (Output
    tokens are committed too, but no later prompt of the trace repeats them.)"""
    seen: set[int] = set()
    hits = 0
    for r in trace:
        tokens = r.prompt.tolist()
        key = 0
        matched = True
        usable = (len(tokens) - 1) // page * page  # admission matches the prompt minus its last token
        for at in range(0, usable, page):
            key = hash((key, tuple(tokens[at : at + page])))
            if matched and key in seen:
                hits += page
            else:
                matched = False
                seen.add(key)
    return hits


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def _figures(trace: list[TraceRequest], skipped: int, hier: _Run, l2: _Run, l1: _Run, infinite: int,
             cost: CostModel, cfg: Config) -> dict[str, object]:
    inp = sum(r.input_length for r in trace)
    rate = (lambda x: round(x / inp, 4)) if inp else (lambda x: 0.0)
    ttft = [cost.ttft_s(*t) for t in hier.ttfts]
    ttft_l2 = [cost.ttft_s(*t) for t in l2.ttfts]
    ttft_l1 = [cost.ttft_s(*t) for t in l1.ttfts]
    return {
        "requests": len(trace),
        "skipped_longer_than_half_device": skipped,
        "input_tokens": inp,
        "storage": cfg.storage.value,
        "hit_tokens_l1": hier.hits_l1,
        "hit_tokens_l2": hier.hits_l2,
        "hit_tokens_l3": hier.hits_l3,
        "recomputed_tokens": hier.recomputed,
        "hit_rate": rate(hier.hits_l1 + hier.hits_l2 + hier.hits_l3),
        "hit_rate_l1_l2": rate(l2.hits_l1 + l2.hits_l2),
        "hit_rate_l1_only": rate(l1.hits_l1),
        "hit_rate_infinite": rate(infinite),
        "ttft_p50_s": round(_percentile(ttft, 0.50), 4),
        "ttft_p99_s": round(_percentile(ttft, 0.99), 4),
        "ttft_p50_s_l1_l2": round(_percentile(ttft_l2, 0.50), 4),
        "ttft_p99_s_l1_l2": round(_percentile(ttft_l2, 0.99), 4),
        "ttft_p50_s_l1_only": round(_percentile(ttft_l1, 0.50), 4),
        "ttft_p99_s_l1_only": round(_percentile(ttft_l1, 0.99), 4),
        "d2h_bytes": hier.d2h_bytes,
        "h2d_bytes": hier.h2d_bytes,
        "storage_read_bytes": hier.storage_read_bytes,
        "storage_written_bytes": hier.storage_written_bytes,
        "retractions": hier.retractions,
        "verified_tokens": hier.verified,
        "device_slots": cfg.device_slots,
        "host_slots": cfg.host_slots,
        "cost_model": asdict(cost),
    }


def _table(f: dict[str, object]) -> None:
    top = "L1 + L2 + L3" if f["storage"] != "none" else "L1 + L2"
    t = Table(title=f"hicache demo: Mooncake conversation trace through {top} (reference scheduler, "
                    f"storage: {f['storage']})")
    t.add_column("figure")
    t.add_column(top, justify="right")
    t.add_column("L1 + L2", justify="right")
    t.add_column("L1 only", justify="right")
    t.add_column("infinite", justify="right")
    t.add_row("requests served", f"{f['requests']:,}", "", "", "")
    t.add_row("input tokens", f"{f['input_tokens']:,}", "", "", "")
    t.add_row("tokens hit in L1", f"{f['hit_tokens_l1']:,}", "", "", "")
    t.add_row("tokens hit in L2", f"{f['hit_tokens_l2']:,}", "", "", "")
    t.add_row("tokens hit in L3", f"{f['hit_tokens_l3']:,}", "", "", "")
    t.add_row("prompt tokens computed", f"{f['recomputed_tokens']:,}", "", "", "")
    t.add_row("hit rate", f"{f['hit_rate']:.1%}", f"{f['hit_rate_l1_l2']:.1%}", f"{f['hit_rate_l1_only']:.1%}",
              f"{f['hit_rate_infinite']:.1%}")
    t.add_row("modelled TTFT p50", f"{f['ttft_p50_s']:.3f} s", f"{f['ttft_p50_s_l1_l2']:.3f} s",
              f"{f['ttft_p50_s_l1_only']:.3f} s", "")
    t.add_row("modelled TTFT p99", f"{f['ttft_p99_s']:.3f} s", f"{f['ttft_p99_s_l1_l2']:.3f} s",
              f"{f['ttft_p99_s_l1_only']:.3f} s", "")
    t.add_row("bytes device -> host", f"{f['d2h_bytes']:,}", "", "", "")
    t.add_row("bytes host -> device", f"{f['h2d_bytes']:,}", "", "", "")
    t.add_row("bytes read from storage", f"{f['storage_read_bytes']:,}", "", "", "")
    t.add_row("bytes written to storage", f"{f['storage_written_bytes']:,}", "", "", "")
    t.add_row("tokens evicted from L1", f"{f['evicted_tokens_l1']:,}", "", "", "")
    t.add_row("tokens evicted from L2", f"{f['evicted_tokens_l2']:,}", "", "", "")
    t.add_row("retractions", f"{f['retractions']:,}", "", "", "")
    t.add_row("cached KV tokens verified", f"{f['verified_tokens']:,}", "", "", "")
    console = Console()
    console.print(t)
    c = f["cost_model"]
    assert isinstance(c, dict)
    console.print(
        f"TTFT model: recomputed tokens at {c['prefill_tokens_per_s']:,.0f} tokens/s + L2 hits at "
        f"{c['l2_gbps']} GB/s + L3 hits at {c['l3_gbps']} GB/s then as L2, x {c['kv_bytes_per_token']:,} "
        "B/token; no queueing. "
        f"L1 {f['device_slots']:,} slots, L2 {f['host_slots']:,} slots; {f['skipped_longer_than_half_device']} "
        "requests longer than half of L1 skipped."
    )
    if f["hit_rate_infinite"] and f["hit_rate_l1_only"] >= f["hit_rate_infinite"]:
        console.print(
            "Every prefix these requests repeat was still in L1 (an infinite cache hits no more): at the start of "
            "the trace a turn reuses only the turn before it. Serve more requests (--requests 300 or more) to see "
            "L2 and L3 hit prefixes from further back."
        )
