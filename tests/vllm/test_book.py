"""The connector's claim, key and save arithmetic, without vLLM."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from kvkeep.keys import Namespace, chain_keys
from kvkeep.vllm.book import ClaimRange, Match, RequestBook, claim_range
from kvkeep.vllm.config import LOAD_ASYNC_MIN_BYTES, ConnectorConfig
from kvkeep.vllm.counters import Counters
from kvkeep.vllm.plan import BlockTransfer

BS = 4
NS = Namespace(model_digest="m", kv_dtype="bf16", layout="LBHNC", backend="cpu/vec", block_size=BS)


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# --- claims -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "computed", "expected"),
    [
        (16, 0, ClaimRange(0, 3)),  # 4 full blocks, but the last token must be computed
        (17, 0, ClaimRange(0, 4)),
        (16, 8, ClaimRange(2, 3)),
        (16, 12, ClaimRange(3, 3)),  # local hit already at the limit
        (3, 0, ClaimRange(0, 0)),  # no full block
        (1, 0, ClaimRange(0, 0)),
        (16, 6, ClaimRange(0, 0)),  # an unaligned local hit gets no claim
    ],
)
def test_claim_range(num_tokens: int, computed: int, expected: ClaimRange) -> None:
    assert claim_range(num_tokens, computed, BS) == expected


@pytest.mark.parametrize("num_tokens", range(1, 40))
@pytest.mark.parametrize("computed_blocks", range(0, 4))
def test_a_claim_never_covers_the_whole_prompt(num_tokens: int, computed_blocks: int) -> None:
    computed = computed_blocks * BS
    if computed > num_tokens - 1:
        return  # vLLM never reports a local hit that large
    claim = claim_range(num_tokens, computed, BS)
    claimed = (claim.limit - claim.first) * BS if not claim.empty else 0
    assert computed + claimed <= num_tokens - 1


# --- config ------------------------------------------------------------------------------------


def test_config_from_extra_validates() -> None:
    cfg = ConnectorConfig.from_extra({"socket": "/tmp/s.sock", "timeout_s": "0.5"})
    assert cfg == ConnectorConfig("/tmp/s.sock", 0.5)
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        ConnectorConfig.from_extra({"socket": "/s", "store_dir": "/x"})
    with pytest.raises(ValueError, match="socket"):
        ConnectorConfig.from_extra({})
    with pytest.raises(ValueError, match="timeout_s"):
        ConnectorConfig.from_extra({"socket": "/s", "timeout_s": 0})
    assert ConnectorConfig.from_extra({"socket": "/s", "staging_mib": 16}).staging_mib == 16
    extra = {"socket": "/s", "load_async_min_blocks": 4}
    assert ConnectorConfig.from_extra(extra).load_async_min_blocks == 4
    extra["load_async_min_blocks"] = None
    assert ConnectorConfig.from_extra(extra).load_async_min_blocks is None
    for bad in (0, 2.5, True, "always"):
        extra["load_async_min_blocks"] = bad
        with pytest.raises(ValueError, match="load_async_min_blocks"):
            ConnectorConfig.from_extra(extra)


def test_the_async_threshold_is_a_size_in_bytes_unless_given_in_blocks() -> None:
    """By default a hit loads in the background from LOAD_ASYNC_MIN_BYTES of blocks on,
    whatever the model's block size; a number of blocks or null (never) overrides it."""
    auto = ConnectorConfig.from_extra({"socket": "/s"})
    assert auto.load_async_min_blocks == "auto"
    assert auto.async_min_blocks(256 << 10) == LOAD_ASYNC_MIN_BYTES // (256 << 10)
    assert auto.async_min_blocks(2 << 20) == LOAD_ASYNC_MIN_BYTES // (2 << 20)
    assert auto.async_min_blocks(LOAD_ASYNC_MIN_BYTES * 2) == 1
    assert auto.async_min_blocks(3 << 20) == -(-LOAD_ASYNC_MIN_BYTES // (3 << 20))  # rounded up
    given = ConnectorConfig.from_extra({"socket": "/s", "load_async_min_blocks": 4})
    assert given.async_min_blocks(256 << 10) == 4
    never = ConnectorConfig.from_extra({"socket": "/s", "load_async_min_blocks": None})
    assert never.async_min_blocks(256 << 10) is None
    with pytest.raises(ValueError, match="staging_mib"):
        ConnectorConfig.from_extra({"socket": "/s", "staging_mib": 0})


# --- keys ---------------------------------------------------------------------------------------


def test_keys_are_the_salted_namespace_chain_and_extend_incrementally() -> None:
    book = RequestBook(NS)
    prompt = tokens(10)
    assert book.keys_for("r", prompt, None) == chain_keys(NS, prompt, BS)
    grown = [*prompt, 7, 8]
    assert book.keys_for("r", grown, None) == chain_keys(NS, grown, BS)
    salted = replace(NS, cache_salt="alice")
    assert book.keys_for("s", prompt, "alice") == chain_keys(salted, prompt, BS)
    assert book.keys_for("s", prompt, "alice")[0] != book.keys_for("r", prompt, None)[0]


def test_match_memo_is_per_inputs() -> None:
    book = RequestBook(NS)
    book.remember_match("r", Match(0, 16, 2))
    assert book.cached_match("r", 0, 16) == Match(0, 16, 2)
    assert book.cached_match("r", 4, 16) is None
    assert book.cached_match("other", 0, 16) is None


# --- loads and saves ---------------------------------------------------------------------------


def test_alloc_loads_the_external_blocks_after_the_local_hit() -> None:
    book = RequestBook(NS)
    prompt = tokens(21)  # 5 full blocks
    keys = chain_keys(NS, prompt, BS)
    book.remember_match("r", Match(4, 21, 3))  # 1 local block, kvkeep has 3 more
    load = book.on_alloc("r", prompt, None, [10, 11, 12, 13, 14, 15], 12)
    assert load is not None
    assert load.blocks == tuple(BlockTransfer(b, keys[i]) for i, b in [(1, 11), (2, 12), (3, 13)])
    plan = book.take_plan([])
    assert plan.loads == (load,) and plan.num_load_blocks == 3
    assert book.take_plan([]).loads == ()  # each load ships once
    # blocks [0, 4) were local or loaded: only block 4 is saved once computed
    assert book.saves_after("r", 21, prompt, None) == [BlockTransfer(14, keys[4])]


def test_the_device_hit_keys_are_known_at_alloc_for_refreshing() -> None:
    book = RequestBook(NS)
    prompt = tokens(41)  # 10 full blocks
    keys = chain_keys(NS, prompt, BS)
    assert book.local_blocks("r") == 0 and book.leading_keys("r", 3) == []
    book.remember_match("r", Match(12, 41, 2))  # vLLM holds 3 blocks, kvkeep 2 more
    assert book.local_blocks("r") == 3
    book.on_alloc("r", prompt, None, list(range(11)), 8)
    assert book.leading_keys("r", 3) == keys[:3]
    book.finish("r")
    assert book.leading_keys("r", 3) == []


def test_saves_follow_every_chunk_and_decode_exactly_once() -> None:
    book = RequestBook(NS)
    seq = tokens(10)
    assert book.on_alloc("r", seq, None, [1, 2], 0) is None
    keys = chain_keys(NS, tokens(20), BS)
    # chunk 1: 6 tokens computed -> block 0 full
    assert book.saves_after("r", 6, seq, None) == [BlockTransfer(1, keys[0])]
    assert book.saves_after("r", 6, seq, None) == []
    # chunk 2: 4 more tokens, a new block id arrives with it -> block 1 full
    book.update_blocks("r", [3], replace=False)
    assert book.saves_after("r", 10, seq, None) == [BlockTransfer(2, keys[1])]
    # decode: tokens arrive one by one; block 2 completes at 12 computed tokens
    for n in (11, 12):
        seq.append(100 + len(seq))
        saves = book.saves_after("r", n, seq, None)
        assert saves == ([BlockTransfer(3, keys[2])] if n == 12 else [])
    # a block id that has not arrived yet is not saved
    seq += tokens(4, start=100 + len(seq))
    assert book.saves_after("r", 16, seq, None) == []
    book.update_blocks("r", [4], replace=False)
    assert book.saves_after("r", 16, seq, None) == [BlockTransfer(4, keys[3])]


def test_tokens_not_known_yet_are_not_saved() -> None:
    book = RequestBook(NS)
    book.on_alloc("r", tokens(7), None, [1, 2], 0)
    assert book.saves_after("r", 8, tokens(7), None) == [
        BlockTransfer(1, chain_keys(NS, tokens(4), BS)[0])
    ]


def test_preemption_restarts_tracking_and_resume_replaces_the_table() -> None:
    book = RequestBook(NS)
    seq = tokens(12)
    book.on_alloc("r", seq, None, [1, 2, 3], 0)
    book.saves_after("r", 12, seq, None)
    book.on_alloc("r", seq, None, [7, 8, 9], 0)  # preempted, re-admitted, new blocks
    book.update_blocks("r", [7, 8, 9, 10], replace=True)
    keys = chain_keys(NS, seq, BS)
    assert book.saves_after("r", 12, seq, None) == [
        BlockTransfer(7, keys[0]),
        BlockTransfer(8, keys[1]),
        BlockTransfer(9, keys[2]),
    ]


def test_a_failed_load_rewinds_the_frontier_so_the_recompute_is_saved() -> None:
    """The poisoning scenario's bookkeeping: P's 3 blocks are claimed and fail to load, the
    same step computes Q's 2 blocks on top of them (the worker drops those saves), vLLM
    truncates the request at the failed block and recomputes: every block is planned again,
    from the first failed one, with the right keys."""
    book = RequestBook(NS)
    prompt = tokens(22)  # P = blocks 0-2 in kvkeep, Q = blocks 3-4, then 2 tokens
    keys = chain_keys(NS, prompt, BS)
    table = [10, 11, 12, 13, 14, 15]
    book.remember_match("r", Match(0, 22, 3))
    book.on_alloc("r", prompt, None, table, 12)
    step1 = book.saves_after("r", 22, prompt, None)  # the load step computes Q
    assert step1 == [BlockTransfer(13, keys[3]), BlockTransfer(14, keys[4])]
    book.take_plan(step1)
    assert book.on_load_errors() == 1  # the step's output reports failed block 11
    book.rewind("r", 4)  # vLLM truncated the request at its first failed block (1)
    step2 = book.saves_after("r", 22, prompt, None)
    assert step2 == [BlockTransfer(table[i], keys[i]) for i in range(1, 5)]
    book.take_plan(step2)
    assert book.saves_after("r", 22, prompt, None) == []


def test_a_failed_load_replans_other_requests_of_the_step() -> None:
    """The worker drops every save of a step with a failed load, also those of requests
    whose loads succeeded: they are planned again in the next step, and only once."""
    book = RequestBook(NS)
    seq = tokens(9)
    keys = chain_keys(NS, seq, BS)
    book.on_alloc("ok", seq, None, [1, 2, 3], 0)
    saves = book.saves_after("ok", 9, seq, None)
    assert saves == [BlockTransfer(1, keys[0]), BlockTransfer(2, keys[1])]
    book.take_plan(saves)
    book.on_load_errors()
    book.rewind("ok", 0)  # vLLM's view before that step: nothing computed; not affected
    assert book.saves_after("ok", 9, seq, None) == saves
    book.take_plan(saves)
    assert book.saves_after("ok", 9, seq, None) == []
    assert book.on_load_errors() == 1
    assert book.on_load_errors() == 0  # rewinds once per report


def test_rewind_never_moves_the_frontier_forward() -> None:
    book = RequestBook(NS)
    seq = tokens(12)
    book.on_alloc("r", seq, None, [1, 2, 3], 0)
    book.take_plan(book.saves_after("r", 4, seq, None))
    book.rewind("r", 12)
    keys = chain_keys(NS, seq, BS)
    assert book.saves_after("r", 12, seq, None) == [
        BlockTransfer(2, keys[1]),
        BlockTransfer(3, keys[2]),
    ]


def test_finish_forgets_and_unknown_requests_are_ignored() -> None:
    book = RequestBook(NS)
    book.on_alloc("r", tokens(8), None, [1, 2], 0)
    assert book.tracking("r") and len(book) == 1
    book.finish("r")
    book.finish("r")
    assert not book.tracking("r") and len(book) == 0
    book.update_blocks("r", [5], replace=False)
    assert book.saves_after("r", 8, tokens(8), None) == []


def test_plan_pickles_small() -> None:
    book = RequestBook(NS)
    prompt = tokens(129 * BS)
    book.remember_match("r", Match(0, len(prompt), 128))
    book.on_alloc("r", prompt, None, list(range(1, 130)), 128 * BS)
    data = pickle.dumps(book.take_plan([]))
    assert pickle.loads(data).num_load_blocks == 128
    assert len(data) < 128 * 64 + 2048  # ~ a key and a block id per block


def test_counters_take_resets() -> None:
    c = Counters()
    assert c.take() is None
    c.add("loaded_tokens", 128)
    c.merge({"loaded_tokens": 128, "load_s": 0.5})
    assert c.take() == {"loaded_tokens": 256, "load_s": 0.5}
    assert c.take() is None


def test_timings_alone_are_held_for_a_later_take() -> None:
    """A decode step's plan time alone is not worth a stats message to vLLM's front end: it
    waits (summed) until the hold has passed or a real count goes out with it."""
    c = Counters()
    c.add("plan_s", 0.001)
    assert c.take(hold_timings_s=60) == {"plan_s": 0.001}  # nothing was taken for 60 s yet
    c.add("plan_s", 0.002)
    assert c.take(hold_timings_s=60) is None
    c.add("plan_s", 0.003)
    assert c.take(hold_timings_s=60) is None
    c.add("saved_tokens", 128)
    assert c.take(hold_timings_s=60) == {"plan_s": 0.005, "saved_tokens": 128}
    c.add("plan_s", 0.001)
    assert c.take(hold_timings_s=0) == {"plan_s": 0.001}


def test_async_loads_start_at_the_threshold_and_a_failed_one_claims_no_more() -> None:
    book = RequestBook(NS, load_async_min_blocks=3)
    assert [book.in_background(n) for n in (0, 2, 3, 9)] == [False, False, True, True]
    assert not RequestBook(NS).in_background(100)  # no threshold: always synchronous
    alone = RequestBook(NS, load_async_min_blocks=3, sync_when_alone=True)
    assert [alone.in_background(9, others) for others in (0, 1, 5)] == [False, True, True]
    assert book.in_background(9, others=0)  # a fixed threshold holds with nobody beside
    prompt = tokens(4 * BS + 1)
    book.remember_match("small", Match(0, len(prompt), 2))
    book.remember_match("big", Match(0, len(prompt), 4))
    small = book.on_alloc("small", prompt, None, [1, 2], 2 * BS)
    big = book.on_alloc("big", prompt, None, [5, 6, 7, 8], 4 * BS)
    assert small is not None and not small.background
    assert big is not None and big.background
    # vLLM reports the load finished with block 7 failed: no claims for "big" from now on
    assert book.on_loads_finished({"big"}, {7, 1}) == {"big"}
    assert not book.claims_for("big") and book.claims_for("small")
    book.finish("big")
    assert book.claims_for("big")  # a new request under the same id starts clean


# --- sliding-window groups (vLLM's hybrid KV cache manager) --------------------------------

WINDOW = 9  # tokens; the next token attends to the last 8: exactly 2 blocks of 4
NULL = 0  # vLLM's null block: what a sliding group's table holds outside the window


@pytest.mark.parametrize(("hit", "first"), [(4, 0), (8, 0), (9, 0), (12, 1), (16, 2), (40, 8)])
def test_window_start_is_vllms_skipped_blocks(hit: int, first: int) -> None:
    """``SlidingWindowManager.get_num_skipped_tokens``: hit - window + 1 tokens are skipped,
    so a hit of 16 tokens needs blocks [2, 4) (tokens 8..15), the last 8 tokens."""
    assert RequestBook(NS, window=WINDOW).window_start(hit) == first
    assert RequestBook(NS).window_start(hit) == 0


def test_a_sliding_group_loads_only_the_window_before_the_hit() -> None:
    """A hit of 6 blocks after 1 local block: the full group loads blocks 1..5, the sliding
    group only blocks 4 and 5; the out-of-window ones are vLLM's null block, never copied."""
    prompt = tokens(29)  # limit 7 blocks
    full, swa = RequestBook(NS, 1), RequestBook(NS, 1, WINDOW, NULL)
    for book in (full, swa):
        book.remember_match("r", Match(4, 29, 5))
    table = [10, NULL, NULL, NULL, 14, 15, 16, 17]
    swa_load = swa.on_alloc("r", prompt, None, table, 20)
    full_load = full.on_alloc("r", prompt, None, [20, 21, 22, 23, 24, 25, 26, 27], 20)
    assert full_load is not None and [b.block_id for b in full_load.blocks] == [21, 22, 23, 24, 25]
    assert swa_load is not None and [b.block_id for b in swa_load.blocks] == [14, 15]
    assert swa_load.background, "with several groups every load is asynchronous"
    keys = chain_keys(NS, prompt, BS)
    assert [b.key for b in swa_load.blocks] == keys[4:6]


def test_a_sliding_group_saves_the_window_before_the_claimable_end_and_after() -> None:
    """A 29-token prompt can be claimed up to 7 blocks; a hit there needs blocks 5 and 6.
    The sliding group saves those and the blocks after them, nothing before; the full
    group saves everything."""
    prompt = tokens(29)
    full, swa = RequestBook(NS), RequestBook(NS, window=WINDOW, null_block=NULL)
    assert swa.on_alloc("r", prompt, None, list(range(1, 9)), 0) is None
    full.on_alloc("r", prompt, None, list(range(1, 9)), 0)
    assert [b.block_id for b in full.saves_after("r", 16, prompt, None)] == [1, 2, 3, 4]
    assert swa.saves_after("r", 16, prompt, None) == []
    assert [b.block_id for b in swa.saves_after("r", 29, prompt, None)] == [6, 7]
    seq = prompt + tokens(3, start=500)  # decode completes block 7
    assert [b.block_id for b in swa.saves_after("r", 32, seq, None)] == [8]


def test_a_sliding_group_never_saves_a_null_block() -> None:
    """A request admitted with a hit holds null blocks below the window; a rewind of its
    frontier (vLLM truncating it) cannot make the group save them."""
    prompt = tokens(29)
    swa = RequestBook(NS, window=WINDOW, null_block=NULL)
    swa.remember_match("r", Match(0, 29, 0))
    swa.on_alloc("r", prompt, None, [NULL, NULL, NULL, NULL, NULL, 15, 16, 17], 0)
    swa.rewind("r", 0)
    assert [b.block_id for b in swa.saves_after("r", 29, prompt, None)] == [15, 16]


def test_a_request_failed_as_a_whole_claims_no_more() -> None:
    book = RequestBook(NS, 1)
    book.remember_match("r", Match(0, 29, 5))
    book.on_alloc("r", tokens(29), None, list(range(8)), 20)
    assert book.on_loads_finished({"r"}, set(), {"r"}) == {"r"}
    assert not book.claims_for("r")


# --- recurrent state (a linear-attention hybrid's state group) ---------------------------------


def state_book(policy: str = "reused") -> RequestBook:
    return RequestBook(NS, 1, window=BS, null_block=0, state=True, state_boundaries=policy)


def test_a_state_group_loads_only_the_state_at_the_hits_last_boundary() -> None:
    """vLLM's align-mode table holds nulls before the hit's last column and a fresh block
    there: the state after (local + external) blocks goes into that block, and nothing else
    loads."""
    book = state_book()
    ids = tokens(21)  # 5 full blocks, 5 claimable
    table = [0, 0, 0, 0, 7, 9]  # column 4: the state after 5 blocks; 9: the running state
    load = book.on_alloc("r", ids, None, table, 5 * BS)
    assert load is not None
    keys = chain_keys(NS.root_key(), ids, BS)
    assert load.blocks == (BlockTransfer(7, keys[4]),)
    with pytest.raises(ValueError, match="one block"):
        RequestBook(NS, 1, window=2 * BS, state=True)


def test_a_state_group_keeps_the_snapshots_later_prompts_reuse() -> None:
    """Of the boundaries vLLM offers, "reused" keeps the prompt's last claimable one, the
    branch point from what kvkeep held, and the reply's; "every" keeps all. A null block, a
    partial block and a boundary past the tokens are never saved."""
    ids = tokens(30)  # claimable: (30 - 1) // 4 = 7 blocks
    keys = chain_keys(NS.root_key(), ids, BS)
    offers = [(10 + b, b * BS) for b in range(1, 8)] + [(0, 4 * BS), (20, 5 * BS + 2)]
    book = state_book()
    book.remember_branch("r", 3)  # kvkeep held 3 blocks of this prompt's attention KV
    book.on_alloc("r", ids, None, [0] * 8, 0)
    saved = book.state_saves("r", offers, ids, None)
    assert saved == [BlockTransfer(13, keys[2]), BlockTransfer(17, keys[6])]
    reply = ids + tokens(6, 900)  # decode wrote the state after 9 blocks
    more = chain_keys(NS.root_key(), reply, BS)
    assert book.state_saves("r", [(19, 9 * BS), (21, 9 * BS + 1)], reply, None) == [
        BlockTransfer(19, more[8])
    ]
    assert book.state_saves("r", [(19, 12 * BS)], reply, None) == []  # beyond the tokens
    every = state_book("every")
    every.on_alloc("r", ids, None, [0] * 8, 0)
    assert [t.block_id for t in every.state_saves("r", offers, ids, None)] == list(range(11, 18))
    assert every.saves_after("r", 30, ids, None) == [], "a state group saves what vLLM offers"
