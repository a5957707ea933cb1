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
        made = frozen_fast_init(dataclasses.dataclass(frozen=True, slots=True, kw_only=True)(cls))
        MESSAGE_TYPES[code] = made  # type: ignore[assignment]
        made.TYPE_CODE = code  # type: ignore[attr-defined]
        return made

    return wrap


def frozen_fast_init(cls: type[T]) -> type[T]:
    """`cls` (a frozen, slotted dataclass) with an `__init__` that sets each field through its
    slot's descriptor: the same instance, at about 60% of the cost of the generated one,
    which goes through `object.__setattr__` by name for every field. Messages are made on
    every delivery, so their construction is on the scheduler's path. A class with a
    `__post_init__`, a default factory or a field outside `__init__` keeps its own."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if (hasattr(cls, "__post_init__") or "__slots__" not in cls.__dict__
            or not cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
            or any(f.default_factory is not dataclasses.MISSING or not f.init for f in fields)):
        raise TypeError(f"{cls.__name__}: frozen_fast_init takes a frozen, slotted dataclass whose fields are "
                        "all set by __init__ without a default factory or __post_init__")
    names: dict[str, Any] = {}
    positional, keyword, body = [], [], []
    for i, f in enumerate(fields):
        param = f.name
        if f.default is not dataclasses.MISSING:
            names[f"_default{i}"] = f.default
            param += f"=_default{i}"
        (keyword if f.kw_only else positional).append(param)
        names[f"_set{i}"] = next(k.__dict__[f.name] for k in cls.__mro__ if f.name in k.__dict__).__set__
        body.append(f"    _set{i}(self, {f.name})")
    params = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    exec(f"def __init__({params}):\n" + ("\n".join(body) or "    pass"), names)  # noqa: S102 - our own source
    init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    init.__annotations__ = dict(cls.__init__.__annotations__)
    cls.__init__ = init  # type: ignore[misc]
    return cls


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
