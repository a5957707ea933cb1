"""`hicache bench transfer`: D2H and H2D throughput through the stream actors.

For each host layout and page size, one `System` runs with a stand-in tree; the
bench sends it scattered pages (a seeded permutation of device and host pages),
as `WriteKV` ops of a few pages each (so the write stream merges them) or as
`LoadKV` ops started together (copied layer by layer), and times from the first
send to the last completion. In the same run, interleaved with those
measurements, it times a raw contiguous copy of the same number of bytes between
two preallocated flat buffers (pinned host <-> device on CUDA). Both sides get
the same warm-up and the same number of repetitions; the median time of each counts.

This is not actor code: it reads `time.perf_counter` and drives the system from
outside, as a scheduler would.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from rich.table import Table

from hicache.messages import (
    ActorName,
    Indices,
    LoadDone,
    LoadKV,
    LoadsStarted,
    Message,
    StartLoads,
    WriteDone,
    WriteKV,
)
from hicache.messages.config import Config, DeviceKind, HostLayout

from ._cli import progress_bar, report
from .._system import System
from ..testing import Probe

PAGE_SIZES = (16, 64, 256)
LAYOUTS = (HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST)
DIRECTIONS = ("d2h", "h2d")
TARGET_PAGE_SIZE = 64
TARGET_RATIO = 0.5
WAIT_S = 120.0
"""Longest wait for one measurement's completions before the bench gives up."""
SEED = 20240


@dataclass(frozen=True, slots=True)
class Workload:
    """The KV shape and sizes of one bench run."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    transfer_slots: int
    """Tokens moved per measurement (a multiple of every page size)."""
    device_slots: int
    host_slots: int
    slots_per_op: int
    """Tokens per `WriteKV` / `LoadKV` op (16 pages of 16 down to 1 of 256): several
    ops share a copy batch, so the write stream merges them."""
    warmup: int
    reps: int

    def config(self, layout: HostLayout, page_size: int, device: DeviceKind) -> Config:
        return Config(
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            page_size=page_size,
            device_slots=self.device_slots,
            host_slots=self.host_slots,
            device=device,
            host_layout=layout,
        )


FULL = Workload(
    # 32 layers x 8 KV heads x 128 x fp16: 128 KiB per token; 2048 tokens = 256 MiB a measurement.
    layers=32, kv_heads=8, head_dim=128, dtype="float16",
    transfer_slots=2048, device_slots=4096, host_slots=8192, slots_per_op=256, warmup=1, reps=7,
)
QUICK = Workload(
    # 2 KiB per token; 1024 tokens = 2 MiB a measurement: a smoke test, not a figure.
    layers=4, kv_heads=2, head_dim=64, dtype="float16",
    transfer_slots=1024, device_slots=2048, host_slots=4096, slots_per_op=256, warmup=1, reps=2,
)


@dataclass(frozen=True, slots=True)
class Result:
    direction: str
    layout: HostLayout
    page_size: int
    gbps: float
    raw_gbps: float

    @property
    def ratio(self) -> float:
        return self.gbps / self.raw_gbps

    def to_json(self) -> dict[str, object]:
        return {
            "direction": self.direction,
            "layout": self.layout.value,
            "page_size": self.page_size,
            "gbps": round(self.gbps, 3),
            "raw_gbps": round(self.raw_gbps, 3),
            "ratio": round(self.ratio, 3),
        }


# -- the two sides of a measurement ------------------------------------------


def _scattered_ops(w: Workload, page_size: int, rng: torch.Generator) -> list[tuple[Indices, Indices]]:
    """(device, host) pages of ops of a few pages each, scattered over the buffers."""
    pages = w.transfer_slots // page_size
    dev_pages = torch.randperm(w.device_slots // page_size, generator=rng)[:pages]
    host_pages = torch.randperm(w.host_slots // page_size, generator=rng)[:pages]
    per_op = max(1, w.slots_per_op // page_size)
    return [
        (Indices.from_tensor(dev_pages[i : i + per_op]), Indices.from_tensor(host_pages[i : i + per_op]))
        for i in range(0, pages, per_op)
    ]


def _time_writes(system: System, ops: list[tuple[Indices, Indices]], op_ids: Iterator[int]) -> float:
    messages = [WriteKV(op_id=next(op_ids), device=d, host=h) for d, h in ops]
    probe = system.probes[ActorName.TREE]
    t0 = time.perf_counter()
    for m in messages:
        system.tell(ActorName.WRITE, m, sender=ActorName.TREE)
    replies = probe.collect(len(messages), timeout_s=WAIT_S)
    elapsed = time.perf_counter() - t0
    _expect_all(replies, WriteDone, messages)
    return elapsed


def _time_loads(system: System, ops: list[tuple[Indices, Indices]], op_ids: Iterator[int]) -> float:
    messages = [LoadKV(op_id=next(op_ids), host=h, device=d) for d, h in ops]
    probe = system.probes[ActorName.TREE]
    assert system.ring is not None
    t0 = time.perf_counter()
    for m in messages:
        system.tell(ActorName.LOAD, m, sender=ActorName.TREE)
    started = system.ask(ActorName.LOAD, StartLoads(), timeout_s=WAIT_S)
    assert isinstance(started, LoadsStarted) and len(started.ops) == len(messages), started
    system.ring.waiter(started.batch).wait_all(timeout_s=WAIT_S)
    told, *replies = probe.collect(1 + len(messages), timeout_s=WAIT_S)  # the start, told to the tree too
    elapsed = time.perf_counter() - t0
    if told != started:
        raise RuntimeError(f"bench transfer: expected the tree to hear {started!r} first, got {told!r}")
    _expect_all(replies, LoadDone, messages)
    return elapsed


def _expect_all(replies: list[Message], kind: type[Message], sent: list[WriteKV] | list[LoadKV]) -> None:
    bad = [r for r in replies if not isinstance(r, kind)]
    if bad:
        raise RuntimeError(f"bench transfer: expected {kind.__name__} for every op, got {bad[0]!r}")
    if sorted(r.op_id for r in replies) != sorted(m.op_id for m in sent):
        raise RuntimeError("bench transfer: completions do not match the ops sent")


class RawCopy:
    """A raw contiguous copy of `nbytes` between two preallocated flat buffers."""

    def __init__(self, nbytes: int, dtype: torch.dtype, device: DeviceKind) -> None:
        n = nbytes // dtype.itemsize
        self.cuda = device is DeviceKind.CUDA
        if self.cuda:
            self.device = torch.zeros(n, dtype=dtype, device="cuda")
            self.host = torch.zeros(n, dtype=dtype, pin_memory=True)
        else:
            self.device = torch.zeros(n, dtype=dtype)
            self.host = torch.zeros(n, dtype=dtype)

    def time(self, direction: str) -> float:
        src, dst = (self.device, self.host) if direction == "d2h" else (self.host, self.device)
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0


# -- the run -----------------------------------------------------------------


def _measure(
    w: Workload, layout: HostLayout, page_size: int, device: DeviceKind, raw: RawCopy, step: Callable[[], None]
) -> list[Result]:
    """Both directions for one layout and page size; actor and raw reps interleaved."""
    config = w.config(layout, page_size, device)
    nbytes = w.transfer_slots * config.bytes_per_slot
    rng = torch.Generator().manual_seed(SEED + page_size)
    ops = _scattered_ops(w, page_size, rng)
    op_ids = iter(range(1, 1 << 62))
    timers = {"d2h": _time_writes, "h2d": _time_loads}
    out = []
    with System(config, stand_ins=(ActorName.TREE,), stand_in=Probe) as system:
        for direction in DIRECTIONS:
            actor_s, raw_s = [], []
            for rep in range(w.warmup + w.reps):
                a = timers[direction](system, ops, op_ids)
                r = raw.time(direction)
                if rep >= w.warmup:
                    actor_s.append(a)
                    raw_s.append(r)
            gbps = nbytes / statistics.median(actor_s) / 1e9
            raw_gbps = nbytes / statistics.median(raw_s) / 1e9
            out.append(Result(direction, layout, page_size, gbps, raw_gbps))
            step()
        system.raise_if_failed()
    return out


def _machine(device: DeviceKind) -> dict[str, object]:
    info: dict[str, object] = {
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": device.value,
    }
    if device is DeviceKind.CUDA:
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _table(results: list[Result], w: Workload, nbytes: int, machine: dict[str, object]) -> Table:
    t = Table(
        title=f"transfer: {nbytes / 2**20:.0f} MiB per measurement, median of {w.reps}"
        + (" (--quick: a smoke test, not a figure)" if w is QUICK else ""),
        caption=(
            f"{machine['cpu_count']} x {machine['cpu_model']}, {machine['memory_gib']} GiB, "
            f"torch {machine['torch']} ({machine['torch_threads']} threads), device {machine['device']}; "
            f"target: ratio >= {TARGET_RATIO} at page size {TARGET_PAGE_SIZE}"
        ),
    )
    for col in ("direction", "layout", "page size", "GB/s", "raw GB/s", "ratio"):
        t.add_column(col, justify="right" if col not in ("direction", "layout") else "left")
    for r in results:
        below = w is FULL and r.page_size == TARGET_PAGE_SIZE and r.ratio < TARGET_RATIO
        mark = " (< target)" if below else ""
        t.add_row(r.direction, r.layout.value, str(r.page_size), f"{r.gbps:.2f}", f"{r.raw_gbps:.2f}",
                  f"{r.ratio:.2f}{mark}")
    return t


def run_bench_transfer(*, as_json: bool, quick: bool) -> int:
    w = QUICK if quick else FULL
    device = DeviceKind.CUDA if torch.cuda.is_available() else DeviceKind.CPU
    dtype = Config(dtype=w.dtype).torch_dtype
    nbytes = w.transfer_slots * w.config(LAYOUTS[0], PAGE_SIZES[0], device).bytes_per_slot
    raw = RawCopy(nbytes, dtype, device)
    results: list[Result] = []
    progress = progress_bar(as_json)
    with progress:
        task = progress.add_task("transfer", total=len(LAYOUTS) * len(PAGE_SIZES) * len(DIRECTIONS))
        for layout in LAYOUTS:
            for page_size in PAGE_SIZES:
                progress.update(task, description=f"{layout.value} page {page_size}")
                results += _measure(w, layout, page_size, device, raw, lambda: progress.advance(task))
    machine = _machine(device)
    table = _table(results, w, nbytes, machine)
    body = {
        "machine": machine,
        "workload": {
            "layers": w.layers, "kv_heads": w.kv_heads, "head_dim": w.head_dim, "dtype": w.dtype,
            "bytes_per_measurement": nbytes, "warmup": w.warmup, "reps": w.reps, "quick": quick,
        },
        "results": [r.to_json() for r in results],
    }
    return report(table, body, as_json=as_json)
