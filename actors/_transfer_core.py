"""`TransferQueue`: the op merger/splitter both streams share (SGLang's cache controller
without its threads).

Operations wait in FIFO order. `next_batch()` takes pieces from the head until the
batch holds `slots_max` units (the streams queue pages, so a unit is a page):
small operations merge into one batch, an operation larger than the room left is
split and continues in the next batch. An operation completes when its last piece is copied.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from hicache.messages import ActorName

from ._errors import InvariantError
from ._kv import _in_range
from ._pages import Ints, Slots, as_tensor, ints


@dataclass(slots=True, eq=False)
class TransferOp:
    """One requested copy. Mutable progress, owned by one stream actor."""

    op_id: int
    requester: ActorName
    src: Slots
    dst: Slots
    """Source and destination slots (a stream actor keeps them in the form their size
    calls for, see `_pages.ints`)."""
    taken: int = 0
    """Slots handed out in pieces so far."""
    pieces: int = 0
    failed: bool = False
    merged: bool = False
    """True once the operation shared a batch with another (counted once in `merged_ops`)."""
    slots: int = field(init=False)
    """`len(src)`: taken once, the batching reads it for every piece."""

    def __post_init__(self) -> None:
        self.slots = len(self.src)


@dataclass(frozen=True, slots=True)
class Piece:
    op: TransferOp
    start: int
    end: int
    last: bool
    """True when this piece completes its operation."""


class TransferQueue:
    def __init__(self, slots_max: int, ops_max: int) -> None:
        if slots_max <= 0 or ops_max <= 0:
            raise ValueError(f"slots_max={slots_max} and ops_max={ops_max} must be > 0")
        self.slots_max = slots_max
        self.ops_max = ops_max
        self._ops: deque[TransferOp] = deque()
        self.merged_ops = 0
        self.split_ops = 0

    def __len__(self) -> int:
        return len(self._ops)

    def push(self, op: TransferOp) -> bool:
        """Queue an operation; False when `ops_max` are already waiting."""
        if len(self._ops) >= self.ops_max:
            return False
        self._ops.append(op)
        return True

    def next_batch(self) -> list[Piece]:
        """Pieces for one copy batch of at most `slots_max` slots (empty if idle)."""
        room = self.slots_max
        batch: list[Piece] = []
        while self._ops and room > 0:
            op = self._ops[0]
            take = min(op.slots - op.taken, room)
            start = op.taken
            op.taken += take
            op.pieces += 1
            last = op.taken == op.slots
            batch.append(Piece(op, start, op.taken, last))
            room -= take
            if last:
                self._ops.popleft()
                if op.pieces > 1:
                    self.split_ops += 1
        if len(batch) > 1:
            for piece in batch:
                if not piece.op.merged:
                    piece.op.merged = True
                    self.merged_ops += 1
        return batch

    def cancel(self, op: TransferOp) -> None:
        """Drop a failed operation: its pieces not handed out yet are never copied."""
        if op in self._ops:
            self._ops.remove(op)

    def drain(self) -> list[TransferOp]:
        """Remove and return every waiting operation."""
        ops = list(self._ops)
        self._ops.clear()
        return ops

    def check_invariants(self) -> None:
        if len(self._ops) > self.ops_max:
            raise InvariantError(f"transfer queue holds {len(self._ops)} ops, bound {self.ops_max}")
        for op in self._ops:
            if op.failed or not 0 <= op.taken < max(op.slots, 1):
                raise InvariantError(f"queued op {op.op_id} is done or failed but still queued")


def batch_indices(batch: list[Piece]) -> tuple[Ints, Ints]:
    """Concatenated source and destination slots of a batch, in piece order."""
    src = _concat_slots([_part(p.op.src, p) for p in batch])
    dst = _concat_slots([_part(p.op.dst, p) for p in batch])
    return src, dst


def _part(slots: Slots, piece: Piece) -> Slots:
    """The piece's part of one of its operation's index arrays (the array itself when whole)."""
    return slots if piece.start == 0 and piece.end == piece.op.slots else slots[piece.start : piece.end]


def _concat_slots(parts: list[Slots]) -> Ints:
    """Slot indices one after another, in the form their number calls for (see `_pages.ints`)."""
    if len(parts) == 1:
        return ints(parts[0])
    if all(isinstance(p, list) for p in parts):
        return ints([i for p in parts for i in p])
    return ints(torch.cat([as_tensor(p) for p in parts]))


def op_problem(src: Slots, src_cap: int, dst: Slots, dst_cap: int, unit: str = "slot") -> str | None:
    """Why an operation's indices (of `unit`s: slots, or pages) are unusable, or None when fine."""
    n = len(src)
    if n != len(dst):
        return f"source has {n} {unit}s but destination has {len(dst)}"
    for name, idx, cap in (("source", src, src_cap), ("destination", dst, dst_cap)):
        if n and not _in_range(ints(idx), cap):
            return f"{name} {unit} out of range 0..{cap - 1}"
    return None

