"""The file backend's index: where each page of its KV shape lies in the segments of its
directory, least recently used first, and the bytes those segments take.

One ordered dict maps a key to an int, the segment's number and the record's (`_SHIFT`);
each segment lists the key of each of its records (`Segment.keys`). So a page costs the
index one dict entry, one int and one list slot: no object per page, and a segment that
vanishes takes its pages out by its own list.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

from ._errors import InvariantError
from ._segments import Segment

_SHIFT: Final = 32
_RECORD: Final = (1 << _SHIFT) - 1


class PageIndex:
    """The pages of one KV shape in a directory's segments (module docstring)."""

    def __init__(self) -> None:
        self._where: OrderedDict[str, int] = OrderedDict()
        """Key -> segment number << _SHIFT | record number, least recently used first."""
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
            if key is not None:
                del where[key]
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

    def runs(self, keys: Sequence[str], pages_max: int) -> Iterator[tuple[Segment, int, int]]:
        """(segment, first record, records) of each run of adjacent records that holds the
        leading indexed keys, in key order, at most `pages_max` records each."""
        where = self._where
        run_at, n = -1, 0
        for key in keys:
            loc = where.get(key)
            if loc is None:
                break
            if n and loc == run_at + n and n < pages_max:
                n += 1
                continue
            if n:
                yield self._by_id[run_at >> _SHIFT], run_at & _RECORD, n
            run_at, n = loc, 1
        if n:
            yield self._by_id[run_at >> _SHIFT], run_at & _RECORD, n

    def locate(self, key: str) -> tuple[Segment, int] | None:
        loc = self._where.get(key)
        return None if loc is None else (self._by_id[loc >> _SHIFT], loc & _RECORD)

    def take(self, key: str, seg: Segment, record: int) -> bool:
        """Index `key` at `record` of `seg` unless it is indexed already; whether it took it.
        (The caller appends to `seg.keys`.)"""
        if key in self._where:
            return False
        self._where[key] = seg.id << _SHIFT | record
        return True

    def missing(self, keys: Sequence[str]) -> list[int]:
        """The positions of the keys the index does not hold."""
        where = self._where
        return [i for i, key in enumerate(keys) if key not in where]

    def append(self, seg: Segment, keys: Sequence[str]) -> None:
        """Index keys not yet indexed, written as the next records of `seg`."""
        first = seg.id << _SHIFT | len(seg.keys)
        self._where.update(zip(keys, range(first, first + len(keys))))
        seg.keys += keys
        seg.live += len(keys)

    def touch(self, keys: Sequence[str]) -> None:
        """Make `keys` the most recently used, in order."""
        move = self._where.move_to_end
        for key in keys:
            move(key)

    def oldest(self) -> str:
        return next(iter(self._where))

    def remove(self, key: str) -> tuple[Segment, int]:
        """Take `key` out; (segment, record) where its page was, now a dead record."""
        loc = self._where.pop(key)
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
        allocated = sum(s.allocated for s in self._by_name.values() if s.shaped)
        if allocated != self.allocated:
            raise InvariantError(f"page index: segments allocate {allocated} bytes, the total says {self.allocated}")
