"""Real Claude Code sessions as a block trace, checked against explicit LRU simulations that
read the raw files themselves (not through the reader)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

from kvkeep.plan.claude_code import Arrival, is_claude_code, read_claude_code
from kvkeep.plan.main import main
from kvkeep.plan.stackdist import stack_distances
from kvkeep.plan.trace import TraceError

from .test_stackdist import brute_force_hits

TRACES = Path(__file__).resolve().parents[3] / "shared/data/claude-code-traces"
WITH_SUBAGENTS = "trace_0282.json.gz"  # 3 sub-agents
UNSEEN = ("trace_0021.json.gz", "trace_0174.json.gz", "trace_0638.json.gz", "trace_0086.json.gz")


@pytest.fixture(scope="module")
def traces() -> Path:
    if not TRACES.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"{TRACES} is missing: the shared data must sit beside the checkout")
        pytest.skip(f"{TRACES} is not beside this checkout")
    return TRACES


def raw(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def raw_lru_hit_rate(doc: dict[str, Any], capacity: int) -> float:
    """The top-level session's requests in file order through an LRU cache of 64-token
    blocks: a request hits the longest cached run of its ids, then caches all of them."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = refs = 0
    for r in doc["requests"]:
        if r["type"] == "subagent":
            continue
        ids = r["hash_ids"]
        refs += len(ids)
        hits += next((i for i, b in enumerate(ids) if b not in cache), len(ids))
        for b in reversed(ids):
            cache[b] = None
            cache.move_to_end(b)
            while len(cache) > capacity:
                cache.popitem(last=False)
    return hits / refs


@pytest.mark.parametrize("capacity", [50, 400, 3000])
def test_a_single_session_gives_exactly_its_lru_hit_rate(traces: Path, capacity: int) -> None:
    path = traces / "trace_0011.json.gz"
    trace = read_claude_code(path)
    assert trace.sessions == 1 and len(trace.requests) == len(raw(path)["requests"])
    assert stack_distances(trace).hit_rate(capacity) == raw_lru_hit_rate(raw(path), capacity)


def test_sub_agents_are_sessions_of_their_own_in_time_order(traces: Path) -> None:
    path = traces / WITH_SUBAGENTS
    doc = raw(path)
    calls = sum(len(r["requests"]) if r["type"] == "subagent" else 1 for r in doc["requests"])
    trace = read_claude_code(path)
    assert trace.sessions == 4 and len(trace.requests) == calls
    times = [r.time_s for r in trace.requests]
    assert times == sorted(times)
    assert len({r.stream for r in trace.requests}) == 4


def test_arrivals_are_seeded_and_interleave_sessions(traces: Path, tmp_path: Path) -> None:
    for name in UNSEEN:
        shutil.copy(traces / name, tmp_path / name)
    a = read_claude_code(tmp_path, arrival=Arrival(window_s=600, seed=1))
    b = read_claude_code(tmp_path, arrival=Arrival(window_s=600, seed=1))
    c = read_claude_code(tmp_path, arrival=Arrival(window_s=600, seed=2))
    assert a.requests == b.requests and a.requests != c.requests
    assert a.sessions == len(UNSEEN) and "4 Claude Code traces" in a.source
    poisson = read_claude_code(tmp_path, arrival=Arrival(rate_per_s=0.01, seed=1))
    assert [r.time_s for r in poisson.requests] == sorted(r.time_s for r in poisson.requests)
    together = read_claude_code(tmp_path)  # all start at 0: sessions overlap
    assert together.max_concurrent() > 1
    with pytest.raises(ValueError, match="not both"):
        Arrival(window_s=10, rate_per_s=1)


@pytest.mark.parametrize("capacity", [500, 2500])
def test_unseen_sessions_match_an_lru_simulation_in_vllms_order(
    traces: Path, tmp_path: Path, capacity: int
) -> None:
    """Four sessions the other tests do not use, interleaved, under vLLM's rules (full
    128-token blocks, one token always computed, output blocks take slots): the planner's
    hit rate equals a brute-force LRU cache that frees blocks last-first, within a point."""
    for name in UNSEEN:
        shutil.copy(traces / name, tmp_path / name)
    trace = read_claude_code(tmp_path, 128, vllm_blocks=True, arrival=Arrival(300, seed=3))
    planned = stack_distances(trace).hit_rate(capacity)
    simulated = brute_force_hits(trace, capacity) / trace.references
    assert abs(planned - simulated) <= 0.01
    assert 0 < planned < 1


def test_larger_blocks_group_ids_by_their_last(tmp_path: Path) -> None:
    doc = {
        "block_size": 64,
        "requests": [
            {"t": 0, "type": "n", "in": 64 * 5 + 3, "out": 1, "hash_ids": [1, 2, 3, 4, 5]},
            {"t": 1, "type": "n", "in": 64 * 4, "out": 1, "hash_ids": [1, 2, 3, 4]},
        ],
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    assert is_claude_code(path)
    trace = read_claude_code(path, 128)
    first, second = trace.requests
    assert len(first.blocks) == 3 and second.blocks == first.blocks[:2]  # 5 -> 2 full + 1
    vllm = read_claude_code(path, 128, vllm_blocks=True)
    assert [len(r.blocks) for r in vllm.requests] == [2, 2]
    assert [r.hit_cap for r in vllm.requests] == [2, 1]  # 256 tokens: one must be computed
    with pytest.raises(TraceError, match="multiple of 64"):
        read_claude_code(path, 100)


def test_a_bad_request_is_named(tmp_path: Path) -> None:
    doc = {"block_size": 64, "requests": [{"t": 0, "type": "n", "in": 300, "hash_ids": [1]}]}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=r"bad.json\[0\]: 1 hash_ids for 'in' = 300"):
        read_claude_code(path)


def test_cli_writes_hit_rates_and_the_answer_in_a_users_terms(
    traces: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in UNSEEN:
        shutil.copy(traces / name, tmp_path / name)
    out = tmp_path / "p.json"
    args = ["--trace", str(tmp_path), "--window", "1800", "--seed", "1", "--block-tokens", "64",
            "--capacity-blocks", "500,2000", "--model", "llama-3.1-8b",
            "--device-gib", "1", "--ram", "4GiB", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert set(doc["hit_rate_by_capacity"]) == {"500", "2000"}
    assert doc["trace"]["sessions"] == 4 and doc["trace"]["requests"] > 0
    assert any("for 4 agent sessions like these" in line for line in doc["recommendation"])
    assert "for 4 agent sessions like these" in capsys.readouterr().out
