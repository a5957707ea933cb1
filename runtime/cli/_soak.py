"""`hicache soak`: a long mixed workload with faults and L3, watching for leaks.

The reference scheduler serves the embedded conversation trace, round after round, on the
production (threaded) runtime: device L1, host L2 and a file L3 in a temporary directory,
bounded (`L3_BYTES_MAX`) so that it is full and evicting within the first minute;
chunked prefill, decode, retraction, aborts of running and prefetching requests, storage
prefetch, and seeded faults (failed copy batches, refused host reservations, failed and
slow storage calls). After every round the cache must be quiet (nothing live, every slot
accounted for) and its invariants hold. Every `--every-s` seconds (a minute by default) it
prints one line: elapsed time, requests served, the process's resident memory, its
threads and its open file descriptors; these must stay flat (the last line says whether
they did). Not a test run in CI: the documented check is `hicache soak --minutes 30`.

Not actor code: it reads the wall clock and /proc.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from hicache.actors._services import SeededFaults
from hicache.messages.config import Config, PrefetchPolicy

from .._facade import HiCache
from ..testing._scheduler import ReferenceScheduler, SchedulerConfig, ServeRequest
from .._system import ThreadedRuntime
from ..testing.explore import check_quiescent
from ..trace import load_trace

ROUND_REQUESTS = 48
"""Trace requests served per round (prompts cut to `PROMPT_TOKENS_MAX`)."""
PROMPT_TOKENS_MAX = 2048
L3_BYTES_MAX = 64 << 20
"""The file L3's bound (`Config.storage_max_bytes`), reached within the first minute: unbounded, the
segments grew by about 150 MB a minute, and with them every fresh instance's index of their pages
(resident memory), which the verdict would take for a leak."""
GROWTH_ALLOWED = 1.25
"""Resident memory may end this much above its level after the first minute (allocator noise)."""


@dataclass(frozen=True, slots=True)
class Sample:
    elapsed_s: float
    requests: int
    rss_mib: float
    threads: int
    fds: int

    def line(self) -> str:
        return (f"{self.elapsed_s / 60:6.1f} min  {self.requests:8d} requests  rss {self.rss_mib:8.1f} MiB  "
                f"threads {self.threads:3d}  fds {self.fds:4d}")


def sample(elapsed_s: float, requests: int) -> Sample:
    rss = 0.0
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    return Sample(elapsed_s, requests, rss, threading.active_count(), len(os.listdir("/proc/self/fd")))


SOAK_MODEL_ID = "hicache-soak"
"""The model the soak's KV is of (the reference scheduler's fingerprints): what its storage keys name."""


def _config(storage_dir: str, seed: int) -> Config:
    policy = list(PrefetchPolicy)[seed % 3]
    return Config(layers=2, kv_heads=1, head_dim=16, page_size=16, device_slots=16 * 512, host_slots=16 * 2048,
                  model_id=SOAK_MODEL_ID, storage="file", storage_dir=storage_dir, storage_max_bytes=L3_BYTES_MAX,
                  prefetch_policy=policy,
                  prefetch_threshold_pages=2,
                  prefetch_timeout_base_s=0.02, prefetch_timeout_per_1k_s=0.05, prefetch_timeout_max_s=0.2)


def _round(hc: HiCache, seed: int, first: int) -> int:
    trace = list(load_trace(first + ROUND_REQUESTS))[first:]
    sched = ReferenceScheduler(hc, SchedulerConfig(max_running=8, prefill_tokens_per_tick=4096, chunk_tokens=1024,
                                                   abort_rate=0.01, seed=seed, lookahead_slots=2, verify=True))
    sched.submit([ServeRequest(f"s{seed}-{r.index}", r.tokens()[:PROMPT_TOKENS_MAX], 1 + r.index % 8)
                  for r in trace if r.input_length >= 2])
    sched.run()
    hc.quiesce()
    hc.check_invariants()
    check_quiescent(hc)
    return len(sched.outcomes)


def run_soak(*, minutes: float, every_s: float, seed: int = 0) -> int:
    deadline = time.monotonic() + minutes * 60
    t0 = time.monotonic()
    samples: list[Sample] = []
    served, first, rounds = 0, 0, 0
    faults = SeededFaults(seed, transfer_fail_rate=0.02, host_exhausted_rate=0.02, storage_fail_rate=0.02,
                          storage_delay_s=0.002)
    with tempfile.TemporaryDirectory(prefix="hicache-soak-") as tmp:
        next_sample = t0
        while True:
            now = time.monotonic()
            if now >= next_sample:
                samples.append(sample(now - t0, served))
                print(samples[-1].line(), flush=True)
                next_sample += every_s
            if now >= deadline:
                break
            # A fresh instance now and then: start and close must not leak either.
            with HiCache(_config(tmp, seed + rounds), runtime=ThreadedRuntime(seed=seed + rounds, faults=faults)) as hc:
                for _ in range(4):
                    served += _round(hc, seed + rounds, first)
                    first = (first + ROUND_REQUESTS) % 10_000
                    rounds += 1
                    if time.monotonic() >= deadline:
                        break
    return _verdict(samples)


def _verdict(samples: list[Sample]) -> int:
    if len(samples) < 3:
        print("too short to judge (fewer than 3 samples)")
        return 0
    base, last = samples[1], samples[-1]
    flat = (last.rss_mib <= base.rss_mib * GROWTH_ALLOWED and last.threads <= base.threads + 1
            and last.fds <= base.fds + 2)
    print(f"{'flat' if flat else 'GROWING'}: rss {base.rss_mib:.1f} -> {last.rss_mib:.1f} MiB, threads "
          f"{base.threads} -> {last.threads}, fds {base.fds} -> {last.fds} (from the second sample on)")
    sys.stdout.flush()
    return 0 if flat else 1
