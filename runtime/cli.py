"""`hicache`: the command line (demo, benchmarks)."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hicache", description="Hierarchical KV-cache manager for LLM serving.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run the main job end to end on an embedded default")
    demo.add_argument("--requests", type=int, default=None, help="requests of the trace to serve")
    demo.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    demo.add_argument("--prefill-tps", type=float, default=None, help="TTFT model: prefill tokens per second")
    demo.add_argument("--l2-gbps", type=float, default=None, help="TTFT model: host -> device GB/s")
    demo.add_argument("--kv-bytes-per-token", type=int, default=None, help="TTFT model: KV bytes per token")

    bench = sub.add_parser("bench", help="benchmarks, each measured side by side in one run")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    tr = bsub.add_parser("transfer", help="D2H/H2D throughput of the stream actors vs a raw copy")
    tr.add_argument("--json", action="store_true", help="print one JSON object with `results`")
    tr.add_argument("--quick", action="store_true", help="a small, fast run (for smoke tests)")
    ov = bsub.add_parser("overhead", help="a tick of 64 requests through the actors vs directly on the cores")
    ov.add_argument("--json", action="store_true", help="print one JSON object (actor_ms, direct_ms, ratio, ...)")
    ov.add_argument("--quick", action="store_true", help="a small, fast run (for smoke tests)")
    tree = bsub.add_parser("tree", help="radix tree match/insert/evict throughput as the tree grows")
    tree.add_argument("--json", action="store_true", help="print one JSON object (evict_us_small, ...)")
    tree.add_argument("--quick", action="store_true", help="a small, fast run (for smoke tests)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from ._demo import CostModel, run_demo

        given = {"prefill_tokens_per_s": args.prefill_tps, "l2_gbps": args.l2_gbps,
                 "kv_bytes_per_token": args.kv_bytes_per_token}
        cost = CostModel(**{k: v for k, v in given.items() if v is not None})
        return run_demo(requests=args.requests, as_json=args.json, cost=cost)
    if args.command == "bench" and args.bench == "transfer":
        from ._bench_transfer import run_bench_transfer

        return run_bench_transfer(as_json=args.json, quick=args.quick)
    if args.command == "bench" and args.bench == "overhead":
        from ._bench_overhead import run_bench_overhead

        return run_bench_overhead(as_json=args.json, quick=args.quick)
    if args.command == "bench" and args.bench == "tree":
        from ._bench_tree import run_bench_tree

        return run_bench_tree(as_json=args.json, quick=args.quick)
    raise AssertionError(f"unhandled command {args}")  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
