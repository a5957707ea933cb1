"""Configuration, the actor base and runtimes, the system wiring, and public tools.

Every name below is imported from its module on first use (PEP 562), so that importing a
module of this package (the command line's parser, say) loads nothing else: torch and
the actors come in with the first name that needs them.
"""

import importlib as _importlib
import warnings as _warnings

# torch warns at import when numpy is absent; hicache does not use numpy.
_warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

_EXPORTS: dict[str, tuple[str, ...]] = {
    "hicache.actors._actor": ("Directory", "HiActor", "Mail", "WrongSenderError"),
    "testing._deterministic": (
        "BlockingGetError", "DeadlockError", "DeterministicFuture", "DeterministicRuntime", "LivelockError",
        "Step", "VirtualClock", "replay_choices"
    ),
    "_executor": ("SerialExecutor",),
    "_inbox": ("Inbox",),
    "_facade": (
        "AdmitResult", "CacheHandle", "CacheStateError", "Closed", "ExpiredHandleError", "HiCache",
        "HiCacheStatistics", "Insufficient", "Request", "RequestError"
    ),
    "_log": ("LOG_VERSION", "DeliveryLog", "rewrite_log"),
    "_log_reader": ("Delivery", "LogEnd", "LogReader", "ParsedLog", "ReplayLogError", "RunHeader", "read_log"),
    "_engine_kv": ("DeviceKV", "KVArgumentError", "SlotIndex"),
    "demo._model_runner": ("Generation", "KVObserver", "ModelRunner", "ModelRunnerError", "PoolCache"),
    "demo._tiny_model": ("tiny_llama",),
    "testing._mooncake_master": ("MasterStartError", "MooncakeMaster"),
    "testing._replay": ("Divergence", "ReplayResult", "replay_log"),
    "_group": ("Group", "RankDivergenceError", "SingleGroup", "TorchGroup"),
    "hicache.actors._layers": ("LayerDoneRing", "LayerWaiter", "LoadFailedError", "StaleWaiterError"),
    "_metrics": ("start_metrics_exporter",),
    "_facade_types": ("TierStatistics",),
    "_timings": ("TimedLayerWaiter",),
    "testing._strategies": ("PCTStrategy", "RandomStrategy", "ReplayStrategy", "ScheduleDivergedError", "Strategy"),
    "hicache.actors._services": ("FailedTransfers", "FaultPlan", "IdSource", "NoFaults", "SeededFaults", "Services"),
    "_system": ("DEFAULT_ASK_TIMEOUT_S", "ActorFailedError", "System", "ThreadedRuntime"),
    "config": (
        "DTYPES", "Available", "Config", "ConfigError", "DeviceKind", "EvictionPolicy", "HostLayout",
        "PrefetchPolicy", "StorageKind", "WritePolicy", "check_resources"
    ),
    "testing._mutants": ("MUTANTS", "Mutant", "mutant"),
    "testing._scheduler": (
        "FakeModel", "ForwardStep", "Outcome", "ReferenceScheduler", "SchedulerConfig", "ServeRequest", "StepModel"
    ),
}
"""Each private module, and the public names it defines."""

_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module if module.startswith("hicache.") else f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
