"""Timing of facade calls and of the forward pass's waits for loaded layers, with `Config.metrics`.

The decision is taken once, when the `HiCache` is made: with metrics on, its call methods
are replaced on that instance by timed ones; with metrics off nothing here runs and the
methods are the class's own, so the scheduler's path costs what it costs without metrics.
Not actor code: it runs on the scheduler's thread and reads `time.perf_counter`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from hicache.actors._durations import DurationHistogram
from hicache.actors._layers import LayerWaiter

TIMED_CALLS: Final = ("admit", "prefetch", "ready", "allocate", "commit", "finish", "abort", "retract",
                      "cache_unfinished", "start_loads", "sync", "evict_device", "evict_host", "room")
"""The facade calls whose latency is counted: every call a scheduler makes per tick."""


@dataclass(frozen=True, slots=True)
class TimedLayerWaiter(LayerWaiter):
    """A `LayerWaiter` that counts how long each wait for a layer of a loading batch took."""

    waits: DurationHistogram | None = None

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        if self.batch == 0 or self.waits is None:  # nothing loads: no wait to count
            return LayerWaiter.wait_layer(self, layer, timeout_s)
        t0 = time.perf_counter()
        try:
            LayerWaiter.wait_layer(self, layer, timeout_s)
        finally:
            self.waits.observe(time.perf_counter() - t0)


class FacadeTimings:
    """The histograms of one `HiCache`: each timed call, and the waits for loaded layers."""

    def __init__(self) -> None:
        self.calls = {name: DurationHistogram() for name in TIMED_CALLS}
        self.load_back_wait = DurationHistogram()

    def instrument(self, cache: Any) -> None:
        """Replace `cache`'s timed call methods (on the instance) by ones that count their latency."""
        start_loads = cache.start_loads
        cache.start_loads = lambda: TimedLayerWaiter(*_fields(start_loads()), waits=self.load_back_wait)
        for name in TIMED_CALLS:
            setattr(cache, name, self._timed(getattr(cache, name), self.calls[name]))

    @staticmethod
    def _timed(call: Callable[..., Any], into: DurationHistogram) -> Callable[..., Any]:
        @functools.wraps(call)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                into.observe(time.perf_counter() - t0)

        return timed


def _fields(waiter: LayerWaiter) -> tuple[Any, int, tuple[int, ...]]:
    return waiter.ring, waiter.batch, waiter.after
