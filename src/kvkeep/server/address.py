"""Where a cache server listens by default, and the one limit a unix socket path has.

A server started with ``--dir DIR`` and no ``--socket`` listens on ``DIR/kvkeep.sock``, and
`kvkeep serve`, the bench and the connector's launch derive the same path from the same
directory. Linux keeps a unix socket's path in 108 bytes with its terminating NUL, so a deep
directory (a CI workspace, pytest's per-worker temporary paths) would make ``bind`` fail with
"AF_UNIX path too long" only once the server runs. There the default moves to the temporary
directory, under a name derived from the directory's absolute path: every process that derives
it from the same directory still agrees, and two directories never share one.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

SOCKET_NAME = "kvkeep.sock"
MAX_SOCKET_PATH_BYTES = 107  # sockaddr_un.sun_path is 108 bytes on Linux, NUL included


def socket_path_fits(path: str) -> bool:
    return len(os.fsencode(path)) <= MAX_SOCKET_PATH_BYTES


def default_socket_path(directory: str | Path) -> str:
    """``DIRECTORY/kvkeep.sock``, or, where that does not fit in a unix socket address,
    ``$TMPDIR/kvkeep-<digest of the directory's absolute path>.sock``."""
    path = str(Path(directory) / SOCKET_NAME)
    if socket_path_fits(path):
        return path
    digest = hashlib.sha256(os.fsencode(os.path.abspath(directory))).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"kvkeep-{digest}.sock")


def check_socket_path(path: str, flag: str = "--socket") -> None:
    """Raise ValueError naming ``flag`` where ``path`` is too long to bind."""
    if not socket_path_fits(path):
        raise ValueError(
            f"{flag} {path!r} is {len(os.fsencode(path))} bytes; a unix socket path holds at "
            f"most {MAX_SOCKET_PATH_BYTES}: give a shorter one (or leave {flag} out to use the "
            "default, which fits)"
        )
