"""Page and slot numbers for both slot allocators: the free-page stack and the conversions.

A call on a pool works on its slot (or page) numbers in one of two forms (`Ints`),
chosen from the call's size when its numbers come in (`ints`) or are made
(`PagePool.alloc`), and kept to the end of the call:

- a few numbers (at most `FEW_MAX` pages, or slots where a call names slots): a
  `list[int]`. Checked, computed and written in plain Python, from a message's bytes
  to the reply's bytes without a tensor: on a few numbers each torch call costs a microsecond or more of overhead,
  more than the whole Python computation;
- more: an int64 tensor, vectorised.

Every helper here takes either form and answers in the form it was given (or, when
it makes numbers, the form for their size), so the cores' logic is written once.
A list that a check refuses is handed to the vectorised check as a tensor, which
names what is wrong: the errors are phrased in one place.

`PagePool` is the free list of pages behind both allocators: a stack of free page
numbers; allocating `k` pages takes the top `k`, freeing pushes them back. O(1) per
page; ownership and double-free checks belong to the pool's owner (which knows each
page's state).
"""

from __future__ import annotations

from array import array
from typing import TypeAlias

import numpy
import torch

from hicache.messages import Indices

FEW_MAX = 256
"""Calls on at most this many numbers (pages, or slots) take the `list[int]` form of `Ints`; larger
ones the tensor form. A torch call costs several microseconds whatever its size, Python about 30 to
60 ns a number per pass: up to a few hundred numbers, the few passes a call makes cost less in
Python than its tensor calls."""

Ints: TypeAlias = list[int] | torch.Tensor
"""Slot or page numbers of one call: Python ints for a few slots, else a 1-D int64 tensor."""


# -- the two forms ---------------------------------------------------------------------


Slots: TypeAlias = "torch.Tensor | Indices | list[int]"
"""Slot numbers as they come in: a 1-D int64 tensor, `Indices` as a message carried them, or Python ints."""


def ints(slots: Slots) -> Ints:
    """`slots` in the form for their number: Python ints when few, else a tensor (zero-copy for `Indices`)."""
    few = len(slots) <= FEW_MAX
    if isinstance(slots, list):
        return slots if few else as_tensor(slots)
    if isinstance(slots, Indices):
        return slots.tolist() if few else slots.as_tensor()
    return slots.tolist() if few else slots


def as_list(numbers: Ints) -> list[int]:
    return numbers if isinstance(numbers, list) else numbers.tolist()


def as_tensor(numbers: Slots) -> torch.Tensor:
    """`numbers` as a 1-D int64 tensor (zero-copy for a tensor and for `Indices`)."""
    if isinstance(numbers, torch.Tensor):
        return numbers
    if isinstance(numbers, Indices):
        return numbers.as_tensor()
    return torch.tensor(numbers, dtype=torch.int64)


def indices_of(numbers: Ints) -> Indices:
    """`numbers` as the `Indices` a message carries."""
    return Indices.from_tensor(numbers) if isinstance(numbers, torch.Tensor) else Indices.of(numbers)


# -- byte tables (page owners, slot states) ----------------------------------------------


def holds(table: bytearray, at: list[int], allowed: frozenset[int]) -> bool:
    """Whether `at` are distinct positions of `table` whose bytes are all in `allowed`
    (the check of a few positions; a False sends the caller to its vectorised check)."""
    if not at:
        return True
    if len(set(at)) != len(at) or min(at) < 0 or max(at) >= len(table):
        return False
    return allowed.issuperset(map(table.__getitem__, at))


def put(table: bytearray | array, view: numpy.ndarray, at: Ints, value: int) -> None:
    """Write `value` at `at` into `table`, whose memory `view` (a numpy array) also shows."""
    if isinstance(at, torch.Tensor):
        # numpy's scatter of one value: several times cheaper than torch's index_fill_ on this path
        view[at.numpy()] = value
        return
    for i in at:
        table[i] = value


def within(at: torch.Tensor, size: int) -> bool:
    """Whether every number of `at` is a position of a table of `size` (two numpy reductions)."""
    if not len(at):
        return True
    a = at.numpy()
    return int(a.min()) >= 0 and int(a.max()) < size


class Distinct:
    """Tells whether a tensor of positions holds each at most once, in O(len) and without a
    sort: each position's index is scattered into a scratch table and read back; a position
    named twice reads back the later index at the earlier one. The positions must be in range
    (`within`)."""

    def __init__(self, size: int) -> None:
        self._scratch = numpy.empty(size, dtype=numpy.int64)
        self._order = numpy.arange(0, dtype=numpy.int64)
        """0, 1, 2, ... as long as the longest call so far (read-only)."""

    def __call__(self, at: torch.Tensor) -> bool:
        n = len(at)
        if len(self._order) < n:
            self._order = numpy.arange(max(n, 2 * len(self._order)), dtype=numpy.int64)
        order, a = self._order[:n], at.numpy()
        self._scratch[a] = order
        return bool(numpy.array_equal(self._scratch[a], order))


# -- pages and slots ---------------------------------------------------------------------


def pages_of(indices: Ints, page_size: int, what: str) -> Ints:
    """The page numbers of `indices`, which must be whole pages in slot order.

    Raises ValueError naming `what` when the indices are not page aligned.
    """
    n = len(indices)
    if n % page_size:
        raise ValueError(f"{what}: {n} slots are not whole pages of {page_size}")
    if isinstance(indices, torch.Tensor) and n <= FEW_MAX:  # a few, given as a tensor
        return as_tensor(pages_of(indices.tolist(), page_size, what))
    if page_size == 1:
        return indices  # a slot is a page
    if isinstance(indices, list):
        pages = [first // page_size for first in indices[::page_size]]
        # Whole pages in order are exactly the slots of the pages their first slots lie in.
        if slots_of_pages(pages, page_size) == indices:
            return pages
        indices = as_tensor(indices)  # the vectorised check below names the culprit
    else:
        pages = indices[::page_size] // page_size
        if torch.equal(slots_of_pages(pages, page_size), indices):  # the same check, vectorised
            return pages
    grid = indices.view(-1, page_size)
    first = grid[:, 0]
    aligned = (first % page_size == 0) & (grid == first.unsqueeze(1) + torch.arange(page_size)).all(1)
    if not bool(aligned.all()):
        bad = int((~aligned).nonzero()[0, 0])
        raise ValueError(
            f"{what}: slots {grid[bad].tolist()} are not one whole page (page_size={page_size})"
        )
    return first // page_size


def slots_of_pages(pages: Ints, page_size: int) -> Ints:
    """Every slot of `pages`, in page order (the inverse of `pages_of`): a list for a list, else
    a new tensor (two tensor operations, cheaper than a list at any size)."""
    if page_size == 1:
        return pages
    if isinstance(pages, list):
        return [slot for page in pages for slot in range(page * page_size, page * page_size + page_size)]
    if pages.device.type != "cpu" or pages.dtype != torch.int64:
        return (pages.unsqueeze(1) * page_size + torch.arange(page_size, device=pages.device)).reshape(-1)
    # Each page's first slot repeated page_size times, plus the offsets 0..page_size-1 over and
    # over: two passes whose inner loops run the whole length (a broadcast add's inner loop is one
    # page long, several times slower), in numpy (cheaper calls than torch's).
    n = len(pages) * page_size
    offsets = _OFFSETS.get(page_size)
    if offsets is None or len(offsets) < n:
        offsets = _OFFSETS[page_size] = numpy.tile(numpy.arange(page_size, dtype=numpy.int64),
                                                   max(n, 1 << 16) // page_size + 1)
    slots = numpy.repeat(pages.numpy() * page_size, page_size)
    slots += offsets[:n]
    return torch.from_numpy(slots)


_OFFSETS: dict[int, numpy.ndarray] = {}
"""Per page size, `0, 1, ..., page_size - 1` repeated (at least 64 Ki slots long, grown to the
longest call; read-only)."""


# -- the free list -----------------------------------------------------------------------


class PagePool:
    def __init__(self, pages: int, page_size: int) -> None:
        if pages <= 0 or page_size <= 0:
            raise ValueError(f"pages={pages} and page_size={page_size} must be > 0")
        self.pages = pages
        self.page_size = page_size
        self._stack = array("q", bytes(8 * pages))
        self._stack_view = torch.frombuffer(self._stack, dtype=torch.int64)
        """The same memory as `_stack` (never resized, so the view stays valid)."""
        self._stack_np = self._stack_view.numpy()
        """The same memory again, for numpy's slicing and reversed copies (cheaper calls than torch's)."""
        # Reversed so that a fresh pool hands out pages 0, 1, 2, ... in order.
        torch.arange(pages - 1, -1, -1, out=self._stack_view)
        self._top = pages

    @property
    def free_pages(self) -> int:
        return self._top

    @property
    def free_slots(self) -> int:
        return self._top * self.page_size

    def alloc(self, k: int) -> Ints | None:
        """`k` free page numbers (new, in the form for `k` pages' slots), or None if fewer are free."""
        if k < 0:
            raise ValueError(f"cannot allocate {k} pages")
        if k > self._top:
            return None
        self._top -= k
        top = self._top
        if k <= FEW_MAX:
            got = self._stack[top : top + k].tolist()
            got.reverse()
            return got
        return torch.from_numpy(self._stack_np[top : top + k][::-1].copy())

    def free(self, pages: Ints) -> None:
        """Push pages back. The caller has checked they were allocated."""
        k = len(pages)
        top = self._top
        if top + k > self.pages:
            raise AssertionError(
                f"freeing {k} pages would give {top + k} free of {self.pages}: double free"
            )
        if isinstance(pages, list):
            self._stack[top : top + k] = array("q", reversed(pages))
        else:
            self._stack_np[top : top + k] = pages.numpy()[::-1]
        self._top = top + k

    def free_page_set(self) -> torch.Tensor:
        """The free page numbers (for invariant checks)."""
        return self._stack_view[: self._top]
