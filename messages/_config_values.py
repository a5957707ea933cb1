"""The values a `Config` field may take: its enums, its element types, and one rule per field.

A rule turns a raw value (a Python value, or a string from a command line, an
environment or a JSON file) into the value core code uses, or raises `ConfigError`
saying which field, what was given and what to give. The same rule runs whether
the value came to `Config(...)`, `Config.replace()` or `Config.from_mapping()`.

Strings are accepted for every field, with surrounding whitespace ignored (except
in paths, where it may be meant): integers in decimal digits (`"64"`, `" +64 "`),
numbers as decimal literals (`"0.5"`, `"1e-3"`; never `"inf"` or `"nan"`),
switches as `true/false`, `yes/no`, `on/off` or `1/0` in any case, enum values in
any case. Python `bool` is never taken for a count or a number, nor an int for a
switch, nor a float for a count (`4.0` is refused: a JSON writer that emits it has
lost the type).
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import math
import re
import urllib.parse
from typing import Any, Final, Protocol

import torch


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what to give."""


class WritePolicy(enum.Enum):
    """When a device node is backed up to host memory."""

    WRITE_THROUGH = "write_through"
    """On the first hit (insert counts as one)."""
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    """On the second hit."""
    WRITE_BACK = "write_back"
    """Only when evicting, before the device slots go."""


class HostLayout(enum.Enum):
    """How the host KV buffer is laid out."""

    LAYER_FIRST = "layer_first"
    """`[2, layers, slots, heads, head_dim]`, the same as the device buffer."""
    PAGE_FIRST = "page_first"
    """`[pages, 2, layers, page_size, heads, head_dim]`: one page is contiguous across all layers."""


class EvictionPolicy(enum.Enum):
    """Which evictable leaf goes first."""

    LRU = "lru"
    LFU = "lfu"
    FIFO = "fifo"
    PRIORITY = "priority"


class PrefetchPolicy(enum.Enum):
    """When a request with a storage prefetch in flight may run."""

    BEST_EFFORT = "best_effort"
    """At once, with whatever has arrived."""
    WAIT_COMPLETE = "wait_complete"
    """Only when the whole prefetch arrived."""
    TIMEOUT = "timeout"
    """When complete, or when its timeout expires."""


class StorageKind(enum.Enum):
    """Which storage (L3) backend the prefetcher talks to."""

    NONE = "none"
    """No L3 tier: nothing is prefetched or backed up to storage."""
    FILE = "file"
    """One checksummed file per page under `storage_dir` (shared by instances on one machine)."""
    MOONCAKE = "mooncake"
    """Mooncake Store: a master and its metadata server, shared by many machines."""


class DeviceKind(enum.Enum):
    """Where the device (L1) buffer lives."""

    CPU = "cpu"
    """A CPU tensor stands in for device memory."""
    CUDA = "cuda"
    """The current CUDA device."""


DTYPES: Final[dict[str, torch.dtype]] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

_INTEGER: Final = re.compile(r"[+-]?[0-9]{1,30}", re.ASCII)
"""Decimal digits, few enough that `int()` never meets its digit limit (every bound is far below)."""
_NUMBER: Final = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)
_TRUE: Final = frozenset({"true", "yes", "on", "1"})
_FALSE: Final = frozenset({"false", "no", "off", "0"})


class Rule(Protocol):
    """How one field turns a raw value into its value."""

    @property
    def allowed(self) -> str:
        """What the field accepts, in words (for errors and the reference page)."""
        ...

    def parse(self, name: str, value: Any) -> Any: ...


def refuse(name: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{name}={value!r} must be {allowed}")


@dataclasses.dataclass(frozen=True, slots=True)
class Count:
    """An integer in `lo..hi`; the upper bound keeps a typo from becoming an allocation."""

    lo: int
    hi: int

    @property
    def allowed(self) -> str:
        return f"an integer in {self.lo}..{self.hi}"

    def parse(self, name: str, value: Any) -> int:
        n = value
        if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
            n = int(value.strip())
        if isinstance(n, bool) or not isinstance(n, int) or not self.lo <= n <= self.hi:
            raise refuse(name, value, self.allowed)
        return n


@dataclasses.dataclass(frozen=True, slots=True)
class Number:
    """A finite number in `(0, hi]` (`[0, hi]` with `zero`): durations in seconds and fractions."""

    hi: float
    zero: bool = False

    @property
    def allowed(self) -> str:
        return f"a number >= 0 and <= {self.hi:g}" if self.zero else f"a number > 0 and <= {self.hi:g}"

    def parse(self, name: str, value: Any) -> float:
        x = value
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            x = float(value.strip())
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise refuse(name, value, self.allowed)
        try:
            x = float(x)
        except OverflowError:
            raise refuse(name, value, self.allowed) from None
        if not (math.isfinite(x) and (0 <= x if self.zero else 0 < x) and x <= self.hi):
            raise refuse(name, value, self.allowed)
        return x


@dataclasses.dataclass(frozen=True, slots=True)
class Switch:
    """On or off."""

    @property
    def allowed(self) -> str:
        return "true or false (or yes/no, on/off, 1/0)"

    def parse(self, name: str, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        word = value.strip().lower() if isinstance(value, str) else None
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise refuse(name, value, self.allowed)


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    """A member of an enum, or its value as a string."""

    enum_cls: type[enum.Enum]

    @property
    def allowed(self) -> str:
        return "one of " + ", ".join(str(m.value) for m in self.enum_cls)

    def parse(self, name: str, value: Any) -> enum.Enum:
        if isinstance(value, self.enum_cls):
            return value
        if isinstance(value, str):
            word = value.strip().lower()
            for member in self.enum_cls:
                if word == member.value:
                    return member
        raise refuse(name, value, self.allowed)


@dataclasses.dataclass(frozen=True, slots=True)
class DType:
    """An element type of `DTYPES`: its name (`"bfloat16"`, `"torch.bfloat16"`) or the `torch.dtype`.
    The name is what the config keeps, so `to_mapping()` stays plain data."""

    @property
    def allowed(self) -> str:
        return "one of " + ", ".join(DTYPES) + " (a name or the torch.dtype)"

    def parse(self, name: str, value: Any) -> str:
        if isinstance(value, torch.dtype):
            value_name = str(value).removeprefix("torch.")
            if DTYPES.get(value_name) is value:
                return value_name
        elif isinstance(value, str):
            word = value.strip().lower().removeprefix("torch.")
            if word in DTYPES:
                return word
        raise refuse(name, value, self.allowed)


@dataclasses.dataclass(frozen=True, slots=True)
class FilePath:
    """A filesystem path as given (whitespace kept); empty means unset."""

    @property
    def allowed(self) -> str:
        return "a path string without NUL characters (empty: unset)"

    def parse(self, name: str, value: Any) -> str:
        if not isinstance(value, str) or "\0" in value:
            raise refuse(name, value, self.allowed)
        return value


class ModelId:
    """A model's name as an engine knows it: any printable text (empty means unset)."""

    @property
    def allowed(self) -> str:
        return (f"printable text of at most {MODEL_ID_CHARS_MAX} characters, like 'meta-llama/Llama-3.1-8B' "
                "(empty: unset)")

    def parse(self, name: str, value: Any) -> str:
        if not isinstance(value, str) or len(value) > MODEL_ID_CHARS_MAX or not value.isprintable():
            raise refuse(name, value, self.allowed)
        return value


MODEL_ID_CHARS_MAX: Final = 1024
"""Longest `Config.model_id`: a hub id, a path, or a name with a revision."""


@dataclasses.dataclass(frozen=True, slots=True)
class Host:
    """A host name or IP address, as another machine reaches this one."""

    @property
    def allowed(self) -> str:
        return "a host name or IP address (no port, no scheme)"

    def parse(self, name: str, value: Any) -> str:
        host = value.strip() if isinstance(value, str) else ""
        if not _HOST.fullmatch(host):
            try:
                ipaddress.ip_address(host)  # an IPv6 address, which binds and names without brackets here
            except ValueError:
                raise refuse(name, value, self.allowed) from None
        return host


@dataclasses.dataclass(frozen=True, slots=True)
class HostPort:
    """`host:port` (an IPv6 host in brackets), the port in 1..65535."""

    @property
    def allowed(self) -> str:
        return "host:port with a port in 1..65535, like 10.0.0.1:50051"

    def parse(self, name: str, value: Any) -> str:
        text = value.strip() if isinstance(value, str) else ""
        host, _, port = text.rpartition(":")
        if not _port_ok(port) or not _host_ok(host):
            raise refuse(name, value, self.allowed)
        return text


@dataclasses.dataclass(frozen=True, slots=True)
class HttpUrl:
    """An `http://host[:port]/path` URL, the port (if given) in 1..65535."""

    @property
    def allowed(self) -> str:
        return "an http:// URL with a host (and a port in 1..65535, if any), like http://10.0.0.1:8080/metadata"

    def parse(self, name: str, value: Any) -> str:
        text = value.strip() if isinstance(value, str) else ""
        try:  # urlsplit refuses some malformed IPv6 hosts itself, with a ValueError
            netloc = urllib.parse.urlsplit(text).netloc if text.startswith("http://") else ""
        except ValueError:
            netloc = ""
        host, port = netloc, ""
        if netloc.rfind(":") > netloc.rfind("]"):  # a port after the host (an IPv6 host's colons are in brackets)
            host, _, port = netloc.rpartition(":")
        if not _host_ok(host) or (port and not _port_ok(port)) or (not port and netloc.endswith(":")) \
                or any(c.isspace() for c in text):
            raise refuse(name, value, self.allowed)
        return text


@dataclasses.dataclass(frozen=True, slots=True)
class Name:
    """A short name that labels what an instance reports: letters, digits, `_`, `-` and `.`."""

    @property
    def allowed(self) -> str:
        return "1 to 64 letters, digits, '_', '-' or '.'"

    def parse(self, name: str, value: Any) -> str:
        text = value.strip() if isinstance(value, str) else ""
        if not _NAME.fullmatch(text):
            raise refuse(name, value, self.allowed)
        return text


_NAME: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _host_ok(host: str) -> bool:
    """A host name, an IPv4 address, or an IPv6 address in brackets."""
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    return _HOST.fullmatch(host) is not None


_HOST: Final = re.compile(r"[A-Za-z0-9_.-]+")


def _port_ok(port: str) -> bool:
    return _INTEGER.fullmatch(port) is not None and port[0] not in "+-" and 1 <= int(port) <= 65535
