"""What an instance allocates at start, what the machine has, and the check between them.

`check_resources(config)` runs before anything is allocated, so that a size the
machine cannot hold (`device_slots=10**12`) or a device it lacks (`device="cuda"`
without CUDA) is one `ConfigError` naming the field to change, instead of an
allocator's message from deep inside start. The check is on the sizes a `Config`
names; it does not reserve anything, and instances started at once on one machine
(one per tensor-parallel rank) each see the memory the others have not taken yet.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

import torch

from ._config_values import ConfigError, DeviceKind, StorageKind


class _Sizes(Protocol):
    """What the check reads of a `Config` (which imports this module to run it)."""

    @property
    def device(self) -> DeviceKind: ...
    @property
    def storage(self) -> StorageKind: ...
    @property
    def page_size(self) -> int: ...
    @property
    def device_slots(self) -> int: ...
    @property
    def host_slots(self) -> int: ...
    @property
    def mooncake_segment_mb(self) -> int: ...
    @property
    def bytes_per_slot(self) -> int: ...
    @property
    def device_pages(self) -> int: ...
    @property
    def host_pages(self) -> int: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Need:
    """One allocation made at start."""

    what: str
    """What it is, in words, with the fields that size it."""
    field: str
    """The field that sets most of its size: the one to lower."""
    nbytes: int
    on_device: bool
    """In CUDA device memory (else in host memory)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Available:
    """What the machine offers; None where it cannot be told (that part is not checked)."""

    cuda: bool
    """A CUDA device is usable by torch."""
    device_free_bytes: int | None
    host_free_bytes: int | None

    @classmethod
    def of_machine(cls, config: _Sizes) -> Available:
        """This machine now; asks CUDA for free memory only when `config` puts the device buffer there."""
        cuda = torch.cuda.is_available()
        device_free = torch.cuda.mem_get_info()[0] if cuda and config.device is DeviceKind.CUDA else None
        return cls(cuda, device_free, host_available_bytes())


def needs(config: _Sizes) -> tuple[Need, ...]:
    """Every allocation of size a `Config` sets, made when an instance starts."""
    bps, on_cuda = config.bytes_per_slot, config.device is DeviceKind.CUDA
    out = [
        Need(f"device KV buffer (device_slots={config.device_slots} x {_size(bps)} a slot)",
             "device_slots", config.device_slots * bps, on_cuda),
        Need(f"host KV buffer (host_slots={config.host_slots} x {_size(bps)} a slot)",
             "host_slots", config.host_pages * config.page_size * bps, False),
        Need("host page states, free list and check table (17 bytes per host page; the table at its first use)",
             "host_slots", 17 * config.host_pages, False),
        Need("device page owners, free list and free pages' codes (16 bytes per device page)",
             "device_slots", 16 * config.device_pages, False),
        Need("device slot numbers by page (8 bytes per device slot)", "device_slots", 8 * config.device_slots, False),
    ]
    if config.storage is StorageKind.MOONCAKE:
        out.append(Need(f"Mooncake segment (mooncake_segment_mb={config.mooncake_segment_mb})",
                        "mooncake_segment_mb", config.mooncake_segment_mb << 20, False))
    return tuple(out)


def check_resources(config: _Sizes, available: Available | None = None) -> None:
    """Raise `ConfigError` when this machine (or `available`) cannot hold what `config` allocates.

    Call it when an instance starts, before any buffer is allocated."""
    have = available or Available.of_machine(config)
    if config.device is DeviceKind.CUDA and not have.cuda:
        raise ConfigError(
            f"device='cuda' but torch {torch.__version__} finds no usable CUDA device (torch built for CUDA "
            f"{torch.version.cuda}): run on a machine with an NVIDIA GPU and a CUDA build of torch, or set device='cpu'"
        )
    all_needs = needs(config)
    for on_device, free in ((True, have.device_free_bytes), (False, have.host_free_bytes)):
        part = [n for n in all_needs if n.on_device is on_device]
        total = sum(n.nbytes for n in part)
        if free is not None and total > free:
            where = "CUDA device memory" if on_device else "host memory"
            raise ConfigError(
                f"the cache needs {_size(total)} of {where} but {_size(free)} is free: "
                f"{' + '.join(f'{n.what} {_size(n.nbytes)}' for n in part)}; "
                f"{_advice(config, part, total, free)}"
            )


def _advice(config: _Sizes, part: list[Need], total: int, free: int) -> str:
    """The fix: how many slots of the largest buffer would fit, else which fields to lower."""
    biggest = max(part, key=lambda n: n.nbytes)
    if biggest.field in ("device_slots", "host_slots"):
        scaled = sum(n.nbytes for n in part if n.field == biggest.field)
        slots = getattr(config, biggest.field)
        fit = max(0, (free - (total - scaled)) * slots // scaled // config.page_size * config.page_size)
        if fit and (biggest.field == "device_slots" or fit > config.device_slots):
            return (f"lower {biggest.field} to at most {fit}, or size the cache in bytes with "
                    "Config.for_model(model_config, device_bytes=..., host_bytes=...)")
    fields = dict.fromkeys(n.field for n in sorted(part, key=lambda n: -n.nbytes))
    return f"lower {', '.join(fields)}"


def host_available_bytes() -> int | None:
    """Memory this process can still take: the kernel's MemAvailable, within the room its
    cgroup (a container's memory limit) leaves; None where neither can be read."""
    known = [b for b in (_meminfo_available(), _cgroup_room()) if b is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """cgroup v2: the limit, less what is charged, plus the page cache it may reclaim."""
    try:
        line = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if x.startswith("0::"))
        folder = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        stat = dict(x.split() for x in (folder / "memory.stat").read_text().splitlines())
        current = int((folder / "memory.current").read_text())
        return max(0, int(limit) - current + int(stat.get("inactive_file", 0)))
    except (OSError, ValueError, StopIteration):
        return None


def _size(n: int) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    value, unit = float(n), 0
    while value >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    return f"{n} B" if unit == 0 else f"{value:.1f} {units[unit]}"
