"""KV bytes per token of a model, from its `config.json` or a preset of published values.

Per token and attention layer a model stores K and V: ``2 * kv_heads * head_dim`` values of
the KV dtype (MLA models one latent of ``kv_lora_rank + qk_rope_head_dim``). A sliding-window
layer's blocks are kept only as far back as the window reaches, at most ``window + block``
tokens, so over a prefix of ``L`` tokens it costs ``min(L, window + block) / L`` of a full
layer, and :meth:`KVFootprint.split` takes both the context length and the block size. Which
layers slide is read the way each family writes it (``layer_types``,
``sliding_window_pattern``, ``use_sliding_window`` + ``max_window_layers``, ``sliding_window``
alone; Gemma 2 alternates). A gated DeltaNet hybrid (Qwen3-Next, Qwen3.5) counts its
full-attention layers per token and its recurrent state per snapshot (`kvkeep.plan.state`);
other Mamba or linear-attention hybrids are refused, naming them
(`kvkeep.launch.model_support`). Which family writes which: docs/notes/kv-footprint.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvkeep.launch.model_support import state_layers
from kvkeep.plan.state import GDNState, gdn_state
from kvkeep.units import format_size

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
}


@dataclass(frozen=True)
class KVFootprint:
    """The KV cache shape of a model. ``values_per_layer`` counts K and V (or the MLA latent)."""

    name: str
    layers: int
    values_per_layer: int
    dtype_bytes: int
    window_layers: int
    window_tokens: int
    source: str
    # An MLA latent (DeepSeek-V2/V3, Kimi K2): the same on every tensor-parallel rank, so
    # kvkeep stores one copy of it however many ranks serve the model.
    latent: bool = False
    # A gated DeltaNet hybrid: ``layers`` counts its full-attention layers only, and each
    # kept boundary costs one snapshot of its state layers.
    state: GDNState | None = None

    def __post_init__(self) -> None:
        if self.layers <= 0 or self.values_per_layer <= 0 or self.dtype_bytes <= 0:
            raise ValueError(f"{self.name}: layers, KV heads and head_dim must be positive")
        if not 0 <= self.window_layers <= self.layers:
            raise ValueError(f"{self.name}: {self.window_layers} sliding layers of {self.layers}")

    @property
    def layer_bytes_per_token(self) -> int:
        return self.values_per_layer * self.dtype_bytes

    @property
    def full_layers(self) -> int:
        return self.layers - self.window_layers

    def split(self, context_tokens: float | None = None, block_tokens: int = 0) -> TokenBytes:
        """Average stored KV bytes per token over a prefix of ``context_tokens`` (None:
        unbounded, where sliding layers add nothing), split by layer kind. A sliding layer
        keeps ``min(context, window + block_tokens)`` tokens of the prefix. Pure."""
        full = float(self.full_layers * self.layer_bytes_per_token)
        if not self.window_layers or context_tokens is None or context_tokens <= 0:
            return TokenBytes(full, 0.0)
        share = min(1.0, (self.window_tokens + block_tokens) / context_tokens)
        return TokenBytes(full, self.window_layers * self.layer_bytes_per_token * share)

    def bytes_per_token(self, context_tokens: float | None = None, block_tokens: int = 0) -> float:
        """``split(context_tokens, block_tokens)``, full and sliding layers together."""
        return self.split(context_tokens, block_tokens).total

    def describe(self) -> str:
        """One line with the numbers and their source."""
        what = "MLA latent values (one copy for all TP ranks)" if self.latent else "KV values"
        text = (
            f"{self.name}: {self.layers} layers x {self.values_per_layer} {what} x "
            f"{self.dtype_bytes} B = {self.layers * self.layer_bytes_per_token:,} B/token"
        )
        if self.window_layers:
            text += (
                f" ({self.window_layers} sliding layers keep {self.window_tokens} tokens: "
                f"{self.full_layers * self.layer_bytes_per_token} B/token beyond the window)"
            )
        if self.state is not None:
            text += (
                f", plus {format_size(self.state.snapshot_bytes())} of "
                f"recurrent state ({self.state.gdn_layers} gated DeltaNet layers) per kept "
                "block boundary"
            )
        return f"{text}; source: {self.source}"


class TokenBytes(NamedTuple):
    """Stored KV bytes per token of a prefix: full-attention and sliding-window layers, and a
    hybrid's state snapshots spread over the tokens stored."""

    full: float
    sliding: float
    state: float = 0.0

    @property
    def total(self) -> float:
        return self.full + self.sliding + self.state


def _hf(repo: str, **config: Any) -> tuple[dict[str, Any], str]:
    return config, f"https://huggingface.co/{repo}/blob/main/config.json"


# Values copied from each model's published config.json (only the fields that size the KV).
PRESETS: dict[str, tuple[dict[str, Any], str]] = {
    # Qwen3-Next-80B-A3B: 48 layers, every 4th full attention (12), the others gated DeltaNet
    # (36). kvkeep does not serve it yet; `kvkeep plan` gives its sizes (`plan.state`).
    "qwen3-next-80b-a3b": _hf(
        "Qwen/Qwen3-Next-80B-A3B-Instruct",
        model_type="qwen3_next",
        num_hidden_layers=48,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12,
        hidden_size=2048,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        torch_dtype="bfloat16",
    ),
    "llama-3.1-8b": _hf(
        "meta-llama/Llama-3.1-8B-Instruct",
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        torch_dtype="bfloat16",
    ),
    "llama-3.1-70b": _hf(
        "meta-llama/Llama-3.1-70B-Instruct",
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        hidden_size=8192,
        torch_dtype="bfloat16",
    ),
    "qwen2.5-coder-7b": _hf(
        "Qwen/Qwen2.5-Coder-7B-Instruct",
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        hidden_size=3584,
        sliding_window=131072,
        use_sliding_window=False,
        torch_dtype="bfloat16",
    ),
    "qwen2.5-coder-32b": _hf(
        "Qwen/Qwen2.5-Coder-32B-Instruct",
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        hidden_size=5120,
        sliding_window=131072,
        use_sliding_window=False,
        torch_dtype="bfloat16",
    ),
    "qwen3-32b": _hf(
        "Qwen/Qwen3-32B",
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        hidden_size=5120,
        use_sliding_window=False,
        torch_dtype="bfloat16",
    ),
    "qwen3-coder-30b-a3b": _hf(
        "Qwen/Qwen3-Coder-30B-A3B-Instruct",
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        hidden_size=2048,
        use_sliding_window=False,
        torch_dtype="bfloat16",
    ),
    "mistral-small-24b": _hf(
        "mistralai/Mistral-Small-24B-Instruct-2501",
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        hidden_size=5120,
        sliding_window=None,
        torch_dtype="bfloat16",
    ),
    "gemma-3-27b": _hf(
        "google/gemma-3-27b-it",
        num_hidden_layers=62,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        hidden_size=5376,
        sliding_window=1024,
        sliding_window_pattern=6,
        torch_dtype="bfloat16",
    ),
    "gpt-oss-20b": _hf(
        "openai/gpt-oss-20b",
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        hidden_size=2880,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        torch_dtype="bfloat16",
    ),
    "gpt-oss-120b": _hf(
        "openai/gpt-oss-120b",
        num_hidden_layers=36,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        hidden_size=2880,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 18,
        torch_dtype="bfloat16",
    ),
    "deepseek-v3": _hf(
        "deepseek-ai/DeepSeek-V3",
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        hidden_size=7168,
        torch_dtype="bfloat16",
    ),
    "kvkeep-tiny": (
        {
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "hidden_size": 256,
            "torch_dtype": "bfloat16",
        },
        "kvkeep.tinymodel.generate.TinyModelSpec defaults (`kvkeep model tiny DIR`)",
    ),
}


def resolve_model(model: str, kv_dtype: str | None = None) -> KVFootprint:
    """A preset name (case-insensitive) or a path to a config.json or a model directory.

    Raises ValueError listing the presets when ``model`` is neither.
    """
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return footprint_from_file(path, kv_dtype)
    preset = PRESETS.get(model.lower())
    if preset is None:
        known = ", ".join(PRESETS)
        raise ValueError(
            f"unknown model {model!r}: give a config.json, a model directory or a preset ({known})"
        )
    config, source = preset
    return footprint_from_config(config, model.lower(), source, kv_dtype)


def footprint_from_file(path: Path, kv_dtype: str | None = None) -> KVFootprint:
    """Read a HF config.json. Raises ValueError naming the file on bad JSON or missing keys."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the model config: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a config.json is a JSON object")
    return footprint_from_config(config, str(path.parent.name or path), str(path), kv_dtype)


def footprint_from_config(
    config: dict[str, Any], name: str, source: str, kv_dtype: str | None = None
) -> KVFootprint:
    """The footprint of a HF config dict (multimodal configs: their ``text_config``)."""
    found = state_layers(config)
    cfg = config.get("text_config") or config
    dtype_bytes = _dtype_bytes(kv_dtype or _dtype(cfg) or _dtype(config))
    state = gdn_state(config, dtype_bytes) if found is not None else None
    if found is not None and state is None:
        raise ValueError(
            f"{name} is a {found.model_type!r} hybrid with recurrent-state layers "
            f"({found.evidence}); kvkeep plan sizes the state of gated DeltaNet hybrids "
            "(Qwen3-Next, Qwen3.5: 'linear_attention' layers and their linear_* sizes) and "
            "cannot size this one's from its config (kvkeep serve still runs it, in vLLM's "
            "'align' mamba cache mode)"
        )
    if state is not None:
        return KVFootprint(
            name=name,
            layers=state.attention_layers,
            values_per_layer=_values_per_layer(cfg, source),
            dtype_bytes=dtype_bytes,
            window_layers=0,
            window_tokens=0,
            source=source,
            state=state,
        )
    layers = _int(cfg, "num_hidden_layers", source)
    window, sliding = _sliding(cfg, layers, str(config.get("model_type") or ""))
    return KVFootprint(
        name=name,
        layers=layers,
        values_per_layer=_values_per_layer(cfg, source),
        dtype_bytes=dtype_bytes,
        window_layers=sliding,
        window_tokens=window,
        source=source,
        latent=bool(cfg.get("kv_lora_rank")),
    )


def _values_per_layer(cfg: dict[str, Any], source: str) -> int:
    """K and V values per token per layer: 2 * kv_heads * head_dim, or the MLA latent."""
    if cfg.get("kv_lora_rank"):
        return int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
    heads = _int(cfg, "num_attention_heads", source)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = cfg.get("head_dim") or _int(cfg, "hidden_size", source) // heads
    return 2 * kv_heads * int(head_dim)


def _dtype(cfg: dict[str, Any]) -> object:
    """The weights' dtype: ``torch_dtype``, or ``dtype`` as transformers 5 writes it."""
    return cfg.get("torch_dtype") or cfg.get("dtype")


def _sliding(cfg: dict[str, Any], layers: int, model_type: str = "") -> tuple[int, int]:
    """(window tokens, number of sliding-window layers); (0, 0) when no layer slides."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return 0, 0
    if isinstance(cfg.get("layer_types"), list):
        return int(window), sum(t == "sliding_attention" for t in cfg["layer_types"])
    if cfg.get("sliding_window_pattern"):
        return int(window), layers - layers // int(cfg["sliding_window_pattern"])
    if (cfg.get("model_type") or model_type) == "gemma2":
        return int(window), (layers + 1) // 2  # layers 0, 2, 4, ... slide
    if cfg.get("use_sliding_window") and cfg.get("max_window_layers") is not None:
        return int(window), max(0, layers - int(cfg["max_window_layers"]))
    return int(window), layers


def _dtype_bytes(dtype: object) -> int:
    if dtype is None or dtype == "auto":
        return 2  # HF configs without torch_dtype are served in 16-bit by default
    size = DTYPE_BYTES.get(str(dtype).lower().removeprefix("torch."))
    if size is None:
        raise ValueError(f"unknown KV dtype {dtype!r}: use --kv-dtype {'/'.join(DTYPE_BYTES)}")
    return size


def _int(cfg: dict[str, Any], key: str, source: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{source}: needs a positive integer {key!r}, got {value!r}")
    return value
