"""The file backend's segment files: their names, their records, and the system calls on them.

A segment is a file `seg-<writer>-<seq>.hkv` that one writer (a `FileBackend`
instance, so one KV shape) appends page records to (`PageFormat`: header, then payload),
created with O_EXCL so no two writers ever share one. All records of a segment have the
same size, so record `r` starts at `r x record size`, and a damaged record is skipped
by that size.

A segment is finished (sealed) once its writer appends no more to it: the writer moved
on to a later segment, or closed. It then leaves an empty file
`seg-<writer>-<seq>.sealed` beside the segment, which goes with it. Only a
finished segment is deleted once its pages are all evicted (or, read by an instance that
never saw a page of it, once every byte of it reads zero): a writer may still be
appending to any other. A writer holds an exclusive `flock` on the segment it appends
to; a writer killed before it closed leaves it unfinished, with the lock free, and
another instance finishes it (`FileBackend._finish_abandoned`: the torn tail cut off,
the seal written) once it has not changed for a while.

Crash safety without fsync: a record counts only when its header checks out and its
whole payload lies within the file. A scan stops at the first record that does not,
unless the next header is already there (damage in the middle): so a torn tail, or a
writer still appending, is looked at again by the next scan, and a payload torn by a
power loss fails its checksum when read.
"""

from __future__ import annotations

import ctypes
import errno
import os
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from ._stored_page import PAGE_GONE, PageFormat

PREFIX: Final = "seg-"
SUFFIX: Final = ".hkv"
SEALED: Final = ".sealed"
DUPLICATE: Final = ""
"""`Segment.keys`' mark of a page stored twice whose other copy the index holds: not this
index's, but no dead record either, since the instance that wrote it reads it."""
SCAN_BYTES: Final = 1 << 20
"""A scan reads segments in chunks of this many bytes when records are small."""
IOV_MAX: Final = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
"""Most buffers one `preadv`/`pwritev` takes."""


def segment_name(writer: str, seq: int) -> str:
    return f"{PREFIX}{writer}-{seq:06d}{SUFFIX}"


def is_segment(name: str) -> bool:
    return name.startswith(PREFIX) and name.endswith(SUFFIX)


def seal_name(name: str) -> str:
    """The name of the file that marks segment `name` finished (its writer appends no more)."""
    return name.removesuffix(SUFFIX) + SEALED


def sealed_segment(name: str) -> str | None:
    """The segment whose seal `name` is, or None when it is not a seal."""
    return name.removesuffix(SEALED) + SUFFIX if name.startswith(PREFIX) and name.endswith(SEALED) else None


def writer_of(name: str) -> tuple[str, int]:
    """(writer, sequence number) of a segment named `seg-<writer>-<seq>.hkv` (older writers' names have no nonce)."""
    stem = name.removeprefix(PREFIX).removesuffix(SUFFIX)
    writer, _, seq = stem.rpartition("-")
    return writer, int(seq) if seq.isascii() and seq.isdigit() else 0  # (str.isdigit takes "²", int does not)


@dataclass(slots=True, eq=False)
class Segment:
    id: int
    """Its number in this instance's index (page locations name it)."""
    name: str
    path: Path
    ours: bool = False
    """This instance writes it."""
    sealed: bool = False
    """No writer appends to it any more (its writer moved on to a later one)."""
    scanned: int = 0
    """Bytes of whole records from the start (the scan's position; for ours, the file's end)."""
    keys: list[str | None] = field(default_factory=list)
    """The key of each record the index holds, by record number; `DUPLICATE` for a whole
    page the index found elsewhere first (another instance may be reading this copy);
    None for a dead record (evicted, damaged, torn): only those may be punched out with a
    neighbour (`hole`)."""
    ticks: array = field(default_factory=lambda: array("q"))
    """The recency stamp of each record the index holds, by record number (`PageIndex`; it
    may be shorter than `keys`, a dead record past its end)."""
    live: int = 0
    """Records the index holds."""
    record: int = 0
    """Bytes of each record, once a header told it (or this instance writes it)."""
    shaped: bool = False
    """It holds records of this instance's KV shape (only those segments count toward the bound)."""
    other_shape: bool = False
    """Its writer writes another KV shape: nothing in it is ever a page of this instance."""
    blank: bool | None = None
    """Every byte of it read zero when last looked (None: not looked): a finished segment
    that holds no page of any KV shape (`FileBackend._make_room` deletes it)."""
    allocated: int = 0
    """Bytes allocated to the file (`st_blocks x 512`) when last looked at."""
    counted: int = 0
    """Of those, what the index's total counts: all of them once it is `shaped`, else none
    (`PageIndex.set_allocated`)."""
    fd: int = -1

    def hole(self, record: int, block: int) -> tuple[int, int]:
        """The bytes to punch out once `record` is dead: the record, widened to the file
        blocks on either side whose other records are dead too (those blocks then hold no
        live byte), never past the scanned end (a writer may be appending there)."""
        size = self.record
        start, end = record * size, (record + 1) * size
        lo = start - start % block
        if lo < start and all(self.keys[r] is None for r in range(lo // size, record)):
            start = lo
        hi = min(end + (-end) % block, self.scanned)
        if hi > end and all(self.keys[r] is None for r in range(record + 1, min(len(self.keys), -(-hi // size)))):
            end = hi
        return start, end


def scan(seg: Segment, fd: int, size: int, fmt: PageFormat, found: Callable[[str, int], bool]) -> None:
    """Read the records of `seg` from `seg.scanned` up to `size` bytes, calling `found(key,
    record number)` for each whole record of `fmt`'s KV shape (True: the index took it). An
    OSError leaves `seg` scanned up to the records before it."""
    h = fmt.header_bytes
    off, buf, buf_at = seg.scanned, b"", 0
    while off + h <= size and not seg.other_shape:
        record = seg.record or fmt.stored_bytes
        if off + h > buf_at + len(buf):
            want = h if record >= SCAN_BYTES // 4 else min(SCAN_BYTES, size - off)
            buf, buf_at = os.pread(fd, want, off), off
            if len(buf) < h:
                break
        header = fmt.unpack(buf[off - buf_at : off - buf_at + h])
        if header.readable and not seg.record:  # the first header tells the writer's record size and KV shape
            record = seg.record = h + header.payload_bytes
            seg.other_shape = bool(header.problem)
        # A later header of another size (bytes put there from outside: its writer writes one
        # shape) is damage, skipped by the size the segment's records have.
        readable = header.readable and h + header.payload_bytes == record
        if not readable and off + record + h > size:
            break
        if off + record > size:
            break
        whole = readable and not header.problem and header.key != DUPLICATE  # (a writer's keys are never empty)
        taken = whole and found(header.key, off // record)
        seg.shaped |= whole
        seg.keys.append(header.key if taken else DUPLICATE if whole else None)
        seg.live += taken
        off += record
        seg.scanned = off  # in step with `keys`, record by record: a read that fails leaves them agreeing
        if header.problem == PAGE_GONE:  # punched out: step over the hole to the next record with data
            gone = _gone_records(fd, off, size, record, h)
            seg.keys += [None] * gone
            off += gone * record
            seg.scanned = off


def _gone_records(fd: int, off: int, size: int, record: int, h: int) -> int:
    """How many records from `off` on have their header in a hole of the file (punched
    out: read, they are zeros), each followed by room for another header (as a scan steps
    over a record that is not whole). 0 where holes are not reported (`SEEK_DATA`)."""
    try:
        data = os.lseek(fd, off, os.SEEK_DATA)
    except OSError as e:
        if e.errno != errno.ENXIO:  # ENXIO: no data past `off`
            return 0
        data = size
    return max(0, min((data - h - off) // record + 1, (size - h - off) // record))


# -- system calls ------------------------------------------------------------------------


def blank(fd: int, size: int) -> bool:
    """Every byte of the file's first `size` bytes reads zero. Only the regions holding data
    are read (`SEEK_DATA`/`SEEK_HOLE`; the whole file where they are not supported)."""
    off = 0
    while off < size:
        try:
            start = os.lseek(fd, off, os.SEEK_DATA)
            end = min(size, os.lseek(fd, start, os.SEEK_HOLE))
        except OSError as e:
            if e.errno == errno.ENXIO:
                return True  # no data past `off`
            start, end = off, size
        while start < end:
            chunk = os.pread(fd, min(SCAN_BYTES, end - start), start)
            if not chunk:
                return True
            if chunk.count(0) != len(chunk):
                return False
            start += len(chunk)
        off = end
    return True


_libc = ctypes.CDLL(None, use_errno=True)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def punch(fd: int, offset: int, length: int) -> None:
    """Free the file's blocks wholly inside `offset .. offset + length` (partial ones are zeroed)."""
    if length <= 0:
        return
    if _libc.fallocate(ctypes.c_int(fd), ctypes.c_int(_FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE),
                       ctypes.c_int64(offset), ctypes.c_int64(length)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def preadv_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Fill `bufs` (at most IOV_MAX) from `fd` at `offset` until they are full or the file
    ends; bytes read."""
    want = sum(map(len, bufs))
    total = os.preadv(fd, bufs, offset)
    while 0 < total < want:  # a short read: the file ends here, or the call stopped early
        rest = _after(bufs, total)
        n = os.preadv(fd, rest, offset + total)
        if n == 0:
            break
        total += n
    return total


def pwritev_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    """Write all of `bufs` (at most IOV_MAX) to `fd` at `offset` (a write may take less)."""
    want = sum(map(len, bufs))
    done = os.pwritev(fd, bufs, offset)
    while done < want:
        n = os.pwritev(fd, _after(bufs, done), offset + done)
        if n == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        done += n


def _after(bufs: list[memoryview], skip: int) -> list[memoryview]:
    """What of `bufs` lies past their first `skip` bytes."""
    for i, b in enumerate(bufs):
        if skip < len(b):
            return [b[skip:], *bufs[i + 1 :]]
        skip -= len(b)
    return []
