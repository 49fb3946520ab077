"""The typed messages encode to exactly the maps protocol version 1 has always sent, and
decode back to themselves: a client or server of either vintage reads the other's frames.
(Version 2 kept every map; only what a checksum is changed, to a u64 XXH3-64.)"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from kvkeep.server import protocol as p
from kvkeep.store.slots import Offset

KEYS = (b"a" * 32, b"b" * 32)
O1, O2 = Offset(64), Offset(128)

REQUESTS: list[tuple[dict[str, Any], p.RequestMessage]] = [
    ({"token": b"t"}, p.AuthRequest(b"t")),
    (
        {"namespace": b"n" * 32, "block_bytes": 5, "label": "x"},
        p.HelloRequest(b"n" * 32, 5, "x"),
    ),
    ({"keys": list(KEYS), "ns": 3}, p.LookupRequest(KEYS, 3)),
    ({"keys": list(KEYS), "ns": 3}, p.ReserveRequest(KEYS, 3)),
    ({"keys": list(KEYS), "ns": 3}, p.AcquireRequest(KEYS, 3)),
    (
        {"slots": [[64, 2], [128, 2**64 - 1]], "ns": 0},
        p.CommitRequest((p.ChecksummedSlot(O1, 2), p.ChecksummedSlot(O2, 2**64 - 1)), 0),
    ),
    ({"slots": [64, 128]}, p.ReleaseRequest((O1, O2))),
    ({"slots": [64, 128], "corrupt": [128]}, p.ReleaseRequest((O1, O2), (O2,))),
    ({}, p.StatsRequest()),
]
REPLIES: list[tuple[dict[str, Any], p.ReplyMessage]] = [
    ({}, p.EmptyReply()),
    (
        {
            "ns": 0,
            "instance": "i",
            "arena_path": "/dev/shm/x",
            "arena_bytes": 9,
            "tiers": ["ram", "disk"],
            "max_block_bytes": 7,
        },
        p.HelloReply(0, "i", "/dev/shm/x", 9, ("ram", "disk"), 7),
    ),
    ({"num_present": 2, "tiers": [0, 1]}, p.LookupReply(2, (0, 1))),
    ({"slots": [[0, 64]]}, p.ReserveReply((p.ReservedSlot(0, O1),))),
    ({"committed": 2}, p.CommitReply(2)),
    ({"slots": [[64, 5]]}, p.AcquireReply((p.ChecksummedSlot(O1, 5),))),
    ({"tiers": {}, "instance": "i"}, p.StatsReply({"tiers": {}, "instance": "i"})),
]


def _packed(body: dict[str, Any]) -> bytes:
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize("wire,message", REQUESTS)
def test_requests_keep_their_version_1_bytes(wire: dict[str, Any], message: Any) -> None:
    assert _packed(message.encode()) == _packed(wire)
    assert p.decode_message(p.Request(1, message.OP, wire), announced=4) == message


@pytest.mark.parametrize("wire,message", REPLIES)
def test_replies_keep_their_version_1_bytes(wire: dict[str, Any], message: Any) -> None:
    assert _packed(message.encode()) == _packed(wire)
    assert type(message).decode(wire) == message


def test_an_unannounced_namespace_is_refused_before_the_keys_are_read() -> None:
    request = p.Request(1, p.Op.LOOKUP, {"ns": 2, "keys": [b"short"]})
    with pytest.raises(p.ProtocolError) as refused:
        p.decode_message(request, announced=2)
    assert refused.value.code is p.ErrorCode.UNKNOWN_NAMESPACE


def test_a_stats_request_may_ask_for_the_integrity_check() -> None:
    assert p.StatsRequest(integrity=True).encode() == {"integrity": True}
    assert p.decode_message(p.Request(1, p.Op.STATS, {"integrity": True}), 0) == p.StatsRequest(
        True
    )


@pytest.mark.parametrize(
    "op,args",
    [
        (p.Op.RELEASE, {"slots": [64, -1]}),
        (p.Op.RELEASE, {"slots": [64, True]}),
        (p.Op.RELEASE, {"slots": [64.0]}),
        (p.Op.RELEASE, {"slots": [2**64]}),
        (p.Op.RELEASE, {"slots": [64], "corrupt": [[64]]}),
        (p.Op.LOOKUP, {"ns": 0, "keys": [b"k" * 32, b"k" * 31]}),
        (p.Op.LOOKUP, {"ns": 0, "keys": [b"k" * 32, "k" * 32]}),
    ],
)
def test_lists_checked_in_bulk_still_refuse_a_bad_item(op: p.Op, args: dict[str, Any]) -> None:
    """Key and offset lists are checked with C loops on the hot path; one bad item among
    good ones is still a BAD_REQUEST."""
    with pytest.raises(p.ProtocolError) as refused:
        p.decode_message(p.Request(1, op, args), announced=1)
    assert refused.value.code is p.ErrorCode.BAD_REQUEST
