"""`Config.check_kv_reads`: a K/V read (`gather`, `page_table`, an index with `distinct=False`)
takes only slots in pages a live request holds, and `gather(layer, ...)` takes a prefix loaded
back from host memory only once that layer landed. A refused read names the first bad slot,
says what it is and what to do, and returns nothing; with the option off (the default) the
same reads go through, as they always did."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
import torch

from hicache.actors import LayerDoneRing, LoadFailedError
from hicache.actors._layers import FAILED_REMEMBERED_MAX
from hicache.runtime import AdmitResult, Config, HiCache, KVArgumentError, Request
from hicache.runtime._kv_checks import LiveSlots

from conftest import FailFirstLoads, opened_caches, small_config

PROMPT = list(range(100, 113))  # 13 tokens: three whole pages and one token at page size 4
READ_TODO = "read only slots a live request holds, as the facade gives them now"


@pytest.fixture
def open_cache(runtime_kind: str) -> Iterator[Callable[..., HiCache]]:
    """`open_cache(**config_fields)`: a started HiCache (2 layers, page size 4, 16 device pages,
    reads and writes checked unless the fields say otherwise) on this test's runtime."""
    yield from opened_caches(runtime_kind, check_kv_reads=True, check_kv_writes=True)


@pytest.fixture
def open_deterministic() -> Iterator[Callable[..., HiCache]]:
    """As `open_cache`, on the deterministic runtime only: nothing runs between two facade calls,
    so a started load-back lands a layer only when the forward pass waits for it."""
    yield from opened_caches("deterministic", check_kv_reads=True, check_kv_writes=True)


def _kv_of(hc: HiCache, tokens: list[int], start: int, layer: int) -> torch.Tensor:
    """What the tests write as layer `layer`'s K (and V) of positions `start..` of `tokens`."""
    x = torch.tensor(tokens[start:], dtype=torch.float32) + 1000 * layer + torch.arange(start, len(tokens)) / 100
    return x[:, None, None].expand(-1, hc.kv.kv_heads, hc.kv.head_dim).to(hc.kv.device, hc.kv.dtype)


def _write(hc: HiCache, slots: torch.Tensor, tokens: list[int], start: int) -> None:
    for layer in range(hc.kv.layers):
        x = _kv_of(hc, tokens, start, layer)
        hc.kv.write(layer, slots, x, x)


def _served(hc: HiCache, rid: str, tokens: list[int], *, end: str = "finish") -> torch.Tensor:
    """Admit, allocate, write and commit every position of `tokens`, then end the request; its slots."""
    [adm] = hc.admit([Request(rid, tokens[:-1])])
    slots = torch.cat([adm.device_indices, hc.allocate({rid: len(tokens) - adm.cached_tokens})[rid]])
    _write(hc, slots[adm.cached_tokens:], tokens, adm.cached_tokens)
    hc.commit({rid: tokens[adm.cached_tokens:]})
    getattr(hc, end)([adm.handle])
    return slots


def _host_hit(hc: HiCache, rid: str = "b") -> AdmitResult:
    """`PROMPT` served, its pages written to host memory and evicted from the device; `rid`
    admitted over it: a host hit of its three whole pages, queued for load-back."""
    _served(hc, "a", PROMPT)
    hc.quiesce()
    assert hc.evict_device(12) == 12
    [adm] = hc.admit([Request(rid, PROMPT)])
    assert (adm.device_hit, adm.host_hit) == (0, 12)
    return adm


def _line(slot: int, what: str) -> str:
    return re.escape(f"slot {slot} {what}; {READ_TODO}") + r".* \(Config\.check_kv_reads\)"


def _refused(hc: HiCache, slots: torch.Tensor, message: str) -> None:
    """Every read of `slots` (a gather of each layer, an index for reading, a block-table row)
    is refused with `message` (the whole line, a regex), and returns nothing."""
    kv = hc.kv
    calls = [lambda: kv.index(slots, distinct=False), lambda: kv.page_table(slots)]
    calls += [lambda layer=layer: kv.gather(layer, slots) for layer in range(kv.layers)]
    calls += [lambda layer=layer: kv.check_read(layer, slots) for layer in range(kv.layers)]
    for call in calls:
        got = None
        with pytest.raises(KVArgumentError, match=f"^{message}$"):
            got = call()
        assert got is None


# -- what is readable ---------------------------------------------------------------------------


def test_a_request_reads_its_cached_prefix_and_its_own_slots(open_cache: Callable[..., HiCache]) -> None:
    hc = open_cache()
    _served(hc, "a", PROMPT)
    longer = PROMPT + [1, 2, 3]
    [adm] = hc.admit([Request("b", longer[:-1])])
    assert adm.device_hit == 12
    slots = torch.cat([adm.device_indices, hc.allocate({"b": 4})["b"]])
    _write(hc, slots[12:], longer, 12)
    every = hc.kv.index(slots, distinct=False)
    for layer in range(hc.kv.layers):
        k, _ = hc.kv.gather(layer, every)
        assert torch.equal(k, _kv_of(hc, longer, 0, layer))
    assert hc.kv.page_table(slots).tolist() == (slots[::4] // 4).tolist()
    hc.commit({"b": longer[12:]})
    hc.finish([adm.handle])


def test_after_cache_unfinished_the_slots_the_facade_gives_now_are_read(open_cache: Callable[..., HiCache]) -> None:
    """Two requests compute the same prompt side by side; the second's `cache_unfinished` finds
    the first's copy in the tree: its slots from then on (`slots(rid)`) read, its own copies no
    longer."""
    hc = open_cache()
    [a, b] = hc.admit([Request("a", PROMPT[:-1]), Request("b", PROMPT[:-1])])
    got = hc.allocate({"a": 8, "b": 8})
    for rid in ("a", "b"):
        _write(hc, got[rid], PROMPT[:8], 0)
    hc.commit({"a": PROMPT[:8], "b": PROMPT[:8]})
    hc.finish([a.handle])
    [handle] = hc.cache_unfinished([b.handle])
    now = hc.slots("b")
    assert torch.equal(now, got["a"])
    assert torch.equal(hc.kv.gather(1, now)[0], _kv_of(hc, PROMPT[:8], 0, 1))
    mine = int(got["b"][0])
    _refused(hc, got["b"], _line(mine, "belongs to no live request (request 'b' gave it up in cache_unfinished(), "
                                       "for the tree's copy of the same tokens)"))
    hc.abort([handle])


def test_with_only_reads_checked_an_index_for_writing_is_read_too(open_cache: Callable[..., HiCache]) -> None:
    hc = open_cache(check_kv_writes=False)
    [adm] = hc.admit([Request("a", PROMPT[:-1])])
    slots = hc.allocate({"a": len(PROMPT)})["a"]
    new = hc.kv.index(slots)
    _write(hc, new, PROMPT, 0)
    assert torch.equal(hc.kv.gather(0, new)[0], _kv_of(hc, PROMPT, 0, 0))
    hc.commit({"a": PROMPT})
    hc.finish([adm.handle])
    with pytest.raises(KVArgumentError, match=re.escape(f"slot {int(slots[0])} belongs to no live request "
                                                        "(request 'a' finished)")):
        hc.kv.gather(0, new)


# -- what is refused ----------------------------------------------------------------------------


def test_a_read_of_a_free_slot_is_refused(open_cache: Callable[..., HiCache]) -> None:
    hc = open_cache()
    hc.admit([Request("a", PROMPT[:-1])])
    mine = hc.allocate({"a": 4})["a"]
    free = next(s for s in range(64) if s // 4 != int(mine[0]) // 4)
    _refused(hc, torch.cat([mine, torch.tensor([free])]), _line(free, "is free (no request holds its page)"))


@pytest.mark.parametrize(("end", "how"), [("finish", "finished"), ("abort", "was aborted"),
                                          ("retract", "was retracted")])
def test_a_read_of_an_ended_request_s_slots_is_refused(open_cache: Callable[..., HiCache], end: str, how: str) -> None:
    """Its cached whole pages (the tree's now) and its freed last page alike: a slot list kept
    past its request's end."""
    hc = open_cache()
    slots = _served(hc, "a", PROMPT, end=end)
    for slot in (int(slots[0]), int(slots[12])):
        _refused(hc, torch.tensor([slot]), _line(slot, f"belongs to no live request (request 'a' {how})"))


def test_a_slot_index_kept_past_its_request_is_refused_at_the_next_gather(open_cache: Callable[..., HiCache]) -> None:
    hc = open_cache()
    [adm] = hc.admit([Request("a", PROMPT[:-1])])
    slots = hc.allocate({"a": len(PROMPT)})["a"]
    _write(hc, slots, PROMPT, 0)
    every = hc.kv.index(slots, distinct=False)
    hc.kv.gather(0, every)
    hc.commit({"a": PROMPT})
    hc.finish([adm.handle])
    with pytest.raises(KVArgumentError, match="^" + _line(int(slots[0]), "belongs to no live request (request 'a' "
                                                                         "finished)") + "$"):
        hc.kv.gather(1, every)


def test_one_index_is_checked_once_for_every_layer_until_the_live_pages_change(
    open_cache: Callable[..., HiCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = []
    real = LiveSlots.readable
    monkeypatch.setattr(LiveSlots, "readable", lambda self, slots: checks.append(1) or real(self, slots))
    hc = open_cache()
    [adm] = hc.admit([Request("a", PROMPT[:-1])])
    slots = hc.allocate({"a": len(PROMPT)})["a"]
    _write(hc, slots, PROMPT, 0)
    every = hc.kv.index(slots, distinct=False)
    for layer in range(hc.kv.layers):
        hc.kv.gather(layer, every)
    assert len(checks) == 1
    hc.allocate({"a": 4}, commit={"a": PROMPT})  # a new page: checked again
    hc.kv.gather(0, every)
    assert len(checks) == 2
    hc.abort([adm.handle])


# -- load-backs ---------------------------------------------------------------------------------


def test_a_load_back_is_read_layer_by_layer_once_each_layer_landed(
    open_deterministic: Callable[..., HiCache]
) -> None:
    """One index for every layer of the pass, made before any layer landed: each gather is
    checked against its own layer's load, and reads the KV the first request wrote."""
    hc = open_deterministic()
    adm = _host_hit(hc)
    prefix = adm.device_indices
    waiter = hc.start_loads()
    every = hc.kv.index(prefix, distinct=False)
    assert hc.kv.page_table(prefix).tolist() == (prefix[::4] // 4).tolist()  # no layer: not a load check
    for layer in range(hc.kv.layers):
        for late in range(layer, hc.kv.layers):
            with pytest.raises(KVArgumentError, match=(
                    f"^slot {int(prefix[0])} is in a prefix that load batch {waiter.batch} brings back from host "
                    f"memory, and its layer {late} has not landed yet; call waiter.wait_layer\\({late}\\) first, "
                    r"on the waiter start_loads\(\) returned \(Config\.check_kv_reads\)$")):
                hc.kv.gather(late, every)
            with pytest.raises(KVArgumentError, match=f"its layer {late} has not landed yet"):
                hc.kv.check_read(late, every)  # a paged kernel's check, before it reads k_pages(late)
        waiter.wait_layer(layer)
        assert hc.kv.check_read(layer, every) is None
        k, v = hc.kv.gather(layer, every)
        assert torch.equal(k, _kv_of(hc, PROMPT[:12], 0, layer)) and torch.equal(v, k)
    hc.abort([adm.handle])


def test_a_load_back_never_started_is_refused_until_start_loads(open_deterministic: Callable[..., HiCache]) -> None:
    hc = open_deterministic()
    adm = _host_hit(hc)
    slot = int(adm.device_indices[4])
    before = hc.kv.index(adm.device_indices, distinct=False)  # kept across start_loads: checked again
    for slots in (adm.device_indices[4:], before):
        with pytest.raises(KVArgumentError, match=(
                f"^slot {slot if slots is not before else int(adm.device_indices[0])} is in the cached prefix of "
                r"request 'b', which a load-back from host memory fills, but start_loads\(\) was not called since "
                r"its admission, so nothing copies it; call start_loads\(\) and wait for the layer "
                r"\(waiter.wait_layer\(1\)\) before reading it \(Config\.check_kv_reads\)$")):
            hc.kv.gather(1, slots)
    held = set((adm.device_indices // 4).tolist())
    other = next(s for s in range(0, 64, 4) if s // 4 not in held)  # the one live request holds its prefix only
    with pytest.raises(KVArgumentError, match=(  # a slot no live request holds: refused first, loading or not
            f"^slot {other} (is free \\(no request holds its page\\)|belongs to no live request \\(request 'a' "
            f"finished\\)); {READ_TODO}")):
        hc.kv.gather(0, torch.cat([adm.device_indices, torch.tensor([other])]))
    waiter = hc.start_loads()
    waiter.wait_all()
    for layer in range(hc.kv.layers):
        assert torch.equal(hc.kv.gather(layer, before)[0], _kv_of(hc, PROMPT[:12], 0, layer))
    hc.abort([adm.handle])


def test_a_read_of_a_load_back_that_failed_is_refused_and_its_pages_granted_again_are_read(
    open_deterministic: Callable[..., HiCache]
) -> None:
    hc = open_deterministic(faults=FailFirstLoads())
    adm = _host_hit(hc)
    waiter = hc.start_loads()
    with pytest.raises(LoadFailedError):
        waiter.wait_layer(0)
    slot = int(adm.device_indices[0])
    with pytest.raises(KVArgumentError, match=(
            f"^slot {slot} is in a prefix whose load-back from host memory failed \\(load batch {waiter.batch}: "
            r"injected: a load-back fails\); its K/V is not valid: retract the requests that read it and "
            r"admit them again \(Config\.check_kv_reads\)$")):
        hc.kv.gather(0, adm.device_indices)
    failed = set((adm.device_indices // 4).tolist())
    hc.retract([adm.handle])
    [c] = hc.admit([Request("c", [7] * 60)])
    mine = hc.allocate({"c": 60})["c"]  # every free page: those the failed load filled among them
    assert failed <= set((mine // 4).tolist())
    _write(hc, mine, [7] * 60, 0)
    for layer in range(hc.kv.layers):
        assert torch.equal(hc.kv.gather(layer, mine)[0], _kv_of(hc, [7] * 60, 0, layer))
    hc.abort([c.handle])


def test_a_load_back_that_failed_is_refused_after_newer_batches_took_its_ring_slot(
    open_deterministic: Callable[..., HiCache]
) -> None:
    """The progress ring holds `load_ring_size` batches: once a newer batch took a failed
    batch's slot, the check took the failed batch for landed, and read its pages."""
    hc = open_deterministic(faults=FailFirstLoads(), load_ring_size=1)
    other = [9] * 13
    _served(hc, "a", PROMPT)
    _served(hc, "x", other)
    hc.quiesce()
    assert hc.evict_device(64) == 24  # both prefixes in host memory only
    [b] = hc.admit([Request("b", PROMPT)])
    failed = hc.start_loads()  # fails
    [y] = hc.admit([Request("y", other)])
    later = hc.start_loads()  # lands, in the ring's one slot
    assert (b.host_hit, y.host_hit, later.batch) == (12, 12, failed.batch + 1)
    later.wait_all()
    why = (f"^slot {int(b.device_indices[0])} is in a prefix whose load-back from host memory failed \\(load batch "
           f"{failed.batch}: injected: a load-back fails\\); its K/V is not valid: retract the requests that read it "
           r"and admit them again \(Config\.check_kv_reads\)$")
    for layer in range(hc.kv.layers):
        with pytest.raises(KVArgumentError, match=why):
            hc.kv.gather(layer, b.device_indices)
        with pytest.raises(KVArgumentError, match=why):
            hc.kv.check_read(layer, b.device_indices)
        assert torch.equal(hc.kv.gather(layer, y.device_indices)[0], _kv_of(hc, other[:12], 0, layer))
    hc.retract([b.handle])
    hc.abort([y.handle])


def test_the_ring_remembers_a_bounded_number_of_failed_batches_past_their_slots() -> None:
    ring = LayerDoneRing(1, 2)
    last = FAILED_REMEMBERED_MAX + 2
    for batch in range(1, last + 1):
        ring.begin(batch)
        ring.fail(batch, f"failure {batch}")
    ring.begin(last + 1)  # takes the one slot
    assert ring.failure(last) == f"failure {last}" and not ring.landed(last, 0)
    assert ring.failure(3) == "failure 3" and not ring.landed(3, 1)  # the oldest remembered
    assert ring.failure(2) is None and ring.landed(2, 0)  # forgotten: FAILED_REMEMBERED_MAX newer failures


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is absent on this machine")
def test_on_cuda_a_load_back_is_read_once_each_layer_was_waited_for() -> None:
    """The slots on the device, checked there; a layer counts as landed once `wait_layer`
    ordered this stream after its copy."""
    with HiCache(small_config(check_kv_reads=True, check_kv_writes=True, device="cuda")) as hc:
        adm = _host_hit(hc)
        waiter = hc.start_loads()
        every = hc.kv.index(adm.device_indices.cuda(), distinct=False)
        assert every.tensor.device.type == "cuda"
        for layer in range(hc.kv.layers):
            waiter.wait_layer(layer)
            k, v = hc.kv.gather(layer, every)
            assert torch.equal(k, _kv_of(hc, PROMPT[:12], 0, layer)) and torch.equal(v, k)
        hc.abort([adm.handle])
        with pytest.raises(KVArgumentError, match=re.escape(f"slot {int(adm.device_indices[0])} belongs to no live "
                                                            "request (request 'b' was aborted)")):
            hc.kv.gather(0, every)


# -- off by default -----------------------------------------------------------------------------


def test_the_check_is_off_by_default_and_then_the_same_reads_go_through(
    open_deterministic: Callable[..., HiCache]
) -> None:
    assert Config().check_kv_reads is False
    hc = open_deterministic(check_kv_reads=False)
    adm = _host_hit(hc)
    ended = hc.kv.index(_served(hc, "c", [5, 6, 7, 8, 9]), distinct=False)
    for slots in (adm.device_indices, ended, torch.tensor([60])):  # loading, an ended request's, any
        assert len(hc.kv.gather(1, slots)[0]) == len(slots)
        hc.kv.page_table(slots)
        hc.kv.check_read(1, slots)
    assert hc.kv._readable is None
    hc.start_loads().wait_all()
    hc.abort([adm.handle])


# -- reads for one request ------------------------------------------------------------------------


def _for_request(hc: HiCache, rid: str, slots: torch.Tensor) -> list[Callable[[], object]]:
    """Every read of `slots` made for request `rid`: a block-table row, and each layer's gather and check."""
    kv = hc.kv
    calls: list[Callable[[], object]] = [lambda: kv.page_table(slots, request_id=rid)]
    calls += [lambda layer=layer: kv.gather(layer, slots, request_id=rid) for layer in range(kv.layers)]
    calls += [lambda layer=layer: kv.check_read(layer, slots, request_id=rid) for layer in range(kv.layers)]
    return calls


def test_a_read_for_a_request_takes_its_cached_prefix_and_own_slots_and_refuses_another_s(
    open_cache: Callable[..., HiCache],
) -> None:
    """Two live requests share a cached prefix: each reads the prefix and its own pages for
    itself; a row that names the other's page (a block table kept after its pages changed
    hands) is refused, naming whose the slot is."""
    hc = open_cache()
    _served(hc, "a", PROMPT)
    b_tokens, c_tokens = PROMPT[:12] + [1, 2, 3, 4], PROMPT[:12] + [5, 6, 7, 8]
    [b, c] = hc.admit([Request("b", b_tokens[:-1]), Request("c", c_tokens[:-1])])
    got = hc.allocate({"b": 4, "c": 4})
    b_slots, c_slots = torch.cat([b.device_indices, got["b"]]), torch.cat([c.device_indices, got["c"]])
    _write(hc, got["b"], b_tokens, 12)
    _write(hc, got["c"], c_tokens, 12)
    for rid, slots, tokens in (("b", b_slots, b_tokens), ("c", c_slots, c_tokens)):
        for call in _for_request(hc, rid, slots):
            call()
        assert torch.equal(hc.kv.gather(1, slots, request_id=rid)[0], _kv_of(hc, tokens, 0, 1))
    mixed = torch.cat([b.device_indices, got["c"]])  # b's prefix, then c's own page
    for call in _for_request(hc, "b", mixed):
        with pytest.raises(KVArgumentError, match="^" + re.escape(
                f"slot {int(got['c'][0])} is request 'c''s, not request 'b''s; a request reads only the slots of "
                "its own positions (its cached prefix's and those allocate() gave it): take them from "
                "slots('b') (Config.check_kv_reads)") + "$"):
            call()
    hc.kv.gather(0, mixed)  # read for no request in particular: every slot is a live request's
    with pytest.raises(KVArgumentError, match=r"^request 'z' is not live \(never admitted, or it ended\)"):
        hc.kv.gather(0, b_slots, request_id="z")
    hc.commit({"b": b_tokens[12:], "c": c_tokens[12:]})
    hc.finish([b.handle, c.handle])


@pytest.mark.parametrize("checked", [True, False], ids=["reads-checked", "unchecked"])
def test_a_request_id_that_is_no_request_id_is_refused_in_one_line(open_cache: Callable[..., HiCache],
                                                                   checked: bool) -> None:
    hc = open_cache(check_kv_reads=checked, check_kv_writes=checked)
    [adm] = hc.admit([Request("a", PROMPT[:-1])])
    slots = hc.allocate({"a": 4})["a"]
    for bad in (7, "", b"a"):
        for call in _for_request(hc, bad, slots):  # type: ignore[arg-type]
            with pytest.raises(KVArgumentError, match=r"^request_id must be a request's id \(a non-empty str\) or "
                                                      r"None, got [^\n]*$"):
                call()
    if not checked:  # without the check, a read for a request is not looked at further
        hc.kv.gather(0, slots, request_id="someone-else")
    hc.abort([adm.handle])
