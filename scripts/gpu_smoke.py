"""The CUDA end-to-end smoke of ``scripts/gpu-check.sh``: a real cache server and a CUDA vLLM
with the kvkeep connector serve one prompt cold, then again after vLLM's own prefix cache is
reset, so the second reply is computed on KV loaded from kvkeep. Passes when kvkeep loaded
tokens and the greedy replies are equal (the tiny model's replies depend on their context).
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> str:
    data = json.dumps(body).encode() if body is not None else None
    method = "POST" if data is not None or url.endswith("reset_prefix_cache") else "GET"
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


def smoke(model: str, timeout_s: float = 300) -> dict[str, Any]:
    """Run the smoke; {"ok": bool, ...figures or "error"}. Stops what it started."""
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
    sock = str(work / "kvkeep.sock")
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
    while not os.path.exists(sock) and time.monotonic() < deadline:
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
    prompt = [random.Random(13).randrange(16, 8000) for _ in range(2000)]
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    cold = json.loads(_http(f"{base}/v1/completions", body))["choices"][0]["text"]
    time.sleep(2)  # saves commit in the background
    _http(f"{base}/reset_prefix_cache")
    before = _loaded(base)
    warm = json.loads(_http(f"{base}/v1/completions", body))["choices"][0]["text"]
    loaded = _loaded(base) - before
    return {"ok": loaded > 0 and warm == cold, "loaded_tokens": loaded,
            "replies_equal": warm == cold, "vllm_ready_s": ready_s}  # fmt: skip
