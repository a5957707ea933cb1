"""Page and slot numbers for both slot allocators: the free-page stack, the page tables
and the conversions.

A call on a pool core works on its page numbers in one of two forms (`Pages`), chosen
from the call's size when its numbers come in (`as_pages`) or are made
(`PagePool.alloc`), and kept to the end of the call:

- a few numbers (at most `FEW_MAX`): a `list[int]`. Checked, computed and written in
  plain Python, from a message's bytes to the reply's bytes without an array: on a few
  numbers each array call costs more than the whole Python computation;
- more: a 1-D int64 numpy array (a view of a message's bytes where they came in one),
  vectorised. numpy rather than torch: the bookkeeping makes many small calls, and
  numpy's cost a half to a quarter of torch's.

Every helper here takes either form and answers in the form it was given (or, when
it makes numbers, the form for their size), so the cores' logic is written once.
A list that a check refuses is handed to the vectorised check, which names what is
wrong: the errors are phrased in one place.

The copies of KV take slot numbers as tensors (`Ints`: a list or a tensor), since
torch indexes the buffers.

`PagePool` is the free list of pages behind both allocators: a stack of free page
numbers; allocating `k` pages takes the top `k`, freeing pushes them back. O(1) per
page, one copy in order each way. `PageTable` is the value per page each pool's core
keeps (the device's owner, the host's state), with the one checked move both make:
only distinct pages in range, each holding an allowed value, change.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from operator import itemgetter
from typing import TypeAlias

import numpy
import torch

from hicache.messages import Indices

FEW_MAX = 256
"""Calls on at most this many numbers (pages, or slots) take the `list[int]` form; larger ones
the array form. An array call costs a microsecond or more whatever its size (several, with cold
caches between calls), Python about 30 to 60 ns a number per pass: up to a few hundred numbers,
the few passes a call makes cost less in Python than its array calls."""

Ints: TypeAlias = list[int] | torch.Tensor
"""Slot numbers of a copy: Python ints for a few slots, else a 1-D int64 tensor."""

Pages: TypeAlias = "list[int] | numpy.ndarray"
"""Page numbers of one call on a pool core: Python ints for a few, else a 1-D int64 numpy array."""

Slots: TypeAlias = "torch.Tensor | Indices | list[int]"
"""Slot or page numbers as they come in: a 1-D int64 tensor, `Indices` as a message carried
them, or Python ints."""


# -- the forms ---------------------------------------------------------------------------


def ints(slots: Slots) -> Ints:
    """`slots` in the form for their number: Python ints when few, else a tensor (zero-copy for `Indices`)."""
    few = len(slots) <= FEW_MAX
    if isinstance(slots, list):
        return slots if few else as_tensor(slots)
    if isinstance(slots, Indices):
        return slots.tolist() if few else slots.as_tensor()
    return slots.tolist() if few else slots


def as_pages(numbers: Slots | numpy.ndarray) -> Pages:
    """`numbers` in the form for their number: Python ints when few, else an int64 array
    (a read-only view of `Indices`' bytes, a tensor's numpy view)."""
    if len(numbers) <= FEW_MAX:
        return numbers if isinstance(numbers, list) else numbers.tolist()
    if isinstance(numbers, Indices):
        return numpy.frombuffer(numbers.buffer(), dtype=numpy.int64)
    if isinstance(numbers, numpy.ndarray):
        return numbers.astype(numpy.int64, copy=False)
    if isinstance(numbers, torch.Tensor):
        return numbers.detach().to(device="cpu", dtype=torch.int64).numpy()
    return numpy.array(numbers, dtype=numpy.int64)


def pages_of_array(held: array) -> Pages:
    """The numbers of an `array("q")` that nobody resizes while the result lives (viewed when many)."""
    return held.tolist() if len(held) <= FEW_MAX else numpy.frombuffer(held, dtype=numpy.int64)


def pages_of_bytes(data: bytes) -> Pages:
    """Page numbers from their int64 bytes (a read-only view of them when many)."""
    return numpy.frombuffer(data, dtype=numpy.int64) if len(data) > 8 * FEW_MAX else array("q", data).tolist()


def as_list(numbers: Ints | Pages) -> list[int]:
    return numbers if isinstance(numbers, list) else numbers.tolist()


def as_tensor(numbers: Slots | numpy.ndarray) -> torch.Tensor:
    """`numbers` as a 1-D int64 tensor (zero-copy for a tensor, a writable int64 array and `Indices`)."""
    if isinstance(numbers, torch.Tensor):
        return numbers
    if isinstance(numbers, Indices):
        return numbers.as_tensor()
    if isinstance(numbers, numpy.ndarray):  # torch takes only writable arrays: a view of bytes is copied
        return torch.from_numpy(numbers.astype(numpy.int64, copy=not numbers.flags.writeable))
    return torch.tensor(numbers, dtype=torch.int64)


def indices_of(numbers: Ints | Pages) -> Indices:
    """`numbers` as the `Indices` a message carries."""
    if isinstance(numbers, list):
        return Indices.of(numbers)
    if isinstance(numbers, numpy.ndarray):
        return Indices(numbers.astype("<i8", copy=False).tobytes())
    return Indices.from_tensor(numbers)


# -- page tables (page owners, page states) ------------------------------------------------


class PageTable:
    """One small integer per page of a pool (`typecode` "i": int32, "q": int64, "B": uint8) in one buffer
    seen three ways: `items` (a bytearray or an `array`, for Python's reads and writes of a few pages), `view`
    (numpy's, for the vectorised ones) and `tensor` (for counts and invariant checks).

    `move` is the checked move both pools make, `fits` its check alone: distinct pages, in
    range, each holding an allowed value. Over an array it is a gather and one comparison of
    bytes when the pages all hold one value (as pages moved together do), plus the distinct
    check: each page's position scattered into a table and read back (a page named twice
    reads back the later position at the earlier one), in O(len) and without a sort: a
    scratch table's, or for `move` on a signed table the entries themselves (see there).
    Each "all equal" test is one `bytes.startswith` of the gathered array against a run of
    the expected values kept as bytes (a `memcmp`, where numpy's comparison and reduction
    are two calls of a few microseconds each and two passes)."""

    def __init__(self, size: int, typecode: str, runs: Iterable[int] = ()) -> None:
        if typecode not in _TABLE_DTYPES:
            raise ValueError(f"a page table's typecode is one of {sorted(_TABLE_DTYPES)}, got {typecode!r}")
        dtype = numpy.dtype(_TABLE_DTYPES[typecode])
        # A bytearray where it can: its item writes cost about half an array's.
        self.items: array | bytearray = (bytearray(size) if typecode == "B"
                                         else array(typecode, bytes(dtype.itemsize * size)))
        self.view = numpy.frombuffer(self.items, dtype=dtype)
        self.tensor = torch.from_numpy(self.view)
        self.size = size
        self._signed = dtype.kind == "i"
        """A signed table's moves mark pages with negative numbers (`_marked`); an unsigned one's
        use a scratch table (`_distinct`)."""
        self._scratch: numpy.ndarray | None = None
        """A position per page for `_distinct`, made at its first use (a signed table's moves need none)."""
        self._order = b""
        """The int64 bytes of 0, 1, 2, ... as long as the longest `_distinct` so far."""
        self._marks = b""
        """The bytes (in the table's dtype) of -1, -2, -3, ... as long as the longest `move` so far."""
        self._runs: dict[int, bytes] = dict.fromkeys(map(int, runs), b"")
        """Per value of `runs` (the owners or states pages move between), the bytes of a run of it
        in the table's dtype, as long as the longest call so far: what `_all` compares with."""

    def fits(self, at: Pages, allowed: frozenset[int], *, fresh: bool = False) -> bool:
        """Whether `at` are distinct pages of the table that each hold a value in `allowed`.
        `fresh`: pages the free list just handed out (distinct and in range by its invariant)."""
        if isinstance(at, list):
            if not at:
                return True
            if not fresh and (len(set(at)) != len(at) or min(at) < 0 or max(at) >= self.size):
                return False
            return allowed.issuperset(map(self.items.__getitem__, at))
        if not len(at):
            return True
        return self._held(at, allowed, fresh) is not None and (fresh or self._distinct(at))

    def move(self, at: Pages, allowed: frozenset[int], value: int, *, fresh: bool = False,
             tally: list[int] | None = None) -> bool:
        """Write `value` at the pages `at` if they are distinct pages of the table that each
        hold a value in `allowed` (what `fits` tells); else change nothing. Whether it wrote.
        `tally` (an unsigned table's: a count of pages per value) follows the move.

        Over an array, a signed table checks distinctness in its own entries, which the
        gather of their values has just brought into the CPU's cache (a scratch table's are
        not): each page's position is written into its entry and read back (as a negative
        number, the form of a free page's code: `_marked`), then `value` is written, or what
        the entries held when a page is named twice."""
        if isinstance(at, list) or fresh or not self._signed:
            if tally is None:
                fits = self.fits(at, allowed, fresh=fresh)
            else:
                fits = self._fits_counted(at, allowed, fresh, tally)
            if not fits:
                return False
            self.put(at, value)
            if tally is not None:
                tally[value] += len(at)
            return True
        if tally is not None:
            raise ValueError("a signed table's moves keep no tally")
        if not self._marked(at, allowed, 0):
            return False
        self.view[at] = value
        return True

    def _fits_counted(self, at: Pages, allowed: frozenset[int], fresh: bool, tally: list[int]) -> bool:
        """`fits`; if it does, each page's value is taken out of `tally` (the gathered values'
        counts: one comparison of bytes when they are all one value, as pages moved together are)."""
        if isinstance(at, list):
            if not at:
                return True
            if not fresh and (len(set(at)) != len(at) or min(at) < 0 or max(at) >= self.size):
                return False
            held = list(map(self.items.__getitem__, at))
            if not allowed.issuperset(held):
                return False
            for value in allowed:
                tally[value] -= held.count(value)
            return True
        if not len(at):
            return True
        got = self._held(at, allowed, fresh)
        if got is None or not (fresh or self._distinct(at)):
            return False
        for value in allowed:
            if self._all(got, value):
                tally[value] -= len(got)
                return True
        for value, n in enumerate(numpy.bincount(got, minlength=len(tally)).tolist()):
            tally[value] -= n
        return True

    def move_free(self, at: Pages, allowed: frozenset[int], first: int) -> bool:
        """`move` to the codes of free pages, in a signed table (the device's owners): page
        `at[i]` gets `-(first + i + 1)` (its place in a free list whose pushed pages start at
        `first`). Over an array, the marks
        `move` writes to find a page named twice are those codes: what they leave is the
        result, with no further write."""
        if isinstance(at, list):
            if not self.fits(at, allowed):
                return False
            self.put_free(at, first)
            return True
        return self._marked(at, allowed, first)

    def _marked(self, at: numpy.ndarray, allowed: frozenset[int], first: int) -> bool:
        """If `at` are distinct pages that each hold a value in `allowed`, write the marks
        `-(first + 1)`, `-(first + 2)`, ... at them and answer True; else change nothing. A
        page named twice reads back another page's mark (the later one's)."""
        if not len(at):
            return True
        held = self._held(at, allowed, False)
        if held is None:
            return False
        view = self.view
        view[at] = self._free_marks(first, len(at))
        if not self._marks.startswith(view.take(at), view.itemsize * first):
            view[at] = held  # a page named twice: each entry gets back what it held
            return False
        return True

    def put_free(self, at: Pages, first: int) -> None:
        """Write the codes of free pages at the pages `at`, unchecked (as `move_free` does)."""
        if isinstance(at, list):
            items = self.items
            for i, page in enumerate(at, first + 1):
                items[page] = -i
        elif len(at):
            self.view[at] = self._free_marks(first, len(at))

    def _free_marks(self, first: int, n: int) -> numpy.ndarray:
        """The codes -(first + 1) .. -(first + n), a view of `_marks` (grown when short)."""
        dtype = self.view.dtype
        if len(self._marks) < dtype.itemsize * (first + n):
            self._marks = _longer(self._marks, first + n, dtype.itemsize,
                                  lambda m: numpy.arange(-1, -m - 1, -1, dtype=dtype))
        return numpy.frombuffer(self._marks, dtype=dtype, count=n, offset=dtype.itemsize * first)

    def _held(self, at: numpy.ndarray, allowed: frozenset[int], fresh: bool) -> numpy.ndarray | None:
        """The values at the pages `at` (an array, not empty) when they are all pages of the table
        holding a value in `allowed`, else None: a gather and two reductions when they all hold
        one value, as pages moved together do."""
        if not fresh and numpy.minimum.reduce(at) < 0:
            return None
        try:
            got = self.view.take(at)
        except IndexError:  # a page past the end
            return None
        for value in allowed:
            if self._all(got, value):
                return got
        return got if numpy.isin(got, tuple(allowed)).all() else None

    def _all(self, values: numpy.ndarray, value: int) -> bool:
        """Whether every one of `values` (a contiguous array of the table's dtype) is `value`:
        one comparison of bytes for a value of `runs`, numpy's for any other (a ledger's number)."""
        run = self._runs.get(value)
        if run is None:
            return bool((values == value).all())
        if len(run) < values.nbytes:
            run = self._runs[value] = _longer(run, len(values), values.itemsize,
                                              lambda m: numpy.full(m, value, dtype=self.view.dtype))
        return run.startswith(values)

    def _distinct(self, at: numpy.ndarray) -> bool:
        n = len(at)
        if len(self._order) < 8 * n:
            self._order = _longer(self._order, n, 8, lambda m: numpy.arange(m, dtype=numpy.int64))
        order = numpy.frombuffer(self._order, dtype=numpy.int64, count=n)
        if self._scratch is None:
            self._scratch = numpy.empty(self.size, dtype=numpy.int64)
        self._scratch[at] = order
        return self._order.startswith(self._scratch.take(at))

    def put(self, at: Pages, value: int) -> None:
        """Write `value` at the pages `at`."""
        if isinstance(at, list):
            items = self.items
            for i in at:
                items[i] = value
        else:
            self.view[at] = value


_TABLE_DTYPES = {"B": numpy.uint8, "i": numpy.int32, "q": numpy.int64}
"""The typecodes a `PageTable` takes, and the dtype of each."""


def _longer(run: bytes, n: int, itemsize: int, make: Callable[[int], numpy.ndarray]) -> bytes:
    """The bytes of `make(m)` for `m` at least `n` items and twice the items of `run`: a run
    grown for a longer call (doubling, so a table's runs are remade a few times in its life)."""
    return make(max(n, 2 * len(run) // itemsize)).tobytes()


# -- the free list ---------------------------------------------------------------------------


class PagePool:
    def __init__(self, pages: int, page_size: int) -> None:
        if pages <= 0 or page_size <= 0:
            raise ValueError(f"pages={pages} and page_size={page_size} must be > 0")
        self.pages = pages
        self.page_size = page_size
        self._stack = numpy.arange(pages, dtype=numpy.int64)
        """The free pages at [low, pages), the next to hand out at `low`: the stack grows
        down, so that a take and a push are each one copy in order (a fresh pool hands out
        pages 0, 1, 2, ... in order; pages pushed are handed out again in the order pushed)."""
        self._low = 0

    @property
    def free_pages(self) -> int:
        return self.pages - self._low

    @property
    def free_slots(self) -> int:
        return (self.pages - self._low) * self.page_size

    def alloc(self, k: int) -> Pages | None:
        """`k` free page numbers (new, in the form for `k` pages), or None if fewer are free."""
        got = self._take(k)
        if got is None:
            return None
        return got.tolist() if k <= FEW_MAX else got.copy()

    def alloc_bytes(self, k: int) -> bytes | None:
        """`k` free page numbers as int64 bytes (one copy), or None if fewer are free."""
        got = self._take(k)
        return None if got is None else got.tobytes()

    def _take(self, k: int) -> numpy.ndarray | None:
        if k < 0:
            raise ValueError(f"cannot allocate {k} pages")
        low = self._low
        if k > self.pages - low:
            return None
        self._low = low + k
        return self._stack[low : low + k]

    def free(self, pages: Pages) -> int:
        """Push pages back (the caller has checked they were allocated); where in the stack
        they went (`stack[low + i]` is `pages[i]`)."""
        k = len(pages)
        low = self._low - k
        if low < 0:
            raise AssertionError(
                f"freeing {k} pages would give {self.pages - low} free of {self.pages}: double free"
            )
        self._stack[low : self._low] = pages
        self._low = low
        return low

    @property
    def low(self) -> int:
        """Where the free pages start in the stack: page `stack[low + i]` is handed out `i`-th."""
        return self._low

    def free_page_set(self) -> torch.Tensor:
        """The free page numbers (for invariant checks)."""
        return torch.from_numpy(self._stack[self._low :])


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


def new_pages(n: int, room: int, page_size: int) -> int:
    """The new pages `n` more slots of a request take: they fill the `room` its pages have
    left first (the rest of its last page, pages held ahead), then whole new pages (the rule
    the device grants by and the facade checks its grants against)."""
    return -(-max(0, n - room) // page_size)


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


_NO_SLOTS = torch.from_numpy(numpy.empty(0, dtype=numpy.int64))
"""What every empty answer of `SlotTable.slots` is a detached tensor of: no element to write,
storage that cannot be resized (numpy's), and shape and strides of each answer's own (an
in-place view op such as `unsqueeze_` on one answer changes no other)."""

_COUNT = itemgetter(3)
"""The slot count of a `SlotTable` part."""


class SlotTable:
    """Every slot of one pool, page by page: the slots of many pages are one gather of rows
    (a copy of `page_size` slots per page, where `slots_of_pages` makes three passes). For
    a caller that turns the pages a pool gave it into slots on every call (the facade);
    it costs 8 bytes per slot of the pool, a small part of that slot's KV."""

    def __init__(self, pages: int, page_size: int) -> None:
        self.page_size = page_size
        self._rows = numpy.arange(pages * page_size, dtype=numpy.int64).reshape(pages, page_size)
        self._rows.flags.writeable = False
        self._row_bytes = memoryview(self._rows.reshape(-1)).cast("B")
        """The rows' bytes: a page's slots are one slice of them (`8 * page_size` bytes)."""

    def split(self, parts: list[tuple[int, int, Indices, int]]) -> tuple[torch.Tensor, ...]:
        """For each `(base, spare, pages, n)`, `n` slots: `base .. base + spare - 1` (the rest of
        a partly used page, or the first slot of a page held ahead), then the first `n - spare`
        slots of `pages`. Made as one tensor (`join`) and split into views: a decode tick's many
        one-slot answers cost one tensor, not one each."""
        whole = self.join(parts)
        sizes = [n for _, _, _, n in parts]
        if len(sizes) == 1:
            return (whole,)
        k = sizes[0]
        if k and sizes.count(k) == len(sizes):  # equal answers (a decode tick's slot each): rows of one view
            return whole.view(-1, k).unbind(0)  # cheaper views than a split's
        return whole.split_with_sizes(sizes)

    def join(self, parts: list[tuple[int, int, Indices, int]]) -> torch.Tensor:
        """The slots of `split`'s parts, one after another, as one new tensor."""
        p = self.page_size
        if sum(map(_COUNT, parts)) <= FEW_MAX:
            flat = array("q")
            if p == 1:  # a slot is a page: the pages' own bytes, or a lone slot held ahead
                for base, spare, pages, n in parts:
                    if spare:
                        flat.append(base)
                    else:
                        flat.frombytes(pages.to_bytes()[: 8 * n])
            else:  # a page's slots: a slice of the rows' bytes (no int made per slot)
                rows, page_bytes = self._row_bytes, 8 * p
                for base, spare, pages, n in parts:
                    if spare == 1:  # a decode step's slot: no range to make
                        flat.append(base)
                    elif spare:
                        flat.extend(range(base, base + spare))
                    if n > spare:
                        need = 8 * (n - spare)
                        for page in pages.tolist()[: -(-(n - spare) // p)]:
                            at = page * page_bytes
                            flat.frombytes(rows[at : at + min(need, page_bytes)])
                            need -= page_bytes
            return torch.frombuffer(flat, dtype=torch.int64) if flat else torch.empty(0, dtype=torch.int64)
        pieces = []
        for base, spare, pages, n in parts:
            if spare:
                pieces.append(numpy.arange(base, base + spare, dtype=numpy.int64))
            if n > spare:
                pieces.append(self._gather(pages, n - spare))
        return torch.from_numpy(numpy.concatenate(pieces) if len(pieces) > 1 or not pieces[0].flags.writeable
                                else pieces[0])

    def slots(self, pages: Indices, n: int) -> torch.Tensor:
        """The first `n` slots of `pages` (page numbers of this pool), as a new tensor."""
        if not n:  # an admission with nothing cached, say: a new tensor over no slots (`detach`
            return _NO_SLOTS.detach()  # costs half of `from_numpy`'s, a third of `torch.empty`'s)
        got = self._gather(pages, n)
        return torch.from_numpy(got if got.flags.writeable else got.copy())

    def _gather(self, pages: Indices, n: int) -> numpy.ndarray:
        """The first `n` slots of `pages`: one gather of rows, or at page size 1 (a slot is a
        page) a read-only view of the pages' own bytes."""
        at = numpy.frombuffer(pages.buffer(), dtype=numpy.int64)
        return at[:n] if self.page_size == 1 else self._rows.take(at, axis=0).reshape(-1)[:n]
