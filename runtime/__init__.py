"""What an engine embeds: `Config`, the `HiCache` facade, the `System` of actors and its
runtime, tensor-parallel groups, metrics and the delivery log.

The tools have rooms of their own: `hicache.runtime.testing` (the deterministic runtime,
exploration, mutants, probes, the reference scheduler and oracle, log replay),
`hicache.runtime.demo` (the demo, a model served over the cache, the simulator),
`hicache.runtime.bench` and `hicache.runtime.cli` (the `hicache` command).

Every name below is imported from its module on first use (PEP 562), so that importing a
module of this package (the command line's parser, say) loads nothing else: torch and
the actors come in with the first name that needs them.
"""

from ._lazy import lazy_exports as _lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {
    "config": (
        "DTYPES", "Available", "Config", "ConfigError", "DeviceKind", "EvictionPolicy", "HostLayout",
        "PrefetchPolicy", "StorageKind", "WritePolicy", "check_resources"
    ),
    "_facade": (
        "AdmitResult", "CacheHandle", "CacheStateError", "Closed", "ExpiredHandleError", "HiCache",
        "HiCacheStatistics", "Insufficient", "Request", "RequestError", "Room"
    ),
    "_facade_types": ("TierStatistics",),
    "_engine_kv": ("DeviceKV", "KVArgumentError", "SlotIndex"),
    "_group": ("Group", "RankDivergenceError", "RankLostError", "SingleGroup", "TorchGroup"),
    "_timings": ("TimedLayerWaiter",),
    "_metrics": ("start_metrics_exporter",),
    "_system": ("DEFAULT_ASK_TIMEOUT_S", "ActorFailedError", "System", "ThreadedRuntime"),
    "_executor": ("SerialExecutor",),
    "_inbox": ("Inbox",),
    "hicache.actors": ("LayerDoneRing", "LayerWaiter", "LoadFailedError", "StaleWaiterError"),
    "_log": ("LOG_VERSION", "DeliveryLog", "rewrite_log"),
    "_log_reader": ("Delivery", "InFlight", "LogEnd", "LogReader", "ParsedLog", "ReplayLogError", "RunHeader", "read_log"),
}
"""Each private module, and the public names it defines."""

__all__, __getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
