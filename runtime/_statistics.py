"""`HiCache.statistics()`: the actors' records and the facade's counts made into tiers.

The tree counts what admissions looked up and hit in device memory and loaded back from
host memory, and of the latter what each request's own storage prefetch had read (the
facade tells it with the admission, `AdmitItem.stored`; the scheduler gets it as
`AdmitResult.storage_hit`). A host hit counts when its load-back lands, so one that fails
is no tier's hit. L2's and L3's hits are split here from that one record, so a
`statistics()` racing a load-back sees both or neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hicache.actors._durations import DurationHistogram
from hicache.messages import (
    ActorName,
    DeviceStatistics,
    HostStatistics,
    PrefetcherStatistics,
    TreeStatistics,
)
from hicache.messages.config import Config, StorageKind

from ._facade_types import HiCacheStatistics, TierStatistics


def cache_statistics(
    config: Config,
    actors: Mapping[ActorName, Any],
    load_back_wait: DurationHistogram,
    calls: Mapping[str, DurationHistogram],
) -> HiCacheStatistics:
    """`actors`: each actor's statistics record, by name (as `System.statistics()` gives them)."""
    tree: TreeStatistics = actors[ActorName.TREE]
    device: DeviceStatistics = actors[ActorName.DEVICE]
    host: HostStatistics = actors[ActorName.HOST]
    prefetch: PrefetcherStatistics = actors[ActorName.PREFETCH]
    per_slot, looked = config.bytes_per_slot, tree.looked_up_tokens
    storage = config.storage is not StorageKind.NONE
    l1_hit = tree.device_hit_tokens
    l3_hit = tree.host_hit_storage_tokens if storage else 0
    l2_hit = tree.host_hit_tokens - l3_hit
    used = device.capacity_slots - device.free_slots
    l1 = TierStatistics("L1", looked, l1_hit, tree.evicted_device_tokens, used, config.device_slots,
                        used * per_slot, config.device_slots * per_slot)
    l2 = l3 = None
    if config.host_tier:
        used = host.capacity_slots - host.free_slots
        l2 = TierStatistics("L2", looked - l1_hit, l2_hit, tree.evicted_host_tokens, used, config.host_slots,
                            used * per_slot, config.host_slots * per_slot)
    if storage:
        l3 = TierStatistics("L3", looked - l1_hit - l2_hit, l3_hit, prefetch.evicted_pages * config.page_size,
                            None, None, prefetch.stored_bytes, config.storage_max_bytes or None)
    return HiCacheStatistics(
        looked_up_tokens=looked, l1=l1, l2=l2, l3=l3, tree=tree, device=device, host=host,
        write=actors[ActorName.WRITE], load=actors[ActorName.LOAD], prefetch=prefetch,
        load_back_wait=load_back_wait.snapshot(), facade_calls={k: h.snapshot() for k, h in calls.items()},
    )
