"""The correctness criterion: exact against vLLM's own hit, drift-tolerant against cold."""

from __future__ import annotations

from kvkeep.bench.criterion import DRIFT_TOL, Reply, same_as_cold, same_as_hit

HIT = Reply([5, 6, 7], [-1.0, -2.0, -3.0], [{5: -1.0, 9: -1.5}, {6: -2.0, 8: -2.02}, {7: -3.0}])


def test_the_same_reply_passes_both_rules() -> None:
    assert same_as_hit(HIT, HIT) and same_as_cold(HIT, HIT)
    assert same_as_hit(HIT, HIT).compared == 3


def test_any_token_or_logprob_difference_fails_the_strict_rule() -> None:
    other_token = Reply([5, 8, 7], [-1.0, -2.02, -3.0])
    verdict = same_as_hit(other_token, HIT)
    assert not verdict and "token 1" in verdict.why and verdict.worst > 0.01
    drifted = Reply([5, 6, 7], [-1.0, -2.01, -3.0])
    assert not same_as_hit(drifted, HIT)


def test_cold_allows_drift_and_a_broken_tie_but_not_a_wrong_token() -> None:
    drifted = Reply([5, 6, 7], [-1.0, -2.05, -3.0])
    assert same_as_cold(drifted, HIT)
    tie_broken = Reply([5, 8, 1], [-1.0, -2.0, -9.0])  # token 1 was within 0.02 of the best
    verdict = same_as_cold(tie_broken, HIT)
    assert verdict and "tie at token 1" in verdict.why
    no_tie = Reply([9, 6, 7], [-1.0, -2.0, -3.0])  # 0.5 below the best: not drift
    assert not same_as_cold(no_tie, HIT)
    far = Reply([5, 6, 7], [-1.0, -2.0 - 2 * DRIFT_TOL, -3.0])
    assert not same_as_cold(far, HIT)
    assert not same_as_cold(Reply([5, 6], [-1.0, -2.0]), HIT)


def test_a_tie_seen_only_by_the_candidate_counts() -> None:
    """Three-way bf16 ties: the cold run's list may miss the candidate's token while the
    candidate lists the cold run's choice right beside its own."""
    cold = Reply([5, 6], [-1.0, -2.0], [{5: -1.0}, {6: -2.0, 8: -2.0}])
    candidate = Reply([5, 9], [-1.0, -2.0], [{5: -1.0}, {9: -2.0, 6: -2.0}])
    assert same_as_cold(candidate, cold)
    far = Reply([5, 9], [-1.0, -2.0], [{5: -1.0}, {9: -2.0, 6: -2.5}])
    assert not same_as_cold(far, cold)


def test_without_alternatives_any_token_difference_fails() -> None:
    cold = Reply([5, 6], [-1.0, -2.0])
    assert not same_as_cold(Reply([5, 8], [-1.0, -2.0]), cold)


def test_a_flip_that_moved_the_tokens_more_than_drift_is_no_tie() -> None:
    """Wrong KV on a flat reply: the candidate's token was within 0.1 of the cold run's
    choice there, but the candidate gives each token a logprob far from the cold run's."""
    cold = Reply([5, 6], [-4.5, -4.0], [{5: -4.5, 9: -4.58}, {6: -4.0}])
    moved = Reply([9, 6], [-4.2, -4.0], [{9: -4.2, 5: -4.25}, {6: -4.0}])
    assert not same_as_cold(moved, cold)
    drifted = Reply([9, 6], [-4.56, -4.0], [{9: -4.56, 5: -4.57}, {6: -4.0}])
    assert same_as_cold(drifted, cold)
