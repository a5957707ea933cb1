"""`hicache bench storage`: reading and writing pages between each storage backend and a
host buffer, against a raw read or write of the same bytes in the same run.

For each backend (file, in a temporary directory: the system's, or a fresh one in `--dir`,
the file system an L3 is to run on, which the report names; Mooncake Store, against a master this
bench starts on 127.0.0.1), each host layout and each page size (2 MiB: a 32-layer,
8-KV-head, head_dim-128 fp16 model with 16-token pages; then 64 KiB and 2 KiB pages of
smaller shapes), it times:
- **read**: `backend.read` of all pages, one call per prefetch step (`Config.storage_step_pages`) as the
  prefetcher makes them: straight into the host pages and verified there, or for small
  pages through the backend's record block (verified there, then copied in);
- **raw read**: the same stored bytes read into the same host buffer, one contiguous
  region, unchecked: a `preadv` per run of adjacent records (file), a `batch_get_into`
  per batch through the same client (Mooncake);
- **write**: `backend.write` of all pages under new keys, one call per backup of
  `write_pages` pages (the prefetcher hands the backend one backup, a node's pages, per
  call; the reference scheduler's 4096-token prefill chunks make nodes of up to 256
  pages of 16 tokens);
- **raw write**: the same number of stored bytes, from the same host buffer (the one
  the backend's writes send from) as one region, in one sequential write appended to a
  file in the same directory (file), or a `batch_put_from` per batch under new keys
  (Mooncake).
Sides are interleaved rep by rep after a warm-up; the median of each counts; every rate
is payload bytes over time, so a ratio is the raw time over the backend's. File I/O goes
through the page cache (no fsync on either side): this measures the backend's own cost,
not a disk's. So that neither write side waits for the disk to take the other's dirty
pages, the file system is synced before each timed write; both sides append fresh bytes
to files (the backend to its segments, the raw side to a file of its own), and Mooncake
objects are removed after each side. A backend that cannot run (no master) is an error row.

With `--load-back`, it also times the path of an L3 hit, 2 MiB pages, each layout: the
pages read from storage into host memory (pinned on CUDA) as a prefetch reads them, then
loaded to the device as the load stream loads an admitted request's pages (one plan, a
copy a layer on its side stream, waited for at the end), against a raw read of the same
stored bytes into the same host buffer plus one contiguous copy of the payload to the
device. On CUDA that is the PCIe path; on a CPU machine the "device" is CPU memory.

This is not actor code: it reads `time.perf_counter` and runs the backends directly.
"""

from __future__ import annotations

import ctypes
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from rich.console import Group
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
from hicache.actors._kv import _Route
from hicache.actors._streams import _CudaStream
from hicache.messages.config import Config, DeviceKind, HostLayout

from ._cli import progress_bar, report
from ._transfer import _machine
from ..testing._mooncake_master import MasterStartError, MooncakeMaster
from .._usage import UsageError

SHAPES: dict[str, dict[str, Any]] = {
    "2MiB": {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "float16", "page_size": 16},
    "64KiB": {"layers": 8, "kv_heads": 4, "head_dim": 64, "dtype": "float16", "page_size": 8},
    "2KiB": {"layers": 2, "kv_heads": 1, "head_dim": 32, "dtype": "float16", "page_size": 8},
}
"""Page sizes and the KV shapes that give them (the demo's pages are 2 KiB)."""
SMALL_MIB_MAX = 16
"""Small pages move at most this much (a page costs a fixed few microseconds)."""
BATCH_PAGES = 16
"""`storage_batch_pages`' default; a read call takes `Config.storage_step_pages` (16 pages at
2 MiB and 64 KiB, 512 at 2 KiB, by `storage_batch_mb`'s default), and so does a raw Mooncake call."""
WRITE_PAGES = 256
"""Pages per write call by default: a backup of a 4096-token prefill chunk of 16-token pages."""
WARMUP = 1
REPS = 5
DEFAULT_MIB = 256
MIB_MIN = 2
"""Least `--mib`: one page of the largest shape, 2 MiB (`hicache bench storage --mib` is parsed
with this bound; a test keeps the two equal)."""
READ_THREADS_MAX = 64
"""Most `--read-threads`: `Config.storage_read_threads`' bound (parsed as `--mib` is)."""
BACKENDS = ("file", "mooncake")
LOAD_BACK_PAGE = "2MiB"
"""The page size the L3-hit path is timed at: a model's pages."""
LAYOUTS = (HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST)


class _Row:
    """A table row of medians: its figures, or None for each when its backend could not run."""

    FIGURES: ClassVar[tuple[str, ...]]
    error: str

    def figures(self) -> dict[str, float]:
        raise NotImplementedError

    def numbers(self) -> dict[str, float | None]:
        return dict.fromkeys(self.FIGURES) if self.error else {k: round(v, 3) for k, v in self.figures().items()}

    def cells(self) -> list[str]:
        """Its figures as a table's cells, or the error in the first and the rest blank."""
        if self.error:
            return [f"[red]error: {self.error}[/red]", *[""] * (len(self.FIGURES) - 1)]
        return [f"{v:.2f}" for v in self.figures().values()]


@dataclass(frozen=True, slots=True)
class Result(_Row):
    FIGURES: ClassVar[tuple[str, ...]] = ("read_gbps", "raw_read_gbps", "read_ratio", "write_gbps", "raw_write_gbps",
                                          "write_ratio")
    backend: str
    layout: HostLayout
    page: str
    read_s: float = 0.0
    raw_read_s: float = 0.0
    write_s: float = 0.0
    raw_write_s: float = 0.0
    payload_bytes: int = 0
    error: str = ""

    def figures(self) -> dict[str, float]:
        gb = self.payload_bytes / 1e9
        return {"read_gbps": gb / self.read_s, "raw_read_gbps": gb / self.raw_read_s,
                "read_ratio": self.raw_read_s / self.read_s, "write_gbps": gb / self.write_s,
                "raw_write_gbps": gb / self.raw_write_s, "write_ratio": self.raw_write_s / self.write_s}

    def to_json(self) -> dict[str, object]:
        return {"backend": self.backend, "layout": self.layout.value, "page": self.page, **self.numbers(),
                "error": self.error}


@dataclass(frozen=True, slots=True)
class LoadBack(_Row):
    """An L3 hit's path: storage -> host (read) -> device (load), and the raw path beside it."""

    FIGURES: ClassVar[tuple[str, ...]] = ("read_gbps", "load_gbps", "path_gbps", "raw_read_gbps", "raw_load_gbps",
                                          "raw_path_gbps", "path_ratio")
    backend: str
    layout: HostLayout
    device: str
    read_s: float = 0.0
    load_s: float = 0.0
    path_s: float = 0.0
    raw_read_s: float = 0.0
    raw_load_s: float = 0.0
    raw_path_s: float = 0.0
    payload_bytes: int = 0
    error: str = ""

    def figures(self) -> dict[str, float]:
        gb = self.payload_bytes / 1e9
        return {"read_gbps": gb / self.read_s, "load_gbps": gb / self.load_s, "path_gbps": gb / self.path_s,
                "raw_read_gbps": gb / self.raw_read_s, "raw_load_gbps": gb / self.raw_load_s,
                "raw_path_gbps": gb / self.raw_path_s, "path_ratio": self.raw_path_s / self.path_s}

    def to_json(self) -> dict[str, object]:
        return {"backend": self.backend, "layout": self.layout.value, "device": self.device, **self.numbers(),
                "error": self.error}


def _config(page: str, pages: int, layout: HostLayout, **storage: Any) -> Config:
    """The shape of `page` with room for the pages and their raw copy (stored bytes, headers included)."""
    p = SHAPES[page]["page_size"]
    host_pages = pages + pages // 8 + 2
    return Config(**SHAPES[page], device_slots=p, host_slots=host_pages * p, host_layout=layout,
                  storage_batch_pages=BATCH_PAGES, **storage)


# -- raw I/O ---------------------------------------------------------------------------------


def _whole(host: KVBuffer) -> memoryview:
    """The host buffer's memory as one writable run of bytes."""
    t = host.tensor
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


class RawFile:
    """The same stored bytes as one region of the host buffer: read per run of adjacent
    records, written by appending them to one file of its own in one sequential write (the
    backend appends to its segments too)."""

    def __init__(self, backend: FileBackend, keys: list[str], host: KVBuffer, source: KVBuffer) -> None:
        self.memory = _whole(host)
        self.source = _whole(source)
        """What a write sends: the buffer the backend's writes send from."""
        self.runs: list[tuple[str, int, int]] = []  # (path, offset, bytes), adjacent records merged
        stored = backend.fmt.stored_bytes
        for key in keys:
            path, offset = backend.locate(key)
            if self.runs and self.runs[-1][0] == str(path) and sum(self.runs[-1][1:]) == offset:
                self.runs[-1] = (str(path), self.runs[-1][1], self.runs[-1][2] + stored)
            else:
                self.runs.append((str(path), offset, stored))
        self.nbytes = len(keys) * stored
        self.fd, self.path = tempfile.mkstemp(prefix="raw-", suffix=".bin", dir=backend.root)

    def read(self) -> None:
        view, at = self.memory, 0
        for path, offset, n in self.runs:
            fd = os.open(path, os.O_RDONLY)
            try:
                if os.preadv(fd, [view[at : at + n]], offset) != n:
                    raise StorageError(f"bench storage: {path} is shorter than its records")
            finally:
                os.close(fd)
            at += n

    def write(self, rep: int) -> None:
        view, done = self.source[: self.nbytes], 0
        while done < self.nbytes:
            done += os.write(self.fd, view[done:])

    def forget(self, rep: int) -> None:
        """The appended bytes stay, as the backend's do."""

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


class RawMooncake:
    """`batch_get_into` / `batch_put_from` of the same stored bytes through the backend's client,
    into or out of one region of the (registered) host buffer."""

    def __init__(self, backend: MooncakeBackend, keys: list[str], host: KVBuffer, source: KVBuffer,
                 batch: int) -> None:
        self.client = backend.client
        self.batch = batch
        """Objects a call: the backend's own (`Config.storage_step_pages`)."""
        self.objects = [backend.object_key(k) for k in keys]
        self.stored = backend.fmt.stored_bytes
        self.base = host.tensor.data_ptr()
        self.source = source.tensor.data_ptr()
        """What a write sends: the buffer the backend's writes send from."""

    def _batches(self, base: int) -> list[tuple[list[str], list[int]]]:
        out = []
        for b in range(0, len(self.objects), self.batch):
            keys = self.objects[b : b + self.batch]
            out.append((keys, [base + (b + i) * self.stored for i in range(len(keys))]))
        return out

    def read(self) -> None:
        for keys, ptrs in self._batches(self.base):
            got = self.client.batch_get_into(keys, ptrs, [self.stored] * len(keys))
            if any(n != self.stored for n in got):
                raise StorageError(f"bench storage: raw Mooncake get returned {got}")

    def write(self, rep: int) -> None:
        for keys, ptrs in self._batches(self.source):
            raw = [f"raw{rep}-{k}" for k in keys]
            if any(self.client.batch_put_from(raw, ptrs, [self.stored] * len(keys))):
                raise StorageError("bench storage: raw Mooncake put failed")

    def forget(self, rep: int) -> None:
        self.client.batch_remove([f"raw{rep}-{k}" for k in self.objects], True)

    def close(self) -> None:
        """Nothing to release: each rep's objects were removed after it."""


# -- one backend -------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _batched(call: Callable[..., Any], keys: list[str], host: KVBuffer, slots: torch.Tensor, per_call: int) -> None:
    """`backend.read` or `backend.write`, `per_call` pages at a time."""
    p = host.shape.page_size
    for b in range(0, len(keys), per_call):
        io = call(keys[b : b + per_call], host, slots[b * p : (b + per_call) * p])
        if io.error or io.pages != len(keys[b : b + per_call]):
            raise StorageError(f"bench storage: {io}")


def _forget(backend: StorageBackend, keys: list[str]) -> None:
    """Remove pages a write rep or a cell stored (Mooncake: its memory is bounded; the file
    backend's pages stay in their segments, as the raw side's bytes do in its file)."""
    if isinstance(backend, MooncakeBackend):
        backend.client.batch_remove([backend.object_key(k) for k in keys], True)


def _before_write(backend: StorageBackend) -> None:
    """Start a timed write with no dirty pages of earlier reps waiting for the disk."""
    if isinstance(backend, FileBackend):
        os.sync()


def _stored(backend: StorageBackend, config: Config, layout: HostLayout, pages: int, seed: int,
            write_pages: int) -> tuple[torch.Tensor, KVBuffer, list[str]]:
    """`pages` pages of seeded random bytes in a host buffer of `layout`, written to `backend`
    `write_pages` a call under keys of their own: (their slots, that buffer, the keys)."""
    slots = torch.arange(pages * config.page_size)
    src = KVBuffer.allocate(KVShape.of(config), config.host_slots, layout, "cpu")
    src.tensor.view(torch.uint8).random_(generator=torch.Generator().manual_seed(seed))
    keys = page_keys(range(seed << 40, (seed << 40) + pages), rank=0)
    _batched(backend.write, keys, src, slots, write_pages)
    return slots, src, keys


def _measure(backend: StorageBackend, config: Config, layout: HostLayout, page: str, pages: int, seed: int,
             write_pages: int, step: Callable[[], None]) -> Result:
    shape = KVShape.of(config)
    slots, src, keys = _stored(backend, config, layout, pages, seed, write_pages)
    dst = KVBuffer.allocate(shape, config.host_slots, layout, "cpu")
    raw = _raw(backend, config, keys, dst, src)
    per_call = config.storage_step_pages
    times: dict[str, list[float]] = {"read": [], "raw_read": [], "write": [], "raw_write": []}
    for rep in range(WARMUP + REPS):
        fresh = page_keys(range((seed << 40) + (rep + 1) * pages, (seed << 40) + (rep + 2) * pages), rank=0)
        sample = {
            "read": _timed(lambda: _batched(backend.read, keys, dst, slots, per_call)),
            "raw_read": _timed(raw.read),
        }
        _before_write(backend)
        sample["write"] = _timed(lambda: _batched(backend.write, fresh, src, slots, write_pages))
        _forget(backend, fresh)
        _before_write(backend)
        sample["raw_write"] = _timed(lambda: raw.write(rep))
        raw.forget(rep)
        if rep >= WARMUP:
            for k, v in sample.items():
                times[k].append(v)
        step()
    _batched(backend.read, keys, dst, slots, per_call)
    raw.close()
    _forget(backend, keys)
    if not torch.equal(dst.read(slots).view(torch.uint8), src.read(slots).view(torch.uint8)):  # bits: NaNs too
        raise StorageError("bench storage: the pages read back differ from those written")
    m = {k: statistics.median(v) for k, v in times.items()}
    return Result(backend.name, layout, page, m["read"], m["raw_read"], m["write"], m["raw_write"],
                  pages * PageFormat(shape).payload_bytes)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _load(host: KVBuffer, device: KVBuffer, pages: torch.Tensor, stream: _CudaStream) -> None:
    """Host pages -> the same device pages as the load stream copies an admitted request's:
    one plan, a copy a layer on its side stream, done once the last layer's event has fired."""
    plan = _Route(host, device).plan_pages(pages, pages)
    event = None
    for layer in range(host.shape.layers):
        _, event = stream.run(plan, layer)
    if event is not None:
        event.synchronize()


def _measure_load_back(backend: StorageBackend, config: Config, layout: HostLayout, pages: int, seed: int,
                       device: torch.device) -> LoadBack:
    shape = KVShape.of(config)
    slots, src, keys = _stored(backend, config, layout, pages, seed, WRITE_PAGES)
    page_ids = torch.arange(pages)
    pin = device.type == "cuda"
    host = KVBuffer.allocate(shape, config.host_slots, layout, "cpu", pin=pin)
    dev = KVBuffer.allocate(shape, pages * shape.page_size, HostLayout.LAYER_FIRST, device)
    raw = _raw(backend, config, keys, host, src)
    payload = pages * PageFormat(shape).payload_bytes
    host_bytes = host.tensor.view(-1).view(torch.uint8)[:payload]
    dev_bytes = dev.tensor.view(-1).view(torch.uint8)[:payload]
    stream = _CudaStream(device)
    times: dict[str, list[float]] = {k: [] for k in ("read", "load", "path", "raw_read", "raw_load", "raw_path")}
    try:
        for rep in range(WARMUP + REPS):
            _sync(device)
            t0 = time.perf_counter()
            _batched(backend.read, keys, host, slots, config.storage_step_pages)
            t1 = time.perf_counter()
            _load(host, dev, page_ids, stream)
            t2 = time.perf_counter()
            raw.read()
            t3 = time.perf_counter()
            dev_bytes.copy_(host_bytes, non_blocking=pin)
            _sync(device)
            t4 = time.perf_counter()
            if rep >= WARMUP:
                for k, v in (("read", t1 - t0), ("load", t2 - t1), ("path", t2 - t0), ("raw_read", t3 - t2),
                             ("raw_load", t4 - t3), ("raw_path", t4 - t2)):
                    times[k].append(v)
        _batched(backend.read, keys, host, slots, config.storage_step_pages)
        _load(host, dev, page_ids, stream)
        if not torch.equal(dev.read(slots).cpu().view(torch.uint8), src.read(slots).view(torch.uint8)):
            raise StorageError("bench storage: the pages loaded to the device differ from those written")
    finally:
        raw.close()
        _forget(backend, keys)
    m = {k: statistics.median(v) for k, v in times.items()}
    return LoadBack(backend.name, layout, str(device), m["read"], m["load"], m["path"], m["raw_read"],
                    m["raw_load"], m["raw_path"], payload)


def _raw(backend: StorageBackend, config: Config, keys: list[str], host: KVBuffer, source: KVBuffer) -> Any:
    if isinstance(backend, FileBackend):
        return RawFile(backend, keys, host, source)
    return RawMooncake(backend, keys, host, source, config.storage_step_pages)  # type: ignore[arg-type]


def _step(page: str) -> int:
    """Pages a read call takes at `page`'s size."""
    return _config(page, 1, LAYOUTS[0]).storage_step_pages


def _pages(page: str, mib: int) -> int:
    payload = PageFormat(KVShape.of(_config(page, 1, LAYOUTS[0]))).payload_bytes
    return max(1, (min(mib, SMALL_MIB_MAX) if page != "2MiB" else mib) * 2**20 // payload)


def _storage_fields(kind: str, mib: int, stack: ExitStack, where: str | None = None) -> dict[str, Any]:
    """The Config fields of `kind`'s storage; `stack` keeps it (directory, master) alive. The file
    backend's directory is a fresh one in `where` (None: the system's temporary directory)."""
    if kind == "file":
        return {"storage": "file",
                "storage_dir": stack.enter_context(tempfile.TemporaryDirectory(prefix="hicache-", dir=where))}
    master = stack.enter_context(MooncakeMaster())
    # Every page size's pages and one write rep's, with room for the headers and the allocator.
    return {"storage": "mooncake", "mooncake_segment_mb": math.ceil(mib * 2.5 + 3 * SMALL_MIB_MAX) + 64,
            **master.config_fields()}


def _run_backend(kind: str, mib: int, write_pages: int, step: Callable[[], None],
                 load_back: torch.device | None = None, read_threads: int | None = None,
                 where: str | None = None) -> tuple[list[Result], list[LoadBack]]:
    """Every layout and page size on one backend, then (given a device) the L3-hit path at
    each layout; error rows for what could not run."""
    results: list[Result] = []
    paths: list[LoadBack] = []
    cells = [(layout, page) for page in SHAPES for layout in LAYOUTS]
    try:
        with ExitStack() as stack:
            fields = _storage_fields(kind, mib, stack, where)
            if read_threads is not None:
                fields["storage_read_threads"] = read_threads
            if load_back is not None:
                page, pages = LOAD_BACK_PAGE, _pages(LOAD_BACK_PAGE, mib)
                config = _config(page, pages, LAYOUTS[0], **fields)
                backend = open_backend(config)
                assert backend is not None
                try:
                    for j, layout in enumerate(LAYOUTS):
                        paths.append(_measure_load_back(backend, config, layout, pages, 100 + j, load_back))
                        step()
                finally:
                    backend.close()
            for i, page in enumerate(SHAPES):
                config = _config(page, _pages(page, mib), LAYOUTS[0], **fields)
                backend = open_backend(config)  # one per KV shape: the host layout is the buffer's alone
                assert backend is not None
                try:
                    for j, layout in enumerate(LAYOUTS):
                        seed = 1 + i * len(LAYOUTS) + j
                        results.append(_measure(backend, config, layout, page, _pages(page, mib), seed,
                                                write_pages, step))
                finally:
                    backend.close()
    except (MasterStartError, StorageError) as e:
        done = {(r.layout, r.page) for r in results}
        results += [Result(kind, layout, page, error=str(e)) for layout, page in cells if (layout, page) not in done]
        if load_back is not None:
            measured = {r.layout for r in paths}
            paths += [LoadBack(kind, layout, str(load_back), error=str(e)) for layout in LAYOUTS
                      if layout not in measured]
    return results, paths


# -- the command -----------------------------------------------------------------------------


def _file_system(path: str) -> str:
    """`"<type> at <mount point>"` of the file system `path` lies on (Linux's mount table), or
    "unknown" where there is none to read."""
    real, best = os.path.realpath(path), ("", "unknown")
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[0]):
                    best = (point, fields[2])
    except OSError:
        return "unknown"
    return f"{best[1]} at {best[0]}" if best[0] else "unknown"


def _table(results: list[Result], mib: int, write_pages: int, read_threads: int, machine: dict[str, object],
           file_dir: str) -> Table:
    t = Table(
        title=f"storage: {mib} MiB of 2 MiB pages ({min(mib, SMALL_MIB_MAX)} MiB of smaller ones), reads of "
              f"storage_step_pages ({', '.join(f'{_step(p)} at {p}' for p in SHAPES)}) on {read_threads} "
              f"read thread(s) and writes of {write_pages} pages a call, median of {REPS}",
        caption=(f"{machine['cpu_count']} x {machine['cpu_model']}, {machine['memory_gib']} GiB, "
                 f"torch {machine['torch']}; file pages in {file_dir} ({_file_system(file_dir)}); raw: the same "
                 "stored bytes, unchecked, one host region"),
    )
    for col in ("backend", "layout", "page", "read GB/s", "raw", "ratio", "write GB/s", "raw", "ratio"):
        t.add_column(col, justify="left" if col in ("backend", "layout", "page") else "right")
    for r in results:
        t.add_row(r.backend, r.layout.value, r.page, *r.cells())
    return t


def _load_back_table(paths: list[LoadBack], mib: int, machine: dict[str, object]) -> Table:
    t = Table(
        title=f"L3 hit: {mib} MiB of {LOAD_BACK_PAGE} pages read from storage into host memory, then loaded to "
              f"the device, median of {REPS}",
        caption=(f"device {machine['device']}" + (f" ({machine['gpu']})" if "gpu" in machine else "")
                 + "; raw: the same stored bytes read into the same host buffer, then one contiguous copy"),
    )
    for col in ("backend", "layout", "read GB/s", "load GB/s", "path GB/s", "raw read", "raw load", "raw path",
                "ratio"):
        t.add_column(col, justify="left" if col in ("backend", "layout") else "right")
    for r in paths:
        t.add_row(r.backend, r.layout.value, *r.cells())
    return t


def run_bench_storage(*, as_json: bool, mib: int, write_pages: int = WRITE_PAGES, backends: tuple[str, ...] = BACKENDS,
                      load_back: bool = False, read_threads: int | None = None, where: str | None = None) -> int:
    """`read_threads`: the backends' `storage_read_threads` (None: the default). `where`: the
    directory the file backend's own directory is made in (None: the system's temporary one)."""
    if where is not None and not (os.path.isdir(where) and os.access(where, os.W_OK | os.X_OK)):
        raise UsageError(f"--dir {where}: not a writable directory; give an existing directory on the file system "
                         "to measure (its L3 mount, say)")
    if mib < MIB_MIN:
        raise UsageError(f"--mib {mib}: give at least {MIB_MIN} (one 2 MiB page)")
    if write_pages < 1:
        raise UsageError(f"--write-pages {write_pages}: give at least 1")
    threads = Config().storage_read_threads if read_threads is None else read_threads
    if type(threads) is not int or not 1 <= threads <= READ_THREADS_MAX:
        raise UsageError(f"--read-threads must be in 1..{READ_THREADS_MAX}, got {read_threads!r}")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's client logs every step at INFO
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise UsageError(f"unknown backend {unknown or backends}; choose from {BACKENDS}")
    file_dir = os.path.abspath(where if where is not None else tempfile.gettempdir())
    kind = DeviceKind.CUDA if load_back and torch.cuda.is_available() else DeviceKind.CPU
    device = torch.device("cuda" if kind is DeviceKind.CUDA else "cpu") if load_back else None
    progress = progress_bar(as_json)
    results: list[Result] = []
    paths: list[LoadBack] = []
    per_backend = len(LAYOUTS) * len(SHAPES) * (WARMUP + REPS) + (len(LAYOUTS) if load_back else 0)
    with progress:
        task = progress.add_task("storage", total=len(backends) * per_backend)
        for name in backends:
            progress.update(task, description=name)
            r, lb = _run_backend(name, mib, write_pages, lambda: progress.advance(task), device, threads, where)
            results += r
            paths += lb
    machine = _machine(kind)
    body = {
        "machine": machine,
        "workload": {"shapes": SHAPES, "mib": mib, "small_mib": min(mib, SMALL_MIB_MAX),
                     "pages": {page: _pages(page, mib) for page in SHAPES},
                     "read_pages": {page: _step(page) for page in SHAPES}, "write_pages": write_pages,
                     "read_threads": threads, "file_dir": file_dir, "file_system": _file_system(file_dir),
                     "warmup": WARMUP, "reps": REPS},
        "results": [r.to_json() for r in results],
    }
    table: Any = _table(results, mib, write_pages, threads, machine, file_dir)
    if load_back:
        body["load_back"] = [r.to_json() for r in paths]
        table = Group(table, _load_back_table(paths, mib, machine))
    return report(table, body, as_json=as_json)
