"""Verbs of the tree actor: admission, finish, chunked-prefill caching, eviction.

The facade (the scheduler's thread) sends these as the `facade`; the tree answers
each with one reply message to the facade once every step of it is done (device
slots for load-back allocated, the device ledger released, ...).
"""

from __future__ import annotations

from ._index import EMPTY, Indices, Tokens
from ._registry import Message, message
from .device import LedgerEntry, ReleaseReason
from .storage import PrefetchEnd, PrefetchEndCounts


@message(400)
class AdmitItem(Message):
    """One request to match against the cache."""

    request_id: str
    """The scheduler's request id."""
    namespace: str
    """Model / LoRA / cache-salt key; requests of different namespaces never share KV."""
    tokens: Tokens
    """The request's prompt (all of it; only whole pages can match)."""
    stored: int = 0
    """Tokens its settled storage prefetch read into host memory: of its host hit, at most
    this many are a storage hit (`Admission.storage_hit`)."""


@message(401)
class AdmitRequests(Message):
    """Match, lock and start load-back for a batch of requests."""

    op_id: int
    """Correlation id echoed in `Admitted`."""
    items: tuple[AdmitItem, ...]
    """The requests, in scheduling order."""


@message(402)
class Admission(Message):
    """What the cache has for one admitted request."""

    request_id: str
    """The request."""
    handle: int
    """Opaque lock handle: pass it back on finish, cache or release."""
    device: Indices
    """Device pages of the cached prefix (whole pages), in token order (pages still loading included)."""
    device_hit: int
    """Tokens of the prefix that were already in device memory."""
    host_hit: int
    """Tokens of the prefix being loaded back from host memory now."""
    host_miss: int
    """Tokens found in host memory but not loaded (quota, minimum length or device memory)."""
    storage_hit: int = 0
    """Of `host_hit`, the tokens the request's own storage prefetch read (`AdmitItem.stored`);
    those pages end the host part of the match, so the ones left in host memory (`host_miss`)
    are not."""
    waits: tuple[int, ...] = ()
    """The load-backs (their op ids) its `host_hit` waits for: those that bring in the nodes of
    its prefix still loading, queued by this admission or by earlier ones, started or not. The
    facade makes the waiter `start_loads` gives fail when one of them fails."""


@message(403)
class Admitted(Message):
    """Reply to `AdmitRequests`: one admission per item, in order."""

    op_id: int
    """The `op_id` of the admission."""
    admissions: tuple[Admission, ...]
    """Per request."""
    loads: Indices = EMPTY
    """The device pages whose load-back from host memory this admission queued (for any of its
    requests): they hold their KV only once the batch the next `StartLoads` starts lands them,
    layer by layer."""


@message(404)
class FinishItem(Message):
    """A request leaving: finished, aborted or retracted."""

    request_id: str
    """The request."""
    handle: int
    """Its lock handle."""
    tokens: Tokens
    """The tokens whose KV was committed after the cached prefix its handle locks, in order
    (the prefix itself the tree has: it is not sent again)."""
    device: Indices
    """The device pages of those tokens, in token order (the last may be partly committed)."""
    reason: ReleaseReason
    """Why it leaves."""
    allocs: int
    """Slots it took from the pages it holds (its last page's free part, pages held ahead) that
    the device was not told of yet (an allocation that fits there is local to the facade):
    passed on with its release."""
    commits: int
    """Slots it committed that the device was not told of yet (the caller's `commit` is
    local; the device hears of it with the next message about the request): passed on with its
    release."""


@message(405)
class FinishRequests(Message):
    """Insert each request's committed prefix, free the rest, release its handle: one place."""

    op_id: int
    """Correlation id echoed in `Finished`."""
    items: tuple[FinishItem, ...]
    """The requests."""


@message(406)
class Finished(Message):
    """Reply to `FinishRequests`, sent by the device once it released the requests'
    pages (the tree's `ReleaseRequests`): the final ledgers (freed == allocated)."""

    op_id: int
    """The `op_id` of the finish."""
    entries: tuple[LedgerEntry, ...]
    """Per request, in order."""


@message(407)
class CacheItem(Message):
    """An unfinished request whose committed prefix should be cached now (chunked prefill)."""

    request_id: str
    """The request."""
    handle: int
    """Its lock handle (released; a new one is returned)."""
    tokens: Tokens
    """Tokens committed so far after the cached prefix its handle locks."""
    device: Indices
    """Their device pages, in token order (the last may be partly committed)."""
    allocs: int
    """Slots it took from the pages it holds that the device was not told of yet: passed on
    with its swap."""
    commits: int
    """Slots it committed that the device was not told of yet: passed on with its swap."""


@message(408)
class CacheUnfinished(Message):
    """Insert committed prefixes, swap to the tree's slots, move the locks."""

    op_id: int
    """Correlation id echoed in `Cached`."""
    items: tuple[CacheItem, ...]
    """The requests."""


@message(409)
class CachedPrefix(Message):
    """One request after caching: its new handle and the pages its prefix now uses."""

    request_id: str
    """The request."""
    handle: int
    """The new lock handle (the old one is released)."""
    device: Indices
    """Device pages of the cached (page-aligned) prefix: the tree's, which replace the request's."""


@message(410)
class Cached(Message):
    """Reply to `CacheUnfinished`."""

    op_id: int
    """The `op_id` of the request."""
    prefixes: tuple[CachedPrefix, ...]
    """Per request, in order (empty when the batch was refused)."""
    refused: tuple[str, ...]
    """Requests whose cached prefix was lost to a failed load-back: nothing was done."""


@message(411)
class EvictDevice(Message):
    """Free at least `tokens` device slots held by the tree, if it can."""

    op_id: int
    """Correlation id echoed in `Evicted`."""
    tokens: int
    """How many slots to free."""


@message(412)
class EvictHost(Message):
    """Free at least `tokens` host slots held by host-only nodes, if it can."""

    op_id: int
    """Correlation id echoed in `Evicted`."""
    tokens: int
    """How many slots to free."""


@message(413)
class Evicted(Message):
    """Reply to `EvictDevice` / `EvictHost` (to the facade) and `EvictForAllocation` (to the device)."""

    op_id: int
    """The `op_id` of the request."""
    device_tokens: int
    """Device slots freed (the frees are queued at the device allocator before this reply)."""
    host_tokens: int
    """Host slots freed."""


@message(429)
class EvictForAllocation(Message):
    """From the device allocator, short of free pages for an allocation: free at least `tokens`
    device slots held by the tree if it can, as `EvictDevice` does, and answer it `Evicted`."""

    op_id: int
    """The allocation's `op_id`, echoed in `Evicted`."""
    tokens: int
    """How many slots the allocation is short of."""


@message(414)
class TreeStatistics(Message):
    """The tree's numbers."""

    nodes: int
    """Nodes, roots excluded."""
    device_tokens: int
    """Tokens resident in device memory (loading included)."""
    host_tokens: int
    """Tokens with a host copy (writing included)."""
    protected_tokens: int
    """Device tokens under a lock."""
    evictable_tokens: int
    """Device tokens not under a lock."""
    live_handles: int
    """Lock handles held by requests."""
    writes_in_flight: int
    """Write-throughs not yet acknowledged."""
    loads_in_flight: int
    """Load-backs not yet acknowledged."""
    looked_up_tokens: int
    """Prompt tokens admissions matched against the cache (hit or not)."""
    device_hit_tokens: int
    """Tokens matched in device memory by admissions."""
    host_hit_tokens: int
    """Tokens admissions answered as host hits whose load-back landed (counted as it lands:
    a load-back that fails counts none)."""
    evicted_device_tokens: int
    """Device tokens evicted."""
    evicted_host_tokens: int
    """Host tokens evicted."""
    backups_done: int
    """Write-throughs completed."""
    backups_failed: int
    """Write-throughs that failed or found no host memory."""
    prefetches_started: int
    """Storage prefetches started."""
    prefetches_in_flight: int
    """Storage prefetches not yet settled."""
    prefetch_skipped: int
    """Prefetches not started for the rate limit or for want of host memory."""
    prefetch_ends: PrefetchEndCounts
    """Settled prefetches by why they ended."""
    storage_hit_tokens: int
    """Tokens of the pages settled prefetches agreed on: storage held them and they were read
    into host memory (pages the tree already held by then count too; their copies are freed).
    The sum of the per-request `PrefetchesSettled` tokens."""
    stored_tokens: int
    """Tokens written to storage by backups (pages already there not counted)."""
    backups_in_flight: int
    """Backups to storage issued and not yet landed (their nodes are host-pinned)."""
    facts_pending: int
    """Rank-local outcomes issued and not yet applied (waiting for agreement with several ranks)."""
    facts_unknown: int
    """Rank-local outcomes issued whose local result has not arrived yet."""
    host_hit_storage_tokens: int = 0
    """Of `host_hit_tokens`, those the requests' own storage prefetches read
    (`Admission.storage_hit`): counted with them, as the load-back lands, so that one record
    splits L2's hits from L3's."""


@message(415)
class PrefetchRequests(Message):
    """Start storage prefetches for queued requests (those whose missing part is long enough)."""

    op_id: int
    """Correlation id echoed in `PrefetchesStarted`."""
    items: tuple[AdmitItem, ...]
    """The requests, with their prompts."""


@message(416)
class PrefetchesStarted(Message):
    """Reply to `PrefetchRequests`: host tokens reserved per request (0: no prefetch started)."""

    op_id: int
    """The `op_id` of the request."""
    tokens: tuple[int, ...]
    """Per item, in order."""


@message(417)
class PrefetchStates(Message):
    """May these requests' prefetches terminate now, by this rank's view and the policy?"""

    op_id: int
    """Correlation id echoed in `PrefetchReadiness`."""
    request_ids: tuple[str, ...]
    """The requests (one without a prefetch is ready)."""


@message(418)
class PrefetchReadiness(Message):
    """Reply to `PrefetchStates`."""

    op_id: int
    """The `op_id` of the request."""
    ready: tuple[bool, ...]
    """Per request, in order (the ranks then agree: all must say yes)."""


@message(419)
class TerminatePrefetches(Message):
    """Stop these requests' prefetches; reply once each prefetcher confirmed its final count."""

    op_id: int
    """Correlation id echoed in `PrefetchesStopped`."""
    request_ids: tuple[str, ...]
    """The requests (one without a prefetch counts 0 pages)."""
    reason: PrefetchEnd
    """`BEST_EFFORT` for a termination by policy, `ABORTED` / `RETRACTED` for a cancelled request."""


@message(420)
class PrefetchesStopped(Message):
    """Reply to `TerminatePrefetches`: pages complete on this rank, per request."""

    op_id: int
    """The `op_id` of the request."""
    pages: tuple[int, ...]
    """Per request, in order."""


@message(421)
class SettlePrefetches(Message):
    """Keep the agreed pages of stopped prefetches as host-only nodes; free the rest (one place)."""

    op_id: int
    """Correlation id echoed in `PrefetchesSettled`."""
    request_ids: tuple[str, ...]
    """The requests, as in `TerminatePrefetches`."""
    pages: tuple[int, ...]
    """Agreed complete pages per request (the minimum over ranks)."""


@message(422)
class PrefetchesSettled(Message):
    """Reply to `SettlePrefetches`: tokens now in host memory from storage, per request."""

    op_id: int
    """The `op_id` of the request."""
    tokens: tuple[int, ...]
    """Per request, in order."""


@message(423)
class ReportFacts(Message):
    """Ask for the rank-local outcomes waiting for agreement (tensor parallel)."""

    op_id: int
    """Correlation id echoed in `LocalFacts`."""


@message(424)
class LocalFacts(Message):
    """Reply to `ReportFacts`."""

    op_id: int
    """The `op_id` of the request."""
    known: tuple[int, ...]
    """Per kind of outcome (write, load, hit, backup): leading operations known on this rank."""
    values: tuple[int, ...]
    """Their outcomes, concatenated in kind order."""


@message(425)
class ApplyFacts(Message):
    """Apply agreed outcomes: the first `counts[k]` operations of each kind, with `values`."""

    op_id: int
    """Correlation id echoed in `FactsApplied`."""
    counts: tuple[int, ...]
    """Per kind, how many (the minimum of every rank's `known`)."""
    values: tuple[int, ...]
    """Their agreed outcomes (the minimum over ranks), concatenated in kind order."""


@message(426)
class FactsApplied(Message):
    """Reply to `ApplyFacts`."""

    op_id: int
    """The `op_id` of the request."""


@message(427)
class DigestTree(Message):
    """Ask for a digest of the tree's logical state (equal on every rank of a group)."""

    op_id: int
    """Correlation id echoed in `TreeDigest`."""


@message(428)
class TreeDigest(Message):
    """Reply to `DigestTree`."""

    op_id: int
    """The `op_id` of the request."""
    digest: str
    """Hex digest over every node's pages, state, locks and pins, and the host mirror."""
    host_used: int
    """Host slots the tree holds or has reserved."""
