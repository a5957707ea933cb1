"""The actors and the plain cores they wrap."""

from hicache.messages import ActorName

from ._actor import Directory, HiActor, Mail, WrongSenderError
from ._device import DEVICE_ROUTES, DeviceAllocatorActor
from ._device_core import RELEASED_REMEMBERED_MAX, DeviceCore, Insufficient, PageOwner
from ._durations import DURATION_BOUNDS_S, DurationHistogram
from ._errors import InvariantError, LedgerError, SlotStateError
from ._host import HOST_ROUTES, HostPoolActor, HostSide
from ._host_core import HostCore
from ._layers import LayerDoneRing, LayerWaiter, LoadFailedError, StaleWaiterError
from ._kv import CopyPlan, KVBuffer, KVShape, copy_kv, runs
from ._facts import FactKind, Facts
from ._mooncake import MooncakeBackend
from ._pages import PagePool, pages_of, slots_of_pages
from ._prefetch import PREFETCH_ROUTES, StoragePrefetcherActor
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
    root_hash,
)
from ._file_backend import FileBackend
from ._storage import open_backend
from ._stored_page import (
    KEY_CHARS_MAX,
    HostPages,
    PageFormat,
    StorageBackend,
    StorageError,
    StorageIO,
    StorageUsage,
    page_keys,
)
from ._services import (
    ActorFailedError,
    FailedTransfers,
    FaultPlan,
    IdSource,
    NoFaults,
    SeededFaults,
    Services,
)
from ._routes import Route, Routes
from ._streams import LOAD_ROUTES, WRITE_ROUTES, LoadStreamActor, WriteStreamActor
from ._tree import TREE_ROUTES, TreeActor
from ._tree_core import TreeCore
from ._tree_shared import HandleError
from ._transfer_core import Piece, TransferOp, TransferQueue

ROUTES: dict[ActorName, Routes] = {
    r.actor: r for r in (TREE_ROUTES, DEVICE_ROUTES, HOST_ROUTES, WRITE_ROUTES, LOAD_ROUTES, PREFETCH_ROUTES)
}
"""Each actor's route table, by its name (the facade is no actor: it has none)."""

__all__ = [
    "Routes",
    "Route",
    "HostSide",
    "WRITE_ROUTES",
    "TREE_ROUTES",
    "ROUTES",
    "PREFETCH_ROUTES",
    "LOAD_ROUTES",
    "HOST_ROUTES",
    "DEVICE_ROUTES",
    "BACKED",
    "DURATION_BOUNDS_S",
    "KEY_CHARS_MAX",
    "NODE_TRANSITIONS",
    "RELEASED_REMEMBERED_MAX",
    "RESIDENT",
    "ActorFailedError",
    "CopyPlan",
    "DeviceAllocatorActor",
    "DeviceCore",
    "Directory",
    "DurationHistogram",
    "FactKind",
    "Facts",
    "FailedTransfers",
    "FaultPlan",
    "FileBackend",
    "HandleError",
    "HiActor",
    "HostCore",
    "HostInsert",
    "HostPages",
    "HostPoolActor",
    "IdSource",
    "InsertOutcome",
    "Insufficient",
    "InvariantError",
    "KVBuffer",
    "KVShape",
    "LayerDoneRing",
    "LayerWaiter",
    "LedgerError",
    "LoadFailedError",
    "LoadStreamActor",
    "Mail",
    "MooncakeBackend",
    "NoFaults",
    "Node",
    "NodeState",
    "NodeStateError",
    "PageFormat",
    "PageOwner",
    "PagePool",
    "Piece",
    "RadixTree",
    "SeededFaults",
    "Services",
    "SlotStateError",
    "StaleWaiterError",
    "StorageBackend",
    "StorageError",
    "StorageIO",
    "StoragePrefetcherActor",
    "StorageUsage",
    "TransferOp",
    "TransferQueue",
    "TreeActor",
    "TreeCore",
    "WriteStreamActor",
    "WrongSenderError",
    "chain_hashes",
    "root_hash",
    "copy_kv",
    "open_backend",
    "page_keys",
    "pages_of",
    "runs",
    "slots_of_pages",
]
