"""`hicache`: the command line (demo, simulate, explore, replay, soak, benchmarks).

Parsing imports nothing heavy: `hicache --help` and a refused argument answer at once, and
torch comes in with the command that needs it. Every mistake in what the user gave (an
argument argparse refuses, a value out of range, an unreadable file, a storage server that
does not answer) is one line on stderr, `hicache COMMAND: what was wrong`, and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn

from .._usage import UsageError

SCENARIOS: Final = ("standard", "faults", "misuse", "pressure", "orphans", "overlap", "storage")
"""`hicache explore --scenario` values (a test keeps them equal to `explore.SCENARIOS`)."""
REPLAYABLE: Final = ("tree", "device", "host", "write", "load")
WRITE_POLICIES: Final = ("write_through", "write_through_selective", "write_back")
EVICTION_POLICIES: Final = ("lru", "lfu", "fifo", "priority")
PREFETCH_POLICIES: Final = ("best_effort", "wait_complete", "timeout")
"""The policy values `hicache simulate` sweeps (a test keeps them equal to `Config`'s enums)."""


class _Parser(argparse.ArgumentParser):
    """Refusals in one line (`hicache demo: ...`), and defaults in every option's help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: {message} (see {self.prog} --help)\n")
        sys.exit(2)


class _Help(argparse.HelpFormatter):
    """Appends `(default: X)` to an option's help when it has a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS) and "default" not in text
        return f"{text} (default: %(default)s)" if shown and action.option_strings else text


def _number(kind: type, low: float, high: float | None = None, what: str = "") -> Callable[[str], Any]:
    """An argparse type: an int or float in low..high, refused in one line otherwise. `float`
    reads `inf` and `nan` too; neither is a rate or a duration, and `inf` would reach
    `--json` as `Infinity`, which is not JSON."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number; give one {_span(low, high)}{what}")
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} must be {_span(low, high)}{what}")
        if kind is int and value > _INT_MAX:  # past what a range or an array takes: an OverflowError deep inside
            raise argparse.ArgumentTypeError(f"{text} is more than any count takes (at most {_INT_MAX})")
        return value

    return parse


def _span(low: float, high: float | None) -> str:
    return f"in {low}..{high}" if high is not None else f">= {low}"


_TINY = 1e-12
_INT_MAX = (1 << 62) - 1
_positive = _number(float, _TINY)
_count = _number(int, 1)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hicache", description="Hierarchical KV-cache manager for LLM serving.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    _demo_args(sub.add_parser("demo", help="run the main job end to end on an embedded default"))
    _simulate_args(sub.add_parser("simulate", help="hit rate per tier and modelled TTFT of your trace, swept "
                                                   "over capacities and policies"))
    _explore_args(sub.add_parser("explore", help="explore schedules deterministically; find and replay failures"))
    rp = sub.add_parser("replay", help="replay a delivery log and report the first divergence")
    rp.add_argument("log", type=Path, help="a log written with --log PATH (or Config.log_path)")
    rp.add_argument("--until", type=_count, default=None, metavar="SEQ", help="stop after delivery SEQ")
    rp.add_argument("--actor", choices=REPLAYABLE, default=None, help="replay only this actor")
    rp.add_argument("--dump", choices=("tree", "device", "host", "ledger"), default=None,
                    help="print that actor's state where replay stopped")
    rp.add_argument("--json", action="store_true", help="print one JSON object")
    sk = sub.add_parser("soak", help="a long mixed workload with faults and L3, printing memory, threads and fds")
    sk.add_argument("--minutes", type=_positive, default=30.0, help="how long to run")
    sk.add_argument("--every-s", type=_positive, default=60.0, help="seconds between samples")
    sk.add_argument("--seed", type=_number(int, 0), default=0, help="seeds the faults and the policies")
    _bench_args(sub.add_parser("bench", help="benchmarks, each measured side by side in one run"))
    return p


def _cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-tps", type=_positive, default=8000.0, help="TTFT model: prefill tokens per second")
    p.add_argument("--l2-gbps", type=_positive, default=20.0, help="TTFT model: host -> device GB/s")
    p.add_argument("--l3-gbps", type=_positive, default=5.0, help="TTFT model: storage -> host GB/s")


def _demo_args(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--requests", type=_count, default=600, help="requests of the trace to serve (1..12031)")
    demo.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    _cost_args(demo)
    demo.add_argument("--kv-bytes-per-token", type=_count, default=131072, help="TTFT model: KV bytes per token")
    demo.add_argument("--log", type=Path, default=None, metavar="PATH",
                      help="write every delivery of the L1 + L2 + L3 run to PATH (hicache replay reads it)")
    demo.add_argument("--storage", choices=("file", "mooncake", "none"), default="file",
                      help="L3 backend: file (a temporary directory), mooncake (a master you started; see "
                           "docs/operations.md) or none (L1 + L2 only)")
    demo.add_argument("--mooncake-master", default="127.0.0.1:50051", metavar="HOST:PORT",
                      help="with --storage mooncake: the master's RPC address")
    demo.add_argument("--mooncake-metadata", default="http://127.0.0.1:8080/metadata", metavar="URL",
                      help="with --storage mooncake: the HTTP metadata server")
    demo.add_argument("--model", default=None, metavar="tiny|PATH",
                      help="serve a real transformer instead of the trace: 'tiny' (a small random Llama on CPU) or "
                           "a local transformers model directory; prints measured TTFT per tier beside the modelled")


def _simulate_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--trace", type=Path, required=True, metavar="FILE",
                   help="a JSONL trace: Mooncake's format (input_length, hash_ids, ...) or one prompt's token ids "
                        "per line (docs/simulate.md)")
    s.add_argument("--format", choices=("auto", "mooncake", "tokens"), default="auto", help="the trace's format")
    s.add_argument("--block-size", type=_count, default=512, help="Mooncake format: tokens per hash id")
    s.add_argument("--requests", type=_count, default=None, help="serve only the trace's first N requests")
    s.add_argument("--page-size", type=_number(int, 1, 4096), default=64, help="tokens per page")
    s.add_argument("--l1", required=True, metavar="SIZES",
                   help="device (L1) capacities: tokens (100000, 100k, 2M) or bytes (4GiB, 500MB), comma-separated")
    s.add_argument("--l2", default=None, metavar="SIZES", help="host (L2) capacities, as --l1 (default: no L2)")
    s.add_argument("--l3", default=None, metavar="SIZES",
                   help="storage (L3) capacities, as --l1 or 'unbounded'; needs --l2 (default: no L3)")
    shape = s.add_mutually_exclusive_group()
    shape.add_argument("--kv-bytes-per-token", type=_count, default=131072,
                       help="KV bytes per token: turns byte capacities into tokens, and prices transfers in the "
                            "TTFT model")
    shape.add_argument("--model-shape", default=None, metavar="LAYERS,KV_HEADS,HEAD_DIM[,DTYPE]",
                       help="the model's KV shape instead of --kv-bytes-per-token (dtype default bfloat16)")
    s.add_argument("--write-policy", default="write_through", metavar="LIST",
                   help=f"write policies to sweep, comma-separated: {', '.join(WRITE_POLICIES)}")
    s.add_argument("--eviction-policy", default="lru", metavar="LIST",
                   help=f"eviction policies to sweep: {', '.join(EVICTION_POLICIES)}")
    s.add_argument("--prefetch-policy", default="best_effort", metavar="LIST",
                   help=f"prefetch policies to sweep: {', '.join(PREFETCH_POLICIES)}")
    _cost_args(s)
    s.add_argument("--no-kv", action="store_true",
                   help="hit rates only: drive the cores without actors or KV bytes, one request at a time (fast)")
    s.add_argument("--json", action="store_true", help="print one JSON object with every run")
    s.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="draw hit rate per tier and modelled TTFT against capacity (matplotlib)")


def _explore_args(ex: argparse.ArgumentParser) -> None:
    ex.add_argument("--scenario", choices=SCENARIOS, default="standard", help="scenario to run")
    ex.add_argument("--strategy", choices=("pct", "random"), default="pct", help="scheduling strategy")
    ex.add_argument("--seeds", type=_count, default=100, help="how many seeds (schedules) to run")
    ex.add_argument("--first-seed", type=_number(int, 0), default=0, help="the first seed")
    ex.add_argument("--depth", type=_count, default=3, help="PCT depth (bug depth it targets)")
    ex.add_argument("--json", action="store_true", help="print one JSON object")
    ex.add_argument("--out", type=Path, default=Path("explore-failures"), help="where failure traces and logs go")
    ex.add_argument("--replay", type=Path, default=None, metavar="TRACE",
                    help="replay a schedule trace written by a failing exploration")
    ex.add_argument("--mutants", action="store_true", help="show that exploration catches each mutant (a known bug put back)")


def _bench_args(bench: argparse.ArgumentParser) -> None:
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH", parser_class=_Parser)

    def quick_json(name: str, help_: str, json_help: str = "print one JSON object") -> argparse.ArgumentParser:
        b = bsub.add_parser(name, help=help_)
        b.add_argument("--json", action="store_true", help=json_help)
        b.add_argument("--quick", action="store_true", help="a small, fast run (for smoke tests)")
        return b

    quick_json("transfer", "D2H/H2D throughput of the stream actors vs a raw copy", "print one JSON object with `results`")
    quick_json("overhead", "a tick of 64 requests through the actors vs directly on the cores",
               "print one JSON object (actor_ms, direct_ms, ratio, ...)")
    quick_json("explore", "schedules and deliveries per second of deterministic exploration")
    quick_json("tree", "radix tree match/insert/evict throughput as the tree grows",
               "print one JSON object (evict_us_small, ...)")
    quick_json("logging", "cost of the delivery log: per delivery, and bench overhead with it on vs off",
               "print one JSON object (us_per_delivery, overhead_ms_off, overhead_ms_on, slowdown, ...)")
    quick_json("replay", "deliveries replayed per second from the log of a scheduler run",
               "print one JSON object (deliveries, replay_s, deliveries_per_s, read_s, ...)")
    tc = quick_json("trace", "the conversation trace through the facade vs the bare cores, per phase",
                    "print one JSON object with `results`")
    tc.add_argument("--requests", type=_count, default=None, help="serve the trace's first N requests (default 2000)")
    st = bsub.add_parser("storage", help="reading pages from each storage backend into host memory vs a raw read")
    st.add_argument("--json", action="store_true", help="print one JSON object with `results`")
    st.add_argument("--mib", type=_number(int, 2), default=256,
                    help="MiB of pages written and read per backend, at least 2 (one 2 MiB page)")
    st.add_argument("--write-pages", type=_count, default=256, help="pages per backend write call, a backup's size")
    st.add_argument("--backend", choices=("file", "mooncake", "both"), default="both",
                    help="the storage backends to time (default both)")
    st.add_argument("--load-back", action="store_true",
                    help="also time an L3 hit's path: storage -> host -> device (the GPU when CUDA is present)")
    st.add_argument("--read-threads", type=_number(int, 1, 64), default=None,
                    help="the backends' storage_read_threads, 1..64: threads that verify a read's large pages "
                         "together (default: Config's, 2)")
    st.add_argument("--dir", default=None,
                    help="the file backend's pages (and the raw side's file) go to a fresh directory in this "
                         "existing, writable directory, the file system an L3 is to run on (default: the system's "
                         "temporary directory)")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    prog = f"hicache {args.command}" + (f" {args.bench}" if args.command == "bench" else "")
    try:
        return _COMMANDS[args.command](args)
    except UsageError as e:
        return _refuse(prog, str(e))
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130
    except Exception as e:  # noqa: BLE001 - only the user's mistakes are turned into one line
        if isinstance(e, _user_errors()):
            return _refuse(prog, str(e))
        raise


def _refuse(prog: str, message: str) -> int:
    sys.stderr.write(f"{prog}: {' '.join(message.split())}\n")
    return 2


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean the user's input or environment is wrong, not the program (their
    modules are loaded by the command that raised them)."""
    from hicache.actors import StorageError
    from hicache.runtime import ConfigError, ReplayLogError
    from hicache.runtime.testing import MasterStartError
    from hicache.runtime.trace import TraceError

    return (ConfigError, StorageError, MasterStartError, ReplayLogError, TraceError)


def _demo(args: argparse.Namespace) -> int:
    from ..demo._demo import CostModel, run_demo

    cost = CostModel(prefill_tokens_per_s=args.prefill_tps, l2_gbps=args.l2_gbps, l3_gbps=args.l3_gbps,
                     kv_bytes_per_token=args.kv_bytes_per_token)
    if args.model is not None:
        from ..demo._demo_model import run_model_demo

        return run_model_demo(args.model, as_json=args.json, cost=cost)
    return run_demo(requests=args.requests, as_json=args.json, cost=cost, log_path=args.log, storage=args.storage,
                    mooncake_master=args.mooncake_master, mooncake_metadata=args.mooncake_metadata)


def _simulate(args: argparse.Namespace) -> int:
    from ..demo._demo import CostModel
    from ..demo._simulate import Sweep, kv_bytes_of_shape, parse_sizes, run_simulate
    from ..demo._simulate_plot import check_plot_available
    from ..demo._simulate_trace import read_trace

    kv = kv_bytes_of_shape(args.model_shape) if args.model_shape else args.kv_bytes_per_token
    sweep = Sweep(
        l1=parse_sizes("--l1", args.l1), l2=parse_sizes("--l2", args.l2) if args.l2 else (),
        l3=parse_sizes("--l3", args.l3, unbounded=True) if args.l3 else (),
        write=_choices("--write-policy", args.write_policy, WRITE_POLICIES),
        eviction=_choices("--eviction-policy", args.eviction_policy, EVICTION_POLICIES),
        prefetch=_choices("--prefetch-policy", args.prefetch_policy, PREFETCH_POLICIES),
        page_size=args.page_size, kv_bytes_per_token=kv,
    )
    sweep.points()  # a capacity that cannot work is refused before the trace is read
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise UsageError(f"--plot {args.plot}: give a .png file name")
    if args.plot is not None:
        check_plot_available(args.plot)
    trace = read_trace(args.trace, args.format, args.block_size, args.requests)
    cost = CostModel(prefill_tokens_per_s=args.prefill_tps, l2_gbps=args.l2_gbps, l3_gbps=args.l3_gbps,
                     kv_bytes_per_token=kv)
    return run_simulate(trace=trace, sweep=sweep, no_kv=args.no_kv, cost=cost, as_json=args.json, plot=args.plot,
                        source=str(args.trace))


def _choices(option: str, text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    values = tuple(dict.fromkeys(v.strip().lower() for v in text.split(",")))
    wrong = [v for v in values if v not in allowed]
    if wrong:
        raise UsageError(f"{option}: {', '.join(map(repr, wrong))} is not one of {', '.join(allowed)}")
    return values


def _explore(args: argparse.Namespace) -> int:
    from ._explore import run_explore

    return run_explore(scenario=args.scenario, strategy=args.strategy, seeds=args.seeds, depth=args.depth,
                       as_json=args.json, out=args.out, replay_path=args.replay, mutants=args.mutants,
                       first_seed=args.first_seed)


def _replay(args: argparse.Namespace) -> int:
    from ._replay import run_replay

    return run_replay(args.log, until=args.until, actor=args.actor, dump=args.dump, as_json=args.json)


def _soak(args: argparse.Namespace) -> int:
    from ._soak import run_soak

    return run_soak(minutes=args.minutes, every_s=args.every_s, seed=args.seed)


def _bench(args: argparse.Namespace) -> int:
    module, function = _BENCHES[args.bench]
    run = getattr(importlib.import_module(module), function)
    if args.bench == "storage":
        backends = ("file", "mooncake") if args.backend == "both" else (args.backend,)
        return int(run(as_json=args.json, mib=args.mib, write_pages=args.write_pages, backends=backends,
                       load_back=args.load_back, read_threads=args.read_threads, where=args.dir))
    if args.bench == "trace":
        return int(run(as_json=args.json, quick=args.quick, requests=args.requests))
    return int(run(as_json=args.json, quick=args.quick))


_BENCHES: Final = {
    "transfer": ("hicache.runtime.bench._transfer", "run_bench_transfer"),
    "overhead": ("hicache.runtime.bench._overhead", "run_bench_overhead"),
    "explore": ("hicache.runtime.cli._explore", "run_bench_explore"),
    "tree": ("hicache.runtime.bench._tree", "run_bench_tree"),
    "logging": ("hicache.runtime.bench._logging", "run_bench_logging"),
    "replay": ("hicache.runtime.bench._replay", "run_bench_replay"),
    "trace": ("hicache.runtime.bench._trace", "run_bench_trace"),
    "storage": ("hicache.runtime.bench._storage", "run_bench_storage"),
}
"""Each benchmark: the module and function that run it."""

_COMMANDS: Final[dict[str, Callable[[argparse.Namespace], int]]] = {
    "demo": _demo, "simulate": _simulate, "explore": _explore, "replay": _replay, "soak": _soak, "bench": _bench,
}

