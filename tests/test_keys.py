"""Keys are deterministic, chained, namespaced and independent of PYTHONHASHSEED."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvkeep.keys import KEY_BYTES, Namespace, chain_keys, pack_tokens
from kvkeep.units import parse_size

NS = Namespace("model-a", "bfloat16", "LBHNC", "cpu-avx512", block_size=4)

_SCRIPT = """
from kvkeep.keys import Namespace, chain_keys
ns = Namespace("model-a", "bfloat16", "LBHNC", "cpu-avx512", block_size=4, cache_salt="s")
print(ns.digest().hex())
print(",".join(k.hex() for k in chain_keys(ns, list(range(19)), 4)))
"""


def _keys_in_subprocess(seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True
    ).stdout


def test_keys_identical_across_hash_seeds() -> None:
    first, second = _keys_in_subprocess("1"), _keys_in_subprocess("12345")
    assert first == second
    ns = Namespace("model-a", "bfloat16", "LBHNC", "cpu-avx512", block_size=4, cache_salt="s")
    assert first.split()[0] == ns.digest().hex()


def test_only_full_blocks_get_keys() -> None:
    keys = chain_keys(NS, list(range(11)), 4)
    assert len(keys) == 2
    assert all(len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 2


def test_incremental_chain_equals_whole_chain() -> None:
    tokens = list(range(100, 124))
    whole = chain_keys(NS, tokens, 4)
    head = chain_keys(NS, tokens[:8], 4)
    tail = chain_keys(NS, tokens[8:], 4, parent=head[-1])
    assert head + tail == whole


def test_prefix_sharing_and_divergence() -> None:
    a = chain_keys(NS, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chain_keys(NS, [1, 2, 3, 4, 5, 6, 7, 9], 4)
    assert a[0] == b[0] and a[1] != b[1]


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_digest", "model-b"),
        ("kv_dtype", "float16"),
        ("layout", "LBNHC"),
        ("backend", "flash"),
        ("tp_rank", 1),
        ("cache_salt", "x"),
        ("format_version", 2),
    ],
)
def test_every_namespace_field_changes_keys(field: str, value: object) -> None:
    fields = {**NS.__dict__, "tp_size": 2, field: value}
    other = Namespace(**fields)  # type: ignore[arg-type]
    base = Namespace(**{**NS.__dict__, "tp_size": 2})
    assert other.digest() != base.digest()
    assert chain_keys(other, [1, 2, 3, 4], 4) != chain_keys(base, [1, 2, 3, 4], 4)


def test_known_answer() -> None:
    # Pin the encoding: a change here invalidates every cache on disk (bump FORMAT_VERSION).
    assert pack_tokens([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    ids = [0, 1, 256, 65_536, 2**32 - 1]
    assert pack_tokens(ids) == pack_tokens(tuple(ids)) == pack_tokens(np.array(ids))
    assert NS.canonical().startswith(b'{"backend":"cpu-avx512","block_size":4')


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError):
        chain_keys(NS, [1, 2, 3, 4], 8)
    for bad in ([-1], [2**32], (1, 2**40), [1.5]):  # lists and tuples take their own path
        with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
            pack_tokens(bad)
        with pytest.raises(ValueError):
            pack_tokens(np.array(bad))
    with pytest.raises(ValueError):
        Namespace("m", "f16", "L", "b", block_size=4, tp_rank=2, tp_size=2)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("4096", 4096),
        ("1GiB", 1 << 30),
        ("500MB", 500_000_000),
        ("64GiB", 64 << 30),
        ("1.5 KiB", 1536),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "1XB", "-1GiB", "1 G i B"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="bad size"):
        parse_size(text)
