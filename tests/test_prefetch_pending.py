"""The prefetcher holds `PrefetchStopped` back while a Mooncake get it gave up on may still
write the prefetch's host slots.

A read whose Mooncake get overran `storage_timeout_s` fails, but the get goes on in the
client. A get of large pages writes straight into the prefetch's host slots; once the tree
has `PrefetchStopped` it may free and reuse those slots, so the prefetcher answers a
`StopPrefetch` only after that call returned. A get of small pages fills the backend's
record block instead, never host slots: the stop is answered at once (the next calls fail
until the get returns, so the block is not reused meanwhile). Here a real `mooncake_master`
on 127.0.0.1 holds the pages, and the prefetcher's client is the real one with its get held
at a gate (a Mooncake call that hangs), on the threaded runtime: the client's call runs in
real time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from mooncake.store import MooncakeDistributedStore

from hicache.actors import KVBuffer, KVShape, PageFormat, _mooncake, open_backend, page_keys
from hicache.actors._prefetch import STOP_RECHECK_S
from hicache.actors._record_block import RecordBlock
from hicache.messages import (
    ActorName,
    Prefetch,
    PrefetchHit,
    PrefetchProgress,
    PrefetchStopped,
    ReadPrefetch,
    StopPrefetch,
)
from hicache.runtime import Config, HostLayout, System, ThreadedRuntime
from hicache.runtime.testing import MooncakeMaster, Probe

from conftest import TreeSide, small_config

pytestmark = pytest.mark.timeout(60)

PAGE = 4
PAGES = 3
TIMEOUT_S = 3.0
"""Long enough for the client's setup on a busy machine; the held get overruns it."""


class GatedStore:
    """A real Mooncake client whose gets (`batch_get_into`, small pages' into the record block;
    `batch_get_into_multi_buffers`, larger pages' into their runs) wait at `gate` first."""

    gate = threading.Event()
    entered = threading.Event()

    def __init__(self) -> None:
        self._client = MooncakeDistributedStore()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def batch_get_into(self, *args: Any) -> Any:
        GatedStore.entered.set()
        assert GatedStore.gate.wait(30), "the test never opened the gate"
        return self._client.batch_get_into(*args)

    def batch_get_into_multi_buffers(self, *args: Any) -> Any:
        GatedStore.entered.set()
        assert GatedStore.gate.wait(30), "the test never opened the gate"
        return self._client.batch_get_into_multi_buffers(*args)


@pytest.fixture
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as m:
        yield m


def _config(master: MooncakeMaster, **shape: Any) -> Config:
    return small_config(page_size=PAGE, storage="mooncake", storage_timeout_s=TIMEOUT_S, storage_batch_pages=PAGES,
                        storage_batch_mb=0, mooncake_segment_mb=16, **master.config_fields(), **shape)


@pytest.mark.parametrize(("shape", "holds"), [({}, False), ({"kv_heads": 8, "head_dim": 512}, True)],
                         ids=["small pages: into the record block", "128 KiB pages: into host slots"])
def test_a_stop_waits_for_a_mooncake_get_into_host_slots_that_overran_its_timeout(
        master: MooncakeMaster, monkeypatch, shape: dict[str, Any], holds: bool) -> None:
    config = _config(master, **shape)
    assert RecordBlock.fits(PageFormat(KVShape.of(config))) is not holds
    keys = page_keys(range(1, PAGES + 1), rank=0)
    writer = open_backend(config)  # its segment holds the pages while the test runs
    src = KVBuffer.allocate(KVShape.of(config), config.host_slots, HostLayout.LAYER_FIRST, "cpu")
    src.tensor.copy_(torch.randn(src.tensor.shape, generator=torch.Generator().manual_seed(1)))
    assert writer.write(keys, src, torch.arange(PAGES * PAGE)).written == PAGES

    GatedStore.gate.clear()
    GatedStore.entered.clear()
    monkeypatch.setattr(_mooncake, "_store_class", lambda: GatedStore)
    system = System(config, runtime=ThreadedRuntime(seed=0), stand_ins=(ActorName.TREE,), stand_in=Probe)
    try:
        tree = TreeSide(system.__enter__())
        host = tree.host_allocate(PAGES * PAGE)
        assert host is not None
        hit = tree.ask(ActorName.PREFETCH, Prefetch(op_id=1, keys=tuple(keys), host=host))
        assert isinstance(hit, PrefetchHit) and hit.pages == PAGES
        tree.tell(ActorName.PREFETCH, ReadPrefetch(op_id=1, pages=PAGES))

        failed = tree.probe.expect(PrefetchProgress, timeout_s=TIMEOUT_S + 5)
        assert GatedStore.entered.is_set()
        assert failed.finished and failed.pages == 0 and "did not return within" in failed.error, failed
        tree.tell(ActorName.PREFETCH, StopPrefetch(op_id=1))
        if holds:
            with pytest.raises(TimeoutError):  # the get still runs: the slots are not the tree's to reuse
                tree.probe.receive(timeout_s=10 * STOP_RECHECK_S)
            assert tree.statistics(ActorName.PREFETCH).in_flight == 1
            opened_at = time.monotonic()
            GatedStore.gate.set()
        stopped = tree.probe.expect(PrefetchStopped, timeout_s=5)
        assert stopped == PrefetchStopped(op_id=1, pages=0)
        if holds:
            assert time.monotonic() - opened_at < 1.0
        assert GatedStore.gate.is_set() is holds  # a get into the block did not hold the stop
        assert tree.statistics(ActorName.PREFETCH).in_flight == 0
        system.check_invariants()
    finally:
        GatedStore.gate.set()
        system.__exit__(None, None, None)
        writer.close()
