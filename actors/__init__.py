"""The actors and the plain cores they wrap."""

import warnings as _warnings

_warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from ._device import DeviceAllocatorActor
from ._device_core import RELEASED_REMEMBERED_MAX, DeviceCore, Insufficient, PageOwner
from ._durations import DURATION_BOUNDS_S, DurationHistogram
from ._errors import InvariantError, LedgerError, SlotStateError
from ._host import HostPoolActor
from ._host_core import HostCore
from ._kv import CopyPlan, KVBuffer, KVShape, copy_kv, runs
from ._facts import FactKind, Facts
from ._mooncake import MooncakeBackend
from ._pages import PagePool, pages_of, slots_of_pages
from ._prefetch import StoragePrefetcherActor
from ._radix import RadixTree
from ._radix_node import (
    BACKED,
    NODE_TRANSITIONS,
    RESIDENT,
    HostInsert,
    InsertOutcome,
    Node,
    NodeState,
    NodeStateError,
    chain_hashes,
)
from ._file_backend import FileBackend
from ._storage import StorageBackend, open_backend
from ._stored_page import (
    KEY_CHARS_MAX,
    HostPages,
    PageFormat,
    StorageError,
    StorageIO,
    StorageUsage,
    page_keys,
)
from ._streams import LoadStreamActor, WriteStreamActor
from ._tree import TreeActor
from ._tree_core import TreeCore
from ._tree_shared import HandleError
from ._transfer_core import Piece, TransferOp, TransferQueue

__all__ = [
    "BACKED",
    "DURATION_BOUNDS_S",
    "NODE_TRANSITIONS",
    "RELEASED_REMEMBERED_MAX",
    "RESIDENT",
    "KEY_CHARS_MAX",
    "CopyPlan",
    "DeviceAllocatorActor",
    "DeviceCore",
    "DurationHistogram",
    "FileBackend",
    "FactKind",
    "Facts",
    "HandleError",
    "HostCore",
    "HostPages",
    "HostInsert",
    "HostPoolActor",
    "InsertOutcome",
    "Insufficient",
    "InvariantError",
    "KVBuffer",
    "KVShape",
    "LedgerError",
    "LoadStreamActor",
    "MooncakeBackend",
    "Node",
    "NodeState",
    "NodeStateError",
    "PageFormat",
    "PageOwner",
    "PagePool",
    "Piece",
    "RadixTree",
    "SlotStateError",
    "StorageBackend",
    "StorageError",
    "StorageIO",
    "StorageUsage",
    "StoragePrefetcherActor",
    "TransferOp",
    "TransferQueue",
    "TreeActor",
    "TreeCore",
    "WriteStreamActor",
    "chain_hashes",
    "copy_kv",
    "open_backend",
    "page_keys",
    "pages_of",
    "runs",
    "slots_of_pages",
]
