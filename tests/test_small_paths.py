"""The Python-int paths the cores take on a few pages do what the vectorised torch paths do.

Each property runs the same calls twice, once as shipped and once with `FEW_MAX`
at 0 (every call vectorised), and compares results, final states and error messages.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

import numpy
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hicache.actors._device_core as device_core_module
import hicache.actors._kv as kv_module
import hicache.actors._pages as pages_module
import hicache.runtime._facade_types as facade_types
from hicache.actors import DeviceCore, HostCore
from hicache.messages import HostSlotState, ReleaseReason
from hicache.runtime import Config

PURE_FIXTURE = [HealthCheck.function_scoped_fixture]
"""`make_config` is a pure function: reusing it across examples is safe."""


def _both(run: Callable[[], Any]) -> tuple[Any, Any]:
    """`run()` with the small paths, then with every call vectorised: what each returned or raised."""

    def outcome() -> Any:
        try:
            got = run()
        except (ValueError, RuntimeError) as err:
            return type(err).__name__, str(err)
        return got

    small = outcome()
    with pytest.MonkeyPatch.context() as mp:
        for module in (pages_module, device_core_module):  # each module that reads it
            mp.setattr(module, "FEW_MAX", 0)
        vectorised = outcome()
    return small, vectorised


@settings(max_examples=200, deadline=None)
@given(slots=st.lists(st.integers(-2, 40), max_size=16), page_size=st.sampled_from([1, 2, 4]))
def test_pages_of_agrees(slots: list[int], page_size: int) -> None:
    small, vectorised = _both(lambda: pages_module.pages_of(torch.tensor(slots, dtype=torch.int64), page_size,
                                                            "slots").tolist())
    assert small == vectorised


@settings(max_examples=200, deadline=None)
@given(pages=st.lists(st.integers(0, 40), max_size=24), page_size=st.sampled_from([1, 2, 4, 16]))
def test_slots_of_pages_agrees(pages: list[int], page_size: int) -> None:
    small, vectorised = _both(lambda: pages_module.slots_of_pages(torch.tensor(pages, dtype=torch.int64),
                                                                  page_size).tolist())
    assert small == vectorised


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), max_size=20))
def test_runs_agree(pairs: list[tuple[int, int]]) -> None:
    a = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
    b = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
    small, vectorised = _both(lambda: kv_module.runs(a, b))
    assert small == vectorised


_HOST_CALLS = st.lists(st.tuples(st.sampled_from(["allocate", "transition", "free"]), st.integers(0, 3),
                                 st.sampled_from(list(HostSlotState)), st.integers(0, 8)), max_size=25)


@settings(max_examples=150, deadline=None, suppress_health_check=PURE_FIXTURE)
@given(calls=_HOST_CALLS)
def test_host_moves_agree(make_config: Callable[..., Config], calls: list[tuple[str, int, HostSlotState, int]]) -> None:
    def run() -> Any:
        core = HostCore(make_config(page_size=4, device_pages=4, host_pages=8))
        held: list[torch.Tensor] = []  # pages, as allocations answered them
        trail = []
        for what, pick, state, n in calls:
            try:
                if what == "allocate":
                    got = core.allocate(4 * (n % 3))
                    if got is not None:
                        held.append(got)
                    trail.append(None if got is None else got.tolist())
                elif held:
                    pages = held[pick % len(held)][: 1 + n % 2]
                    if what == "transition":
                        core.transition(pages, state)
                    else:
                        core.free(pages)
                    trail.append(what)
            except (ValueError, RuntimeError) as err:
                trail.append(str(err))
        return trail, core.counts(), core.states(torch.arange(8)).tolist()

    small, vectorised = _both(run)
    assert small == vectorised


_DEVICE_CALLS = st.lists(st.tuples(st.sampled_from(["allocate", "commit", "swap", "release", "load", "adopt",
                                                    "free"]), st.integers(0, 2), st.integers(0, 9)), max_size=25)


@settings(max_examples=150, deadline=None, suppress_health_check=PURE_FIXTURE)
@given(calls=_DEVICE_CALLS)
def test_device_calls_agree(make_config: Callable[..., Config], calls: list[tuple[str, int, int]]) -> None:
    def run() -> Any:
        core = DeviceCore(make_config(page_size=4, device_pages=16))
        loads: list[torch.Tensor] = []  # pages of loads
        trail = []
        for what, r, n in calls:
            rid = f"r{r}"
            try:
                if what == "allocate":
                    got = core.allocate([(rid, n)])
                    trail.append(got if not isinstance(got, dict) else {k: v.tolist() for k, v in got.items()})
                elif what == "commit":
                    trail.append(core.commit(rid, n % 5))
                elif what == "swap":  # one page, adopted or freed
                    page = torch.tensor([n % 3])
                    trail.append(core.swap(rid, page[: n % 2], page[n % 2:]))
                elif what == "release":
                    trail.append(core.release(rid, torch.arange(n % 2), ReleaseReason.FINISHED))
                elif what == "load":
                    got = core.allocate_load(n)
                    if isinstance(got, torch.Tensor):
                        loads.append(got)
                    trail.append(got if not isinstance(got, torch.Tensor) else got.tolist())
                elif loads:
                    pages = loads[r % len(loads)]
                    (core.adopt_loaded if what == "adopt" else core.free_tree)(pages)
                    trail.append(what)
            except (ValueError, RuntimeError) as err:
                trail.append(f"{type(err).__name__}: {err}")
        return trail, core.counts(), core._owner.tolist()

    small, vectorised = _both(run)
    assert small == vectorised


_TOKEN_DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8]


def _token_tensor(ids: list[int], dtype: torch.dtype, layout: str) -> torch.Tensor:
    """`ids` as a tensor laid out plainly, as every other element of a larger one, or past an offset."""
    if layout == "strided":
        return torch.tensor([x for i in ids for x in (i, 7)], dtype=torch.int64).to(dtype)[::2]
    if layout == "offset":
        return torch.tensor([5, *ids], dtype=torch.int64).to(dtype)[1:]
    return torch.tensor(ids, dtype=torch.int64).to(dtype)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(-3, 120), max_size=90), dtype=st.sampled_from(_TOKEN_DTYPES),
       form=st.sampled_from(["list", "array", "plain", "strided", "offset"]))
def test_token_ids_are_checked_alike_in_python_and_in_arrays(ids: list[int], dtype: torch.dtype, form: str) -> None:
    """The facade's token check: a few ids in Python, many through numpy, a contiguous int64
    tensor's bytes and an `array("q")`'s read in place; the same bytes or the same error every way."""
    as_list = form in ("list", "array")
    tokens: Any = ids if form == "list" else array("q", ids) if form == "array" else _token_tensor(ids, dtype, form)

    def convert() -> Any:
        try:
            return facade_types.token_bytes(tokens, "tokens of request", "r")
        except facade_types.RequestError as err:
            return str(err)

    small = convert()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(facade_types, "_FEW_TOKENS", -1)
        mp.setattr(facade_types, "_FEW_TENSOR_TOKENS", -1)
        mp.setattr(facade_types, "_SIGN_BYTES_MAX", -1)  # every sign through numpy's minimum
        mp.setattr(facade_types, "_LITTLE_ENDIAN", False)  # every tensor through numpy's view and copy
        vectorised = convert()
    assert small == vectorised
    kept = ids if as_list else tokens.tolist()
    if min(kept, default=0) < 0:
        assert isinstance(small, str) and small.startswith("tokens of request 'r': token ids must be in 0..")
    else:
        assert small == array("q", kept).tobytes()


@settings(max_examples=200, deadline=None)
@given(n=st.sampled_from([1, 2, 7, 64, 2047, 2048, 2049, 5000]), data=st.data())
def test_the_sign_check_of_token_bytes_finds_a_negative_id_wherever_it_sits(n: int, data: st.DataObject) -> None:
    """A negative id's last byte has its top bit set, a non-negative one's never: the check of
    the high bytes (up to `_SIGN_BYTES_MAX` ids) and numpy's minimum agree, at the extremes too."""
    ids = numpy.full(n, data.draw(st.sampled_from([0, 1, 127, 128, 255, 2**55, 2**63 - 1])), dtype=numpy.int64)
    at = data.draw(st.integers(0, n - 1))
    bad = data.draw(st.sampled_from([None, -1, -128, -(2**55), -(2**63)]))
    if bad is not None:
        ids[at] = bad
    raw = ids.astype("<i8").tobytes()
    assert facade_types._negative(raw, n) is (bad is not None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(facade_types, "_SIGN_BYTES_MAX", -1)
        assert facade_types._negative(raw, n) is (bad is not None)
    if bad is not None:
        assert facade_types._lowest(raw, n) == bad


@pytest.mark.parametrize("token", [0, 7, 2**63 - 1, -1, 2**63, True, 1.0, "7", None, numpy.int64(9)])
def test_a_decode_steps_one_token_is_checked_as_any_list_of_tokens(token: Any) -> None:
    """One int token in a list takes a shortcut (no array); it must accept and refuse exactly
    what the general check does, with the same words."""
    def convert(tokens: Any) -> Any:
        try:
            return facade_types.token_bytes(tokens, "tokens committed for request", "r")
        except facade_types.RequestError as err:
            return str(err)

    general = convert([token, 0])  # two tokens: the general check
    one = convert([token])
    if isinstance(general, bytes):
        assert one == general[:8] == array("q", [int(token)]).tobytes()
    else:
        assert isinstance(one, str) and one == general


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 3), min_size=1, max_size=200), data=st.data())
def test_a_bool_among_many_token_ids_is_refused_wherever_it_sits(ids: list[int], data: st.DataObject) -> None:
    """A list packs in one pass, in which a bool passes for 0 or 1: the check looks at every
    id packed as 0 or 1, so a bool is refused at any place, among ints 0 and 1 too, and ints
    (numpy's too) are never taken for bools; one path for a few ids, another for many."""
    forms: list[Any] = [numpy.int64(i) if k % 3 == 0 else i for k, i in enumerate(ids)]
    assert facade_types.token_bytes(forms, "tokens of request", "r") == array("q", ids).tobytes()
    at = data.draw(st.integers(0, len(ids) - 1))
    flag = data.draw(st.booleans())
    forms[at] = flag
    for few in (64, -1):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(facade_types, "_FEW_TOKENS", few)
            with pytest.raises(facade_types.RequestError, match=rf"must be int token ids, got {flag} \(bool\)"):
                facade_types.token_bytes(forms, "tokens of request", "r")
            with pytest.raises(facade_types.RequestError, match=rf"must be int token ids, got {flag} \(bool\)"):
                facade_types.token_bytes(tuple(forms), "tokens of request", "r")


_NUMPY_TOKEN_DTYPES = [numpy.int64, numpy.int32, numpy.int16, numpy.int8, numpy.uint32, numpy.uint16, numpy.uint8,
                       numpy.dtype(">i8")]


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(-3, 120), max_size=90), dtype=st.sampled_from(_NUMPY_TOKEN_DTYPES),
       layout=st.sampled_from(["plain", "strided"]))
def test_a_numpy_array_of_token_ids_is_the_same_tokens_as_a_list(ids: list[int], dtype: Any, layout: str) -> None:
    """A 1-D integer numpy array (a tokenizer's `return_tensors="np"`, an engine's id buffer),
    of any byte order or stride, gives the list's bytes or the list's error about the sign."""
    kept = [i for i in ids if i >= 0] if numpy.dtype(dtype).kind == "u" else ids
    a = numpy.array([x for i in kept for x in (i, 7)], dtype=dtype)[::2] if layout == "strided" \
        else numpy.array(kept, dtype=dtype)

    def convert(tokens: Any) -> Any:
        try:
            return facade_types.token_bytes(tokens, "tokens of request", "r")
        except facade_types.RequestError as err:
            return str(err)

    assert convert(a) == convert(kept)
    if min(kept, default=0) >= 0:
        assert convert(a) == array("q", kept).tobytes()


@pytest.mark.parametrize(("value", "words"), [
    (numpy.array([1.0, 2.0]), r"must hold integer token ids, got an array of dtype float64 \(use numpy\.int64\)"),
    (numpy.array([True, False]), r"must hold integer token ids, got an array of dtype bool"),
    (numpy.array([1, 2], dtype=numpy.uint64), r"must hold integer token ids, got an array of dtype uint64"),
    (numpy.arange(6).reshape(2, 3), r"must be one sequence of token ids, got an array of shape \(2, 3\)"),
    (numpy.array(["7"]), r"must hold integer token ids, got an array of dtype <U1"),
    (numpy.array([1, 2], dtype=object), r"must hold integer token ids, got an array of dtype object"),
])
def test_a_numpy_array_that_cannot_hold_token_ids_is_refused_in_one_line(value: Any, words: str) -> None:
    with pytest.raises(facade_types.RequestError, match=r"^tokens of request 'r' " + words) as err:
        facade_types.token_bytes(value, "tokens of request", "r")
    assert "\n" not in str(err.value)
