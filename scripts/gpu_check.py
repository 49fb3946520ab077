"""kvkeep's data-path check on one device; run by ``scripts/gpu-check.sh`` (see there).

Prints one JSON line. With ``--device cuda`` (the default): pinned and pageable host<->device
bandwidth, kvkeep's per-step save and load bandwidth for 16-token blocks in each layout vLLM
uses on CUDA (through ``kvkeep.vllm.cuda.CudaMover``, the connector's own code), a verified
load as the loader runs it (every checksum, then the copy), checksum GB/s by thread count,
and, if a CUDA vLLM imports, an end-to-end smoke test (``--smoke``). With ``--device cpu``:
the same layout figures for a KV cache in host memory (``kvkeep.vllm.mover.Mover``),
beside the old block-by-block, layer-by-layer loop.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvkeep.server.arenamap import ArenaMap
from kvkeep.store.base import checksum
from kvkeep.vllm.cuda import PINS, CudaMover
from kvkeep.vllm.layout import KVLayout, LayoutDescription
from kvkeep.vllm.mover import Mover
from kvkeep.vllm.verify import SlotVerifier, default_threads

# physical axis order of logical [L, B, H, N, C] (vllm/v1/kv_cache_layout.py)
STRIDE_ORDER = {"LBNHC": (0, 1, 3, 2, 4), "LBHNC": (0, 1, 2, 3, 4), "BLHNC": (1, 0, 2, 3, 4)}


def timed(fn: Callable[[], Any], reps: int, sync: Callable[[], None]) -> float:
    """Seconds per call of ``fn``, after one warm-up call."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def bandwidth(device: str, mib: int, sync: Callable[[], None]) -> dict[str, float]:
    """Host<->device copy bandwidth, GB/s, pinned and pageable."""
    nbytes = mib << 20
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for kind, pinned in (("pinned", True), ("pageable", False)):
        host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
        h2d = timed(lambda h=host: dev.copy_(h, non_blocking=True), 5, sync)
        d2h = timed(lambda h=host: h.copy_(dev, non_blocking=True), 5, sync)
        out[f"{kind}_h2d_gbps"] = nbytes / h2d / 1e9
        out[f"{kind}_d2h_gbps"] = nbytes / d2h / 1e9
    return out


def engine(layout: str, shape: tuple[int, ...], device: str) -> KVLayout:
    """A KV cache of one allocation in ``layout``, with per-layer logical views, as vLLM
    0.32 registers it."""
    order = STRIDE_ORDER[layout]
    phys = torch.randn([shape[a] for a in order], device=device).to(torch.bfloat16)
    five = phys.permute(*[order.index(a) for a in range(5)])
    views = {f"l{i}": five[i] for i in range(shape[0])}
    page = five[0, 0].numel() * 2
    desc = LayoutDescription(layout, shape[1], shape[3], 1, tuple(views), page)
    return KVLayout.build(desc, views)


def layout_figures(
    layout: str, shape: tuple[int, ...], batch: int, device: str, old: bool
) -> dict[str, Any]:
    """Save and load GB/s of one step of ``batch`` blocks, through the connector's mover; the
    load target is checked to hold exactly the saved bytes."""
    kv = engine(layout, shape, device)
    mover: Mover = CudaMover(torch.device(device)) if device.startswith("cuda") else Mover()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    ids = torch.randperm(shape[1] - 1)[:batch] + 1
    rows = mover.host_buffer(batch, kv.block_bytes)
    # as a worker maps a cache server's arena; registered (on CUDA) by the connector's own
    # code, and unregistered when the last slot view and this name let it go
    arena = ArenaMap(f"check-{layout}", mmap.mmap(-1, batch * kv.block_bytes))
    mover.pin_arena(arena)
    pinned = PINS.wait(arena, 120.0) if device.startswith("cuda") else None
    slots = [
        np.frombuffer(arena.map, np.uint8, kv.block_bytes, j * kv.block_bytes) for j in range(batch)
    ]
    nbytes = batch * kv.block_bytes
    save = timed(lambda: mover.gather(kv, ids, rows)(), 5, sync)
    for j in range(batch):
        slots[j][:] = rows[j].numpy()
    targets = ids.roll(1).tolist()
    load = timed(lambda: mover.scatter(kv, targets, slots), 5, sync)
    check = torch.empty_like(rows)
    mover.gather(kv, torch.tensor(targets).to(device), check)()
    out = {"fused": kv.fused, "block_bytes": kv.block_bytes, "batch_blocks": batch,
           "arena_pinned": pinned,
           "save_gbps": nbytes / save / 1e9, "load_gbps": nbytes / load / 1e9,
           "round_trip_exact": bool(torch.equal(check, rows))}  # fmt: skip
    # a load as the connector's loader runs it: the checksums on the mover's threads beside
    # the copy in
    views, checksums = [s.data for s in slots], [checksum(s.data) for s in slots]
    verifier = SlotVerifier(mover.verify_threads)

    def verified_load(expected: list[int] = checksums) -> int:
        check = verifier.start(views, expected)
        return mover.scatter_checked(kv, targets, slots, check)

    out["verify_threads"] = verifier.threads
    out["verified_load_gbps"] = nbytes / timed(verified_load, 5, sync) / 1e9
    # a slot that misses its checksum: the load stops there; on CUDA its bytes and the later
    # slots' never reach the KV cache (the host writes them and reports them failed)
    bad = batch // 2
    before = torch.empty_like(rows)
    kv_targets = torch.tensor(targets).to(device)
    mover.gather(kv, kv_targets, before)()
    rng = np.random.default_rng(2)
    for j in range(batch):
        slots[j][:] = rng.integers(0, 255, kv.block_bytes, dtype=np.uint8)
    expected = [checksum(s.data) for s in slots]
    expected[bad] ^= 1
    out["bad_slot_load_stops_there"] = verified_load(expected) == bad
    sync()
    after = torch.empty_like(rows)
    mover.gather(kv, kv_targets, after)()
    written = [j for j in range(batch) if not torch.equal(after[j], before[j])]
    out["bad_slot_blocks_written"] = f"{len(written)} of {batch} (bad one: {bad})"
    if device.startswith("cuda"):
        out["bad_bytes_kept_out"] = written == list(range(bad))
    verifier.close()
    if old:
        out["old_loop_save_gbps"] = nbytes / timed(lambda: old_save(kv, ids, slots), 3, sync) / 1e9
        out["old_loop_load_gbps"] = nbytes / timed(lambda: old_load(kv, ids, slots), 3, sync) / 1e9
    return out


def verify_figures(block_bytes: int, blocks: int) -> dict[str, float]:
    """GB/s of a load's checksums over ``blocks`` arena slots, by thread count (up to the
    cores this process may use): what ``kvkeep.vllm.verify.default_threads`` should pick."""
    arena = mmap.mmap(-1, blocks * block_bytes)
    np.frombuffer(arena, np.uint8)[:] = 7
    views = [memoryview(arena)[j * block_bytes : (j + 1) * block_bytes] for j in range(blocks)]
    checksums = [checksum(v) for v in views]
    out = {}
    for threads in (1, 2, 4, 8):
        if threads > max(1, len(os.sched_getaffinity(0))):
            break
        verifier = SlotVerifier(threads, min_parallel_bytes=0)
        seconds = timed(lambda v=verifier: v.first_bad(views, checksums), 3, lambda: None)
        out[f"threads_{threads}_gbps"] = blocks * block_bytes / seconds / 1e9
        verifier.close()
    out["default_threads"] = default_threads()
    return out


def old_save(kv: KVLayout, ids: torch.Tensor, slots: list[np.ndarray]) -> None:
    """The data path before issue 13: per block, per layer, one synchronous ``copy_``."""
    for j, b in enumerate(ids.tolist()):
        flat = torch.from_numpy(slots[j])
        for i, layer in enumerate(kv._layers):
            page = flat[i * kv.page_bytes : (i + 1) * kv.page_bytes]
            page.view(kv.dtype).view(kv.page_shape).copy_(layer.view[b])


def old_load(kv: KVLayout, ids: torch.Tensor, slots: list[np.ndarray]) -> None:
    """Loads before issue 13: per block, per layer, one synchronous ``copy_``."""
    for j, b in enumerate(ids.tolist()):
        flat = torch.from_numpy(slots[j])
        for i, layer in enumerate(kv._layers):
            page = flat[i * kv.page_bytes : (i + 1) * kv.page_bytes]
            layer.view[b].copy_(page.view(kv.dtype).view(kv.page_shape))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--blocks", type=int, default=1024, help="blocks in the KV cache")
    p.add_argument("--batch", type=int, default=512, help="blocks per step (512 x 16 = 8k)")
    p.add_argument("--old", action="store_true", help="also time the old per-layer loop")
    p.add_argument("--threads", type=int, help="torch CPU threads (1: steady on a busy host)")
    p.add_argument("--smoke-model", help="a model directory: run the end-to-end smoke on it")
    p.add_argument(
        "--smoke-mla-model",
        help="an MLA model directory (`kvkeep model tiny DIR --arch deepseek`): the smoke on "
        "it too, on the GPU's MLA backend",
    )
    p.add_argument(
        "--smoke-hybrid",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a state-layer hybrid's model directory (repeatable): the smoke on it too, in "
        "vLLM's align mamba cache mode",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result: dict[str, Any] = {"device": args.device, "torch": torch.__version__}
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(args.device)
        result["bandwidth"] = bandwidth(args.device, 256, sync)
    shape = (args.layers, args.blocks, args.heads, args.block_size, 2 * args.head_dim)
    result["shape_LBHNC"] = list(shape)
    result["layouts"] = {
        name: layout_figures(name, shape, args.batch, args.device, args.old)
        for name in STRIDE_ORDER
    }
    block_bytes = next(iter(result["layouts"].values()))["block_bytes"]
    result["verify"] = verify_figures(block_bytes, args.batch)
    ok = all(
        v["round_trip_exact"]
        and v["bad_slot_load_stops_there"]
        and v.get("bad_bytes_kept_out", True)
        for v in result["layouts"].values()
    )
    if args.smoke_model:
        from gpu_smoke import smoke  # a CUDA vLLM, the cache server and the model

        result["smoke"] = smoke(args.smoke_model)
        ok = ok and bool(result["smoke"].get("ok"))
    if args.smoke_mla_model:
        from gpu_smoke import smoke

        result["smoke_mla"] = smoke(args.smoke_mla_model)
        ok = ok and bool(result["smoke_mla"].get("ok"))
    if args.smoke_hybrid:
        from gpu_smoke import smoke

        result["smoke_hybrid"] = {}
        for entry in args.smoke_hybrid:
            name, _, model = entry.partition("=")
            result["smoke_hybrid"][name] = smoke(model)
            ok = ok and bool(result["smoke_hybrid"][name].get("ok"))
    result["ok"] = ok
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
