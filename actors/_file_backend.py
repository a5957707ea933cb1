"""The file backend: pages appended to per-writer segment files under `storage_dir`.

Each backend instance (a writer) appends the records of its pages (`PageFormat`: header,
then payload) to segment files of its own, `seg-<pid>-<instance>-<seq>.hkv`, created
with O_EXCL so no two writers ever share one. A backup's pages go out in one `pwritev`
per batch straight from the host runs (no staging copy, no file per page), and a read
is one `preadv` per run of adjacent records straight into the reserved host slots,
verified there (`HostPages`, `checksum`).

Every instance keeps an index of the pages of its KV shape in every segment of the
directory (key -> segment, offset, checksum), in least-recently-used order. It is built
by a scan at start and brought up to date by a rescan (new segments, grown tails) when
a key is not in it: so a page another process wrote after this one started is found.
Records of another KV shape are skipped (another model's pages: a miss, never a hit).

Crash safety without fsync: a record counts only when its header checks out and its
whole payload lies within the file; a scan stops at the first record that does not
(a torn tail, or a writer still appending), and a payload torn by a power loss fails
its checksum at read. So a crash never leaves a page that verifies wrong, and a restart
finds every complete page.

`storage_max_bytes` bounds the bytes allocated to the segments of this KV shape (what
`du` counts), within one segment: before a write would pass it, the least recently used
pages are evicted, each by punching its record (and any dead bytes around it) out of its
segment (`fallocate(PUNCH_HOLE)`), and a finished segment with no page left is deleted.
Several instances may share the directory and its bound; each evicts by its own reads.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import torch

from hicache.runtime.config import Config

from ._kv import KVBuffer, KVShape
from ._stored_page import (
    HostPages,
    PageFormat,
    StorageError,
    StorageIO,
    StorageUsage,
    check_keys,
    checksum,
    log,
    page_starts,
)

SEGMENT_BYTES_MAX: Final = 64 << 20
"""A writer starts a new segment once its current one would pass this (or an eighth of
`storage_max_bytes`, when that is smaller): the unit the size bound may overshoot by."""
SCAN_BYTES: Final = 1 << 20
"""A scan reads segments in chunks of this many bytes when records are small."""
IOV_MAX: Final = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
"""Most buffers one `preadv`/`pwritev` takes."""
FDS_OPEN_MAX: Final = 256
"""Segment files kept open for reading; past this the cache of open files is emptied."""

_WRITERS = itertools.count()
"""Instance number of each backend of this process: with the pid, its writer name."""

_libc = ctypes.CDLL(None, use_errno=True)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def _punch(fd: int, offset: int, length: int) -> None:
    """Free the file's blocks wholly inside `offset .. offset + length` (partial ones are zeroed)."""
    if length <= 0:
        return
    if _libc.fallocate(ctypes.c_int(fd), ctypes.c_int(_FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE),
                       ctypes.c_int64(offset), ctypes.c_int64(length)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


@dataclass(slots=True, eq=False)
class _Segment:
    name: str
    path: Path
    ours: bool = False
    """This backend writes it."""
    sealed: bool = False
    """No writer appends to it any more (its writer moved on to a later one)."""
    scanned: int = 0
    """Bytes of whole records from the start (the scan's position; for ours, the file's end)."""
    live: list[int] = field(default_factory=list)
    """Offsets of the records the index holds, ascending."""
    keys: dict[int, str] = field(default_factory=dict)
    """The key of the record at each offset of `live`."""
    allocated: int = 0
    """Bytes allocated to the file (`st_blocks * 512`) when last looked at."""
    shaped: bool = False
    """It holds records of this instance's KV shape (only those segments count toward the bound)."""
    record: int = 0
    """Bytes of each of its records (one writer writes one KV shape), once a header told it."""
    fd: int = -1


@dataclass(slots=True, eq=False)
class _Page:
    segment: _Segment
    offset: int
    """Where its record (header first) starts."""
    checksum: int


class FileBackend:
    """Pages in per-writer append-only segment files under `config.storage_dir` (module docstring)."""

    name = "file"

    def __init__(self, config: Config) -> None:
        self.root = Path(config.storage_dir)
        self.fmt = PageFormat(KVShape.of(config))
        self.max_bytes = config.storage_max_bytes
        self._writer = f"{os.getpid()}-{next(_WRITERS)}"
        self._seq = 0
        self._segment_bytes = SEGMENT_BYTES_MAX
        if self.max_bytes:
            self._segment_bytes = max(self.fmt.stored_bytes, min(SEGMENT_BYTES_MAX, self.max_bytes // 8))
        self._segments: dict[str, _Segment] = {}
        self._index: OrderedDict[str, _Page] = OrderedDict()
        """The pages of this KV shape found in the segments, least recently used first."""
        self._current: _Segment | None = None
        self._allocated = 0
        self._evicted = 0
        self._errors = 0
        self._hosts: tuple[KVBuffer, HostPages] | None = None
        self._headers = bytearray()
        self._probe_writable()
        self._refresh()
        self._make_room(0)

    # -- opening ---------------------------------------------------------------------

    def _probe_writable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe.{self._writer}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise StorageError(
                f"file storage directory {str(self.root)!r} cannot be created or written ({e}); "
                "check that the path is a directory this process may write (storage_dir)"
            ) from e

    def _error(self, what: str, path: Path | str, e: OSError, key: str = "") -> str:
        """Count and log one OS error; the text for `StorageIO.error`."""
        self._errors += 1
        log.error("storage os error", backend=self.name, call=what, path=str(path), key=key, error=str(e))
        return f"{what} {path} failed: {e}"

    # -- the public calls ------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> int:
        check_keys(keys)
        n = self._leading(keys)
        if n < len(keys):
            self._refresh()
            n = self._leading(keys)
        return n

    def _leading(self, keys: Sequence[str]) -> int:
        index = self._index
        for i, key in enumerate(keys):
            if key not in index:
                return i
        return len(keys)

    def locate(self, key: str) -> tuple[Path, int] | None:
        """Where the record of `key` lies (segment file, offset of its header), or None."""
        page = self._index.get(key)
        return None if page is None else (page.segment.path, page.offset)

    def usage(self) -> StorageUsage:
        return StorageUsage(stored_bytes=self._allocated, evicted_pages=self._evicted, io_errors=self._errors)

    def close(self) -> None:
        for seg in self._segments.values():
            self._close_fd(seg)
        self._segments.clear()
        self._index.clear()
        self._current = None

    def _host_pages(self, host: KVBuffer) -> HostPages:
        if self._hosts is None or self._hosts[0] is not host:
            self._hosts = (host, HostPages(host))
        return self._hosts[1]

    def _header_views(self, n: int) -> list[memoryview]:
        h = self.fmt.header_bytes
        if len(self._headers) < n * h:
            self._headers = bytearray(n * h)
        m = memoryview(self._headers)
        return [m[i * h : (i + 1) * h] for i in range(n)]

    # -- read ------------------------------------------------------------------------------

    def read(self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> StorageIO:
        check_keys(keys)
        starts = page_starts(keys, host, slots)
        pages = self._host_pages(host)
        if self._leading(keys) < len(keys):
            self._refresh()
        done = 0
        for group in self._runs_of_records(keys, pages.runs_per_page):
            good, error = self._read_group(keys, starts, done, group, pages)
            done += good
            if error:
                return StorageIO(pages=done, bytes=done * self.fmt.payload_bytes, error=error)
        if done < len(keys):
            return StorageIO(pages=done, bytes=done * self.fmt.payload_bytes,
                             error=f"page {keys[done]} is not in storage")
        return StorageIO(pages=done, bytes=done * self.fmt.payload_bytes)

    def _runs_of_records(self, keys: Sequence[str], runs_per_page: int) -> list[list[_Page]]:
        """The leading indexed pages of `keys`, grouped into runs of adjacent records of one
        segment that one `preadv` can read (at most IOV_MAX buffers)."""
        per_call = max(1, IOV_MAX // (1 + runs_per_page))
        stored = self.fmt.stored_bytes
        groups: list[list[_Page]] = []
        for key in keys:
            page = self._index.get(key)
            if page is None:
                break
            last = groups[-1][-1] if groups else None
            if (last is not None and last.segment is page.segment and last.offset + stored == page.offset
                    and len(groups[-1]) < per_call):
                groups[-1].append(page)
            else:
                groups.append([page])
        return groups

    def _read_group(
        self, keys: Sequence[str], starts: list[int], first: int, group: list[_Page], pages: HostPages
    ) -> tuple[int, str]:
        """Read one run of records into the host pages of keys `first ..` and verify them
        there; (leading good pages, error)."""
        seg = group[0].segment
        headers = self._header_views(len(group))
        blocks = [pages.blocks(starts[first + i]) for i in range(len(group))]
        bufs = [b for i in range(len(group)) for b in (headers[i], *blocks[i])]
        try:
            got = _preadv_all(self._fd(seg), bufs, group[0].offset)
        except OSError as e:
            self._forget_segment_if_gone(seg, e)
            return 0, f"page {keys[first]}: " + self._error("reading", seg.path, e, keys[first])
        for i, page in enumerate(group):
            key = keys[first + i]
            if got < (i + 1) * self.fmt.stored_bytes:
                problem = f"truncated: the segment ends within its record ({seg.path})"
            else:
                problem = self.fmt.problem(key, headers[i], checksum(blocks[i]))
            if problem:
                self._drop(key, page, problem)
                return i, f"page {key} is unusable ({problem}); dropped it"
            self._index.move_to_end(key)
        return len(group), ""

    def _drop(self, key: str, page: _Page, problem: str) -> None:
        log.warning("storage page unusable, dropped", backend=self.name, key=key, problem=problem,
                    path=str(page.segment.path))
        self._remove(key, page)

    # -- write -----------------------------------------------------------------------------

    def write(self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> StorageIO:
        check_keys(keys)
        starts = page_starts(keys, host, slots)
        pages = self._host_pages(host)
        if self._leading(keys) < len(keys) or any(k not in self._index for k in keys):
            self._refresh()  # another instance may have stored some since
        todo = [i for i, key in enumerate(keys) if key not in self._index]
        per_call = max(1, IOV_MAX // (1 + pages.runs_per_page))
        written = 0
        for b in range(0, len(todo), per_call):
            batch = todo[b : b + per_call]
            error = self._append([keys[i] for i in batch], [starts[i] for i in batch], pages)
            if error:
                return StorageIO(pages=self._leading(keys), written=written,
                                 bytes=written * self.fmt.payload_bytes, error=error)
            written += len(batch)
        return StorageIO(pages=len(keys), written=written, bytes=written * self.fmt.payload_bytes)

    def _append(self, keys: list[str], starts: list[int], pages: HostPages) -> str:
        """Append the records of these pages to this writer's segment in one `pwritev`."""
        fmt = self.fmt
        headers = self._header_views(len(keys))
        bufs: list[memoryview] = []
        sums = []
        for key, start, header in zip(keys, starts, headers, strict=True):
            blocks = pages.blocks(start)
            sums.append(checksum(blocks))
            fmt.pack(header, key, sums[-1])
            bufs += (header, *blocks)
        need = len(keys) * fmt.stored_bytes
        self._make_room(need)
        seg, error = self._writable(need)
        if seg is None:
            return f"page {keys[0]}: {error}"
        try:
            _pwritev_all(seg.fd, bufs, seg.scanned)
        except OSError as e:
            self._cut_tail(seg)
            return f"page {keys[0]}: " + self._error("writing", seg.path, e, keys[0])
        for i, key in enumerate(keys):
            offset = seg.scanned + i * fmt.stored_bytes
            self._index[key] = _Page(seg, offset, sums[i])
            seg.live.append(offset)
            seg.keys[offset] = key
        seg.scanned += need
        self._restat(seg)
        return ""

    def _writable(self, need: int) -> tuple[_Segment | None, str]:
        """This writer's segment with room for `need` more bytes: a new one when there is none,
        it is full, or it was deleted (its directory too: recreated)."""
        seg = self._current
        if seg is not None:
            try:
                gone = os.fstat(seg.fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                self._forget_segment(seg)
                seg = None
            elif seg.scanned and seg.scanned + need > self._segment_bytes:
                seg.sealed = True
                seg = None
        if seg is not None:
            return seg, ""
        self._current = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            while True:
                name = f"seg-{self._writer}-{self._seq:06d}.hkv"
                self._seq += 1
                try:
                    fd = os.open(self.root / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                    break
                except FileExistsError:
                    continue  # a writer of an earlier process with this pid left it
        except OSError as e:
            return None, self._error("creating a segment in", self.root, e)
        seg = _Segment(name, self.root / name, ours=True, shaped=True, fd=fd)
        self._segments[name] = seg
        self._current = seg
        return seg, ""

    def _cut_tail(self, seg: _Segment) -> None:
        """After a failed append: cut the partial record off, or stop appending to this segment
        (a scan stops at a torn record, so nothing may follow it)."""
        try:
            os.ftruncate(seg.fd, seg.scanned)
        except OSError as e:
            self._error("truncating", seg.path, e)
            seg.sealed = True
            self._current = None

    # -- the index: scans ---------------------------------------------------------------

    def _refresh(self) -> None:
        """Bring the index up to date with the directory: new segments, grown ones, deleted ones."""
        try:
            names = sorted((e.stat().st_mtime_ns, e.name) for e in os.scandir(self.root)
                           if e.name.startswith("seg-") and e.name.endswith(".hkv") and e.is_file())
        except FileNotFoundError:
            names = []  # removed under us: every page in it is gone; the next write recreates it
        except OSError as e:
            self._error("listing", self.root, e)
            return
        present = {name for _, name in names}
        for seg in [s for s in self._segments.values() if s.name not in present and s is not self._current]:
            self._forget_segment(seg)
        latest: dict[str, int] = {}
        for _, name in names:
            writer, seq = _writer_of(name)
            latest[writer] = max(latest.get(writer, -1), seq)
        for _, name in names:
            seg = self._segments.get(name)
            if seg is None:
                seg = self._segments[name] = _Segment(name, self.root / name)
            if seg.ours:
                continue
            writer, seq = _writer_of(name)
            if not seg.sealed:
                self._scan(seg)
                seg.sealed = seq < latest[writer]  # its writer moved on: it no longer grows

    def _scan(self, seg: _Segment) -> None:
        """Index the whole records of `seg` past `seg.scanned`."""
        try:
            fd = self._fd(seg)
            size = os.fstat(fd).st_size
            self._scan_records(seg, fd, size)
        except OSError as e:
            self._forget_segment_if_gone(seg, e)
            if seg.name in self._segments:
                self._error("scanning", seg.path, e)
            return
        self._restat(seg)

    def _scan_records(self, seg: _Segment, fd: int, size: int) -> None:
        """Index the records from `seg.scanned` on. A header that does not check out is skipped
        by the segment's record size when the next header is there (damage in the middle);
        otherwise the scan stops there (a torn tail, or a writer still appending) and the
        next scan looks again."""
        fmt = self.fmt
        h = fmt.header_bytes
        off, buf, buf_at = seg.scanned, b"", 0
        while off + h <= size:
            record = seg.record or fmt.stored_bytes
            if off + h > buf_at + len(buf):
                want = h if record >= SCAN_BYTES // 4 else min(SCAN_BYTES, size - off)
                buf, buf_at = os.pread(fd, want, off), off
                if len(buf) < h:
                    break
            header = fmt.unpack(buf[off - buf_at : off - buf_at + h])
            if header.readable:
                record = seg.record = h + header.payload_bytes
            elif off + record + h > size:
                break
            if off + record > size:
                break
            if not header.problem:
                seg.shaped = True
                if header.key not in self._index:
                    self._index[header.key] = _Page(seg, off, header.checksum)
                    seg.live.append(off)
                    seg.keys[off] = header.key
            off += record
        seg.scanned = off

    # -- the index: removal, eviction, accounting ------------------------------------------

    def _remove(self, key: str, page: _Page) -> None:
        """Take `key` out of the index and punch its record (and the dead bytes around it) out."""
        del self._index[key]
        seg = page.segment
        live = seg.live
        i = bisect_left(live, page.offset)
        del live[i]
        del seg.keys[page.offset]
        start = live[i - 1] + self.fmt.stored_bytes if i > 0 else 0
        end = live[i] if i < len(live) else seg.scanned
        if not live and seg.sealed and seg.shaped:
            self._delete_segment(seg)
            return
        try:
            _punch(self._fd(seg), start, end - start)
        except OSError as e:
            if e.errno != errno.EOPNOTSUPP:
                self._forget_segment_if_gone(seg, e)
                self._error("punching a page out of", seg.path, e, key)
            return
        self._restat(seg)

    def _make_room(self, need: int) -> None:
        """Evict least recently used pages until `need` more bytes fit within `storage_max_bytes`."""
        if not self.max_bytes:
            return
        while self._index and self._allocated + need > self.max_bytes:
            key, page = next(iter(self._index.items()))
            self._remove(key, page)
            self._evicted += 1
        for seg in [s for s in self._segments.values() if s.shaped and s.sealed and not s.live]:
            self._delete_segment(seg)

    def _delete_segment(self, seg: _Segment) -> None:
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            pass  # another instance deleted it first
        except OSError as e:
            self._error("deleting", seg.path, e)
            return
        self._forget_segment(seg)

    def _forget_segment_if_gone(self, seg: _Segment, e: OSError) -> None:
        if isinstance(e, FileNotFoundError) or e.errno == errno.ESTALE:
            self._forget_segment(seg)

    def _forget_segment(self, seg: _Segment) -> None:
        """Drop a segment (deleted, or unreachable) and every page the index had in it."""
        for key in seg.keys.values():
            del self._index[key]
        seg.live.clear()
        seg.keys.clear()
        self._set_allocated(seg, 0)
        self._close_fd(seg)
        self._segments.pop(seg.name, None)
        if seg is self._current:
            self._current = None

    def _restat(self, seg: _Segment) -> None:
        try:
            self._set_allocated(seg, os.fstat(self._fd(seg)).st_blocks * 512)
        except OSError as e:
            self._error("stat of", seg.path, e)

    def _set_allocated(self, seg: _Segment, allocated: int) -> None:
        if seg.shaped:
            self._allocated += allocated - seg.allocated
        seg.allocated = allocated

    # -- files -------------------------------------------------------------------------------

    def _fd(self, seg: _Segment) -> int:
        if seg.fd < 0:
            if sum(s.fd >= 0 for s in self._segments.values()) >= FDS_OPEN_MAX:
                for s in self._segments.values():
                    if s is not self._current:
                        self._close_fd(s)
            try:
                seg.fd = os.open(seg.path, os.O_RDWR)  # writable, to punch evicted pages out
            except PermissionError:
                seg.fd = os.open(seg.path, os.O_RDONLY)
        return seg.fd

    def _close_fd(self, seg: _Segment) -> None:
        if seg.fd >= 0:
            os.close(seg.fd)
            seg.fd = -1


def _writer_of(name: str) -> tuple[str, int]:
    """(writer, sequence number) of a segment named `seg-<pid>-<instance>-<seq>.hkv`."""
    stem = name.removeprefix("seg-").removesuffix(".hkv")
    writer, _, seq = stem.rpartition("-")
    return writer, int(seq) if seq.isdigit() else 0


def _preadv_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Fill `bufs` from `fd` at `offset` until they are full or the file ends; bytes read."""
    total, i = 0, 0
    while i < len(bufs):
        n = os.preadv(fd, bufs[i : i + IOV_MAX], offset + total)
        if n == 0:
            break
        total += n
        while i < len(bufs) and n >= len(bufs[i]):
            n -= len(bufs[i])
            i += 1
        if n:
            bufs[i] = bufs[i][n:]
    return total


def _pwritev_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    """Write all of `bufs` to `fd` at `offset` (a write may take less)."""
    i = 0
    while i < len(bufs):
        n = os.pwritev(fd, bufs[i : i + IOV_MAX], offset)
        if n == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while i < len(bufs) and n >= len(bufs[i]):
            n -= len(bufs[i])
            i += 1
        if n:
            bufs[i] = bufs[i][n:]
