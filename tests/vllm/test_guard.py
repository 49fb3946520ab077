"""The rules that keep vLLM from serving a failed synchronous load's blocks, without vLLM
(the end-to-end proof is ``tests/e2e/test_correctness.py``)."""

from __future__ import annotations

from typing import NamedTuple

from kvkeep.keys import Namespace, chain_keys
from kvkeep.vllm import compat
from kvkeep.vllm.guard import PLANS_IN_FLIGHT, SyncLoadGuard, tails_from

NS = Namespace(model_digest="m", kv_dtype="bf16", layout="LBHNC", backend="cpu/vec", block_size=4)
KEYS = chain_keys(NS.root_key(), list(range(40)), 4)


class Config(NamedTuple):
    max_concurrent_batches: int  # vLLM's: 1 step by step, 2 with asynchronous scheduling


def test_a_hit_over_an_unconfirmed_load_waits_until_its_outcome_is_known() -> None:
    guard = SyncLoadGuard()
    assert not guard.active and not guard.covers(KEYS)
    guard.hold(KEYS[3:6])
    assert guard.covers(KEYS[:4]), "a hit admitted in the same step as the load"
    assert not guard.covers(KEYS[:3]), "a hit that stops before the loaded blocks"
    for _ in range(PLANS_IN_FLIGHT):
        guard.planned()
        assert guard.covers(KEYS[:5]), "a plan whose outcome may still be unknown"
    guard.planned()
    assert not guard.covers(KEYS) and not guard.active


def test_scheduling_step_by_step_a_hit_waits_only_in_the_loads_own_step() -> None:
    guard = SyncLoadGuard(plans_in_flight=compat.plans_in_flight(Config(1)))
    guard.hold(KEYS[3:6])
    assert guard.covers(KEYS[:5])
    guard.planned()  # vLLM processes the step's output before it schedules the next one
    assert not guard.covers(KEYS[:5]) and not guard.active


def test_plans_in_flight_follow_vllms_concurrent_batches() -> None:
    assert [compat.plans_in_flight(Config(n)) for n in (1, 2, 4)] == [0, 1, 3]


def test_each_plan_holds_only_its_own_loads() -> None:
    guard = SyncLoadGuard(plans_in_flight=1)
    guard.hold(KEYS[0:2])
    guard.planned()
    guard.hold(KEYS[5:6])
    guard.planned()
    assert not guard.covers(KEYS[:2]) and guard.covers(KEYS[:6])


def test_the_tail_from_the_first_failed_block_leaves_the_prefix_cache() -> None:
    tables = [[7, 8, 9, 10, 11], [1, 2, 3], [20, 9, 21]]
    assert tails_from(tables, {9}) == {9, 10, 11, 21}
    assert tails_from(tables, {3, 11}) == {3, 11}
    assert tails_from([], {5}) == {5}, "a failed block nobody tracks still goes"
