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

The ranks must also decide alike: a rank with another page size, pool size, policy or
model would take other decisions from the same calls, and its tree would drift from
the others' with no agreement to notice. So every rank's `start()` compares the
`Config` fields that decide (`agree_config`) and refuses to start on a difference.

And the ranks must agree on the same thing: a collective of one call (a rank's `ready`)
that met another rank's collective of another call (its `sync`, or a lone rank's
`start()` after a restart) with as many values would mix unrelated numbers. So the
facade's agreements go through `agree`, which tags each with what it agrees on and
raises `RankDivergenceError` on every rank when the tags differ.

And the ranks must make the same calls between agreements: most calls (an admission, a
commit, a finish) change a rank's cache with no collective, and a rank whose engine made
another call there (a different commit, a request admitted on one rank only) would hold
another tree from then on. So the facade keeps a digest of every call it took since it
started, with its arguments and the answers the agreed state decides (a cache that parted
under the same calls answers differently), and `sync`, `ready` and `quiesce` compare it
in the collective they make anyway: ranks whose calls or answers differ raise
`RankDivergenceError` on every rank at the next of them (once per tick, when the engine
syncs every tick).
"""

from __future__ import annotations

import datetime
import enum
import hashlib
from collections.abc import Sequence
from typing import Any, Final, Protocol

import torch
from hicache.messages import Config, ConfigError

SAME_ON_EVERY_RANK = (
    "layers", "head_dim", "dtype", "model_id", "page_size", "device_slots", "host_slots", "host_tier",
    "write_policy", "eviction_policy", "prefetch_policy", "ahead_slots", "load_back_min_tokens",
    "load_back_quota_tokens", "storage", "prefetch_threshold_pages", "prefetch_rate_fraction",
    "prefetch_timeout_base_s", "prefetch_timeout_per_1k_s", "prefetch_timeout_max_s",
)
"""`Config` fields that decide what a cache does with a call, or name the model whose KV it
holds: every rank of a group gives the same. The rest may differ (a rank's own storage
directory, log, metrics, KV heads and transfer bounds)."""


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


class Agreement(enum.Enum):
    """What an agreement of the facade is about: its tag in the collective."""

    CONFIG = 1
    """`start()`: the deciding `Config` fields."""
    FACT_COUNTS = 2
    """`sync`: how many outcomes of each kind every rank knows."""
    FACT_VALUES = 3
    """`sync`: the values of those outcomes."""
    READY = 4
    """`ready`: whether each prefetch may stop."""
    STOPPED = 5
    """The end of a prefetch: its complete pages."""
    QUIESCED = 6
    """`quiesce`: whether every rank's work landed within its timeout."""


CALLS_BITS: Final = 62
"""Bits of the digest of a rank's calls that an agreement compares (`agree`'s `calls`)."""
_HALF: Final = (1 << (CALLS_BITS // 2)) - 1


def agree(group: Group, about: Agreement, values: Sequence[int], calls: int | None = None) -> list[int]:
    """`group.all_min(values)`, in the same collective as a check that every rank agrees on
    the same thing (`about`) and, given `calls` (a digest of the calls each rank made since it
    started, `CALLS_BITS` of it), that every rank made the same calls; nothing added with one
    rank. A value `v` is the same on every rank exactly when the minimum of `v` is minus the
    minimum of `-v`."""
    if group.size == 1:
        return group.all_min(values)
    tag = about.value
    head = [tag, -tag]
    if calls is not None:
        low, high = calls & _HALF, (calls >> (CALLS_BITS // 2)) & _HALF
        head += [low, -low, high, -high]
    agreed = group.all_min([*head, *values])
    if agreed[0] != -agreed[1]:
        raise RankDivergenceError(
            f"rank {group.rank} of {group.size}: its agreement on {about.name.lower().replace('_', ' ')} met "
            "another rank's agreement on something else; the ranks made different calls (every rank must make "
            "the agreeing calls, start, sync, ready, quiesce and the end of a prefetch, in the same order)"
        )
    if calls is not None and (agreed[2] != -agreed[3] or agreed[4] != -agreed[5]):
        raise RankDivergenceError(
            f"rank {group.rank} of {group.size}: at its agreement on {about.name.lower().replace('_', ' ')}, the "
            "calls it made since it started differ from another rank's (or the cache's answers to them do), so "
            "their caches differ: every rank must make the same calls (admit, prefetch, ready, allocate, commit, "
            "finish, abort, retract, cache_unfinished, start_loads, evict_device, evict_host) with the same "
            "arguments, in the same order; close every rank and start them again together"
        )
    return agreed[len(head):]


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


def agree_config(group: Group, config: Config) -> None:
    """Refuse to start when the ranks' `config`s differ in a field of `SAME_ON_EVERY_RANK`
    (one agreement, on every rank; nothing with one rank)."""
    if group.size == 1:
        return
    codes = [_code(getattr(config, name)) for name in SAME_ON_EVERY_RANK]
    agreed = agree(group, Agreement.CONFIG, [*codes, *(-c for c in codes)])
    n = len(codes)
    differ = [name for i, name in enumerate(SAME_ON_EVERY_RANK) if agreed[i] != -agreed[n + i]]
    if differ:
        mine = ", ".join(f"{name}={_plain(getattr(config, name))!r}" for name in differ)
        raise ConfigError(f"rank {group.rank} of {group.size}: the ranks' configs differ in {', '.join(differ)} "
                          f"(this rank: {mine}); give every rank of a tensor-parallel group the same")


def _plain(value: object) -> object:
    """A `Config` value as it is written in a config (an enum as its value)."""
    return value.value if isinstance(value, enum.Enum) else value


def _code(value: object) -> int:
    """A value as a non-negative int63, equal on every rank for equal values."""
    raw = repr(_plain(value)).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1
