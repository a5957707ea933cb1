"""Mooncake Store as the storage tier, shared by many serving machines.

Each instance is a Mooncake client: it mounts `mooncake_segment_mb` of its memory into
the store and asks the master (`mooncake_master`, with its HTTP metadata server) where
objects live. Pages are stored in the envelope of `PageFormat` and move only through
one registered staging buffer (`batch_get_into` / `batch_put_from`), so the client
needs no local buffer of its own.

The client is a blocking C++ library, and none of this may hang. Measured here:
against an unreachable master `setup` retries for about 90 s, so `open` first connects
to the master and the metadata server itself, within `storage_timeout_s`; after the
master died, a `put` or `remove` returned only after about 4 s. So calls run on one
private daemon thread and the caller waits at most `storage_timeout_s`. This is the one
place hicache starts a thread outside the runtime: it wraps a blocking C client, not
actor logic. A call that overran makes the next calls fail at once until it returns, so
the thread never queues work and the staging buffer it may still be filling is not
reused meanwhile.

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
    clients (unset, the transfer engine listens on the first non-loopback interface).
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Final, TypeVar

import torch

from hicache.runtime.config import Config

from ._kv import KVBuffer, KVShape
from ._storage import PageFormat, Staging, StorageError, StorageIO, check_keys, log, page_starts

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

SETUP_RETRIES: Final = 3
"""Attempts of the client's `setup` (each up to `storage_timeout_s`)."""

_CLIENT_ENV: Final = ("MC_RPC_TIMEOUT_MS", "MC_RPC_CONNECT_TIMEOUT_MS", "MC_STORE_CLIENT_SETUP_RETRIES",
                      "MC_TCP_BIND_ADDRESS")
_USER_ENV: Final = frozenset(k for k in _CLIENT_ENV if k in os.environ)
"""The client variables the environment set before hicache ran: left as they are."""

_ABANDONED: Final[list[object]] = []
"""Clients left open by `close` (see the module docstring); kept referenced so that their
destructor, the same blocking teardown, does not run before process exit."""

_INSTALL_HINT: Final = (
    "install the extra (pip install 'hicache[mooncake]': mooncake-transfer-engine-non-cuda; "
    "mooncake-transfer-engine on CUDA hosts) and the Debian packages libibverbs1 "
    "ibverbs-providers libnl-3-200 libnl-route-3-200"
)


def _describe(code: int) -> str:
    return f"code {code}: {_CODES.get(code, 'see Mooncake ErrorCode')}"


class _CallFailed(Exception):
    """A client call did not return within the timeout, or an earlier one still runs."""


class _BoundedCalls:
    """Runs one blocking client call at a time on a daemon thread; waits at most `timeout_s`.

    A daemon thread, not a `ThreadPoolExecutor`: the executor joins its threads at
    interpreter exit, so one call stuck in the C client would hang the process's exit.
    `keep` holds what a stuck call may still touch (the staging buffer), so it outlives
    the backend.
    """

    def __init__(self, timeout_s: float, keep: tuple[object, ...]) -> None:
        self.timeout_s = timeout_s
        self._keep = keep
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._pending: tuple[str, Future[Any]] | None = None
        threading.Thread(target=self._work, name="hicache-mooncake", daemon=True).start()

    def busy(self) -> str:
        """What still runs after its caller gave up on it; "" when the thread is free."""
        if self._pending is None or self._pending[1].done():
            return ""
        return f"an earlier Mooncake call ({self._pending[0]}) has not returned after {self.timeout_s:g} s"

    def run(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the client thread; raises _CallFailed when it takes longer than
        the timeout (or the thread is still busy); re-raises what `fn` raised."""
        still = self.busy()
        if still:
            raise _CallFailed(still)
        future: Future[T] = Future()
        self._pending = (what, future)
        self._jobs.put((future, fn, args))
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError:
            raise _CallFailed(f"Mooncake {what} did not return within {self.timeout_s:g} s") from None

    def settle(self) -> str:
        """Wait up to the timeout for a call that overran; then `busy()`."""
        if self._pending is not None:
            try:
                self._pending[1].exception(timeout=self.timeout_s)
            except TimeoutError:
                pass
        return self.busy()

    def stop(self) -> None:
        self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            future.set_running_or_notify_cancel()
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the caller, who re-raises it
                future.set_exception(e)


class MooncakeBackend:
    """Pages in Mooncake Store (TCP transport). See the module docstring for how calls are bounded."""

    name = "mooncake"

    def __init__(self, config: Config) -> None:
        store_class = _store_class()
        _probe(config)
        self._config = config
        os.environ.update({k: v for k, v in _client_env(config).items() if k not in _USER_ENV})
        self.fmt = PageFormat(KVShape.of(config))
        self._staging = Staging(self.fmt, config.storage_batch_pages)
        self._store = store_class()
        self._calls = _BoundedCalls(config.storage_timeout_s, keep=(self._staging, self._store))
        self._closed = False
        try:
            rc = self._calls.run(
                "setup", self._store.setup, config.mooncake_local_host, config.mooncake_metadata,
                config.mooncake_segment_mb << 20, 0, "tcp", "", config.mooncake_master,
            )
            if rc == 0:
                rc = self._calls.run("register_buffer", self._store.register_buffer,
                                     self._staging.address, len(self._staging.buffer))
        except _CallFailed as e:
            _ABANDONED.append(self._store)  # still inside setup: never destroy it mid-run
            self._calls.stop()
            raise StorageError(_setup_failed(config, str(e))) from None
        if rc != 0:
            self._calls.stop()
            raise StorageError(_setup_failed(config, _describe(rc)))

    @property
    def pending(self) -> str:
        """The client call that still runs after its caller gave up on it ("" when none):
        until it returns, every call fails at once."""
        return self._calls.busy()

    @property
    def client(self) -> Any:
        """The `MooncakeDistributedStore` underneath, for tools and benches that need raw access."""
        return self._store

    def exists(self, keys: Sequence[str]) -> int:
        check_keys(keys)
        if not keys:
            return 0
        try:
            found = self._calls.run("batch_is_exist", self._store.batch_is_exist, list(keys))
        except _CallFailed as e:
            log.error("storage call failed", backend=self.name, call="batch_is_exist", error=str(e))
            return 0
        for i, f in enumerate(found):
            if f != 1:
                if f < 0:
                    log.error("storage call failed", backend=self.name, call="batch_is_exist", key=keys[i],
                              error=_describe(f))
                return i
        return len(keys)

    def read(self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> StorageIO:
        return self._staging.read(keys, host, slots, self._read_batch)

    def _read_batch(self, keys: Sequence[str]) -> tuple[int, str]:
        """Get and verify `keys` into the staging pages; (leading good pages, error)."""
        stored = self.fmt.stored_bytes
        ptrs = [self._staging.address + i * stored for i in range(len(keys))]
        try:
            got = self._calls.run("batch_get_into", self._store.batch_get_into, list(keys), ptrs,
                                  [stored] * len(keys))
        except _CallFailed as e:
            log.error("storage call failed", backend=self.name, call="batch_get_into", key=keys[0], error=str(e))
            return 0, f"page {keys[0]}: {e}"
        for i, (key, n) in enumerate(zip(keys, got, strict=True)):
            if n == _NOT_FOUND:
                return i, f"page {key} is not in storage"
            problem = self._oversized(key) if n == _INVALID_PARAMS else ""
            if problem:
                self._drop(key, problem)
                return i, f"page {key} is unusable ({problem}); dropped it"
            if n < 0:
                log.error("storage call failed", backend=self.name, call="batch_get_into", key=key,
                          error=_describe(n))
                return i, f"page {key}: Mooncake get failed ({_describe(n)})"
            problem = self.fmt.problem(key, self._staging.page(i, n))
            if problem:
                self._drop(key, problem)
                return i, f"page {key} is unusable ({problem}); dropped it"
        return len(keys), ""

    def _oversized(self, key: str) -> str:
        """Why `get_into` found no room for `key` when the object is larger than a page
        (the client says only 'invalid parameters'); "" when it is not that."""
        try:
            size = self._calls.run("get_size", self._store.get_size, key)
        except _CallFailed:
            return ""
        return f"object of {size} bytes, expected {self.fmt.stored_bytes}" if size > self.fmt.stored_bytes else ""

    def _drop(self, key: str, problem: str) -> None:
        log.warning("storage page unusable, dropped", backend=self.name, key=key, problem=problem)
        try:
            rc = self._calls.run("remove", self._store.remove, key, True)
        except _CallFailed as e:
            log.error("storage call failed", backend=self.name, call="remove", key=key, error=str(e))
            return
        if rc not in (0, _NOT_FOUND):
            log.error("storage call failed", backend=self.name, call="remove", key=key, error=_describe(rc))

    def write(self, keys: Sequence[str], host: KVBuffer, slots: torch.Tensor) -> StorageIO:
        check_keys(keys)
        starts = page_starts(keys, host, slots)
        stage = self._staging
        stored = self.fmt.stored_bytes
        written = 0

        def result(pages: int, error: str = "") -> StorageIO:
            return StorageIO(pages=pages, written=written, bytes=written * self.fmt.payload_bytes, error=error)

        for b in range(0, len(keys), stage.pages):
            batch = list(keys[b : b + stage.pages])
            try:
                found = self._calls.run("batch_is_exist", self._store.batch_is_exist, batch)
                failed = next((f for f in found if f < 0), 0)
                if failed:  # the master does not answer: a put now would only block the client
                    log.error("storage call failed", backend=self.name, call="batch_is_exist", key=batch[0],
                              error=_describe(failed))
                    return result(b, f"page {batch[0]}: Mooncake exists check failed ({_describe(failed)})")
                todo = [i for i, f in enumerate(found) if f != 1]
                if not todo:
                    continue
                stage.gather(host, [starts[b + i] for i in todo], [batch[i] for i in todo])
                codes = self._calls.run(
                    "batch_put_from", self._store.batch_put_from, [batch[i] for i in todo],
                    [stage.address + j * stored for j in range(len(todo))], [stored] * len(todo),
                )
            except _CallFailed as e:
                log.error("storage call failed", backend=self.name, call="write", key=batch[0], error=str(e))
                return result(b, f"page {batch[0]}: {e}")
            for i, rc in zip(todo, codes, strict=True):
                if rc not in (0, _ALREADY_EXISTS):
                    log.error("storage call failed", backend=self.name, call="batch_put_from", key=batch[i],
                              error=_describe(rc))
                    return result(b + i, f"page {batch[i]}: Mooncake put failed ({_describe(rc)})")
                if rc == 0:
                    written += 1
        return result(len(keys))

    def close(self) -> None:
        """Unmount this client's segment (its pages leave the store) and stop the call thread.

        When the master does not answer, or a call still hangs after waiting the timeout
        once more, the client is left open for Mooncake to tear down at exit (a close then
        would block the interpreter for over 10 s).
        """
        if self._closed:
            return
        self._closed = True
        problem = self._calls.settle()
        if not problem:
            try:
                _probe(self._config)
            except StorageError as e:
                problem = str(e)
        if problem:
            log.warning("storage client left open until exit", backend=self.name, reason=problem)
            _ABANDONED.append(self._store)
        else:
            self._store.close()  # holds the GIL, so the call thread could not bound it either
        self._calls.stop()


def _client_env(config: Config) -> dict[str, str]:
    """The Mooncake client's environment variables for `config` (see the module docstring)."""
    timeout_ms = str(max(1, round(config.storage_timeout_s * 1000)))
    return {
        "MC_RPC_TIMEOUT_MS": timeout_ms,
        "MC_RPC_CONNECT_TIMEOUT_MS": timeout_ms,
        "MC_STORE_CLIENT_SETUP_RETRIES": str(SETUP_RETRIES),
        "MC_TCP_BIND_ADDRESS": config.mooncake_local_host,
    }


def _setup_failed(config: Config, why: str) -> str:
    return (
        f"Mooncake client setup failed ({why}) with master {config.mooncake_master}, metadata server "
        f"{config.mooncake_metadata}, local host {config.mooncake_local_host}, segment "
        f"{config.mooncake_segment_mb} MiB: check that the master address is a mooncake_master's --rpc_port "
        "(not its metadata or metrics port), that mooncake_local_host is an address of this machine the "
        "other clients can reach, and that the segment fits in memory"
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
