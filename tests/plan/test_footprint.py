"""KV footprint from config.json files and presets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvkeep.plan.footprint import PRESETS, footprint_from_config, resolve_model
from kvkeep.tinymodel.generate import TinyModelSpec, llama_config, model_config


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


# --- sliding windows: what kvkeep stores per token -------------------------------------------

GEMMA3_TINY = {  # the Gemma-3-style test model: 5 sliding layers of 512 tokens, then 1 full
    "model_type": "gemma3_text",
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_size": 256,
    "sliding_window": 512,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "dtype": "bfloat16",
}


def _write(tmp_path: Path, config: dict[str, object]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_sliding_layer_stores_its_window_and_one_block_per_prefix(tmp_path: Path) -> None:
    fp = resolve_model(str(_write(tmp_path, GEMMA3_TINY)))
    layer = 2 * 2 * 64 * 2  # K and V, 2 heads of 64, bf16: 512 B per token and layer
    assert (fp.full_layers, fp.window_layers, fp.layer_bytes_per_token) == (1, 5, layer)
    split = fp.split(8192, block_tokens=128)
    assert split.full == layer  # the full layer keeps every token
    assert split.sliding == 5 * layer * (512 + 128) / 8192  # window + one block, of 8192
    # the acceptance bound: the window share of the full figure plus one block per layer
    assert split.total * 8192 == layer * 8192 + 5 * layer * (512 + 128)
    assert split.total / (6 * layer) == pytest.approx(0.2318, abs=1e-4)
    assert fp.split(512, 128)[:2] == (layer, 5 * layer)  # within the window every layer counts
    assert fp.bytes_per_token(8192, 128) == split.total


def test_the_pattern_form_of_gemma3_gives_the_same_layers(tmp_path: Path) -> None:
    cfg = {k: v for k, v in GEMMA3_TINY.items() if k != "layer_types"}
    fp = resolve_model(str(_write(tmp_path, {**cfg, "sliding_window_pattern": 6})))
    assert (fp.full_layers, fp.window_layers) == (1, 5)


def test_gemma3_27b_from_its_published_config(tmp_path: Path) -> None:
    # https://huggingface.co/google/gemma-3-27b-it/blob/main/config.json: the KV fields of
    # text_config (62 layers, 16 KV heads of 128, window 1024, every 6th layer global) and the
    # top-level torch_dtype
    config = {
        "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text",
            "head_dim": 128,
            "hidden_size": 5376,
            "num_attention_heads": 32,
            "num_hidden_layers": 62,
            "num_key_value_heads": 16,
            "sliding_window": 1024,
            "sliding_window_pattern": 6,
        },
        "torch_dtype": "bfloat16",
    }
    fp = resolve_model(str(_write(tmp_path, config)))
    layer = 2 * 16 * 128 * 2  # 8 KiB per token and layer
    assert (fp.full_layers, fp.window_layers, fp.window_tokens) == (10, 52, 1024)
    split = fp.split(32768, block_tokens=16)  # vLLM's CUDA block size
    assert split.full == 10 * layer == 81920
    assert split.sliding == 52 * layer * (1024 + 16) / 32768 == 13520
    assert split.total / (62 * layer) == pytest.approx(0.1879, abs=1e-4)  # vs all 62 layers
    assert resolve_model("gemma-3-27b").split(32768, 16) == split  # the preset agrees


def test_gpt_oss_alternation_stores_window_plus_block(tmp_path: Path) -> None:
    fp = resolve_model("gpt-oss-20b")
    per_layer = 2 * 8 * 64 * 2
    assert fp.split(4096, 16)[:2] == (12 * per_layer, 12 * per_layer * (128 + 16) / 4096)


def test_gemma2_alternates_without_saying_so() -> None:
    # https://huggingface.co/google/gemma-2-9b-it/blob/main/config.json (KV fields)
    cfg = {"model_type": "gemma2", "num_hidden_layers": 42, "num_attention_heads": 16,
           "num_key_value_heads": 8, "head_dim": 256, "hidden_size": 3584,
           "sliding_window": 4096, "torch_dtype": "float32"}  # fmt: skip
    fp = footprint_from_config(cfg, "gemma-2-9b", "test")
    assert (fp.full_layers, fp.window_layers, fp.dtype_bytes) == (21, 21, 4)


def test_transformers_5_dtype_key_is_read(tmp_path: Path) -> None:
    fp = resolve_model(str(_write(tmp_path, {**GEMMA3_TINY, "dtype": "float32"})))
    assert fp.dtype_bytes == 4


def test_a_gdn_hybrid_counts_its_full_attention_layers_only(tmp_path: Path) -> None:
    # https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json (abridged)
    config = {"model_type": "qwen3_next", "num_hidden_layers": 48, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 2048,
              "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12,
              "linear_num_key_heads": 16, "linear_num_value_heads": 32,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128,
              "torch_dtype": "bfloat16"}  # fmt: skip
    fp = resolve_model(str(_write(tmp_path, config)))
    assert (fp.layers, fp.bytes_per_token()) == (12, 24_576)
    assert fp.state is not None and fp.state.gdn_layers == 36


def test_an_mla_config_gives_its_latent_once_and_says_so(tmp_path: Path) -> None:
    """DeepSeek-V3's published shape (61 layers, a 512 + 64 latent, bf16): 70,272 bytes a
    token, one copy for every tensor-parallel rank; the tiny MLA model's matches its spec."""
    v3 = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "hidden_size": 7168,
        "torch_dtype": "bfloat16",
    }
    fp = footprint_from_config(v3, "deepseek-v3", "published config")
    assert fp.bytes_per_token() == 70_272 and fp.latent
    assert "70,272 B/token" in fp.describe() and "one copy for all TP ranks" in fp.describe()
    spec = TinyModelSpec(arch="deepseek", layers=2, dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(model_config(spec)))
    assert resolve_model(str(tmp_path)).bytes_per_token() == spec.kv_bytes_per_token == 4608
