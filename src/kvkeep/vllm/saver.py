"""Saves off the step: copy new blocks out of the KV cache, store them in the background.

On the step (``Saver.stage``, from ``wait_for_save``) the only work is one batched copy of the
step's new blocks into staging rows kvkeep owns; the step never waits for an RPC, a checksum
or a free buffer (with every row in flight its saves are skipped and counted,
``saves_skipped_busy``). A background thread, on its own connection, RESERVEs slots (the
server skips keys it holds), checksums each row, copies it into its slot and COMMITs, several
steps' jobs at once and not while a prefill runs: a save is visible once the prefill that made
it ends, or ``QUIET_S`` after the engine went idle, and at most ``LINGER_S`` after its step;
``drain`` and ``shutdown`` store it at once. Invariants: a slot is committed with the
checksum of its staged row, never of the slot, so only the engine's bytes pass the check at
load; a failed RESERVE, copy or COMMIT releases the slots and publishes nothing (counted); a
dead cache server costs only saves. Why staging, the batching and its measurements, and the
integrity argument: docs/notes/saver.md.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvkeep.host.background import start_thread, unbind
from kvkeep.keys import BlockKey
from kvkeep.server.client import CacheUnavailable, KVKeepClient, Session, SlotRef
from kvkeep.store.base import checksum
from kvkeep.vllm.layout import KVLayout
from kvkeep.vllm.mover import Mover, Wait
from kvkeep.vllm.plan import BlockTransfer

log = logging.getLogger("vllm.kvkeep")

MIN_STAGING_BYTES = 64 << 20
MAX_AUTO_STAGING_BYTES = 1 << 30  # pinned memory on CUDA: a bigger budget is asked for, not taken


MIN_BUFFERS = 16  # jobs the saver may have in flight before a step's saves are skipped
LINGER_S = 2.0  # how long the background thread waits for more jobs to store together, at most
QUIET_S = 0.1  # no step staged anything for this long: the engine went idle, store what waits
MAX_BATCH_BLOCKS = 256  # blocks stored by one RESERVE/COMMIT pair, at most


def staging_shape(step_blocks: int, block_bytes: int, staging_bytes: int | None) -> tuple[int, int]:
    """(jobs, rows per job) of the staging memory: room for at least MIN_BUFFERS jobs of up
    to one step's blocks each (a step with more is staged as several jobs); the staging holds
    jobs x rows rows, and a job takes only the rows it fills (`_Ring`), so small steps fit
    many more jobs. ``staging_bytes`` None: two full steps, within [64 MiB, 1 GiB]."""
    if staging_bytes is None:
        two_steps = 2 * step_blocks * block_bytes
        staging_bytes = max(MIN_STAGING_BYTES, min(MAX_AUTO_STAGING_BYTES, two_steps))
    rows = max(1, min(step_blocks, staging_bytes // (MIN_BUFFERS * block_bytes)))
    return max(MIN_BUFFERS, staging_bytes // (rows * block_bytes)), rows


class _Job(NamedTuple):
    session: Session
    keys: tuple[BlockKey, ...]  # row j of ``buffer`` holds keys[j]'s bytes
    buffer: torch.Tensor  # its rows of the staging memory
    wait: Wait
    end: int  # `_Ring.take`'s mark: giving it back frees these rows and every earlier job's


class _Ring:
    """Rows of the staging memory, taken in order and given back in the same order: a job
    takes the next run of rows it fills, never more. Where a run would cross the end, the
    rows left before it are skipped and it starts again at row 0. Thread-safe: the step takes,
    the background thread gives back."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._head = self._tail = 0  # rows ever taken (skipped ones too), ever given back
        self._before = 0  # the head before the last take
        self._lock = threading.Lock()

    def take(self, n: int) -> tuple[int, int] | None:
        """(first row, mark) of ``n`` contiguous rows; None if they are not free now."""
        with self._lock:
            at = self._head % self.rows
            skip = self.rows - at if at + n > self.rows else 0
            if n > self.rows or self._head + skip + n - self._tail > self.rows:
                return None
            self._before, self._head = self._head, self._head + skip + n
            return (0 if skip else at), self._head

    def untake(self, mark: int) -> None:
        """Undo the last take (the one that returned ``mark``), skipped rows included."""
        with self._lock:
            if self._head == mark:
                self._head = self._before

    def give_back(self, mark: int) -> None:
        """The rows of the job ``take`` returned ``mark`` for, and those of every earlier job."""
        with self._lock:
            self._tail = max(self._tail, mark)

    def free(self) -> int:
        with self._lock:
            return self.rows - (self._head - self._tail)


_FLUSH = object()  # in the job queue: store the jobs gathered so far without waiting

Count = Callable[[str, float], None]
Timed = Callable[[str], contextlib.AbstractContextManager[None]]


class Saver:
    """Stages a step's new blocks and stores them in the background (see the module doc).

    ``stage`` never raises and never blocks on the cache server. Not for concurrent ``stage``
    calls (vLLM's worker calls it from one thread); the background thread is its own.
    """

    def __init__(
        self,
        client: KVKeepClient,
        layout: KVLayout,
        count: Count,
        timed: Timed,
        shape: tuple[int, int],
        mover: Mover | None = None,
    ) -> None:
        """``shape``: (jobs, rows per job) of the staging memory (``staging_shape``)."""
        self.client, self.layout = client, layout
        self._count, self._timed = count, timed
        self.mover = mover or Mover()
        jobs, self.rows_per_buffer = shape
        self._staging = self.mover.host_buffer(jobs * self.rows_per_buffer, layout.block_bytes)
        self._ring = _Ring(jobs * self.rows_per_buffer)
        self._jobs: queue.Queue[_Job | threading.Event | object | None] = queue.Queue()
        self._lingering = False  # a job was queued since the last flush
        self._last_staged = 0.0  # time.monotonic() of the last staged job (no wake-up)
        self._wake = threading.Event()  # ends a linger early (``_gather``)
        self._thread = start_thread(self._loop, "kvkeep-save")

    # on the step ---------------------------------------------------------------------------

    def stage(self, session: Session, saves: Sequence[BlockTransfer]) -> int:
        """Copy the blocks of ``saves`` (the first block id of each key) out of the KV cache
        and queue them for storing. Returns how many blocks were staged."""
        by_key: dict[BlockKey, int] = {}
        for block in saves:
            by_key.setdefault(block.key, block.block_id)
        items = list(by_key.items())
        staged = 0
        for start in range(0, len(items), self.rows_per_buffer):
            chunk = items[start : start + self.rows_per_buffer]
            if not self._stage_chunk(session, chunk):
                self._count("saves_skipped_busy", len(items) - start)
                break
            staged += len(chunk)
        return staged

    def _stage_chunk(self, session: Session, chunk: list[tuple[BlockKey, int]]) -> bool:
        taken = self._ring.take(len(chunk))
        if taken is None:
            return False
        first, mark = taken
        rows = self._staging[first : first + len(chunk)]
        ids = torch.tensor([block_id for _, block_id in chunk], dtype=torch.int64)
        try:
            with self._timed("copy_out_s"):
                wait = self.mover.gather(self.layout, ids, rows)
        except Exception:
            self._ring.untake(mark)
            raise
        self._last_staged = time.monotonic()
        self._jobs.put(_Job(session, tuple(k for k, _ in chunk), rows, wait, mark))
        self._lingering = True
        if self._low():
            self._wake.set()  # staging runs low: store now rather than at the linger's end
        return True

    def _low(self) -> bool:
        """A quarter of the staging rows or less is free."""
        return self._ring.free() <= self._ring.rows // 4

    def flush(self) -> None:
        """A step saved nothing: store what waits for more jobs now. Cheap when nothing does."""
        if self._lingering:
            self._lingering = False
            self._post(_FLUSH)

    # in the background ---------------------------------------------------------------------

    def _loop(self) -> None:
        unbind()  # not on the core of the forward's first thread, which started this one
        self.mover.bind_thread()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, threading.Event):  # drain(): everything before it is done
                job.set()
                continue
            if not isinstance(job, _Job):  # a flush with nothing waiting
                continue
            batch, control = self._gather(job)
            cpu = time.thread_time()
            try:
                for session in dict.fromkeys(j.session for j in batch):
                    self._store([j for j in batch if j.session is session])
            finally:
                self._ring.give_back(max(j.end for j in batch))
                self._count("saver_cpu_s", time.thread_time() - cpu)
            if control is None:
                return
            if isinstance(control, threading.Event):
                control.set()

    def _gather(self, first: _Job) -> tuple[list[_Job], threading.Event | bool | None]:
        """``first`` and the jobs that arrive after it while steps keep staging (each within
        QUIET_S of the last), for at most LINGER_S, while a quarter of the rows stay free
        and the batch holds at most MAX_BATCH_BLOCKS blocks; plus the control item that ended
        it (a drain's Event, None for shutdown; True: no control).

        While it lingers the thread sleeps on ``_wake``, which a staged job does not set: a
        wake per step's job preempted the forward's threads once a step on a CPU engine. It
        wakes by itself once per QUIET_S to see whether steps still stage. A flush, a drain,
        a shutdown and staging past its high-water mark set it."""
        batch, blocks = [first], len(first.keys)
        deadline = time.monotonic() + LINGER_S
        while blocks < MAX_BATCH_BLOCKS and not self._low():
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                now = time.monotonic()
                remaining = min(deadline, self._last_staged + QUIET_S) - now
                if remaining <= 0:
                    break
                self._wake.wait(remaining)
                self._wake.clear()  # whatever set it is in the queue: the next get sees it
                continue
            if item is None or isinstance(item, threading.Event):
                return batch, item
            if not isinstance(item, _Job):  # flush
                break
            batch.append(item)
            blocks += len(item.keys)
        return batch, True

    def _post(self, item: threading.Event | object | None) -> None:
        """Queue a control item (flush, drain, shutdown) and wake a lingering thread."""
        self._jobs.put(item)
        self._wake.set()

    def _store(self, jobs: Sequence[_Job]) -> None:
        """RESERVE, checksum rows and copy them into slots, COMMIT; on any failure publish nothing.
        ``jobs`` share one session; a key staged twice is stored from its first row."""
        rows: dict[BlockKey, torch.Tensor] = {}
        for job in jobs:
            job.wait()
            for j, key in enumerate(job.keys):
                rows.setdefault(key, job.buffer[j])
        slots: list[SlotRef] = []
        try:
            with self._timed("reserve_rpc_s"):
                slots = self.client.reserve(jobs[0].session, list(rows))
            if not slots:
                return
            checksums = self._fill(rows, slots)
            with self._timed("commit_rpc_s"):
                committed = self.client.commit(jobs[0].session, slots, checksums)
            self._count("saved_tokens", committed * self.layout.description.block_size)
            if committed < len(slots):  # reservations lost with a connection: not ours now
                self._count("save_failures", 1)
        except Exception as exc:
            self._count("save_failures", 1)
            log.debug("kvkeep: save failed: %s", exc)
            with contextlib.suppress(CacheUnavailable):
                self.client.release(slots)

    def _fill(self, rows: dict[BlockKey, torch.Tensor], slots: Sequence[SlotRef]) -> list[int]:
        """Checksum each slot's row and copy it into the slot; the checksums, in order.

        The checksum is of the row, the bytes the engine computed, read once just before the
        copy reads them again from cache. Taken from the slot after the copy it would cover
        whatever else was written there meanwhile (docs/notes/saver.md). The phases are timed
        per batch, not per slot: on 2 cores four counter updates a slot cost more than a
        256 KiB block's checksum."""
        checksums = []
        clock, copy_s, hash_s = time.perf_counter, 0.0, 0.0
        try:
            for slot in slots:
                row = rows[slot.key].numpy()
                t0 = clock()
                checksums.append(checksum(row.data))
                t1 = clock()
                self._copy_into(self.client.slot_view(slot), row)
                copy_s, hash_s = copy_s + clock() - t1, hash_s + t1 - t0
        finally:
            self._count("slot_copy_s", copy_s)
            self._count("checksum_s", hash_s)
        return checksums

    @staticmethod
    def _copy_into(slot: np.ndarray, row: np.ndarray) -> None:
        """One staged row into its arena slot (a seam for the race tests' gates)."""
        np.copyto(slot, row)

    # lifecycle -----------------------------------------------------------------------------

    def drain(self, timeout_s: float) -> bool:
        """Wait until every block staged so far was stored or failed; False on timeout."""
        done = threading.Event()
        self._post(done)
        return done.wait(timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Store what is queued (bounded), stop the thread, close the connection."""
        self._post(None)
        self._thread.join(timeout=timeout_s)
        self.client.close()
