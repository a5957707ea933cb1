"""The actors and the plain cores they wrap."""

import warnings as _warnings

_warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from ._device import DeviceAllocatorActor
from ._device_core import RELEASED_REMEMBERED_MAX, DeviceCore, Insufficient, LedgerView, PageOwner
from ._errors import InvariantError, LedgerError, SlotStateError
from ._host import HostPoolActor
from ._host_core import HostCore
from ._kv import CopyPlan, KVBuffer, KVShape, copy_kv, runs
from ._pages import PagePool, pages_of
from ._radix import BACKED, NODE_TRANSITIONS, RESIDENT, InsertOutcome, Node, NodeState, NodeStateError, RadixTree
from ._streams import LoadStreamActor, WriteStreamActor
from ._tree import TreeActor
from ._tree_core import HandleError, TreeCore
from ._transfer_core import Piece, TransferOp, TransferQueue

__all__ = [
    "BACKED",
    "NODE_TRANSITIONS",
    "RELEASED_REMEMBERED_MAX",
    "RESIDENT",
    "CopyPlan",
    "DeviceAllocatorActor",
    "DeviceCore",
    "HandleError",
    "HostCore",
    "HostPoolActor",
    "InsertOutcome",
    "Insufficient",
    "InvariantError",
    "KVBuffer",
    "KVShape",
    "LedgerError",
    "LedgerView",
    "LoadStreamActor",
    "Node",
    "NodeState",
    "NodeStateError",
    "PageOwner",
    "PagePool",
    "Piece",
    "RadixTree",
    "SlotStateError",
    "TransferOp",
    "TransferQueue",
    "TreeActor",
    "TreeCore",
    "WriteStreamActor",
    "copy_kv",
    "pages_of",
    "runs",
]
