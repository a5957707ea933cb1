"""What the parts of the tree core share: the radix tree, the host mirror, counters, the outbox.

`TreeCore` builds one `TreeShared` and hands it to each of its parts (admission,
write-back, the prefetch book, the backup book); a part owns its own tables and
reaches the others only through the methods the core wires it to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hicache.messages import ActorName, Indices, Message, PrefetchEnd
from hicache.messages.config import Config, StorageKind

from ._facts import Agreement
from ._radix import RadixTree
from ._stored_page import page_keys

DEVICE, HOST, WRITE, LOAD, FACADE = ActorName.DEVICE, ActorName.HOST, ActorName.WRITE, ActorName.LOAD, ActorName.FACADE
PREFETCH = ActorName.PREFETCH


class HandleError(RuntimeError):
    """A lock handle that does not exist (any more) or belongs to another request."""


@dataclass(slots=True)
class Counters:
    looked_up_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    host_hit_storage_tokens: int = 0
    evicted_device_tokens: int = 0
    evicted_host_tokens: int = 0
    backups_done: int = 0
    backups_failed: int = 0
    prefetches_started: int = 0
    prefetch_skipped: int = 0
    prefetch_ends: dict[PrefetchEnd, int] = field(default_factory=lambda: dict.fromkeys(PrefetchEnd, 0))
    storage_hit_tokens: int = 0
    stored_tokens: int = 0


class TreeShared:
    """State every part reads or changes: one instance per tree core."""

    __slots__ = ("config", "page_size", "tree", "next_id", "now", "outbox", "host_free", "n", "agreement",
                 "storage")

    def __init__(self, config: Config, next_id: Callable[[], int], now: Callable[[], float]) -> None:
        self.config = config
        self.page_size = config.page_size
        self.tree = RadixTree(config.page_size, config.eviction_policy, index_tokens=config.page_size,
                              model_id=config.model_id)
        self.next_id = next_id
        self.now = now
        self.outbox: list[tuple[ActorName, Message]] = []
        self.host_free = config.host_buffer_slots
        """The host pool's free slots, mirrored: only the tree reserves or frees host slots."""
        self.n = Counters()
        self.agreement = Agreement(local=config.tp_size == 1)
        self.storage = config.storage is not StorageKind.NONE

    def emit(self, to: ActorName, message: Message) -> None:
        self.outbox.append((to, message))

    def storage_keys(self, hashes: Sequence[int]) -> tuple[str, ...]:
        """The storage keys of pages with these hashes, as this rank of its group stores them."""
        return tuple(page_keys(hashes, self.config.tp_rank, ranks=self.config.tp_size))


def cat(parts: Sequence[Indices | None]) -> Indices:
    """The slots of all parts, one after another (a None part has none)."""
    return Indices.concat(p for p in parts if p is not None)
