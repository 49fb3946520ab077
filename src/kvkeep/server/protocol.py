"""The control-plane wire protocol, version 1. Block bytes never travel here (see the arena).

Framing: every message is ``length (u32 big-endian) || msgpack body``; bodies over
``MAX_FRAME_BYTES`` are refused and the connection closed. A request body is the map
``{"v": 1, "id": int, "op": str, "args": map}``; a reply is
``{"v": 1, "id": int, "ok": true, "result": map}`` or
``{"v": 1, "id": int, "ok": false, "error": {"code": str, "message": str}}``.
msgpack is decoded with size limits and no extension types: no pickle, no reflection. A body
may build at most ``MAX_DECODED_ITEMS`` array and map entries in all: a frame of nested empty
arrays would otherwise make ~70 bytes of Python objects per byte received (600 MB for one 8 MiB
frame, and seconds of the event loop).

Operations (``ns`` is the id HELLO returned on this connection; keys are 32-byte bin)::

    AUTH    {token: bin}                                -> {}            (TCP: required first)
    HELLO   {namespace: bin32, block_bytes: int, label: str}
            -> {ns: int, instance: str, arena_path: str, arena_bytes: int,
                tiers: [str], max_block_bytes: int}
    LOOKUP  {ns, keys: [bin32]}     -> {num_present: int, tiers: [int]}   (leading keys only)
    RESERVE {ns, keys: [bin32]}     -> {slots: [[index, offset]]}  (skips stored keys; stops
                                                                    when the arena is full)
    COMMIT  {ns, slots: [[offset, crc32]]}  -> {committed: int}
    ACQUIRE {ns, keys: [bin32]}     -> {slots: [[offset, crc32]]}  (pinned leading hits)
    RELEASE {slots: [offset]}       -> {}        (unpins acquired slots, aborts reserved ones)
    STATS   {}                      -> {stats map}
"""

from __future__ import annotations

import enum
import struct
from typing import Any, NamedTuple

import msgpack

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 8 << 20
MAX_KEYS_PER_REQUEST = 65536
KEY_BYTES = 32
MAX_MAP_ITEMS = 256  # envelopes, args and STATS replies are small maps
MAX_DECODED_ITEMS = 4 * MAX_KEYS_PER_REQUEST  # a COMMIT of 65,536 [offset, crc] rows: 3×
MAX_WIRE_INT = 2**64 - 1  # offsets and checksums must fit msgpack's uint64
FRAME_HEADER = struct.Struct(">I")


class Op(enum.Enum):
    AUTH = "AUTH"
    HELLO = "HELLO"
    LOOKUP = "LOOKUP"
    RESERVE = "RESERVE"
    COMMIT = "COMMIT"
    ACQUIRE = "ACQUIRE"
    RELEASE = "RELEASE"
    STATS = "STATS"


class ErrorCode(enum.Enum):
    VERSION = "version"  # connection is closed after this reply
    MALFORMED = "malformed"  # connection is closed after this reply
    FRAME_TOO_LARGE = "frame_too_large"  # connection is closed after this reply
    UNAUTHORIZED = "unauthorized"  # connection is closed after this reply
    UNKNOWN_NAMESPACE = "unknown_namespace"
    BAD_REQUEST = "bad_request"
    BLOCK_TOO_LARGE = "block_too_large"


FATAL_CODES = frozenset(
    {ErrorCode.VERSION, ErrorCode.MALFORMED, ErrorCode.FRAME_TOO_LARGE, ErrorCode.UNAUTHORIZED}
)


class ProtocolError(Exception):
    """A request that cannot be served; ``code`` says whether the connection survives it."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Request(NamedTuple):
    id: int
    op: Op
    args: dict[str, Any]


def frame(body: dict[str, Any]) -> bytes:
    """``body`` encoded and length-prefixed."""
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return FRAME_HEADER.pack(len(data)) + data


def check_frame_length(length: int) -> None:
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE, f"frame of {length} bytes > {MAX_FRAME_BYTES}"
        )


class _DecodeBudget:
    """Counts the entries of every array and map a decode builds; msgpack calls it once per
    container, after building it, so at most one over-long container is built past the limit."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items = 0

    def charge(self, container: Any) -> Any:
        self.items += len(container) + 1
        if self.items > MAX_DECODED_ITEMS:
            raise ValueError(f"more than {MAX_DECODED_ITEMS} array or map entries")
        return container


def unpack(data: bytes) -> dict[str, Any]:
    """Decode one body; raises ProtocolError(MALFORMED) on anything but a msgpack map."""
    budget = _DecodeBudget()
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_FRAME_BYTES,
            max_array_len=MAX_KEYS_PER_REQUEST,
            max_map_len=MAX_MAP_ITEMS,
            list_hook=budget.charge,
            object_hook=budget.charge,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"undecodable frame: {exc}") from exc
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "a frame must be a map")
    return body


def decode_request(data: bytes) -> Request:
    """A validated request envelope; raises ProtocolError (VERSION, MALFORMED, BAD_REQUEST)."""
    body = unpack(data)
    if body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.VERSION,
            f"protocol version {body.get('v')!r} unsupported; speak {PROTOCOL_VERSION}",
        )
    request_id, op, args = body.get("id"), body.get("op"), body.get("args", {})
    if not isinstance(request_id, int) or not isinstance(args, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "a request needs an int id and a map of args")
    try:
        return Request(request_id, Op(op), args)
    except ValueError:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown op {op!r}") from None


def ok_reply(request_id: int, result: dict[str, Any]) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": True, "result": result}


def error_reply(request_id: int, error: ProtocolError) -> dict[str, Any]:
    detail = {"code": error.code.value, "message": str(error)}
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": False, "error": detail}


def request_body(request_id: int, op: Op, args: dict[str, Any]) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "op": op.value, "args": args}


# --- argument checks (server side) ----------------------------------------------------------


def arg_int(args: dict[str, Any], name: str) -> int:
    value = args.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} must be a non-negative int")
    return value


def arg_bytes(args: dict[str, Any], name: str, length: int | None = None) -> bytes:
    value = args.get(name)
    if not isinstance(value, bytes) or (length is not None and len(value) != length):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} must be {length or 'some'} bytes")
    return value


def arg_keys(args: dict[str, Any]) -> list[bytes]:
    keys = args.get("keys")
    if not isinstance(keys, list) or len(keys) > MAX_KEYS_PER_REQUEST:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"keys must be a list of <= {MAX_KEYS_PER_REQUEST}"
        )
    if {len(k) if type(k) is bytes else -1 for k in keys} - {KEY_BYTES}:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"every key must be {KEY_BYTES} bytes")
    return keys


def arg_int_list(args: dict[str, Any], name: str, width: int) -> list[Any]:
    """A list of non-negative ints (width 1) or of ``width``-long lists of them."""
    items = args.get(name)
    if not isinstance(items, list) or len(items) > MAX_KEYS_PER_REQUEST:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} must be a list")
    for item in items:
        row = [item] if width == 1 else item
        if not isinstance(row, list) or len(row) != width or not all(map(_wire_uint, row)):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"{name} rows must be {width} non-negative ints"
            )
    return items


def _wire_uint(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_WIRE_INT
