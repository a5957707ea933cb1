"""`hicache bench storage`: reading pages from each storage backend into a host buffer,
against a raw read of the same bytes in the same run.

For each backend (file, in a temporary directory; Mooncake Store, against a master this
bench starts on 127.0.0.1) and each host layout, the bench writes `--mib` of pages of a
32-layer, 8-KV-head, head_dim-128 fp16 model (16-token pages: 2 MiB each), then times:
- **backend**: `backend.read` of all pages, one call per `storage_batch_pages` pages as
  the prefetcher makes them: the stored bytes land in staging, are checked (header and
  CRC-32) and copied into the host buffer;
- **raw**: the same stored bytes read into one preallocated buffer, unchecked, not
  copied on: per file `readinto` (file), `batch_get_into` per batch through the same
  client (Mooncake).
The two are interleaved rep by rep after a warm-up; the median of each counts. File
reads come from the page cache (the pages were just written): this measures the
backend's own cost, not a disk. A backend that cannot run (no master) is an error row.

This is not actor code: it reads `time.perf_counter` and runs the backends directly.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from rich.table import Table

from hicache.actors import (
    FileBackend,
    KVBuffer,
    KVShape,
    MooncakeBackend,
    PageFormat,
    StorageBackend,
    StorageError,
    open_backend,
    page_keys,
)

from ._bench_cli import progress_bar, report
from ._bench_transfer import _machine
from ._mooncake_master import MasterStartError, MooncakeMaster
from .config import Config, DeviceKind, HostLayout

SHAPE = {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "float16", "page_size": 16}
"""128 KiB of K and V a token; a 16-token page is 2 MiB."""
BATCH_PAGES = 16
WARMUP = 1
REPS = 5
DEFAULT_MIB = 256
BACKENDS = ("file", "mooncake")
LAYOUTS = (HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST)


@dataclass(frozen=True, slots=True)
class Result:
    backend: str
    layout: HostLayout
    gbps: float = 0.0
    raw_gbps: float = 0.0
    write_gbps: float = 0.0
    error: str = ""

    @property
    def ratio(self) -> float:
        return self.gbps / self.raw_gbps if self.raw_gbps else 0.0

    def to_json(self) -> dict[str, object]:
        numbers = None if self.error else {
            "gbps": round(self.gbps, 3), "raw_gbps": round(self.raw_gbps, 3), "ratio": round(self.ratio, 3),
            "write_gbps": round(self.write_gbps, 3),
        }
        return {"backend": self.backend, "layout": self.layout.value,
                **(numbers or dict.fromkeys(("gbps", "raw_gbps", "ratio", "write_gbps"))), "error": self.error}


def _config(pages: int, layout: HostLayout, **storage: Any) -> Config:
    """The bench's shape with room for `pages` host pages (the layout matters only to KVShape users)."""
    p = SHAPE["page_size"]
    return Config(**SHAPE, device_slots=p, host_slots=(pages + 1) * p, host_layout=layout,
                  storage_batch_pages=BATCH_PAGES, **storage)


# -- raw reads ---------------------------------------------------------------------------


class RawFile:
    """Reads each page file whole into one preallocated buffer."""

    def __init__(self, backend: FileBackend, keys: list[str]) -> None:
        self.paths = [backend.path(k) for k in keys]
        self.buffer = memoryview(bytearray(len(keys) * backend.fmt.stored_bytes))
        self.stored = backend.fmt.stored_bytes

    def read(self) -> int:
        for i, path in enumerate(self.paths):
            with open(path, "rb", buffering=0) as f:
                if f.readinto(self.buffer[i * self.stored : (i + 1) * self.stored]) != self.stored:
                    raise RuntimeError(f"bench storage: {path} is shorter than a stored page")
        return len(self.buffer)


class RawMooncake:
    """`batch_get_into` of the same keys through the backend's client into one registered buffer."""

    def __init__(self, backend: MooncakeBackend, keys: list[str]) -> None:
        self.client = backend.client
        self.keys = keys
        self.stored = backend.fmt.stored_bytes
        self.buffer = torch.empty(len(keys) * self.stored, dtype=torch.uint8)
        if self.client.register_buffer(self.buffer.data_ptr(), self.buffer.numel()) != 0:
            raise StorageError("bench storage: Mooncake could not register the raw read buffer")

    def read(self) -> int:
        base = self.buffer.data_ptr()
        for b in range(0, len(self.keys), BATCH_PAGES):
            keys = self.keys[b : b + BATCH_PAGES]
            got = self.client.batch_get_into(keys, [base + (b + i) * self.stored for i in range(len(keys))],
                                             [self.stored] * len(keys))
            if any(n != self.stored for n in got):
                raise StorageError(f"bench storage: raw Mooncake get returned {got}")
        return self.buffer.numel()

    def close(self) -> None:
        self.client.unregister_buffer(self.buffer.data_ptr())


# -- one backend ---------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _read_all(backend: StorageBackend, keys: list[str], host: KVBuffer, slots: torch.Tensor) -> int:
    """`backend.read` one batch of pages at a time, as the prefetcher calls it; payload bytes."""
    p = host.shape.page_size
    moved = 0
    for b in range(0, len(keys), BATCH_PAGES):
        io = backend.read(keys[b : b + BATCH_PAGES], host, slots[b * p : (b + BATCH_PAGES) * p])
        if io.error:
            raise StorageError(f"bench storage: {io.error}")
        moved += io.bytes
    return moved


def _measure(
    backend: StorageBackend, shape: KVShape, pages: int, layout: HostLayout, seed: int, step: Callable[[], None]
) -> Result:
    p = shape.page_size
    keys = page_keys(range(seed << 32, (seed << 32) + pages), rank=0)
    slots = torch.arange(pages * p)
    src = KVBuffer.allocate(shape, (pages + 1) * p, layout, "cpu")
    src.tensor.view(torch.uint8).random_(generator=torch.Generator().manual_seed(seed))
    dst = KVBuffer.allocate(shape, (pages + 1) * p, layout, "cpu")
    write_s, wrote = _timed(lambda: backend.write(keys, src, slots))
    if wrote.error or wrote.written != pages:
        raise StorageError(f"bench storage: writing the pages failed: {wrote}")
    raw = RawFile(backend, keys) if isinstance(backend, FileBackend) else RawMooncake(backend, keys)
    read_s, raw_s = [], []
    try:
        for rep in range(WARMUP + REPS):
            r, moved = _timed(lambda: _read_all(backend, keys, dst, slots))
            w, raw_bytes = _timed(raw.read)
            if rep >= WARMUP:
                read_s.append(r)
                raw_s.append(w)
            step()
    finally:
        if isinstance(raw, RawMooncake):
            raw.close()
    if not torch.equal(dst.read(slots).view(torch.uint8), src.read(slots).view(torch.uint8)):  # bits: NaNs too
        raise StorageError("bench storage: the pages read back differ from those written")
    return Result(backend.name, layout, gbps=moved / statistics.median(read_s) / 1e9,
                  raw_gbps=raw_bytes / statistics.median(raw_s) / 1e9, write_gbps=wrote.bytes / write_s / 1e9)


def _storage_fields(kind: str, pages: int, stack: ExitStack) -> dict[str, Any]:
    """The Config fields of `kind`'s storage; `stack` keeps it (directory, master) alive."""
    if kind == "file":
        return {"storage": "file", "storage_dir": stack.enter_context(tempfile.TemporaryDirectory(prefix="hicache-"))}
    stored_mib = len(LAYOUTS) * pages * PageFormat(KVShape.of(_config(pages, LAYOUTS[0]))).stored_bytes / 2**20
    master = stack.enter_context(MooncakeMaster())
    return {"storage": "mooncake", "mooncake_segment_mb": math.ceil(stored_mib * 1.25) + 64, **master.config_fields()}


def _run_backend(kind: str, pages: int, step: Callable[[], None]) -> list[Result]:
    """Both layouts on one backend; error rows for what could not run."""
    results: list[Result] = []
    try:
        with ExitStack() as stack:
            config = _config(pages, LAYOUTS[0], **_storage_fields(kind, pages, stack))
            backend = open_backend(config)
            assert backend is not None
            stack.callback(backend.close)
            for seed, layout in enumerate(LAYOUTS, start=1):
                results.append(_measure(backend, KVShape.of(config), pages, layout, seed, step))
    except (MasterStartError, StorageError) as e:
        done = {r.layout for r in results}
        results += [Result(kind, layout, error=str(e)) for layout in LAYOUTS if layout not in done]
    return results


# -- the command -----------------------------------------------------------------------------


def _table(results: list[Result], pages: int, machine: dict[str, object]) -> Table:
    t = Table(
        title=f"storage: {pages} pages of 2 MiB read in batches of {BATCH_PAGES}, median of {REPS}",
        caption=(f"{machine['cpu_count']} x {machine['cpu_model']}, {machine['memory_gib']} GiB, "
                 f"torch {machine['torch']}; raw: the same stored bytes, unchecked, into one buffer"),
    )
    for col in ("backend", "layout", "GB/s", "raw GB/s", "ratio", "write GB/s"):
        t.add_column(col, justify="left" if col in ("backend", "layout") else "right")
    for r in results:
        if r.error:
            t.add_row(r.backend, r.layout.value, f"[red]error: {r.error}[/red]", "", "", "")
        else:
            t.add_row(r.backend, r.layout.value, f"{r.gbps:.2f}", f"{r.raw_gbps:.2f}", f"{r.ratio:.2f}",
                      f"{r.write_gbps:.2f}")
    return t


def run_bench_storage(*, as_json: bool, mib: int) -> int:
    if mib < 2:
        raise SystemExit("hicache bench storage: --mib must be at least 2 (one 2 MiB page)")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's client logs every step at INFO
    pages = mib // 2
    progress = progress_bar(as_json)
    results: list[Result] = []
    with progress:
        task = progress.add_task("storage", total=len(BACKENDS) * len(LAYOUTS) * (WARMUP + REPS))
        for kind in BACKENDS:
            progress.update(task, description=kind)
            results += _run_backend(kind, pages, lambda: progress.advance(task))
    machine = _machine(DeviceKind.CPU)
    table = _table(results, pages, machine)
    body = {
        "machine": machine,
        "workload": {**SHAPE, "page_bytes": _config(1, LAYOUTS[0]).bytes_per_slot * SHAPE["page_size"],
                     "pages": pages, "mib": mib,
                     "batch_pages": BATCH_PAGES, "warmup": WARMUP, "reps": REPS},
        "results": [r.to_json() for r in results],
    }
    return report(table, body, as_json=as_json)
