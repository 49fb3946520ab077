"""Keeping the prefixes vLLM serves from its own pool warm in kvkeep's RAM.

A request whose prefix vLLM already holds never asks kvkeep about that prefix, so without
this it ages out of kvkeep's RAM while it is the hottest data there, and is gone when vLLM
restarts. The scheduler hands each admitted request's device-hit keys to a ``TouchQueue``,
which sends them in one TOUCH from its own thread and connection: the scheduler never waits
for it, and never sends a message per block.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Sequence

from kvkeep.host.background import start_thread
from kvkeep.keys import BlockKey
from kvkeep.server.client import CacheUnavailable, KVKeepClient, Session

log = logging.getLogger("vllm.kvkeep")


class TouchQueue:
    """One daemon thread sending TOUCH messages, at most ``depth`` waiting.

    ``submit`` never blocks and never raises: with the queue full the TOUCH is dropped
    (the prefix only ages sooner). A failed TOUCH is logged at debug level and forgotten.
    """

    def __init__(self, client: KVKeepClient, depth: int = 64) -> None:
        self._client = client
        self._queue: queue.Queue[tuple[Session, Sequence[BlockKey]] | None] = queue.Queue(depth)
        self.dropped = 0
        self._thread = start_thread(self._loop, "kvkeep-touch")

    def submit(self, session: Session, keys: Sequence[BlockKey]) -> bool:
        """Queue one TOUCH of ``keys``; False if it was dropped (queue full) or empty."""
        if not keys:
            return False
        try:
            self._queue.put_nowait((session, keys))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def flush(self) -> None:
        """Block until every queued TOUCH was sent or failed (for tests)."""
        self._queue.join()

    def close(self) -> None:
        """Stop the thread after what is queued; idempotent, never blocks for long."""
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            return
        self._thread.join(timeout=self._client.timeout_s + 1.0)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._client.touch(*item)
            except CacheUnavailable as exc:
                log.debug("kvkeep: TOUCH of %d blocks failed: %s", len(item[1]), exc)
            finally:
                self._queue.task_done()
        self._queue.task_done()
