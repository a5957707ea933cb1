"""`open_backend`: the storage (L3) backend a `Config` names.

Above the backends, which do not know each other: the protocol they keep and what they
share (keys, the stored page format) is in `_stored_page.py`; the file backend in
`_file_backend.py`, Mooncake Store in `_mooncake.py`.
"""

from __future__ import annotations

from hicache.messages.config import Config, StorageKind

from ._file_backend import FileBackend
from ._mooncake import MooncakeBackend
from ._stored_page import StorageBackend


def open_backend(config: Config) -> StorageBackend | None:
    """The backend `config.storage` names, ready to use; None for `StorageKind.NONE`.

    Raises StorageError saying what to check when the backend cannot be used.
    """
    if config.storage is StorageKind.NONE:
        return None
    if config.storage is StorageKind.FILE:
        return FileBackend(config)
    return MooncakeBackend(config)
