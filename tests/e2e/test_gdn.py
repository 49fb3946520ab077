"""A gated DeltaNet hybrid (Qwen3-Next) under kvkeep: its recurrent state kept at block
boundaries, beside its attention KV, through a real vLLM restart.

One cache server and one vLLM in mode kvkeep on the tiny Qwen3-Next (3 GDN layers, then 1
full-attention layer; each its own KV cache group; vLLM's 'align' mamba cache mode), shared
by the module. vLLM's hybrid block depends on the CPU (256 tokens with AVX-512 BF16, where the
state is kept in float32; 128 on an AVX2-only EPYC, bf16 state): the rig reads it from the
engine. Its state reads its context (``A_log`` -6: a token 3,000
positions back still changes the reply), so a wrong state shows.

- vLLM keeps its hybrid manager on; kvkeep keeps one attention group and three state groups.
- A swapped state (another prompt's, at the same boundary, valid checksum) changes the reply.
- A corrupt or a missing state or attention block is a counted miss, and the reply is a cold
  one; so is a prompt whose disk segment was cut short while the cache server was down.
- A cache-server SIGKILL in the middle of a session costs no request, and once a new server
  is up the connector serves states from it again.
- A turn that extends a stored prompt hits up to that prompt's last boundary, where kvkeep
  kept the state, though its own blocks go further.
- After a real vLLM restart a 4k-token prompt is served from kvkeep: every claimable token,
  and the reply equals the cold one and vLLM's own align-mode prefix-cache hit.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvkeep.bench.criterion import same_as_cold, same_as_hit
from kvkeep.bench.metrics import kvkeep_events
from kvkeep.launch.cache_server import CacheServerProcess
from kvkeep.store.base import checksum

from .conftest import kvkeep_deployment
from .engine import (
    Deployment,
    Judged,
    Reference,
    StoredNamespace,
    complete,
    decisive_reference,
    drop,
    engine_block,
    reference,
    reset_device_cache,
    settled_tokens,
    vllm_block,
)

pytestmark = pytest.mark.e2e

STATE_GROUPS = 3
STATE_OPS = ("state_loaded", "state_load_failed", "state_saved")


def claimable(ids: list[int], block: int) -> int:
    """The blocks of a prompt kvkeep may serve: all but its last token's."""
    return (len(ids) - 1) // block


@dataclass
class Rig(Deployment):
    """A hybrid under kvkeep: its namespaces by group, and states planted or awaited."""

    block: int = 0  # vLLM's hybrid block for the model, read from the engine's log

    def groups(self) -> dict[str, StoredNamespace]:
        """The engine's namespaces by kind and index (``g3/full``, ``g0/state``)."""
        known = json.loads((self.cache.cfg.directory / "namespaces.json").read_text())
        found = {}
        for entry in known.values():
            role, _, kind = entry["label"].partition("/")
            if role in ("scheduler", "worker0") and kind:
                digest = bytes.fromhex(entry["namespace"])
                found[kind] = StoredNamespace(digest, int(entry["block_bytes"]), self.block)
        return found

    def full(self) -> StoredNamespace:
        (ns,) = (ns for name, ns in self.groups().items() if name.endswith("/full"))
        return ns

    def states(self) -> list[StoredNamespace]:
        return [ns for name, ns in sorted(self.groups().items()) if name.endswith("/state")]

    def has_state(self, ns: StoredNamespace, ids: list[int], blocks: int) -> bool:
        return self.stored_in(ns, ids, blocks - 1) >= 1 if blocks else False

    def wait_stored(self, ids: list[int]) -> None:
        """Until the attention group holds every claimable block of ``ids`` and each state
        group the state at its last claimable boundary."""
        limit = claimable(ids, self.block)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.stored_in(self.full(), ids) >= limit and all(
                self.has_state(ns, ids, limit) for ns in self.states()
            ):
                return
            time.sleep(0.2)
        raise AssertionError(f"not stored: attention {self.stored_in(self.full(), ids)}/{limit}")

    def counters(self) -> dict[str, float]:
        tokens = settled_tokens(self.url)
        return {**tokens, **kvkeep_events(self.url, STATE_OPS)}

    def loads_in_full(self, ids: list[int]) -> bool:
        _, moved = served(self, ids)
        return moved["loaded"] == claimable(ids, self.block) * self.block

    def replace_state(self, ids: list[int], donor: list[int], blocks: int) -> None:
        """Store, in every state group, ``donor``'s state after ``blocks`` blocks as that of
        ``ids``, with a valid checksum: a wrong state every integrity check passes."""
        client = self.client()
        try:
            for ns in self.states():
                slots = client.acquire(ns.session(), [ns.keys(donor)[blocks - 1]])
                assert slots, "the donor's state is not stored"
                try:
                    data = client.slot_view(slots[0]).copy()
                finally:
                    client.release(slots)
                key = ns.keys(ids)[blocks - 1]
                assert drop(client, ns, [key]), "could not make room for the swapped state"
                (slot,) = client.reserve(ns.session(), [key])
                client.slot_view(slot)[:] = data
                assert client.commit(ns.session(), [slot], [checksum(data.data)]) == 1
        finally:
            client.close()


@pytest.fixture(scope="module")
def rig(tiny_qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    logs = tmp_path_factory.mktemp("gdn-logs")
    with kvkeep_deployment("kvkg", tiny_qwen3_next, logs, max_model_len=8192) as (cache, vllm):
        rig = Rig(cache, vllm, random.Random(2037), block=engine_block(vllm.log_path))
        try:
            yield rig
        finally:
            rig.cache.stop()  # the disk-tier server the truncation test put in its place


def served(rig: Rig, ids: list[int]) -> tuple[Judged, dict[str, float]]:
    """``ids`` sent once vLLM's device cache is emptied, and how the counters moved."""
    before = rig.counters()
    reset_device_cache(rig.url)
    reply = complete(rig.url, ids)
    after = rig.counters()
    return reply, {k: after.get(k, 0) - before.get(k, 0) for k in after}


@dataclass
class Swap:
    """A planted prompt served with another prompt's state, and an untouched control."""

    planted: Reference
    wrong: Judged  # the planted prompt served from kvkeep with the swapped state
    control: Reference
    right: Judged  # the control served from kvkeep
    moved: dict[str, float]  # the counters over the control's request
    claimable_tokens: int  # the control's


def swap_states(rig: Rig, tokens: int) -> Swap:
    """Three stored prompts of ``tokens`` tokens: the planted one (its cold reply without a
    near tie, so a wrong state can be told from drift) gets the donor's state after its last
    claimable block, in every state group, with a valid checksum; then, once the device cache
    is emptied each time, the planted prompt and an untouched control are served."""
    planted, planted_ref = decisive_reference(rig.url, lambda: rig.prompt(tokens), block=rig.block)
    donor, control = rig.prompt(tokens), rig.prompt(tokens)
    control_ref = reference(rig.url, control, block=rig.block)
    for ids in (planted, donor, control):
        complete(rig.url, ids)
        rig.wait_stored(ids)
    rig.replace_state(planted, donor, claimable(planted, rig.block))
    wrong, _ = served(rig, planted)
    right, moved = served(rig, control)
    limit = claimable(control, rig.block) * rig.block
    return Swap(planted_ref, wrong, control_ref, right, moved, limit)


def test_vllm_keeps_its_hybrid_manager_and_kvkeep_keeps_the_state_groups(rig: Rig) -> None:
    log = rig.vllm.log_path.read_text(errors="replace")
    assert "Turning off hybrid kv cache manager" not in log
    assert rig.block == vllm_block(rig.vllm.log_path) > 16, "kvkeep keys by vLLM's hybrid block"
    assert len(rig.states()) == STATE_GROUPS and rig.full() is not None
    sizes = {ns.block_bytes for ns in rig.states()}
    assert len(sizes) == 1 and sizes.pop() < rig.full().block_bytes, "copies padding"


def test_a_swapped_state_changes_the_reply(rig: Rig) -> None:
    """Two stored prompts of one length: the planted one's state, in every state group, is
    the other's (attention KV right, checksums valid). Its reply departs from its cold one
    beyond drift, while an untouched control served the same way equals vLLM's own hit."""
    swap = swap_states(rig, 2100)
    assert swap.moved["loaded"] >= swap.claimable_tokens, "the control was not served by kvkeep"
    assert same_as_hit(swap.right.reply, swap.control.hit), "the control's reply"
    verdict = same_as_cold(swap.wrong.reply, swap.planted.cold)
    assert not verdict, "a swapped state left the reply as it was: the state is not read"


@pytest.mark.parametrize(
    ("part", "fault"),
    [("state", "corrupt"), ("state", "missing"), ("block", "corrupt"), ("block", "missing")],
)
def test_a_bad_state_or_block_is_a_counted_miss_and_the_reply_a_cold_one(
    rig: Rig, part: str, fault: str
) -> None:
    """A corrupt state, or a corrupt attention block half-way along the prompt, fails the
    load, and vLLM recomputes the whole request: its states hold no earlier position to
    resume from. A missing state leaves no boundary to claim (no other state was kept for
    this prompt), and so does a missing block: the claim would stop before it, where no state
    was kept. Nothing loads then. Either way the reply is the cold one."""
    ids = rig.prompt(2100)
    ref = reference(rig.url, ids, block=rig.block)
    complete(rig.url, ids)
    rig.wait_stored(ids)
    limit = claimable(ids, rig.block)
    ns, index = (rig.states()[1], limit - 1) if part == "state" else (rig.full(), limit // 2)
    client = rig.client()
    try:
        if fault == "corrupt":
            assert rig.corrupt(ns, ids, index)
        else:
            assert drop(client, ns, [ns.keys(ids)[index]])
    finally:
        client.close()
    reply, moved = served(rig, ids)
    verdict = same_as_cold(reply.reply, ref.cold)
    assert verdict, f"the reply after a {fault} {part}: {verdict.why}"
    if fault == "corrupt":
        failed = moved["state_load_failed"] if part == "state" else moved["load_failed"]
        assert failed >= 1, f"the corrupt {part} was not refused: {moved}"
    else:
        assert moved["loaded"] == 0 and moved["state_loaded"] == 0, f"claimed: {moved}"


def test_a_turn_that_extends_a_stored_prompt_hits_at_its_last_boundary(rig: Rig) -> None:
    """An agent's next turn: the stored prompt plus 1,200 new tokens. kvkeep kept the state
    at the first prompt's last claimable boundary, so the claim steps back there from the
    new prompt's end (it has no state beyond), and the reply equals vLLM's own hit."""
    first = rig.prompt(2100)
    complete(rig.url, first)
    rig.wait_stored(first)
    turn = first + rig.prompt(1200)
    ref = reference(rig.url, turn, block=rig.block)
    reply, moved = served(rig, turn)
    assert moved["loaded"] == claimable(first, rig.block) * rig.block, moved
    assert moved["state_loaded"] == STATE_GROUPS, moved
    assert same_as_hit(reply.reply, ref.hit), "the extended turn's reply"
    rig.wait_stored(turn)  # and its own last boundary is kept for the turn after


def test_a_cache_server_sigkill_mid_session_costs_no_request(rig: Rig) -> None:
    """An agent's session grows 300 tokens a turn; the cache server is SIGKILLed after the
    third turn and a new one (empty: RAM only) started after the fifth. Every turn is
    answered, and once the connector is back the session's next turn is served from kvkeep,
    states included, with vLLM's own hit's reply."""
    context = rig.session_through_a_server_sigkill()
    context += rig.prompt(300)
    complete(rig.url, context)
    rig.wait_stored(context)
    ref = reference(rig.url, context, block=rig.block)
    reply, moved = served(rig, context)
    assert moved["loaded"] == claimable(context, rig.block) * rig.block, moved
    assert moved["state_loaded"] == STATE_GROUPS, moved
    assert same_as_hit(reply.reply, ref.hit), "the turn after the SIGKILL"


def test_a_state_cut_short_on_disk_is_a_miss_and_the_reply_a_cold_one(rig: Rig) -> None:
    """The cache server is replaced by one with a disk tier on the same socket. A prompt's
    attention blocks and states are written through to disk, and the newest segment loses
    its second half while the server is down (a crash mid-write, a full disk). Restarted, the
    server no longer holds the state at the prompt's last boundary or a block before it, so
    the claim finds no boundary with everything it needs: nothing loads and the reply is the
    cold one."""
    rig.cache.stop()
    rig.cache = CacheServerProcess(replace(rig.cache.cfg, disk="256MiB")).ensure()
    rig.wait_connected()
    ids = rig.prompt(2100)
    ref = reference(rig.url, ids, block=rig.block)
    complete(rig.url, ids)
    rig.wait_stored(ids)
    rig.cache.stop()  # SIGTERM: writes through to disk and seals the segments
    newest = sorted((rig.directory / "disk").glob("seg-*.log"))[-1]
    with open(newest, "r+b") as f:
        f.truncate(newest.stat().st_size // 2)
    rig.cache.ensure()
    rig.wait_connected()
    reply, moved = served(rig, ids)
    limit = claimable(ids, rig.block) * rig.block
    assert moved["loaded"] < limit, f"a cut block or state was served: {moved}"
    verdict = same_as_cold(reply.reply, ref.cold)
    assert verdict, f"the reply after a cut segment: {verdict.why}"


def test_4k_tokens_are_served_from_kvkeep_after_a_vllm_restart(rig: Rig) -> None:
    """The real restart (last in the module: it replaces the module's engine): every
    claimable token of a 4k-token prompt comes from kvkeep, three states among them, and the
    reply equals the cold one and vLLM's own align-mode hit (16 greedy tokens)."""
    ids = rig.prompt(4000)
    ref: Reference = reference(rig.url, ids, max_tokens=16, block=rig.block)
    complete(rig.url, ids)
    rig.wait_stored(ids)
    rig.vllm.stop()
    rig.vllm.start()
    before = rig.counters()
    reply = complete(rig.url, ids, max_tokens=16)
    after = rig.counters()
    loaded = after["loaded"] - before["loaded"]
    limit = claimable(ids, rig.block) * rig.block
    assert loaded >= 0.99 * limit, f"{loaded} of {limit}"
    assert after["state_loaded"] - before["state_loaded"] == STATE_GROUPS
    for rule, expected in ((same_as_cold, ref.cold), (same_as_hit, ref.hit)):
        verdict = rule(reply.reply, expected)
        assert verdict, f"after the restart ({rule.__name__}): {verdict.why}"
