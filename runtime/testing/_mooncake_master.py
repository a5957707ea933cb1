"""A private `mooncake_master` on 127.0.0.1, for tests and benchmarks.

`MooncakeMaster` starts the master that the `mooncake-transfer-engine(-non-cuda)`
wheel ships, with its HTTP metadata server, on free loopback ports, waits until both
accept connections, and stops it. Production masters are started by operators
(docs/operations.md); this class only saves tests and benches from a fixed port that
another run may hold.
"""

from __future__ import annotations

import importlib.util
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

HOST = "127.0.0.1"
START_TIMEOUT_S = 15.0
"""Longest wait for a new master to accept connections."""
STOP_TIMEOUT_S = 5.0
"""Longest wait for a stopped master to exit before it is killed."""


class MasterStartError(RuntimeError):
    """The master binary is missing, or the master did not come up; the message says why."""


def master_binary() -> Path:
    """The `mooncake_master` executable: the one inside the installed `mooncake` package,
    else the first on PATH."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "mooncake_master"
        if candidate.is_file():
            return candidate
    found = shutil.which("mooncake_master")
    if found:
        return Path(found)
    raise MasterStartError(
        "mooncake_master was not found: install hicache's mooncake extra "
        "(pip install 'hicache[mooncake]', or `make install`), which ships it"
    )


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports the kernel had free on HOST a moment ago."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection((HOST, port), timeout=0.2).close()
    except OSError:
        return False
    return True


class MooncakeMaster:
    """One `mooncake_master` process on HOST; a context manager that stops it on exit.

    `config_fields()` gives the `Config` fields that point a client at it.
    """

    def __init__(self, *, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.start_timeout_s = start_timeout_s
        self.rpc_port, self.metadata_port, self.metrics_port = _free_ports(3)
        self._dir = tempfile.TemporaryDirectory(prefix="hicache-mooncake-")
        self.log_path = Path(self._dir.name) / "mooncake_master.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """`host:port` of the master's RPC port (`Config.mooncake_master`)."""
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """URL of its HTTP metadata server (`Config.mooncake_metadata`)."""
        return f"http://{HOST}:{self.metadata_port}/metadata"

    def config_fields(self) -> dict[str, Any]:
        return {"mooncake_master": self.address, "mooncake_metadata": self.metadata_url, "mooncake_local_host": HOST}

    def command(self) -> list[str]:
        """The master's command line: loopback only, HTTP metadata server on, its own ports."""
        return [
            str(master_binary()),
            f"--rpc_address={HOST}",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={HOST}",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.metrics_port}",
            "--enable_metric_reporting=false",
        ]

    def start(self) -> MooncakeMaster:
        """Start the master and wait until its RPC and metadata ports accept connections."""
        command = self.command()
        with open(self.log_path, "wb") as out:
            self._process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout_s
        while not (_accepts(self.rpc_port) and _accepts(self.metadata_port)):
            problem = ""
            if self._process.poll() is not None:
                problem = f"mooncake_master exited with {self._process.returncode}"
            elif time.monotonic() > deadline:
                problem = (f"mooncake_master did not accept connections on ports {self.rpc_port} and "
                           f"{self.metadata_port} within {self.start_timeout_s:g} s")
            if problem:
                tail = self.log_tail()
                self.stop()
                raise MasterStartError(f"{problem} ({' '.join(command)}); its output ends:\n{tail}")
            time.sleep(0.05)
        return self

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the master's output (what it said before failing)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def kill(self) -> None:
        """Kill the master at once (SIGKILL), as a crash would."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait()

    def pause(self) -> None:
        """Freeze the master (SIGSTOP), as a hung one: its kernel still accepts connections."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused master run again (SIGCONT)."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop the master (SIGTERM, then SIGKILL after STOP_TIMEOUT_S) and remove its log."""
        if self._process is not None and self._process.poll() is None:
            self.resume()  # a paused process takes SIGTERM only once it runs
            self._process.terminate()
            try:
                self._process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        self._dir.cleanup()

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
