"""What a scenario reads from the system under test besides the responses themselves.

`Probe` bundles the server URL with the counters a scenario diffs around a measurement:
vLLM's own `/metrics` (device and connector hits, in tokens) and, where a kvkeep cache server
is part of the deployment, its per-tier stats. A probe without a cache server reads zeros for
the kvkeep tiers, so every mode reports the same fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvkeep.bench.runner import metrics_delta, scrape_metrics

TierStats = Callable[[], dict[str, Any]]


@dataclass(frozen=True)
class Counters:
    """A snapshot of every counter a scenario may diff."""

    vllm: dict[str, float]
    tier_hits: dict[str, float]


@dataclass
class Probe:
    url: str
    tier_stats: TierStats | None = None

    def snapshot(self) -> Counters:
        return Counters(scrape_metrics(self.url), self._tier_hits())

    def _tier_hits(self) -> dict[str, float]:
        if self.tier_stats is None:
            return {}
        try:
            tiers = self.tier_stats().get("tiers", {})
        except Exception:  # a dead cache server reads as no hits; the scenario goes on
            return {}
        return {name: float(t.get("hits", 0)) for name, t in tiers.items()}

    def delta(self, before: Counters) -> Counters:
        after = self.snapshot()
        hits = {k: v - before.tier_hits.get(k, 0.0) for k, v in after.tier_hits.items()}
        return Counters(metrics_delta(before.vllm, after.vllm), hits)


def cacheable_tokens(prompt_tokens: int, block_size: int) -> int:
    """Tokens any prefix cache could serve: full blocks, never the prompt's last token."""
    return ((prompt_tokens - 1) // block_size) * block_size


def hit_split(delta: Counters, cacheable: int, block_size: int) -> dict[str, float]:
    """Hit rates over `cacheable` tokens: device, connector, and kvkeep's tiers.

    The kvkeep tiers split the connector's hits in proportion to the blocks each tier served
    (RAM or disk), because vLLM only counts the connector as a whole.
    """
    if cacheable <= 0:
        return {"hit_rate": 0.0, "device_hit_rate": 0.0, "external_hit_rate": 0.0}
    device = delta.vllm.get("vllm:prefix_cache_hits_total", 0.0)
    external = delta.vllm.get("vllm:external_prefix_cache_hits_total", 0.0)
    out = {
        "hit_rate": (device + external) / cacheable,
        "device_hit_rate": device / cacheable,
        "external_hit_rate": external / cacheable,
    }
    served = sum(delta.tier_hits.values())
    for tier, blocks in delta.tier_hits.items():
        share = blocks / served if served else 0.0
        out[f"{tier}_hit_rate"] = external * share / cacheable
    return out
