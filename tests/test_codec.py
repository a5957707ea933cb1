"""The message codec: every registered message round-trips exactly, encodes to the bytes
msgpack's own packer writes, and may carry large `Indices` as blob references; bad bytes
fail loudly.

The round-trip property builds its Hypothesis strategies from each message
dataclass's field annotations, so a newly registered message is covered without
touching this file. An annotation the builder does not know fails the test: teach
`strategy_for` the new type (and the codec, if it needs to).
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import types
import typing
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.messages import (
    ENUM_TYPES,
    MESSAGE_TYPES,
    ActorName,
    AllocateHost,
    CodecError,
    HostSlotState,
    Indices,
    Tokens,
    InvariantsHeld,
    Message,
    SetHostState,
    SlotDemand,
    decode,
    encode,
    field_names,
)

INT_MIN = -(2**63)
INT_MAX = 2**64 - 1  # msgpack's integer range: int64 .. uint64

EXT_INDICES, EXT_ENUM, EXT_RECORD, EXT_TOKENS = 1, 2, 3, 4

ALL_MESSAGES = sorted(MESSAGE_TYPES.values(), key=lambda c: c.TYPE_CODE)
ALL_ENUMS = sorted(ENUM_TYPES.values(), key=lambda c: c.TYPE_CODE)


# -- strategies from annotations ----------------------------------------------


def hints(cls: type) -> dict[str, Any]:
    """Resolved field annotations of a message class (its module uses postponed annotations)."""
    resolved = typing.get_type_hints(cls)
    return {name: resolved[name] for name in field_names(cls)}


def _indices(cls: type[Indices] = Indices) -> st.SearchStrategy[Indices]:
    values = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40)
    return values.map(lambda v: cls(struct.pack(f"<{len(v)}q", *v)))


def strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    """A strategy for values of annotation `tp`; raises TypeError for an unknown one."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(INT_MIN, INT_MAX)
    if tp is float:
        return st.floats(allow_nan=False)  # NaN != NaN: a NaN field could never compare equal
    if tp is str:
        return st.text(max_size=20)
    if tp is bytes:
        return st.binary(max_size=40)
    if tp is type(None):
        return st.none()
    if tp in (Indices, Tokens):
        return _indices(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if ENUM_TYPES.get(getattr(tp, "TYPE_CODE", None)) is not tp:
            raise TypeError(f"enum {tp.__name__} is carried in a message but not declared with @wire_enum")
        return st.sampled_from(list(tp))
    if isinstance(tp, type) and issubclass(tp, Message):
        if MESSAGE_TYPES.get(getattr(tp, "TYPE_CODE", None)) is not tp:
            raise TypeError(f"record {tp.__name__} is carried in a message but not declared with @message")
        return st.builds(tp, **{name: strategy_for(h) for name, h in hints(tp).items()})
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for(args[0]), max_size=4).map(tuple)
        return st.tuples(*(strategy_for(a) for a in args))
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(strategy_for(a) for a in args))
    raise TypeError(f"no strategy for field annotation {tp!r}; teach strategy_for (and the codec) about it")


def assert_identical(got: Any, want: Any, path: str) -> None:
    """Equal, and of exactly the same types all the way down (an IntEnum is not an int)."""
    assert type(got) is type(want), f"{path}: decoded a {type(got).__name__}, encoded a {type(want).__name__}"
    if isinstance(want, Message):
        for name in field_names(type(want)):
            assert_identical(getattr(got, name), getattr(want, name), f"{path}.{name}")
    elif isinstance(want, tuple):
        assert len(got) == len(want), f"{path}: {len(got)} items decoded, {len(want)} encoded"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_identical(g, w, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: decoded {got!r}, encoded {want!r}"


# -- the round trip -----------------------------------------------------------


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_registered_message_round_trips_exactly(cls: type[Message], data: st.DataObject) -> None:
    msg = data.draw(strategy_for(cls), label=cls.__name__)
    got = decode(encode(msg))
    assert got == msg
    assert_identical(got, msg, cls.__name__)


def _msgpack_reference(msg: Message) -> bytes:
    """The codec's bytes as msgpack's own packer writes them (how `encode` was written before it
    was written out by hand): every registered message must come out the same."""

    def default(value: Any) -> Any:
        if type(value) is tuple:
            return list(value)
        if type(value) in (Indices, Tokens):
            return msgpack.ExtType(EXT_INDICES if type(value) is Indices else EXT_TOKENS, value.to_bytes())
        if isinstance(value, enum.Enum):
            return msgpack.ExtType(EXT_ENUM, msgpack.packb([type(value).TYPE_CODE, value.value]))
        if isinstance(value, Message):
            return msgpack.ExtType(EXT_RECORD, pack(value))
        raise TypeError(type(value).__name__)

    def pack(m: Message) -> bytes:
        fields = [m.TYPE_CODE, *(getattr(m, n) for n in field_names(type(m)))]  # type: ignore[attr-defined]
        return msgpack.packb(fields, default=default, use_bin_type=True, strict_types=True)

    return pack(msg)


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_registered_message_encodes_to_the_bytes_msgpack_packs(cls: type[Message], data: st.DataObject) -> None:
    msg = data.draw(strategy_for(cls), label=cls.__name__)
    assert encode(msg) == _msgpack_reference(msg)


@pytest.mark.parametrize("value", [
    0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, -1, -32, -33, -128, -129, -2**15, -2**15 - 1,
    -2**31, -2**31 - 1, -2**63,
])
def test_each_integer_takes_the_smallest_msgpack_form(value: int) -> None:
    msg = AllocateHost(op_id=value, tokens=0)
    assert encode(msg) == _msgpack_reference(msg)
    assert decode(encode(msg)) == msg


def test_strings_bytes_and_arrays_at_each_length_boundary_are_msgpacks_own() -> None:
    from hicache.messages import PrefetchesStarted

    for n in (0, 15, 16, 31, 32, 255, 256, 65535, 65536):
        for msg in (SlotDemand(request_id="x" * n, tokens=1), PrefetchesStarted(op_id=1, tokens=(7,) * n),
                    SetHostState(pages=Indices(bytes(8 * n)), state=HostSlotState.SYNCED)):
            assert encode(msg) == _msgpack_reference(msg), (type(msg).__name__, n)


class _Held:
    """A blob store for the encoder: payloads of at least 16 bytes are held and referred to."""

    def __init__(self) -> None:
        self.blobs: dict[int, bytes] = {}

    def refer(self, data: bytes) -> int | None:
        if len(data) < 16:
            return None
        for n, held in self.blobs.items():
            if held == data:
                return n
        self.blobs[len(self.blobs)] = data
        return len(self.blobs) - 1


def test_large_indices_and_tokens_travel_as_blob_references_and_come_back_exact() -> None:
    from hicache.messages import AdmitItem, AdmitRequests

    held = _Held()
    tokens = Tokens.from_range(100, 40)
    msg = AdmitRequests(op_id=3, items=(AdmitItem(request_id="a", namespace="", tokens=tokens),
                                        AdmitItem(request_id="b", namespace="n", tokens=Tokens.of([1]))))
    small = SetHostState(pages=Indices.of([1]), state=HostSlotState.SYNCED)
    data = encode(msg, held)
    assert len(data) < len(encode(msg)) and list(held.blobs.values()) == [tokens.to_bytes()]
    assert_identical(decode(data, held.blobs), msg, "AdmitRequests")
    assert encode(small, held) == encode(small)  # nothing to refer to
    again = SetHostState(pages=Indices(tokens.to_bytes()), state=HostSlotState.SYNCED)
    assert_identical(decode(encode(again, held), held.blobs), again, "SetHostState")  # an Indices, not Tokens
    assert len(held.blobs) == 1


def test_a_blob_reference_without_its_blob_raises_codec_error() -> None:
    held = _Held()
    data = encode(SetHostState(pages=Indices.from_range(0, 4), state=HostSlotState.SYNCED), held)
    with pytest.raises(CodecError, match=r"refers to blob 0, and no blobs were given"):
        decode(data)
    with pytest.raises(CodecError, match=r"refers to blob 0, which is not among the 1 given"):
        decode(data, {7: b""})


def test_every_field_annotation_has_a_strategy() -> None:
    for cls in ALL_MESSAGES:
        for tp in hints(cls).values():
            strategy_for(tp)  # raises TypeError, naming the annotation, when unknown


def test_every_wire_enum_is_carried_by_some_message() -> None:
    def enums_in(tp: Any) -> set[type]:
        found = {tp} if isinstance(tp, type) and issubclass(tp, enum.Enum) else set()
        for arg in typing.get_args(tp):
            found |= enums_in(arg)
        return found

    carried = {e for cls in ALL_MESSAGES for tp in hints(cls).values() for e in enums_in(tp)}
    unused = [e.__name__ for e in ALL_ENUMS if e not in carried]
    assert not unused, f"wire enums that no message field carries (dead codes, or a missing field): {unused}"


def test_an_int_enum_decodes_as_its_enum_not_as_a_plain_int() -> None:
    msg = SetHostState(pages=Indices.of([16, 17]), state=HostSlotState.WRITING)
    got = decode(encode(msg))
    assert type(got.state) is HostSlotState
    assert got.state is HostSlotState.WRITING


def test_nested_records_and_empty_values_round_trip() -> None:
    from hicache.messages import AllocateSlots, LoadsStarted, StartLoads

    for msg in (
        AllocateSlots(op_id=7, demands=(SlotDemand(request_id="a", tokens=3), SlotDemand(request_id="", tokens=0)),
                      allocs=(SlotDemand(request_id="c", tokens=2),), commits=(SlotDemand(request_id="b", tokens=1),),
                      evict=True),
        AllocateSlots(op_id=0, demands=(), allocs=(), commits=(), evict=False),
        LoadsStarted(batch=0, ops=()),
        StartLoads(),
        SetHostState(pages=Indices(), state=HostSlotState.RESERVED),
    ):
        assert_identical(decode(encode(msg)), msg, type(msg).__name__)


# -- the shape of every message class -----------------------------------------


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
def test_every_message_class_is_frozen_slotted_and_keyword_only(cls: type[Message]) -> None:
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    assert dataclasses.is_dataclass(cls), f"{cls.__name__} is not a dataclass"
    assert params.frozen, f"{cls.__name__} is not frozen"
    unslotted = [k.__name__ for k in cls.__mro__ if k is not object and "__slots__" not in k.__dict__]
    assert not unslotted, f"{cls.__name__} is not slotted all the way up: {unslotted} lack __slots__"
    positional = [f.name for f in dataclasses.fields(cls) if not f.kw_only]
    assert not positional, f"{cls.__name__} has positional fields {positional}"
    assert issubclass(cls, Message)
    assert MESSAGE_TYPES[cls.TYPE_CODE] is cls  # type: ignore[attr-defined]


def test_a_message_instance_refuses_assignment_and_new_attributes() -> None:
    msg = AllocateHost(op_id=1, tokens=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.op_id = 2  # type: ignore[misc]
    with pytest.raises((AttributeError, TypeError)):
        msg.extra = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        AllocateHost(1, 16)  # type: ignore[misc]


FORBIDDEN = (list, dict, set, frozenset, bytearray, torch.Tensor)


def _forbidden_in(tp: Any) -> list[str]:
    bad = []
    origin = typing.get_origin(tp) or tp
    if isinstance(origin, type) and issubclass(origin, FORBIDDEN):
        bad.append(repr(tp))
    for arg in typing.get_args(tp):
        bad += _forbidden_in(arg)
    return bad


def test_no_field_annotation_is_a_list_dict_set_or_tensor() -> None:
    found = {
        f"{cls.__name__}.{name}": bad
        for cls in ALL_MESSAGES
        for name, tp in hints(cls).items()
        if (bad := _forbidden_in(tp))
    }
    assert not found, f"message fields must be values (tuples, bytes, Indices), not: {found}"


def test_the_forbidden_annotation_check_catches_nested_containers() -> None:
    assert _forbidden_in(tuple[list[int], ...])
    assert _forbidden_in(dict[str, int])
    assert _forbidden_in(torch.Tensor)
    assert not _forbidden_in(tuple[SlotDemand, ...])


# -- what bad payloads raise ----------------------------------------------------


def packed(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def test_an_unknown_type_code_raises_codec_error_naming_it() -> None:
    with pytest.raises(CodecError, match=r"unknown message type code 65000"):
        decode(packed([65000, 1, 2]))


def test_every_truncation_of_a_payload_raises_codec_error() -> None:
    data = encode(SetHostState(pages=Indices.of(range(32)), state=HostSlotState.SYNCED))
    for cut in range(len(data)):
        with pytest.raises(CodecError, match=r"malformed payload \(\d+ bytes\)"):
            decode(data[:cut])


def test_a_payload_that_is_not_an_array_raises_codec_error_naming_its_type() -> None:
    with pytest.raises(CodecError, match=r"expected \[type_code, fields\.\.\.\], got dict"):
        decode(packed({"op_id": 1}))
    with pytest.raises(CodecError, match=r"expected \[type_code, fields\.\.\.\], got int"):
        decode(packed(201))
    with pytest.raises(CodecError, match=r"expected \[type_code, fields\.\.\.\], got an empty array"):
        decode(packed([]))
    with pytest.raises(CodecError, match=r"expected \[type_code, fields\.\.\.\], got type code 'x'"):
        decode(packed(["x", 1]))


def test_a_boolean_type_code_is_not_taken_for_an_integer() -> None:
    with pytest.raises(CodecError, match=r"got type code True"):
        decode(packed([True]))


def test_a_wrong_field_count_raises_codec_error_naming_the_message_and_its_fields() -> None:
    with pytest.raises(CodecError, match=r"malformed AllocateHost \(type code 201\): 1 values for 2 fields"):
        decode(packed([201, 5]))
    with pytest.raises(CodecError, match=r"malformed AllocateHost \(type code 201\): 3 values for 2 fields \('op_id', 'tokens'\)"):
        decode(packed([201, 5, 16, 0]))


def test_an_unknown_enum_value_raises_codec_error_naming_the_enum() -> None:
    bad_member = msgpack.ExtType(EXT_ENUM, packed([ActorName.TYPE_CODE, "nobody"]))  # type: ignore[attr-defined]
    with pytest.raises(CodecError, match=r"'nobody' is not a member of enum ActorName"):
        decode(packed([InvariantsHeld.TYPE_CODE, bad_member]))  # type: ignore[attr-defined]
    bad_enum = msgpack.ExtType(EXT_ENUM, packed([9999, "tree"]))
    with pytest.raises(CodecError, match=r"unknown enum type code 9999"):
        decode(packed([InvariantsHeld.TYPE_CODE, bad_enum]))  # type: ignore[attr-defined]


def test_garbage_bytes_raise_codec_error() -> None:
    with pytest.raises(CodecError, match=r"malformed payload \(1 bytes\): FormatError"):
        decode(b"\xc1")  # a byte msgpack never uses
    with pytest.raises(CodecError, match=r"malformed payload \(0 bytes\)"):
        decode(b"")
    with pytest.raises(CodecError, match=r"malformed payload \(\d+ bytes\): ExtraData"):
        decode(encode(AllocateHost(op_id=1, tokens=16)) + b"\x00")


def test_an_unknown_extension_type_raises_codec_error_naming_it() -> None:
    with pytest.raises(CodecError, match=r"unknown msgpack extension type 42"):
        decode(packed([InvariantsHeld.TYPE_CODE, msgpack.ExtType(42, b"")]))  # type: ignore[attr-defined]


def test_indices_bytes_that_are_not_whole_int64s_raise_codec_error() -> None:
    bad = msgpack.ExtType(EXT_INDICES, b"\x00" * 12)
    with pytest.raises(CodecError, match=r"multiple of 8"):
        decode(packed([SetHostState.TYPE_CODE, bad, msgpack.ExtType(EXT_ENUM, packed([200, 1]))]))  # type: ignore[attr-defined]


def test_records_nested_past_the_bound_raise_codec_error_instead_of_crashing() -> None:
    # A few hundred levels used to overflow the C stack of the unpacker (a segfault).
    payload = packed([InvariantsHeld.TYPE_CODE, "tree"])  # type: ignore[attr-defined]
    for _ in range(3000):
        payload = packed([InvariantsHeld.TYPE_CODE, msgpack.ExtType(EXT_RECORD, payload)])  # type: ignore[attr-defined]
    with pytest.raises(CodecError, match=r"records nested deeper than \d+ levels"):
        decode(payload)


def test_decode_refuses_a_value_that_is_not_bytes() -> None:
    with pytest.raises(CodecError, match=r"decode wants bytes, got str"):
        decode("[201, 1, 16]")  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=64))
def test_arbitrary_bytes_decode_to_a_message_or_raise_codec_error(data: bytes) -> None:
    try:
        got = decode(data)
    except CodecError:
        return
    assert isinstance(got, Message)


# -- what bad values raise when encoding ----------------------------------------


def test_encoding_an_unregistered_class_raises_codec_error() -> None:
    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Stray(Message):
        x: int

    with pytest.raises(CodecError, match=r"Stray is not a registered message"):
        encode(Stray(x=1))


def test_encoding_an_unsupported_field_value_raises_codec_error_naming_its_type() -> None:
    with pytest.raises(CodecError, match=r"cannot encode a value of type object"):
        encode(SlotDemand(request_id=object(), tokens=1))  # type: ignore[arg-type]

    class Loose(enum.Enum):
        A = "a"

    with pytest.raises(CodecError, match=r"enum Loose is not registered"):
        encode(InvariantsHeld(actor=Loose.A))  # type: ignore[arg-type]


def test_encoding_an_out_of_range_int_or_unencodable_text_raises_codec_error() -> None:
    with pytest.raises(CodecError, match=r"integer 18446744073709551616 is outside msgpack.s range"):
        encode(AllocateHost(op_id=2**64, tokens=16))
    with pytest.raises(CodecError, match=r"cannot encode SlotDemand.*surrogates"):
        encode(SlotDemand(request_id="\ud800", tokens=1))
