"""One registration point per scenario: its module's ``COMMAND``, listed in the registry, is
all the parser, the report and `bench all` read."""

from __future__ import annotations

from kvkeep.bench import cli, suite
from kvkeep.bench.scenarios import registry
from kvkeep.traffic.workload import CharEstimate


def test_the_commands_are_the_registry_s_and_bench_all() -> None:
    names = [c.name for c in registry.SCENARIOS]
    assert len(set(names)) == len(names)
    assert set(cli.COMMANDS) == {*names, "all"} and cli.COMMANDS["all"] is suite.COMMAND


def test_the_suite_s_sizes_are_the_scenarios_knobs() -> None:
    parts = {c.name: c.in_suite for c in registry.SCENARIOS if c.in_suite is not None}
    for size, which in ((suite.QUICK, "quick"), (suite.FULL, "full")):
        assert {n: getattr(p, which) for n, p in parts.items()} == dict(size.knobs)
    assert suite.QUICK.replay is parts["replay"].quick  # a scenario's knobs by its name
    places = [place for p in parts.values() for place in p.runs]
    assert len(set(places)) == len(places), "two parts of bench all in one place"


def test_bench_all_runs_its_parts_in_their_places() -> None:
    quick = [s.name for s in suite.suite(suite.QUICK, CharEstimate())]
    # S2 first: its cold prompts measure the machine's pace (`kvkeep.bench.pace`)
    assert quick == ["ttft", "session", "hol", "capacity", "agents", "restart", "replay",
                     "hol@vllm-defaults"]  # fmt: skip
    full = [s.name for s in suite.suite(suite.FULL, CharEstimate(), hol_reference=False)]
    assert full == ["ttft", "session", "hol", "capacity", "agents", "agents_fit", "restart",
                    "replay"]  # fmt: skip


def test_every_claim_reads_a_result_the_report_has() -> None:
    sections = registry.sections()
    assert all(claim.scenario in sections for claim in registry.claims())
    assert [c.label[:2] for c in registry.claims()] == sorted(
        c.label[:2] for c in registry.claims()
    )


def test_bench_all_s_document_records_its_size_and_the_session_s_spec() -> None:
    args = cli.parser("all").parse_args(["--quick", "--together", "no", "--modes", "vllm"])
    results = {"session": {"vllm": {"r": 1}}, "hol@vllm-defaults": {"vllm": {"r": 2}}}
    doc = cli._document("all", results, args)
    assert doc["scenarios"]["session"] == {
        "scenario": "session",
        "modes": {"vllm": {"r": 1}},
        "spec": {"turns": 30, "scale": 0.1, "max_output_tokens": 4},
    }  # fmt: skip
    assert doc["scenarios"]["hol"]["modes"] == {"vllm@vllm-defaults": {"r": 2}}
    assert doc["setup"]["size"] == "quick" and doc["setup"]["num_blocks"] == 128


def test_kvkeep_bench_s_routing_table_is_the_registry_s() -> None:
    """`kvkeep bench --help` lists each scenario without importing the bench (it would cost
    `kvkeep --help` a second), so `kvkeep.cli.BENCHES` repeats the names and help lines: this
    holds the copy to the descriptors, in their order."""
    from kvkeep import cli as top

    listed = {name: route.help for name, route in top.BENCHES.items()}
    assert listed == {name: command.help for name, command in cli.COMMANDS.items()}
    assert list(listed) == list(cli.COMMANDS)
