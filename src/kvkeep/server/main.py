"""``kvkeep server``: run the cache server in the foreground until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import sys
from pathlib import Path

from kvkeep.host.background import POLICIES, set_policy
from kvkeep.server.metrics import serve_metrics
from kvkeep.server.server import CacheServer, ServerConfig
from kvkeep.store.remote import RemoteConfig, WritePolicy
from kvkeep.units import parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvkeep server", description="run the kvkeep cache server")
    ap.add_argument("--dir", required=True, help="state directory (disk tier, socket, lock)")
    ap.add_argument("--ram", type=_size, required=True, help="RAM tier size, e.g. 8GiB")
    ap.add_argument("--disk", type=_size, default=0, help="disk tier size, e.g. 500GB (0: off)")
    ap.add_argument(
        "--socket",
        help="unix socket path (default DIR/kvkeep.sock; where that is too long for a "
        "unix socket, kvkeep-<digest of DIR>.sock in the temporary directory)",
    )
    ap.add_argument("--listen", type=_host_port, help="also accept TCP on HOST:PORT")
    ap.add_argument("--token-file", help="file holding the token TCP clients must present")
    ap.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    ap.add_argument("--metrics-host", default="127.0.0.1")
    ap.add_argument("--queue-depth", type=int, default=256, help="write-through queue bound")
    ap.add_argument(
        "--background",
        choices=POLICIES,
        default="idle",
        help="idle (default): write-through to the lower tiers runs only on cores nothing "
        "else wants, so it never slows the engine; normal: at the server's own priority",
    )
    ap.add_argument("--extent", type=_size, default=64 << 20, help="arena extent (max block)")
    _remote_arguments(ap.add_argument_group("remote tier (a Valkey/Redis shared by servers)"))
    return ap


def _remote_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--remote",
        metavar="URL",
        help="valkey://HOST:PORT[/DB], redis://..., rediss:// (TLS), or a cluster seed list "
        "valkey://H1:P1,H2:P2. Run the store with maxmemory and maxmemory-policy allkeys-lru: "
        "it, not kvkeep, decides what to evict",
    )
    group.add_argument(
        "--remote-write",
        choices=[p.value for p in WritePolicy],
        default=WritePolicy.THROUGH.value,
        help="through: send every committed block (other servers see it at once); "
        "evict: send a block only when RAM evicts it (less traffic)",
    )
    group.add_argument(
        "--remote-rate",
        type=_size,
        default=64 << 20,
        help="bytes per second sent to the store, e.g. 200MB (0: no limit); default 64MiB",
    )
    group.add_argument(
        "--remote-timeout",
        type=float,
        default=0.25,
        help="seconds before a store call is a miss (default 0.25)",
    )
    group.add_argument(
        "--remote-ttl", type=int, default=0, help="seconds a block lives (0: maxmemory decides)"
    )


def remote_config_from(args: argparse.Namespace) -> RemoteConfig | None:
    if args.remote is None:
        return None
    return RemoteConfig(
        url=args.remote,
        write_policy=WritePolicy(args.remote_write),
        timeout_s=args.remote_timeout,
        write_rate_bytes=args.remote_rate,
        ttl_s=args.remote_ttl,
    )


def config_from(args: argparse.Namespace) -> ServerConfig:
    token = Path(args.token_file).read_bytes().strip() if args.token_file else None
    return ServerConfig(
        directory=args.dir,
        ram_bytes=args.ram,
        disk_bytes=args.disk,
        socket_path=args.socket,
        listen=args.listen,
        token=token,
        extent_bytes=args.extent,
        queue_depth=args.queue_depth,
        remote=remote_config_from(args),
    )


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    _raise_fd_limit()
    set_policy(args.background)
    try:
        server = CacheServer(config_from(args))
    except (ValueError, RuntimeError, OSError) as exc:
        sys.stderr.write(f"kvkeep server: {exc}\n")
        return 2
    if args.metrics_port is not None:
        serve_metrics(server.stats, args.metrics_port, args.metrics_host)
    asyncio.run(server.run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
