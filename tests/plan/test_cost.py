"""Prefill fitting, tier hit rates, TTFT estimates and load-vs-recompute verdicts."""

from __future__ import annotations

import pytest

from kvkeep.plan.cost import (
    Measurement,
    PrefillModel,
    Workload,
    estimate,
    fit_prefill,
    load_verdict,
)
from kvkeep.plan.stackdist import stack_distances
from kvkeep.plan.tiers import TierSpec, tier_hits
from kvkeep.plan.trace import BlockTrace, Request


def test_fit_recovers_a_quadratic_prefill() -> None:
    # DESIGN.md's shape: overhead + linear + quadratic
    true = PrefillModel(linear_s=1e-4, quadratic_s=2e-8, overhead_s=0.03)
    sizes = (2048, 8192, 16384, 32768)
    fitted = fit_prefill([Measurement(n, true.compute_s(n, 0)) for n in sizes])
    assert fitted.linear_s == pytest.approx(1e-4, rel=1e-6)
    assert fitted.quadratic_s == pytest.approx(2e-8, rel=1e-6)
    assert fitted.overhead_s == pytest.approx(0.03, rel=1e-6)


def test_fit_drops_negative_terms() -> None:
    # perfectly linear with noise that would make the quadratic term negative
    data = [Measurement(1000, 0.1), Measurement(2000, 0.2), Measurement(4000, 0.39)]
    fitted = fit_prefill(data)
    assert fitted.quadratic_s >= 0 and fitted.overhead_s >= 0
    assert fitted.compute_s(4000, 0) == pytest.approx(0.39, rel=0.05)


def test_fit_needs_two_sizes() -> None:
    with pytest.raises(ValueError, match="at least two prompt sizes"):
        fit_prefill([Measurement(1000, 0.1), Measurement(1000, 0.11)])


def test_cached_tokens_still_cost_attention() -> None:
    m = PrefillModel(linear_s=1.0, quadratic_s=0.5)
    assert m.compute_s(4, 0) == 4 + 0.5 * 16
    assert m.compute_s(4, 3) == 1 + 0.5 * (16 - 9)


def two_turns() -> BlockTrace:
    # request 2 extends request 1: with >= 2 blocks cached it hits 2 of its 3 blocks
    reqs = (Request((0, 1), 8, 2, output_tokens=2), Request((0, 1, 2), 12, 3, output_tokens=2))
    return BlockTrace(reqs, 4, "test", "trace")


def test_tiers_are_inclusive() -> None:
    sd = stack_distances(two_turns())
    hits = tier_hits(sd, [TierSpec("device", 1), TierSpec("ram", 1), TierSpec("disk", 2)])
    assert [round(h.hit_rate * 5) for h in hits] == [1, 0, 1]  # RAM no bigger: adds nothing
    assert hits[-1].cumulative_hit_rate == pytest.approx(2 / 5)
    assert hits[-1].cumulative_token_hit_rate == pytest.approx(8 / 20)


def test_estimate_by_hand() -> None:
    trace, prefill = two_turns(), PrefillModel(linear_s=0.01)
    sd = stack_distances(trace)
    tiers = [TierSpec("device", 1), TierSpec("ram", 4, load_gbps=1e-6)]  # 1 kB/s
    work = Workload(agents=2, tool_delay_s=1.0, decode_s_per_token=0.1)
    cold = estimate("none", sd, trace, [], 10.0, prefill, work)
    assert cold.mean_ttft_s == pytest.approx((0.08 + 0.12) / 2)
    warm = estimate("ram", sd, trace, tiers, 10.0, prefill, work)
    # turn 2: 4 tokens from the device, 4 from RAM (40 bytes at 1 kB/s), 4 computed
    assert warm.mean_ttft_s == pytest.approx((0.08 + 0.04 + 0.04) / 2)
    assert warm.token_hit_rate == pytest.approx(8 / 20)
    busy = 0.08 + 0.2  # mean TTFT + 2 output tokens x 0.1 s
    assert warm.turns_per_min == pytest.approx(60 * min(2 / (busy + 1.0), 1 / busy))


def test_slow_disk_loses_to_recompute() -> None:
    prefill = PrefillModel(linear_s=5e-5)
    disk = TierSpec("disk", 100, load_gbps=1.0)
    slow = load_verdict(disk, 320 * 1024, prefill, 10_000)  # Llama-70B over a 1 GB/s disk
    assert slow is not None and not slow.worth_loading
    fast = load_verdict(TierSpec("ram", 100, load_gbps=20.0), 320 * 1024, prefill, 10_000)
    assert fast is not None and fast.worth_loading
    assert load_verdict(TierSpec("device", 10), 1.0, prefill, 1) is None


def test_configs_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="--prefill-s-per-token"):
        PrefillModel(linear_s=0)
    with pytest.raises(ValueError, match="ram tier's bandwidth"):
        TierSpec("ram", 10, load_gbps=0)
    with pytest.raises(ValueError, match="--agents"):
        Workload(agents=0)
