"""The actors and the plain cores they wrap."""

import warnings as _warnings

_warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from hicache.messages import ActorName

from ._device import DEVICE_ROUTES, DeviceAllocatorActor
from ._device_core import RELEASED_REMEMBERED_MAX, DeviceCore, Insufficient, PageOwner
from ._durations import DURATION_BOUNDS_S, DurationHistogram
from ._errors import InvariantError, LedgerError, SlotStateError
from ._host import HOST_ROUTES, HostPoolActor, HostSide
from ._host_core import HostCore
from ._kv import CopyPlan, KVBuffer, KVShape, copy_kv, runs
from ._facts import Facts
from ._mooncake import MooncakeBackend
from ._pages import PagePool, pages_of, slots_of_pages
from ._prefetch import PREFETCH_ROUTES, StoragePrefetcherActor
from ._radix import (
    BACKED,
    NODE_TRANSITIONS,
    RESIDENT,
    HostInsert,
    InsertOutcome,
    Node,
    NodeState,
    NodeStateError,
    RadixTree,
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
from ._routes import Route, Routes
from ._streams import LOAD_ROUTES, WRITE_ROUTES, LoadStreamActor, WriteStreamActor
from ._tree import TREE_ROUTES, TreeActor
from ._tree_core import HandleError, TreeCore
from ._transfer_core import Piece, TransferOp, TransferQueue

ROUTES: dict[ActorName, Routes] = {
    r.actor: r for r in (TREE_ROUTES, DEVICE_ROUTES, HOST_ROUTES, WRITE_ROUTES, LOAD_ROUTES, PREFETCH_ROUTES)
}
"""Each actor's route table, by its name (the facade is no actor: it has none)."""

__all__ = [
    "BACKED",
    "DEVICE_ROUTES",
    "DURATION_BOUNDS_S",
    "HOST_ROUTES",
    "LOAD_ROUTES",
    "NODE_TRANSITIONS",
    "PREFETCH_ROUTES",
    "RELEASED_REMEMBERED_MAX",
    "RESIDENT",
    "ROUTES",
    "TREE_ROUTES",
    "WRITE_ROUTES",
    "KEY_CHARS_MAX",
    "CopyPlan",
    "DeviceAllocatorActor",
    "DeviceCore",
    "DurationHistogram",
    "FileBackend",
    "Facts",
    "HandleError",
    "HostCore",
    "HostPages",
    "HostInsert",
    "HostPoolActor",
    "HostSide",
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
    "Route",
    "Routes",
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
