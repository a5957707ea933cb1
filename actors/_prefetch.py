"""`StoragePrefetcherActor`: the storage (L3) client; prefetch into host slots and backup from them.

It owns no slot and frees nothing (SGLang #9302): the tree reserves the host slots of
a prefetch and names them in `Prefetch`; the prefetcher fills them and reports in
messages, and every prefetch ends with the tree's `StopPrefetch`, answered by the
final page count, after which the prefetcher never writes those slots again. The
tree alone then keeps or frees them.

Reads go in steps of `Config.storage_step_pages`, each step a message to itself, so a
`StopPrefetch` waits for one step at most. The backend reads straight into the
reserved slots and verifies the pages there; a page counts as complete only once
it is verified. A backend call that overran its timeout may still be writing
host memory (`StorageBackend.pending`): while it is, `PrefetchStopped` waits,
checked again every `STOP_RECHECK_S`, since after it the tree may reuse the slots.
Injected storage latency delays the next step by a runtime timer, never a sleep,
so the deterministic runtime runs it in virtual time. Every storage fault is an
operating condition: a miss or a failed backup, never a failed actor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.messages import (
    ActorName,
    ContinuePrefetch,
    Indices,
    Message,
    PagesStored,
    Prefetch,
    PrefetcherStatistics,
    PrefetchHit,
    PrefetchProgress,
    PrefetchStopped,
    ReadPrefetch,
    StopPrefetch,
    StorePages,
)
from ._actor import Directory, HiActor
from ._services import Services
from hicache.messages.config import Config

from ._durations import DurationHistogram
from ._errors import InvariantError
from ._kv import KVBuffer
from ._pages import as_tensor, slots_of_pages
from ._routes import Routes
from ._stored_page import StorageUsage

TREE = ActorName.TREE

STOP_RECHECK_S = 0.05
"""How often a stop held back by a pending backend call looks again."""


@dataclass(slots=True)
class _Read:
    keys: tuple[str, ...]
    host: torch.Tensor
    hit: int
    started_s: float
    """When the prefetch arrived (runtime clock)."""
    target: int = 0
    """Pages the tree asked to read (its agreed hit)."""
    done: int = 0
    """Leading pages whose bytes are in host memory."""
    finished: bool = False
    step_pending: bool = False
    stopping: bool = False
    """The tree stopped it; the reply waits for a pending backend call to return."""


@dataclass(slots=True)
class _Counters:
    prefetches: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    pages_written: int = 0
    bytes_written: int = 0
    errors: int = 0
    prefetch_s: DurationHistogram = field(default_factory=DurationHistogram)
    backup_s: DurationHistogram = field(default_factory=DurationHistogram)


class StoragePrefetcherActor(HiActor):
    name = ActorName.PREFETCH

    def __init__(
        self, *, config: Config, host_kv: KVBuffer, backend: Any, services: Services, directory: Directory
    ) -> None:
        super().__init__(services=services, directory=directory)
        self._host = host_kv
        self._backend = backend
        """A `StorageBackend`, or None when the config has no storage (every page is a miss)."""
        self._page = config.page_size
        self._batch = config.storage_step_pages
        self._reads: dict[int, _Read] = {}
        self._n = _Counters()

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        return PREFETCH_ROUTES.deliver(self, sender, message)

    def _on_prefetch(self, m: Prefetch) -> PrefetchHit:
        return PrefetchHit(op_id=m.op_id, pages=self._start(m.op_id, m.keys, self._slots(m.host)))

    def _on_read(self, m: ReadPrefetch) -> None:
        r = self._reads[m.op_id]
        if m.pages > r.hit:
            raise InvariantError(f"prefetch {m.op_id}: asked to read {m.pages} pages but storage holds {r.hit}")
        r.target = m.pages
        self._schedule(m.op_id, r)

    def _slots(self, pages: Indices) -> torch.Tensor:
        """The host slots of the pages a message names (backends read and write by slot)."""
        return as_tensor(slots_of_pages(pages.as_tensor(), self._page))

    def _start(self, op: int, keys: tuple[str, ...], host: torch.Tensor) -> int:
        if op in self._reads:
            raise InvariantError(f"prefetch {op} started twice")
        if len(host) != len(keys) * self._page:
            raise InvariantError(f"prefetch {op}: {len(keys)} pages need {len(keys) * self._page} slots, got {len(host)}")
        self._n.prefetches += 1
        hit = 0
        fault = self._services.faults.storage_fault(op, "exists")
        if fault is not None:
            self._n.errors += 1
        elif self._backend is not None:
            hit = self._backend.exists(keys)
        self._reads[op] = _Read(keys, host, hit, self._services.clock.now_s())
        return hit

    def _schedule(self, op: int, r: _Read) -> None:
        if r.done >= r.target:
            r.finished = True
            self.send(ActorName.TREE, PrefetchProgress(op_id=op, pages=r.done, finished=True, error=""))
            return
        r.step_pending = True
        delay = self._services.faults.storage_delay(op)
        if delay > 0:
            self.send_later(delay, self.name, ContinuePrefetch(op_id=op))
        else:
            self.send(self.name, ContinuePrefetch(op_id=op))

    def _stop_read(self, op: int) -> PrefetchStopped | None:
        r = self._reads.get(op)
        if r is None:  # the tree stops one that never reached storage
            return PrefetchStopped(op_id=op, pages=0)
        if getattr(self._backend, "pending", ""):
            if not r.stopping:
                r.stopping = True
                self.send_later(STOP_RECHECK_S, self.name, ContinuePrefetch(op_id=op))
            return None
        del self._reads[op]
        self._n.prefetch_s.observe(self._services.clock.now_s() - r.started_s)
        return PrefetchStopped(op_id=op, pages=r.done)

    def _step(self, op: int) -> Message | None:
        r = self._reads.get(op)
        if r is None:  # stopped while the step was queued
            return None
        if r.stopping:
            r.stopping = False
            stopped = self._stop_read(op)
            if stopped is not None:
                self.send(ActorName.TREE, stopped)
            return None
        r.step_pending = False
        p = self._page
        a, b = r.done, min(r.done + self._batch, r.target)
        error = self._services.faults.storage_fault(op, "read") or ""
        got = 0
        if not error:
            io = self._backend.read(r.keys[a:b], self._host, r.host[a * p : b * p])
            got, error = io.pages, io.error
            self._n.bytes_read += io.bytes
        self._n.pages_read += got
        self._n.errors += bool(error)
        r.done += got
        if error:
            r.finished = True
            self.send(ActorName.TREE, PrefetchProgress(op_id=op, pages=r.done, finished=True, error=error))
            return None
        if r.done < r.target:
            self.send(ActorName.TREE, PrefetchProgress(op_id=op, pages=r.done, finished=False, error=""))
        self._schedule(op, r)
        return None

    def _store(self, op: int, keys: tuple[str, ...], host: torch.Tensor) -> PagesStored:
        if len(host) != len(keys) * self._page:
            raise InvariantError(f"backup {op}: {len(keys)} pages need {len(keys) * self._page} slots, got {len(host)}")
        error = self._services.faults.storage_fault(op, "write") or ""
        if error or self._backend is None:
            self._n.errors += 1
            return PagesStored(op_id=op, pages=0, written=0, error=error or "no storage backend configured")
        started_s = self._services.clock.now_s()
        io = self._backend.write(keys, self._host, host)
        self._n.backup_s.observe(self._services.clock.now_s() - started_s)
        self._n.pages_written += io.written
        self._n.bytes_written += io.bytes
        self._n.errors += bool(io.error)
        return PagesStored(op_id=op, pages=io.pages, written=io.written, error=io.error)

    def awaiting(self) -> tuple[str, ...]:
        steps = sum(r.step_pending for r in self._reads.values())
        return (f"{steps} storage read steps",) if steps else ()

    def check_invariants(self) -> None:
        if self._backend is not None:
            self._backend.check_invariants()
        for op, r in self._reads.items():
            if not 0 <= r.done <= r.target <= r.hit <= len(r.keys):
                raise InvariantError(f"prefetch {op}: 0 <= done {r.done} <= target {r.target} <= hit {r.hit} "
                                     f"<= {len(r.keys)} pages does not hold")

    def statistics(self) -> PrefetcherStatistics:
        n = self._n
        usage = StorageUsage() if self._backend is None else self._backend.usage()
        return PrefetcherStatistics(
            backend=getattr(self._backend, "name", "none"), prefetches=n.prefetches, in_flight=len(self._reads),
            pages_read=n.pages_read, bytes_read=n.bytes_read, pages_written=n.pages_written,
            bytes_written=n.bytes_written, errors=n.errors, stored_bytes=usage.stored_bytes,
            evicted_pages=usage.evicted_pages, io_errors=usage.io_errors,
            prefetch_durations=n.prefetch_s.snapshot(), backup_durations=n.backup_s.snapshot(),
        )

    def on_stop(self) -> None:
        if self._backend is not None:
            self._backend.close()


PREFETCH_ROUTES: Routes[StoragePrefetcherActor] = Routes(ActorName.PREFETCH, {
    Prefetch: (TREE, StoragePrefetcherActor._on_prefetch, "looking up a prefetch in storage"),
    ReadPrefetch: (TREE, StoragePrefetcherActor._on_read, "reading a prefetch into host slots"),
    StopPrefetch: (TREE, lambda actor, m: actor._stop_read(m.op_id), "stopping a prefetch"),
    StorePages: (TREE, lambda actor, m: actor._store(m.op_id, m.keys, actor._slots(m.host)), "backing up host pages"),
    ContinuePrefetch: (ActorName.PREFETCH, lambda actor, m: actor._step(m.op_id), "reading the next step of a prefetch"),
})
"""The prefetcher's messages: every verb from the tree (it reserves and frees the slots the
prefetcher fills), and the note it sends itself for each read step."""
