"""``kvkeep serve MODEL [--ram SIZE --disk SIZE --dir PATH] [-- vLLM args]``.

One command: start the kvkeep cache server unless one already listens on the socket, then
vLLM's OpenAI server with the kvkeep connector configured. Ctrl-C (or SIGTERM) stops what this
command started, vLLM first, and leaves a cache server it found running. ``--dry-run`` prints
the equivalent commands.

The process helpers here (``CacheServerProcess``, ``kv_transfer_args``) are shared with the
bench launcher; nothing here imports vllm.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvkeep.units import parse_size

CONNECTOR_CLASS = "KVKeepConnector"
CONNECTOR_MODULE = "kvkeep.vllm.connector"
DEFAULT_DIR = Path.home() / ".cache" / "kvkeep"


def kv_transfer_config(
    socket_path: str,
    timeout_s: float = 1.0,
    audit: bool = False,
    more: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """vLLM's ``--kv-transfer-config`` for the kvkeep connector. Pure. ``audit`` turns on
    the connector's debug comparison of recomputed blocks with their stored copies; ``more``
    adds other connector settings (``kvkeep.vllm.scheduling.ConnectorConfig`` checks them)."""
    extra: dict[str, object] = {"socket": socket_path, "timeout_s": timeout_s, **(more or {})}
    if audit:
        extra["audit"] = True
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def kv_transfer_args(
    socket_path: str,
    timeout_s: float = 1.0,
    audit: bool = False,
    more: Mapping[str, object] | None = None,
) -> list[str]:
    """The vLLM arguments that load the kvkeep connector. Pure."""
    config = kv_transfer_config(socket_path, timeout_s, audit, more)
    text = json.dumps(config, separators=(",", ":"))
    return ["--kv-transfer-config", text]


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

    @property
    def socket_path(self) -> str:
        return self.socket or str(self.directory / "kvkeep.sock")

    def command(self) -> list[str]:
        """The argv that runs this server in the foreground. Pure."""
        return [
            sys.executable, "-m", "kvkeep.cli", "server",
            "--dir", str(self.directory),
            "--ram", self.ram,
            "--disk", self.disk,
            "--socket", self.socket_path,
            *self.extra_args,
        ]  # fmt: skip


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
                raise RuntimeError(f"kvkeep server did not start; see {self.log_path}:\n"
                                   + _tail(self.log_path))  # fmt: skip
            time.sleep(0.1)
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the server if this object started it. Idempotent."""
        stop_process_group(self.proc, timeout_s)


def stop_process_group(proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """SIGTERM ``proc``'s group (a session leader), then SIGKILL after ``timeout_s``."""
    if proc is None or proc.poll() is not None:
        return
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    _signal_group(proc.pid, signal.SIGKILL)  # stragglers of the group


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


# --- the command ----------------------------------------------------------------------------


def vllm_command(model: str, socket_path: str, vllm_args: list[str]) -> list[str]:
    """vLLM's OpenAI server with the connector configured, plus the user's arguments. Pure."""
    base = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    return base + kv_transfer_args(socket_path) + vllm_args


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvkeep serve",
        description="start the kvkeep cache server (unless one is running), then vLLM with "
        "the kvkeep connector; arguments after -- go to vLLM",
    )
    ap.add_argument("model", help="model name or directory, as vLLM takes it")
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="cache server state directory")
    ap.add_argument("--ram", default="4GiB", help="RAM tier size (default 4GiB)")
    ap.add_argument("--disk", default="0", help="disk tier size, e.g. 200GiB (default: off)")
    ap.add_argument("--socket", help="cache server socket (default DIR/kvkeep.sock)")
    ap.add_argument(
        "--remote",
        metavar="URL",
        help="shared tier on Valkey/Redis: valkey://HOST:PORT, redis://..., or a cluster seed list",
    )
    ap.add_argument("--remote-write", choices=("through", "evict"), default="through",
                    help="write to the remote tier at once, or when it leaves RAM")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return ap


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """kvkeep's arguments and vLLM's (everything after the first ``--``)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def main(argv: list[str]) -> int:
    own, vllm_args = split_args(argv)
    args = parser().parse_args(own)
    try:
        remote = ("--remote", args.remote, "--remote-write", args.remote_write)
        extra = remote if args.remote else ()
        cache = CacheServerConfig(args.dir, args.ram, args.disk, args.socket, extra)
    except ValueError as exc:
        print(f"kvkeep serve: {exc}", file=sys.stderr)
        return 2
    engine = vllm_command(args.model, cache.socket_path, vllm_args)
    if args.dry_run:
        print(f"# unless a cache server already listens on {cache.socket_path}:")
        print(shlex.join(cache.command()) + " &")
        print(shlex.join(engine))
        return 0
    return _run(cache, engine)


def _run(cache_cfg: CacheServerConfig, engine: list[str]) -> int:
    """Run both until vLLM exits or we are told to stop; stop what we started."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    cache = CacheServerProcess(cache_cfg)
    proc: subprocess.Popen[bytes] | None = None
    try:
        cache.ensure()
        how = "started" if cache.started else "found running"
        print(f"kvkeep serve: cache server {how} at {cache_cfg.socket_path}", file=sys.stderr)
        proc = subprocess.Popen(engine, start_new_session=True)
        return proc.wait()
    except KeyboardInterrupt:
        print("\nkvkeep serve: stopping", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"kvkeep serve: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_process_group(proc, 30.0)
        cache.stop()


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
