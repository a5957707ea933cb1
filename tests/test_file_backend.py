"""The file backend's segments: sharing a directory between processes, crashes, the size
bound (`storage_max_bytes`) and storage faults as operating conditions (a miss, counted and
logged once with its path; never a raised error, never wrong KV)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hicache.actors import (
    FileBackend,
    InvariantError,
    KVBuffer,
    KVShape,
    PageFormat,
    StorageIO,
    _file_backend,
)
from hicache.runtime import Config, HostLayout
from hicache.actors._page_index import PageIndex
from hicache.actors._record_block import RecordBlock
from hicache.actors import _segments
from hicache.actors._segments import Segment, seal_name
from hicache.actors._stored_page import HostPages
from hicache.runtime.testing import capture_logs

pytestmark = pytest.mark.timeout(60)

PAGE = 16
HOST_PAGES = 64


def _config(storage_dir: Path, **changes: Any) -> Config:
    """32 KiB pages (4 layers x 2 heads x head_dim 64, fp16, 16 tokens)."""
    values: dict[str, Any] = dict(layers=4, kv_heads=2, head_dim=64, page_size=PAGE, device_slots=8 * PAGE,
                                  host_slots=HOST_PAGES * PAGE, storage="file", storage_dir=str(storage_dir))
    values.update(changes)
    return Config(**values)


def _slots(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * PAGE + torch.arange(PAGE)).flatten()


def _host(config: Config, seed: int | None = None, layout: HostLayout = HostLayout.LAYER_FIRST) -> KVBuffer:
    host = KVBuffer.allocate(KVShape.of(config), HOST_PAGES * PAGE, layout, "cpu")
    if seed is not None:
        host.tensor.view(torch.uint8).random_(generator=torch.Generator().manual_seed(seed))
    return host


def _same(a: KVBuffer, a_pages: list[int], b: KVBuffer, b_pages: list[int]) -> bool:
    return torch.equal(a.read(_slots(a_pages)).view(torch.uint8), b.read(_slots(b_pages)).view(torch.uint8))


def _keys(stem: str, n: int) -> list[str]:
    return [f"{stem}-{i}" for i in range(n)]


def _du(root: Path) -> int:
    """Bytes allocated to the files under `root`, as `du` counts them."""
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


@pytest.fixture
def opened(tmp_path: Path) -> Iterator[Any]:
    """`opened(**changes)`: a FileBackend over `tmp_path`; its index checked and closed at teardown."""
    backends: list[FileBackend] = []

    def open_one(**changes: Any) -> FileBackend:
        backends.append(FileBackend(_config(tmp_path, **changes)))
        return backends[-1]

    yield open_one
    for b in backends:
        b.check_invariants()
        b.close()


# -- segments ------------------------------------------------------------------------------


def test_a_backup_of_many_small_pages_goes_to_one_segment_file(tmp_path: Path, opened: Any) -> None:
    config = _config(tmp_path, layers=1, kv_heads=1, head_dim=64, page_size=8)  # 2 KiB pages
    backend = FileBackend(config)
    host = KVBuffer.allocate(KVShape.of(config), 512 * 8, HostLayout.PAGE_FIRST, "cpu")
    slots = torch.arange(512 * 8)
    assert backend.write(_keys("small", 512), host, slots).written == 512
    assert [p.name for p in tmp_path.iterdir()] == [backend.locate("small-0")[0].name]
    backend.close()


@pytest.mark.parametrize("layout", [HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST], ids=lambda x: x.value)
def test_a_call_of_more_pages_than_one_system_call_takes_moves_them_all(tmp_path: Path, opened: Any, layout) -> None:
    pages = 1500  # layer_first: 5 buffers a record, so past IOV_MAX (1024) in one call
    config = _config(tmp_path, layers=2, kv_heads=1, head_dim=32, page_size=8, host_slots=pages * 8)
    backend = opened(layers=2, kv_heads=1, head_dim=32, page_size=8, host_slots=pages * 8)
    src = KVBuffer.allocate(KVShape.of(config), pages * 8, layout, "cpu")
    src.tensor.view(torch.uint8).random_(generator=torch.Generator().manual_seed(11))
    dst = KVBuffer.allocate(KVShape.of(config), pages * 8, layout, "cpu")
    keys, slots = _keys("many", pages), torch.arange(pages * 8)

    assert backend.write(keys, src, slots).written == pages
    assert backend.read(keys, dst, slots) == StorageIO(pages=pages, bytes=pages * backend.fmt.payload_bytes)
    assert torch.equal(dst.tensor.view(torch.uint8), src.tensor.view(torch.uint8))


def test_a_write_stores_each_new_key_once_whatever_else_the_call_holds(tmp_path: Path, opened: Any) -> None:
    backend = opened()
    config = _config(tmp_path)
    src, dst = _host(config, seed=5), _host(config)
    first = backend.write(["k-1", "k-2", "k-1"], src, _slots([0, 1, 6]))  # all new, one twice
    assert (first.pages, first.written, first.error) == (3, 2, "")
    again = backend.write(["k-3", "k-1", "k-3", "k-4"], src, _slots([2, 3, 4, 5]))  # one stored, one twice
    assert (again.pages, again.written, again.error) == (4, 2, "")
    [segment] = [p for p in tmp_path.iterdir()]
    assert segment.stat().st_size == 4 * backend.fmt.stored_bytes  # no page written twice
    backend.check_invariants()
    assert backend.read(["k-1", "k-2", "k-3", "k-4"], dst, _slots([0, 1, 2, 3])).pages == 4
    assert _same(dst, [0, 1, 2, 3], src, [0, 1, 2, 5])


def test_a_page_another_process_writes_after_this_one_opened_is_found(tmp_path: Path, opened: Any) -> None:
    reader = opened()
    assert reader.exists(["late-0"]) == 0
    script = f"""
import torch
from hicache.actors import FileBackend, KVBuffer, KVShape
from hicache.runtime import Config, HostLayout
config = Config(**{dict(layers=4, kv_heads=2, head_dim=64, page_size=PAGE, device_slots=8 * PAGE,
                        host_slots=HOST_PAGES * PAGE, storage="file", storage_dir=str(tmp_path))!r})
host = KVBuffer.allocate(KVShape.of(config), {HOST_PAGES * PAGE}, HostLayout.PAGE_FIRST, "cpu")
host.tensor.view(torch.uint8).random_(generator=torch.Generator().manual_seed(3))
assert FileBackend(config).write(["late-0", "late-1"], host, torch.arange(2 * {PAGE})).written == 2
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)

    assert reader.exists(["late-0", "late-1"]) == 2
    src, dst = _host(_config(tmp_path), seed=3, layout=HostLayout.PAGE_FIRST), _host(_config(tmp_path))
    assert reader.read(["late-0", "late-1"], dst, _slots([5, 9])).pages == 2
    assert _same(dst, [5, 9], src, [0, 1])


def _settle(root: Path) -> None:
    """Date the directory's last change a minute back, as if nothing had changed in it since."""
    old = time.time_ns() - 60 * 10**9
    os.utime(root, ns=(old, old))


def _counting(calls: list[int], f: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return f(*args, **kwargs)
    return counted


def test_a_lookup_that_misses_lists_the_directory_only_when_it_changed(
        tmp_path: Path, opened: Any, monkeypatch: Any) -> None:
    # A prefetch of a prompt storage does not hold ends in a miss: with thousands of segments a
    # listing (or a walk over every segment) at each miss, or at each backup under a bound that
    # evicts nothing, costs more than the reads.
    backend = opened(storage_max_bytes=64 << 20)
    src, dst = _host(_config(tmp_path), seed=8), _host(_config(tmp_path))
    backend._segment_bytes = backend.fmt.stored_bytes  # a segment a page
    for i in range(20):
        assert backend.write([f"one-{i}"], src, _slots([i])).written == 1
    backend._segment_bytes = _file_backend.SEGMENT_BYTES_MAX  # the backups below append to one segment
    assert backend.write(["last"], src, _slots([20])).written == 1
    _settle(tmp_path)
    listings: list[int] = []
    walks: list[int] = []
    monkeypatch.setattr(_file_backend.os, "scandir", _counting(listings, os.scandir))
    monkeypatch.setattr(PageIndex, "segments", _counting(walks, PageIndex.segments))
    for i in range(20):
        assert backend.exists(["one-0", f"missing-{i}"]) == 1
        assert backend.read(["one-1", f"missing-{i}"], dst, _slots([0, 1])).pages == 1
        assert backend.write([f"more-{i}"], src, _slots([21])).written == 1
    assert len(listings) <= 1 and len(walks) <= 1, (len(listings), len(walks))  # the one after `_settle`
    monkeypatch.undo()

    other = opened()  # another instance stores a page: the directory changes, the next miss lists it
    assert other.write(["late"], src, _slots([22])).written == 1
    assert backend.exists(["late"]) == 1
    assert backend.read(["late"], dst, _slots([2])).pages == 1
    assert _same(dst, [2], src, [22])


def test_reads_and_usage_over_many_segments_look_at_a_bounded_number_of_them(
        tmp_path: Path, opened: Any, monkeypatch: Any) -> None:
    # More segments than files kept open: reading a page of each opens one file a read (the
    # cache of open files emptied now and then), with no count over every segment; `usage`
    # (each statistics() call) looks at `RESTATS_PER_USAGE` segments a call, in turn.
    writer = opened()
    src, dst = _host(_config(tmp_path), seed=9), _host(_config(tmp_path))
    n = _file_backend.FDS_OPEN_MAX + 44
    writer._segment_bytes = writer.fmt.stored_bytes  # a segment a page
    keys = _keys("many", n)
    for i, key in enumerate(keys):
        assert writer.write([key], src, _slots([i % HOST_PAGES])).written == 1
    reader = opened()
    walks: list[int] = []
    stats: list[int] = []
    monkeypatch.setattr(PageIndex, "segments", _counting(walks, PageIndex.segments))
    for i, key in enumerate(keys):
        assert reader.read([key], dst, _slots([0])).pages == 1
        assert _same(dst, [0], src, [i % HOST_PAGES])
    assert walks == []
    monkeypatch.setattr(_file_backend.os, "fstat", _counting(stats, os.fstat))
    calls = -(-n // _file_backend.RESTATS_PER_USAGE)
    for _ in range(calls):
        stats.clear()
        assert reader.usage().stored_bytes == _du(tmp_path)
        assert len(stats) <= _file_backend.RESTATS_PER_USAGE
    assert len(walks) <= 2  # the turns' lists of segments


def test_processes_sharing_a_directory_under_a_bound_read_only_right_pages_and_agree_on_its_bytes(
    tmp_path: Path,
) -> None:
    # Three processes back up, read, look up and restart over one directory at once, each
    # evicting what the others stored (tests/_storage_worker.py). Afterwards a new instance's
    # accounting is what `du` counts, within the bound, and no file is left but segments and seals.
    max_bytes = 256 << 10
    worker = Path(__file__).with_name("_storage_worker.py")
    runs = [subprocess.Popen([sys.executable, str(worker), str(tmp_path), str(seed), "400", str(max_bytes)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in range(3)]
    read_in_all = 0
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, f"a worker read a wrong page or failed: {out} {err[-2000:]}"
        read, right = map(int, out.split())
        assert read == right
        read_in_all += read
    assert read_in_all > 100  # the workers read what they and the others stored
    after = FileBackend(_config(tmp_path, layers=2, kv_heads=1, head_dim=32, page_size=8, storage_max_bytes=max_bytes))
    after.check_invariants()
    assert after.usage().stored_bytes == _du(tmp_path) <= max_bytes
    assert all(p.suffix in (".hkv", ".sealed") for p in tmp_path.iterdir()), sorted(tmp_path.iterdir())
    after.close()


def test_a_restart_finds_every_complete_page_and_none_of_a_torn_tail(tmp_path: Path, opened: Any) -> None:
    a = opened()
    src = _host(_config(tmp_path), seed=4)
    ks = _keys("torn", 4)
    assert a.write(ks[:3], src, _slots([0, 1, 2])).written == 3
    path, _ = a.locate(ks[0])
    a.close()
    # A crash while appending the fourth page: its header and half its payload made it.
    whole = path.read_bytes()
    fmt = PageFormat(KVShape.of(_config(tmp_path)))
    with open(path, "ab") as f:
        f.write(whole[: fmt.header_bytes].replace(ks[0].encode(), ks[3].encode()) + whole[fmt.header_bytes :][:1000])

    b = opened()
    assert b.exists(ks) == 3
    dst = _host(_config(tmp_path))
    assert b.read(ks, dst, _slots([3, 4, 5, 6])).pages == 3
    assert _same(dst, [3, 4, 5], src, [0, 1, 2])
    assert b.write(ks, src, _slots([0, 1, 2, 3])).written == 1  # the torn page is written again, elsewhere
    assert opened().read(ks, dst, _slots([3, 4, 5, 6])).pages == 4


def test_a_page_whose_bytes_were_lost_after_a_crash_reads_as_a_miss(tmp_path: Path, opened: Any) -> None:
    a = opened()
    src = _host(_config(tmp_path), seed=5)
    ks = _keys("lost", 3)
    a.write(ks, src, _slots([0, 1, 2]))
    path, offset = a.locate(ks[1])
    fmt = a.fmt
    with open(path, "r+b") as f:  # blocks allocated but never written before power went: zeros
        f.seek(offset + fmt.header_bytes + 4096)
        f.write(bytes(4096))

    b = opened()
    dst = _host(_config(tmp_path))
    got = b.read(ks, dst, _slots([0, 1, 2]))
    assert got.pages == 1 and "checksum mismatch" in got.error


READ_PATHS = {  # (KV shape, host layout, read through the record block)
    "32 KiB layer_first, staged": ({}, HostLayout.LAYER_FIRST, True),
    "32 KiB page_first, direct": ({}, HostLayout.PAGE_FIRST, False),
    "2 KiB page_first, staged": ({"layers": 1, "kv_heads": 1, "head_dim": 32}, HostLayout.PAGE_FIRST, True),
    "128 KiB layer_first, direct": ({"layers": 8, "kv_heads": 4}, HostLayout.LAYER_FIRST, False),
}


def _four_pages_on(tmp_path: Path, opened: Any, shape: dict[str, Any], layout: HostLayout,
                   staged: bool) -> tuple[FileBackend, KVBuffer, KVBuffer, list[str]]:
    """A backend of `shape` that stored four pages of `src` (host pages 0-3), and a `dst` buffer
    whose reads take the path `staged` names: (backend, src, dst, keys)."""
    backend = opened(**shape)
    config = _config(tmp_path, **shape)
    src, dst = _host(config, seed=6, layout=layout), _host(config, layout=layout)
    assert RecordBlock.stages_reads(HostPages(dst)) == staged
    ks = _keys("four", 4)
    backend.write(ks, src, _slots([0, 1, 2, 3]))
    return backend, src, dst, ks


@pytest.mark.parametrize("shape,layout,staged", READ_PATHS.values(), ids=READ_PATHS.keys())
def test_a_damaged_payload_byte_is_a_miss_on_every_read_path(tmp_path: Path, opened: Any, shape, layout,
                                                            staged) -> None:
    a, src, dst, ks = _four_pages_on(tmp_path, opened, shape, layout, staged)
    path, offset = a.locate(ks[2])
    with open(path, "r+b") as f:  # one bit of the third page's last payload byte flipped
        f.seek(offset + a.fmt.stored_bytes - 1)
        last = f.read(1)[0]
        f.seek(offset + a.fmt.stored_bytes - 1)
        f.write(bytes([last ^ 1]))

    got = a.read(ks, dst, _slots([0, 1, 2, 3]))
    assert got.pages == 2 and "checksum mismatch" in got.error
    assert _same(src, [0, 1], dst, [0, 1])
    assert a.exists(ks) == 2  # the damaged page was dropped; the one after it is still stored
    assert a.read(ks[3:], dst, _slots([3])).pages == 1 and _same(src, [3], dst, [3])


@pytest.mark.parametrize("shape,layout,staged", READ_PATHS.values(), ids=READ_PATHS.keys())
def test_a_segment_cut_short_after_it_was_indexed_is_a_miss_from_the_cut_on_every_read_path(
        tmp_path: Path, opened: Any, shape, layout, staged) -> None:
    a, src, dst, ks = _four_pages_on(tmp_path, opened, shape, layout, staged)
    path, offset = a.locate(ks[0])
    b = opened(**shape)  # indexes all four, then the file loses the end of the third
    assert b.exists(ks) == 4
    with open(path, "r+b") as f:
        f.truncate(offset + 2 * b.fmt.stored_bytes + b.fmt.header_bytes + 100)

    got = b.read(ks, dst, _slots([0, 1, 2, 3]))
    assert got.pages == 2 and "truncated" in got.error
    assert _same(src, [0, 1], dst, [0, 1])


# -- the size bound ------------------------------------------------------------------------------


def test_storage_max_bytes_bounds_the_bytes_on_disk_within_one_segment(tmp_path: Path, opened: Any) -> None:
    max_bytes = 1 << 20
    backend = opened(storage_max_bytes=max_bytes)
    src = _host(_config(tmp_path), seed=6)
    for round_ in range(8):  # 8 x 16 pages of 32 KiB: 4 MiB written
        ks = _keys(f"bound{round_}", 16)
        assert backend.write(ks, src, _slots(list(range(16)))).written == 16
        assert _du(tmp_path) <= max_bytes + backend._segment_bytes, round_
    usage = backend.usage()
    assert usage.stored_bytes == _du(tmp_path)
    assert usage.evicted_pages >= 8 * 16 - max_bytes // backend.fmt.stored_bytes
    assert backend.exists(_keys("bound7", 16)) == 16  # the newest pages stay

    again = opened(storage_max_bytes=max_bytes)  # a restart rebuilds the accounting by a scan
    assert again.usage().stored_bytes == _du(tmp_path)
    assert again.exists(_keys("bound7", 16)) == 16


def test_a_segment_first_seen_mid_append_counts_all_its_bytes_toward_the_bound(tmp_path: Path) -> None:
    # Another writer's segment, listed while its first record was half written (no whole
    # record yet: not a segment of this shape so far), then complete.
    elsewhere = tmp_path / "elsewhere"
    writer = FileBackend(_config(elsewhere))
    src = _host(_config(tmp_path), seed=7)
    ks = _keys("mid", 16)
    assert writer.write(ks, src, _slots(list(range(16)))).written == 16
    whole = writer.locate(ks[0])[0].read_bytes()
    writer.close()
    shared = tmp_path / "shared"
    reader = FileBackend(_config(shared, storage_max_bytes=64 << 20))
    segment = shared / "seg-99999-0-000000.hkv"
    segment.write_bytes(whole[:8192])
    assert reader.exists(ks) == 0
    reader.check_invariants()
    with open(segment, "ab") as f:
        f.write(whole[8192:])
    assert reader.exists(ks) == 16
    reader.check_invariants()
    assert reader.usage().stored_bytes == _du(shared)
    reader.close()


def test_a_record_of_another_shape_put_into_a_segment_being_read_is_skipped_as_damage(
        tmp_path: Path, opened: Any) -> None:
    # A writer still appends to its segment (one KV shape); from outside, another server's
    # record (another shape, another size) is appended to it. A reader must skip it by its
    # segment's record size: before, it took the new size for every later record, read
    # and punched the writer's good pages at wrong offsets.
    a, b = opened(), opened()
    src = _host(_config(tmp_path), seed=11)
    ks = _keys("shape", 8)
    assert a.write(ks, src, _slots(list(range(8)))).written == 8
    assert b.exists(ks) == 8  # b has scanned a's segment, still being appended to
    elsewhere = tmp_path / "elsewhere"
    other = FileBackend(_config(elsewhere, layers=2, head_dim=32))
    assert other.write(["other-0"], _host(_config(elsewhere, layers=2, head_dim=32), seed=1), _slots([0])).written == 1
    foreign = other.locate("other-0")[0].read_bytes()
    other.close()
    with open(a.locate(ks[0])[0], "ab") as f:
        f.write(foreign)
    assert b.exists(["not-stored"]) == 0  # a miss: b scans the segment again, the foreign record too
    b.check_invariants()
    more = _keys("shape-more", 4)
    assert a.write(more, src, _slots([8, 9, 10, 11])).written == 4  # a appends on (over the stray bytes)
    for reader in (b, a):
        dst = _host(_config(tmp_path))
        got = reader.read(ks + more, dst, _slots(list(range(12))))
        assert got.pages == 12 and not got.error, got
        assert _same(src, list(range(12)), dst, list(range(12)))


@pytest.mark.parametrize("when", ["at open", "while serving"])
def test_a_stray_file_named_like_a_segment_is_no_error(tmp_path: Path, opened: Any, when: str) -> None:
    # "²" is a digit to str.isdigit but not to int(): its listing raised ValueError, which
    # failed the prefetch actor (every call after it) or the start of every instance.
    stray = tmp_path / "seg-1-0-\u00b2.hkv"
    if when == "at open":
        stray.write_bytes(b"")
    backend = opened()
    src = _host(_config(tmp_path), seed=12)
    assert backend.write(_keys("stray", 4), src, _slots([0, 1, 2, 3])).written == 4
    stray.write_bytes(b"")
    assert backend.exists(_keys("stray", 4) + ["not-stored"]) == 4  # a miss lists the directory again
    assert opened().exists(_keys("stray", 4)) == 4


@pytest.mark.parametrize("names", ["same pid and instance", "same name"])
def test_writers_of_one_pid_sharing_a_directory_never_take_each_others_live_segment_for_a_finished_one(
        tmp_path: Path, opened: Any, monkeypatch, names: str) -> None:
    # Two servers, each its container's pid 1, on one volume: their writers' names had
    # only the pid and the instance number, so they were equal. Each took the other's
    # live segment for one its writer had moved on from, and a reader's bound deleted it
    # while its writer still appended to it.
    monkeypatch.setattr(_file_backend.os, "getpid", lambda: 1)
    if names == "same name":  # the nonce too: the second writer meets the first's segment when it creates its own
        monkeypatch.setattr(_file_backend.os, "urandom", lambda n: bytes(n))
    monkeypatch.setattr(_file_backend, "_WRITERS", iter([0, 0, 1, 2, 3]))
    a, b = opened(), opened(storage_max_bytes=1 << 20)
    src = _host(_config(tmp_path), seed=13)
    assert a.write(_keys("a", 4), src, _slots([0, 1, 2, 3])).written == 4
    assert b.write(_keys("b", 4), src, _slots([4, 5, 6, 7])).written == 4
    assert a.locate("a-0")[0].name.split("-")[:-1] != b.locate("b-0")[0].name.split("-")[:-1]  # two writers
    assert b.exists(_keys("a", 4)) == 4
    assert a.write(_keys("a2", 4), src, _slots([8, 9, 10, 11])).written == 4
    assert b.exists(_keys("a2", 4)) == 4  # b scans a's live segment again: it is not finished
    b.max_bytes = 1  # b's bound is reached: it evicts every page it can, a's too
    b.write(_keys("b2", 1), src, _slots([12]))
    assert a.locate("a2-0")[0].exists()  # a's live segment stays (its pages are punched out)
    assert a.write(_keys("a3", 4), src, _slots([13, 14, 15, 16])).written == 4
    assert opened().exists(_keys("a3", 4)) == 4  # what a appends after it is found


def test_a_scan_steps_over_punched_out_records_without_reading_them(tmp_path: Path, monkeypatch) -> None:
    # A bounded directory's segments keep the holes of evicted pages; a restart's scan
    # used to read every one record by record (about 35 ms a MiB of holes).
    from hicache.actors._segments import punch

    config = _config(tmp_path, layers=1, kv_heads=1, head_dim=64, page_size=8, host_slots=1024 * 8)  # 2 KiB pages
    writer = FileBackend(config)
    host = KVBuffer.allocate(KVShape.of(config), 1024 * 8, HostLayout.PAGE_FIRST, "cpu")
    ks = _keys("holes", 1024)
    assert writer.write(ks, host, torch.arange(1024 * 8)).written == 1024
    path, last = writer.locate(ks[-1])
    writer.close()
    with open(path, "r+b") as f:  # the first ~1000 records' blocks, as evictions punch them
        punch(f.fileno(), 0, last - last % 4096 - 4 * 4096)
    unpacked = 0
    unpack = PageFormat.unpack

    def counted(self: PageFormat, header: Any) -> Any:
        nonlocal unpacked
        unpacked += 1
        return unpack(self, header)

    monkeypatch.setattr(PageFormat, "unpack", counted)
    reader = FileBackend(config)
    reader.check_invariants()  # every record accounted for, the holes as dead ones
    kept = 1024 - next(i for i, k in enumerate(ks) if reader.exists([k]))
    assert 5 <= kept <= 40 and reader.exists(ks[-kept:]) == kept
    assert unpacked <= kept + 2, f"{unpacked} headers read for {kept} records with data"
    reader.close()


def test_a_page_another_instance_evicted_is_a_miss_logged_at_info(tmp_path: Path, opened: Any) -> None:
    a, b = opened(storage_max_bytes=1 << 20), opened(storage_max_bytes=1 << 20)
    src = _host(_config(tmp_path), seed=8)
    ks = _keys("peer", 8)
    assert a.write(ks, src, _slots(list(range(8)))).written == 8
    for round_ in range(6):  # b fills the bound: a's pages, the oldest b knows of, are punched out
        assert b.write(_keys(f"more{round_}", 8), src, _slots(list(range(8)))).written == 8
    assert b.exists(ks[:1]) == 0 and a.locate(ks[0]) is not None

    dst = _host(_config(tmp_path))
    with capture_logs() as logs:
        got = a.read(ks, dst, _slots(list(range(8))))
    assert got.pages == 0 and got.error.startswith(f"page {ks[0]} is not in storage (gone:"), got
    assert [(e["event"], e["log_level"]) for e in logs] == [("storage page gone", "info")], logs
    assert a.locate(ks[0]) is None and a.exists(ks) == 0


@pytest.mark.parametrize("shape", [{}, {"layers": 1, "kv_heads": 1, "head_dim": 32}], ids=["32 KiB", "2 KiB"])
def test_restarts_under_a_bound_leave_neither_bytes_nor_files_behind(tmp_path: Path, shape: dict[str, Any]) -> None:
    # Each instance writes a few pages and closes, leaving its last segment to the next ones:
    # once its pages are evicted that segment goes, with its seal, even when the pages were
    # punched out before a later instance first saw it (every byte zero, no header to read).
    config = _config(tmp_path, storage_max_bytes=256 << 10, **shape)
    src = _host(config, seed=9)
    stored = PageFormat(KVShape.of(config)).stored_bytes
    per_round = max(1, (64 << 10) // stored)
    for round_ in range(40):
        backend = FileBackend(config)
        assert backend.write(_keys(f"restart{round_}", per_round), src, _slots(list(range(per_round)))).written \
            == per_round
        backend.check_invariants()
        assert backend.usage().stored_bytes == _du(tmp_path) <= (256 << 10) + backend._segment_bytes, round_
        backend.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) <= 2 * (256 << 10) // (per_round * stored) + 2, files  # segments and their seals


def test_a_closed_writers_segment_and_its_seal_go_with_its_last_page(tmp_path: Path, opened: Any) -> None:
    a = opened()
    src = _host(_config(tmp_path), seed=10)
    assert a.write(_keys("closed", 4), src, _slots([0, 1, 2, 3])).written == 4
    path = a.locate("closed-0")[0]
    a.close()
    assert (tmp_path / seal_name(path.name)).exists()

    b = opened(storage_max_bytes=1 << 20)
    for round_ in range(4):  # 4 x 8 pages of 32 KiB fill the bound: the closed writer's pages go first
        assert b.write(_keys(f"after{round_}", 8), src, _slots(list(range(8)))).written == 8
    assert b.exists(["closed-0"]) == 0
    assert not path.exists() and not (tmp_path / seal_name(path.name)).exists()


def _killed_writer(root: Path, keys: list[str], seed: int) -> Path:
    """The segment of a process that wrote the pages of `keys` (host pages 0.., of seed `seed`,
    page_first) to `root` and was killed (SIGKILL) before it closed: never sealed. A torn half
    record is appended, as a kill during an append leaves it, and the file is made a minute old."""
    script = f"""
import os, signal, torch
from hicache.actors import FileBackend, KVBuffer, KVShape
from hicache.runtime import Config, HostLayout
config = Config(**{dict(layers=4, kv_heads=2, head_dim=64, page_size=PAGE, device_slots=8 * PAGE,
                        host_slots=HOST_PAGES * PAGE, storage="file", storage_dir=str(root))!r})
host = KVBuffer.allocate(KVShape.of(config), {HOST_PAGES * PAGE}, HostLayout.PAGE_FIRST, "cpu")
host.tensor.view(torch.uint8).random_(generator=torch.Generator().manual_seed({seed}))
assert FileBackend(config).write({keys!r}, host, torch.arange({len(keys) * PAGE})).written == {len(keys)}
os.kill(os.getpid(), signal.SIGKILL)
"""
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == -9
    [segment] = [p for p in root.iterdir()]
    with open(segment, "ab") as f:
        f.write(b"\x5a" * 5000)
    old = segment.stat().st_mtime - 60
    os.utime(segment, (old, old))
    return segment


def test_a_killed_writers_segment_is_finished_by_the_next_instance_and_goes_with_its_last_page(
        tmp_path: Path, opened: Any) -> None:
    # A writer killed without closing never seals its last segment: before, no instance ever
    # deleted it (nor its torn tail), so each kill left a file and its bytes for good, counted
    # toward the bound by every instance, which evicted live pages in their place.
    keys = _keys("killed", 8)
    segment = _killed_writer(tmp_path, keys, seed=12)
    stored = PageFormat(KVShape.of(_config(tmp_path))).stored_bytes
    b = opened(storage_max_bytes=1 << 20)
    assert (tmp_path / seal_name(segment.name)).exists()  # finished: sealed, the torn tail cut off
    assert segment.stat().st_size == 8 * stored
    src, dst = _host(_config(tmp_path), seed=12, layout=HostLayout.PAGE_FIRST), _host(_config(tmp_path))
    assert b.read(keys, dst, _slots(list(range(8)))).pages == 8
    assert _same(dst, list(range(8)), src, list(range(8)))
    b.check_invariants()
    for round_ in range(5):  # 5 x 8 pages of 32 KiB pass the bound: the killed writer's pages go first
        assert b.write(_keys(f"after{round_}", 8), src, _slots(list(range(8)))).written == 8
    assert b.exists(keys[:1]) == 0
    assert not segment.exists() and not (tmp_path / seal_name(segment.name)).exists()
    assert b.usage().stored_bytes == _du(tmp_path)


@pytest.mark.parametrize("bound", [0, 1 << 20])
def test_a_writer_killed_before_its_first_record_landed_leaves_no_file_behind(tmp_path: Path, bound: int) -> None:
    # Killed between creating its segment and the first byte of its first write (or after a
    # first write that failed on a full disk and was cut off): an empty segment. Before, no
    # instance ever finished it, so every kill left a file for good, which every instance
    # looked at again on each lookup that missed.
    script = f"""
import os, signal, torch
from hicache.actors import FileBackend, KVBuffer, KVShape, _file_backend
from hicache.runtime import Config, HostLayout
config = Config(**{dict(layers=4, kv_heads=2, head_dim=64, page_size=PAGE, device_slots=8 * PAGE,
                        host_slots=HOST_PAGES * PAGE, storage="file", storage_dir=str(tmp_path))!r})
host = KVBuffer.allocate(KVShape.of(config), {HOST_PAGES * PAGE}, HostLayout.PAGE_FIRST, "cpu")
_file_backend._write_records = lambda job: os.kill(os.getpid(), signal.SIGKILL)
FileBackend(config).write(["never-0"], host, torch.arange({PAGE}))
"""
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == -9
    [segment] = list(tmp_path.iterdir())
    assert segment.stat().st_size == 0
    old = segment.stat().st_mtime - 60
    os.utime(segment, (old, old))

    b = FileBackend(_config(tmp_path, storage_max_bytes=bound))
    assert list(tmp_path.iterdir()) == []
    assert b.write(_keys("next", 2), _host(_config(tmp_path), seed=3), _slots([0, 1])).written == 2
    b.check_invariants()
    b.close()


def test_a_writer_whose_every_write_failed_on_a_full_disk_leaves_no_file_behind(
        tmp_path: Path, monkeypatch: Any) -> None:
    # Before, it sealed its empty segment on closing: two files for good (without a bound,
    # nothing deletes a finished segment).
    def full(fd: int, bufs: list[memoryview], offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_file_backend, "pwritev_all", full)
    a = FileBackend(_config(tmp_path))
    assert "No space left" in a.write(_keys("full", 2), _host(_config(tmp_path)), _slots([0, 1])).error
    a.check_invariants()
    a.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fds_max", [3, 256], ids=["closed", "open"])
def test_segments_deleted_by_hand_are_let_go_without_errors_and_their_bytes_stop_counting(
        tmp_path: Path, opened: Any, monkeypatch: Any, fds_max: int) -> None:
    # The deleted files are closed in the instance (its cache of open files holds 3), or open.
    # Before, each `usage` counted and logged an error for every deleted file it looked at
    # that was not open, and went on counting (and holding open) the bytes of those that were.
    monkeypatch.setattr(_file_backend, "FDS_OPEN_MAX", fds_max)
    src = _host(_config(tmp_path), seed=15)
    for round_ in range(6):  # six writers, a segment each
        writer = FileBackend(_config(tmp_path))
        assert writer.write(_keys(f"byhand{round_}", 2), src, _slots([0, 1])).written == 2
        writer.close()
    a = opened(storage_max_bytes=1 << 30)
    assert a.exists(_keys("byhand5", 2)) == 2 and a.usage().stored_bytes == _du(tmp_path) > 0
    for path in tmp_path.iterdir():
        path.unlink()

    with capture_logs() as logs:
        usage = a.usage()
    assert logs == [] and usage.io_errors == 0, logs
    assert usage.stored_bytes == _du(tmp_path) == 0
    assert all(a.exists(_keys(f"byhand{round_}", 1)) == 0 for round_ in range(6))


@pytest.mark.parametrize("writer", ["closed", "killed"])
def test_a_read_error_during_a_scan_loses_no_page_and_cuts_nothing_off(
        tmp_path: Path, monkeypatch: Any, writer: str) -> None:
    # The 4th header read of the scan at start fails once (an I/O error). Before, the index
    # was left inconsistent (records listed but not counted as scanned), the rest of the
    # segment was never scanned again, and a killed writer's segment was cut off at that point.
    keys = _keys(writer, 8)
    src = _host(_config(tmp_path), seed=16, layout=HostLayout.PAGE_FIRST)
    if writer == "killed":
        segment = _killed_writer(tmp_path, keys, seed=16)
    else:
        w = FileBackend(_config(tmp_path))
        assert w.write(keys, src, _slots(list(range(8)))).written == 8
        segment = w.locate(keys[0])[0]
        w.close()
    size = segment.stat().st_size
    monkeypatch.setattr(_segments, "SCAN_BYTES", 4096)  # 32 KiB records: one header a read
    real, calls = os.pread, []

    def flaky(fd: int, n: int, offset: int) -> bytes:
        calls.append(offset)
        if len(calls) == 4:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", flaky)
    b = FileBackend(_config(tmp_path))
    monkeypatch.setattr(os, "pread", real)
    assert b.usage().io_errors == 1
    b.check_invariants()
    assert segment.stat().st_size >= min(size, 8 * b.fmt.stored_bytes)
    dst = _host(_config(tmp_path))
    assert b.read(keys, dst, _slots(list(range(8)))).pages == 8
    assert _same(dst, list(range(8)), src, list(range(8)))
    b.check_invariants()
    b.close()


def test_a_live_writers_segment_is_not_finished_however_long_it_waits(tmp_path: Path, opened: Any) -> None:
    a = opened()
    src = _host(_config(tmp_path), seed=13)
    assert a.write(_keys("idle", 4), src, _slots([0, 1, 2, 3])).written == 4
    segment = a.locate("idle-0")[0]
    old = segment.stat().st_mtime - 60
    os.utime(segment, (old, old))  # idle a minute: its lock still tells it is alive
    b = opened(storage_max_bytes=1 << 20)
    assert b.exists(_keys("idle", 4)) == 4
    assert not (tmp_path / seal_name(segment.name)).exists()
    assert a.write(_keys("later", 4), src, _slots([4, 5, 6, 7])).written == 4
    assert a.locate("later-0")[0] == segment  # still appending to it
    assert b.exists(_keys("later", 4)) == 4


def test_a_finished_segment_whose_pages_were_all_punched_out_unseen_is_deleted(tmp_path: Path, opened: Any) -> None:
    writer = opened()
    src = _host(_config(tmp_path), seed=11)
    assert writer.write(_keys("unseen", 4), src, _slots([0, 1, 2, 3])).written == 4
    path = writer.locate("unseen-0")[0]
    evictor = opened(storage_max_bytes=1 << 20)
    for round_ in range(4):  # the writer's pages go first; its segment is not finished yet, so it stays
        assert evictor.write(_keys(f"evicting{round_}", 8), src, _slots(list(range(8)))).written == 8
    assert evictor.exists(["unseen-0"]) == 0 and path.exists()
    writer.close()  # finished now, with no page left: nothing in it but zeros

    opened(storage_max_bytes=1 << 20)  # a new instance, which never saw a page of it
    assert not path.exists() and not (tmp_path / seal_name(path.name)).exists()


def test_evicting_next_to_another_instances_copy_of_a_page_leaves_that_copy_whole(
    tmp_path: Path, opened: Any, monkeypatch: Any
) -> None:
    # Two instances back up the same page at once: each appends a copy, and each indexes its
    # own. A third indexes the first copy it scans and holds the other as a duplicate; when it
    # evicts the pages around that duplicate, it must not punch it out with them.
    a, b = opened(), opened()
    src = _host(_config(tmp_path), seed=12)
    assert a.write(["twice"], src, _slots([0])).written == 1
    with monkeypatch.context() as m:
        m.setattr(b, "_refresh", lambda listing: None)  # b has not seen a's copy yet
        assert b.write(["before", "twice", "after"], src, _slots([1, 0, 2])).written == 3
    c = opened(storage_max_bytes=4 * a.fmt.stored_bytes)
    assert c.write(_keys("newer", 3), src, _slots([3, 4, 5])).written == 3  # evicts all three it knows of
    assert c.exists(["twice"]) == 0 and c.exists(["before"]) == 0 and c.exists(["after"]) == 0

    dst = _host(_config(tmp_path))
    assert b.read(["twice"], dst, _slots([7])).pages == 1, "b's own copy was punched out with its neighbours"
    assert _same(dst, [7], src, [0])


def test_the_least_recently_read_pages_are_evicted_first(tmp_path: Path, opened: Any) -> None:
    backend = opened(storage_max_bytes=24 * 33 * 1024)  # room for about 24 pages
    src, dst = _host(_config(tmp_path), seed=7), _host(_config(tmp_path))
    old, hot = _keys("old", 8), _keys("hot", 8)
    backend.write(hot, src, _slots(list(range(8))))
    backend.write(old, src, _slots(list(range(8, 16))))
    assert backend.read(hot, dst, _slots(list(range(8)))).pages == 8  # hot is now the most recent

    backend.write(_keys("new", 16), src, _slots(list(range(16, 32))))

    assert backend.exists(hot) == 8
    assert backend.exists(old) == 0
    assert backend.read(hot, dst, _slots(list(range(8)))).pages == 8
    assert _same(dst, list(range(8)), src, list(range(8)))


def test_evicting_small_pages_one_by_one_frees_the_blocks_they_shared() -> None:
    size, block = 2216, 4096  # 2 KiB pages with their header: records straddle the blocks
    seg = Segment(0, "seg-1-0-000000.hkv", Path("unused"), record=size, shaped=True, scanned=8 * size,
                  keys=[f"k{i}" for i in range(8)], live=8)
    holes = []
    for r in range(4):  # evicted oldest first, as the bound does
        seg.keys[r] = None
        holes.append(seg.hole(r, block))

    assert holes[0] == (0, size)  # block 0 still holds record 1
    assert holes[1] == (0, 2 * size)  # now block 0 is dead: the hole starts at it
    freed = set().union(*(range(-(-a // block), b // block) for a, b in holes))
    assert freed == {0, 1}  # every block wholly in records 0-3 (4 x 2216 = 8864 bytes)
    assert all(b <= 4 * size for _, b in holes), "a hole reached into a live record"


def test_a_hole_never_reaches_past_the_scanned_end() -> None:
    seg = Segment(0, "seg-1-0-000000.hkv", Path("unused"), record=3000, shaped=True, scanned=3000,
                  keys=["k0"], live=1)
    seg.keys[0] = None
    assert seg.hole(0, 4096) == (0, 3000)  # the rest of the block may be a record being appended


# -- faults ----------------------------------------------------------------------------------------


def _small_disk(directory: Path, monkeypatch: Any, capacity: int = 1 << 20) -> int:
    """The backend's writes fail with ENOSPC once `directory` would take more than `capacity`
    bytes (other files fill the rest of its file system); `capacity`."""
    real = _file_backend.pwritev_all

    def small_disk(fd: int, bufs: list[memoryview], offset: int) -> None:
        if _du(directory) + sum(map(len, bufs)) > capacity:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, bufs, offset)

    monkeypatch.setattr(_file_backend, "pwritev_all", small_disk)
    return capacity


@pytest.mark.parametrize("bound", [0, 64 << 20])
def test_a_file_system_full_before_the_bound_makes_room_by_evicting_as_the_bound_would(
        tmp_path: Path, opened: Any, monkeypatch: Any, bound: int) -> None:
    # The directory's file system holds 1 MiB (other files fill the rest), far below the
    # bound: a write that hits ENOSPC evicts the least recently used pages and is tried once
    # more. Before, every backup from then on failed until someone freed space. Without a
    # bound, the backend deletes nothing on its own: the write fails, a counted miss.
    capacity = _small_disk(tmp_path, monkeypatch)
    backend = opened(storage_max_bytes=bound)
    src, dst = _host(_config(tmp_path), seed=14), _host(_config(tmp_path))
    failed = 0
    for round_ in range(12):  # 12 x 8 pages of 32 KiB: three times what the disk holds
        keys = _keys(f"full{round_}", 8)
        io = backend.write(keys, src, _slots(list(range(8))))
        backend.check_invariants()
        failed += bool(io.error)
        if bound:
            assert (io.pages, io.written, io.error) == (8, 8, ""), round_
            assert backend.read(keys, dst, _slots(list(range(8, 16)))).pages == 8
            assert _same(dst, list(range(8, 16)), src, list(range(8)))
        else:
            assert io.pages == backend.exists(keys) and (io.pages == 8) == (not io.error)
    assert _du(tmp_path) <= capacity
    if bound:
        assert backend.exists(_keys("full0", 1)) == 0 and backend.usage().evicted_pages > 0
    else:
        assert failed >= 8 and backend.usage().evicted_pages == 0 and backend.exists(_keys("full0", 8)) == 8


def test_once_the_file_system_filled_before_the_bound_backups_make_room_before_they_write(
        tmp_path: Path, opened: Any, monkeypatch: Any) -> None:
    # The file system holds 1 MiB, the bound is 64 MiB. Before, every backup from the first
    # ENOSPC on was written twice (failed, evicted, tried again), each failure counted and
    # logged as an error although no backup failed.
    capacity = _small_disk(tmp_path, monkeypatch)

    def statvfs(path: Any) -> Any:
        st = os.statvfs_result((4096,) * 10)
        return os.statvfs_result((4096, 4096, capacity // 4096, max(0, capacity - _du(tmp_path)) // 4096,
                                  max(0, capacity - _du(tmp_path)) // 4096, *st[5:]))

    monkeypatch.setattr(os, "statvfs", statvfs)
    backend = opened(storage_max_bytes=64 << 20)
    src = _host(_config(tmp_path), seed=17)
    with capture_logs() as logs:
        for round_ in range(12):  # 12 x 8 pages of 32 KiB: three times what the disk holds
            assert backend.write(_keys(f"room{round_}", 8), src, _slots(list(range(8)))).error == "", round_
            backend.check_invariants()
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["storage os error"], logs  # the first only
    assert backend.usage().io_errors == 1 and _du(tmp_path) <= capacity
    assert backend.exists(_keys("room11", 8)) == 8


def test_a_segment_at_the_largest_file_this_process_may_write_is_finished_and_the_next_one_used(
        tmp_path: Path, opened: Any, monkeypatch: Any) -> None:
    # `ulimit -f` (RLIMIT_FSIZE, with SIGXFSZ ignored) of 256 KiB, below the 64 MiB a segment
    # may reach: a write past it fails with EFBIG. Before, the writer kept appending to that
    # segment, and every backup from then on failed. Now the backup that met it goes to a new
    # segment, and segments stay as large as what the first one held.
    limit = 256 << 10
    real = _file_backend.pwritev_all

    def limited(fd: int, bufs: list[memoryview], offset: int) -> None:
        if offset + sum(map(len, bufs)) > limit:
            raise OSError(errno.EFBIG, "File too large")
        real(fd, bufs, offset)

    monkeypatch.setattr(_file_backend, "pwritev_all", limited)
    backend = opened()
    src, dst = _host(_config(tmp_path), seed=18), _host(_config(tmp_path))
    for round_ in range(12):  # 12 x 4 pages of 32 KiB: 1.5 MiB
        io = backend.write(_keys(f"big{round_}", 4), src, _slots([0, 1, 2, 3]))
        assert (io.pages, io.written, io.error) == (4, 4, ""), round_
        backend.check_invariants()
    assert backend.usage().io_errors == 1  # the write that met the limit
    assert max(p.stat().st_size for p in tmp_path.iterdir()) <= limit
    assert backend.read(_keys("big11", 4), dst, _slots([4, 5, 6, 7])).pages == 4
    assert _same(dst, [4, 5, 6, 7], src, [0, 1, 2, 3])


def test_a_read_error_is_a_counted_miss_logged_once_with_its_path(tmp_path: Path, opened: Any, monkeypatch) -> None:
    backend = opened()
    src, dst = _host(_config(tmp_path), seed=8), _host(_config(tmp_path))
    backend.write(_keys("eio", 2), src, _slots([0, 1]))

    def failing(*args: Any) -> int:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_file_backend.os, "preadv", failing)
    with capture_logs() as logs:
        got = backend.read(_keys("eio", 2), dst, _slots([0, 1]))
    monkeypatch.undo()

    path = str(backend.locate("eio-0")[0])
    assert got.pages == 0 and "Input/output error" in got.error and path in got.error
    assert [(e["log_level"], e["path"]) for e in logs] == [("error", path)]
    assert backend.usage().io_errors == 1
    assert backend.read(_keys("eio", 2), dst, _slots([0, 1])).pages == 2  # the next call works


def test_a_read_error_on_a_helper_thread_is_a_counted_miss_and_the_next_read_works(
    tmp_path: Path, opened: Any, monkeypatch
) -> None:
    """Pages of 256 KiB are read on `storage_read_threads` threads: an error in a helper's
    piece fails the call as one on the prefetcher's thread does, once all pieces ended."""
    large = dict(layers=4, kv_heads=4, head_dim=256, storage_read_threads=2)  # 256 KiB pages
    backend = opened(**large)
    assert backend.fmt.payload_bytes == 256 << 10
    src, dst = _host(_config(tmp_path, **large), seed=9), _host(_config(tmp_path, **large))
    ks = _keys("helper-eio", 6)
    assert backend.write(ks, src, _slots([0, 1, 2, 3, 4, 5])).written == 6
    caller, real, threads = threading.current_thread(), _file_backend.os.preadv, set()

    def failing_on_helpers(*args: Any) -> int:
        threads.add(threading.current_thread().name)
        if threading.current_thread() is not caller:
            raise OSError(5, "Input/output error")
        return real(*args)

    monkeypatch.setattr(_file_backend.os, "preadv", failing_on_helpers)
    with capture_logs() as logs:
        got = backend.read(ks, dst, _slots([6, 7, 8, 9, 10, 11]))
    monkeypatch.undo()

    assert len(threads) == 2, threads  # the prefetcher's thread (here the test's) and one helper
    path = str(backend.locate(ks[0])[0])
    assert got.pages == 0 and "Input/output error" in got.error and path in got.error, got
    assert [(e["log_level"], e["path"]) for e in logs] == [("error", path)]
    assert backend.usage().io_errors == 1
    assert backend.read(ks, dst, _slots([6, 7, 8, 9, 10, 11])).pages == 6  # the next call works
    assert _same(dst, [6, 7, 8, 9, 10, 11], src, [0, 1, 2, 3, 4, 5])


def test_a_removed_storage_directory_is_recreated_by_the_next_backup(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    a = FileBackend(_config(root))
    src, dst = _host(_config(root), seed=9), _host(_config(root))
    assert a.write(_keys("gone", 2), src, _slots([0, 1])).written == 2
    shutil.rmtree(root)

    assert a.write(_keys("back", 2), src, _slots([2, 3])) == StorageIO(pages=2, written=2, bytes=2 * a.fmt.payload_bytes)
    assert a.exists(_keys("gone", 2)) == 0  # they went with the directory
    b = FileBackend(_config(root))
    assert b.read(_keys("back", 2), dst, _slots([0, 1])).pages == 2
    assert _same(dst, [0, 1], src, [2, 3])
    shutil.rmtree(root)
    with capture_logs() as logs:
        a.close()  # its segment went with the directory again: nothing to seal, no error
        b.close()
    assert logs == [] and a.usage().io_errors == 0, logs


def test_a_corrupt_page_that_cannot_be_removed_is_a_miss_and_the_backend_goes_on(tmp_path: Path) -> None:
    a = FileBackend(_config(tmp_path))
    src, dst = _host(_config(tmp_path), seed=10), _host(_config(tmp_path))
    ks = _keys("stuck", 3)
    a.write(ks, src, _slots([0, 1, 2]))
    path, offset = a.locate(ks[1])
    with open(path, "r+b") as f:
        f.seek(offset + a.fmt.header_bytes + 100)
        f.write(b"\xff\xfe")
    immutable(path, tmp_path)
    try:
        with capture_logs() as logs:
            got = a.read(ks, dst, _slots([0, 1, 2]))
        assert got.pages == 1 and "checksum mismatch" in got.error
        errors = [e for e in logs if e["log_level"] == "error"]
        assert len(errors) == 1 and errors[0]["path"] == str(path), logs
        assert a.usage().io_errors == 1
        assert a.exists(ks) == 1  # a miss from now on, though its bytes stay
        assert a.read(ks, dst, _slots([0, 1, 2])).pages == 1
    finally:
        mutable(path, tmp_path)
    a.close()


def test_the_caches_check_covers_the_file_backends_page_index(tmp_path: Path, monkeypatch) -> None:
    # The prefetch actor checks its backend's index with its own state, on its own thread.
    from hicache.runtime import HiCache

    checked: list[FileBackend] = []

    def planted(self: FileBackend) -> None:
        checked.append(self)
        raise InvariantError("page index: planted")

    with HiCache(_config(tmp_path)) as hc:
        hc.check_invariants()
        monkeypatch.setattr(FileBackend, "check_invariants", planted)
        with pytest.raises(InvariantError, match="planted"):
            hc.check_invariants()
        monkeypatch.undo()
        hc.check_invariants()  # a failed check changes nothing
    assert len(checked) == 1


def immutable(*paths: Path) -> None:
    """Make files and directories unchangeable, even for root (`chattr +i`)."""
    subprocess.run(["chattr", "+i", *map(str, paths)], check=True)


def mutable(*paths: Path) -> None:
    subprocess.run(["chattr", "-i", *map(str, paths)], check=True)
