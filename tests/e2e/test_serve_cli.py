"""`kvkeep serve MODEL -- --port P` as the README has it on CPU: no memory flags, no
environment. It starts (choosing vLLM's KV pool beside the RAM tier), answers a chat through
the ``openai`` client, and on Ctrl-C stops everything it started: no process is left."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from kvkeep.bench.deploy.vllm import free_port
from kvkeep.launch.cache_server import socket_listening

pytestmark = pytest.mark.e2e


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, "kvkeep serve exited:\n" + log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise AssertionError("kvkeep serve did not become ready:\n" + log.read_text()[-3000:])


def _as_in_a_terminal() -> None:
    """Ctrl-C's default action: a job started in the background of a script (as this test
    may be) inherits SIGINT ignored, which a terminal's foreground job does not."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kill_left_behind(proc: subprocess.Popen[bytes], children: list[psutil.Process]) -> None:
    """After a failure: stop serve and what it started (each leads its own group), by PID.
    SIGTERM first, so that a cache server removes its shared-memory arena; then SIGKILL."""
    procs = [psutil.Process(proc.pid), *children] if proc.poll() is None else children
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(p.pid) == p.pid:
                    os.killpg(p.pid, sig)
                else:
                    p.send_signal(sig)
        procs = psutil.wait_procs(procs, timeout=20)[1]
    proc.wait()


def test_serve_as_written_answers_a_chat_and_ctrl_c_leaves_nothing(
    tiny_model: Path, tmp_path: Path
) -> None:
    directory = Path(tempfile.mkdtemp(prefix="kvks-"))  # short: a unix socket path
    port, log = free_port(), tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    argv = [sys.executable, "-m", "kvkeep.cli", "serve", str(tiny_model), "--dir", str(directory),
            "--", "--port", str(port)]  # fmt: skip
    with open(log, "wb") as out:  # its own group, as a shell's foreground job is
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_as_in_a_terminal)  # fmt: skip
    children: list[psutil.Process] = []
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", log)
        children += psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 3  # the cache server, vLLM's API server, its EngineCore...
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
        assert reply.choices[0].message.content is not None
        assert reply.usage and reply.usage.prompt_tokens_details is not None  # serve's flag
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends to the foreground job
        assert proc.wait(timeout=60) == 130
        assert not socket_listening(str(directory / "kvkeep.sock"))
        alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"left behind: {[(c.pid, c.cmdline()[:4]) for c in alive]}"
    finally:  # after a failure only: what is still running is killed, by PID
        _kill_left_behind(proc, children)
        shutil.rmtree(directory, ignore_errors=True)
    text = log.read_text()
    assert "vLLM KV pool" in text and "chosen by kvkeep serve" in text, text[-3000:]
