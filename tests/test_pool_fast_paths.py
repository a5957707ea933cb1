"""Both forms of `Ints` give the same results, on the calls the pool actors make.

The pools keep a call's page (or slot) numbers as Python ints when they are few and as a
tensor when there are many (`FEW_MAX`, in `_pages`). Each property here runs one
random sequence of calls four times: as shipped, with a limit low enough that sizes fall on both
sides of it (so that one call may mix the forms), with every call in Python ints, and with every
call vectorised.
What each call returned or raised, and the final owner or state tables, must be equal.
Pages go in as `Indices`, as the actors pass them, or as tensors, as the other callers do
(tests/test_small_paths.py does the same on a few pages, with tensors only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hicache.actors._device_core as device_core_module
import hicache.actors._pages as pages_module
from hicache.actors import DeviceCore, HostCore
import numpy

from hicache.actors._pages import FEW_MAX, PageTable, as_list, as_pages, indices_of, ints
from hicache.messages import HostSlotState, Indices, ReleaseReason
from hicache.runtime import Config

PURE_FIXTURE = [HealthCheck.function_scoped_fixture]
"""`make_config` is a pure function: reusing it across examples is safe."""

FORMS = {"shipped": None, "mixed": 16, "ints": 1 << 30, "tensors": 0}
"""`FEW_MAX` for each run: as shipped, low enough that calls fall on both sides of it, every call
in Python ints, every call vectorised."""


def _in_every_form(run: Callable[[], Any]) -> dict[str, Any]:
    """What `run()` returned, run once per form."""
    got = {}
    for form, limit in FORMS.items():
        with pytest.MonkeyPatch.context() as mp:
            if limit is not None:
                for module in (pages_module, device_core_module):
                    mp.setattr(module, "FEW_MAX", limit)
            got[form] = run()
    return got


def _outcome(call: Callable[[], Any]) -> Any:
    """What `call()` returned, or the type and text of what it raised."""
    try:
        return call()
    except (ValueError, RuntimeError, AssertionError) as err:
        return f"{type(err).__name__}: {err}"


def _played(calls: list[Any], step: Callable[..., Any], check: Callable[[], Any]) -> list[Any]:
    """Each call's outcome (`step(*call)`), each followed by the invariant check's."""
    trail = []
    for call in calls:
        trail.append(_outcome(lambda call=call: step(*call)))
        trail.append(_outcome(check))
    return trail


# -- the conversions ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(-(2**40), 2**40), max_size=2 * FEW_MAX))
def test_indices_and_python_ints_convert_both_ways_as_tensors_and_arrays_do(values: list[int]) -> None:
    tensor = torch.tensor(values, dtype=torch.int64)
    idx = Indices.from_tensor(tensor)
    assert indices_of(values) == idx == indices_of(tensor) == indices_of(numpy.array(values, dtype=numpy.int64))
    assert idx.tolist() == values == idx.as_tensor().tolist()
    for given_as in (idx, tensor):
        got = ints(given_as)
        assert isinstance(got, list) == (len(values) <= FEW_MAX)
        assert as_list(got) == values
    for given_as in (idx, tensor, values, numpy.array(values, dtype=numpy.int64)):
        got = as_pages(given_as)
        assert isinstance(got, list) == (len(values) <= FEW_MAX)
        assert as_list(got) == values


@settings(max_examples=300, deadline=None)
@given(table=st.lists(st.integers(0, 3), min_size=1, max_size=12), at=st.lists(st.integers(-3, 14), max_size=8),
       allowed=st.frozensets(st.integers(0, 3)), value=st.integers(0, 3), typecode=st.sampled_from(["B", "i", "q"]),
       runs=st.sampled_from([(), (0, 2), range(4)]), warm=st.integers(0, 3))
def test_a_page_table_takes_distinct_pages_in_range_with_allowed_values_in_either_form(
    table: list[int], at: list[int], allowed: frozenset[int], value: int, typecode: str, runs: Any,
    warm: int
) -> None:
    """In either form, and whether a value's "all equal" test is a comparison of bytes with
    a run of it (`runs`; a run shorter or longer than the call: `warm` earlier calls) or numpy's."""
    pt = PageTable(len(table), typecode, runs=runs)
    for k in range(warm):  # grow the runs (and the marks) past, or not up to, this call's length
        pt.view[:] = 0
        assert pt.fits(numpy.arange(min(len(table), 4 * k + 1), dtype=numpy.int64), frozenset({0}))
    pt.view[:] = table
    expected = (len(set(at)) == len(at) and all(0 <= i < len(table) for i in at)
                and all(table[i] in allowed for i in at))
    assert pt.fits(at, allowed) is expected
    assert pt.fits(numpy.array(at, dtype=numpy.int64), allowed) is expected
    if expected and at:
        pt.put(at[:1], value)
        pt.put(numpy.array(at[1:], dtype=numpy.int64), value)
        assert [pt.items[i] for i in at] == [value] * len(at)
        assert pt.view.tolist() == pt.tensor.tolist() == list(pt.items)
    after = [value if expected and i in at else v for i, v in enumerate(table)]
    for form in (list, lambda xs: numpy.array(xs, dtype=numpy.int64)):
        pt.view[:] = table
        assert pt.move(form(at), allowed, value) is expected  # the check and the write: all or nothing
        assert pt.view.tolist() == after


@pytest.mark.parametrize("first, second", [(0, 1), (0, 299), (150, 151), (298, 299)])
@pytest.mark.parametrize("typecode", ["B", "i", "q"])
def test_a_page_table_refuses_an_array_naming_a_page_twice_wherever_the_two_are(
        first: int, second: int, typecode: str) -> None:
    pt = PageTable(1000, typecode, runs=range(4))
    pt.view[:] = 2
    at = numpy.arange(100, 400, dtype=numpy.int64)
    at[second] = at[first]
    assert pt.fits(at, frozenset({2})) is False
    assert pt.move(at, frozenset({2}), 0) is False
    assert set(pt.view.tolist()) == {2}  # nothing written
    assert pt.move(numpy.arange(100, 400, dtype=numpy.int64), frozenset({2}), 0) is True


# -- the device pool -----------------------------------------------------------------------

_DEVICE_CALLS = st.lists(
    st.tuples(st.sampled_from(["allocate", "allocate2", "commit", "swap", "release", "load", "adopt", "free",
                               "free_request_pages"]),
              st.integers(0, 2), st.integers(0, 90), st.integers(0, 3)),
    max_size=30,
)


@settings(max_examples=120, deadline=None, suppress_health_check=PURE_FIXTURE)
@given(page_size=st.sampled_from([1, 2, 4]), calls=_DEVICE_CALLS)
def test_device_calls_agree_in_every_form(
    make_config: Callable[..., Config], page_size: int, calls: list[tuple[str, int, int, int]]
) -> None:
    pages = 160 // page_size

    def run() -> Any:
        core = DeviceCore(make_config(page_size=page_size, device_pages=pages, host_pages=2 * pages))
        p = page_size
        mine: dict[str, list[int]] = {}  # each live request's pages not yet handed over, in token order
        loads: list[list[int]] = []
        tree: list[list[int]] = []

        def given_as(values: list[int], k: int) -> Indices | torch.Tensor:
            """`values` as the actors pass pages (`Indices`, odd `k`) or as the other callers do."""
            tensor = torch.tensor(values, dtype=torch.int64)
            return Indices.from_tensor(tensor) if k % 2 else tensor

        def new_pages(key: str, slots: list[int]) -> list[int]:
            """The pages `allocate` newly gave a request, from the slots it answered (the rest of
            the request's last page first, then its new pages' slots)."""
            return [pg for pg in dict.fromkeys(s // p for s in slots) if pg not in mine.get(key, ())]

        def step(what: str, r: int, n: int, k: int) -> Any:
            rid = f"r{r}"
            if what in ("allocate", "allocate2"):
                demands = [(rid, n)] if what == "allocate" else [(rid, n % 7), (f"r{(r + 1) % 3}", n)]
                got = core.allocate_pages(demands) if k % 2 else core.allocate(demands)
                if isinstance(got, dict):
                    got = {key: v.tolist() for key, v in got.items()}
                    for key, v in got.items():
                        mine.setdefault(key, []).extend(v if k % 2 else new_pages(key, v))
                return got
            if what == "commit":
                return core.commit_many([(rid, n % 20)])
            if what == "swap":
                held = mine.get(rid, [])
                a, b = k % 2, k // 2
                view = core.swap(rid, given_as(held[:a], k), given_as(held[a : a + b], k + 1))
                tree.append(held[:a])
                mine[rid] = held[a + b :]
                return view
            if what == "release":
                held = mine.get(rid, [])
                adopt = held[: n % 4]
                view = core.release(rid, given_as(adopt, k),
                                    ReleaseReason.FINISHED if k < 3 else ReleaseReason.RETRACTED)
                tree.append(adopt)
                mine.pop(rid, None)
                return view
            if what == "load":
                got = core.allocate_load_pages(n) if k % 2 else core.allocate_load(n)
                if not isinstance(got, device_core_module.Insufficient):
                    got = got.tolist()
                    loads.append(got)
                return got
            if what == "adopt" and loads:
                got = loads.pop(n % len(loads))
                core.adopt_loaded(given_as(got, k))
                tree.append(got)
                return what
            if what == "free" and (tree or loads):
                owned = tree if tree and (k % 2 or not loads) else loads
                core.free_tree(given_as(owned.pop(n % len(owned)), k))
                return what
            if what == "free_request_pages" and mine.get(rid):  # misuse: the request owns them
                core.free_tree(given_as(mine[rid][: 1 + k], k))
            return None

        trail = _played(calls, step, core.check_invariants)
        return trail, core.counts(), core._owner.tolist(), core._pool.free_page_set().tolist()

    got = _in_every_form(run)
    assert got["ints"] == got["shipped"] == got["tensors"]


# -- the host pool -------------------------------------------------------------------------

_HOST_CALLS = st.lists(
    st.tuples(st.sampled_from(["allocate", "transition", "transition", "free", "free_twice"]),
              st.integers(0, 5), st.sampled_from(list(HostSlotState)), st.integers(0, 80)),
    max_size=30,
)


@settings(max_examples=120, deadline=None, suppress_health_check=PURE_FIXTURE)
@given(page_size=st.sampled_from([1, 4]), calls=_HOST_CALLS)
def test_host_calls_agree_in_every_form(
    make_config: Callable[..., Config], page_size: int, calls: list[tuple[str, int, HostSlotState, int]]
) -> None:
    pages = 160  # allocations of up to 80 pages: on both sides of `FEW_MAX` in the mixed form

    def run() -> Any:
        core = HostCore(make_config(page_size=page_size, device_pages=pages // 2, host_pages=pages))
        held: list[list[int]] = []
        freed: list[list[int]] = []

        def step(what: str, pick: int, state: HostSlotState, n: int) -> Any:
            as_indices = n % 2 == 1
            if what == "allocate":
                got = core.allocate_pages(n * page_size) if as_indices else core.allocate(n * page_size)
                if got is not None:
                    held.append(got.tolist())
                    return held[-1]
                return got
            if what == "free_twice" and freed:  # misuse: a double free
                what, some = "free", freed[pick % len(freed)]
            elif held:
                some = held[pick % len(held)]
                some = some[: len(some) - n % 2] if what == "transition" else some
            else:
                return None
            given_as = indices_of(some) if as_indices else torch.tensor(some, dtype=torch.int64)
            if what == "transition":
                core.transition(given_as, state)
            else:
                core.free(given_as)
                freed.append(some)
                if some in held:
                    held.remove(some)
            return what

        trail = _played(calls, step, core.check_invariants)
        return trail, core.counts(), core._state.tolist(), core._pool.free_page_set().tolist()

    got = _in_every_form(run)
    assert got["ints"] == got["shipped"] == got["tensors"]
