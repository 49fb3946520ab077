"""CUDA specifics of the data path, in one place; nothing else in kvkeep touches CUDA.

- The arena is registered as pinned memory (``cudaHostRegister``) so that copies between it
  and the device are DMA, not staged through pageable bounce buffers; it is registered again
  when a cache-server restart re-maps the arena (a new instance), and the old map released.
- Each worker (one per rank) has its own side stream. A save gathers the step's blocks into a
  device staging buffer on that stream, records an event the engine's stream waits for (so
  vLLM may reuse the blocks once they are read, without the CPU waiting), then copies the
  staging buffer to pinned host rows with one non-blocking DMA; the saver's thread waits for
  that copy's event before it checksums and commits.
- A load copies its slots to device staging (one DMA per block, from pinned memory) while
  the host checks their checksums on several threads, then scatters the slots that passed
  with one ``index_copy_`` that the engine's stream waits for (a bad slot's bytes never reach
  the KV cache), and waits for the copies (the slots are unpinned right after).
- An asynchronous load (vLLM's ``load_async``) does the same on a second side stream, from
  the loader's thread: it waits for a fence event recorded on the engine's stream when the
  load was started (blocks just allocated may still be read by earlier kernels), and the
  thread waits for the scatter before it reports the request finished. The engine's stream
  waits for nothing: vLLM schedules the request only after that report.

Importing this module needs no GPU; ``mover_for`` picks the host ``Mover`` for a CPU cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from kvkeep.vllm.layout import KVLayout
from kvkeep.vllm.transfer import ArenaRegion, Fence, Mover, Wait
from kvkeep.vllm.verify import Check, default_threads

log = logging.getLogger("vllm.kvkeep")


def mover_for(layout: KVLayout) -> Mover:
    """The mover for the device the KV cache lives on."""
    if layout.device.type == "cuda":
        return CudaMover(layout.device)
    return Mover()


class CudaMover(Mover):
    """Batched, stream-ordered copies for a KV cache on one CUDA device (one per rank)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # one core hashes slower than PCIe copies: a load's checksums run on several threads
        self.verify_threads = default_threads()
        self.stream = torch.cuda.Stream(device)
        self.load_stream = torch.cuda.Stream(device)  # asynchronous loads, off the step
        self._pinned: ArenaRegion | None = None

    def host_buffer(self, rows: int, row_bytes: int) -> torch.Tensor:
        return torch.zeros(rows, row_bytes, dtype=torch.uint8, pin_memory=True)

    def gather(self, layout: KVLayout, ids: torch.Tensor, rows: torch.Tensor) -> Wait:
        engine = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(engine)  # the forward that wrote the blocks comes first
        with torch.cuda.stream(self.stream):
            staged = torch.empty(rows.shape, dtype=torch.uint8, device=self.device)
            layout.gather_blocks(ids.to(self.device, non_blocking=True), staged)
            read = torch.cuda.Event()
            read.record(self.stream)
            rows.copy_(staged, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self.stream)
        engine.wait_event(read)  # vLLM may overwrite the blocks only after they were read
        return landed.synchronize

    def fence(self) -> Fence:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def scatter(
        self, layout: KVLayout, block_ids: Sequence[int], slots: Sequence[np.ndarray]
    ) -> None:
        self.scatter_checked(layout, block_ids, slots, Check.passed(len(slots)))

    def scatter_background(
        self, layout: KVLayout, block_ids: Sequence[int], slots: Sequence[np.ndarray], after: Fence
    ) -> None:
        self.scatter_checked(layout, block_ids, slots, Check.passed(len(slots)), after)

    def scatter_checked(
        self,
        layout: KVLayout,
        block_ids: Sequence[int],
        slots: Sequence[np.ndarray],
        check: Check,
        after: Fence | bool = False,
    ) -> int:
        """One batched DMA of the slots into device staging rows; the host waits for the
        checksums while it runs, then only the slots that passed are scattered into the KV
        cache, so a bad slot's bytes never reach it. On the step (``after`` False) on
        ``stream``, after the engine's work so far, and the engine's stream waits for the
        scatter; off it on ``load_stream``, after ``after``, and this waits for the scatter."""
        on_step = after is False
        stream = self.stream if on_step else self.load_stream
        engine = torch.cuda.current_stream(self.device)
        copied = torch.cuda.Event()
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                if on_step:
                    stream.wait_stream(engine)
                elif isinstance(after, torch.cuda.Event):
                    stream.wait_event(after)
                staged = torch.empty(
                    len(slots), layout.block_bytes, dtype=torch.uint8, device=self.device
                )
                for j, slot in enumerate(slots):
                    staged[j].copy_(torch.from_numpy(slot), non_blocking=True)
                copied.record(stream)
        finally:
            good = check.result()  # the checksums run on the host while the DMA does
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if good:
                ids = torch.tensor(list(block_ids[:good]), dtype=torch.int64)
                layout.scatter_blocks(ids.to(self.device, non_blocking=True), staged[:good])
            done = torch.cuda.Event()
            done.record(stream)
        copied.synchronize()  # the slots are unpinned as soon as this returns
        if on_step:
            engine.wait_stream(stream)  # the forward reads the blocks after the scatter
        else:
            done.synchronize()  # the request is reported after this
        return good

    def pin_arena(self, region: ArenaRegion | None) -> None:
        """Register ``region`` as pinned host memory, once per cache-server instance; the
        previous instance's region is unregistered. Failures are logged, not raised: an
        unpinned arena is slower, never wrong."""
        if region is None or (
            self._pinned is not None and self._pinned.instance == region.instance
        ):
            return
        if self._pinned is not None:
            _cudart_call("cudaHostUnregister", self._pinned.address)
            self._pinned = None
        if _cudart_call("cudaHostRegister", region.address, region.length, 0):
            self._pinned = region
            log.info("kvkeep: arena of %s (%d bytes) pinned", region.instance, region.length)


def _cudart_call(name: str, *args: int) -> bool:
    """Call a CUDA runtime function through torch; True when it returned cudaSuccess."""
    try:
        result = getattr(torch.cuda.cudart(), name)(*args)
    except Exception as exc:
        log.warning("kvkeep: %s failed: %s", name, exc)
        return False
    code = int(result[0] if isinstance(result, tuple) else result)
    if code:
        log.warning("kvkeep: %s returned CUDA error %d; copies stay unpinned", name, code)
    return code == 0
