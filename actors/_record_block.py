"""A batch of page records laid out as a segment file holds them, gathered from host memory.

A write of small pages pays per page for every buffer it hands the kernel and every
Python call it makes; a `RecordBlock` makes those costs per batch instead. One copy
gathers the payloads of the batch's pages from the host buffer into the rows of the
block (a layer_first page's 2 x L runs become one row: `[2, L, pages, run]` copied into
`[pages, 2, L, run]`), each row is checksummed while it is in the CPU's cache, the
batch's headers are built in bulk (`Headers.fill`) and copied into the rows' heads, and
the block goes out in one write: byte for byte the records that a write of each header
and payload in turn gives (`PageFormat`), so readers and scans see no difference.

The copies are numpy's: single-threaded, at a small fixed cost a call. A torch
copy of this size is split across torch's intra-op threads, whose fork and join, on a
machine whose cores are busy with other work, can cost more than the copy.

The block is bounded (`RECORD_BLOCK_BYTES`) so that what the copy brought in is still in
cache for the checksums and the write; pages larger than `STAGED_PAGE_BYTES_MAX` are
written straight from the host runs instead: one more copy of each byte would cost more
than the buffers and calls it saves.

Reads of small pages come back the same way (`stages_reads`): one read of the records
into the block, each payload checksummed in its row (a view made once with the block), the
headers copied out for the batch's comparison, and one copy scattering the rows into the
host (`scatter`, the inverse of the gather). A direct read would hand the kernel a buffer
per run and per header, make a view of each page for its checksum, and stream a page of
several runs through the checksum run by run: for a layer_first page up to
`STAGED_PAGE_BYTES_MAX`, or any page up to `STAGED_READ_BYTES_MAX`, those Python objects
and calls cost more than one more copy of the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import torch
import xxhash

from ._stored_page import Headers, HostPages, PageFormat

RECORD_BLOCK_BYTES: Final = 1 << 20
"""Most payload bytes one block holds (one write; with their headers, a little more): as
many pages as a prefetch step of `storage_batch_mb`'s default reads, in one block."""
STAGED_PAGE_BYTES_MAX: Final = 64 << 10
"""Pages up to this payload size are written through a record block."""
STAGED_READ_BYTES_MAX: Final = 4 << 10
"""Pages of one run (page_first) up to this payload size are read through a record block;
pages of several runs (layer_first) up to `STAGED_PAGE_BYTES_MAX`. Measured alternating in
one process: page_first 2 KiB pages 1.9-2.3 us a page staged against 2.3-2.8 direct, 8 to
32 KiB as fast either way, 64 KiB 12-18% slower staged; layer_first 32 KiB pages of 64 runs
20 against 57 us, 64 KiB 29-34 against 32-40."""


class RecordBlock:
    """Room for the records of up to `capacity` pages of `fmt`, one after another (module docstring)."""

    def __init__(self, fmt: PageFormat, capacity: int = 0) -> None:
        """Room for `capacity` records (0: as many pages as `RECORD_BLOCK_BYTES` holds, at least one)."""
        h, record = fmt.header_bytes, fmt.stored_bytes
        self.fmt = fmt
        self.capacity = capacity or max(1, RECORD_BLOCK_BYTES // fmt.payload_bytes)
        self._rows = np.empty((self.capacity, record), dtype=np.uint8)
        self.address: int = self._rows.ctypes.data
        """Where the block's memory starts (to register it with a storage client)."""
        self._memory = memoryview(self._rows).cast("B")
        self._payloads = [self._memory[i * record + h : (i + 1) * record] for i in range(self.capacity)]
        """Each row's payload, for its checksum."""
        self._headers = Headers.allocate(fmt, self.capacity)
        self._header_rows = np.frombuffer(self._headers.memory, dtype=np.uint8).reshape(self.capacity, h)
        self._host: tuple[HostPages, np.ndarray] | None = None

    @staticmethod
    def fits(fmt: PageFormat) -> bool:
        """Pages of `fmt` are written through a record block."""
        return fmt.payload_bytes <= STAGED_PAGE_BYTES_MAX

    def fill(self, keys: Sequence[str], starts: Sequence[int], pages: HostPages) -> memoryview:
        """The records of the pages of `keys`, whose first host slots are `starts`, as one
        block of bytes (valid until the next `fill`)."""
        n, h = len(keys), self.fmt.header_bytes
        if n != len(starts) or not 0 < n <= self.capacity:
            raise ValueError(f"{n} keys, {len(starts)} pages, room for 1 to {self.capacity} records")
        rows = self._rows[:n]
        _gather(pages, self._bytes_of(pages), starts, rows[:, h:])
        self._headers.fill(keys, list(map(xxhash.xxh3_64_intdigest, self._payloads[:n])))
        rows[:, :h] = self._header_rows[:n]
        return self._memory[: n * self.fmt.stored_bytes]

    @staticmethod
    def stages_reads(pages: HostPages) -> bool:
        """Reads into these host pages go through a record block (module docstring)."""
        if pages.runs_per_page > 1:
            return pages.page_bytes <= STAGED_PAGE_BYTES_MAX
        return pages.page_bytes <= STAGED_READ_BYTES_MAX

    def space(self, n: int) -> memoryview:
        """Room for `n` records, to read them into."""
        return self._memory[: n * self.fmt.stored_bytes]

    @property
    def nbytes(self) -> int:
        return self._rows.nbytes

    def addresses(self, n: int) -> list[int]:
        """Where each of the first `n` records starts in memory."""
        return list(range(self.address, self.address + n * self.fmt.stored_bytes, self.fmt.stored_bytes))

    def received(self, n: int, headers: memoryview) -> list[int]:
        """For the first `n` records read into the block: their headers copied into `headers`,
        one after another, and the checksums of their payloads."""
        h = self.fmt.header_bytes
        np.frombuffer(headers, dtype=np.uint8, count=n * h).reshape(n, h)[...] = self._rows[:n, :h]
        return list(map(xxhash.xxh3_64_intdigest, self._payloads[:n]))

    def scatter(self, n: int, starts: Sequence[int], pages: HostPages) -> None:
        """Copy the payloads of the first `n` records into the host pages whose first slots are `starts`."""
        if n:
            _place(pages, self._bytes_of(pages), starts[:n], self._rows[:n, self.fmt.header_bytes :])

    def _bytes_of(self, pages: HostPages) -> np.ndarray:
        """The host buffer's bytes (kept for the buffer last written from or read into)."""
        if self._host is None or self._host[0] is not pages:
            self._host = (pages, pages.host.tensor.view(-1).view(torch.uint8).numpy())
        return self._host[1]


def _gather(pages: HostPages, raw: np.ndarray, starts: Sequence[int], into: np.ndarray) -> None:
    """Copy the payloads (`[2, L, P, H, D]` bytes) of the host pages whose first slots are
    `starts` into the rows of `into` (`[len(starts), payload bytes]`); `raw` is the host
    buffer's bytes. One copy, straight from the host buffer when the pages are adjacent there."""
    pick, rows, host = _views(pages, raw, starts, into)
    rows[...] = host[pick]


def _place(pages: HostPages, raw: np.ndarray, starts: Sequence[int], rows: np.ndarray) -> None:
    """The inverse of `_gather`: copy the rows of `rows` into the payloads of the host pages
    whose first slots are `starts`. One copy, straight into the host buffer."""
    pick, rows, host = _views(pages, raw, starts, rows)
    host[pick] = rows


def _views(pages: HostPages, raw: np.ndarray, starts: Sequence[int],
           rows: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray]:
    """(an index of the pages, the rows, the host buffer), the rows and the indexed host
    buffer of one shape: the rows as they are and the buffer as `[pages, payload]`
    (page_first), or the rows as `[2, L, pages, run]` views of `[pages, 2, L, run]` and the
    pages indexed on that axis (layer_first). The pages are a slice when they are adjacent
    in the host buffer, else a list."""
    host, n = pages.host, len(starts)
    p, layers = host.shape.page_size, host.shape.layers
    first, last = starts[0], starts[-1]
    adjacent = last - first == (n - 1) * p and list(starts) == list(range(first, last + 1, p))
    pick = slice(first // p, first // p + n) if adjacent else [a // p for a in starts]
    if host.page_first:
        return pick, rows, raw.reshape(host.slots // p, -1)
    # [2, L, pages, run] in the host, [pages, 2, L, run] in the records: indexed by page on axis 2
    staged = np.reshape(rows, (n, 2, layers, -1), copy=False).transpose(1, 2, 0, 3)
    return (slice(None), slice(None), pick), staged, raw.reshape(2, layers, host.slots // p, -1)
