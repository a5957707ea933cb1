"""`HiCache.kv`: the device pool per layer, as an engine's forward pass reads and writes it."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from hicache.actors import KVShape
from hicache.runtime import CacheStateError, Config, DeviceKV, HiCache, KVArgumentError, Request
from hicache.runtime.testing.oracle import FingerprintOracle

CFG = Config(layers=3, kv_heads=2, head_dim=4, dtype="float32", page_size=4, device_slots=64, host_slots=256)


def _kv_of(n: int, seed: int, layers: int = 1) -> torch.Tensor:
    """Distinct values `[layers, n, kv_heads, head_dim]`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layers, n, CFG.kv_heads, CFG.head_dim, generator=gen)


@pytest.fixture
def cache() -> Any:
    with HiCache(CFG) as hc:
        yield hc


def test_the_kv_api_is_refused_before_start_and_after_close() -> None:
    hc = HiCache(CFG)
    with pytest.raises(CacheStateError, match=r"^the cache is not running: call start\(\)"):
        hc.kv
    with hc:
        kv = hc.kv
        assert isinstance(kv, DeviceKV) and hc.kv is kv
    with pytest.raises(CacheStateError, match=r"^the cache is not running"):
        hc.kv
    with hc:  # a restart has a fresh pool, and a fresh view of it
        assert hc.kv is not kv and hc.kv.buffer is hc.device_kv


def test_layer_views_are_the_device_buffer_in_the_shapes_paged_kernels_take(cache: HiCache) -> None:
    kv = cache.kv
    assert (kv.layers, kv.kv_heads, kv.head_dim, kv.page_size, kv.slots, kv.pages) == (3, 2, 4, 4, 64, 16)
    assert kv.k(1).shape == (64, 2, 4) and kv.v(1).shape == (64, 2, 4)
    assert kv.k_pages(2).shape == (16, 4, 2, 4) and kv.v_pages(2).shape == (16, 4, 2, 4)
    kv.v_pages(2)[3, 1] = 7.0  # a view: slot 3 * 4 + 1 of layer 2's V
    got = cache.device_kv.read(torch.tensor([13]))
    assert bool((got[1, 2] == 7.0).all()) and not bool(got[0].any()) and not bool(got[1, :2].any())


def test_a_layer_write_lands_in_its_slots_of_that_layer_only_and_gathers_back_in_order(cache: HiCache) -> None:
    kv = cache.kv
    slots = torch.tensor([9, 2, 40])
    k, v = _kv_of(3, 1)[0], _kv_of(3, 2)[0]
    kv.write(1, slots, k, v)
    gk, gv = kv.gather(1, torch.tensor([40, 9]))
    assert torch.equal(gk, k[[2, 0]]) and torch.equal(gv, v[[2, 0]])
    whole = cache.device_kv.read(slots)  # the pools' own reader agrees on the layout
    assert torch.equal(whole[0, 1], k) and torch.equal(whole[1, 1], v)
    assert not bool(whole[:, [0, 2]].any()), "another layer changed"
    assert int((cache.device_kv.tensor != 0).sum()) == 2 * 3 * 2 * 4


def test_what_an_engine_writes_layer_by_layer_reads_back_through_the_oracle_after_a_hit(cache: HiCache) -> None:
    """Per-layer writes agree with the pools' layout: the oracle checks them, then a second
    request hits the prefix in device memory and gathers the same K/V."""
    oracle = FingerprintOracle(KVShape.of(CFG))
    tokens = list(range(100, 113))  # 13 tokens: admit 12, compute all 13
    [adm] = cache.admit([Request("a", tokens[:-1])])
    slots = cache.allocate({"a": len(tokens)})["a"]
    want = oracle.expected(tokens, 0, len(tokens))
    index = cache.kv.index(slots)
    for layer in range(CFG.layers):
        cache.kv.write(layer, index, want[0, layer], want[1, layer])
    oracle.verify(cache.device_kv, tokens, slots)
    cache.commit({"a": tokens})
    cache.finish([adm.handle])
    [hit] = cache.admit([Request("b", tokens + [1, 2, 3])])
    assert hit.device_hit == 12
    for layer in range(CFG.layers):
        k, v = cache.kv.gather(layer, hit.device_indices)
        assert torch.equal(k, want[0, layer, :12]) and torch.equal(v, want[1, layer, :12])
    cache.finish([hit.handle])
    cache.check_invariants()


def test_a_page_table_names_the_pages_of_a_request_and_the_paged_views_read_its_kv(cache: HiCache) -> None:
    [adm] = cache.admit([Request("r", [5, 6, 7, 8, 9])])
    cache.allocate({"r": 6})
    for _ in range(3):  # decode steps fill the last page, then take a new one
        cache.allocate({"r": 1})
    slots = cache.slots("r")
    assert len(slots) == 9
    table = cache.kv.page_table(slots)
    assert table.tolist() == (slots[::4] // 4).tolist() and len(table) == 3
    values = _kv_of(9, 3)[0]
    cache.kv.write(0, slots, values, values + 1)
    paged = cache.kv.k_pages(0)[table].flatten(0, 1)[:9]  # what a paged kernel reads via the block table
    assert torch.equal(paged, values)
    with pytest.raises(KVArgumentError, match=r"^these slots are not whole pages in position order"):
        cache.kv.page_table(slots.flip(0))
    cache.abort([adm.handle])


@pytest.mark.parametrize(("call", "message"), [
    (lambda kv: kv.k(3), r"^layer must be an int in 0\.\.2, got 3$"),
    (lambda kv: kv.gather(True, torch.tensor([1])), r"^layer must be an int in 0\.\.2, got True$"),
    (lambda kv: kv.gather(0, [1, 2]), r"^slots must be a 1-D int64 \(or int32\) tensor, as the facade gives them; "
                                      r"got list$"),
    (lambda kv: kv.gather(0, torch.tensor([1.0])), r"^slots must be a 1-D int64 .* got a torch.float32 tensor of "
                                                   r"shape \(1,\)$"),
    (lambda kv: kv.gather(0, torch.tensor([3, 64])), r"^slot 64 is outside the pool's 0\.\.63$"),
    (lambda kv: kv.check_read(3, torch.tensor([1])), r"^layer must be an int in 0\.\.2, got 3$"),
    (lambda kv: kv.check_read(0, torch.tensor([64])), r"^slot 64 is outside the pool's 0\.\.63$"),
    (lambda kv: kv.write(0, torch.tensor([-1]), *_kv_of(1, 0, 2)), r"^slot -1 is outside the pool's 0\.\.63$"),
    (lambda kv: kv.write(0, torch.tensor([4, 5, 4]), *_kv_of(3, 0, 2)),
     r"^a write names a slot twice: each new token needs a slot of its own$"),
    (lambda kv: kv.write(0, torch.tensor([4, 5]), *_kv_of(3, 0, 2)),
     r"^k must be \[tokens, kv_heads, head_dim\] = \[2, 2, 4\], got \(3, 2, 4\)$"),
    (lambda kv: kv.write(0, torch.tensor([4]), _kv_of(1, 0)[0], _kv_of(1, 0)[0].double()),
     r"^v is torch.float64 but the pool holds torch.float32: compute K/V in the cache's dtype"),
    (lambda kv: kv.write(0, kv.index(torch.tensor([4]), distinct=False), *_kv_of(1, 0, 2)),
     r"^slots indexed with distinct=False cannot be written"),
])
def test_bad_arguments_are_one_line_errors_and_change_nothing(cache: HiCache, call: Any, message: str) -> None:
    with pytest.raises(KVArgumentError, match=message):
        call(cache.kv)
    assert not bool(cache.device_kv.tensor.any())


def test_slots_checked_for_one_cache_are_refused_by_another(cache: HiCache) -> None:
    index = cache.kv.index(torch.tensor([1, 2]))
    with HiCache(CFG) as other:
        with pytest.raises(KVArgumentError, match=r"^these slots were checked against another cache's pool"):
            other.kv.gather(0, index)


def test_k_and_v_copied_from_other_slots_of_the_pool_land_whole(cache: HiCache) -> None:
    """V given as a view of the pool (a copy from slots 0-1 to 4-5): torch refused the second
    `index_copy_` as overlapping after K had landed, with its own multi-line error."""
    kv = cache.kv
    k, v = _kv_of(2, 1, 2)
    kv.write(0, torch.tensor([0, 1]), k, v)
    kv.write(0, torch.tensor([4, 5]), kv.k(0)[0:2], kv.v(0)[0:2])
    got_k, got_v = kv.gather(0, torch.tensor([4, 5]))
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_checked_slots_are_the_index_own_copy(cache: HiCache) -> None:
    """An engine reuses its output-slot buffer: changing it after `index` must not change what
    was checked (a slot named twice, or out of range, written unchecked)."""
    kv = cache.kv
    buf = torch.tensor([1, 2])
    index = kv.index(buf)
    buf[1] = 1
    k, v = _kv_of(2, 2, 2)
    kv.write(0, index, k, v)
    got_k, _ = kv.gather(0, torch.tensor([1, 2]))
    assert torch.equal(got_k, k)


def test_k_and_v_computed_with_autograd_on_leave_no_graph_in_the_pool(cache: HiCache) -> None:
    """The pool kept a `grad_fn`, and each write's graph held that pass's tensors alive."""
    kv = cache.kv
    w = torch.ones(1, requires_grad=True)
    k, v = (x * w for x in _kv_of(2, 3, 2))
    kv.write(0, torch.tensor([1, 2]), k, v)
    got_k, got_v = kv.gather(0, torch.tensor([1, 2]))
    assert kv.k(0).grad_fn is None and not got_k.requires_grad and not got_v.requires_grad
    assert torch.equal(got_k, k.detach())


@pytest.mark.parametrize("layer", [1.5, "0", None, True, 3, -1])
def test_a_waiter_refuses_a_layer_that_is_not_one_of_the_model(cache: HiCache, layer: Any) -> None:
    waiter = cache.start_loads()
    with pytest.raises(ValueError, match=rf"^layer must be an int in 0\.\.2, got {re.escape(repr(layer))}$"):
        waiter.wait_layer(layer)
    waiter.wait_all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is absent on this machine")
def test_on_cuda_writes_and_gathers_stay_on_the_device() -> None:
    with HiCache(CFG.replace(device="cuda")) as hc:
        kv = hc.kv
        assert kv.device.type == "cuda" and kv.k_pages(0).device.type == "cuda"
        k, v = (x.cuda() for x in _kv_of(3, 5, 2))
        kv.write(2, torch.tensor([1, 2, 3]), k, v)  # the facade's CPU slots; K/V on the device
        gk, gv = kv.gather(2, torch.tensor([3, 1]))
        assert gk.device.type == "cuda" and torch.equal(gk, k[[2, 0]]) and torch.equal(gv, v[[2, 0]])
        with pytest.raises(KVArgumentError, match=r"^k is on cpu but the pool is on cuda:0"):
            kv.write(2, torch.tensor([4]), k[:1].cpu(), v[:1])
