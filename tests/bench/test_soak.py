"""The soak's parts that need no vLLM: the fault schedule, counters across restarts, RSS
growth, and the disk corruption."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvkeep.bench.scenarios import soak_faults
from kvkeep.bench.scenarios.soak_faults import (
    Event,
    Faults,
    Monotonic,
    Sample,
    SoakSpec,
    rss_growth,
    schedule,
)


def test_ten_minutes_schedule_six_kills_three_restarts() -> None:
    """Three restarts, so the ready faults that follow each strike three times."""
    events = schedule(SoakSpec(minutes=10))
    kinds = [e.kind for e in events]
    assert kinds.count("server_kill") == 6
    assert kinds.count("engine_restart") == 3
    assert kinds.count("corrupt_live") == 3
    assert [e.t_s for e in events] == sorted(e.t_s for e in events)
    assert all(e.t_s < 600 for e in events)
    restarts = [e.t_s for e in events if e.kind == "engine_restart"]
    kills = [e.t_s for e in events if e.kind == "server_kill"]
    assert all(abs(k - r) >= 10 for k in kills for r in restarts)


def test_a_kill_moved_past_a_restart_does_not_land_on_the_next_one() -> None:
    # 40 and 50 lie within 10 s of the restart at 45 and move to 50 and 60; 60 is a tick too
    events = schedule(SoakSpec(minutes=1.5, kill_every_s=10, restart_every_s=45))
    kills = [e.t_s for e in events if e.kind == "server_kill"]
    assert kills == [10, 20, 30, 50, 60, 70, 80]


def test_faults_that_fell_due_during_a_long_restart_are_skipped_not_fired_in_a_burst(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = [Event(0.1, "engine_restart"), Event(0.2, "server_kill"), Event(0.3, "server_kill"),
            Event(1.2, "server_kill")]  # fmt: skip
    monkeypatch.setattr(soak_faults, "schedule", lambda spec: plan)
    done: list[tuple[str, float]] = []

    def do(kind: str, kills: int) -> str:
        done.append((kind, time.monotonic() - t0))
        if kind == "engine_restart":
            time.sleep(0.8)  # a restart that outlasts the next two kills' times
        return ""

    t0 = time.monotonic()
    engine = SimpleNamespace(ready_s=None)  # no start measured: no restart is too late
    faults = Faults(SoakSpec(minutes=0.05, kill_every_s=0.4, down_s=0.1), None, engine,
                    SimpleNamespace(t0=t0))  # type: ignore[arg-type]  # fmt: skip
    monkeypatch.setattr(faults, "_do", do)
    faults.run(threading.Event())
    assert [kind for kind, _ in done] == ["engine_restart", "server_kill"]
    assert done[1][1] >= 1.2  # the one kill left fired at its time, not at once
    assert [e.kind for e in faults.events] == ["engine_restart", "skipped", "skipped",
                                               "server_kill"]  # fmt: skip
    assert faults.count("server_kill") == 1


def test_a_restart_that_fell_due_during_a_long_kill_fires_late_not_never(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CI once took 30 s to bring a killed server back; the restart due meanwhile was skipped,
    # and with it the ready fault the short soak exists for.
    plan = [Event(0.1, "server_kill"), Event(0.2, "server_kill"), Event(0.3, "engine_restart")]
    monkeypatch.setattr(soak_faults, "schedule", lambda spec: plan)
    done: list[tuple[str, float]] = []

    def do(kind: str, kills: int) -> str:
        done.append((kind, time.monotonic() - t0))
        if kind == "server_kill" and len(done) == 1:
            time.sleep(0.8)  # a kill whose server is slow to come back
        return ""

    t0 = time.monotonic()
    faults = Faults(SoakSpec(minutes=0.05, kill_every_s=0.4, down_s=0.1), None,
                    SimpleNamespace(ready_s=None), SimpleNamespace(t0=t0))  # type: ignore[arg-type]  # fmt: skip
    monkeypatch.setattr(faults, "_do", do)
    faults.run(threading.Event())
    assert [kind for kind, _ in done] == ["server_kill", "engine_restart"]
    assert done[1][1] >= 0.8  # late, right after the slow kill
    assert [e.kind for e in faults.events] == ["server_kill", "skipped", "engine_restart"]


def test_no_corruption_when_off() -> None:
    events = schedule(SoakSpec(minutes=10, corrupt=False))
    assert "corrupt_live" not in {e.kind for e in events}


def test_monotonic_sums_counters_across_restarts() -> None:
    m = Monotonic()
    m.see({"hits": 5})
    m.see({"hits": 9})
    m.see({"hits": 2})  # the process restarted: a new epoch
    m.see({"hits": 4})
    assert m.total("hits") == 13
    assert m.total("absent") == 0


def _sample(t: float, pid: int, gen: int, server: float, vllm: float) -> Sample:
    return Sample(t, pid, gen, server, vllm, 0, 0, 0, 0, {})


def test_rss_growth_is_measured_within_one_lifetime() -> None:
    # vLLM generation 0 is flat at 1000 MB, generation 1 at 3000 MB: a restart, not a leak
    samples = [_sample(t, 1, 0, 20, 1000) for t in range(9)]
    samples += [_sample(t, 1, 1, 20, 3000) for t in range(9, 18)]
    assert rss_growth(samples) == {"server_mb": 0.0, "vllm_mb": 0.0}
    leaking = [_sample(t, 2, 0, 20 + 10 * t, 1000) for t in range(9)]
    assert rss_growth(leaking)["server_mb"] == 30.0
    assert rss_growth(leaking[:3]) == {"server_mb": None, "vllm_mb": None}


def test_hit_windows_count_each_window_s_requests_and_kvkeep_blocks() -> None:
    from kvkeep.bench.criterion import Reply, Verdict
    from kvkeep.bench.judged import Judged
    from kvkeep.bench.scenarios.soak import Result, hit_windows

    def result(t: float, prompt: int, cached: int) -> Result:
        return Result(t, 0.1, Judged(Reply([], []), prompt, cached), Verdict(True, "", 0, 0.0))

    def sample(t: float, hits: float) -> Sample:
        return Sample(t, 1, 0, None, None, hits, 0, 0, 0, {})

    results = [result(1.0, 100, 50), result(2.0, 100, 100), result(12.0, 200, 0)]
    samples = [
        sample(5.0, 10),
        sample(9.0, 30),
        sample(10.0, 33),
        sample(15.0, 35),
        sample(35.0, 90),
    ]
    windows = hit_windows(results, samples, duration_s=30.0, windows=3)
    assert [w["requests"] for w in windows] == [2, 1, 0]
    assert [w["cached_fraction"] for w in windows] == [0.75, 0.0, 0.0]
    # the running total's growth within each window; the sample after the end counts nowhere
    assert [w["kvkeep_hit_blocks"] for w in windows] == [30, 5, 0]


def test_corruption_flips_bytes_in_non_empty_segments_and_counts_them(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "seg-1.log").write_bytes(bytes(4096))
    (disk / "seg-2.log").write_bytes(b"")
    cache = SimpleNamespace(directory=tmp_path)
    faults = Faults(SoakSpec(), cache, None, SimpleNamespace(t0=0.0))  # type: ignore[arg-type]
    assert faults._corrupt() == "8 bytes flipped in 1 segments"
    changed = sum(b != 0 for b in (disk / "seg-1.log").read_bytes())
    assert faults.flipped == 8 and 1 <= changed <= 8  # a place may be drawn twice
    assert (disk / "seg-2.log").read_bytes() == b""
    (disk / "seg-1.log").write_bytes(b"")
    assert faults._corrupt() == "no segment to corrupt" and faults.flipped == 8
