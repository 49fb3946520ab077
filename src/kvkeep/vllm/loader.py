"""Loads: fill engine blocks from arena slots, on the step or in the background.

``BlockLoader.load`` is one request's load on one connection::

    ACQUIRE keys (pins) -> copy the slots in, their checksums beside the copy -> RELEASE

RELEASE is sent without waiting for its reply (read before the connection's next call). A
synchronous load runs in ``start_load_kv``, before the forward; an asynchronous one (vLLM's
``load_async``) on ``BackgroundLoads``' thread and connection, and the step's
``get_finished`` collects what has finished since the last step. Every submitted request is
reported exactly once, loaded or not, with the engine blocks it failed to fill (vLLM
recomputes from the first); no forward runs on a failed asynchronous load, so it costs no
saves. Pins are released once the copy is done, or when the connection dies.
The load path in detail: docs/notes/loads.md.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvkeep.host.background import start_thread, unbind
from kvkeep.server.client import CacheUnavailable, KVKeepClient, Session, SlotRef
from kvkeep.vllm.layout import KVLayout
from kvkeep.vllm.mover import Fence, Mover
from kvkeep.vllm.plan import RequestLoad
from kvkeep.vllm.verify import SlotVerifier

log = logging.getLogger("vllm.kvkeep")

Count = Callable[[str, float], None]
Timed = Callable[[str], contextlib.AbstractContextManager[None]]


class LoadResult(NamedTuple):
    """How one request's load ended: ``loaded`` leading blocks hold their KV; the engine
    blocks in ``failed`` (the rest) do not."""

    req_id: str
    loaded: int
    failed: tuple[int, ...]


def result_of(request: RequestLoad, loaded: int) -> LoadResult:
    return LoadResult(request.req_id, loaded, tuple(b.block_id for b in request.blocks[loaded:]))


class BlockLoader:
    """Fills engine blocks from arena slots over one connection. Not for concurrent calls."""

    def __init__(
        self, client: KVKeepClient, layout: KVLayout, mover: Mover, count: Count, timed: Timed
    ) -> None:
        self.client, self.layout, self.mover = client, layout, mover
        self._count, self._timed = count, timed
        self.verifier = SlotVerifier(mover.verify_threads)

    def load(self, session: Session, request: RequestLoad, after: Fence | bool = False) -> int:
        """How many leading blocks of ``request`` were verified and copied in (0 when the copy
        itself failed: a batched copy may have written any of them). Never raises.
        ``after``: False for a load on the step; else a background load, ordered after this
        fence (``Mover.fence``)."""
        slots: list[SlotRef] = []
        corrupt: list[SlotRef] = []
        good = 0
        try:
            with self._timed("acquire_rpc_s"):
                slots = self.client.acquire(session, [b.key for b in request.blocks])
            good = self._verify_and_copy(request, slots, after)
            if good < len(slots):
                log.warning("kvkeep: block %s failed its checksum", slots[good].key.hex()[:12])
                # Report every bad one of the rest too (this path is rare): the server drops
                # them, so one pass is enough for loads or saves to replace them.
                corrupt = [s for s in slots[good:] if not self.client.verify(s)]
        except Exception as exc:
            log.warning(
                "kvkeep: load of %s failed (%d blocks verified): %s", request.req_id, good, exc
            )
            good = 0
        finally:
            self._release(slots, corrupt)
        return good

    def _verify_and_copy(
        self, request: RequestLoad, slots: Sequence[SlotRef], after: Fence | bool
    ) -> int:
        """Copy the slots in while their checksums run beside the copy (``SlotVerifier``,
        ``Mover.scatter_checked``); how many leading slots hold their block's key and passed.
        The engine blocks from there on are reported failed, whatever the copy put in them."""
        self.mover.pin_arena(self.client.arena())
        pairs = zip(request.blocks, slots, strict=False)
        whole = min(len(request.blocks), len(slots))
        keyed = next((i for i, (b, s) in enumerate(pairs) if s.key != b.key), whole)
        if keyed == 0:
            return 0
        views = [self.client.slot_view(s) for s in slots[:keyed]]
        ids = [b.block_id for b in request.blocks[:keyed]]
        t0 = time.perf_counter()
        check = self.verifier.start([v.data for v in views], [s.checksum for s in slots[:keyed]])
        try:
            return self.mover.scatter_checked(self.layout, ids, views, check, after)
        finally:
            check.result()  # no helper reads a slot once this returns: the pins may go
            self._count("verify_s", check.caller_s)
            self._count("copy_in_s", time.perf_counter() - t0 - check.caller_s)

    def _release(self, slots: Sequence[SlotRef], corrupt: Sequence[SlotRef] = ()) -> None:
        if not slots:
            return
        # Not waiting for the reply: the copy is done, and nothing here needs the answer (on
        # failure the server drops a dead connection's pins itself).
        with contextlib.suppress(CacheUnavailable), self._timed("release_rpc_s"):
            self.client.release(slots, corrupt, wait=False)


class _Job(NamedTuple):
    session: Session
    request: RequestLoad
    after: Fence


class BackgroundLoads:
    """vLLM's asynchronous loads, on a thread and a connection of their own (see the module
    doc). ``submit`` and ``take_finished`` never block on the cache server."""

    def __init__(self, loader: BlockLoader, count: Count) -> None:
        self.loader = loader
        self._count = count
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._finished: list[LoadResult] = []
        self._lock = threading.Lock()
        self._pending = 0
        self._thread = start_thread(self._loop, "kvkeep-load")

    def submit(self, session: Session, request: RequestLoad, after: Fence) -> None:
        """Queue a request's load; it is reported by a later ``take_finished``, exactly once."""
        with self._lock:
            self._pending += 1
        self._jobs.put(_Job(session, request, after))

    def take_finished(self) -> list[LoadResult]:
        """The loads that ended since the last call (each once), in the order they ended."""
        with self._lock:
            done, self._finished = self._finished, []
            self._pending -= len(done)
        return done

    @property
    def pending(self) -> int:
        """Loads submitted and not yet taken by ``take_finished``."""
        with self._lock:
            return self._pending

    def _loop(self) -> None:
        unbind()
        self.loader.mover.bind_thread()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loaded = 0
            t0 = time.perf_counter()
            try:
                loaded = self.loader.load(job.session, job.request, job.after)
            finally:
                self._count("load_s", time.perf_counter() - t0)
                with self._lock:
                    self._finished.append(result_of(job.request, loaded))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Finish the queued loads (bounded), stop the thread, close the connection."""
        self._jobs.put(None)
        self._thread.join(timeout=timeout_s)
        self.loader.verifier.close()
        self.loader.client.close()
