"""The one JSON form of scenario results: field names as keys, FLAT groups merged in."""

from __future__ import annotations

from pathlib import Path

from bench_examples import EXAMPLES

from kvkeep.bench import report
from kvkeep.bench.http import AgentsSummary
from kvkeep.bench.metrics import HitRates
from kvkeep.bench.report.results import typed
from kvkeep.bench.result import to_json
from kvkeep.bench.scenarios import registry
from kvkeep.bench.scenarios.agents import AgentsResult, PoolFit
from kvkeep.bench.scenarios.ttft import SizeTTFT, TTFTResult
from kvkeep.traffic.workload import SessionSpec


def _agents(fit: PoolFit | None) -> dict:
    summary = AgentsSummary(2, 4, 60.0, 4.0, {"0": 2.0}, {"0": [1.0]}, 1.0, 1.0, 0.1)
    rates = HitRates(0.5, 0.25, 0.25, {"ram_hit_rate": 0.25})
    return to_json(AgentsResult(summary, rates, 0.5, 1000, 0.2, SessionSpec(), 128, 800, fit))


def test_flat_groups_put_their_keys_beside_the_result_s_own() -> None:
    doc = _agents(PoolFit(2.5, 3))
    assert doc["turns_per_min"] == 4.0 and doc["ram_hit_rate"] == 0.25
    assert doc["working_set_over_pool"] == 2.5 and doc["pool_blocks"] == 3
    assert doc["spec"]["turns"] == SessionSpec().turns  # a nested dataclass stays nested
    assert not {"summary", "rates", "tiers", "fit"} & doc.keys()


def test_an_absent_flat_group_adds_no_keys() -> None:
    doc = _agents(None)
    assert "working_set_over_pool" not in doc and "pool_blocks" not in doc


def test_nested_results_in_a_dict_keep_their_keys() -> None:
    size = SizeTTFT(1.0, 0.1, [1.0], [0.1], 10.0, 0, 896, 1000)
    assert to_json(TTFTResult({"1000": size}))["sizes"]["1000"]["warm_cached_tokens"] == 896
    assert "after_restart_s" not in to_json(size)


def test_every_table_plot_and_claim_reads_its_scenario_s_typed_result(tmp_path: Path) -> None:
    """Each section's table and plots, and each claim, drawn from the example result of its
    scenario as results.json holds it: every claim has a figure in every mode."""
    names = sorted(registry.sections())
    doc = {
        "scenarios": {
            n: {"scenario": n, "modes": {m: to_json(EXAMPLES[n]) for m in ("vllm", "kvkeep")}}
            for n in names
        }
    }
    paths = report.write_report(doc, tmp_path)
    md = (tmp_path / "report.md").read_text()
    for name, section in registry.sections().items():
        if section.table is not None:
            run = typed(doc["scenarios"][name], section.result)
            assert section.table(run) in md, name
    for claim in registry.claims():
        start = f"| {claim.label.split('{')[0]}"
        row = next(line for line in md.splitlines() if line.startswith(start))
        assert "-" not in [cell.strip() for cell in row.strip("|").split("|")[2:]], row
    assert "| S2 TTFT, 4,096-token prompt again | 1.35 s -> ~120 ms | 0.300 s | 0.300 s |" in md
    assert sum(p.suffix == ".png" for p in paths) == 8


def test_the_ttft_table_holds_each_restart_against_vllm_alone_s() -> None:
    """With ``--restart``: what each mode found cached after vLLM restarted, and how much
    faster it answered than vLLM alone after its own restart; without it, no such column."""
    from kvkeep.bench.scenarios.ttft import AfterRestart, ttft_table

    def size(after_s: float, cached: int) -> SizeTTFT:
        after = AfterRestart(after_s, cached, cached / 4096, 20.0)
        return SizeTTFT(1.0, 0.1, [1.0], [0.1], 10.0, 0, 3840, 4096, after)

    modes = {"vllm": size(1.0, 0), "kvkeep": size(0.125, 3840)}
    doc = {
        "scenario": "ttft",
        "modes": {m: to_json(TTFTResult({"4096": s})) for m, s in modes.items()},
    }
    table = ttft_table(typed(doc, TTFTResult))
    assert "| 4,096 | vllm | 1.000 s | 0.100 s | 10.0x | 1.000 s | 0 | - |" in table
    assert "| 4,096 | kvkeep | 1.000 s | 0.100 s | 10.0x | 0.125 s | 3,840 | 8.0x |" in table
    plain = to_json(TTFTResult({"4096": SizeTTFT(1.0, 0.1, [1.0], [0.1], 10.0, 0, 3840, 4096)}))
    assert "after vLLM restart" not in ttft_table(typed({"modes": {"vllm": plain}}, TTFTResult))
