"""Modes taking turns: the Turnstile on real threads, and a group of scenarios run side by
side through the mode loop (scenarios that start no engine)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvkeep.bench.context import Needs, RunContext, Setup
from kvkeep.bench.deploy.vllm import LaunchConfig
from kvkeep.bench.suite import _run_together
from kvkeep.bench.turns import Turnstile


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
    log = run_members(Turnstile(["vllm", "kvkeep"], no_wait), {"vllm": 3, "kvkeep": 3})
    assert log == ["vllm", "kvkeep"] * 3


def test_a_member_with_more_units_goes_on_alone_once_the_others_are_done() -> None:
    log = run_members(Turnstile(["a", "b", "c"], no_wait), {"a": 1, "b": 3, "c": 2})
    assert log == ["a", "b", "c", "b", "c", "b"]


def test_a_member_that_fails_leaves_the_rotation_and_the_others_go_on() -> None:
    log = run_members(Turnstile(["a", "b"], no_wait), {"a": 4, "b": 3}, fail="a")
    assert log == ["a", "b", "a", "b", "b"]


def test_the_turn_is_reentrant_and_settles_once_per_turn() -> None:
    settled: list[int] = []
    stile = Turnstile(["a"], lambda: settled.append(1))
    with stile.turn("a"), stile.turn("a"):
        pass
    with stile.turn("a"):
        pass
    assert len(settled) == 2


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
def test_a_group_runs_each_scenario_in_its_modes_at_once_unit_by_unit(tmp_path: Path) -> None:
    """Marked units alternate between the modes, who goes first alternates between the
    scenarios, and a scenario that marks nothing holds the turn for its whole run."""
    marked, whole = Units("marked", 2), Units("whole", 2, marks=False)
    log: list[tuple[str, str]] = []
    marked.log = whole.log = log
    setup = Setup(LaunchConfig(model=tmp_path, log_dir=tmp_path), together=True)
    out: dict[str, dict[str, object]] = {"marked": {}, "whole": {}}

    class Bar:
        def set_postfix_str(self, _: str) -> None: ...
        def update(self, _: int) -> None: ...

    todo = {"vllm": [marked, whole], "kvkeep": [marked, whole]}
    _run_together([marked, whole], todo, setup.base, Needs(engine=False), setup, out, Bar(), False)  # type: ignore[arg-type]
    assert log == [("marked", "vllm"), ("marked", "kvkeep")] * 2 + [
        ("whole", "kvkeep"), ("whole", "kvkeep"), ("whole", "vllm"), ("whole", "vllm")]  # fmt: skip
    assert out["marked"] == {"vllm": {"units": 2}, "kvkeep": {"units": 2}}
