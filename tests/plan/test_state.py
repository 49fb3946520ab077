"""A gated DeltaNet hybrid's sizes: attention KV per token and the state per snapshot."""

from __future__ import annotations

import pytest

from kvkeep.plan.footprint import PRESETS, resolve_model
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


def test_plan_gives_the_sizes_with_its_refusal() -> None:
    with pytest.raises(ValueError) as refused:
        resolve_model("qwen3-next-80b-a3b")
    text = str(refused.value)
    assert "cannot restore that state" in text
    assert "24,576 B of KV per token" in text and "39,518,208 B (37.7 MiB)" in text


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
