"""The storage (L3) tier's protocol, and `open_backend`.

A backend is a plain, synchronous object (no actor): the storage prefetcher is its only
caller. What the backends share (keys, the stored page format, the bytes of host pages)
is in `_stored_page.py`; the file backend in `_file_backend.py`, Mooncake Store in
`_mooncake.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from hicache.messages.config import Config, StorageKind

from ._file_backend import FileBackend
from ._kv import KVBuffer
from ._mooncake import MooncakeBackend
from ._stored_page import StorageIO, StorageUsage, page_keys


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

    def close(self) -> None:
        """Release the backend's resources; it is unusable afterwards."""
        ...


def open_backend(config: Config) -> StorageBackend | None:
    """The backend `config.storage` names, ready to use; None for `StorageKind.NONE`.

    Raises StorageError saying what to check when the backend cannot be used.
    """
    if config.storage is StorageKind.NONE:
        return None
    if config.storage is StorageKind.FILE:
        return FileBackend(config)
    return MooncakeBackend(config)
