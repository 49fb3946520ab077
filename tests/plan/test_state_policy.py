"""Which boundaries' state a hybrid keeps, replayed over hand-made traces whose answer is
known: an agent's next turn, a sub-agent sharing a system prompt, and the cost of 'every'."""

from __future__ import annotations

import pytest

from kvkeep.plan.state_policy import compare, replay
from kvkeep.plan.trace import BlockTrace, make_request

B = 100  # tokens per block


def trace(*prompts: tuple[list[int], int]) -> BlockTrace:
    """Requests under vLLM's rules: (block ids, prompt tokens)."""
    return BlockTrace(
        tuple(make_request(ids, tokens, B, True) for ids, tokens in prompts), B, "test", "vllm"
    )


def test_an_agent_s_next_turn_hits_its_last_prompt_s_claimable_boundary() -> None:
    """Turn 1 has 5 full blocks (550 tokens: 5 claimable); turn 2 extends it to 8 blocks.
    Both policies serve turn 2's first 5 blocks; 'reused' keeps one state a turn (each
    prompt's end), 'every' each boundary computed."""
    t = trace((list(range(5)), 550), (list(range(8)), 850))
    reused, every = compare(t)
    assert (reused.hit_tokens, every.hit_tokens) == (500, 500)
    assert (reused.snapshots, every.snapshots) == (1 + 1, 5 + 3)


def test_a_prompt_that_is_a_whole_number_of_blocks_still_leaves_a_state_its_next_turn_hits() -> (
    None
):
    """600 tokens, 6 full blocks: the last token's block cannot be claimed, so the state kept
    is at 5 blocks, and the next turn (which changed that last block) hits there."""
    t = trace((list(range(6)), 600), ([0, 1, 2, 3, 4, 60, 61], 700))
    assert replay(t, "reused").hit_tokens == 500


def test_a_sibling_misses_at_a_new_branch_point_once_under_reused() -> None:
    """Two sub-agents share the parent's first 3 blocks: the first finds no state there
    under 'reused' (the parent kept its last boundary only) and keeps one at its branch
    point; the second hits it. 'every' serves both."""
    parent = (list(range(10)), 1050)
    first = ([0, 1, 2, 20, 21], 550)
    second = ([0, 1, 2, 30, 31], 550)
    reused, every = compare(trace(parent, first, second))
    assert reused.hit_tokens == 300 and every.hit_tokens == 600
    assert reused.attention_hit_tokens == every.attention_hit_tokens == 600
    assert reused.snapshots < every.snapshots


def test_the_claim_steps_back_only_so_far() -> None:
    """The third prompt holds 6 stored blocks, with a state only 3 boundaries back (at 3):
    found within 4 steps, not within 2."""
    t = trace((list(range(3)), 350), (list(range(8)), 850), ([0, 1, 2, 3, 4, 5, 70, 71], 850))
    assert replay(t, "reused").hit_tokens == 300 + 300
    assert replay(t, "reused", steps_back=2).hit_tokens == 300 + 0


def test_an_unknown_policy_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="reused, every"):
        replay(trace(), "sometimes")
