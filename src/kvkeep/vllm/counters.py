"""The connector's counters: what it did and where a step's time went, merged across workers.

Free of vllm; ``kvkeep.vllm.stats`` exports them to vLLM's metrics.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

PROFILE_NAMES = (
    # scheduler: a whole admission answer, its LOOKUP round trip, a whole step plan
    "match_s",
    "lookup_rpc_s",
    "plan_s",
    # worker, loads (before the forward): ACQUIRE, checksums, copies in, RELEASE
    "acquire_rpc_s",
    "verify_s",
    "copy_in_s",
    "release_rpc_s",
    # worker, saves: on the step only the batched copy out into staging rows; the saver's
    # thread: RESERVE, rows into slots, checksums, COMMIT
    "copy_out_s",
    "reserve_rpc_s",
    "slot_copy_s",
    "checksum_s",
    "commit_rpc_s",
    # the saver's thread: the CPU time it took for all of that (the others are wall times)
    "saver_cpu_s",
)
"""Where a kvkeep step's time goes, in seconds (``vllm:kvkeep_seconds_total{op=...}``)."""

COUNTER_NAMES = (
    "lookups",
    "lookup_failures",
    "offered_tokens",
    "loaded_tokens",
    "load_failed_tokens",
    "saved_tokens",
    # the same for a hybrid's sliding-window groups (block tokens summed over the groups)
    "window_loaded_tokens",
    "window_load_failed_tokens",
    "window_saved_tokens",
    # a hybrid's recurrent-state snapshots, one per group and boundary (counts, not tokens)
    "states_loaded",
    "states_load_failed",
    "states_saved",
    "save_failures",
    "saves_dropped",
    "saves_skipped_busy",
    "async_loads",
    "async_loads_failed",
    "admissions_deferred",
    "blocks_evicted",
    "evict_failures",
    "sync_loads_refused",
    "audit_blocks",
    "audit_mismatches",
    "unkeyable_lora",
    "unkeyable_multimodal",
    "unkeyable_prompt_embeds",
    "load_s",
    "save_s",
    *PROFILE_NAMES,
)


@contextlib.contextmanager
def timed(add: Callable[[str, float], object], name: str) -> Iterator[None]:
    """Call ``add(name, seconds)`` with the block's wall time, also when it raises."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        add(name, time.perf_counter() - t0)


@dataclass
class Counters:
    """kvkeep's own count of what the connector did; merged across workers by addition.
    Thread-safe (the commit thread counts too)."""

    values: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTER_NAMES, 0))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _taken: float = field(default=float("-inf"), repr=False, compare=False)  # of the last take

    def add(self, name: str, amount: float) -> None:
        with self._lock:
            self.values[name] = self.values.get(name, 0) + amount

    def merge(self, other: Mapping[str, float]) -> None:
        for name, amount in other.items():
            self.add(name, amount)

    def timed(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Add the block's wall time to ``name`` (seconds), also when it raises."""
        return timed(self.add, name)

    def take(self, hold_timings_s: float = 0.0) -> dict[str, float] | None:
        """The non-zero counts since the last take, and reset; None if nothing happened.

        With ``hold_timings_s``, counts that are only timings (``*_s``, as every step's plan
        time is) are kept for a later take until they are that old: vLLM ships a connector's
        stats to its front end in every step that has some, which on a decode step cost more
        than kvkeep's own work. Every other count goes out at once."""
        with self._lock:
            data = {k: v for k, v in self.values.items() if v}
            now = time.monotonic()
            timings_only = all(k.endswith("_s") for k in data)
            if not data or (timings_only and now - self._taken < hold_timings_s):
                return None
            self.values = dict.fromkeys(COUNTER_NAMES, 0)
            self._taken = now
        return data
