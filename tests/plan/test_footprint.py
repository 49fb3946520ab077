"""KV footprint from config.json files and presets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvkeep.model import TinyModelSpec, llama_config
from kvkeep.plan.footprint import PRESETS, footprint_from_config, resolve_model


def test_tiny_model_config_matches_its_spec(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(llama_config(TinyModelSpec())))
    fp = resolve_model(str(tmp_path))
    assert fp.bytes_per_token() == TinyModelSpec().kv_bytes_per_token == 2048
    assert resolve_model("kvkeep-tiny").bytes_per_token() == 2048


@pytest.mark.parametrize(
    ("preset", "bytes_per_token"),
    [
        ("llama-3.1-8b", 32 * 2 * 8 * 128 * 2),  # 128 KiB
        ("Llama-3.1-70B", 80 * 2 * 8 * 128 * 2),  # 320 KiB
        ("qwen2.5-coder-32b", 64 * 2 * 8 * 128 * 2),  # use_sliding_window false: no window
        ("qwen3-32b", 64 * 2 * 8 * 128 * 2),
        ("mistral-small-24b", 40 * 2 * 8 * 128 * 2),
        ("deepseek-v3", 61 * (512 + 64) * 2),  # MLA latent
    ],
)
def test_presets(preset: str, bytes_per_token: int) -> None:
    fp = resolve_model(preset)
    assert fp.bytes_per_token() == bytes_per_token
    assert "huggingface.co" in fp.source


def test_gpt_oss_counts_sliding_layers_at_their_window() -> None:
    fp = resolve_model("gpt-oss-20b")
    per_layer = 2 * 8 * 64 * 2
    assert (fp.window_layers, fp.window_tokens) == (12, 128)
    assert fp.bytes_per_token(128) == 24 * per_layer  # within the window every layer counts
    assert fp.bytes_per_token(1280) == pytest.approx(12 * per_layer + 12 * per_layer / 10)
    assert fp.bytes_per_token() == 12 * per_layer  # long contexts: the full layers only


def test_gemma3_pattern_makes_every_sixth_layer_global() -> None:
    fp = resolve_model("gemma-3-27b")
    assert (fp.full_layers, fp.window_layers, fp.window_tokens) == (10, 52, 1024)


def test_mistral_style_window_slides_every_layer() -> None:
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "hidden_size": 4096, "sliding_window": 4096}  # fmt: skip
    assert footprint_from_config(cfg, "m", "test").window_layers == 32


def test_kv_dtype_override() -> None:
    assert resolve_model("llama-3.1-8b", "fp8").bytes_per_token() == 64 * 1024


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'gpt-5'.*llama-3.1-8b.*gpt-oss-20b"):
        resolve_model("gpt-5")
    assert len(PRESETS) >= 6


def test_missing_key_names_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4}))
    with pytest.raises(ValueError, match="'num_hidden_layers'"):
        resolve_model(str(tmp_path / "config.json"))


def test_unknown_dtype_says_what_to_pass() -> None:
    with pytest.raises(ValueError, match="--kv-dtype"):
        resolve_model("llama-3.1-8b", "int3")
