"""`bench soak`'s table and plot: its figures, hit rate and memory over time, the faults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvkeep.bench.report.plots import figure


def table(doc: dict[str, Any]) -> str:
    """The run's figures as a plain-text table."""
    keys = (
        "requests",
        "failed_requests",
        "requests_lost_to_engine_restart",
        "wrong_outputs",
        "replies_compared",
        "ties_broken",
        "max_logprob_diff",
        "server_kills",
        "engine_restarts",
        "ready_faults",
        "ready_faults_missed",
        "guard",
        "live_corruptions",
        "bytes_flipped",
        "disk_checksum_failures",
        "kvkeep_hit_blocks",
        "kvkeep_loaded_tokens",
        "kvkeep_load_failed_tokens",
        "cached_fraction",
        "latency_p50_s",
        "latency_p99_s",
        "rss_growth_mb",
    )
    lines = [f"{k:34} {_fmt(doc[k])}" for k in keys]
    lines.append("")
    lines.append(f"{'t (s)':>8} {'requests':>9} {'cached':>8} {'kvkeep blocks':>14}")
    for w in doc["hit_rate_over_time"]:
        lines.append(
            f"{w['t_s']:8.0f} {w['requests']:9d} {w['cached_fraction']:8.3f} "
            f"{w['kvkeep_hit_blocks']:14.0f}"
        )
    lines.append("")
    lines.append(f"{'t (s)':>8} {'server MB':>10} {'vLLM MB':>10}")
    for s in doc["rss_over_time"][:: max(1, len(doc["rss_over_time"]) // 12)]:
        lines.append(f"{s['t_s']:8.0f} {_fmt(s['server_mb']):>10} {_fmt(s['vllm_mb']):>10}")
    lines.append("")
    for e in doc["events"]:
        lines.append(f"  {e['t_s']:7.1f} s  {e['kind']:15} {e['took_s']:5.1f} s  {e['detail']}")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    return str(v)


def plot(doc: dict[str, Any], path: Path) -> Path:
    """Hit rate and RSS over time with the faults marked, drawn into ``path``."""
    colours = {
        "server_kill": "red",
        "engine_restart": "black",
        "corrupt_live": "orange",
        "ready_kill": "purple",
        "ready_corrupt": "magenta",
    }
    with figure(path, "bench soak", "seconds", "", rows=2) as (top, bottom):
        hits = doc["hit_rate_over_time"]
        top.plot([w["t_s"] for w in hits], [w["cached_fraction"] for w in hits], marker="o")
        top.set_ylabel("cached fraction of prompt")
        rss = doc["rss_over_time"]
        for name in ("server_mb", "vllm_mb"):
            bottom.plot([s["t_s"] for s in rss], [s[name] or float("nan") for s in rss], label=name)
        bottom.set_ylabel("private RSS (MB)")
        bottom.legend()
        for e in doc["events"]:
            for ax in (top, bottom):
                ax.axvline(e["t_s"], color=colours.get(e["kind"], "grey"), alpha=0.4)
    return path
