"""`Indices`: an immutable, hashable, zero-copy value of int64 slot indices."""

from __future__ import annotations

import copy
import ctypes
import pickle
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.messages import EMPTY, Indices, Tokens

int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)


def _address_of_bytes(data: bytes) -> int:
    """Where CPython keeps the payload of a bytes object (no copy is made)."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0


# -- construction -------------------------------------------------------------------


def test_of_keeps_values_and_order() -> None:
    idx = Indices.of([5, 3, 9, 0])
    assert idx.tolist() == [5, 3, 9, 0]
    assert len(idx) == 4


def test_of_an_empty_iterable_is_the_empty_value() -> None:
    assert Indices.of([]) == EMPTY
    assert len(EMPTY) == 0 and not EMPTY
    assert EMPTY.tolist() == []
    assert EMPTY.as_tensor().dtype == torch.int64 and EMPTY.as_tensor().shape == (0,)


def test_from_tensor_accepts_every_integer_dtype_and_stores_int64() -> None:
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        idx = Indices.from_tensor(torch.tensor([1, 2, 7], dtype=dtype))
        assert idx.tolist() == [1, 2, 7]
        assert idx.as_tensor().dtype == torch.int64
        assert len(idx.to_bytes()) == 3 * 8


@pytest.mark.parametrize("n", [1, 5, 1000])
def test_from_tensor_copies_so_later_writes_to_the_tensor_do_not_show(n: int) -> None:
    t = torch.arange(n)
    idx = Indices.from_tensor(t)
    t[0] = 99
    assert idx.tolist() == list(range(n))


@pytest.mark.parametrize("n", [0, 7, 3000])
def test_from_tensor_of_a_slice_reads_from_where_the_slice_starts(n: int) -> None:
    """A contiguous slice's memory starts past its storage's: the bytes are the slice's own."""
    base = torch.arange(n + 10)
    t = base[3 : 3 + n]
    assert t.is_contiguous() and t.storage_offset() == 3
    idx = Indices.from_tensor(t)
    assert idx.tolist() == list(range(3, 3 + n)) and len(idx) == n
    base[3:].fill_(-1)
    assert idx.tolist() == list(range(3, 3 + n))


@pytest.mark.parametrize("n", [10, 2000])
def test_from_tensor_reads_a_non_contiguous_tensor_in_logical_order(n: int) -> None:
    t = torch.arange(n)[::2]
    assert not t.is_contiguous()
    assert Indices.from_tensor(t).tolist() == list(range(0, n, 2))
    assert Indices.from_tensor(torch.arange(n).view(2, -1).t()[0]).tolist() == [0, n // 2]  # a column


def test_from_range_is_contiguous() -> None:
    assert Indices.from_range(7, 4).tolist() == [7, 8, 9, 10]
    assert Indices.from_range(7, 0) == EMPTY


def test_from_pages_lists_every_slot_of_each_page_in_page_order() -> None:
    assert Indices.from_pages([2, 0], 4).tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    assert Indices.from_pages(torch.tensor([3]), 1).tolist() == [3]


def test_concat_joins_parts_in_order() -> None:
    joined = Indices.concat([Indices.of([1]), EMPTY, Indices.of([2, 3])])
    assert joined.tolist() == [1, 2, 3]


def test_concat_of_one_non_empty_part_and_empty_ones_is_that_part_without_a_copy() -> None:
    big = Indices.of(range(1000))
    assert Indices.concat([EMPTY, big]) is big and Indices.concat([big, EMPTY, EMPTY]) is big
    assert Indices.concat([EMPTY, EMPTY]) == EMPTY and Indices.concat([]) == EMPTY
    tokens = Tokens.of([1, 2])  # a part of another class is joined into a value of this one
    assert type(Indices.concat([EMPTY, tokens])) is Indices and Indices.concat([EMPTY, tokens]).tolist() == [1, 2]


def test_values_are_little_endian_int64_bytes() -> None:
    assert Indices.of([1, -1]).to_bytes() == (1).to_bytes(8, "little") + (-1).to_bytes(8, "little", signed=True)


@given(st.lists(int64s, max_size=64))
def test_any_int64_values_round_trip_through_bytes(values: list[int]) -> None:
    idx = Indices.of(values)
    assert idx.tolist() == values
    assert Indices(idx.to_bytes()) == idx


# -- zero-copy reading --------------------------------------------------------------


def test_as_tensor_is_a_view_of_the_value_bytes_not_a_copy() -> None:
    idx = Indices.of(range(100))
    t = idx.as_tensor()
    assert t.data_ptr() == _address_of_bytes(idx.to_bytes())
    assert idx.as_tensor().data_ptr() == t.data_ptr()
    assert t.dtype == torch.int64 and t.device.type == "cpu"
    assert t.tolist() == list(range(100))


def test_indices_built_from_bytes_share_those_bytes() -> None:
    data = Indices.of([4, 5, 6]).to_bytes()
    idx = Indices(data)
    assert idx.to_bytes() is data
    assert idx.as_tensor().data_ptr() == _address_of_bytes(data)


# -- immutability -------------------------------------------------------------------


def test_attributes_cannot_be_set_or_deleted() -> None:
    idx = Indices.of([1, 2])
    with pytest.raises(AttributeError, match="immutable"):
        idx._data = b""  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        idx.extra = 1  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="immutable"):
        del idx._data
    assert idx.tolist() == [1, 2]


def test_an_indices_value_has_no_instance_dict() -> None:
    assert not hasattr(Indices.of([1]), "__dict__")


# -- slicing ------------------------------------------------------------------------


def test_slices_follow_python_slice_rules() -> None:
    idx = Indices.of(range(10))
    assert idx[2:5].tolist() == [2, 3, 4]
    assert idx[-3:].tolist() == [7, 8, 9]
    assert idx[:].tolist() == list(range(10))
    assert idx[5:2] == EMPTY
    assert idx[8:100].tolist() == [8, 9]


def test_a_slice_owns_its_bytes_and_keeps_no_view_of_the_parent() -> None:
    parent = Indices.of(range(1000))
    part = parent[10:12]
    assert len(part.to_bytes()) == 2 * 8
    lo = _address_of_bytes(parent.to_bytes())
    assert not lo <= part.as_tensor().data_ptr() < lo + len(parent.to_bytes())


def test_a_slice_keeping_most_of_a_large_value_is_a_view_of_its_bytes_and_equals_the_copy() -> None:
    parent = Tokens.of(range(2000))
    lo = _address_of_bytes(parent.to_bytes())
    view = parent[:-1]
    assert lo == view.as_tensor().data_ptr()  # no copy
    assert view.span() == (parent.to_bytes(), 0, 1999 * 8)
    assert type(view) is Tokens and view == Tokens.of(range(1999)) and hash(view) == hash(Tokens.of(range(1999)))
    assert view.tolist() == list(range(1999)) and view.to_tensor().tolist() == list(range(1999))
    assert type(view.to_bytes()) is bytes and view.to_bytes() == parent.to_bytes()[: 1999 * 8]
    assert pickle.loads(pickle.dumps(view)) == view and copy.deepcopy(view) == view
    inner = view[100:]  # a view of a view: still of the parent's bytes, at its place there
    assert inner.span() == (parent.to_bytes(), 800, 1999 * 8) and inner.tolist() == list(range(100, 1999))
    assert Indices.concat([Indices.of(range(1000))[:-1], Indices.of([7])]).tolist() == [*range(999), 7]
    small = view[:3]  # a small part of a view owns its bytes: it keeps nothing else alive
    assert type(small.span()[0]) is bytes and len(small.span()[0]) == 24 and small.tolist() == [0, 1, 2]
    assert parent[:] is parent


def test_views_compare_by_content_with_views_and_with_values_of_their_own_bytes() -> None:
    a, b = Indices.of(range(1000)), Indices.of([*range(999), 5])
    assert a[:-1] == b[:-1] and a[:-1] == Indices.of(range(999)) and Indices.of(range(999)) == b[:-1]
    assert a[1:] != b[1:] and a[1:] != Indices.of([*range(1, 999), 5]) and a[:-1] != a[1:]
    assert a[:-1] != a[:-2] and a[:-1] != Tokens(a[:-1].to_bytes())  # another length; another class


@settings(suppress_health_check=[HealthCheck.large_base_example])  # large values are the point
@given(st.binary(min_size=512 * 8, max_size=1100 * 8), st.integers(-1200, 1200), st.integers(-1200, 1200),
       st.integers(-1200, 1200), st.integers(-1200, 1200))
def test_slices_of_large_values_and_of_their_slices_agree_with_list_slicing(
    raw: bytes, a: int, b: int, c: int, d: int
) -> None:
    # 512 to 1100 int64 values of any bits, drawn as one byte string: a list of that many
    # integers drawn one by one is slow enough to fail hypothesis' health check on a busy machine.
    values = list(struct.unpack(f"<{len(raw) // 8}q", raw[: len(raw) // 8 * 8]))
    first = Indices.of(values)[a:b]
    assert first.tolist() == values[a:b]
    second = first[c:d]
    assert second.tolist() == values[a:b][c:d] and second == Indices.of(values[a:b][c:d])
    data, start, stop = second.span()
    assert data[start:stop] == second.to_bytes()


@given(st.lists(int64s, max_size=40), st.integers(-50, 50), st.integers(-50, 50))
def test_slicing_agrees_with_list_slicing(values: list[int], start: int, stop: int) -> None:
    assert Indices.of(values)[start:stop].tolist() == values[start:stop]


def test_steps_and_single_items_are_refused() -> None:
    idx = Indices.of(range(4))
    with pytest.raises(TypeError, match="contiguous slices only"):
        idx[::2]
    with pytest.raises(TypeError, match="contiguous slices only"):
        idx[0]  # type: ignore[call-overload]


# -- equality, hashing, pickling -------------------------------------------------------


def test_equal_values_are_equal_and_hash_alike() -> None:
    a = Indices.of([1, 2, 3])
    b = Indices.from_tensor(torch.tensor([1, 2, 3], dtype=torch.int32))
    assert a == b and hash(a) == hash(b)
    assert len({a, b, Indices.of([3, 2, 1])}) == 2


def test_indices_differ_from_other_types_and_other_values() -> None:
    a = Indices.of([1, 2, 3])
    assert a != Indices.of([1, 2])
    assert a != [1, 2, 3]
    assert a != a.to_bytes()


def test_pickle_and_copies_give_an_equal_value() -> None:
    a = Indices.of(range(20))
    for b in (pickle.loads(pickle.dumps(a)), copy.copy(a), copy.deepcopy(a)):
        assert b == a and b.tolist() == list(range(20))


def test_repr_shows_short_values_and_abbreviates_long_ones() -> None:
    assert repr(Indices.of([1, 2])) == "Indices([1, 2])"
    assert repr(Indices.of(range(100))) == "Indices([0, 1, 2, 3, ...] n=100)"


# -- bad input ----------------------------------------------------------------------


def test_raw_data_must_be_bytes() -> None:
    with pytest.raises(TypeError, match="wants bytes of int64, got bytearray"):
        Indices(bytearray(8))  # type: ignore[arg-type]


def test_raw_data_must_be_whole_int64s() -> None:
    with pytest.raises(ValueError, match="multiple of 8.*got 3 bytes"):
        Indices(b"123")


def test_a_tensor_of_more_than_one_dimension_is_refused() -> None:
    with pytest.raises(ValueError, match=r"1-D tensor, got shape \(2, 2\)"):
        Indices.from_tensor(torch.zeros(2, 2, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool])
def test_a_tensor_that_is_not_integer_is_refused(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="integer tensor"):
        Indices.from_tensor(torch.zeros(3, dtype=dtype))


def test_non_integer_values_are_refused_not_truncated() -> None:
    with pytest.raises(TypeError, match="float"):
        Indices.of([1, 2.5])  # type: ignore[list-item]


def test_values_outside_int64_are_refused() -> None:
    with pytest.raises((OverflowError, RuntimeError, ValueError)):
        Indices.of([2**63])


# -- lazy concatenation ------------------------------------------------------------------


def _big(first: int, n: int) -> Indices:
    return Indices.of(range(first, first + n))


def test_a_large_concat_is_an_equal_value_whose_slices_within_a_part_copy_nothing() -> None:
    prefix, new = _big(0, 600), _big(10_000, 3000)
    joined = Indices.concat([prefix, new])
    eager = Indices(prefix.to_bytes() + new.to_bytes())
    assert len(joined) == 3600 and joined
    # The new part back out of the joined value: the new part's own bytes, no copy.
    back = joined[600:3600]
    assert back.span()[0] is new.span()[0] and back == new
    assert joined[600:2200].span()[0] is new.span()[0]  # a view of most of it, by the slice rule
    assert joined[600:1000].span()[0] is not new.span()[0]  # a copy of a small part of it
    # Slices across the parts stay lazy and read right.
    assert joined[:3000] == eager[:3000] and joined[599:601].tolist() == [599, 10_000]
    assert joined == eager and eager == joined and hash(joined) == hash(eager)
    assert repr(joined) == repr(eager) == "Indices([0, 1, 2, 3, ...] n=3600)"
    assert joined.tolist() == eager.tolist() and joined.to_bytes() == eager.to_bytes()
    assert torch.equal(joined.as_tensor(), eager.as_tensor())
    # Once its bytes were read it is an ordinary value; its slices still agree.
    assert joined[600:3600] == new and joined[10:20].tolist() == list(range(10, 20))
    assert len(joined[10:20]) == 10 and len(joined[10:3000]) == 2990 and len(joined[10:3000][5:]) == 2985


def test_a_concat_of_lazy_values_flattens_and_small_or_token_concats_join_at_once() -> None:
    a, b, c = _big(0, 600), _big(1000, 600), _big(5000, 600)
    ab = Indices.concat([a, b])
    abc = Indices.concat([ab, EMPTY, c])
    assert abc[1200:1800].span()[0] is c.span()[0]  # the parts of both, in one flat list
    assert abc.tolist() == a.tolist() + b.tolist() + c.tolist()
    assert Indices.concat([EMPTY, ab]) is ab  # a lone part, lazy or not, as it is
    small = Indices.concat([Indices.of([1]), Indices.of([2])])
    assert type(small) is Indices and small.tolist() == [1, 2]
    small_tokens = Tokens.concat([Tokens.of([1]), Tokens.of([2])])
    assert type(small_tokens) is Tokens and small_tokens == Tokens.of([1, 2])


def test_a_large_token_concat_is_a_lazy_tokens_value() -> None:
    from hicache.messages import FinishItem, ReleaseReason, decode, encode

    a, b = Tokens.of(range(600)), Tokens.of(range(1000, 1600))
    joined = Tokens.concat([a, b])
    eager = Tokens(a.to_bytes() + b.to_bytes())
    assert isinstance(joined, Tokens) and len(joined) == 1200
    assert joined[:600].span()[0] is a.span()[0]  # a slice within a part: that part, no join
    assert type(joined[10:20]) is Tokens and type(joined[590:610]) is not Indices and joined[5:5] == Tokens()
    assert joined == eager and eager == joined and hash(joined) == hash(eager)
    assert joined != Indices(eager.to_bytes()) and Indices(eager.to_bytes()) != joined  # another kind
    assert repr(joined) == repr(eager) == "Tokens([0, 1, 2, 3, ...] n=1200)"
    for other in (pickle.loads(pickle.dumps(joined)), copy.copy(Tokens.concat([a, b]))):
        assert type(other) is Tokens and other == eager
    item = FinishItem(request_id="r", handle=1, tokens=Tokens.concat([a, b]), device=Indices.of([1]),
                      reason=ReleaseReason.FINISHED, allocs=0, commits=0)
    back = decode(encode(item))
    assert type(back.tokens) is Tokens and back == item


def test_head_span_reads_a_prefix_where_it_lies_without_joining() -> None:
    a, b = _big(0, 600), _big(5000, 600)
    joined = Indices.concat([a, b])
    data, start, stop = joined.head_span(500)
    assert data is a.span()[0] and (start, stop) == (0, 4000)
    big = _big(0, 2000)
    view = big[100:2000]  # a view of most of big's bytes
    assert view.head_span(10) == (big.span()[0], 800, 880)
    data, start, stop = joined.head_span(700)  # across the parts: the joined bytes
    assert data[start:stop] == joined.to_bytes()[:5600]


def test_view_then_is_a_view_and_a_tail_whatever_the_share_of_the_bytes() -> None:
    data = Tokens.of(range(10_000)).to_bytes()
    out = Tokens.view_then(data, 8 * 9000, 8 * 9600, Tokens.of([7, 8]).to_bytes())
    assert type(out) is not Tokens and isinstance(out, Tokens)  # lazy: nothing joined yet
    assert out.head_span(600) == (data, 8 * 9000, 8 * 9600)  # a tenth of `data`, still not copied
    assert out == Tokens.of([*range(9000, 9600), 7, 8])
    alone = Tokens.view_then(data, 0, 8 * 1000, b"")
    assert type(alone) is Tokens and alone.span() == (data, 0, 8000) and alone == Tokens.of(range(1000))
    small = Tokens.view_then(data, 8, 80, b"")  # a few ids: copied, keeping nothing alive
    assert type(small) is Tokens and small.span()[0] is not data and small == Tokens.of(range(1, 10))
    for lo, hi, tail in ((8, 4, b""), (3, 80, b""), (0, 8 * 10_001, b""), (0, 80, b"123")):
        with pytest.raises(ValueError, match="view_then needs"):
            Tokens.view_then(data, lo, hi, tail)
    with pytest.raises(ValueError, match="head_span of 1201 items of a value of 1200"):
        Tokens.concat([Tokens.of(range(600)), Tokens.of(range(600))]).head_span(1201)


@settings(max_examples=60)
@given(st.lists(st.integers(0, 700), min_size=2, max_size=5), st.integers(-3000, 3000), st.integers(-3000, 3000),
       st.integers(-3000, 3000), st.integers(-3000, 3000))
def test_slices_of_lazy_concats_agree_with_list_slicing(sizes: list[int], a: int, b: int, c: int, d: int) -> None:
    parts = [_big(1000 * i, n) for i, n in enumerate(sizes)]
    values = [v for p in parts for v in p.tolist()]
    joined = Indices.concat(parts)
    first = joined[a:b]
    assert len(first) == len(values[a:b]) and first.tolist() == values[a:b]
    assert first[c:d].tolist() == values[a:b][c:d] and first[c:d] == Indices.of(values[a:b][c:d])


def test_a_lazy_concat_pickles_copies_and_encodes_as_indices() -> None:
    from hicache.messages import FreeDeviceSlots, decode, encode

    joined = Indices.concat([_big(0, 600), _big(7000, 600)])
    for other in (pickle.loads(pickle.dumps(joined)), copy.copy(joined), copy.deepcopy(joined)):
        assert type(other) is Indices and other == joined
    message = FreeDeviceSlots(pages=Indices.concat([_big(0, 600), _big(7000, 600)]))
    back = decode(encode(message))
    assert type(back.pages) is Indices and back == message
