"""A hybrid (sliding-window) model under kvkeep keeps vLLM's hybrid KV cache manager on.

One cache server and one vLLM in mode kvkeep on the tiny Gemma-3-style model (5 sliding-window
layers of 512 tokens, then 1 full; each its own KV cache group), shared by the module.

- vLLM keeps HMA on with the connector (no "Turning off hybrid kv cache manager").
- The guard: this model reads its context too, and a wrong block in the full-attention
  group, served from kvkeep, changes the reply.
- A failed load (a corrupt block in any group) fails the whole request, which vLLM computes
  again: the reply is right.
- Once vLLM's device cache is emptied, a 4k-token prompt is served from kvkeep, every
  claimable full-attention block loaded and only the window's sliding blocks, and the reply
  equals vLLM's own prefix-cache hit; kvkeep stores about one window per sliding layer.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvkeep.bench.criterion import same_as_cold, same_as_hit

from .conftest import kvkeep_deployment
from .engine import (
    BLOCK,
    Deployment,
    StoredNamespace,
    assert_wrong_block_shows,
    complete,
    decisive_reference,
    full_blocks,
    plant_wrong_block,
    reference,
    reset_device_cache,
    settled_tokens,
)

pytestmark = pytest.mark.e2e

WINDOW = 512
SLIDING_LAYERS = 5
WINDOW_BLOCKS = -(-(WINDOW - 1) // BLOCK)  # vLLM's blocks for a sliding hit: 4


@dataclass
class Rig(Deployment):
    def groups(self) -> dict[str, StoredNamespace]:
        """The engine's namespaces by kind and index (``g5/full``, ``g0/swa512``), as the
        cache server recorded them (under the label of whichever side, the scheduler or a
        worker, announced them first)."""
        known = json.loads((self.cache.cfg.directory / "namespaces.json").read_text())
        found = {}
        for entry in known.values():
            role, _, kind = entry["label"].partition("/")
            if role in ("scheduler", "worker0") and kind:
                ns = StoredNamespace(bytes.fromhex(entry["namespace"]), int(entry["block_bytes"]))
                found[kind] = ns
        return found

    def full(self) -> StoredNamespace:
        (ns,) = (ns for name, ns in self.groups().items() if name.endswith("/full"))
        return ns

    def sliding(self) -> list[StoredNamespace]:
        return [ns for name, ns in self.groups().items() if "/swa" in name]

    def wait_stored(self, ids: list[int]) -> None:
        """Until the full group holds every full block of ``ids`` and each sliding group the
        window before the claimable end."""
        limit = full_blocks(ids)
        first = window_start(limit)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.stored_in(self.full(), ids) >= limit and all(
                self.stored_in(ns, ids, first) >= limit - first for ns in self.sliding()
            ):
                return
            time.sleep(0.2)
        raise AssertionError(f"not stored: full {self.stored_in(self.full(), ids)} of {limit}")

    def counters(self) -> dict[str, float]:
        """The connector's token counters once two reads a second apart agree."""
        return settled_tokens(self.url)

    def ram_bytes(self) -> int:
        client = self.client()
        try:
            return int(client.stats()["tiers"]["ram"]["bytes_used"])
        finally:
            client.close()


def window_start(blocks: int) -> int:
    """The first block a hit of ``blocks`` blocks needs in a sliding group."""
    return max(0, blocks * BLOCK - WINDOW + 1) // BLOCK


@pytest.fixture(scope="module")
def rig(tiny_gemma3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    logs = tmp_path_factory.mktemp("hybrid-logs")
    with kvkeep_deployment("kvkh", tiny_gemma3, logs, max_model_len=8192) as (cache, vllm):
        yield Rig(cache, vllm, random.Random(2027))


def test_vllm_keeps_its_hybrid_kv_cache_manager(rig: Rig) -> None:
    log = rig.vllm.log_path.read_text(errors="replace")
    assert "Turning off hybrid kv cache manager" not in log
    assert "kv cache group sizes (128, 128, 128, 128, 128, 128)" in log, "not 6 groups"
    assert len(rig.sliding()) == SLIDING_LAYERS and rig.full() is not None


def test_the_model_reads_its_context_and_a_wrong_block_changes_the_reply(rig: Rig) -> None:
    """Three prefixes before one suffix give three replies; a block of the full-attention
    group with another block's bytes (valid checksum), served from kvkeep, gives a reply
    both rules reject, while the untouched prompt beside it passes the strict rule."""
    suffix = rig.prompt(64)
    replies = [complete(rig.url, rig.prompt(1500) + suffix).reply for _ in range(3)]
    assert len({tuple(r.token_ids) for r in replies}) == 3, "the replies ignore the context"
    planted, planted_ref = decisive_reference(rig.url, lambda: rig.prompt(1300))
    control = rig.prompt(1300)
    refs = [planted_ref, reference(rig.url, control)]
    for ids in (planted, control):
        complete(rig.url, ids)
        rig.wait_stored(ids)
    client = rig.client()
    try:
        # One full-attention layer of six reads these blocks, and the sliding layers read the
        # prompt's tail right: one wrong block there moved the reply by less than drift on a
        # Xeon without AMX (its first five tokens within 0.1 nats of the cold run's). Every
        # other block is wrong here, each with its left neighbour's bytes.
        for index in range(1, full_blocks(planted), 2):
            plant_wrong_block(client, rig.full(), planted, index)
    finally:
        client.close()
    assert_wrong_block_shows(rig.url, planted, control, refs, full_blocks(planted))


@pytest.mark.parametrize("group", ["full", "sliding"])
def test_a_corrupt_block_in_any_group_ends_in_a_correct_recompute(rig: Rig, group: str) -> None:
    """A block whose bytes no longer match their checksum fails its group's load; vLLM then
    recomputes the whole request (``failed_recving``), and the reply is a cold one."""
    ids = rig.prompt(1300)
    ref = reference(rig.url, ids)
    complete(rig.url, ids)
    rig.wait_stored(ids)
    limit = full_blocks(ids)
    ns = rig.full() if group == "full" else rig.sliding()[0]
    assert rig.corrupt(ns, ids, limit - 1)
    before = rig.counters()
    reset_device_cache(rig.url)
    served = complete(rig.url, ids)
    after = rig.counters()
    verdict = same_as_cold(served.reply, ref.cold)
    assert verdict, f"the recompute after a failed {group} load: {verdict.why}"
    failed = "load_failed" if group == "full" else "window_load_failed"
    assert after.get(failed, 0) > before.get(failed, 0), "the corrupt block was not refused"


def test_on_an_empty_device_cache_4k_tokens_are_served_from_kvkeep_like_vllms_own_hit(
    rig: Rig,
) -> None:
    """At 4k tokens, once vLLM's device cache is emptied: every claimable full-attention
    block loads from kvkeep, the sliding groups load only their window, the reply equals
    vLLM's own prefix-cache hit, and kvkeep stores one window (plus a block) per sliding
    layer. (That blocks outlive a vLLM restart is proved on the dense model.)"""
    ids = rig.prompt(4096)
    ram_before = rig.ram_bytes()
    complete(rig.url, ids)
    rig.wait_stored(ids)
    stored = rig.ram_bytes() - ram_before
    before = rig.counters()
    reset_device_cache(rig.url)
    served = complete(rig.url, ids)
    after = rig.counters()
    ref = reference(rig.url, ids)
    limit = full_blocks(ids)
    loaded = after["loaded"] - before["loaded"]
    assert loaded >= 0.99 * limit * BLOCK, f"{loaded} of {limit * BLOCK} tokens loaded"
    window_loaded = after.get("window_loaded", 0) - before.get("window_loaded", 0)
    assert window_loaded == SLIDING_LAYERS * (limit - window_start(limit)) * BLOCK
    verdict = same_as_hit(served.reply, ref.hit)
    assert verdict, f"the restarted engine's reply: {verdict.why}"
    page = rig.full().block_bytes  # one layer's block: every group here has one layer
    full_figure = len(ids) * (1 + SLIDING_LAYERS) * page // BLOCK
    bound = -(-len(ids) // BLOCK) * page + SLIDING_LAYERS * (WINDOW_BLOCKS + 1) * page
    print(f"stored {stored / len(ids):.0f} B/token; every layer's KV: "
          f"{full_figure / len(ids):.0f} B/token; bound {bound / len(ids):.0f}")  # fmt: skip
    assert stored <= bound, f"stored {stored} bytes, more than {bound}"
