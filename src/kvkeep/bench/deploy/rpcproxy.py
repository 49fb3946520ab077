"""A unix-socket proxy between the connector and a real cache server that can act between
two RPCs: it forwards every frame unchanged; when a request of an armed op (e.g. ACQUIRE)
arrives it first runs a hook (evict the blocks the LOOKUP promised, SIGKILL the server), and
when the reply to an op armed with ``arm_reply`` comes back it runs that hook on the reply
before passing it on (flip a byte of a slot the server just handed out).

This is how the fault tests and ``bench soak`` put a fault exactly between the scheduler's
LOOKUP and the worker's ACQUIRE, a window of a few milliseconds. Block bytes never pass
through here: the client maps the server's arena itself, from the path HELLO returns (the
proxy remembers the last one, ``arena_path``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import msgpack

HEADER = struct.Struct(">I")


class RpcProxy:
    def __init__(self, listen_path: str, server_path: str) -> None:
        self.listen_path, self.server_path = listen_path, server_path
        self._hooks: dict[str, Callable[[], None]] = {}
        self._reply_hooks: dict[str, Callable[[dict[str, Any]], None]] = {}
        self.arena_path: str | None = None  # from the last HELLO answered
        self._lock = threading.Lock()
        self.fired: list[str] = []
        with contextlib.suppress(FileNotFoundError):
            os.unlink(listen_path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(listen_path)
        self._listener.listen(16)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, op: str, hook: Callable[[], None]) -> None:
        """Run ``hook`` once, before the next frame of ``op`` is forwarded."""
        with self._lock:
            self._hooks[op] = hook

    def arm_reply(self, op: str, hook: Callable[[dict[str, Any]], None]) -> None:
        """Run ``hook(result)`` once, on the next successful reply to ``op``, before the
        client gets it."""
        with self._lock:
            self._reply_hooks[op] = hook

    def disarm(self) -> None:
        with self._lock:
            self._hooks.clear()
            self._reply_hooks.clear()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.listen_path)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                server.connect(self.server_path)
            except OSError:
                client.close()  # the server is down: the client sees a refused connection
                server.close()
                continue
            ops: dict[Any, str] = {}  # this connection's requests in flight: id -> op
            threading.Thread(target=self._requests, args=(client, server, ops), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client, ops), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket, ops: dict[Any, str]) -> None:
        try:
            while True:
                head = _recv(client, HEADER.size)
                body = _recv(client, HEADER.unpack(head)[0])
                request = msgpack.unpackb(body, raw=False)
                op = request.get("op", "")
                ops[request.get("id")] = op
                self._before(op)
                server.sendall(head + body)
        except (OSError, ConnectionError, ValueError):
            pass
        finally:
            _close(client, server)

    def _replies(self, server: socket.socket, client: socket.socket, ops: dict[Any, str]) -> None:
        try:
            while True:
                head = _recv(server, HEADER.size)
                body = _recv(server, HEADER.unpack(head)[0])
                reply = msgpack.unpackb(body, raw=False)
                op = ops.pop(reply.get("id"), "")
                if reply.get("ok"):
                    self._after(op, reply.get("result") or {})
                client.sendall(head + body)
        except (OSError, ConnectionError, ValueError):
            pass
        finally:
            _close(client, server)

    def _after(self, op: str, result: dict[str, Any]) -> None:
        if op == "HELLO" and "arena_path" in result:
            self.arena_path = str(result["arena_path"])
        with self._lock:
            hook = self._reply_hooks.pop(op, None)
        if hook is not None:
            self.fired.append(f"{op} reply")
            hook(result)

    def _before(self, op: str) -> None:
        with self._lock:
            hook = self._hooks.pop(op, None)
        if hook is not None:
            self.fired.append(op)
            hook()


def _recv(sock: socket.socket, count: int) -> bytes:
    buf = bytearray()
    while len(buf) < count:
        chunk = sock.recv(count - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)


def _close(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()
