"""`Config` and its enums, where users import them: they live beside the messages
(`hicache.messages.config`), the immutable value every layer reads."""

from hicache.messages.config import (
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
    "DTYPES",
    "Available",
    "Config",
    "ConfigError",
    "DeviceKind",
    "EvictionPolicy",
    "HostLayout",
    "PrefetchPolicy",
    "StorageKind",
    "WritePolicy",
    "check_resources",
]
