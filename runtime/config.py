"""`Config`: every knob of a hicache instance, validated once at the edge.

A `Config` is frozen and always valid: the constructor checks every field and
raises `ConfigError` naming the field, the bad value and what is allowed.
`Config.from_mapping()` parses raw values (strings from a command line or a
JSON file) into the enums and types the core code uses; core code never sees a
raw string.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Final

import torch


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


class WritePolicy(enum.Enum):
    """When a device node is backed up to host memory."""

    WRITE_THROUGH = "write_through"
    """On the first hit (insert counts as one)."""
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    """On the second hit."""
    WRITE_BACK = "write_back"
    """Only when evicting, before the device slots go."""


class HostLayout(enum.Enum):
    """How the host KV buffer is laid out."""

    LAYER_FIRST = "layer_first"
    """`[2, layers, slots, heads, head_dim]`, the same as the device buffer."""
    PAGE_FIRST = "page_first"
    """`[pages, 2, layers, page_size, heads, head_dim]`: one page is contiguous across all layers."""


class EvictionPolicy(enum.Enum):
    """Which evictable leaf goes first."""

    LRU = "lru"
    LFU = "lfu"
    FIFO = "fifo"
    PRIORITY = "priority"


class PrefetchPolicy(enum.Enum):
    """When a request with a storage prefetch in flight may run."""

    BEST_EFFORT = "best_effort"
    """At once, with whatever has arrived."""
    WAIT_COMPLETE = "wait_complete"
    """Only when the whole prefetch arrived."""
    TIMEOUT = "timeout"
    """When complete, or when its timeout expires."""


class StorageKind(enum.Enum):
    """Which storage (L3) backend the prefetcher talks to."""

    NONE = "none"
    """No L3 tier: nothing is prefetched or backed up to storage."""
    FILE = "file"
    """One checksummed file per page under `storage_dir` (shared by instances on one machine)."""
    MOONCAKE = "mooncake"
    """Mooncake Store: a master and its metadata server, shared by many machines."""


class DeviceKind(enum.Enum):
    """Where the device (L1) buffer lives."""

    CPU = "cpu"
    """A CPU tensor stands in for device memory."""
    CUDA = "cuda"
    """The current CUDA device."""


DTYPES: Final[dict[str, torch.dtype]] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Shape of the KV cache, capacities, policies and bounds of one instance."""

    # -- model shape ---------------------------------------------------------
    layers: int = 4
    """Transformer layers (each has K and V)."""
    kv_heads: int = 2
    """KV heads per layer on this rank."""
    head_dim: int = 64
    """Elements per head."""
    dtype: str = "float16"
    """Element type of the KV buffers; one of `DTYPES`."""

    # -- capacities ----------------------------------------------------------
    page_size: int = 16
    """Tokens per page: the unit of allocation, matching and transfer."""
    device_slots: int = 4096
    """Token slots of the device (L1) buffer; a multiple of `page_size`."""
    host_slots: int = 16384
    """Token slots of the host (L2) buffer; larger than `device_slots`, a multiple of `page_size`."""
    device: DeviceKind = DeviceKind.CPU
    """Where the device buffer lives."""
    host_layout: HostLayout = HostLayout.LAYER_FIRST
    """Layout of the host buffer."""

    # -- policies ------------------------------------------------------------
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    """When device nodes are backed up to host."""
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    """Which device leaf is evicted first."""
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    """When a request waiting on a storage prefetch may run."""

    host_tier: bool = True
    """Use host memory (L2) at all; False gives an L1-only cache for comparison."""
    load_back_min_tokens: int = 1
    """A host-only match shorter than this is recomputed instead of loaded back."""
    load_back_quota_tokens: int = 1 << 20
    """Most tokens one admission batch may load back from host (device memory it may take)."""

    # -- storage (L3) -------------------------------------------------------
    storage: StorageKind = StorageKind.NONE
    """The L3 backend; `none` turns prefetch and backup off."""
    storage_dir: str = ""
    """Directory of the file backend (created if missing); required when `storage` is `file`."""
    mooncake_master: str = "127.0.0.1:50051"
    """`host:port` of the Mooncake master (its RPC port)."""
    mooncake_metadata: str = "http://127.0.0.1:8080/metadata"
    """URL of the Mooncake HTTP metadata server (`mooncake_master --enable_http_metadata_server`)."""
    mooncake_local_host: str = "127.0.0.1"
    """This machine's address as other Mooncake clients reach it."""
    mooncake_segment_mb: int = 256
    """Memory this instance contributes to the Mooncake Store, in MiB."""
    storage_timeout_s: float = 5.0
    """Longest one storage call may take before it counts as failed (never a hang)."""
    storage_batch_pages: int = 16
    """Pages the prefetcher reads or writes per step (a stop waits for at most one step)."""
    storage_max_bytes: int = 0
    """File backend: most bytes its pages may take on disk (least recently used pages are evicted
    past it, within one segment file); 0: no bound."""
    prefetch_threshold_pages: int = 2
    """A prefetch starts only when at least this many pages of a request are not in L1/L2."""
    prefetch_rate_fraction: float = 0.5
    """Tokens being prefetched stay at most this fraction of the host capacity."""
    prefetch_timeout_base_s: float = 1.0
    """`timeout` policy: base seconds a request waits for its prefetch ..."""
    prefetch_timeout_per_1k_s: float = 0.25
    """... plus these seconds per 1,000 prefetched tokens ..."""
    prefetch_timeout_max_s: float = 10.0
    """... capped at this."""

    # -- tensor parallel -----------------------------------------------------
    tp_rank: int = 0
    """This instance's rank in its tensor-parallel group."""
    tp_size: int = 1
    """Ranks in the group; with more than one, rank-local outcomes are agreed before they apply."""

    log_path: str = ""
    """Write every delivery to this JSON-lines file (`hicache replay` reads it); empty: no log."""

    # -- transfer bounds -----------------------------------------------------
    transfer_pages_max: int = 64
    """Most pages one copy batch moves; larger operations are split, smaller ones merged."""
    transfer_queue_ops_max: int = 4096
    """Most operations a stream holds queued; more are refused as failed."""
    load_ring_size: int = 4
    """Load batches whose per-layer progress stays observable (the next can overlap a forward pass)."""

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "page_size", "transfer_pages_max",
                     "transfer_queue_ops_max", "load_ring_size", "load_back_min_tokens", "load_back_quota_tokens",
                     "mooncake_segment_mb", "storage_batch_pages", "prefetch_threshold_pages", "tp_size"):
            _positive_int(name, getattr(self, name))
        if isinstance(self.tp_rank, bool) or not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank={self.tp_rank!r} must be an integer in 0..tp_size-1 (tp_size={self.tp_size})")
        if isinstance(self.storage_max_bytes, bool) or not isinstance(self.storage_max_bytes, int) \
                or self.storage_max_bytes < 0:
            raise ConfigError(f"storage_max_bytes={self.storage_max_bytes!r} must be an integer >= 0 (0: no bound)")
        for name in ("storage_timeout_s", "prefetch_rate_fraction", "prefetch_timeout_base_s",
                     "prefetch_timeout_per_1k_s", "prefetch_timeout_max_s"):
            _positive_number(name, getattr(self, name))
        if self.prefetch_rate_fraction > 1:
            raise ConfigError(f"prefetch_rate_fraction={self.prefetch_rate_fraction} must be in (0, 1]")
        for name in ("storage_dir", "mooncake_master", "mooncake_metadata", "mooncake_local_host"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a string")
        for name in ("device_slots", "host_slots"):
            _positive_int(name, getattr(self, name))
            if getattr(self, name) % self.page_size:
                raise ConfigError(
                    f"{name}={getattr(self, name)} must be a multiple of page_size={self.page_size}"
                )
        if self.host_slots <= self.device_slots:
            raise ConfigError(
                f"host_slots={self.host_slots} must be larger than device_slots="
                f"{self.device_slots}: the host tier backs up the device tier"
            )
        if self.storage is StorageKind.FILE and not self.storage_dir:
            raise ConfigError("storage='file' needs storage_dir: the directory that holds the pages")
        if self.storage is not StorageKind.NONE and not self.host_tier:
            raise ConfigError("storage needs host_tier=true: pages move between storage and host memory")
        if not isinstance(self.log_path, str):
            raise ConfigError(f"log_path={self.log_path!r} must be a path string (empty: no log)")
        if not isinstance(self.host_tier, bool):
            raise ConfigError(f"host_tier={self.host_tier!r} must be true or false")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is unknown; allowed: {', '.join(DTYPES)}")
        for f in dataclasses.fields(self):
            if isinstance(f.default, enum.Enum):
                # Store the member, never the raw string: core code compares with `is`.
                object.__setattr__(self, f.name, _member(f.name, type(f.default), getattr(self, f.name)))

    # -- derived values ------------------------------------------------------

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of K and V of one token across all layers."""
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * elem

    @property
    def device_pages(self) -> int:
        return self.device_slots // self.page_size

    @property
    def host_pages(self) -> int:
        return self.host_slots // self.page_size

    def replace(self, **changes: Any) -> Config:
        """A copy with some fields changed (validated like any other)."""
        return Config.from_mapping({**self.to_mapping(), **changes})

    # -- the edge ------------------------------------------------------------

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> Config:
        """Parse raw values (strings for enums) into a valid `Config`."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown config field(s) {', '.join(unknown)}; known: {', '.join(known)}"
            )
        values: dict[str, Any] = {}
        for name, value in raw.items():
            default = known[name].default
            if isinstance(default, enum.Enum):
                values[name] = _member(name, type(default), value)
            elif isinstance(default, bool):
                values[name] = _parse_bool(name, value)
            elif isinstance(default, float):
                values[name] = _parse_float(name, value)
            elif not isinstance(default, int):
                values[name] = value
            else:
                values[name] = _parse_int(name, value)
        return cls(**values)

    def to_mapping(self) -> dict[str, Any]:
        """Plain values (enums as their strings), the inverse of `from_mapping`."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.value if isinstance(v, enum.Enum) else v
        return out


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ConfigError(f"{name}={value!r} must be true or false")


def _parse_float(name: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"{name}={value!r} must be a number")


def _positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigError(f"{name}={value!r} must be a number")
    if value <= 0:
        raise ConfigError(f"{name}={value} must be > 0")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} must be an integer")
    if value <= 0:
        raise ConfigError(f"{name}={value} must be > 0")


def _parse_int(name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ConfigError(f"{name}={value!r} must be an integer")


def _member(name: str, enum_cls: type[enum.Enum], value: Any) -> Any:
    if isinstance(value, enum_cls):
        return value
    for member in enum_cls:
        if value == member.value:
            return member
    allowed = ", ".join(str(m.value) for m in enum_cls)
    raise ConfigError(f"{name}={value!r} is not allowed; allowed: {allowed}")
