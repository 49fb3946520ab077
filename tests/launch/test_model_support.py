"""Which configs declare Mamba / linear-attention layers: shapes from published config.json
files (only the fields that matter, source in a comment), and transformers' own configs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import transformers

from kvkeep.host.cpu_pool import GENERATED_WEIGHTS
from kvkeep.launch.model_support import (
    StateLayers,
    config_of,
    cpu_failure,
    cpu_refusal,
    hybrid_refusal,
    latent_attention,
    sparse_latent,
    sparse_refusal,
    state_layers,
)
from kvkeep.launch.serve import check_weights
from kvkeep.tinymodel.generate import TinyModelSpec, llama_config


@pytest.mark.parametrize(
    ("config", "evidence"),
    [
        # huggingface.co/ibm-granite/granite-4.0-h-small/blob/main/config.json
        (
            {
                "model_type": "granitemoehybrid",
                "layer_types": ["mamba"] * 5 + ["attention"] + ["mamba"] * 4,
            },
            "layer_types has 9 of 10 layers of type mamba",
        ),
        # huggingface.co/nvidia/NVIDIA-Nemotron-Nano-9B-v2/blob/main/config.json (abridged)
        (
            {"model_type": "nemotron_h", "hybrid_override_pattern": "M-M-M*-M-"},
            "hybrid_override_pattern has 4 Mamba layers",
        ),
        # huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json
        (
            {
                "model_type": "qwen3_next",
                "full_attention_interval": 4,
                "linear_num_value_heads": 32,
            },
            "config key 'linear_num_value_heads'",
        ),
        # huggingface.co/ai21labs/AI21-Jamba-Mini-1.5/blob/main/config.json
        (
            {"model_type": "jamba", "attn_layer_period": 8, "mamba_d_state": 16},
            "config key 'mamba_d_state'",
        ),
        # huggingface.co/LiquidAI/LFM2-1.2B/blob/main/config.json (abridged)
        (
            {"model_type": "lfm2", "layer_types": ["conv", "conv", "full_attention"]},
            "layer_types has 2 of 3 layers of type conv",
        ),
        # a multimodal config: the text model's layer types (Qwen3.5 style)
        (
            {
                "model_type": "qwen3_5",
                "text_config": {"layer_types": ["linear_attention"] * 3 + ["full_attention"]},
            },
            "layer_types has 3 of 4 layers of type linear_attention",
        ),
        # huggingface.co/MiniMaxAI/MiniMax-Text-01/blob/main/config.json (abridged)
        (
            {"model_type": "minimax_text_01", "attn_type_list": [0] * 7 + [1]},
            "attn_type_list has 7 of 8 linear-attention layers",
        ),
        ({"model_type": "mamba2"}, "model_type 'mamba2'"),
    ],
    ids=[
        "granite-4-h",
        "nemotron-h",
        "qwen3-next",
        "jamba",
        "lfm2",
        "qwen3.5",
        "minimax",
        "mamba2",
    ],
)
def test_published_state_layer_configs_are_found(config: dict[str, Any], evidence: str) -> None:
    found = state_layers(config)
    assert found is not None
    assert found.model_type == config["model_type"]
    assert evidence in found.evidence


@pytest.mark.parametrize(
    "config",
    [
        llama_config(TinyModelSpec()),
        # huggingface.co/openai/gpt-oss-20b/blob/main/config.json (abridged)
        {
            "model_type": "gpt_oss",
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 12,
        },
        # huggingface.co/google/gemma-3-27b-it/blob/main/config.json (abridged)
        {
            "model_type": "gemma3",
            "text_config": {"sliding_window": 1024, "sliding_window_pattern": 6},
        },
        transformers.Gemma3TextConfig(num_hidden_layers=6).to_dict(),
        {"model_type": "softmax_only", "attn_type_list": [1] * 8},  # MiniMax's list, no 0
    ],
    ids=["tiny-llama", "gpt-oss", "gemma-3", "gemma-3-transformers", "softmax-list"],
)
def test_attention_only_models_are_not_flagged(config: dict[str, Any]) -> None:
    assert state_layers(config) is None


def test_transformers_hybrid_configs_are_found() -> None:
    """What `save_pretrained` writes for each family vLLM runs natively."""
    for cfg in (
        transformers.GraniteMoeHybridConfig(),
        transformers.Qwen3NextConfig(),
        transformers.NemotronHConfig(),
        transformers.FalconH1Config(),
        transformers.Zamba2Config(),
        transformers.JambaConfig(),
    ):
        assert state_layers(cfg.to_dict()) is not None, type(cfg).__name__


def test_a_hybrid_is_refused_only_where_no_boundary_state_can_exist() -> None:
    """'align' (or the mode left to kvkeep serve) passes; mode 'none' and prefix caching off
    are refused naming the model type, the reason and the command without kvkeep."""
    found = state_layers({"model_type": "granitemoehybrid", "layer_types": ["mamba", "attention"]})
    assert found is not None
    assert hybrid_refusal(found, "/m") is None
    assert hybrid_refusal(found, "/m", "align") is None
    for bad, why in (
        ({"mode": "none"}, "--mamba-cache-mode none keeps one running state"),
        ({"prefix_caching_off": True}, "only with prefix caching on"),
    ):
        text = hybrid_refusal(found, "/m", **bad)
        assert text is not None and why in text
        assert "/m is a 'granitemoehybrid' hybrid" in text
        assert "`python -m vllm.entrypoints.openai.api_server --model /m`" in text


def test_the_hybrids_vllm_cpu_fails_on_are_named_with_the_failure() -> None:
    nemotron = state_layers({"model_type": "nemotron_h", "hybrid_override_pattern": "M*M"})
    qwen35 = state_layers(
        {"model_type": "qwen3_5", "text_config": {"layer_types": ["linear_attention"]}}
    )
    next_ = state_layers({"model_type": "qwen3_next", "linear_num_value_heads": 32})
    assert nemotron is not None and qwen35 is not None and next_ is not None
    assert cpu_failure(next_) is None
    failure = cpu_failure(nemotron)
    assert failure is not None and "IndexError in mamba_mixer2.conv_ssm_forward" in failure
    assert "2 Mamba layers" in cpu_refusal(nemotron, failure, "/models/nano")
    assert "torchvision" in (cpu_failure(qwen35) or "")


def test_config_of_reads_a_local_model_only(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert config_of(str(tmp_path)) == {"model_type": "llama"}
    assert config_of(str(tmp_path / "config.json")) == {"model_type": "llama"}
    assert config_of("ibm-granite/granite-4.0-h-small") is None  # a hub id: not looked up
    (tmp_path / "config.json").write_text("{not json")
    assert config_of(str(tmp_path)) is None  # vLLM will say what is wrong with it


def test_mla_latents_are_kept_and_sparse_mla_is_refused() -> None:
    """A dense latent (DeepSeek-V2/V3, Kimi K2) is served; DeepSeek-V3.2's indexer and V4's
    compressed KV are refused by name, with the command that serves them without kvkeep."""
    v3 = {"model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    found = latent_attention(v3)
    assert found is not None and found.values_per_token == 576
    assert state_layers(v3) is None and sparse_latent(v3) is None
    assert latent_attention({"model_type": "llama", "num_key_value_heads": 8}) is None
    assert latent_attention({**v3, "is_causal": False}) is None  # vLLM runs it without MLA
    for config in ({**v3, "index_topk": 2048}, {**v3, "model_type": "deepseek_v4"}):
        evidence = sparse_latent(config)
        assert evidence is not None
        text = sparse_refusal(evidence, "/m")
        assert "sparse or compressed MLA" in text
        assert "`python -m vllm.entrypoints.openai.api_server --model /m`" in text


def _commands(message: str) -> list[list[str]]:
    """The commands a message tells the user to run (in backticks), as argv for their
    ``--help`` form: the words before the first option or placeholder, then --help."""
    found = []
    for text in re.findall(r"`((?:python -m|kvkeep) [^`]+)`", message):
        words = []
        for word in text.split():
            if (word.startswith("-") and word != "-m") or word.isupper() or "/" in word:
                break
            words.append(word)
        argv = [sys.executable, "-m", "kvkeep.cli", *words[1:]] if words[0] == "kvkeep" else [
            sys.executable, *words[1:]
        ]  # fmt: skip
        found.append([*argv, "--help"])
    return found


def test_every_command_a_refusal_names_runs() -> None:
    """Each command a refusal tells the user to run works with the installed packages, in
    its --help form: vLLM's OpenAI server as the vllm-cpu package starts it (its `vllm`
    console script does not), and `kvkeep model tiny`."""
    messages = [
        hybrid_refusal(StateLayers("nemotron_h", "pattern"), "/m", "none") or "",
        sparse_refusal("config key 'index_topk'", "/m"),
    ]
    with pytest.raises(ValueError) as generated:
        check_weights(["--load-format", GENERATED_WEIGHTS])  # refused: no engine starts
    messages.append(str(generated.value))
    commands = [argv for m in messages for argv in _commands(m)]
    assert len(commands) == 3, commands
    for argv in dict.fromkeys(map(tuple, commands)):  # each distinct command once (7 s each)
        run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and "usage" in run.stdout.lower(), (argv, run.stderr[-500:])


def test_every_failure_refused_on_cpu_is_tried_by_the_gpu_check() -> None:
    """Each vLLM-cpu failure `kvkeep serve` refuses on (`CPU_FAILURES`) has a tiny model of its
    family that scripts/gpu-check.sh writes and smokes, so a GPU run says whether it serves."""
    from kvkeep.launch.model_support import CPU_FAILURES
    from kvkeep.tinymodel import hybrids

    script = (Path(__file__).parents[2] / "scripts" / "gpu-check.sh").read_text()
    found = re.search(r"for kind in ([^;]+);", script)
    assert found is not None, "gpu-check.sh writes no hybrids"
    tried = set()
    for kind in found.group(1).split():
        config_class, shape = hybrids.SHAPES[kind]
        config = getattr(transformers, config_class)(**hybrids.COMMON, **shape).to_dict()
        layers = state_layers(config)
        assert layers is not None, kind
        tried.add(CPU_FAILURES.get(layers.model_type))
    assert set(CPU_FAILURES.values()) <= tried
