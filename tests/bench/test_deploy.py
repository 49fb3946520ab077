"""The deployment handles: the cache server on real `kvkeep server` processes, and the vLLM
command line (no vLLM is started here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvkeep.bench.deploy.cache import CacheServer, CacheSpec
from kvkeep.bench.deploy.vllm import MODES, LaunchConfig, build_command
from kvkeep.serve import CPU_SCHEDULING, flag_value


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
    for extra in (("--load-format", "dummy"), ("--load_format", "DUMMY"), ("--load-f", "dummy")):
        with pytest.raises(ValueError, match="--load-format dummy"):
            LaunchConfig(model=tiny_model, extra_args=extra).validate()
    LaunchConfig(model=tiny_model, extra_args=("--load-format", "safetensors")).validate()


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
