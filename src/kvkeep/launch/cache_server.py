"""A kvkeep cache server as a child process: its config, its command line, start-or-reuse and
stop by process group.

``CacheServerProcess.ensure`` reuses a server already listening on the socket and otherwise
starts one and waits until it listens; ``stop`` stops only a server this object started
(SIGTERM, so it flushes, then SIGKILL), and returns once no process of its group is left.
`kvkeep serve`, the bench launcher and the e2e tests share it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvkeep.server.address import check_socket_path, default_socket_path
from kvkeep.units import parse_size

DEFAULT_DIR = Path.home() / ".cache" / "kvkeep"


@dataclass(frozen=True)
class CacheServerConfig:
    """One kvkeep cache server: its state directory, tier sizes and socket."""

    directory: Path
    ram: str = "4GiB"
    disk: str = "0"
    socket: str | None = None
    extra_args: tuple[str, ...] = ()  # more `kvkeep server` flags, e.g. the remote tier

    def __post_init__(self) -> None:
        parse_size(self.ram)  # raises ValueError naming the bad size
        parse_size(self.disk)
        if self.socket is not None:
            check_socket_path(self.socket)

    @property
    def socket_path(self) -> str:
        return self.socket or default_socket_path(self.directory)

    def command(self) -> list[str]:
        """The argv that runs this server in the foreground. Pure."""
        return [
            sys.executable,
            "-m",
            "kvkeep.cli",
            "server",
            "--dir",
            str(self.directory),
            "--ram",
            self.ram,
            "--disk",
            self.disk,
            "--socket",
            self.socket_path,
            *self.extra_args,
        ]


def socket_listening(path: str) -> bool:
    """Whether something accepts connections on the unix socket ``path`` right now."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


class CacheServerProcess:
    """A cache server this process started (``started``) or found running. ``stop()`` only
    stops one it started, by its process group: SIGTERM (it flushes), then SIGKILL."""

    def __init__(self, cfg: CacheServerConfig) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = cfg.directory / "server.log"

    @property
    def started(self) -> bool:
        return self.proc is not None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def ensure(self, timeout_s: float = 60.0) -> CacheServerProcess:
        """Reuse a server listening on the socket, or start one and wait until it listens.
        Raises RuntimeError (with the log's tail) if it does not come up."""
        if socket_listening(self.cfg.socket_path):
            return self
        self.cfg.directory.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cfg.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while not socket_listening(self.cfg.socket_path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"kvkeep server did not start; see {self.log_path}:\n" + log_tail(self.log_path)
                )
            time.sleep(0.1)
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the server if this object started it. Idempotent."""
        stop_process_group(self.proc, timeout_s)


def stop_process_group(proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """SIGTERM ``proc``'s group (a session leader), then SIGKILL after ``timeout_s``; returns
    once no process of the group is left (a killed process that held gigabytes of KV pool
    takes a moment to exit, and until then its memory is not free)."""
    if proc is None or proc.poll() is not None:
        return
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    _signal_group(proc.pid, signal.SIGKILL)  # stragglers of the group
    deadline = time.monotonic() + 10.0
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""
