"""Wrong KV is never served or stored, and the tests can see it if it were.

One cache server (a RAM tier of 32 engine blocks: 8 MiB in bf16, 16 MiB in float32) behind
a proxy that can act between the scheduler's LOOKUP and the worker's ACQUIRE, and one vLLM in
mode kvkeep with its device cache resettable, shared by the module. Replies are judged by
``kvkeep.bench.criterion``.

- The guard: the tiny model reads its context (different prefixes, different replies), and a
  block with wrong bytes and a valid checksum changes the reply. Every output comparison in
  the suite is only as good as this.
- A failed load stores no wrong KV: the block that fails and the new tokens vLLM computes on
  top of it in the same step (the "poisoning" scenario), eviction between LOOKUP and ACQUIRE,
  and a SIGKILL of the cache server in that window.
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvkeep.bench.criterion import same_as_cold, same_as_hit
from kvkeep.bench.deploy.rpcproxy import RpcProxy
from kvkeep.bench.deploy.vllm import LaunchConfig, VLLMServer
from kvkeep.bench.metrics import kvkeep_tokens
from kvkeep.launch.cache_server import CacheServerConfig, CacheServerProcess
from kvkeep.store.base import checksum

from .engine import (
    BLOCK,
    MODEL_NAME,
    VOCAB,
    Deployment,
    Judged,
    StoredNamespace,
    arena_problems,
    assert_wrong_block_shows,
    complete,
    corrupt_stored,
    decisive_reference,
    engine_block_bytes,
    full_blocks,
    plant_wrong_block,
    reference,
    reset_device_cache,
    worker_namespace,
)

pytestmark = pytest.mark.e2e

RAM_BLOCKS = 32  # the rig's RAM tier, in engine blocks of the tiny model


@dataclass
class Rig(Deployment):
    proxy: RpcProxy  # between vLLM and the cache server
    asynchronous: bool = False  # every load is asynchronous (load_async_min_blocks 1)
    _namespace: StoredNamespace | None = None

    def namespace(self) -> StoredNamespace:
        """The engine's namespace, read once (tools that say HELLO later relabel it)."""
        if self._namespace is None:
            self._namespace = worker_namespace(self.cache.cfg.directory)
        return self._namespace

    def counters(self) -> dict[str, float]:
        """The connector's counters once two reads a second apart agree (stats reach the API
        server a step or two late), plus the dropped saves."""
        last = self._read()
        for _ in range(15):
            time.sleep(1.0)
            now = self._read()
            if now == last:
                return now
            last = now
        return last

    def _read(self) -> dict[str, float]:
        """Token counters by op, plus event counters by op (``dropped`` for dropped saves)."""
        counts = kvkeep_tokens(self.url)
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        pattern = r'^vllm:kvkeep_events_total\{[^}]*op="(\w+)"[^}]*\} (\S+)'
        ops = ("save_dropped_after_failed_load", "audit_block", "audit_mismatch", "async_load")
        for op in ops:
            counts[op] = 0.0
        for op, value in re.findall(pattern, text, re.M):
            counts[op] = counts.get(op, 0.0) + float(value)
        counts["dropped"] = counts["save_dropped_after_failed_load"]
        return counts

    def stored(self, ids: list[int]) -> int:
        """How many leading full blocks of ``ids`` the cache server holds."""
        return self.stored_in(self.namespace(), ids)

    def plant_wrong_block(self, ids: list[int], index: int) -> None:
        client = self.client()
        try:
            plant_wrong_block(client, self.namespace(), ids, index)
        finally:
            client.close()

    def corrupt_stored(self, ids: list[int]) -> int:
        """Flip a byte of every stored block of ``ids`` in the arena; how many blocks."""
        client = self.client()
        try:
            return corrupt_stored(client, self.namespace(), ids)
        finally:
            client.close()

    def wait_stored(self, ids: list[int], blocks: int) -> None:
        deadline = time.monotonic() + 15
        while self.stored(ids) < blocks and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.stored(ids) >= blocks, f"only {self.stored(ids)} of {blocks} blocks stored"


@pytest.fixture(scope="module", params=["sync", "async"])
def rig(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Rig]:
    """The rig with every load synchronous, then (a second vLLM) every load asynchronous."""
    asynchronous = request.param == "async"
    base = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvkc-{os.getpid()}-{time.time_ns()}"
    ram = str(RAM_BLOCKS * engine_block_bytes(tiny_model))
    cache = CacheServerProcess(CacheServerConfig(base / "cache", ram=ram, disk="0"))
    cache.ensure()
    proxy = RpcProxy(str(base / "proxy.sock"), cache.cfg.socket_path)
    cfg = LaunchConfig(
        model=tiny_model,
        mode="kvkeep",
        max_model_len=8192,
        cache_socket=proxy.listen_path,
        cache_audit=True,
        log_dir=tmp_path_factory.mktemp("correctness-logs"),
        extra_env=(("VLLM_SERVER_DEV_MODE", "1"),),
        connector_settings=(("load_async_min_blocks", 1 if asynchronous else None),),
    )
    rig = Rig(cache, VLLMServer(cfg), random.Random(2026), proxy, asynchronous)
    try:
        rig.vllm.start()
        yield rig
        rig.vllm.stop()
        assert arena_problems(cache.cfg.socket_path) == []
    finally:
        rig.vllm.stop()
        proxy.close()
        rig.cache.stop()
        shutil.rmtree(base, ignore_errors=True)


def sync_only(rig: Rig) -> None:
    """Tests that load nothing, or only the synchronous path, run on the sync rig."""
    if rig.asynchronous:
        pytest.skip("no asynchronous load in this test")


def async_only(rig: Rig) -> None:
    if not rig.asynchronous:
        pytest.skip("asynchronous loads only")


# --- the guard ---------------------------------------------------------------------------------


def test_the_model_reads_its_context(rig: Rig) -> None:
    """Three prefixes before the same suffix give three different greedy replies, and the
    output distribution is far from uniform (dummy weights give ln(1/vocab) everywhere)."""
    sync_only(rig)
    suffix = rig.prompt(64)
    replies = [complete(rig.url, rig.prompt(1500) + suffix, max_tokens=8).reply for _ in range(3)]
    tokens = [tuple(r.token_ids) for r in replies]
    assert len(set(tokens)) == 3, (
        f"the same suffix gave the same reply after other prefixes: {tokens}"
    )
    uniform = -math.log(VOCAB)
    best = max(lp for r in replies for lp in r.logprobs)
    assert best > uniform + 2.0, f"top logprob {best:.3f}: the model's outputs are uniform"


def test_a_wrong_block_changes_the_reply(rig: Rig) -> None:
    """A block with another block's bytes and a valid checksum, served from kvkeep, gives a
    reply that both rules reject; the untouched prompt beside it passes the strict rule.
    On the async rig this is also the proof that asynchronously loaded blocks are read."""
    before = rig.counters()
    planted, planted_ref = decisive_reference(rig.url, lambda: rig.prompt(1300))
    control = rig.prompt(1300)
    refs = [planted_ref, reference(rig.url, control)]
    for ids in (planted, control):
        complete(rig.url, ids)
        rig.wait_stored(ids, full_blocks(ids))
    rig.plant_wrong_block(planted, index=5)
    assert_wrong_block_shows(rig.url, planted, control, refs, full_blocks(planted))
    async_loads = rig.counters()["async_load"] - before["async_load"]
    assert async_loads == (2 if rig.asynchronous else 0)


# --- a failed load stores no wrong KV ---------------------------------------------------------


def test_a_failed_load_stores_no_wrong_kv(rig: Rig) -> None:
    """P is cached; its blocks are corrupted in the arena; P+Q is sent: P's loads fail their
    checksum and the same step computes Q's blocks on top of them. Nothing of that step may
    be stored. The recompute saves P and Q again; served from kvkeep afterwards, P+Q equals
    vLLM's own prefix-cache hit."""
    p, q = rig.prompt(1000), rig.prompt(600)
    ref = reference(rig.url, p + q)
    complete(rig.url, p)
    rig.wait_stored(p, full_blocks(p))
    assert rig.corrupt_stored(p) == full_blocks(p)
    before = rig.counters()
    reset_device_cache(rig.url)
    first = complete(rig.url, p + q)
    mid = rig.counters()
    assert same_as_cold(first.reply, ref.cold), "the reply of the failed load itself is wrong"
    if rig.stored(p + q) < full_blocks(p + q):
        reset_device_cache(rig.url)  # (a connector that did not re-save P saves it now)
        complete(rig.url, p)
    rig.wait_stored(p + q, full_blocks(p + q))
    reset_device_cache(rig.url)
    served = complete(rig.url, p + q)
    after = rig.counters()
    assert served.cached_tokens == full_blocks(p + q) * BLOCK
    verdict = same_as_hit(served.reply, ref.hit)
    assert verdict, f"P+Q served from kvkeep: {verdict.why}"
    assert after["loaded"] - mid["loaded"] == full_blocks(p + q) * BLOCK
    assert mid["load_failed"] > before["load_failed"], "the corrupt blocks were not refused"
    if rig.asynchronous:  # the failed load fed no forward: nothing to drop
        assert mid["dropped"] == before["dropped"]
    else:
        assert mid["dropped"] > before["dropped"], "the failed step's saves were not dropped"
    assert rig.stored(p) == full_blocks(p), "P's blocks were not saved by the recompute"


def test_no_request_reads_a_failed_loads_blocks_before_they_are_recomputed(rig: Rig) -> None:
    """Three agents share a prefix P that kvkeep holds corrupt. A loads P synchronously; B is
    admitted in the same step and would hit P in vLLM's prefix cache, where vLLM puts a
    synchronous load's blocks before they are loaded; C arrives while A recomputes P, 128
    tokens a step. Neither may read P's blocks before A has recomputed them (vLLM itself
    lets both, vllm-project/vllm#49250): every reply is right, and so is what is stored."""
    sync_only(rig)
    p = rig.prompt(1200)
    z, a, b, c = rig.prompt(300), p + rig.prompt(150), p + rig.prompt(150), p + rig.prompt(150)
    refs = [reference(rig.url, ids) for ids in (a, b, c)]
    for ids in (z, p):  # the RAM tier (32 blocks) evicts the references' blocks first
        complete(rig.url, ids)
        rig.wait_stored(ids, full_blocks(ids))
    assert rig.corrupt_stored(p) == full_blocks(p)
    before = rig.counters()
    reset_device_cache(rig.url)
    replies: dict[str, Judged] = {}

    def send(name: str, ids: list[int]) -> threading.Thread:
        thread = threading.Thread(target=lambda: replies.update({name: complete(rig.url, ids)}))
        thread.start()
        time.sleep(0.15)  # in this order into vLLM's queue
        return thread

    sent: list[threading.Thread] = []

    def while_z_loads() -> None:  # A and B queue up behind Z's step: one step admits both
        sent.extend([send("a", a), send("b", b)])
        rig.proxy.arm("ACQUIRE", while_a_loads)
        time.sleep(0.4)  # under the connector's RPC timeout: Z's load succeeds

    def while_a_loads() -> None:  # C is admitted while A recomputes
        sent.append(send("c", c))
        time.sleep(0.4)

    rig.proxy.arm("ACQUIRE", while_z_loads)
    try:
        complete(rig.url, z, max_tokens=32)
        for thread in sent:
            thread.join(timeout=120)
    finally:
        rig.proxy.disarm()
    after = rig.counters()
    assert rig.proxy.fired[-2:] == ["ACQUIRE", "ACQUIRE"], rig.proxy.fired
    assert after["load_failed"] > before["load_failed"], "A's load of the corrupt P did not fail"
    assert after.get("admission_deferred", 0) > before.get("admission_deferred", 0), (
        "B was not admitted beside A's load: the test did not set up what it guards"
    )
    for name, ref in zip("abc", refs, strict=True):
        verdict = same_as_cold(replies[name].reply, ref.cold)
        assert verdict, f"{name.upper()}: {verdict.why}"
    for name, ids, ref in zip("abc", (a, b, c), refs, strict=True):
        rig.wait_stored(ids, full_blocks(ids))
        reset_device_cache(rig.url)
        served = complete(rig.url, ids)
        assert served.cached_tokens == full_blocks(ids) * BLOCK
        verdict = same_as_cold(served.reply, ref.cold)
        assert verdict, f"{name.upper()} served from kvkeep afterwards: {verdict.why}"


def _flood(rig: Rig, blocks: int) -> None:
    """Write ``blocks`` blocks of another namespace: the RAM tier's LRU evicts the rest."""
    ns = rig.namespace()
    client = rig.client()
    try:
        session = client.session(os.urandom(32), ns.block_bytes, "flood")
        for _ in range(blocks):
            slots = client.reserve(session, [os.urandom(32)])
            client.commit(session, slots, [checksum(client.slot_view(s).data) for s in slots])
    finally:
        client.close()


def test_eviction_between_lookup_and_acquire_is_a_clean_miss(rig: Rig) -> None:
    """The proxy holds the worker's ACQUIRE until the RAM tier (32 blocks) has evicted every
    block the scheduler's LOOKUP found: the load misses, vLLM recomputes, the reply is right,
    and what is stored afterwards is right."""
    ids = rig.prompt(1500)
    ref = reference(rig.url, ids)
    complete(rig.url, ids)
    rig.wait_stored(ids, full_blocks(ids))
    before = rig.counters()
    reset_device_cache(rig.url)
    rig.proxy.arm("ACQUIRE", lambda: _flood(rig, 40))
    try:
        raced = complete(rig.url, ids)
    finally:
        rig.proxy.disarm()
    mid = rig.counters()
    assert "ACQUIRE" in rig.proxy.fired
    assert mid["load_failed"] - before["load_failed"] == full_blocks(ids) * BLOCK
    assert mid["loaded"] == before["loaded"]
    assert same_as_cold(raced.reply, ref.cold)
    rig.wait_stored(ids, full_blocks(ids))  # saved again by the recompute
    reset_device_cache(rig.url)
    again = complete(rig.url, ids)
    assert again.cached_tokens == full_blocks(ids) * BLOCK
    assert same_as_hit(again.reply, ref.hit)


def test_sigkill_between_lookup_and_acquire(rig: Rig) -> None:
    """The cache server is SIGKILLed after the LOOKUP and before the ACQUIRE: the load fails,
    vLLM recomputes, nothing wrong is stored, and with a new server the prompt is cached and
    served right again."""
    ids = rig.prompt(1200)
    ref = reference(rig.url, ids)
    complete(rig.url, ids)
    rig.wait_stored(ids, full_blocks(ids))
    reset_device_cache(rig.url)

    def kill() -> None:
        pid = rig.cache.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        rig.cache.stop(timeout_s=5)

    rig.proxy.arm("ACQUIRE", kill)
    try:
        killed = complete(rig.url, ids)
    finally:
        rig.proxy.disarm()
        rig.cache.ensure()
    assert "ACQUIRE" in rig.proxy.fired
    assert same_as_cold(killed.reply, ref.cold)
    # the new server's RAM is empty; the connector reconnects (backoff up to 5 s) and saves
    deadline = time.monotonic() + 30
    while rig.stored(ids) < full_blocks(ids) and time.monotonic() < deadline:
        reset_device_cache(rig.url)
        complete(rig.url, ids)
        time.sleep(1.0)
    assert rig.stored(ids) == full_blocks(ids), "the connector did not save after the restart"
    reset_device_cache(rig.url)
    again = complete(rig.url, ids)
    assert again.cached_tokens == full_blocks(ids) * BLOCK
    assert same_as_hit(again.reply, ref.hit)


# --- the debug aid ------------------------------------------------------------------------------


def test_audit_tells_drift_from_a_wrong_block(rig: Rig) -> None:
    """A block-aligned prompt's last block is computed again on every send (vLLM must compute
    a token) while kvkeep keeps its first copy. With ``audit`` on, the connector compares the
    two: equal or drift, logged at INFO. Once a wrong block is planted there, the same
    comparison counts a mismatch and logs a warning; the block is never loaded (no claim
    covers a prompt's last token), so the reply stays right."""
    sync_only(rig)
    aligned = rig.prompt(10 * BLOCK)
    ref = reference(rig.url, aligned)
    complete(rig.url, aligned)
    rig.wait_stored(aligned, 10)
    before = rig.counters()
    reset_device_cache(rig.url)
    complete(rig.url, aligned)
    mid = rig.counters()
    assert mid["audit_block"] == before["audit_block"] + 1
    rig.plant_wrong_block(aligned, index=9)
    reset_device_cache(rig.url)
    served = complete(rig.url, aligned)
    after = rig.counters()
    assert after["audit_block"] == mid["audit_block"] + 1
    assert after["audit_mismatch"] == mid["audit_mismatch"] + 1
    warnings = [line for line in rig.vllm.log_path.read_text().splitlines()
                if "kvkeep audit" in line and "WARNING" in line]  # fmt: skip
    assert len(warnings) == 1, warnings
    assert same_as_hit(served.reply, ref.hit)


# --- asynchronous loads ------------------------------------------------------------------------


def test_an_async_load_that_fails_mid_way_keeps_its_good_prefix(rig: Rig) -> None:
    """Block 4 of 11 is corrupt in the arena: the asynchronous load fills blocks 0-3, reports
    4-10 failed in the step that reports the request finished, and vLLM computes from block 4.
    The reply is right; the recompute saves blocks 4-10 (the save frontier starts at the
    failed block), and served from kvkeep afterwards the prompt equals vLLM's own hit."""
    async_only(rig)
    ids = rig.prompt(1450)
    ref = reference(rig.url, ids)
    complete(rig.url, ids)
    rig.wait_stored(ids, full_blocks(ids))
    assert rig.corrupt(rig.namespace(), ids, 4)
    before = rig.counters()
    reset_device_cache(rig.url)
    first = complete(rig.url, ids)
    mid = rig.counters()
    assert mid["loaded"] - before["loaded"] == 4 * BLOCK
    assert mid["load_failed"] - before["load_failed"] == (full_blocks(ids) - 4) * BLOCK
    assert first.cached_tokens == full_blocks(ids) * BLOCK  # vLLM counts the claim (notes)
    assert same_as_cold(first.reply, ref.cold), "the reply of the failed load is wrong"
    rig.wait_stored(ids, full_blocks(ids))  # blocks 4.. saved again by the recompute
    reset_device_cache(rig.url)
    served = complete(rig.url, ids)
    verdict = same_as_hit(served.reply, ref.hit)
    assert verdict, f"served from kvkeep after the recompute: {verdict.why}"
    assert rig.counters()["load_failed"] == mid["load_failed"]


def _finished(rig: Rig) -> float:
    """Requests vLLM finished, for any reason but an abort (``vllm:request_success_total``
    does not count those)."""
    text = httpx.get(f"{rig.url}/metrics", timeout=10).text
    pattern = r"^vllm:request_success_total\{[^}]*\} (\S+)"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_an_abort_during_an_async_load_leaks_nothing(rig: Rig) -> None:
    """The proxy holds the load's ACQUIRE while the client gives up on the request (vLLM
    aborts it in WAITING_FOR_REMOTE_KVS and keeps its blocks). The load then copies into
    the aborted request's blocks and reports it; vLLM frees them. The engine keeps serving
    right replies, and no pin is left: flooding the RAM tier evicts every block."""
    async_only(rig)
    ids = rig.prompt(1400)
    ref = reference(rig.url, ids)
    complete(rig.url, ids)
    rig.wait_stored(ids, full_blocks(ids))
    before, finished = rig.counters(), _finished(rig)
    reset_device_cache(rig.url)
    # Held for less than the connector's RPC timeout (1 s), so the load then succeeds.
    rig.proxy.arm("ACQUIRE", lambda: time.sleep(0.8))
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{rig.url}/v1/completions", timeout=0.3,
                       json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 8})  # fmt: skip
        time.sleep(2.0)  # the load finishes after the abort
    finally:
        rig.proxy.disarm()
    assert "ACQUIRE" in rig.proxy.fired
    mid = rig.counters()
    assert _finished(rig) == finished, "vLLM finished the request instead of aborting it"
    assert mid["async_load"] - before["async_load"] == 1
    assert mid["loaded"] - before["loaded"] == full_blocks(ids) * BLOCK
    served = complete(rig.url, ids)  # served from kvkeep again: the engine is fine
    assert served.cached_tokens == full_blocks(ids) * BLOCK
    assert same_as_hit(served.reply, ref.hit)
    _flood(rig, 40)
    ns, client = rig.namespace(), rig.client()
    try:
        left = [k for k in ns.keys(ids) if client.lookup(ns.session(), [k]).num_present]
    finally:
        client.close()
    assert left == [], f"{len(left)} blocks survived the flood: a pin was leaked"
