"""The benchmarks behind `hicache bench`: each measures one path side by side with its baseline.

Each module has a `run_bench_*` function that the command line calls; `docs/benchmarks.md`
holds the figures with the command that printed each.
"""

__all__: list[str] = []
