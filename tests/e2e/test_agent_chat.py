"""The agent path, as a user runs it: a multi-turn chat through the ``openai`` client against
``kvkeep serve``, replayed once vLLM's device cache is empty, every turn served from kvkeep.

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

import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvkeep.bench.criterion import Reply, same_as_hit
from kvkeep.bench.deploy.vllm import free_port
from kvkeep.bench.prompts import reset_device_cache
from kvkeep.launch.cache_server import stop_process_group

from .conftest import CacheServerFactory
from .engine import BLOCK, full_blocks, settled_tokens

pytestmark = pytest.mark.e2e

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
        self.env["VLLM_SERVER_DEV_MODE"] = "1"  # for reset_device_cache
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


def test_a_chat_replayed_on_an_empty_device_cache_is_served_from_kvkeep(
    tiny_model: Path, tmp_path: Path, cache_server: CacheServerFactory
) -> None:
    rng = random.Random(5)
    cache = cache_server("1GiB")
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
        before = settled_tokens(serve.url)
        assert before["loaded"] == 0

        reset_device_cache(serve.url)  # kvkeep's server keeps its blocks
        replayed = [ask(client, turn) for turn in transcript]
        loaded = settled_tokens(serve.url)["loaded"]
        sizes = [prompt_tokens(serve.url, turn) for turn in transcript]
    finally:
        serve.stop()

    for i, ((_, reply, cached), ref) in enumerate(zip(replayed, reference, strict=True)):
        assert cached == full_blocks(sizes[i]) * BLOCK, f"turn {i}: only {cached} cached"
        verdict = same_as_hit(reply, ref)
        assert verdict, f"turn {i}: {verdict.why}"
    # the first turn's blocks and each later turn's new ones came from kvkeep
    assert loaded == full_blocks(sizes[-1]) * BLOCK
