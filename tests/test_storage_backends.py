"""The storage backends against real storage: a temporary directory, and a real
`mooncake_master` on 127.0.0.1 (a missing binary fails these tests; it is never a skip).

Each behaviour runs on both backends through `pair`: two backend instances sharing one
storage (one directory; one master), opened once per module because a Mooncake client
takes about a second to close. Tests use keys of their own, so they do not see each other's
pages. KV shapes are tiny (2 layers, 1 head, head_dim 8, fp16, 4-token pages: 256 bytes a page).
"""

from __future__ import annotations

import gc
import itertools

import hashlib
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from hicache.actors import (
    FileBackend,
    InvariantError,
    KVBuffer,
    KVShape,
    MooncakeBackend,
    PageFormat,
    StorageError,
    StorageIO,
    open_backend,
    page_keys,
)
from hicache.actors._io_threads import THREADED_PAGE_BYTES_MIN
from hicache.actors._mooncake import SETUP_RETRIES
from hicache.actors._record_block import RecordBlock
from hicache.actors._stored_page import checksum
from hicache.runtime import Config, HostLayout
from hicache.runtime.testing import MooncakeMaster, capture_logs
from hicache.runtime.testing._mooncake_master import master_binary
from mooncake.store import MooncakeDistributedStore

pytestmark = pytest.mark.timeout(30)

PAGE = 4
BATCH_PAGES = 3
"""Staging holds 3 pages, so reads and writes of 7 pages cross batch boundaries."""
HOST_PAGES = 16
KINDS = ("file", "mooncake")
LAYOUTS = (HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST)


def _config(**changes: Any) -> Config:
    values: dict[str, Any] = dict(
        layers=2, kv_heads=1, head_dim=8, page_size=PAGE, device_slots=8 * PAGE, host_slots=HOST_PAGES * PAGE,
        storage_batch_pages=BATCH_PAGES, storage_batch_mb=0, mooncake_segment_mb=16, storage_timeout_s=5.0,
    )
    values.update(changes)
    return Config(**values)


SHAPE = KVShape.of(_config())
FORMAT = PageFormat(SHAPE)


def _slots(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * PAGE + torch.arange(PAGE)).flatten()


def _host(layout: HostLayout, seed: int | None = None) -> KVBuffer:
    """A host buffer of HOST_PAGES pages: random KV with a seed, zeros without."""
    host = KVBuffer.allocate(SHAPE, HOST_PAGES * PAGE, layout, "cpu")
    if seed is not None:
        host.tensor.copy_(torch.randn(host.tensor.shape, generator=torch.Generator().manual_seed(seed)))
    return host


def _same(a: KVBuffer, a_pages: list[int], b: KVBuffer, b_pages: list[int]) -> bool:
    return torch.equal(a.read(_slots(a_pages)), b.read(_slots(b_pages)))


# -- storage and backends --------------------------------------------------------------


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as m:
        yield m


@pytest.fixture(scope="module")
def raw_client(master: MooncakeMaster) -> Iterator[Any]:
    """A plain Mooncake client (with a local buffer, so `put(bytes)` works) for damaging pages."""
    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", master.metadata_url, 16 << 20, 16 << 20, "tcp", "", master.address) == 0
    yield client
    client.close()


@pytest.fixture(scope="module", params=KINDS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """Two backend instances of one kind over the same storage."""
    if request.param == "file":
        config = _config(storage="file", storage_dir=str(tmp_path_factory.mktemp("pages")))
    else:
        config = _config(storage="mooncake", **request.getfixturevalue("master").config_fields())
    a, b = open_backend(config), open_backend(config)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def keys(request: pytest.FixtureRequest) -> Callable[[int], list[str]]:
    """`keys(n)`: n page keys that no other test uses."""
    stem = hashlib.blake2b(request.node.nodeid.encode(), digest_size=8).hexdigest()
    return lambda n: [f"{stem}-{i}" for i in range(n)]


# -- both backends ----------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_written_pages_read_back_byte_for_byte_into_other_host_pages(pair, keys, layout) -> None:
    a, b = pair
    src, dst = _host(layout, seed=1), _host(layout)
    ks = keys(7)
    src_pages, dst_pages = [9, 2, 3, 15, 0, 7, 4], [1, 14, 6, 5, 11, 8, 12]

    wrote = a.write(ks, src, _slots(src_pages))
    assert wrote == StorageIO(pages=7, written=7, bytes=7 * FORMAT.payload_bytes)
    assert a.exists(ks) == 7
    got = a.read(ks, dst, _slots(dst_pages))

    assert got == StorageIO(pages=7, bytes=7 * FORMAT.payload_bytes)
    assert _same(src, src_pages, dst, dst_pages)
    untouched = sorted(set(range(HOST_PAGES)) - set(dst_pages))
    assert not dst.read(_slots(untouched)).any()


def test_exists_counts_only_the_leading_keys_that_are_stored(pair, keys) -> None:
    a, _ = pair
    ks = keys(5)
    host = _host(HostLayout.LAYER_FIRST, seed=2)
    for k, page in ((ks[0], 0), (ks[1], 1), (ks[3], 3)):
        assert a.write([k], host, _slots([page])).written == 1

    assert a.exists(ks) == 2
    assert a.exists(ks[3:]) == 1
    assert a.exists([ks[2], ks[0]]) == 0
    assert a.exists([]) == 0


def test_a_second_write_of_a_key_writes_nothing_and_keeps_the_stored_bytes(pair, keys) -> None:
    a, _ = pair
    ks = keys(4)
    first, second, out = (_host(HostLayout.PAGE_FIRST, seed=s) for s in (3, 4, None))
    assert a.write(ks[:2], first, _slots([0, 1])).written == 2

    again = a.write(ks, second, _slots([0, 1, 2, 3]))

    assert again == StorageIO(pages=4, written=2, bytes=2 * FORMAT.payload_bytes)
    assert a.write(ks, second, _slots([0, 1, 2, 3])) == StorageIO(pages=4, written=0, bytes=0)
    assert a.read(ks, out, _slots([0, 1, 2, 3])).pages == 4
    assert _same(out, [0, 1], first, [0, 1])
    assert _same(out, [2, 3], second, [2, 3])


def test_a_read_stops_at_the_first_missing_page_and_says_which(pair, keys) -> None:
    a, _ = pair
    ks = keys(5)
    src, dst = _host(HostLayout.LAYER_FIRST, seed=5), _host(HostLayout.LAYER_FIRST)
    a.write(ks[:2] + ks[3:], src, _slots([0, 1, 3, 4]))

    got = a.read(ks, dst, _slots([0, 1, 2, 3, 4]))

    assert got.pages == 2 and got.bytes == 2 * FORMAT.payload_bytes
    assert ks[2] in got.error and "not in storage" in got.error
    assert _same(dst, [0, 1], src, [0, 1])


def test_two_instances_over_one_storage_see_each_others_pages(pair, keys) -> None:
    a, b = pair
    ks = keys(3)
    src, dst = _host(HostLayout.PAGE_FIRST, seed=6), _host(HostLayout.LAYER_FIRST)
    assert a.write(ks, src, _slots([3, 4, 5])).written == 3

    assert b.exists(ks) == 3
    assert b.write(ks, src, _slots([3, 4, 5])).written == 0
    assert b.read(ks, dst, _slots([0, 1, 2])).pages == 3
    assert _same(dst, [0, 1, 2], src, [3, 4, 5])


BAD_KEYS = ("", "a/b", "../x", "k.tmp", "sp ace", "ü", "x" * 81)


@pytest.mark.parametrize("bad", BAD_KEYS)
def test_a_key_outside_the_allowed_characters_is_a_value_error(pair, bad) -> None:
    a, _ = pair
    host = _host(HostLayout.LAYER_FIRST)
    with pytest.raises(ValueError, match=r"0-9, a-z, A-Z, '_' and '-'"):
        a.exists(["ok", bad])
    with pytest.raises(ValueError, match="not allowed"):
        a.write([bad], host, _slots([0]))
    with pytest.raises(ValueError, match="not allowed"):
        a.read([bad], host, _slots([0]))


def test_slots_that_are_not_whole_pages_in_key_order_are_a_value_error(pair, keys) -> None:
    a, _ = pair
    ks = keys(2)
    host = _host(HostLayout.LAYER_FIRST)
    with pytest.raises(ValueError, match="2 keys x page_size 4"):
        a.write(ks, host, _slots([0]))
    with pytest.raises(ValueError, match="whole pages"):
        a.write(ks, host, _slots([0, 1]) + 1)
    with pytest.raises(ValueError, match="whole pages"):
        a.write(ks, host, _slots([0, 1]).flip(0))
    with pytest.raises(ValueError, match="within the host buffer"):
        a.read(ks, host, _slots([HOST_PAGES - 1, HOST_PAGES]))


# -- damaged pages ---------------------------------------------------------------------
#
# A read writes the host slots before it verifies them, so a damaged page's bytes may be in
# its slots: what must hold is that the page and those after it do not count (`pages`).


def _envelope(key: str, host: KVBuffer, page: int) -> bytes:
    """The stored bytes of host page `page` (page_first) under `key`, as a backend writes them."""
    payload = bytes(host.tensor[page].contiguous().view(torch.uint8).flatten().tolist())
    header = bytearray(FORMAT.header_bytes)
    FORMAT.pack(memoryview(header), key, checksum([memoryview(payload)]))
    return bytes(header) + payload


def _stored(backend: Any, raw_client: Any, key: str) -> bytes:
    """The stored bytes of `key`'s page, read past the backend."""
    if isinstance(backend, FileBackend):
        path, offset = backend.locate(key)
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(FORMAT.stored_bytes)
    return raw_client.get(backend.object_key(key))


def _overwrite(backend: Any, raw_client: Any, key: str, stored: bytes) -> None:
    """Replace the stored bytes of `key`'s page, past the backend (same place for a file)."""
    if isinstance(backend, FileBackend):
        path, offset = backend.locate(key)
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(stored)
    else:
        assert raw_client.remove(backend.object_key(key), True) == 0
        assert raw_client.put(backend.object_key(key), stored) == 0


def _stray_padding(stored: bytes) -> bytes:
    """A byte after the key where the header has zeros, with the header's own checksum redone:
    every field still says the right thing, but it is not the header a writer makes."""
    header = bytearray(stored[: FORMAT.header_bytes])
    (key_len,) = struct.unpack_from("<H", header, 6)
    header[80 + key_len] = ord("x")
    struct.pack_into("<Q", header, FORMAT.header_bytes - 8, xxhash.xxh3_64_intdigest(bytes(header[:-8])))
    return bytes(header) + stored[FORMAT.header_bytes :]


DAMAGES: dict[str, Callable[[bytes], bytes]] = {
    "flipped payload byte": lambda b: b[:-7] + bytes([b[-7] ^ 0x40]) + b[-6:],
    "flipped header byte": lambda b: b[:12] + bytes([b[12] ^ 1]) + b[13:],
    "flipped key byte": lambda b: b[:80] + bytes([b[80] ^ 1]) + b[81:],
    "zeroed": lambda b: bytes(len(b)),
    "bad magic": lambda b: b"XXXX" + b[4:],
    "stray byte in the key's padding": _stray_padding,
}
"""Damage in place, as a file record (same size) or a Mooncake object can suffer it."""
SIZE_DAMAGES: dict[str, Callable[[bytes], bytes]] = {
    "truncated": lambda b: b[: len(b) - 100],
    "header only": lambda b: b[: FORMAT.header_bytes],
    "one byte": lambda b: b[:1],
    "one byte more": lambda b: b + b"\0",
}
"""Objects of the wrong size (Mooncake); file records torn at a segment's end: test_file_backend.py."""


def _damaged_read(pair: Any, keys: Any, raw_client: Any, damage: Callable[[bytes], bytes]) -> None:
    a, b = pair
    ks = keys(3)
    src = _host(HostLayout.PAGE_FIRST, seed=7)
    assert a.write(ks, src, _slots([0, 1, 2])).written == 3
    _overwrite(a, raw_client, ks[1], damage(_stored(a, raw_client, ks[1])))

    # The writer, whose index holds the page, and another instance; reads into either layout
    # (a layer_first page this small is read through a record block, a page_first one straight in).
    for reader, layout in itertools.product((a, b), LAYOUTS):
        dst = _host(layout)
        with capture_logs() as logs:
            got = reader.read(ks, dst, _slots([0, 1, 2]))
        assert got.pages == 1 and ks[1] in got.error, got
        assert "unusable" in got.error or "not in storage" in got.error, got
        assert _same(dst, [0], src, [0])
        if "unusable" in got.error:
            assert [e["key"] for e in logs if e["log_level"] == "warning"] == [ks[1]], logs
        assert reader.exists(ks) == 1, "the damaged page still counts as stored"
    assert a.write(ks, src, _slots([0, 1, 2])) == StorageIO(pages=3, written=1, bytes=FORMAT.payload_bytes)
    dst = _host(HostLayout.LAYER_FIRST)
    assert b.read(ks, dst, _slots([0, 1, 2])).pages == 3
    assert _same(dst, [0, 1, 2], src, [0, 1, 2])


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_page_is_a_logged_miss_that_never_counts_and_is_rewritten(pair, keys, raw_client, damage) -> None:
    _damaged_read(pair, keys, raw_client, DAMAGES[damage])


@pytest.mark.parametrize("pair", ["mooncake"], indirect=True)
@pytest.mark.parametrize("damage", SIZE_DAMAGES)
def test_a_mooncake_object_of_the_wrong_size_is_a_miss_and_is_rewritten(pair, keys, raw_client, damage) -> None:
    _damaged_read(pair, keys, raw_client, SIZE_DAMAGES[damage])


@pytest.mark.parametrize("kind", KINDS)
def test_pages_past_a_record_block_move_run_by_run_and_a_damaged_one_is_a_miss(
    kind: str, keys, master: MooncakeMaster, raw_client, tmp_path: Path
) -> None:
    """Pages larger than `RecordBlock.fits` (128 KiB here) are read and written straight
    from and into the host runs, a buffer a run, and verified there; the smaller pages of
    the other tests go through a record block."""
    shape = dict(layers=8, kv_heads=4, head_dim=256, page_size=PAGE, device_slots=4 * PAGE, host_slots=8 * PAGE)
    where = ({"storage": "file", "storage_dir": str(tmp_path)} if kind == "file"
             else {"storage": "mooncake", "mooncake_segment_mb": 32, **master.config_fields()})
    config = Config(**shape, **where, storage_batch_pages=BATCH_PAGES, storage_batch_mb=0)
    fmt = PageFormat(KVShape.of(config))
    assert fmt.payload_bytes == 128 << 10 and not RecordBlock.fits(fmt)
    backend = open_backend(config)
    ks = keys(5)
    for layout in LAYOUTS:
        src = KVBuffer.allocate(KVShape.of(config), 8 * PAGE, layout, "cpu")
        src.tensor.view(torch.uint8).random_(generator=torch.Generator().manual_seed(11))
        if layout is LAYOUTS[0]:
            assert backend.write(ks, src, _slots([3, 0, 6, 1, 4])).written == 5
        for other in LAYOUTS:
            dst = KVBuffer.allocate(KVShape.of(config), 8 * PAGE, other, "cpu")
            assert backend.read(ks, dst, _slots([7, 2, 5, 0, 1])).pages == 5
            if layout is LAYOUTS[0]:
                want = src.read(_slots([3, 0, 6, 1, 4])).view(torch.uint8)
                assert torch.equal(dst.read(_slots([7, 2, 5, 0, 1])).view(torch.uint8), want), other
    if isinstance(backend, FileBackend):
        path, offset = backend.locate(ks[2])
        with open(path, "r+b") as f:
            f.seek(offset + fmt.stored_bytes - 7)
            byte = f.read(1)
            f.seek(offset + fmt.stored_bytes - 7)
            f.write(bytes([byte[0] ^ 0x40]))
    else:
        stored = raw_client.get(backend.object_key(ks[2]))
        assert raw_client.remove(backend.object_key(ks[2]), True) == 0
        assert raw_client.put(backend.object_key(ks[2]), stored[:-7] + bytes([stored[-7] ^ 0x40]) + stored[-6:]) == 0
    dst = KVBuffer.allocate(KVShape.of(config), 8 * PAGE, HostLayout.LAYER_FIRST, "cpu")
    got = backend.read(ks, dst, _slots([0, 1, 2, 3, 4]))
    assert got.pages == 2 and ks[2] in got.error and "unusable" in got.error, got
    backend.close()


@pytest.mark.parametrize("kind", KINDS)
def test_large_pages_verified_on_several_threads_read_as_on_one_and_a_damaged_one_stops_the_read(
    kind: str, keys, master: MooncakeMaster, raw_client, tmp_path: Path
) -> None:
    """Pages of `THREADED_PAGE_BYTES_MIN` or more are verified on `storage_read_threads`
    threads (the file backend reads them there too): the bytes and the verdicts are those of
    one thread, and a damaged page stops the read at itself wherever its piece ran."""
    page = 8
    shape = dict(layers=8, kv_heads=4, head_dim=256, page_size=page, device_slots=4 * page, host_slots=8 * page)
    where = ({"storage": "file", "storage_dir": str(tmp_path)} if kind == "file"
             else {"storage": "mooncake", "mooncake_segment_mb": 32, **master.config_fields()})
    fmt = PageFormat(KVShape.of(Config(**shape)))
    assert fmt.payload_bytes == THREADED_PAGE_BYTES_MIN

    def slots(pages: list[int]) -> torch.Tensor:
        return (torch.tensor(pages, dtype=torch.int64)[:, None] * page + torch.arange(page)).flatten()

    ks = keys(7)
    src = KVBuffer.allocate(KVShape.of(Config(**shape)), 8 * page, HostLayout.PAGE_FIRST, "cpu")
    src.tensor.view(torch.uint8).random_(generator=torch.Generator().manual_seed(12))
    backends = {n: open_backend(Config(**shape, **where, storage_batch_pages=7, storage_batch_mb=0,
                                       storage_read_threads=n)) for n in (1, 2, 3)}
    try:
        assert backends[1].write(ks, src, slots([3, 0, 6, 1, 4, 7, 2])).written == 7
        want = src.read(slots([3, 0, 6, 1, 4, 7, 2])).view(torch.uint8)
        for n, backend in backends.items():
            for layout in LAYOUTS:
                dst = KVBuffer.allocate(KVShape.of(Config(**shape)), 8 * page, layout, "cpu")
                assert backend.read(ks, dst, slots([7, 2, 5, 0, 1, 6, 3])) == StorageIO(
                    pages=7, bytes=7 * fmt.payload_bytes), (n, layout)
                assert torch.equal(dst.read(slots([7, 2, 5, 0, 1, 6, 3])).view(torch.uint8), want), (n, layout)
        # Damage the fifth page, then the second: the read stops at each, on every thread count.
        for bad in (4, 1):
            stored = _stored(backends[1], raw_client, ks[bad])
            _overwrite(backends[1], raw_client, ks[bad], stored[:-7] + bytes([stored[-7] ^ 0x40]) + stored[-6:])
            for n, backend in backends.items():
                for layout in LAYOUTS:
                    dst = KVBuffer.allocate(KVShape.of(Config(**shape)), 8 * page, layout, "cpu")
                    got = backend.read(ks, dst, slots([7, 2, 5, 0, 1, 6, 3]))
                    assert got.pages == bad and ks[bad] in got.error, (n, layout, got)
                    assert "unusable" in got.error or "not in storage" in got.error, got  # dropped by an earlier reader
                    good, written = slots([7, 2, 5, 0, 1, 6, 3][:bad]), slots([3, 0, 6, 1, 4, 7, 2][:bad])
                    assert torch.equal(dst.read(good).view(torch.uint8), src.read(written).view(torch.uint8)), (n, layout)
            assert backends[1].write(ks, src, slots([3, 0, 6, 1, 4, 7, 2])).written == 1  # put back whole
    finally:
        for backend in backends.values():
            backend.close()


def test_a_file_read_on_several_threads_stops_where_the_segment_ends(tmp_path: Path) -> None:
    """A segment cut short within the first of a read's pieces: the pieces after it read
    nothing that counts, on any thread count."""
    page = 8
    shape = dict(layers=8, kv_heads=4, head_dim=256, page_size=page, device_slots=4 * page, host_slots=8 * page)
    config = Config(**shape, storage="file", storage_dir=str(tmp_path), storage_batch_pages=7, storage_batch_mb=0)
    fmt = PageFormat(KVShape.of(config))
    slots = (torch.arange(7)[:, None] * page + torch.arange(page)).flatten()
    src = KVBuffer.allocate(KVShape.of(config), 8 * page, HostLayout.PAGE_FIRST, "cpu")
    src.tensor.view(torch.uint8).random_(generator=torch.Generator().manual_seed(13))
    writer = open_backend(config)
    ks = [f"cut-{i}" for i in range(7)]
    assert writer.write(ks, src, slots).written == 7
    path, offset = writer.locate(ks[0])
    writer.close()
    readers = {n: open_backend(config.replace(storage_read_threads=n)) for n in (1, 2, 3)}  # each indexes all 7
    with open(path, "r+b") as f:
        f.truncate(offset + 2 * fmt.stored_bytes + fmt.header_bytes + 1000)  # inside the third page
    for n, reader in readers.items():
        dst = KVBuffer.allocate(KVShape.of(config), 8 * page, HostLayout.LAYER_FIRST, "cpu")
        got = reader.read(ks, dst, slots)
        assert got.pages == 2 and "truncated" in got.error, (n, got)
        assert torch.equal(dst.read(slots[: 2 * page]).view(torch.uint8), src.read(slots[: 2 * page]).view(torch.uint8)), n
        reader.close()


def test_a_page_stored_under_another_key_is_a_miss(pair, keys, raw_client) -> None:
    a, _ = pair
    ks = keys(2)
    src, dst = _host(HostLayout.LAYER_FIRST, seed=8), _host(HostLayout.LAYER_FIRST)
    a.write(ks, src, _slots([0, 1]))
    _overwrite(a, raw_client, ks[1], _stored(a, raw_client, ks[0]))

    got = a.read(ks[1:], dst, _slots([0]))

    assert got.pages == 0 and f"holds the page of key {ks[0]!r}" in got.error


def test_a_page_written_by_a_backend_is_exactly_the_documented_record(pair, keys, raw_client) -> None:
    a, _ = pair
    key = keys(1)[0]
    src = _host(HostLayout.PAGE_FIRST, seed=9)
    a.write([key], src, _slots([5]))
    assert _stored(a, raw_client, key) == _envelope(key, src, 5)


@pytest.mark.parametrize("size", [4096, 1 << 20], ids=["small page", "large page"])
def test_the_page_checksum_is_xxh3_64_of_the_runs_one_after_the_other(size: int) -> None:
    data = (bytes(range(256)) * (size // 256 + 1))[:size]
    runs = [memoryview(data)[i : i + 1000] for i in range(0, len(data), 1000)]
    assert checksum(runs) == checksum([memoryview(data)]) == xxhash.xxh3_64_intdigest(data)


# -- keys and opening -------------------------------------------------------------------


def test_page_keys_are_hex_hashes_with_a_rank_suffix_unless_shared_by_all_ranks() -> None:
    assert page_keys([1, 0xABCDEF], rank=0) == [f"{1:032x}-r0", f"{0xABCDEF:032x}-r0"]
    assert page_keys([1, 2**128 - 1], rank=3, ranks=4) == [f"{1:032x}-r3of4", "f" * 32 + "-r3of4"]
    assert page_keys([2**127], rank=0, per_rank=False) == [f"{2**127:032x}"]
    with pytest.raises(ValueError, match=r"^rank 3 of a group of 2: a rank is in 0..ranks-1$"):
        page_keys([1], rank=3, ranks=2)
    with pytest.raises(ValueError, match="non-negative"):
        page_keys([-1], rank=0)
    with pytest.raises(ValueError, match="80 characters"):
        page_keys([2**400], rank=0)


def test_open_backend_gives_none_without_storage_and_the_named_backend_otherwise(tmp_path: Path) -> None:
    assert open_backend(_config()) is None
    backend = open_backend(_config(storage="file", storage_dir=str(tmp_path / "new" / "dir")))
    assert isinstance(backend, FileBackend)
    assert (tmp_path / "new" / "dir").is_dir()


def test_an_unwritable_file_storage_directory_is_a_storage_error_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(StorageError, match=r"a-file/pages.*storage_dir"):
        open_backend(_config(storage="file", storage_dir=str(blocker / "pages")))


def test_concurrent_writers_of_the_same_keys_leave_whole_pages_and_no_temporary_files(tmp_path: Path) -> None:
    config = _config(storage="file", storage_dir=str(tmp_path))
    backends = [FileBackend(config) for _ in range(4)]
    src = _host(HostLayout.PAGE_FIRST, seed=10)
    ks = [f"{i:016x}-r0" for i in range(8)]
    start = threading.Barrier(len(backends))
    results: list[StorageIO] = []

    def write(backend: FileBackend) -> None:
        start.wait()
        results.append(backend.write(ks, src, _slots(list(range(8)))))

    threads = [threading.Thread(target=write, args=(b,)) for b in backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert all(r.pages == 8 and not r.error for r in results), results
    assert sum(r.written for r in results) >= 8
    dst = _host(HostLayout.LAYER_FIRST)
    assert backends[0].read(ks, dst, _slots(list(range(8)))).pages == 8
    assert _same(dst, list(range(8)), src, list(range(8)))
    assert not list(tmp_path.rglob("*.tmp"))


# -- Mooncake only ----------------------------------------------------------------------


def test_the_mooncake_master_binary_is_installed() -> None:
    assert master_binary().is_file()


def test_an_unreachable_mooncake_master_is_a_storage_error_at_open_naming_the_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]  # nothing listens there once the socket is closed
    config = _config(storage="mooncake", storage_timeout_s=0.5, mooncake_master=f"127.0.0.1:{free}",
                     mooncake_metadata=f"http://127.0.0.1:{free}/metadata")
    started = time.monotonic()
    with pytest.raises(StorageError, match=rf"127\.0\.0\.1:{free}.*--enable_http_metadata_server"):
        open_backend(config)
    assert time.monotonic() - started < 2.0


def test_a_mooncake_local_host_that_is_not_this_machines_is_a_storage_error_at_open(master: MooncakeMaster) -> None:
    # The client set up with any local host: the instance served its own pages, while every
    # other client's get from its segment and put into it failed (-800).
    not_ours = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never a local address
    config = _config(storage="mooncake", **{**master.config_fields(), "mooncake_local_host": not_ours})
    with pytest.raises(StorageError, match=r"mooncake_local_host='192\.0\.2\.1' is not an address of this machine"):
        open_backend(config)


def test_an_address_that_answers_but_is_no_mooncake_master_is_a_storage_error_within_the_retries(
    master: MooncakeMaster,
) -> None:
    timeout_s = 0.5
    wrong = f"127.0.0.1:{master.metadata_port}"  # the HTTP metadata server, not the master's RPC port
    config = _config(storage="mooncake", storage_timeout_s=timeout_s, mooncake_master=wrong,
                     mooncake_metadata=master.metadata_url)
    started = time.monotonic()
    with pytest.raises(StorageError, match=rf"setup failed.*master {wrong}"):
        open_backend(config)
    assert time.monotonic() - started < (SETUP_RETRIES + 2) * timeout_s + 1.0


def test_opening_against_a_frozen_mooncake_master_names_a_master_that_does_not_answer(keys) -> None:
    # A stopped (SIGSTOP) master's kernel accepts the connection, and setup fails with code -1:
    # the message sent the operator to the port numbers, the local host and the segment size only.
    with MooncakeMaster() as m:
        config = _config(storage="mooncake", storage_timeout_s=0.5, **m.config_fields())
        m.pause()
        try:
            with pytest.raises(StorageError, match=r"setup failed.*that the master answers \(a frozen"):
                open_backend(config)
        finally:
            m.resume()


def test_a_storage_timeout_shorter_than_the_client_setup_still_opens(master: MooncakeMaster, keys) -> None:
    """Setup takes 40-300 ms here: it gets `SETUP_WAIT_MIN_S`, not a timeout meant for reads and writes."""
    src, dst = _host(HostLayout.PAGE_FIRST, seed=12), _host(HostLayout.PAGE_FIRST)
    backend = open_backend(_config(storage="mooncake", storage_timeout_s=0.001, **master.config_fields()))
    assert isinstance(backend, MooncakeBackend)
    try:
        ks = keys(2)
        if backend.write(ks, src, _slots([0, 1])).written == 2:  # a 1 ms call may time out under load: a miss
            read = backend.read(ks, dst, _slots([0, 1]))
            assert read.pages in (0, 1, 2)
            assert torch.equal(dst.read(_slots([0, 1])[: read.pages * PAGE]), src.read(_slots([0, 1])[: read.pages * PAGE]))
    finally:
        backend.close()


def test_a_mooncake_master_killed_mid_run_gives_misses_and_errors_within_the_timeout(keys) -> None:
    timeout_s = 1.0
    src, dst = _host(HostLayout.PAGE_FIRST, seed=11), _host(HostLayout.PAGE_FIRST)
    ks = keys(4)
    with MooncakeMaster() as m:
        backend = open_backend(_config(storage="mooncake", storage_timeout_s=timeout_s, **m.config_fields()))
        assert isinstance(backend, MooncakeBackend)
        assert backend.write(ks[:2], src, _slots([0, 1])).written == 2
        m.kill()

        def timed(call: Callable[[], Any]) -> Any:
            started = time.monotonic()
            out = call()
            assert time.monotonic() - started < timeout_s + 0.5
            return out

        with capture_logs() as logs:
            assert timed(lambda: backend.exists(ks)) == 0
            read = timed(lambda: backend.read(ks[:2], dst, _slots([0, 1])))
            wrote = timed(lambda: backend.write(ks[2:], src, _slots([2, 3])))
        assert read.pages == 0 and read.error
        assert wrote.pages == 0 and wrote.written == 0 and wrote.error
        assert not dst.tensor.any()
        assert any(e["log_level"] == "error" for e in logs), logs

        # The master comes back (empty), so close can shut the client down instead of
        # leaving it to a teardown at exit that would wait for a dead master.
        m.start()
        deadline = time.monotonic() + 15
        while backend.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        with capture_logs() as logs:
            backend.close()
        assert not logs, "close left the client open although the master answers"


def test_closing_against_a_hung_mooncake_master_leaves_the_client_open_within_the_timeout(keys) -> None:
    # A stopped (SIGSTOP) master's kernel still accepts connections, so a connection was
    # taken for an answer, and the client's close, which holds the interpreter lock, blocked
    # every thread for about 9 s.
    timeout_s = 0.5
    src = _host(HostLayout.PAGE_FIRST, seed=12)
    with MooncakeMaster() as m:
        backend = open_backend(_config(storage="mooncake", storage_timeout_s=timeout_s, **m.config_fields()))
        assert isinstance(backend, MooncakeBackend)
        assert backend.write(keys(2), src, _slots([0, 1])).written == 2
        m.pause()
        try:
            started = time.monotonic()
            with capture_logs() as logs:
                backend.close()
            assert time.monotonic() - started < timeout_s + 1.0
        finally:
            m.resume()
        assert [e["event"] for e in logs] == ["storage client left open until exit"], logs
        assert "did not return within" in logs[0]["reason"]


@pytest.mark.parametrize("head_dim", [8, 256], ids=["record_block", "host_slots"])
def test_a_client_left_open_at_close_lets_go_of_the_host_buffer_no_call_still_touches(keys, head_dim) -> None:
    # A close that met a frozen (or dead) master kept every buffer ever registered until the
    # process exited, although no get or put still ran: each restart of the cache after such
    # a close left its whole host tier behind.
    with MooncakeMaster() as m:
        backend = open_backend(_config(storage="mooncake", storage_timeout_s=0.5, head_dim=head_dim,
                                       **m.config_fields()))
        assert isinstance(backend, MooncakeBackend)
        host = KVBuffer.allocate(backend.fmt.shape, HOST_PAGES * PAGE, HostLayout.PAGE_FIRST, "cpu")
        assert backend.write(keys(1), host, _slots([0])).written == 1  # registers the host buffer
        freed = weakref.ref(host.tensor)
        m.pause()
        try:
            with capture_logs() as logs:
                backend.close()
        finally:
            m.resume()
        assert [e["event"] for e in logs] == ["storage client left open until exit"], logs
        backend._calls._thread.join(10)  # its existence check returns once the master runs again
        assert not backend._calls._thread.is_alive()
        del host, backend
        gc.collect()
        assert freed() is None, "the client left open still holds the host buffer"


class _Wrapped:
    """A Mooncake client whose named methods are replaced; everything else is the real one's."""

    def __init__(self, real: Any, **methods: Callable[..., Any]) -> None:
        self._real, self._methods = real, methods

    def __getattr__(self, name: str) -> Any:
        return self._methods.get(name) or getattr(self._real, name)


def test_a_put_from_host_slots_that_overran_has_its_objects_removed_once_it_returns(keys) -> None:
    # Pages of 128 KiB are put straight from host memory. A put that overran its timeout (its
    # objects placed in a peer that froze) still read the host slots after the backup counted
    # as failed and the tree reused them: it then stored objects whose payload did not match
    # their headers, in a store the tree believed did not have them.
    fields = dict(layers=4, kv_heads=2, head_dim=256, page_size=16, device_slots=8 * 16, host_slots=16 * 16,
                  storage_timeout_s=0.5, mooncake_segment_mb=16)
    with MooncakeMaster() as m:
        config = Config(storage="mooncake", **fields, **m.config_fields())
        backend = open_backend(config)
        assert isinstance(backend, MooncakeBackend) and not RecordBlock.fits(backend.fmt)
        host = KVBuffer.allocate(KVShape.of(config), 16 * 16, HostLayout.PAGE_FIRST, "cpu")
        host.tensor.copy_(torch.randn(host.tensor.shape, generator=torch.Generator().manual_seed(21)))
        slots = torch.arange(4 * 16)
        real, gate = backend._store, threading.Event()

        def frozen_peer_put(*args: Any) -> Any:
            gate.wait(10)
            return real.batch_put_from_multi_buffers(*args)

        ks = keys(4)
        try:
            backend._store = _Wrapped(real, batch_put_from_multi_buffers=frozen_peer_put)
            wrote = backend.write(ks, host, slots)
            assert (wrote.pages, wrote.written) == (0, 0) and "did not return within 0.5 s" in wrote.error
            host.tensor.fill_(7.0)  # the tree reuses the slots of the backup that failed
            gate.set()
            deadline = time.monotonic() + 10
            while backend._calls.busy() and time.monotonic() < deadline:
                time.sleep(0.01)
            with capture_logs() as logs:
                assert backend.exists(ks) == 0
            assert "storage put overran, its objects removed" in [e["event"] for e in logs]
            backend._store = real
            assert backend.write(ks, host, slots).written == 4  # stored anew, whole
            dst = KVBuffer.allocate(KVShape.of(config), 16 * 16, HostLayout.PAGE_FIRST, "cpu")
            assert backend.read(ks, dst, slots).pages == 4 and torch.equal(dst.read(slots), host.read(slots))
        finally:
            gate.set()
            backend._store = real
            backend.close()


def test_a_get_that_failed_does_not_drop_a_page_whose_size_the_master_did_not_answer(keys) -> None:
    # A get fails (-800: the object's segment is in a peer that died or froze) and the size
    # asked next answers an error code (-900 the master did not answer, -704 gone): the code
    # was taken for the object's size, the page called unusable and removed, healthy or not.
    src, dst = _host(HostLayout.PAGE_FIRST, seed=22), _host(HostLayout.PAGE_FIRST)
    ks = keys(1)
    with MooncakeMaster() as m:
        backend = open_backend(_config(storage="mooncake", **m.config_fields()))
        assert isinstance(backend, MooncakeBackend)
        real = backend._store
        try:
            assert backend.write(ks, src, _slots([0])).written == 1
            backend._store = _Wrapped(real, batch_get_into=lambda objects, *_: [-800] * len(objects),
                                      batch_get_into_multi_buffers=lambda objects, *_: [-800] * len(objects),
                                      get_size=lambda key: -900)
            with capture_logs() as logs:
                read = backend.read(ks, dst, _slots([0]))
            assert read.pages == 0 and "-800" in read.error
            assert "storage page unusable, dropped" not in [e["event"] for e in logs]
            backend._store = real
            assert backend.read(ks, dst, _slots([0])).pages == 1 and torch.equal(dst.read(_slots([0])), src.read(_slots([0])))
        finally:
            backend._store = real
            backend.close()


def test_the_client_waits_on_a_peer_that_stopped_answering_a_fraction_of_the_storage_timeout() -> None:
    # The TCP transport waits 30 s by default for a frozen peer, several times a batch: a
    # get of a page in a peer stopped with SIGSTOP held the call thread 30-60 s, and every
    # call meanwhile failed at once. Whole seconds, at least 1.
    from hicache.actors._mooncake import _client_env

    for timeout_s, waits in ((5.0, "1"), (0.5, "1"), (60.0, "15")):
        env = _client_env(_config(storage="mooncake", storage_timeout_s=timeout_s))
        assert env["MC_TCP_PROGRESS_TIMEOUT_SEC"] == env["MC_TCP_STATUS_TIMEOUT_SEC"] == waits


def test_only_a_get_into_host_slots_that_overran_holds_back_a_stopped_prefetch() -> None:
    # Against a dead master an existence check or a put returns after about 4 s; a stopped
    # prefetch (and the scheduler's `ready`) waited for it, though it writes no host slot.
    from hicache.actors._mooncake import _BoundedCalls, _CallFailed

    with MooncakeMaster() as m:
        backend = open_backend(_config(storage="mooncake", **m.config_fields()))
        assert isinstance(backend, MooncakeBackend)
        real, backend._calls = backend._calls, _BoundedCalls(0.05, keep=[])
        try:
            for call, holds in (("batch_is_exist", False), ("batch_put_from", False), ("batch_get_into", False),
                                ("batch_get_into_multi_buffers", True)):
                gate = threading.Event()
                with pytest.raises(_CallFailed):
                    backend._calls.run(call, gate.wait)
                assert backend._calls.busy() and bool(backend.pending) is holds, call
                gate.set()
                assert backend._calls.settle() == "" and backend.pending == ""
        finally:
            backend._calls.stop(wait=True)
            backend._calls = real
            backend.close()


# -- the Mooncake client's call thread ----------------------------------------------------------


def test_a_bounded_call_returns_its_value_and_reraises_what_it_raised() -> None:
    from hicache.actors._mooncake import _BoundedCalls

    calls = _BoundedCalls(5.0, keep=[])
    try:
        assert [calls.run("add", lambda a, b: a + b, k, 1) for k in range(50)] == list(range(1, 51))
        with pytest.raises(KeyError, match="missing"):
            calls.run("lookup", {}.__getitem__, "missing")
        assert calls.run("after an error", lambda: "fine") == "fine" and calls.busy() == ""
        calls.check_invariants()
        calls._returned.release()  # an outcome handed over for no call: the next call would take it
        with pytest.raises(InvariantError, match="no call waiting"):
            calls.check_invariants()
    finally:
        calls.stop(wait=True)
    assert not calls._thread.is_alive(), "a stop that waits returns once the call thread has ended"


def test_a_call_that_overran_fails_the_next_ones_until_it_returns_and_its_value_is_never_taken() -> None:
    """The caller gives up after the timeout; the thread still runs the call. Until it returns,
    every call fails at once (naming it); once it has, the next call gets its own value."""
    from hicache.actors._mooncake import _BoundedCalls, _CallFailed

    class Stale:
        pass

    made: list[weakref.ref[Stale]] = []

    def slow_get() -> Stale:
        gate.wait(10)
        value = Stale()
        made.append(weakref.ref(value))
        return value

    gate = threading.Event()
    calls = _BoundedCalls(0.2, keep=[])
    try:
        with pytest.raises(_CallFailed, match="slow_get did not return within 0.2 s"):
            calls.run("slow_get", slow_get)
        assert "slow_get" in calls.busy()
        with pytest.raises(_CallFailed, match=r"an earlier Mooncake call \(slow_get\) has not returned"):
            calls.run("next", lambda: "never run")
        gate.set()
        deadline = time.monotonic() + 5
        while calls.busy() and time.monotonic() < deadline:  # as the prefetcher polls `pending`
            time.sleep(0.01)
        assert calls.busy() == ""
        assert made and made[0]() is None, "the overrun call's value is kept after its release was taken"
        assert calls.run("next", lambda: "its own") == "its own"
        assert calls.busy() == ""
    finally:
        gate.set()
        calls.stop(wait=True)


def test_a_wait_cut_short_by_an_interrupt_leaves_the_call_pending_not_its_value_for_the_next() -> None:
    from hicache.actors._mooncake import _BoundedCalls, _CallFailed

    gate = threading.Event()
    calls = _BoundedCalls(5.0, keep=[])

    class Cut(BaseException):
        pass

    real = calls._returned

    class CutLock:  # the wait raises as Ctrl-C would, the lock itself stays the thread's
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            if timeout != -1:
                raise Cut()
            return real.acquire(blocking)

    try:
        calls._returned = CutLock()  # type: ignore[assignment]
        with pytest.raises(Cut):
            calls.run("get", lambda: (gate.wait(10), "stale")[1])
        calls._returned = real
        with pytest.raises(_CallFailed, match=r"\(get\) has not returned"):
            calls.run("next", lambda: "never run")
        gate.set()
        assert calls.settle() == ""
        assert calls.run("next", lambda: "fresh") == "fresh"
    finally:
        gate.set()
        calls.stop(wait=True)
