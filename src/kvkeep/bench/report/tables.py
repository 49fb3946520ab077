"""One Markdown table per scenario, and the study's claims side by side.

Each scenario module's `Command` names its tables (``sections``) and its claims' rows. Most
tables are a row per mode and a column per result field: a `Table` of `Column`s. A column
names the field by its key in the results (the result dataclass's field name).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvkeep.bench.command import Claim, Format
from kvkeep.bench.report.results import _raw_scenarios, scenarios
from kvkeep.vllm.counters import PROFILE_NAMES


def _fmt(pattern: str, value: Callable[[Any], Any] = float) -> Format:
    """A cell's text: ``pattern`` of ``value(v)``, or "-" where nothing was measured (None)."""
    return lambda v: "-" if v is None else pattern.format(value(v))


count, secs, times, one_place = _fmt("{:,}", int), _fmt("{:.3f} s"), _fmt("{:.1f}x"), _fmt("{:.1f}")
pct = _fmt("{:.1f}%", lambda v: 100 * float(v))


def _table(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Column:
    label: str
    key: str
    fmt: Format = secs


@dataclass(frozen=True)
class Table:
    """A row per mode (modes with an empty result are "not run" and left out)."""

    head: str | Callable[[dict[str, Any]], str]
    columns: tuple[Column, ...]
    first: str = "mode"
    not_run: str = ""  # why a mode's result is empty, said above the table

    def __call__(self, doc: dict[str, Any]) -> str:
        head = self.head if isinstance(self.head, str) else self.head(doc)
        run = {m: r for m, r in doc["modes"].items() if r}
        skipped = [m for m in doc["modes"] if m not in run]
        if skipped and self.not_run:
            head += f"Not run for {', '.join(skipped)}: {self.not_run}.\n\n"
        rows = [[m, *(c.fmt(r.get(c.key)) for c in self.columns)] for m, r in run.items()]
        return head + _table([self.first, *(c.label for c in self.columns)], rows)


def _first(doc: dict[str, Any]) -> dict[str, Any]:
    return next(iter(doc["modes"].values()), {})


# The study's figures (30-turn coding-agent session on a GPU; see DESIGN.md, S1 and S2).
SESSION_ROWS: tuple[tuple[str, str, Format, str], ...] = (
    ("last_turn_prompt_tokens", "last turn: prompt tokens", count, "~115k"),
    ("total_prompt_tokens", "total prompt tokens (30 turns)", count, ">2M"),
    ("total_computed_tokens", "total tokens computed (re-read)", count, ""),
    ("max_turn_computed_tokens", "most tokens computed in one turn", count, "<=~10k (cached)"),
    ("reread_ratio", "prompt / computed", times, "14x"),
    ("ttft_mean_s", "mean TTFT", secs, ""),
    ("last_turn_ttft_s", "last turn TTFT", secs, ""),
    ("session_s", "session wall time", secs, ""),
)


def session_table(doc: dict[str, Any]) -> str:
    """A row per figure, a column per mode (the study's figure beside them)."""
    modes = doc["modes"]
    rows = [
        [label, study, *(fmt(modes[m].get(key)) for m in modes)]
        for key, label, fmt, study in SESSION_ROWS
    ]
    spec = doc.get("spec") or {}
    scale = f" at scale {spec['scale']}" if "scale" in spec else ""
    head = f"### S1: a {spec.get('turns', '?')}-turn coding-agent session{scale}\n\n"
    return head + _table(["", "study (scale 1)", *modes], rows)


def ttft_table(doc: dict[str, Any]) -> str:
    """A row per prompt size and mode."""
    modes = doc["modes"]
    sizes = sorted({int(s) for m in modes.values() for s in m["sizes"]})
    rows = [
        [f"{size:,}", m, secs(r.get("cold_s")), secs(r.get("warm_s")), times(r.get("speedup"))]
        for size in sizes
        for m, res in modes.items()
        for r in [res["sizes"].get(str(size), {})]
    ]
    head = (
        "### S2: time to first token, cold vs the same prompt again\n\n"
        "Study: 1.35 s cold, ~0.12 s with the prefix cache.\n\n"
    )
    return head + _table(["prompt tokens", "mode", "cold", "warm", "cold / warm"], rows)


def capacity_table(doc: dict[str, Any]) -> str:
    """Hit rates by tier: whichever tiers the results have."""
    tiers = sorted({k for m in doc["modes"].values() for k in m if k.endswith("_hit_rate")})
    tiers = [t for t in tiers if t not in ("hit_rate", "device_hit_rate", "external_hit_rate")]
    d = _first(doc)
    head = (
        f"### S3: {d.get('num_docs')} documents of {d.get('doc_tokens')} tokens, "
        f"{d.get('k')}x the device pool, in tile order\n\n"
        "Study: device hit rate 0%; CPU offload >99% at 164 ms.\n\n"
    )
    columns = (
        Column("hit rate (all tiers)", "hit_rate", pct),
        Column("device", "device_hit_rate", pct),
        *(Column(t.removesuffix("_hit_rate"), t, pct) for t in tiers),
        Column("TTFT", "ttft_s"),
    )
    return Table(head, columns)(doc)


def _agents_head(doc: dict[str, Any]) -> str:
    """ "### S5: 8 closed-loop agents, working set 2.80x the device pool (exceeds it)"."""
    n, ratio = _first(doc).get("agents", ""), _first(doc).get("working_set_over_pool")
    title = f"{n} concurrent closed-loop agents"
    if ratio is not None:
        fits = "exceeds it" if ratio > 1 else "fits in it"
        title = f"{n} closed-loop agents, working set {ratio:.2f}x the device pool ({fits})"
    study = "Study: ~8 turns/min without a cache, ~60 with; late-turn wait 104 s -> 2.1 s."
    return f"### S5: {title}\n\n{study}\n\n"


agents_table = Table(
    _agents_head,
    (
        Column("turns/min", "turns_per_min", one_place),
        Column("mean wait", "mean_wait_s"),
        Column("late-turn wait", "late_turn_wait_s"),
        Column("cached", "cached_fraction", pct),
        Column("working set / pool", "working_set_over_pool", lambda v: f"{v or 0:.2f}"),
    ),
)

hol_table = Table(
    "### S6: a cached request alone and beside a large uncached prefill\n\n",
    (
        Column("cached alone", "ttft_alone_s"),
        Column("beside prefill", "ttft_beside_prefill_s"),
        Column("ratio", "ratio", times),
        Column("prefill alone", "long_prefill_alone_s"),
        Column("beside cached", "long_prefill_ttft_s"),
        Column("ratio", "long_prefill_ratio", times),
        Column("prefill budget", "max_num_batched_tokens", lambda v: str(v or "default")),
        Column(
            "long-prefill threshold", "long_prefill_token_threshold", lambda v: str(v or "none")
        ),
    ),
)

restart_table = Table(
    "### S4: after a restart\n\nStudy: native caching is cold again; LMCache 99.9% hits at "
    "141 ms, but restarts 20-30 s slower. The restarted vLLM first serves as many documents "
    "of its own as the first one did before its warm pass (a new process is slower for its "
    "first requests, hit or not); TTFTs leave out the first document after each restart. "
    "The same documents are then asked again at once: device hits in the same engine, the "
    "fairest figure to hold the TTFT after the restart against.\n\n",
    (
        Column("cold", "cold_ttft_s"),
        Column("warm", "warm_ttft_s"),
        Column("hits after vLLM restart", "after_engine_restart_hit_rate", pct),
        Column("TTFT", "after_engine_restart_ttft_s"),
        Column("device hits just after", "after_engine_restart_device_ttft_s"),
        Column(
            "hits after cache server restart (SIGTERM, SIGKILL)",
            "after_server_restart_hit_rate",
            pct,
        ),
        Column("TTFT", "after_server_sigkill_ttft_s"),
        Column("vLLM restart to ready", "restart_ready_s"),
    ),
    not_run="without a cache nothing survives",
)

replicas_table = Table(
    "### Agents over replicas, turns routed round-robin\n\n",
    (
        Column("turns/min", "turns_per_min", one_place),
        Column("hit rate", "hit_rate", pct),
        Column("device", "device_hit_rate", pct),
        Column("remote", "remote_hit_rate", pct),
        Column("mean TTFT", "mean_ttft_s"),
    ),
    first="store",
)

remote_restart_table = Table(
    "### A host lost and replaced: TTFT cold, from kvkeep RAM, from the remote tier\n\n",
    (
        Column("cold", "cold_ttft_s"),
        Column("RAM hit", "ram_ttft_s"),
        Column("remote hit", "remote_ttft_s"),
        Column("remote hit rate", "remote_hit_rate", pct),
        Column("KV bytes/token", "kv_bytes_per_token", _fmt("{}", str)),
    ),
)


def _replay_head(doc: dict[str, Any]) -> str:
    d = _first(doc)
    spec, ratio = d.get("spec") or {}, d.get("working_set_over_pool")
    pool = f", working set {ratio:.1f}x the device pool" if ratio else ""
    return (
        f"### S7: {d.get('sessions', '?')} real Claude Code sessions, closed loop{pool}\n\n"
        f"{spec.get('block_tokens', '?')} tokens per 64-token trace block; pauses x "
        f"{spec.get('time_scale', '?')}; {d.get('requests', '?')} requests.\n\n"
    )


replay_table = Table(
    _replay_head,
    (
        Column("prompt tokens", "prompt_tokens", count),
        Column("cached: device", "device_cached_tokens", count),
        Column("cached: kvkeep", "kvkeep_cached_tokens", count),
        Column("computed", "computed_tokens", count),
        Column("hit rate", "hit_rate", pct),
        Column("TTFT p50", "ttft_p50_s"),
        Column("p90", "ttft_p90_s"),
        Column("p99", "ttft_p99_s"),
        Column("requests/min", "requests_per_min", one_place),
        Column("session wall", "session_wall_s_mean"),
    ),
)


def _get(node: Any, path: Iterable[str]) -> Any:
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def claims_table(doc: dict[str, Any], claims: Iterable[Claim]) -> str:
    """One row per claim of the study (in the order given): its figure, then each mode
    measured in this run ("-" where that mode did not measure it)."""
    docs = scenarios(doc)
    raw = _raw_scenarios(doc).values()
    modes = list(dict.fromkeys(m for d in raw for m in d["modes"]))
    sizes = [int(s) for m in modes for s in _get(docs, ("ttft", "modes", m, "sizes")) or {}]
    big = max(sizes, default=0)
    rows = [
        [
            c.label.format(big=big),
            c.study,
            *(
                c.fmt(_get(docs, (c.scenario, "modes", m, *(p.format(big=big) for p in c.path))))
                for m in modes
            ),
        ]
        for c in claims
    ]
    head = "## The study's claims, measured side by side\n\n"
    return head + _table(["claim", "study", *modes], rows)


# The connector's phases (`vllm:kvkeep_seconds_total{op=...}`), then its whole load and save.
PROFILE_OPS = (
    *(name.removesuffix("_s") for name in PROFILE_NAMES),
    "load",
    "save",
    "server_cpu",
    "server_rpc_cpu",
)


def profile_table(doc: dict[str, Any]) -> str:
    """`--profile`: the connector's milliseconds per phase, in total and per finished request,
    one row per scenario and mode that recorded a profile (mode kvkeep; the others are 0)."""
    rows = []
    for name, d in scenarios(doc).items():
        for mode, result in d["modes"].items():
            prof = result.get("profile")
            if not prof or not any(prof.get(op) for op in PROFILE_OPS):
                continue
            n = max(prof.get("requests", 0.0), 1.0)
            cells = [
                f"{1e3 * prof.get(op, 0.0):.0f} / {1e3 * prof.get(op, 0.0) / n:.1f}"
                for op in PROFILE_OPS
            ]
            rows.append([name, mode, count(prof.get("requests")), *cells])
    head = (
        "### Connector profile (ms in total / ms per request; `load` and `save` are the "
        "worker's whole step phases, the others their parts; `saver_cpu` is the saver "
        "thread's CPU time, `server_cpu` the cache server's, `server_rpc_cpu` the part "
        "of it that answered requests)\n\n"
    )
    return head + _table(["scenario", "mode", "requests", *PROFILE_OPS], rows)
