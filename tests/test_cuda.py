"""The CUDA path: device buffer on the GPU, pinned host buffer, side streams, per-layer events.

These tests run wherever CUDA is available and are skipped only when it is absent
(CI has no GPU; a lent GPU machine runs them).
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch

from hicache.actors import DeviceCore, HostCore, KVBuffer, KVShape, copy_kv
from hicache.messages import HostSlotState, Indices, LoadDone, WriteDone
from hicache.runtime import DeviceKind, HostLayout
from hicache.runtime.testing.oracle import FingerprintOracle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is absent on this machine")


def _cuda_config(make_config: Any, page_size: int, layout: HostLayout) -> Any:
    return make_config(page_size=page_size, device=DeviceKind.CUDA, host_layout=layout, transfer_pages_max=2)


@pytest.mark.parametrize("layout", list(HostLayout))
def test_cuda_pools_put_the_device_buffer_on_the_gpu_and_pin_the_host_buffer(make_config: Any, layout: HostLayout) -> None:
    cfg = _cuda_config(make_config, 4, layout)
    assert DeviceCore(cfg).kv.device.type == "cuda"
    host = HostCore(cfg).kv.tensor
    assert host.device.type == "cpu" and host.is_pinned()


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", list(HostLayout))
def test_kv_round_trips_gpu_to_pinned_host_to_gpu_through_the_streams(
    make_config: Any, start_system: Any, oracle_for: Any, page_size: int, layout: HostLayout
) -> None:
    cfg = _cuda_config(make_config, page_size, layout)
    tree = start_system(cfg)
    oracle = oracle_for(cfg)
    rng = random.Random(page_size)
    tokens = [rng.randrange(32_000) for _ in range(3 * page_size + 1)]
    n = len(tokens)
    grant = tree.allocate({"r": n})["r"]
    assert len(grant) == -(-n // page_size)  # whole pages; the last one partly filled unless page_size is 1
    oracle.write(tree.system.device_kv, tokens, tree.slots(grant)[:n])
    tree.commit("r", n)
    host = tree.host_allocate(len(grant) * page_size)
    assert isinstance(tree.write(grant, host), WriteDone)
    oracle.verify(tree.system.host_kv, tokens, tree.slots(host)[:n])
    loaded = tree.allocate_load(n)
    tree.host_move(host, HostSlotState.HOST_ONLY)
    assert isinstance(tree.load(host, loaded), LoadDone)
    torch.cuda.current_stream().synchronize()
    oracle.verify(tree.system.device_kv, tokens, tree.slots(loaded)[:n])


def test_per_layer_waits_order_the_compute_stream_after_each_layer_copy(make_config: Any) -> None:
    from hicache.actors._layers import LayerDoneRing

    ring = LayerDoneRing(2, 2)
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    ring.begin(1)
    with torch.cuda.stream(side):
        x.add_(1)
        event = torch.cuda.Event()
        event.record(side)
    ring.layer_done(1, 0, event)
    ring.wait_layer(1, 0)  # the current stream now waits on the event
    assert float(x.sum()) == float(x.numel())


def test_copy_kv_between_gpu_and_pinned_host_is_byte_exact(make_config: Any) -> None:
    cfg = make_config(page_size=4)
    shape = KVShape.of(cfg)
    dev = KVBuffer.allocate(shape, 64, HostLayout.LAYER_FIRST, "cuda")
    host = KVBuffer.allocate(shape, 128, HostLayout.PAGE_FIRST, "cpu", pin=True)
    oracle = FingerprintOracle(shape)
    tokens = list(range(20))
    src = Indices.from_pages([3, 1, 7, 5, 9], 4).as_tensor()
    dst = Indices.from_pages([30, 2, 11, 12, 13], 4).as_tensor()
    oracle.write(dev, tokens, src)
    copy_kv(dev, src, host, dst, non_blocking=True)
    torch.cuda.synchronize()
    oracle.verify(host, tokens, dst)


def test_bench_transfer_runs_on_the_gpu(capsys: Any) -> None:
    from hicache.runtime.cli import main

    assert main(["bench", "transfer", "--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(r["gbps"] > 0 for r in out["results"])


@pytest.mark.parametrize("layout", list(HostLayout))
def test_a_pinned_host_buffer_is_mapped_and_pages_cross_in_one_kernel_each_way(layout: HostLayout) -> None:
    """The streams' route between the GPU buffer and the pinned host buffer is mapped (one
    gather and one scatter kernel a copy), and its copies are byte-exact both ways, all
    layers at once (writes) and layer by layer (loads), for scattered pages."""
    from hicache.actors._kv import _Route

    shape = KVShape(layers=3, heads=2, head_dim=16, dtype=torch.bfloat16, page_size=8)
    dev = KVBuffer.allocate(shape, 32 * 8, HostLayout.LAYER_FIRST, "cuda")
    host = KVBuffer.allocate(shape, 48 * 8, layout, "cpu", pin=True)
    g = torch.Generator().manual_seed(7)
    dev.tensor.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, dev.tensor.shape, generator=g, dtype=torch.int16))
    host.tensor.view(torch.int16).random_(generator=g)
    before = host.tensor.clone()
    d_pages, h_pages = [5, 0, 31, 17, 2, 9], [40, 3, 11, 12, 47, 0]
    down = _Route(dev, host)
    assert down.mapped is not None and down.mapped[1].device.type == "cuda"
    down.plan_pages(torch.tensor(d_pages), torch.tensor(h_pages)).run(non_blocking=True)
    torch.cuda.synchronize()
    want = before.clone()
    want_buf = KVBuffer(shape, want, layout)
    p = shape.page_size
    for d, h in zip(d_pages, h_pages, strict=True):
        dst, src = torch.arange(h * p, h * p + p), torch.arange(d * p, d * p + p)
        want_buf.write(dst, dev.read(src))
    assert torch.equal(host.tensor.view(torch.int16), want.view(torch.int16))

    back = KVBuffer.allocate(shape, 32 * 8, HostLayout.LAYER_FIRST, "cuda")
    up = _Route(host, back)
    assert up.mapped is not None
    plan = up.plan_pages(torch.tensor(h_pages), torch.tensor(d_pages))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for layer in range(shape.layers):
            plan.run(layer=layer, non_blocking=True)
    side.synchronize()
    for d in d_pages:
        s = torch.arange(d * p, d * p + p)
        assert torch.equal(back.read(s).view(torch.int16), dev.read(s).view(torch.int16))
    untouched = [pg for pg in range(32) if pg not in d_pages]
    rest = torch.cat([torch.arange(pg * p, pg * p + p) for pg in untouched])
    assert not back.read(rest).view(torch.int16).any()


def test_pageable_host_memory_is_not_mapped_and_still_copies_exactly(caplog: Any) -> None:
    import logging

    from hicache.actors._kv import _Route
    from hicache.actors._streams import _route
    from hicache.messages import ActorName

    shape = KVShape(layers=2, heads=1, head_dim=8, dtype=torch.float16, page_size=4)
    dev = KVBuffer.allocate(shape, 16, HostLayout.LAYER_FIRST, "cuda")
    dev.tensor.copy_(torch.randn(dev.tensor.shape))
    host = KVBuffer.allocate(shape, 16, HostLayout.PAGE_FIRST, "cpu")
    route = _Route(dev, host)
    assert route.mapped is None
    with caplog.at_level(logging.WARNING, logger="hicache.streams"):
        _route(dev, host, ActorName.WRITE)  # a stream on this route says so once
        _route(dev, KVBuffer.allocate(shape, 16, HostLayout.PAGE_FIRST, "cpu", pin=True), ActorName.WRITE)
    [record] = caplog.records
    assert "not reachable by GPU kernels" in record.getMessage()
    route.plan_pages(torch.tensor([3, 1]), torch.tensor([0, 2])).run()
    torch.cuda.synchronize()
    for d, h in ((3, 0), (1, 2)):
        assert torch.equal(host.read(torch.arange(h * 4, h * 4 + 4)), dev.read(torch.arange(d * 4, d * 4 + 4)))


def test_a_mapped_load_is_queued_while_the_compute_stream_is_still_busy() -> None:
    """The load stream's first layer moves its page numbers to the GPU and queues its kernels
    without waiting for the compute stream it is ordered after: when `run` returns, a long
    kernel queued before it on the default stream is still running (a host wait on it, as a
    copy of the page numbers from pageable memory would make, would have seen it finish)."""
    from hicache.actors._kv import _Route
    from hicache.actors._streams import _CudaStream

    shape = KVShape(layers=2, heads=1, head_dim=64, dtype=torch.float16, page_size=16)
    dev = KVBuffer.allocate(shape, 64 * 16, HostLayout.LAYER_FIRST, "cuda")
    host = KVBuffer.allocate(shape, 64 * 16, HostLayout.PAGE_FIRST, "cpu", pin=True)
    host.tensor.copy_(torch.randn(host.tensor.shape))
    plan = _Route(host, dev).plan_pages(torch.tensor([7, 3, 60]), torch.tensor([0, 9, 1]))
    stream = _CudaStream(dev.device)
    compute = torch.cuda.current_stream()
    torch.cuda._sleep(4_000_000_000)  # about two seconds of GPU cycles on the compute stream
    _, event = stream.run(plan, layer=0)
    assert not compute.query(), "the host waited for the compute stream before queueing the load"
    event.synchronize()
    for h, d in ((7, 0), (3, 9), (60, 1)):
        got = dev.read(torch.arange(d * 16, d * 16 + 16), layer=0)
        assert torch.equal(got, host.read(torch.arange(h * 16, h * 16 + 16), layer=0))
