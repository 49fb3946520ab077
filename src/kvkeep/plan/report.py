"""The planner's findings: a JSON document, a recommendation in the study's terms, a plot.

The rule of thumb it applies, with the workload's numbers: keep the prefix cache on; add a
RAM tier when the working set outgrows the device; add disk only when it must survive
restarts or outgrow RAM, and only where loading from it beats recomputing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvkeep.plan.cost import Estimate, LoadVerdict, PrefillModel
from kvkeep.plan.footprint import KVFootprint, TokenBytes
from kvkeep.plan.stackdist import COLD, StackDistances
from kvkeep.plan.state_policy import PolicyOutcome
from kvkeep.plan.tiers import TierHits, TierSpec
from kvkeep.plan.trace import BlockTrace
from kvkeep.units import format_size

ENOUGH = 0.99  # a tier "covers" the workload when it reaches 99% of the ceiling


@dataclass(frozen=True)
class Findings:
    """Everything the planner computed, ready to print, dump or plot."""

    trace: BlockTrace
    sd: StackDistances
    capacities: tuple[int, ...]
    footprint: KVFootprint | None
    tiers: tuple[TierSpec, ...]
    tier_hits: tuple[TierHits, ...]
    prefill: PrefillModel | None
    estimates: tuple[Estimate, ...]
    verdicts: tuple[LoadVerdict, ...]
    # A hybrid's state policies replayed over the trace, kvkeep's default first.
    state_policies: tuple[PolicyOutcome, ...] = ()

    @property
    def block_bytes(self) -> float | None:
        """KV bytes of one block at the workload's mean prompt length (None: no model)."""
        if self.footprint is None:
            return None
        per_token = stored_bytes_per_token(self.footprint, self.trace, self.state_policies)
        return per_token * self.trace.block_tokens

    def blocks_for(self, fraction_of_ceiling: float) -> int:
        """Smallest capacity whose hit rate reaches ``fraction_of_ceiling`` of the ceiling."""
        finite = np.sort(self.sd.distances[self.sd.distances != COLD])
        if not finite.size:
            return 0
        index = max(0, int(np.ceil(fraction_of_ceiling * finite.size)) - 1)
        return int(finite[index])

    def size(self, blocks: int) -> str:
        """``blocks`` in bytes when the model is known, else in blocks."""
        if self.block_bytes is None:
            return f"{blocks:,} blocks"
        return f"{format_size(blocks * self.block_bytes)} ({blocks:,} blocks)"


def stored_split(
    footprint: KVFootprint, trace: BlockTrace, policies: tuple[PolicyOutcome, ...] = ()
) -> TokenBytes:
    """Stored KV bytes per token at the workload's mean prompt and block size, by layer kind;
    a hybrid's snapshots under kvkeep's policy (``policies[0]``) spread over its tokens."""
    split = footprint.split(trace.mean_prompt_tokens(), trace.block_tokens)
    if footprint.state is None or not policies:
        return split
    state = policies[0].state_bytes_per_token(footprint.state.snapshot_bytes())
    return split._replace(state=state)


def stored_bytes_per_token(
    footprint: KVFootprint, trace: BlockTrace, policies: tuple[PolicyOutcome, ...] = ()
) -> float:
    return stored_split(footprint, trace, policies).total


def to_json(f: Findings, lines: list[str], elapsed_s: float) -> dict[str, Any]:
    """The JSON document ``--json`` writes."""
    sd, trace = f.sd, f.trace
    return {
        "trace": {
            "source": trace.source,
            "rules": trace.rules,
            "block_tokens": trace.block_tokens,
            "requests": len(trace.requests),
            "sessions": trace.sessions,
            "max_concurrent_sessions": trace.max_concurrent() if trace.sessions else None,
            "references": sd.references,
            "distinct_blocks": sd.distinct_blocks,
            "prompt_tokens": trace.prompt_tokens,
        },
        "ceiling": sd.ceiling(),
        "token_ceiling": sd.token_hit_rate(int(COLD) - 1),
        "hit_rate_by_capacity": {str(c): sd.hit_rate(c) for c in f.capacities},
        "token_hit_rate_by_capacity": {str(c): sd.token_hit_rate(c) for c in f.capacities},
        "blocks_for_99pct_of_ceiling": f.blocks_for(ENOUGH),
        "footprint": _footprint_json(f),
        "tiers": [t._asdict() for t in f.tier_hits],
        "prefill": None if f.prefill is None else vars(f.prefill),
        "estimates": [e._asdict() for e in f.estimates],
        "load_vs_recompute": [v._asdict() for v in f.verdicts],
        "state_policies": [_policy_json(f, p) for p in f.state_policies],
        "recommendation": lines,
        "elapsed_s": elapsed_s,
    }


def _footprint_json(f: Findings) -> dict[str, Any] | None:
    if f.footprint is None:
        return None
    split = stored_split(f.footprint, f.trace, f.state_policies)
    state = f.footprint.state
    return {
        **vars(f.footprint),
        "state": None
        if state is None
        else {**vars(state), "snapshot_bytes": state.snapshot_bytes()},
        "bytes_per_token": split.total,
        "full_bytes_per_token": split.full,
        "sliding_bytes_per_token": split.sliding,
        "state_bytes_per_token": split.state,
        "block_bytes": f.block_bytes,
        "describe": f.footprint.describe(),
    }


def _policy_json(f: Findings, p: PolicyOutcome) -> dict[str, Any]:
    snapshot = f.footprint.state.snapshot_bytes() if f.footprint and f.footprint.state else 0
    return {
        **vars(p),
        "hit_rate": p.hit_rate,
        "attention_hit_rate": p.attention_hit_rate,
        "state_bytes": p.state_bytes(snapshot),
    }


def state_policy_lines(f: Findings) -> list[str]:
    """What each state policy keeps and serves over the workload, as a table."""
    if f.footprint is None or f.footprint.state is None or not f.state_policies:
        return []
    snapshot = f.footprint.state.snapshot_bytes()
    attention = f.state_policies[0].stored_blocks * f.trace.block_tokens
    attention_bytes = attention * f.footprint.split().full
    lines = [
        f"recurrent state: one snapshot is {format_size(snapshot)}; the workload's attention KV "
        f"is {format_size(attention_bytes)} ({attention:,} tokens in blocks of "
        f"{f.trace.block_tokens}). Which boundaries to keep:",
        "| boundaries kept | snapshots | state stored | prompt tokens served from cache |",
        "|---|---:|---:|---:|",
    ]
    names = {"reused": "reused (kvkeep's default)", "every": "every boundary"}
    for p in f.state_policies:
        lines.append(
            f"| {names.get(p.policy, p.policy)} | {p.snapshots:,} | "
            f"{format_size(p.state_bytes(snapshot))} | {p.hit_rate:.1%} |"
        )
    lines.append(
        f"(attention KV alone would serve {f.state_policies[0].attention_hit_rate:.1%}: a hit "
        "also needs a state at its last boundary)"
    )
    return lines


def recommend(f: Findings) -> list[str]:
    """The recommendation, one finding per line, with numbers."""
    ceiling = f.sd.ceiling()
    lines = [
        f"workload: {len(f.trace.requests):,} requests, {f.sd.references:,} block references, "
        f"working set {f.size(f.sd.distinct_blocks)}; an unbounded cache hits "
        f"{ceiling:.1%} (the ceiling), {ENOUGH:.0%} of it needs {f.size(f.blocks_for(ENOUGH))}"
    ]
    lines += _model_line(f)
    lines += state_policy_lines(f)
    lines += [_tier_line(f, hits, ceiling) for hits in f.tier_hits]
    lines += _advice(f, ceiling)
    lines += _agents_line(f)
    lines += [_verdict_line(v) for v in f.verdicts]
    lines += [_estimate_line(e) for e in f.estimates]
    return lines


def _model_line(f: Findings) -> list[str]:
    """Stored bytes per token and, for a sliding-window model, what each layer kind adds."""
    if f.footprint is None:
        return []
    fp, split = f.footprint, stored_split(f.footprint, f.trace, f.state_policies)
    text = (
        f"model {fp.name}: {format_size(split.total)}/token stored at the mean prompt of "
        f"{f.trace.mean_prompt_tokens():,.0f} tokens"
    )
    if fp.latent:
        text += (
            f" (an MLA latent: {fp.layers} layers x {fp.values_per_layer} values x "
            f"{fp.dtype_bytes} B = {fp.layers * fp.layer_bytes_per_token:,} B/token, one copy "
            "for every tensor-parallel rank)"
        )
    if fp.state is not None:
        text += (
            f": {fp.layers} full-attention layers {format_size(split.full)}/token, and the "
            f"{fp.state.gdn_layers} gated DeltaNet layers' state snapshots kvkeep keeps "
            f"{format_size(split.state)}/token (one snapshot per kept boundary, in blocks of "
            f"{f.trace.block_tokens} tokens)"
        )
    if fp.window_layers:
        every = fp.layers * fp.layer_bytes_per_token
        text += (
            f" ({split.total / every:.1%} of keeping every layer): {fp.full_layers} "
            f"full-attention layers {format_size(split.full)}/token, {fp.window_layers} "
            f"sliding-window layers {format_size(split.sliding)}/token (each keeps at most "
            f"{fp.window_tokens} + {f.trace.block_tokens} tokens of a prefix)"
        )
    return [text]


def _tier_line(f: Findings, hits: TierHits, ceiling: float) -> str:
    share = min(1.0, hits.capacity_blocks / max(1, f.sd.distinct_blocks))
    if hits.name == "device":
        return (
            f"device holds {share:.0%} of the working set: expect a "
            f"{hits.hit_rate:.1%} device hit rate (ceiling {ceiling:.1%})"
        )
    return (
        f"a {f.size(hits.capacity_blocks)} {hits.name} tier brings the hit rate to "
        f"{hits.cumulative_hit_rate:.1%} (+{hits.hit_rate:.1%})"
    )


def _advice(f: Findings, ceiling: float) -> list[str]:
    need = f.blocks_for(ENOUGH)
    reach = max((t.capacity_blocks for t in f.tiers), default=0)
    device = next((t.capacity_blocks for t in f.tiers if t.name == "device"), 0)
    ram = next((t.capacity_blocks for t in f.tiers if t.name == "ram"), 0)
    if ceiling == 0:
        return ["no block is ever reused: a cache cannot help this workload"]
    if not f.tiers:
        return [f"no tier sizes given (--device-gib/--ram/--disk): {f.size(need)} reach 99%"]
    if device >= need:
        return [
            "keep the prefix cache on: it alone reaches "
            f"{f.sd.hit_rate(device) / ceiling:.0%} of the ceiling; RAM tier not needed"
        ]
    out = []
    if max(device, ram) < need:
        out.append(f"add a RAM tier of {f.size(need)}: it brings {f.sd.hit_rate(need):.1%}")
    persist = f"disk tier not needed unless restarts matter: then {f.size(f.sd.distinct_blocks)}"
    if reach < need and ram:
        persist = f"add disk of {f.size(need)}: the working set outgrows the RAM tier"
    return [*out, persist]


def _agents_line(f: Findings) -> list[str]:
    """The answer in a user's terms, for traces of agent sessions with tiers given."""
    if not f.trace.sessions or not f.tier_hits:
        return []
    sizes = ", ".join(f"{h.name} {f.size(h.capacity_blocks)}" for h in f.tier_hits)
    model = f" on {f.footprint.name}" if f.footprint is not None else ""
    reach = f.sd.token_hit_rate(sum(h.capacity_blocks for h in f.tier_hits))
    return [
        f"for {f.trace.sessions} agent sessions like these (at most "
        f"{f.trace.max_concurrent()} at once){model}: {sizes} -> {reach:.1%} of prompt tokens "
        "served from cache"
    ]


def _verdict_line(v: LoadVerdict) -> str:
    compare = "faster" if v.worth_loading else "SLOWER"
    text = (
        f"loading from {v.tier} takes {v.load_s_per_token * 1e6:.2f} us/token, {compare} than "
        f"recomputing ({v.recompute_s_per_token * 1e6:.2f} us/token)"
    )
    return text if v.worth_loading else text + f": recompute instead of using the {v.tier} tier"


def _estimate_line(e: Estimate) -> str:
    return (
        f"{e.name}: token hit rate {e.token_hit_rate:.1%}, mean TTFT {e.mean_ttft_s:.3f} s, "
        f"{e.turns_per_min:.1f} turns/min"
    )


def plot(f: Findings, path: Path) -> None:
    """Hit rate against capacity (bytes when the model is known), tier boundaries marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = f.sd.curve()
    scale = (f.block_bytes or 1) / (2**30 if f.block_bytes else 1)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(curve.capacities * scale, 100 * curve.hit_rates, label="LRU, prefix semantics")
    ax.axhline(100 * f.sd.ceiling(), color="grey", ls=":", label="ceiling (unbounded)")
    for tier, color in zip(f.tiers, ("tab:red", "tab:green", "tab:purple"), strict=False):
        ax.axvline(tier.capacity_blocks * scale, color=color, ls="--", label=tier.name)
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (GiB)" if f.block_bytes else "cache capacity (blocks)")
    ax.set_ylabel("block references hit (%)")
    ax.set_title(f"hit rate vs capacity: {f.trace.source}"[:80], fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
