"""Configuration, the actor base and runtimes, the system wiring, and public tools."""

import warnings as _warnings

# torch warns at import when numpy is absent; hicache does not use numpy.
_warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from ._actor import Directory, HiActor, Mail, WrongSenderError
from ._deterministic import (
    BlockingGetError,
    DeadlockError,
    DeterministicFuture,
    DeterministicRuntime,
    LivelockError,
    Step,
    VirtualClock,
    replay_choices,
)
from ._executor import SerialExecutor
from ._facade import (
    AdmitResult,
    CacheHandle,
    CacheStateError,
    Closed,
    ExpiredHandleError,
    HiCache,
    HiCacheStatistics,
    Insufficient,
    Request,
    RequestError,
)
from ._log import LOG_VERSION, DeliveryLog
from ._mooncake_master import MasterStartError, MooncakeMaster
from ._replay import Delivery, Divergence, ParsedLog, ReplayLogError, ReplayResult, read_log, replay_log
from ._group import Group, RankDivergenceError, SingleGroup, TorchGroup
from ._layers import LayerDoneRing, LayerWaiter, LoadFailedError, StaleWaiterError
from ._metrics import start_metrics_exporter
from ._facade_types import TierStatistics
from ._timings import TimedLayerWaiter
from ._strategies import PCTStrategy, RandomStrategy, ReplayStrategy, ScheduleDivergedError, Strategy
from ._services import FailedTransfers, FaultPlan, IdSource, NoFaults, SeededFaults, Services
from ._system import DEFAULT_ASK_TIMEOUT_S, ActorFailedError, System, ThreadedRuntime
from .config import (
    DTYPES,
    Available,
    Config,
    ConfigError,
    DeviceKind,
    EvictionPolicy,
    HostLayout,
    PrefetchPolicy,
    StorageKind,
    WritePolicy,
    check_resources,
)

__all__ = [
    "LOG_VERSION",
    "Delivery",
    "DeliveryLog",
    "Divergence",
    "ParsedLog",
    "ReplayLogError",
    "ReplayResult",
    "read_log",
    "replay_log",
    "MUTANTS",
    "FakeModel",
    "Mutant",
    "Outcome",
    "ReferenceScheduler",
    "SchedulerConfig",
    "ServeRequest",
    "mutant",
    "AdmitResult",
    "CacheHandle",
    "CacheStateError",
    "Closed",
    "ExpiredHandleError",
    "HiCache",
    "HiCacheStatistics",
    "Insufficient",
    "TierStatistics",
    "TimedLayerWaiter",
    "start_metrics_exporter",
    "Request",
    "RequestError",
    "BlockingGetError",
    "DeadlockError",
    "DeterministicFuture",
    "DeterministicRuntime",
    "LivelockError",
    "PCTStrategy",
    "RandomStrategy",
    "ReplayStrategy",
    "ScheduleDivergedError",
    "Step",
    "Strategy",
    "VirtualClock",
    "replay_choices",
    "DEFAULT_ASK_TIMEOUT_S",
    "DTYPES",
    "ActorFailedError",
    "Available",
    "check_resources",
    "Config",
    "ConfigError",
    "DeviceKind",
    "Directory",
    "EvictionPolicy",
    "FailedTransfers",
    "FaultPlan",
    "Group",
    "HiActor",
    "HostLayout",
    "IdSource",
    "LayerDoneRing",
    "LayerWaiter",
    "LoadFailedError",
    "Mail",
    "MasterStartError",
    "MooncakeMaster",
    "NoFaults",
    "PrefetchPolicy",
    "RankDivergenceError",
    "StorageKind",
    "SeededFaults",
    "SingleGroup",
    "SerialExecutor",
    "Services",
    "StaleWaiterError",
    "System",
    "ThreadedRuntime",
    "TorchGroup",
    "WritePolicy",
    "WrongSenderError",
]


# These import the actors, which import this package: loaded on first use (PEP 562).
_LAZY = {
    "MUTANTS": "_mutants",
    "Mutant": "_mutants",
    "mutant": "_mutants",
    "FakeModel": "_scheduler",
    "Outcome": "_scheduler",
    "ReferenceScheduler": "_scheduler",
    "SchedulerConfig": "_scheduler",
    "ServeRequest": "_scheduler",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
