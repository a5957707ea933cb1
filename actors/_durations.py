"""`DurationHistogram`: durations counted into fixed buckets, for statistics and metrics.

One set of bucket bounds serves every duration the cache reports (a facade call, a wait
for a loaded layer, a prefetch, a backup), from tens of microseconds to the longest
prefetch timeout, so that histograms of different operations line up in a dashboard.
Counting is a bisect and two additions; a snapshot is a frozen `Durations` record.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Final

from hicache.messages import Durations

DURATION_BOUNDS_S: Final = (5e-05, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                            0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the buckets; one more bucket holds what lies above them."""


class DurationHistogram:
    """Counts of durations per bucket of `DURATION_BOUNDS_S`, and their sum."""

    __slots__ = ("_counts", "_sum_s")

    def __init__(self) -> None:
        self._counts = [0] * (len(DURATION_BOUNDS_S) + 1)
        self._sum_s = 0.0

    def observe(self, seconds: float) -> None:
        if not seconds >= 0.0:
            raise ValueError(f"a duration must be >= 0 seconds, got {seconds} (a clock that went backwards?)")
        self._counts[bisect_left(DURATION_BOUNDS_S, seconds)] += 1
        self._sum_s += seconds

    def snapshot(self) -> Durations:
        return Durations(bounds_s=DURATION_BOUNDS_S, bucket_counts=tuple(self._counts), sum_s=self._sum_s)
