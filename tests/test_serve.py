"""`kvkeep serve`: the commands it runs, and reuse of a cache server already listening."""

from __future__ import annotations

import json
import shlex
import shutil
import tempfile
from pathlib import Path

import pytest

from kvkeep.serve import CacheServerConfig, CacheServerProcess, main, socket_listening, split_args


def test_split_args_hands_everything_after_the_separator_to_vllm() -> None:
    assert split_args(["m", "--ram", "1GiB", "--", "--port", "9"]) == (
        ["m", "--ram", "1GiB"],
        ["--port", "9"],
    )
    assert split_args(["m"]) == (["m"], [])


def test_dry_run_prints_the_server_and_vllm_commands(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["my/model", "--dir", str(tmp_path), "--ram", "2GiB", "--dry-run",
                 "--", "--port", "8123"])  # fmt: skip
    assert code == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    server, engine = (shlex.split(ln.rstrip(" &")) for ln in lines)
    assert server[-8:] == ["--dir", str(tmp_path), "--ram", "2GiB", "--disk", "0",
                           "--socket", str(tmp_path / "kvkeep.sock")]  # fmt: skip
    assert engine[engine.index("--model") + 1] == "my/model"
    assert engine[-2:] == ["--port", "8123"]
    config = json.loads(engine[engine.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KVKeepConnector"
    assert config["kv_connector_module_path"] == "kvkeep.vllm.connector"
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"]["socket"] == str(tmp_path / "kvkeep.sock")


def test_dry_run_passes_the_remote_tier_to_the_cache_server(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["m", "--dir", str(tmp_path), "--remote", "valkey://127.0.0.1:6380",
                 "--remote-write", "evict", "--dry-run"])  # fmt: skip
    assert code == 0
    server = shlex.split(capsys.readouterr().out.splitlines()[1].rstrip(" &"))
    assert server[-4:] == ["--remote", "valkey://127.0.0.1:6380", "--remote-write", "evict"]


def test_a_bad_size_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["m", "--dir", str(tmp_path), "--ram", "lots", "--dry-run"]) == 2
    assert "lots" in capsys.readouterr().err


def test_a_listening_server_is_reused_and_left_running() -> None:
    directory = Path(tempfile.mkdtemp(prefix="kvk-serve-"))  # short: a unix socket path
    cfg = CacheServerConfig(directory, ram="64MiB")
    first = CacheServerProcess(cfg).ensure()
    try:
        assert first.started and socket_listening(cfg.socket_path)
        second = CacheServerProcess(cfg).ensure()
        assert not second.started
        second.stop()  # not ours: a no-op
        assert socket_listening(cfg.socket_path)
    finally:
        first.stop()
        shutil.rmtree(directory, ignore_errors=True)
    assert not socket_listening(cfg.socket_path)
