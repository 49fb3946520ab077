"""`bench replay`'s arithmetic and report: percentiles, rates over prompt tokens, the hit rate
over time, and the S7 table, claims rows and plots, from measured-looking inputs."""

from __future__ import annotations

import json
from pathlib import Path

from kvkeep.bench import report
from kvkeep.bench.http import TurnResult
from kvkeep.bench.metrics import Counters
from kvkeep.bench.report.tables import claims_table
from kvkeep.bench.result import to_json
from kvkeep.bench.scenarios import registry
from kvkeep.bench.scenarios.replay import percentile, summarize, timeline
from kvkeep.plan.replay import ReplaySpec, load_replay


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert [percentile(values, q) for q in (0.5, 0.9, 0.99, 1.0)] == [50.0, 90.0, 99.0, 100.0]
    assert percentile([3.0], 0.99) == 3.0 and percentile([], 0.5) == 0.0


def counters(prompt: float, device: float, external: float) -> Counters:
    return Counters({"vllm:prompt_tokens_total": prompt, "vllm:prefix_cache_queries_total": prompt,
                     "vllm:prefix_cache_hits_total": device,
                     "vllm:external_prefix_cache_hits_total": external}, {})  # fmt: skip


def test_the_hit_rate_over_time_is_cumulative_over_lookups() -> None:
    samples = [(0.0, counters(100, 0, 0)), (2.0, counters(100, 0, 0)),
               (4.0, counters(1100, 100, 500)), (6.0, counters(3100, 600, 2400))]  # fmt: skip
    assert timeline(samples) == [
        {"t_s": 4.0, "device_hit_rate": 0.1, "kvkeep_hit_rate": 0.5},
        {"t_s": 6.0, "device_hit_rate": 0.2, "kvkeep_hit_rate": 0.8},
    ]


def test_summary_and_report(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    rows = [{"t": i, "type": "n", "in": 64 * (4 + i), "out": 10, "hash_ids": list(range(4 + i))}
            for i in range(3)]  # fmt: skip
    trace.write_text(json.dumps({"block_size": 64, "requests": rows}))
    replay = load_replay(ReplaySpec((trace,), sessions=1, block_tokens=32))
    sent = [TurnResult(0, i, 128 + 32 * i, 96 * (i > 0), 128 + 32 * i - 96 * (i > 0), 1,
                       0.1 * (i + 1), 0.2, 10.0 * i) for i in range(3)]  # fmt: skip
    delta = Counters(counters(480, 96, 96).vllm, {"ram": 3.0, "disk": 1.0})
    result = summarize(replay, sent, delta, wall_s=30.0, pool=1)
    assert (result.prompt_tokens, result.computed_tokens) == (480, 288)
    assert result.reported_hit_rate == 192 / 480
    assert (result.device_cached_tokens, result.kvkeep_cached_tokens) == (96, 96)
    assert result.hit_rate == 192 / 480 and result.tier_hit_rates == {"ram": 0.15, "disk": 0.05}
    assert (result.ttft_p50_s, result.ttft_p99_s) == (0.2, 0.30000000000000004)
    assert result.requests_per_min == 6.0 and result.session_wall_s_max == 20.2
    assert result.order == [[0, 0], [0, 1], [0, 2]]
    assert result.working_set_tokens == 128 and result.working_set_over_pool == 1.0
    doc = {"scenario": "replay", "modes": {"kvkeep": to_json(result)}}
    paths = report.write_report(doc, tmp_path / "out")
    md = (tmp_path / "out/report.md").read_text()
    assert "### S7: 1 real Claude Code sessions, closed loop, working set 1.0x" in md
    assert "| kvkeep | 480 | 96 | 96 | 288 | 40.0% | 0.200 s |" in md
    assert {p.name for p in paths if p.suffix == ".png"} == {
        "replay_ttft_cdf.png", "replay_hit_rate_over_time.png"}  # fmt: skip
    claims = claims_table({"scenarios": {"replay": doc}}, registry.claims(), registry.sections())
    assert (
        "| S7 real coding-agent sessions: hit rate | 94% with room, 17% without | 40.0% |" in claims
    )
