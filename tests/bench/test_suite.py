"""The one mode loop and the bench's shape, without vLLM: scenarios that need no engine, and
the source read with ast."""

from __future__ import annotations

import argparse
import ast
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from kvkeep.bench import cli, suite
from kvkeep.bench.context import Needs, RunContext, Setup
from kvkeep.bench.deploy.vllm import LaunchConfig
from kvkeep.bench.scenarios import hol
from kvkeep.bench.suite import (
    _key,
    _shareable,
    by_scenario,
    launch_config,
    pool_tokens,
    rotation,
    run_modes,
)

BENCH = Path(__file__).resolve().parents[2] / "src" / "kvkeep" / "bench"


@dataclass(frozen=True)
class Seen:
    mode: str


@dataclass
class Fake:
    """A scenario that starts nothing and records the contexts it was given."""

    name: str
    modes: tuple[str, ...] | None = None
    fail: bool = False
    seen: list[str] = field(default_factory=list)

    def needs(self) -> Needs:
        return Needs(engine=False, modes=self.modes)

    def run(self, ctx: RunContext) -> Seen:
        self.seen.append(ctx.mode)
        if self.fail:
            raise RuntimeError("it broke")
        return Seen(ctx.mode)


def setup(tmp_path: Path) -> Setup:
    return Setup(LaunchConfig(model=tmp_path, log_dir=tmp_path))


def test_every_scenario_runs_in_every_mode_it_means_something_in(tmp_path: Path) -> None:
    a, b = Fake("a"), Fake("b", modes=("kvkeep",))
    out = run_modes([a, b], ["none", "kvkeep"], setup(tmp_path))
    assert a.seen == ["none", "kvkeep"] and b.seen == ["kvkeep"]
    assert out == {"a": {"none": {"mode": "none"}, "kvkeep": {"mode": "kvkeep"}},
                   "b": {"none": {}, "kvkeep": {"mode": "kvkeep"}}}  # fmt: skip


def test_a_failed_scenario_is_recorded_and_the_others_still_run(tmp_path: Path) -> None:
    bad, good = Fake("bad", fail=True), Fake("good")
    out = run_modes([bad, good], ["vllm"], setup(tmp_path))
    assert out["bad"]["vllm"] == {"error": "RuntimeError: it broke"}
    assert out["good"]["vllm"] == {"mode": "vllm"}


def test_an_endpoint_is_measured_once_and_cannot_serve_an_own_engine_scenario(
    tmp_path: Path,
) -> None:
    @dataclass
    class Restarts(Fake):
        def needs(self) -> Needs:
            return Needs(engine=False, own_engine=True)

    plain, own = Fake("plain"), Restarts("own")
    s = Setup(LaunchConfig(model=tmp_path), endpoint="http://127.0.0.1:9")
    out = run_modes([plain, own], ["none", "vllm"], s)
    assert plain.seen == ["endpoint"] and own.seen == []
    assert "error" in out["own"]["endpoint"]


def test_launch_config_fits_the_longest_prompt_within_the_pool(tmp_path: Path) -> None:
    base = LaunchConfig(model=tmp_path, max_model_len=2048)
    assert launch_config(base, Needs(), 5000).max_model_len == 5120
    pooled = launch_config(base, Needs(num_blocks=16), 5000)
    assert (pooled.num_blocks, pooled.max_model_len) == (16, 15 * 128)
    assert launch_config(base, Needs(max_num_batched_tokens=512), 0).max_num_batched_tokens == 512
    assert launch_config(base, Needs(scheduling="vllm"), 0).scheduling == "vllm"
    assert launch_config(base, Needs(), 0).scheduling == "kvkeep"


def test_hol_compares_with_vllms_own_scheduling_in_a_deployment_of_its_own(
    tmp_path: Path,
) -> None:
    """Every mode runs with serve's scheduling; `bench hol` adds mode vllm at vLLM's defaults
    (filed as vllm@vllm-defaults), on a deployment that differs only in that."""
    argv = ["--model", str(tmp_path), "--modes", "vllm,kvkeep"]
    main, ref = hol.build(cli.parser("hol").parse_args(argv))
    assert (main.needs().scheduling, ref.needs().scheduling) == (None, "vllm")
    assert ref.needs().modes == ("vllm",) and ref.name == "hol@vllm-defaults"
    base = LaunchConfig(model=tmp_path)
    assert _key(main.needs(), base) != _key(ref.needs(), base)
    same = cli.parser("hol").parse_args([*argv, "--scheduling", "vllm"])
    assert [s.name for s in hol.build(same)] == ["hol"]  # every mode at vLLM's defaults already
    measured = cli.parser("hol").parse_args([*argv, "--endpoint", "http://127.0.0.1:9"])
    assert [s.name for s in hol.build(measured)] == ["hol"]  # a running server: as it is
    results = {"hol": {"vllm": {"r": 1}}, "hol@vllm-defaults": {"vllm": {"r": 2}, "kvkeep": {}}}
    assert by_scenario(results) == {"hol": {"vllm": {"r": 1}, "vllm@vllm-defaults": {"r": 2}}}


def test_a_variant_is_filed_under_its_scenario_with_tagged_modes(tmp_path: Path) -> None:
    args = cli.parser("hol").parse_args(["--endpoint", "http://x", "--model", str(tmp_path)])
    results = {"hol@512": {"vllm": {"r": 1}}, "hol@2048": {"vllm": {"r": 2}}}
    doc = cli._document("hol", results, args)
    assert doc["scenario"] == "hol"
    assert doc["modes"] == {"vllm@512": {"r": 1}, "vllm@2048": {"r": 2}}


def test_modes_narrow_to_what_the_scenarios_need() -> None:
    only_kvkeep, anywhere = Fake("k", modes=("kvkeep",)), Fake("x")
    assert cli._modes(["none", "vllm"], [only_kvkeep]) == ["kvkeep"]
    assert cli._modes(["none", "kvkeep"], [only_kvkeep]) == ["kvkeep"]
    assert cli._modes(["none", "vllm"], [only_kvkeep, anywhere]) == ["none", "vllm"]


def test_a_bad_cache_size_is_refused_before_anything_starts(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["session", "--modes", "kvkeep", "--model", str(tiny_model), "--cache-disk", "2 gigs"]
    assert cli.main(argv) == 2
    assert "kvkeep bench session: bad size '2 gigs'" in capsys.readouterr().err


def test_a_baseline_stride_below_one_is_refused_and_three_samples_the_baselines(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["agents", "--model", str(tiny_model), "--baseline-stride", "0"]
    assert cli.main(argv) == 2
    assert "--baseline-stride must be at least 1" in capsys.readouterr().err
    args = cli.parser("agents").parse_args(["--model", str(tiny_model), "--baseline-stride", "3"])
    (scenario,) = cli._scenarios("agents", args)
    assert scenario.baseline_stride == 3


def test_every_command_parses_its_defaults() -> None:
    for name in cli.COMMANDS:
        assert isinstance(cli.parser(name).parse_args([]), argparse.Namespace)


# --- the shape of the code ------------------------------------------------------------------


def _calls(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def test_only_deploy_starts_processes() -> None:
    """One vLLM handle and one cache-server handle: nothing else in bench/ starts a process
    (the mode loop's deployment builds the handles; `store` runs cache servers of its own)."""
    starters = {"Popen", "CacheServerProcess", "RedisProcess"}
    handles = {"VLLMServer", "CacheServer"}
    allowed = {"context.py": handles, "scenarios/store.py": {"CacheServer"}}
    for path in sorted(BENCH.rglob("*.py")):
        rel = path.relative_to(BENCH).as_posix()
        if rel.startswith("deploy/"):
            continue
        bad = _calls(path) & (starters | handles - allowed.get(rel, set()))
        assert not bad, f"{rel} calls {sorted(bad)}"


def test_no_module_over_500_lines() -> None:
    long = {p.name: n for p in BENCH.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_a_hybrid_models_context_fits_its_pool_as_vllm_counts_it(
    tiny_model: Path, tiny_gemma3: Path
) -> None:
    """With the hybrid KV cache manager every group takes its own blocks, a sliding group its
    window and a step's tokens: vLLM refuses to start when max_model_len asks for more. 28,160
    tokens is what vLLM 0.32 itself reports for 256 blocks of the tiny Gemma-3 at budget 256
    ("the estimated maximum model length is 28160")."""
    assert pool_tokens(tiny_model, 255, 256) == 255 * 128
    assert pool_tokens(tiny_gemma3, 255, 256) == 28160
    assert pool_tokens(tiny_gemma3, 255, 2048) < 28160  # a bigger step holds more window
    base = LaunchConfig(model=tiny_gemma3, max_model_len=32768)
    assert launch_config(base, Needs(num_blocks=256), 0).max_model_len == 28160


def test_modes_side_by_side_alternate_who_goes_first_from_one_scenario_to_the_next() -> None:
    """Each scenario with the modes that run it, in the order they take turns; the order
    reversed from one scenario to the next, so that no mode always goes first."""
    a, b, c, d = Fake("a"), Fake("b"), Fake("c", modes=("kvkeep",)), Fake("d")
    todo = {"none": [a, b, d], "vllm": [a, b, d], "kvkeep": [a, b, c, d]}
    order = [(s.name, modes) for s, modes in rotation([a, b, c, d], todo)]
    assert order == [("a", ["none", "vllm", "kvkeep"]), ("b", ["kvkeep", "vllm", "none"]),
                     ("c", ["kvkeep"]), ("d", ["kvkeep", "vllm", "none"])]  # fmt: skip


def test_together_is_off_for_scenarios_that_start_no_engine_or_several(tmp_path: Path) -> None:
    """Replicas already share the cores among themselves, and a scenario without an engine
    has nothing to put side by side: both run one mode at a time even when asked."""
    s = replace(setup(tmp_path), together=True)
    a = Fake("a")
    out = run_modes([a], ["none", "kvkeep"], s)
    assert a.seen == ["none", "kvkeep"] and out["a"]["kvkeep"] == {"mode": "kvkeep"}
    assert not _shareable(Needs(replicas=2), s) and not _shareable(Needs(engine=False), s)
    assert _shareable(Needs(), s)
    assert not _shareable(Needs(), replace(s, endpoint="http://127.0.0.1:9"))


def test_the_progress_bar_counts_measured_seconds_so_its_estimate_is_the_whole_run_s() -> None:
    @dataclass
    class Named:
        name: str

    long, short, unmeasured = Named("agents"), Named("ttft"), Named("new")
    scenarios = typing.cast(list[suite.Scenario], [long, short, unmeasured])
    with suite.Progress(scenarios, 2, {"agents": 100.0, "ttft": 10.0}) as bar:
        assert bar._bar.total == 100 + 10 + 55  # the unmeasured one: the mean of the others
        bar.done([long])  # agents done in one of its two modes: half its time
        assert bar._bar.n == 50
        bar.done([short, unmeasured])
        assert bar._bar.n == 50 + 5 + 27.5
    with suite.Progress(scenarios, 3, None) as bar:  # nothing measured: a scenario each
        bar.done([long, short])
        assert (bar._bar.n, bar._bar.total) == (2, 9)
