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

Arrays decode as tuples, so every message round-trips to an equal value.
Packing uses msgpack's `strict_types`: an `int` or `str` subclass (an `IntEnum`
such as `HostSlotState`) goes through the extension hook instead of decaying to
a plain int that would decode as the wrong type.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Final

import msgpack

from ._index import Indices, Tokens
from ._registry import ENUM_TYPES, MESSAGE_TYPES, Message, field_names

_EXT_INDICES: Final = 1
_EXT_ENUM: Final = 2
_EXT_RECORD: Final = 3
_EXT_TOKENS: Final = 4

_RECORD_DEPTH_MAX: Final = 8
"""Most levels of records nested in records a payload may hold. Real messages nest
two deep; a crafted payload nested a few hundred deep would overflow the C stack
of the msgpack unpacker (a segfault, not an exception), so decoding stops here."""


class CodecError(ValueError):
    """A payload could not be decoded (or a value could not be encoded)."""


# Per class: a function that turns a message into its positional list, and one
# that builds the message from the decoded values. Generated once per class
# because `dataclasses.asdict` and `cls(**dict(zip(...)))` are several times slower.
_ENCODERS: dict[type, Callable[[Any], list[Any]]] = {}
_DECODERS: dict[int, Callable[[tuple[Any, ...]], Message]] = {}


def _compile(code: int, cls: type[Message]) -> None:
    names = field_names(cls)
    body = ", ".join(f"m.{n}" for n in names)
    enc_src = f"def enc(m):\n    return [{code}{', ' if names else ''}{body}]\n"
    args = ", ".join(f"{n}=v[{i + 1}]" for i, n in enumerate(names))
    dec_src = f"def dec(v):\n    return cls({args})\n"
    scope: dict[str, Any] = {"cls": cls}
    exec(enc_src, scope)  # noqa: S102 - source built from dataclass field names only
    exec(dec_src, scope)  # noqa: S102
    _ENCODERS[cls] = scope["enc"]
    _DECODERS[code] = scope["dec"]


def _encoder_for(cls: type) -> Callable[[Any], list[Any]]:
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


def _default(value: Any) -> msgpack.ExtType | list[Any]:
    if type(value) is tuple:  # strict_types sends tuples here; they travel as arrays
        return list(value)
    if type(value) is Indices:
        return msgpack.ExtType(_EXT_INDICES, value.to_bytes())
    if type(value) is Tokens:
        return msgpack.ExtType(_EXT_TOKENS, value.to_bytes())
    if isinstance(value, enum.Enum):
        code = getattr(type(value), "TYPE_CODE", None)
        if code is None or ENUM_TYPES.get(code) is not type(value):
            raise CodecError(
                f"enum {type(value).__name__} is not registered; declare it with @wire_enum(code)"
            )
        return msgpack.ExtType(_EXT_ENUM, msgpack.packb([code, value.value]))
    if isinstance(value, Message):
        return msgpack.ExtType(_EXT_RECORD, _pack(_encoder_for(type(value))(value)))
    if type(value) is int:  # strict_types hands over the ints msgpack cannot hold
        raise CodecError(f"integer {value} is outside msgpack's range -2**63 .. 2**64-1")
    raise CodecError(
        f"cannot encode a value of type {type(value).__name__}; messages carry ints, "
        "floats, str, bytes, bools, None, tuples, Indices, registered enums and records"
    )


def _pack(values: list[Any]) -> bytes:
    return msgpack.packb(values, default=_default, use_bin_type=True, strict_types=True)


def _ext_value(code: int, data: bytes, depth: int) -> Any:
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
        return _build(_unpack(data, depth + 1))
    raise CodecError(f"unknown msgpack extension type {code}")


def _unpack(data: bytes, depth: int = 0) -> Any:
    def hook(code: int, payload: bytes) -> Any:
        return _ext_value(code, payload, depth)

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
    names = field_names(cls)
    if len(values) - 1 != len(names):
        raise CodecError(
            f"malformed {cls.__name__} (type code {code}): {len(values) - 1} values for "
            f"{len(names)} fields {names}"
        )
    dec = _DECODERS.get(code)
    if dec is None:
        _compile(code, cls)
        dec = _DECODERS[code]
    try:
        return dec(values)
    except (TypeError, ValueError) as err:
        raise CodecError(f"malformed {cls.__name__} (type code {code}): {err}") from err


def encode(msg: Message) -> bytes:
    """The msgpack bytes of a registered message."""
    try:
        return _pack(_encoder_for(type(msg))(msg))
    except (TypeError, OverflowError, UnicodeEncodeError) as err:
        raise CodecError(f"cannot encode {type(msg).__name__}: {err}") from err


def decode(data: bytes) -> Message:
    """The message encoded in `data`; `CodecError` says what was wrong otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"decode wants bytes, got {type(data).__name__}")
    try:
        values = _unpack(data)
    except CodecError:
        raise
    except (msgpack.UnpackException, ValueError, TypeError, IndexError) as err:
        raise CodecError(f"malformed payload ({len(data)} bytes): {type(err).__name__}: {err}") from err
    return _build(values)
