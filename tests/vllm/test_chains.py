"""Keys taken from a recent request's chain are exactly the keys hashing would give."""

from __future__ import annotations

import random

from kvkeep.keys import Namespace, chain_keys, pack_tokens
from kvkeep.vllm.book import RequestBook
from kvkeep.vllm.chains import RecentChains, common_blocks

NS = Namespace("m", "bfloat16", "LBHNC", "cpu", block_size=4)


def test_a_request_that_extends_a_finished_one_gets_the_keys_hashing_gives() -> None:
    rng = random.Random(0)
    book = RequestBook(NS)
    turn = [rng.randrange(1000) for _ in range(41)]
    for i in range(6):  # each turn re-sends the last one and adds to it
        assert book.keys_for(f"t{i}", turn, None) == chain_keys(NS, turn, 4)
        turn = turn + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        assert book.keys_for(f"t{i}", turn, None) == chain_keys(NS, turn, 4)  # decode grows it
        book.finish(f"t{i}")
    assert book.chains.reused_blocks >= 5 * 10


def test_a_request_that_parts_mid_block_or_under_another_salt_is_hashed_from_there() -> None:
    rng = random.Random(1)
    book = RequestBook(NS)
    base = [rng.randrange(1000) for _ in range(40)]
    book.keys_for("a", base, None)
    book.finish("a")
    for cut in (0, 1, 17, 18, 19, 39):  # a different token at ``cut``: block cut // 4 differs
        other = list(base)
        other[cut] += 1
        reused = book.chains.reused_blocks
        assert book.keys_for(f"x{cut}", other, None) == chain_keys(NS, other, 4)
        assert book.chains.reused_blocks - reused == cut // 4
        book.finish(f"x{cut}")
    salted = book.keys_for("s", base, "salt")
    assert salted == chain_keys(Namespace("m", "bfloat16", "LBHNC", "cpu", 4, cache_salt="salt"),
                                base, 4)  # fmt: skip
    assert salted[0] != chain_keys(NS, base, 4)[0]


def test_recent_chains_stay_within_their_byte_budget() -> None:
    rng = random.Random(2)
    chains = RecentChains(block_size=4, max_bytes=10_000)
    root = NS.root_key()
    for _ in range(50):
        tokens = [rng.randrange(1000) for _ in range(200)]  # 50 blocks: 800 + 1600 bytes
        chains.add(root, pack_tokens(tokens), chain_keys(root, tokens, 4))
    assert 1 <= len(chains) <= 4
    assert chains._bytes <= 10_000


def test_common_blocks_counts_whole_equal_blocks() -> None:
    a = pack_tokens(list(range(40)))
    assert common_blocks(a, a, 16) == 10
    assert common_blocks(a, a[:-16], 16) == 9
    b = bytearray(a)
    b[16 * 3 + 5] ^= 1
    assert common_blocks(a, bytes(b), 16) == 3
    assert common_blocks(a, b"", 16) == 0
