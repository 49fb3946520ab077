"""The study scenarios' arithmetic and reports, on hand-made numbers (no vLLM)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from bench_examples import EXAMPLES

from kvkeep.bench import report
from kvkeep.bench.http import TurnResult, summarize_agents, summarize_sample
from kvkeep.bench.metrics import Counters, HitRates, cacheable_tokens, hit_split, mean_rates
from kvkeep.bench.prompts import Queried
from kvkeep.bench.result import to_json
from kvkeep.bench.sampling import balanced_turns, grid_turns, sample_error, turn_work
from kvkeep.bench.scenarios.capacity import CapacitySpec
from kvkeep.bench.scenarios.restart import Requeried, summarize
from kvkeep.tinymodel.generate import TinyModelSpec, llama_config
from kvkeep.traffic.workload import CharEstimate, SessionSpec, generate_sessions


def test_cacheable_tokens_never_include_the_last_token() -> None:
    assert cacheable_tokens(2048 + 16, 128) == 2048
    assert cacheable_tokens(2048, 128) == 1920  # the last block holds the last token
    assert cacheable_tokens(1, 128) == 0


def test_hit_split_by_device_connector_and_kvkeep_tiers() -> None:
    delta = Counters(
        vllm={
            "vllm:prefix_cache_hits_total": 256.0,
            "vllm:external_prefix_cache_hits_total": 768.0,
        },
        tier_hits={"ram": 4.0, "disk": 2.0},
    )
    rates = to_json(hit_split(delta, 1024))
    assert rates["hit_rate"] == 1.0
    assert rates["device_hit_rate"] == 0.25
    assert rates["external_hit_rate"] == 0.75
    assert rates["ram_hit_rate"] == pytest.approx(0.5)
    assert rates["disk_hit_rate"] == pytest.approx(0.25)


def test_capacity_documents_total_k_times_the_pool() -> None:
    spec = CapacitySpec(pool_blocks=64, k=4, doc_tokens=1024, rounds=2)
    docs = spec.documents()
    assert len(docs) == spec.num_docs == 32
    assert sum(len(d) for d in docs) == 4 * 64 * 128
    assert len({tuple(d[:8]) for d in docs}) == len(docs)  # no two documents share a prefix
    assert spec.documents() == docs  # deterministic


def test_capacity_counts_a_hybrid_models_pool_blocks(tmp_path: Path) -> None:
    """Gemma-3 style (5 sliding layers of 512 tokens, 1 full): a 1024-token document holds 8
    blocks of the full group and 5 of each sliding group, 33 of the pool, not 8."""
    config = {"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "sliding_window": 512,
              "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = CapacitySpec(pool_blocks=64, k=4, doc_tokens=1024, rounds=2).for_model(tmp_path)
    assert (spec.doc_blocks, spec.num_docs) == (8 + 5 * 5, 8)  # ceil(4 * 64 / 33)
    spec.validate()
    with pytest.raises(ValueError, match="holds 34 blocks of the 32"):  # and its question
        replace(spec, pool_blocks=32).validate()
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps(llama_config(TinyModelSpec())))
    plain = CapacitySpec(pool_blocks=64, k=4, doc_tokens=1024, rounds=2).for_model(llama)
    assert (plain.doc_blocks, plain.num_docs) == (8, 32)  # as without a model
    unknown = CapacitySpec(pool_blocks=64, k=4, doc_tokens=1024, rounds=2)
    assert unknown.for_model(tmp_path / "none") == unknown  # an --endpoint run's


@pytest.mark.parametrize(
    "kwargs, word",
    [({"rounds": 1}, "--rounds"), ({"doc_tokens": 1000}, "multiple"), ({"pool_blocks": 4}, "fit")],
)
def test_capacity_spec_errors_name_the_flag(kwargs, word) -> None:
    with pytest.raises(ValueError, match=word):
        CapacitySpec(**kwargs).validate()


def test_agents_summary_turns_per_minute_and_late_wait() -> None:
    rows = [
        TurnResult(agent=a, turn=t, prompt_tokens=100, cached_tokens=0, computed_tokens=100,
                   output_tokens=8, ttft_s=0.1, latency_s=float(t + 1), start_s=float(2 * t))
        for a in range(2) for t in range(6)
    ]  # fmt: skip
    s = to_json(summarize_agents(rows, wall_s=30.0, agents=2))
    assert s["turns"] == 12
    assert s["turns_per_min"] == pytest.approx(24.0)
    assert s["late_turn_wait_s"] == pytest.approx((2 + 3 + 4 + 5 + 6) / 5)
    assert s["wait_per_turn_s"]["0"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    # agent 0's last turn ends at 10 + 6 = 16 s: 6 turns in 16 s
    assert s["turns_per_min_per_agent"]["0"] == pytest.approx(6 / (16 / 60))


def test_a_sample_of_turns_is_summarized_alike_whether_a_mode_ran_it_alone_or_every_turn() -> None:
    assert grid_turns(30, 3) == list(range(1, 30, 3)) and grid_turns(4, 1) == [0, 1, 2, 3]
    sample = grid_turns(30, 3)

    def rows(turns: list[int], latency: float) -> list[TurnResult]:
        return [TurnResult(a, t, 100, 0, 100, 4, 0.1, latency * (t + 1), 0.0)
                for a in range(2) for t in turns]  # fmt: skip

    every = summarize_sample(rows(list(range(30)), 0.1), sample, 0.2, 2, 3)
    alone = summarize_sample(rows(sample, 0.1), sample, 0.2, 2, 3)
    assert every == alone and every.turns == 20
    # each agent: 10 sampled turns, latencies 0.2, 0.5, ..., 2.9 s (15.5 s) and 10 tool delays
    assert every.turns_per_min == pytest.approx(20 / (17.5 / 60))
    assert every.late_turn_wait_s == pytest.approx((2.6 + 2.9) / 2)  # LATE_TURNS 5 at stride 3
    slower = summarize_sample(rows(sample, 0.2), sample, 0.2, 2, 3)
    assert slower.turns_per_min < every.turns_per_min


def test_the_baselines_sample_carries_every_modes_average_work() -> None:
    """S5's generated sessions (the demo's size): their turn 1 adds the first tool result,
    about three times a later turn's new tokens. The grid 1, 4, ..., 28 carries the
    no-cache mode's work (prompt tokens) but 10% more than kvkeep's average (new tokens);
    the balanced sample carries both within 3%, one turn from each three in a row."""
    spec = SessionSpec(turns=30, scale=0.08, max_output_tokens=4)
    sessions = generate_sessions(spec, CharEstimate(), 8)
    work = turn_work(sessions)
    grid = grid_turns(30, 3)
    assert sample_error(work, grid) > 0.08  # the new tokens: what the grid got wrong

    sample = balanced_turns(work, 3)
    assert sample_error(work, sample) < 0.03
    assert [t // 3 for t in sample] == list(range(10))  # one in each stratum, in order
    assert balanced_turns(work, 3) == sample  # deterministic
    assert balanced_turns(work, 1) == list(range(30))
    # a short last stratum still gets its turn
    assert [t // 4 for t in balanced_turns(work, 4)] == list(range(8))


def test_turn_work_reads_prompt_and_new_tokens_per_turn() -> None:
    spec = SessionSpec(turns=4, scale=0.05, max_output_tokens=4)
    sessions = generate_sessions(spec, CharEstimate(), 2)
    work = turn_work(sessions)
    prompts = [[t.target_tokens for t in s] for s in sessions]
    assert work[2][0] == pytest.approx((prompts[0][2] + prompts[1][2]) / 2)
    assert work[2][1] == pytest.approx((prompts[0][2] ** 2 + prompts[1][2] ** 2) / 2)
    new = [(p[2] - p[1]) for p in prompts]
    assert work[2][2] == pytest.approx(sum(new) / 2)
    assert work[0][2] == pytest.approx(work[0][0])  # the first turn: all of it is new


def _phase(hit: float, ttft: float) -> Queried:
    return Queried(HitRates(hit), ttft, [ttft], 1024)


def test_restart_figures_take_the_worse_of_the_two_server_restarts() -> None:
    phases = {
        "warmup": _phase(0.0, 1.0),
        "warm": _phase(1.0, 0.05),
        "after_engine_restart": _phase(1.0, 0.06),
        "after_server_sigterm": _phase(1.0, 0.07),
        "after_server_sigkill": _phase(0.98, 0.08),
    }
    phases["after_engine_restart"] = Requeried(HitRates(1.0), 0.06, [0.06], 1024, 0.1, None, 0.04)
    flat = to_json(summarize(25.0, [27.0, 31.0, 26.0], phases))
    assert flat["restart_ready_s"] == 27.0  # the median restart
    assert flat["restart_ready_samples_s"] == [27.0, 31.0, 26.0]
    assert flat["after_engine_restart_device_ttft_s"] == 0.04
    assert flat["after_server_restart_hit_rate"] == 0.98
    assert flat["after_engine_restart_ttft_s"] == 0.06
    assert flat["phases"]["after_server_sigkill"]["hit_rate"] == 0.98
    no_cache = summarize(25.0, [27.0], {k: v for k, v in phases.items() if "server" not in k})
    assert no_cache.after_server_restart_hit_rate is None


def test_restart_ttfts_are_medians_so_one_slow_request_does_not_move_them() -> None:
    slow_first = Queried(HitRates(0.0), 0.7, [0.9, 0.6, 0.6], 3072)  # a mean of 0.7
    phases = {"warmup": slow_first, "warm": _phase(1.0, 0.05)}
    phases["after_engine_restart"] = Requeried(
        HitRates(1.0), 0.02, [0.02, 0.02, 0.2], 1024, 0.1, None, 0.04
    )
    result = summarize(25.0, [27.0], phases)
    assert result.cold_ttft_s == 0.6
    assert result.after_engine_restart_ttft_s == 0.02


def test_mean_rates_weigh_each_measurement_by_its_cacheable_tokens() -> None:
    a = HitRates(1.0, 0.0, 1.0, {"ram_hit_rate": 1.0})
    b = HitRates(0.5, 0.5, 0.0)
    mean = mean_rates([(a, 300), (b, 100)])
    assert (mean.hit_rate, mean.device_hit_rate) == (0.875, 0.125)
    assert mean.tiers == {"ram_hit_rate": 0.75}


def test_all_report_has_a_row_per_claim_and_a_self_contained_page(tmp_path: Path) -> None:
    def mode(hit: float) -> dict:
        agents = EXAMPLES["agents"]
        summary = replace(agents.summary, turns_per_min=60.0 * hit + 8)
        return {
            "capacity": replace(EXAMPLES["capacity"], rates=HitRates(hit, 0.0, hit)),
            "restart": replace(EXAMPLES["restart"], after_engine_restart_hit_rate=hit),
            "agents": replace(agents, summary=summary, cached_fraction=hit),
            "hol": replace(EXAMPLES["hol"], long_prefill_ratio=1.1, long_prefill_alone_s=2.0,
                           long_prefill_ttft_s=2.2, max_num_batched_tokens=None,
                           long_prefill_token_threshold=512),
        }  # fmt: skip

    modes = {"vllm": mode(0.0), "kvkeep": mode(1.0)}
    doc = {
        "scenarios": {
            name: {"scenario": name, "modes": {m: to_json(r[name]) for m, r in modes.items()}}
            for name in ("capacity", "restart", "agents", "hol")
        }
    }
    paths = report.write_report(doc, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| S3 hit rate, all tiers | >99% (offload) | 0.0% | 100.0% |" in md
    assert "| S5 turns/min, agents > pool | ~8 -> ~60 | 8.0 | 68.0 |" in md
    assert "| S6 the big prefill's TTFT beside it / alone | (not measured) | 1.1x | 1.1x |" in md
    assert "| 2.000 s | 2.200 s | 1.1x | default | 512 |" in md  # S6's own table
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == sum(p.suffix == ".png" for p in paths) >= 3
    assert "<td>S4 hit rate after vLLM restart</td>" in page
    assert 'src="http' not in page  # nothing to fetch: one self-contained file
