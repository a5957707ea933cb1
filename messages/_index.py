"""`Indices`: an immutable sequence of slot indices that can travel in a message.

Inside it is the little-endian int64 bytes of the indices, so a message never
holds a list or a tensor, the codec ships the bytes as they are, and a pool turns
them back into a tensor without a copy.

A slice that keeps most of a large value (`VIEW_FRACTION` of it, `VIEW_BYTES_MIN`
bytes or more) is a read-only view of the same bytes, as a prompt without its last
token is; any other slice is a copy of its part, so that a small slice never keeps a
large value's bytes alive. Either way the value is immutable: its bytes are a
`bytes` object's.

`Indices.concat` (and `Tokens.concat`) of several parts of `JOIN_LAZY_BYTES_MIN` bytes or
more joins them when something first reads the bytes; its length, its slices and the
span of a prefix held by its first part (`head_span`) need none, so a scheduler that
joins a cached prefix's slots to new ones and hands the tree the new part copies
nothing, and neither does a request's tokens' way to the tree (`view_then`: a view of
its prompt's bytes and what it committed past them). Such a value is an `Indices` (or
a `Tokens`) like any other to every reader.
"""

from __future__ import annotations

import ctypes
from array import array
import sys
import warnings
from collections.abc import Iterable
from typing import Final

import torch

_ITEM_BYTES: Final = 8
_LITTLE: Final = sys.byteorder == "little"
VIEW_BYTES_MIN: Final = 4096
"""Slices of values at least this large may be views (smaller ones copy in the time a view takes)."""
VIEW_FRACTION: Final = 0.5
"""A slice keeping at least this fraction of the bytes under it is a view of them: what a
view keeps alive beyond itself is at most as much again."""


def viewed(size: int, whole: int) -> bool:
    """The slice rule: whether a part of `size` bytes of a `whole`-byte object is kept as a
    view of it (else a copy of the part). A value's slices and the radix tree's node keys
    follow it, and the facade asks it where a commit would become such a part."""
    return size >= VIEW_BYTES_MIN and size >= VIEW_FRACTION * whole


JOIN_LAZY_BYTES_MIN: Final = VIEW_BYTES_MIN
"""`Indices.concat` of at least this many bytes in several parts is joined when first read
(smaller ones are joined at once, in less time than the lazy value takes to make)."""

with warnings.catch_warnings():
    # torch warns, once per process, when it wraps a buffer it cannot write to (the bytes of
    # every `Indices`; the contract of `as_tensor` is the guard). Spend that warning here so
    # that `as_tensor` needs no `catch_warnings`, which costs more than the wrapping itself.
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(bytes(_ITEM_BYTES), dtype=torch.int64)


class Indices:
    """Slot indices as an immutable value: hashable, comparable, cheap to ship.

    Build one with `Indices.of(...)`, `Indices.from_tensor(...)`,
    `Indices.from_range(...)` or `Indices.from_pages(...)`; read it with
    `as_tensor()` (zero-copy) or `tolist()`.
    """

    __slots__ = ("_at", "_data")

    _data: bytes | memoryview
    """The bytes, or a read-only byte view of part of a `bytes` object (a large slice)."""
    _at: int
    """A view's: where its bytes start in that object (unset for a value of its own bytes)."""

    def __init__(self, data: bytes = b"") -> None:
        if not isinstance(data, bytes):
            raise TypeError(f"Indices wants bytes of int64, got {type(data).__name__}")
        if len(data) % _ITEM_BYTES:
            raise ValueError(
                f"Indices bytes must be a multiple of 8 (int64), got {len(data)} bytes"
            )
        object.__setattr__(self, "_data", data)

    # -- construction -------------------------------------------------------

    @classmethod
    def of(cls, values: Iterable[int]) -> Indices:
        """Indices from Python integers (a float or other non-integer raises TypeError)."""
        packed = array("q", values if type(values) is list else list(values))  # checks each is an int
        if not _LITTLE:  # pragma: no cover - every supported host is little-endian
            packed.byteswap()
        return cls._wrap(packed.tobytes())

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Indices:
        """Indices from a 1-D integer tensor (copied once into immutable bytes)."""
        if tensor.dtype is torch.int64 and tensor.is_cpu and tensor.dim() == 1 and _LITTLE and tensor.is_contiguous():
            # The common case, few checks: its memory is the bytes, copied once (a bytes object
            # made straight from it costs less than numpy's view and copy, or a pack of its ints).
            n = tensor.shape[0]  # not len(): torch's __len__ is a Python wrapper
            return cls._wrap(ctypes.string_at(tensor.data_ptr(), 8 * n) if n else b"")
        if tensor.dim() != 1:
            raise ValueError(f"Indices need a 1-D tensor, got shape {tuple(tensor.shape)}")
        if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
            raise TypeError(f"Indices need an integer tensor, got {tensor.dtype}")
        flat = tensor.detach().to(device="cpu", dtype=torch.int64).contiguous()
        if not _LITTLE:  # pragma: no cover - every supported host is little-endian
            flat = flat.byteswap()  # type: ignore[attr-defined]
        return cls(_tensor_bytes(flat))

    @classmethod
    def from_range(cls, start: int, count: int) -> Indices:
        """The contiguous indices `start, start + 1, ..., start + count - 1`."""
        return cls.from_tensor(torch.arange(start, start + count, dtype=torch.int64))

    @classmethod
    def from_pages(cls, pages: torch.Tensor | Iterable[int], page_size: int) -> Indices:
        """All slots of the given pages, in page order."""
        p = pages if isinstance(pages, torch.Tensor) else torch.tensor(list(pages), dtype=torch.int64)
        slots = p.to(torch.int64).unsqueeze(1) * page_size + torch.arange(page_size)
        return cls.from_tensor(slots.reshape(-1))

    @classmethod
    def concat(cls, parts: Iterable[Indices]) -> Indices:
        """The indices of all parts, one after another (a lone non-empty part of this class as it is).

        Indices (or `Tokens`) of at least `JOIN_LAZY_BYTES_MIN` bytes in several parts are joined
        only when something reads their bytes; a slice within one part is that part's slice, so
        that a cached prefix's slots joined to new ones and sliced back to the new ones copies
        nothing, and a request's tokens that are mostly a view of its prompt's are not copied
        on their way to the tree."""
        parts = parts if type(parts) is list else list(parts)
        lazy = _LAZY.get(cls)
        if len(parts) > 1:  # an empty part adds nothing: a cached prefix of none, say
            parts = [p for p in parts if type(p) is lazy or p._data]  # a lazy value is never empty
        if len(parts) == 1 and (type(parts[0]) is cls or type(parts[0]) is lazy):
            return parts[0]  # as joining one bytes object would return it, and a view is not copied
        if lazy is not None and len(parts) > 1:
            flat: list[Indices] = []
            size = 0
            for p in parts:
                if type(p) is lazy and p._parts is not None:
                    flat += p._parts
                    size += p._n * _ITEM_BYTES
                else:
                    flat.append(p)
                    size += len(p._data)
            if size >= JOIN_LAZY_BYTES_MIN:
                return lazy._of(tuple(flat), size // _ITEM_BYTES)
            parts = flat
        return cls._wrap(b"".join([p._data for p in parts]))

    @classmethod
    def view_then(cls, data: bytes, lo: int, hi: int, tail: bytes) -> Indices:
        """The items of `data[lo:hi]` (whole int64s), then those of `tail`: a lazy join of a
        view of the first and `tail`, which copies neither; at most `JOIN_LAZY_BYTES_MIN`
        bytes in all, one copy. A view whatever its share of `data`: for a caller that holds
        `data` as long as the value anyway (a request's prompt, while it is live)."""
        if type(data) is not bytes or type(tail) is not bytes or lo % _ITEM_BYTES or hi % _ITEM_BYTES \
                or len(tail) % _ITEM_BYTES or not 0 <= lo <= hi <= len(data):
            raise ValueError(f"view_then needs bytes, 0 <= lo <= hi <= len(data) at int64 boundaries and a tail of "
                             f"whole int64s, got lo={lo}, hi={hi}, {len(data)} and {len(tail)} bytes")
        if hi - lo + len(tail) < JOIN_LAZY_BYTES_MIN or hi <= lo:
            return cls._wrap(data[lo:hi] + tail)
        head = cls._wrap(memoryview(data)[lo:hi])
        object.__setattr__(head, "_at", lo)
        if not tail:
            return head
        return _LAZY[cls]._of((head, cls._wrap(tail)), (hi - lo + len(tail)) // _ITEM_BYTES)

    @classmethod
    def _wrap(cls, data: bytes | memoryview) -> Indices:
        """An instance over `data` already known to be whole int64s (the bytes of other
        instances, or a slice of them at item boundaries): no checks to repeat."""
        out = object.__new__(cls)
        object.__setattr__(out, "_data", data)
        return out

    # -- reading ------------------------------------------------------------

    def as_tensor(self) -> torch.Tensor:
        """A zero-copy int64 CPU tensor over the bytes. Treat it as read-only:
        writing into it would change a value that other messages share."""
        if not self._data:
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(self._data, dtype=torch.int64)

    def to_tensor(self) -> torch.Tensor:
        """A new, writable int64 CPU tensor of the indices (a copy the caller owns)."""
        if not self._data:
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(bytearray(self._data), dtype=torch.int64)

    def tolist(self) -> list[int]:
        """The indices as Python ints (read from the bytes, no tensor)."""
        unpacked = array("q")
        unpacked.frombytes(self._data)
        if not _LITTLE:  # pragma: no cover - every supported host is little-endian
            unpacked.byteswap()
        return unpacked.tolist()

    def to_bytes(self) -> bytes:
        """The little-endian int64 bytes (a copy when this value is a view of a larger one's)."""
        data = self._data
        return data if type(data) is bytes else data.tobytes()

    def buffer(self) -> bytes | memoryview:
        """The bytes without a copy: `bytes`, or a read-only memoryview of them (a view's)."""
        return self._data

    def span(self) -> tuple[bytes, int, int]:
        """`(data, start, stop)`: the bytes are `data[start:stop]`, without a copy."""
        data = self._data
        if type(data) is bytes:
            return data, 0, len(data)
        return data.obj, self._at, self._at + len(data)

    def head_span(self, n: int) -> tuple[bytes, int, int]:
        """`span()` of the first `n` items (at most `len(self)`): for a lazy join whose first
        part holds them, that part's, so that reading a prefix joins nothing."""
        if not 0 <= n <= len(self):
            raise ValueError(f"head_span of {n} items of a value of {len(self)}")
        data, start, _ = self.span()
        return data, start, start + n * _ITEM_BYTES

    def __getitem__(self, key: slice) -> Indices:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("Indices support contiguous slices only, e.g. idx[2:10]")
        data = self._data
        start, stop, _ = key.indices(len(data) // _ITEM_BYTES)
        lo, hi = start * _ITEM_BYTES, max(start, stop) * _ITEM_BYTES
        if hi - lo == len(data):
            return self
        under = len(data) if type(data) is bytes else len(data.obj)
        if viewed(hi - lo, under):
            if type(data) is bytes:
                out, at = self._wrap(memoryview(data)[lo:hi]), lo
            else:
                out, at = self._wrap(data[lo:hi]), self._at + lo
            object.__setattr__(out, "_at", at)
            return out
        return self._wrap(bytes(data[lo:hi]) if type(data) is not bytes else data[lo:hi])

    def __len__(self) -> int:
        return len(self._data) // _ITEM_BYTES

    def __bool__(self) -> bool:
        return bool(self._data)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self) and _kind(other) is not _kind(self):
            return False
        mine, theirs = self._data, other._data  # type: ignore[attr-defined]
        if type(mine) is bytes and type(theirs) is bytes:
            return mine == theirs
        if len(mine) != len(theirs):
            return False
        # One memcmp where a view is involved (memoryview's own == compares item by item).
        data, start, stop = self.span()
        return data.startswith(theirs, start, stop)

    def __hash__(self) -> int:
        return hash(self._data)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Indices are immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Indices are immutable")

    def __repr__(self) -> str:
        n = len(self)
        if n <= 8:
            return f"{_kind(self).__name__}({self.tolist()})"
        head = self.as_tensor()[:4].tolist()
        return f"{_kind(self).__name__}([{', '.join(map(str, head))}, ...] n={n})"

    def __reduce__(self) -> tuple[type[Indices], tuple[bytes]]:
        return (type(self), (self.to_bytes(),))


def _tensor_bytes(flat: torch.Tensor) -> bytes:
    """The raw bytes of a contiguous CPU int64 tensor, copied once (no numpy)."""
    n = flat.numel() * _ITEM_BYTES
    return ctypes.string_at(flat.data_ptr(), n) if n else b""


class _Joined(Indices):
    """`Indices.concat` of several parts, joined into one bytes object the first time
    something reads the bytes (then it is an ordinary value). Until then its length and
    its slices need no bytes: a slice within one part is that part's slice (a view or a
    copy by the rule of slices), one across parts another lazy value of the parts' slices.
    Equal, hashed, encoded and pickled as the `Indices` of the same numbers."""

    __slots__ = ("_parts", "_n")

    _parts: tuple[Indices, ...] | None
    """The parts, each a non-empty value with bytes of its own (None once joined)."""
    _n: int

    @classmethod
    def _of(cls, parts: tuple[Indices, ...], n: int) -> _Joined:
        out = object.__new__(cls)
        object.__setattr__(out, "_parts", parts)
        object.__setattr__(out, "_n", n)
        return out

    @classmethod
    def _wrap(cls, data: bytes | memoryview) -> Indices:
        return Indices._wrap(data)  # what the base class's slices make of the joined bytes: plain values

    def head_span(self, n: int) -> tuple[bytes, int, int]:
        parts = self._parts
        if parts is not None and 0 <= n <= len(parts[0]):
            return parts[0].head_span(n)
        return Indices.head_span(self, n)

    def __getattr__(self, name: str) -> bytes:
        # Only `_data` is ever unset (until the first read of the bytes, which joins them).
        if name != "_data":
            raise AttributeError(f"'Indices' object has no attribute {name!r}")
        data = b"".join([p._data for p in self._parts])  # type: ignore[union-attr]
        object.__setattr__(self, "_data", data)
        object.__setattr__(self, "_parts", None)
        return data

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __getitem__(self, key: slice) -> Indices:
        parts = self._parts
        if parts is None or type(key) is not slice or key.step not in (None, 1):
            return Indices.__getitem__(self, key)
        start, stop, _ = key.indices(self._n)
        if stop - start >= self._n:
            return self
        if stop <= start:
            return self._wrap(b"")
        pieces, at = [], 0
        for p in parts:
            end = at + len(p._data) // _ITEM_BYTES
            if start < end and stop > at:
                pieces.append(p[start - at if start > at else 0 : stop - at])
            at = end
        return pieces[0] if len(pieces) == 1 else type(self)._of(tuple(pieces), stop - start)

    def __reduce__(self) -> tuple[type[Indices], tuple[bytes]]:
        return (_kind(self), (self.to_bytes(),))


def _kind(value: object) -> type | None:
    """The kind of value an `Indices` is for equality: `Indices` or `Tokens` (a lazy join of either too)."""
    return _KIND.get(type(value), type(value))


class Tokens(Indices):
    """Token ids as an immutable value (the same int64 bytes as `Indices`, another meaning)."""

    __slots__ = ()


class _JoinedTokens(_Joined, Tokens):
    """`Tokens.concat` of several parts, joined when first read: `_Joined` for token ids."""

    __slots__ = ()

    @classmethod
    def _wrap(cls, data: bytes | memoryview) -> Indices:
        return Tokens._wrap(data)


_LAZY: Final[dict[type, type[_Joined]]] = {Indices: _Joined, Tokens: _JoinedTokens}
"""Per kind, the class of its lazy joins (`concat`)."""
_KIND: Final[dict[type, type]] = {_Joined: Indices, _JoinedTokens: Tokens}
"""Per lazy class, the kind of value it is for equality, hashing and encoding."""

EMPTY: Final = Indices()
