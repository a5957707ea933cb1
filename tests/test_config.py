"""`Config`: one parse path for the constructor, `replace()` and `from_mapping()`; frozen values."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.messages._config_values import Count
from hicache.runtime import (
    DTYPES,
    Config,
    ConfigError,
    DeviceKind,
    EvictionPolicy,
    HostLayout,
    PrefetchPolicy,
    StorageKind,
    WritePolicy,
)

ENUM_FIELDS = {
    "device": DeviceKind,
    "host_layout": HostLayout,
    "write_policy": WritePolicy,
    "eviction_policy": EvictionPolicy,
    "prefetch_policy": PrefetchPolicy,
    "storage": StorageKind,
}
FIELDS = {f.name: f for f in dataclasses.fields(Config)}
COUNT_FIELDS = sorted(n for n, f in FIELDS.items() if isinstance(f.metadata["rule"], Count))

PATHS: dict[str, Callable[[dict[str, Any]], Config]] = {
    "constructor": lambda raw: Config(**raw),
    "replace": lambda raw: Config().replace(**raw),
    "from_mapping": lambda raw: Config.from_mapping(raw),
}
"""The three ways in; each test of what is accepted runs through all of them."""


def _outcome(path: Callable[[dict[str, Any]], Config], raw: dict[str, Any]) -> Config | str:
    """The config a path makes of `raw`, or the message of its `ConfigError`."""
    try:
        return path(raw)
    except ConfigError as e:
        return f"ConfigError: {e}"


def _same_through_every_path(raw: dict[str, Any]) -> Config | str:
    outcomes = {name: _outcome(path, raw) for name, path in PATHS.items()}
    assert len(set(map(repr, outcomes.values()))) == 1, f"the paths disagree on {raw!r}: {outcomes}"
    return outcomes["constructor"]


def test_the_defaults_make_a_valid_config() -> None:
    c = Config()
    assert c.device_slots % c.page_size == 0 and c.host_slots > c.device_slots
    assert c.device_pages * c.page_size == c.device_slots
    assert (c.layers, c.kv_heads, c.head_dim, c.dtype) == (4, 2, 64, "float16")
    assert c.bytes_per_slot == 2 * 4 * 2 * 64 * 2


# -- what the three paths accept, and that they agree ------------------------------------


@pytest.mark.parametrize(("raw", "expected"), [
    ({"layers": "64"}, {"layers": 64}),
    ({"layers": " 64 "}, {"layers": 64}),
    ({"layers": "+64\n"}, {"layers": 64}),
    ({"tp_size": "2", "tp_rank": "1"}, {"tp_size": 2, "tp_rank": 1}),
    ({"tp_rank": "0"}, {"tp_rank": 0}),
    ({"host_tier": "no"}, {"host_tier": False}),
    ({"host_tier": " YES "}, {"host_tier": True}),
    ({"host_tier": "off"}, {"host_tier": False}),
    ({"host_tier": "1"}, {"host_tier": True}),
    ({"storage_timeout_s": " 2.5 "}, {"storage_timeout_s": 2.5}),
    ({"storage_timeout_s": "1e-3"}, {"storage_timeout_s": 0.001}),
    ({"storage_timeout_s": 3}, {"storage_timeout_s": 3.0}),
    ({"write_policy": " Write_Back "}, {"write_policy": WritePolicy.WRITE_BACK}),
    ({"dtype": torch.bfloat16}, {"dtype": "bfloat16"}),
    ({"dtype": "torch.float8_e4m3fn"}, {"dtype": "float8_e4m3fn"}),
    ({"mooncake_master": " 10.0.0.7:50051 "}, {"mooncake_master": "10.0.0.7:50051"}),
    ({"mooncake_master": "[::1]:50051"}, {"mooncake_master": "[::1]:50051"}),
    ({"mooncake_metadata": "http://[::1]:8080/metadata"}, {"mooncake_metadata": "http://[::1]:8080/metadata"}),
    ({"mooncake_metadata": "http://meta.example/metadata"}, {"mooncake_metadata": "http://meta.example/metadata"}),
    ({"storage_dir": " /tmp/with space "}, {"storage_dir": " /tmp/with space "}),
])
def test_raw_values_are_converted_the_same_way_by_every_path(raw: dict[str, Any], expected: dict[str, Any]) -> None:
    c = _same_through_every_path(raw)
    assert isinstance(c, Config), c
    for name, value in expected.items():
        got = getattr(c, name)
        assert got == value and type(got) is type(value), (name, got)


MODEL_ID_RULE = "printable text of at most 1024 characters, like 'meta-llama/Llama-3.1-8B' (empty: unset)"


@pytest.mark.parametrize(("raw", "message"), [
    ({"layers": "4.0"}, "layers='4.0' must be an integer in 1..1024"),
    ({"layers": 4.0}, "layers=4.0 must be an integer in 1..1024"),
    ({"layers": "0x10"}, "layers='0x10' must be an integer in 1..1024"),
    ({"layers": "1_000"}, "layers='1_000' must be an integer in 1..1024"),
    ({"layers": ""}, "layers='' must be an integer in 1..1024"),
    ({"layers": "٣"}, "layers='٣' must be an integer in 1..1024"),
    ({"layers": "9" * 5000}, f"layers={'9' * 5000!r} must be an integer in 1..1024"),
    ({"layers": True}, "layers=True must be an integer in 1..1024"),
    ({"layers": None}, "layers=None must be an integer in 1..1024"),
    ({"tp_rank": "-1"}, "tp_rank='-1' must be an integer in 0..1023"),
    ({"host_tier": "maybe"}, "host_tier='maybe' must be true or false (or yes/no, on/off, 1/0)"),
    ({"host_tier": 1}, "host_tier=1 must be true or false (or yes/no, on/off, 1/0)"),
    ({"storage_timeout_s": "inf"}, "storage_timeout_s='inf' must be a number > 0 and <= 86400"),
    ({"storage_timeout_s": float("inf")}, "storage_timeout_s=inf must be a number > 0 and <= 86400"),
    ({"storage_timeout_s": float("nan")}, "storage_timeout_s=nan must be a number > 0 and <= 86400"),
    ({"storage_timeout_s": "nan"}, "storage_timeout_s='nan' must be a number > 0 and <= 86400"),
    ({"storage_timeout_s": 10**400}, "storage_timeout_s=1" + "0" * 400 + " must be a number > 0 and <= 86400"),
    ({"storage_timeout_s": False}, "storage_timeout_s=False must be a number > 0 and <= 86400"),
    ({"prefetch_rate_fraction": 1.5}, "prefetch_rate_fraction=1.5 must be a number > 0 and <= 1"),
    ({"mooncake_segment_mb": 8}, "mooncake_segment_mb=8 must be an integer in 16..1048576"),
    ({"prefetch_rate_fraction": 0}, "prefetch_rate_fraction=0 must be a number > 0 and <= 1"),
    ({"prefetch_timeout_per_1k_s": -0.25}, "prefetch_timeout_per_1k_s=-0.25 must be a number >= 0 and <= 86400"),
    ({"dtype": torch.float64}, "dtype=torch.float64 must be one of float16, bfloat16, float32, float8_e4m3fn, "
                               "float8_e5m2 (a name or the torch.dtype)"),
    ({"storage_dir": b"/tmp"}, "storage_dir=b'/tmp' must be a path string without NUL characters (empty: unset)"),
    ({"log_path": "a\0b"}, "log_path='a\\x00b' must be a path string without NUL characters (empty: unset)"),
    ({"model_id": "llama\n"}, f"model_id='llama\\n' must be {MODEL_ID_RULE}"),
    ({"model_id": 3}, f"model_id=3 must be {MODEL_ID_RULE}"),
    ({"model_id": "m" * 1025}, f"model_id={'m' * 1025!r} must be {MODEL_ID_RULE}"),
])
def test_bad_raw_values_are_one_config_error_from_every_path(raw: dict[str, Any], message: str) -> None:
    assert _same_through_every_path(raw) == f"ConfigError: {message}"


@pytest.mark.parametrize("name", COUNT_FIELDS)
def test_every_integer_field_has_a_range_with_an_upper_bound(name: str) -> None:
    rule = FIELDS[name].metadata["rule"]
    assert rule.hi < 2**63
    for bad in (rule.lo - 1, rule.hi + 1):
        assert _same_through_every_path({name: bad}) == f"ConfigError: {name}={bad} must be an integer in " \
                                                        f"{rule.lo}..{rule.hi}"


def test_a_write_copy_batch_ends_at_its_pages_or_its_bytes_whichever_comes_first() -> None:
    # 2 layers x 1 head x 8 dims x fp16 x K and V: 64 bytes a slot, 1 KiB a page of 16
    small = Config(layers=2, kv_heads=1, head_dim=8, dtype="float16", page_size=16)
    assert small.transfer_batch_pages == 4096  # 4 MiB: the page bound
    assert small.replace(transfer_pages_max=7).transfer_batch_pages == 7
    # 32 layers x 8 heads x 128 dims x fp16 x 2: 128 KiB a slot, 2 MiB a page: 128 MiB is 64 pages
    large = Config(layers=32, kv_heads=8, head_dim=128, dtype="float16", page_size=16,
                   device_slots=1 << 16, host_slots=1 << 17)
    assert large.transfer_batch_pages == 64
    assert large.replace(transfer_batch_mb=1).transfer_batch_pages == 1  # never less than a page


def test_a_huge_storage_batch_is_refused_at_once() -> None:
    assert _same_through_every_path({"storage_batch_pages": 10**9}) == \
        "ConfigError: storage_batch_pages=1000000000 must be an integer in 1..4096"


@pytest.mark.parametrize("name", sorted(ENUM_FIELDS))
def test_an_unknown_enum_string_is_refused_naming_the_allowed_values(name: str) -> None:
    allowed = ", ".join(m.value for m in ENUM_FIELDS[name])
    assert _same_through_every_path({name: "bogus"}) == f"ConfigError: {name}='bogus' must be one of {allowed}"


def test_enum_strings_are_stored_as_members() -> None:
    c = Config(device="cuda", write_policy="write_through_selective")  # type: ignore[arg-type]
    assert c.device is DeviceKind.CUDA
    assert c.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE


def test_a_member_of_another_enum_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^write_policy=<HostLayout.LAYER_FIRST: 'layer_first'> must be one of "):
        Config(write_policy=HostLayout.LAYER_FIRST)  # type: ignore[arg-type]


def test_an_unknown_field_is_the_same_config_error_from_every_path() -> None:
    message = _same_through_every_path({"pages": 4, "colour": "red", "layers": 2})
    assert isinstance(message, str)
    assert message.startswith("ConfigError: unknown config field(s) colour, pages; known: layers, kv_heads, ")


def test_from_mapping_refuses_what_is_not_a_mapping_of_names() -> None:
    with pytest.raises(ConfigError, match=r"^unknown config field\(s\) 3; known: layers"):
        Config.from_mapping({3: 4})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match=r"^a config mapping must be a mapping .* not list$"):
        Config.from_mapping([("layers", 2)])  # type: ignore[arg-type]


# -- the rules between fields, on converted values -----------------------------------------


@pytest.mark.parametrize("storage", ["file", StorageKind.FILE, " FILE "])
def test_file_storage_without_a_directory_is_refused_by_every_path(storage: object) -> None:
    assert _same_through_every_path({"storage": storage}) == \
        "ConfigError: storage='file' needs storage_dir: the directory that holds the pages"


@pytest.mark.parametrize("raw", [
    {"storage": "none", "host_tier": False},
    {"storage": "none", "host_tier": "false"},
    {"storage": StorageKind.NONE, "host_tier": False},
])
def test_an_l1_only_cache_without_storage_is_accepted_by_every_path(raw: dict[str, Any]) -> None:
    c = _same_through_every_path(raw)
    assert isinstance(c, Config) and c.storage is StorageKind.NONE and c.host_tier is False


def test_storage_without_the_host_tier_is_refused_saying_what_to_change() -> None:
    assert _same_through_every_path({"storage": "mooncake", "host_tier": "no"}) == (
        "ConfigError: storage='mooncake' needs host_tier=true: pages move between storage and host memory "
        "(or set storage='none')")


@pytest.mark.parametrize("host_slots", [4096, 2048, "4096"])
def test_host_slots_must_be_larger_than_device_slots(host_slots: object) -> None:
    assert _same_through_every_path({"device_slots": "4096", "host_slots": host_slots}) == (
        f"ConfigError: host_slots={int(host_slots)} must be larger than device_slots=4096: "  # type: ignore[call-overload]
        "the host tier backs up the device tier")


@pytest.mark.parametrize("name", ["device_slots", "host_slots"])
def test_slots_must_be_a_multiple_of_the_page_size(name: str) -> None:
    raw = {"device_slots": 2048, "host_slots": 8192, name: " 4100 "}
    assert _same_through_every_path(raw) == f"ConfigError: {name}=4100 must be a multiple of page_size=16"


@pytest.mark.parametrize(("rank", "size"), [(1, 1), ("4", "4"), (5, 2)])
def test_the_rank_must_be_below_the_group_size(rank: object, size: object) -> None:
    assert _same_through_every_path({"tp_rank": rank, "tp_size": size}) == \
        f"ConfigError: tp_rank={int(rank)} must be below tp_size={int(size)}"  # type: ignore[call-overload]


# -- Mooncake addresses --------------------------------------------------------------------

MASTER_RULE = "host:port with a port in 1..65535, like 10.0.0.1:50051"
URL_RULE = "an http:// URL with a host (and a port in 1..65535, if any), like http://10.0.0.1:8080/metadata"


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("mooncake_metadata", "http://127.0.0.1:99999/metadata", URL_RULE),
    ("mooncake_metadata", "http://127.0.0.1:0/metadata", URL_RULE),
    ("mooncake_metadata", "http://127.0.0.1:port/metadata", URL_RULE),
    ("mooncake_metadata", "https://127.0.0.1:8080/metadata", URL_RULE),
    ("mooncake_metadata", "127.0.0.1:8080", URL_RULE),
    ("mooncake_metadata", "http:///metadata", URL_RULE),
    ("mooncake_metadata", "http://a b:8080/", URL_RULE),
    ("mooncake_metadata", 8080, URL_RULE),
    ("mooncake_master", "127.0.0.1:99999", MASTER_RULE),
    ("mooncake_master", "127.0.0.1:0", MASTER_RULE),
    ("mooncake_master", "127.0.0.1", MASTER_RULE),
    ("mooncake_master", ":50051", MASTER_RULE),
    ("mooncake_master", "127.0.0.1:+80", MASTER_RULE),
    ("mooncake_master", "my host:50051", MASTER_RULE),
    ("mooncake_master", "::1:50051", MASTER_RULE),  # an IPv6 host needs its brackets
    ("mooncake_master", "[::1:50051", MASTER_RULE),
    ("mooncake_master", "[zz]:50051", MASTER_RULE),
    ("mooncake_master", "http://h:50051", MASTER_RULE),
    ("mooncake_metadata", "http://[::1:8080/metadata", URL_RULE),  # urlsplit raises ValueError for these
    ("mooncake_metadata", "http://[zz]:8080/m", URL_RULE),
    ("mooncake_metadata", "http://[::1]]:8080/m", URL_RULE),
    ("mooncake_metadata", "http://user@h:8080/m", URL_RULE),
    ("mooncake_metadata", "http://h:/m", URL_RULE),
    ("mooncake_local_host", "", "a host name or IP address (no port, no scheme)"),
    ("mooncake_local_host", "my host", "a host name or IP address (no port, no scheme)"),
    ("metrics_host", "h:1", "a host name or IP address (no port, no scheme)"),
    ("metrics_host", "http://x", "a host name or IP address (no port, no scheme)"),
    ("metrics_host", "[::1]", "a host name or IP address (no port, no scheme)"),
])
def test_a_bad_mooncake_address_is_one_config_error(field: str, value: object, rule: str) -> None:
    assert _same_through_every_path({field: value}) == f"ConfigError: {field}={value!r} must be {rule}"


# -- a property: the three paths agree on any input ----------------------------------------

_INT_FORMS = st.one_of(st.integers(-3, 5000), st.integers(-3, 5000).map(str),
                       st.integers(0, 5000).map(lambda n: f" {n}\t"), st.sampled_from(["4.0", "", "x", "0x10"]),
                       st.booleans(), st.floats(allow_nan=True), st.none())
_NUMBER_FORMS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 10**20),
                          st.floats(0.001, 100).map(str), st.sampled_from(["inf", "nan", " 1.5 ", "-1", "1e400"]),
                          st.booleans())
_SWITCH_FORMS = st.one_of(st.booleans(), st.integers(-1, 2),
                          st.sampled_from(["true", "False", " no ", "YES", "on", "off", "1", "0", "maybe", ""]))
_TEXT_FORMS = st.one_of(st.text(max_size=12), st.sampled_from(["/tmp/x", "127.0.0.1:1", "http://h:99999/m",
                                                               "http://h:8080/m", "h:0", "[::1]:5"]), st.none())
_FORMS_BY_FIELD: dict[str, st.SearchStrategy[Any]] = {}
for _name, _field in FIELDS.items():
    _default = _field.default
    if isinstance(_default, enum.Enum):
        _values = [m.value for m in type(_default)]
        _FORMS_BY_FIELD[_name] = st.one_of(
            st.sampled_from(list(type(_default))), st.sampled_from(_values),
            st.sampled_from(_values).map(lambda v: f" {v.upper()} "), st.sampled_from(list(HostLayout)),
            st.text(max_size=6))
    elif _name == "dtype":
        _FORMS_BY_FIELD[_name] = st.one_of(st.sampled_from(list(DTYPES)), st.sampled_from(list(DTYPES.values())),
                                           st.sampled_from([torch.float64, torch.int8, "float64", " BFloat16 "]))
    elif isinstance(_default, bool):
        _FORMS_BY_FIELD[_name] = _SWITCH_FORMS
    elif isinstance(_default, int):
        _FORMS_BY_FIELD[_name] = _INT_FORMS
    elif isinstance(_default, float):
        _FORMS_BY_FIELD[_name] = _NUMBER_FORMS
    else:
        _FORMS_BY_FIELD[_name] = _TEXT_FORMS


@st.composite
def _raw_configs(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=6, unique=True))
    raw = {name: draw(_FORMS_BY_FIELD[name]) for name in names}
    if draw(st.integers(0, 9)) == 0:
        raw[draw(st.sampled_from(["colour", "Layers", "page-size", ""]))] = 1
    return raw


@settings(max_examples=400, deadline=None)
@given(raw=_raw_configs())
def test_the_constructor_replace_and_from_mapping_agree_on_any_input(raw: dict[str, Any]) -> None:
    outcome = _same_through_every_path(raw)
    if isinstance(outcome, Config):
        assert Config.from_mapping(outcome.to_mapping()) == outcome
        assert all(type(getattr(outcome, n)) is type(FIELDS[n].default) for n in FIELDS)


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
        if raw["storage"] == "file":
            raw["storage_dir"] = "/tmp/hicache-pages"
        return Config.from_mapping(raw)

    return build()


@settings(max_examples=60, deadline=None)
@given(config=_valid_configs())
def test_to_mapping_and_from_mapping_round_trip_through_json_and_strings(config: Config) -> None:
    plain = config.to_mapping()
    assert all(not isinstance(v, enum.Enum) for v in plain.values())
    assert Config.from_mapping(json.loads(json.dumps(plain))) == config
    assert Config.from_mapping(plain) == config
    assert Config.from_mapping({k: v if isinstance(v, str) else json.dumps(v) for k, v in plain.items()}) == config
    assert config.replace() == config == Config(**plain)


def test_replace_parses_and_checks_the_changed_config() -> None:
    c = Config()
    assert c.replace(page_size="8").page_size == 8
    with pytest.raises(ConfigError, match=r"^page_size=0 must be an integer in 1\.\.4096$"):
        c.replace(page_size=0)


def test_a_config_is_frozen_slotted_and_keyword_only() -> None:
    c = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.page_size = 8  # type: ignore[misc]
    assert not hasattr(c, "__dict__")
    with pytest.raises(TypeError):
        Config(4)  # type: ignore[misc]


def test_every_field_has_a_rule_and_a_description() -> None:
    for f in dataclasses.fields(Config):
        assert f.metadata["rule"].parse(f.name, f.default) == f.default
        assert f.metadata["doc"].strip(), f.name


def test_a_storage_step_takes_at_least_storage_batch_pages_and_more_small_pages_up_to_the_byte_bound() -> None:
    """`storage_step_pages`: model-sized pages keep `storage_batch_pages`; 2 KiB pages go as many
    as fit in `storage_batch_mb`, at most STORAGE_STEP_PAGES_MAX; 0 MiB means pages alone."""
    from hicache.messages.config import STORAGE_STEP_PAGES_MAX

    model = Config(layers=32, kv_heads=8, head_dim=128, dtype="float16", page_size=16)  # 2 MiB pages
    assert model.storage_step_pages == 16
    assert model.replace(storage_batch_mb=64).storage_step_pages == 32
    small = Config(layers=2, kv_heads=1, head_dim=32, dtype="float16", page_size=8)  # 2 KiB pages
    assert small.storage_step_pages == 512
    assert small.replace(storage_batch_mb=0).storage_step_pages == 16
    assert small.replace(storage_batch_pages=1000).storage_step_pages == 1000
    tiny = Config(layers=1, kv_heads=1, head_dim=1, dtype="float16", page_size=1)  # 4-byte pages
    assert tiny.storage_step_pages == STORAGE_STEP_PAGES_MAX
    assert _same_through_every_path({"storage_batch_mb": -1}) == \
        "ConfigError: storage_batch_mb=-1 must be an integer in 0..1024"
