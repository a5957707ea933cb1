"""The actors and the plain cores they wrap."""

from ._device import DeviceAllocatorActor
from ._device_core import RELEASED_REMEMBERED_MAX, DeviceCore, Insufficient, LedgerView, PageOwner
from ._errors import InvariantError, LedgerError, SlotStateError
from ._host import HostPoolActor
from ._host_core import HostCore
from ._kv import CopyPlan, KVBuffer, KVShape, copy_kv, runs
from ._pages import PagePool, pages_of
from ._streams import LoadStreamActor, WriteStreamActor
from ._transfer_core import Piece, TransferOp, TransferQueue

__all__ = [
    "RELEASED_REMEMBERED_MAX",
    "CopyPlan",
    "DeviceAllocatorActor",
    "DeviceCore",
    "HostCore",
    "HostPoolActor",
    "Insufficient",
    "InvariantError",
    "KVBuffer",
    "KVShape",
    "LedgerError",
    "LedgerView",
    "LoadStreamActor",
    "PageOwner",
    "PagePool",
    "Piece",
    "SlotStateError",
    "TransferOp",
    "TransferQueue",
    "WriteStreamActor",
    "copy_kv",
    "pages_of",
    "runs",
]
