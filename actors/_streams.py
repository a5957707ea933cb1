"""The two transfer stream actors: D2H writes and layer-by-layer H2D loads.

They do the work of SGLang's HiCacheController without its threads and polling:
operations arrive as messages, queue in a `TransferQueue` (merge small, split
large), are copied page-granular by a `CopyPlan` on the stream's route (the
device and host buffers, worked out once), and each completion is a message to
the requester. A failed copy is reported as failed, never as done.

On CUDA each stream has its own CUDA stream; it first orders itself after the
compute stream (the KV to write, or the slots to fill, are the compute stream's),
copies with `non_blocking`, records an event and completes an operation only when
its event has completed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from hicache.messages import (
    ActorName,
    CopyLayer,
    Indices,
    DrainWrites,
    LoadDone,
    LoadFailed,
    LoadKV,
    LoadsStarted,
    Message,
    StartLoads,
    StreamStatistics,
    WriteDone,
    WriteFailed,
    WriteKV,
)
from ._actor import Directory, HiActor
from ._layers import LayerDoneRing
from ._logging import logger
from ._services import Services
from hicache.messages.config import Config

from ._errors import InvariantError
from ._kv import CopyPlan, KVBuffer, _Route, involves_cuda
from ._pages import Ints, ints
from ._routes import Routes
from ._transfer_core import TransferOp, TransferQueue, _concat_slots, batch_indices, op_problem

TREE = ActorName.TREE

log = logger("hicache.streams")

_COPY_ERRORS = (RuntimeError, ValueError, IndexError)
"""What a torch copy raises on bad input or a device fault; reported as a failed transfer."""


def _route(src: KVBuffer, dst: KVBuffer, stream: ActorName) -> _Route:
    """The route a stream copies on. Between the GPU and a host buffer no kernel can reach
    (pageable memory: a pool built outside `System`, or pinning refused), copies go run by
    run through staging at a small share of the bus: said once, as a warning, when the
    stream starts."""
    route = _Route(src, dst)
    if route.mapped is None and involves_cuda(src, dst):
        host = src if src.device.type == "cpu" else dst
        log.warning("host KV buffer not reachable by GPU kernels: copies go run by run, far below the bus's "
                    "speed (pin the host buffer)", stream=stream.value, host_pinned=host.tensor.is_pinned())
    return route


class _CudaStream:
    """A side CUDA stream, or nothing on CPU (copies are synchronous there)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self, plan: CopyPlan, layer: int | None = None) -> tuple[int, Any]:
        """Run `plan` (all layers or one); its bytes and the event of its completion. On
        CUDA the copy goes on the side stream, after what the compute stream has queued,
        without blocking; on CPU it is done on return, and there is no event."""
        if self.stream is None:
            return plan.run(layer=layer), None
        self.stream.wait_stream(torch.cuda.default_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            nbytes = plan.run(layer=layer, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return nbytes, event


@dataclass(slots=True)
class _Counters:
    ops_done: int = 0
    ops_failed: int = 0
    slots_copied: int = 0
    bytes_copied: int = 0
    batches: int = 0

    def record(self, queue: TransferQueue, queued: int) -> StreamStatistics:
        return StreamStatistics(
            ops_done=self.ops_done,
            ops_failed=self.ops_failed,
            slots_copied=self.slots_copied,
            bytes_copied=self.bytes_copied,
            batches=self.batches,
            merged_ops=queue.merged_ops,
            split_ops=queue.split_ops,
            queued_ops=queued,
        )


def _enqueue(
    queue: TransferQueue,
    counters: _Counters,
    requester: ActorName,
    op_id: int,
    src: tuple[Indices, KVBuffer],
    dst: tuple[Indices, KVBuffer],
    what: str,
) -> str | None:
    """Queue an operation on pages; the reason it was refused (counted as failed), or None.
    The operation keeps its page numbers in the form their number calls for (Python ints
    for a few, see `FEW_MAX`), read from the message once."""
    p = src[1].shape.page_size
    s, d = ints(src[0]), ints(dst[0])
    problem = op_problem(s, src[1].slots // p, d, dst[1].slots // p, "page")
    if problem is None and not queue.push(TransferOp(op_id, requester, s, d)):
        problem = f"{what} queue full ({queue.ops_max} ops, transfer_queue_ops_max)"
    elif problem is not None:
        problem = f"bad {what}: {problem}"
    if problem is not None:
        counters.ops_failed += 1
    return problem


class WriteStreamActor(HiActor):
    """Copies device -> host. `WriteKV` in; `WriteDone` / `WriteFailed` to the requester."""

    name = ActorName.WRITE

    def __init__(
        self, *, config: Config, device_kv: KVBuffer, host_kv: KVBuffer, services: Services, directory: Directory
    ) -> None:
        super().__init__(services=services, directory=directory)
        self._device = device_kv
        self._host = host_kv
        self._route = _route(device_kv, host_kv, self.name)
        self._queue = TransferQueue(config.transfer_batch_pages, config.transfer_queue_ops_max)
        self._page = config.page_size
        self._cuda = _CudaStream(device_kv.device)
        self._drain_pending = False
        self._n = _Counters()

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        return WRITE_ROUTES.deliver(self, sender, message)

    def _on_write(self, m: WriteKV) -> WriteFailed | None:
        # The tree is the only sender its route admits: the requester the completion goes to.
        refused = _enqueue(self._queue, self._n, TREE, m.op_id, (m.device, self._device), (m.host, self._host), "write")
        if refused is not None:
            return WriteFailed(op_id=m.op_id, reason=refused)
        self._schedule_drain()
        return None

    def _on_drain(self, m: DrainWrites) -> None:
        self._drain_pending = False
        self._copy_next_batch()
        if len(self._queue):
            self._schedule_drain()

    def _schedule_drain(self) -> None:
        if not self._drain_pending:
            self._drain_pending = True
            self.send(self.name, DrainWrites())

    def _copy_next_batch(self) -> None:
        batch = [p for p in self._queue.next_batch() if not p.op.failed]
        if not batch:
            return
        ops = tuple(dict.fromkeys(p.op.op_id for p in batch))
        reason = self._services.faults.transfer_fault(self.name, ops)
        if reason is None:
            src, dst = batch_indices(batch)
            try:
                nbytes, event = self._cuda.run(self._route.plan_pages(src, dst))
                if event is not None:
                    event.synchronize()
            except _COPY_ERRORS as err:
                reason = f"copy failed: {err}"
        self._n.batches += 1
        for piece in batch:
            op = piece.op
            if reason is not None:
                if not op.failed:
                    op.failed = True
                    self._queue.cancel(op)
                    self._n.ops_failed += 1
                    self.send(op.requester, WriteFailed(op_id=op.op_id, reason=reason))
                continue
            if piece.last:
                self._n.ops_done += 1
                self._n.slots_copied += op.slots * self._page
                self.send(op.requester, WriteDone(op_id=op.op_id, slots=op.slots * self._page))
        if reason is None:
            self._n.bytes_copied += nbytes

    def check_invariants(self) -> None:
        self._queue.check_invariants()

    def statistics(self) -> StreamStatistics:
        return self._n.record(self._queue, len(self._queue))


@dataclass(slots=True)
class _LoadBatch:
    batch: int
    ops: list[TransferOp]
    src: Ints
    dst: Ints
    plan: CopyPlan | None = None
    """The batch's pieces, planned at its first layer and run for every layer."""
    refused: str = ""
    """Why a load queued for this batch was refused, or why an earlier batch that no forward
    pass waited on failed ("" when neither): the batch fails."""
    awaited: bool = True
    """A forward pass waits on it: `start_loads` started it or handed it out since. The failure
    of one that none waits on (`quiesce` and `close` start those) fails the next awaited one."""


class LoadStreamActor(HiActor):
    """Copies host -> device layer by layer. `LoadKV` queues, `StartLoads` starts a
    batch; per-layer progress goes to the `LayerDoneRing` the forward pass waits on;
    `LoadDone` / `LoadFailed` to each requester when the batch ends."""

    name = ActorName.LOAD

    def __init__(
        self,
        *,
        config: Config,
        device_kv: KVBuffer,
        host_kv: KVBuffer,
        ring: LayerDoneRing,
        services: Services,
        directory: Directory,
    ) -> None:
        super().__init__(services=services, directory=directory)
        self._device = device_kv
        self._host = host_kv
        self._route = _route(host_kv, device_kv, self.name)
        self._ring = ring
        self._layers = config.layers
        # Loads are merged per batch, never split: each step copies one layer.
        self._queue = TransferQueue(config.host_pages, config.transfer_queue_ops_max)
        self._page = config.page_size
        self._started: deque[_LoadBatch] = deque()
        self._running: _LoadBatch | None = None
        self._next_batch = 1
        self._refused = ""
        """The first load refused since the last start, and why: the batch the next start makes
        fails, whether a forward pass waits on it or not (the facade gives that batch to the
        requests admitted since the last start, whose admissions answered the refused host hits)."""
        self._unwaited = ""
        """Why a batch no forward pass waited on failed, when no awaited batch was started behind
        it: the next awaited batch fails (its forward pass may read what that batch was to load)."""
        self._cuda = _CudaStream(device_kv.device)
        self._n = _Counters()

    def handle(self, sender: ActorName, message: Message) -> Message | None:
        return LOAD_ROUTES.deliver(self, sender, message)

    def _on_load(self, m: LoadKV) -> LoadFailed | None:
        # The tree is the only sender its route admits: the requester the completion goes to.
        refused = _enqueue(self._queue, self._n, TREE, m.op_id, (m.host, self._host), (m.device, self._device), "load")
        if refused is not None:
            # The admission that sent it has answered a host hit already: the forward pass must
            # not read slots no load fills. The batch the next start gives it fails.
            self._refused = self._refused or f"load {m.op_id} was refused: {refused}"
            return LoadFailed(op_id=m.op_id, reason=refused)
        return None

    def _start(self, m: StartLoads) -> LoadsStarted:
        ops = self._queue.drain()
        refused, self._refused = self._refused, ""
        if m.awaited and self._unwaited:  # an unawaited batch's failure reaches a forward pass
            refused, self._unwaited = refused or self._unwaited, ""
        if not ops and not refused:  # a prefix an admission counted as a host hit may still be in a batch in flight
            last = self._started[-1] if self._started else self._running
            if last is not None and m.awaited:
                last.awaited = True
            return LoadsStarted(batch=last.batch if last is not None else 0, ops=())
        if len(ops) > 1:
            self._queue.merged_ops += len(ops)
        b = self._next_batch
        self._next_batch += 1
        src = _concat_slots([op.src for op in ops]) if ops else []
        dst = _concat_slots([op.dst for op in ops]) if ops else []
        self._started.append(_LoadBatch(b, ops, src, dst, refused=refused, awaited=m.awaited))
        started = LoadsStarted(batch=b, ops=tuple(op.op_id for op in ops))
        self.send(TREE, started)  # before any LoadDone of the batch: an eviction may wait for these
        self._run_next()
        return started

    def _run_next(self) -> None:
        if self._running is not None or not self._started:
            return
        self._running = self._started.popleft()
        self._ring.begin(self._running.batch)
        self.send(self.name, CopyLayer(batch=self._running.batch, layer=0))

    def _copy_layer(self, m: CopyLayer) -> None:
        b, layer = m.batch, m.layer
        run = self._running
        if run is None or run.batch != b:
            raise AssertionError(f"load stream: CopyLayer for batch {b} but batch {run and run.batch} is running")
        reason = None
        if layer == 0:
            reason = run.refused or self._services.faults.transfer_fault(self.name, tuple(op.op_id for op in run.ops))
        if reason is None:
            try:
                if run.plan is None:
                    run.plan = self._route.plan_pages(run.src, run.dst)
                nbytes, event = self._cuda.run(run.plan, layer)
                self._n.bytes_copied += nbytes
                self._ring.layer_done(b, layer, event)
            except _COPY_ERRORS as err:
                reason = f"copy of layer {layer} failed: {err}"
        if reason is not None:
            self._ring.fail(b, reason)
            self._finish(run, reason)
        elif layer + 1 < self._layers:
            self.send(self.name, CopyLayer(batch=b, layer=layer + 1))
        else:
            if event is not None:
                event.synchronize()
            self._finish(run, None)

    def _finish(self, run: _LoadBatch, reason: str | None) -> None:
        self._running = None
        self._n.batches += 1
        if reason is not None and not run.awaited:
            # Its requests' admissions answered host hits, and their forward pass waits on a later
            # batch: fail the next awaited one (started already, or the next start's).
            failed = f"load-back batch {run.batch}, which no forward pass waited on, failed: {reason}"
            later = next((r for r in self._started if r.awaited), None)
            if later is None:
                self._unwaited = self._unwaited or failed
            elif not later.refused:
                later.refused = failed
        for op in run.ops:
            if reason is None:
                self._n.ops_done += 1
                self._n.slots_copied += op.slots * self._page
                self.send(op.requester, LoadDone(op_id=op.op_id, batch=run.batch, slots=op.slots * self._page))
            else:
                self._n.ops_failed += 1
                self.send(op.requester, LoadFailed(op_id=op.op_id, reason=reason))
        self._run_next()

    def check_invariants(self) -> None:
        self._queue.check_invariants()
        if self._running is None and self._started:
            raise InvariantError("load stream: batches wait although none is running")

    def statistics(self) -> StreamStatistics:
        waiting = len(self._queue) + sum(len(b.ops) for b in self._started)
        return self._n.record(self._queue, waiting)


WRITE_ROUTES: Routes[WriteStreamActor] = Routes(ActorName.WRITE, {
    WriteKV: (TREE, WriteStreamActor._on_write, "copying device pages to host"),
    DrainWrites: (ActorName.WRITE, WriteStreamActor._on_drain, "copying the next write batch"),
})
"""The write stream's messages: the tree's writes, and the note it sends itself to copy the
next batch (after whatever else queued in its inbox)."""

LOAD_ROUTES: Routes[LoadStreamActor] = Routes(ActorName.LOAD, {
    LoadKV: (TREE, LoadStreamActor._on_load, "copying host pages to device"),
    StartLoads: (ActorName.FACADE, LoadStreamActor._start, "starting the queued loads"),
    CopyLayer: (ActorName.LOAD, LoadStreamActor._copy_layer, "copying the next layer of a load batch"),
})
"""The load stream's messages: the tree's loads, the scheduler's start before a forward pass,
and the note it sends itself to copy the next layer."""
