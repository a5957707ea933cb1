"""`hicache`: the command line (demo, explore, benchmarks)."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hicache", description="Hierarchical KV-cache manager for LLM serving.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run the main job end to end on an embedded default")
    demo.add_argument("--requests", type=int, default=None, help="requests of the trace to serve")
    demo.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    demo.add_argument("--prefill-tps", type=float, default=None, help="TTFT model: prefill tokens per second")
    demo.add_argument("--l2-gbps", type=float, default=None, help="TTFT model: host -> device GB/s")
    demo.add_argument("--log", type=Path, default=None, metavar="PATH",
                      help="write every delivery of the L1 + L2 run to PATH (hicache replay reads it)")
    demo.add_argument("--kv-bytes-per-token", type=int, default=None, help="TTFT model: KV bytes per token")
    demo.add_argument("--l3-gbps", type=float, default=None, help="TTFT model: storage -> host GB/s")
    demo.add_argument("--storage", choices=("file", "mooncake", "none"), default="file",
                      help="L3 backend: file (a temporary directory, the default), mooncake (a master you "
                           "started; see docs/operations.md) or none (L1 + L2 only)")
    demo.add_argument("--mooncake-master", default=None, metavar="HOST:PORT",
                      help="with --storage mooncake: the master's RPC address (default 127.0.0.1:50051)")
    demo.add_argument("--mooncake-metadata", default=None, metavar="URL",
                      help="with --storage mooncake: the HTTP metadata server (default http://127.0.0.1:8080/metadata)")

    ex = sub.add_parser("explore", help="explore schedules deterministically; find and replay failures")
    ex.add_argument("--scenario", default="standard", help="scenario to run (default: standard)")
    ex.add_argument("--strategy", choices=("pct", "random"), default="pct", help="scheduling strategy")
    ex.add_argument("--seeds", type=int, default=100, help="how many seeds (schedules) to run")
    ex.add_argument("--first-seed", type=int, default=0, help="the first seed")
    ex.add_argument("--depth", type=int, default=3, help="PCT depth (bug depth it targets)")
    ex.add_argument("--json", action="store_true", help="print one JSON object")
    ex.add_argument("--out", type=Path, default=Path("explore-failures"), help="where failure traces and logs go")
    ex.add_argument("--replay", type=Path, default=None, metavar="TRACE", help="replay a recorded schedule")
    ex.add_argument("--mutants", action="store_true", help="show that exploration catches each seeded bug")

    rp = sub.add_parser("replay", help="replay a delivery log and report the first divergence")
    rp.add_argument("log", type=Path, help="a log written with --log PATH (or Config.log_path)")
    rp.add_argument("--until", type=int, default=None, metavar="SEQ", help="stop after delivery SEQ")
    rp.add_argument("--actor", default=None, help="replay only this actor (tree, device, host, write, load)")
    rp.add_argument("--dump", choices=("tree", "device", "host", "ledger"), default=None,
                    help="print that actor's state where replay stopped")
    rp.add_argument("--json", action="store_true", help="print one JSON object")

    bench = sub.add_parser("bench", help="benchmarks, each measured side by side in one run")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    tr = bsub.add_parser("transfer", help="D2H/H2D throughput of the stream actors vs a raw copy")
    tr.add_argument("--json", action="store_true", help="print one JSON object with `results`")
    tr.add_argument("--quick", action="store_true", help="a small, fast run (for smoke tests)")
    ov = bsub.add_parser("overhead", help="a tick of 64 requests through the actors vs directly on the cores")
    ov.add_argument("--json", action="store_true", help="print one JSON object (actor_ms, direct_ms, ratio, ...)")
    ov.add_argument("--quick", action="store_true", help="a small, fast run (for smoke tests)")
    bex = bsub.add_parser("explore", help="schedules and deliveries per second of deterministic exploration")
    bex.add_argument("--json", action="store_true", help="print one JSON object")
    bex.add_argument("--quick", action="store_true", help="a small, fast run (for smoke tests)")
    tree = bsub.add_parser("tree", help="radix tree match/insert/evict throughput as the tree grows")
    tree.add_argument("--json", action="store_true", help="print one JSON object (evict_us_small, ...)")
    tree.add_argument("--quick", action="store_true", help="a small, fast run (for smoke tests)")
    lg = bsub.add_parser("logging", help="cost of the delivery log: per delivery, and bench overhead with it on vs off")
    lg.add_argument("--json", action="store_true",
                    help="print one JSON object (us_per_delivery, overhead_ms_off, overhead_ms_on, slowdown, ...)")
    lg.add_argument("--quick", action="store_true", help="a small, fast run (for smoke tests)")
    rb = bsub.add_parser("replay", help="deliveries replayed per second from the log of a scheduler run")
    rb.add_argument("--json", action="store_true",
                    help="print one JSON object (deliveries, replay_s, deliveries_per_s, read_s, ...)")
    rb.add_argument("--quick", action="store_true", help="a small, fast run (for smoke tests)")
    tc = bsub.add_parser("trace", help="the conversation trace through the facade vs the bare cores, per phase")
    tc.add_argument("--json", action="store_true", help="print one JSON object with `results`")
    tc.add_argument("--quick", action="store_true", help="a small, fast run (for smoke tests)")
    tc.add_argument("--requests", type=int, default=None, help="serve the trace's first N requests (default 2000)")
    st = bsub.add_parser("storage", help="reading pages from each storage backend into host memory vs a raw read")
    st.add_argument("--json", action="store_true", help="print one JSON object with `results`")
    st.add_argument("--mib", type=int, default=256, help="MiB of pages written and read per backend (default 256)")
    st.add_argument("--write-pages", type=int, default=256,
                    help="pages per backend.write call, a backup's size (default 256)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from ._demo import CostModel, run_demo

        given = {"prefill_tokens_per_s": args.prefill_tps, "l2_gbps": args.l2_gbps, "l3_gbps": args.l3_gbps,
                 "kv_bytes_per_token": args.kv_bytes_per_token}
        cost = CostModel(**{k: v for k, v in given.items() if v is not None})
        return run_demo(requests=args.requests, as_json=args.json, cost=cost, log_path=args.log,
                        storage=args.storage, mooncake_master=args.mooncake_master,
                        mooncake_metadata=args.mooncake_metadata)
    if args.command == "replay":
        from ._replay_cli import run_replay

        return run_replay(args.log, until=args.until, actor=args.actor, dump=args.dump, as_json=args.json)
    if args.command == "explore":
        from ._explore_cli import run_explore

        return run_explore(scenario=args.scenario, strategy=args.strategy, seeds=args.seeds, depth=args.depth,
                           as_json=args.json, out=args.out, replay_path=args.replay, mutants=args.mutants,
                           first_seed=args.first_seed)
    if args.command == "bench" and args.bench == "explore":
        from ._explore_cli import run_bench_explore

        return run_bench_explore(as_json=args.json, quick=args.quick)
    if args.command == "bench" and args.bench == "transfer":
        from ._bench_transfer import run_bench_transfer

        return run_bench_transfer(as_json=args.json, quick=args.quick)
    if args.command == "bench" and args.bench == "overhead":
        from ._bench_overhead import run_bench_overhead

        return run_bench_overhead(as_json=args.json, quick=args.quick)
    if args.command == "bench" and args.bench == "tree":
        from ._bench_tree import run_bench_tree

        return run_bench_tree(as_json=args.json, quick=args.quick)
    if args.command == "bench" and args.bench == "logging":
        from ._bench_logging import run_bench_logging

        return run_bench_logging(as_json=args.json, quick=args.quick)
    if args.command == "bench" and args.bench == "replay":
        from ._bench_replay import run_bench_replay

        return run_bench_replay(as_json=args.json, quick=args.quick)
    if args.command == "bench" and args.bench == "trace":
        from ._bench_trace import run_bench_trace

        return run_bench_trace(as_json=args.json, quick=args.quick, requests=args.requests)
    if args.command == "bench" and args.bench == "storage":
        from ._bench_storage import run_bench_storage

        return run_bench_storage(as_json=args.json, mib=args.mib, write_pages=args.write_pages)
    raise AssertionError(f"unhandled command {args}")  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
