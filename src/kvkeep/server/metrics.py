"""Prometheus metrics, read from the store's stats on every scrape (nothing is double-kept)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_COUNTERS = {
    "hits": "blocks served",
    "misses": "blocks asked for and not found",
    "bytes_in": "bytes stored",
    "bytes_out": "bytes served",
    "evictions": "blocks evicted",
    "checksum_failures": "records that failed their checksum (served as misses)",
    "rejected_puts": "blocks refused (too large, or no evictable room)",
    "errors": "calls to the remote store that failed or timed out (served as misses)",
    "dropped_puts": "writes to the remote store given up (queue full or store down)",
    "write_errors": "failed writes to the medium, e.g. a full filesystem",
}
_GAUGES = {
    "blocks": "blocks held",
    "bytes_used": "bytes held",
    "capacity_bytes": "capacity",
}


class StoreCollector:
    """Turns ``stats()`` of the server into kvkeep_* metric families."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        tiers: dict[str, dict[str, int]] = stats["tiers"]
        for name, help_text in _COUNTERS.items():
            family = CounterMetricFamily(f"kvkeep_tier_{name}", help_text, labels=["tier"])
            for tier, values in tiers.items():
                family.add_metric([tier], values[name])
            yield family
        for name, help_text in _GAUGES.items():
            gauge = GaugeMetricFamily(f"kvkeep_tier_{name}", help_text, labels=["tier"])
            for tier, values in tiers.items():
                gauge.add_metric([tier], values[name])
            yield gauge
        yield CounterMetricFamily(
            "kvkeep_dropped_writes",
            "write-through blocks dropped: queue full",
            stats["dropped_writes"],
        )
        yield CounterMetricFamily(
            "kvkeep_corrupt_writes",
            "blocks not written through: their RAM bytes failed the checksum",
            stats["corrupt_writes"],
        )
        yield GaugeMetricFamily(
            "kvkeep_queue_depth", "blocks waiting for write-through", stats["queue_depth"]
        )
        yield GaugeMetricFamily(
            "kvkeep_connections", "open client connections", stats["connections"]
        )


def serve_metrics(stats: Callable[[], dict[str, Any]], port: int, host: str = "127.0.0.1") -> None:
    """Serve /metrics on ``host:port`` from a daemon thread."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(stats))
    start_http_server(port, addr=host, registry=registry)
