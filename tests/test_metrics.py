"""Named statistics per tier, and the Prometheus metrics scraped over HTTP after a known workload."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pykka
import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hicache.actors import DURATION_BOUNDS_S, DurationHistogram, KVShape
from hicache.messages import HostSlotState, PrefetchEnd
from hicache.runtime import (
    CacheStateError,
    Config,
    ConfigError,
    HiCache,
    LoadFailedError,
    Request,
    start_metrics_exporter,
)
from hicache.runtime._timings import TIMED_CALLS
from hicache.runtime.testing.oracle import FingerprintOracle

from conftest import FailFirstLoads, make_runtime

PROMPT = list(range(100, 112))  # three pages of 4
LONGER = PROMPT + [7, 7, 7, 7]


def _config(**changes: object) -> Config:
    return Config(layers=2, kv_heads=1, head_dim=8, page_size=4, device_slots=64, host_slots=256, **changes)  # type: ignore[arg-type]


def serve(cache: HiCache, request: Request) -> tuple[int, int, int]:
    """One request as an engine serves it; its (device, host, storage) hits."""
    model = FingerprintOracle(KVShape.of(cache.config))
    [admitted] = cache.admit([request])
    cache.start_loads().wait_all()
    rid, tokens, cached = request.request_id, list(request.tokens), admitted.cached_tokens
    slots = cache.allocate({rid: len(tokens) - cached})[rid]  # type: ignore[index]
    model.write(cache.device_kv, tokens, slots, start=cached)
    cache.commit({rid: tokens[cached:]})
    model.verify(cache.device_kv, tokens, cache.slots(rid))
    cache.finish([admitted.handle])
    cache.check_invariants()
    return admitted.device_hit, admitted.host_hit, admitted.storage_hit


def known_workload(cache: HiCache) -> None:
    """12 tokens missed; 16 looked up, 12 hit in L1; then, L1 evicted, 16 loaded back from L2."""
    assert serve(cache, Request("a", PROMPT)) == (0, 0, 0)
    assert serve(cache, Request("b", LONGER)) == (12, 0, 0)
    cache.quiesce()  # the write-throughs landed: the prefix is backed up in host memory
    assert cache.evict_device(64) == 16
    assert serve(cache, Request("c", LONGER)) == (0, 16, 0)
    cache.quiesce()


def test_statistics_name_each_tier_and_each_state() -> None:
    with HiCache(_config()) as cache:
        known_workload(cache)
        s = cache.statistics()
        cache.check_invariants()
    assert s.looked_up_tokens == 12 + 16 + 16
    assert (s.l1.tier, s.l1.requested_tokens, s.l1.hit_tokens, s.l1.evicted_tokens) == ("L1", 44, 12, 16)
    assert s.l2 is not None and (s.l2.requested_tokens, s.l2.hit_tokens) == (32, 16)
    assert s.l3 is None and [t.tier for t in s.tiers] == ["L1", "L2"]
    assert s.l1.hit_rate == pytest.approx(12 / 44) and s.l2.hit_rate == pytest.approx(0.5)
    assert s.hit_tokens == 28 and s.hit_rate == pytest.approx(28 / 44)
    assert s.l1.capacity_tokens == 64 and s.l1.capacity_bytes == 64 * _config().bytes_per_slot
    assert s.l1.used_tokens == s.device.capacity_slots - s.device.free_slots == 16
    assert s.l2.used_tokens == 16 and s.l2.used_bytes == 16 * _config().bytes_per_slot
    assert s.host.slots_in(HostSlotState.SYNCED) == s.host.synced_slots == 16
    assert sum(s.host.slots_in(st) for st in HostSlotState) == s.host.capacity_slots
    assert s.tree.prefetch_ends.of(PrefetchEnd.COMPLETE) == s.tree.prefetch_ends.complete == 0
    assert s.facade_calls == {} and s.load_back_wait.count == 0  # counted only with metrics


def test_as_dict_is_json_with_the_hit_rates() -> None:
    with HiCache(_config()) as cache:
        known_workload(cache)
        d = json.loads(json.dumps(cache.statistics().as_dict()))
    assert d["looked_up_tokens"] == 44 and d["hit_tokens"] == 28 and d["hit_rate"] == pytest.approx(28 / 44)
    assert d["l1"]["hit_rate"] == pytest.approx(12 / 44) and d["l2"]["hit_tokens"] == 16 and d["l3"] is None
    assert d["host"]["synced_slots"] == 16 and d["tree"]["prefetch_ends"]["miss"] == 0
    assert d["prefetch"]["backup_durations"]["bucket_counts"] == [0] * (len(DURATION_BOUNDS_S) + 1)


def test_storage_hits_count_as_l3_and_not_as_l2(tmp_path: Path) -> None:
    config = _config(storage="file", storage_dir=str(tmp_path), prefetch_policy="wait_complete",
                     prefetch_threshold_pages=1)
    with HiCache(config) as cache:
        serve(cache, Request("a", PROMPT))
        cache.quiesce()  # backed up to storage
    with HiCache(config) as cache:
        request = Request("b", LONGER)
        assert cache.prefetch([request]) == {"b": 16}
        while not cache.ready(["b"]):
            pass
        assert serve(cache, request) == (0, 12, 12)
        cache.quiesce()  # the tree has heard that the load-back landed
        s = cache.statistics()
    assert s.l2 is not None and s.l3 is not None
    assert (s.l1.requested_tokens, s.l1.hit_tokens) == (16, 0)
    assert (s.l2.requested_tokens, s.l2.hit_tokens) == (16, 0)
    assert (s.l3.requested_tokens, s.l3.hit_tokens) == (16, 12)
    assert s.l3.used_tokens is None and s.l3.used_bytes > 0 and s.l3.capacity_bytes is None
    assert s.tree.prefetch_ends.complete == 1
    assert s.prefetch.prefetch_durations.count == 1


def _scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """`{sample name: {sorted labels: value}}` of the exporter's page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text = page.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _at(samples: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, cache: str, **labels: str) -> float:
    return samples[name][tuple(sorted({"cache": cache, "rank": "0", **labels}.items()))]


def test_a_scrape_after_a_known_workload_has_each_family_and_value() -> None:
    port = start_metrics_exporter(0)
    with HiCache(_config(metrics=True, metrics_name="scraped")) as cache:
        known_workload(cache)
        s = cache.statistics()
        m = _scrape(port)
    c = "scraped"
    for tier, requested, hit in (("L1", 44, 12), ("L2", 32, 16)):
        assert _at(m, "hicache_requested_tokens_total", c, tier=tier) == requested
        assert _at(m, "hicache_hit_tokens_total", c, tier=tier) == hit
    assert _at(m, "hicache_evicted_tokens_total", c, tier="L1") == 16
    assert _at(m, "hicache_capacity_tokens", c, tier="L1") == 64
    assert _at(m, "hicache_capacity_tokens", c, tier="L2") == 256
    assert _at(m, "hicache_used_tokens", c, tier="L2") == 16
    assert _at(m, "hicache_transferred_tokens_total", c, operation="load_back") == 16
    assert _at(m, "hicache_transferred_bytes_total", c, operation="load_back") == 16 * _config().bytes_per_slot
    assert _at(m, "hicache_transferred_tokens_total", c, operation="write_through") == s.write.slots_copied > 0
    assert _at(m, "hicache_prefetches_total", c, outcome="complete") == 0
    assert _at(m, "hicache_live_requests", c) == 0
    assert _at(m, "hicache_ahead_tokens", c) == 0
    # one admit per request, each timed; the one load-back batch waited for both of its layers
    assert _at(m, "hicache_facade_call_seconds_count", c, call="admit") == 3
    assert _at(m, "hicache_facade_call_seconds_count", c, call="finish") == 3
    assert _at(m, "hicache_facade_call_seconds_bucket", c, call="admit", le="+Inf") == 3
    assert _at(m, "hicache_load_back_wait_seconds_count", c) == 2
    assert _at(m, "hicache_backup_duration_seconds_count", c) == 0
    assert not any(labels for labels in m.get("hicache_requested_tokens_total", {})
                   if dict(labels).get("tier") == "L3")  # no storage: no L3 series


def test_a_closed_cache_leaves_the_scrape() -> None:
    port = start_metrics_exporter(0)
    with HiCache(_config(metrics=True, metrics_name="closed-one")):
        pass
    m = _scrape(port)
    assert not any(dict(labels).get("cache") == "closed-one" for labels in m.get("hicache_live_requests", {}))


def test_scrapes_and_statistics_racing_a_close_never_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scrape runs on the exporter's thread whenever Prometheus asks, `statistics()` on any
    thread: while a `close()` stops the actors (slowed here to 20 ms an actor), a scrape
    leaves the cache out and `statistics()` raises `CacheStateError`, never an actor's
    death (`ActorDeadError`, a missing actor, "the system is not running") seen through."""
    stop_actor = pykka.ActorRef.stop

    def slowly(self: pykka.ActorRef[Any], *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.02)
        return stop_actor(self, *args, **kwargs)

    monkeypatch.setattr(pykka.ActorRef, "stop", slowly)
    cache = HiCache(_config(metrics=True, metrics_name="racing"))
    errors: list[BaseException] = []
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            try:
                generate_latest(REGISTRY)
            except Exception as e:  # noqa: BLE001 - the test reports it
                errors.append(e)

    def read() -> None:
        while not done.is_set():
            try:
                cache.statistics()
            except CacheStateError:
                pass
            except Exception as e:  # noqa: BLE001 - the test reports it
                errors.append(e)

    threads = [threading.Thread(target=scrape), threading.Thread(target=read)]
    try:
        for _ in range(4):
            cache.start()
            if not threads[0].is_alive():
                for t in threads:
                    t.start()
            serve(cache, Request("a", PROMPT))
            cache.close()
    finally:
        done.set()
        for t in threads:
            t.join()
    assert not errors, f"{len(errors)} failed while a close ran, the first: {errors[0]!r}"


def test_an_ask_an_actor_never_reads_ends_once_it_has_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """pykka's ask checks that the actor lives, then puts the message in its inbox; if the actor
    stops in between, nobody reads it. A `statistics()` racing `close()` waited the whole
    reply timeout for it (60 s; 2 here), then failed with a `TimeoutError`."""
    from hicache.messages import ActorName, GetStatistics

    cache = HiCache(_config()).start()
    try:
        real = cache.system.directory.ref

        class Dropped:
            """The ref of an actor that stopped between the liveness check and the put."""

            def ask(self, message: Any, block: bool = True) -> Any:
                return pykka.ThreadingFuture()

            def is_alive(self) -> bool:
                return False

        monkeypatch.setattr(cache.system.directory, "ref", lambda name: Dropped() if name is ActorName.LOAD else real(name))
        with pytest.raises(pykka.ActorDeadError, match="the load actor stopped without answering GetStatistics"):
            cache.system.ask(ActorName.LOAD, GetStatistics(), timeout_s=2.0)
        monkeypatch.undo()
    finally:
        cache.close()


def test_a_statistics_call_that_a_close_and_a_start_overtook_says_the_cache_was_closed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The actors a `statistics()` asks stop under it, and by the time it sees the error a
    `start()` has run too (another thread's restart): that is still the documented
    `CacheStateError`, not the dead actor's error seen through."""
    cache = HiCache(_config()).start()
    try:
        def overtaken() -> Any:
            cache.close()
            cache.start()
            raise pykka.ActorDeadError("DeviceAllocatorActor (urn:hicache:device) not found")

        monkeypatch.setattr(cache.system, "statistics", overtaken)
        with pytest.raises(CacheStateError, match="closed while statistics"):
            cache.statistics()
        monkeypatch.undo()
        assert cache.statistics().l1.requested_tokens == 0
    finally:
        cache.close()


def test_l2_and_l3_hits_split_from_one_record_so_a_racing_statistics_sees_both_or_neither(tmp_path: Path) -> None:
    """`statistics()` between the tree's handling of an admission with a storage hit and the
    facade's return from `admit` (another thread's scrape) counted the request's host hit as
    L2's, then took it back: L2's hit counter went down. The tree now counts the storage
    part with the host hit, both when the load-back lands."""
    config = _config(storage="file", storage_dir=str(tmp_path), prefetch_policy="wait_complete",
                     prefetch_threshold_pages=1)
    with HiCache(config) as cache:
        serve(cache, Request("a", PROMPT))
        cache.quiesce()
    with HiCache(config) as cache:
        request = Request("b", LONGER)
        assert cache.prefetch([request]) == {"b": 16}
        while not cache.ready(["b"]):
            pass
        seen = []
        admitted = cache._admitted

        def between(item: Any, adm: Any) -> Any:  # the tree has answered; admit() has not returned
            seen.append(cache.statistics())
            return admitted(item, adm)

        cache._admitted = between  # type: ignore[method-assign]
        assert serve(cache, request) == (0, 12, 12)
        cache.quiesce()
        after = cache.statistics()
    [during] = seen
    assert during.l2 is not None and during.l3 is not None and after.l2 is not None and after.l3 is not None
    assert (during.l2.hit_tokens, during.l3.hit_tokens) in ((0, 0), (0, 12))  # its load landed, or not yet
    assert (after.l2.hit_tokens, after.l3.hit_tokens) == (0, 12)


def test_a_load_back_that_fails_is_no_l2_hit() -> None:
    """The tree counted an admission's host hit (and its storage part) as served when it
    answered it, so a load-back that then failed still counted as an L2 or L3 hit, and the
    request admitted again to recompute it counted a second one: L2's hit rate stayed up
    while nothing loaded. A host hit now counts when its load-back lands."""
    with HiCache(_config(), runtime=make_runtime("threads", faults=FailFirstLoads(1))) as cache:
        serve(cache, Request("a", PROMPT))
        cache.quiesce()
        assert cache.evict_device(64) == 12
        [admitted] = cache.admit([Request("b", PROMPT)])
        assert admitted.host_hit == 12
        with pytest.raises(LoadFailedError):
            cache.start_loads().wait_all()
        cache.retract([admitted.handle])
        cache.quiesce()
        failed = cache.statistics()
        assert serve(cache, Request("b", PROMPT)) == (0, 12, 0)  # admitted again: its prefix loads back
        cache.quiesce()
        retried = cache.statistics()
    assert failed.l2 is not None and retried.l2 is not None
    assert (failed.load.ops_failed, failed.load.slots_copied) == (1, 0)
    assert (failed.l1.requested_tokens, failed.l2.requested_tokens, failed.l2.hit_tokens) == (24, 24, 0)
    assert (retried.l2.requested_tokens, retried.l2.hit_tokens) == (36, 12) and retried.load.slots_copied == 12


def test_a_load_back_of_prefetched_pages_that_fails_is_no_l3_hit(tmp_path: Path) -> None:
    """As above, for the pages a request's own storage prefetch read: they counted as L3's hit."""
    config = _config(storage="file", storage_dir=str(tmp_path), prefetch_policy="wait_complete",
                     prefetch_threshold_pages=1)
    with HiCache(config) as cache:
        serve(cache, Request("a", PROMPT))
        cache.quiesce()
    with HiCache(config, runtime=make_runtime("threads", faults=FailFirstLoads(1))) as cache:
        assert cache.prefetch([Request("b", PROMPT)]) == {"b": 12}
        while not cache.ready(["b"]):
            pass
        [admitted] = cache.admit([Request("b", PROMPT)])
        assert (admitted.host_hit, admitted.storage_hit) == (12, 12)
        with pytest.raises(LoadFailedError):
            cache.start_loads().wait_all()
        cache.retract([admitted.handle])
        cache.quiesce()
        s = cache.statistics()
    assert s.l2 is not None and s.l3 is not None and s.tree.prefetch_ends.complete == 1
    assert (s.l2.hit_tokens, s.l3.requested_tokens, s.l3.hit_tokens) == (0, 12, 0)


def test_an_exporter_address_that_does_not_resolve_names_the_host_not_the_port() -> None:
    """It said "pick another port" for a host name that resolves to nothing."""
    with pytest.raises(OSError, match=r"cannot serve metrics on no-such-host\.invalid:0: .*; check metrics_host$"):
        start_metrics_exporter(0, host="no-such-host.invalid")
    assert Config(metrics_host="::1").metrics_host == "::1"  # an IPv6 address binds without brackets


def test_prefetched_pages_the_quota_leaves_in_host_memory_are_no_storage_hit(tmp_path: Path) -> None:
    """Of a prompt's four pages, two were in host memory and a prefetch read the other two; the
    load-back quota let the admission load back the first two only (host_miss 8). The tree
    took the request's storage hit as min(prefetched, host hit) = 8: L3 was credited with the
    8 tokens L2 served, and `AdmitResult.storage_hit` said 8 of pages left in host memory."""
    prompt = PROMPT + LONGER[12:]
    config = _config(storage="file", storage_dir=str(tmp_path), prefetch_policy="wait_complete",
                     prefetch_threshold_pages=1)
    with HiCache(config) as cache:
        serve(cache, Request("a", prompt))
        cache.quiesce()  # backed up to storage
    with HiCache(config.replace(load_back_quota_tokens=8)) as cache:
        serve(cache, Request("b", prompt[:8]))
        cache.quiesce()
        assert cache.evict_device(64) == 8  # the first two pages: in host memory only
        assert cache.prefetch([Request("c", prompt)]) == {"c": 8}
        while not cache.ready(["c"]):
            pass
        [admitted] = cache.admit([Request("c", prompt)])
        assert (admitted.device_hit, admitted.host_hit, admitted.host_miss) == (0, 8, 8)
        storage_hit = admitted.storage_hit
        cache.start_loads().wait_all()
        cache.finish([admitted.handle])
        cache.quiesce()
        s = cache.statistics()
    assert storage_hit == 0 and s.l2 is not None and s.l3 is not None
    assert (s.l2.requested_tokens, s.l2.hit_tokens, s.l3.requested_tokens, s.l3.hit_tokens) == (24, 8, 16, 0)


DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def _documented_families() -> dict[str, tuple[str, str, set[str]]]:
    """docs/metrics.md's family table: `{name as scraped: (type, extra label, its values listed)}`."""
    families = {}
    for row in DOCS.read_text().splitlines():
        if row.startswith("| `hicache_"):
            name, kind, labels = (cell.strip() for cell in row.strip("|").split("|")[:3])
            label, _, listed = labels.partition(":")
            families[name.strip("`")] = (kind, label.split()[0].strip("`,") if label != "-" else "",
                                         set(re.findall(r"`(\w+)`", listed)))
    return families


def _scraped_families(port: int, cache: str) -> dict[str, tuple[str, str, set[str]]]:
    """The scrape's hicache families of `cache`, as `_documented_families` gives them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text = page.read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        labels = [{k: v for k, v in sample.labels.items() if k not in ("cache", "rank", "le")}
                  for sample in family.samples if sample.labels.get("cache") == cache]
        if family.name.startswith("hicache_") and labels:
            extra = {k for one in labels for k in one}
            assert len(extra) <= 1, (family.name, extra)
            label = extra.pop() if extra else ""
            name = family.name + ("_total" if family.type == "counter" else "")
            families[name] = (family.type, label, {one[label] for one in labels} if label else set())
    return families


def test_every_documented_family_is_scraped_with_its_type_and_labels(tmp_path: Path) -> None:
    """The scrape had no family for the storage backend's OS or client errors (`io_errors`),
    the only count of a failed lookup, which reads as a miss."""
    port = start_metrics_exporter(0)
    config = _config(storage="file", storage_dir=str(tmp_path), metrics=True, metrics_name="documented")
    with HiCache(config) as cache:
        known_workload(cache)
        scraped = _scraped_families(port, "documented")
    documented = _documented_families()
    assert len(documented) == 21
    assert scraped.keys() == documented.keys()
    for name, (kind, label, values) in documented.items():
        assert scraped[name][:2] == (kind, label), name
        if values:
            assert scraped[name][2] == values, name


def test_a_lookup_storage_cannot_make_is_a_miss_counted_as_an_io_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend error in a prefetch's lookup (a directory that cannot be listed; Mooncake's
    `batch_is_exist` failing) ends the prefetch as a miss, not in `errors` (nor in
    `hicache_transfer_failures_total{operation="storage"}`): only `io_errors` counts it, and
    no family exported that."""
    port = start_metrics_exporter(0)
    root, scandir = str(tmp_path), os.scandir

    def refused(path: Any = ".") -> Any:
        if str(path) == root:
            raise PermissionError(13, "Permission denied", root)
        return scandir(path)

    config = _config(storage="file", storage_dir=root, prefetch_threshold_pages=1, metrics=True,
                     metrics_name="unlisted")
    with HiCache(config) as cache:
        monkeypatch.setattr(os, "scandir", refused)
        assert cache.prefetch([Request("a", PROMPT)]) == {"a": 12}
        while not cache.ready(["a"]):
            pass
        monkeypatch.undo()
        cache.quiesce()
        s = cache.statistics()
        m = _scrape(port)
    assert s.tree.prefetch_ends.miss == 1 and (s.prefetch.errors, s.prefetch.io_errors) == (0, 1)
    assert _at(m, "hicache_transfer_failures_total", "unlisted", operation="storage") == 0
    assert _at(m, "hicache_storage_io_errors_total", "unlisted") == 1


def test_the_config_port_starts_the_exporter() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with HiCache(_config(metrics=True, metrics_port=port, metrics_name="by-port")) as cache:
        serve(cache, Request("a", PROMPT))
        m = _scrape(port)
    assert _at(m, "hicache_requested_tokens_total", "by-port", tier="L1") == 12


def test_two_exporting_instances_need_distinct_names() -> None:
    with HiCache(_config(metrics=True, metrics_name="twin")):
        second = HiCache(_config(metrics=True, metrics_name="twin"))
        with pytest.raises(CacheStateError, match="exports metrics as cache='twin' rank=0"):
            second.start()
        assert not second.system.started
        with HiCache(_config(metrics=True, metrics_name="twin-2")):
            pass


def test_without_metrics_the_calls_are_the_class_own() -> None:
    with HiCache(_config()) as cache:
        assert not set(TIMED_CALLS) & set(vars(cache))
    with HiCache(_config(metrics=True, metrics_name="timed")) as cache:
        assert set(TIMED_CALLS) <= set(vars(cache))


def test_metrics_port_without_metrics_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="metrics_port=9400 needs metrics=true"):
        _config(metrics_port=9400)
    with pytest.raises(ConfigError, match="metrics_name"):
        _config(metrics_name="has space")


def test_a_histogram_puts_a_duration_on_a_bound_in_that_bucket() -> None:
    h = DurationHistogram()
    for seconds in (0.0, DURATION_BOUNDS_S[0], DURATION_BOUNDS_S[0] * 1.01, 1e9):
        h.observe(seconds)
    d = h.snapshot()
    assert d.bucket_counts[:2] == (2, 1) and d.bucket_counts[-1] == 1 and d.count == 4
    with pytest.raises(ValueError, match="a duration must be >= 0 seconds"):
        h.observe(-1.0)
