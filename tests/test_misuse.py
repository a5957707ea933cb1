"""Misuse of the facade as a new user commits it: malformed arguments, a call from a second
thread, a call cut short, start after close. Each is one clear error (or, for a call cut
short, a late reply undone or adopted), nothing reaches an actor malformed, and the next
call works with nothing leaked.
"""

from __future__ import annotations

import _thread
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

from hicache.actors import FileBackend
from hicache.messages import ActorName, ConfigError, SlotDemand
from hicache.runtime import (
    CacheHandle,
    CacheStateError,
    Config,
    HiCache,
    Insufficient,
    KVArgumentError,
    LoadFailedError,
    Request,
    RequestError,
    ThreadedRuntime,
)
from hicache.runtime.testing import DeterministicRuntime

from conftest import FailFirstLoads, make_runtime


def seq(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture
def cache(runtime_kind: str, make_config: Callable[..., Config]) -> Iterator[HiCache]:
    with HiCache(make_config(), runtime=make_runtime(runtime_kind)) as hc:
        yield hc
        hc.check_invariants()


def _quiet(hc: HiCache) -> None:
    """Nothing live, nothing locked: every device slot is free or the tree's."""
    hc.quiesce()
    hc.check_invariants()
    s = hc.statistics()
    assert s.tree.live_handles == 0 and s.tree.protected_tokens == 0
    assert s.device.request_slots == 0 and s.device.live_requests == 0


# -- malformed arguments ------------------------------------------------------------------------

BAD_REQUESTS = [
    (Request("a", seq(8), namespace=None), r"namespace must be a str"),  # type: ignore[arg-type]
    (Request("a", seq(8), namespace=b"x"), r"namespace must be a str"),  # type: ignore[arg-type]
    (Request("a", seq(8), namespace=123), r"namespace must be a str"),  # type: ignore[arg-type]
    # A lone surrogate (a surrogateescape decode's) is no UTF-8: as a namespace it killed the tree.
    (Request("a", seq(8), namespace="ns\udfff"), r"namespace must be text UTF-8 can encode"),
    (Request("b\udfff", seq(8)), r"request_id must be text UTF-8 can encode"),
    (Request(None, seq(8)), r"request_id must be a non-empty str"),  # type: ignore[arg-type]
    (Request("", seq(8)), r"request_id must be a non-empty str"),
    (Request("a", [1, 2, 10.7]), r"must be int token ids, got 10\.7 \(float\)"),
    (Request("a", [1, True, 3]), r"must be int token ids, got True \(bool\)"),
    (Request("a", [1, "x"]), r"must be int token ids, got 'x' \(str\)"),
    (Request("a", [1, None]), r"must be int token ids, got None \(NoneType\)"),
    (Request("a", [1, 2**63]), r"token ids must be ints in 0\.\.9223372036854775807"),
    (Request("a", [1, -5]), r"token ids must be in 0\.\.9223372036854775807, got -5"),
    (Request("a", torch.tensor([1.5, 2.0])), r"integer token ids, got a torch\.float32 tensor"),
    (Request("a", torch.tensor([True, False])), r"integer token ids, got a torch\.bool tensor"),
    (Request("a", torch.tensor([[1, 2]])), r"one sequence of token ids, got a tensor of shape \(1, 2\)"),
    (Request("a", torch.tensor([3, -1])), r"token ids must be in 0\.\.\d+, got -1"),
    (Request("a", torch.tensor([3, -7], dtype=torch.int32)), r"token ids must be in 0\.\.\d+, got -7"),
    (Request("a", torch.tensor([5, 1, -2, 4])[::2]), r"token ids must be in 0\.\.\d+, got -2"),
    (Request("a", "abc"),  # type: ignore[arg-type]
     r"must be a 1-D integer tensor or numpy array, or a sequence of ints, got str"),
    (Request("a", 17),  # type: ignore[arg-type]
     r"must be a 1-D integer tensor or numpy array, or a sequence of ints, got int"),
]


@pytest.mark.parametrize(("request_", "error"), BAD_REQUESTS, ids=lambda x: repr(x)[:40] if isinstance(x, Request) else "")
def test_a_malformed_request_is_one_request_error_and_reaches_no_actor(
    cache: HiCache, request_: Request, error: str
) -> None:
    before = cache.statistics().tree
    with pytest.raises(RequestError, match=error):
        cache.admit([request_])
    with pytest.raises(RequestError, match=error):
        cache.prefetch([request_])
    assert cache.statistics().tree == before
    [ok] = cache.admit([Request("a", seq(8))])  # the next call works, under the same id
    cache.finish([ok.handle])
    _quiet(cache)


@pytest.mark.parametrize(("call", "error"), [
    (lambda hc: hc.evict_device("x"), r"tokens must be an int, got 'x'"),
    (lambda hc: hc.evict_device(-1), r"tokens must be in 0\.\.\d+, got -1"),
    (lambda hc: hc.evict_host(None), r"tokens must be an int, got None"),
    (lambda hc: hc.evict_host(True), r"tokens must be an int, got True"),
    (lambda hc: hc.evict_host(10**30), r"tokens must be in 0\.\.\d+, got 10{30}"),
    (lambda hc: hc.allocate({"live": True}), r"demands\['live'\] must be an int, got True"),
    (lambda hc: hc.allocate({"live": 10**30}), r"demands\['live'\] must be in 0\.\.\d+, got 10{30}"),
    (lambda hc: hc.allocate({"live": 2.0}), r"demands\['live'\] must be an int, got 2\.0"),
    (lambda hc: hc.allocate({7: 1}), r"a request id in demands must be a non-empty str, got 7"),
    (lambda hc: hc.allocate([("live", 1)]), r"demands must be a mapping of request id to count, got list"),
    (lambda hc: hc.commit({"live": [1.5]}), r"tokens committed for request 'live' must be int token ids"),
    (lambda hc: hc.commit([1, 2]), r"commit must map request ids to tokens, got list"),
    (lambda hc: hc.finish(["live"]), r"expected a CacheHandle from admit\(\) or cache_unfinished\(\), got 'live'"),
    (lambda hc: hc.finish([CacheHandle(["x"], 1)]), r"request_id must be a non-empty str, got \['x'\]"),  # type: ignore[arg-type]
    (lambda hc: hc.finish("live"), r"requests must be a list, got str"),
    (lambda hc: hc.ready(None), r"request_ids must be a list, got NoneType"),
    (lambda hc: hc.ready([3]), r"request_id must be a non-empty str, got 3"),
    (lambda hc: hc.admit(None), r"requests must be a list, got NoneType"),
    (lambda hc: hc.admit([("a", [1])]), r"expected a Request, got \('a', \[1\]\)"),
    (lambda hc: hc.slots(None), r"request_id must be a non-empty str, got None"),
    # arrays and tensors have `__index__`, which takes one integer element only
    (lambda hc: hc.evict_device(numpy.array([1.0])), r"tokens must be an int, got array\(\[1\.\]\)"),
    (lambda hc: hc.evict_host(torch.tensor([1.5])), r"tokens must be an int, got tensor\(\[1\.5000\]\)"),
    (lambda hc: hc.allocate({"live": numpy.array([[1], [2]])}), r"demands\['live'\] must be an int, got array\(\[\[1\], \[2\]\]\)$"),
    (lambda hc: hc.allocate({"live": torch.tensor([[1, 2], [3, 4]])}), r"must be an int, got tensor\(\[\[1, 2\], \[3, 4\]\]\)$"),
    (lambda hc: hc.allocate({"live": torch.tensor([3])}), r"demands\['live'\] must be an int, got tensor\(\[3\]\)$"),
    (lambda hc: hc.evict_device(numpy.array([2])), r"tokens must be an int, got array\(\[2\]\)$"),
    (lambda hc: hc.allocate({"live": 1}, commit=torch.tensor([[1, 2]])), r"commit must map request ids to tokens, got Tensor"),
    (lambda hc: hc.allocate({"live": 1}, flat=numpy.array([[1], [2]])), r"flat must be True or False, got array\(\[\[1\], \[2\]\]\)$"),
    (lambda hc: hc.admit([numpy.array([[1], [2]])]), r"expected a Request, got array\(\[\[1\], \[2\]\]\)$"),
    (lambda hc: hc.admit([Request(numpy.array([[1], [2]]), [1])]), r"request_id must be a non-empty str, got array\("),
    (lambda hc: hc.admit([Request("b", [1, numpy.array([[1], [2]])])]), r"must be int token ids, got array\(\[\[1\], \[2\]\]\) \(ndarray\)$"),
    (lambda hc: hc.quiesce("1"), r"timeout_s must be a number of seconds above 0 and at most 86400, got '1'"),
    (lambda hc: hc.quiesce(0), r"timeout_s must be a number of seconds above 0 and at most 86400, got 0"),
    (lambda hc: hc.quiesce(float("nan")), r"timeout_s must be a number of seconds above 0 and at most 86400, got nan"),
    (lambda hc: hc.quiesce(10**400), r"timeout_s must be a number of seconds above 0 and at most 86400, got 1000"),
    (lambda hc: hc.close(timeout_s=[1]), r"timeout_s must be a number of seconds above 0 and at most 86400, got \[1\]"),
    (lambda hc: hc.close(drain=1), r"drain must be True or False, got 1"),
    (lambda hc: hc.kv.index(torch.tensor([0, 1]), distinct=torch.tensor([0, 0])),
     r"distinct must be True or False, got tensor\(\[0, 0\]\)$"),
    (lambda hc: hc.kv.k(torch.tensor([[0], [1]])), r"layer must be an int in 0\.\.\d+, got tensor\(\[\[0\], \[1\]\]\)$"),
])
def test_a_malformed_argument_is_one_request_error_and_the_cache_keeps_working(
    cache: HiCache, call: Callable[[HiCache], Any], error: str
) -> None:
    [live] = cache.admit([Request("live", seq(8))])
    before = cache.statistics()
    with pytest.raises((RequestError, KVArgumentError), match=error) as caught:
        call(cache)
    assert "\n" not in str(caught.value)
    after = cache.statistics()
    assert (after.tree, after.device, after.host) == (before.tree, before.device, before.host)
    got = cache.allocate({"live": 4})
    assert isinstance(got, dict) and len(got["live"]) == 4
    cache.commit({"live": seq(4, 9)})
    cache.finish([live.handle])
    _quiet(cache)


def test_ending_a_finished_request_by_its_id_says_it_is_finished(cache: HiCache) -> None:
    [a] = cache.admit([Request("a", seq(8))])
    cache.allocate({"a": 8})
    cache.commit({"a": seq(8)})
    cache.finish([a.handle])
    for end in (cache.abort, cache.retract):
        with pytest.raises(RequestError, match=r"^request 'a' already finished: nothing is left to end$"):
            end(["a"])
    _quiet(cache)


def _host_hit(hc: HiCache, rid: str, tokens: list[int]) -> Any:
    """Admit `tokens` after a first request computed them and device memory let them go: a host hit."""
    [a] = hc.admit([Request(rid + "-first", tokens)])
    hc.allocate({rid + "-first": len(tokens)})
    hc.commit({rid + "-first": tokens})
    hc.finish([a.handle])
    hc.quiesce()
    hc.evict_device(hc.config.device_slots)
    [b] = hc.admit([Request(rid, tokens)])
    assert b.host_hit == len(tokens) and b.device_hit == 0
    return b


def test_a_commit_over_a_host_hit_whose_load_back_was_never_started_is_refused(cache: HiCache) -> None:
    """The forward pass of a request whose load-back was not started read device slots the load
    has not filled: its KV is wrong, and committing it would cache it. Refused, naming the fix."""
    b = _host_hit(cache, "b", seq(8))
    cache.allocate({"b": 1})
    for call in (lambda: cache.commit({"b": [9]}), lambda: cache.allocate({"b": 1}, commit={"b": [9]})):
        with pytest.raises(RequestError, match=r"^request 'b' was admitted with 8 tokens to load back from host "
                                               r"memory \(host_hit\), but start_loads\(\) was not called since: .*"
                                               r"retract this request and admit it again$"):
            call()
    assert cache.committed_tokens("b") == seq(8) and cache.allocated("b") == 9   # the refused calls changed nothing
    cache.retract([b.handle])
    [b] = cache.admit([Request("b", seq(8))])          # admitted again, the load started this time
    assert b.host_hit == 8
    cache.start_loads().wait_all()
    cache.allocate({"b": 1}, commit={})
    cache.commit({"b": [9]})
    cache.finish([b.handle])
    [c] = cache.admit([Request("c", seq(8))])           # a device hit loads nothing
    cache.allocate({"c": 1})
    cache.commit({"c": [9]})
    cache.finish([c.handle])
    _quiet(cache)


def test_a_commit_over_a_host_hit_whose_load_back_failed_is_refused(runtime_kind: str,
                                                                    make_config: Callable[..., Config]) -> None:
    """An engine that went on after `LoadFailedError` computed its KV over a prefix the load never
    filled (its pages may already be another request's), and committing it cached that KV as
    this prompt's. Refused, naming the fix; the request retracted and admitted again is served."""
    with HiCache(make_config(), runtime=make_runtime(runtime_kind, faults=FailFirstLoads())) as hc:
        b = _host_hit(hc, "b", seq(8))
        waiter = hc.start_loads()
        with pytest.raises(LoadFailedError):
            waiter.wait_all()
        hc.allocate({"b": 1})
        for call in (lambda: hc.commit({"b": [9]}), lambda: hc.allocate({"b": 1}, commit={"b": [9]})):
            with pytest.raises(RequestError, match=(
                    rf"^request 'b': the load-back of its 8 tokens from host memory failed \(load batch "
                    rf"{waiter.batch}: injected: a load-back fails\), so KV computed over them is wrong; retract "
                    r"this request and admit it again$")):
                call()
        assert hc.committed_tokens("b") == seq(8) and hc.allocated("b") == 9  # the refused calls changed nothing
        hc.retract([b.handle])
        [b] = hc.admit([Request("b", seq(8))])
        hc.start_loads().wait_all()
        hc.allocate({"b": 1}, commit={})
        hc.commit({"b": [9]})
        hc.finish([b.handle])
        _quiet(hc)


def test_quiesce_starts_and_waits_for_the_load_backs_so_a_commit_after_it_is_taken(cache: HiCache) -> None:
    b = _host_hit(cache, "b", seq(8))
    cache.quiesce()
    cache.allocate({"b": 1})
    cache.commit({"b": [9]})
    cache.finish([b.handle])
    _quiet(cache)


def test_indexing_an_insufficient_allocation_says_it_did_not_fit_and_what_to_do(cache: HiCache) -> None:
    [a] = cache.admit([Request("a", seq(8))])
    got = cache.allocate({"a": cache.config.device_slots + 4})
    assert isinstance(got, Insufficient) and got.shortfall_slots > 0
    with pytest.raises(TypeError, match=r"^allocate\(\) did not fit: \d+ slots asked, \d+ free after eviction; "
                                        r"nothing was allocated\. Check isinstance\(result, Insufficient\)"):
        got["a"]
    flat = cache.allocate({"a": cache.config.device_slots + 4}, flat=True)
    with pytest.raises(AttributeError, match=r"^allocate\(\) did not fit: .* \(Insufficient has no 'split'\)$"):
        flat.split([1])
    assert not hasattr(flat, "split") and getattr(flat, "_absent", None) is None
    cache.abort([a.handle])
    _quiet(cache)


def test_ending_an_admitted_request_by_its_id_says_to_pass_its_handle(cache: HiCache) -> None:
    [a] = cache.admit([Request("a", seq(8))])
    for end in (cache.abort, cache.retract):
        with pytest.raises(RequestError, match=r"^request 'a' is admitted: pass its CacheHandle \(from admit\(\) or "
                                               r"cache_unfinished\(\), or handle\('a'\)\), not its id$"):
            end(["a"])
    cache.abort([cache.handle("a")])
    _quiet(cache)


def test_a_count_may_be_a_numpy_or_torch_integer_scalar(cache: HiCache) -> None:
    """What an engine's own arithmetic gives (a 0-d tensor, a numpy integer) counts as an int;
    only an array or a tensor with a dimension is refused (the table above)."""
    [live] = cache.admit([Request("live", seq(8))])
    got = cache.allocate({"live": torch.tensor(3)})
    assert isinstance(got, dict) and len(got["live"]) == 3
    got = cache.allocate({"live": numpy.int64(2)})
    assert isinstance(got, dict) and len(got["live"]) == 2
    cache.commit({"live": seq(5, 9)})
    cache.finish([live.handle])
    _quiet(cache)


def test_with_a_delivery_log_a_huge_count_is_refused_at_the_facade_and_the_log_replays(
    make_config: Callable[..., Config], tmp_path: Path
) -> None:
    from hicache.runtime import read_log
    from hicache.runtime.testing import replay_log

    log = tmp_path / "misuse.log"
    with HiCache(make_config(log_path=str(log))) as hc:
        [a] = hc.admit([Request("a", seq(8))])
        with pytest.raises(RequestError, match=r"must be in 0\.\.\d+, got 10{30}"):
            hc.evict_host(10**30)
        with pytest.raises(RequestError, match=r"must be in 0\.\.\d+, got 10{30}"):
            hc.allocate({"a": 10**30})
        hc.allocate({"a": 4})
        hc.commit({"a": seq(4, 9)})
        hc.finish([a.handle])
        hc.quiesce()
    assert replay_log(read_log(log)).divergence is None


# -- lifecycle and threads -------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"config": "small"}, r"config must be a Config \(None: the defaults\), got 'small'; build one with Config"),
    ({"config": {"layers": 2}}, r"config must be a Config .*, got \{'layers': 2\}"),
    ({"runtime": "threads"}, r"runtime must be a ThreadedRuntime or a DeterministicRuntime, got 'threads'"),
    ({"group": 2}, r"group must be a Group \(rank, size, all_min: SingleGroup, TorchGroup\), got 2"),
    ({"reply_timeout_s": "60"}, r"reply_timeout_s must be a number of seconds above 0 and at most 86400, got '60'"),
    ({"reply_timeout_s": 0}, r"reply_timeout_s must be a number of seconds above 0 and at most 86400, got 0"),
])
def test_a_malformed_constructor_argument_is_one_request_error(make_config: Callable[..., Config],
                                                               kwargs: dict[str, Any], error: str) -> None:
    kwargs = {"config": make_config(), **kwargs}
    with pytest.raises(RequestError, match=error) as caught:
        HiCache(**kwargs)
    assert "\n" not in str(caught.value)


def test_actor_classes_keyed_by_a_name_that_is_not_an_actor_name_are_refused(make_config: Callable[..., Config]) -> None:
    """A key "tree" (a str, not `ActorName.TREE`) would have been ignored: the real actor ran."""
    with pytest.raises(TypeError, match=r"actor_classes maps an ActorName to an actor class, got 'tree'"):
        HiCache(make_config(), actor_classes={"tree": object})  # type: ignore[dict-item]


def test_calls_before_start_and_after_close_are_one_clear_error(make_config: Callable[..., Config]) -> None:
    hc = HiCache(make_config())
    with pytest.raises(CacheStateError, match=r"not running: call start\(\)"):
        hc.admit([Request("a", seq(8))])
    with pytest.raises(CacheStateError, match=r"not running: call start\(\)"):
        hc.room()
    hc.start()
    hc.close()
    with pytest.raises(CacheStateError, match=r"not running: call start\(\)"):
        hc.admit([Request("a", seq(8))])
    with pytest.raises(CacheStateError, match=r"not running: call start\(\)"):
        hc.room()
    with pytest.raises(CacheStateError, match=r"not running"):
        hc.statistics()


def test_start_after_close_starts_a_fresh_cache_and_leaves_no_thread(make_config: Callable[..., Config]) -> None:
    before = set(threading.enumerate())
    hc = HiCache(make_config())
    for round_ in range(3):
        hc.start()
        [a] = hc.admit([Request("a", seq(8))])
        assert a.cached_tokens == 0, "a restart is an empty cache"
        hc.allocate({"a": 8})
        hc.commit({"a": seq(8)})
        hc.finish([a.handle])
        closed = hc.close()
        assert closed.drained and (closed.writes_dropped, closed.backups_dropped) == (0, 0)
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not (set(threading.enumerate()) - before), "a thread outlived close()"
    with pytest.raises(CacheStateError, match="already started"):
        hc.start()
        hc.start()
    hc.close()


def test_a_call_from_a_second_thread_is_a_clear_error_at_once(make_config: Callable[..., Config]) -> None:
    cache = HiCache(make_config()).start()
    errors: list[BaseException] = []

    def other() -> None:
        for call in (lambda: cache.admit([Request("b", seq(8))]), cache.room):
            try:
                call()
            except BaseException as err:  # noqa: BLE001 - the test reports it below
                errors.append(err)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 2 and all(isinstance(e, CacheStateError) for e in errors)
    assert all("called by one thread, the one that started it" in str(e) for e in errors)
    stats = [None]
    reader = threading.Thread(target=lambda: stats.__setitem__(0, cache.statistics()))
    reader.start()
    reader.join()
    assert stats[0] is not None, "statistics() may be called from any thread"
    _quiet(cache)
    cache.close()


def test_a_failed_start_leaves_an_existing_log_as_it_was_and_no_thread(
    make_config: Callable[..., Config], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "kept.log"
    log.write_text("an earlier run's log\n")
    before = set(threading.enumerate())

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no storage here")

    monkeypatch.setattr("hicache.runtime._system.open_backend", broken)
    hc = HiCache(make_config(log_path=str(log), storage="file", storage_dir=str(tmp_path / "l3")))
    with pytest.raises(RuntimeError, match="no storage here"):
        hc.start()
    assert log.read_text() == "an earlier run's log\n"
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not (set(threading.enumerate()) - before)


@pytest.mark.parametrize("where", ["a folder", "in a missing folder", "under a file"])
def test_a_log_path_that_cannot_be_written_is_one_config_error_at_start_and_no_thread(
    make_config: Callable[..., Config], tmp_path: Path, where: str
) -> None:
    (tmp_path / "a-file").write_text("")
    path = {"a folder": tmp_path, "in a missing folder": tmp_path / "no" / "x.log",
            "under a file": tmp_path / "a-file" / "x.log"}[where]
    before = set(threading.enumerate())
    hc = HiCache(make_config(log_path=str(path)))
    with pytest.raises(ConfigError, match=r"^log_path='.*' cannot be written \(.+\): give a file in a folder") as caught:
        hc.start()
    assert "\n" not in str(caught.value)
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not (set(threading.enumerate()) - before), "a start that failed left actor threads running"
    with HiCache(make_config(log_path=str(tmp_path / "x.log"))) as ok:  # a good path starts
        ok.check_invariants()


def test_a_quiesce_that_times_out_says_what_is_in_flight_and_the_cache_goes_on(
    make_config: Callable[..., Config], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = FileBackend.write

    def slowly(self: FileBackend, *args: Any) -> Any:  # a backup to storage takes 0.5 s
        time.sleep(0.5)
        return write(self, *args)

    monkeypatch.setattr(FileBackend, "write", slowly)
    with HiCache(make_config(storage="file", storage_dir=str(tmp_path / "l3"))) as hc:
        [a] = hc.admit([Request("a", seq(8))])
        hc.allocate({"a": 9})
        hc.commit({"a": seq(9)})
        hc.finish([a.handle])  # written through to host memory at once (CPU), then backed up
        with pytest.raises(TimeoutError, match=r"^still in flight after 0\.01 s: \d+ write-throughs, \d+ load-backs, "
                                                r"1 backups and \d+ prefetches; wait longer \(timeout_s\) or "
                                                r"close\(drain=False\) to drop them$"):
            hc.quiesce(0.01)
        hc.quiesce()
        hc.check_invariants()
        assert hc.statistics().tree.backups_in_flight == 0
        _quiet(hc)


def test_an_actor_stuck_past_the_stop_timeout_is_left_behind_and_the_cache_starts_again(
    make_config: Callable[..., Config], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A backup to storage that hangs (a file system that stopped answering, say) holds the
    # prefetcher in its handler past the wait for it to stop. Before, close() raised pykka's
    # Timeout: the actors after it were not stopped, the log stayed open and locked, and a new
    # cache on the same log path refused to start.
    from hicache.runtime import _system
    from hicache.runtime._calls import _GATE

    monkeypatch.setattr(_system, "DEFAULT_ASK_TIMEOUT_S", 0.5)
    monkeypatch.setattr(_system, "THREAD_JOIN_TIMEOUT_S", 0.2)
    hung, entered = threading.Event(), threading.Event()
    write = FileBackend.write

    def hanging(self: FileBackend, *args: Any) -> Any:
        entered.set()
        hung.wait(30)
        return write(self, *args)

    monkeypatch.setattr(FileBackend, "write", hanging)
    config = make_config(storage="file", storage_dir=str(tmp_path / "l3"), log_path=str(tmp_path / "run.log"))
    users = _GATE.users
    hc = HiCache(config).start()
    try:
        [a] = hc.admit([Request("a", seq(8))])
        hc.allocate({"a": 9})
        hc.commit({"a": seq(9)})
        hc.finish([a.handle])
        assert entered.wait(10)
        closed = hc.close(drain=False)
        assert closed.actors_left == ("prefetch",) and not closed.drained
        assert not hc.system.started and _GATE.users == users
        monkeypatch.setattr(FileBackend, "write", write)
        with HiCache(config) as again:  # the same log path: the first log was closed
            [b] = again.admit([Request("b", seq(8))])
            again.allocate({"b": 9})
            again.commit({"b": seq(9)})
            again.finish([b.handle])
            _quiet(again)
    finally:
        hung.set()


def test_close_drains_backups_in_flight_so_a_next_instance_finds_every_page(
    make_config: Callable[..., Config], tmp_path: Path
) -> None:
    config = make_config(device_pages=64, host_pages=256, storage="file", storage_dir=str(tmp_path),
                         prefetch_threshold_pages=1, prefetch_policy="wait_complete")
    prompts = [seq(40, 1000 * i) for i in range(1, 6)]
    with HiCache(config) as hc:
        for i, prompt in enumerate(prompts):
            [a] = hc.admit([Request(f"r{i}", prompt)])
            hc.allocate({f"r{i}": len(prompt)})
            hc.commit({f"r{i}": prompt})
            hc.finish([a.handle])
        closed = hc.close()  # no quiesce: close drains
    assert closed.drained and closed.backups_dropped == 0
    with HiCache(config) as hc:
        for i, prompt in enumerate(prompts):
            assert hc.prefetch([Request(f"q{i}", prompt)]) == {f"q{i}": 40}
        got = {}
        deadline = time.monotonic() + 30
        while len(got) < len(prompts) and time.monotonic() < deadline:
            got.update(hc.ready([f"q{i}" for i in range(len(prompts)) if f"q{i}" not in got]))
        assert got == {f"q{i}": 40 for i in range(len(prompts))}


# -- calls cut short ---------------------------------------------------------------------------


def _a_cache_whose_writes_wait(make_config: Callable[..., Config],
                               sent: list[Any] | None = None) -> tuple[HiCache, threading.Event]:
    """8 device pages of 4 slots whose write stream (on its own thread) holds every write
    until the gate is set; `sent` collects the facade's `AllocateSlots`."""
    gate = threading.Event()

    def observe(receiver: ActorName, mail: Any) -> None:
        if sent is not None and mail.sender is ActorName.FACADE and type(mail.message).__name__ == "AllocateSlots":
            sent.append(mail.message)
        if receiver is ActorName.WRITE and type(mail.message).__name__ == "DrainWrites":
            gate.wait(10)

    config = make_config(page_size=4, device_pages=8, host_pages=32)
    return HiCache(config, runtime=ThreadedRuntime(observe=observe, write_stream_thread=True),
                   reply_timeout_s=0.3), gate


def _lock_a_node_by_its_write(hc: HiCache) -> None:
    """Request "a" of 24 tokens (6 of the 8 pages) finishes: its write-through is held at the
    gate, so its node stays locked and an eviction must wait for it."""
    [a] = hc.admit([Request("a", seq(24))])
    hc.allocate({"a": 24})
    hc.commit({"a": seq(24)})
    hc.finish([a.handle])


def test_a_call_whose_wait_times_out_has_its_late_reply_adopted_and_the_next_call_works(
    make_config: Callable[..., Config],
) -> None:
    """An allocation that must wait for a write in flight on the write stream's own thread (its node is locked by the write)
    times out; the write then lands, the device's retry allocates, and the next call adopts
    that late grant: the slots join the request, nothing leaks."""
    hc, gate = _a_cache_whose_writes_wait(make_config)
    with hc:
        _lock_a_node_by_its_write(hc)
        [b] = hc.admit([Request("b", seq(24, 500))])
        with pytest.raises(TimeoutError, match=r"no reply to op \d+ within 0\.3s"):
            hc.allocate({"b": 24})  # needs the locked node's pages: the eviction waits for the write
        assert hc.allocated("b") == 0  # nothing granted yet: the device waits for the eviction
        gate.set()
        hc.quiesce()  # a call: it adopts the late grant first
        assert hc.allocated("b") == 24
        assert len(hc.slots("b").unique()) == 24
        hc.commit({"b": seq(24, 500)})
        hc.finish([b.handle])
        _quiet(hc)


def test_while_a_given_up_allocation_is_in_flight_a_slot_in_the_last_page_is_asked_of_the_device(
    make_config: Callable[..., Config],
) -> None:
    """A request's allocation that needs a page times out (the eviction waits for a write);
    its next demand fits in its last page but is sent to the device all the same: served by
    the facade alone, it could take a slot that the late grant, computed by the device without
    it, counts as the grant's. The device answers it at once and the late grant after it, in
    the order the facade applies them, so both ledgers agree."""
    sent: list[Any] = []
    hc, gate = _a_cache_whose_writes_wait(make_config, sent)
    with hc:
        _lock_a_node_by_its_write(hc)
        [b] = hc.admit([Request("b", seq(5, 500))])
        assert isinstance(hc.allocate({"b": 5}), dict)  # the last two free pages: 3 slots left in the second
        with pytest.raises(TimeoutError, match=r"no reply to op \d+ within 0\.3s"):
            hc.allocate({"b": 4})  # a page more: the eviction waits for the write
        sent.clear()
        got = hc.allocate({"b": 1})
        assert isinstance(got, dict) and got["b"].tolist() == hc.slots("b").tolist()[5:6]
        assert [m.demands for m in sent] == [(SlotDemand(request_id="b", tokens=1),)]
        gate.set()
        hc.quiesce()  # a call: it adopts the late grant, which joins the request after the slot above
        assert hc.allocated("b") == 10 and len(hc.slots("b").unique()) == 10
        hc.commit({"b": seq(10, 500)})
        [entry] = hc.finish([b.handle])
        assert (entry.allocated, entry.committed, entry.freed) == (10, 10, 10)
        _quiet(hc)


def test_ctrl_c_during_a_call_lands_where_the_call_may_give_up_and_leaks_nothing(
    make_config: Callable[..., Config], request: pytest.FixtureRequest,
) -> None:
    """SIGINT at random moments of a workload: each lands as KeyboardInterrupt at a point
    where the facade can give up (never inside an actor's handler), an interrupted admission
    is taken back, and at the end every slot and lock is accounted for."""
    from hicache.runtime._calls import _GATE

    assert threading.current_thread() is threading.main_thread()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # a background job: Python's handler, as in a terminal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        request.addfinalizer(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _GATE._handle)
    config = make_config(device_pages=32, host_pages=128)
    interrupts = 0
    rng = __import__("random").Random(5)
    with HiCache(config) as hc:
        for i in range(150):
            timer = threading.Timer(rng.random() * 0.002, _thread.interrupt_main)
            rid = f"r{i}"
            try:
                timer.start()
                try:
                    [a] = hc.admit([Request(rid, seq(4 * (1 + i % 5), 100 * (i % 7)))])
                    hc.allocate({rid: 4})
                    hc.commit({rid: seq(4, 9000 + i)})
                    hc.finish([a.handle])
                finally:
                    timer.join()  # past this, the interrupt has landed (here, at the latest) or never comes
            except KeyboardInterrupt:
                interrupts += 1
            for live in hc.live_requests:  # the scheduler cleans up what it lost track of
                hc.retract([hc.handle(live)])
            hc.check_invariants()
        _quiet(hc)
    assert interrupts > 0


def _serve(hc: HiCache, rid: str, tokens: list[int]) -> None:
    """A request computes and caches `tokens` and finishes."""
    [adm] = hc.admit([Request(rid, tokens)])
    hc.allocate({rid: len(tokens)})
    hc.commit({rid: tokens})
    hc.finish([adm.handle])


def test_a_late_admission_taken_back_during_the_next_calls_wait_leaves_that_call_its_reply(
        make_config: Callable[..., Config]) -> None:
    """An admission given up before the tree saw it; the next call (`tree_digest`) is sent, and
    its wait first gets the late `Admitted`, whose take-back asks the tree and waits too. That
    inner wait got the digest first: 'answers no call it made', the call failed and its op
    stayed pending for good (which also switched the facade's leaked-lock check off)."""
    rt = DeterministicRuntime(seed=1)
    with HiCache(make_config(), runtime=rt, reply_timeout_s=5) as hc:
        _serve(hc, "a", seq(16))
        real = hc.system.next_reply

        def not_yet(timeout_s: Any, *, block: bool = True) -> Any:
            if not block:  # the next call starts before the late reply has come
                return None
            hc.system.next_reply = real  # type: ignore[method-assign]
            return real(timeout_s, block=block)

        def give_up(timeout_s: Any, *, block: bool = True) -> Any:  # before the tree has seen the admission
            hc.system.next_reply = not_yet  # type: ignore[method-assign]
            raise KeyboardInterrupt

        hc.system.next_reply = give_up  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            hc.admit([Request("b", seq(16, 500))])
        digest, host_used = hc.tree_digest()  # the late Admitted, then this call's reply, come in its wait
        assert isinstance(digest, str) and hc._pending == {} and hc.live_requests == ()
        hc.check_invariants()
        [b] = hc.admit([Request("b", seq(16, 500))])
        hc.finish([b.handle])
        _quiet(hc)


def test_a_second_ctrl_c_while_an_interrupted_admission_is_taken_back_waits_for_the_take_back(
    make_config: Callable[..., Config], request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C during an admission, and again while the facade takes it back: the second one
    landed inside the tree's handler on this thread (the take-back ran after the gate had
    opened), the message releasing the admission's lock was lost, and the lock leaked."""
    from hicache.actors._actor import HiActor
    from hicache.runtime._calls import _GATE

    assert threading.current_thread() is threading.main_thread()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        request.addfinalizer(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _GATE._handle)
    armed = {"AdmitRequests": False, "FinishRequests": False}
    real = HiActor.on_receive

    def on_receive(self: HiActor, mail: Any) -> Any:
        name = type(mail.message).__name__
        if armed.get(name):
            armed[name] = False
            _thread.interrupt_main()
        return real(self, mail)

    monkeypatch.setattr(HiActor, "on_receive", on_receive)
    with HiCache(make_config()) as hc:
        armed.update(AdmitRequests=True, FinishRequests=True)
        with pytest.raises(KeyboardInterrupt):
            hc.admit([Request("a", seq(8))])
        assert not any(armed.values())  # both interrupts were raised
        assert hc.live_requests == () and hc.statistics().tree.live_handles == 0
        hc.check_invariants()
        [a] = hc.admit([Request("a", seq(8))])
        hc.finish([a.handle])
        _quiet(hc)


def test_a_late_admission_is_released_and_its_id_stays_usable(make_config: Callable[..., Config]) -> None:
    """An admission cut short on the deterministic runtime (its reply held back): the late
    `Admitted` is undone by the next call, so no lock leaks and the id can be admitted again."""
    rt = DeterministicRuntime(seed=1)
    with HiCache(make_config(), runtime=rt, reply_timeout_s=0.5) as hc:
        _serve(hc, "a", seq(16))
        real = hc.system.next_reply

        def lose_one(timeout_s: Any, *, block: bool = True) -> Any:  # the reply arrives after the wait gave up
            hc.system.next_reply = real  # type: ignore[method-assign]
            rt.run_until_idle()
            raise KeyboardInterrupt

        hc.system.next_reply = lose_one  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            hc.admit([Request("b", seq(16))])
        assert hc.live_requests == ()
        hc.check_invariants()  # the late Admitted was undone: no handle without a live request
        [b] = hc.admit([Request("b", seq(16))])
        assert b.cached_tokens == 16
        hc.finish([b.handle])
        _quiet(hc)


def test_an_admit_given_up_on_while_its_load_waits_for_slots_leaves_the_next_admit_of_that_prefix_working(
    make_config: Callable[..., Config], oracle_for: Callable[[Config], Any],
) -> None:
    """`admit` of a host-only prefix waits for its load-back's slots (the eviction waits for a
    write held here) and times out; the next `admit` of the same prefix reached the tree while
    the first still waited, both planned to load the prefix, and the tree died when the second
    load started (LOADING -> LOADING). Now the second is planned after the first is answered."""
    hold, held = threading.Event(), threading.Event()

    def observe(receiver: ActorName, mail: Any) -> None:
        if receiver is ActorName.WRITE and type(mail.message).__name__ == "DrainWrites" and hold.is_set():
            held.set()
            while hold.is_set():
                time.sleep(0.005)

    config = make_config(page_size=4, device_pages=8, host_pages=32)
    oracle = oracle_for(config)
    with HiCache(config, runtime=ThreadedRuntime(observe=observe, write_stream_thread=True),
                 reply_timeout_s=1.0) as hc:
        prefix = seq(8, 1000)
        [p] = hc.admit([Request("p", prefix + [1])])
        oracle.write(hc.device_kv, prefix + [1], hc.allocate({"p": 9})["p"])
        hc.commit({"p": prefix + [1]})
        hc.finish([p.handle])
        hc.quiesce()
        hc.evict_device(config.device_slots)
        hold.set()  # "a" fills 7 of the 8 pages, and its write is held: its node stays locked
        [a] = hc.admit([Request("a", seq(28, 5000))])
        hc.allocate({"a": 28})
        hc.commit({"a": seq(28, 5000)})
        hc.finish([a.handle])
        assert held.wait(10)
        with pytest.raises(TimeoutError, match=r"no reply to op \d+ within 1\.0s"):
            hc.admit([Request("x", prefix + [7])])  # its load needs 2 pages: the eviction waits for the write
        threading.Timer(0.1, hold.clear).start()  # the write lands while the next admission waits its turn
        [y] = hc.admit([Request("y", prefix + [8])])
        assert y.host_hit == 8
        hc.start_loads().wait_all(timeout_s=30)
        oracle.verify(hc.device_kv, prefix, y.device_indices)
        hc.finish([y.handle])
        _quiet(hc)
