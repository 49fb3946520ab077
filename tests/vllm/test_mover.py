"""The host mover and the device-neutral parts of ``kvkeep.vllm.cuda``, on CPU tensors."""

from __future__ import annotations

import gc
import mmap
import threading
import time
from pathlib import Path

import numpy as np
import torch

from kvkeep.server.arenamap import ArenaMap
from kvkeep.vllm import cuda
from kvkeep.vllm.layout import KVLayout, LayoutDescription
from kvkeep.vllm.mover import Mover, region_of

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
    mover.pin_arena(ArenaMap("i", arena))  # a no-op for a host cache
    mover.bind_thread()  # likewise
    mover.scatter(kv, [7, 0, 2], slots)
    again = mover.host_buffer(3, kv.block_bytes)
    mover.gather(kv, torch.tensor([7, 0, 2]), again)
    assert torch.equal(again, rows)


def test_region_of_names_the_whole_mapping() -> None:
    arena = mmap.mmap(-1, 1 << 16)
    region = region_of("inst", arena)
    assert region.length == 1 << 16 and region.instance == "inst"
    assert region.address == np.frombuffer(arena, np.uint8).ctypes.data


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in a mapping of this process, by /proc/self/maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return True
    return False


class _Recorder:
    """Stands in for cudaHostRegister/Unregister (no GPU here): records the calls, their
    thread, and whether the memory was still mapped when it was unregistered."""

    def __init__(self, ok: bool = True) -> None:
        self.ok = ok
        self.calls: list[tuple[str, int, str, bool]] = []
        self.gate = threading.Event()
        self.gate.set()

    def register(self, address: int, length: int, device: torch.device) -> bool:
        self.gate.wait(10)
        self.calls.append(("register", address, threading.current_thread().name, True))
        return self.ok

    def unregister(self, address: int) -> bool:
        name = threading.current_thread().name
        self.calls.append(("unregister", address, name, _mapped(address)))
        return True


def test_pins_register_a_mapping_once_off_the_step_and_unregister_it_before_its_unmap() -> None:
    rec = _Recorder()
    pins = cuda.Pins(rec.register, rec.unregister)
    arena = ArenaMap("inst", mmap.mmap(-1, 1 << 20))
    address = np.frombuffer(arena.map, np.uint8).ctypes.data
    rec.gate.clear()  # registering takes a while: pin() must not wait for it
    t0 = time.monotonic()
    for device in ("cuda:0", "cuda:0", "cuda:1"):  # every group's mover, every thread
        pins.pin(arena, torch.device(device))
    assert time.monotonic() - t0 < 1.0
    assert not pins.wait(arena, 0.05)  # still registering
    rec.gate.set()
    assert pins.wait(arena, 10.0)
    assert rec.calls == [("register", address, "kvkeep-pin", True)]
    del arena  # the last holder lets it go, as arenamap.retire does after a server restart
    gc.collect()
    assert rec.calls[1:] == [("unregister", address, "kvkeep-pin", True)]
    assert not _mapped(address)


def test_a_mapping_that_failed_to_pin_is_not_tried_again_nor_unpinned() -> None:
    rec = _Recorder(ok=False)
    pins = cuda.Pins(rec.register, rec.unregister)
    arena = ArenaMap("inst", mmap.mmap(-1, 1 << 16))
    pins.pin(arena, torch.device("cuda:0"))
    assert not pins.wait(arena, 10.0)
    pins.pin(arena, torch.device("cuda:0"))
    assert not pins.wait(arena, 10.0)
    del arena
    gc.collect()
    assert [c[0] for c in rec.calls] == ["register"]


def test_a_mapping_gone_before_its_turn_is_never_registered() -> None:
    rec = _Recorder()
    pins = cuda.Pins(rec.register, rec.unregister)
    first, second = ArenaMap("a", mmap.mmap(-1, 1 << 16)), ArenaMap("b", mmap.mmap(-1, 1 << 16))
    rec.gate.clear()
    pins.pin(first, torch.device("cuda:0"))  # holds the pin thread
    pins.pin(second, torch.device("cuda:0"))
    del second
    gc.collect()
    rec.gate.set()
    assert pins.wait(first, 10.0)
    assert [c[0] for c in rec.calls] == ["register"]
