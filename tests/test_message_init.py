"""`frozen_fast_init`: every message, and the facade's frozen records, are built by an
`__init__` that sets the slots directly; it must take and refuse exactly what the
dataclass's own `__init__` takes and refuses, and leave the same instance."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.messages import MESSAGE_TYPES
from hicache.messages._registry import frozen_fast_init
from hicache.runtime import AdmitResult, CacheHandle, Request

from test_codec import strategy_for, hints

FAST = [*sorted(MESSAGE_TYPES.values(), key=lambda c: c.TYPE_CODE), CacheHandle, Request, AdmitResult]


def _reference(cls: type) -> type:
    """The same class as the dataclass decorator alone makes it (its generated `__init__`)."""
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    ns: dict[str, Any] = {"__annotations__": dict(cls.__annotations__)}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            ns[f.name] = f.default
    kw_only = all(f.kw_only for f in dataclasses.fields(cls)) and bool(dataclasses.fields(cls))
    return dataclasses.dataclass(frozen=params.frozen, slots=True, kw_only=kw_only)(type(cls.__name__, (), ns))


@pytest.mark.parametrize("cls", FAST, ids=lambda c: c.__name__)
def test_the_fast_init_has_the_signature_of_the_dataclass_init(cls: type) -> None:
    assert inspect.signature(cls.__init__) == inspect.signature(_reference(cls).__init__)
    assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"


@settings(max_examples=4, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("cls", sorted(MESSAGE_TYPES.values(), key=lambda c: c.TYPE_CODE), ids=lambda c: c.__name__)
def test_a_message_built_by_the_fast_init_holds_every_field_it_was_given(cls: type, data: st.DataObject) -> None:
    values = {name: data.draw(strategy_for(h), label=name) for name, h in hints(cls).items()}
    made = cls(**values)
    assert {name: getattr(made, name) for name in values} == values
    assert made == dataclasses.replace(made) and hash(made) == hash(dataclasses.replace(made))
    for name in list(values)[:1]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(made, name, 0)


def test_missing_unknown_and_positional_arguments_are_refused_as_the_dataclass_refuses_them() -> None:
    cls = next(c for c in MESSAGE_TYPES.values() if c.__name__ == "FinishItem")
    with pytest.raises(TypeError, match="missing 6 required keyword-only arguments"):
        cls(request_id="a")
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        cls(request_id="a", handle=1, tokens=None, device=None, reason=None, allocs=0, commits=0, colour=1)
    with pytest.raises(TypeError, match="takes 1 positional argument"):
        cls("a", 1, None, None, None, 0, 0)
    assert Request("r", [1, 2]) == Request(request_id="r", tokens=[1, 2], namespace="")
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'tokens'"):
        Request("r")


def test_a_class_the_fast_init_cannot_serve_is_refused_with_the_reason() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        x: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass(frozen=True, slots=True)
    class Listed:
        xs: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(slots=True)
    class Mutable:
        x: int

    for cls in (Checked, Listed, Mutable):
        with pytest.raises(TypeError, match="takes a frozen, slotted dataclass"):
            frozen_fast_init(cls)
