"""``kvkeep server``: run the cache server in the foreground until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import sys
from pathlib import Path

from kvkeep.server.metrics import serve_metrics
from kvkeep.server.server import CacheServer, ServerConfig
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
    ap.add_argument("--socket", help="unix socket path (default DIR/kvkeep.sock)")
    ap.add_argument("--listen", type=_host_port, help="also accept TCP on HOST:PORT")
    ap.add_argument("--token-file", help="file holding the token TCP clients must present")
    ap.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    ap.add_argument("--metrics-host", default="127.0.0.1")
    ap.add_argument("--queue-depth", type=int, default=256, help="write-through queue bound")
    ap.add_argument("--extent", type=_size, default=64 << 20, help="arena extent (max block)")
    return ap


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
    )


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    _raise_fd_limit()
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
