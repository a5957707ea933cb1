"""`hicache simulate --plot FILE.png`: hit rate per tier and modelled TTFT against capacity.

The x axis is the capacity that takes the most values in the sweep (L1, else L2, else L3);
each combination of the other swept values is one series. Drawn with matplotlib's Agg
backend (no display needed).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from .._usage import UsageError, check_writable_file


def check_plot_available(path: Path) -> None:
    """UsageError unless matplotlib (the `plot` extra) can be imported and `path` can be
    written (checked before the runs, which may take long)."""
    check_writable_file("--plot", path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"--plot {path}: drawing needs matplotlib, which is not installed; "
                         "pip install 'hicache[plot]' (or matplotlib)") from None


def plot_sweep(outcomes: list[Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axis = max(("l1", "l2", "l3"), key=lambda a: len({getattr(o.point, a) for o in outcomes}))
    series: dict[str, list[Any]] = defaultdict(list)
    for o in outcomes:
        series[_series_label(o.point, axis)].append(o)
    fig, (hits, ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, runs in series.items():
        runs.sort(key=lambda o: getattr(o.point, axis) or 0)
        xs = [getattr(o.point, axis) or 0 for o in runs]
        rates = [o.as_dict() for o in runs]
        line, = hits.plot(xs, [r["hit_rate"] for r in rates], marker="o", label=f"all tiers {label}".strip())
        for tier, style in (("l1", ":"), ("l2", "--"), ("l3", "-.")):
            if any(r[f"hit_rate_{tier}"] for r in rates):
                hits.plot(xs, [r[f"hit_rate_{tier}"] for r in rates], style, color=line.get_color(),
                          label=f"{tier.upper()} {label}".strip())
        ttft.plot(xs, [o.ttft_p50_s for o in runs], marker="o", color=line.get_color(), label=f"p50 {label}".strip())
        ttft.plot(xs, [o.ttft_p99_s for o in runs], "--", color=line.get_color(), label=f"p99 {label}".strip())
    hits.set(xlabel=f"{axis.upper()} capacity (tokens)", ylabel="hit rate (of input tokens)", ylim=(0, 1))
    ttft.set(xlabel=f"{axis.upper()} capacity (tokens)", ylabel="modelled TTFT (s)")
    for ax in (hits, ttft):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise UsageError(f"--plot: cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)


def _series_label(point: Any, axis: str) -> str:
    parts = [f"{a.upper()} {getattr(point, a):,}" for a in ("l1", "l2", "l3") if a != axis and getattr(point, a)]
    parts += [point.write_policy, point.eviction_policy, point.prefetch_policy]
    return "(" + ", ".join(parts) + ")"
