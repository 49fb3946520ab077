"""The machine's pace and the time boxes it sets (`kvkeep.bench.pace`), without vLLM: the
arithmetic, the wiring from `bench all --quick` into its scenarios, and the report's line."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvkeep.bench import cli, report
from kvkeep.bench.pace import REFERENCE_S, REFERENCE_TOKENS, Pace
from kvkeep.bench.scenarios import agents, hol, restart, session, ttft


def paced(seconds: float, tokens: int = REFERENCE_TOKENS) -> Pace:
    p = Pace()
    p.record(tokens, seconds)
    return p


def test_an_unmeasured_or_faster_machine_keeps_every_size() -> None:
    for pace in (Pace(), paced(REFERENCE_S / 3)):
        assert pace.factor == 1.0
        assert pace.units(15, 5) == 15
        assert pace.stride(3, 10) == 3


def test_a_slower_machine_runs_fewer_units_down_to_the_floor() -> None:
    """The AVX2-only EPYC's 8k cold prefill (2.8 s) against the AMX machine's (0.6 s)."""
    avx2 = paced(2.8)
    assert avx2.factor == pytest.approx(2.8 / REFERENCE_S)
    assert avx2.units(15, 5) == 5  # 15 / 4.7 is 3: the floor
    assert avx2.units(3, 1) == 1
    assert avx2.stride(3, 10) == 10  # 3 * 4.7 is 14: the cap
    half_as_fast = paced(2 * REFERENCE_S)
    assert half_as_fast.units(15, 5) == 8
    assert half_as_fast.units(3, 1) == 2
    assert half_as_fast.stride(3, 10) == 6


def test_the_floor_never_exceeds_the_size_and_a_prompt_of_another_size_scales() -> None:
    assert paced(100.0).units(3, 5) == 3  # a size below the floor is kept, not raised
    assert paced(REFERENCE_S, tokens=REFERENCE_TOKENS // 2).factor == pytest.approx(2.0)
    bad = Pace()
    bad.record(0, 1.0)
    bad.record(8192, 0.0)
    assert bad.measured_s is None  # nothing to read a pace from


def test_the_modes_record_at_once_and_the_median_decides() -> None:
    pace = Pace()
    threads = [
        threading.Thread(target=pace.record, args=(REFERENCE_TOKENS, s)) for s in (1.0, 9.0, 1.2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pace.measured_s == pytest.approx(1.2)  # one slow mode does not set the pace


def test_the_demo_shares_one_pace_and_only_the_demo(tiny_model: Path) -> None:
    """`bench all --quick` gives S2 a pace to record and S6, S5 and S4 the same one to read;
    `--no-time-box` and the full size give none."""
    args = cli.parser("all").parse_args(["--quick", "--model", str(tiny_model)])
    scenarios = {s.name: s for s in cli._scenarios("all", args)}
    pace = scenarios["ttft"].pace
    assert isinstance(pace, Pace) and pace is args.pace
    for name in ("session", "hol", "hol@vllm-defaults", "agents", "restart"):
        assert vars(scenarios[name])["pace"] is pace, name
    assert next(iter(scenarios)) == "ttft"  # it measures before any of them reads
    assert scenarios["session"].stride() == 1  # unmeasured: every size as it is
    pace.record(REFERENCE_TOKENS, 2.8)
    assert scenarios["session"].stride() == session.STRIDE_MOST
    assert scenarios["hol"].tries() == hol.LEAST_REPEATS
    assert scenarios["hol@vllm-defaults"].tries() == 3
    assert scenarios["agents"].stride() == agents.STRIDE_MOST
    assert scenarios["restart"].restarts() == 1
    for argv in (["--quick", "--no-time-box"], []):
        args = cli.parser("all").parse_args([*argv, "--model", str(tiny_model)])
        for s in cli._scenarios("all", args):
            assert getattr(s, "pace", None) is None, (argv, s.name)
        assert args.pace is None


def test_a_scenario_without_a_pace_keeps_its_units() -> None:
    assert hol.HOLScenario().tries() == hol.REPEATS
    assert restart.RestartScenario(restart.RestartSpec(restarts=3)).restarts() == 3
    assert ttft.TTFTScenario().pace is None


def test_the_report_says_what_the_time_boxes_made_of_the_machine() -> None:
    doc = {
        "pace": paced(2.8).summary(),
        "scenarios": {
            "hol": {"modes": {"none": {"tries": 5}}},
            "agents": {"modes": {"none": {"stride": 10}}},
            "restart": {"modes": {"vllm": {"restart_ready_samples_s": [33.0]}}},
        },
    }
    text = report.pace_markdown(doc)
    assert "took 2.80 s here" in text and "4.7x" in text
    assert "S6 5 tries in every mode (15 at the reference)" in text
    assert "S5's baselines one turn in 10 (3 at the reference)" in text
    assert "S4 1 vLLM restart(s) per mode (3 at the reference)" in text
    fast = report.pace_markdown({"pace": paced(0.3).summary(), "scenarios": {}})
    assert fast.endswith("so every baseline ran at its size.")
    assert "measured no cold prefill" in report.pace_markdown({"pace": Pace().summary()})
