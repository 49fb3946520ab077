"""The architectures ``kvkeep model tiny`` can write: HF config and checkpoint tensor names.

``llama`` is the default, one group of full-attention layers. ``gemma3`` is a hybrid for vLLM's
hybrid KV cache manager: Gemma 3's interleave of sliding-window layers and full-attention
layers (``layer_types``, which transformers' ``Gemma3TextConfig`` and vLLM's Gemma3 model
read; by default 5 sliding then 1 full, Gemma 3's own pattern). ``--sliding-pattern 2`` gives
gpt-oss's alternation (sliding, full, sliding, ...) on the same architecture.

Gemma's RMS norms scale by ``1 + weight``, so its norm weights are written as 0 where Llama's
are 1: both models then start with unit norms (``norm_value``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

ARCHES = ("llama", "gemma3")


class ArchShapes(Protocol):
    """The fields of ``TinyModelSpec`` the architectures read."""

    @property
    def layers(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    @property
    def intermediate(self) -> int: ...
    @property
    def max_positions(self) -> int: ...
    @property
    def sliding_window(self) -> int: ...
    @property
    def sliding_pattern(self) -> int: ...


@dataclass(frozen=True)
class Arch:
    """What differs between architectures: the value norm weights take (unit scale), the
    per-layer tensors besides q/k/v/o and the MLP, and the HF config's own keys."""

    name: str
    norm_value: float
    layer_norms: tuple[str, ...]
    scales_embeddings: bool = False  # the model multiplies embeddings by sqrt(hidden)


LLAMA = Arch("llama", 1.0, ("input_layernorm", "post_attention_layernorm"))
GEMMA3 = Arch(
    "gemma3",
    0.0,
    scales_embeddings=True,
    layer_norms=(
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "self_attn.q_norm",
        "self_attn.k_norm",
    ),
)


def arch(name: str) -> Arch:
    """The architecture called ``name``; ValueError naming the choices otherwise."""
    for a in (LLAMA, GEMMA3):
        if a.name == name:
            return a
    raise ValueError(f"--arch {name!r} is not one of {list(ARCHES)}")


def layer_types(spec: ArchShapes) -> list[str]:
    """Gemma 3's interleave: every ``sliding_pattern``-th layer (1-based) is full attention,
    the others slide (transformers' ``Gemma3TextConfig`` default rule, written out)."""
    return [
        "full_attention" if (i + 1) % spec.sliding_pattern == 0 else "sliding_attention"
        for i in range(spec.layers)
    ]


def shape_config(architecture: str, model_type: str, spec: ArchShapes) -> dict[str, object]:
    """The HF ``config.json`` keys every architecture writes the same way, in this order:
    which model it is, then its shapes."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_positions,
    }


def gemma3_config(spec: ArchShapes) -> dict[str, object]:
    """The HF ``config.json`` keys of a text-only Gemma 3 (``Gemma3ForCausalLM``), bf16."""
    return shape_config("Gemma3ForCausalLM", "gemma3_text", spec) | {
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        # q and k are RMS-normed per head, so q.k has std sqrt(head_dim); scaled by
        # 1/sqrt(head_dim / 6.25) the scores have std 2.5, as the Llama model's: peaked
        # attention, so a different context (or a wrong KV block) changes the reply.
        "query_pre_attn_scalar": max(1, round(spec.head_dim / 6.25)),
        "sliding_window": spec.sliding_window,
        "layer_types": layer_types(spec),
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "attention_bias": False,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }


def layer_shapes(a: Arch, spec: ArchShapes, i: int) -> dict[str, tuple[int, ...]]:
    """The tensors of decoder layer ``i``, by checkpoint name."""
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    pre = f"model.layers.{i}."
    shapes: dict[str, tuple[int, ...]] = {
        pre + "self_attn.q_proj.weight": (q, spec.hidden),
        pre + "self_attn.k_proj.weight": (kv, spec.hidden),
        pre + "self_attn.v_proj.weight": (kv, spec.hidden),
        pre + "self_attn.o_proj.weight": (spec.hidden, q),
        pre + "mlp.gate_proj.weight": (spec.intermediate, spec.hidden),
        pre + "mlp.up_proj.weight": (spec.intermediate, spec.hidden),
        pre + "mlp.down_proj.weight": (spec.hidden, spec.intermediate),
    }
    for norm in a.layer_norms:
        width = spec.head_dim if norm.startswith("self_attn.") else spec.hidden
        shapes[f"{pre}{norm}.weight"] = (width,)
    return shapes
