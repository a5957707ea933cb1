"""Seeded randomised stress of the device ledger, the host state machine and the
transfers, against a plain model of who owns which page.

One random program (`Program`) plays the scheduler and the tree: allocate,
commit (writing fingerprint KV), release for all three reasons (the tree adopting
whole committed pages), write-through, device eviction, load-back, host drops,
prefetch reservations, and a few programmer errors. It runs on two backends:
the plain cores directly (thousands of steps per seed) and the actors on threads
(a shorter run). After every step the cores' invariants are checked and the
counts by owner / state are compared with the model; every KV byte that moves
is verified with the oracle; at the end everything is given back and every
device and host slot must be free. As in the messages, both backends name device
and host memory by page numbers; the program turns pages into slots for the
oracle and the copies.

A failure names its seed: rerun with the same seed to reproduce it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest
import torch

from hicache.actors import (
    DeviceCore,
    FailedTransfers,
    HostCore,
    Insufficient,
    LedgerError,
    PageOwner,
    SlotStateError,
    copy_kv,
)
from hicache.messages import ActorName, HostSlotState, Indices, LoadDone, ReleaseReason, WriteDone
from hicache.runtime import Config, HostLayout
from hicache.runtime.testing.oracle import FingerprintOracle

from conftest import pages_to_slots

S = HostSlotState
FAIL_EVERY = 11
"""Transfers whose op id is a multiple of this fail (injected on both backends)."""


def _fails(op: int) -> bool:
    return op % FAIL_EVERY == 0


class Backend(Protocol):
    """Device and host memory named by page numbers (`allocate` answers each request's new pages)."""

    device_kv: Any
    host_kv: Any

    def allocate(self, demands: list[tuple[str, int]]) -> dict[str, list[int]] | tuple[int, int, int]: ...
    def commit(self, rid: str, n: int) -> tuple[int, int]: ...
    def release(self, rid: str, adopt: list[int], reason: ReleaseReason) -> tuple[int, int]: ...
    def free_device(self, pages: list[int]) -> None: ...
    def allocate_load(self, n: int) -> list[int] | None: ...
    def adopt_loaded(self, pages: list[int]) -> None: ...
    def host_allocate(self, n: int) -> list[int] | None: ...
    def host_move(self, pages: list[int], state: HostSlotState) -> None: ...
    def host_free(self, pages: list[int]) -> None: ...
    def write(self, op: int, device: list[int], host: list[int]) -> bool: ...
    def load(self, op: int, host: list[int], device: list[int]) -> bool: ...
    def counts(self) -> tuple[dict[PageOwner, int], tuple[int, ...]]: ...


def _t(numbers: list[int]) -> torch.Tensor:
    return torch.tensor(numbers, dtype=torch.int64)


class CoreBackend:
    """The plain cores, called directly; copies are `copy_kv` between their buffers (on the
    slots of the pages)."""

    def __init__(self, config: Config) -> None:
        self.device = DeviceCore(config)
        self.host = HostCore(config)
        self.device_kv, self.host_kv = self.device.kv, self.host.kv
        self.p = config.page_size

    def allocate(self, demands: list[tuple[str, int]]) -> dict[str, list[int]] | tuple[int, int, int]:
        got = self.device.allocate_pages(demands)
        if isinstance(got, Insufficient):
            return (got.requested_slots, got.free_slots, got.shortfall_slots)
        return {rid: idx.tolist() for rid, idx in got.items()}

    def commit(self, rid: str, n: int) -> tuple[int, int]:
        v = self.device.commit(rid, n)
        return v.allocated, v.committed

    def release(self, rid: str, adopt: list[int], reason: ReleaseReason) -> tuple[int, int]:
        v = self.device.release(rid, _t(adopt), reason)
        return v.allocated, v.freed

    def free_device(self, pages: list[int]) -> None:
        self.device.free_tree(_t(pages))

    def allocate_load(self, n: int) -> list[int] | None:
        got = self.device.allocate_load(n)
        return None if isinstance(got, Insufficient) else got.tolist()

    def adopt_loaded(self, pages: list[int]) -> None:
        self.device.adopt_loaded(_t(pages))

    def host_allocate(self, n: int) -> list[int] | None:
        got = self.host.allocate(n)
        return None if got is None else got.tolist()

    def host_move(self, pages: list[int], state: HostSlotState) -> None:
        self.host.transition(_t(pages), state)

    def host_free(self, pages: list[int]) -> None:
        self.host.free(_t(pages))

    def write(self, op: int, device: list[int], host: list[int]) -> bool:
        self.host_move(host, S.WRITING)
        if _fails(op):
            self.host_move(host, S.RESERVED)
            return False
        copy_kv(self.device_kv, pages_to_slots(device, self.p), self.host_kv, pages_to_slots(host, self.p))
        self.host_move(host, S.SYNCED)
        return True

    def load(self, op: int, host: list[int], device: list[int]) -> bool:
        self.host_move(host, S.LOADING)
        if _fails(op):
            self.host_move(host, S.HOST_ONLY)
            return False
        for layer in range(self.device_kv.shape.layers):
            copy_kv(self.host_kv, pages_to_slots(host, self.p), self.device_kv, pages_to_slots(device, self.p),
                    layer=layer)
        self.host_move(host, S.SYNCED)
        return True

    def counts(self) -> tuple[dict[PageOwner, int], tuple[int, ...]]:
        self.device.check_invariants()
        self.host.check_invariants()
        return self.device.counts(), self.host.counts()


class ActorBackend:
    """The actors on threads, through `TreeSide` (which checks every actor's invariants
    after each message); copies go through the write and load streams."""

    def __init__(self, tree: Any) -> None:
        self.tree = tree
        self.device_kv, self.host_kv = tree.system.device_kv, tree.system.host_kv

    def allocate(self, demands: list[tuple[str, int]]) -> dict[str, list[int]] | tuple[int, int, int]:
        got = self.tree.allocate(dict(demands))
        if not isinstance(got, dict):
            return (got.requested_slots, got.free_slots, got.shortfall_slots)
        return {rid: idx.tolist() for rid, idx in got.items()}

    def commit(self, rid: str, n: int) -> tuple[int, int]:
        e = self.tree.commit(rid, n)
        return e.allocated, e.committed

    def release(self, rid: str, adopt: list[int], reason: ReleaseReason) -> tuple[int, int]:
        e = self.tree.release(rid, Indices.of(adopt), reason)
        return e.allocated, e.freed

    def free_device(self, pages: list[int]) -> None:
        self.tree.free_device(Indices.of(pages))

    def allocate_load(self, n: int) -> list[int] | None:
        got = self.tree.allocate_load(n)
        return None if got is None else got.tolist()

    def adopt_loaded(self, pages: list[int]) -> None:
        self.tree.adopt_loaded(Indices.of(pages))

    def host_allocate(self, n: int) -> list[int] | None:
        got = self.tree.host_allocate(n)
        return None if got is None else got.tolist()

    def host_move(self, pages: list[int], state: HostSlotState) -> None:
        self.tree.host_move(Indices.of(pages), state)

    def host_free(self, pages: list[int]) -> None:
        self.tree.host_free(Indices.of(pages))

    def write(self, op: int, device: list[int], host: list[int]) -> bool:
        return isinstance(self.tree.write(Indices.of(device), Indices.of(host), op_id=op), WriteDone)

    def load(self, op: int, host: list[int], device: list[int]) -> bool:
        return isinstance(self.tree.load(Indices.of(host), Indices.of(device), op_id=op), LoadDone)

    def counts(self) -> tuple[dict[PageOwner, int], tuple[int, ...]]:
        d = self.tree.statistics(ActorName.DEVICE)
        h = self.tree.statistics(ActorName.HOST)
        owners = {
            PageOwner.FREE: d.free_slots,
            PageOwner.REQUEST: d.request_slots,
            PageOwner.TREE: d.tree_slots,
            PageOwner.LOADING: d.loading_slots,
        }
        return owners, tuple(h.slots_in(s) for s in HostSlotState)


@dataclass
class _Request:
    tokens: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    """Its pages in token order (the last one maybe partly allocated)."""
    allocated: int = 0
    committed: int = 0


@dataclass
class _Block:
    """A cached prefix the tree keeps: its device pages, its host pages, or both."""

    tokens: list[int]
    device: list[int] | None
    host: list[int] | None


class Program:
    """The random scheduler-and-tree, with the model of every page's owner."""

    def __init__(self, backend: Backend, config: Config, seed: int) -> None:
        self.b = backend
        self.cfg = config
        self.p = config.page_size
        self.rng = random.Random(seed)
        self.oracle = FingerprintOracle(
            backend.device_kv.shape, seed=seed
        )
        self.live: dict[str, _Request] = {}
        self.final: set[str] = set()
        self.retracted: set[str] = set()
        self.blocks: list[_Block] = []
        self.reserved: list[list[int]] = []
        self.rids = 0
        self.ops = 0
        self.done: dict[str, int] = {}

    # -- the model ------------------------------------------------------------------

    def expected(self) -> tuple[dict[PageOwner, int], tuple[int, ...]]:
        """Slots by device owner and by host state (the cores count slots)."""
        p = self.p
        request = sum(len(r.pages) * p for r in self.live.values())
        tree = sum(len(b.device) * p for b in self.blocks if b.device is not None)
        device = {
            PageOwner.FREE: self.cfg.device_slots - request - tree,
            PageOwner.REQUEST: request,
            PageOwner.TREE: tree,
            PageOwner.LOADING: 0,
        }
        host = [0] * len(S)
        host[S.RESERVED] = sum(len(r) * p for r in self.reserved)
        host[S.SYNCED] = sum(len(b.host) * p for b in self.blocks if b.host is not None and b.device is not None)
        host[S.HOST_ONLY] = sum(len(b.host) * p for b in self.blocks if b.host is not None and b.device is None)
        host[S.FREE] = self.cfg.host_slots - sum(host)
        return device, tuple(host)

    def check(self, what: str) -> None:
        assert self.b.counts() == self.expected(), f"after {what}"

    def _device_owned(self) -> set[int]:
        owned = {pg for r in self.live.values() for pg in r.pages}
        owned |= {pg for b in self.blocks if b.device is not None for pg in b.device}
        return owned

    def _slots(self, pages: list[int]) -> torch.Tensor:
        return pages_to_slots(pages, self.p)

    def _request_slots(self, req: _Request, start: int, stop: int) -> torch.Tensor:
        """The slots of the request's tokens `start .. stop`."""
        return self._slots(req.pages)[start:stop]

    def _new_tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(30_000) for _ in range(n)]

    def _next_op(self) -> int:
        self.ops += 1
        return self.ops

    # -- steps ----------------------------------------------------------------------

    def allocate(self) -> None:
        rng, p = self.rng, self.p
        if self.final and rng.random() < 0.05:
            rid = rng.choice(sorted(self.final))
            with pytest.raises(LedgerError, match=f"request '{rid}' was already released"):
                self.b.allocate([(rid, 1)])
            return
        demands: dict[str, int] = {}
        for _ in range(rng.randint(1, 3)):
            if self.live and rng.random() < 0.6:
                rid = rng.choice(sorted(self.live))
            elif self.retracted and rng.random() < 0.3:
                rid = rng.choice(sorted(self.retracted))
            else:
                self.rids += 1
                rid = f"r{self.rids}"
            demands[rid] = rng.randint(0, 3 * p)
        wanted = {}
        for rid, n in demands.items():
            have = self.live[rid].allocated if rid in self.live else 0
            wanted[rid] = -(-max(0, n - (-have) % p) // p)  # what the last partial page cannot hold
        need = sum(wanted.values())
        free_pages = self.expected()[0][PageOwner.FREE] // p
        before = self._device_owned()
        got = self.b.allocate(list(demands.items()))
        if need > free_pages:
            assert got == (need * p, free_pages * p, (need - free_pages) * p)
            return
        assert isinstance(got, dict) and list(got) == list(demands)
        new_pages: set[int] = set()
        for rid, n in demands.items():
            req = self.live.setdefault(rid, _Request())
            self.retracted.discard(rid)
            assert len(got[rid]) == wanted[rid], "a grant names the request's new pages only"
            new_pages |= set(got[rid])
            req.pages += got[rid]
            req.allocated += n
            req.tokens += self._new_tokens(n)
        assert not new_pages & before, "allocation handed out a page that has an owner"
        assert len(new_pages) == need

    def commit(self) -> None:
        open_ = [rid for rid, r in sorted(self.live.items()) if r.committed < r.allocated]
        if not open_:
            return
        rid = self.rng.choice(open_)
        req = self.live[rid]
        room = req.allocated - req.committed
        if self.rng.random() < 0.05:
            with pytest.raises(LedgerError, match=f"request '{rid}': committing {room + 1} more slots"):
                self.b.commit(rid, room + 1)
            return
        n = self.rng.randint(1, room)
        start = req.committed
        self.oracle.write(self.b.device_kv, req.tokens, self._request_slots(req, start, start + n), start=start)
        assert self.b.commit(rid, n) == (req.allocated, start + n)
        req.committed += n

    def release(self) -> None:
        if not self.live:
            return
        rid = self.rng.choice(sorted(self.live))
        self._release(rid, self.rng.choice(list(ReleaseReason)))

    def _release(self, rid: str, reason: ReleaseReason) -> None:
        req = self.live.pop(rid)
        k = self.rng.randint(0, req.committed // self.p)  # whole committed pages the tree adopts
        adopt = req.pages[:k]
        if k:
            self.oracle.verify(self.b.device_kv, req.tokens, self._slots(adopt))
        assert self.b.release(rid, adopt, reason) == (req.allocated, req.allocated)
        self.done[rid] = req.allocated
        if k:
            self.blocks.append(_Block(req.tokens[: k * self.p], adopt, None))
        (self.retracted if reason is ReleaseReason.RETRACTED else self.final).add(rid)
        if reason is not ReleaseReason.RETRACTED:
            self.retracted.discard(rid)

    def _host_room(self, n: int) -> bool:
        return self.expected()[1][S.FREE] >= n

    def write_through(self) -> None:
        todo = [b for b in self.blocks if b.device is not None and b.host is None]
        if not todo:
            return
        block = self.rng.choice(todo)
        n = len(block.tokens)
        fits = self._host_room(n)
        host = self.b.host_allocate(n)
        assert (host is not None) == fits
        if host is None:
            return
        op = self._next_op()
        assert self.b.write(op, block.device, host) == (not _fails(op))
        if _fails(op):
            self.reserved.append(host)  # RESERVED again: its bytes are not valid
            return
        block.host = host
        self.oracle.verify(self.b.host_kv, block.tokens, self._slots(host))

    def evict_device(self) -> None:
        todo = [b for b in self.blocks if b.device is not None]
        if not todo:
            return
        block = self.rng.choice(todo)
        self.b.free_device(block.device)
        if block.host is None:
            self.blocks.remove(block)
            return
        block.device = None
        self.b.host_move(block.host, S.HOST_ONLY)

    def load_back(self) -> None:
        todo = [b for b in self.blocks if b.device is None]
        if not todo:
            return
        block = self.rng.choice(todo)
        assert block.host is not None
        n = len(block.tokens)
        fits = self.expected()[0][PageOwner.FREE] >= n
        device = self.b.allocate_load(n)
        assert (device is not None) == fits
        if device is None:
            return
        op = self._next_op()
        assert self.b.load(op, block.host, device) == (not _fails(op))
        if _fails(op):
            self.b.free_device(device)  # a failed load's pages hold nothing valid
            return
        self.b.adopt_loaded(device)
        block.device = device
        self.oracle.verify(self.b.device_kv, block.tokens, self._slots(device))

    def drop_host(self) -> None:
        todo = [b for b in self.blocks if b.host is not None]
        if not todo:
            return
        block = self.rng.choice(todo)
        self.b.host_free(block.host)
        block.host = None
        if block.device is None:
            self.blocks.remove(block)

    def prefetch(self) -> None:
        n = self.rng.randint(1, 3) * self.p
        fits = self._host_room(n)
        host = self.b.host_allocate(n)
        assert (host is not None) == fits
        if host is None:
            return
        self.b.host_move(host, S.PREFETCHING)
        if self.rng.random() < 0.3:  # the storage read failed
            self.b.host_move(host, S.RESERVED)
            self.reserved.append(host)
            return
        tokens = self._new_tokens(n)
        self.oracle.write(self.b.host_kv, tokens, self._slots(host))
        self.b.host_move(host, S.HOST_ONLY)
        self.blocks.append(_Block(tokens, None, host))

    def return_reservation(self) -> None:
        if self.reserved:
            self.b.host_free(self.reserved.pop(self.rng.randrange(len(self.reserved))))

    def misuse(self) -> None:
        """A programmer error; it must be refused and change nothing."""
        synced = [b for b in self.blocks if b.host is not None and b.device is not None]
        if synced and self.rng.random() < 0.5:
            block = self.rng.choice(synced)
            with pytest.raises(SlotStateError, match="to WRITING.*is SYNCED"):
                self.b.host_move(block.host, S.WRITING)
            return
        free_pages = sorted(set(range(self.cfg.device_pages)) - self._device_owned())
        if free_pages:
            page = self.rng.choice(free_pages)
            with pytest.raises(SlotStateError, match=r"double free\?"):
                self.b.free_device([page])

    def verify_some_block(self) -> None:
        if not self.blocks:
            return
        block = self.rng.choice(self.blocks)
        if block.device is not None:
            self.oracle.verify(self.b.device_kv, block.tokens, self._slots(block.device))
        if block.host is not None:
            self.oracle.verify(self.b.host_kv, block.tokens, self._slots(block.host))

    # -- the run --------------------------------------------------------------------

    STEPS = (
        (allocate, 5), (commit, 6), (release, 4), (write_through, 3), (evict_device, 3),
        (load_back, 3), (drop_host, 2), (prefetch, 1), (return_reservation, 1),
        (misuse, 0.3), (verify_some_block, 1),
    )

    def run(self, steps: int) -> None:
        fns = [f for f, _ in self.STEPS]
        weights = [w for _, w in self.STEPS]
        self.check("start")
        for i in range(steps):
            fn = self.rng.choices(fns, weights)[0]
            fn(self)
            self.check(f"step {i} ({fn.__name__})")
        self.give_everything_back()

    def give_everything_back(self) -> None:
        for rid in sorted(self.live):
            self._release(rid, ReleaseReason.FINISHED)
            self.check(f"final release of {rid}")
        for block in list(self.blocks):
            if block.device is not None:
                self.b.free_device(block.device)
            if block.host is not None:
                self.b.host_free(block.host)
            self.blocks.remove(block)
            self.check("final free of a block")
        for host in self.reserved:
            self.b.host_free(host)
        self.reserved.clear()
        device, host = self.b.counts()
        assert device[PageOwner.FREE] == self.cfg.device_slots, "device slots leaked"
        assert host[S.FREE] == self.cfg.host_slots, "host slots leaked"


CASES = [
    (0, 1, HostLayout.LAYER_FIRST),
    (1, 4, HostLayout.PAGE_FIRST),
    (2, 16, HostLayout.LAYER_FIRST),
    (3, 4, HostLayout.LAYER_FIRST),
]


@pytest.mark.parametrize(("seed", "page_size", "layout"), CASES, ids=lambda v: getattr(v, "value", v))
def test_random_ledger_and_host_traffic_on_the_cores_keeps_every_slot_accounted_for(
    make_config: Any, seed: int, page_size: int, layout: HostLayout
) -> None:
    cfg = make_config(page_size=page_size, device_pages=24, host_pages=40, host_layout=layout)
    backend = CoreBackend(cfg)
    program = Program(backend, cfg, seed)
    program.run(4000)
    # every finished request's ledger is whole, and enough happened to mean something
    for rid in program.final:
        view = backend.device.ledger(rid)
        assert view.freed == view.allocated == program.done[rid]
    assert len(program.final) > 50
    assert program.ops > 50


@pytest.mark.parametrize(("seed", "page_size", "layout"), [(10, 4, HostLayout.PAGE_FIRST), (11, 1, HostLayout.LAYER_FIRST)],
                         ids=lambda v: getattr(v, "value", v))
def test_random_traffic_through_the_actors_keeps_every_slot_accounted_for(
    make_config: Any, start_system: Any, seed: int, page_size: int, layout: HostLayout
) -> None:
    cfg = make_config(page_size=page_size, device_pages=16, host_pages=32, host_layout=layout, transfer_pages_max=2)
    tree = start_system(cfg, faults=FailedTransfers(frozenset(range(FAIL_EVERY, 100_000, FAIL_EVERY))))
    program = Program(ActorBackend(tree), cfg, seed)
    program.run(600)
    assert program.ops > 5 and len(program.final) > 5
    assert tree.probe.pending() == 0
