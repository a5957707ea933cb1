"""The message decorator and the type-code registry the codec reads.

Every message is a frozen, slotted, keyword-only dataclass declared with
`@message(code)`; enums that travel inside messages are declared with
`@wire_enum(code)`. Codes are stable wire identifiers: never reuse one.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)


class Message:
    """Base of every message and record that crosses an actor boundary."""

    __slots__ = ()


MESSAGE_TYPES: dict[int, type[Message]] = {}
"""Type code -> message (or record) class."""

ENUM_TYPES: dict[int, type[enum.Enum]] = {}
"""Type code -> enum class carried inside messages."""


def message(code: int) -> Callable[[type[T]], type[T]]:
    """Declare a message class: frozen, slotted, keyword-only, registered under `code`."""

    def wrap(cls: type[T]) -> type[T]:
        if not issubclass(cls, Message):
            raise TypeError(f"{cls.__name__} must derive from Message")
        _claim(code, cls.__name__, MESSAGE_TYPES)
        made = dataclasses.dataclass(frozen=True, slots=True, kw_only=True)(cls)
        MESSAGE_TYPES[code] = made  # type: ignore[assignment]
        made.TYPE_CODE = code  # type: ignore[attr-defined]
        return made

    return wrap


def wire_enum(code: int) -> Callable[[type[E]], type[E]]:
    """Declare an enum that may travel inside messages, registered under `code`."""

    def wrap(cls: type[E]) -> type[E]:
        _claim(code, cls.__name__, ENUM_TYPES)
        ENUM_TYPES[code] = cls
        cls.TYPE_CODE = code  # type: ignore[attr-defined]
        if cls.__hash__ is enum.Enum.__hash__:
            # Members are singletons compared by identity: hash them by identity too, in C
            # (Enum's own hash is a Python call on the name, paid at every dict lookup by name).
            cls.__hash__ = object.__hash__  # type: ignore[method-assign]
        return cls

    return wrap


def _claim(code: int, name: str, table: dict[int, Any]) -> None:
    if not isinstance(code, int) or not 0 < code < 2**16:
        raise ValueError(f"type code of {name} must be an int in 1..65535, got {code!r}")
    if code in table and table[code].__name__ != name:
        raise ValueError(
            f"type code {code} of {name} is already taken by {table[code].__name__}"
        )


def field_names(cls: type[Message]) -> tuple[str, ...]:
    """The fields of a message class, in declaration (wire) order."""
    return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
