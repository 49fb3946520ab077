"""The report's PNG plots, one function per scenario (its `Command` names it; `plot_agents`
also takes the run whose working set fits)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def figure(path: Path, title: str, xlabel: str, ylabel: str, rows: int = 1) -> Iterator[Any]:
    """Matplotlib axes (one per row) drawn into ``path`` on leaving the block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, 1, figsize=(7 if rows == 1 else 9, 3 * rows + 1), sharex=True)
    each = list(axes) if rows > 1 else [axes]
    each[0].set_title(title)
    each[-1].set_xlabel(xlabel)
    for ax in each:
        ax.grid(alpha=0.3)
        ax.set_ylabel(ylabel)
    yield axes
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_session(doc: dict[str, Any], out: Path) -> list[Path]:
    """Computed tokens per turn and TTFT per turn, one line per mode."""
    paths = []
    for key, ylabel, name in (
        ("computed_tokens", "tokens computed (prompt - cached)", "computed_tokens_per_turn.png"),
        ("ttft_s", "time to first token (s)", "ttft_per_turn.png"),
    ):
        with figure(out / name, f"{ylabel} per turn, by cache mode", "turn", ylabel) as ax:
            for mode, res in doc["modes"].items():
                ax.plot([t[key] for t in res["turns"]], marker="o", markersize=3, label=mode)
            ax.legend()
        paths.append(out / name)
    return paths


def plot_ttft(doc: dict[str, Any], out: Path) -> list[Path]:
    """Cold and warm TTFT per prompt size, a pair of bars per mode (log scale)."""
    sizes = sorted({int(s) for m in doc["modes"].values() for s in m["sizes"]})
    series = {
        f"{mode} {kind[:-2]}": [r["sizes"].get(str(s), {}).get(kind, 0) for s in sizes]
        for mode, r in doc["modes"].items()
        for kind in ("cold_s", "warm_s")
    }
    return _bar_plot(
        out / "ttft_by_size.png",
        [f"{s:,}" for s in sizes],
        series,
        "time to first token (s)",
        "TTFT: cold vs the same prompt again",
        xlabel="prompt tokens",
        log=True,
    )


def _bar_plot(
    path: Path,
    labels: list[str],
    series: dict[str, list[float]],
    ylabel: str,
    title: str,
    stacked: bool = False,
    xlabel: str = "",
    log: bool = False,
) -> list[Path]:
    with figure(path, title, xlabel, ylabel) as ax:
        bottom = [0.0] * len(labels)
        width = 0.8 if stacked else 0.8 / max(1, len(series))
        for i, (name, vals) in enumerate(series.items()):
            xs = [k if stacked else k + i * width for k in range(len(labels))]
            ax.bar(xs, vals, width, bottom=bottom if stacked else None, label=name)
            if stacked:
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        offset = 0 if stacked else 0.4 - width / 2
        ax.set_xticks([k + offset for k in range(len(labels))], labels)
        if log:
            ax.set_yscale("log")
        if len(series) > 1:
            ax.legend()
    return [path]


def plot_capacity(doc: dict[str, Any], out: Path) -> list[Path]:
    """Hit rate by tier, stacked, per mode."""
    modes = list(doc["modes"])
    tiers = sorted({k for m in doc["modes"].values() for k in m if k.endswith("_hit_rate")})
    tiers = [t for t in tiers if t not in ("hit_rate", "external_hit_rate")]
    series = {
        t[: -len("_hit_rate")]: [100 * doc["modes"][m].get(t, 0.0) for m in modes] for t in tiers
    }
    return _bar_plot(
        out / "hit_rate_by_tier.png",
        modes,
        series,
        "hit rate (%)",
        "S3: hit rate by tier, by mode",
        stacked=True,
    )


def plot_agents(doc: dict[str, Any], out: Path, fit: dict[str, Any] | None = None) -> list[Path]:
    """Turns/min by mode; with ``fit`` (the run whose working set fits), both runs side by side."""
    modes = list(doc["modes"])
    series: dict[str, list[float]] = {}
    for run in filter(None, (doc, fit)):
        first: dict[str, Any] = next(iter(run["modes"].values()), {})
        ratio = first.get("working_set_over_pool")
        label = "turns/min" if ratio is None else f"working set {ratio:.2f}x pool"
        series[label] = [run["modes"].get(m, {}).get("turns_per_min", 0.0) for m in modes]
    return _bar_plot(
        out / "turns_per_min.png",
        modes,
        series,
        "turns per minute",
        "S5: agents' turns per minute, by mode",
    )


def plot_restart(doc: dict[str, Any], out: Path) -> list[Path]:
    modes = list(doc["modes"])
    phases = {
        "cold": "cold_ttft_s",
        "warm": "warm_ttft_s",
        "after vLLM restart": "after_engine_restart_ttft_s",
        "after cache-server SIGKILL": "after_server_sigkill_ttft_s",
    }
    series = {
        label: [doc["modes"][m].get(key) or 0.0 for m in modes] for label, key in phases.items()
    }
    return _bar_plot(
        out / "ttft_after_restart.png",
        modes,
        series,
        "TTFT (s)",
        "S4: time to first token around restarts",
    )


def plot_replay(doc: dict[str, Any], out: Path) -> list[Path]:
    """S7: the TTFT CDF per mode, and the hit rate by tier over the run."""
    cdf, over_time = out / "replay_ttft_cdf.png", out / "replay_hit_rate_over_time.png"
    with figure(cdf, "S7: time to first token, real sessions", "TTFT (s)", "requests") as ax:
        for mode, r in doc["modes"].items():
            ttfts = sorted(r.get("ttfts_s") or [])
            ax.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=mode)
        ax.set_xscale("log")
        ax.legend()
    title = "S7: hit rate by tier over time"
    with figure(over_time, title, "seconds into the run", "hit rate (%)") as ax:
        for mode, r in doc["modes"].items():
            points = r.get("timeline") or []
            for tier, style in (("device", "-"), ("kvkeep", "--")):
                ys = [100 * p[f"{tier}_hit_rate"] for p in points]
                if any(ys) or (tier == "device" and points):
                    ax.plot([p["t_s"] for p in points], ys, style, label=f"{mode}: {tier}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    return [cdf, over_time]
