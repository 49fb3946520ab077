"""Stack distances against hand-worked traces and a brute-force LRU cache replay."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkeep.plan.stackdist import COLD, stack_distances
from kvkeep.plan.trace import BlockTrace, Request, make_request, read_mooncake

MOONCAKE = Path(__file__).resolve().parents[3] / "shared/data/mooncake-synthetic-trace.jsonl"


def trace_of(*requests: list[int], block_tokens: int = 4) -> BlockTrace:
    reqs = tuple(Request(tuple(r), len(r) * block_tokens, len(r)) for r in requests)
    return BlockTrace(reqs, block_tokens, "test", "trace")


def brute_force_hits(trace: BlockTrace, capacity: int) -> int:
    """A real LRU cache of `capacity` blocks: longest cached prefix hits, then the request's
    blocks, its output's tail blocks last, are cached and freed last block first (so the first
    block is most recent)."""
    cache: OrderedDict[object, None] = OrderedDict()
    hits = 0
    for n, r in enumerate(trace.requests):
        for i, b in enumerate(r.blocks):
            if i >= r.hit_cap or b not in cache:
                break
            hits += 1
        tails = [("tail", n, j) for j in range(r.tail_blocks)]
        for b in reversed([*r.blocks, *tails]):
            cache[b] = None
            cache.move_to_end(b)
            while len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def test_shared_prefix_hand_worked() -> None:
    # stack after r1: 0 1 2 (top first); after r2: 0 1 3 2
    sd = stack_distances(trace_of([0, 1, 2], [0, 1, 3], [0, 1, 2, 4]))
    assert sd.distances.tolist() == [COLD] * 3 + [1, 2, COLD] + [1, 2, 4, COLD]
    assert sd.hit_rate(2) == pytest.approx(4 / 10)
    assert sd.hit_rate(3) == pytest.approx(4 / 10)
    assert sd.hit_rate(4) == pytest.approx(5 / 10)
    assert sd.ceiling() == pytest.approx(5 / 10)
    assert sd.hits_per_request(2).tolist() == [0, 2, 2]


def test_cyclic_single_blocks_get_nothing_below_the_working_set() -> None:
    docs, rounds = 5, 4
    sd = stack_distances(trace_of(*[[d] for _ in range(rounds) for d in range(docs)]))
    for capacity in range(1, docs):
        assert sd.hit_rate(capacity) == 0.0
    assert sd.hit_rate(docs) == pytest.approx((rounds - 1) / rounds)


def test_cyclic_documents_in_vllm_order() -> None:
    """D documents of k blocks in tile order: block j of a document sits at (D-1)k + j when it
    comes round again, because vLLM evicts each document's tail first. So there are no hits at
    all up to (D-1)k blocks, then C - (D-1)k blocks per document, and all of them at Dk."""
    docs, k, rounds = 4, 3, 3
    reqs = [[d * k + j for j in range(k)] for _ in range(rounds) for d in range(docs)]
    sd = stack_distances(trace_of(*reqs))
    warm = sd.distances[docs * k :]
    assert warm.tolist() == [(docs - 1) * k + j for j in range(1, k + 1)] * (docs * (rounds - 1))
    assert sd.hit_rate((docs - 1) * k) == 0.0
    for c in range((docs - 1) * k, docs * k + 1):
        assert sd.hit_rate(c) * len(reqs) * k == brute_force_hits(trace_of(*reqs), c)


def test_hit_cap_leaves_the_last_block_to_compute() -> None:
    r = make_request([7, 8], tokens=8, block_tokens=4, vllm_blocks=True)
    assert r.hit_cap == 1  # (8 - 1) // 4: vLLM recomputes the last token, so its block too
    sd = stack_distances(BlockTrace((r, r), 4, "test", "vllm"))
    assert sd.distances.tolist() == [COLD, COLD, 1, COLD]
    assert sd.token_hit_rate(10) == pytest.approx(4 / 16)


def test_output_tail_blocks_take_slots_but_never_hit() -> None:
    # r1 caches [0, 1] plus one block its output filled, freed first (so it sits below them);
    # then r2 = [2]. Stack before r3, top first: 2, 0, 1, tail.
    r1 = Request((0, 1), 8, 2, tail_blocks=1)
    trace = BlockTrace((r1, Request((2,), 4, 1), Request((0, 1), 8, 2)), 4, "t", "vllm")
    sd = stack_distances(trace)
    assert sd.distances.tolist() == [COLD, COLD, COLD, 2, 3]
    assert sd.distinct_blocks == 3  # the tail is no block of the working set
    # r2's block at 3 (not 2): r1's tail pushed the older blocks down, then sank itself
    trace = BlockTrace((Request((9,), 4, 1), r1, Request((9,), 4, 1)), 4, "t", "vllm")
    assert stack_distances(trace).distances.tolist() == [COLD, COLD, COLD, 4]


def test_vllm_rules_drop_the_partial_block() -> None:
    r = make_request([1, 2, 3], tokens=10, block_tokens=4, vllm_blocks=True)
    assert (r.blocks, r.hit_cap) == ((1, 2), 2)


def test_ids_that_break_the_prefix_property_still_hit_only_as_a_prefix() -> None:
    sd = stack_distances(trace_of([5, 6], [7, 6]))
    assert sd.distances.tolist() == [COLD, COLD, COLD, COLD]


@st.composite
def trie_traces(draw: st.DrawFn) -> BlockTrace:
    """Requests that walk a random trie, so equal ids always mean equal prefixes."""
    children: dict[tuple[int, int], int] = {}
    reqs = []
    for _ in range(draw(st.integers(1, 25))):
        path, parent = [], -1
        for choice in draw(st.lists(st.integers(0, 2), min_size=1, max_size=6)):
            parent = children.setdefault((parent, choice), len(children))
            path.append(parent)
        cap = draw(st.integers(0, len(path)))
        tails = draw(st.integers(0, 2))
        reqs.append(Request(tuple(path), len(path) * 4, cap, tail_blocks=tails))
    return BlockTrace(tuple(reqs), 4, "hypothesis", "trace")


@settings(max_examples=200, deadline=None)
@given(trie_traces(), st.integers(1, 30))
def test_matches_a_brute_force_lru_cache(trace: BlockTrace, capacity: int) -> None:
    sd = stack_distances(trace)
    assert round(sd.hit_rate(capacity) * sd.references) == brute_force_hits(trace, capacity)
    per_request = sd.hits_per_request(capacity)
    assert per_request.sum() == brute_force_hits(trace, capacity)


def test_curve_is_monotone_and_ends_at_the_ceiling() -> None:
    sd = stack_distances(trace_of([0, 1], [2], [0, 1], [2, 3], [0]))
    rates = sd.curve().hit_rates
    assert (rates[1:] >= rates[:-1]).all()
    assert rates[-1] == pytest.approx(sd.ceiling())


@pytest.mark.skipif(
    not MOONCAKE.is_file() and not os.environ.get("CI"),  # in CI a missing trace fails
    reason="the shared Mooncake trace is not beside this checkout",
)
def test_mooncake_trace_ceiling() -> None:
    sd = stack_distances(read_mooncake(MOONCAKE))
    assert sd.distinct_blocks == 43_924
    assert round(sd.hit_rate(1_000_000), 4) == 0.6396
    assert sd.hit_rate(1000) < sd.hit_rate(5000) < sd.hit_rate(20000) < 0.6396
