"""Hit rates per tier: device (vLLM's prefix cache), then RAM, then disk.

The tiers are **inclusive**: kvkeep writes every computed block through to RAM and, behind it,
to disk, so RAM holds what the device holds and disk what RAM holds. A reference is therefore
served by the first tier whose own capacity covers its stack distance, and a tier adds the
references with ``previous capacity < distance <= its capacity``. A tier no larger than the
one above it adds nothing, which is the point the recommendation makes about small RAM tiers.

Each tier is modelled as an LRU over the whole reference stream. That is exact for the device
tier; for RAM and disk it assumes their recency follows the engine's (kvkeep only sees the
references the device misses, so a block hot on the device may age out of RAM sooner; the
difference matters only when RAM is barely larger than the device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvkeep.plan.stackdist import StackDistances


@dataclass(frozen=True)
class TierSpec:
    """One tier: its capacity in blocks and how fast blocks load from it (None: no load)."""

    name: str
    capacity_blocks: int
    load_gbps: float | None = None

    def __post_init__(self) -> None:
        if self.capacity_blocks < 0:
            raise ValueError(f"the {self.name} tier needs a capacity >= 0 blocks")
        if self.load_gbps is not None and self.load_gbps <= 0:
            raise ValueError(f"the {self.name} tier's bandwidth must be positive (GB/s)")


class TierHits(NamedTuple):
    """What a tier adds: fractions of block references and of prompt tokens it serves."""

    name: str
    capacity_blocks: int
    hit_rate: float
    cumulative_hit_rate: float
    token_hit_rate: float
    cumulative_token_hit_rate: float


def tier_hits(sd: StackDistances, tiers: list[TierSpec]) -> list[TierHits]:
    """Per-tier hits for inclusive tiers in order (device first). Pure."""
    out: list[TierHits] = []
    reach, below, below_tokens = 0, 0.0, 0.0
    for tier in tiers:
        reach = max(reach, tier.capacity_blocks)
        total, total_tokens = sd.hit_rate(reach), sd.token_hit_rate(reach)
        out.append(
            TierHits(
                name=tier.name,
                capacity_blocks=tier.capacity_blocks,
                hit_rate=total - below,
                cumulative_hit_rate=total,
                token_hit_rate=total_tokens - below_tokens,
                cumulative_token_hit_rate=total_tokens,
            )
        )
        below, below_tokens = total, total_tokens
    return out


def reaches(tiers: list[TierSpec]) -> list[int]:
    """The capacity each tier's hits extend to: the running maximum of capacities."""
    out, reach = [], 0
    for tier in tiers:
        reach = max(reach, tier.capacity_blocks)
        out.append(reach)
    return out
