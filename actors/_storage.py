"""The storage (L3) tier: one backend protocol, the stored page format, and the file backend.

A backend is a plain, synchronous object (no actor): the storage prefetcher calls it.
It stores *pages* under opaque keys chosen by the caller (`page_keys`): a page is the
K and V of `page_size` tokens across all layers, as the bytes of a `[2, L, P, H, D]`
block. Every stored page is an envelope (`PageFormat`): a fixed header that names the
key and carries a CRC-32 of the payload, then the payload. A page that is truncated,
corrupt or stored under another key is a miss: `read` stops there, logs it, drops the
bad page so the next backup can rewrite it, and never copies its bytes into the host
buffer (a page is checked in a staging buffer first). Mooncake Store is in `_mooncake.py`.

CRC-32 rather than a cryptographic digest: the checksum only has to catch torn or
flipped bytes, not an adversary (whoever can write the storage can write a valid
checksum too), and it is the fastest here. On this machine class (2 KVM cores, AVX-512)
over 2-8 MiB buffers: `zlib.crc32` 4.3-5.3 GB/s, `blake2b` 0.8 GB/s, `sha1`/`sha256`
1.8-1.9 GB/s, and zlib-ng's `crc32` (the `fast` extra; the same CRC-32, so the same
stored bytes) 54 GB/s, which is used when installed.
"""

from __future__ import annotations

import io
import itertools
import os
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from ._logging import logger
import torch

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # the `fast` extra is not installed: the same checksum, about 10x slower
    from zlib import crc32

from hicache.runtime.config import Config, StorageKind

from ._kv import KVBuffer, KVShape

KEY_CHARS_MAX: Final = 80
"""Longest page key, in characters."""
_KEY = re.compile(rf"[0-9A-Za-z_-]{{1,{KEY_CHARS_MAX}}}")

log = logger("hicache.storage")


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


class StorageBackend(Protocol):
    """What the storage prefetcher needs from an L3 backend. Not thread-safe: one caller."""

    name: str

    def exists(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored (one batched call; stops at the first miss)."""
        ...

    def read(self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> StorageIO:
        """Copy the pages of `keys` into the page-aligned host `slots`, in order; stops at the
        first page that is missing, corrupt or failed. Pages before it are fully in place."""
        ...

    def write(self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> StorageIO:
        """Store the host pages at `slots` under `keys`, in order; a stored page is not rewritten."""
        ...

    def close(self) -> None:
        """Release the backend's resources; it is unusable afterwards."""
        ...


def page_keys(hashes: Sequence[int], rank: int, per_rank: bool = True) -> list[str]:
    """Storage keys of a chain of page hashes: 16+ hex digits, then `-r{rank}` when each
    tensor-parallel rank stores its own share of the heads (`per_rank`)."""
    if any(h < 0 for h in hashes):
        raise ValueError(f"page hashes must be non-negative integers, got {min(hashes)}")
    suffix = f"-r{rank}" if per_rank else ""
    keys = [f"{h:016x}{suffix}" for h in hashes]
    check_keys(keys)
    return keys


def check_keys(keys: Sequence[str]) -> None:
    """Raise ValueError for a key a backend must not accept (it becomes a file name or a
    Mooncake object key as it is)."""
    for key in keys:
        if not isinstance(key, str) or _KEY.fullmatch(key) is None:
            raise ValueError(
                f"storage key {key!r} is not allowed: a key is 1 to {KEY_CHARS_MAX} characters "
                "of 0-9, a-z, A-Z, '_' and '-' (see page_keys)"
            )


def open_backend(config: Config) -> StorageBackend | None:
    """The backend `config.storage` names, ready to use; None for `StorageKind.NONE`.

    Raises StorageError saying what to check when the backend cannot be used.
    """
    if config.storage is StorageKind.NONE:
        return None
    if config.storage is StorageKind.FILE:
        return FileBackend(config)
    from ._mooncake import MooncakeBackend

    return MooncakeBackend(config)


# -- the stored page -------------------------------------------------------------------


class PageFormat:
    """How one page is stored: a 128-byte header, then the payload.

    Header (little endian): magic `HKVP`, format version (u16), key length (u16),
    payload length (u64), CRC-32 of the payload (u32), the key's ASCII bytes (80,
    zero padded), zero padding to 128 bytes so the payload starts cache-line aligned.
    """

    MAGIC: Final = b"HKVP"
    VERSION: Final = 1
    HEADER: Final = struct.Struct(f"<4sHHQI{KEY_CHARS_MAX}s28x")

    def __init__(self, shape: KVShape) -> None:
        self.shape = shape
        self.header_bytes = self.HEADER.size
        self.payload_bytes = shape.page_size * shape.bytes_per_slot
        self.stored_bytes = self.header_bytes + self.payload_bytes

    def seal(self, key: str, page: memoryview) -> None:
        """Write the header of `key` into the first bytes of `page` (one stored page),
        over the payload that follows it."""
        payload = page[self.header_bytes :]
        self.HEADER.pack_into(
            page, 0, self.MAGIC, self.VERSION, len(key), len(payload), crc32(payload), key.encode()
        )

    def problem(self, key: str, page: memoryview) -> str:
        """Why the stored bytes `page` are not a valid page of `key`; "" when they are."""
        if len(page) < self.header_bytes:
            return f"truncated: {len(page)} bytes, shorter than the {self.header_bytes}-byte header"
        magic, version, key_len, payload_len, crc, raw_key = self.HEADER.unpack_from(page)
        if magic != self.MAGIC:
            return f"not a hicache page (magic {magic!r}, expected {self.MAGIC!r})"
        if version != self.VERSION:
            return f"page format version {version}; this build reads version {self.VERSION}"
        stored_key = raw_key[:key_len].decode("ascii", "replace")
        if stored_key != key:
            return f"holds the page of key {stored_key!r}"
        if payload_len != self.payload_bytes:
            return f"payload of {payload_len} bytes; pages of this KV shape have {self.payload_bytes}"
        if len(page) != self.stored_bytes:
            return f"truncated: {len(page)} bytes, expected {self.stored_bytes}"
        if crc32(page[self.header_bytes :]) != crc:
            return "checksum mismatch: the payload is corrupt"
        return ""


class Staging:
    """A buffer of `pages` stored pages (header + payload each) that pages pass through
    between storage and the host buffer, so bytes are verified before they reach the host."""

    def __init__(self, fmt: PageFormat, pages: int) -> None:
        self.fmt = fmt
        self.pages = pages
        self.buffer = bytearray(pages * fmt.stored_bytes)
        self.memory = memoryview(self.buffer)
        s = fmt.shape
        self._rows = torch.frombuffer(self.buffer, dtype=torch.uint8).view(pages, fmt.stored_bytes)
        flat = self._rows[:, fmt.header_bytes :].view(s.dtype)
        self._payloads = flat.view(pages, 2, s.layers, 1, s.page_size, s.heads, s.head_dim)

    @property
    def address(self) -> int:
        """Address of the first byte (for clients that copy by pointer)."""
        return self._rows.data_ptr()

    def page(self, i: int, nbytes: int | None = None) -> memoryview:
        """The bytes of stored page `i` (its first `nbytes` if given)."""
        start = i * self.fmt.stored_bytes
        return self.memory[start : start + (self.fmt.stored_bytes if nbytes is None else nbytes)]

    def gather(self, host: KVBuffer, starts: Sequence[int], keys: Sequence[str]) -> None:
        """Copy host pages (first slot of each in `starts`) into the staging pages and seal them."""
        p = self.fmt.shape.page_size
        for i, (start, key) in enumerate(zip(starts, keys, strict=True)):
            self._payloads[i].copy_(host.view(start, 1, p, None))
            self.fmt.seal(key, self.page(i))

    def scatter(self, host: KVBuffer, starts: Sequence[int]) -> None:
        """Copy staging pages `0 .. len(starts)` (already verified) into the host pages."""
        p = self.fmt.shape.page_size
        for i, start in enumerate(starts):
            host.view(start, 1, p, None).copy_(self._payloads[i])

    def read(
        self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor,
        read_batch: Callable[[Sequence[str]], tuple[int, str]],
    ) -> StorageIO:
        """A backend's read: up to `pages` keys at a time, `read_batch` fetches and verifies them
        into the staging pages and says how many leading ones are good (and, if it stopped, why);
        those are copied into the host pages. It stops at the first page that is not good."""
        check_keys(keys)
        starts = page_starts(keys, host, slots)
        done = 0
        while done < len(keys):
            good, error = read_batch(keys[done : done + self.pages])
            self.scatter(host, starts[done : done + good])
            done += good
            if error:
                return StorageIO(pages=done, bytes=done * self.fmt.payload_bytes, error=error)
        return StorageIO(pages=done, bytes=done * self.fmt.payload_bytes)


def page_starts(keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> list[int]:
    """The first host slot of each key's page; ValueError unless `slots` are whole, aligned
    pages of `host`, one per key, in key order."""
    p = host.shape.page_size
    n = len(keys)
    if slots.dim() != 1 or slots.dtype != torch.int64 or len(slots) != n * p:
        raise ValueError(
            f"slots must be a 1-D int64 tensor of {n} keys x page_size {p} = {n * p} host slots, "
            f"got {slots.dtype} of shape {tuple(slots.shape)}"
        )
    if n == 0:
        return []
    pages = slots.view(n, p)
    starts = pages[:, 0]
    if bool((starts % p).any()) or not torch.equal(pages, starts[:, None] + torch.arange(p)):
        raise ValueError(f"slots must be whole pages: each key's {p} slots run page_start .. page_start + {p}")
    if int(starts.min()) < 0 or int(starts.max()) + p > host.slots:
        raise ValueError(f"slots must lie within the host buffer's {host.slots} slots")
    return starts.tolist()


# -- the file backend -------------------------------------------------------------------

_TEMP_IDS = itertools.count()
"""Temporary file names are `<key>.<pid>.<n>.tmp`: unique per writer process and call
(several backends of one process share the counter), never random."""


class FileBackend:
    """One file per page under `config.storage_dir`, in subdirectories named by the first
    two characters of the key. Instances on one machine (processes) may share a directory.

    A page is written to a temporary name in its own directory and `os.replace`d into
    place, so a reader sees a whole page or none; concurrent writers of one key each
    write their own temporary file and the last rename wins (the bytes are the same).
    Nothing is fsynced: this is a cache; a page torn by a crash fails its checksum and
    reads as a miss.
    """

    name = "file"

    def __init__(self, config: Config) -> None:
        self.root = Path(config.storage_dir)
        self.fmt = PageFormat(KVShape.of(config))
        self._staging = Staging(self.fmt, config.storage_batch_pages)
        self._probe_writable()

    def _probe_writable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe.{os.getpid()}.{next(_TEMP_IDS)}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise StorageError(
                f"file storage directory {str(self.root)!r} cannot be created or written ({e}); "
                "check that the path is a directory this process may write (storage_dir)"
            ) from e

    def path(self, key: str) -> Path:
        """Where the page of `key` is stored."""
        return self.root / key[:2] / key

    def exists(self, keys: Sequence[str]) -> int:
        check_keys(keys)
        for i, key in enumerate(keys):
            if not self._present(key):
                return i
        return len(keys)

    def _present(self, key: str) -> bool:
        """A page file of the right size is there (a short or long one counts as absent, so
        the next backup replaces it)."""
        try:
            return self.path(key).stat().st_size == self.fmt.stored_bytes
        except OSError:
            return False

    def read(self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> StorageIO:
        return self._staging.read(keys, host, slots, self._read_batch)

    def _read_batch(self, keys: Sequence[str]) -> tuple[int, str]:
        """Read and verify `keys` into the staging pages; (leading good pages, error)."""
        for i, key in enumerate(keys):
            path = self.path(key)
            try:
                with open(path, "rb", buffering=0) as f:
                    size = os.fstat(f.fileno()).st_size
                    n = _read_all(f, self._staging.page(i, min(size, self.fmt.stored_bytes)))
            except FileNotFoundError:
                return i, f"page {key} is not in storage"
            except OSError as e:
                log.error("storage read failed", backend=self.name, key=key, path=str(path), error=str(e))
                return i, f"page {key}: reading {path} failed: {e}"
            problem = f"file of {size} bytes, expected {self.fmt.stored_bytes}" if size != n else ""
            problem = problem or self.fmt.problem(key, self._staging.page(i, n))
            if problem:
                self._drop(key, problem)
                return i, f"page {key} is unusable ({problem}); dropped it"
        return len(keys), ""

    def _drop(self, key: str, problem: str) -> None:
        log.warning("storage page unusable, dropped", backend=self.name, key=key, problem=problem)
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            pass  # another instance dropped or replaced it first

    def write(self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> StorageIO:
        check_keys(keys)
        starts = page_starts(keys, host, slots)
        stage = self._staging
        written = 0
        for b in range(0, len(keys), stage.pages):
            batch = keys[b : b + stage.pages]
            todo = [i for i, key in enumerate(batch) if not self._present(key)]
            stage.gather(host, [starts[b + i] for i in todo], [batch[i] for i in todo])
            for j, i in enumerate(todo):
                error = self._write_page(batch[i], stage.page(j))
                if error:
                    return StorageIO(pages=b + i, written=written, bytes=written * self.fmt.payload_bytes,
                                     error=error)
                written += 1
        return StorageIO(pages=len(keys), written=written, bytes=written * self.fmt.payload_bytes)

    def _write_page(self, key: str, page: memoryview) -> str:
        path = self.path(key)
        tmp = path.with_name(f"{key}.{os.getpid()}.{next(_TEMP_IDS)}.tmp")
        try:
            try:
                f = open(tmp, "wb", buffering=0)
            except FileNotFoundError:  # the first page of its subdirectory, or it was cleaned away
                path.parent.mkdir(exist_ok=True)
                f = open(tmp, "wb", buffering=0)
            with f:
                _write_all(f, page)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.error("storage write failed", backend=self.name, key=key, path=str(path), error=str(e))
            return f"page {key}: writing {path} failed: {e}"
        return ""

    def close(self) -> None:
        """Nothing to release: every call opens and closes its own files."""


def _read_all(f: io.FileIO, into: memoryview) -> int:
    """Fill `into` from `f` until it is full or the file ends (a read may return less)."""
    got = 0
    while got < len(into):
        n = f.readinto(into[got:])
        if not n:
            break
        got += n
    return got


def _write_all(f: io.FileIO, data: memoryview) -> None:
    """Write all of `data` (a write may take less)."""
    done = 0
    while done < len(data):
        done += f.write(data[done:]) or 0
