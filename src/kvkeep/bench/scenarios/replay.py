"""`kvkeep bench replay` (S7): real Claude Code sessions replayed against the engine.

The requests are :mod:`kvkeep.plan.replay`'s, the ones the planner reads, so `kvkeep plan
--compare` can set its prediction beside what this measures. Each session runs closed-loop on
`bench.http.agent_loop`: a request waits for the previous reply, then for the trace's pause
times ``--time-scale``; a session starts at its arrival offset times ``--time-scale`` (all at
once without ``--window``). Besides the totals, a mode's result holds the order the requests
were sent (what the planner replays) and the hit rates over time, sampled every ``SAMPLE_S``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from kvkeep.bench.command import Claim, Command, InSuite, Section, SuiteRun
from kvkeep.bench.context import RunContext
from kvkeep.bench.http import TurnResult, agent_loop
from kvkeep.bench.metrics import Counters, Probe, hit_split, metrics_delta
from kvkeep.bench.report.plots import figure
from kvkeep.bench.report.results import Run
from kvkeep.bench.report.tables import Column, Table, count, one_place, pct, secs
from kvkeep.bench.scenario import Needs
from kvkeep.plan.replay import (
    DEFAULT_TRACES,
    Replay,
    ReplayCall,
    ReplaySpec,
    load_replay,
    replay_trace,
)
from kvkeep.traffic.endpoint import complete_ids, discover_model

SAMPLE_S = 2.0  # how often the counters are read for the hit rate over time
Sample = tuple[float, Counters]  # (seconds since the replay started, the counters then)


@dataclass(frozen=True)
class ReplayResult:
    """One mode's replay. Rates are fractions of prompt tokens; times are seconds."""

    hit_rate: float
    device_hit_rate: float
    kvkeep_hit_rate: float
    tier_hit_rates: dict[str, float]  # kvkeep's share by tier: {"ram": ..., "disk": ...}
    prompt_tokens: int
    device_cached_tokens: int
    kvkeep_cached_tokens: int
    computed_tokens: int  # prompt - cached, as the server reported per request
    reported_hit_rate: float  # cached / prompt tokens from the replies (vLLM counts hits again
    # when it preempts and reschedules a request; the replies do not)
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    requests: int
    requests_per_min: float
    wall_s: float
    session_wall_s_mean: float
    session_wall_s_max: float
    sessions: int
    working_set_tokens: int
    pool_blocks: int | None
    working_set_over_pool: float | None
    block_size: int
    ttfts_s: list[float]  # every request's, in send order: the TTFT CDF
    timeline: list[dict[str, float]]  # cumulative: {"t_s", "device_hit_rate", ...}
    order: list[list[int]]  # [session, index] of each request, in the order sent
    spec: dict[str, Any]  # ReplaySpec.record()


@dataclass
class ReplayScenario:
    spec: ReplaySpec
    num_blocks: int | None = None  # its own device pool (`bench all`); None: the run's
    name: str = "replay"

    @functools.cached_property
    def replay(self) -> Replay:
        return load_replay(self.spec)

    def needs(self) -> Needs:
        """The longest request; a trace that cannot be read asks for nothing here and fails
        in ``run``, so the other scenarios of `bench all` still run."""
        try:
            tokens = self.replay.max_tokens()
        except (ValueError, OSError):
            tokens = 0
        return Needs(tokens=tokens, num_blocks=self.num_blocks)

    def run(self, ctx: RunContext) -> ReplayResult:
        pool = ctx.engine.cfg.num_blocks if ctx.engines else None
        if ctx.engines and self.replay.max_tokens() > ctx.engine.cfg.max_model_len:
            raise ValueError(
                f"the longest replayed request is {self.replay.max_tokens()} tokens, over vLLM's "
                f"max_model_len {ctx.engine.cfg.max_model_len}: raise --num-blocks or lower "
                "--block-tokens"
            )
        probe = ctx.probe()
        before = probe.snapshot()
        t0 = time.perf_counter()
        rows, samples = asyncio.run(_replay(ctx.url, self.replay, probe))
        wall = time.perf_counter() - t0
        return summarize(self.replay, rows, probe.delta(before), wall, pool, samples)


async def _replay(url: str, replay: Replay, probe: Probe) -> tuple[list[TurnResult], list[Sample]]:
    """Every session closed-loop; the results in send order (of ``start_s``), and the sampled
    counters."""
    rows: list[TurnResult] = []
    async with httpx.AsyncClient() as client:
        model = await discover_model(client, url)
    t_run = time.perf_counter()

    async def step(client: httpx.AsyncClient, _: int, call: ReplayCall) -> None:
        await asyncio.sleep(call.pause_s)
        prompt = replay.prompt_ids(call.session, call.turn)
        start = time.perf_counter() - t_run
        s = await complete_ids(client, url, model, prompt, call.output_tokens)
        rows.append(
            TurnResult(
                call.session,
                call.turn,
                s.prompt_tokens,
                s.cached_tokens,
                s.prompt_tokens - s.cached_tokens,
                s.output_tokens,
                s.ttft_s,
                s.latency_s,
                start,
            )
        )
        bar.update()

    samples: list[Sample] = []
    with tqdm(
        total=replay.requests, desc=f"  {len(replay.sessions)} sessions' requests", leave=False
    ) as bar:
        sampler = asyncio.create_task(_sample(probe, t_run, samples))
        try:
            await agent_loop(replay.calls, step)
        finally:
            sampler.cancel()
    samples.append((time.perf_counter() - t_run, await asyncio.to_thread(probe.snapshot)))
    return sorted(rows, key=lambda r: r.start_s), samples


async def _sample(probe: Probe, t_run: float, out: list[Sample]) -> None:
    """Append a sample every SAMPLE_S until cancelled; a scrape that fails is skipped (the plot
    has a gap, the replay goes on)."""
    while True:
        with contextlib.suppress(httpx.HTTPError):
            out.append((time.perf_counter() - t_run, await asyncio.to_thread(probe.snapshot)))
        await asyncio.sleep(SAMPLE_S)


def summarize(
    replay: Replay,
    rows: list[TurnResult],
    delta: Counters,
    wall_s: float,
    pool: int | None,
    samples: Sequence[Sample] = (),
) -> ReplayResult:
    """The result of one mode from its requests (send order), the counters' increase over
    the run and the counters sampled during it."""
    block = replay.spec.engine_block_tokens
    prompt = sum(r.prompt_tokens for r in rows)
    split = hit_split(delta, prompt)  # over prompt tokens, as the planner's token rate
    tiers = {k.removesuffix("_hit_rate"): v for k, v in split.tiers.items()}
    ttfts = [r.ttft_s for r in rows]
    walls = _session_walls(rows)
    working = replay_trace(replay).distinct_blocks() * block
    return ReplayResult(
        hit_rate=split.hit_rate,
        device_hit_rate=split.device_hit_rate,
        kvkeep_hit_rate=split.external_hit_rate,
        tier_hit_rates=tiers,
        prompt_tokens=prompt,
        device_cached_tokens=round(split.device_hit_rate * prompt),
        kvkeep_cached_tokens=round(split.external_hit_rate * prompt),
        computed_tokens=sum(r.computed_tokens for r in rows),
        reported_hit_rate=sum(r.cached_tokens for r in rows) / max(1, prompt),
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p90_s=percentile(ttfts, 0.9),
        ttft_p99_s=percentile(ttfts, 0.99),
        requests=len(rows),
        requests_per_min=len(rows) / (wall_s / 60),
        wall_s=wall_s,
        session_wall_s_mean=sum(walls) / max(1, len(walls)),
        session_wall_s_max=max(walls),
        sessions=len(replay.sessions),
        working_set_tokens=working,
        pool_blocks=pool,
        working_set_over_pool=working / (pool * block) if pool else None,
        block_size=block,
        ttfts_s=ttfts,
        timeline=timeline(samples),
        order=[[r.agent, r.turn] for r in rows],
        spec=replay.spec.record(),
    )


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in (0, 1]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _session_walls(rows: list[TurnResult]) -> list[float]:
    """Seconds from each session's first request to its last reply."""
    spans: dict[int, tuple[float, float]] = {}
    for r in rows:
        lo, hi = spans.get(r.agent, (r.start_s, r.start_s + r.latency_s))
        spans[r.agent] = (min(lo, r.start_s), max(hi, r.start_s + r.latency_s))
    return [hi - lo for lo, hi in spans.values()] or [0.0]


def timeline(samples: Sequence[Sample]) -> list[dict[str, float]]:
    """Hit rates by tier from the first sample to each later one, over the prompt tokens vLLM
    looked up in between (``prefix_cache_queries``, counted when the hits are, so a rate
    never exceeds 1). Samples where nothing was looked up yet are left out."""
    if not samples:
        return []
    out = []
    for t, counters in samples[1:]:
        diff = Counters(metrics_delta(samples[0][1].vllm, counters.vllm), {})
        queries = diff.vllm.get("vllm:prefix_cache_queries_total", 0.0)
        if queries > 0:
            rates = hit_split(diff, int(queries))
            out.append(
                {
                    "t_s": t,
                    "device_hit_rate": rates.device_hit_rate,
                    "kvkeep_hit_rate": rates.external_hit_rate,
                }
            )
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    d = ReplaySpec(traces=())
    p.add_argument(
        "--traces",
        type=Path,
        nargs="+",
        default=[DEFAULT_TRACES],
        help=f"Claude Code trace files or directories of them (default: {DEFAULT_TRACES})",
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=d.sessions,
        help="how many sessions (sub-agents count) run concurrently: the earliest",
    )
    p.add_argument(
        "--block-tokens",
        type=int,
        default=d.block_tokens,
        help="tokens each 64-token trace block becomes (a divisor of 64)",
    )
    p.add_argument("--window", type=float, help="sessions start uniformly over S trace seconds")
    p.add_argument("--seed", type=int, default=d.seed, help="arrival model and token ids")
    p.add_argument(
        "--time-scale",
        type=float,
        default=d.time_scale,
        help="multiplies the trace's pauses and start offsets",
    )
    p.add_argument("--max-output-tokens", type=int, default=d.max_output_tokens)
    p.add_argument("--max-requests", type=int, help="each session's first N requests only")


def build(args: argparse.Namespace) -> list[ReplayScenario]:
    """The scenario; its sessions are read now, so a bad trace is an error (exit 2) at once."""
    spec = ReplaySpec(
        traces=tuple(args.traces),
        sessions=args.sessions,
        block_tokens=args.block_tokens,
        window_s=args.window,
        seed=args.seed,
        time_scale=args.time_scale,
        max_output_tokens=args.max_output_tokens,
        max_requests=args.max_requests,
    )
    scenario = ReplayScenario(spec)
    _ = scenario.replay
    return [scenario]


@dataclass(frozen=True, kw_only=True)
class ReplaySize:
    """S7 in `bench all`: which real sessions, how scaled, on what device pool. Chosen (with
    `kvkeep.plan.replay`) so that their working set is at least 3x the pool: QUICK's is 91
    blocks on 25 (3.6x), FULL's 277 on 49 (5.7x). These sessions make 24-26 requests each
    (14 for trace_0021), enough for kvkeep to reach ~90% of prompt tokens. QUICK measured
    1:45 for all three modes, engine starts included (2 cores, 2026-11-30)."""

    files: tuple[str, ...]
    block_tokens: int
    pool_blocks: int
    time_scale: float = 0.001


def _in_suite(size: ReplaySize, _: SuiteRun) -> list[ReplayScenario]:
    """Its own small pool, after restart: a deployment of its own either way."""
    files = tuple(DEFAULT_TRACES / f"{name}.json.gz" for name in size.files)
    spec = ReplaySpec(
        traces=files,
        sessions=len(files),
        block_tokens=size.block_tokens,
        time_scale=size.time_scale,
    )
    return [ReplayScenario(spec, num_blocks=size.pool_blocks)]


def _replay_head(run: Run[ReplayResult]) -> str:
    d = run.first
    spec = d.spec if d else {}
    ratio = d and d.working_set_over_pool
    pool = f", working set {ratio:.1f}x the device pool" if ratio else ""
    return (
        f"### S7: {d.sessions if d else '?'} real Claude Code sessions, closed loop{pool}\n\n"
        f"{spec.get('block_tokens', '?')} tokens per 64-token trace block; pauses x "
        f"{spec.get('time_scale', '?')}; {d.requests if d else '?'} requests.\n\n"
    )


replay_table: Table[ReplayResult] = Table(
    _replay_head,
    (
        Column("prompt tokens", lambda r: r.prompt_tokens, count),
        Column("cached: device", lambda r: r.device_cached_tokens, count),
        Column("cached: kvkeep", lambda r: r.kvkeep_cached_tokens, count),
        Column("computed", lambda r: r.computed_tokens, count),
        Column("hit rate", lambda r: r.hit_rate, pct),
        Column("TTFT p50", lambda r: r.ttft_p50_s),
        Column("p90", lambda r: r.ttft_p90_s),
        Column("p99", lambda r: r.ttft_p99_s),
        Column("requests/min", lambda r: r.requests_per_min, one_place),
        Column("session wall", lambda r: r.session_wall_s_mean),
    ),
)


def plot_replay(run: Run[ReplayResult], out: Path) -> list[Path]:
    """S7: the TTFT CDF per mode, and the hit rate by tier over the run."""
    cdf, over_time = out / "replay_ttft_cdf.png", out / "replay_hit_rate_over_time.png"
    with figure(cdf, "S7: time to first token, real sessions", "TTFT (s)", "requests") as ax:
        for mode, r in run.modes.items():
            ttfts = sorted(r.ttfts_s)
            ax.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=mode)
        ax.set_xscale("log")
        ax.legend()
    title = "S7: hit rate by tier over time"
    with figure(over_time, title, "seconds into the run", "hit rate (%)") as ax:
        for mode, r in run.modes.items():
            for tier, style in (("device", "-"), ("kvkeep", "--")):
                ys = [100 * p[f"{tier}_hit_rate"] for p in r.timeline]
                if any(ys) or (tier == "device" and r.timeline):
                    ax.plot([p["t_s"] for p in r.timeline], ys, style, label=f"{mode}: {tier}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    return [cdf, over_time]


COMMAND = Command(
    name="replay",
    help="real Claude Code sessions, closed loop (S7)",
    add_args=add_args,
    build=build,
    modes="none,vllm,kvkeep",
    sections={"replay": Section(ReplayResult, replay_table, plot_replay)},
    claims=(
        # S7's "study" figures quote issue 15's LRU simulation of 40 real sessions (94% with
        # 3.2M tokens of room, 17% with 320k), not a measurement.
        Claim[ReplayResult](
            "S7 real coding-agent sessions: hit rate",
            "94% with room, 17% without",
            "replay",
            lambda r: r.hit_rate,
            pct,
        ),
        Claim[ReplayResult](
            "S7 device hit rate (working set >= 3x pool)",
            "-",
            "replay",
            lambda r: r.device_hit_rate,
            pct,
        ),
        Claim[ReplayResult]("S7 TTFT p50", "-", "replay", lambda r: r.ttft_p50_s, secs),
        Claim[ReplayResult]("S7 TTFT p99", "-", "replay", lambda r: r.ttft_p99_s, secs),
    ),
    in_suite=InSuite(
        quick=ReplaySize(
            files=("trace_0086", "trace_0624", "trace_0427", "trace_0021"),
            block_tokens=4,
            pool_blocks=25,
            time_scale=0.0002,
        ),
        full=ReplaySize(
            files=(
                "trace_0086",
                "trace_0624",
                "trace_0427",
                "trace_0021",
                "trace_0617",
                "trace_0358",
            ),
            block_tokens=8,
            pool_blocks=49,
        ),
        runs={70: _in_suite},
        # seconds in all three modes, engine starts included (`make demo`, 2 cores with AMX)
        quick_s={"replay": 107},
    ),
)
