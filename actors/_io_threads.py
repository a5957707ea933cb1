"""`IOThreads`: the pieces of one storage call run on the caller's thread and a few helpers.

A verified read from the page cache is bound by one core: the kernel's copy into the
host slots, then the checksum over the same bytes, each a fraction of what memory can
do. Both release the interpreter lock (`preadv`, and XXH3 over a whole large page), so
the independent pieces of one read (adjacent records, each into its own host slots)
run side by side on `threads` threads: the caller's and `threads - 1` helpers. A helper
is a daemon thread, started at the first call that has pieces for it, so a process with
storage reads that hang (a dead network mount) still exits; a `ThreadPoolExecutor`
would join it at exit. A child forked after the helpers started has none of their
threads, so its first call starts helpers of its own.

The call is synchronous: `map` returns once every piece has finished, whatever failed,
so no helper is still writing into host slots the caller's caller may hand on. `start`
hands one piece to the first helper and returns at once: the file backend's writes send
one batch of records while the caller makes the next, and take its outcome before the
call returns. Which
piece runs where changes nothing but time: each piece reads its own bytes into its own
slots and returns its own checksums, and the caller combines them in order. This module
and the Mooncake client's call thread are where the storage backends use threads; the
actors above them take time, ids and timers from the runtime.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Final, TypeVar

THREADED_PAGE_BYTES_MIN: Final = 256 << 10
"""Pages at least this large are verified on `storage_read_threads` threads together: their
`preadv` (file) and checksums run without the interpreter lock, so on two threads a file
read of 2 MiB pages from the page cache runs at about the rate of one unverified `preadv`
(docs/benchmarks.md). Smaller pages stay on the prefetcher's thread: their checksums and
per-page Python hold the lock, and a hand-off cost more than it gave (64 KiB pages: 0.24-0.40
of a raw read on two threads, 0.31-0.54 on one)."""

CLOSE_JOIN_TIMEOUT_S: Final = 10.0
"""How long `close` waits for each helper to end (after the work it has): one stuck in a read
of a dead mount is left to the process's exit."""

T = TypeVar("T")
R = TypeVar("R")


class IOThreads:
    """`threads` threads in all for the pieces of one call: the caller's and `threads - 1` helpers."""

    def __init__(self, threads: int, name: str) -> None:
        if type(threads) is not int or threads < 1:
            raise ValueError(f"IOThreads needs at least 1 thread, got {threads!r}")
        self.threads = threads
        self._name = name
        self._helpers: list[queue.SimpleQueue[Any]] = []
        """Each helper's queue of work (a share of a call's pieces), in start order."""
        self._threads: list[threading.Thread] = []
        """The helpers' threads, in the same order."""
        self._pid = os.getpid()
        """The process the helpers run in: a fork's child has none of them, and starts its own."""

    def threads_for(self, page_bytes: int) -> int:
        """The threads a read of pages of `page_bytes` runs on: all of them for pages of
        `THREADED_PAGE_BYTES_MIN` or more, else the caller's alone."""
        return self.threads if page_bytes >= THREADED_PAGE_BYTES_MIN else 1

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """`[fn(item) for item in items]`, item k on thread k % threads (0: the caller's).
        Returns when all have finished. If any failed, raises once all have ended: the caller's
        share's exception, else the first failed helper's (each share stops at its failure)."""
        n = min(self.threads, len(items))
        if n <= 1:
            return [fn(item) for item in items]
        self._start(n - 1)
        shares: list[Future[list[R]]] = []
        for k in range(1, n):
            done: Future[list[R]] = Future()
            self._helpers[k - 1].put((done, fn, items[k::n]))
            shares.append(done)
        mine: list[R] | None = None
        failed: BaseException | None = None
        try:
            mine = [fn(item) for item in items[0::n]]
        except BaseException as err:  # the helpers' pieces still run: wait for them first
            failed = err
        theirs: list[list[R]] = []
        for share in shares:
            try:
                theirs.append(share.result())
            except BaseException as err:
                theirs.append([])
                failed = failed or err
        if failed is not None:
            raise failed
        assert mine is not None
        out: list[R] = [None] * len(items)  # type: ignore[list-item]
        out[0::n] = mine
        for k, got in enumerate(theirs, start=1):
            out[k::n] = got
        return out

    def start(self, fn: Callable[[T], R], item: T) -> Future[list[R]]:
        """`fn(item)` on the first helper, begun now: the caller goes on with other work and
        takes the outcome from the future (`[fn(item)]`, or what it raised) before it starts
        the next one. Needs a helper (`threads` >= 2)."""
        if self.threads < 2:
            raise ValueError(f"IOThreads.start needs a helper thread; this one has {self.threads} thread")
        self._start(1)
        done: Future[list[R]] = Future()
        self._helpers[0].put((done, fn, (item,)))
        return done

    def close(self) -> None:
        """Stop the helpers, each after the work it has, and wait for them to end (up to
        `CLOSE_JOIN_TIMEOUT_S` each): once closed, no helper of this one runs (a process that
        exits then stops no thread halfway through native code)."""
        for work in self._helpers:
            work.put(None)
        threads = self._threads if self._pid == os.getpid() else []
        self._helpers, self._threads = [], []
        for thread in threads:
            thread.join(CLOSE_JOIN_TIMEOUT_S)

    def _start(self, helpers: int) -> None:
        if self._pid != os.getpid():  # forked since they started: their threads stayed in the parent
            self._helpers, self._threads, self._pid = [], [], os.getpid()
        while len(self._helpers) < helpers:
            work: queue.SimpleQueue[Any] = queue.SimpleQueue()
            name = f"{self._name}-{len(self._helpers) + 1}"
            thread = threading.Thread(target=_serve, args=(work,), name=name, daemon=True)
            thread.start()
            self._helpers.append(work)
            self._threads.append(thread)


def shares(n: int, k: int) -> list[tuple[int, int]]:
    """`range(n)` in `k` contiguous shares of nearly equal size, as (start, stop)."""
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def _serve(work: queue.SimpleQueue[Any]) -> None:
    while (task := work.get()) is not None:
        done, fn, items = task
        try:
            done.set_result([fn(item) for item in items])
        except BaseException as err:  # handed to the caller, which raises it
            done.set_exception(err)
