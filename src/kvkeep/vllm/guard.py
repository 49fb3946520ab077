"""No request reads the blocks a failed synchronous load left behind.

vLLM puts the blocks of a synchronous load into its prefix cache when it allocates them,
before the worker has copied anything, and under the "recompute" policy it leaves them there
when the load fails: it truncates the failed request at its first failed block, and that
request recomputes the blocks in place, one prefill chunk per step (128 tokens with
``kvkeep serve``'s CPU defaults). Until then the blocks hold whatever they held before, and
vLLM lets two kinds of request read them:

- one admitted in the same step on a prefix-cache hit over them: vLLM keeps it going on the
  assumption that the owner recomputes the shared blocks first, which chunked prefill breaks
  (vllm-project/vllm#49250);
- one admitted while the owner is still recomputing.

Agents that share a system prompt do both (``bench soak`` served whole wrong replies after a
vLLM restart and a cache-server kill). kvkeep closes both gaps with two rules:

1. Until the outcome of a synchronous load is known, no request is admitted on a vLLM hit
   that covers the blocks the load writes, or the blocks its request computes on top of
   them in the same step. The connector answers "not yet" (None), and vLLM asks again in
   the next step. Scheduling step by step (always on CPU), vLLM knows the outcome by then;
   under asynchronous scheduling, one step later. A request waits no longer than that: a
   wait costs it its free device blocks that other admissions evict meanwhile.
2. When a step reports failed blocks, every request that holds one has its blocks, from the
   first failed one on, evicted from vLLM's prefix cache (through the KV cache manager that
   vLLM binds to the connector). The owner still recomputes them in place, but nobody
   shares them; kvkeep saves them again and serves them from there.

Free of vllm.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from kvkeep.keys import BlockKey

PLANS_IN_FLIGHT = 1
"""Plans handed to vLLM whose outcome may still be unknown when it admits requests, under
asynchronous scheduling (vLLM schedules a step before it processes the output of the step
before). 0 when vLLM schedules step by step (``compat.plans_in_flight``)."""


class SyncLoadGuard:
    """Keys of the blocks that synchronous loads write, kept for the plan being built and
    the last ``PLANS_IN_FLIGHT`` plans. Not thread-safe (vLLM's scheduler is
    single-threaded)."""

    def __init__(self, plans_in_flight: int = PLANS_IN_FLIGHT) -> None:
        self._building: set[BlockKey] = set()
        self._recent: deque[frozenset[BlockKey]] = deque(maxlen=max(plans_in_flight, 0))

    def hold(self, keys: Iterable[BlockKey]) -> None:
        """A synchronous load planned for the plan being built writes ``keys``."""
        self._building.update(keys)

    def planned(self) -> None:
        """The plan being built was handed to vLLM; the oldest one held expires."""
        self._recent.append(frozenset(self._building))
        self._building = set()

    @property
    def active(self) -> bool:
        return bool(self._building) or any(self._recent)

    def covers(self, keys: Sequence[BlockKey]) -> bool:
        """Whether any of ``keys`` (a request's vLLM hit) is written by a load whose outcome
        may still be unknown."""
        if not self.active:
            return False
        held = [self._building, *(s for s in self._recent if s)]
        return any(key in s for key in keys for s in held)


def tails_from(tables: Iterable[Sequence[int]], failed: set[int]) -> set[int]:
    """Of each block table that holds a failed block, the blocks from the first failed one
    on: what vLLM must not serve from its prefix cache any more. Pure."""
    tails: set[int] = set(failed)
    for table in tables:
        first = next((i for i, block in enumerate(table) if block in failed), None)
        if first is not None:
            tails.update(table[first:])
    return tails
