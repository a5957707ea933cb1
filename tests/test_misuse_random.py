"""Seeded random calls of the facade and the KV API with malformed arguments, between
well-formed requests.

A seed picks a page size and whether there is a host tier, then makes 300 calls: each
takes two values from a pool of wrong types, out-of-range numbers, arrays and tensors of
every shape and dtype, iterators, ids of live and unknown requests, `Request`s with
malformed fields, and passes them to one of the calls a scheduler or an engine makes
(`admit`, `prefetch`, `ready`, `allocate` with `commit` and `flat`, `commit`, `finish`,
`abort`, `retract`, `cache_unfinished`, `allocated`, `slots`, `committed_tokens`,
`handle`, `quiesce`, `evict_device`, `evict_host`, `close`, and `DeviceKV`'s `write`,
`gather`, `index`, `page_table`, `k`), and `room`; half the seeds check K/V writes against the
slots live requests hold (`check_kv_writes`). Some combinations are valid, and run. What may
not happen: an exception other than `RequestError`, `KVArgumentError` or
`CacheStateError`; an error message of more than one line; a broken invariant after the
call; a well-formed request, served every 25 calls, that fails. A failure names its seed
and the call.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy
import pytest
import torch

from hicache.runtime import CacheStateError, Config, HiCache, KVArgumentError, Request, RequestError

pytestmark = pytest.mark.timeout(120)

STEPS = 300
REFUSALS = (RequestError, KVArgumentError, CacheStateError)


def _values(rid: str) -> list[Any]:
    """Arguments a caller might pass by mistake (`rid`: a live request's id)."""
    return [
        None, -1, 0, 1, 2**70, -(2**70), 1.5, -0.0, 1e300, float("nan"), float("inf"), True, "x", "", "\n",
        b"ab", bytearray(b"a"), [], (), {}, set(), [None], [-1], [1.5], ["a"], [2**64], [3], iter([1]), object(),
        {"a": -1}, {1: 2}, {"a": "b"}, {"a": 2**70}, {"a": None}, {rid: -1}, {rid: 2**70}, {rid: 1.5}, {rid: "3"},
        {rid: True}, {rid: [1.5]}, {rid: [-5]}, {rid: [2**63]}, {rid: "abc"}, {rid: None},
        {rid: torch.tensor([[1, 2]])}, {rid: torch.tensor([1.5])}, {rid: numpy.array([1], dtype=numpy.uint64)},
        {rid: numpy.array([[1], [2]])}, {rid: torch.tensor([1], dtype=torch.int8)}, {rid: torch.tensor(3)},
        torch.tensor([[1, 2]]), torch.tensor([1.5]), torch.tensor([-1]), torch.tensor([]), torch.tensor([0, 0]),
        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([10**9, 0]), torch.tensor([0, 1])[::2],
        torch.tensor([0, 1]).as_strided((2,), (0,)), torch.zeros(2, 1, 4), torch.zeros(2, 1, 4, dtype=torch.float16),
        torch.zeros(2, 1, 4, dtype=torch.float64), torch.zeros(1, 1, 4, dtype=torch.float16), torch.zeros(2, 4),
        torch.zeros(2, 1, 4, dtype=torch.float16).transpose(0, 2), numpy.array([1.0]),
        numpy.array([1], dtype=numpy.uint64), numpy.zeros((2, 1, 4), dtype=numpy.float16),
        [Request("zz", [1, 2])], [Request("zz", [-1])], [Request("zz", [])], [Request("", [1])],
        [Request("zz", "abc")], [Request("zz", [1.5])], [Request("zz", torch.tensor([[1]]))],  # type: ignore[arg-type]
        [Request("zz", [2**63])], [Request(5, [1])], [Request(rid, [1, 2])],  # type: ignore[arg-type]
        [Request("zz", [1, 2], namespace=5)], [Request(numpy.array([[1], [2]]), [1])],  # type: ignore[arg-type]
        Request("zz", [1]), ["zz"], [rid], [rid, rid], ["nobody"], [None], [object()], rid, "nobody",
    ]


def _brief(value: Any) -> str:
    return " ".join(repr(value).split())[:60]


def _kv_args(cache: HiCache) -> torch.Tensor:
    kv = cache.kv
    return torch.zeros(2, kv.kv_heads, kv.head_dim, dtype=kv.dtype)


ONE_ARGUMENT = ("admit", "prefetch", "ready", "allocate", "commit", "allocated", "slots", "committed_tokens", "handle",
                "finish", "abort", "retract", "cache_unfinished", "quiesce", "evict_device", "evict_host")
"""The facade's calls that take one argument: each gets the first value."""

CALLS: dict[str, Callable[[HiCache, Any, Any, random.Random], Any]] = {
    **{name: (lambda c, x, y, r, name=name: getattr(c, name)(x)) for name in ONE_ARGUMENT},
    "allocate(commit=)": lambda c, x, y, r: c.allocate(x, commit=y),
    "allocate(flat=)": lambda c, x, y, r: c.allocate(x, flat=y),
    "close": lambda c, x, y, r: c.close(drain=x, timeout_s=y) if r.random() < 0.5 else c.close(timeout_s=x),
    "kv.write(layer, slots)": lambda c, x, y, r: c.kv.write(x, y, _kv_args(c), _kv_args(c)),
    "kv.write(k, v)": lambda c, x, y, r: c.kv.write(0, torch.tensor([0, 1]), x, y),
    "kv.write(slots, k)": lambda c, x, y, r: c.kv.write(0, x, _kv_args(c) if r.random() < 0.5 else y, _kv_args(c)),
    "kv.gather": lambda c, x, y, r: c.kv.gather(x, y),
    "kv.index": lambda c, x, y, r: c.kv.index(x, distinct=y),
    "kv.page_table": lambda c, x, y, r: c.kv.page_table(x),
    "kv.k": lambda c, x, y, r: c.kv.k(x),
    "room": lambda c, x, y, r: c.room(),
}


def _serve_one(cache: HiCache, rid: str) -> None:
    """A well-formed request, start to finish: the calls before it poisoned nothing."""
    [adm] = cache.admit([Request(rid, list(range(1, 10)))])
    cache.start_loads().wait_all()
    got = cache.allocate({rid: 10 - adm.cached_tokens})
    assert isinstance(got, dict), f"{rid}: {got}"
    cache.commit({rid: list(range(1, 11))[adm.cached_tokens:]})
    cache.finish([adm.handle])


@pytest.mark.parametrize("seed", range(6))
def test_random_malformed_calls_are_one_line_refusals_and_poison_nothing(seed: int) -> None:
    rng = random.Random(seed)
    p = rng.choice([1, 4, 16])
    config = Config(layers=1, kv_heads=1, head_dim=4, page_size=p, device_slots=p * 16, host_slots=p * 64,
                    host_tier=rng.random() < 0.7, check_kv_writes=seed % 2 == 1)
    refused = 0
    with HiCache(config) as cache:
        for step in range(STEPS):
            live = list(cache.live_requests)
            if rng.random() < 0.2 or not live:  # a request the malformed calls may name
                rid = f"r{step}"
                ids = [rng.randrange(1, 5) for _ in range(rng.randrange(1, 3 * p + 2))]
                cache.admit([Request(rid, ids)])
                cache.start_loads().wait_all()
                live.append(rid)
            values = _values(rng.choice(live))
            name = rng.choice(sorted(CALLS))
            x, y = rng.choice(values), rng.choice(values)
            where = f"seed {seed} step {step}: {name}({_brief(x)}, {_brief(y)})"
            try:
                CALLS[name](cache, x, y, rng)
            except REFUSALS as e:
                refused += 1
                assert "\n" not in str(e), f"{where}: a multi-line error: {e!r}"
            except Exception as e:  # noqa: BLE001 - the test names it
                pytest.fail(f"{where} raised {type(e).__name__}: {e}")
            if not cache.system.started:  # a close that took its arguments
                cache.start()
            cache.check_invariants()
            if step % 25 == 0:
                _serve_one(cache, f"ok{step}")
        for rid in cache.live_requests:
            cache.abort([cache.handle(rid)])
        cache.quiesce()
        cache.check_invariants()
    assert refused > STEPS // 2, f"seed {seed}: only {refused} of {STEPS} calls were refused: the values are too tame"
