"""Generated workloads: agent sessions share exactly their prefix blocks; tile order cycles."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvkeep.plan.stackdist import stack_distances
from kvkeep.plan.workloads import TileSpec, session_trace, template_encoder, tile_trace
from kvkeep.traffic.workload import HFTokenizer, SessionSpec, generate_sessions

SPEC = SessionSpec(turns=6, scale=0.03, max_output_tokens=8)


def assert_turns_extend(trace_requests: list, agent: int) -> None:
    turns = [r for r in trace_requests if r.stream == agent]
    for prev, cur in itertools.pairwise(turns):
        assert cur.blocks[: len(prev.blocks)] == prev.blocks
        assert cur.hit_cap == (cur.tokens - 1) // 128


def test_session_turns_extend_the_previous_prompt(tiny_model: Path) -> None:
    trace = session_trace(SPEC, agents=2, block_tokens=128, model_dir=tiny_model)
    assert len(trace.requests) == 12
    assert [r.stream for r in trace.requests[:4]] == [0, 1, 0, 1]  # round-robin
    for agent in (0, 1):
        assert_turns_extend(list(trace.requests), agent)
    # both agents share the system prompt and tool list: their first blocks are equal
    assert trace.requests[0].blocks[0] == trace.requests[1].blocks[0]


def test_session_without_a_tokenizer_is_still_prefix_exact() -> None:
    trace = session_trace(SPEC, agents=1, block_tokens=128)
    assert_turns_extend(list(trace.requests), 0)
    sd = stack_distances(trace)
    # every turn but the first re-reads the previous one: all of it hits when cached
    assert sd.ceiling() > 0.5


def test_tile_order_gets_nothing_below_all_other_documents() -> None:
    spec = TileSpec(documents=4, doc_tokens=1024, rounds=3)
    trace = tile_trace(spec, 128)
    sd = stack_distances(trace)
    k = 1024 // 128
    assert sd.hit_rate(3 * k) == 0.0
    assert sd.hit_rate(4 * k) == sd.ceiling() == 2 / 3
    assert trace.requests[0].hit_cap == k  # the question leaves tokens to compute


def test_template_renders_as_vllm_does(tiny_model: Path) -> None:
    """Tool JSON in the caller's key order and no newline before a tool call: what
    transformers' apply_chat_template (vLLM's renderer) produces. jinja2's own tojson sorted
    the keys and, untrimmed, every tool call gained a newline: prompts grew by 3 + 1 per turn
    tokens over the prompt sizes vLLM reported in `bench all --quick`."""
    turns = generate_sessions(SPEC, HFTokenizer(tiny_model), 1)[0][:3]
    encode = template_encoder(tiny_model)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    text = tok.decode(encode(turns[2].messages, turns[2].tools), skip_special_tokens=False)
    assert '[{"type": "function", "function": {"name": "read_file"' in text
    assert "\n<tool_call>" not in text and "<tool_call>" in text
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_model))
    for t in turns:
        text = hf.apply_chat_template(
            t.messages, tools=t.tools, add_generation_prompt=True, tokenize=False
        )
        assert encode(t.messages, t.tools) == hf(text, add_special_tokens=False).input_ids
