"""The connector's settings, from ``kv_connector_extra_config``: validated once at start-up
(``ConnectorConfig.from_extra``), with a message that names the key and what it takes.

Free of vllm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LOAD_ASYNC_MIN_BYTES = 16 << 20
"""Where a synchronous load starts to cost the other running requests more than an
asynchronous one costs its own request (one extra engine step): the default threshold
(``load_async_min_blocks`` "auto") is this many bytes of blocks. Measured on 2 cores with the
tiny model (256 KiB blocks): a decode step takes about 5 ms (``scripts/async_threshold.py``),
and a synchronous load with batched copies about 0.8 ms for 32 blocks and 4 ms for 128 on an
idle machine (ACQUIRE, verify, copy, RELEASE), so 16 MiB (64 blocks) stalls the others for
under half a step. An asynchronous load costs its own request at least one step, which at 32
blocks was a quarter of a cached request's TTFT (S4). Over PCIe with pinned memory 16 MiB is
under 1 ms. On CPU a background copy takes the same cores as the forward, so it is not free
for the others either.
With no other request running a synchronous load stalls nobody, so "auto" then loads every
hit on the step (idle engine, 2 cores with AMX: 64 blocks reached the first token in 44 ms on
the step, 57 ms in the background). A number of blocks is a fixed threshold; null: never."""


STATE_BOUNDARIES = {
    "reused": "the snapshots a later prompt reuses: at each prompt's last boundary (the next "
    "turn extends it), in its reply, and where it left a prefix kvkeep held (a sub-agent's "
    "shared system prompt)",
    "every": "every snapshot vLLM writes at a block boundary",
}
"""A linear-attention hybrid's snapshot is tens of MiB (Qwen3-Next-80B: 37.7 MiB in bf16,
as much as 1,608 tokens of its attention KV), so saving one at every block boundary stores
more state than KV."""


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config``, validated. Unknown keys are refused, not ignored.

    ``socket`` is the cache server's unix socket; ``timeout_s`` bounds every RPC (the scheduler
    waits at most this long on a LOOKUP); ``max_backoff_s`` caps the reconnect backoff.
    """

    socket: str
    timeout_s: float = 1.0
    max_backoff_s: float = 5.0
    audit: bool = False  # debug: compare blocks vLLM computes again with their stored copy
    # host memory per worker for saves on their way to the server; None: two full steps
    staging_mib: float | None = None
    # a hit of at least this many blocks loads in the background (vLLM's async load): the
    # request waits a step or more, other requests' steps do not wait for its copies.
    # None: every load is synchronous.
    load_async_min_blocks: int | str | None = "auto"  # "auto": LOAD_ASYNC_MIN_BYTES of blocks
    # which recurrent-state snapshots a linear-attention hybrid saves (``STATE_BOUNDARIES``)
    state_boundaries: str = "reused"

    def __post_init__(self) -> None:
        if not self.socket:
            raise ValueError("kv_connector_extra_config.socket: give the cache server's socket")
        if not 0 < self.timeout_s <= 60:
            raise ValueError(f"timeout_s must lie in (0, 60] seconds, got {self.timeout_s}")
        if not 0 < self.max_backoff_s <= 600:
            raise ValueError(f"max_backoff_s must lie in (0, 600], got {self.max_backoff_s}")
        if self.staging_mib is not None and not 1 <= self.staging_mib <= 65536:
            raise ValueError(f"staging_mib must lie in [1, 65536] MiB, got {self.staging_mib}")
        if self.state_boundaries not in STATE_BOUNDARIES:
            raise ValueError(
                f"state_boundaries must be one of {sorted(STATE_BOUNDARIES)}, got "
                f"{self.state_boundaries!r}"
            )
        blocks = self.load_async_min_blocks
        if blocks != "auto" and blocks is not None and (not isinstance(blocks, int) or blocks < 1):
            raise ValueError(
                f'load_async_min_blocks must be a whole number >= 1, "auto" (the default: '
                f"{LOAD_ASYNC_MIN_BYTES >> 20} MiB of blocks) or null (never load in "
                f"the background), got {blocks!r}"
            )

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        """Build from vLLM's free-form dict; raises ValueError naming what to change."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        if "socket" not in extra:
            raise ValueError("kv_connector_extra_config needs 'socket' (the cache server's)")
        strings = ("state_boundaries",)
        audit = extra.get("audit", False)
        if not isinstance(audit, bool):
            raise ValueError(f"kv_connector_extra_config.audit must be true or false: {audit!r}")
        whole = ("load_async_min_blocks",)
        numbers: dict[str, Any] = {
            k: float(v) for k, v in extra.items() if k not in ("socket", "audit", *whole, *strings)
        }
        for key in whole:
            if key in extra:
                numbers[key] = (
                    extra[key] if extra[key] == "auto" else _whole_or_none(key, extra[key])
                )
        config = cls(socket=str(extra["socket"]), audit=audit, **numbers)
        if "state_boundaries" in extra:
            config = dataclasses.replace(config, state_boundaries=str(extra["state_boundaries"]))
        return config

    def async_min_blocks(self, block_bytes: int) -> int | None:
        """The smallest hit, in blocks of ``block_bytes``, that loads asynchronously (None:
        none does)."""
        if self.load_async_min_blocks == "auto":
            return max(1, -(-LOAD_ASYNC_MIN_BYTES // max(block_bytes, 1)))
        assert not isinstance(self.load_async_min_blocks, str)
        return self.load_async_min_blocks

    @property
    def sync_when_alone(self) -> bool:
        """Whether any hit loads on the step when no other request runs ("auto")."""
        return self.load_async_min_blocks == "auto"


def _whole_or_none(key: str, value: Any) -> int | None:
    """``value`` as an int (None stays None); raises ValueError naming ``key`` otherwise."""
    if value is None:
        return None
    try:
        whole = not isinstance(value, bool) and float(value) == int(float(value))
    except (TypeError, ValueError):
        whole = False
    if not whole:
        raise ValueError(f"kv_connector_extra_config.{key} must be a whole number: {value!r}")
    return int(float(value))
