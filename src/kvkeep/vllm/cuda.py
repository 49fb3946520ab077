"""CUDA specifics of the data path, in one place; nothing else in kvkeep touches CUDA.

- The arena is registered as pinned memory once per mapping in the process (`Pins`), off the
  step, and unregistered before it is unmapped; until it is registered copies are slower,
  never wrong.
- Each worker has its own side streams. A save gathers the step's blocks into device staging
  and DMAs them to pinned host rows; the engine's stream waits only for the gather.
- A load DMAs its slots to device staging (at most ``STAGE_BYTES`` at once) while the host
  checks their checksums, then scatters only the slots that passed: a bad slot's bytes never
  reach the KV cache. An asynchronous load's scatter waits for a fence on the engine's stream,
  and its request is reported only after the scatter.
- kvkeep's own threads (saver, loader) make the mover's device current first (``bind_thread``).

Importing this module needs no GPU; ``mover_for`` picks the host ``Mover`` for a CPU cache.
Streams, events and their reasons: docs/notes/cuda.md.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvkeep.host.background import start_thread
from kvkeep.server.arenamap import ArenaMap
from kvkeep.vllm.layout import KVLayout
from kvkeep.vllm.mover import Fence, Mover, Wait, region_of
from kvkeep.vllm.verify import Check, default_threads

log = logging.getLogger("vllm.kvkeep")


def mover_for(layout: KVLayout) -> Mover:
    """The mover for the device the KV cache lives on."""
    if layout.device.type == "cuda":
        return CudaMover(layout.device)
    return Mover()


STAGE_BYTES = 256 << 20  # device staging a load takes at once: a long prefix loads in parts


class CudaMover(Mover):
    """Batched, stream-ordered copies for a KV cache on one CUDA device (one per rank)."""

    def __init__(self, device: torch.device) -> None:
        if device.index is None:  # "cuda": the current one (set_device needs an index)
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # one core hashes slower than PCIe copies: a load's checksums run on several threads
        self.verify_threads = default_threads()
        self.stream = torch.cuda.Stream(device)  # saves, and loads' scatters on the step
        self.load_stream = torch.cuda.Stream(device)  # asynchronous loads' scatters
        # loads' host-to-device DMA, behind nothing else: not the last save's gather (on
        # ``stream``, after the forward), and beside saves' device-to-host copies
        self.copy_stream = torch.cuda.Stream(device)

    # A CUDA call on a thread with no current device makes a context on device 0: hundreds
    # of MiB on another rank's GPU.
    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def host_buffer(self, rows: int, row_bytes: int) -> torch.Tensor:
        return torch.zeros(rows, row_bytes, dtype=torch.uint8, pin_memory=True)

    def gather(self, layout: KVLayout, ids: torch.Tensor, rows: torch.Tensor) -> Wait:
        engine = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(engine)  # the forward that wrote the blocks comes first
        with torch.cuda.stream(self.stream):
            staged = torch.empty(rows.shape, dtype=torch.uint8, device=self.device)
            layout.gather_blocks(_on_device(ids, self.device), staged)
            read = torch.cuda.Event()
            read.record(self.stream)
            rows.copy_(staged, non_blocking=True)
            landed = torch.cuda.Event(blocking=True)  # waited for by a thread: no spinning
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

    def scatter_checked(
        self,
        layout: KVLayout,
        block_ids: Sequence[int],
        slots: Sequence[np.ndarray],
        check: Check,
        after: Fence | bool = False,
    ) -> int:
        """The slots' DMA into device staging starts at once (it waits for nothing: the
        staging rows are fresh); the host waits for the checksums while it runs. Then, after
        the engine's work so far (on the step, ``after`` False, on ``stream``) or after
        ``after`` (off it, on ``load_stream``), only the slots that passed are scattered into
        the KV cache, so a bad slot's bytes never reach it. A load of more than
        ``STAGE_BYTES`` stages its first part beside the checksums and the rest part by part.
        On the step the engine's stream waits for the scatter; off it this does. The slots
        are no longer read when this returns, whatever it raises."""
        on_step = after is False
        stream = self.stream if on_step else self.load_stream
        engine = torch.cuda.current_stream(self.device)
        part = max(1, STAGE_BYTES // max(layout.block_bytes, 1))
        # ``copied`` marks the DMA issued (on ``copy_stream``), ``done`` the scatter
        copied, done = torch.cuda.Event(blocking=True), torch.cuda.Event(blocking=True)
        staged: torch.Tensor | None = None
        good = 0
        try:
            try:
                staged = self._stage(layout, slots[:part], copied)
            finally:
                good = check.result()  # the checksums run on the host while the DMA does
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                if on_step:
                    stream.wait_stream(engine)
                elif isinstance(after, torch.cuda.Event):
                    stream.wait_event(after)
                for lo in range(0, good, part):
                    hi = min(lo + part, good)
                    if lo:
                        staged = None  # its memory goes back once the scatter has read it
                        staged = self._stage(layout, slots[lo:hi], copied)
                    assert staged is not None
                    stream.wait_event(copied)
                    staged.record_stream(stream)  # made on ``copy_stream``, read here
                    ids = torch.tensor(list(block_ids[lo:hi]), dtype=torch.int64)
                    layout.scatter_blocks(_on_device(ids, self.device), staged[: hi - lo])
        finally:
            with torch.cuda.device(self.device):
                # whatever was issued, even by a ``_stage`` that raised, ends before these
                copied.record(self.copy_stream)
                done.record(stream)
            if on_step:
                engine.wait_stream(stream)  # the forward reads the blocks after the scatter
                # The slots are unpinned once this returns. A load of one part waits here
                # for its DMA only, not for the engine's work.
                copied.synchronize()
            else:
                done.synchronize()  # the request is reported after this
        return good

    def _stage(
        self, layout: KVLayout, slots: Sequence[np.ndarray], copied: torch.cuda.Event
    ) -> torch.Tensor:
        """The slots on the device, one non-blocking DMA each on ``copy_stream``, which
        waits for nothing (the staging rows are fresh); ``copied`` marks their end."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
            staged = torch.empty(
                len(slots), layout.block_bytes, dtype=torch.uint8, device=self.device
            )
            for j, slot in enumerate(slots):
                staged[j].copy_(torch.from_numpy(slot), non_blocking=True)
            copied.record(self.copy_stream)
        return staged

    def pin_arena(self, arena: ArenaMap | None) -> None:
        """Have ``arena`` registered as pinned host memory (`Pins`, in the background)."""
        if arena is not None:
            PINS.pin(arena, self.device)


def _on_device(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host ``ids`` on the device by a non-blocking copy from pinned memory, on the current
    stream: from pageable memory the copy would first wait for the stream's earlier work."""
    if ids.device.type == "cuda":
        return ids
    return ids.pin_memory().to(device, non_blocking=True)


Register = Callable[[int, int, torch.device], bool]
Unregister = Callable[[int], bool]


class Pins:
    """This process's arena mappings registered as pinned host memory: each once, however
    many movers, groups and threads ask, and unregistered before it is unmapped.

    Registering and unregistering run on one thread of their own (``kvkeep-pin``), in the
    order asked: registering tens of GiB takes seconds, and a failed call leaves a CUDA error
    on its thread that the next kernel launch there would raise. A mapping that failed is
    not tried again. ``wait`` tells whether a mapping is registered (tools and tests)."""

    def __init__(self, register: Register | None = None, unregister: Unregister | None = None):
        self._register = register or _cuda_register
        self._unregister = unregister or _cuda_unregister
        self._lock = threading.Lock()
        # re-entrant: a mapping freed by a collection while this is held unpins through it
        self._start_lock = threading.RLock()
        self._state: weakref.WeakKeyDictionary[ArenaMap, threading.Event] = (
            weakref.WeakKeyDictionary()
        )
        self._registered: dict[int, bool] = {}  # address -> registered
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def pin(self, arena: ArenaMap, device: torch.device) -> None:
        """Register ``arena`` in the background, unless it was asked before; never blocks."""
        with self._lock:
            if arena in self._state:
                return
            ended = self._state[arena] = threading.Event()
            ref = weakref.ref(arena)
            self._submit(lambda: self._pin(ref, device, ended))

    def wait(self, arena: ArenaMap, timeout_s: float) -> bool:
        """Whether ``arena`` is registered, waiting up to ``timeout_s`` for a registration
        asked before; False if it was never asked, failed, or is still running."""
        with self._lock:
            ended = self._state.get(arena)
        if ended is None or not ended.wait(timeout_s):
            return False
        address, _ = _span(arena)
        return self._registered.get(address, False)

    def _submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)
        with self._start_lock:  # one pin thread: its jobs run in the order asked
            if self._thread is None or not self._thread.is_alive():
                self._thread = start_thread(self._run, "kvkeep-pin")

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # each job says what failed; the thread serves the next one
                log.exception("kvkeep: pinning the arena failed")

    def _pin(
        self, ref: weakref.ref[ArenaMap], device: torch.device, ended: threading.Event
    ) -> None:
        arena = ref()  # held while registering: its mapping cannot go meanwhile
        try:
            if arena is None:
                return
            address, length = _span(arena)
            try:
                ok = self._register(address, length, device)
            except Exception as exc:
                log.warning("kvkeep: cannot pin the arena (%s); copies stay unpinned", exc)
                ok = False
            if ok:
                self._registered[address] = True
                # Runs when the mapping's last holder lets it go, before its memory is
                # unmapped (an ArenaMap's weak references go before its map); not at exit.
                weakref.finalize(arena, self._unpin, address).atexit = False
                log.info("kvkeep: arena of %s (%d bytes) pinned", arena.instance, length)
        finally:
            ended.set()

    def _unpin(self, address: int) -> None:
        """Unregister ``address`` on the pin thread, and wait for it (the caller is about to
        unmap it); at once when the pin thread itself dropped the mapping."""
        if threading.current_thread() is self._thread:
            self._unpin_now(address)
            return
        ended = threading.Event()

        def job() -> None:
            self._unpin_now(address)
            ended.set()

        self._submit(job)
        if not ended.wait(60.0):
            log.warning("kvkeep: unpinning an old arena took over 60 s; going on")

    def _unpin_now(self, address: int) -> None:
        if self._registered.pop(address, False):
            try:
                self._unregister(address)
            except Exception as exc:
                log.warning("kvkeep: cannot unpin an old arena: %s", exc)


def _span(arena: ArenaMap) -> tuple[int, int]:
    region = region_of(arena.instance, arena.map)
    return region.address, region.length


def _cuda_register(address: int, length: int, device: torch.device) -> bool:
    torch.cuda.set_device(device)  # this thread's only device: no context on device 0
    return _cudart_call("cudaHostRegister", address, length, 1)  # 1: cudaHostRegisterPortable


def _cuda_unregister(address: int) -> bool:
    return _cudart_call("cudaHostUnregister", address)


PINS = Pins()


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
