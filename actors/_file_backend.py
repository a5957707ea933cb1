"""The file backend: pages appended to per-writer segment files under `storage_dir`.

Each backend instance (a writer) appends the records of its pages to segment files of
its own (`_segments.py`: names, records, scans, crash safety). A backup's pages go out
in one write per batch, no file per page: small pages (`RecordBlock.fits`) as a record
block, the batch's records gathered by one copy beside headers built in bulk
(`_record_block.py`); larger ones in one `pwritev` straight from the host runs. A call of
several batches writes each on a helper thread (`IOThreads.start`) while it makes the
next one's records in the other of two blocks (or header sets), and waits for that write
before it claims the next batch: one write in flight, in segment order, so a crash
leaves what a sequential writer would (64 KiB pages: 1.3-1.5x the rate of one batch
after the other). The keys
of a batch are claimed in the index before it is written (`PageIndex.claim`: one dict
probe a key tells a stored or repeated key and indexes a new one) and given back if the
write fails: after each call the index holds only pages written whole. A read is one
`preadv` per run of adjacent records straight into the reserved host slots, verified
there before they count: the headers received must equal,
byte for byte, the headers that the keys and the checksums of the payloads received
give (`Headers`). A run is at most `READ_RUN_BYTES`, so the bytes a `preadv` just
brought in are still in the CPU's cache when they are checksummed. Small pages
(`RecordBlock.stages_reads`: layer_first up to 64 KiB, page_first up to 4 KiB) are read through
a record block instead, a block of records a `preadv`, checksummed in the block and
scattered into the host slots by one copy; verified the same way before they count.

Every instance keeps an index of the pages of its KV shape in every segment of the
directory (`_page_index.py`), least recently used first. It is built by a scan at start
and brought up to date when a key is not in it: a read, `exists` or write scans the
segments other writers may still append to, and lists the directory (new segments,
deleted ones) when its modification time changed since the last listing, or was too
recent then to tell (`LISTING_SETTLED_S`). So a page another process wrote after this one
started is found, and a lookup that misses costs a `stat` of the directory, not a listing
of thousands of segments. A page another instance stored a moment ago may be written
twice (both copies are whole pages; each index keeps one).

`storage_max_bytes` bounds the bytes allocated to the segments of this KV shape (what
`du` counts), within one segment: before a write would pass it, the least recently used
pages are evicted, each by punching its record (and the dead blocks around it) out of
its segment (`fallocate(PUNCH_HOLE)`), and a finished segment with no page left is
deleted. Several instances may share the directory and its bound; each evicts by its
own reads. The bytes are counted as they change (this instance's writes, evictions and
scans); `usage` looks again at a few segments a call, in turn, for the holes other
instances punched. A segment whose writer was killed (its `flock` free, the file
unchanged for `ABANDONED_AFTER_S`) is finished by the instance that lists it next, so
that it goes too (an empty one at once). Once the file system filled before the bound,
each write also makes room in what it has free (`_make_room`).
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Final, NamedTuple

import torch

from hicache.messages.config import Config

from ._errors import InvariantError
from ._kv import KVBuffer, KVShape
from ._io_threads import IOThreads, shares
from ._page_index import PageIndex
from ._record_block import RecordBlock
from ._segments import (
    IOV_MAX,
    Segment,
    blank,
    is_segment,
    preadv_all,
    punch,
    pwritev_all,
    scan,
    seal_name,
    sealed_segment,
    segment_name,
    writer_of,
)
from ._stored_page import (
    PAGE_GONE,
    Headers,
    HostPages,
    PageFormat,
    StorageError,
    StorageIO,
    StorageUsage,
    check_keys,
    log,
    page_starts,
)

SEGMENT_BYTES_MAX: Final = 64 << 20
"""A writer starts a new segment once its current one would pass this (or an eighth of
`storage_max_bytes`, when that is smaller; or what a segment held when a write to it met
the largest file this process may write, `EFBIG`): the unit the size bound may overshoot by."""
READ_RUN_BYTES: Final = 1 << 20
"""Most payload bytes one `preadv` reads (with their headers, a little more; a larger page
is read alone): what it brought in is checksummed before the next one, while it is still in
the CPU's cache. A prefetch step of `storage_batch_mb`'s default is one read: split in two
by its headers, 64 KiB page_first reads took 8-13% longer."""
FDS_OPEN_MAX: Final = 256
"""Segment files kept open for reading; past this the cache of open files is emptied."""
LISTING_SETTLED_S: Final = 0.05
"""A listing trusts the directory's modification time once that is this much older than the
listing (by the file system's clock, which stamps at the kernel's tick: 10 ms at the coarsest):
a file created later then changes it. Until then each lookup that misses lists the directory
again."""
LISTING_SETTLED_WHOLE_S: Final = 2.0
"""`LISTING_SETTLED_S` for a file system that stamps whole seconds (a time without a fraction)."""
RESTATS_PER_USAGE: Final = 64
"""Segments `usage` looks at again per call, in turn: another instance's evictions punch pages
out of segments this one indexes, and show in its total within a bounded number of calls."""
_FULL: Final = frozenset({errno.ENOSPC, errno.EDQUOT})
"""The errors of a file system with no room left (for anyone, or for this user)."""
ABANDONED_AFTER_S: Final = 5.0
"""An unfinished segment whose writer's lock is free is finished (sealed, its torn tail cut off)
once it has not changed for this long."""
_PAGES_PER_CALL_MAX: Final = IOV_MAX // 2
"""Most pages one `preadv`/`pwritev` moves (a header and at least one run each)."""

_WRITERS = itertools.count()
"""Instance number of each backend of this process: with the pid, its writer name."""


def _writer_name() -> str:
    """A name no other writer on this directory has: `<pid>-<instance>-<nonce>`. The pid and
    the instance number tell the writers of one process apart (and order them, for listings);
    the nonce tells apart processes of one pid, which servers in containers of their own
    (each its pid 1) or on other machines sharing the volume are. Two writers of one name
    would take each other's live segment for a finished one (a later sequence number of the
    same writer) and delete it. The nonce is the operating system's randomness, not the
    runtime's: a seeded id would repeat in every process, and the name decides nothing
    but which file a writer appends to."""
    return f"{os.getpid()}-{next(_WRITERS)}-{os.urandom(4).hex()}"


class FileBackend:
    """Pages in per-writer append-only segment files under `config.storage_dir` (module docstring)."""

    name = "file"

    def __init__(self, config: Config) -> None:
        self.root = Path(config.storage_dir)
        self.fmt = PageFormat(KVShape.of(config))
        self.max_bytes = config.storage_max_bytes
        self._writer = _writer_name()
        self._seq = 0
        self._segment_bytes = SEGMENT_BYTES_MAX
        if self.max_bytes:
            self._segment_bytes = max(self.fmt.stored_bytes, min(SEGMENT_BYTES_MAX, self.max_bytes // 8))
        self._index = PageIndex()
        self._current: Segment | None = None
        self._listed_ns = -1
        """The directory's modification time when it was last listed."""
        self._listing_settled = False
        """That time was `LISTING_SETTLED_S` old at the listing: while it is unchanged, no segment
        was created or deleted since (`_directory_changed`)."""
        self._growing: dict[str, Segment] = {}
        """The segments of the last listing that other writers may still append to (not ours,
        not finished, of this KV shape as far as is known): those a lookup that misses scans."""
        self._open: dict[int, Segment] = {}
        """The segments whose file is open (`Segment.fd`), by id: at most `FDS_OPEN_MAX` or so."""
        self._emptied: dict[str, Segment] = {}
        """Finished segments that held no page when last looked at (under `storage_max_bytes`):
        the next eviction deletes those still empty (`_evict_down_to`)."""
        self._restats: list[Segment] = []
        """The segments `usage` has yet to look at again in this turn (last first)."""
        self._evicted = 0
        self._disk_full = False
        """The last write failed because the file system is full (`ENOSPC`, `EDQUOT`)."""
        self._fs_filled = False
        """The file system filled before `storage_max_bytes` once: writes make room on it too."""
        self._file_full = False
        """The last write failed because its segment is as large as this process may write a
        file (`EFBIG`: `ulimit -f`); the segment is finished (`_landed`)."""
        self._errors = 0
        self._hosts: tuple[KVBuffer, HostPages] | None = None
        self._sent = (Headers.allocate(self.fmt, _PAGES_PER_CALL_MAX), Headers.allocate(self.fmt, _PAGES_PER_CALL_MAX))
        """The headers of large pages' records, two sets used in turn (`_records`)."""
        self._blocks: tuple[RecordBlock, RecordBlock] | None = None
        """Made at the first use of pages small enough (`_record_blocks`)."""
        self._received = Headers.allocate(self.fmt, _PAGES_PER_CALL_MAX)
        self._expected = Headers.allocate(self.fmt, _PAGES_PER_CALL_MAX)
        self._threads = IOThreads(config.storage_read_threads, f"hicache-file-read-{self._writer}")
        self._writes = IOThreads(2, f"hicache-file-write-{self._writer}")
        """Its helper writes one batch of records while the caller makes the next (`_append`)."""
        self._block = self._probe_writable()
        self._refresh(listing=True)
        self._make_room(0)

    # -- opening ---------------------------------------------------------------------

    def _probe_writable(self) -> int:
        """Check that the directory can be written; its filesystem's block size."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe.{self._writer}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
            return os.statvfs(self.root).f_bsize or 4096
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
        n = self._index.leading(keys)
        if n < len(keys):
            self._refresh(listing=self._directory_changed())
            n = self._index.leading(keys)
        return n

    def locate(self, key: str) -> tuple[Path, int] | None:
        """Where the record of `key` lies (segment file, offset of its header), or None."""
        found = self._index.locate(key)
        return None if found is None else (found[0].path, found[1] * found[0].record)

    def usage(self) -> StorageUsage:
        """The index's total, which follows this instance's own writes, evictions and scans as
        they happen; the changes other instances make to segments it indexes (their evictions'
        holes) are taken in by looking at `RESTATS_PER_USAGE` segments a call, in turn."""
        index, turn = self._index, self._restats
        if not turn:
            turn.extend(reversed(index.segments()))
        for _ in range(min(RESTATS_PER_USAGE, len(turn))):
            seg = turn.pop()
            if seg.shaped and index.segment(seg.name) is seg:
                self._restat(seg)
        return StorageUsage(stored_bytes=index.allocated, evicted_pages=self._evicted, io_errors=self._errors)

    def check_invariants(self) -> None:
        self._index.check_invariants()
        segments = self._index.segments()
        opened = {seg.id for seg in segments if seg.fd >= 0}
        if opened != set(self._open) or any(self._index.segment(seg.name) is not seg for seg in self._open.values()):
            raise InvariantError(f"file storage: {len(opened)} segments of the index have their file open, the "
                                 f"cache of open files holds {len(self._open)} (every open file is in the cache)")
        for seg in segments:
            if not (seg.ours or seg.sealed or seg.other_shape) and self._growing.get(seg.name) is not seg:
                raise InvariantError(f"file storage: segment {seg.name} may still grow (another writer's, not "
                                     "finished) but is not among those a lookup that misses scans")

    def close(self) -> None:
        current = self._current
        if current is not None and not current.scanned:
            self._delete_segment(current)  # no record landed in it (its writes failed): nothing to keep
        elif current is not None:
            self._seal(current)
        for seg in list(self._open.values()):
            self._close_fd(seg)
        self._index = PageIndex()
        self._current = None
        self._growing, self._emptied, self._restats = {}, {}, []
        self._threads.close()
        self._writes.close()

    def _host_pages(self, host: KVBuffer) -> HostPages:
        if self._hosts is None or self._hosts[0] is not host:
            self._hosts = (host, HostPages(host))
        return self._hosts[1]

    # -- read ------------------------------------------------------------------------------

    def read(self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> StorageIO:
        check_keys(keys)
        starts = page_starts(keys, host, slots)
        pages = self._host_pages(host)
        runs = self._index.runs(keys, _PAGES_PER_CALL_MAX)
        if sum(n for _, _, n in runs) < len(keys):
            self._refresh(listing=self._directory_changed())
            runs = self._index.runs(keys, _PAGES_PER_CALL_MAX)
        done = 0
        for seg, first, n in runs:
            good, error = self._read_run(seg, first, keys[done : done + n], starts[done : done + n], pages)
            done += good
            if error:
                return StorageIO(pages=done, bytes=done * self.fmt.payload_bytes, error=error)
        if done < len(keys):
            return StorageIO(pages=done, bytes=done * self.fmt.payload_bytes,
                             error=f"page {keys[done]} is not in storage")
        return StorageIO(pages=done, bytes=done * self.fmt.payload_bytes)

    def _read_run(
        self, seg: Segment, first: int, keys: Sequence[str], starts: list[int], pages: HostPages
    ) -> tuple[int, str]:
        """Read adjacent records `first ..` of `seg` into the host pages of `keys` and verify
        them there; (leading good pages, error)."""
        received, expected = self._received, self._expected
        block = self._record_block() if RecordBlock.stages_reads(pages) else None
        try:
            if block is not None:
                sums = self._read_staged(seg, first, starts, pages, block)
            else:
                sums = self._read_checksummed(seg, first, pages, starts, received.views)
        except OSError as e:
            self._forget_segment_if_gone(seg, e)
            return 0, f"page {keys[0]}: " + self._error("reading", seg.path, e, keys[0])
        n, whole = len(keys), len(sums)
        expected.fill(keys[:whole] if whole < n else keys, sums)
        if whole == n and received.same(expected, n):
            self._index.touch(seg, first, n)
            return n, ""
        bad, problem = received.first_bad(expected, keys[:whole], sums)
        problem = problem or f"truncated: the segment ends within its record ({seg.path})"
        self._index.touch(seg, first, bad)
        self._release(*self._index.remove(keys[bad]), keys[bad])
        if problem == PAGE_GONE:  # a peer evicted it (or a crash lost it): a miss, not damage
            log.info("storage page gone", backend=self.name, key=keys[bad], path=str(seg.path))
            return bad, f"page {keys[bad]} is not in storage ({problem})"
        log.warning("storage page unusable, dropped", backend=self.name, key=keys[bad], problem=problem,
                    path=str(seg.path))
        return bad, f"page {keys[bad]} is unusable ({problem}); dropped it"

    def _read_checksummed(
        self, seg: Segment, first: int, pages: HostPages, starts: list[int], headers: Sequence[memoryview]
    ) -> list[int]:
        """Read the records of the host pages at `starts` into them (the headers into `headers`)
        in pieces of at most `READ_RUN_BYTES` (a larger page alone), each piece checksummed
        while it is still in the CPU's cache; the checksums of the whole records read (fewer
        than the pages when the segment ends early). Pages of `THREADED_PAGE_BYTES_MIN` or
        more: the pieces, at least one a thread, run on the `storage_read_threads` threads
        (`IOThreads`), each making its own buffers while the others read, and count in order
        up to the first one the file ended in."""
        fd, record, per_page = self._fd(seg), seg.record, 1 + pages.runs_per_page
        per_read = max(1, min(READ_RUN_BYTES // self.fmt.payload_bytes, IOV_MAX // per_page))
        n = len(starts)
        threads = self._threads.threads_for(self.fmt.payload_bytes)
        pieces = shares(n, max(-(-n // per_read), min(threads, n)))

        def piece(ab: tuple[int, int]) -> tuple[int, list[int]]:
            a, b = ab
            payloads = pages.payloads(starts[a:b])
            whole = preadv_all(fd, pages.records(headers[a:b], payloads), (first + a) * record) // record
            return whole, pages.checksums(payloads[:whole])

        sums: list[int] = []
        read = self._threads.map(piece, pieces) if threads > 1 else map(piece, pieces)  # lazily, one by one
        for (a, b), (whole, got) in zip(pieces, read):
            sums += got
            if a + whole < b:  # the file ends here: read no further (on threads: count no further)
                break
        return sums

    def _read_staged(self, seg: Segment, first: int, starts: list[int], pages: HostPages,
                     block: RecordBlock) -> list[int]:
        """`_read_checksummed` through a record block (`RecordBlock.stages_reads`): the records
        read into the block a block at a time, their headers copied into the received ones, their
        payloads checksummed in the block and scattered into the host pages."""
        fd, record, n, h = self._fd(seg), seg.record, len(starts), self.fmt.header_bytes
        sums: list[int] = []
        for a in range(0, n, block.capacity):
            b = min(a + block.capacity, n)
            whole = preadv_all(fd, [block.space(b - a)], (first + a) * record) // record
            got = block.received(whole, self._received.memory[a * h :])
            block.scatter(whole, starts[a : a + whole], pages)
            sums += got
            if a + whole < b:
                break
        return sums

    # -- write -----------------------------------------------------------------------------

    def write(self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> StorageIO:
        """Store the pages of `keys` not stored yet. Under `storage_max_bytes`, a file system
        that fills up before the bound (other files share it) is a bound reached: the least
        recently used pages make room for what is left of the call, which is tried once more,
        and from then on each write makes room on the file system too (`_make_room`)."""
        self._disk_full = self._file_full = False
        io = self._write(keys, host, slots)
        if io.error and self._disk_full and self.max_bytes and len(self._index):
            self._fs_filled = True
            left = len(keys) - io.pages
            evicted = self._evict_down_to(self._index.allocated - left * self.fmt.stored_bytes)
            log.warning("storage full before its bound: evicted the least recently used pages to make room",
                        backend=self.name, path=str(self.root), evicted_pages=evicted, bound_bytes=self.max_bytes)
        elif not (io.error and self._file_full):  # (else its segment is finished: the next write starts another)
            return io
        self._disk_full = self._file_full = False
        again = self._write(keys, host, slots)
        return replace(again, written=io.written + again.written, bytes=io.bytes + again.bytes)

    def _write(self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> StorageIO:
        check_keys(keys)
        starts = page_starts(keys, host, slots)
        pages = self._host_pages(host)
        stored = self._index.leading(keys)
        if stored < len(keys):
            self._refresh(listing=self._directory_changed())  # another instance may have stored some
            stored = self._index.leading(keys)
        if keys and stored == len(keys):
            return StorageIO(pages=len(keys))  # all stored: nothing to make room for, no segment to start
        per_call = self._pages_per_append(pages)
        todo_keys, todo_starts, filtered = keys, starts, False
        b = written = turn = 0
        pending: _Append | None = None
        try:
            while b < len(todo_keys):
                batch, at = todo_keys[b : b + per_call], todo_starts[b : b + per_call]
                bufs = self._records(batch, at, pages, turn)  # while the last batch is being written
                turn ^= 1
                done, pending = pending, None
                written, error = self._settle(done, written)
                if error:
                    return self._write_failed(keys, written, error)
                pending, error = self._append(batch, bufs, last=b + len(batch) >= len(todo_keys))
                if error:
                    return self._write_failed(keys, written, error)
                if pending is not None:
                    b += len(batch)
                elif filtered:
                    raise InvariantError(f"file storage: page index refused new, distinct keys ({batch[0]} ..)")
                else:  # some are stored already or repeated: from here on, write only the others
                    todo_keys, todo_starts = self._unstored(todo_keys[b:], todo_starts[b:])
                    b, filtered = 0, True
            done, pending = pending, None
            written, error = self._settle(done, written)
            if error:
                return self._write_failed(keys, written, error)
        finally:
            if pending is not None:  # an exception on the way: no write is left in flight
                self._landed(pending)
        return StorageIO(pages=len(keys), written=written, bytes=written * self.fmt.payload_bytes)

    def _settle(self, append: _Append | None, written: int) -> tuple[int, str]:
        """Pages written whole so far once `append` (if any) has landed, and its error."""
        if append is None:
            return written, ""
        error = self._landed(append)
        return (written, error) if error else (written + append.pages, "")

    def _write_failed(self, keys: Sequence[str], written: int, error: str) -> StorageIO:
        return StorageIO(pages=self._index.leading(keys), written=written,
                         bytes=written * self.fmt.payload_bytes, error=error)

    def _pages_per_append(self, pages: HostPages) -> int:
        """Pages one `pwritev` takes: a record block's (small pages), else what one call's buffers hold."""
        if RecordBlock.fits(self.fmt):
            return self._record_blocks()[0].capacity
        return min(_PAGES_PER_CALL_MAX, IOV_MAX // (1 + pages.runs_per_page))

    def _unstored(self, keys: Sequence[str], starts: Sequence[int]) -> tuple[list[str], list[int]]:
        """The keys the index does not hold, each once (a key twice in one call is written once), and their pages."""
        seen: set[str] = set()
        todo = [i for i in self._index.missing(keys) if not (keys[i] in seen or seen.add(keys[i]))]
        return [keys[i] for i in todo], [starts[i] for i in todo]

    def _record_block(self) -> RecordBlock | None:
        """Where this backend reads small pages through (None: pages too large for a record block)."""
        return self._record_blocks()[0] if RecordBlock.fits(self.fmt) else None

    def _record_blocks(self) -> tuple[RecordBlock, RecordBlock]:
        """The two record blocks small pages are written through, in turn (made at first use)."""
        if self._blocks is None:
            self._blocks = (RecordBlock(self.fmt), RecordBlock(self.fmt))
        return self._blocks

    def _records(self, keys: list[str], starts: list[int], pages: HostPages, turn: int) -> list[memoryview]:
        """The buffers of the records of these pages, made in the `turn`-th of two sets (the
        other may still be being written): a record block (small pages), or each header
        followed by the page's runs in host memory."""
        if RecordBlock.fits(self.fmt):
            return [self._record_blocks()[turn].fill(keys, starts, pages)]
        payloads = pages.payloads(starts)
        headers = self._sent[turn]
        headers.fill(keys, pages.checksums(payloads))
        return pages.records(headers.views, payloads)

    def _append(self, keys: list[str], bufs: list[memoryview], *, last: bool) -> tuple[_Append | None, str]:
        """Start appending the records of these pages (`bufs`) to this writer's segment in one
        `pwritev`: on the write thread, or (`last` of a call: nothing to make meanwhile) here;
        `_landed` takes its outcome. (the write, error); no write and no error when a key is
        stored already or repeated (`PageIndex.claim`)."""
        need = len(keys) * self.fmt.stored_bytes
        self._make_room(need)
        seg, error = self._writable(need)
        if seg is None:
            return None, f"page {keys[0]}: {error}"
        if not self._index.claim(seg, keys):
            return None, ""
        job = (seg.fd, bufs, seg.scanned)
        if last:
            done: Future[list[None]] = Future()
            try:
                done.set_result([_write_records(job)])
            except OSError as e:
                done.set_exception(e)
        else:
            done = self._writes.start(_write_records, job)
        return _Append(done, seg, keys[0], len(keys)), ""

    def _landed(self, append: _Append) -> str:
        """Wait for an append to end: its records count once written whole; a failed one is
        taken back from the index and cut off the segment. The error ("" when none)."""
        seg = append.segment
        try:
            append.done.result()
        except OSError as e:
            self._index.unclaim(seg, append.pages)
            self._cut_tail(seg)
            self._disk_full = e.errno in _FULL
            self._file_full = e.errno == errno.EFBIG and seg.scanned > 0
            if self._file_full:  # segments from now on stay as large as this one could hold
                self._segment_bytes = seg.scanned
                if seg is self._current:
                    self._seal(seg)
                    self._current = None
            return f"page {append.first_key}: " + self._error("writing", seg.path, e, append.first_key)
        seg.scanned += append.pages * self.fmt.stored_bytes
        self._restat(seg)  # the total follows this writer's bytes as they land (`usage`)
        return ""

    def _writable(self, need: int) -> tuple[Segment | None, str]:
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
                self._seal(seg)
                seg = None
        if seg is not None:
            return seg, ""
        self._current = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            while True:
                name = segment_name(self._writer, self._seq)
                self._seq += 1
                try:
                    fd = os.open(self.root / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                    break
                except FileExistsError:  # another writer has this name: never append after its segments
                    self._writer, self._seq = _writer_name(), 0
            try:  # held while this process lives: a segment of some bytes whose lock is free lost its writer
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                pass  # no locks here: other instances then take this writer for a live one, as before
        except OSError as e:
            self._disk_full = e.errno in _FULL
            return None, self._error("creating a segment in", self.root, e)
        self._current = self._index.new_segment(name, self.root / name, ours=True, record=self.fmt.stored_bytes,
                                                fd=fd)
        self._open[self._current.id] = self._current
        return self._current, ""

    def _seal(self, seg: Segment) -> None:
        """This writer appends no more to `seg`: mark it finished, for every instance (its seal
        file), so that it is deleted once its pages are evicted."""
        seg.sealed = True
        if self.max_bytes and not seg.live:
            self._emptied[seg.name] = seg
        try:
            if seg.fd < 0 or os.fstat(seg.fd).st_nlink:  # not deleted meanwhile
                (self.root / seal_name(seg.name)).touch()
        except FileNotFoundError:
            pass  # its directory was removed, and the segment with it
        except OSError as e:
            self._error("sealing", seg.path, e)

    def _cut_tail(self, seg: Segment) -> None:
        """After a failed append: cut the partial record off, or stop appending to this segment
        (a scan stops at a torn record, so nothing may follow it)."""
        try:
            os.ftruncate(seg.fd, seg.scanned)
        except OSError as e:
            self._error("truncating", seg.path, e)
            self._seal(seg)
            self._current = None

    # -- the index: listing and scans --------------------------------------------------------

    def _directory_changed(self) -> bool:
        """A segment may have been created or deleted since the last listing: the directory's
        modification time changed, or was too recent then to tell (`LISTING_SETTLED_S`)."""
        if not self._listing_settled:
            return True
        try:
            return os.stat(self.root).st_mtime_ns != self._listed_ns
        except OSError:
            return True

    def _refresh(self, listing: bool) -> None:
        """Bring the index up to date: with `listing`, new and deleted segments; then the
        segments other writers may still append to."""
        if listing:
            self._list()
        for seg in list(self._growing.values()):
            if not (seg.sealed or seg.other_shape) and self._index.segment(seg.name) is seg:
                self._scan(seg)
            if seg.sealed or seg.other_shape or self._index.segment(seg.name) is not seg:
                self._growing.pop(seg.name, None)

    def _list(self) -> None:
        try:
            now_ns = time.time_ns()  # (the file system's clock, which stamps the directory)
            listed_ns = os.stat(self.root).st_mtime_ns
            entries = [e.name for e in os.scandir(self.root)]
        except FileNotFoundError:
            # removed under us: every page in it is gone; the next write recreates it
            now_ns, listed_ns, entries = 0, -1, []
        except OSError as e:
            self._error("listing", self.root, e)
            return
        self._listed_ns = listed_ns
        settled_s = LISTING_SETTLED_S if listed_ns % 1_000_000_000 else LISTING_SETTLED_WHOLE_S
        self._listing_settled = now_ns - listed_ns >= settled_s * 1e9
        names = sorted(filter(is_segment, entries))
        present = set(names)
        sealed = {seg for seg in map(sealed_segment, entries) if seg is not None}
        for seg in self._index.segments():
            if seg.name not in present and seg is not self._current:
                self._forget_segment(seg)
        for name in sealed - present:  # its segment was deleted: the seal is left over
            self._unlink(self.root / seal_name(name))
        latest: dict[str, int] = {}
        for name in names:
            writer, seq = writer_of(name)
            latest[writer] = max(latest.get(writer, -1), seq)
        growing: dict[str, Segment] = {}
        for name in names:
            seg = self._index.segment(name) or self._index.new_segment(name, self.root / name)
            writer, seq = writer_of(name)
            # A scan that failed part way is not the last one: the segment is scanned again
            # from there by the next lookup that misses, and finished by a later listing.
            if not (seg.ours or seg.sealed) and (seq < latest[writer] or name in sealed):
                seg.sealed = self._scan(seg)  # its writer moved on, or closed: this scan is its last
            elif not (seg.ours or seg.sealed) and self._writer_died(seg) and self._scan(seg):
                self._finish_abandoned(seg)  # its writer was killed: scanned a last time, finish it for every instance
            if self._index.segment(name) is not seg:
                continue  # gone while it was looked at
            if not (seg.ours or seg.sealed or seg.other_shape):
                growing[name] = seg
            elif self.max_bytes and seg.sealed and not seg.live:
                self._emptied[name] = seg
        self._growing = growing

    def _writer_died(self, seg: Segment) -> bool:
        """The writer of this unfinished segment is gone: its lock (`_writable`) is free, and the
        segment has not changed for `ABANDONED_AFTER_S` (a writer locks it as it creates it; one
        that takes no lock, of an earlier version, is left alone while it appends). An empty
        segment too: its writer was killed before its first record landed, or after a first
        write that failed was cut off."""
        try:
            fd = self._fd(seg)
            if time.time() - os.fstat(fd).st_mtime < ABANDONED_AFTER_S:  # (the file system's clock)
                return False
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held (a live writer), or no locks here
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True

    def _finish_abandoned(self, seg: Segment) -> None:
        """Seal a segment whose writer died, and cut off the torn record it left after its whole
        ones (when the records are of this KV shape, or no header is whole): no instance would.
        An empty one holds nothing for any instance: it is deleted."""
        h = self.fmt.header_bytes
        try:
            fd = self._fd(seg)
            size = os.fstat(fd).st_size
            if not size:
                self._delete_segment(seg)
                return
            if seg.scanned < size and ((seg.record and not seg.other_shape) or size < h):
                os.ftruncate(fd, seg.scanned)
                self._restat(seg)
        except OSError as e:
            self._forget_segment_if_gone(seg, e)
            if self._index.segment(seg.name) is seg:
                self._error("truncating", seg.path, e)
        if self._index.segment(seg.name) is seg:  # (not deleted meanwhile)
            self._seal(seg)

    def _scan(self, seg: Segment) -> bool:
        """Index the whole records `seg` gained since the last scan; whether it read up to the
        end (False: an error stopped it, after the records before it were indexed)."""
        try:
            fd = self._fd(seg)
            st = os.fstat(fd)
            if st.st_size >= seg.scanned + self.fmt.header_bytes:
                index = self._index
                try:
                    scan(seg, fd, st.st_size, self.fmt, lambda key, record: index.take(key, seg, record))
                finally:
                    index.end_scan()
        except OSError as e:
            self._forget_segment_if_gone(seg, e)
            if self._index.segment(seg.name) is seg:
                self._error("scanning", seg.path, e)
                self._index.set_allocated(seg, seg.allocated)  # counted as it is shaped now
            return False
        self._index.set_allocated(seg, st.st_blocks * 512)
        return True

    # -- the index: removal, eviction, accounting ------------------------------------------

    def _make_room(self, need: int) -> None:
        """Evict least recently used pages until `need` more bytes fit within `storage_max_bytes`
        and, once the file system filled before it (`_fs_filled`), in the space the file system
        has free, less a block (a write takes whole blocks)."""
        if not self.max_bytes:
            return
        target = self.max_bytes - need
        if self._fs_filled:
            try:
                st = os.statvfs(self.root)
            except OSError:
                pass  # the write tells (and `write` makes room if it fails for want of it)
            else:
                target = min(target, self._index.allocated + st.f_bavail * st.f_frsize - need - self._block)
        self._evict_down_to(target)

    def _evict_down_to(self, allocated: int) -> int:
        """Evict least recently used pages until the index's segments take at most `allocated`
        bytes (or no page is left); finished segments left without a page are deleted. Pages evicted."""
        index, evicted = self._index, 0
        while len(index) and index.allocated > allocated:
            key = index.oldest()
            self._release(*index.remove(key), key)
            evicted += 1
        self._evicted += evicted
        emptied, self._emptied = self._emptied, {}
        for seg in emptied.values():
            if (index.segment(seg.name) is seg and seg.sealed and not seg.live
                    and (seg.shaped or self._blank(seg))):
                self._delete_segment(seg)
        return evicted

    def _release(self, seg: Segment, record: int, key: str) -> None:
        """Give back the disk space of a record that just died: the segment, when it was its
        last page and no writer appends to it; else the record's blocks."""
        if not seg.live and seg.sealed and seg.shaped:
            self._delete_segment(seg)
            return
        start, end = seg.hole(record, self._block)
        try:
            punch(self._fd(seg), start, end - start)
        except OSError as e:
            if e.errno != errno.EOPNOTSUPP:
                self._forget_segment_if_gone(seg, e)
                self._error("punching a page out of", seg.path, e, key)
            return
        self._restat(seg)

    def _blank(self, seg: Segment) -> bool:
        """A finished segment none of whose records this instance reads holds no page of any
        KV shape: every byte of it reads zero (its pages were punched out before this instance
        first scanned it). Looked at once."""
        if seg.blank is None and not seg.other_shape:
            try:
                fd = self._fd(seg)
                seg.blank = blank(fd, os.fstat(fd).st_size)
            except OSError as e:
                self._forget_segment_if_gone(seg, e)
                return False
        return bool(seg.blank)

    def _delete_segment(self, seg: Segment) -> None:
        if self._unlink(seg.path):
            self._unlink(self.root / seal_name(seg.name))
            self._forget_segment(seg)

    def _unlink(self, path: Path) -> bool:
        """Delete `path` (a segment or a seal); whether it is gone now (it may never have been
        there, or another instance deleted it first). An error is counted and logged."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._error("deleting", path, e)
            return False
        return True

    def _forget_segment_if_gone(self, seg: Segment, e: OSError) -> None:
        if isinstance(e, FileNotFoundError) or e.errno == errno.ESTALE:
            self._forget_segment(seg)

    def _forget_segment(self, seg: Segment) -> None:
        """Drop a segment (deleted, or unreachable) and every page the index had in it."""
        self._index.drop_segment(seg)
        self._close_fd(seg)
        if self._growing.get(seg.name) is seg:
            del self._growing[seg.name]
        if seg is self._current:
            self._current = None

    def _restat(self, seg: Segment) -> None:
        """Count the bytes `seg` takes now; forget it when it was deleted (by another instance,
        or by hand): its pages are misses, and its file, when open here, is let go so that
        its space comes back."""
        try:
            st = os.fstat(self._fd(seg))
        except OSError as e:
            self._forget_segment_if_gone(seg, e)
            if self._index.segment(seg.name) is seg:
                self._error("stat of", seg.path, e)
            return
        if st.st_nlink == 0:
            self._forget_segment(seg)
        else:
            self._index.set_allocated(seg, st.st_blocks * 512)

    # -- files -------------------------------------------------------------------------------

    def _fd(self, seg: Segment) -> int:
        if seg.fd < 0:
            if len(self._open) >= FDS_OPEN_MAX:
                for s in list(self._open.values()):
                    if s is not self._current:
                        self._close_fd(s)
            try:
                seg.fd = os.open(seg.path, os.O_RDWR)  # writable, to punch evicted pages out
            except PermissionError:
                seg.fd = os.open(seg.path, os.O_RDONLY)
            self._open[seg.id] = seg
        return seg.fd

    def _close_fd(self, seg: Segment) -> None:
        if seg.fd >= 0:
            os.close(seg.fd)
            seg.fd = -1
            self._open.pop(seg.id, None)


class _Append(NamedTuple):
    """One batch of records on its way to a segment (`FileBackend._append`)."""

    done: Future[list[None]]
    segment: Segment
    first_key: str
    pages: int


def _write_records(args: tuple[int, list[memoryview], int]) -> None:
    fd, bufs, offset = args
    pwritev_all(fd, bufs, offset)
