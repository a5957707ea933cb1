"""msgpack codec for registered messages.

Wire format: a message is the msgpack array `[type_code, field_1, ..., field_n]`
in declaration order (positional: no field names on the wire). Values that are
not plain msgpack travel as extension types:

| ext | value                      | payload                              |
|-----|----------------------------|--------------------------------------|
| 1   | `Indices`                  | the int64 bytes as they are          |
| 2   | a registered enum member   | msgpack `[enum_code, member.value]`  |
| 3   | a nested registered record | msgpack `[type_code, fields...]`     |
| 4   | `Tokens`                   | the int64 bytes as they are          |
| 5   | `Indices` held elsewhere   | msgpack int: the number of a blob    |
| 6   | `Tokens` held elsewhere    | msgpack int: the number of a blob    |

Extensions 5 and 6 appear only where the encoder was given a `BlobRefs` (the
delivery log: a large `Indices` repeated from message to message is written once,
as a blob, and referred to after); `decode` then needs the blobs.

Arrays decode as tuples, so every message round-trips to an equal value.
Exact types decide the encoding, as with msgpack's `strict_types`: an `int` or
`str` subclass (an `IntEnum` such as `HostSlotState`) travels as its enum, not as
a plain int that would decode as the wrong type.

Encoding is written here in Python rather than left to `msgpack.packb` with a
`default` hook: that hook runs for every tuple, enum, record and `Indices` (the
most of a message), and packs each nested record with a packer of its own, which
made encoding most of the cost of logging a delivery. The bytes are msgpack's,
the smallest form of each value as msgpack's own packer writes it (a test
compares the two on every registered message). Decoding is msgpack's.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

import msgpack

from ._index import Indices, Tokens, _Joined, _JoinedTokens
from ._registry import ENUM_TYPES, MESSAGE_TYPES, Message, field_names

_EXT_INDICES: Final = 1
_EXT_ENUM: Final = 2
_EXT_RECORD: Final = 3
_EXT_TOKENS: Final = 4
_EXT_INDICES_BLOB: Final = 5
_EXT_TOKENS_BLOB: Final = 6

_RECORD_DEPTH_MAX: Final = 8
"""Most levels of records nested in records a payload may hold. Real messages nest
two deep; a crafted payload nested a few hundred deep would overflow the C stack
of the msgpack unpacker (a segfault, not an exception), so decoding stops here."""


class CodecError(ValueError):
    """A payload could not be decoded (or a value could not be encoded)."""


class BlobRefs(Protocol):
    """Where the encoder may put the bytes of an `Indices` instead of inlining them."""

    def refer(self, data: bytes) -> int | None:
        """The number of the blob that holds `data` (stored now if new), or None to inline it."""


# -- encoding: each value appends its msgpack bytes to a list of parts ------------------------

_Parts = list[bytes]
_Put = Callable[[Any, _Parts, "BlobRefs | None"], None]

_INT_FIX: Final = [(i % 256).to_bytes(1, "big") for i in range(-32, 128)]
"""msgpack's one-byte ints, -32 .. 127, at index `value + 32`."""
_F64 = struct.Struct(">Bd").pack
_U8 = struct.Struct(">BB").pack
_U16 = struct.Struct(">BH").pack
_U32 = struct.Struct(">BI").pack
_U64 = struct.Struct(">BQ").pack
_I8 = struct.Struct(">Bb").pack
_I16 = struct.Struct(">Bh").pack
_I32 = struct.Struct(">Bi").pack
_I64 = struct.Struct(">Bq").pack
_FIXEXT: Final = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}


def _int(v: int) -> bytes:
    if -32 <= v < 128:
        return _INT_FIX[v + 32]
    if v >= 0:
        if v < 1 << 8:
            return _U8(0xCC, v)
        if v < 1 << 16:
            return _U16(0xCD, v)
        if v < 1 << 32:
            return _U32(0xCE, v)
        if v < 1 << 64:
            return _U64(0xCF, v)
    elif v >= -(1 << 7):
        return _I8(0xD0, v)
    elif v >= -(1 << 15):
        return _I16(0xD1, v)
    elif v >= -(1 << 31):
        return _I32(0xD2, v)
    elif v >= -(1 << 63):
        return _I64(0xD3, v)
    raise CodecError(f"integer {v} is outside msgpack's range -2**63 .. 2**64-1")


def _sized(n: int, fix: int, fix_max: int, small: int | None, mid: int, big: int) -> bytes:
    """The header of a str, bin or array of `n` items (`small`: the 8-bit length form, if any)."""
    if n < fix_max:
        return (fix | n).to_bytes(1, "big")
    if small is not None and n < 1 << 8:
        return _U8(small, n)
    if n < 1 << 16:
        return _U16(mid, n)
    if n < 1 << 32:
        return _U32(big, n)
    raise CodecError(f"a value of {n} items or bytes is over msgpack's bound of 2**32 - 1")


def _array_header(n: int) -> bytes:
    return _sized(n, 0x90, 16, None, 0xDC, 0xDD)


def _ext_header(code: int, n: int) -> bytes:
    fixed = _FIXEXT.get(n)
    if fixed is not None:
        return bytes((fixed, code))
    if n < 1 << 8:
        return bytes((0xC7, n, code))
    if n < 1 << 16:
        return _U16(0xC8, n) + bytes((code,))
    if n < 1 << 32:
        return _U32(0xC9, n) + bytes((code,))
    raise CodecError(f"an extension value of {n} bytes is over msgpack's bound of 2**32 - 1")


def _put_int(v: int, out: _Parts, refs: BlobRefs | None) -> None:
    out.append(_int(v))


def _put_bool(v: bool, out: _Parts, refs: BlobRefs | None) -> None:
    out.append(b"\xc3" if v else b"\xc2")


def _put_none(v: None, out: _Parts, refs: BlobRefs | None) -> None:
    out.append(b"\xc0")


def _put_float(v: float, out: _Parts, refs: BlobRefs | None) -> None:
    out.append(_F64(0xCB, v))


def _put_str(v: str, out: _Parts, refs: BlobRefs | None) -> None:
    data = v.encode("utf-8")
    out.append(_sized(len(data), 0xA0, 32, 0xD9, 0xDA, 0xDB))
    out.append(data)


def _put_bin(v: bytes | bytearray | memoryview, out: _Parts, refs: BlobRefs | None) -> None:
    data = bytes(v)
    out.append(_sized(len(data), 0, 0, 0xC4, 0xC5, 0xC6))
    out.append(data)


def _put_array(v: tuple[Any, ...] | list[Any], out: _Parts, refs: BlobRefs | None) -> None:
    out.append(_array_header(len(v)))
    for item in v:
        _PUT.get(type(item), _put_other)(item, out, refs)


def _put_map(v: dict[Any, Any], out: _Parts, refs: BlobRefs | None) -> None:
    out.append(_sized(len(v), 0x80, 16, None, 0xDE, 0xDF))
    for key, item in v.items():
        _PUT.get(type(key), _put_other)(key, out, refs)
        _PUT.get(type(item), _put_other)(item, out, refs)


def _indices_put(inline_ext: int, blob_ext: int) -> _Put:
    """The encoder of `Indices` (or `Tokens`): its bytes under `inline_ext`, or, when the blob
    store takes them, the number of their blob under `blob_ext`."""

    def put(v: Indices, out: _Parts, refs: BlobRefs | None) -> None:
        data = v.to_bytes()
        ref = refs.refer(data) if refs is not None else None
        if ref is None:
            out.append(_ext_header(inline_ext, len(data)))
            out.append(data)
        else:
            number = _int(ref)
            out.append(_ext_header(blob_ext, len(number)))
            out.append(number)

    return put


_ENUM_EXT: dict[enum.Enum, bytes] = {}
"""Per enum member: its whole extension value (a member travels as the same bytes every time)."""


def _put_enum(v: enum.Enum, out: _Parts, refs: BlobRefs | None) -> None:
    ext = _ENUM_EXT.get(v)
    if ext is None:
        inner: _Parts = [_array_header(2), _int(type(v).TYPE_CODE)]  # type: ignore[attr-defined]
        _PUT.get(type(v.value), _put_other)(v.value, inner, None)
        payload = b"".join(inner)
        ext = _ENUM_EXT[v] = _ext_header(_EXT_ENUM, len(payload)) + payload
    out.append(ext)


def _put_record(v: Message, out: _Parts, refs: BlobRefs | None) -> None:
    inner: _Parts = []
    _ENCODERS[type(v)](v, inner, refs)
    payload = b"".join(inner)
    out.append(_ext_header(_EXT_RECORD, len(payload)))
    out.append(payload)


def _put_other(v: Any, out: _Parts, refs: BlobRefs | None) -> None:
    """A value of a type not (yet) in `_PUT`: a registered enum or record is encoded and its
    type added to `_PUT`; anything else is an error."""
    cls = type(v)
    if isinstance(v, enum.Enum):
        code = getattr(cls, "TYPE_CODE", None)
        if code is None or ENUM_TYPES.get(code) is not cls:
            raise CodecError(f"enum {cls.__name__} is not registered; declare it with @wire_enum(code)")
        _PUT[cls] = _put_enum
    elif isinstance(v, Message):
        _encoder_for(cls)
        _PUT[cls] = _put_record
    else:
        raise CodecError(
            f"cannot encode a value of type {cls.__name__}; messages carry ints, "
            "floats, str, bytes, bools, None, tuples, Indices, registered enums and records"
        )
    _PUT[cls](v, out, refs)


_PUT: dict[type, _Put] = {
    int: _put_int,
    bool: _put_bool,
    type(None): _put_none,
    float: _put_float,
    str: _put_str,
    bytes: _put_bin,
    bytearray: _put_bin,
    memoryview: _put_bin,
    tuple: _put_array,
    list: _put_array,
    dict: _put_map,
    Indices: _indices_put(_EXT_INDICES, _EXT_INDICES_BLOB),
    _Joined: _indices_put(_EXT_INDICES, _EXT_INDICES_BLOB),  # a lazy concat: the same value
    Tokens: _indices_put(_EXT_TOKENS, _EXT_TOKENS_BLOB),
    _JoinedTokens: _indices_put(_EXT_TOKENS, _EXT_TOKENS_BLOB),
}
"""The encoder of each exact type msgpack's packer packs natively (lists, dicts and byte buffers
too, as it did, though messages carry none), of `Indices`, and of each registered enum and
record once `_put_other` has seen it; any other type goes to `_put_other`."""


# Per class: a function that appends a message's `[code, fields...]` to the parts, and one
# that builds the message from the decoded values. Generated once per class: a loop over
# `dataclasses.fields` and `cls(**dict(zip(...)))` are several times slower.
_ENCODERS: dict[type, Callable[[Any, _Parts, BlobRefs | None], None]] = {}
_DECODERS: dict[int, Callable[[tuple[Any, ...]], Message]] = {}
_FIELDS: dict[int, tuple[str, ...]] = {}
"""Per type code: its class's field names (`dataclasses.fields` is slow to ask per message)."""


def _compile(code: int, cls: type[Message]) -> None:
    names = field_names(cls)
    puts = "".join(f"    v = m.{n}\n    get(type(v), other)(v, out, refs)\n" for n in names)
    enc_src = f"def enc(m, out, refs):\n    out.append(head)\n{puts}"
    args = ", ".join(f"{n}=v[{i + 1}]" for i, n in enumerate(names))
    dec_src = f"def dec(v):\n    return cls({args})\n"
    scope: dict[str, Any] = {
        "cls": cls, "head": _array_header(len(names) + 1) + _int(code), "get": _PUT.get, "other": _put_other,
    }
    exec(enc_src, scope)  # noqa: S102 - source built from dataclass field names only
    exec(dec_src, scope)  # noqa: S102
    _ENCODERS[cls] = scope["enc"]
    _DECODERS[code] = scope["dec"]
    _FIELDS[code] = names


def _encoder_for(cls: type) -> Callable[[Any, _Parts, BlobRefs | None], None]:
    enc = _ENCODERS.get(cls)
    if enc is None:
        code = getattr(cls, "TYPE_CODE", None)
        if code is None or MESSAGE_TYPES.get(code) is not cls:
            raise CodecError(
                f"{cls.__name__} is not a registered message; declare it with @message(code)"
            )
        _compile(code, cls)
        enc = _ENCODERS[cls]
    return enc


def encode(msg: Message, refs: BlobRefs | None = None) -> bytes:
    """The msgpack bytes of a registered message; with `refs`, large `Indices` may be blob references."""
    out: _Parts = []
    try:
        _encoder_for(type(msg))(msg, out, refs)
    except (TypeError, OverflowError, UnicodeEncodeError) as err:
        raise CodecError(f"cannot encode {type(msg).__name__}: {err}") from err
    return b"".join(out)


# -- decoding ----------------------------------------------------------------------------------


def _ext_value(code: int, data: bytes, depth: int, blobs: Mapping[int, bytes] | None) -> Any:
    if code == _EXT_INDICES:
        return Indices(data)
    if code == _EXT_TOKENS:
        return Tokens(data)
    if code == _EXT_ENUM:
        enum_code, value = msgpack.unpackb(data, use_list=False)
        cls = ENUM_TYPES.get(enum_code)
        if cls is None:
            raise CodecError(f"unknown enum type code {enum_code}")
        try:
            return cls(value)
        except ValueError:
            raise CodecError(f"{value!r} is not a member of enum {cls.__name__}") from None
    if code == _EXT_RECORD:
        if depth >= _RECORD_DEPTH_MAX:
            raise CodecError(f"records nested deeper than {_RECORD_DEPTH_MAX} levels (the codec's bound)")
        return _build(_unpack(data, depth + 1, blobs))
    if code in (_EXT_INDICES_BLOB, _EXT_TOKENS_BLOB):
        number = msgpack.unpackb(data)
        if blobs is None:
            raise CodecError(f"the payload refers to blob {number!r}, and no blobs were given (only a "
                             "delivery log's bodies refer to blobs; decode them with the log's)")
        held = blobs.get(number)
        if held is None:
            raise CodecError(f"the payload refers to blob {number!r}, which is not among the {len(blobs)} given")
        return Indices(held) if code == _EXT_INDICES_BLOB else Tokens(held)
    raise CodecError(f"unknown msgpack extension type {code}")


def _unpack(data: bytes, depth: int = 0, blobs: Mapping[int, bytes] | None = None) -> Any:
    def hook(code: int, payload: bytes) -> Any:
        return _ext_value(code, payload, depth, blobs)

    return msgpack.unpackb(data, use_list=False, raw=False, ext_hook=hook)


def _build(values: Any) -> Message:
    expected = "malformed payload: expected [type_code, fields...], got"
    if not isinstance(values, tuple):
        raise CodecError(f"{expected} {type(values).__name__}")
    if not values:
        raise CodecError(f"{expected} an empty array")
    code = values[0]
    if not isinstance(code, int) or isinstance(code, bool):
        raise CodecError(f"{expected} type code {code!r}")
    cls = MESSAGE_TYPES.get(code)
    if cls is None:
        raise CodecError(
            f"unknown message type code {code}; {len(MESSAGE_TYPES)} codes are registered "
            "(is the sender a newer version, or was its module not imported?)"
        )
    dec = _DECODERS.get(code)
    if dec is None:
        _compile(code, cls)
        dec = _DECODERS[code]
    names = _FIELDS[code]
    if len(values) - 1 != len(names):
        raise CodecError(
            f"malformed {cls.__name__} (type code {code}): {len(values) - 1} values for "
            f"{len(names)} fields {names}"
        )
    try:
        return dec(values)
    except (TypeError, ValueError) as err:
        raise CodecError(f"malformed {cls.__name__} (type code {code}): {err}") from err


def decode(data: bytes, blobs: Mapping[int, bytes] | None = None) -> Message:
    """The message encoded in `data` (`blobs`: what its blob references refer to, by number);
    `CodecError` says what was wrong otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"decode wants bytes, got {type(data).__name__}")
    try:
        values = _unpack(data, 0, blobs)
    except CodecError:
        raise
    except (msgpack.UnpackException, ValueError, TypeError, IndexError) as err:
        raise CodecError(f"malformed payload ({len(data)} bytes): {type(err).__name__}: {err}") from err
    return _build(values)
