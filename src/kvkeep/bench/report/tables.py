"""One Markdown table per scenario (`TABLES`), and the study's claims side by side."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvkeep.bench.report.results import _raw_scenarios, scenarios

# The study's figures (30-turn coding-agent session on a GPU; see DESIGN.md, S1 and S2).
STUDY = {
    "last_turn_prompt_tokens": "~115k",
    "total_prompt_tokens": ">2M",
    "max_turn_computed_tokens": "<=~10k (cached)",
    "reread_ratio": "14x",
    "ttft_cold_s": "1.35 s",
    "ttft_warm_s": "~0.12 s",
}


def _table(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _int(v: Any) -> str:
    return "-" if v is None else f"{int(v):,}"


def _s(v: Any) -> str:
    return "-" if v is None else f"{float(v):.3f} s"


def _x(v: Any) -> str:
    return "-" if v is None else f"{float(v):.1f}x"


def session_table(doc: dict[str, Any]) -> str:
    modes = doc["modes"]
    metrics: list[tuple[str, str, Callable[[Any], str]]] = [
        ("last_turn_prompt_tokens", "last turn: prompt tokens", _int),
        ("total_prompt_tokens", "total prompt tokens (30 turns)", _int),
        ("total_computed_tokens", "total tokens computed (re-read)", _int),
        ("max_turn_computed_tokens", "most tokens computed in one turn", _int),
        ("reread_ratio", "prompt / computed", _x),
        ("ttft_mean_s", "mean TTFT", _s),
        ("last_turn_ttft_s", "last turn TTFT", _s),
        ("session_s", "session wall time", _s),
    ]
    rows = [
        [label, STUDY.get(key, ""), *(fmt(modes[m].get(key)) for m in modes)]
        for key, label, fmt in metrics
    ]
    spec = doc.get("spec") or {}
    scale = f" at scale {spec['scale']}" if "scale" in spec else ""
    head = f"### S1: a {spec.get('turns', '?')}-turn coding-agent session{scale}\n\n"
    return head + _table(["", "study (scale 1)", *modes], rows)


def ttft_table(doc: dict[str, Any]) -> str:
    modes = doc["modes"]
    sizes = sorted({int(s) for m in modes.values() for s in m["sizes"]})
    rows = []
    for size in sizes:
        for m, res in modes.items():
            r = res["sizes"].get(str(size), {})
            rows.append(
                [f"{size:,}", m, _s(r.get("cold_s")), _s(r.get("warm_s")), _x(r.get("speedup"))]
            )
    head = (
        "### S2: time to first token, cold vs the same prompt again\n\n"
        f"Study: {STUDY['ttft_cold_s']} cold, {STUDY['ttft_warm_s']} with the prefix cache.\n\n"
    )
    return head + _table(["prompt tokens", "mode", "cold", "warm", "cold / warm"], rows)


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * float(v):.1f}%"


def capacity_table(doc: dict[str, Any]) -> str:
    modes = doc["modes"]
    tiers = sorted({k for m in modes.values() for k in m if k.endswith("_hit_rate")})
    tiers = [t for t in tiers if t not in ("device_hit_rate", "external_hit_rate")]
    header = ["mode", "hit rate (all tiers)", "device", *(t[: -len("_hit_rate")] for t in tiers)]
    rows = [
        [m, _pct(r.get("hit_rate")), _pct(r.get("device_hit_rate")),
         *(_pct(r.get(t)) for t in tiers), _s(r.get("ttft_s"))]
        for m, r in modes.items()
    ]  # fmt: skip
    any_mode = next(iter(modes.values()))
    head = (
        f"### S3: {any_mode.get('num_docs')} documents of {any_mode.get('doc_tokens')} tokens, "
        f"{any_mode.get('k')}x the device pool, in tile order\n\n"
        "Study: device hit rate 0%; CPU offload >99% at 164 ms.\n\n"
    )
    return head + _table([*header, "TTFT"], rows)


def agents_table(doc: dict[str, Any]) -> str:
    rows = [
        [m, f"{r['turns_per_min']:.1f}", _s(r.get("mean_wait_s")), _s(r.get("late_turn_wait_s")),
         _pct(r.get("cached_fraction")), f"{r.get('working_set_over_pool') or 0:.2f}"]
        for m, r in doc["modes"].items()
    ]  # fmt: skip
    head = (
        f"### S5: {_agents_title(doc)}\n\n"
        "Study: ~8 turns/min without a cache, ~60 with; late-turn wait 104 s -> 2.1 s.\n\n"
    )
    header = ["mode", "turns/min", "mean wait", "late-turn wait", "cached", "working set / pool"]
    return head + _table(header, rows)


def _agents_title(doc: dict[str, Any]) -> str:
    """ "8 closed-loop agents, working set 2.8x the device pool (exceeds it)"."""
    any_mode: dict[str, Any] = next(iter(doc["modes"].values()), {})
    n = any_mode.get("agents", "")
    ratio = any_mode.get("working_set_over_pool")
    if ratio is None:
        return f"{n} concurrent closed-loop agents"
    fits = "exceeds it" if ratio > 1 else "fits in it"
    return f"{n} closed-loop agents, working set {ratio:.2f}x the device pool ({fits})"


def hol_table(doc: dict[str, Any]) -> str:
    rows = [
        [m, _s(r["ttft_alone_s"]), _s(r["ttft_beside_prefill_s"]), _x(r.get("ratio")),
         _s(r.get("long_prefill_alone_s")), _s(r.get("long_prefill_ttft_s")),
         _x(r.get("long_prefill_ratio")), str(r.get("max_num_batched_tokens") or "default"),
         str(r.get("long_prefill_token_threshold") or "none")]
        for m, r in doc["modes"].items()
    ]  # fmt: skip
    head = "### S6: a cached request alone and beside a large uncached prefill\n\n"
    header = ["mode", "cached alone", "beside prefill", "ratio", "prefill alone",
              "beside cached", "ratio", "prefill budget", "long-prefill threshold"]  # fmt: skip
    return head + _table(header, rows)


def restart_table(doc: dict[str, Any]) -> str:
    rows = [
        [m, _s(r.get("cold_ttft_s")), _s(r.get("warm_ttft_s")),
         _pct(r.get("after_engine_restart_hit_rate")), _s(r.get("after_engine_restart_ttft_s")),
         _pct(r.get("after_server_restart_hit_rate")), _s(r.get("after_server_sigkill_ttft_s")),
         _s(r.get("restart_ready_s"))]
        for m, r in doc["modes"].items() if r
    ]  # fmt: skip
    skipped = [m for m, r in doc["modes"].items() if not r]
    head = (
        "### S4: after a restart\n\n"
        "Study: native caching is cold again; LMCache 99.9% hits at 141 ms, but restarts "
        "20-30 s slower.\n\n"
    )
    if skipped:
        head += f"Not run for {', '.join(skipped)}: without a cache nothing survives.\n\n"
    header = ["mode", "cold", "warm", "hits after vLLM restart", "TTFT", "hits after cache "
              "server restart (SIGTERM, SIGKILL)", "TTFT", "vLLM restart to ready"]  # fmt: skip
    return head + _table(header, rows)


def _get(doc: dict[str, Any], scenario: str, mode: str, *path: str) -> Any:
    node: Any = scenarios(doc).get(scenario, {}).get("modes", {}).get(mode)
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def claims_table(doc: dict[str, Any]) -> str:
    """One row per claim of the study: its figure, then each mode measured in this run."""
    raw = _raw_scenarios(doc).values()
    modes = list(dict.fromkeys(m for d in raw for m in d.get("modes") or {}))
    big = max((int(s) for m in modes for s in _get(doc, "ttft", m, "sizes") or {}), default=0)
    rows_spec: list[tuple[str, str, Callable[[str], str]]] = [
        ("S1 last turn: tokens computed", "115k -> <=10k",
         lambda m: _int(_get(doc, "session", m, "last_turn_computed_tokens"))),
        ("S1 session: tokens computed in total", ">2M -> ~145k",
         lambda m: _int(_get(doc, "session", m, "total_computed_tokens"))),
        ("S1 prompt / computed", "14x", lambda m: _x(_get(doc, "session", m, "reread_ratio"))),
        (f"S2 TTFT, {big:,}-token prompt again", "1.35 s -> ~120 ms",
         lambda m: _s(_get(doc, "ttft", m, "sizes", str(big), "warm_s"))),
        ("S3 device hit rate, docs 4x pool", "0%",
         lambda m: _pct(_get(doc, "capacity", m, "device_hit_rate"))),
        ("S3 hit rate, all tiers", ">99% (offload)",
         lambda m: _pct(_get(doc, "capacity", m, "hit_rate"))),
        ("S3 TTFT", "164 ms", lambda m: _s(_get(doc, "capacity", m, "ttft_s"))),
        ("S4 hit rate after vLLM restart", "0% native, 99.9% LMCache",
         lambda m: _pct(_get(doc, "restart", m, "after_engine_restart_hit_rate"))),
        ("S4 TTFT after vLLM restart", "141 ms (LMCache)",
         lambda m: _s(_get(doc, "restart", m, "after_engine_restart_ttft_s"))),
        ("S4 hit rate after cache-server restart", "(not measured)",
         lambda m: _pct(_get(doc, "restart", m, "after_server_restart_hit_rate"))),
        ("S4 vLLM restart to ready", "+20-30 s with LMCache",
         lambda m: _s(_get(doc, "restart", m, "restart_ready_s"))),
        ("S5 turns/min, agents > pool", "~8 -> ~60",
         lambda m: _f1(_get(doc, "agents", m, "turns_per_min"))),
        ("S5 late-turn wait", "104 s -> 2.1 s",
         lambda m: _s(_get(doc, "agents", m, "late_turn_wait_s"))),
        ("S6 cached TTFT beside a big prefill / alone", "'still waits'",
         lambda m: _x(_get(doc, "hol", m, "ratio"))),
        ("S6 the big prefill's TTFT beside it / alone", "(not measured)",
         lambda m: _x(_get(doc, "hol", m, "long_prefill_ratio"))),
    ]  # fmt: skip
    rows = [[claim, study, *(fmt(m) for m in modes)] for claim, study, fmt in rows_spec]
    head = "## The study's claims, measured side by side\n\n"
    return head + _table(["claim", "study", *modes], rows)


def _f1(v: Any) -> str:
    return "-" if v is None else f"{float(v):.1f}"


def replicas_table(doc: dict[str, Any]) -> str:
    rows = [
        [m, f"{r['turns_per_min']:.1f}", _pct(r.get("hit_rate")), _pct(r.get("device_hit_rate")),
         _pct(r.get("remote_hit_rate")), _s(r.get("mean_ttft_s"))]
        for m, r in doc["modes"].items() if r
    ]  # fmt: skip
    head = "### Agents over replicas, turns routed round-robin\n\n"
    return head + _table(["store", "turns/min", "hit rate", "device", "remote", "mean TTFT"], rows)


def remote_restart_table(doc: dict[str, Any]) -> str:
    rows = [
        [m, _s(r.get("cold_ttft_s")), _s(r.get("ram_ttft_s")), _s(r.get("remote_ttft_s")),
         _pct(r.get("remote_hit_rate")), str(r.get("kv_bytes_per_token", "-"))]
        for m, r in doc["modes"].items()
    ]  # fmt: skip
    head = "### A host lost and replaced: TTFT cold, from kvkeep RAM, from the remote tier\n\n"
    header = ["mode", "cold", "RAM hit", "remote hit", "remote hit rate", "KV bytes/token"]
    return head + _table(header, rows)


TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "agents_replicas": replicas_table,
    "restart_remote": remote_restart_table,
    "restart": restart_table,
    "session": session_table,
    "ttft": ttft_table,
    "capacity": capacity_table,
    "agents": agents_table,
    "agents_fit": agents_table,
    "hol": hol_table,
}
