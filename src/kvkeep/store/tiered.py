"""The tiered store: the RAM arena on top of an ordered list of lower tiers.

- ``lookup`` returns the longest contiguous prefix of keys present in any tier.
- ``acquire`` pins a block in RAM, promoting it from the first lower tier that has it.
- ``commit`` makes a block visible in RAM and queues it for write-through to every lower
  tier. The queue is bounded: when it is full the write is dropped and counted, and the
  caller never blocks. The writer thread pins the slot while it copies it out.
- Lower tiers named in ``WriteBehindConfig.on_evict`` are skipped by write-through and given
  the block instead when RAM evicts it (the remote tier's "write on eviction" policy).
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvkeep.store.base import StoreKey, Tier, checksum
from kvkeep.store.memory import ArenaTier, Pinned

log = logging.getLogger("kvkeep.store")


@dataclass(frozen=True)
class WriteBehindConfig:
    """``queue_depth``: blocks waiting for the lower tiers before writes are dropped.

    ``on_evict``: names of lower tiers written when RAM evicts a block rather than when it
    is committed (their ``put`` must copy and not block: it runs under the arena lock).
    """

    queue_depth: int = 256
    on_evict: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.queue_depth <= 0:
            raise ValueError(f"queue_depth must be positive, got {self.queue_depth}")


class Lookup(NamedTuple):
    """``num_present`` leading keys are stored; ``tiers[i]`` is the index of key i's tier."""

    num_present: int
    tiers: tuple[int, ...]


class ReserveStatus(enum.Enum):
    RESERVED = "reserved"
    PRESENT = "present"  # already stored (or being written): nothing to do
    FULL = "full"  # no slot could be freed: every candidate is pinned


class Reservation(NamedTuple):
    status: ReserveStatus
    offset: int = -1


class _Write(NamedTuple):
    key: StoreKey
    offset: int
    length: int
    crc: int


class TieredStore:
    """Thread-safe. ``tiers[0]`` is the arena; blocks found in ``tiers[i>0]`` move up."""

    def __init__(self, ram: ArenaTier, lower: Sequence[Tier], config: WriteBehindConfig) -> None:
        self.ram = ram
        self.lower = list(lower)
        self.tiers: list[Tier] = [ram, *self.lower]
        unknown = config.on_evict - {t.name for t in self.lower}
        if unknown:
            raise ValueError(f"on_evict names tiers {sorted(unknown)} that are not configured")
        self._through = [t for t in self.lower if t.name not in config.on_evict]
        self._spill = [t for t in self.lower if t.name in config.on_evict]
        if self._spill:
            ram.on_evict = self._spill_evicted
        self._queue: queue.Queue[_Write | None] = queue.Queue(config.queue_depth)
        self.dropped_writes = 0
        self.write_errors = 0
        self.corrupt_writes = 0  # blocks whose RAM bytes no longer matched at write-through
        self._writer = threading.Thread(target=self._write_loop, name="kvkeep-writer", daemon=True)
        self._writer.start()

    def lookup(self, keys: Sequence[StoreKey]) -> Lookup:
        """Longest contiguous present prefix across tiers. RAM hits become most recent (the
        engine is about to ACQUIRE them), nothing else changes.

        RAM and local tiers are asked key by key; a tier with ``contains_many`` (the remote)
        is asked once, in one batch, for the keys from the first one no faster tier holds.
        That call may block for up to the remote's timeout (see ``may_block``).
        """
        # Hot path (1,000-key prompts within a millisecond): bound methods, no generators
        # while RAM hits.
        ram_contains = self.ram.touch
        probes = [(level, _Probe(tier, keys).has) for level, tier in enumerate(self.lower, 1)]
        tiers: list[int] = []
        for index, key in enumerate(keys):
            if ram_contains(key):
                tiers.append(0)
                continue
            level = next((lv for lv, has in probes if has(index)), -1)
            if level < 0:
                break
            tiers.append(level)
        return Lookup(len(tiers), tuple(tiers))

    @property
    def may_block(self) -> bool:
        """Whether ``lookup`` can wait on the network (a lower tier answers in batches)."""
        return any(hasattr(t, "contains_many") for t in self.lower)

    def held_below(self, key: StoreKey) -> bool:
        """Whether a lower tier says it probably holds ``key``, from local knowledge (no I/O)."""
        return any(t.contains(key) for t in self.lower)

    def reserve(self, key: StoreKey, length: int) -> Reservation:
        """A RAM slot to write ``key`` into, unless some tier already holds it."""
        if any(t.contains(key) for t in self.lower):
            return Reservation(ReserveStatus.PRESENT)
        offset = self.ram.reserve(key, length)
        if offset is not None:
            return Reservation(ReserveStatus.RESERVED, offset)
        if self.ram.holds(key):
            return Reservation(ReserveStatus.PRESENT)
        return Reservation(ReserveStatus.FULL)

    def commit(self, offset: int, crc: int) -> bool:
        """Publish a reserved slot and queue it for the lower tiers; never blocks."""
        # The writer's pin is taken atomically with the commit so the slot cannot be evicted
        # before the write-through copies it out.
        if not self.ram.commit(offset, crc, keep_pin=bool(self._through)):
            return False
        info = self.ram.committed(offset)
        if self._through and info is not None:
            self._enqueue(_Write(info.key, offset, info.length, crc))
        return True

    def acquire(self, key: StoreKey, length: int) -> Pinned | None:
        """Pin ``key`` in RAM, promoting it from a lower tier; None on a miss.

        Blocks on disk I/O when promoting: call it off the event loop in that case. A lower
        tier's checksum failure is a miss. The caller must ``release`` the returned offset.
        """
        pinned = self.ram.pin(key)
        if pinned is not None:
            return pinned
        for tier in self.lower:
            if tier.contains(key):
                return self._promote(tier, key, length)
        return None

    def release(self, offset: int) -> None:
        self.ram.unpin(offset)

    def flush(self) -> None:
        """Block until every queued write has reached the lower tiers."""
        self._queue.join()

    def close(self) -> None:
        """Flush, stop the writer, close the lower tiers, remove the arena."""
        self.flush()
        self._queue.put(None)
        self._writer.join()
        for tier in self.lower:
            close = getattr(tier, "close", None)
            if close is not None:
                close()
        self.ram.close()

    def stats(self) -> dict[str, object]:
        """Per-tier counters and occupancy plus write-behind state; a snapshot."""
        return {
            "tiers": {t.name: t.stats().as_dict() for t in self.tiers},
            "dropped_writes": self.dropped_writes,
            "write_errors": self.write_errors,
            "corrupt_writes": self.corrupt_writes,
            "queue_depth": self._queue.qsize(),
            "pending_writes": self._queue.unfinished_tasks,
        }

    def _promote(self, tier: Tier, key: StoreKey, length: int) -> Pinned | None:
        offset = self.ram.reserve(key, length)
        if offset is None:
            return self.ram.pin(key)  # another reader is promoting it, or RAM is all pinned
        found = tier.get(key, self.ram.view(offset, length))
        if found is None or found.length != length:
            self.ram.abort(offset)
            return None
        self.ram.commit(offset, found.checksum, keep_pin=True)
        return Pinned(offset, length, found.checksum)

    def _enqueue(self, write: _Write) -> None:
        try:
            self._queue.put_nowait(write)
        except queue.Full:
            self.ram.unpin(write.offset)
            self.dropped_writes += 1

    def _write_loop(self) -> None:
        while (write := self._queue.get()) is not None:
            try:
                self._write_through(write)
            finally:
                self.ram.unpin(write.offset)
                self._queue.task_done()
        self._queue.task_done()

    def _spill_evicted(self, key: StoreKey, data: memoryview, crc: int) -> None:
        """RAM's eviction hook: hand the block to the on-evict tiers (they copy it)."""
        if self._spill and not verify(data, crc):
            self.corrupt_writes += 1
            return
        for tier in self._spill:
            tier.put(key, data, crc)

    def _write_through(self, write: _Write) -> None:
        if not self._through:
            return
        data = self.ram.view(write.offset, write.length)
        if not verify(data, write.crc):
            # The RAM copy went bad after its commit (a scribble, a faulty writer). Persisting
            # it would only turn one miss into a miss that outlives the server.
            self.corrupt_writes += 1
            log.warning("a block changed in RAM after its commit; not written to lower tiers")
            return
        for tier in self._through:
            try:
                tier.put(write.key, data, write.crc)
            except Exception:
                # An uncaught error here would end the writer: every later write would pile
                # up pinned in the queue and close() would wait on it forever.
                self.write_errors += 1
                log.exception("write-through to %s failed", tier.name)


class _Probe:
    """Answers "does ``tier`` hold ``keys[i]``" for increasing ``i``.

    A tier with ``contains_many`` is asked once, on the first question, for ``keys[i:]``;
    others are asked key by key.
    """

    __slots__ = ("_answers", "_batch", "_contains", "_keys", "_start")

    def __init__(self, tier: Tier, keys: Sequence[StoreKey]) -> None:
        self._contains = tier.contains
        self._batch = getattr(tier, "contains_many", None)
        self._keys = keys
        self._answers: list[bool] | None = None
        self._start = 0

    def has(self, index: int) -> bool:
        if self._batch is None:
            return self._contains(self._keys[index])
        if self._answers is None:
            self._start, self._answers = index, self._batch(self._keys[index:])
        return self._answers[index - self._start]


def verify(data: memoryview, expected: int) -> bool:
    """Whether ``data`` has the CRC-32 ``expected``."""
    return checksum(data) == expected
