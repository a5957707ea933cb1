"""The values the facade hands a scheduler, its errors, and the checks of its arguments.

Every argument of a facade call is checked here before anything reaches an actor:
a wrong type or a value out of range is one `RequestError` that names the argument
and the value, and the actors never see it.
"""

from __future__ import annotations


import ctypes
import dataclasses
import enum
import operator
import reprlib
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy
import torch

from hicache.actors import Insufficient  # noqa: F401  (re-exported: the facade returns the device core's value)
from hicache.messages import (
    DeviceStatistics,
    Durations,
    Tokens,
    HostStatistics,
    PrefetcherStatistics,
    StreamStatistics,
    TreeStatistics,
)
from hicache.messages._registry import frozen_fast_init
from hicache.messages.config import SECONDS_MAX

TOKEN_ID_MAX = 2**63 - 1
"""Token ids travel as int64: 0 .. 2**63 - 1."""

_FEW_TOKENS = 64
"""Token lists up to this long are checked in plain Python (an array call costs more)."""
_SIGN_BYTES_MAX = 2048
"""Up to this many ids, a sign check reads their high bytes (`_negative`); numpy's minimum
over more, where the strided copy costs more than numpy's pass (about 10 against 4 µs at
14,000 ids)."""
_FEW_TENSOR_TOKENS = 16
"""CPU tensors of another dtype than int64 up to this long are read as a list (one torch call)
and checked in Python."""
_LITTLE_ENDIAN = sys.byteorder == "little"
"""A contiguous int64 CPU tensor's memory is already the wire's little-endian int64 bytes."""
_NUMPY_INT64 = numpy.dtype("<i8")
"""Little-endian int64: the only numpy ids a commit compares with its prompt as they lie."""

COUNT_MAX = 2**62
"""Largest count of tokens or slots a call may name (more than any pool; fits every wire field)."""

_TOKEN_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}
                          | {getattr(torch, n) for n in ("uint16", "uint32") if hasattr(torch, n)})
"""Tensor dtypes that hold token ids losslessly as int64."""


class RequestError(ValueError):
    """A facade call was malformed or named a request in a way its lifecycle does not allow."""


class ExpiredHandleError(RequestError):
    """A handle was used after `cache_unfinished` replaced it or its request ended."""


class CacheStateError(RuntimeError):
    """The cache is not running (not started yet, or closed), or is called from a second thread."""


@frozen_fast_init
@dataclass(frozen=True, slots=True)
class CacheHandle:
    """Opaque: what a request holds while it lives. Pass it to finish, abort, retract, cache."""

    request_id: str
    _token: int


TokenIds = Sequence[int] | torch.Tensor | numpy.ndarray
"""Token ids as a caller may give them (`token_bytes` says which of each it takes)."""


@frozen_fast_init
@dataclass(frozen=True, slots=True)
class Request:
    """A request to admit: its id, prompt tokens and namespace (model / LoRA / cache salt).

    Admit what the engine will not recompute: an engine computes at least the last prompt
    token to get its logits, so it admits `tokens[:-1]` (see the README)."""

    request_id: str
    tokens: TokenIds
    namespace: str = ""


@frozen_fast_init
@dataclass(frozen=True, slots=True)
class AdmitResult:
    request_id: str
    handle: CacheHandle
    device_indices: torch.Tensor
    """Slots of the cached prefix (`cached_tokens` of them); loads into some may still run."""
    device_hit: int
    """Prefix tokens already in device memory (L1)."""
    host_hit: int
    """Prefix tokens loaded back from host memory now (wait per layer before reading them),
    including those this request's storage prefetch brought there (`storage_hit`)."""
    host_miss: int
    """Tokens in host memory that were not loaded back (quota, minimum length)."""
    storage_hit: int = 0
    """Of `host_hit`, the tokens this request's storage prefetch read from L3 (so L2 served
    `host_hit - storage_hit` and L3 `storage_hit`); the prefetched pages are the last of those
    found in host memory, so those not loaded back (`host_miss`) are not counted."""

    @property
    def cached_tokens(self) -> int:
        return self.device_hit + self.host_hit


@dataclass(frozen=True, slots=True)
class Closed:
    """What `HiCache.close` did with the work in flight."""

    drained: bool
    """Every write to host and backup to storage in flight landed before the actors stopped."""
    writes_dropped: int
    """Writes to host memory still in flight when the actors stopped (-1: unknown, an actor had failed)."""
    backups_dropped: int
    """Backups to storage still in flight when the actors stopped, their pages not stored (-1: unknown,
    an actor had failed)."""
    actors_left: tuple[str, ...] = ()
    """Actors that did not stop within 60 s, still in a handler (a storage call that hangs, say):
    left behind, their threads end on their own (each is logged as an error). The cache may start
    again meanwhile."""


@dataclass(frozen=True, slots=True)
class Room:
    """What `HiCache.room` returns: the device slots an allocation could get now, for
    admission control. Each figure is a whole number of pages."""

    free_slots: int
    """Slots in free device pages."""
    evictable_slots: int
    """Device slots of cached tokens no request holds (the tree's `evictable_tokens`): what
    an allocation's eviction frees."""
    ahead_slots: int
    """Slots in the pages live requests hold ahead for their decode steps (`Config.ahead_slots`),
    which an allocation that comes up short takes back."""

    @property
    def available_slots(self) -> int:
        """`free_slots + evictable_slots + ahead_slots`: the most one `allocate` gets in new pages
        without `Insufficient` (a request also gets what its own last page has left)."""
        return self.free_slots + self.evictable_slots + self.ahead_slots


@dataclass(frozen=True, slots=True)
class TierStatistics:
    """One tier's numbers: tokens since start, capacity now.

    A tier is asked for the tokens every tier above it missed: L1 for every token looked
    up, L2 for those L1 missed, L3 for those L1 and L2 missed."""

    tier: str
    """`L1` (device memory), `L2` (host memory) or `L3` (storage)."""
    requested_tokens: int
    """Prompt tokens looked up in this tier (the ones the tiers above it missed)."""
    hit_tokens: int
    """Of those, the tokens this tier served (L2, L3: once their load-back landed; L3: read
    by the request's prefetch). A host hit whose load-back failed is no tier's."""
    evicted_tokens: int
    """Tokens evicted from this tier (L3: pages the file backend evicted, in tokens)."""
    used_tokens: int | None
    """Token slots in use now (None for L3, which counts bytes)."""
    capacity_tokens: int | None
    """Token slots of the tier (None for L3)."""
    used_bytes: int
    """KV bytes in use now (L3: bytes the storage takes for this KV shape; 0 for Mooncake)."""
    capacity_bytes: int | None
    """KV bytes the tier holds at most (L3: `storage_max_bytes`; None when unbounded)."""

    @property
    def hit_rate(self) -> float:
        """`hit_tokens / requested_tokens` (0.0 before any request)."""
        return self.hit_tokens / self.requested_tokens if self.requested_tokens else 0.0


@dataclass(frozen=True, slots=True)
class HiCacheStatistics:
    """What `HiCache.statistics()` returns: per tier, then each actor's own record."""

    looked_up_tokens: int
    """Prompt tokens admissions looked up (hit or not)."""
    l1: TierStatistics
    l2: TierStatistics | None
    """None without a host tier."""
    l3: TierStatistics | None
    """None without storage."""
    tree: TreeStatistics
    device: DeviceStatistics
    host: HostStatistics
    write: StreamStatistics
    load: StreamStatistics
    prefetch: PrefetcherStatistics
    load_back_wait: Durations
    """Seconds the forward pass waited for each loaded layer (`LayerWaiter.wait_layer` of a
    batch that loads); counted only with `Config.metrics`."""
    facade_calls: Mapping[str, Durations]
    """Seconds of each facade call, by method name; counted only with `Config.metrics`."""

    @property
    def tiers(self) -> tuple[TierStatistics, ...]:
        """The configured tiers, top down."""
        return tuple(t for t in (self.l1, self.l2, self.l3) if t is not None)

    @property
    def hit_tokens(self) -> int:
        """Tokens served by any tier."""
        return sum(t.hit_tokens for t in self.tiers)

    @property
    def hit_rate(self) -> float:
        """`hit_tokens / looked_up_tokens` (0.0 before any request)."""
        return self.hit_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain values for JSON: every field, nested records as objects, and the hit rates."""
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        for name in ("l1", "l2", "l3"):
            tier = getattr(self, name)
            if tier is not None:
                out[name]["hit_rate"] = tier.hit_rate
        out["hit_tokens"], out["hit_rate"] = self.hit_tokens, self.hit_rate
        return out


def _plain(value: Any) -> Any:
    """A statistics value as JSON takes it (records become objects, enums their values)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


# -- argument checks ---------------------------------------------------------------------


_BRIEF = reprlib.Repr()
_BRIEF.maxstring = _BRIEF.maxother = 80


def shown(value: Any) -> str:
    """`value` as an error message names it: its repr on one line (a 2-D array's has several),
    long ones cut short."""
    return " ".join(_BRIEF.repr(value).split())


def request_id(value: Any, what: str = "request_id") -> str:
    if type(value) is not str or not value:
        raise RequestError(f"{what} must be a non-empty str, got {shown(value)}")
    if not value.isascii():
        _encodable(value, what)
    return value


def namespace(value: Any) -> str:
    if type(value) is not str:
        raise RequestError(f"namespace must be a str (\"\" for the default), got {shown(value)}")
    if not value.isascii():
        _encodable(value, "namespace")
    return value


def _encodable(value: str, what: str) -> None:
    """A name the cache keys KV by and the log records as UTF-8: a lone surrogate (from a
    bytes-to-str decode with `surrogateescape`, say) cannot be encoded."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{what} must be text UTF-8 can encode (no lone surrogates), got {shown(value)}") from None


def count(what: str, value: Any, maximum: int) -> int:
    """A number of tokens or slots: an int (not a bool) in 0..maximum."""
    if type(value) is int and 0 <= value <= maximum:
        return value
    if type(value) is bool or not hasattr(type(value), "__index__") or getattr(value, "ndim", 0):
        # (an array or tensor of one integer element has `__index__` too; a 0-d one is a scalar)
        raise RequestError(f"{what} must be an int, got {shown(value)}")
    try:
        n = operator.index(value)
    except TypeError:
        raise RequestError(f"{what} must be an int, got {shown(value)}") from None
    if not 0 <= n <= maximum:
        raise RequestError(f"{what} must be in 0..{maximum}, got {n}")
    return n


def seconds(what: str, value: Any) -> float:
    """A wait in seconds: an int or float in (0, `SECONDS_MAX`] (not a bool)."""
    if type(value) is bool or not isinstance(value, (int, float)) or not 0 < value <= SECONDS_MAX:
        raise RequestError(f"{what} must be a number of seconds above 0 and at most {SECONDS_MAX:g}, "
                           f"got {shown(value)}")
    return float(value)


def switch(what: str, value: Any) -> bool:
    if type(value) is not bool:
        raise RequestError(f"{what} must be True or False, got {shown(value)}")
    return value


def token_bytes(tokens: Any, what: str, request_id: str | None = None) -> bytes:
    """Token ids as little-endian int64 bytes: a 1-D integer tensor or numpy array, or a
    sequence of ints, every id in 0..2**63 - 1. Anything else (floats, bools, strings, None,
    a 2-D tensor, an id out of range) is a `RequestError` naming `what` (and `request_id`:
    the name is put together only for the error)."""
    if type(tokens) is list and len(tokens) == 1:  # a decode step's one token: no array
        token = tokens[0]
        if type(token) is int and 0 <= token <= TOKEN_ID_MAX:
            return token.to_bytes(8, "little")
    try:
        if isinstance(tokens, torch.Tensor):
            return _tensor_token_bytes(tokens)
        if isinstance(tokens, numpy.ndarray):
            return _numpy_token_bytes(tokens)
        return _sequence_token_bytes(tokens)
    except _BadTokens as bad:
        name = what if request_id is None else f"{what} {request_id!r}"
        raise RequestError(f"{name}{bad}") from None


class _BadTokens(Exception):
    """What is wrong with some token ids, as the end of a sentence naming them."""


def _sequence_token_bytes(tokens: Any) -> bytes:
    if type(tokens) is array and tokens.typecode == "q" and _LITTLE_ENDIAN:  # int64s already: their bytes
        return _nonnegative(tokens.tobytes(), len(tokens))
    if type(tokens) is not list and (isinstance(tokens, (str, bytes, bytearray))
                                     or not isinstance(tokens, (Sequence, array, range))):
        raise _BadTokens(f" must be a 1-D integer tensor or numpy array, or a sequence of ints, "
                         f"got {type(tokens).__name__}")
    # One pass in C packs the ids (struct's, about three times as fast as an array's), refusing
    # what is not an integer (a float, a string, None) and what does not fit in int64; numpy
    # and other integer scalars pack by `__index__`. Only a bool packs where it should not, as
    # 0 or 1: the ids packed as 0 or 1 are looked at one by one (a prompt's few special
    # tokens), not every id's type.
    n = len(tokens)
    try:
        data = struct.pack(f"<{n}q", *tokens)
    except (struct.error, TypeError, OverflowError):
        _refuse_ids(tokens)
    if n and type(tokens) is not range and type(tokens) is not array:
        if n <= _FEW_TOKENS:
            suspects: Any = (i for i, t in enumerate(tokens) if t == 0 or t == 1)
        else:
            suspects = numpy.flatnonzero(numpy.frombuffer(data, dtype=numpy.uint64) <= 1).tolist()
        for i in suspects:
            if type(tokens[i]) is bool:
                raise _BadTokens(f" must be int token ids, got {shown(tokens[i])} (bool)")
    return _nonnegative(data, n)


def _numpy_token_bytes(a: numpy.ndarray) -> bytes:
    """A 1-D numpy array of a dtype that holds token ids losslessly (as `_TOKEN_DTYPES`
    allows for tensors): its ids as int64 bytes, one copy (its own bytes when it is a
    contiguous little-endian int64 array), and one pass for the sign."""
    if a.ndim != 1:
        raise _BadTokens(f" must be one sequence of token ids, got an array of shape {a.shape}")
    if a.dtype.kind not in "iu" or (a.dtype.kind == "u" and a.dtype.itemsize == 8):
        raise _BadTokens(f" must hold integer token ids, got an array of dtype {a.dtype} (use numpy.int64)")
    n = a.shape[0]
    if not n:
        return b""
    return _nonnegative(a.astype("<i8", copy=False).tobytes(), n)


def _refuse_ids(tokens: Any) -> NoReturn:
    """Raise `_BadTokens` naming the first id of `tokens` that does not pack as an int64."""
    for t in tokens:
        if type(t) is bool or not hasattr(type(t), "__index__"):
            raise _BadTokens(f" must be int token ids, got {shown(t)} ({type(t).__name__})")
        try:
            value = operator.index(t)
        except TypeError:  # an integer-like that is not one (a 0-d float tensor, say)
            raise _BadTokens(f" must be int token ids, got {shown(t)} ({type(t).__name__})") from None
        if not 0 <= value <= TOKEN_ID_MAX:
            raise _BadTokens(f": token ids must be ints in 0..{TOKEN_ID_MAX} (got {value})")
    raise _BadTokens(f" must be int token ids in 0..{TOKEN_ID_MAX}")  # pragma: no cover - struct refused one of them


def _nonnegative(data: bytes, n: int) -> bytes:
    """`data`, `n` ids as little-endian int64 bytes, if none is negative; else `_BadTokens`
    naming the smallest. Every form of token ids ends here once it is bytes."""
    if n and _negative(data, n):
        raise _BadTokens(f": token ids must be in 0..{TOKEN_ID_MAX}, got {_lowest(data, n)}")
    return data


def _negative(ids: bytes, n: int) -> bool:
    """Whether one of `n` ids, as little-endian int64 bytes, is negative: the top bit of its
    last byte. Up to `_SIGN_BYTES_MAX` ids, one strided copy of those bytes and one ASCII
    test (0.1-0.2 µs for a decode step's id, where a `min` over them is 0.5-1); numpy's
    minimum over more."""
    if n <= _SIGN_BYTES_MAX:
        return not ids[7::8].isascii()
    return bool(numpy.minimum.reduce(numpy.frombuffer(ids, dtype=numpy.int64)) < 0)


def _lowest(ids: bytes, n: int) -> int:
    """The smallest of `n` ids, as little-endian int64 bytes (for an error's message)."""
    return int(numpy.minimum.reduce(numpy.frombuffer(ids, dtype=numpy.int64, count=n)))


def _tensor_token_bytes(t: torch.Tensor) -> bytes:
    if t.dim() != 1:
        raise _BadTokens(f" must be one sequence of token ids, got a tensor of shape {tuple(t.shape)}")
    if t.dtype not in _TOKEN_DTYPES:
        raise _BadTokens(f" must hold integer token ids, got a {t.dtype} tensor (use torch.int64)")
    n = t.shape[0]  # the shape, not len(): torch's __len__ is a Python wrapper
    if not n:
        return b""
    if t.is_cpu and t.dtype is torch.int64 and _LITTLE_ENDIAN and t.is_contiguous():
        data = ctypes.string_at(t.data_ptr(), 8 * n)  # the one copy, straight from the tensor's memory
    elif n <= _FEW_TENSOR_TOKENS and t.is_cpu:  # a decode step's token: one torch call, then Python
        data = struct.pack(f"<{n}q", *t.tolist())
    elif t.is_cpu:  # as a numpy array (its view, copy and minimum: cheaper calls than torch's)
        return _numpy_token_bytes((t.detach() if t.requires_grad else t).numpy())
    else:
        data = Tokens.from_tensor(t).to_bytes()  # one copy; it converts the dtype and device itself
    return _nonnegative(data, n)


def prompt_continued(prompt: bytes, at: int, tokens: Any) -> tuple[int, bytes] | None:
    """How committed `tokens` continue a request's admitted prompt (`prompt`, its checked int64
    bytes) from token `at`, when they are int64s as they lie in memory (a contiguous CPU tensor,
    numpy array or `array("q")`; a prefill's part of the prompt, say): `(m, rest)`, where the
    first `m` tokens are the prompt's from `at` on (one comparison of bytes, no copy, no check:
    the prompt's were checked) and `rest` is the bytes of the others. None for any other form
    of tokens, when they differ from the prompt's where both have tokens, or when `rest` holds
    a negative id: `token_bytes` takes those, as any commit (and names what is wrong)."""
    kind = type(tokens)
    if kind is torch.Tensor:
        if tokens.dtype is not torch.int64 or not tokens.is_cpu or tokens.dim() != 1 or not tokens.is_contiguous():
            return None  # (an int64 tensor never requires grad: `numpy()` takes it)
        ids = memoryview(tokens.numpy())
    elif kind is numpy.ndarray:
        if tokens.dtype != _NUMPY_INT64 or tokens.ndim != 1 or not tokens.flags.c_contiguous:
            return None
        ids = memoryview(tokens)
    elif kind is array:
        if tokens.typecode != "q":  # as `token_bytes` reads int64s as they lie
            return None
        ids = memoryview(tokens)
    else:
        return None
    n = len(ids)
    m = min(n, len(prompt) // 8 - at)
    if m <= 0 or not _LITTLE_ENDIAN or not prompt.startswith(ids[:m], 8 * at):
        return None
    if m == n:
        return m, b""
    rest = ids[m:].tobytes()
    return None if _negative(rest, n - m) else (m, rest)


def demands(value: Any, what: str, maximum: int) -> dict[str, int]:
    """`{request_id: count}` with every key and count checked."""
    if type(value) is not dict and not isinstance(value, Mapping):
        raise RequestError(f"{what} must be a mapping of request id to count, got {type(value).__name__}")
    out = {}
    for rid, n in value.items():
        if type(rid) is not str or not rid or type(n) is not int or not 0 <= n <= maximum:
            rid, n = request_id(rid, f"a request id in {what}"), count(f"{what}[{rid!r}]", n, maximum)
        out[rid] = n  # (the names in the errors are put together only for an error)
    return out
