"""The agent path, as a user runs it: a multi-turn chat through the ``openai`` client against
``kvkeep serve``, replayed after a real vLLM restart, every turn served from kvkeep.

1. A 12-turn chat is generated: each turn adds a user message and the model's own reply.
2. The transcript is replayed once more against the same engine: the reference (vLLM's own
   prefix-cache hits on the KV it computed in step 1).
3. vLLM is restarted (the cache server, started apart, stays up) and the transcript is
   replayed again: every turn's full blocks come from kvkeep, and every reply equals the
   reference in tokens and logprobs (``kvkeep.bench.criterion.same_as_hit``), and the OpenAI
   usage's ``cached_tokens`` (turned on by ``kvkeep serve``) counts the tokens kvkeep supplied.

Built so that no block is computed twice (see the criterion's docstring): every prompt ends
mid-block and each reply is capped so that its decode never completes that block. The user
messages are padded to get there, measured with vLLM's own ``/tokenize``.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvkeep.bench.criterion import Reply, same_as_hit
from kvkeep.bench.deploy.vllm import free_port
from kvkeep.bench.metrics import kvkeep_tokens
from kvkeep.launch.cache_server import CacheServerConfig, CacheServerProcess, stop_process_group

pytestmark = pytest.mark.e2e

BLOCK = 128
TURNS = 12
MAX_REPLY = 12
MODEL = "kvkeep-tiny"
WORDS = Path(random.__file__).read_text().split()


class Serve:
    """``kvkeep serve`` as a subprocess: attaches to the cache server already listening."""

    def __init__(self, model: Path, cache_dir: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            sys.executable,
            "-m",
            "kvkeep.cli",
            "serve",
            str(model),
            "--dir",
            str(cache_dir),
            "--",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            MODEL,
            "--max-model-len",
            "8192",
            "--enforce-eager",
        ]  # fmt: skip  (no --enable-prompt-tokens-details: serve turns it on)
        self.env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "kvkeep serve exited:\n" + self.log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise AssertionError("vLLM under kvkeep serve did not become ready")

    def stop(self) -> None:
        stop_process_group(self.proc, 30.0)


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[CacheServerProcess]:
    directory = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvka-{os.getpid()}-{time.time_ns()}"
    proc = CacheServerProcess(CacheServerConfig(directory, ram="1GiB", disk="0")).ensure()
    yield proc
    proc.stop()
    shutil.rmtree(directory, ignore_errors=True)


def prompt_tokens(url: str, messages: list[dict[str, Any]]) -> int:
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
    r = httpx.post(f"{url}/tokenize", json=body, timeout=30)
    r.raise_for_status()
    return int(r.json()["count"])


def user_turn(url: str, messages: list[dict[str, Any]], rng: random.Random) -> list[dict]:
    """Messages plus a user message padded until the prompt ends mid-block with room for a
    whole reply in that block (so no block is ever computed twice)."""
    words = [rng.choice(WORDS) for _ in range(rng.randrange(80, 400))]
    while True:
        turn = [*messages, {"role": "user", "content": " ".join(words)}]
        rest = prompt_tokens(url, turn) % BLOCK
        if 0 < rest < BLOCK - MAX_REPLY:
            return turn
        words.append(rng.choice(WORDS))


def ask(client: openai.OpenAI, messages: list[dict[str, Any]]) -> tuple[str, Reply, int]:
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_REPLY, temperature=0.0,  # type: ignore[arg-type]
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


def settled(url: str, name: str) -> float:
    """A connector counter once two reads a second apart agree (stats arrive a step late)."""
    last = kvkeep_tokens(url)[name]
    for _ in range(15):
        time.sleep(1.0)
        now = kvkeep_tokens(url)[name]
        if now == last:
            break
        last = now
    return last


def test_a_chat_replayed_after_a_vllm_restart_is_served_from_kvkeep(
    tiny_model: Path, tmp_path: Path, cache: CacheServerProcess
) -> None:
    rng = random.Random(5)
    serve = Serve(tiny_model, cache.cfg.directory, tmp_path / "serve.log")
    serve.start()
    try:
        client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0)
        system = " ".join(rng.choice(WORDS) for _ in range(600))
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        transcript: list[list[dict[str, Any]]] = []
        for _ in range(TURNS):
            messages = user_turn(serve.url, messages, rng)
            transcript.append(messages)
            text, _, _ = ask(client, messages)
            messages = [*messages, {"role": "assistant", "content": text}]
        reference = [ask(client, turn)[1] for turn in transcript]
        loaded_before = kvkeep_tokens(serve.url)["loaded"]
    finally:
        serve.stop()
    assert loaded_before == 0

    serve.start()  # a new vLLM: its device cache is empty; kvkeep's server kept its blocks
    try:
        client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0)
        replayed = [ask(client, turn) for turn in transcript]
        loaded = settled(serve.url, "loaded")
        sizes = [prompt_tokens(serve.url, turn) for turn in transcript]
    finally:
        serve.stop()

    for i, ((_, reply, cached), ref) in enumerate(zip(replayed, reference, strict=True)):
        assert cached == (sizes[i] - 1) // BLOCK * BLOCK, f"turn {i}: only {cached} cached"
        verdict = same_as_hit(reply, ref)
        assert verdict, f"turn {i}: {verdict.why}"
    # the first turn's blocks and each later turn's new ones came from kvkeep
    assert loaded == (sizes[-1] - 1) // BLOCK * BLOCK
