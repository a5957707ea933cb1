"""What both storage (L3) backends share: the protocol they keep (`StorageBackend`), keys,
the stored page format, the bytes of host pages, and the results of their calls.

A backend stores *pages* under opaque keys chosen by the caller (`page_keys`): a page is the
K and V of `page_size` tokens across all layers, as the bytes of a `[2, L, P, H, D]`
block, whatever the host layout (`HostPages` finds those bytes in the host buffer:
one run in page_first, 2 x L runs in layer_first). Every stored page is a record
(`PageFormat`): a header that names the key and the KV shape (dtype, layers, heads,
head_dim, page size, payload layout) and carries a checksum of the header and one of
the payload, then the payload.

Reads go straight into the host slots the tree reserved and are verified there (the
file backend reads small pages of several runs through a record block, verified there
and copied into those slots in one pass, `_record_block.py`): a page that is missing,
truncated, corrupt, stored under another key or of another KV shape does not count
(`StorageIO.pages` stops before it), so its bytes never become visible to the tree,
which frees or reuses those reserved slots. Every OS or client error is an operating
condition: counted, logged once with its path or key, a miss.

The checksum is XXH3-64 (the `xxhash` wheel): it only has to catch torn or flipped
bytes, not an adversary (whoever can write the storage can write a valid checksum
too), and it streams over the runs of a layer_first page without copying them (a
small page's runs are joined first: one call instead of one per run). A batch's
headers are built in bulk and checked as one block (`Headers`). The backends are in `_file_backend.py` and
`_mooncake.py`, each knowing only this module; `open_backend` (`_storage.py`) picks one.
"""

from __future__ import annotations

import ctypes
import functools
import re
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import chain, repeat
from typing import Any, Final, Protocol

import numpy as np
import torch
import xxhash

from ._kv import KVBuffer, KVShape
from ._logging import logger
from ._pages import _longer

KEY_CHARS_MAX: Final = 80
"""Longest page key, in characters."""
_KEY = re.compile(rf"[0-9A-Za-z_-]{{1,{KEY_CHARS_MAX}}}")
_KEY_BYTES: Final = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_-"

log = logger("hicache.storage")
PAGE_GONE: Final = "gone: its header reads as zeros (its bytes were punched out, or never written before a crash)"
"""The problem of a stored page whose header is all zero bytes: in a file, a record another
instance sharing the directory evicted (`fallocate` punched it out), or one a crash lost.
Not damage: the file backend reads it as a miss and logs it at info level."""


class StorageError(RuntimeError):
    """Backend cannot be used (unreachable master, unwritable dir...): message says what to check."""


@dataclass(frozen=True, slots=True)
class StorageIO:
    """The outcome of one `read` or `write`."""

    pages: int
    """read: leading pages whose verified bytes are now in the host slots;
    write: leading pages now present in storage (written or already there)."""
    written: int = 0
    """write only: pages actually written (the others were already there)."""
    bytes: int = 0
    """Payload bytes moved."""
    error: str = ""
    """Non-empty when a page failed (miss, corrupt page, timeout, backend error): what and which key."""


@dataclass(frozen=True, slots=True)
class StorageUsage:
    """What a backend holds and has done, for `statistics()`."""

    stored_bytes: int = 0
    """Bytes the backend's storage takes (file: allocated on disk, as `du` counts; Mooncake: 0, the
    store's own accounting is the master's)."""
    evicted_pages: int = 0
    """Pages this backend removed to stay within `storage_max_bytes`."""
    io_errors: int = 0
    """OS or client errors met (each also logged once, with its path or key)."""


def page_keys(hashes: Sequence[int], rank: int, per_rank: bool = True, ranks: int = 1) -> list[str]:
    """Storage keys of a chain of page hashes: 32 hex digits (more for a larger number),
    then, when each tensor-parallel rank stores its own share of the heads (`per_rank`),
    `-r{rank}` and, in a group of more than one rank, `of{ranks}`: the share a rank holds
    depends on both (rank 2 of 4 and rank 2 of 8 may each hold one KV head, not the same one)."""
    if any(h < 0 for h in hashes):
        raise ValueError(f"page hashes must be non-negative integers, got {min(hashes)}")
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} of a group of {ranks}: a rank is in 0..ranks-1")
    suffix = (f"-r{rank}" if ranks == 1 else f"-r{rank}of{ranks}") if per_rank else ""
    keys = [f"{h:032x}{suffix}" for h in hashes]
    check_keys(keys)
    return keys


def check_keys(keys: Sequence[str]) -> None:
    """Raise ValueError for a key a backend must not accept (it becomes part of a file record
    or a Mooncake object key as it is)."""
    try:  # the whole batch at once; the loop below only names the bad key
        joined = "\n".join(keys).encode("ascii")
    except (TypeError, UnicodeEncodeError):
        joined = None
    if not keys or (joined and joined.translate(None, _KEY_BYTES) == b"\n" * (len(keys) - 1)
                    and b"\n\n" not in joined and joined[0] != 10 and joined[-1] != 10  # no empty key
                    and max(map(len, keys)) <= KEY_CHARS_MAX):
        return
    for key in keys:
        if not isinstance(key, str) or _KEY.fullmatch(key) is None:
            raise ValueError(
                f"storage key {key!r} is not allowed: a key is 1 to {KEY_CHARS_MAX} characters "
                "of 0-9, a-z, A-Z, '_' and '-' (see page_keys)"
            )


# -- the stored page -------------------------------------------------------------------


PAYLOAD_LAYOUT: Final = b"kv,layer,token,head,dim"
"""The order of a payload's elements, recorded in every header: `[2, L, P, H, D]`, the same
for both host layouts (a page written from either reads into either)."""


class PageFormat:
    """How one page is stored: a `HEADER.size`-byte header, then the payload.

    Header (little endian): magic `HKVP`, format version (u16), key length (u16),
    payload length (u64), XXH3-64 of the payload (u64), the dtype's name (16 bytes),
    layers, heads, head_dim and page size (u32 each), the payload layout (24 bytes),
    the key's ASCII bytes (80, zero padded), then XXH3-64 of everything before it.
    A header that fails its own checksum tells nothing, not even its length.
    """

    MAGIC: Final = b"HKVP"
    VERSION: Final = 2
    HEADER: Final = struct.Struct(f"<4sHHQQ16sIIII24s{KEY_CHARS_MAX}sQ")
    KEY_LENGTH_AT: Final = struct.calcsize("<4sH")
    CHECKSUM_AT: Final = struct.calcsize("<4sHHQ")
    KEY_AT: Final = struct.calcsize("<4sHHQQ16sIIII24s")
    """Where the key length (u16), the payload checksum (u64) and the key lie in a header; the
    checksum, the key and the header's own checksum are whole 8-byte words (`Headers.fill`)."""

    def __init__(self, shape: KVShape) -> None:
        self.shape = shape
        self.header_bytes = self.HEADER.size
        self.payload_bytes = shape.page_size * shape.bytes_per_slot
        self.stored_bytes = self.header_bytes + self.payload_bytes
        self._dtype = str(shape.dtype).removeprefix("torch.").encode()
        self._shape_fields = (self._dtype, shape.layers, shape.heads, shape.head_dim, shape.page_size,
                              PAYLOAD_LAYOUT)
        template = bytearray(self.HEADER.size)
        self.HEADER.pack_into(template, 0, self.MAGIC, self.VERSION, 0, self.payload_bytes, 0, *self._shape_fields,
                              b"", 0)
        self.shape_region = bytes(template[24:80])
        """The dtype, dims and payload layout, as stored."""
        self.template = bytes(template)
        """A header of this format and KV shape with an empty key and both checksums 0."""
        self.tag = f"{xxhash.xxh3_64_intdigest(repr((self.VERSION, self._shape_fields)).encode()) & 0xFFFFFFFF:08x}"
        """8 hex digits naming the format version and the KV shape, for backends that keep
        pages of different shapes apart by name (Mooncake object keys)."""

    def describe(self) -> str:
        s = self.shape
        return (f"{self._dtype.decode()} x {s.layers} layers x {s.heads} heads x head_dim {s.head_dim}, "
                f"page_size {s.page_size}")

    def pack(self, into: memoryview, key: str, checksum: int) -> None:
        """Write the header of `key`, whose payload has XXH3-64 `checksum`, into `into`."""
        h = self.HEADER
        fields = (self.MAGIC, self.VERSION, len(key), self.payload_bytes, checksum, *self._shape_fields,
                  key.encode())
        h.pack_into(into, 0, *fields, 0)
        struct.pack_into("<Q", into, h.size - 8, xxhash.xxh3_64_intdigest(into[: h.size - 8]))

    def unpack(self, header: memoryview | bytes) -> Header:
        """What a stored header says, and whether it is an intact header of a page of this
        format and KV shape (`Header.problem` is "" then)."""
        h = self.HEADER
        if len(header) < h.size:
            return Header(problem=f"truncated: {len(header)} bytes, shorter than the {h.size}-byte header")
        magic, version, key_len, length, payload_sum, dtype, layers, heads, head_dim, page, layout, raw_key, own = (
            h.unpack_from(header))
        if magic != self.MAGIC:
            if not any(header[: h.size]):
                return Header(problem=PAGE_GONE)
            return Header(problem=f"not a hicache page (magic {magic!r}, expected {self.MAGIC!r})")
        if version != self.VERSION:
            return Header(problem=f"page format version {version}; this build reads version {self.VERSION}")
        if xxhash.xxh3_64_intdigest(header[: h.size - 8]) != own:
            return Header(problem="header checksum mismatch: the header is corrupt")
        key = raw_key[: min(key_len, KEY_CHARS_MAX)].decode("ascii", "replace")
        found = Header(key=key, payload_bytes=length, checksum=payload_sum, readable=True)
        if (dtype.rstrip(b"\0"), layers, heads, head_dim, page, layout.rstrip(b"\0")) != self._shape_fields:
            name = dtype.rstrip(b"\0").decode("ascii", "replace")
            theirs = f"{name} x {layers} layers x {heads} heads x head_dim {head_dim}, page_size {page}"
            return replace(found, problem=f"a page of another KV shape ({theirs}; this instance: {self.describe()})")
        if length != self.payload_bytes:
            return replace(found, problem=f"payload of {length} bytes; pages of this KV shape have {self.payload_bytes}")
        return found

    def problem(self, key: str, header: memoryview | bytes, payload_checksum: int) -> str:
        """Why a header and the checksum of the payload read with it are not a valid page of
        `key`; "" when they are."""
        found = self.unpack(header)
        if found.problem:
            return found.problem
        if found.key != key:
            return f"holds the page of key {found.key!r}"
        if found.checksum != payload_checksum:
            return "checksum mismatch: the payload is corrupt"
        expected = bytearray(self.header_bytes)
        self.pack(memoryview(expected), key, payload_checksum)
        if bytes(header[: self.header_bytes]) != expected:
            return "the header differs from the one its key and payload give (stray bytes in its padding)"
        return ""


@dataclass(frozen=True, slots=True)
class Header:
    """A stored page header as read (`PageFormat.unpack`)."""

    key: str = ""
    payload_bytes: int = 0
    checksum: int = 0
    """XXH3-64 of the payload, as stored."""
    readable: bool = False
    """The header is intact (magic, version, its own checksum): its key and length can be trusted."""
    problem: str = ""
    """Why it is not a page of this format and KV shape ("" when it is)."""


class Headers:
    """Room for the headers of a batch of pages, one after another in `memory`.

    A write fills them from the keys and the payload checksums and sends them out; a
    read receives the stored headers into one block and fills another from the keys and
    the checksums of the payloads it received: the pages are intact exactly when the two
    blocks are equal, which one comparison of the batch tells (`same`). Filling builds
    the batch's headers in bulk, as columns of 8-byte words over the block (the template,
    the checksums, the keys); the one per-page call left is the header's own XXH3-64.
    """

    def __init__(self, fmt: PageFormat, memory: memoryview) -> None:
        h = fmt.header_bytes
        self.fmt = fmt
        self.memory = memory.cast("B")
        self.capacity = len(self.memory) // h
        self.views = [self.memory[i * h : (i + 1) * h] for i in range(self.capacity)]
        """Each header's bytes, for `preadv`/`pwritev` and Mooncake's buffers."""
        self._words = self.memory[: self.capacity * h].cast("Q")
        self._halves = self.memory[: self.capacity * h].cast("H")
        self._signed = [v[: h - 8] for v in self.views]
        """What each header's own checksum covers."""

    @classmethod
    def allocate(cls, fmt: PageFormat, capacity: int) -> Headers:
        return cls(fmt, memoryview(bytearray(capacity * fmt.header_bytes)))

    def fill(self, keys: Sequence[str], sums: Sequence[int]) -> None:
        """Header `i` becomes the header of `keys[i]` (checked: `check_keys`) with payload checksum `sums[i]`."""
        n, fmt = len(keys), self.fmt
        if n != len(sums) or n > self.capacity:
            raise ValueError(f"{n} keys, {len(sums)} checksums, room for {self.capacity} headers")
        if not n:
            return
        h, lengths = fmt.header_bytes, list(map(len, keys))
        longest, same = max(lengths), lengths.count(lengths[0]) == n
        if longest > KEY_CHARS_MAX:
            raise ValueError(f"storage key of {longest} characters; at most {KEY_CHARS_MAX} (check_keys)")
        row = bytearray(fmt.template)  # every header's fields but its key and checksums
        struct.pack_into("<H", row, fmt.KEY_LENGTH_AT, lengths[0] if same else 0)
        self.memory[: n * h] = row * n
        if not same:
            self._column(self._halves, fmt.KEY_LENGTH_AT // 2, h // 2, n, array("H", lengths))
        self._column(self._words, fmt.CHECKSUM_AT // 8, h // 8, n, array("Q", sums))
        width = -(-longest // 8)  # words of key bytes, zero padded
        if same:
            pad = "\0" * (width * 8 - longest)
            raw = (pad.join(keys) + pad).encode("ascii")
        else:
            raw = "".join(map(str.ljust, keys, repeat(width * 8), repeat("\0"))).encode("ascii")
        key_words = memoryview(raw).cast("Q")
        for j in range(width):
            self._column(self._words, fmt.KEY_AT // 8 + j, h // 8, n, key_words[j::width])
        own = array("Q", list(map(xxhash.xxh3_64_intdigest, self._signed[:n])))
        self._column(self._words, (h - 8) // 8, h // 8, n, own)

    @staticmethod
    def _column(view: memoryview, first: int, step: int, n: int, values: Any) -> None:
        """Item `first` of each of the first `n` headers (`step` items each) becomes the next of `values`."""
        view[first : first + n * step : step] = values

    def same(self, other: Headers, n: int) -> bool:
        """The first `n` headers of both are byte for byte equal."""
        k = n * self.fmt.header_bytes
        return self.memory[:k].tobytes() == other.memory[:k].tobytes()

    def first_bad(self, expected: Headers, keys: Sequence[str], sums: Sequence[int]) -> tuple[int, str]:
        """(index, why) of the first of these received headers that is not `expected`'s; (len(keys), "")
        when all are. `expected` holds the headers of `keys` and `sums` (`fill`)."""
        for i, key in enumerate(keys):
            if self.views[i].tobytes() != expected.views[i].tobytes():
                return i, self.fmt.problem(key, self.views[i], sums[i]) or "the header differs from the expected one"
        return len(keys), ""


def checksum(blocks: Sequence[memoryview]) -> int:
    """XXH3-64 of the bytes of `blocks`, one after the other (a page's payload), streamed
    run by run without a copy. (Small pages of several runs are checksummed in a record
    block's rows instead, `_record_block.py`.)"""
    if len(blocks) == 1:
        return xxhash.xxh3_64_intdigest(blocks[0])
    h = xxhash.xxh3_64()
    for b in blocks:
        h.update(b)
    return h.intdigest()


# -- host pages as stored bytes ------------------------------------------------------------


class HostPages:
    """The payload bytes of the pages of a host KV buffer, where they lie in its memory.

    A page's payload is its `[2, L, P, H, D]` block: in page_first the page itself, one
    run; in layer_first the K or V of one layer of its `P` slots is one run, so `2 x L`
    runs. Backends read into and write from these runs directly (`readv`/`writev`, a
    Mooncake multi-buffer get or put); small pages go through a record block instead
    (`_record_block.py`): one copy of a batch's payloads beside their headers on a write, a
    copy of the block into their runs on a read.
    """

    def __init__(self, host: KVBuffer) -> None:
        t = host.tensor
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("storage reads and writes need a contiguous host buffer in CPU memory")
        s = host.shape
        self.host = host
        self.address = t.data_ptr()
        self.nbytes = t.numel() * t.element_size()
        self._memory = memoryview((ctypes.c_char * self.nbytes).from_address(self.address)).cast("B")
        self.page_bytes = s.page_size * s.bytes_per_slot
        item, run = t.element_size(), s.page_size * s.heads * s.head_dim * t.element_size()
        if host.page_first:
            self._runs = [(0, self.page_bytes)]
            self._slot_step = s.bytes_per_slot  # pages are adjacent: slot * bytes_per_slot is the page start
        else:
            kv, layer = t.stride()[:2]
            self._runs = [(k * kv * item + l_ * layer * item, run) for k in range(2) for l_ in range(s.layers)]
            self._slot_step = s.heads * s.head_dim * item
        self.runs_per_page = len(self._runs)
        self._run_slices = [slice(off, off + n) for off, n in self._runs]

    def spans(self, start: int) -> list[tuple[int, int]]:
        """(offset in the buffer, length) of each run of the page whose first slot is `start`."""
        base = start * self._slot_step
        return [(base + off, n) for off, n in self._runs]

    def blocks(self, start: int) -> list[memoryview]:
        """The runs of the page whose first slot is `start`, as writable views of the buffer."""
        m, base = self._memory, start * self._slot_step
        return [m[base + off : base + off + n] for off, n in self._runs]

    def payloads(self, starts: Sequence[int]) -> list[Any]:
        """The payload of each page whose first slot is in `starts`: a writable view of the
        buffer (one run a page), or a list of them (`blocks`)."""
        m, step = self._memory, self._slot_step
        if self.runs_per_page == 1:
            size = self.page_bytes
            return [m[a : a + size] for a in map(step.__mul__, starts)]
        runs = self._run_slices  # slices of the view from the page's start: no index arithmetic a run
        return [list(map(m[b:].__getitem__, runs)) for b in map(step.__mul__, starts)]

    def records(self, headers: Sequence[memoryview], payloads: list[Any]) -> list[Any]:
        """The buffers of the pages' records in file order: each header, then its payload's runs."""
        if not payloads or not isinstance(payloads[0], list):
            return list(chain.from_iterable(zip(headers, payloads)))
        bufs: list[memoryview] = []
        for header, runs in zip(headers, payloads):
            bufs.append(header)
            bufs += runs
        return bufs

    def checksums(self, payloads: list[Any]) -> list[int]:
        """XXH3-64 of each of `payloads` (`checksum`), each a map over the batch (no Python loop)."""
        if not payloads or not isinstance(payloads[0], list):
            return list(map(xxhash.xxh3_64_intdigest, payloads))
        return list(map(checksum, payloads))


_SLOTS_BY_LIST_MAX: Final = 256
"""`page_starts` checks up to this many slots as Python ints; more with one tensor comparison."""


def page_starts(keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> list[int]:
    """The first host slot of each key's page; ValueError unless `slots` are whole, aligned
    pages of `host`, one per key, in key order."""
    p = host.shape.page_size
    n = len(keys)
    if slots.dtype != torch.int64 or slots.shape != (n * p,):
        raise ValueError(
            f"slots must be a 1-D int64 tensor of {n} keys x page_size {p} = {n * p} host slots, "
            f"got {slots.dtype} of shape {tuple(slots.shape)}"
        )
    if n == 0:
        return []
    if n * p <= _SLOTS_BY_LIST_MAX:
        listed = slots.tolist()
        first = listed[0]
        run = listed == list(range(first, first + n * p))  # one run of pages, as a fresh allocation often is
    else:
        values = slots.numpy()  # without torch's per-op cost: one subtraction, one memcmp
        first = int(values[0])
        run = _ascending(n * p).startswith(values - first)
    if run:
        whole, low, high = first % p == 0, first, first + n * p
    elif n * p <= _SLOTS_BY_LIST_MAX:
        starts = listed[::p]
        whole = not any(s % p for s in starts) and listed == [s + i for s in starts for i in range(p)]
        low, high = min(starts), max(starts) + p
    else:
        starts = slots[::p].tolist()
        pages = slots.view(n, p)
        whole = not any(s % p for s in starts) and torch.equal(pages - pages[:, :1], _offsets(p).expand(n, p))
        low, high = min(starts), max(starts) + p
    if not whole:
        raise ValueError(f"slots must be whole pages: each key's {p} slots run page_start .. page_start + {p}")
    if low < 0 or high > host.slots:
        raise ValueError(f"slots must lie within the host buffer's {host.slots} slots")
    return list(range(first, first + n * p, p)) if run else starts


_ASCENDING = np.arange(1 << 12, dtype=np.int64).tobytes()
"""The int64 bytes of 0, 1, 2, ... (grown by doubling): a run of slots from `first` is the
one whose values minus `first` they start with."""


def _ascending(m: int) -> bytes:
    """`_ASCENDING`, at least `m` numbers long."""
    global _ASCENDING
    if len(_ASCENDING) < 8 * m:
        _ASCENDING = _longer(_ASCENDING, m, 8, lambda k: np.arange(k, dtype=np.int64))
    return _ASCENDING


@functools.cache
def _offsets(page_size: int) -> torch.Tensor:
    return torch.arange(page_size)


class StorageBackend(Protocol):
    """What the storage prefetcher needs from an L3 backend. Not thread-safe: one caller.

    No call raises for an operating condition (a miss, a damaged page, an OS or client
    error): those are `StorageIO.error`. Keys or slots that are not allowed raise ValueError.
    """

    name: str

    def exists(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored (one batched call; stops at the first miss)."""
        ...

    def read(self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> StorageIO:
        """Read the pages of `keys` into the page-aligned host `slots`, in order, and verify
        them there; stops at the first page that is missing, damaged or failed. The pages
        before it are verified in place; bytes at or after it may have been written but
        are not counted."""
        ...

    def write(self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> StorageIO:
        """Store the host pages at `slots` under `keys`, in order; a stored page is not rewritten."""
        ...

    def usage(self) -> StorageUsage:
        """What the backend holds and has done."""
        ...

    def check_invariants(self) -> None:
        """Raise `InvariantError` if the backend's own bookkeeping (an index of what it
        stores) is broken."""
        ...

    def close(self) -> None:
        """Release the backend's resources; it is unusable afterwards."""
        ...
