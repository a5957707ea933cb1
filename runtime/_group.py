"""Tensor-parallel groups: how the ranks of one model agree on rank-local outcomes.

Each rank runs its own hicache (its own actors over its own shard of the KV
heads). Whatever depends on one rank's physical state (storage hits, pages
prefetched, acks that arrived, whether a prefetch may stop) is agreed before it
changes a tree or a pool: the facade reduces the local values with `all_min`.

A group's collectives must run the same number of times, in the same order, on
every rank, whatever each rank's local state: the field's worst hangs came from
one rank skipping a collective. So `all_min` performs the same collectives on
every call, even for an empty list, and checks that every rank passed as many values
(a difference means the ranks' caches diverged: it raises instead of hanging or
mixing up values). It costs two collectives: a fixed-size one for the shape, then
the values.

A collective that fails (another rank died, froze past the group's timeout, or closed
the group) raises `RankLostError`, and so does every later one at once: the group is
out of step for good, and the caches' only way on is `close()`, a new group on every
rank, and new caches.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class RankDivergenceError(RuntimeError):
    """Ranks of a group reached the same collective with different shapes: their state diverged."""


class RankLostError(RuntimeError):
    """A collective of the group failed: another rank died, froze for longer than the group's
    timeout, or left the group. The group is unusable from then on."""


class Group(Protocol):
    rank: int
    size: int

    def all_min(self, values: Sequence[int]) -> list[int]:
        """The element-wise minimum of `values` over every rank."""
        ...


class SingleGroup:
    """The trivial group of one rank: agreement is the local value."""

    rank = 0
    size = 1

    def all_min(self, values: Sequence[int]) -> list[int]:
        return [int(v) for v in values]


class TorchGroup:
    """A torch.distributed process group (gloo: CPU tensors, any machine)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call TorchGroup.start(...) or "
                               "torch.distributed.init_process_group('gloo', ...) first")
        self._dist = dist
        self._group = group
        self._lost: str | None = None
        """Why the group is unusable, once a collective failed."""
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    @classmethod
    def start(cls, rank: int, size: int, init_method: str, timeout_s: float = 60.0) -> TorchGroup:
        """Join (or form) the default gloo group, e.g. `init_method="tcp://127.0.0.1:29500"`.
        `timeout_s` bounds every collective: a rank that froze is noticed after it (one that
        died, at once), as a `RankLostError` (a group formed by hand keeps gloo's own
        timeout, 30 minutes by default)."""
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return cls()

    def all_min(self, values: Sequence[int]) -> list[int]:
        n = len(values)
        shape = torch.tensor([n, -n], dtype=torch.int64)  # fixed size: cannot hang on a shape mismatch
        self._all_reduce_min(shape)
        lo, hi = int(shape[0]), -int(shape[1])
        if lo != hi:
            raise RankDivergenceError(
                f"rank {self.rank}: a collective over {n} values met ranks passing between {lo} and {hi}; "
                "the ranks' caches diverged (a rank-local outcome was applied without agreement)"
            )
        t = torch.tensor([*values, 0], dtype=torch.int64)  # never empty: every rank runs it
        self._all_reduce_min(t)
        return [int(v) for v in t[:n]]

    def _all_reduce_min(self, t: torch.Tensor) -> None:
        if self._lost is None:
            try:
                self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self._group)
                return
            except RuntimeError as err:  # gloo: a peer's connection reset or closed, or the timeout passed
                cause = " ".join(str(err).split()).split(" This is typically caused")[0][:300]
                self._lost = (f"rank {self.rank} of {self.size}: a collective of the tensor-parallel group failed "
                              f"({cause}); another rank died, froze past the group's timeout, or left the group. "
                              "The group is unusable: close() this cache and the group, then start a new group "
                              "on every rank and new caches")
        # Raised outside the handler, neither chained nor with gloo's error as its context: that
        # error's frames hold the process group, whose threads would outlive
        # destroy_process_group() for as long as the exception is kept.
        raise RankLostError(self._lost)

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()
