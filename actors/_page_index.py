"""The file backend's index: where each page of its KV shape lies in the segments of its
directory, least recently used first, and the bytes those segments take.

A dict maps a key to an int, the segment's number and the record's (`_SHIFT`); each
segment lists the key of each of its records (`Segment.keys`). So a page costs the
index one dict entry, one int and one list slot: no object per page, and a segment that
vanishes takes its pages out by its own list.

Recency without a node per page: a page that was never read since it was indexed is as
recent as the call that indexed it, and those calls are a queue of record ranges
(`_fresh`, one entry per write or scan); a page that was read moves to an ordered dict
of read pages (`_read`), least recently read first. The least recently used page is the
older of the two heads, by the number of the call (`_tick`) that last used it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from ._errors import InvariantError
from ._segments import Segment

_SHIFT: Final = 32
_RECORD: Final = (1 << _SHIFT) - 1


class PageIndex:
    """The pages of one KV shape in a directory's segments (module docstring)."""

    def __init__(self) -> None:
        self._where: dict[str, int] = {}
        """Key -> segment number << _SHIFT | record number."""
        self._fresh: deque[list[int]] = deque()
        """[tick, segment number, next record, end record] of the records each write or scan
        indexed, oldest first; `next record` moves on as the head's pages are evicted."""
        self._read: OrderedDict[str, int] = OrderedDict()
        """Key -> tick of its last read, for the pages read since they were indexed; least recent first."""
        self._tick = 0
        self._by_id: dict[int, Segment] = {}
        self._by_name: dict[str, Segment] = {}
        self._ids = itertools.count()
        self.allocated = 0
        """Bytes allocated to the segments that hold pages of this KV shape."""

    # -- segments ----------------------------------------------------------------------------

    def new_segment(self, name: str, path: Path, *, ours: bool = False, record: int = 0, fd: int = -1) -> Segment:
        seg = Segment(next(self._ids), name, path, ours=ours, record=record, shaped=ours, fd=fd)
        self._by_id[seg.id] = seg
        self._by_name[name] = seg
        return seg

    def segment(self, name: str) -> Segment | None:
        return self._by_name.get(name)

    def segments(self) -> list[Segment]:
        return list(self._by_name.values())

    def drop_segment(self, seg: Segment) -> None:
        """Forget a segment (deleted, or unreachable) and every page the index had in it."""
        where, read = self._where, self._read
        for key in seg.keys:
            if key is not None:
                del where[key]
                read.pop(key, None)
        seg.keys.clear()
        seg.live = 0
        self.set_allocated(seg, 0)
        del self._by_id[seg.id]
        del self._by_name[seg.name]

    def set_allocated(self, seg: Segment, allocated: int) -> None:
        if seg.shaped:
            self.allocated += allocated - seg.allocated
        seg.allocated = allocated

    # -- pages ---------------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def leading(self, keys: Sequence[str]) -> int:
        """How many leading keys the index holds."""
        where = self._where
        for i, key in enumerate(keys):
            if key not in where:
                return i
        return len(keys)

    def missing(self, keys: Sequence[str]) -> list[int]:
        """The positions of the keys the index does not hold."""
        where = self._where
        return [i for i, key in enumerate(keys) if key not in where]

    def runs(self, keys: Sequence[str], pages_max: int) -> list[tuple[Segment, int, int]]:
        """(segment, first record, records) of each run of adjacent records that holds the
        leading indexed keys, in key order, at most `pages_max` records each."""
        where = self._where
        out, run_at, n = [], -1, 0
        for key in keys:
            loc = where.get(key)
            if loc is None:
                break
            if n and loc == run_at + n and n < pages_max:
                n += 1
                continue
            if n:
                out.append((self._by_id[run_at >> _SHIFT], run_at & _RECORD, n))
            run_at, n = loc, 1
        if n:
            out.append((self._by_id[run_at >> _SHIFT], run_at & _RECORD, n))
        return out

    def locate(self, key: str) -> tuple[Segment, int] | None:
        loc = self._where.get(key)
        return None if loc is None else (self._by_id[loc >> _SHIFT], loc & _RECORD)

    def take(self, key: str, seg: Segment, record: int) -> bool:
        """Index `key` at `record` of `seg` (found by a scan) unless it is indexed already;
        whether it took it. (The caller appends to `seg.keys`.)"""
        if key in self._where:
            return False
        self._where[key] = seg.id << _SHIFT | record
        last = self._fresh[-1] if self._fresh else None
        if last is not None and last[0] == self._tick and last[1] == seg.id and last[3] == record:
            last[3] += 1
        else:
            self._fresh.append([self._tick, seg.id, record, record + 1])
        return True

    def end_scan(self) -> None:
        """The pages a scan took are as recent as each other; later calls are more recent."""
        self._tick += 1

    def append(self, seg: Segment, keys: Sequence[str]) -> None:
        """Index keys not yet indexed, written as the next records of `seg`."""
        if not self.claim(seg, keys):
            raise InvariantError(f"page index: appending {len(keys)} keys to {seg.name}, some of them indexed "
                                 "already or repeated (write only the keys `missing` gives, each once)")

    def claim(self, seg: Segment, keys: Sequence[str]) -> bool:
        """Index `keys` as the next records of `seg`, about to be written there, when none of
        them is indexed and none is repeated; whether it did (else the index is unchanged).
        One dict probe a key, for the test and the entry both; `unclaim` takes it back."""
        n, first = len(keys), len(seg.keys)
        loc = seg.id << _SHIFT | first
        locs = list(range(loc, loc + n))
        where = self._where
        got = list(map(where.setdefault, keys, locs))
        if got != locs:  # a key held elsewhere, or a repeat given the location of its first
            for key, mine, found in zip(keys, locs, got):
                if found == mine:
                    del where[key]
            return False
        seg.keys += keys
        seg.live += n
        self._fresh.append([self._tick, seg.id, first, first + n])
        self._tick += 1
        return True

    def unclaim(self, seg: Segment, n: int) -> None:
        """Take back the last `claim`, of the `n` last records of `seg`: their write failed."""
        last = self._fresh[-1] if self._fresh else None
        if last is None or last[1] != seg.id or last[3] != len(seg.keys) or last[3] - last[2] != n:
            raise InvariantError(f"page index: unclaim of {n} records of {seg.name} that its last claim did not add")
        self._fresh.pop()
        for key in seg.keys[-n:]:
            del self._where[key]
        del seg.keys[-n:]
        seg.live -= n

    def touch(self, keys: Sequence[str]) -> None:
        """`keys` were read: the most recently used now."""
        read, tick = self._read, self._tick
        self._tick += 1
        read.update(zip(keys, itertools.repeat(tick)))
        deque(map(read.move_to_end, keys), maxlen=0)

    def oldest(self) -> str:
        """The least recently used page's key (the index must not be empty)."""
        fresh, read = self._fresh, self._read
        while fresh:
            head = fresh[0]
            seg = self._by_id.get(head[1])
            if seg is not None:
                keys, r, end = seg.keys, head[2], head[3]
                while r < end and (keys[r] is None or keys[r] in read):
                    r += 1  # evicted, dropped, or read since: not this range's to give
                head[2] = r
                if r < end:
                    first_read = next(iter(read), None)
                    if first_read is not None and read[first_read] < head[0]:
                        return first_read
                    return keys[r]  # type: ignore[return-value]
            fresh.popleft()
        return next(iter(read))

    def remove(self, key: str) -> tuple[Segment, int]:
        """Take `key` out; (segment, record) where its page was, now a dead record."""
        loc = self._where.pop(key)
        self._read.pop(key, None)
        seg, record = self._by_id[loc >> _SHIFT], loc & _RECORD
        seg.keys[record] = None
        seg.live -= 1
        return seg, record

    def check_invariants(self) -> None:
        for key, loc in self._where.items():
            seg = self._by_id.get(loc >> _SHIFT)
            if seg is None or seg.keys[loc & _RECORD] != key:
                raise InvariantError(f"page index: {key!r} points at a record that does not hold it")
        for seg in self._by_name.values():
            live = sum(k is not None for k in seg.keys)
            if live != seg.live or self._by_id.get(seg.id) is not seg:
                raise InvariantError(f"page index: segment {seg.name} counts {seg.live} live records, holds {live}")
            if seg.shaped and seg.scanned != len(seg.keys) * seg.record:
                raise InvariantError(f"page index: segment {seg.name} scanned {seg.scanned} bytes, "
                                     f"{len(seg.keys)} records of {seg.record}")
        self._check_recency()
        allocated = sum(s.allocated for s in self._by_name.values() if s.shaped)
        if allocated != self.allocated:
            raise InvariantError(f"page index: segments allocate {allocated} bytes, the total says {self.allocated}")

    def _check_recency(self) -> None:
        """Every page is either read (in `_read`, by tick) or in a fresh range still ahead."""
        if any(key not in self._where for key in self._read):
            raise InvariantError("page index: a read page that the index does not hold")
        for ticks in (list(self._read.values()), [f[0] for f in self._fresh]):
            if ticks != sorted(ticks):
                raise InvariantError("page index: recency out of order")
        ahead = set()
        for _, seg_id, r, end in self._fresh:
            seg = self._by_id.get(seg_id)
            if seg is not None:
                ahead.update(k for k in seg.keys[r:end] if k is not None)
        lost = [k for k in self._where if k not in self._read and k not in ahead]
        if lost:
            raise InvariantError(f"page index: {len(lost)} pages (e.g. {lost[0]!r}) in no recency order")
