"""The deployment handles: the cache server on real `kvkeep server` processes, and the vLLM
command line (no vLLM is started here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvkeep.bench.deploy.cache import CacheServer, CacheSpec
from kvkeep.bench.deploy.vllm import (
    MODES,
    LaunchConfig,
    LaunchError,
    VLLMServer,
    build_command,
    loaded_format,
)
from kvkeep.host.cpu_pool import GENERATED_WEIGHTS
from kvkeep.launch.serve import CPU_SCHEDULING, flag_value


def test_cache_server_restarts_dies_and_is_replaced() -> None:
    with CacheServer(CacheSpec(ram="64MiB", disk="64MiB"), name="test") as cache:
        assert cache.stats() is not None
        first = cache.pid
        (cache.directory / "marker").write_text("state")
        cache.kill()
        assert cache.stats() is None, "a killed server answers nothing"
        cache.restart("sigkill")
        assert cache.pid not in (None, first) and cache.stats() is not None
        assert (cache.directory / "marker").exists(), "a restart keeps the state directory"
        cache.replace_host()
        assert not (cache.directory / "marker").exists(), "a new host starts empty"
        assert cache.stats() is not None
        directory = cache.directory
    assert not directory.exists(), "close() deletes the state"


def test_remote_arguments_only_with_a_store() -> None:
    spec = CacheSpec(extra_args=("--queue-depth", "8"))
    assert spec.args(None) == ("--queue-depth", "8")
    assert spec.args("valkey://h:1")[:2] == ("--remote", "valkey://h:1")
    assert spec.args("valkey://h:1")[-2:] == ("--queue-depth", "8")


def test_every_mode_loads_the_models_own_weights(tiny_model: Path) -> None:
    """No mode, and no extra argument, may make vLLM generate its own weights: with them no
    reply depends on its context and no test could see a wrong KV block."""
    for mode in MODES:
        cfg = LaunchConfig(model=tiny_model, mode=mode, cache_socket="/tmp/unused.sock")
        cfg.validate()
        argv, _ = build_command(cfg, 8000)
        assert not any(a.startswith("--load-format") for a in argv), argv
    g = GENERATED_WEIGHTS  # inputs the launcher must refuse
    for extra in (("--load-format", g), ("--load_format", g.upper()), ("--load-f", g)):
        with pytest.raises(ValueError, match="vLLM would generate the model's weights"):
            LaunchConfig(model=tiny_model, extra_args=extra).validate()
    LaunchConfig(model=tiny_model, extra_args=("--load-format", "safetensors")).validate()


def test_an_engine_whose_log_says_it_generated_its_weights_is_refused(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The check after start-up, for a way past the argument checks (an environment
    variable, say): vLLM's own config line decides. A real engine that generates its weights
    is what the suite never starts, so its log line stands in."""
    server = VLLMServer(LaunchConfig(model=tiny_model, log_dir=tmp_path))
    line = "INFO [core.py:133] Initializing a V1 LLM engine with config: load_format={}, x=1\n"
    server.log_path.write_text(line.format("auto"))
    server._check_loaded_weights()
    server.log_path.write_text(line.format(GENERATED_WEIGHTS.upper()))
    with pytest.raises(LaunchError, match="vLLM generated the model's weights"):
        server._check_loaded_weights()
    server.log_path.write_text("no config line yet\n")
    assert loaded_format(server.log_path) is None


def test_a_model_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no weight files; `kvkeep model tiny"):
        LaunchConfig(model=tmp_path).validate()


def test_every_mode_runs_with_the_same_scheduling_unless_the_config_sets_it(
    tiny_model: Path,
) -> None:
    """Modes differ only in their cache: serve's scheduling in every mode by default, vLLM's
    own in every mode with scheduling "vllm", and a value given wins in both."""

    def threshold(mode: str, value: int | None, scheduling: str = "kvkeep") -> str | None:
        cfg = LaunchConfig(model=tiny_model, mode=mode, cache_socket="/s",
                           long_prefill_token_threshold=value, scheduling=scheduling)  # fmt: skip
        return flag_value(build_command(cfg, 1)[0], "--long-prefill-token-threshold")

    serve = dict(CPU_SCHEDULING)["--long-prefill-token-threshold"]
    assert {threshold(mode, None) for mode in MODES} == {serve}
    assert {threshold(mode, None, "vllm") for mode in MODES} == {None}  # vLLM's own default
    assert threshold("kvkeep", 0) == "0"  # vLLM's default, asked for: no cap
    assert threshold("vllm", 256, "vllm") == "256"
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        LaunchConfig(model=tiny_model, long_prefill_token_threshold=-1).validate()
    with pytest.raises(ValueError, match="scheduling 'fast': choose one of kvkeep, vllm"):
        LaunchConfig(model=tiny_model, scheduling="fast").validate()
