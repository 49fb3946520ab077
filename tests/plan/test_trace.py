"""Trace readers: Mooncake JSONL and runner output, and errors that name the bad line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvkeep.plan.trace import (
    TraceError,
    make_request,
    measured_hit_rate,
    read_mooncake,
    read_trace,
)

GOOD = '{"timestamp": 1500, "input_length": 1000, "output_length": 7, "hash_ids": [0, 1]}'


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reads_mooncake_fields(tmp_path: Path) -> None:
    trace = read_mooncake(write(tmp_path, GOOD, "", GOOD))
    assert len(trace.requests) == 2
    r = trace.requests[0]
    assert (r.blocks, r.tokens, r.hit_cap, r.time_s, r.output_tokens) == ((0, 1), 1000, 2, 1.5, 7)


def test_vllm_rules_on_mooncake(tmp_path: Path) -> None:
    r = read_mooncake(write(tmp_path, GOOD), vllm_blocks=True).requests[0]
    assert (r.blocks, r.hit_cap) == ((0,), 1)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"input_length": 10}', "'hash_ids' must be a list"),
        ('{"hash_ids": [0, -1]}', "'hash_ids' must be a list"),
        ('{"hash_ids": [0], "input_length": "x"}', "'input_length' must be"),
        ('{"hash_ids": [0], "input_length": 5000}', "does not fit 1 blocks of 512"),
        ('{"hash_ids": [0], "input_length": 10, "timestamp": -3}', "'timestamp' must be"),
    ],
)
def test_malformed_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = write(tmp_path, GOOD, line)
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: .*{message}"):
        read_mooncake(path)


def test_empty_trace_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no requests"):
        read_mooncake(write(tmp_path, ""))


def runner_doc(tmp_path: Path) -> Path:
    turns = [
        {"turn": 0, "prompt_tokens": 300, "cached_tokens": 0, "output_tokens": 4},
        {"turn": 1, "prompt_tokens": 520, "cached_tokens": 256, "output_tokens": 4},
    ]
    doc = {"scenario": "session", "modes": {"prefix": {"turns": turns}}}
    path = tmp_path / "session.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


def test_runner_output_is_one_growing_chain(tmp_path: Path) -> None:
    trace = read_trace(runner_doc(tmp_path), 128, vllm_blocks=False, mode=None)
    assert trace.rules == "vllm"
    assert [r.blocks for r in trace.requests] == [(0, 1), (0, 1, 2, 3)]
    assert [r.hit_cap for r in trace.requests] == [2, 4]
    assert measured_hit_rate(runner_doc(tmp_path)) == pytest.approx(256 / 820)


def test_runner_output_unknown_mode(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no mode 'kvkeep'; it has prefix"):
        read_trace(runner_doc(tmp_path), 128, vllm_blocks=False, mode="kvkeep")


@pytest.mark.parametrize(
    ("tokens", "output", "tail"),
    [(300, 16, 0), (250, 16, 1), (256, 1, 0), (256, 129, 1), (100, 300, 3)],
)
def test_vllm_rules_count_the_blocks_the_output_fills(tokens: int, output: int, tail: int) -> None:
    """(tokens + output - 1) // B - tokens // B: the last sampled token never enters the KV."""
    r = make_request(range(3), tokens, 128, True, output_tokens=output)
    assert r.tail_blocks == tail
    assert make_request(range(3), tokens, 128, False, output_tokens=output).tail_blocks == 0
