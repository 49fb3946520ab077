"""`kvkeep bench store` runs end to end on small sizes and writes every figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvkeep.bench.cli import main


@pytest.mark.slow
def test_store_bench_writes_all_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "store.json"
    argv = ["store", "--json", str(out), "--dir", str(tmp_path), "--total", "16MiB"]
    assert main([*argv, "--block", "256KiB", "--rebuild-blocks", "2000", "--lookups", "20"]) == 0
    results = json.loads(out.read_text())["results"]
    for name in (
        "memcpy_gbps", "ram_put_gbps", "ram_get_gbps", "ram_get_verified_gbps",
        "disk_get_gbps", "disk_direct_read_gbps", "lookup_p99_ms", "rebuild_s_per_100k",
    ):  # fmt: skip
        assert results[name] > 0, name
    phases = results["disk_breakdown"]
    for name in ("wall_s", "server_read_s", "client_acquire_s", "client_copy_s"):
        assert phases[name] > 0, name
    assert phases["server_read_s"] < phases["client_acquire_s"] < phases["wall_s"]
    samples = results["disk_samples"]  # the disk figures are medians of rounds taken in turn
    assert len(samples["get_gbps"]) == len(samples["direct_read_gbps"]) == 3
    assert results["disk_get_gbps"] == sorted(samples["get_gbps"])[1]
    printed = capsys.readouterr().out
    assert "lookup_p99_ms" in printed and "server_read_s" in printed


@pytest.mark.slow
def test_store_bench_drives_the_connectors_own_saver_and_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The put and verified-get figures time the Saver and BlockLoader an engine runs: a
    loader that loads nothing fails the run, and both are called for every block."""
    from kvkeep.vllm.loader import BlockLoader
    from kvkeep.vllm.saver import Saver

    calls = {"stage": 0, "load": 0}
    stage, load = Saver.stage, BlockLoader.load

    def counted_stage(self: Saver, *args: object) -> int:
        calls["stage"] += 1
        return stage(self, *args)  # type: ignore[arg-type]

    def counted_load(self: BlockLoader, *args: object) -> int:
        calls["load"] += 1
        return load(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Saver, "stage", counted_stage)
    monkeypatch.setattr(BlockLoader, "load", counted_load)
    argv = ["store", "--dir", str(tmp_path), "--total", "8MiB", "--block", "256KiB"]
    assert main([*argv, "--rebuild-blocks", "500", "--lookups", "5"]) == 0
    blocks, batch = 32, 32  # 8 MiB of 256 KiB blocks, a step or a request each
    assert calls["stage"] >= blocks // batch
    assert calls["load"] >= (3 + 3) * blocks // batch  # RAM and disk rounds
    monkeypatch.setattr(BlockLoader, "load", lambda self, *args: 0)
    assert main([*argv, "--rebuild-blocks", "500", "--lookups", "5"]) == 1
