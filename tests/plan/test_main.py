"""The `kvkeep plan` command line end to end (no server needed)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvkeep.plan.main import main

MOONCAKE = Path(__file__).resolve().parents[3] / "shared/data/mooncake-synthetic-trace.jsonl"


@pytest.mark.skipif(
    not MOONCAKE.is_file() and not os.environ.get("CI"),  # in CI a missing trace fails
    reason="the shared Mooncake trace is not beside this checkout",
)
def test_acceptance_on_the_mooncake_trace(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    t0 = time.perf_counter()
    argv = ["--trace", str(MOONCAKE), "--block-tokens", "512",
            "--capacity-blocks", "1000,5000,20000,1000000", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert time.perf_counter() - t0 < 10
    rates = json.loads(out.read_text())["hit_rate_by_capacity"]
    assert list(rates) == ["1000", "5000", "20000", "1000000"]
    assert round(rates["1000000"], 4) == 0.6396


def test_tiles_with_sizes_plot_and_recommendation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = tmp_path / "store.json"
    bench.write_text(json.dumps({"results": {"ram_get_gbps": 8.0, "disk_get_gbps": 1.0}}))
    argv = ["--tiles", "8", "--doc-tokens", "4096", "--model", "kvkeep-tiny",
            "--device-gib", str(6 * 4096 * 2048 / 2**30), "--ram", "1GiB",
            "--store-bench", str(bench), "--prefill-s-per-token", "1e-4",
            "--json", str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.png")]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "device holds 75% of the working set: expect a 0.0% device hit rate" in text
    assert "ram tier brings the hit rate to 50.0%" in text
    assert "disk tier not needed unless restarts matter" in text
    doc = json.loads((tmp_path / "t.json").read_text())
    assert [t["name"] for t in doc["tiers"]] == ["device", "ram"]
    assert doc["estimates"][-1]["mean_ttft_s"] < doc["estimates"][0]["mean_ttft_s"]
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_bytes_without_a_model_says_what_to_add(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tiles", "2", "--ram", "1GiB"]) == 2
    assert "needs --model (or give --ram-blocks)" in capsys.readouterr().err


def test_malformed_trace_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [0], "input_length": 10}\n{"hash_ids": "x"}\n')
    assert main(["--trace", str(bad)]) == 2
    assert "bad.jsonl:2: 'hash_ids' must be a list" in capsys.readouterr().err


def test_a_sliding_window_model_shows_its_bytes_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Gemma-3 style, 5 sliding layers of 512 tokens and 1 full; prompts of 8192 + 32 tokens."""
    config = {"model_type": "gemma3_text", "num_hidden_layers": 6, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256,
              "sliding_window": 512, "sliding_window_pattern": 6}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "p.json"
    argv = ["--tiles", "4", "--doc-tokens", "8192", "--question-tokens", "32",
            "--model", str(tmp_path), "--ram", "1GiB", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    sliding = 5 * 512 * (512 + 128) / 8224  # 199 B/token: window plus one block of 128
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("model "))
    assert "711 B/token stored at the mean prompt of 8,224 tokens (23.2% of keeping" in line
    assert "1 full-attention layers 512 B/token, 5 sliding-window layers 199 B/token" in line
    footprint = json.loads(out.read_text())["footprint"]
    assert (footprint["full_bytes_per_token"], footprint["sliding_bytes_per_token"]) == (
        512,
        sliding,
    )
    assert footprint["block_bytes"] == (512 + sliding) * 128
