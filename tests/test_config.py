"""`Config`: validated once at the edge, frozen, and parsed from raw values."""

from __future__ import annotations

import dataclasses
import enum
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.runtime import (
    DTYPES,
    Config,
    ConfigError,
    DeviceKind,
    EvictionPolicy,
    HostLayout,
    PrefetchPolicy,
    WritePolicy,
)

ENUM_FIELDS = {
    "device": DeviceKind,
    "host_layout": HostLayout,
    "write_policy": WritePolicy,
    "eviction_policy": EvictionPolicy,
    "prefetch_policy": PrefetchPolicy,
}
POSITIVE_INT_FIELDS = (
    "layers", "kv_heads", "head_dim", "page_size", "device_slots", "host_slots",
    "transfer_pages_max", "transfer_queue_ops_max", "load_ring_size",
)


def test_the_defaults_make_a_valid_config() -> None:
    c = Config()
    assert c.device_slots % c.page_size == 0 and c.host_slots > c.device_slots
    assert c.device_pages * c.page_size == c.device_slots


@pytest.mark.parametrize("page_size", [0, -16])
def test_a_page_size_that_is_not_positive_is_refused(page_size: int) -> None:
    with pytest.raises(ConfigError, match=rf"page_size={page_size} must be > 0"):
        Config(page_size=page_size)


@pytest.mark.parametrize("name", POSITIVE_INT_FIELDS)
def test_every_count_must_be_a_positive_integer(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}=0 must be > 0"):
        Config(**{name: 0})
    with pytest.raises(ConfigError, match=rf"^{name}='8' must be an integer"):
        Config(**{name: "8"})
    with pytest.raises(ConfigError, match=rf"^{name}=True must be an integer"):
        Config(**{name: True})


@pytest.mark.parametrize("host_slots", [4096, 2048])
def test_host_slots_must_be_larger_than_device_slots(host_slots: int) -> None:
    with pytest.raises(ConfigError, match=rf"host_slots={host_slots} must be larger than device_slots=4096"):
        Config(device_slots=4096, host_slots=host_slots)


@pytest.mark.parametrize("name", ["device_slots", "host_slots"])
def test_slots_must_be_a_multiple_of_the_page_size(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"{name}=4100 must be a multiple of page_size=16"):
        Config(**{"device_slots": 2048, "host_slots": 8192, name: 4100})


def test_an_unknown_dtype_is_refused_naming_the_allowed_ones() -> None:
    allowed = ", ".join(DTYPES)
    with pytest.raises(ConfigError, match=rf"dtype='float64' is unknown; allowed: {allowed}$"):
        Config(dtype="float64")


@pytest.mark.parametrize("name", sorted(ENUM_FIELDS))
def test_an_unknown_enum_string_is_refused_naming_the_allowed_values(name: str) -> None:
    allowed = ", ".join(m.value for m in ENUM_FIELDS[name])
    with pytest.raises(ConfigError, match=rf"^{name}='bogus' is not allowed; allowed: {allowed}$"):
        Config.from_mapping({name: "bogus"})
    with pytest.raises(ConfigError, match=rf"^{name}='bogus' is not allowed; allowed: {allowed}$"):
        Config(**{name: "bogus"})


def test_a_member_of_another_enum_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"write_policy=<HostLayout.LAYER_FIRST: 'layer_first'> is not allowed"):
        Config(write_policy=HostLayout.LAYER_FIRST)  # type: ignore[arg-type]


def test_from_mapping_refuses_unknown_fields_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) colour, pages; known: layers, kv_heads, "):
        Config.from_mapping({"pages": 4, "colour": "red", "layers": 2})


@pytest.mark.parametrize("raw", ["four", "4.0", "", "0x10"])
def test_from_mapping_refuses_strings_that_are_not_integers(raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"^layers={raw!r} must be an integer$"):
        Config.from_mapping({"layers": raw})


@pytest.mark.parametrize("raw", [4.0, None, True])
def test_from_mapping_refuses_non_integer_values_for_counts(raw: object) -> None:
    with pytest.raises(ConfigError, match=r"^layers=.* must be an integer$"):
        Config.from_mapping({"layers": raw})


def test_from_mapping_parses_integer_strings_and_enum_strings() -> None:
    c = Config.from_mapping({"page_size": "8", "device_slots": "64", "host_slots": "256",
                             "device": "cuda", "host_layout": "page_first", "write_policy": "write_back"})
    assert (c.page_size, c.device_slots, c.host_slots) == (8, 64, 256)
    assert c.device is DeviceKind.CUDA
    assert c.host_layout is HostLayout.PAGE_FIRST
    assert c.write_policy is WritePolicy.WRITE_BACK


def test_enum_strings_given_to_the_constructor_are_stored_as_members() -> None:
    c = Config(device="cuda", write_policy="write_through_selective")  # type: ignore[arg-type]
    assert c.device is DeviceKind.CUDA
    assert c.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE


def _valid_configs() -> st.SearchStrategy[Config]:
    @st.composite
    def build(draw: st.DrawFn) -> Config:
        page = draw(st.sampled_from([1, 2, 4, 16, 64]))
        device_pages = draw(st.integers(1, 64))
        host_pages = draw(st.integers(device_pages + 1, 256))
        raw: dict[str, object] = {
            "layers": draw(st.integers(1, 80)),
            "kv_heads": draw(st.integers(1, 16)),
            "head_dim": draw(st.sampled_from([8, 64, 128])),
            "dtype": draw(st.sampled_from(sorted(DTYPES))),
            "page_size": page,
            "device_slots": device_pages * page,
            "host_slots": host_pages * page,
            "transfer_pages_max": draw(st.integers(1, 512)),
            "transfer_queue_ops_max": draw(st.integers(1, 10_000)),
            "load_ring_size": draw(st.integers(1, 8)),
        }
        for name, cls in ENUM_FIELDS.items():
            raw[name] = draw(st.sampled_from([m.value for m in cls]))
        return Config.from_mapping(raw)

    return build()


@settings(max_examples=60, deadline=None)
@given(config=_valid_configs())
def test_to_mapping_and_from_mapping_round_trip_through_json(config: Config) -> None:
    plain = config.to_mapping()
    assert all(not isinstance(v, enum.Enum) for v in plain.values())
    assert Config.from_mapping(json.loads(json.dumps(plain))) == config
    assert Config.from_mapping(plain) == config


def test_replace_validates_the_changed_config() -> None:
    c = Config()
    assert c.replace(page_size=8).page_size == 8
    with pytest.raises(ConfigError, match=r"page_size=0 must be > 0"):
        c.replace(page_size=0)


def test_a_config_is_frozen_slotted_and_keyword_only() -> None:
    c = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.page_size = 8  # type: ignore[misc]
    assert not hasattr(c, "__dict__")
    with pytest.raises(TypeError):
        Config(4)  # type: ignore[misc]
