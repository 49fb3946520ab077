"""How blocks move between the engine's KV cache and host memory, for a cache in host memory.

A ``Mover`` does a step's copies for one device. This one serves a KV cache in host memory
(vLLM's CPU backend): saves are one batched gather into kvkeep's staging rows; loads copy each
block straight from its arena slot (one op per block when the layout is fused, see
``KVLayout``). Measured on 2 cores for 128-token blocks, that beats staging the slots and one
``index_copy_``, which pays a second memcpy (see ``scripts/gpu-check.sh`` and the issue-13
note). ``kvkeep.vllm.cuda.CudaMover`` is the device one.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvkeep.server.arenamap import ArenaMap
from kvkeep.vllm.layout import KVLayout
from kvkeep.vllm.verify import Check, host_threads

Wait = Callable[[], None]
Fence = object | None
"""The engine's work issued so far, marked on the step's thread (a CUDA event; None on the
host, where every engine op has finished when the step's Python code runs)."""


RUN_BYTES = 1 << 20  # a host load copies, then checks, this much at a time (a core's L2)


class ArenaRegion(NamedTuple):
    """The arena mapping of one cache-server instance, as host memory to register."""

    instance: str
    address: int
    length: int


def region_of(instance: str, buffer: mmap.mmap) -> ArenaRegion:
    """The address and length of a mapped arena."""
    array = np.frombuffer(buffer, dtype=np.uint8)
    return ArenaRegion(instance, int(array.ctypes.data), int(array.size))


def _done() -> None:
    return None


class Mover:
    """Copies for a KV cache in host memory. Every method blocks until its copy is done
    (``gather`` returns an already finished wait) and raises only on a bad buffer."""

    def __init__(self) -> None:
        # Threads a load's checksums may run on, the loader's own included
        # (``kvkeep.vllm.verify``): a helper that hashes while the loader copies, where the
        # copy (torch's thread team, the engine's on a CPU engine) leaves it a core.
        self.verify_threads = host_threads(torch.get_num_threads())

    def pin_arena(self, arena: ArenaMap | None) -> None:
        """Make the cache server's arena fast to copy from (a no-op in host memory)."""

    def bind_thread(self) -> None:
        """Make the calling thread (one of kvkeep's own) ready to copy for this mover's
        device (a no-op in host memory)."""

    def host_buffer(self, rows: int, row_bytes: int) -> torch.Tensor:
        """A host staging buffer of ``rows`` rows, its pages touched now (not on the step)."""
        return torch.zeros(rows, row_bytes, dtype=torch.uint8)

    def gather(self, layout: KVLayout, ids: torch.Tensor, rows: torch.Tensor) -> Wait:
        """Start copying engine blocks ``ids`` into host ``rows``; returns a wait for the end.
        After it returns, vLLM may overwrite the blocks (the copy has read them or will have
        before any later work on the engine's stream)."""
        layout.gather_blocks(ids, rows)
        return _done

    def scatter(
        self, layout: KVLayout, block_ids: Sequence[int], slots: Sequence[np.ndarray]
    ) -> None:
        """Copy each arena slot ``slots[j]`` into engine block ``block_ids[j]``; returns once
        the blocks hold the bytes."""
        for block_id, slot in zip(block_ids, slots, strict=True):
            layout.scatter(block_id, slot)

    def scatter_checked(
        self,
        layout: KVLayout,
        block_ids: Sequence[int],
        slots: Sequence[np.ndarray],
        check: Check,
        after: Fence | bool = False,
    ) -> int:
        """Copy the slots in while ``check`` runs their checksums; how many leading slots
        passed (``check.result()``). Here every run of about ``RUN_BYTES`` is copied straight
        into its engine blocks, then the loader's thread checks what no helper has taken of
        it, while it is still in cache; copying stops at a run past a slot known bad. The
        blocks from the first bad slot on may hold any bytes: the loader reports them
        failed, so vLLM recomputes them before it reads them. ``after`` is ignored: on the
        host every engine op has finished when Python runs."""
        run = max(1, RUN_BYTES // max(layout.block_bytes, 1))
        try:
            for lo in range(0, len(slots), run):
                if check.failed_before(lo):
                    break
                self.scatter(layout, block_ids[lo : lo + run], slots[lo : lo + run])
                check.help(lo + run)
        finally:
            good = check.result()
        return good

    def fence(self) -> Fence:
        """Mark the engine's work issued so far (call on the step's thread)."""
        return None
