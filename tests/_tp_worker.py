"""One tensor-parallel rank, run as a child process by tests/test_tensor_parallel.py.

    python tests/_tp_worker.py MODE RANK SIZE INIT_METHOD STORAGE_DIR RESULT_JSON

Modes:
- `serve:WRITE_POLICY:PREFETCH_POLICY` (e.g. `serve:WRITE_BACK:TIMEOUT`): its own HiCache
  (threaded runtime, file storage in the shared STORAGE_DIR, this rank's injected
  faults) under the reference scheduler, on a workload served
  twice with every tier below storage emptied in between (so the second pass
  prefetches from L3). After every tick the ranks exchange their tree digest, host
  use, free device slots, `room()` and queue state; the first difference ends both ranks.
- `diverge`: rank 0 passes two values to `all_min`, the others one.
- `lose`: rank 1 leaves the group; rank 0's next two collectives must raise `RankLostError`.

The result (or the divergence) goes to RESULT_JSON. A rank that runs past its own
deadline dumps every thread's stack to stderr and exits (the parent kills it too).
"""

from __future__ import annotations

import faulthandler
import json
import sys
import traceback
from pathlib import Path
from typing import Any

RANK_DEADLINE_S = 75.0
"""A rank that has not finished by then prints its threads' stacks and exits."""
COLLECTIVE_TIMEOUT_S = 30.0
"""A collective one rank never joins fails after this long instead of hanging."""
VIEW_BYTES_MAX = 1024
"""Largest per-tick view a rank sends to the others."""
TICKS_MAX = 4000
"""A phase that needs more ticks than this is stuck."""

FAULTS = {
    0: {"seed": 1, "storage_delay_s": 0.002, "storage_fail_rate": 0.05, "transfer_fail_rate": 0.02,
        "host_exhausted_rate": 0.02},
    1: {"seed": 2, "storage_delay_s": 0.0005, "storage_fail_rate": 0.08, "transfer_fail_rate": 0.04,
        "host_exhausted_rate": 0.0},
}
"""Each rank's injected faults: different seeds, latencies and rates."""


class Diverged(AssertionError):
    def __init__(self, where: str, views: list[Any]) -> None:
        super().__init__(f"ranks diverged at {where}: {views}")
        self.where, self.views = where, views


def serve(group: Any, rank: int, size: int, storage_dir: str, write: str, prefetch: str) -> dict[str, Any]:
    import torch.distributed as dist

    from hicache.actors import SeededFaults
    from hicache.runtime import Config, HiCache, PrefetchPolicy, StorageKind, ThreadedRuntime, WritePolicy
    from hicache.runtime.testing._scheduler import ReferenceScheduler, SchedulerConfig, ServeRequest
    from hicache.runtime.testing.explore import synthetic_workload

    cfg = Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=4 * 24, host_slots=4 * 48,
                 write_policy=WritePolicy[write], load_back_min_tokens=4, transfer_pages_max=2,
                 storage=StorageKind.FILE, storage_dir=storage_dir, storage_batch_pages=2, storage_batch_mb=0,
                 prefetch_policy=PrefetchPolicy[prefetch], prefetch_threshold_pages=2, prefetch_rate_fraction=1.0,
                 prefetch_timeout_base_s=0.004, prefetch_timeout_per_1k_s=0.1,
                 tp_rank=rank, tp_size=size)
    f = FAULTS[rank % len(FAULTS)]
    faults = SeededFaults(f["seed"], transfer_fail_rate=f["transfer_fail_rate"],
                          host_exhausted_rate=f["host_exhausted_rate"], storage_fail_rate=f["storage_fail_rate"],
                          storage_delay_s=f["storage_delay_s"])
    checks = 0

    def agree(hc: HiCache, sched: ReferenceScheduler | None, where: str) -> None:
        nonlocal checks
        digest, host_used = hc.tree_digest()
        free = hc.statistics().device.free_slots
        room = hc.room()
        queues = [len(sched.waiting), sorted(sched.running)] if sched is not None else None
        mine = [digest, host_used, free, [room.free_slots, room.evictable_slots, room.ahead_slots], queues]
        views = _all_gather_json(dist, mine, size)
        checks += 1
        if any(v != mine for v in views):
            raise Diverged(where, views)

    def run(hc: HiCache, sched: ReferenceScheduler, phase: str) -> int:
        start = sched.ticks
        while sched.waiting or sched.running:
            if sched.ticks - start >= TICKS_MAX:
                raise RuntimeError(f"{phase}: {len(sched.waiting)} waiting, {len(sched.running)} running "
                                   f"after {TICKS_MAX} ticks")
            sched.tick()
            hc.check_invariants()
            agree(hc, sched, f"{phase} tick {sched.ticks}")
        return sched.ticks - start

    work = synthetic_workload(5, 24, cfg.page_size, blocks=6, blocks_per_prompt=4, tail_pages=2, outputs_max=4)
    again = [ServeRequest(f"again-{r.request_id}", r.prompt, r.output_tokens) for r in work]
    with HiCache(cfg, runtime=ThreadedRuntime(seed=rank, faults=faults), group=group) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(
            max_running=4, prefill_tokens_per_tick=16, chunk_tokens=8, abort_rate=0.02, seed=3,
            lookahead_slots=2, device_budget_ratio=2.0, prefetch_window=4,
        ))
        sched.submit(work)
        first = run(hc, sched, "first pass")
        hc.quiesce()
        agree(hc, sched, "after the first pass")
        # Empty device and host memory: the second pass finds its prefixes in storage only.
        evicted = [hc.evict_device(cfg.device_slots)]
        hc.quiesce()  # under write_back the eviction started write-backs: their slots go when they land
        evicted.append(hc.evict_host(cfg.host_slots))
        agree(hc, sched, "after eviction")
        sched.submit(again)
        second = run(hc, sched, "second pass")
        hc.quiesce()
        hc.check_invariants()
        agree(hc, sched, "at the end")
        s = hc.statistics()
        outcomes = list(sched.outcomes.values())
        return {
            "rank": rank, "ticks": [first, second], "digest_checks": checks, "evicted": evicted,
            "prefetches_started": s.tree.prefetches_started, "prefetch_ends": s.as_dict()["tree"]["prefetch_ends"],
            "storage_hit_tokens": s.tree.storage_hit_tokens, "stored_tokens": s.tree.stored_tokens,
            "scheduler_storage_hit": sum(o.storage_hit for o in outcomes),
            "pages_read": s.prefetch.pages_read, "pages_written": s.prefetch.pages_written,
            "storage_errors": s.prefetch.errors, "faults_injected": faults.injected,
            "load_failures": sched.load_failures, "backups_failed": s.tree.backups_failed,
            "host_hit_tokens": s.tree.host_hit_tokens, "device_hit_tokens": s.tree.device_hit_tokens,
            "verified_tokens": sched.model.verified_tokens,
            "requests": len(outcomes), "finished": sum(o.finished for o in outcomes),
            "aborted": sum(o.aborted for o in outcomes),
            "ended": all(o.finished or o.aborted for o in outcomes),
            "live_handles": s.tree.live_handles, "facts_pending": s.tree.facts_pending,
            "writes_in_flight": s.tree.writes_in_flight, "loads_in_flight": s.tree.loads_in_flight,
            "prefetches_in_flight": s.tree.prefetches_in_flight,
        }


def _all_gather_json(dist: Any, value: Any, size: int) -> list[Any]:
    """Every rank's `value` (JSON), through a fixed-size byte tensor (no numpy needed)."""
    import torch

    raw = json.dumps(value).encode()
    if len(raw) > VIEW_BYTES_MAX:
        raise ValueError(f"a rank's view takes {len(raw)} bytes, more than {VIEW_BYTES_MAX}")
    mine = torch.zeros(VIEW_BYTES_MAX + 8, dtype=torch.uint8)
    mine[:8] = torch.tensor(list(len(raw).to_bytes(8, "little")), dtype=torch.uint8)
    mine[8 : 8 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(out, mine)
    views = []
    for t in out:
        b = bytes(t.tolist())
        views.append(json.loads(b[8 : 8 + int.from_bytes(b[:8], "little")]))
    return views


def diverge(group: Any, rank: int) -> dict[str, Any]:
    from hicache.runtime._group import RankDivergenceError

    out: dict[str, Any] = {"rank": rank, "raised": None}
    try:
        group.all_min([7, 8] if rank == 0 else [7])
    except RankDivergenceError as err:
        out["raised"] = str(err)
    out["after"] = group.all_min([10 + rank])  # the group is still in step: the next collective works
    return out


def lose(group: Any, rank: int) -> dict[str, Any]:
    """Rank 1 leaves the group (as a rank that died would); rank 0's next collectives fail."""
    import time

    from hicache.runtime._group import RankLostError

    out: dict[str, Any] = {"rank": rank, "raised": []}
    group.all_min([1])
    if rank == 1:
        group.close()
        return out
    time.sleep(0.5)
    for _ in range(2):
        t0 = time.monotonic()
        try:
            group.all_min([1])
        except RankLostError as err:
            out["raised"].append([str(err), time.monotonic() - t0])
    return out


def main(argv: list[str]) -> int:
    mode, rank_s, size_s, init_method, storage_dir, result = argv
    rank, size = int(rank_s), int(size_s)
    faulthandler.dump_traceback_later(RANK_DEADLINE_S, exit=True)
    from hicache.runtime._group import TorchGroup

    group = TorchGroup.start(rank, size, init_method, timeout_s=COLLECTIVE_TIMEOUT_S)
    out: dict[str, Any]
    code = 0
    try:
        if mode.startswith("serve:"):
            _, write, prefetch = mode.split(":")
            out = serve(group, rank, size, storage_dir, write, prefetch)
        elif mode == "diverge":
            out = diverge(group, rank)
        elif mode == "lose":
            out = lose(group, rank)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    except Diverged as err:
        out, code = {"rank": rank, "diverged": err.where, "views": [repr(v) for v in err.views]}, 1
    except BaseException:
        out, code = {"rank": rank, "error": traceback.format_exc()}, 1
    Path(result).write_text(json.dumps(out))
    group.close()
    faulthandler.cancel_dump_traceback_later()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
