"""What a scenario reads from the system under test besides the responses themselves.

One Prometheus parser (`samples`) and the counters read with it. A `Probe` snapshots what a
scenario diffs around a measurement: vLLM's device and connector hits and, where a kvkeep
cache server is deployed, its hits per tier (none without one, so every mode reports the same
fields). `hit_split` turns a difference into `HitRates`, the group several results share.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvkeep.bench.result import flat_suffix

# vLLM metrics the instrument reads (counters, in tokens), summed over their labels.
VLLM_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
)
KVKEEP_OPS = ("offered", "loaded", "load_failed", "saved")

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+([-+0-9.eEinfNa]+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus text page (`#` lines skipped)."""
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            yield m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))


def scrape(url: str, timeout_s: float = 30.0) -> str:
    """`{url}/metrics` as text; raises httpx.HTTPError."""
    r = httpx.get(f"{url}/metrics", timeout=timeout_s)
    r.raise_for_status()
    return r.text


def vllm_counters(url: str) -> dict[str, float]:
    """`VLLM_COUNTERS` from `{url}/metrics`, each summed over its labels (0 where missing)."""
    out = dict.fromkeys(VLLM_COUNTERS, 0.0)
    for name, _, value in samples(scrape(url)):
        if name in out:
            out[name] += value
    return out


def kvkeep_tokens(url: str, page: str | None = None) -> dict[str, float]:
    """The connector's `vllm:kvkeep_tokens_total` by op (tokens offered, loaded, failed to
    load, saved); zeros when the connector is off. ``page``: a page `scrape` already read."""
    out = dict.fromkeys(KVKEEP_OPS, 0.0)
    for name, labels, value in samples(scrape(url) if page is None else page):
        if name == "vllm:kvkeep_tokens_total" and "op" in labels:
            out[labels["op"]] = out.get(labels["op"], 0.0) + value
    return out


GUARD_EVENTS = (
    "admission_deferred",
    "evicted_after_failed_load",
    "sync_load_refused",
    "evict_failed",
    "async_load_failed",
)
"""The connector's `vllm:kvkeep_events_total` ops that say a failed load was contained."""


def kvkeep_events(
    url: str, ops: Sequence[str] = GUARD_EVENTS, page: str | None = None
) -> dict[str, float]:
    """The connector's `vllm:kvkeep_events_total` of ``ops`` (zeros when none happened).
    ``page``: a page `scrape` already read."""
    out = dict.fromkeys(ops, 0.0)
    for name, labels, value in samples(scrape(url) if page is None else page):
        if name == "vllm:kvkeep_events_total" and labels.get("op") in out:
            out[labels["op"]] += value
    return out


def kvkeep_profile(urls: Sequence[str]) -> dict[str, float]:
    """Seconds per connector phase (`vllm:kvkeep_seconds_total` by op, summed over ``urls``)
    and ``requests`` (`vllm:request_success_total`); empty phases when the connector is off."""
    out: dict[str, float] = {}
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        for name, labels, value in samples(text):
            if name == "vllm:kvkeep_seconds_total" and "op" in labels:
                out[labels["op"]] = out.get(labels["op"], 0.0) + value
            elif name == "vllm:request_success_total":
                out["requests"] = out.get("requests", 0.0) + value
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counter increase between two scrapes."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


@dataclass(frozen=True)
class Counters:
    """A snapshot (or a difference) of every counter a scenario may diff."""

    vllm: dict[str, float]
    tier_hits: dict[str, float]

    def __add__(self, other: Counters) -> Counters:
        def add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
            return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {**a, **b}}

        return Counters(add(self.vllm, other.vllm), add(self.tier_hits, other.tier_hits))


@dataclass
class Probe:
    """A server's counters; ``url`` may be a callable for a server that restarts."""

    url: str | Callable[[], str]
    tier_stats: Callable[[], dict[str, Any] | None] | None = None

    def snapshot(self) -> Counters:
        return Counters(vllm_counters(self.current_url()), self._tier_hits())

    def current_url(self) -> str:
        return self.url if isinstance(self.url, str) else self.url()

    def _tier_hits(self) -> dict[str, float]:
        try:  # a dead cache server reads as no hits; the scenario goes on
            tiers = ((self.tier_stats() if self.tier_stats else None) or {}).get("tiers", {})
        except Exception:
            return {}
        return {name: float(t.get("hits", 0)) for name, t in tiers.items()}

    def delta(self, before: Counters) -> Counters:
        after = self.snapshot()
        hits = {k: v - before.tier_hits.get(k, 0.0) for k, v in after.tier_hits.items()}
        return Counters(metrics_delta(before.vllm, after.vllm), hits)


def cacheable_tokens(prompt_tokens: int, block_size: int) -> int:
    """Tokens any prefix cache could serve: full blocks, never the prompt's last token."""
    return ((prompt_tokens - 1) // block_size) * block_size


@dataclass(frozen=True)
class HitRates:
    """Hits over the tokens a cache could serve; ``tiers``: {"ram_hit_rate": ..., ...}, the
    connector's hits split by the kvkeep tier that served them (none without a cache server).
    Its JSON keys are flat in the result that holds it."""

    hit_rate: float = 0.0
    device_hit_rate: float = 0.0
    external_hit_rate: float = 0.0
    tiers: dict[str, float] = field(default_factory=dict, metadata=flat_suffix("_hit_rate"))

    def get(self, key: str) -> float:
        """A rate by its JSON key (a tier's missing rate reads as 0)."""
        return float(getattr(self, key)) if key in _RATES else self.tiers.get(key, 0.0)


_RATES = ("hit_rate", "device_hit_rate", "external_hit_rate")


def hit_split(delta: Counters, cacheable: int) -> HitRates:
    """Hit rates over `cacheable` tokens: device, connector, and kvkeep's tiers.

    The kvkeep tiers split the connector's hits in proportion to the blocks each tier served
    (RAM, disk or remote), because vLLM only counts the connector as a whole.
    """
    if cacheable <= 0:
        return HitRates()
    device = delta.vllm.get("vllm:prefix_cache_hits_total", 0.0)
    external = delta.vllm.get("vllm:external_prefix_cache_hits_total", 0.0)
    served = sum(delta.tier_hits.values())
    tiers = {
        f"{tier}_hit_rate": external * (blocks / served if served else 0.0) / cacheable
        for tier, blocks in delta.tier_hits.items()
    }
    return HitRates(
        (device + external) / cacheable, device / cacheable, external / cacheable, tiers
    )


def mean_rates(parts: Sequence[tuple[HitRates, int]]) -> HitRates:
    """The rates of several measurements together, each weighted by its cacheable tokens."""
    total = sum(w for _, w in parts) or 1
    keys = [*_RATES, *dict.fromkeys(k for r, _ in parts for k in r.tiers)]
    mean = {k: sum(r.get(k) * w for r, w in parts) / total for k in keys}
    hit, device, external = (mean.pop(k) for k in _RATES)
    return HitRates(hit, device, external, mean)
