"""The host mover and the device-neutral parts of ``kvkeep.vllm.cuda``, on CPU tensors."""

from __future__ import annotations

import mmap

import numpy as np
import torch

from kvkeep.vllm import cuda
from kvkeep.vllm.layout import KVLayout, LayoutDescription
from kvkeep.vllm.transfer import Mover, region_of

L, B, H, N, C = 3, 8, 2, 16, 8


def engine(layout: str, order: tuple[int, ...]) -> KVLayout:
    """One allocation in physical axis ``order`` of logical [L, B, H, N, C], as vLLM does."""
    logical = (L, B, H, N, C)
    phys = torch.randn([logical[a] for a in order]).to(torch.bfloat16)
    five = phys.permute(*[order.index(a) for a in range(5)])
    views = {f"l{i}": five[i] for i in range(L)}
    desc = LayoutDescription(layout, B, N, 1, tuple(views), H * N * C * 2)
    return KVLayout.build(desc, views)


def test_a_host_cache_gets_the_host_mover() -> None:
    kv = engine("LBHNC", (0, 1, 2, 3, 4))
    assert type(cuda.mover_for(kv)) is Mover


def test_host_mover_saves_then_loads_through_arena_slots() -> None:
    """Rows gathered on the step, written into slots of a mapped arena, scattered into other
    blocks: the blocks then hold exactly the saved bytes (BLHNC, block-outermost)."""
    kv = engine("BLHNC", (1, 0, 2, 3, 4))
    mover = Mover()
    rows = mover.host_buffer(3, kv.block_bytes)
    assert mover.gather(kv, torch.tensor([1, 4, 6]), rows)() is None
    arena = mmap.mmap(-1, 3 * kv.block_bytes)
    slots = [np.frombuffer(arena, np.uint8, kv.block_bytes, j * kv.block_bytes) for j in range(3)]
    for j, slot in enumerate(slots):
        slot[:] = rows[j].numpy()
    mover.pin_arena(region_of("i", arena))  # a no-op for a host cache
    mover.scatter(kv, [7, 0, 2], slots)
    again = mover.host_buffer(3, kv.block_bytes)
    mover.gather(kv, torch.tensor([7, 0, 2]), again)
    assert torch.equal(again, rows)


def test_region_of_names_the_whole_mapping() -> None:
    arena = mmap.mmap(-1, 1 << 16)
    region = region_of("inst", arena)
    assert region.length == 1 << 16 and region.instance == "inst"
    assert region.address == np.frombuffer(arena, np.uint8).ctypes.data
