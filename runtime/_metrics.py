"""Prometheus metrics of every `HiCache` in this process that has `Config.metrics` on.

Nothing is counted for them on the scheduler's path: one collector, registered in
prometheus_client's default registry when the first instance starts, reads each
exporting instance's `statistics()` when it is scraped and turns the records into
metric families (`hicache_` names, labels `cache` and `rank`, plus `tier`, `outcome`,
`operation` or `call` where a family is split). The histograms come from the same
records: the prefetcher counts prefetch and backup durations by the runtime's clock,
the facade (only with metrics on) its call latencies and the forward pass's waits for
loaded layers. docs/metrics.md lists every family.

The exporter is prometheus_client's HTTP server over the default registry, started by
`start_metrics_exporter` or by `Config.metrics_port` at `HiCache.start()`; one server per
address serves every exporting instance of the process.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from hicache.messages import Config, Durations, PrefetchEnd

from ._facade_types import CacheStateError, HiCacheStatistics


class _Exported(Protocol):
    """What the exporter reads of a `HiCache` (which imports this module to register)."""

    @property
    def config(self) -> Config: ...

    def statistics(self) -> HiCacheStatistics: ...


_LABELS = ("cache", "rank")

_lock = threading.Lock()
_exporting: dict[tuple[str, int], _Exported] = {}
"""The started instances with metrics on, by (`metrics_name`, `tp_rank`)."""
_servers: dict[tuple[str, int], int] = {}
"""Exporters started in this process: (host, port asked) -> port bound."""
_registered = False


def track(cache: _Exported) -> None:
    """Export `cache`'s metrics from now on (at its start); start its exporter if it names a port."""
    key = (cache.config.metrics_name, cache.config.tp_rank)
    with _lock:
        other = _exporting.get(key)
        if other is not None and other is not cache:
            raise CacheStateError(
                f"another running HiCache exports metrics as cache={key[0]!r} rank={key[1]}; close it first "
                "or give this one another metrics_name"
            )
        _register()
        if cache.config.metrics_port:
            _serve(cache.config.metrics_port, cache.config.metrics_host)
        _exporting[key] = cache


def untrack(cache: _Exported) -> None:
    """Stop exporting `cache`'s metrics (at its close); nothing if it does not export them."""
    key = (cache.config.metrics_name, cache.config.tp_rank)
    with _lock:
        if _exporting.get(key) is cache:
            del _exporting[key]


def start_metrics_exporter(port: int = 0, host: str = "127.0.0.1") -> int:
    """Serve the metrics of every exporting `HiCache` of this process (and whatever else the
    default prometheus_client registry holds) over HTTP at `http://host:port/metrics`.
    Port 0 picks a free one. Returns the port bound; asking again for the same address
    returns the same server's port."""
    if type(port) is not int or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535 (0: any free port), got {port!r}")
    with _lock:
        _register()
        return _serve(port, host)


def _register() -> None:
    global _registered
    if not _registered:
        REGISTRY.register(_Collector())
        _registered = True


def _serve(port: int, host: str) -> int:
    bound = _servers.get((host, port))
    if bound is not None:
        return bound
    try:
        server, _thread = start_http_server(port, addr=host)
    except socket.gaierror as e:  # the address, not the port
        raise OSError(e.errno, f"cannot serve metrics on {host}:{port}: {e.strerror}; check metrics_host") from None
    except OSError as e:
        raise OSError(e.errno, f"cannot serve metrics on {host}:{port}: {e.strerror}; pick another port") from None
    bound = int(server.server_address[1])
    _servers[(host, port)] = bound
    if port == 0:
        _servers[(host, bound)] = bound
    return bound


class _Collector:
    """Reads the exporting instances' statistics at each scrape (prometheus_client's custom collector)."""

    def describe(self) -> list[Metric]:
        return list(_Families().all())

    def collect(self) -> Iterator[Metric]:
        with _lock:
            caches = list(_exporting.values())
        families = _Families()
        for cache in caches:
            try:
                stats = cache.statistics()
            except CacheStateError:  # closed while this scrape ran
                continue
            families.add(cache.config.metrics_name, cache.config.tp_rank, cache.config.page_size, stats)
        yield from families.all()


class _Families:
    """One scrape's metric families, filled instance by instance."""

    def __init__(self) -> None:
        def counter(name: str, doc: str, *extra: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"hicache_{name}", doc, labels=(*_LABELS, *extra))

        def gauge(name: str, doc: str, *extra: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"hicache_{name}", doc, labels=(*_LABELS, *extra))

        def histogram(name: str, doc: str, *extra: str) -> HistogramMetricFamily:
            return HistogramMetricFamily(f"hicache_{name}", doc, labels=(*_LABELS, *extra))

        self.requested = counter("requested_tokens", "Prompt tokens looked up in a tier: those the tiers above it "
                                 "missed (L1: every token looked up).", "tier")
        self.hit = counter("hit_tokens", "Prompt tokens a tier served (L2, L3: once the load-back landed; L3: read "
                           "by the request's prefetch).", "tier")
        self.evicted = counter("evicted_tokens", "Tokens evicted from a tier.", "tier")
        self.moved_tokens = counter("transferred_tokens", "Tokens copied between tiers: write_through (L1 -> L2), "
                                    "load_back (L2 -> L1), backup (L2 -> L3), prefetch (L3 -> L2).", "operation")
        self.moved_bytes = counter("transferred_bytes", "Bytes copied between tiers, by operation as "
                                   "hicache_transferred_tokens_total.", "operation")
        self.prefetches = counter("prefetches", "Settled storage prefetches, by why they ended.", "outcome")
        self.prefetches_started = counter("prefetches_started", "Storage prefetches started.")
        self.prefetches_skipped = counter("prefetches_skipped", "Prefetches not started for the rate limit or "
                                          "for want of host memory.")
        self.failures = counter("transfer_failures", "Copies or storage reads and writes that failed, by "
                                "operation (storage: a read or a write of storage).", "operation")
        self.io_errors = counter("storage_io_errors", "OS or client errors the storage backend met (a failed "
                                 "lookup, which reads as a miss, included).")
        self.used_tokens = gauge("used_tokens", "Token slots in use in a tier (L1, L2).", "tier")
        self.capacity_tokens = gauge("capacity_tokens", "Token slots of a tier (L1, L2).", "tier")
        self.used_bytes = gauge("used_bytes", "KV bytes in use in a tier (L3: what the file backend "
                                "takes on disk; 0 for Mooncake).", "tier")
        self.capacity_bytes = gauge("capacity_bytes", "KV bytes a tier holds at most (L3 only when "
                                    "storage_max_bytes bounds it).", "tier")
        self.live = gauge("live_requests", "Requests admitted and not yet finished, aborted or retracted.")
        self.ahead = gauge("ahead_tokens", "Device token slots live requests hold in pages ahead of their "
                           "allocations (ahead_slots), as the device last heard; given back first when "
                           "memory is short.")
        self.in_flight = gauge("in_flight_operations", "Operations issued and not yet acknowledged.", "operation")
        self.wait = histogram("load_back_wait_seconds", "Seconds the forward pass waited for one layer of a "
                              "batch that loads back from host memory.")
        self.prefetch_s = histogram("prefetch_duration_seconds", "Seconds from a prefetch reaching the storage "
                                    "client to its stop.")
        self.backup_s = histogram("backup_duration_seconds", "Seconds one backup's write to storage took.")
        self.calls = histogram("facade_call_seconds", "Seconds of each HiCache call, by method.", "call")

    def all(self) -> Iterator[Metric]:
        return (v for v in vars(self).values() if isinstance(v, Metric))

    def add(self, name: str, rank: int, page: int, s: HiCacheStatistics) -> None:
        who = (name, str(rank))
        for tier in s.tiers:
            at = (*who, tier.tier)
            self.requested.add_metric(at, tier.requested_tokens)
            self.hit.add_metric(at, tier.hit_tokens)
            self.evicted.add_metric(at, tier.evicted_tokens)
            if tier.used_tokens is not None and tier.capacity_tokens is not None:
                self.used_tokens.add_metric(at, tier.used_tokens)
                self.capacity_tokens.add_metric(at, tier.capacity_tokens)
            self.used_bytes.add_metric(at, tier.used_bytes)
            if tier.capacity_bytes is not None:
                self.capacity_bytes.add_metric(at, tier.capacity_bytes)
        self._transfers(who, page, s)
        ends = s.tree.prefetch_ends
        for end in PrefetchEnd:
            self.prefetches.add_metric((*who, end.value), ends.of(end))
        self.prefetches_started.add_metric(who, s.tree.prefetches_started)
        self.prefetches_skipped.add_metric(who, s.tree.prefetch_skipped)
        self.io_errors.add_metric(who, s.prefetch.io_errors)
        self.live.add_metric(who, s.tree.live_handles)
        self.ahead.add_metric(who, s.device.ahead_slots)
        for op, n in (("write_through", s.tree.writes_in_flight), ("load_back", s.tree.loads_in_flight),
                      ("prefetch", s.tree.prefetches_in_flight), ("backup", s.tree.backups_in_flight)):
            self.in_flight.add_metric((*who, op), n)
        _observe(self.wait, who, s.load_back_wait)
        _observe(self.prefetch_s, who, s.prefetch.prefetch_durations)
        _observe(self.backup_s, who, s.prefetch.backup_durations)
        for call, durations in s.facade_calls.items():
            _observe(self.calls, (*who, call), durations)

    def _transfers(self, who: tuple[str, str], page: int, s: HiCacheStatistics) -> None:
        p = s.prefetch
        for op, tokens, nbytes in (("write_through", s.write.slots_copied, s.write.bytes_copied),
                                   ("load_back", s.load.slots_copied, s.load.bytes_copied),
                                   ("backup", p.pages_written * page, p.bytes_written),
                                   ("prefetch", p.pages_read * page, p.bytes_read)):
            self.moved_tokens.add_metric((*who, op), tokens)
            self.moved_bytes.add_metric((*who, op), nbytes)
        for op, n in (("write_through", s.write.ops_failed), ("load_back", s.load.ops_failed), ("storage", p.errors)):
            self.failures.add_metric((*who, op), n)


def _observe(family: HistogramMetricFamily, labels: Sequence[str], d: Durations) -> None:
    """One histogram sample set from a `Durations` record (cumulative buckets, as Prometheus counts)."""
    buckets: list[Any] = []
    total = 0
    for bound, n in zip((*map(_le, d.bounds_s), "+Inf"), d.bucket_counts, strict=True):
        total += n
        buckets.append((bound, total))
    family.add_metric(list(labels), buckets, d.sum_s)


def _le(bound: float) -> str:
    return repr(float(bound))
