"""The file backend's index: where each page of its KV shape lies in the segments of its
directory, least recently used first, and the bytes those segments take.

A dict maps a key to an int, the segment's number and the record's (`_SHIFT`); each
segment lists the key of each of its records (`Segment.keys`). So a page costs the
index one dict entry, one int and one list slot: no object per page, and a segment that
vanishes takes its pages out by its own list.

Recency without a node per page: every call that uses pages (a write, a scan, a read of
a run of adjacent records) has a number (`_tick`), stamped on each record it used
(`Segment.ticks`, one int64 a record) and queued as the record ranges it used (`_order`,
oldest first). A record belongs to the one range whose tick it bears; a range whose
records were all used again since, or died, is skipped when it comes to the head, and
dropped by a compaction when the queue has doubled. So a read costs the index one slice
assignment and one queued range a run, not a step per page.
"""

from __future__ import annotations

import itertools
from array import array
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from ._errors import InvariantError
from ._segments import Segment

_SHIFT: Final = 32
_RECORD: Final = (1 << _SHIFT) - 1
_UNUSED: Final = -1
"""The tick of a record that no range holds: dead, or not the index's."""
_ORDER_MIN: Final = 1024
"""The queue of ranges is compacted when it grows past twice its last compacted length, or this."""


class PageIndex:
    """The pages of one KV shape in a directory's segments (module docstring)."""

    def __init__(self, order_min: int = _ORDER_MIN) -> None:
        """`order_min`: the queue of ranges is compacted when it grows past this, or past
        twice its length after the last compaction."""
        self._where: dict[str, int] = {}
        """Key -> segment number << _SHIFT | record number."""
        self._order: deque[list[int]] = deque()
        """[tick, segment number, next record, end record] of the records each call used, oldest
        first; `next record` moves on as the head's pages are evicted or found used since."""
        self._order_min = self._order_max = order_min
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
        where = self._where
        for key in seg.keys:
            if key:  # not dead, not a duplicate: indexed
                del where[key]
        seg.keys.clear()
        del seg.ticks[:]
        seg.live = 0
        self.set_allocated(seg, 0)
        del self._by_id[seg.id]
        del self._by_name[seg.name]

    def set_allocated(self, seg: Segment, allocated: int) -> None:
        """`seg` takes `allocated` bytes now. The total counts them once it holds records of
        this shape: a segment looked at before its first whole record (another writer's,
        caught mid-append) counts all its bytes from the look that finds one."""
        counted = allocated if seg.shaped else 0
        self.allocated += counted - seg.counted
        seg.counted = counted
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
        locs = list(map(self._where.get, keys))
        first = locs[0] if locs else None
        if first is not None and len(locs) <= pages_max and locs == list(range(first, first + len(locs))):
            return [(self._by_id[first >> _SHIFT], first & _RECORD, len(locs))]  # the common read: one run
        out, run_at, n = [], -1, 0
        for loc in locs:
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
        if record == len(seg.ticks):  # the scan's next record, as a scan takes them
            seg.ticks.append(self._tick)
        else:
            _stamp(seg, record, 1, self._tick)
        last = self._order[-1] if self._order else None
        if last is not None and last[0] == self._tick and last[1] == seg.id and last[3] == record:
            last[3] += 1
        else:
            self._queue(self._tick, seg, record, 1)
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
        self.touch(seg, first, n)
        return True

    def unclaim(self, seg: Segment, n: int) -> None:
        """Take back the last `claim`, of the `n` last records of `seg`: their write failed."""
        last = self._order[-1] if self._order else None
        if last is None or last[1] != seg.id or last[3] != len(seg.keys) or last[3] - last[2] != n:
            raise InvariantError(f"page index: unclaim of {n} records of {seg.name} that its last claim did not add")
        self._order.pop()
        for key in seg.keys[-n:]:
            del self._where[key]
        del seg.keys[-n:]
        del seg.ticks[len(seg.keys):]
        seg.live -= n

    def touch(self, seg: Segment, first: int, n: int) -> None:
        """Records `first .. first + n - 1` of `seg` were used (read, or written): the most
        recently used now, in record order."""
        if n:
            tick = self._tick
            self._tick += 1
            _stamp(seg, first, n, tick)
            self._queue(tick, seg, first, n)

    def _queue(self, tick: int, seg: Segment, first: int, n: int) -> None:
        order = self._order
        order.append([tick, seg.id, first, first + n])
        if len(order) > self._order_max:
            self._compact()

    def oldest(self) -> str:
        """The least recently used page's key (the index must not be empty)."""
        order, by_id = self._order, self._by_id
        while order:
            head = order[0]
            tick, seg = head[0], by_id.get(head[1])
            if seg is not None:
                ticks, r, end = seg.ticks, head[2], head[3]
                while r < end and ticks[r] != tick:
                    r += 1  # evicted, dropped, or used since: not this range's to give
                head[2] = r
                if r < end:
                    return seg.keys[r]  # type: ignore[return-value]
            order.popleft()
        raise InvariantError("page index: no page in the recency order (oldest of an empty index)")

    def _compact(self) -> None:
        """Drop the ranges none of whose records bears their tick any more."""
        by_id = self._by_id
        kept = deque(r for r in self._order
                     if (seg := by_id.get(r[1])) is not None and seg.ticks[r[2] : r[3]].count(r[0]))
        self._order = kept
        self._order_max = max(self._order_min, 2 * len(kept))

    def remove(self, key: str) -> tuple[Segment, int]:
        """Take `key` out; (segment, record) where its page was, now a dead record."""
        loc = self._where.pop(key)
        seg, record = self._by_id[loc >> _SHIFT], loc & _RECORD
        seg.keys[record] = None
        seg.ticks[record] = _UNUSED
        seg.live -= 1
        return seg, record

    def check_invariants(self) -> None:
        for key, loc in self._where.items():
            seg = self._by_id.get(loc >> _SHIFT)
            if seg is None or seg.keys[loc & _RECORD] != key:
                raise InvariantError(f"page index: {key!r} points at a record that does not hold it")
        for seg in self._by_name.values():
            live = sum(map(bool, seg.keys))
            if live != seg.live or self._by_id.get(seg.id) is not seg:
                raise InvariantError(f"page index: segment {seg.name} counts {seg.live} live records, holds {live}")
            if seg.shaped and seg.scanned != len(seg.keys) * seg.record:
                raise InvariantError(f"page index: segment {seg.name} scanned {seg.scanned} bytes, "
                                     f"{len(seg.keys)} records of {seg.record}")
            if seg.counted != seg.allocated * seg.shaped:
                raise InvariantError(f"page index: segment {seg.name} counts {seg.counted} of its {seg.allocated} "
                                     f"bytes toward the total ({'a' if seg.shaped else 'no'} segment of this shape)")
        self._check_recency()
        allocated = sum(s.allocated for s in self._by_name.values() if s.shaped)
        if allocated != self.allocated:
            raise InvariantError(f"page index: segments allocate {allocated} bytes, the total says {self.allocated}")

    def _check_recency(self) -> None:
        """Every page bears the tick of one queued range that holds its record, the queue is in
        tick order, and no dead record bears a tick."""
        ticks = [r[0] for r in self._order]
        if ticks != sorted(ticks):
            raise InvariantError("page index: recency out of order")
        held = set()
        for tick, seg_id, r, end in self._order:
            seg = self._by_id.get(seg_id)
            if seg is not None:
                held.update((seg_id, i) for i in range(r, end) if seg.ticks[i] == tick)
        for seg in self._by_name.values():
            if len(seg.ticks) > len(seg.keys):
                raise InvariantError(f"page index: segment {seg.name} stamps {len(seg.ticks)} records of "
                                     f"{len(seg.keys)}")
            for i, key in enumerate(seg.keys):
                tick = seg.ticks[i] if i < len(seg.ticks) else _UNUSED
                if (not key) != (tick == _UNUSED):
                    raise InvariantError(f"page index: record {i} of {seg.name} is "
                                         f"{'not indexed' if not key else 'live'} with tick {tick}")
                if key and (seg.id, i) not in held:
                    raise InvariantError(f"page index: {key!r} is in no recency order")


def _stamp(seg: Segment, first: int, n: int, tick: int) -> None:
    """Records `first .. first + n - 1` of `seg` bear `tick` (records before them that none
    stamped yet bear `_UNUSED`)."""
    ticks = seg.ticks
    if len(ticks) < first + n:
        ticks.extend(array("q", [_UNUSED]) * (first + n - len(ticks)))
    ticks[first : first + n] = array("q", [tick]) * n
