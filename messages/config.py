"""`Config`: every knob of a hicache instance, parsed and checked once at the edge.

A `Config` is frozen and always valid. `Config(...)`, `Config.replace()` and
`Config.from_mapping()` take the same path: every field's value goes through the
field's rule (`_config_values`), which converts a raw value (a string from a
command line or a JSON file, an enum's value, a `torch.dtype`) into the type core
code uses or raises `ConfigError`; the rules that tie fields together are checked
after that, on converted values. Core code never sees a raw string.

`Config.for_model()` takes the model-shape fields from a transformers config and
turns memory budgets in bytes into slots; `check_resources()` (run at start) checks
the sizes against the machine before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Final

import torch

from ._config_values import (
    DTYPES,
    Choice,
    ConfigError,
    Count,
    DeviceKind,
    DType,
    EvictionPolicy,
    FilePath,
    Host,
    HostLayout,
    HostPort,
    HttpUrl,
    ModelId,
    Name,
    Number,
    PrefetchPolicy,
    Rule,
    StorageKind,
    Switch,
    WritePolicy,
    refuse,
)
from ._model_shape import model_name, model_shape
from ._resources import Available, check_resources

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

SLOTS_MAX: Final = 1 << 40
"""Most token slots (and tokens) any size field may name: far above any machine's memory, far
below where int64 slot indices overflow; `check_resources` holds sizes to the actual machine."""
SECONDS_MAX: Final = 86_400.0
"""Longest duration a field may name: a day is no timeout, and larger ones overflow timer waits."""
STORAGE_STEP_PAGES_MAX: Final = 4096
"""Most pages of one prefetch step or one Mooncake call."""
MOONCAKE_SEGMENT_MB_MIN: Final = 16
"""Smallest segment the Mooncake client mounts (it refuses less with "invalid parameters")."""


def _field(default: Any, rule: Rule, doc: str) -> Any:
    """A field with its rule and its description (the reference page is made from them)."""
    return dataclasses.field(default=default, metadata={"rule": rule, "doc": doc})


_MODEL_SHAPE_NOTE = " The default is a test shape, not a model's: set it from the model, or use `Config.for_model`."


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Shape of the KV cache, capacities, policies and bounds of one instance.

    The model-shape fields (`layers`, `kv_heads`, `head_dim`, `dtype`) default to a
    small test shape, not a model's: set them from the model, or build the config
    with `Config.for_model`. Each field's meaning and the values it takes are in
    docs/configuration.md.
    """

    # -- model shape ---------------------------------------------------------
    layers: int = _field(4, Count(1, 1024), "Transformer layers (each has K and V)." + _MODEL_SHAPE_NOTE)
    kv_heads: int = _field(2, Count(1, 1024), "KV heads per layer on this tensor-parallel rank." + _MODEL_SHAPE_NOTE)
    head_dim: int = _field(64, Count(1, 4096), "Elements per head." + _MODEL_SHAPE_NOTE)
    dtype: str = _field("float16", DType(), "Element type of the KV buffers; kept as its name." + _MODEL_SHAPE_NOTE)
    model_id: str = _field("", ModelId(),
                           "The model whose KV this is: a hub id or a weights path, or any name that changes "
                           "whenever the KV would (other weights, a fine-tune, another RoPE scaling). Every page's "
                           "storage key is derived from it, so instances of different models that share a storage "
                           "directory or Mooncake store never read each other's pages; the instances of one model "
                           "give the same. Empty: the keys name no model, and every instance on that storage must "
                           "serve the same one. `Config.for_model` takes it from the model config's name.")

    # -- capacities ----------------------------------------------------------
    page_size: int = _field(16, Count(1, 4096), "Tokens per page: the unit of allocation, matching and transfer.")
    device_slots: int = _field(4096, Count(1, SLOTS_MAX),
                               "Token slots of the device (L1) buffer; a multiple of `page_size`.")
    host_slots: int = _field(16384, Count(1, SLOTS_MAX),
                             "Token slots of the host (L2) buffer; larger than `device_slots`, a multiple of `page_size`. "
                             "Unused with `host_tier=false` (then one page is allocated).")
    device: DeviceKind = _field(DeviceKind.CPU, Choice(DeviceKind),
                                "Where the device buffer lives: `cpu` (a CPU tensor stands in) or `cuda`.")
    host_layout: HostLayout = _field(HostLayout.LAYER_FIRST, Choice(HostLayout), "Layout of the host buffer.")

    # -- policies ------------------------------------------------------------
    write_policy: WritePolicy = _field(WritePolicy.WRITE_THROUGH, Choice(WritePolicy),
                                       "When device nodes are backed up to host.")
    eviction_policy: EvictionPolicy = _field(EvictionPolicy.LRU, Choice(EvictionPolicy),
                                             "Which device leaf is evicted first.")
    prefetch_policy: PrefetchPolicy = _field(PrefetchPolicy.BEST_EFFORT, Choice(PrefetchPolicy),
                                             "When a request waiting on a storage prefetch may run.")
    ahead_slots: int = _field(16, Count(0, 1 << 16),
                              "A decode step that needs a new device page (a demand of at most these slots) "
                              "also gets this many slots' worth of whole pages more while they are free (never "
                              "by eviction; given back first when memory is short), so the next steps are served "
                              "without a message to the device; 0: exactly what is asked. Rounded down to "
                              "pages: by default 16 at `page_size` 1, one at 16, none at 32 or more.")
    host_tier: bool = _field(True, Switch(),
                             "Use host memory (L2) at all; false gives an L1-only cache for comparison.")
    load_back_min_tokens: int = _field(1, Count(1, SLOTS_MAX),
                                       "A host-only match shorter than this is recomputed instead of loaded back.")
    load_back_quota_tokens: int = _field(1 << 20, Count(1, SLOTS_MAX),
                                         "Most tokens one admission batch may load back from host "
                                         "(device memory it may take).")

    # -- storage (L3) -------------------------------------------------------
    storage: StorageKind = _field(StorageKind.NONE, Choice(StorageKind),
                                  "The L3 backend; `none` turns prefetch and backup off.")
    storage_dir: str = _field("", FilePath(),
                              "Directory of the file backend (created if missing); required when `storage` is `file`.")
    mooncake_master: str = _field("127.0.0.1:50051", HostPort(),
                                  "`host:port` of the Mooncake master (its RPC port).")
    mooncake_metadata: str = _field("http://127.0.0.1:8080/metadata", HttpUrl(),
                                    "URL of the Mooncake HTTP metadata server "
                                    "(`mooncake_master --enable_http_metadata_server`).")
    mooncake_local_host: str = _field("127.0.0.1", Host(),
                                      "This machine's address as other Mooncake clients reach it.")
    mooncake_segment_mb: int = _field(256, Count(MOONCAKE_SEGMENT_MB_MIN, 1 << 20),
                                      "Memory this instance contributes to the Mooncake Store, in MiB (the "
                                      "Mooncake client refuses less than 16).")
    storage_timeout_s: float = _field(5.0, Number(SECONDS_MAX),
                                      "Longest one storage call may take before it counts as failed (never a hang).")
    storage_batch_pages: int = _field(16, Count(1, STORAGE_STEP_PAGES_MAX),
                                      "Pages the prefetcher reads per step, and Mooncake moves per call, at least "
                                      "(a stop waits for at most one step).")
    storage_batch_mb: int = _field(1, Count(0, 1 << 10),
                                   "A step also takes more pages while they hold at most this many MiB of KV "
                                   "(small pages share a call's fixed cost); 0: `storage_batch_pages` exactly.")
    storage_read_threads: int = _field(2, Count(1, 64),
                                       "Threads that verify the pages of one storage read together, pages "
                                       "of 256 KiB or more (file: their reads too); 1: the prefetcher's alone.")
    storage_max_bytes: int = _field(0, Count(0, 1 << 62),
                                    "File backend: most bytes its pages may take on disk (least recently used "
                                    "pages are evicted past it, within one segment file); 0: no bound.")
    prefetch_threshold_pages: int = _field(2, Count(1, SLOTS_MAX),
                                           "A prefetch starts only when at least this many pages of a request "
                                           "are not in L1/L2.")
    prefetch_rate_fraction: float = _field(0.5, Number(1.0),
                                           "Tokens being prefetched stay at most this fraction of the host capacity.")
    prefetch_timeout_base_s: float = _field(1.0, Number(SECONDS_MAX),
                                            "`timeout` policy: base seconds a request waits for its prefetch ...")
    prefetch_timeout_per_1k_s: float = _field(0.25, Number(SECONDS_MAX, zero=True),
                                              "... plus these seconds per 1,000 prefetched tokens (0: a flat timeout) ...")
    prefetch_timeout_max_s: float = _field(10.0, Number(SECONDS_MAX), "... capped at this.")

    # -- tensor parallel -----------------------------------------------------
    tp_rank: int = _field(0, Count(0, 1023), "This instance's rank in its tensor-parallel group; below `tp_size`.")
    tp_size: int = _field(1, Count(1, 1024),
                          "Ranks in the group; with more than one, rank-local outcomes are agreed before they apply.")

    log_path: str = _field("", FilePath(),
                           "Write every delivery to this JSON-lines file (`hicache replay` reads it); empty: no log.")
    check_kv_writes: bool = _field(False, Switch(),
                                   "Refuse a K/V write (`DeviceKV.write`, and `DeviceKV.index` with `distinct=True`, "
                                   "an index for writing) into a slot no live request holds for its own positions: "
                                   "a cached prefix (shared), a free slot, an ended request's; and one made for a "
                                   "`request_id` into a slot that request does not hold. For an engine's tests "
                                   "and staging: each checked index reads the live requests' pages again after they "
                                   "changed, and on CUDA waits for the device once; see docs/engine.md.")
    check_kv_reads: bool = _field(False, Switch(),
                                  "Refuse a K/V read (`DeviceKV.gather`, `page_table`, and `index` with "
                                  "`distinct=False`) of a slot no live request holds (a slot list kept past "
                                  "`cache_unfinished` or its request's end, a free slot), a read made for a "
                                  "`request_id` of a slot that request does not hold, and a `gather(layer, ...)` "
                                  "of a prefix whose load-back from host memory has not landed that layer (not "
                                  "waited for, or `start_loads` not called). For an engine's tests and staging: "
                                  "each checked index reads the live requests' pages again after they changed, and "
                                  "on CUDA waits for the device once; see docs/engine.md.")

    # -- metrics -------------------------------------------------------------
    metrics: bool = _field(False, Switch(),
                           "Export this instance's numbers as Prometheus metrics (read from `statistics()` "
                           "when scraped) and time its facade calls; see docs/metrics.md.")
    metrics_port: int = _field(0, Count(0, 65535),
                               "With `metrics`: serve every exporting instance's metrics over HTTP on this port "
                               "from `start()` on; 0: no server of its own (the process's default registry "
                               "holds them).")
    metrics_host: str = _field("127.0.0.1", Host(),
                               "Address the metrics server listens on (`0.0.0.0`: every interface).")
    metrics_name: str = _field("hicache", Name(),
                               "The `cache` label of this instance's metrics: instances exporting in one process "
                               "need distinct names or ranks.")

    # -- transfer bounds -----------------------------------------------------
    transfer_pages_max: int = _field(4096, Count(1, 1 << 16),
                                     "Most pages one copy batch moves; larger operations are split, smaller merged.")
    transfer_batch_mb: int = _field(128, Count(1, 1 << 20),
                                    "Most MiB one write copy batch moves (at least one page): a batch ends at this "
                                    "or at `transfer_pages_max`, whichever comes first.")
    transfer_queue_ops_max: int = _field(4096, Count(1, 1 << 20),
                                         "Most operations a stream holds queued; more are refused as failed "
                                         "(a refused load-back fails the batch the next start_loads gives).")
    load_ring_size: int = _field(4, Count(1, 256),
                                 "Load batches whose per-layer progress stays observable "
                                 "(the next can overlap a forward pass).")

    def __new__(cls, *args: Any, **raw: Any) -> Config:
        # An unknown keyword is a configuration mistake like any other: the same
        # ConfigError from the constructor as from `replace` and `from_mapping`.
        _refuse_unknown(raw)
        return object.__new__(cls)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.metadata["rule"].parse(f.name, getattr(self, f.name)))
        self._check_together()

    def _check_together(self) -> None:
        """The rules between fields, on converted values."""
        for name in ("device_slots", "host_slots"):
            if getattr(self, name) % self.page_size:
                raise ConfigError(f"{name}={getattr(self, name)} must be a multiple of page_size={self.page_size}")
        if self.host_tier and self.host_slots <= self.device_slots:
            raise ConfigError(f"host_slots={self.host_slots} must be larger than device_slots="
                              f"{self.device_slots}: the host tier backs up the device tier")
        if self.tp_rank >= self.tp_size:
            raise ConfigError(f"tp_rank={self.tp_rank} must be below tp_size={self.tp_size}")
        if self.storage is StorageKind.FILE and not self.storage_dir:
            raise ConfigError("storage='file' needs storage_dir: the directory that holds the pages")
        if self.metrics_port and not self.metrics:
            raise ConfigError(f"metrics_port={self.metrics_port} needs metrics=true (or set metrics_port=0)")
        if self.storage is not StorageKind.NONE and not self.host_tier:
            raise ConfigError(f"storage={self.storage.value!r} needs host_tier=true: pages move between "
                              "storage and host memory (or set storage='none')")

    # -- derived values ------------------------------------------------------

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of K and V of one token across all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.torch_dtype.itemsize

    @property
    def transfer_batch_pages(self) -> int:
        """Pages one write copy batch moves at most: `transfer_pages_max`, fewer where their KV
        passes `transfer_batch_mb` (a batch bounds bytes; the page bound keeps its index lists short)."""
        by_bytes = (self.transfer_batch_mb << 20) // (self.page_size * self.bytes_per_slot)
        return max(1, min(self.transfer_pages_max, by_bytes))

    @property
    def storage_step_pages(self) -> int:
        """Pages one prefetch step reads and one Mooncake call moves: `storage_batch_pages`, or
        as many as `storage_batch_mb` of KV holds where that is more (at most
        `STORAGE_STEP_PAGES_MAX`). A storage call has a fixed cost of tens of microseconds
        (more for Mooncake); sixteen 2 KiB pages would pay it for 32 KiB."""
        by_bytes = (self.storage_batch_mb << 20) // (self.page_size * self.bytes_per_slot)
        return max(self.storage_batch_pages, min(STORAGE_STEP_PAGES_MAX, by_bytes))

    @property
    def ahead_pages(self) -> int:
        """Whole pages a request gets beyond its demand when it needs a new page and they are
        free: `ahead_slots` rounded down to pages."""
        return self.ahead_slots // self.page_size

    @property
    def device_pages(self) -> int:
        return self.device_slots // self.page_size

    @property
    def host_pages(self) -> int:
        """Pages of the host buffer: `host_slots`' with a host tier; one without (an L1-only
        cache writes nothing there, and a host buffer of `host_slots` would be memory spent on
        nothing)."""
        return self.host_slots // self.page_size if self.host_tier else 1

    @property
    def host_buffer_slots(self) -> int:
        """Slots of the host buffer (`host_pages` whole pages)."""
        return self.host_pages * self.page_size

    def replace(self, **changes: Any) -> Config:
        """A copy with some fields changed (parsed and checked like any other)."""
        return Config(**{**self._values(), **changes})

    def _values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # -- the edge ------------------------------------------------------------

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> Config:
        """Parse raw values (strings from a command line or a JSON file) into a valid `Config`."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"a config mapping must be a mapping of field names to values, not {type(raw).__name__}")
        _refuse_unknown(raw)
        return cls(**raw)

    def to_mapping(self) -> dict[str, Any]:
        """Plain values (enums as their strings), the inverse of `from_mapping`."""
        return {k: v.value if isinstance(v, enum.Enum) else v for k, v in self._values().items()}

    @classmethod
    def for_model(
        cls,
        model_config: Any,
        *,
        device_bytes: int,
        host_bytes: int | None = None,
        host_ratio: float | None = None,
        check: bool = True,
        **fields: Any,
    ) -> Config:
        """A `Config` for a transformers model, its sizes given as memory budgets.

        `model_config` is a transformers `PretrainedConfig` (or any object with its
        attribute names, or a dict of them, as a `config.json` loads): layers, KV heads
        (this rank's share of `tp_size`), head dim and dtype come from it; `dtype=` in
        `fields` overrides the model's.
        `model_id` comes from it too (its `_name_or_path`, with the hub revision's commit
        when the config records one: transformers 5 records none), unless `fields` gives one.
        `device_bytes` and `host_bytes` (or `host_ratio` times `device_bytes`) are the
        bytes of KV each tier may hold, turned into whole pages (with `host_tier=False`, an
        L1-only cache, the host budget may be left out). `fields` sets any
        other field. With `check` (the default) the result is checked against this
        machine's memory (`check_resources`)."""
        if type(check) is not bool:
            raise refuse("check", check, "True or False")
        taken = sorted({"layers", "kv_heads", "head_dim", "device_slots", "host_slots"} & set(fields))
        if taken:
            raise ConfigError(f"for_model sets {', '.join(taken)} from the model and the byte budgets: leave "
                              f"{'it' if len(taken) == 1 else 'them'} out")
        if "model_id" not in fields:
            fields = {**fields, "model_id": model_name(model_config)}
        page_size = _RULES["page_size"].parse("page_size", fields.get("page_size", _DEFAULTS["page_size"]))
        base = cls(**fields, device_slots=page_size, host_slots=2 * page_size)  # sized below, from the shape
        shape = model_shape(model_config, base.tp_size, fields.get("dtype"))
        if shape.dtype is None:
            raise ConfigError("model_config has no dtype (nor torch_dtype): pass dtype=, the element type "
                              "of the engine's KV cache, like dtype='bfloat16'")
        shaped = base.replace(layers=shape.layers, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                              dtype=shape.dtype)
        device_pages, host_pages = _budget_pages(shaped, device_bytes, host_bytes, host_ratio)
        config = shaped.replace(device_slots=device_pages * shaped.page_size, host_slots=host_pages * shaped.page_size)
        if check:
            check_resources(config)
        return config


def _refuse_unknown(raw: Mapping[Any, Any]) -> None:
    unknown = sorted(repr(k) if not isinstance(k, str) else k for k in raw if k not in _FIELD_NAMES)
    if unknown:
        raise ConfigError(f"unknown config field(s) {', '.join(unknown)}; known: {', '.join(_FIELD_NAMES)}")


def _budget_pages(shaped: Config, device_bytes: Any, host_bytes: Any, host_ratio: Any) -> tuple[int, int]:
    """Whole pages of KV that the byte budgets hold, for the shape of `shaped`."""
    page_bytes = shaped.bytes_per_slot * shaped.page_size
    device_bytes = Count(1, SLOTS_MAX * page_bytes).parse("device_bytes", device_bytes)
    if device_bytes < page_bytes:
        raise ConfigError(
            f"device_bytes={device_bytes} holds no page: one page (page_size={shaped.page_size} tokens x "
            f"{shaped.bytes_per_slot} bytes of K and V) takes {page_bytes} bytes; give at least that"
        )
    if not shaped.host_tier and host_bytes is None and host_ratio is None:
        return device_bytes // page_bytes, 1  # an L1-only cache: its host buffer is one page, unused
    if (host_bytes is None) == (host_ratio is None):
        raise ConfigError("give host_bytes (bytes of KV in host memory) or host_ratio (host bytes per "
                          "device byte, like 2.0), one of them (with host_tier=False, neither)")
    if host_ratio is not None:
        host_bytes = int(device_bytes * Number(1e6).parse("host_ratio", host_ratio))
    host_bytes = Count(1, SLOTS_MAX * page_bytes).parse("host_bytes", host_bytes)
    if host_bytes // page_bytes <= device_bytes // page_bytes:
        raise ConfigError(
            f"host_bytes={host_bytes} holds {host_bytes // page_bytes} pages of {page_bytes} bytes, no more than "
            f"the device's {device_bytes // page_bytes}: give the host tier more bytes than the device (host_ratio > 1)"
        )
    return device_bytes // page_bytes, host_bytes // page_bytes


_RULES: Final[dict[str, Rule]] = {f.name: f.metadata["rule"] for f in dataclasses.fields(Config)}
_DEFAULTS: Final[dict[str, Any]] = {f.name: f.default for f in dataclasses.fields(Config)}
_FIELD_NAMES: Final = tuple(_RULES)
