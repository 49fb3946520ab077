"""What `kvkeep bench replay` sends: Claude Code trace blocks as token ids, checked against the
trace itself and against the planner's reading of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvkeep.plan.claude_code import read_claude_code
from kvkeep.plan.replay import (
    ReplaySpec,
    load_replay,
    planned_order,
    replay_trace,
    scaled_tokens,
)
from kvkeep.plan.trace import BlockTrace

from .test_claude_code import traces  # noqa: F401  (fixture)

FOUR = ("trace_0011.json.gz", "trace_0021.json.gz", "trace_0282.json.gz", "trace_0086.json.gz")


def write_trace(path: Path, *requests: tuple[list[int], int]) -> Path:
    """A trace file of requests (hash_ids, extra tokens past the last full block)."""
    rows = [{"t": float(i), "type": "n", "in": 64 * len(ids) + extra, "out": 40,
             "hash_ids": ids} for i, (ids, extra) in enumerate(requests)]  # fmt: skip
    path.write_text(json.dumps({"block_size": 64, "requests": rows}))
    return path


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def test_equal_block_ids_are_equal_tokens_within_a_file_only(tmp_path: Path) -> None:
    one = write_trace(tmp_path / "a.json", ([1, 2, 3], 10), ([1, 2, 3, 4], 0), ([1, 5], 63))
    two = write_trace(tmp_path / "b.json", ([1, 2, 3], 10))
    replay = load_replay(ReplaySpec((one, two), sessions=2, block_tokens=8))
    first, second, third = (replay.prompt_ids(0, i) for i in range(3))
    assert [len(p) for p in (first, second, third)] == [8 * 3 + 2, 8 * 4, 8 * 2 + 7]
    assert second[:24] == first[:24] and common_prefix(first, second) < 26
    assert third[:8] == first[:8] and third[8:16] != first[8:16]
    other = replay.prompt_ids(1, 0)  # the same ids in another file: another block
    assert common_prefix(other, first) < 8


def test_prompts_are_deterministic_in_the_seed(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "a.json", ([1, 2], 5), ([1, 2, 3], 5))
    a = load_replay(ReplaySpec((path,), sessions=1))
    b = load_replay(ReplaySpec((path,), sessions=1))
    c = load_replay(ReplaySpec((path,), sessions=1, seed=1))
    assert a.prompt_ids(0, 1) == b.prompt_ids(0, 1) != c.prompt_ids(0, 1)
    assert a.prompt_ids(0, 0)[:16] == a.prompt_ids(0, 1)[:16]
    assert a.prompt_ids(0, 0)[16:] != a.prompt_ids(0, 1)[16:19]  # each request's own tail


@pytest.mark.parametrize("b", [2, 4, 8, 16, 32, 64])
def test_scaled_lengths_keep_full_blocks_and_the_hit_cap(b: int) -> None:
    """n = 64q + r -> b q + c: the same full engine blocks and the same blocks that may hit
    as the trace read with (128 / b) x 64-token blocks."""
    big = 64 * 128 // b
    for n in range(1, 3 * big + 130):
        m = scaled_tokens(n, b)
        assert m // 128 == n // big and (m - 1) // 128 == (n - 1) // big, n


def test_bad_block_tokens_are_named() -> None:
    for b in (1, 3, 12, 128):
        with pytest.raises(ValueError, match="--block-tokens"):
            ReplaySpec((), block_tokens=b).validate()


@pytest.mark.parametrize("b", [4, 8])
def test_the_replay_hits_and_misses_as_the_trace_does(traces: Path, tmp_path: Path, b: int) -> None:  # noqa: F811
    """Real sessions: the replay's engine blocks are the planner's blocks of the trace read with
    64 * 128 / b-token blocks under vLLM's rules, request by request."""
    files = tuple(traces / f for f in FOUR)
    for f in files:
        (tmp_path / f.name).write_bytes(f.read_bytes())
    replay = load_replay(ReplaySpec((tmp_path,), sessions=7, block_tokens=b))
    assert len(replay.sessions) == 7  # 4 files, 3 sub-agents
    scaled = replay_trace(replay)
    planned = read_claude_code(tmp_path, 64 * 128 // b, vllm_blocks=True)
    assert canonical(scaled) == canonical(planned)


def canonical(trace: BlockTrace) -> list[tuple[list[int], int]]:
    """(blocks, hit cap) of every request, blocks renamed in order of first appearance."""
    names: dict[int, int] = {}
    return [([names.setdefault(b, len(names)) for b in r.blocks], r.hit_cap)
            for r in trace.requests]  # fmt: skip


def test_the_tokens_share_exactly_the_blocks_the_planner_says(traces: Path) -> None:  # noqa: F811
    """The prompts vLLM will see: two requests share k full 128-token blocks of token ids
    iff their planner blocks share a prefix of k (same engine blocks, same names)."""
    replay = load_replay(ReplaySpec((traces / "trace_0282.json.gz",), sessions=4))
    order = planned_order(replay)[:40]
    trace = replay_trace(replay, order)
    prompts = [replay.prompt_ids(s, i) for s, i in order]
    for x in range(0, len(order), 3):
        for y in range(x + 1, len(order), 5):
            shared = common_prefix(prompts[x], prompts[y]) // 128
            full = min(len(prompts[x]), len(prompts[y])) // 128
            named = common_prefix(list(trace.requests[x].blocks), list(trace.requests[y].blocks))
            assert min(shared, full) == named, (order[x], order[y])


def test_sessions_are_the_earliest_and_the_order_is_checked(traces: Path) -> None:  # noqa: F811
    spec = ReplaySpec((traces,), sessions=3, window_s=600, seed=4, max_requests=5)
    replay = load_replay(spec)
    assert [len(c) for c in replay.calls] == [5, 5, 5] or max(map(len, replay.calls)) <= 5
    starts = [s.start_s for s in replay.sessions]
    assert starts == sorted(starts)
    assert ReplaySpec.from_record(json.loads(json.dumps(spec.record()))).sessions == 3
    with pytest.raises(ValueError, match="twice"):
        replay_trace(replay, [(0, 0), (0, 0)])
    with pytest.raises(ValueError, match="does not have"):
        replay_trace(replay, [(0, 9)])
    with pytest.raises(ValueError, match="only"):
        load_replay(ReplaySpec((traces / FOUR[0],), sessions=2))
