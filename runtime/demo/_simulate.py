"""`hicache simulate --trace FILE`: hit rate per tier and modelled TTFT of a user's trace, swept
over capacities and policies in one command.

Each combination of the swept values (L1, L2 and L3 capacities; write, eviction and
prefetch policies) is one run over the same requests. Two engines:

- by default the reference scheduler serves the trace through `HiCache` on threads, as
  `hicache demo` does (batching, chunked prefill, decode, prefetch, storage in a
  temporary directory), with small fingerprint KV that the fake model checks;
- `--no-kv` drives the cores without actors or KV bytes, one request at a time
  (`_simulate_cores`): the same decisions, far faster, for when only hit rates matter.

Capacities are tokens (`100000`, `100k`, `2M`) or bytes (`4GiB`, `500MB`), turned into
tokens with the KV bytes per token (`--kv-bytes-per-token`, or `--model-shape`).
TTFT is modelled from each request's hits as in the demo (`CostModel`).
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.table import Table

from hicache.actors import KVShape, PageFormat
from hicache.messages import Tokens
from hicache.messages.config import DTYPES, SLOTS_MAX, Config

from ._demo import CostModel, _percentile, _Run, _serve, serve_requests
from ._simulate_plot import plot_sweep
from ._progress import progress
from ._simulate_cores import SimCores
from ._simulate_trace import SimRequest
from .._usage import UsageError

_UNITS: Final = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_BYTE_UNITS: Final = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                      "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE: Final = re.compile(r"(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>[a-zA-Z]*)")

KV_SHAPE: Final = {"layers": 2, "kv_heads": 1, "head_dim": 16, "dtype": "float16"}
"""The fingerprint KV of the default engine: its bytes are checks, not a model's."""


@dataclass(frozen=True, slots=True)
class Size:
    """A capacity as given: tokens, or bytes (None: unbounded, for L3)."""

    text: str
    tokens: int | None = None
    nbytes: int | None = None

    @property
    def unbounded(self) -> bool:
        return self.tokens is None and self.nbytes is None

    def in_tokens(self, kv_bytes_per_token: int) -> int | None:
        if self.nbytes is not None:
            return self.nbytes // kv_bytes_per_token
        return self.tokens


def parse_sizes(option: str, text: str, *, unbounded: bool = False) -> tuple[Size, ...]:
    """`100k,1M,4GiB` -> sizes (tokens without a byte unit; `unbounded` allowed where asked)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if unbounded and part.lower() == "unbounded":
            out.append(Size(part))
            continue
        m = _SIZE.fullmatch(part)
        unit = m["unit"].lower() if m else ""
        if m is None or (unit not in _UNITS and unit not in _BYTE_UNITS):
            extra = " or 'unbounded'" if unbounded else ""
            raise UsageError(f"{option}: {part!r} is not a size: give tokens (100000, 100k, 2M) or bytes "
                             f"(4GiB, 500MB){extra}, comma-separated")
        try:
            value = Fraction(m["n"])  # exact: a float would report a long number as another one
        except ValueError:  # more digits than Python converts
            raise UsageError(f"{option}: {part!r} is larger than any capacity; give at most {SLOTS_MAX:,} "
                             "tokens") from None
        size = (Size(part, tokens=int(value * _UNITS[unit])) if unit in _UNITS
                else Size(part, nbytes=int(value * _BYTE_UNITS[unit])))
        if not (size.tokens or size.nbytes):
            raise UsageError(f"{option}: {part!r} is no capacity; give a size above 0")
        out.append(size)
    return tuple(out)


def kv_bytes_of_shape(text: str) -> int:
    """`LAYERS,KV_HEADS,HEAD_DIM[,DTYPE]` -> bytes of K and V of one token."""
    parts = [p.strip() for p in text.split(",")]
    dtype = parts.pop() if len(parts) == 4 else "bfloat16"
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts) or dtype not in DTYPES:
        raise UsageError(f"--model-shape: {text!r} is not LAYERS,KV_HEADS,HEAD_DIM[,DTYPE] with counts above 0 "
                         f"and a dtype of {', '.join(DTYPES)} (like 32,8,128,bfloat16)")
    layers, heads, dim = map(int, parts)
    return 2 * layers * heads * dim * DTYPES[dtype].itemsize


@dataclass(frozen=True, slots=True)
class Point:
    """One run of a sweep: its capacities (tokens; L3 None: unbounded or absent) and policies."""

    l1: int
    l2: int | None
    l3: int | None
    storage: bool
    write_policy: str
    eviction_policy: str
    prefetch_policy: str

    def label(self) -> str:
        tiers = f"L1 {self.l1:,}" + (f", L2 {self.l2:,}" if self.l2 else "")
        if self.storage:
            tiers += f", L3 {self.l3:,}" if self.l3 else ", L3 unbounded"
        return f"{tiers} ({self.write_policy}, {self.eviction_policy}, {self.prefetch_policy})"


@dataclass(frozen=True, slots=True)
class Sweep:
    l1: tuple[Size, ...]
    l2: tuple[Size, ...]
    l3: tuple[Size, ...]
    write: tuple[str, ...]
    eviction: tuple[str, ...]
    prefetch: tuple[str, ...]
    page_size: int
    kv_bytes_per_token: int

    def points(self) -> list[Point]:
        out = []
        l2s = self.l2 or (None,)
        l3s = self.l3 or (None,)
        for l1, l2, l3, w, e, p in itertools.product(self.l1, l2s, l3s, self.write, self.eviction, self.prefetch):
            out.append(self._point(l1, l2, l3, w, e, p))
        return out

    def _point(self, l1: Size, l2: Size | None, l3: Size | None, w: str, e: str, p: str) -> Point:
        t1 = self._tokens("--l1", l1)
        t2 = self._tokens("--l2", l2) if l2 is not None else None
        if t2 is not None and t2 <= t1:
            raise UsageError(f"--l2 {l2.text} ({t2:,} tokens) must be larger than --l1 {l1.text} ({t1:,} tokens): "
                             "host memory backs device memory up")
        if l3 is not None and t2 is None:
            raise UsageError("--l3 needs --l2: pages move between storage and host memory")
        t3 = None if l3 is None or l3.unbounded else self._tokens("--l3", l3)
        return Point(t1, t2, t3, l3 is not None, w, e, p)

    def _tokens(self, option: str, size: Size) -> int:
        """The whole pages of `size`, in tokens. A bounded tier must hold a page: an L3 of 0
        tokens would otherwise read as unbounded (None and 0 are both "no bound" to a `Point`)."""
        n = size.in_tokens(self.kv_bytes_per_token) or 0
        n = n // self.page_size * self.page_size
        if n < self.page_size:
            raise UsageError(f"{option} {size.text} holds no page of {self.page_size} tokens "
                             f"({self.kv_bytes_per_token:,} KV bytes per token)")
        if n > SLOTS_MAX:
            raise UsageError(f"{option} {size.text} is more than a tier may hold; give at most {SLOTS_MAX:,} tokens")
        return n


@dataclass(frozen=True, slots=True)
class Outcome:
    point: Point
    requests: int
    skipped: int
    input_tokens: int
    hit_l1: int
    hit_l2: int
    hit_l3: int
    ttft_p50_s: float
    ttft_p99_s: float
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        rate = (lambda n: round(n / self.input_tokens, 4)) if self.input_tokens else (lambda n: 0.0)
        d.update(hit_rate=rate(self.hit_l1 + self.hit_l2 + self.hit_l3), hit_rate_l1=rate(self.hit_l1),
                 hit_rate_l2=rate(self.hit_l2), hit_rate_l3=rate(self.hit_l3))
        return d


def run_simulate(*, trace: list[SimRequest], sweep: Sweep, no_kv: bool, cost: CostModel, as_json: bool,
                 plot: Path | None, source: str) -> int:
    points = sweep.points()
    outcomes = []
    with progress(transient=True) as bar:
        for i, point in enumerate(points):
            label = f"run {i + 1}/{len(points)}: {point.label()}"
            run = _run_cores if no_kv else _run_actors
            outcomes.append(run(trace, point, sweep.page_size, cost, bar, label))
    body = {"trace": source, "engine": "cores, no KV" if no_kv else "reference scheduler, HiCache",
            "page_size": sweep.page_size, "kv_bytes_per_token": sweep.kv_bytes_per_token,
            "cost_model": asdict(cost), "runs": [o.as_dict() for o in outcomes]}
    if plot is not None:
        plot_sweep(outcomes, plot)
    if as_json:
        print(json.dumps(body))
    else:
        out = Console(width=None if sys.stdout.isatty() else 160)  # a file or pipe gets the whole table
        out.print(_table(outcomes, body))
        if plot is not None:
            out.print(f"plot: {plot}")
    return 0


def _config(point: Point, page: int, shape: dict[str, Any], storage_dir: str = "") -> Config:
    host = point.l2 if point.l2 is not None else point.l1 + page
    fields: dict[str, Any] = {"page_size": page, "device_slots": point.l1, "host_slots": host,
                              "host_tier": point.l2 is not None, "write_policy": point.write_policy,
                              "eviction_policy": point.eviction_policy, "prefetch_policy": point.prefetch_policy}
    if point.storage:
        fields.update(storage="file", storage_dir=storage_dir, model_id="hicache-simulate")
    return Config(**shape, **fields)


def _run_cores(trace: list[SimRequest], point: Point, page: int, cost: CostModel, bar: Any, label: str) -> Outcome:
    tiny = {"layers": 1, "kv_heads": 1, "head_dim": 1, "dtype": "float16"}  # no KV moves; the pools stay small
    cfg = _config(point, page, tiny, storage_dir="unused" if point.storage else "")
    sim = SimCores(cfg, point.l3 // page if point.l3 else None)
    served = [r for r in trace if 2 <= r.input_length <= cfg.device_slots]
    task = bar.add_task(label, total=len(served))
    t0, hits, ttfts = time.perf_counter(), [0, 0, 0], []
    looked = 0
    for n, r in enumerate(served):
        s = sim.serve(f"r{r.index}", Tokens.from_tensor(r.tokens()))
        looked += r.input_length
        hits[0] += s.device_hit
        hits[1] += s.host_hit - s.storage_hit
        hits[2] += s.storage_hit
        ttfts.append(cost.ttft_s(r.input_length - s.device_hit - s.host_hit, s.host_hit, s.storage_hit))
        if n % 256 == 255:
            bar.update(task, completed=n + 1)
    bar.update(task, completed=len(served))
    sim.check_invariants()
    return Outcome(point, len(served), len(trace) - len(served), looked, *hits,
                   round(_percentile(ttfts, 0.5), 4), round(_percentile(ttfts, 0.99), 4),
                   round(time.perf_counter() - t0, 2))


def _run_actors(trace: list[SimRequest], point: Point, page: int, cost: CostModel, bar: Any, label: str) -> Outcome:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hicache-simulate-l3-") as tmp:
        cfg = _config(point, page, KV_SHAPE, storage_dir=tmp)
        if point.storage and point.l3:
            stored = PageFormat(KVShape.of(cfg)).stored_bytes
            cfg = cfg.replace(storage_max_bytes=point.l3 // page * stored)
        served = [r for r in trace if r.input_length <= cfg.device_slots // 2]
        run: _Run = _serve(serve_requests(served), cfg, bar, label)  # type: ignore[arg-type]
    ttfts = [cost.ttft_s(*t) for t in run.ttfts]
    return Outcome(point, len(served), len(trace) - len(served), sum(r.input_length for r in served),
                   run.hits_l1, run.hits_l2, run.hits_l3, round(_percentile(ttfts, 0.5), 4),
                   round(_percentile(ttfts, 0.99), 4), round(time.perf_counter() - t0, 2))


def _table(outcomes: list[Outcome], body: dict[str, Any]) -> Table:
    c = body["cost_model"]
    t = Table(title=f"hicache simulate: {body['trace']} ({body['engine']}, page {body['page_size']})",
              caption=f"capacities in tokens; hit rates of the input tokens; TTFT modelled: recomputed tokens at "
                      f"{c['prefill_tokens_per_s']:,.0f} tokens/s, L2 hits at {c['l2_gbps']} GB/s, L3 hits at "
                      f"{c['l3_gbps']} GB/s then as L2, {c['kv_bytes_per_token']:,} KV bytes per token")
    for col in ("L1", "L2", "L3", "write", "eviction", "prefetch", "reqs", "hit L1", "hit L2", "hit L3", "hit",
                "TTFT p50", "TTFT p99"):
        t.add_column(col, justify="right")
    for o in outcomes:
        p, d = o.point, o.as_dict()
        l3 = "-" if not p.storage else (f"{p.l3:,}" if p.l3 else "unbounded")
        t.add_row(f"{p.l1:,}", f"{p.l2:,}" if p.l2 else "-", l3, p.write_policy, p.eviction_policy,
                  p.prefetch_policy, f"{o.requests:,}", f"{d['hit_rate_l1']:.1%}", f"{d['hit_rate_l2']:.1%}",
                  f"{d['hit_rate_l3']:.1%}", f"{d['hit_rate']:.1%}", f"{o.ttft_p50_s:.3f} s", f"{o.ttft_p99_s:.3f} s")
    return t
