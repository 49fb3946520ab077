"""`kvkeep plan`: which cache configuration a workload needs, with the hit rate to expect.

    kvkeep plan --trace mooncake.jsonl --block-tokens 512 --capacity-blocks 1000,5000 --json p.json
    kvkeep plan --session --agents 8 --tokenizer MODEL_DIR --model llama-3.1-8b \\
        --device-gib 20 --ram 64GiB --disk 1TiB --prefill-s-per-token 2e-4 --store-bench s.json
    kvkeep plan --tiles 48 --doc-tokens 16000 --rounds 2 --model qwen3-32b --device-gib 40 ...
    kvkeep plan --compare kvkeep-report/results.json     # predicted vs `kvkeep bench` measured
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvkeep.plan import compare
from kvkeep.plan.claude_code import TRACE_BLOCK_TOKENS, Arrival, is_claude_code, read_claude_code
from kvkeep.plan.cost import PrefillModel, Workload, calibrate, estimate, load_verdict
from kvkeep.plan.footprint import KVFootprint, resolve_model
from kvkeep.plan.report import Findings, plot, recommend, stored_bytes_per_token, to_json
from kvkeep.plan.stackdist import stack_distances
from kvkeep.plan.state_policy import compare as compare_state_policies
from kvkeep.plan.tiers import TierSpec, tier_hits
from kvkeep.plan.trace import BlockTrace, TraceError, read_trace
from kvkeep.plan.workloads import TileSpec, session_trace, tile_trace
from kvkeep.traffic.workload import STUDY_TURNS, SessionSpec
from kvkeep.units import parse_size

TIERS = ("device", "ram", "disk")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvkeep plan", description=__doc__.splitlines()[0])
    src = p.add_argument_group("workload (one of)")
    w = src.add_mutually_exclusive_group(required=True)
    w.add_argument(
        "--trace",
        type=Path,
        help="Mooncake JSONL, `kvkeep bench session --json`, or Claude Code traces "
        "(a .json/.json.gz file or a directory of them)",
    )
    w.add_argument("--session", action="store_true", help="kvkeep's generated agent sessions")
    w.add_argument("--tiles", type=int, metavar="N", help="N documents queried in tile order")
    w.add_argument(
        "--compare",
        type=Path,
        metavar="RESULTS",
        help="bench results.json (all, capacity, agents, replay): predicted vs measured hit rates",
    )
    src.add_argument(
        "--block-tokens",
        type=int,
        help="default 512 for Mooncake, 64 for Claude Code traces, else 128 (CPU)",
    )
    claude = "Claude Code traces: sessions"
    src.add_argument(
        "--window", type=float, metavar="S", help=f"{claude} start uniformly over S seconds"
    )
    src.add_argument(
        "--rate",
        type=float,
        metavar="R",
        help=f"{claude} arrive as a Poisson process, R per second",
    )
    src.add_argument("--seed", type=int, default=0, help="seed of the arrival model")
    src.add_argument(
        "--vllm-blocks",
        action="store_true",
        help="apply vLLM's rules to a trace: full blocks only, >= 1 token computed",
    )
    src.add_argument("--mode", help="the runner-output mode to read (default: the first)")
    src.add_argument("--agents", type=int, default=1, help="agents (sessions) in closed loop")
    src.add_argument("--turns", type=int, default=STUDY_TURNS)
    src.add_argument("--scale", type=float, default=SessionSpec().scale)
    src.add_argument("--tokenizer", type=Path, help="model dir: chat template + tokenizer.json")
    src.add_argument("--doc-tokens", type=int, default=16_000)
    src.add_argument("--rounds", type=int, default=2)
    src.add_argument("--question-tokens", type=int, default=32)
    m = p.add_argument_group("model and tiers")
    m.add_argument("--model", help="preset name, config.json or model dir (KV bytes per token)")
    m.add_argument("--kv-dtype", help="override the KV dtype (bf16, fp16, fp8, fp32)")
    m.add_argument("--capacity-blocks", type=_ints, default=[], help="e.g. 1000,5000,20000")
    for tier in TIERS:
        m.add_argument(f"--{tier}-blocks", type=int, help=f"{tier} tier capacity in blocks")
    m.add_argument("--device-gib", type=float, help="vLLM KV pool size (needs --model)")
    m.add_argument("--ram", type=parse_size, help="RAM tier size, e.g. 64GiB (needs --model)")
    m.add_argument("--disk", type=parse_size, help="disk tier size, e.g. 2TiB (needs --model)")
    c = p.add_argument_group("cost model")
    c.add_argument("--prefill-s-per-token", type=float, help="linear prefill cost (s/token)")
    c.add_argument("--prefill-s-per-token2", type=float, default=0.0, help="quadratic (s/token^2)")
    c.add_argument("--prefill-overhead-s", type=float, default=0.0)
    c.add_argument("--calibrate", metavar="ENDPOINT", help="measure prefill on a live server")
    c.add_argument("--store-bench", type=Path, help="`kvkeep bench store --json` output")
    c.add_argument("--ram-gbps", type=float, help="RAM tier load bandwidth (GB/s)")
    c.add_argument("--disk-gbps", type=float, help="disk tier load bandwidth (GB/s)")
    c.add_argument("--tool-delay", type=float, default=0.0, help="seconds an agent's tool runs")
    c.add_argument("--decode-s-per-token", type=float, default=0.0)
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, help="write the findings here")
    o.add_argument("--plot", type=Path, help="write the hit-rate curve here (PNG)")
    return p


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use integers separated by commas") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: use non-negative integers, e.g. 1000,5000")
    return values


def hybrid_block(footprint: KVFootprint | None, granularity: int = 1) -> int | None:
    """A hybrid's block (vLLM's in 'align' mode on CUDA, `GDNState.hybrid_block_tokens`),
    rounded up to a multiple of the trace's ``granularity``; None for other models."""
    if footprint is None or footprint.state is None:
        return None
    block = footprint.state.hybrid_block_tokens()
    return granularity * -(-block // granularity)


def load_trace(args: argparse.Namespace, footprint: KVFootprint | None = None) -> BlockTrace:
    """The workload the arguments name; a hybrid's blocks are vLLM's for it unless
    ``--block-tokens`` says otherwise (a hybrid's state exists only at its boundaries)."""
    if args.trace and is_claude_code(args.trace):
        arrival = Arrival(args.window, args.rate, args.seed)
        block = (
            args.block_tokens or hybrid_block(footprint, TRACE_BLOCK_TOKENS) or TRACE_BLOCK_TOKENS
        )
        return read_claude_code(args.trace, block, args.vllm_blocks, arrival)
    if args.trace:
        if args.window is not None or args.rate is not None:
            raise TraceError(
                "--window and --rate interleave Claude Code sessions; "
                f"{args.trace} is not a Claude Code trace"
            )
        block = args.block_tokens or 512
        return read_trace(args.trace, block, args.vllm_blocks, args.mode)
    block = args.block_tokens or hybrid_block(footprint) or 128
    if args.session:
        spec = SessionSpec(turns=args.turns, scale=args.scale)
        return session_trace(spec, args.agents, block, args.tokenizer)
    tiles = TileSpec(args.tiles, args.doc_tokens, args.rounds, args.question_tokens)
    return tile_trace(tiles, block)


def tier_specs(args: argparse.Namespace, block_bytes: float | None) -> list[TierSpec]:
    """Tiers in order, from sizes in blocks or bytes; ValueError naming the missing --model."""
    sizes = {"device": _gib(args.device_gib), "ram": args.ram, "disk": args.disk}
    bandwidth = _bandwidths(args)
    out = []
    for tier in TIERS:
        blocks = getattr(args, f"{tier}_blocks")
        if blocks is None and sizes[tier] is not None:
            if block_bytes is None:
                raise ValueError(f"a {tier} size in bytes needs --model (or give --{tier}-blocks)")
            blocks = int(sizes[tier] // block_bytes)
        if blocks is not None:
            out.append(TierSpec(tier, blocks, bandwidth.get(tier)))
    return out


def _gib(value: float | None) -> int | None:
    return None if value is None else int(value * 2**30)


def _bandwidths(args: argparse.Namespace) -> dict[str, float]:
    """GB/s per tier: the command line wins over `kvkeep bench store` results."""
    out: dict[str, float] = {}
    if args.store_bench:
        doc = json.loads(args.store_bench.read_text())
        results = doc.get("results", doc)
        for tier, key in (("ram", "ram_get_gbps"), ("disk", "disk_get_gbps")):
            if isinstance(results.get(key), int | float):
                out[tier] = float(results[key])
    for tier in ("ram", "disk"):
        if getattr(args, f"{tier}_gbps") is not None:
            out[tier] = getattr(args, f"{tier}_gbps")
    return out


def prefill_model(args: argparse.Namespace) -> PrefillModel | None:
    if args.calibrate:
        return calibrate(args.calibrate)
    if args.prefill_s_per_token is None:
        return None
    return PrefillModel(
        args.prefill_s_per_token, args.prefill_s_per_token2, args.prefill_overhead_s
    )


def analyse(args: argparse.Namespace) -> Findings:
    """Read the workload, replay it once and evaluate every configuration."""
    footprint = resolve_model(args.model, args.kv_dtype) if args.model else None
    trace = load_trace(args, footprint)
    sd = stack_distances(trace)
    policies = compare_state_policies(trace) if footprint and footprint.state else ()
    per_token = stored_bytes_per_token(footprint, trace, policies) if footprint else None
    tiers = tier_specs(args, per_token * trace.block_tokens if per_token else None)
    prefill = prefill_model(args)
    estimates, verdicts = _costs(args, trace, sd, tiers, footprint, prefill, per_token)
    return Findings(
        trace,
        sd,
        tuple(args.capacity_blocks),
        footprint,
        tuple(tiers),
        tuple(tier_hits(sd, tiers)),
        prefill,
        tuple(estimates),
        tuple(verdicts),
        policies,
    )


def _costs(
    args: argparse.Namespace,
    trace: BlockTrace,
    sd: Any,
    tiers: list[TierSpec],
    footprint: KVFootprint | None,
    prefill: PrefillModel | None,
    stored_per_token: float | None = None,
) -> tuple[list[Any], list[Any]]:
    """Estimates for no cache, then each tier added in turn; load-vs-recompute per tier."""
    if prefill is None:
        return [], []
    context = trace.mean_prompt_tokens()
    per_token = stored_per_token or 0.0
    workload = Workload(args.agents, args.tool_delay, args.decode_s_per_token)
    names = ["no cache", *("+".join(t.name for t in tiers[: i + 1]) for i in range(len(tiers)))]
    estimates = [
        estimate(name, sd, trace, tiers[:i], per_token, prefill, workload)
        for i, name in enumerate(names)
    ]
    verdicts = [load_verdict(t, per_token, prefill, context) for t in tiers] if footprint else []
    return estimates, [v for v in verdicts if v is not None]


def compare_main(args: argparse.Namespace) -> int:
    """`--compare`: the planner's hit rates next to a bench run's, as a table (and --json)."""
    model = Path(args.model) if args.model else args.tokenizer
    config = compare.CompareConfig(model, args.ram, args.disk)
    try:
        result = compare.compare(args.compare, config)
    except (TraceError, ValueError, KeyError, OSError) as exc:
        print(f"kvkeep plan --compare: {exc}", file=sys.stderr)
        return 2
    print("\n".join(compare.table(result)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(compare.to_json(result), indent=2) + "\n")
        print(f"JSON written to {args.json}", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.compare:
        return compare_main(args)
    t0 = time.perf_counter()
    try:
        findings = analyse(args)
    except (TraceError, ValueError, OSError) as exc:
        print(f"kvkeep plan: {exc}", file=sys.stderr)
        return 2
    lines = recommend(findings)
    print("\n".join(lines), flush=True)
    for cap in findings.capacities:
        print(f"  {cap:>12,} blocks: {findings.sd.hit_rate(cap):.2%} of block references hit")
    if args.plot:
        plot(findings, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    if args.json:
        doc = to_json(findings, lines, time.perf_counter() - t0)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"JSON written to {args.json}", file=sys.stderr)
    return 0
