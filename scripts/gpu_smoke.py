"""The CUDA end-to-end smoke of ``scripts/gpu-check.sh``: a real cache server and a CUDA vLLM
with the kvkeep connector serve one prompt cold, then again after vLLM's own prefix cache is
reset, so the second reply is computed on KV loaded from kvkeep. Passes when kvkeep loaded
tokens and the greedy replies are equal, and only on a model whose replies depend on their
context: a model directory without weight files is refused before anything starts, and the
same question after two other prefixes must get two other replies (vLLM's generated weights,
its ``dummy`` load format, would give every prompt the same reply, so equal replies would prove
nothing about the KV).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvkeep.host.cpu_pool import WEIGHT_SUFFIXES


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> str:
    data = json.dumps(body).encode() if body is not None else None
    method = "POST" if data is not None or "/reset_prefix_cache" in url else "GET"
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return str(r.read().decode())


def _wait(url: str, proc: subprocess.Popen[bytes], deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}")
        try:
            _http(url, timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError("not ready in time")


def _loaded(base: str) -> float:
    total = 0.0
    for line in _http(f"{base}/metrics").splitlines():
        if line.startswith("vllm:kvkeep_tokens_total") and 'op="loaded"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def model_problem(model: str) -> str | None:
    """Why ``model`` cannot be the smoke's model (None: it can): it must be a local directory
    with a config.json and weight files of its own."""
    path = Path(model)
    if not (path / "config.json").is_file():
        return f"{model} is not a model directory with a config.json"
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in path.iterdir()):
        return (f"{model} has no weight files: its replies would not depend on their context; "
                f"`kvkeep model tiny {model}` writes seeded weights")  # fmt: skip
    return None


def smoke(model: str, timeout_s: float = 300) -> dict[str, Any]:
    """Run the smoke; {"ok": bool, ...figures or "error"}. Stops what it started."""
    problem = model_problem(model)
    if problem is not None:
        return {"ok": False, "error": problem}
    work = Path(tempfile.mkdtemp(prefix="kvkeep-gpu-smoke-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        return _run(model, work, procs, time.monotonic() + timeout_s)
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "logs": str(work)}
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        if not os.environ.get("KVKEEP_KEEP_SMOKE"):
            shutil.rmtree(work, ignore_errors=True)


def _start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def _run(
    model: str, work: Path, procs: list[subprocess.Popen[bytes]], deadline: float
) -> dict[str, Any]:
    sock = str(work / "cache" / "kvkeep.sock")  # the server's socket in its --dir
    server = [
        sys.executable,
        "-m",
        "kvkeep.cli",
        "server",
        "--dir",
        str(work / "cache"),
        "--ram",
        "2GiB",
    ]
    (work / "cache").mkdir()
    procs.append(_start(server, work / "cache.log"))
    while not os.path.exists(sock):
        if procs[-1].poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the cache server did not start; see {work / 'cache.log'}")
        time.sleep(0.2)
    port = _free_port()
    transfer = {"kv_connector": "KVKeepConnector",
                "kv_connector_module_path": "kvkeep.vllm.connector", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"socket": sock, "timeout_s": 2.0}}  # fmt: skip
    vllm = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "4096",
            "--gpu-memory-utilization", "0.3", "--enforce-eager",
            "--kv-transfer-config", json.dumps(transfer)]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    procs.append(_start(vllm, work / "vllm.log", env))
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    _wait(f"{base}/health", procs[-1], deadline)
    ready_s = time.monotonic() - t0
    rng = random.Random(13)
    prefixes = [[rng.randrange(16, 8000) for _ in range(2000)] for _ in range(2)]
    question = [rng.randrange(16, 8000) for _ in range(32)]
    cold, other = (_reply(base, model, prefix + question) for prefix in prefixes)
    reads_context = cold != other  # else equal replies below would prove nothing
    time.sleep(2)  # saves commit in the background
    _http(f"{base}/reset_prefix_cache?reset_external=false")
    before = _loaded(base)
    warm = _reply(base, model, prefixes[0] + question)
    loaded = _loaded(base) - before
    return {"ok": loaded > 0 and warm == cold and reads_context, "loaded_tokens": loaded,
            "replies_equal": warm == cold, "reads_context": reads_context,
            "vllm_ready_s": ready_s}  # fmt: skip


def _reply(base: str, model: str, prompt: list[int]) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    return str(json.loads(_http(f"{base}/v1/completions", body))["choices"][0]["text"])
