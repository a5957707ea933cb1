"""`hicache demo`: the L1/L2 data plane end to end on the embedded trace.

For each wave of trace requests it does what the tree will do around a
write-through and a load-back, through the real actors on threads:

1. allocate device slots per request (the ledger), write fingerprint KV for the
   prompt (the stand-in for a prefill) and commit it;
2. reserve host slots, mark them WRITING, write device -> host (merged and
   split by the write stream); on `WriteDone` mark them SYNCED;
3. release the requests (their device slots are freed, exactly once) and mark
   the host copies HOST_ONLY: L2 holds the only copy;
4. allocate load slots, mark the host copies LOADING, queue the loads and start
   them as one batch; wait layer by layer like a forward pass, verify every
   byte with the fingerprint oracle, then free both copies.

Invariants of every actor are checked after each wave.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hicache.actors import KVShape
from hicache.messages import (
    ActorName,
    AdoptLoadedSlots,
    AllocateHost,
    AllocateLoadSlots,
    AllocateSlots,
    CommitSlots,
    FreeDeviceSlots,
    FreeHostSlots,
    HostAllocated,
    HostSlotState,
    Indices,
    LoadDone,
    LoadKV,
    ReleaseReason,
    ReleaseRequests,
    SetHostState,
    SlotDemand,
    SlotRelease,
    SlotsAllocated,
    StartLoads,
    WriteDone,
    WriteKV,
)

from ._system import System
from .config import Config
from .oracle import FingerprintOracle
from .trace import TraceRequest, load_trace

DEMO_REQUESTS = 48
DEMO_WAVE = 8
TREE = ActorName.TREE


@dataclass
class _Tally:
    requests: int = 0
    tokens: int = 0
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    d2h_s: float = 0.0
    h2d_s: float = 0.0
    verified_tokens: int = 0
    waves: int = 0


def demo_config() -> Config:
    return Config(layers=4, kv_heads=2, head_dim=64, dtype="float16", page_size=16,
                  device_slots=16 * 4096, host_slots=16 * 16384)


def run_demo(requests: int | None = None, as_json: bool = False) -> int:
    n = DEMO_REQUESTS if requests is None else requests
    if n <= 0:
        raise SystemExit(f"hicache demo: --requests must be > 0, got {n}")
    cfg = demo_config()
    trace = list(load_trace(n))
    tally = _Tally()
    err = Console(stderr=True)
    with System(cfg, stand_ins=(TREE,)) as system, Progress(console=err, transient=True) as bar:
        oracle = FingerprintOracle(KVShape.of(cfg))
        task = bar.add_task("L1 -> L2 -> L1", total=len(trace))
        for wave in _waves(trace, DEMO_WAVE, cfg.device_slots - DEMO_WAVE * cfg.page_size):
            _round_trip(system, oracle, [(f"r{r.index}", r.tokens()) for r in wave], tally)
            system.check_invariants()
            bar.advance(task, len(wave))
        stats = system.statistics()
    free_dev = stats[ActorName.DEVICE].free_slots == cfg.device_slots  # type: ignore[attr-defined]
    free_host = stats[ActorName.HOST].slots_by_state[HostSlotState.FREE] == cfg.host_slots  # type: ignore[attr-defined]
    figures = {
        "requests": tally.requests,
        "skipped_longer_than_device": len(trace) - tally.requests,
        "input_tokens": tally.tokens,
        "waves": tally.waves,
        "d2h_bytes": tally.d2h_bytes,
        "h2d_bytes": tally.h2d_bytes,
        "d2h_gbps": round(tally.d2h_bytes / max(tally.d2h_s, 1e-9) / 1e9, 3),
        "h2d_gbps": round(tally.h2d_bytes / max(tally.h2d_s, 1e-9) / 1e9, 3),
        "verified_tokens": tally.verified_tokens,
        "slots_conserved": bool(free_dev and free_host),
    }
    if as_json:
        print(json.dumps(figures))
    else:
        table = Table(title="hicache demo: L1 -> L2 -> L1 round trip on the Mooncake conversation trace")
        table.add_column("figure")
        table.add_column("value", justify="right")
        for k, v in figures.items():
            table.add_row(k.replace("_", " "), f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v))
        Console().print(table)
    return 0 if figures["slots_conserved"] and tally.verified_tokens == tally.tokens else 1


def _waves(trace: list[TraceRequest], most: int, slots: int) -> Iterator[list[TraceRequest]]:
    """Consecutive requests, at most `most` per wave and `slots` tokens in all."""
    wave: list[TraceRequest] = []
    used = 0
    for req in trace:
        if req.input_length > slots:
            continue  # longer than the whole device pool: counted as skipped
        if wave and (len(wave) == most or used + req.input_length > slots):
            yield wave
            wave, used = [], 0
        wave.append(req)
        used += req.input_length
    if wave:
        yield wave


def _round_trip(system: System, oracle: FingerprintOracle, wave: list[tuple[str, torch.Tensor]], tally: _Tally) -> None:
    probe = system.probes[TREE]
    ids = system.services.ids
    p = system.config.page_size
    ask = system.ask

    # 1. prefill: allocate, write fingerprint KV, commit.
    demands = tuple(SlotDemand(request_id=rid, tokens=len(t)) for rid, t in wave)
    got = ask(ActorName.DEVICE, AllocateSlots(op_id=ids.next("op"), demands=demands))
    if not isinstance(got, SlotsAllocated):
        raise RuntimeError(f"demo wave does not fit the device pool: {got}")
    device = {g.request_id: g.indices for g in got.grants}
    for rid, tokens in wave:
        oracle.write(system.device_kv, tokens, device[rid].as_tensor())
    ask(ActorName.DEVICE, CommitSlots(op_id=ids.next("op"), demands=demands))

    # 2. write-through: reserve host pages, WRITING, D2H, SYNCED on WriteDone.
    host: dict[str, Indices] = {}
    for rid, tokens in wave:
        h = ask(ActorName.HOST, AllocateHost(op_id=ids.next("op"), tokens=-(-len(tokens) // p) * p), sender=TREE)
        if not isinstance(h, HostAllocated):
            raise RuntimeError(f"demo wave does not fit the host pool: {h}")
        host[rid] = h.indices
        system.tell(ActorName.HOST, SetHostState(indices=h.indices, state=HostSlotState.WRITING), sender=TREE)
    t0 = time.perf_counter()
    for rid, tokens in wave:
        system.tell(ActorName.WRITE, WriteKV(op_id=ids.next("op"), device=device[rid], host=host[rid][: len(tokens)]), sender=TREE)
    for _ in wave:
        probe.expect(WriteDone)
    tally.d2h_s += time.perf_counter() - t0
    for rid, _t in wave:
        system.tell(ActorName.HOST, SetHostState(indices=host[rid], state=HostSlotState.SYNCED), sender=TREE)

    # 3. finish: release every device slot (exactly once); the host copy is now the only one.
    releases = tuple(SlotRelease(request_id=rid, adopt=Indices(), reason=ReleaseReason.FINISHED) for rid, _ in wave)
    ask(ActorName.DEVICE, ReleaseRequests(op_id=ids.next("op"), releases=releases))
    for rid, _t in wave:
        system.tell(ActorName.HOST, SetHostState(indices=host[rid], state=HostSlotState.HOST_ONLY), sender=TREE)

    # 4. load-back: load slots, LOADING, queue, start one batch, wait per layer, verify.
    loaded: dict[str, Indices] = {}
    for rid, tokens in wave:
        g = ask(ActorName.DEVICE, AllocateLoadSlots(op_id=ids.next("op"), tokens=len(tokens)), sender=TREE)
        if not isinstance(g, SlotsAllocated):
            raise RuntimeError(f"demo wave does not fit the device pool for load-back: {g}")
        loaded[rid] = g.grants[0].indices
        system.tell(ActorName.HOST, SetHostState(indices=host[rid], state=HostSlotState.LOADING), sender=TREE)
        system.tell(ActorName.LOAD, LoadKV(op_id=ids.next("op"), host=host[rid][: len(tokens)], device=loaded[rid][: len(tokens)]), sender=TREE)
    t0 = time.perf_counter()
    started = ask(ActorName.LOAD, StartLoads(), sender=TREE)
    waiter = system.ring.waiter(started.batch)  # type: ignore[union-attr]
    for layer in range(system.config.layers):
        waiter.wait_layer(layer)
    for _ in wave:
        probe.expect(LoadDone)
    tally.h2d_s += time.perf_counter() - t0
    for rid, tokens in wave:
        oracle.verify(system.device_kv, tokens, loaded[rid].as_tensor()[: len(tokens)])
        tally.verified_tokens += len(tokens)
        system.tell(ActorName.DEVICE, AdoptLoadedSlots(indices=loaded[rid]), sender=TREE)
        system.tell(ActorName.HOST, SetHostState(indices=host[rid], state=HostSlotState.SYNCED), sender=TREE)
        system.tell(ActorName.DEVICE, FreeDeviceSlots(indices=loaded[rid]), sender=TREE)
        system.tell(ActorName.HOST, FreeHostSlots(indices=host[rid]), sender=TREE)
        tally.tokens += len(tokens)
        tally.d2h_bytes += len(tokens) * system.config.bytes_per_slot
        tally.h2d_bytes += len(tokens) * system.config.bytes_per_slot
    tally.requests += len(wave)
    tally.waves += 1
