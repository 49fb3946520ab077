"""Pool blocks per request under vLLM's hybrid KV cache manager (its grouping rule, by hand)."""

from __future__ import annotations

import pytest

from kvkeep.plan.footprint import footprint_from_config, resolve_model
from kvkeep.plan.pool import PoolGroups, pool_groups, request_blocks
from kvkeep.tinymodel.generate import TinyModelSpec, llama_config

GEMMA3_TINY = {"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 64, "sliding_window": 512,
               "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}  # fmt: skip


def test_a_plain_model_holds_one_block_per_block_of_tokens() -> None:
    fp = footprint_from_config(llama_config(TinyModelSpec()), "tiny", "test")
    assert pool_groups(fp) == PoolGroups(1, 0, 4)
    assert request_blocks(fp, 4096, 128) == 32
    assert request_blocks(fp, 4097, 128) == 33


def test_gemma3_style_makes_six_groups_of_one_layer() -> None:
    """vLLM logs "kv cache group sizes (128, 128, 128, 128, 128, 128)" for this model."""
    fp = footprint_from_config(GEMMA3_TINY, "gemma3-tiny", "test")
    assert pool_groups(fp) == PoolGroups(full=1, sliding=5, group_size=1)
    # 4096 tokens: 32 blocks of the full group, 5 sliding groups of ceil(511/128)+1 = 5 blocks
    assert request_blocks(fp, 4096, 128) == 32 + 5 * 5
    assert request_blocks(fp, 256, 128) == 2 + 5 * 2  # within the window: every block


@pytest.mark.parametrize(
    ("preset", "groups"),
    [
        ("gpt-oss-20b", PoolGroups(1, 1, 12)),  # 12 sliding, 12 full
        ("gemma-3-27b", PoolGroups(1, 6, 10)),  # 52 sliding padded to 6 groups of 10
        ("llama-3.1-8b", PoolGroups(1, 0, 32)),
    ],
)
def test_published_models_group_as_vllm_does(preset: str, groups: PoolGroups) -> None:
    assert pool_groups(resolve_model(preset)) == groups


def test_every_layer_sliding_is_one_sliding_group() -> None:
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "hidden_size": 4096, "sliding_window": 4096}  # Mistral 7B v0.1  # fmt: skip
    fp = footprint_from_config(cfg, "m", "test")
    assert pool_groups(fp) == PoolGroups(0, 1, 32)
    assert request_blocks(fp, 16384, 16) == 256 + 1


def test_bad_sizes_are_refused() -> None:
    fp = footprint_from_config(GEMMA3_TINY, "g", "test")
    with pytest.raises(ValueError, match="positive"):
        request_blocks(fp, 0, 128)
