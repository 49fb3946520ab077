"""The connector refuses KV cache groups that hold a recurrent state (Mamba, linear attention).

Specs and group configs are vLLM's real classes, their state shapes from vLLM's own
``MambaStateShapeCalculator`` for a tiny Bamba-like and a tiny Qwen3-Next-like model; the
model config is a real transformers config. Only VllmConfig is a stand-in (a real one needs
a loadable model), as in test_compat.
"""

from __future__ import annotations

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

from kvkeep.vllm.compat import UnsupportedConfig, check_supported
from kvkeep.vllm.connector import KVKeepConnector

BS = 16


def full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def sliding() -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=512
    )


def mamba2() -> MambaSpec:
    """A Bamba / Granite-4.0-H layer: hidden 256, 8 heads of 64, state 16, conv 4."""
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1, intermediate_size=512, n_groups=1, num_heads=8, head_dim=64,
        state_size=16, conv_kernel=4,
    )  # fmt: skip
    return MambaSpec(block_size=BS, shapes=shapes, dtypes=(torch.bfloat16, torch.float32))


def gated_delta_net() -> MambaSpec:
    """A Qwen3-Next linear-attention layer (gated DeltaNet), tiny."""
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp_world_size=1, num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32,
        conv_kernel_size=4,
    )  # fmt: skip
    return MambaSpec(
        block_size=BS,
        shapes=shapes,
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    )


def cache_config(*groups: tuple[KVCacheSpec, int]) -> KVCacheConfig:
    """Groups of (spec, number of layers), as vLLM's hybrid KV cache manager builds them."""
    specs = [
        KVCacheGroupSpec([f"model.layers.{g}.{i}" for i in range(n)], spec)
        for g, (spec, n) in enumerate(groups)
    ]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=specs)


def engine(hf_config: Any) -> Any:
    return SimpleNamespace(
        parallel_config=ParallelConfig(), model_config=SimpleNamespace(hf_config=hf_config)
    )


BAMBA = transformers.BambaConfig(num_hidden_layers=4, attn_layer_indices=[3])
QWEN3_NEXT = transformers.Qwen3NextConfig(num_hidden_layers=4)


@pytest.mark.parametrize(
    ("hf_config", "groups", "words"),
    [
        (BAMBA, [(full(), 1), (mamba2(), 3)], "'bamba' model has 3 Mamba"),
        (QWEN3_NEXT, [(gated_delta_net(), 3), (full(), 1)], "'qwen3_next' model has 3 Mamba"),
        (BAMBA, [(mamba2(), 3)], "in 1 of 1 KV cache groups"),  # state layers alone
        (BAMBA, [(full(), 1), (sliding(), 1), (mamba2(), 2)], "in 1 of 3 KV cache groups"),
    ],
    ids=["bamba", "qwen3-next", "mamba-only", "with-sliding"],
)
def test_state_groups_are_refused_naming_the_model_type(
    hf_config: Any, groups: list[tuple[KVCacheSpec, int]], words: str
) -> None:
    with pytest.raises(UnsupportedConfig) as err:
        check_supported(engine(hf_config), cache_config(*groups))
    message = str(err.value)
    assert words in message
    assert "MambaSpec" in message
    assert "vLLM alone" in message and "run without the kvkeep connector" in message


def test_attention_groups_pass_the_state_check() -> None:
    """One full-attention group is what kvkeep keeps; the state check lets it through."""
    check_supported(engine(BAMBA), cache_config((full(), 4)))


def test_the_model_type_is_unknown_without_a_model_config() -> None:
    bare = SimpleNamespace(parallel_config=ParallelConfig())
    with pytest.raises(UnsupportedConfig, match="'unknown' model"):
        check_supported(bare, cache_config((full(), 1), (mamba2(), 3)))


def test_the_connector_refuses_a_mamba_hybrid_before_it_connects() -> None:
    """Both roles raise kvkeep's message at construction: it is the root cause in vLLM's log
    (the socket in the config does not exist, so getting further would fail otherwise)."""
    cfg = engine(BAMBA)
    cfg.kv_transfer_config = SimpleNamespace(
        kv_connector_extra_config={"socket": "/nonexistent/kvkeep.sock"}
    )
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UnsupportedConfig, match="'bamba' model has 3 Mamba"):
            KVKeepConnector(cfg, role, cache_config((full(), 1), (mamba2(), 3)))
