"""Verbs of the storage prefetcher: L3 -> host prefetch and host -> L3 backup.

The tree reserves host slots and names them; the prefetcher fills them from
storage (prefetch) or copies them to storage (backup) and reports in messages.
It never frees a slot: every prefetch ends with the tree's `StopPrefetch` and its
`PrefetchStopped`, after which the tree alone frees what was not kept (one party
frees host slots, as SGLang #9302 made it).

A prefetch, in messages::

    tree -> Prefetch(keys, host)           prefetcher: how many leading pages exist
         <- PrefetchHit(pages)             (the tree agrees on it across ranks, frees the surplus)
    tree -> ReadPrefetch(pages)            prefetcher: read them in bounded steps
         <- PrefetchProgress(pages, ...)   after each step: pages whose bytes are in host memory
    tree -> StopPrefetch                   whenever the tree terminates it (any time after Prefetch)
         <- PrefetchStopped(pages)         final: no byte of these slots is written after this
"""

from __future__ import annotations

import enum

from ._index import Indices
from ._registry import Message, message, wire_enum
from .common import Durations


@wire_enum(500)
class PrefetchEnd(enum.Enum):
    """Why a prefetch was terminated (statistics count each)."""

    COMPLETE = "complete"
    """Every page storage had arrived."""
    MISS = "miss"
    """Storage held none of the pages, or the lookup failed (a backend error, counted in
    `PrefetcherStatistics.io_errors`; an injected one in `errors`)."""
    FAILED = "failed"
    """A read failed before every page arrived (`wait_complete` policy)."""
    BEST_EFFORT = "best_effort"
    """The request ran with what had arrived (`best_effort` policy)."""
    TIMEOUT = "timeout"
    """It ended short under the `timeout` policy: its timeout expired, or a read failed first
    (which rank's read failed is not agreed, so the two are not told apart)."""
    ABORTED = "aborted"
    """The request was aborted while its prefetch was in flight."""
    RETRACTED = "retracted"
    """The request was retracted while its prefetch was in flight."""


@message(510)
class PrefetchEndCounts(Message):
    """Settled prefetches by why they ended: one field per `PrefetchEnd` member, named by its value."""

    complete: int
    """Every page storage had arrived."""
    miss: int
    """Storage held none of the pages, or the lookup failed."""
    failed: int
    """A read failed before every page arrived (`wait_complete` policy)."""
    best_effort: int
    """The request ran with what had arrived (`best_effort` policy)."""
    timeout: int
    """It ended short under the `timeout` policy."""
    aborted: int
    """The request was aborted while its prefetch was in flight."""
    retracted: int
    """The request was retracted while its prefetch was in flight."""

    def of(self, end: PrefetchEnd) -> int:
        """Settled prefetches that ended for `end`."""
        return int(getattr(self, end.value))


@message(500)
class Prefetch(Message):
    """Find how many leading pages of `keys` storage holds; reply `PrefetchHit`, then wait."""

    op_id: int
    """The tree's id of this prefetch."""
    keys: tuple[str, ...]
    """Storage keys of the pages, in token order (a hash chain seeded by the model and the namespace, rank suffix)."""
    host: Indices
    """The host pages the tree reserved: one per key, in key order."""


@message(501)
class PrefetchHit(Message):
    """Reply to `Prefetch`: storage holds the first `pages` keys (0: a miss)."""

    op_id: int
    """The prefetch."""
    pages: int
    """Leading pages found."""


@message(502)
class ReadPrefetch(Message):
    """Read the first `pages` pages (the hit the ranks agreed on) into the reserved slots."""

    op_id: int
    """The prefetch."""
    pages: int
    """Pages to read (at most the reported hit); slots past them are not touched."""


@message(503)
class PrefetchProgress(Message):
    """Pages of a prefetch whose bytes are in host memory (sent after each step)."""

    op_id: int
    """The prefetch."""
    pages: int
    """Leading pages complete so far."""
    finished: bool
    """No more pages will arrive: all were read, or a read failed."""
    error: str
    """What failed, if a read did (the pages after it are not read)."""


@message(504)
class StopPrefetch(Message):
    """Terminate a prefetch; the prefetcher answers `PrefetchStopped` with the final count."""

    op_id: int
    """The prefetch."""


@message(505)
class PrefetchStopped(Message):
    """Reply to `StopPrefetch`: nothing is written into the prefetch's slots any more."""

    op_id: int
    """The prefetch."""
    pages: int
    """Leading pages whose bytes are in host memory."""


@message(506)
class StorePages(Message):
    """Back up host pages to storage (pages already stored are not rewritten)."""

    op_id: int
    """The tree's id of this backup."""
    keys: tuple[str, ...]
    """Storage keys, one per page."""
    host: Indices
    """The host pages holding them, one per key (the tree pins them until `PagesStored`)."""


@message(507)
class PagesStored(Message):
    """Reply to `StorePages`."""

    op_id: int
    """The backup."""
    pages: int
    """Leading pages now in storage (written now or already there)."""
    written: int
    """Pages written by this backup."""
    error: str
    """What failed, if a page could not be stored."""


@message(508)
class PrefetcherStatistics(Message):
    """The prefetcher's numbers."""

    backend: str
    """Which backend (`file`, `mooncake`, or `none`)."""
    prefetches: int
    """Prefetches received."""
    in_flight: int
    """Prefetches not yet stopped."""
    pages_read: int
    """Pages read from storage into host memory."""
    bytes_read: int
    """Bytes read from storage."""
    pages_written: int
    """Pages written to storage by backups."""
    bytes_written: int
    """Bytes written to storage."""
    errors: int
    """Storage reads and writes that failed (misses of corrupt pages, timeouts, backend errors),
    and injected faults (a lookup's too). A lookup the backend could not make reads as a miss:
    only `io_errors` counts it."""
    stored_bytes: int = 0
    """Bytes the storage holds for this KV shape (file backend: allocated on disk; 0 for Mooncake)."""
    evicted_pages: int = 0
    """Pages the backend evicted to stay within `storage_max_bytes`."""
    io_errors: int = 0
    """OS or client errors the backend met (each logged once, with its path or key)."""
    prefetch_durations: Durations
    """Seconds from a prefetch's arrival to its `PrefetchStopped` (runtime clock)."""
    backup_durations: Durations
    """Seconds one backup's write to storage took (runtime clock)."""


@message(509)
class ContinuePrefetch(Message):
    """The prefetcher to itself: read the next step of a prefetch (a stop can come in between),
    or look again whether a stop held back by a pending backend call can be answered."""

    op_id: int
    """The prefetch."""
