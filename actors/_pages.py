"""`PagePool`: the free list of pages behind both slot allocators.

A stack of free page numbers in one int64 tensor: allocating `k` pages takes the
top `k`, freeing pushes them back. O(1) per page and vectorised; ownership and
double-free checks belong to the pool's owner (which knows each page's state).
"""

from __future__ import annotations

import torch

SMALL_SLOTS_MAX = 64
"""Calls on at most this many slots (or pages) check and compute with Python ints (`tolist`)
instead of vectorised torch calls: on a few slots each torch call costs microseconds of
overhead, and a check takes a dozen of them. Larger calls, and inputs a check refuses, take
the torch path (which names what is wrong)."""


class PagePool:
    def __init__(self, pages: int, page_size: int) -> None:
        if pages <= 0 or page_size <= 0:
            raise ValueError(f"pages={pages} and page_size={page_size} must be > 0")
        self.pages = pages
        self.page_size = page_size
        # Reversed so that a fresh pool hands out pages 0, 1, 2, ... in order.
        self._stack = torch.arange(pages - 1, -1, -1, dtype=torch.int64)
        self._top = pages

    @property
    def free_pages(self) -> int:
        return self._top

    @property
    def free_slots(self) -> int:
        return self._top * self.page_size

    def alloc(self, k: int) -> torch.Tensor | None:
        """`k` free page numbers (a new tensor), or None if fewer are free."""
        if k < 0:
            raise ValueError(f"cannot allocate {k} pages")
        if k > self._top:
            return None
        self._top -= k
        return self._stack[self._top : self._top + k].flip(0).clone()

    def free(self, pages: torch.Tensor) -> None:
        """Push pages back. The caller has checked they were allocated."""
        k = len(pages)
        if self._top + k > self.pages:
            raise AssertionError(
                f"freeing {k} pages would give {self._top + k} free of {self.pages}: double free"
            )
        self._stack[self._top : self._top + k] = pages.flip(0)
        self._top += k

    def free_page_set(self) -> torch.Tensor:
        """The free page numbers (for invariant checks)."""
        return self._stack[: self._top]


def pages_of(indices: torch.Tensor, page_size: int, what: str) -> torch.Tensor:
    """The page numbers of `indices`, which must be whole pages in slot order.

    Raises ValueError naming `what` when the indices are not page aligned.
    """
    n = len(indices)
    if n % page_size:
        raise ValueError(f"{what}: {n} slots are not whole pages of {page_size}")
    if n == 0:
        return torch.empty(0, dtype=torch.int64)
    if n <= SMALL_SLOTS_MAX:
        slots = indices.tolist()
        firsts = slots[::page_size]
        if all(f % page_size == 0 and slots[i : i + page_size] == list(range(f, f + page_size))
               for i, f in zip(range(0, n, page_size), firsts)):
            return torch.tensor([f // page_size for f in firsts], dtype=torch.int64)
    grid = indices.view(-1, page_size)
    first = grid[:, 0]
    aligned = (first % page_size == 0) & (grid == first.unsqueeze(1) + torch.arange(page_size)).all(1)
    if not bool(aligned.all()):
        bad = int((~aligned).nonzero()[0, 0])
        raise ValueError(
            f"{what}: slots {grid[bad].tolist()} are not one whole page (page_size={page_size})"
        )
    return first // page_size


def slots_of_pages(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every slot of `pages`, in page order (the inverse of `pages_of`)."""
    if len(pages) * page_size <= SMALL_SLOTS_MAX:
        return torch.tensor([page * page_size + i for page in pages.tolist() for i in range(page_size)],
                            dtype=torch.int64)
    return (pages.unsqueeze(1) * page_size + torch.arange(page_size)).reshape(-1)
