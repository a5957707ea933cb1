"""Record blocks: the file backend's writes of small pages, a batch's records gathered into
one block and sent in one write (and its reads of small layer_first pages, a block of
records read at a time and scattered into the host slots). The block must hold byte for byte the records a write of
each header and payload in turn gives, whatever the host layout and wherever the pages
lie; a crash mid-write must leave only whole pages that verify, found by a restart."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import xxhash
from hicache.actors import FileBackend, KVBuffer, KVShape, PageFormat, _file_backend
from hicache.actors._record_block import RecordBlock
from hicache.actors._stored_page import HostPages
from hicache.runtime import Config, HostLayout

pytestmark = pytest.mark.timeout(60)

PAGE = 8
LAYOUTS = [HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST]


def _config(storage_dir: Path, host_pages: int) -> Config:
    """2 KiB pages (2 layers x 1 head x head_dim 32, fp16, 8 tokens): written through record blocks."""
    return Config(layers=2, kv_heads=1, head_dim=32, page_size=PAGE, device_slots=8 * PAGE,
                  host_slots=host_pages * PAGE, storage="file", storage_dir=str(storage_dir))


def _host(config: Config, layout: HostLayout, seed: int | None = None) -> KVBuffer:
    host = KVBuffer.allocate(KVShape.of(config), config.host_slots, layout, "cpu")
    if seed is not None:
        host.tensor.view(torch.uint8).random_(generator=torch.Generator().manual_seed(seed))
    return host


def _slots(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * PAGE + torch.arange(PAGE)).flatten()


def _records(fmt: PageFormat, keys: list[str], starts: list[int], pages: HostPages) -> bytes:
    """The records of these pages as a write of each header, then each run of its payload, gives."""
    out = b""
    for key, start in zip(keys, starts, strict=True):
        payload = b"".join(bytes(run) for run in pages.blocks(start))
        header = bytearray(fmt.header_bytes)
        fmt.pack(memoryview(header), key, xxhash.xxh3_64_intdigest(payload))
        out += bytes(header) + payload
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
@pytest.mark.parametrize("where", ["adjacent", "scattered"])
def test_a_record_block_holds_the_records_each_header_and_payload_in_turn_give(tmp_path: Path, layout, where) -> None:
    config = _config(tmp_path, 64)
    fmt = PageFormat(KVShape.of(config))
    pages = HostPages(_host(config, layout, seed=7))
    block = RecordBlock(fmt)
    order = list(range(10, 40)) if where == "adjacent" else [33, 2, 17, 60, 5, 6, 7, 41, 0, 63]
    starts = [p * PAGE for p in order]
    keys = [f"{i:016x}-r0" if i % 4 else f"short{i}" for i in range(len(order))]  # lengths differ too
    assert bytes(block.fill(keys, starts, pages)) == _records(fmt, keys, starts, pages)
    same_length = [f"{i:016x}-r1" for i in range(len(order))]
    assert bytes(block.fill(same_length, starts, pages)) == _records(fmt, same_length, starts, pages)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_pages_written_through_blocks_read_back_bitwise_into_either_layout(tmp_path: Path, layout) -> None:
    n = 1200  # several blocks in one call
    config = _config(tmp_path, 2 * n)
    backend = FileBackend(config)
    assert backend._record_block() is not None and backend._record_block().capacity < n
    src = _host(config, layout, seed=3)
    order = list(range(n, 2 * n))
    order[100:300] = order[100:300][::-1]  # some pages out of host order
    keys = [f"{i:016x}-r0" for i in range(n)]
    assert backend.write(keys, src, _slots(order)).written == n
    backend.check_invariants()
    scattered = torch.randperm(2 * n, generator=torch.Generator().manual_seed(5))[:n].tolist()
    for other in LAYOUTS:  # a layer_first page this small is read through blocks too
        for into in (list(range(n)), scattered):
            dst = _host(config, other)
            assert backend.read(keys, dst, _slots(into)).pages == n
            got, want = dst.read(_slots(into)), src.read(_slots(order))
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), other
            untouched = sorted(set(range(2 * n)) - set(into))
            assert not dst.read(_slots(untouched)).view(torch.uint8).any(), "a read wrote outside its slots"
    backend.close()


def test_repeated_and_stored_keys_across_blocks_are_written_once(tmp_path: Path) -> None:
    config = _config(tmp_path, 2048)
    backend = FileBackend(config)
    capacity = backend._record_block().capacity
    src = _host(config, HostLayout.PAGE_FIRST, seed=9)
    stored = [f"s{i}" for i in range(5)]
    assert backend.write(stored, src, _slots(list(range(5)))).written == 5
    # The second block repeats a key of the first and holds two stored ones.
    keys = [f"n{i}" for i in range(capacity + 20)]
    keys[capacity + 3], keys[capacity + 7], keys[capacity + 11] = "n1", "s2", "s4"
    io = backend.write(keys, src, _slots(list(range(10, 10 + len(keys)))))
    assert (io.pages, io.written, io.error) == (len(keys), len(keys) - 3, "")
    backend.check_invariants()
    [segment] = list(tmp_path.iterdir())
    assert segment.stat().st_size == (5 + len(keys) - 3) * backend.fmt.stored_bytes
    dst = _host(config, HostLayout.LAYER_FIRST)
    unique = list(dict.fromkeys(stored + keys))
    assert backend.read(unique, dst, _slots(list(range(len(unique))))).pages == len(unique)
    first_of: dict[str, int] = {}
    for i, key in enumerate(stored):
        first_of.setdefault(key, i)
    for i, key in enumerate(keys):
        first_of.setdefault(key, 10 + i)
    want = src.read(_slots([first_of[k] for k in unique])).view(torch.uint8)
    assert torch.equal(dst.read(_slots(list(range(len(unique))))).view(torch.uint8), want)
    backend.close()


def test_a_failed_block_write_leaves_no_page_indexed_and_the_next_write_goes_on(tmp_path: Path, monkeypatch) -> None:
    config = _config(tmp_path, 64)
    backend = FileBackend(config)
    src = _host(config, HostLayout.LAYER_FIRST, seed=2)
    assert backend.write(["a0", "a1"], src, _slots([0, 1])).written == 2
    real = _file_backend.pwritev_all

    def torn(fd: int, bufs: list[memoryview], offset: int) -> None:
        os.pwrite(fd, bufs[0][: len(bufs[0]) // 2], offset)  # half the block made it
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_file_backend, "pwritev_all", torn)
    io = backend.write(["b0", "b1", "b2"], src, _slots([2, 3, 4]))
    assert (io.pages, io.written) == (0, 0) and "No space left on device" in io.error
    backend.check_invariants()
    assert backend.exists(["b0"]) == 0 and backend.exists(["a0", "a1"]) == 2
    monkeypatch.setattr(_file_backend, "pwritev_all", real)
    assert backend.write(["b0", "b1", "b2"], src, _slots([2, 3, 4])).written == 3
    backend.check_invariants()
    dst = _host(config, HostLayout.PAGE_FIRST)
    assert FileBackend(config).read(["a0", "a1", "b0", "b1", "b2"], dst, _slots(list(range(5)))).pages == 5
    backend.close()


def test_a_write_of_several_blocks_makes_each_next_block_while_the_last_is_written_one_at_a_time_in_order(
        tmp_path: Path, monkeypatch) -> None:
    config = _config(tmp_path, 2048)
    backend = FileBackend(config)
    capacity = backend._record_block().capacity
    n = 2 * capacity + 10  # three blocks
    src = _host(config, HostLayout.LAYER_FIRST, seed=6)
    real, calls, busy = _file_backend.pwritev_all, [], []
    record = backend.fmt.stored_bytes

    def watched(fd: int, bufs: list[memoryview], offset: int) -> None:
        busy.append(1)
        calls.append((threading.current_thread().name, offset, sum(map(len, bufs)), len(busy)))
        time.sleep(0.05)  # long enough for the caller to make the next block meanwhile, if it does
        try:
            real(fd, bufs, offset)
        finally:
            busy.pop()

    monkeypatch.setattr(_file_backend, "pwritev_all", watched)
    keys = [f"{i:016x}-w" for i in range(n)]
    assert backend.write(keys, src, _slots(list(range(n)))).written == n
    backend.check_invariants()
    # Every block but the last goes out on the write thread; the last (nothing left to make) here.
    assert [name.startswith("hicache-file-write-") for name, *_ in calls] == [True, True, False]
    assert [(offset, size) for _, offset, size, _ in calls] == [
        (0, capacity * record), (capacity * record, capacity * record), (2 * capacity * record, 10 * record)]
    assert max(depth for *_, depth in calls) == 1, "two writes of one segment were in flight together"
    dst = _host(config, HostLayout.PAGE_FIRST)
    assert backend.read(keys, dst, _slots(list(range(n)))).pages == n
    assert torch.equal(dst.read(_slots(list(range(n)))).view(torch.uint8), src.read(_slots(list(range(n)))).view(torch.uint8))
    backend.close()


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failed_write_on_the_write_thread_keeps_the_blocks_before_it_and_indexes_none_after(
        tmp_path: Path, monkeypatch, failing: int) -> None:
    config = _config(tmp_path, 2048)
    backend = FileBackend(config)
    capacity = backend._record_block().capacity
    n = 2 * capacity + 10
    src = _host(config, HostLayout.PAGE_FIRST, seed=8)
    real, seen = _file_backend.pwritev_all, []

    def fails_once(fd: int, bufs: list[memoryview], offset: int) -> None:
        seen.append(offset)
        if len(seen) - 1 == failing:
            os.pwrite(fd, bufs[0][: len(bufs[0]) // 3], offset)  # a third of the block made it
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, bufs, offset)

    monkeypatch.setattr(_file_backend, "pwritev_all", fails_once)
    keys = [f"{i:016x}-f" for i in range(n)]
    io = backend.write(keys, src, _slots(list(range(n))))
    assert (io.pages, io.written) == (failing * capacity, failing * capacity)
    assert "No space left on device" in io.error and keys[failing * capacity] in io.error
    assert len(seen) == failing + 1, "a block after the failed one was written"
    backend.check_invariants()
    assert backend.exists(keys) == failing * capacity
    assert os.path.getsize(next(tmp_path.iterdir())) == failing * capacity * backend.fmt.stored_bytes
    monkeypatch.setattr(_file_backend, "pwritev_all", real)
    assert backend.write(keys, src, _slots(list(range(n)))).written == n - failing * capacity
    backend.check_invariants()
    dst = _host(config, HostLayout.LAYER_FIRST)
    assert FileBackend(config).read(keys, dst, _slots(list(range(n)))).pages == n
    assert torch.equal(dst.read(_slots(list(range(n)))).view(torch.uint8), src.read(_slots(list(range(n)))).view(torch.uint8))
    backend.close()


def test_a_crash_mid_block_leaves_whole_pages_that_a_restart_finds_and_none_that_verifies_wrong(tmp_path: Path) -> None:
    config = _config(tmp_path, 64)
    fields = dict(layers=2, kv_heads=1, head_dim=32, page_size=PAGE, device_slots=8 * PAGE, host_slots=64 * PAGE,
                  storage="file", storage_dir=str(tmp_path))
    script = f"""
import os, torch
from hicache.actors import FileBackend, KVBuffer, KVShape, _file_backend
from hicache.runtime import Config, HostLayout
config = Config(**{fields!r})
host = KVBuffer.allocate(KVShape.of(config), {64 * PAGE}, HostLayout.LAYER_FIRST, "cpu")
host.tensor.view(torch.uint8).random_(generator=torch.Generator().manual_seed(4))
backend = FileBackend(config)
assert backend.write(["c0", "c1"], host, torch.arange({2 * PAGE})).written == 2
record = backend.fmt.stored_bytes
def crash(fd, bufs, offset):  # the process dies with 2 records and a half of this block written
    os.pwrite(fd, bufs[0][: 2 * record + record // 2], offset)
    os._exit(3)
_file_backend.pwritev_all = crash
backend.write(["c2", "c3", "c4", "c5"], host, torch.arange({2 * PAGE}, {6 * PAGE}))
"""
    done = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert done.returncode == 3
    src = _host(config, HostLayout.LAYER_FIRST, seed=4)
    restarted = FileBackend(config)
    keys = ["c0", "c1", "c2", "c3", "c4", "c5"]
    assert restarted.exists(keys) == 4
    dst = _host(config, HostLayout.PAGE_FIRST)
    io = restarted.read(keys, dst, _slots(list(range(6))))
    assert (io.pages, io.error) == (4, "page c4 is not in storage")
    want = src.read(_slots([0, 1, 2, 3])).view(torch.uint8)
    assert torch.equal(dst.read(_slots([0, 1, 2, 3])).view(torch.uint8), want)
    assert restarted.write(keys, src, _slots(list(range(6)))).written == 2  # the torn page is written again
    restarted.check_invariants()
    assert FileBackend(config).read(keys, dst, _slots(list(range(6)))).pages == 6
    restarted.close()
