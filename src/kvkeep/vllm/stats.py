"""kvkeep's counters in vLLM's stats pipeline and in Prometheus.

The connector's sides count into ``counters.Counters``; vLLM ships the worker's counts to the
scheduler each step, sums them here, and the API server exports them as
``vllm:kvkeep_tokens_total``, ``vllm:kvkeep_seconds_total`` and ``vllm:kvkeep_events_total``,
each with an ``op`` label.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvkeep.vllm.counters import PROFILE_NAMES, Counters

if TYPE_CHECKING:
    pass


class KVKeepStats(KVConnectorStats):
    """kvkeep's counters in vLLM's stats pipeline: summed across workers and steps."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVKeepStats:
        merged = Counters(dict(self.data))
        merged.merge(other.data)
        return KVKeepStats(data={k: v for k, v in merged.values.items() if v})

    def reduce(self) -> dict[str, int | float]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVKeepPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvkeep_tokens_total{op=offered|loaded|load_failed|saved}``,
    ``vllm:kvkeep_seconds_total{op=load|save}`` and ``vllm:kvkeep_events_total{op=...}``."""

    _TOKENS: ClassVar[dict[str, str]] = {
        "offered_tokens": "offered",
        "loaded_tokens": "loaded",
        "load_failed_tokens": "load_failed",
        "saved_tokens": "saved",
        "window_loaded_tokens": "window_loaded",
        "window_load_failed_tokens": "window_load_failed",
        "window_saved_tokens": "window_saved",
    }
    _SECONDS: ClassVar[dict[str, str]] = {
        "load_s": "load",
        "save_s": "save",
        **{name: name.removesuffix("_s") for name in PROFILE_NAMES},
    }
    _EVENTS: ClassVar[dict[str, str]] = {
        "lookups": "lookup",
        "lookup_failures": "lookup_failed",
        "save_failures": "save_failed",
        "saves_dropped": "save_dropped_after_failed_load",  # blocks
        "saves_skipped_busy": "save_skipped_staging_full",  # blocks
        "states_loaded": "state_loaded",  # recurrent-state snapshots, per group
        "states_load_failed": "state_load_failed",
        "states_saved": "state_saved",
        "async_loads": "async_load",  # requests
        "async_loads_failed": "async_load_failed",  # requests with a failed block
        "admissions_deferred": "admission_deferred",  # a vLLM hit on an unconfirmed load
        "blocks_evicted": "evicted_after_failed_load",  # vLLM prefix-cache blocks
        "evict_failures": "evict_failed",  # rule 2 raised: held instead, async from then on
        "sync_loads_refused": "sync_load_refused",  # no way to evict: loaded asynchronously
        "audit_blocks": "audit_block",
        "audit_mismatches": "audit_mismatch",
        "unkeyable_lora": "unkeyable_lora",
        "unkeyable_multimodal": "unkeyable_multimodal",
        "unkeyable_prompt_embeds": "unkeyable_prompt_embeds",
    }

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine: Any):
        super().__init__(vllm_config, metric_types, labelnames, per_engine)
        names = [*labelnames, "op"]
        self._families: dict[str, Any] = {
            "tokens": self._counter_cls(
                name="vllm:kvkeep_tokens", documentation="KV tokens by kvkeep op", labelnames=names
            ),
            "seconds": self._counter_cls(
                name="vllm:kvkeep_seconds", documentation="time in kvkeep copies", labelnames=names
            ),
            "events": self._counter_cls(
                name="vllm:kvkeep_events", documentation="kvkeep RPC outcomes", labelnames=names
            ),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = list(self.per_engine_labelvalues[engine_idx])
        for table, family in ((self._TOKENS, "tokens"), (self._SECONDS, "seconds")):
            for key, op in table.items():
                if transfer_stats_data.get(key):
                    metric = self._families[family].labels(*labels, op)
                    metric.inc(transfer_stats_data[key])
        for key, op in self._EVENTS.items():
            if transfer_stats_data.get(key):
                self._families["events"].labels(*labels, op).inc(transfer_stats_data[key])
