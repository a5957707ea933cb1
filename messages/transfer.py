"""Verbs of the two transfer streams: device -> host writes, host -> device loads."""

from __future__ import annotations

from ._index import Indices
from ._registry import Message, message


@message(300)
class WriteKV(Message):
    """Copy KV from device pages into host pages (D2H). Replies `WriteDone` or `WriteFailed`."""

    op_id: int
    """The requester's id for this operation."""
    device: Indices
    """Source device pages."""
    host: Indices
    """Destination host pages, as many as `device`."""


@message(301)
class WriteDone(Message):
    """Every byte of a write is in host memory."""

    op_id: int
    """The operation."""
    slots: int
    """Slots copied."""


@message(302)
class WriteFailed(Message):
    """A write did not complete; its host slots hold no valid KV."""

    op_id: int
    """The operation."""
    reason: str
    """What went wrong."""


@message(303)
class LoadKV(Message):
    """Queue a copy of KV from host pages into device pages (H2D); `StartLoads` starts it."""

    op_id: int
    """The requester's id for this operation."""
    host: Indices
    """Source host pages."""
    device: Indices
    """Destination device pages, as many as `host`."""


@message(304)
class StartLoads(Message):
    """Start every queued load as one batch, layer by layer."""

    awaited: bool = True
    """A forward pass waits on the batch (`start_loads`). False: `quiesce` and `close`, which
    start queued loads that nobody waits on; if such a batch fails, the next awaited batch
    fails too (the requests it counted a host hit for would read slots no load filled)."""


@message(305)
class LoadsStarted(Message):
    """Reply to `StartLoads`: which batch the forward pass waits on. The tree is told too: an
    eviction may wait for a started load-back (one the facade has not started may never land)."""

    batch: int
    """Batch number (generation); 0 when nothing was queued."""
    ops: tuple[int, ...]
    """Operations in the batch."""


@message(306)
class LoadDone(Message):
    """Every layer of a load is in device memory."""

    op_id: int
    """The operation."""
    batch: int
    """The batch it was part of."""
    slots: int
    """Slots copied."""


@message(307)
class LoadFailed(Message):
    """A load did not complete; its device slots hold no valid KV."""

    op_id: int
    """The operation."""
    reason: str
    """What went wrong."""


@message(308)
class DrainWrites(Message):
    """The write stream's note to itself: copy the next merged batch of queued writes."""


@message(309)
class CopyLayer(Message):
    """The load stream's note to itself: copy one layer of the running batch."""

    batch: int
    """The running batch."""
    layer: int
    """The layer to copy next."""


@message(310)
class StreamStatistics(Message):
    """Counters of one transfer stream."""

    ops_done: int
    """Operations completed."""
    ops_failed: int
    """Operations reported failed."""
    slots_copied: int
    """Slots copied by completed operations."""
    bytes_copied: int
    """Bytes copied."""
    batches: int
    """Copy batches run (merged writes, or load batches)."""
    merged_ops: int
    """Operations that shared a batch with another."""
    split_ops: int
    """Operations split over several batches."""
    queued_ops: int
    """Operations waiting now."""
