"""The cache server's control-plane wire protocol, version 2; block bytes never travel here.

Framing: every message is ``length (u32 big-endian) || msgpack body``; a body over
``MAX_FRAME_BYTES`` is refused and the connection closed. A request body is the map
``{"v": 2, "id": int, "op": str, "args": map}``; a reply is ``{"v": 2, "id": int, "ok": true,
"result": map}`` or ``{"v": 2, "id": int, "ok": false, "error": {"code": str, "message": str}}``.
msgpack is decoded with size limits (``MAX_DECODED_ITEMS``) and no extension types: no pickle,
no reflection. Every int is non-negative; a key is a 32-byte block key, ``ns`` the id HELLO
returned on this connection, a checksum ``kvkeep.store.base.checksum`` (XXH3-64) of a block's
bytes. Each operation (AUTH, HELLO, LOOKUP, RESERVE, COMMIT, ACQUIRE, TOUCH, RELEASE, STATS)
has a typed request and reply below: ``encode`` gives the args or result map, ``decode``
validates one. A connection's reservations are aborted and its pins dropped when it closes.
Every operation's arguments and results: docs/notes/protocol.md.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, NamedTuple, Self, get_args

import msgpack

from kvkeep.store.slots import Offset

PROTOCOL_VERSION = 2  # 2: 64-bit checksums, TOUCH
MAX_FRAME_BYTES = 8 << 20
MAX_KEYS_PER_REQUEST = 65536
KEY_BYTES = 32
MAX_MAP_ITEMS = 256  # envelopes, args and STATS replies are small maps
# Without a bound, nested empty arrays make ~70 bytes of Python objects per byte received.
MAX_DECODED_ITEMS = 4 * MAX_KEYS_PER_REQUEST  # a COMMIT of 65,536 [offset, checksum] rows: 3×
MAX_WIRE_INT = 2**64 - 1  # offsets and checksums (store.base.CHECKSUM_BITS) fit msgpack's uint64
MAX_LABEL_CHARS = 200
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
    TOUCH = "TOUCH"


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
    # C loops (map, set): a per-key generator cost ~0.15 ms a 1,000-key LOOKUP
    if not set(map(type, keys)) <= {bytes} or not set(map(len, keys)) <= {KEY_BYTES}:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"every key must be {KEY_BYTES} bytes")
    return keys


def arg_int_list(args: dict[str, Any], name: str, width: int) -> list[Any]:
    """A list of non-negative ints (width 1) or of ``width``-long lists of them."""
    items = args.get(name)
    if not isinstance(items, list) or len(items) > MAX_KEYS_PER_REQUEST:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} must be a list")
    flat = width == 1 and set(map(type, items)) <= {int}  # hot (RELEASE): C loops
    if flat and (not items or (min(items) >= 0 and max(items) <= MAX_WIRE_INT)):
        return items
    for item in items:
        row = [item] if width == 1 else item
        if not isinstance(row, list) or len(row) != width or not all(map(_wire_uint, row)):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"{name} rows must be {width} non-negative ints"
            )
    return items


def _wire_uint(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_WIRE_INT


def _offsets(args: dict[str, Any], name: str) -> tuple[Offset, ...]:
    return tuple(arg_int_list(args, name, 1))  # checked ints: Offset is int at run time


def uint_pairs(rows: list[Any]) -> list[Any]:
    """``rows`` if its pairs are non-negative ints (checked even on the hot path: the client
    maps these offsets); else ProtocolError, or ValueError/TypeError if not pairs."""
    if not all(type(a) is int and type(b) is int and a >= 0 and b >= 0 for a, b in rows):
        raise ProtocolError(ErrorCode.MALFORMED, "slot rows must be pairs of non-negative ints")
    return rows


def _announced(args: dict[str, Any], announced: int) -> int:
    """The ``ns`` of a request, which must be an id HELLO returned on this connection."""
    ns = arg_int(args, "ns")
    if ns >= announced:
        raise ProtocolError(
            ErrorCode.UNKNOWN_NAMESPACE, f"namespace {ns} was not announced by HELLO"
        )
    return ns


# --- typed messages -------------------------------------------------------------------------
# A message's fields are its wire map, in the order version 1 has always sent them (so frames
# stay byte-identical; tuples and NamedTuples pack as arrays). Requests decode with
# ``decode(args, announced)``, where ``announced`` counts the namespaces this connection has
# announced, so an unknown ``ns`` is refused before anything else is checked, and raise
# ProtocolError on anything malformed. Replies (from the server) decode with
# ``decode(result)``, checking only their shape on the hot paths: a malformed one raises
# ProtocolError, KeyError, TypeError or ValueError, which the client turns into
# CacheUnavailable.


class _Message:
    def encode(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class AuthRequest(_Message):
    """AUTH ``{token: bin} -> {}``: required first on TCP; a wrong token is fatal."""

    OP: ClassVar[Op] = Op.AUTH
    token: bytes

    @classmethod
    def decode(cls, args: dict[str, Any], announced: int = 0) -> Self:
        return cls(arg_bytes(args, "token"))


@dataclass(frozen=True)
class EmptyReply(_Message):
    """The reply to AUTH and RELEASE."""

    @classmethod
    def decode(cls, result: dict[str, Any]) -> Self:
        return cls()


@dataclass(frozen=True)
class HelloRequest(_Message):
    """HELLO: announces a namespace; ``block_too_large`` if its blocks cannot fit."""

    OP: ClassVar[Op] = Op.HELLO
    namespace: bytes  # the client's namespace digest (kvkeep.keys.Namespace.digest())
    block_bytes: int
    label: str = ""  # for operators' logs only

    @classmethod
    def decode(cls, args: dict[str, Any], announced: int = 0) -> Self:
        namespace = arg_bytes(args, "namespace", KEY_BYTES)
        block_bytes = arg_int(args, "block_bytes")
        label = args.get("label", "")
        return cls(
            namespace, block_bytes, label[:MAX_LABEL_CHARS] if isinstance(label, str) else ""
        )


@dataclass(frozen=True)
class HelloReply(_Message):
    ns: int
    instance: str  # the server process; slots of another instance are void
    arena_path: str
    arena_bytes: int
    tiers: tuple[str, ...]  # tier names, fastest first
    max_block_bytes: int

    @classmethod
    def decode(cls, result: dict[str, Any]) -> Self:
        return cls(
            int(result["ns"]),
            str(result["instance"]),
            str(result["arena_path"]),
            int(result["arena_bytes"]),
            tuple(map(str, result["tiers"])),
            int(result["max_block_bytes"]),
        )


@dataclass(frozen=True)
class KeysRequest(_Message):
    """LOOKUP, RESERVE, ACQUIRE and TOUCH: block keys in one namespace."""

    OP: ClassVar[Op]
    keys: tuple[bytes, ...]
    ns: int

    @classmethod
    def decode(cls, args: dict[str, Any], announced: int = 0) -> Self:
        ns = _announced(args, announced)
        return cls(tuple(arg_keys(args)), ns)


@dataclass(frozen=True)
class LookupRequest(KeysRequest):
    """LOOKUP: the leading keys present in some tier, and the index of each one's tier."""

    OP: ClassVar[Op] = Op.LOOKUP


@dataclass(frozen=True)
class LookupReply(_Message):
    num_present: int  # leading keys present in some tier
    tiers: tuple[int, ...]  # tiers[i]: index (in HELLO's tiers) of key i's tier

    @classmethod
    def decode(cls, result: dict[str, Any]) -> Self:
        return cls(int(result["num_present"]), tuple(result["tiers"]))


@dataclass(frozen=True)
class ReserveRequest(KeysRequest):
    """RESERVE: slots to write keys into; skips keys already stored, stops at the first key
    no slot can be freed for (RAM all pinned)."""

    OP: ClassVar[Op] = Op.RESERVE


class ReservedSlot(NamedTuple):
    key_index: int  # into the request's keys
    offset: Offset


@dataclass(frozen=True)
class ReserveReply(_Message):
    slots: tuple[ReservedSlot, ...]

    @classmethod
    def decode(cls, result: dict[str, Any]) -> Self:
        return cls(tuple(map(ReservedSlot._make, uint_pairs(result["slots"]))))


class ChecksummedSlot(NamedTuple):
    offset: Offset
    checksum: int  # of the slot's bytes: a u64, as every wire int is checked to be


@dataclass(frozen=True)
class CommitRequest(_Message):
    """COMMIT: publishes slots this connection reserved; others are ignored (not counted)."""

    OP: ClassVar[Op] = Op.COMMIT
    slots: tuple[ChecksummedSlot, ...]  # the checksum the client computed over each slot
    ns: int

    @classmethod
    def decode(cls, args: dict[str, Any], announced: int = 0) -> Self:
        ns = _announced(args, announced)
        rows = arg_int_list(args, "slots", 2)
        return cls(tuple(ChecksummedSlot(Offset(o), c) for o, c in rows), ns)


@dataclass(frozen=True)
class CommitReply(_Message):
    committed: int

    @classmethod
    def decode(cls, result: dict[str, Any]) -> Self:
        return cls(arg_int(result, "committed"))


@dataclass(frozen=True)
class AcquireRequest(KeysRequest):
    """ACQUIRE: pins the leading present keys for reading (loaded from lower tiers if needed)."""

    OP: ClassVar[Op] = Op.ACQUIRE


@dataclass(frozen=True)
class AcquireReply(_Message):
    slots: tuple[ChecksummedSlot, ...]  # pinned, for the leading keys; checksum as stored

    @classmethod
    def decode(cls, result: dict[str, Any]) -> Self:
        return cls(tuple(map(ChecksummedSlot._make, uint_pairs(result["slots"]))))


@dataclass(frozen=True)
class TouchRequest(KeysRequest):
    """TOUCH: the keys held in RAM become the most recently used, keys[0] most of all; no hit
    is counted (the engine serves them from its own pool: keep them warm)."""

    OP: ClassVar[Op] = Op.TOUCH


@dataclass(frozen=True)
class ReleaseRequest(_Message):
    """RELEASE: unpins acquired slots and aborts reserved ones (others are ignored); the
    server checks each ``corrupt`` slot again and drops it if its bytes are bad and nobody
    else pins it."""

    OP: ClassVar[Op] = Op.RELEASE
    slots: tuple[Offset, ...]
    corrupt: tuple[Offset, ...] = ()  # acquired slots among ``slots`` that failed the check

    def encode(self) -> dict[str, Any]:
        return {"slots": self.slots, **({"corrupt": self.corrupt} if self.corrupt else {})}

    @classmethod
    def decode(cls, args: dict[str, Any], announced: int = 0) -> Self:
        corrupt = _offsets(args, "corrupt") if "corrupt" in args else ()
        return cls(_offsets(args, "slots"), corrupt)


@dataclass(frozen=True)
class StatsRequest(_Message):
    """STATS: ``integrity`` adds every inconsistency ``RamTier.check_integrity`` finds
    (O(slots), for tests)."""

    OP: ClassVar[Op] = Op.STATS
    integrity: bool = False

    def encode(self) -> dict[str, Any]:
        return {"integrity": True} if self.integrity else {}

    @classmethod
    def decode(cls, args: dict[str, Any], announced: int = 0) -> Self:
        return cls(args.get("integrity") is True)


@dataclass(frozen=True)
class StatsReply(_Message):
    """Counters and occupancy per tier, write-behind state, instance, connections (see
    ``TieredStore.stats`` and ``CacheServer.stats``): a map read by operators and tests."""

    stats: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> dict[str, Any]:
        return self.stats

    @classmethod
    def decode(cls, result: dict[str, Any]) -> Self:
        return cls(result)


RequestMessage = (
    AuthRequest
    | HelloRequest
    | LookupRequest
    | ReserveRequest
    | CommitRequest
    | AcquireRequest
    | ReleaseRequest
    | StatsRequest
    | TouchRequest
)
ReplyMessage = (
    EmptyReply | HelloReply | LookupReply | ReserveReply | CommitReply | AcquireReply | StatsReply
)

REQUESTS: dict[Op, type[RequestMessage]] = {m.OP: m for m in get_args(RequestMessage)}


def decode_message(request: Request, announced: int) -> RequestMessage:
    """The typed request of a decoded envelope; raises ProtocolError (BAD_REQUEST,
    UNKNOWN_NAMESPACE). ``announced``: namespaces announced on this connection so far."""
    return REQUESTS[request.op].decode(request.args, announced)
