"""Mooncake Store as the storage tier, shared by many serving machines.

Each instance is a Mooncake client: it mounts `mooncake_segment_mb` of its memory into
the store and asks the master (`mooncake_master`, with its HTTP metadata server) where
objects live. A page is one object, its `PageFormat` record, named by its key and the
format's KV-shape tag (`<key>.<tag>`), so instances of another KV shape never see it.
Pages larger than a record block's (`RecordBlock.fits`: over 64 KiB) move straight
between the store and the host buffer, which the backend registers with the client: a
multi-buffer get scatters an object into the header slot of a small registered buffer
and the page's runs in host memory (`HostPages`), where it is verified; a multi-buffer
put gathers them back. Smaller pages go through a registered record block, one buffer
an object: a batch's objects are got into it, verified there and copied into their host
pages by one copy, or gathered into it by one copy and put. The client's cost is per
buffer, and a small layer_first page is a buffer per run (2 x layers), so the copy costs
less than the buffers it saves; a get that overruns its timeout then fills the block,
never host slots. The client needs no buffer of its own.

The client is a blocking C++ library, and none of this may hang. Measured here:
against an unreachable master `setup` retries for about 90 s, so `open` first connects
to the master and the metadata server itself, within `storage_timeout_s` (and refuses a
`mooncake_local_host` no interface here has: the client sets up with any); after the
master died, a `put` or `remove` returned only after about 4 s. So calls run on one
private daemon thread and the caller waits at most `storage_timeout_s`. This is the one
place hicache starts a thread outside the runtime: it wraps a blocking C client, not
actor logic. A call that overran makes the next calls fail at once until it returns, so
the thread never queues work and the buffers it may still be filling are not reused
meanwhile: the prefetcher does not report a prefetch stopped (after which the tree may
reuse its host slots) while a get into host slots is pending (`pending`).

Three client calls hold the interpreter lock, so no timeout of ours can bound them:
- `close` (about 2 s here with a live master, over 10 s against a dead one), and the
  destructor, which does the same teardown. `close` therefore first checks that no call
  hangs and that the master answers; otherwise it leaves the client open (`_ABANDONED`)
  and Mooncake tears it down at process exit.
- `setup`, which against an address that accepts connections but is no master waits on
  its RPCs without end. The client reads a few environment variables at each `setup`;
  the backend sets them from the `Config` first (`_client_env`), except those the
  environment had set before hicache was imported:
  - `MC_RPC_TIMEOUT_MS`, `MC_RPC_CONNECT_TIMEOUT_MS`: `storage_timeout_s`, so `setup`
    gives up within `SETUP_RETRIES` x the timeout;
  - `MC_STORE_CLIENT_SETUP_RETRIES`: `SETUP_RETRIES` (a retry picks another local port);
  - `MC_TCP_BIND_ADDRESS`: `mooncake_local_host`, the address announced to the other
    clients (unset, the transfer engine listens on the first non-loopback interface);
  - `MC_TCP_PROGRESS_TIMEOUT_SEC`, `MC_TCP_STATUS_TIMEOUT_SEC`: `storage_timeout_s` / 4 (whole
    seconds, at least 1). Unset (30 s), a get or put of objects in a peer that stopped answering
    (frozen, or gone without a reset) held the call thread 30-60 s, and every call meanwhile failed
    at once.
"""

from __future__ import annotations

import ctypes
import os
import queue
import socket
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import torch

from hicache.messages.config import Config

from ._errors import InvariantError
from ._io_threads import IOThreads, shares
from ._kv import KVBuffer, KVShape
from ._record_block import RecordBlock
from ._stored_page import (
    Headers,
    HostPages,
    PageFormat,
    StorageError,
    StorageIO,
    StorageUsage,
    check_keys,
    log,
    page_starts,
)

T = TypeVar("T")

_CODES: Final = {
    -1: "internal error",
    -200: "no space left in the store's segments",
    -600: "invalid parameters",
    -704: "object not found",
    -705: "object already exists",
    -706: "object has a lease",
    -800: "transfer failed",
    -900: "RPC to the master failed (is mooncake_master running?)",
}
"""Mooncake `ErrorCode`s seen here, in words (the client returns them as negative ints)."""
_INVALID_PARAMS: Final = -600
_NOT_FOUND: Final = -704
_ALREADY_EXISTS: Final = -705
_TRANSFER_FAILED: Final = -800

SETUP_RETRIES: Final = 3
"""Attempts of the client's `setup` (each up to `storage_timeout_s`)."""
TRANSFER_WAITS: Final = 4
"""A get or put of one batch whose objects lie in a peer that stopped answering returned after about
3 of the TCP transport's progress timeouts here (8 pages; 1 page: 1), so that timeout is
`storage_timeout_s` / 4, in whole seconds and at least 1."""
SETUP_WAIT_MIN_S: Final = 5.0
"""Least time opening waits for the client's setup and registrations: a healthy setup takes
40-300 ms here, longer than a tight `storage_timeout_s` meant for reads and writes."""

_CLIENT_ENV: Final = ("MC_RPC_TIMEOUT_MS", "MC_RPC_CONNECT_TIMEOUT_MS", "MC_STORE_CLIENT_SETUP_RETRIES",
                      "MC_TCP_BIND_ADDRESS", "MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
_USER_ENV: Final = frozenset(k for k in _CLIENT_ENV if k in os.environ)
"""The client variables the environment set before hicache ran: left as they are."""

_ABANDONED: Final[list[object]] = []
"""Clients left open by `close` (see the module docstring); kept referenced so that their
destructor, the same blocking teardown, does not run before process exit. With a client whose
call that reads or writes our buffers (`_TOUCHES_BUFFERS`) still runs, those buffers too; without
one, the client touches them no more (its transfers to and from peers use its segment)."""

_INSTALL_HINT: Final = (
    "install the extra (pip install 'hicache[mooncake]': mooncake-transfer-engine-non-cuda; "
    "mooncake-transfer-engine on CUDA hosts) and the Debian packages libibverbs1 "
    "ibverbs-providers libnl-3-200 libnl-route-3-200"
)


def _describe(code: int) -> str:
    return f"code {code}: {_CODES.get(code, 'see Mooncake ErrorCode')}"


class _CallFailed(Exception):
    """A client call did not return within the timeout, or an earlier one still runs."""


_WRITES_HOST_SLOTS: Final = frozenset({"batch_get_into_multi_buffers"})
"""The client calls that write into host slots (a small page's get fills the record block)."""
_TOUCHES_BUFFERS: Final = frozenset({"batch_get_into", "batch_get_into_multi_buffers", "batch_put_from",
                                     "batch_put_from_multi_buffers", "register_buffer"})
"""The client calls that read or write (or register) our buffers: the headers, the record block, the
host KV. The others (existence checks, sizes, removals) touch none of them."""


class _BoundedCalls:
    """Runs one blocking client call at a time on a daemon thread; waits at most `timeout_s`.

    A daemon thread, not a `ThreadPoolExecutor`: the executor joins its threads at
    interpreter exit, so one call stuck in the C client would hang the process's exit.
    `keep` holds what a stuck call may still touch (the registered buffers), so it outlives
    the backend.

    The hand-off is a queue and a lock, not a `Future`: the thread releases `_returned` once
    a call's outcome is in `_outcome`, and the caller waits on that lock alone (half the
    cost of a future's condition here, 17-20 against 36-37 us a call, which a step of small
    pages pays once or twice). Exactly one release follows each call, so a call that
    overran is known to have returned once its release can be taken (`busy`).
    """

    def __init__(self, timeout_s: float, keep: list[object]) -> None:
        self.timeout_s = timeout_s
        self._keep = keep
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._returned = threading.Lock()
        self._returned.acquire()  # held until the thread has an outcome to hand over
        self._outcome: tuple[bool, Any] = (True, None)
        """(returned, its value) or (raised, the exception), of the last call."""
        self._overran = ""
        """The name of a call the caller gave up on, until the thread is done with it."""
        self._thread = threading.Thread(target=self._work, name="hicache-mooncake", daemon=True)
        self._thread.start()

    @property
    def overran(self) -> str:
        """The name of the call its caller gave up on, until the thread is done with it ("": none)."""
        return self._overran

    def busy(self) -> str:
        """What still runs after its caller gave up on it; "" when the thread is free."""
        if self._overran:
            self._take_overrun(blocking=False)
        if not self._overran:
            return ""
        return f"an earlier Mooncake call ({self._overran}) has not returned after {self.timeout_s:g} s"

    def _take_overrun(self, *, blocking: bool) -> None:
        """Take the release of the call that overran if it has returned (`blocking`: waiting up
        to the timeout for it); its outcome, which no caller waits for any more, is dropped."""
        lock = self._returned
        if lock.acquire(timeout=self.timeout_s) if blocking else lock.acquire(blocking=False):
            self._overran = ""
            self._outcome = (True, None)  # let go of its value (and of an exception's frames)

    def run(self, what: str, fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
        """`fn(*args)` on the client thread; raises _CallFailed when it takes longer than
        `timeout_s` (by default the calls' timeout) or the thread is still busy; re-raises what
        `fn` raised."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        still = self.busy()
        if still:
            raise _CallFailed(still)
        # Pending until its outcome is taken here: a wait cut short leaves it so, and set before
        # the hand-over, a call cut short before it would keep every later call failing (safe),
        # never take another call's outcome.
        self._overran = what
        self._jobs.put((fn, args))
        if not self._returned.acquire(timeout=wait_s):
            raise _CallFailed(f"Mooncake {what} did not return within {wait_s:g} s")
        self._overran = ""
        returned, value = self._outcome
        self._outcome = (True, None)  # let go of the value (and of an exception's frames)
        if returned:
            return value  # type: ignore[no-any-return]
        raise value

    def check_invariants(self) -> None:
        """Between calls, an outcome is handed over only for a call that overran: one for
        nobody would be taken by the next call as its own."""
        if not self._overran and not self._returned.locked():
            raise InvariantError("Mooncake calls: an outcome was handed over with no call waiting for it "
                                 "(each call's thread releases exactly once)")

    def settle(self) -> str:
        """Wait up to the timeout for a call that overran; then `busy()`."""
        if self._overran:
            self._take_overrun(blocking=True)
        return self.busy()

    def stop(self, *, wait: bool) -> None:
        """End the thread once it is free; `wait`: return once it has ended (up to the timeout;
        a close does not wait for a thread whose call is stuck in the client)."""
        self._jobs.put(None)
        if wait:
            self._thread.join(self.timeout_s)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args = job
            try:
                self._outcome = (True, fn(*args))
            except BaseException as e:  # handed to the caller, who re-raises it
                self._outcome = (False, e)
            self._returned.release()


class MooncakeBackend:
    """Pages in Mooncake Store (TCP transport). See the module docstring for how calls are bounded."""

    name = "mooncake"

    def __init__(self, config: Config) -> None:
        store_class = _store_class()
        _probe(config)
        _check_local_host(config.mooncake_local_host)
        self._config = config
        os.environ.update({k: v for k, v in _client_env(config).items() if k not in _USER_ENV})
        self.fmt = PageFormat(KVShape.of(config))
        self._batch = config.storage_step_pages
        self._headers = torch.zeros(self._batch * self.fmt.header_bytes, dtype=torch.uint8)
        self._moved = Headers(self.fmt, _bytes_of(self._headers))
        """The headers a get receives into or a put sends from (registered with the client)."""
        self._expected = Headers.allocate(self.fmt, self._batch)
        self._block = RecordBlock(self.fmt, capacity=self._batch) if RecordBlock.fits(self.fmt) else None
        """Where a get of small pages lands, a batch's objects one after another (registered)."""
        self._store = store_class()
        self._keep: list[object] = [self._headers, self._store, self._block]
        self._hosts: dict[int, HostPages] = {}
        """Host buffers registered with the client, by address."""
        self._errors = 0
        self._late_put: list[str] = []
        """Objects of a put straight from host memory that overran: its caller gave up and the tree
        may reuse those host slots while the put still reads them, so once it returns they go."""
        self._calls = _BoundedCalls(config.storage_timeout_s, keep=self._keep)
        self._threads = IOThreads(config.storage_read_threads, "hicache-mooncake-verify")
        self._closed = False
        wait_s = max(SETUP_RETRIES * config.storage_timeout_s, SETUP_WAIT_MIN_S)
        try:
            rc = self._calls.run(
                "setup", self._store.setup, config.mooncake_local_host, config.mooncake_metadata,
                config.mooncake_segment_mb << 20, 0, "tcp", "", config.mooncake_master, timeout_s=wait_s,
            )
            if rc == 0:
                rc = self._calls.run("register_buffer", self._store.register_buffer,
                                     self._headers.data_ptr(), self._headers.numel(), timeout_s=wait_s)
            if rc == 0 and self._block is not None:
                rc = self._calls.run("register_buffer", self._store.register_buffer,
                                     self._block.address, self._block.nbytes, timeout_s=wait_s)
        except _CallFailed as e:
            _ABANDONED.append(self._store)  # still inside setup: never destroy it mid-run
            self._calls.stop(wait=False)
            raise StorageError(_setup_failed(config, str(e))) from None
        if rc != 0:
            self._calls.stop(wait=True)
            raise StorageError(_setup_failed(config, _describe(rc)))

    @property
    def pending(self) -> str:
        """A client call that still runs after its caller gave up on it and may still write
        host slots ("" when none): a get straight into host pages. Any call that overran makes
        the next calls fail at once until it returns, but only such a get holds back a stopped
        prefetch (whose host slots the tree may then reuse): against a dead master an
        existence check or a put returns after about 4 s, and a stop waited that long."""
        still = self._calls.busy()
        return still if still and self._calls.overran in _WRITES_HOST_SLOTS else ""

    @property
    def client(self) -> Any:
        """The `MooncakeDistributedStore` underneath, for tools and benches that need raw access."""
        return self._store

    def object_key(self, key: str) -> str:
        """The store's name of the page of `key`: the key and this KV shape's format tag."""
        return f"{key}.{self.fmt.tag}"

    def usage(self) -> StorageUsage:
        return StorageUsage(io_errors=self._errors)

    def check_invariants(self) -> None:
        """The pages' bookkeeping is the store's; here, the hand-over of client calls."""
        self._calls.check_invariants()

    def _failed(self, call: str, key: str, error: str) -> None:
        self._errors += 1
        log.error("storage call failed", backend=self.name, call=call, key=key, error=error)

    def exists(self, keys: Sequence[str]) -> int:
        check_keys(keys)
        if not keys:
            return 0
        self._remove_late_put()
        try:
            found = self._calls.run("batch_is_exist", self._store.batch_is_exist, [self.object_key(k) for k in keys])
        except _CallFailed as e:
            self._failed("batch_is_exist", keys[0], str(e))
            return 0
        for i, f in enumerate(found):
            if f != 1:
                if f < 0:
                    self._failed("batch_is_exist", keys[i], _describe(f))
                return i
        return len(keys)

    def _host_pages(self, host: KVBuffer) -> tuple[HostPages | None, str]:
        """The host buffer's pages, registered with the client at first use."""
        address = host.tensor.data_ptr()
        pages = self._hosts.get(address)
        if pages is not None and pages.host is host:
            return pages, ""
        pages = HostPages(host)
        try:
            rc = self._calls.run("register_buffer", self._store.register_buffer, pages.address, pages.nbytes)
        except _CallFailed as e:
            rc, why = -1, str(e)
        else:
            why = _describe(rc)
        if rc != 0:
            self._failed("register_buffer", "", why)
            return None, f"registering the host buffer with Mooncake failed ({why})"
        self._hosts[address] = pages
        self._keep.append(pages)
        return pages, ""

    def _buffers(self, pages: HostPages, starts: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Per page: the addresses and sizes of its header slot and its runs in host memory."""
        h = self.fmt.header_bytes
        base, hdr = pages.address, self._headers.data_ptr()
        ptrs, sizes = [], []
        for i, start in enumerate(starts):
            spans = pages.spans(start)
            ptrs.append([hdr + i * h, *(base + off for off, _ in spans)])
            sizes.append([h, *(n for _, n in spans)])
        return ptrs, sizes

    def read(self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> StorageIO:
        check_keys(keys)
        starts = page_starts(keys, host, slots)
        self._remove_late_put()
        pages, error = self._host_pages(host) if keys else (None, "")
        done = 0
        while done < len(keys) and not error:
            batch = keys[done : done + self._batch]
            good, error = self._read_batch(batch, starts[done : done + len(batch)], pages)
            done += good
        return StorageIO(pages=done, bytes=done * self.fmt.payload_bytes, error=error)

    def _read_batch(self, keys: Sequence[str], starts: Sequence[int], pages: HostPages) -> tuple[int, str]:
        """Get `keys` and verify them; (leading good pages, error). Small pages (`RecordBlock.fits`)
        come into the registered record block, one buffer an object, are verified there and copied
        into their host pages; larger ones come straight into their host pages, a buffer a run
        (the header's into the registered header slots), and are verified there."""
        objects, block = [self.object_key(k) for k in keys], self._block
        try:
            if block is not None:
                size = self.fmt.stored_bytes
                got = self._calls.run("batch_get_into", self._store.batch_get_into, objects,
                                      block.addresses(len(keys)), [size] * len(keys))
                n = next((i for i, code in enumerate(got) if code != size), len(keys))  # a size: a short object
            else:
                ptrs, sizes = self._buffers(pages, starts)
                got = self._calls.run("batch_get_into_multi_buffers", self._store.batch_get_into_multi_buffers,
                                      objects, ptrs, sizes)
                n = next((i for i, code in enumerate(got) if code < 0), len(keys))
        except _CallFailed as e:
            self._failed("batch_get", keys[0], str(e))
            return 0, f"page {keys[0]}: {e}"
        if block is not None:  # the headers to where a multi-buffer get puts them, for one comparison
            sums = block.received(n, self._moved.memory)
        else:
            sums = self._checksums(pages, pages.payloads(starts[:n]))
        self._expected.fill(keys[:n], sums)
        if not self._moved.same(self._expected, n):
            bad, problem = self._moved.first_bad(self._expected, keys[:n], sums)
            if block is not None:
                block.scatter(bad, starts, pages)
            self._drop(keys[bad], problem)
            return bad, f"page {keys[bad]} is unusable ({problem}); dropped it"
        if block is not None:
            block.scatter(n, starts, pages)
        if n == len(keys):
            return n, ""
        key, code = keys[n], got[n]
        if code == _NOT_FOUND:
            return n, f"page {key} is not in storage"
        problem = self._misfit(key) if code >= 0 or code in (_INVALID_PARAMS, _TRANSFER_FAILED) else ""
        if problem:
            self._drop(key, problem)
            return n, f"page {key} is unusable ({problem}); dropped it"
        self._failed("batch_get", key, _describe(code))
        return n, f"page {key}: Mooncake get failed ({_describe(code)})"

    def _misfit(self, key: str) -> str:
        """Why a get of `key` failed when the object is not the size of a page (the client says
        only 'invalid parameters' or 'transfer failed'); "" when it is not that."""
        try:
            size = self._calls.run("get_size", self._store.get_size, self.object_key(key))
        except _CallFailed:
            return ""
        if size < 0:  # an error code, not a size: gone (-704) or unanswered, never proof of a misfit
            return ""
        return f"object of {size} bytes, expected {self.fmt.stored_bytes}" if size != self.fmt.stored_bytes else ""

    def _drop(self, key: str, problem: str) -> None:
        log.warning("storage page unusable, dropped", backend=self.name, key=key, problem=problem)
        try:
            rc = self._calls.run("remove", self._store.remove, self.object_key(key), True)
        except _CallFailed as e:
            self._failed("remove", key, str(e))
            return
        if rc not in (0, _NOT_FOUND):
            self._failed("remove", key, _describe(rc))

    def write(self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> StorageIO:
        check_keys(keys)
        starts = page_starts(keys, host, slots)
        self._remove_late_put()
        pages, error = self._host_pages(host) if keys else (None, "")
        if error:
            return StorageIO(pages=0, error=f"page {keys[0]}: {error}")
        written = 0
        for b in range(0, len(keys), self._batch):
            stored, done, error = self._write_batch(keys[b : b + self._batch], starts[b : b + self._batch], pages)
            written += done
            if error:
                return StorageIO(pages=b + stored, written=written, bytes=written * self.fmt.payload_bytes,
                                 error=error)
        return StorageIO(pages=len(keys), written=written, bytes=written * self.fmt.payload_bytes)

    def _write_batch(
        self, keys: Sequence[str], starts: Sequence[int], pages: HostPages
    ) -> tuple[int, int, str]:
        """Put the pages of `keys` not yet stored: (leading pages now stored, pages written, error).
        Small pages (`RecordBlock.fits`) are gathered into the registered record block and put
        one buffer an object; larger ones straight from host memory, a buffer a run."""
        objects = [self.object_key(k) for k in keys]
        from_host: list[str] = []
        try:
            found = self._calls.run("batch_is_exist", self._store.batch_is_exist, objects)
            failed = next((f for f in found if f < 0), 0)
            if failed:  # the master does not answer: a put now would only block the client
                self._failed("batch_is_exist", keys[0], _describe(failed))
                return 0, 0, f"page {keys[0]}: Mooncake exists check failed ({_describe(failed)})"
            todo = [i for i, f in enumerate(found) if f != 1]
            if not todo:
                return len(keys), 0, ""
            todo_keys, todo_starts = [keys[i] for i in todo], [starts[i] for i in todo]
            if self._block is not None:
                self._block.fill(todo_keys, todo_starts, pages)
                codes = self._calls.run("batch_put_from", self._store.batch_put_from, [objects[i] for i in todo],
                                        self._block.addresses(len(todo)), [self.fmt.stored_bytes] * len(todo))
            else:
                ptrs, sizes = self._buffers(pages, todo_starts)
                self._moved.fill(todo_keys, pages.checksums(pages.payloads(todo_starts)))
                from_host = [objects[i] for i in todo]
                codes = self._calls.run("batch_put_from_multi_buffers", self._store.batch_put_from_multi_buffers,
                                        [objects[i] for i in todo], ptrs, sizes)
        except _CallFailed as e:
            if from_host:  # the put itself overran (the existence check just returned): it still reads host slots
                self._late_put = from_host
            self._failed("write", keys[0], str(e))
            return 0, 0, f"page {keys[0]}: {e}"
        written = 0
        for i, rc in zip(todo, codes, strict=True):
            if rc not in (0, _ALREADY_EXISTS):
                self._failed("batch_put", keys[i], _describe(rc))
                return i, written, f"page {keys[i]}: Mooncake put failed ({_describe(rc)})"
            written += rc == 0
        return len(keys), written, ""

    def _remove_late_put(self) -> None:
        """Once a put from host memory that overran has returned, remove the objects it may have
        stored: their payload may have been read from host slots the tree reused after the backup
        failed, so it need not match their header (a reader would drop them as corrupt)."""
        if not self._late_put or self._calls.busy():
            return
        objects, self._late_put = self._late_put, []
        log.warning("storage put overran, its objects removed", backend=self.name, key=objects[0], pages=len(objects))
        try:
            codes = self._calls.run("batch_remove", self._store.batch_remove, objects, True)
        except _CallFailed as e:
            self._failed("remove", objects[0], str(e))
            return
        bad = [(o, c) for o, c in zip(objects, codes) if c not in (0, _NOT_FOUND)]
        if bad:
            self._failed("remove", bad[0][0], _describe(bad[0][1]))

    def _checksums(self, pages: HostPages, payloads: list[Any]) -> list[int]:
        """The checksums of pages a get brought into host memory: large pages of one run
        (page_first) on `storage_read_threads` threads, in contiguous shares
        (`THREADED_PAGE_BYTES_MIN`). A layer_first page's checksum streams over its runs, each
        too small to let go of the interpreter lock: a second thread would only wait for it."""
        k = min(self._threads.threads_for(self.fmt.payload_bytes), len(payloads))
        if k <= 1 or pages.runs_per_page > 1:
            return pages.checksums(payloads)
        parts = [payloads[a:b] for a, b in shares(len(payloads), k)]
        return [s for part in self._threads.map(pages.checksums, parts) for s in part]

    def close(self) -> None:
        """Unmount this client's segment (its pages leave the store) and stop the call thread.

        When the master does not answer a request within the timeout, or a call still hangs
        after waiting the timeout once more, the client is left open for Mooncake to tear
        down at exit (a close then would block the interpreter for over 10 s).
        """
        if self._closed:
            return
        self._closed = True
        problem = self._calls.settle()
        if not problem:
            self._remove_late_put()
            try:
                _probe(self._config)
            except StorageError as e:
                problem = str(e)
        if not problem:
            problem = self._unanswered()
        if problem:
            log.warning("storage client left open until exit", backend=self.name, reason=problem)
            # The client, and the buffers only while a call that may still touch them runs: kept
            # for good, the host KV buffer (the whole host tier) outlived every restart that
            # met a dead or frozen master.
            _ABANDONED.append(self._keep if self._calls.overran in _TOUCHES_BUFFERS else self._store)
        else:
            self._store.close()  # holds the GIL, so the call thread could not bound it either
        self._calls.stop(wait=not problem)
        self._threads.close()


    def _unanswered(self) -> str:
        """Why the master does not answer a request within the timeout ("" when it does). A
        connection alone is no answer: the kernel of a stopped (SIGSTOP) master accepts it,
        and a close against that master blocked the interpreter for about 9 s."""
        try:
            found = self._calls.run("batch_is_exist", self._store.batch_is_exist, [self.object_key(_PROBE_KEY)])
        except _CallFailed as e:
            return str(e)
        bad = [f for f in found if f < 0]
        return f"the master answered a probe with {_describe(bad[0])}" if bad else ""


_PROBE_KEY: Final = "hicache-close-probe"
"""The key whose existence `close` asks the master for, to see that it answers."""


def _bytes_of(buffer: torch.Tensor) -> memoryview:
    """The memory of `buffer` (uint8, CPU) as a writable byte view."""
    return memoryview((ctypes.c_char * buffer.numel()).from_address(buffer.data_ptr())).cast("B")


def _client_env(config: Config) -> dict[str, str]:
    """The Mooncake client's environment variables for `config` (see the module docstring)."""
    timeout_ms = str(max(1, round(config.storage_timeout_s * 1000)))
    # A transfer to a peer that stopped answering (frozen, or its host gone without a reset) waits on
    # these, 30 s each by default, and a batch waits several in a row: whole seconds, at least 1.
    transfer_s = str(max(1, int(config.storage_timeout_s / TRANSFER_WAITS)))
    return {
        "MC_RPC_TIMEOUT_MS": timeout_ms,
        "MC_RPC_CONNECT_TIMEOUT_MS": timeout_ms,
        "MC_STORE_CLIENT_SETUP_RETRIES": str(SETUP_RETRIES),
        "MC_TCP_BIND_ADDRESS": config.mooncake_local_host,
        "MC_TCP_PROGRESS_TIMEOUT_SEC": transfer_s,
        "MC_TCP_STATUS_TIMEOUT_SEC": transfer_s,
    }


def _setup_failed(config: Config, why: str) -> str:
    return (
        f"Mooncake client setup failed ({why}) with master {config.mooncake_master}, metadata server "
        f"{config.mooncake_metadata}, local host {config.mooncake_local_host}, segment "
        f"{config.mooncake_segment_mb} MiB: check that the master address is a mooncake_master's --rpc_port "
        "(not its metadata or metrics port), that the master answers (a frozen or overloaded one still "
        "accepts connections), that mooncake_metadata is its metadata URL (path /metadata), and that the "
        "segment fits in memory"
    )


def _store_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise StorageError(f"Mooncake Store cannot be loaded ({e}): {_INSTALL_HINT}") from None
    return MooncakeDistributedStore


def _probe(config: Config) -> None:
    """Connect to the master and the metadata server once, within the timeout, so that an
    unreachable one is a clear error now rather than a client that retries for 90 s."""
    tried = f"master {config.mooncake_master!r}, metadata server {config.mooncake_metadata!r}"
    host, _, port = config.mooncake_master.rpartition(":")
    url = urllib.parse.urlsplit(config.mooncake_metadata)
    if not host or not port.isdigit():
        raise StorageError(f"mooncake_master={config.mooncake_master!r} must be host:port (the master's RPC port)")
    if url.scheme != "http" or not url.hostname:
        raise StorageError(f"mooncake_metadata={config.mooncake_metadata!r} must be an http:// URL of the "
                           "master's HTTP metadata server, like http://10.0.0.1:8080/metadata")
    for what, address in (("master", (host, int(port))), ("metadata server", (url.hostname, url.port or 80))):
        try:
            socket.create_connection(address, timeout=config.storage_timeout_s).close()
        except OSError as e:
            raise StorageError(
                f"cannot reach the Mooncake {what} at {address[0]}:{address[1]} ({e}); tried {tried}. "
                "Check that mooncake_master runs there with --enable_http_metadata_server=true, that "
                "its --rpc_port and --http_metadata_server_port match these addresses, and that no "
                "firewall blocks them (docs/operations.md)"
            ) from None


def _check_local_host(host: str) -> None:
    """Refuse a `mooncake_local_host` that is not an address of this machine. The client sets up
    with any, and this instance then serves its own pages, but every other client's get from its
    segment and put into it fails (-800): the transfer engine cannot listen there."""
    why = "it resolves to no address"
    try:
        found = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError as e:
        found, why = [], str(e)
    for family, kind, _, _, address in found:
        try:
            with socket.socket(family, kind) as s:
                s.bind(address)
            return
        except OSError as e:
            why = f"{address[0]}: {e}"
    raise StorageError(
        f"mooncake_local_host={host!r} is not an address of this machine ({why}): set it to this "
        "machine's address that the other serving machines reach (127.0.0.1 when all run here); the "
        "other clients read and write this instance's segment through it (docs/operations.md)"
    )
