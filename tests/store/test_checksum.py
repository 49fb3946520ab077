"""The one checksum every tier, the server and the client call, and its fused copy."""

from __future__ import annotations

import numpy as np
import pytest

from kvkeep.store.base import CHECKSUM_BITS, checksum, copy_checked


def test_checksum_is_64_bits_and_sees_every_byte() -> None:
    data = bytearray(np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8))
    value = checksum(data)
    assert 0 <= value < 2**CHECKSUM_BITS and value == checksum(memoryview(bytes(data)))
    for index in (0, 256 << 10, len(data) - 1):
        data[index] ^= 1
        assert checksum(data) != value, index
        data[index] ^= 1


@pytest.mark.parametrize("length", [0, 1, 256 << 10, (256 << 10) + 1, 3 << 20])
def test_copy_checked_copies_and_answers_as_checksum_does(length: int) -> None:
    src = np.random.default_rng(length).integers(0, 255, length, dtype=np.uint8)
    dst = np.zeros(length + 64, dtype=np.uint8)
    assert copy_checked(dst.data, src.data, checksum(src.data))
    assert bytes(dst[:length]) == src.tobytes() and not dst[length:].any()
    assert not copy_checked(dst.data, src.data, checksum(src.data) ^ 1)


def test_copy_checked_fails_on_a_byte_changed_in_any_chunk() -> None:
    src = np.random.default_rng(1).integers(0, 255, 1 << 20, dtype=np.uint8)
    expected = checksum(src.data)
    dst = np.empty_like(src)
    for index in (0, (256 << 10) - 1, 256 << 10, (1 << 20) - 1):
        src[index] ^= 0x80
        assert not copy_checked(dst.data, src.data, expected), index
        src[index] ^= 0x80
    assert copy_checked(dst.data, src.data, expected)
