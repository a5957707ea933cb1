"""Per-layer load progress that the forward pass waits on.

The load stream copies a batch layer by layer and publishes each finished layer
here; the forward pass calls `wait_layer(i)` before attention reads layer `i`.
Progress lives in a bounded ring of `ring_size` batches, so the next batch's load
can run while the forward pass still reads the previous one. A batch that fails
makes every wait on it raise `LoadFailedError`: a failed copy is never "done", not even
once newer batches took its slot (the last `FAILED_REMEMBERED_MAX` failures are kept).

On CUDA the load stream records one event per layer and `wait_layer` makes the
caller's current stream wait on it: the host returns as soon as the event is
recorded, and the GPU orders the read after the copy.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch


class LoadFailedError(RuntimeError):
    """The load batch the forward pass waits on failed; its KV is not valid."""


class StaleWaiterError(RuntimeError):
    """A waiter outlived its ring slot: `ring_size` newer batches started since."""


@dataclass(slots=True)
class _Slot:
    batch: int = 0
    layers_done: int = 0
    failure: str | None = None
    events: list[Any] | None = None
    waited: int = 0
    """A bit per layer a `wait_layer` returned for: on CUDA the waiter's stream reads it after its copy."""


FAILED_REMEMBERED_MAX = 1024
"""Failed batches a ring remembers past their slots (`LayerDoneRing.failure`): a read check
refuses the pages of one of them however many batches began since, up to this many newer
failures."""


class LayerDoneRing:
    """Threaded implementation: a condition variable over `ring_size` slots."""

    def __init__(self, ring_size: int, layers: int) -> None:
        if ring_size <= 0 or layers <= 0:
            raise ValueError(f"ring_size={ring_size} and layers={layers} must be > 0")
        self.ring_size = ring_size
        self.layers = layers
        self._slots = [_Slot() for _ in range(ring_size)]
        self._cond = threading.Condition()
        self._failed: dict[int, str] = {}
        """The last `FAILED_REMEMBERED_MAX` failed batches and why, kept past their ring slots:
        a failed batch never lands, however many batches began since (`landed`, `failure`)."""

    # -- producer side (the load stream) ------------------------------------

    def check_layer(self, layer: Any) -> None:
        """ValueError unless `layer` is an int (not a bool) in 0..layers - 1."""
        if type(layer) is not int or not 0 <= layer < self.layers:
            raise ValueError(f"layer must be an int in 0..{self.layers - 1}, got {layer!r}")

    def begin(self, batch: int) -> None:
        """Start publishing `batch` (overwrites the slot of batch - ring_size)."""
        with self._cond:
            slot = self._slots[batch % self.ring_size]
            if slot.batch and slot.batch != batch and slot.layers_done < self.layers and slot.failure is None:
                raise RuntimeError(
                    f"load batch {batch} would overwrite batch {slot.batch}, which is still running"
                )
            slot.batch, slot.layers_done, slot.failure, slot.events = batch, 0, None, [None] * self.layers
            slot.waited = 0
            self._cond.notify_all()

    def layer_done(self, batch: int, layer: int, event: Any = None) -> None:
        """Layer `layer` of `batch` is copied (or, on CUDA, its copy is enqueued and `event` recorded)."""
        with self._cond:
            slot = self._current(batch)
            if layer != slot.layers_done:
                raise RuntimeError(
                    f"batch {batch}: layer {layer} reported done after {slot.layers_done} layers; "
                    "layers complete in order"
                )
            assert slot.events is not None
            slot.events[layer] = event
            slot.layers_done += 1
            self._cond.notify_all()

    def fail(self, batch: int, reason: str) -> None:
        """The batch failed: waiters on any of its layers raise `LoadFailedError`."""
        with self._cond:
            self._current(batch).failure = reason
            self._failed[batch] = reason
            if len(self._failed) > FAILED_REMEMBERED_MAX:
                del self._failed[next(iter(self._failed))]
            self._cond.notify_all()

    # -- consumer side (the forward pass) -----------------------------------

    def waiter(self, batch: int, after: tuple[int, ...] = ()) -> LayerWaiter:
        return LayerWaiter(self, batch, after)

    def wait_layer(self, batch: int, layer: int, timeout_s: float | None = None) -> None:
        self.check_layer(layer)
        if batch == 0:  # nothing was loaded
            return
        with self._cond:
            ok = self._cond.wait_for(lambda: self._ready(batch, layer), timeout=timeout_s)
            if not ok:
                raise TimeoutError(f"layer {layer} of load batch {batch} not done after {timeout_s}s")
            slot = self._slots[batch % self.ring_size]
            if slot.failure is not None:
                raise LoadFailedError(f"load batch {batch} failed: {slot.failure}")
            event = slot.events[layer] if slot.events else None
            slot.waited |= 1 << layer
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def landed(self, batch: int, layer: int) -> bool:
        """Whether layer `layer` of `batch` may be read now, without waiting: its copy is done
        (on CUDA: a `wait_layer` ordered the waiter's stream after it, or its event completed), or
        a later batch began (batches run one after another, each synchronised at its end). A
        failed batch never lands. Never blocks (`Config.check_kv_reads` asks on the facade's thread)."""
        if batch == 0:
            return True
        with self._cond:
            slot = self._slots[batch % self.ring_size]
            if slot.batch != batch:
                return slot.batch > batch and batch not in self._failed
            if slot.failure is not None or slot.layers_done <= layer:
                return False
            event = slot.events[layer] if slot.events else None
            return event is None or bool(slot.waited >> layer & 1) or bool(event.query())

    def failure(self, batch: int) -> str | None:
        """Why `batch` failed, if it did (and is among the last `FAILED_REMEMBERED_MAX` that failed)."""
        with self._cond:
            return self._failed.get(batch)

    def _ready(self, batch: int, layer: int) -> bool:
        slot = self._slots[batch % self.ring_size]
        if slot.batch > batch:
            raise StaleWaiterError(
                f"waiting on load batch {batch}, but its ring slot now holds batch {slot.batch}; "
                f"a forward pass must wait within {self.ring_size} batches of its load"
            )
        if slot.batch < batch:
            return False  # not begun yet
        return slot.failure is not None or slot.layers_done > layer

    def _current(self, batch: int) -> _Slot:
        slot = self._slots[batch % self.ring_size]
        if slot.batch != batch:
            raise RuntimeError(f"load batch {batch} is not the one in its ring slot ({slot.batch})")
        return slot


@dataclass(frozen=True, slots=True)
class LayerWaiter:
    """What the forward pass holds for one load batch: `batch`, and the earlier batches its
    prefixes wait on too (`after`: admitted while those were in flight, a request counted
    their pages as host hits). Batches run one after another, so once a layer of `batch` is
    done every earlier batch has ended: the wait raises if any of them failed."""

    ring: LayerDoneRing
    batch: int
    after: tuple[int, ...] = ()

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Return when layer `layer` of this batch may be read; raise if the load failed."""
        self.ring.wait_layer(self.batch, layer, timeout_s)
        for earlier in self.after:
            if (why := self.ring.failure(earlier)) is not None:
                raise LoadFailedError(f"load batch {earlier}, which a prefix loaded with batch {self.batch} "
                                      f"waits on, failed: {why}")

    def wait_all(self, timeout_s: float | None = None) -> None:
        for layer in range(self.ring.layers):
            self.wait_layer(layer, timeout_s)
